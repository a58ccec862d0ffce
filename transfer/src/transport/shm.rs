//! Shared-memory transport for peers on the same host (same boot id, pid and mount namespace).
//!
//! Engine-allocated target regions are memfds: the initiator opens the target's fd through
//! `/proc/<pid>/fd/<n>`, checks that it is the announced memfd (inode and size), maps it and
//! copies with `memcpy`. Raw-registered target regions (caller memory) are reached with
//! `process_vm_writev`/`process_vm_readv`. Both need ptrace-level permission over the target
//! (same user; Yama's ptrace_scope permitting), which is the protection here: bounds, generation
//! and access are checked by the initiator only, since the target's CPU is not involved. Only
//! offered regions are announced; a stale announcement cannot redirect a write into another file
//! because the inode is verified after opening.
//!
//! Notifications go over the control connection after the copy, so they arrive after the data;
//! a fence follows each, and the batch completes only once the target answered it, i.e. once
//! the notification is queued there (the same guarantee as TCP, whose target acknowledges the
//! notification frame after queuing it).
//!
//! Copies of up to [`INLINE_MAX`] bytes run on the submitting thread; larger ones on the
//! engine's copy thread. A batch goes to the copy thread as well while an earlier batch to the
//! same peer is queued or running there, so batches submitted one after the other to a peer are
//! copied, and their notifications sent, in submission order.
//!
//! The `cuda_ipc` transport is this per-peer state with a [`DeviceCopy`] plugged in: transfers
//! whose remote region is device memory are queued on the GPU by it, and their regions stay
//! counted as in use until the GPU finished them; without one (shm), such a transfer is refused
//! with `Error::Unsupported`.
//!
//! Copies into the target's memory (mapped memfds and `process_vm_writev`) are counted per
//! region: when the target withdraws a region, later copies fail with `Error::StaleRegion` and
//! the withdrawal is confirmed to the target (by the engine's fence after `RegionsRemoved`)
//! only once no copy into it is running. A target that fences this engine
//! (`Engine::fence`) withdraws every region this way before it closes the connection.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};

use super::api::{CopyJob, EstablishCtx, PeerTransport, Transport};
use crate::batch::{BatchState, Pending, Posted, Xfer};
use crate::ctrl::CtrlWriter;
use crate::error::Error;
use crate::host::host_identity;
use crate::mem::{cma_copy, RegionMem};
use crate::region::GateGuard;
use crate::types::{BatchStats, Dir, RegionId, TransportKind};
use crate::wire::{HostIdentity, ProtocolError, WireRegion, TRANSPORT_SHM};

/// Batches up to this many bytes are copied by the submitting thread.
pub(crate) const INLINE_MAX: u64 = 1 << 20;

/// Withdrawn regions remembered (to refuse copies validated before the withdrawal arrived).
const MAX_REVOKED: usize = 1 << 16;

#[derive(Default)]
struct Guard {
    /// Regions the target withdrew (bounded, oldest forgotten first).
    revoked: HashSet<RegionId>,
    order: VecDeque<RegionId>,
    /// Copies into target memory running now, per region.
    busy: HashMap<RegionId, u32>,
}

/// Copies between local region memory and a same-host peer's device regions (the
/// `cuda_ipc` transport's; [`ShmPeer`] hands it every transfer whose remote region carries
/// CUDA IPC keys).
pub(crate) trait DeviceCopy: Send + Sync {
    /// Queues the copy of `x` (bounds-checked against the region it opened); it may still be
    /// running when this returns.
    fn queue(&self, dir: Dir, x: &Xfer) -> Result<(), Error>;
    /// Waits until every copy queued so far has completed.
    fn finish(&self) -> Result<(), Error>;
    /// The peer withdrew these regions: close what was opened of them (after the copies
    /// queued into them completed).
    fn forget(&self, ids: &[RegionId]);
    /// The peer is gone.
    fn clear(&self);
}

struct Shared {
    pid: i32,
    kind: TransportKind,
    /// Copies into the peer's device regions (`cuda_ipc`); `None` for shm.
    device: Option<Box<dyn DeviceCopy>>,
    maps: Mutex<HashMap<RegionId, Option<Arc<RegionMem>>>>,
    ctrl: Arc<CtrlWriter>,
    closed: AtomicBool,
    guard: Mutex<Guard>,
    guard_cv: Condvar,
    /// Batches to this peer queued on or running in the copy thread.
    queued: AtomicUsize,
}

/// Per-peer shm state.
pub(crate) struct ShmPeer {
    sh: Arc<Shared>,
    worker: Sender<CopyJob>,
}

impl ShmPeer {
    /// The per-peer state of `shm` (`device: None`) or of `cuda_ipc`.
    pub fn new(
        pid: u32,
        ctrl: Arc<CtrlWriter>,
        worker: Sender<CopyJob>,
        device: Option<Box<dyn DeviceCopy>>,
    ) -> ShmPeer {
        let kind = match device {
            Some(_) => TransportKind::CudaIpc,
            None => TransportKind::Shm,
        };
        ShmPeer {
            sh: Arc::new(Shared {
                pid: pid as i32,
                kind,
                device,
                maps: Mutex::new(HashMap::new()),
                ctrl,
                closed: AtomicBool::new(false),
                guard: Mutex::new(Guard::default()),
                guard_cv: Condvar::new(),
                queued: AtomicUsize::new(0),
            }),
            worker,
        }
    }
}

impl Shared {
    /// The mapping of a remote memfd region, or `None` when it must be reached with CMA.
    fn mapping(&self, r: &WireRegion) -> Option<Arc<RegionMem>> {
        if r.fd < 0 {
            return None;
        }
        let mut m = self.maps.lock();
        if let Some(v) = m.get(&r.id) {
            return v.clone();
        }
        if self.guard.lock().revoked.contains(&r.id) {
            return None; // withdrawn: the guarded path below refuses it
        }
        let mapped = self.open_map(r);
        if let Err(e) = &mapped {
            tracing::debug!(region = ?r.id, error = %e, "cannot map peer memfd; using process_vm_*");
        }
        let v = mapped.ok().map(Arc::new);
        m.insert(r.id, v.clone());
        v
    }

    fn open_map(&self, r: &WireRegion) -> Result<RegionMem, Error> {
        let path = format!("/proc/{}/fd/{}", self.pid, r.fd);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)?;
        let md = f.metadata()?;
        if md.ino() != r.ino {
            return Err(ProtocolError::NotAnnouncedMemfd { path }.into());
        }
        let len = usize::try_from(r.len)
            .map_err(|_| Error::InvalidArgument("region too large".into()))?;
        Ok(RegionMem::map_fd(f.as_fd(), len)?)
    }

    /// Copies `x`, or queues it on the device when its remote region is device memory: then
    /// the guards that keep the regions in use go to `queued`, to be dropped after
    /// [`DeviceCopy::finish`].
    fn copy<'a>(&'a self, dir: Dir, x: &'a Xfer, queued: &mut Vec<Held<'a>>) -> Result<(), Error> {
        let len =
            usize::try_from(x.len).map_err(|_| Error::InvalidArgument("op too large".into()))?;
        // Our side of the copy runs inside the local region's gate (refused once unregistered);
        // the target's side is counted as running (refused once the target withdrew it, and
        // waited for by the withdrawal: what a fence of this engine by the target relies on).
        let local = x.local.enter()?;
        let busy = self.enter(x.remote.id)?;
        if x.remote.ipc.is_some() {
            let dev = self.device.as_ref().ok_or_else(|| {
                Error::Unsupported(format!(
                    "remote region {:?} is device memory: only the cuda_ipc transport reaches it",
                    x.remote.id
                ))
            })?;
            dev.queue(dir, x)?;
            queued.push((local, busy));
            return Ok(());
        }
        match self.mapping(&x.remote) {
            Some(map) => match dir {
                Dir::Write => RegionMem::copy_between(
                    &x.local.mem,
                    x.local_offset,
                    &map,
                    x.remote_offset,
                    len,
                )?,
                Dir::Read => RegionMem::copy_between(
                    &map,
                    x.remote_offset,
                    &x.local.mem,
                    x.local_offset,
                    len,
                )?,
            },
            None => {
                let addr = x
                    .remote
                    .addr
                    .checked_add(x.remote_offset)
                    .ok_or_else(|| Error::InvalidArgument("remote address overflow".into()))?;
                cma_copy(
                    self.pid,
                    &x.local.mem,
                    x.local_offset,
                    addr,
                    len,
                    dir == Dir::Write,
                )
                .map_err(|e| {
                    if e.raw_os_error() == Some(libc::ESRCH) {
                        Error::PeerDead("peer process is gone".into())
                    } else {
                        Error::Io(e)
                    }
                })?
            }
        }
        Ok(())
    }

    /// Marks a copy into target region `id` as running (refused once it is withdrawn).
    fn enter(&self, id: RegionId) -> Result<Busy<'_>, Error> {
        let mut g = self.guard.lock();
        if g.revoked.contains(&id) {
            return Err(Error::StaleRegion(id));
        }
        *g.busy.entry(id).or_insert(0) += 1;
        Ok(Busy { sh: self, id })
    }

    /// The target withdrew these regions: refuse new copies, wait for running ones.
    fn revoke(&self, ids: &[RegionId]) {
        let mut g = self.guard.lock();
        for id in ids {
            if g.revoked.insert(*id) {
                g.order.push_back(*id);
            }
        }
        while g.order.len() > MAX_REVOKED {
            if let Some(old) = g.order.pop_front() {
                g.revoked.remove(&old);
            }
        }
        while ids.iter().any(|id| g.busy.contains_key(id)) {
            self.guard_cv.wait(&mut g);
        }
    }

    fn run(&self, st: &BatchState, dir: Dir, xfers: &[Xfer], notify: Option<Vec<u8>>) {
        if self.closed.load(Ordering::Acquire) {
            st.fail(Error::PeerDead("peer closed".into()));
            return;
        }
        let mut queued = Vec::new();
        let mut res = Ok(true);
        for x in xfers {
            if st.is_done() {
                res = Ok(false); // timed out or failed meanwhile
                break;
            }
            if let Err(e) = self.copy(dir, x, &mut queued) {
                res = Err(e);
                break;
            }
        }
        // Copies queued on the device complete before their regions are let go, and before
        // the notification leaves.
        if !queued.is_empty() {
            if let Some(dev) = &self.device {
                if let Err(e) = dev.finish() {
                    res = res.and(Err(e));
                }
            }
        }
        drop(queued);
        match res {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                st.fail(e);
                return;
            }
        }
        match notify {
            // The batch's last part completes when the target confirms the notification.
            Some(tag) => {
                if let Err(e) = self.ctrl.send_notify(st.id, tag) {
                    st.fail(Error::PeerDead(format!("sending notification: {e}")));
                }
            }
            None => st.part_done(),
        }
    }
}

/// The guards of a copy queued on the device: the local region's gate and the target region's
/// count of running copies.
type Held<'a> = (GateGuard<'a>, Busy<'a>);

/// A running copy into target memory (see [`Shared::enter`]).
struct Busy<'a> {
    sh: &'a Shared,
    id: RegionId,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut g = self.sh.guard.lock();
        if let Some(n) = g.busy.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                g.busy.remove(&self.id);
                self.sh.guard_cv.notify_all();
            }
        }
    }
}

impl PeerTransport for ShmPeer {
    fn kind(&self) -> TransportKind {
        self.sh.kind
    }

    fn post(&self, b: Posted, pending: &Arc<Pending>) -> Result<Arc<BatchState>, Error> {
        let stats = BatchStats {
            bytes: b.bytes,
            ops: b.ops,
            writes: b.xfers.len(),
            slices: b.xfers.len(),
            transport: self.sh.kind,
        };
        let st = BatchState::new(b.id, 1, stats, b.deadline, Vec::new(), &b.timer).posted_as(&b);
        pending.insert(&st)?;
        // Inline only when no earlier batch to this peer is still with the copy thread (keeps
        // submission order).
        if b.bytes <= INLINE_MAX && self.sh.queued.load(Ordering::Acquire) == 0 {
            self.sh.run(&st, b.dir, &b.xfers, b.notify);
        } else {
            let (sh, st2) = (self.sh.clone(), st.clone());
            let (dir, xfers, notify) = (b.dir, b.xfers, b.notify);
            self.sh.queued.fetch_add(1, Ordering::AcqRel);
            let job: CopyJob = Box::new(move || {
                sh.run(&st2, dir, &xfers, notify);
                sh.queued.fetch_sub(1, Ordering::AcqRel);
            });
            if self.worker.send(job).is_err() {
                self.sh.queued.fetch_sub(1, Ordering::AcqRel);
                st.fail(Error::Shutdown);
                return Err(Error::Shutdown);
            }
        }
        Ok(st)
    }

    fn regions_removed(&self, ids: &[RegionId]) {
        {
            let mut m = self.sh.maps.lock();
            for id in ids {
                m.remove(id);
            }
        }
        self.sh.revoke(ids);
        if let Some(dev) = &self.sh.device {
            dev.forget(ids);
        }
    }

    fn close(&self) {
        self.sh.closed.store(true, Ordering::Release);
        self.sh.maps.lock().clear();
        if let Some(dev) = &self.sh.device {
            dev.clear();
        }
    }
}

/// The shared-memory transport (same host only).
///
/// Its handshake blob is the address of 16 random bytes in this process and their value: the
/// peer reads them with `process_vm_readv` to find out whether it may access our memory at all
/// (same user, ptrace policy, container seccomp). When it may not, it uses TCP instead
/// (`TransportKind::Auto`) or refuses (`TransportKind::Shm`).
pub(crate) struct ShmTransport {
    probe: Box<[u8; 16]>,
}

impl ShmTransport {
    pub fn new() -> Self {
        ShmTransport {
            probe: Box::new(crate::auth::random()),
        }
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }
    fn bit(&self) -> u8 {
        TRANSPORT_SHM
    }
    fn hello_blob(&self) -> Option<Vec<u8>> {
        Some(crate::wire::shm::encode_probe(
            self.probe.as_ptr() as u64,
            &self.probe,
        ))
    }
    fn usable_with(&self, remote_host: &HostIdentity, remote_blob: Option<&[u8]>) -> bool {
        let local = host_identity();
        let Some((addr, token)) = remote_blob.and_then(crate::wire::shm::decode_probe) else {
            return false;
        };
        if !local.same_host(remote_host) {
            return false;
        }
        let mut got = [0u8; 16];
        match crate::mem::cma_peek(remote_host.pid as i32, addr, &mut got) {
            Ok(()) => got == token,
            Err(e) => {
                tracing::info!(error = %e, "same host, but the peer's memory is not accessible; not using shm");
                false
            }
        }
    }
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error> {
        Ok(Arc::new(ShmPeer::new(
            ctx.remote_host.pid,
            ctx.ctrl,
            ctx.copy_tx,
            None,
        )))
    }
}

#[cfg(test)]
mod probe_tests {
    use super::*;

    #[test]
    fn shm_probe_reads_the_peer_token_and_rejects_a_wrong_one() {
        let t = ShmTransport::new();
        let me = host_identity();
        let blob = t.hello_blob().expect("blob");
        assert!(t.usable_with(&me, Some(&blob)));
        let mut wrong = blob.clone();
        wrong[8] ^= 0xff;
        assert!(!t.usable_with(&me, Some(&wrong)));
        assert!(!t.usable_with(&me, None));
        assert!(!t.usable_with(&me, Some(&blob[..10])));
        let mut other = me.clone();
        other.boot_id = "another-host".into();
        assert!(!t.usable_with(&other, Some(&blob)));
        // An address that is not mapped in the peer: the read fails, shm is not used.
        let mut unmapped = blob.clone();
        unmapped[..8].copy_from_slice(&8u64.to_le_bytes());
        assert!(!t.usable_with(&me, Some(&unmapped)));
    }
}

/// The device path of [`ShmPeer`] (what `cuda_ipc` plugs in) against a host-memory stand-in for
/// the GPU: copies are queued, and run only when `finish` is let through by the test.
#[cfg(test)]
mod device_tests {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::batch::Timer;
    use crate::region::{RegionEntry, RegionGate};
    use crate::types::{Access, DeviceIpc};

    /// A queued copy: direction, local memory and offset, remote offset, length.
    type Queued = (Dir, Arc<RegionMem>, u64, u64, usize);

    /// "Device memory" of the peer: host memory, keyed by region; copies wait for `finish`.
    struct StandIn {
        remote: Arc<RegionMem>,
        queued: Mutex<Vec<Queued>>,
        release: Mutex<mpsc::Receiver<()>>,
        entered: Mutex<mpsc::Sender<()>>,
    }

    impl DeviceCopy for StandIn {
        fn queue(&self, dir: Dir, x: &Xfer) -> Result<(), Error> {
            let ok = x.remote.ipc.is_some() && x.remote_offset + x.len <= self.remote.len() as u64;
            if !ok {
                return Err(Error::InvalidArgument("stand-in: bad copy".into()));
            }
            self.queued.lock().push((
                dir,
                x.local.mem.clone(),
                x.local_offset,
                x.remote_offset,
                x.len as usize,
            ));
            Ok(())
        }
        fn finish(&self) -> Result<(), Error> {
            let _ = self.entered.lock().send(());
            self.release.lock().recv().expect("released");
            for (dir, local, lo, ro, n) in self.queued.lock().drain(..) {
                match dir {
                    Dir::Write => RegionMem::copy_between(&local, lo, &self.remote, ro, n)?,
                    Dir::Read => RegionMem::copy_between(&self.remote, ro, &local, lo, n)?,
                }
            }
            Ok(())
        }
        fn forget(&self, _ids: &[RegionId]) {}
        fn clear(&self) {}
    }

    fn stats() -> BatchStats {
        BatchStats {
            bytes: 1 << 16,
            ops: 2,
            writes: 2,
            slices: 2,
            transport: TransportKind::CudaIpc,
        }
    }

    #[test]
    fn device_copies_complete_before_the_notification_and_the_withdrawal() {
        let (release_tx, release_rx) = mpsc::channel();
        let (entered_tx, entered_rx) = mpsc::channel();
        let remote = Arc::new(RegionMem::alloc_memfd(1 << 20).expect("memfd"));
        let dev = StandIn {
            remote: remote.clone(),
            queued: Mutex::new(Vec::new()),
            release: Mutex::new(release_rx),
            entered: Mutex::new(entered_tx),
        };
        let ctrl = Arc::new(CtrlWriter::new(1 << 20));
        let (worker, _jobs) = crossbeam_channel::unbounded::<CopyJob>();
        let peer = Arc::new(ShmPeer::new(1, ctrl.clone(), worker, Some(Box::new(dev))));
        assert_eq!(peer.kind(), TransportKind::CudaIpc);
        let local = Arc::new(RegionEntry {
            id: RegionId {
                index: 1,
                generation: 1,
            },
            access: Access::Local,
            mem: Arc::new(RegionMem::alloc_memfd(1 << 20).expect("memfd")),
            gate: RegionGate::default(),
        });
        let data: Vec<u8> = (0..1 << 16).map(|i| (i * 7 + 3) as u8).collect();
        local.mem.copy_in(4096, &data).expect("fill");
        let id = RegionId {
            index: 9,
            generation: 2,
        };
        let wire = WireRegion {
            ipc: Some(DeviceIpc {
                handle: [5; 64],
                offset: 0,
            }),
            ..WireRegion::keyless(id, 1 << 20, Access::ReadWrite)
        };
        let xfer = |lo: u64, ro: u64| Xfer {
            local: local.clone(),
            local_offset: lo,
            remote: wire.clone(),
            remote_offset: ro,
            len: 1 << 15,
        };
        let timer = Arc::new(Timer::default());
        let st = BatchState::new(
            7,
            1,
            stats(),
            Instant::now() + Duration::from_secs(60),
            Vec::new(),
            &timer,
        );
        let sh = peer.sh.clone();
        let (st2, xfers) = (
            st.clone(),
            vec![xfer(4096, 0), xfer(4096 + (1 << 15), 1 << 19)],
        );
        let run = std::thread::spawn(move || sh.run(&st2, Dir::Write, &xfers, Some(b"t".to_vec())));
        entered_rx.recv().expect("finish entered");
        // Queued, not finished: no notification yet, no byte there, and a withdrawal of the
        // target region waits for the copies.
        assert_eq!(ctrl.queued_bytes(), 0);
        let mut first = vec![0u8; 1 << 15];
        remote.copy_out(0, &mut first).expect("read");
        assert!(first.iter().all(|&b| b == 0));
        // Both copies count as running into the target region (a withdrawal waits for them)
        // and hold the local region's gate.
        assert_eq!(peer.sh.guard.lock().busy.get(&wire.id), Some(&2));
        let p2 = peer.clone();
        let revoke = std::thread::spawn(move || p2.regions_removed(&[wire.id]));
        release_tx.send(()).expect("release");
        run.join().expect("run");
        revoke.join().expect("revoke");
        assert!(ctrl.queued_bytes() > 0, "the notification after the copies");
        let mut got = vec![0u8; 1 << 16];
        remote.copy_out(0, &mut got[..1 << 15]).expect("read");
        remote.copy_out(1 << 19, &mut got[1 << 15..]).expect("read");
        assert_eq!(got, data, "every byte, both copies");
        // Withdrawn: the next batch naming the region fails, before any copy.
        let st3 = BatchState::new(
            8,
            1,
            stats(),
            Instant::now() + Duration::from_secs(60),
            Vec::new(),
            &timer,
        );
        peer.sh.run(&st3, Dir::Write, &[xfer(0, 0)], None);
        let done = crate::batch::Batch { state: st3 };
        assert!(matches!(done.wait(), Err(Error::StaleRegion(_))));
    }
}
