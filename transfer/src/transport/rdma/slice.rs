//! A peer's slice size, adapted to what limits its rate ([`SliceSizer`]).
//!
//! Every work request costs the engine and the NIC a fixed amount on top of its bytes (a post,
//! a completion, the NIC's per-request processing). Where that fixed cost and not the wire
//! limits the rate — small slices on a fast link: 64 KiB slices at 400 Gb/s need 763k work
//! requests a second — bigger slices move the same bytes in fewer requests. Whether that is the
//! case depends on the NIC, the CPU and the load, so the sizer finds out by trying, per peer and
//! direction:
//!
//! 1. It measures the rate of the peer's large batches (those cut into at least two work
//!    requests per lane, so every lane is busy; smaller batches measure latency, not rate) at
//!    the current slice size, over a window of at least [`WINDOW`] batches and
//!    [`WINDOW_NS`] of their time: their bytes over the sum of their post-to-last-completion
//!    times.
//! 2. It then doubles the slice and measures a window again. The doubling is kept when it
//!    raised the rate by at least [`GAIN`], and the next doubling is tried; otherwise the
//!    sizer goes back to the last size that paid and settles there. It never doubles past the
//!    largest slice ([`crate::EngineConfig::rdma_slice_max`]), nor to a size that would leave the
//!    window's batches with fewer than two work requests per lane (large slices must still be
//!    spread over every queue pair).
//! 3. After [`REPROBE_WINDOWS`] windows at the settled size it probes again, with the last of
//!    those windows as the base (the load may have changed): alternately the next doubling and,
//!    above the configured size, a halving. A halving is kept, and the next one tried, when it
//!    raised the rate by at least [`GAIN`] — the same search downwards — so a slice grown while
//!    the request rate limited comes back down once smaller slices move more. Where only one
//!    direction is possible it tries that one.
//!
//! It never goes below the configured `slice_size`, and a batch too small to give every lane a
//! request at the current size is cut into one request per lane instead (never smaller than
//! `slice_size`), so a grown slice does not collapse a batch onto fewer queue pairs than the
//! configured one would ([`SliceSizer::slice_for`]). Batches cut before a change are not
//! counted at the new size. The sizer is plain arithmetic on what it is told (no clock, no
//! I/O), so its decisions are tested by feeding it rates.

/// Batches per measured window, at least.
pub(super) const WINDOW: u32 = 8;
/// The batches' time per measured window, at least (ns): shorter windows measure noise.
pub(super) const WINDOW_NS: u64 = 50_000_000;
/// A doubling (or halving) of the slice is kept when it raised the rate by at least this fraction.
pub(super) const GAIN: f64 = 0.10;
/// Windows at a settled size before the next probe.
pub(super) const REPROBE_WINDOWS: u32 = 64;

/// Where the sizer is in its search.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Measuring the current size as the base of the first doubling.
    Base,
    /// Measuring the current size, double (`up`) or half `base`, whose rate was `rate` (bytes
    /// per ns).
    Probe { base: u64, rate: f64, up: bool },
    /// Settled at the current size; `left` windows before the next probe, which halves first
    /// when `down` (and doubles first otherwise).
    Settled { left: u32, down: bool },
}

/// The slice size of one peer's work requests in one direction (see the module docs).
#[derive(Debug)]
pub(super) struct SliceSizer {
    cur: u64,
    floor: u64,
    max: u64,
    /// A batch counts when it was cut into at least this many work requests (two per lane).
    min_wrs: u64,
    phase: Phase,
    // The window being measured (at `cur`).
    bytes: u64,
    ns: u64,
    wrs: u64,
    batches: u32,
}

/// A change of slice size, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Change {
    /// Trying a doubled or halved size.
    Probing(u64),
    /// Settled at this size: the last probe did not pay, or none is possible.
    Settled(u64),
}

impl SliceSizer {
    /// Starts at `slice` bytes (also the smallest size), grows up to `max` (no growth when
    /// `max ≤ slice`), counting batches of at least two work requests on each of `lanes`.
    pub(super) fn new(slice: u64, max: u64, lanes: usize) -> SliceSizer {
        let slice = slice.max(1);
        SliceSizer {
            cur: slice,
            floor: slice,
            max: max.max(slice),
            min_wrs: 2 * lanes.max(1) as u64,
            phase: Phase::Base,
            bytes: 0,
            ns: 0,
            wrs: 0,
            batches: 0,
        }
    }

    /// The current slice size (a large batch's).
    pub(super) fn slice(&self) -> u64 {
        self.cur
    }

    /// The slice to cut a batch of `bytes` with: the current size, or, when that would leave
    /// some lane without a work request, the size that gives every lane one — but never less
    /// than the configured slice. So a grown slice never puts a batch on fewer lanes than the
    /// configured one would have. Such a batch is not counted in a window (its slice is not the
    /// current one; with fewer requests than lanes it would not count anyway).
    pub(super) fn slice_for(&self, bytes: u64) -> u64 {
        let lanes = self.min_wrs / 2;
        self.cur.min(self.floor.max(bytes.div_ceil(lanes)))
    }

    /// A batch cut with `slice` into `wrs` work requests moved `bytes` in `ns` nanoseconds
    /// (post to its last completion). Returns the change of size it caused, if any.
    pub(super) fn observe(&mut self, slice: u64, wrs: u64, bytes: u64, ns: u64) -> Option<Change> {
        if slice != self.cur || wrs < self.min_wrs || ns == 0 || self.max == self.floor {
            return None;
        }
        self.bytes = self.bytes.saturating_add(bytes);
        self.ns = self.ns.saturating_add(ns);
        self.wrs = self.wrs.saturating_add(wrs);
        self.batches = self.batches.saturating_add(1);
        if self.batches < WINDOW || self.ns < WINDOW_NS {
            return None;
        }
        let rate = self.bytes as f64 / self.ns as f64;
        let wrs_per_batch = self.wrs / u64::from(self.batches);
        (self.bytes, self.ns, self.wrs, self.batches) = (0, 0, 0, 0);
        match self.phase {
            Phase::Base => Some(self.probe(true, rate, wrs_per_batch)),
            Phase::Probe {
                base,
                rate: before,
                up,
            } => {
                if rate >= before * (1.0 + GAIN) {
                    Some(self.probe(up, rate, wrs_per_batch))
                } else {
                    // Back to the last size that paid; the next probe goes the other way.
                    self.cur = base;
                    self.settle(up);
                    Some(Change::Settled(base))
                }
            }
            Phase::Settled { left, down } if left > 1 => {
                self.phase = Phase::Settled {
                    left: left - 1,
                    down,
                };
                None
            }
            Phase::Settled { down, .. } => {
                let first = self.probe(!down, rate, wrs_per_batch);
                let change = match first {
                    Change::Settled(_) => self.probe(down, rate, wrs_per_batch),
                    c => c,
                };
                match change {
                    // No room either way: stay quietly.
                    Change::Settled(_) => None,
                    c => Some(c),
                }
            }
        }
    }

    /// Probes the next size up (double) or down (half) after a window at `rate` whose batches
    /// had `wrs_per_batch` work requests each, when the cap, the lanes and the configured slice
    /// allow it; settles otherwise.
    fn probe(&mut self, up: bool, rate: f64, wrs_per_batch: u64) -> Change {
        let next = if up {
            let next = self.cur.saturating_mul(2);
            (next <= self.max && wrs_per_batch / 2 >= self.min_wrs).then_some(next)
        } else {
            let next = self.cur / 2;
            (next >= self.floor).then_some(next)
        };
        match next {
            Some(next) => {
                self.phase = Phase::Probe {
                    base: self.cur,
                    rate,
                    up,
                };
                self.cur = next;
                Change::Probing(next)
            }
            None => {
                self.settle(!up);
                Change::Settled(self.cur)
            }
        }
    }

    /// Settles at the current size; the next probe, [`REPROBE_WINDOWS`] windows on, halves
    /// first when `down`.
    fn settle(&mut self, down: bool) {
        self.phase = Phase::Settled {
            left: REPROBE_WINDOWS,
            down,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K64: u64 = 64 << 10;

    /// Feeds batches of `wrs` requests at `rate` bytes per ns at the sizer's current size
    /// until a window closes (or, for batches that do not count, 4096 of them); returns the
    /// change it caused.
    fn window(s: &mut SliceSizer, wrs: u64, rate: f64) -> Option<Change> {
        for _ in 0..4096 {
            let slice = s.slice();
            let bytes = wrs * slice;
            let counted = s.batches;
            let out = s.observe(slice, wrs, bytes, (bytes as f64 / rate) as u64);
            if out.is_some() || (counted > 0 && s.batches == 0) {
                return out;
            }
        }
        None
    }

    #[test]
    fn a_window_needs_its_batches_and_its_time() {
        let mut s = SliceSizer::new(K64, 16 << 20, 1);
        // WINDOW batches of 1 ms each: too short; the window closes at WINDOW_NS.
        let ms = 1_000_000;
        for _ in 0..WINDOW_NS / ms - 1 {
            assert_eq!(s.observe(K64, 64, 64 * K64, ms), None);
        }
        assert_eq!(
            s.observe(K64, 64, 64 * K64, ms),
            Some(Change::Probing(2 * K64))
        );
        // Long batches: still WINDOW of them.
        for _ in 0..WINDOW - 1 {
            assert_eq!(s.observe(2 * K64, 32, 64 * K64, WINDOW_NS), None);
        }
        assert_eq!(
            s.observe(2 * K64, 32, 64 * K64, WINDOW_NS),
            Some(Change::Settled(K64))
        );
    }

    #[test]
    fn grows_while_doubling_pays_then_settles_on_the_last_that_paid() {
        // Per-request cost limits: every doubling raises the rate by a third, until 256 KiB,
        // where the wire limits (no gain from 512 KiB).
        let mut s = SliceSizer::new(K64, 16 << 20, 4);
        let mut rates = [10.0, 13.3, 17.7, 18.0].into_iter();
        assert_eq!(
            window(&mut s, 512, rates.next().unwrap()),
            Some(Change::Probing(2 * K64))
        );
        // The window at the new size needs the batches cut at it: one cut before does not count.
        assert_eq!(s.observe(K64, 512, 512 * K64, 1000), None);
        assert_eq!(s.batches, 0);
        assert_eq!(
            window(&mut s, 256, rates.next().unwrap()),
            Some(Change::Probing(4 * K64))
        );
        assert_eq!(
            window(&mut s, 128, rates.next().unwrap()),
            Some(Change::Probing(8 * K64))
        );
        // 18.0 against 17.7: under GAIN, back to 256 KiB.
        assert_eq!(
            window(&mut s, 64, rates.next().unwrap()),
            Some(Change::Settled(4 * K64))
        );
        assert_eq!(s.slice(), 4 * K64);
        // Settled: nothing changes until REPROBE_WINDOWS windows went by. The doubling did not
        // pay, so the next probe halves; that does not pay either, and the one after doubles.
        for _ in 1..REPROBE_WINDOWS {
            assert_eq!(window(&mut s, 128, 18.0), None);
        }
        assert_eq!(window(&mut s, 128, 18.0), Some(Change::Probing(2 * K64)));
        assert_eq!(window(&mut s, 256, 17.0), Some(Change::Settled(4 * K64)));
        for _ in 1..REPROBE_WINDOWS {
            assert_eq!(window(&mut s, 128, 18.0), None);
        }
        assert_eq!(window(&mut s, 128, 18.0), Some(Change::Probing(8 * K64)));
        assert_eq!(window(&mut s, 64, 18.5), Some(Change::Settled(4 * K64)));
    }

    #[test]
    fn a_grown_slice_comes_back_down_when_smaller_ones_move_more() {
        let mut s = SliceSizer::new(K64, 16 << 20, 1);
        // The request rate limits: grows to 256 KiB.
        assert_eq!(window(&mut s, 512, 10.0), Some(Change::Probing(2 * K64)));
        assert_eq!(window(&mut s, 256, 15.0), Some(Change::Probing(4 * K64)));
        assert_eq!(window(&mut s, 128, 20.0), Some(Change::Probing(8 * K64)));
        assert_eq!(window(&mut s, 64, 20.5), Some(Change::Settled(4 * K64)));
        // The load changes: 256 KiB slices now move 10, smaller ones more.
        for _ in 1..REPROBE_WINDOWS {
            assert_eq!(window(&mut s, 128, 10.0), None);
        }
        assert_eq!(window(&mut s, 128, 10.0), Some(Change::Probing(2 * K64)));
        assert_eq!(window(&mut s, 256, 12.0), Some(Change::Probing(K64)));
        // Down at the configured slice: settled there, and never below it.
        assert_eq!(window(&mut s, 512, 14.0), Some(Change::Settled(K64)));
        assert_eq!(s.slice(), K64);
        // At the configured slice the next probe doubles.
        for _ in 1..REPROBE_WINDOWS {
            assert_eq!(window(&mut s, 512, 14.0), None);
        }
        assert_eq!(window(&mut s, 512, 14.0), Some(Change::Probing(2 * K64)));
        assert_eq!(window(&mut s, 256, 14.0), Some(Change::Settled(K64)));
    }

    #[test]
    fn a_wire_bound_peer_keeps_its_slice() {
        let mut s = SliceSizer::new(1 << 20, 16 << 20, 2);
        assert_eq!(window(&mut s, 64, 20.0), Some(Change::Probing(2 << 20)));
        assert_eq!(window(&mut s, 32, 20.5), Some(Change::Settled(1 << 20)));
        assert_eq!(s.slice(), 1 << 20);
    }

    #[test]
    fn never_past_the_cap_nor_below_two_requests_per_lane() {
        // Cap: 128 KiB.
        let mut s = SliceSizer::new(K64, 2 * K64, 1);
        assert_eq!(window(&mut s, 64, 1.0), Some(Change::Probing(2 * K64)));
        assert_eq!(window(&mut s, 32, 2.0), Some(Change::Settled(2 * K64)));
        // Lanes: 4 lanes need 8 requests a batch; batches of 12 would have 6 at double the size.
        let mut s = SliceSizer::new(K64, 16 << 20, 4);
        assert_eq!(window(&mut s, 12, 1.0), Some(Change::Settled(K64)));
        // Batches too small to count (under two requests a lane) change nothing.
        let mut s = SliceSizer::new(K64, 16 << 20, 4);
        assert_eq!(window(&mut s, 7, 1.0), None);
        assert_eq!(window(&mut s, 7, 1.0), None);
        assert_eq!(s.slice(), K64);
    }

    #[test]
    fn a_grown_slice_still_spreads_a_small_batch_over_the_lanes() {
        let mut s = SliceSizer::new(K64, 1 << 20, 2);
        for (wrs, rate) in [(512, 10.0), (256, 20.0), (128, 40.0), (64, 80.0)] {
            assert!(matches!(
                window(&mut s, wrs, rate),
                Some(Change::Probing(_))
            ));
        }
        assert_eq!(s.slice(), 1 << 20);
        // Large batches: the grown slice.
        assert_eq!(s.slice_for(64 << 20), 1 << 20);
        assert_eq!(s.slice_for(2 << 20), 1 << 20);
        // Under one slice per lane: half each.
        assert_eq!(s.slice_for(1 << 20), 512 << 10);
        assert_eq!(s.slice_for((1 << 20) + 1), (512 << 10) + 1);
        // Never below the configured slice.
        assert_eq!(s.slice_for(100 << 10), K64);
        assert_eq!(s.slice_for(1), K64);
        // Not grown: the configured slice for every batch.
        let s = SliceSizer::new(K64, 1 << 20, 2);
        assert_eq!(s.slice_for(1 << 20), K64);
        assert_eq!(s.slice_for(1), K64);
    }

    #[test]
    fn off_when_the_cap_is_the_slice() {
        let mut s = SliceSizer::new(K64, K64, 1);
        assert_eq!(window(&mut s, 512, 1.0), None);
        let mut s = SliceSizer::new(K64, 0, 1);
        assert_eq!(window(&mut s, 512, 1.0), None);
        assert_eq!(s.slice(), K64);
    }

    #[test]
    fn zero_times_are_ignored() {
        let mut s = SliceSizer::new(K64, 16 << 20, 1);
        for _ in 0..4 * WINDOW {
            assert_eq!(s.observe(K64, 64, 64 * K64, 0), None);
        }
        assert_eq!(s.slice(), K64);
    }
}
