//! Completions: a peer's work requests completed (or failed, or flushed) and what follows
//! (re-posting, failing or finishing batches).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_verbs::WcStatus;

use super::signal::{completion_is_current, covered_outcome};
use super::state::{BatchCtx, PeerShared, WrEntry, WR_TRACE};
use crate::error::Error;

/// How long a failing READ batch waits for its flushed WRs before the failure is published.
const QUIESCE_MAX: Duration = Duration::from_secs(5);

impl PeerShared {
    /// One completion of ours, reported by QP number `qpn`: first the unsignalled WRs it
    /// covers (those still posted on the same QP), then the WR itself. A completion from a QP
    /// the WR is not posted on now is stale and ignored (see `completion_is_current`).
    pub(super) fn complete(&self, wr_id: u64, qpn: u32, result: Result<(), WcStatus>) {
        let covered: Vec<u64> = {
            let mut m = self.wrs.lock();
            let Some(e) = m.get_mut(&wr_id) else {
                return;
            };
            tracing::trace!(
                target: WR_TRACE,
                wr = wr_id & 0xffff_ffff,
                lane = e.lane,
                qpn,
                status = ?result,
                posted_on = ?e.qp.as_ref().map(|q| q.qpn()),
                "completion"
            );
            if !completion_is_current(e.qp.as_ref().map(|q| q.qpn()), qpn) {
                self.stale.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    wr_id,
                    qpn,
                    "rdma completion from a queue pair the work request is not posted on; ignored"
                );
                return;
            }
            let covers = std::mem::take(&mut e.covers);
            let qp = e.qp.clone();
            covers
                .into_iter()
                .filter(|id| {
                    m.get(id).is_some_and(|c| match (&c.qp, &qp) {
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        _ => false,
                    })
                })
                .collect()
        };
        let covered_result = covered_outcome(&result);
        for id in covered {
            self.complete_one(id, covered_result);
        }
        self.complete_one(wr_id, result);
    }

    pub(super) fn complete_one(&self, wr_id: u64, result: Result<(), WcStatus>) {
        let Some(mut e) = self.wrs.lock().remove(&wr_id) else {
            return;
        };
        let lane = e.lane;
        if e.qp.is_some() {
            e.batch.on_nic.fetch_sub(1, Ordering::AcqRel);
            let _ =
                self.lanes[lane]
                    .inflight
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
        let (current, suspect) = {
            let mut st = self.lanes[lane].st.lock();
            let current = e.qp.as_ref().is_some_and(|q| Arc::ptr_eq(q, &st.qp));
            let mut suspect = None;
            if current && !st.broken && result == Err(WcStatus::WrFlush) {
                // A flush from the lane's current QP, which we did not move to the error state,
                // and no error completion before it: the provider errored the QP without
                // reporting the failing WR. SoftRoCE (rxe, Linux 6.1) does this on a NAK in the
                // middle of a READ response sequence and reports that READ *successful*
                // although its data never landed (`tests/rdma_read_stress_vm.rs`).
                tracing::warn!(
                    target: WR_TRACE,
                    lane,
                    qpn = st.qp.qpn(),
                    "rdma: the provider moved a queue pair to the error state without an error \
                     completion; the WR last reported successful on it is not trusted"
                );
                // RC completes in order and every WR here is signalled or covered: the WR whose
                // success this QP reported last is the one the provider failed.
                suspect = st
                    .last_ok
                    .take()
                    .filter(|(q, ..)| Arc::ptr_eq(q, &st.qp))
                    .map(|(_, id, x)| (id, x));
            }
            if current {
                st.outstanding = st.outstanding.saturating_sub(1);
                if result.is_err() {
                    self.break_lane(lane, &mut st);
                }
            }
            if let Err(err) = self.pump(lane, &mut st) {
                tracing::warn!(lane, error = %err, "rdma post failed; lane broken");
                self.break_lane(lane, &mut st);
            }
            (current, suspect)
        };
        let posted_on = e.qp.take();
        if let Some((id, x)) = suspect {
            self.repost_suspect(id, x);
        }
        match result {
            Ok(()) => {
                let finished = e.batch.left.fetch_sub(1, Ordering::AcqRel) == 1;
                if finished {
                    self.sampled(&e.batch.sample);
                    self.finish(&e.batch);
                }
                if let (true, Some(q)) = (current, posted_on) {
                    // Remembered until the QP's next completion; the entry only while its batch
                    // still waits (it can be posted again then).
                    let mut st = self.lanes[lane].st.lock();
                    if Arc::ptr_eq(&q, &st.qp) && !st.broken {
                        st.last_ok = Some((q, wr_id, (!finished).then_some(e)));
                    }
                }
            }
            Err(WcStatus::WrFlush) => {
                // Flushed by a broken queue pair: post it again elsewhere.
                self.wrs.lock().insert(wr_id, e);
                self.reroute(vec![wr_id], "queue pair flushed");
            }
            Err(
                s @ (WcStatus::RemoteInvalidRequest
                | WcStatus::RemoteInvalidRdRequest
                | WcStatus::RemoteOperation),
            ) => {
                // The peer's NIC refused the request as malformed although it was well formed
                // (a bad key or an out-of-bounds address is `RemoteAccess`): a transport-level
                // fault (SoftRoCE does this after packet loss under load). Retried elsewhere,
                // bounded, like a flushed WR.
                tracing::debug!(lane, status = ?s, "rdma work request refused; retrying elsewhere");
                self.wrs.lock().insert(wr_id, e);
                self.reroute(vec![wr_id], "remote invalid request");
            }
            Err(
                s @ (WcStatus::RetryExceeded
                | WcStatus::RnrRetryExceeded
                | WcStatus::ResponseTimeout),
            ) => {
                // No answer from the peer on this queue pair: congestion or a dead peer. The
                // lane is broken (and re-established over the control connection); the WR is
                // tried again on another lane, a bounded number of times, so a congested path
                // costs a retry while a dead peer still fails (every lane times out, or the
                // control connection dies) with `PeerDead`.
                tracing::debug!(lane, status = ?s, "rdma work request unanswered; retrying elsewhere");
                self.wrs.lock().insert(wr_id, e);
                self.reroute(vec![wr_id], "peer unreachable");
            }
            Err(s) => {
                let err = match s {
                    WcStatus::RemoteAccess => Error::AccessDenied(e.region),
                    // Our own keys refused by our NIC: a defect here, not the caller's input.
                    s @ (WcStatus::LocalProtection | WcStatus::LocalAccess) => {
                        Error::Io(std::io::Error::other(format!(
                            "rdma work request failed: {s:?} (local key of lane {lane})"
                        )))
                    }
                    other => Error::Io(std::io::Error::other(format!(
                        "rdma work request failed: {other:?}"
                    ))),
                };
                tracing::debug!(lane, status = ?s, "rdma work request failed");
                e.batch.state.fail(err);
            }
        }
        self.maybe_reconnect(lane);
        if result.is_err() && !self.closed() {
            let (ok, later) = self.lane_sets();
            if ok.is_empty() && later.is_empty() {
                (self.on_dead)("rdma: every queue pair failed".into());
            }
        }
    }

    /// Posts again a WR that its QP reported successful right before the provider moved that
    /// QP to the error state without an error completion (SoftRoCE reports a READ it failed
    /// this way; its data never landed). Only while its batch still waits for other WRs: the
    /// batch's count goes up again first, so it cannot complete before this WR completes again.
    /// A batch that already completed cannot be repaired (logged).
    pub(super) fn repost_suspect(&self, id: u64, e: Option<WrEntry>) {
        let e = e.filter(|e| {
            e.batch
                .left
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n > 0).then_some(n + 1)
                })
                .is_ok()
        });
        let Some(e) = e else {
            tracing::warn!(
                target: WR_TRACE,
                wr = id & 0xffff_ffff,
                "rdma: a WR reported successful by a queue pair that then failed belongs to a \
                 batch that already completed; its data may be missing"
            );
            return;
        };
        tracing::debug!(target: WR_TRACE, wr = id & 0xffff_ffff, "posting a suspect WR again");
        self.wrs.lock().insert(id, e);
        self.reroute(
            vec![id],
            "provider failed the queue pair after reporting success",
        );
    }

    pub(super) fn finish(&self, b: &BatchCtx) {
        if b.state.is_done() {
            return;
        }
        let tag = b.notify.lock().take();
        match tag {
            // Every WR completed, so every byte landed: the notification goes out now, and the
            // batch's part completes when the target confirms it queued it (the engine's fence),
            // so a completed batch's notification is already at the target.
            Some(tag) => {
                if let Err(e) = self.ctrl.send_notify(b.state.id, tag) {
                    b.state
                        .fail(Error::PeerDead(format!("sending notification: {e}")));
                }
            }
            None => b.state.part_done(),
        }
    }

    /// Breaks the lanes carrying a batch's WRs and waits (bounded) until none is on the NIC.
    /// The batch is marked first, so that its flushed WRs are dropped rather than posted again
    /// on another lane (re-established lanes come back quickly: a WR re-posted there would be
    /// on the NIC again while this waits, and could land after the failure is published).
    pub(super) fn quiesce(&self, b: &BatchCtx) {
        b.quiescing.store(true, Ordering::Release);
        let mask = b.lanes.load(Ordering::Acquire);
        for (i, l) in self.lanes.iter().enumerate() {
            if mask & (1u64 << (i % 64)) != 0 && b.on_nic.load(Ordering::Acquire) > 0 {
                let mut st = l.st.lock();
                self.break_lane(i, &mut st);
            }
        }
        let t0 = Instant::now();
        while b.on_nic.load(Ordering::Acquire) > 0 && t0.elapsed() < QUIESCE_MAX {
            std::thread::sleep(Duration::from_micros(200));
        }
        if b.on_nic.load(Ordering::Acquire) > 0 {
            tracing::warn!("rdma: READs of a failed batch did not flush in time");
        }
    }
}
