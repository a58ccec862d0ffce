//! The RDMA devices of this process: each device is opened once ([`Nic`]: its context, PD,
//! completion queue) and shared by every engine that uses it, with one completion thread per
//! device; every peer of every engine has a process-wide key, so a completion found on any
//! device's queue reaches its peer.
//!
//! Why: a vLLM instance runs several engines in one process (a data engine per worker, control
//! engines that open no device). With a context per engine, 8 NICs and 8 instances per node
//! would make well over a hundred device contexts and a completion thread per NIC per engine;
//! here a process holds one context and one completion thread per device it uses, whatever
//! the number of engines.
//!
//! A [`Nic`] lives while an engine's transport holds it; when the last one lets go, its
//! completion thread stops at its next wake-up (at most the completion wait, 200 ms) and the
//! device is closed after it. An engine created meanwhile opens the device again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use kvwire_verbs::{Verbs, VerbsError};

use super::devices::{Dev, Nic};
use super::state::PeerShared;

/// What the completion thread of one device reads.
pub(super) struct CqThread {
    pub(super) dev: Arc<Dev>,
    pub(super) poll_us: Arc<AtomicU64>,
    pub(super) stop: Arc<AtomicBool>,
}

impl CqThread {
    pub(super) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    pub(super) fn poll(&self) -> Duration {
        Duration::from_micros(self.poll_us.load(Ordering::Relaxed))
    }
}

/// A device of one loaded library: (library path, device name).
type NicKey = (String, String);

/// Devices open in this process.
static NICS: LazyLock<Mutex<HashMap<NicKey, Weak<Nic>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Peers of every engine of this process, by key (the high half of their work-request ids).
static PEERS: LazyLock<RwLock<HashMap<u32, Weak<PeerShared>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));
static NEXT_PEER: AtomicU32 = AtomicU32::new(1);

/// The device `name` of library `lib` for one more engine: the process's open one, or opened
/// now (with its completion thread). `poll` is this engine's completion poll window.
pub(super) fn nic(
    verbs: &Verbs,
    lib: &str,
    name: &str,
    poll: Duration,
) -> Result<Arc<Nic>, VerbsError> {
    let poll_us = u64::try_from(poll.as_micros()).unwrap_or(u64::MAX);
    let key = (lib.to_string(), name.to_string());
    let mut nics = NICS.lock();
    nics.retain(|_, w| w.strong_count() > 0);
    if let Some(n) = nics.get(&key).and_then(Weak::upgrade) {
        n.poll_us.fetch_max(poll_us, Ordering::Relaxed);
        return Ok(n);
    }
    let dev = Arc::new(Dev::open(verbs, name)?);
    let nic = Arc::new(Nic {
        dev: dev.clone(),
        poll_us: Arc::new(AtomicU64::new(poll_us)),
        stop: Arc::new(AtomicBool::new(false)),
    });
    let t = CqThread {
        dev,
        poll_us: nic.poll_us.clone(),
        stop: nic.stop.clone(),
    };
    // Linux keeps 15 bytes of a thread name: "rdma-cq-mlx5_10" fits.
    std::thread::Builder::new()
        .name(format!("rdma-cq-{name}"))
        .spawn(move || completion_loop(t))
        .map_err(|source| VerbsError::Os {
            op: "spawning the completion thread",
            source,
        })?;
    nics.insert(key, Arc::downgrade(&nic));
    Ok(nic)
}

/// A fresh process-wide peer key, the peer entered under it (entries of peers that are gone
/// are dropped here).
pub(super) fn add_peer(make: impl FnOnce(u32) -> Arc<PeerShared>) -> Arc<PeerShared> {
    let mut peers = PEERS.write();
    peers.retain(|_, w| w.strong_count() > 0);
    let mut key = NEXT_PEER.fetch_add(1, Ordering::Relaxed);
    while key == 0 || peers.contains_key(&key) {
        key = NEXT_PEER.fetch_add(1, Ordering::Relaxed);
    }
    let p = make(key);
    peers.insert(key, Arc::downgrade(&p));
    p
}

/// The peer a completion's work-request id names, while it lives.
pub(super) fn peer(key: u32) -> Option<Arc<PeerShared>> {
    PEERS.read().get(&key).and_then(Weak::upgrade)
}

/// The completion thread of one device of the process: reaps its completion queue and hands
/// each completion to the peer its work-request id names, whichever engine that peer is of.
pub(super) fn completion_loop(t: CqThread) {
    let mut out = Vec::with_capacity(64);
    let d = &t.dev;
    // After a round that reaped completions, and while WRs of this device are still on the
    // NIC, poll the CQ for up to the poll window before arming it and sleeping on the channel:
    // the next completion is usually that close, and the sleep/wake-up costs more. Never while
    // idle: a round that reaped nothing (the wait timed out) disables the window.
    let mut active = false;
    while !t.stopped() {
        out.clear();
        let poll = t.poll();
        if active && !poll.is_zero() && d.inflight.load(Ordering::Acquire) > 0 {
            let t0 = Instant::now();
            loop {
                match d.cq.poll(&mut out, 64) {
                    Ok(0) => {}
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(device = %d.name, error = %e, "rdma completion queue poll failed");
                        break;
                    }
                }
                if t0.elapsed() >= poll || d.inflight.load(Ordering::Acquire) == 0 {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        if out.is_empty() {
            match d.cq.wait(&mut out, 64, Duration::from_millis(200)) {
                Ok(_) => {}
                Err(VerbsError::Timeout(_)) => {
                    active = false;
                    continue;
                }
                Err(e) => {
                    tracing::warn!(device = %d.name, error = %e, "rdma completion queue failed");
                    std::thread::sleep(Duration::from_millis(50));
                    active = false;
                    continue;
                }
            }
        }
        active = !out.is_empty();
        for c in out.drain(..) {
            let Some(p) = peer((c.wr_id >> 32) as u32) else {
                continue;
            };
            p.complete(
                c.wr_id,
                c.qp_num,
                c.result.map(|_| ()).map_err(|e| e.status),
            );
        }
    }
}
