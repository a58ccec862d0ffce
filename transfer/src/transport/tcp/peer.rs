//! [`TcpPeer`]: a peer's lanes (opened on first use or at connect), striping and posting;
//! [`TcpTransport`].

use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::lane::{reader_loop, send_jobs, sender_loop, Job, Lane, LaneShared, OutFrame};
use crate::auth::{self, LaneCred};
use crate::batch::{BatchState, Pending, Posted, ReadSlice};
use crate::error::Error;
use crate::net::{refuse, spawn_counted, tune, DeadlineIo, Threads};
use crate::session;
use crate::transport::api::{EstablishCtx, OnDead, PeerTransport, Transport};
use crate::transport::marks::CopyMarks;
use crate::types::{BatchStats, Dir, TransportKind};
use crate::wire::{self, FrameHeader, FrameKind, FLAG_TRACKED, TRANSPORT_TCP};

/// Batches up to this many bytes are written by the submitting thread when a lane is idle.
const INLINE_MAX: u64 = 256 << 10;
/// Smallest slice when striping a batch over lanes.
const MIN_STRIPE: u64 = 64 << 10;

/// How to open lanes to a peer.
pub(crate) struct LaneTarget {
    pub addr: SocketAddr,
    pub cred: LaneCred,
    pub lanes: usize,
    pub timeout: Duration,
}

/// Per-peer TCP state: the lanes this engine opened to the peer (opened on first use for
/// inbound peers, at connect for outbound ones).
pub(crate) struct TcpPeer {
    target: LaneTarget,
    slice_size: u64,
    lanes: Mutex<Option<Arc<Vec<Lane>>>>,
    rr: AtomicUsize,
    closed: AtomicBool,
    pending: Arc<Pending>,
    on_dead: OnDead,
    marks: Arc<CopyMarks>,
    threads: Threads,
}

impl TcpPeer {
    pub fn new(
        target: LaneTarget,
        slice_size: usize,
        pending: Arc<Pending>,
        on_dead: OnDead,
        marks: Arc<CopyMarks>,
        threads: Threads,
    ) -> TcpPeer {
        TcpPeer {
            target,
            slice_size: slice_size.clamp(4096, wire::MAX_SLICE as usize) as u64,
            lanes: Mutex::new(None),
            rr: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            pending,
            on_dead,
            marks,
            threads,
        }
    }

    /// Opens the lanes now (if not yet open).
    pub fn ensure_lanes(&self) -> Result<Arc<Vec<Lane>>, Error> {
        let mut g = self.lanes.lock();
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::PeerDead(
                self.pending
                    .closed_reason()
                    .unwrap_or_else(|| "closed".into()),
            ));
        }
        if let Some(l) = g.as_ref() {
            return Ok(l.clone());
        }
        let mut lanes = Vec::with_capacity(self.target.lanes);
        for i in 0..self.target.lanes.max(1) {
            let s = open_lane(&self.target, i as u16)?;
            let sh = Arc::new(LaneShared {
                s: s.try_clone()?,
                wlock: Mutex::new(()),
                queued: AtomicUsize::new(0),
                mark: self.marks.lane(),
            });
            let (tx, rx) = crossbeam_channel::unbounded();
            let (sh2, od) = (sh.clone(), self.on_dead.clone());
            spawn_counted(format!("kvwire-tx{i}"), &self.threads, move || {
                sender_loop(sh2, rx, od)
            })?;
            let (p, od, m) = (
                self.pending.clone(),
                self.on_dead.clone(),
                self.marks.lane(),
            );
            spawn_counted(format!("kvwire-rx{i}"), &self.threads, move || {
                reader_loop(s, p, od, m)
            })?;
            lanes.push(Lane { sh, tx });
        }
        let l = Arc::new(lanes);
        *g = Some(l.clone());
        Ok(l)
    }

    fn dispatch(
        &self,
        lanes: &[Lane],
        per_lane: Vec<Vec<OutFrame>>,
        batch: &Arc<BatchState>,
        tracked: bool,
        inline_ok: bool,
    ) -> Result<(), Error> {
        for (i, frames) in per_lane.into_iter().enumerate() {
            if frames.is_empty() {
                continue;
            }
            let lane = &lanes[i];
            let job = Job {
                batch: batch.clone(),
                tracked,
                frames,
            };
            if inline_ok && lane.sh.queued.load(Ordering::Acquire) == 0 {
                if let Some(g) = lane.sh.wlock.try_lock() {
                    drop(g);
                    if let Err(e) = send_jobs(&lane.sh, std::slice::from_ref(&job)) {
                        let reason = format!("lane send failed: {e}");
                        (self.on_dead)(reason.clone());
                        return Err(Error::PeerDead(reason));
                    }
                    continue;
                }
            }
            lane.sh.queued.fetch_add(1, Ordering::AcqRel);
            if lane.tx.send(job).is_err() {
                lane.sh.queued.fetch_sub(1, Ordering::AcqRel);
                return Err(Error::PeerDead("lane sender stopped".into()));
            }
        }
        Ok(())
    }

    fn stripe(&self, total: u64, nlanes: usize) -> u64 {
        if total <= self.slice_size * nlanes as u64 {
            let per = total.div_ceil(nlanes as u64).max(MIN_STRIPE);
            per.min(self.slice_size)
        } else {
            self.slice_size
        }
    }
}

/// Opens lane `lane` to the peer: the join (both proofs) within `t.timeout` as a whole.
fn open_lane(t: &LaneTarget, lane: u16) -> Result<TcpStream, Error> {
    let s = TcpStream::connect_timeout(&t.addr, t.timeout)?;
    tune(&s)?;
    let mut io = DeadlineIo::new(&s, Instant::now() + t.timeout);
    if let Err(f) = session::join_lane(&mut io, &t.cred, lane, auth::random()) {
        if let Some(b) = f.reject() {
            refuse(&s, &b);
        }
        return Err(match f.into_error() {
            Error::Io(e) if e.kind() == std::io::ErrorKind::TimedOut => Error::Timeout,
            e => e,
        });
    }
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    Ok(s)
}

impl PeerTransport for TcpPeer {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn post(&self, b: Posted, pending: &Arc<Pending>) -> Result<Arc<BatchState>, Error> {
        let lanes = self.ensure_lanes()?;
        let n = lanes.len();
        let stripe = self.stripe(b.bytes, n);
        let small = b.bytes <= INLINE_MAX;
        let first = self.rr.fetch_add(1, Ordering::Relaxed) % n;
        let mut per_lane: Vec<Vec<OutFrame>> = (0..n).map(|_| Vec::new()).collect();
        let mut reads: Vec<ReadSlice> = Vec::new();
        let mut slices = 0usize;
        let mut lane_i = first;
        let flags = if b.notify.is_some() { FLAG_TRACKED } else { 0 };
        for x in &b.xfers {
            let mut done = 0u64;
            while done < x.len {
                let len = (x.len - done).min(stripe);
                let hdr = FrameHeader {
                    kind: if b.dir == Dir::Write {
                        FrameKind::Write
                    } else {
                        FrameKind::ReadReq
                    },
                    flags,
                    batch: b.id,
                    region: x.remote.id,
                    offset: x.remote_offset + done,
                    len: len as u32,
                    aux: slices as u32,
                };
                let payload = match b.dir {
                    Dir::Write => Some((x.local.clone(), x.local_offset + done, len as usize)),
                    Dir::Read => {
                        reads.push(ReadSlice {
                            local: x.local.clone(),
                            offset: x.local_offset + done,
                            len: len as u32,
                        });
                        None
                    }
                };
                per_lane[lane_i].push(OutFrame {
                    hdr: hdr.encode(),
                    tail: Vec::new(),
                    payload,
                });
                slices += 1;
                done += len;
                if !small {
                    lane_i = (lane_i + 1) % n;
                }
            }
        }
        let mut parts = slices as u32;
        if let Some(tag) = &b.notify {
            // The notification follows the slices on the last lane used; the target counts the
            // slices landed on every lane before delivering it.
            let last = if slices == 0 || small {
                first
            } else {
                (lane_i + n - 1) % n
            };
            let hdr = FrameHeader::simple(FrameKind::Notify, b.id, tag.len() as u32, slices as u32)
                .encode();
            per_lane[last].push(OutFrame {
                hdr,
                tail: tag.clone(),
                payload: None,
            });
            parts += 1;
        }
        let stats = BatchStats {
            bytes: b.bytes,
            ops: b.ops,
            writes: b.xfers.len(),
            slices,
            transport: TransportKind::Tcp,
        };
        let st = BatchState::new(b.id, parts, stats, b.deadline, reads, &b.timer).posted_as(&b);
        pending.insert(&st)?;
        if parts == 0 {
            st.complete_now();
            return Ok(st);
        }
        self.dispatch(&lanes, per_lane, &st, flags != 0, small)?;
        Ok(st)
    }

    fn warm_up(&self) -> Result<(), Error> {
        self.ensure_lanes().map(|_| ())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if let Some(l) = self.lanes.lock().take() {
            for lane in l.iter() {
                let _ = lane.sh.s.shutdown(Shutdown::Both);
            }
        }
    }
}

/// The TCP transport (always available).
pub(crate) struct TcpTransport;

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn bit(&self) -> u8 {
        TRANSPORT_TCP
    }
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error> {
        Ok(Arc::new(TcpPeer::new(
            LaneTarget {
                addr: ctx.lane_addr,
                cred: ctx.lane_cred,
                lanes: ctx.cfg.lanes,
                timeout: ctx.cfg.connect_timeout,
            },
            ctx.cfg.slice_size,
            ctx.pending,
            ctx.on_dead,
            ctx.marks,
            ctx.threads,
        )))
    }
}
