//! Posting on a lane and keeping lanes usable: the backlog pump, breaking a lane, moving
//! work requests to another lane, asking the peer to re-establish a broken one.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::Ordering;

use kvwire_verbs::{Endpoint, RemoteSlice, SendOp, SendRequest, Sge, VerbsError};

use super::signal::signal_plan;
use super::state::{LaneState, PeerShared, WrEntry, MAX_RETRIES, WR_TRACE};
use crate::error::Error;
use crate::wire::rdma::{LaneOp, RdmaMsg};

/// A work request about to be posted on a lane: its id, what it does, its local pieces (a
/// range of the chain's scatter-gather entries), where it goes, whether it is signalled.
struct Posting {
    id: u64,
    op: SendOp,
    sges: Range<usize>,
    remote: RemoteSlice,
    signaled: bool,
}

impl PeerShared {
    /// Posts what fits of the lane's backlog. Called with the lane state locked.
    pub(super) fn pump(&self, lane: usize, st: &mut LaneState) -> Result<(), VerbsError> {
        let l = &self.lanes[lane];
        while !st.broken && !st.backlog.is_empty() && st.outstanding < l.depth {
            let k = (l.depth - st.outstanding).min(st.backlog.len());
            let ids: Vec<u64> = st.backlog.drain(..k).collect();
            let mut sges: Vec<Sge> = Vec::with_capacity(ids.len());
            let wrs: Vec<Posting> = {
                let mut m = self.wrs.lock();
                let mut v = Vec::with_capacity(ids.len());
                for id in ids {
                    let done = match m.get(&id) {
                        Some(e) => e.batch.stopped(),
                        None => continue,
                    };
                    if done {
                        m.remove(&id); // timed out or failing meanwhile: not posted at all
                        continue;
                    }
                    if let Some(e) = m.get_mut(&id) {
                        let mrs = e.mr.mrs.chunks_on(l.ldev);
                        let Some(&rkey) = e.wr.rkeys.get(l.rdev) else {
                            continue; // cannot happen: lanes are chosen where keys exist
                        };
                        if e.wr
                            .local
                            .iter()
                            .any(|p| mrs.get(p.chunk as usize).is_none())
                        {
                            continue; // cannot happen: every device registers every chunk
                        }
                        e.qp = Some(st.qp.clone());
                        e.batch.on_nic.fetch_add(1, Ordering::AcqRel);
                        e.batch
                            .lanes
                            .fetch_or(1u64 << (lane % 64), Ordering::AcqRel);
                        let from = sges.len();
                        sges.extend(e.wr.local.iter().map(|p| Sge {
                            addr: p.addr,
                            length: p.len,
                            lkey: mrs[p.chunk as usize].lkey(),
                        }));
                        let remote = RemoteSlice {
                            addr: e.wr.raddr,
                            rkey,
                        };
                        v.push(Posting {
                            id,
                            op: e.wr.op,
                            sges: from..sges.len(),
                            remote,
                            signaled: false,
                        });
                    }
                }
                // Signal every READ, every `signal_every`-th WR and the last one of the chain;
                // each signalled WR covers the unsignalled ones before it.
                let ops: Vec<SendOp> = v.iter().map(|w| w.op).collect();
                for (signalled, covers) in signal_plan(&ops, self.signal_every) {
                    v[signalled].signaled = true;
                    if let Some(e) = m.get_mut(&v[signalled].id) {
                        e.covers = covers.iter().map(|&j| v[j].id).collect();
                    }
                }
                v
            };
            if wrs.is_empty() {
                continue;
            }
            let reqs: Vec<SendRequest<'_>> = wrs
                .iter()
                .map(|w| SendRequest {
                    wr_id: w.id,
                    op: w.op,
                    local: &sges[w.sges.clone()],
                    remote: w.remote,
                    signaled: w.signaled,
                })
                .collect();
            if let Err(e) = st.qp.post_send(&reqs) {
                // A failed chain may have posted a prefix; the QP goes to the error state, so
                // whatever was posted and not executed flushes. Count it as posted (its
                // completions come back) and requeue the rest. (An unsignalled WR of the
                // prefix after its last signalled one that did execute produces no
                // completion: its batch ends at its deadline. Posting fails only when the
                // QP is already broken or its queue full, which the depth accounting avoids.)
                let index = match &e {
                    VerbsError::PostFailed { index, .. } => *index,
                    _ => 0,
                };
                {
                    let mut m = self.wrs.lock();
                    for w in &wrs[index..] {
                        if let Some(x) = m.get_mut(&w.id) {
                            x.qp = None;
                            x.covers.clear();
                            x.batch.on_nic.fetch_sub(1, Ordering::AcqRel);
                        }
                        st.backlog.push_back(w.id);
                    }
                }
                st.outstanding += index;
                l.inflight.fetch_add(index, Ordering::AcqRel);
                return Err(e);
            }
            st.outstanding += wrs.len();
            l.inflight.fetch_add(wrs.len(), Ordering::AcqRel);
            l.posted.fetch_add(wrs.len() as u64, Ordering::Relaxed);
            if tracing::enabled!(target: WR_TRACE, tracing::Level::TRACE) {
                let qpn = st.qp.qpn();
                for w in &wrs {
                    tracing::trace!(target: WR_TRACE, wr = w.id & 0xffff_ffff, lane, qpn, "posted");
                }
            }
        }
        Ok(())
    }

    /// Marks a lane broken: its QP goes to the error state, so every WR posted on it flushes.
    pub(super) fn break_lane(&self, lane: usize, st: &mut LaneState) {
        if !st.broken {
            tracing::debug!(target: WR_TRACE, lane, qpn = st.qp.qpn(), "rdma lane broken");
            st.broken = true;
            let _ = st.qp.set_error();
        }
    }

    /// Queues WRs on a lane and posts what fits.
    pub(super) fn submit(&self, lane: usize, ids: Vec<u64>) {
        let failed = {
            let mut st = self.lanes[lane].st.lock();
            if st.broken && !self.recoverable(&st) {
                ids
            } else {
                st.backlog.extend(ids);
                match self.pump(lane, &mut st) {
                    Ok(()) => Vec::new(),
                    Err(e) => {
                        tracing::warn!(lane, error = %e, "rdma post failed; lane broken");
                        self.break_lane(lane, &mut st);
                        Vec::new()
                    }
                }
            }
        };
        if !failed.is_empty() {
            self.reroute(failed, "lane broken");
        }
        self.maybe_reconnect(lane);
    }

    /// Moves WRs to a healthy lane (or one being re-established), or fails their batches.
    pub(super) fn reroute(&self, ids: Vec<u64>, why: &str) {
        let (ok, later) = self.lane_sets();
        let targets = if ok.is_empty() { &later } else { &ok };
        let closed = self.closed();
        let mut by_lane: HashMap<usize, Vec<u64>> = HashMap::new();
        let mut fail: Vec<WrEntry> = Vec::new();
        {
            let mut m = self.wrs.lock();
            for id in ids {
                let Some(e) = m.get_mut(&id) else { continue };
                if e.batch.quiescing.load(Ordering::Acquire) {
                    m.remove(&id); // its batch is failing: flushed off the NIC, not re-posted
                    continue;
                }
                if closed
                    || targets.is_empty()
                    || e.retries >= MAX_RETRIES
                    || e.batch.state.is_done()
                {
                    if let Some(e) = m.remove(&id) {
                        fail.push(e);
                    }
                    continue;
                }
                let eligible: Vec<usize> = targets
                    .iter()
                    .copied()
                    .filter(|&l| e.wr.rkeys.get(self.lanes[l].rdev).is_some_and(|k| *k != 0))
                    .collect();
                if eligible.is_empty() {
                    if let Some(e) = m.remove(&id) {
                        fail.push(e);
                    }
                    continue;
                }
                e.retries += 1;
                e.qp = None;
                let l = eligible[(id as usize) % eligible.len()];
                tracing::trace!(target: WR_TRACE, wr = id & 0xffff_ffff, from = e.lane, to = l, why, "re-posted");
                e.lane = l;
                by_lane.entry(l).or_default().push(id);
            }
        }
        for e in fail {
            e.batch.state.fail(Error::PeerDead(format!(
                "rdma: {why}; no queue pair left for the transfer"
            )));
        }
        let n: usize = by_lane.values().map(Vec::len).sum();
        if n > 0 {
            self.reposts.fetch_add(n as u64, Ordering::Relaxed);
            tracing::debug!(wrs = n, why, "rdma work requests re-posted");
        }
        for (l, ids) in by_lane {
            self.submit(l, ids);
        }
        if targets.is_empty() && !closed {
            (self.on_dead)(format!("rdma: every queue pair failed ({why})"));
        }
    }

    pub(super) fn send_msg(
        &self,
        op: LaneOp,
        lane: usize,
        nonce: u64,
        ep: &Endpoint,
    ) -> Result<(), Error> {
        let m = RdmaMsg::Lane {
            op,
            lane,
            nonce,
            ep: *ep,
        };
        self.ctrl.send(&m.to_ctrl())
    }

    /// A broken lane whose QP has drained asks the peer to re-establish it.
    pub(super) fn maybe_reconnect(&self, lane: usize) {
        let (nonce, ep) = {
            let mut st = self.lanes[lane].st.lock();
            if !st.broken || st.pending.is_some() || st.outstanding > 0 || !self.recoverable(&st) {
                return;
            }
            let (qp, psn, ep) = match self.new_qp(lane) {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(lane, error = %e, "cannot create a queue pair to reconnect");
                    return;
                }
            };
            let nonce = u64::from_le_bytes(crate::auth::random::<8>());
            st.pending = Some((qp, psn, nonce));
            st.reconnects += 1;
            (nonce, ep)
        };
        tracing::debug!(lane, "rdma lane: asking the peer to reconnect");
        if let Err(e) = self.send_msg(LaneOp::Reconnect, lane, nonce, &ep) {
            tracing::debug!(lane, error = %e, "reconnect request not sent");
            self.lanes[lane].st.lock().pending = None;
        }
    }
}
