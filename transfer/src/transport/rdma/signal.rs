//! Selective signalling: which work requests of a chain are signalled, what a signalled
//! completion says about the ones it covers, and which completions are current.

use kvwire_verbs::{SendOp, WcStatus};

/// Which WRs of a chain (`ops`, posted in order on one QP) are signalled, and which
/// unsignalled ones each signalled WR covers: every READ, every `every`-th WR since the
/// previous signalled one, and the last one are signalled; a signalled WR covers the
/// unsignalled WRs since the previous signalled one of the chain. Every WR of the chain is
/// either signalled or covered by exactly one later signalled WR (the last WR is always
/// signalled), so no WR is left without a completion.
///
/// READs are always signalled: a provider can report a READ successful whose data never
/// landed and then fail its QP without an error completion (SoftRoCE does, see
/// `completion::complete_one`); the engine repairs that by posting again the WR whose success
/// the QP reported last, which needs each READ's own completion. WRITEs carry the KV path and
/// are where the completion count matters.
pub(super) fn signal_plan(ops: &[SendOp], every: usize) -> Vec<(usize, Vec<usize>)> {
    let every = every.max(1);
    let n = ops.len();
    let mut out = Vec::with_capacity(n / every + 1);
    let mut cover = Vec::new();
    for (j, op) in ops.iter().enumerate() {
        if cover.len() + 1 >= every || j + 1 == n || *op == SendOp::Read {
            out.push((j, std::mem::take(&mut cover)));
        } else {
            cover.push(j);
        }
    }
    out
}

/// What a signalled WR's completion says about the unsignalled WRs it covers that are still
/// posted on its QP. Success: RC completes a QP's WRs in order and an unsignalled WR that fails
/// or is flushed reports on its own, so they completed. Any error: they are treated as flushed
/// and posted again (WRITE and READ are idempotent: the same bytes land twice at worst), so a
/// WR is reported successful only by its own successful completion or a later successful one on
/// the same QP, never inferred from an error path (QP re-creation, flushes, retries).
pub(super) fn covered_outcome(signalled: &Result<(), WcStatus>) -> Result<(), WcStatus> {
    match signalled {
        Ok(()) => Ok(()),
        Err(_) => Err(WcStatus::WrFlush),
    }
}

/// Whether a completion reported by QP `wc_qpn` belongs to the current posting of a WR whose
/// entry says it is posted on `posted_on` (`None`: not on any QP now, waiting in a backlog).
/// Completions are matched by `wr_id`; this check keeps a completion from an earlier posting
/// of the same WR (on a QP it has since left) from completing a later posting still in flight.
pub(super) fn completion_is_current(posted_on: Option<u32>, wc_qpn: u32) -> bool {
    posted_on == Some(wc_qpn)
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;

    /// One QP's send queue as the accounting sees it: WRs posted in chains (signal plan of
    /// `pump`), executed in order by a model NIC, completions consumed in order with the rules
    /// of `complete` (covers of a signalled WR resolved by `covered_outcome`).
    struct QpModel {
        /// Per posted WR: (batch, signalled).
        wrs: Vec<(u8, bool)>,
        /// Signalled WR -> the unsignalled ones it covers.
        covers: HashMap<usize, Vec<usize>>,
    }

    impl QpModel {
        /// Posts `batches` (each a list of WR counts per chain, interleaved chain by chain).
        fn post(chains: &[(u8, usize)], every: usize) -> QpModel {
            let mut m = QpModel {
                wrs: Vec::new(),
                covers: HashMap::new(),
            };
            for &(batch, n) in chains {
                let base = m.wrs.len();
                m.wrs.extend(std::iter::repeat_n((batch, false), n));
                for (sig, cov) in signal_plan(&vec![SendOp::Write; n], every) {
                    m.wrs[base + sig].1 = true;
                    m.covers
                        .insert(base + sig, cov.into_iter().map(|j| base + j).collect());
                }
            }
            m
        }

        /// The completions an RC QP reports when its first `ok` WRs execute and the rest fail
        /// (the first with `fail`, the others flushed): successes only when signalled, errors
        /// always. `lose_flush` drops the flush report of that WR (a misbehaving provider).
        fn cqes(
            &self,
            ok: usize,
            fail: WcStatus,
            lose_flush: Option<usize>,
        ) -> Vec<(usize, Result<(), WcStatus>)> {
            let mut out = Vec::new();
            for (i, &(_, sig)) in self.wrs.iter().enumerate() {
                if i < ok {
                    if sig {
                        out.push((i, Ok(())));
                    }
                } else if i == ok {
                    out.push((i, Err(fail)));
                } else if lose_flush != Some(i) {
                    out.push((i, Err(WcStatus::WrFlush)));
                }
            }
            out
        }

        /// Consumes completions like `complete`: returns each WR's resolution (first one wins;
        /// a WR resolved twice is a defect and panics).
        fn account(
            &self,
            cqes: &[(usize, Result<(), WcStatus>)],
        ) -> HashMap<usize, Result<(), WcStatus>> {
            let mut done: HashMap<usize, Result<(), WcStatus>> = HashMap::new();
            let mut settle = |i: usize, r: Result<(), WcStatus>| {
                assert!(done.insert(i, r).is_none(), "WR {i} resolved twice");
            };
            let mut resolved: HashSet<usize> = HashSet::new();
            for (i, r) in cqes {
                if let Some(cov) = self.covers.get(i) {
                    for &c in cov {
                        // `complete` only resolves covered WRs still posted on the QP.
                        if resolved.insert(c) {
                            settle(c, covered_outcome(r));
                        }
                    }
                }
                if resolved.insert(*i) {
                    settle(*i, *r);
                }
            }
            done
        }
    }

    #[test]
    fn signal_plan_signals_every_nth_and_the_last_and_covers_the_rest_once() {
        for every in 1..=20 {
            for n in 0..70 {
                let plan = signal_plan(&vec![SendOp::Write; n], every);
                let mut seen = vec![0u8; n];
                let mut prev = None;
                for (sig, cov) in &plan {
                    assert!(prev.is_none_or(|p| p < *sig), "in order");
                    assert!((sig + 1) % every == 0 || sig + 1 == n);
                    assert!(cov.iter().all(|c| c < sig && prev.is_none_or(|p| *c > p)));
                    seen[*sig] += 1;
                    for &c in cov {
                        seen[c] += 1;
                    }
                    prev = Some(*sig);
                }
                assert!(
                    seen.iter().all(|&k| k == 1),
                    "n={n} every={every}: {seen:?}"
                );
                if n > 0 {
                    assert_eq!(plan.last().map(|p| p.0), Some(n - 1), "last is signalled");
                }
                if every == 1 {
                    assert!(plan.iter().all(|(_, c)| c.is_empty()));
                }
            }
        }
    }

    #[test]
    fn reads_are_always_signalled_and_writes_every_nth() {
        // Every mix of READs and WRITEs up to 9 WRs: each READ signalled, no run of
        // unsignalled WRs longer than `every - 1`, every WR signalled or covered exactly once.
        for every in [1usize, 2, 3, 16] {
            for n in 0..=9usize {
                for mask in 0u32..(1 << n) {
                    let ops: Vec<SendOp> = (0..n)
                        .map(|j| {
                            if mask & (1 << j) != 0 {
                                SendOp::Read
                            } else {
                                SendOp::Write
                            }
                        })
                        .collect();
                    let plan = signal_plan(&ops, every);
                    let mut seen = vec![0u8; n];
                    for (sig, cov) in &plan {
                        seen[*sig] += 1;
                        assert!(cov.len() < every, "{ops:?} every={every}: run too long");
                        for &c in cov {
                            assert_eq!(ops[c], SendOp::Write, "a READ left unsignalled");
                            assert!(c < *sig);
                            seen[c] += 1;
                        }
                    }
                    assert!(seen.iter().all(|&k| k == 1), "{ops:?} every={every}");
                    for (j, op) in ops.iter().enumerate() {
                        if *op == SendOp::Read {
                            assert!(plan.iter().any(|(s, _)| *s == j), "READ {j} unsignalled");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn selective_signalling_never_reports_a_wr_done_that_did_not_execute() {
        // Chains of two batches interleaved on one QP (as the backlog posts them), every
        // failure point, every failure status the NIC reports: each WR is resolved exactly
        // once, and a WR resolved Ok really executed.
        let chains = [(1u8, 7), (2, 16), (1, 3), (2, 1), (1, 33), (2, 5)];
        for every in [1usize, 2, 4, 16, 64] {
            let q = QpModel::post(&chains, every);
            let n = q.wrs.len();
            for ok in 0..=n {
                for fail in [
                    WcStatus::RetryExceeded,
                    WcStatus::RemoteAccess,
                    WcStatus::WrFlush,
                    WcStatus::RemoteInvalidRequest,
                ] {
                    let done = q.account(&q.cqes(ok, fail, None));
                    assert_eq!(done.len(), n, "every={every} ok={ok}: a WR left unresolved");
                    for (i, r) in &done {
                        if r.is_ok() {
                            assert!(*i < ok, "every={every} ok={ok}: WR {i} reported done");
                        }
                    }
                    // Nothing that executed is lost either: a WR is Ok or re-posted (error).
                    let oks = done.values().filter(|r| r.is_ok()).count();
                    assert!(oks <= ok);
                }
            }
        }
    }

    #[test]
    fn a_lost_flush_report_does_not_turn_into_success() {
        // A provider that drops the flush completion of an unsignalled WR (rxe does when its CQ
        // is full): the signalled WR after it reports a flush, and the covered WR is re-posted,
        // not reported done.
        let q = QpModel::post(&[(1, 16), (2, 16)], 16);
        let n = q.wrs.len();
        for ok in 0..n {
            for lost in ok + 1..n {
                if q.wrs[lost].1 {
                    continue; // only unsignalled WRs are covered
                }
                let done = q.account(&q.cqes(ok, WcStatus::RetryExceeded, Some(lost)));
                assert_eq!(done.len(), n);
                assert!(
                    done.iter().all(|(i, r)| r.is_err() || *i < ok),
                    "ok={ok} lost={lost}: a WR that never ran reported done"
                );
            }
        }
    }

    #[test]
    fn completions_from_a_queue_pair_the_wr_left_are_stale() {
        assert!(completion_is_current(Some(17), 17));
        assert!(
            !completion_is_current(Some(18), 17),
            "re-posted on another QP"
        );
        assert!(
            !completion_is_current(None, 17),
            "waiting in a backlog, not on any QP"
        );
    }
}
