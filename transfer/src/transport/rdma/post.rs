//! [`RdmaPeer`] as a [`PeerTransport`]: batches cut into work requests and striped over the
//! lanes, counters, close.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use kvwire_verbs::SendOp;

use super::mrs::MrSet;
use super::state::{BatchCtx, RdmaPeer, Sample, WrEntry};
use super::wr::{Piece, Wr};
use crate::batch::{BatchState, Pending, Posted};
use crate::error::Error;
use crate::transport::api::PeerTransport;
use crate::types::{BatchStats, Dir, RegionId, TransportKind};

impl PeerTransport for RdmaPeer {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn post(&self, b: Posted, pending: &Arc<Pending>) -> Result<Arc<BatchState>, Error> {
        let sh = &self.sh;
        if sh.closed() {
            return Err(Error::PeerDead("peer closed".into()));
        }
        let tr = sh.tr.upgrade().ok_or(Error::Shutdown)?;
        // Cut into WRs first (typed errors before anything is posted): slices of at most
        // `slice` bytes, and consecutive slices from one local region into one remote range
        // gathered into one WR (see `wr`).
        struct Cut {
            wr: Wr,
            region: RegionId,
            /// The remote chunk the WR writes into (or reads from).
            rchunk: u64,
            mr: Arc<MrSet>,
        }
        let mut cuts: Vec<Cut> = Vec::new();
        let mut ask: Vec<RegionId> = Vec::new();
        let (op, max_sge) = match b.dir {
            Dir::Write => (SendOp::Write, sh.sge_write),
            Dir::Read => (SendOp::Read, sh.sge_read),
        };
        let slice = sh.slice(b.dir, b.bytes);
        {
            let mrs = tr.mrs.read();
            for x in &b.xfers {
                // Not registered any more: the region was unregistered meanwhile.
                let mr = match mrs.get(&x.local.id) {
                    Some(mr) => mr.clone(),
                    None if x.local.mem.device_ipc().is_some() => {
                        return Err(Error::Unsupported(format!(
                            "local region {:?} is device memory that the NICs did not register \
                             (neither dma-buf nor nvidia-peermem: the log says why)",
                            x.local.id
                        )))
                    }
                    None => return Err(Error::StaleRegion(x.local.id)),
                };
                if x.remote.rkey == 0 {
                    return Err(Error::Unsupported(format!(
                        "remote region {:?} carries no RDMA key",
                        x.remote.id
                    )));
                }
                let base = x
                    .remote
                    .addr
                    .checked_add(x.remote_offset)
                    .ok_or_else(|| Error::InvalidArgument("remote address overflow".into()))?;
                // Slices never cross a chunk of the local registration or of the remote one
                // (one key each); the remote chunk's keys are looked up once per chunk.
                let lchunk = mr.mrs.chunk_len().max(1);
                let rchunk = x.remote.chunks.as_ref().map_or(u64::MAX, |c| c.len);
                let mut rkeys: Option<(u64, Arc<[u32]>)> = None;
                let mut done = 0u64;
                while done < x.len {
                    let lo = x.local_offset + done;
                    let ro = x.remote_offset + done;
                    let n = (x.len - done)
                        .min(slice)
                        .min(lchunk - lo % lchunk)
                        .min(rchunk - ro % rchunk);
                    let lc = lo / lchunk;
                    let first = mr.mrs.get(0, lc as usize).ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "local offset {lo} outside region {:?}",
                            x.local.id
                        ))
                    })?;
                    let sge = first
                        .sge((lo - lc * lchunk) as usize, n as usize)
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    let piece = Piece {
                        addr: sge.addr,
                        len: sge.length,
                        chunk: lc as u32,
                    };
                    let rc = ro / rchunk;
                    let keys = match &rkeys {
                        Some((c, k)) if *c == rc => k.clone(),
                        _ => {
                            let first = remote_chunk_key(&x.remote, rc).ok_or_else(|| {
                                Error::InvalidArgument(format!(
                                    "remote offset {ro} outside region {:?}",
                                    x.remote.id
                                ))
                            })?;
                            let k = sh.rkeys_for(x.remote.id, rc as usize, first, &mut ask);
                            rkeys = Some((rc, k.clone()));
                            k
                        }
                    };
                    let raddr = base + done;
                    done += n;
                    if let Some(last) = cuts.last_mut() {
                        if Arc::ptr_eq(&last.mr, &mr)
                            && last.region == x.remote.id
                            && last.rchunk == rc
                            && last.wr.rkeys == keys
                            && last.wr.gather(piece, raddr, max_sge, slice)
                        {
                            continue;
                        }
                    }
                    cuts.push(Cut {
                        wr: Wr::new(op, piece, raddr, keys),
                        region: x.remote.id,
                        rchunk: rc,
                        mr: mr.clone(),
                    });
                }
            }
        }
        let stats = BatchStats {
            bytes: b.bytes,
            ops: b.ops,
            writes: b.xfers.len(),
            slices: cuts.len(),
            transport: TransportKind::Rdma,
        };
        let st = BatchState::new(b.id, 1, stats, b.deadline, Vec::new(), &b.timer).posted_as(&b);
        pending.insert(&st)?;
        let ctx = Arc::new(BatchCtx {
            state: st.clone(),
            left: AtomicU32::new(cuts.len() as u32),
            notify: Mutex::new(b.notify),
            on_nic: AtomicU32::new(0),
            lanes: AtomicU64::new(0),
            quiescing: AtomicBool::new(false),
            sample: Sample {
                dir: b.dir,
                slice,
                wrs: cuts.len() as u64,
                bytes: b.bytes,
                posted: Instant::now(),
            },
        });
        if b.dir == Dir::Read {
            // At a deadline (or any failure from outside the data path), READs still in flight
            // could land in the caller's memory after the caller saw the error: break the lanes
            // they are on (their WRs flush, other batches' WRs are re-posted, the lanes are
            // re-established) and wait, bounded, for the flush.
            let (w, c) = (Arc::downgrade(sh), Arc::downgrade(&ctx));
            st.set_on_fail(Box::new(move |e: &Error| {
                if !matches!(e, Error::Timeout) {
                    return;
                }
                let (Some(sh), Some(c)) = (w.upgrade(), c.upgrade()) else {
                    return;
                };
                sh.quiesce(&c);
            }));
        }
        if cuts.is_empty() {
            sh.finish(&ctx);
            return Ok(st);
        }
        let (ok, later) = sh.lane_sets();
        let targets = if ok.is_empty() { later } else { ok };
        if targets.is_empty() {
            let e = Error::PeerDead("rdma: no usable queue pair".into());
            st.fail(e.duplicate());
            return Err(e);
        }
        // Round-robin over the target lanes whose remote device has the region's key (the
        // announced key of the remote's first device is always there).
        let n = cuts.len() as u32;
        let start = sh.next_lane.fetch_add(n, Ordering::Relaxed) as usize;
        let mut by_lane: Vec<Vec<u64>> = vec![Vec::new(); sh.lanes.len()];
        let mut eligible: Vec<usize> = Vec::with_capacity(targets.len());
        let mut eligible_for: Option<Arc<[u32]>> = None;
        {
            let mut m = sh.wrs.lock();
            for (i, c) in cuts.into_iter().enumerate() {
                if !eligible_for
                    .as_ref()
                    .is_some_and(|k| Arc::ptr_eq(k, &c.wr.rkeys))
                {
                    eligible.clear();
                    eligible.extend(
                        targets
                            .iter()
                            .copied()
                            .filter(|&l| c.wr.rkeys.get(sh.lanes[l].rdev).is_some_and(|k| *k != 0)),
                    );
                    eligible_for = Some(c.wr.rkeys.clone());
                }
                if eligible.is_empty() {
                    for id in by_lane.iter().flatten() {
                        m.remove(id);
                    }
                    drop(m);
                    let e = Error::PeerDead(
                        "rdma: no usable queue pair reaches the region's device".into(),
                    );
                    st.fail(e.duplicate());
                    return Err(e);
                }
                let lane = eligible[(start + i) % eligible.len()];
                let id = sh.wr_id();
                m.insert(
                    id,
                    WrEntry {
                        qp: None,
                        batch: ctx.clone(),
                        lane,
                        wr: c.wr,
                        retries: 0,
                        region: c.region,
                        mr: c.mr,
                        covers: Vec::new(),
                    },
                );
                by_lane[lane].push(id);
            }
        }
        for (lane, ids) in by_lane.into_iter().enumerate() {
            if !ids.is_empty() {
                sh.submit(lane, ids);
            }
        }
        if !ask.is_empty() {
            sh.request_keys(&ask);
        }
        Ok(st)
    }

    fn lane_counters(&self) -> Vec<u64> {
        self.sh
            .lanes
            .iter()
            .map(|l| l.posted.load(Ordering::Relaxed))
            .collect()
    }

    fn device_counters(&self) -> Vec<(String, u64)> {
        let Some(t) = self.sh.tr.upgrade() else {
            return Vec::new();
        };
        t.devs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let n = self
                    .sh
                    .lanes
                    .iter()
                    .filter(|l| l.ldev == i)
                    .map(|l| l.posted.load(Ordering::Relaxed))
                    .sum();
                (d.name.clone(), n)
            })
            .collect()
    }

    fn regions_removed(&self, ids: &[RegionId]) {
        self.sh.forget_keys(ids);
    }

    fn on_ctrl(&self, data: &[u8]) -> Result<(), Error> {
        self.sh.on_msg(data)
    }

    fn slice_sizes(&self) -> Option<[u64; 2]> {
        Some(self.sh.slice_sizes())
    }

    fn reposts(&self) -> u64 {
        self.sh.reposts.load(Ordering::Relaxed)
    }

    fn lanes_reestablished(&self) -> u64 {
        self.sh
            .lanes
            .iter()
            .map(|l| l.reestablished.load(Ordering::Relaxed))
            .sum()
    }

    fn close(&self) {
        if self.sh.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let stale = self.sh.stale.load(Ordering::Relaxed);
        if stale > 0 {
            tracing::warn!(
                stale,
                "rdma: completions from a queue pair a WR had left were ignored"
            );
        }
        for l in &self.sh.lanes {
            let mut st = l.st.lock();
            st.broken = true;
            st.backlog.clear();
            st.pending = None;
            st.last_ok = None;
            let _ = st.qp.set_error();
        }
        // The engine fails in-flight batches; drop their entries (the QPs flush what was posted).
        let all: Vec<WrEntry> = self.sh.wrs.lock().drain().map(|(_, e)| e).collect();
        for e in all {
            e.batch.state.fail(Error::PeerDead("peer closed".into()));
        }
    }
}

/// The remote region's key of chunk `chunk` on its first device (`None`: it has no such
/// chunk).
fn remote_chunk_key(r: &crate::wire::WireRegion, chunk: u64) -> Option<u32> {
    match (chunk, &r.chunks) {
        (0, _) => Some(r.rkey),
        (c, Some(ch)) => ch.rkeys.get(usize::try_from(c - 1).ok()?).copied(),
        (_, None) => None,
    }
}
