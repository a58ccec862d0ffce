//! The target side of a data path: region checks and notification accounting
//! ([`TargetCtx`], [`NotifyTracker`]).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::marks::CopyMarks;
use crate::error::Error;
use crate::notify::{Budget, Charge, Notification, NotifyQueue, NOTIFY_OVERHEAD};
use crate::region::{RegionGate, RegionTable};
use crate::types::PeerId;
use crate::wire::ProtocolError;

/// What a target-side data path needs: region checks, notification tracking and delivery.
#[derive(Clone)]
pub(crate) struct TargetCtx {
    pub regions: Arc<RegionTable>,
    pub notify: Arc<NotifyQueue>,
    pub peer: PeerId,
    pub tracker: Arc<NotifyTracker>,
    /// Where this peer's lane threads mark the region they are copying.
    pub marks: Arc<CopyMarks>,
    /// The peer's own gate: every copy of its lanes runs inside it; closed when the peer is
    /// closed or fenced (then no copy of that peer runs any more once it is idle).
    pub gate: Arc<RegionGate>,
    /// The peer's budget of pending notification bytes.
    pub budget: Arc<Budget>,
}

#[derive(Default)]
struct Track {
    landed: u32,
    refused: u32,
    expected: Option<u32>,
    tag: Option<(Vec<u8>, Charge)>,
    /// Not delivered even when complete (its notification was refused: budget spent).
    dropped: bool,
}

/// Target side: counts the slices of batches that carry a notification and delivers the tag
/// once every slice of the batch (on every lane) landed, whatever the arrival order. A batch
/// with a refused slice never delivers its tag; its entry is dropped once all slices are
/// accounted for.
#[derive(Default)]
pub(crate) struct NotifyTracker {
    m: Mutex<HashMap<u64, Track>>,
}

/// Bound on batches tracked at once per peer.
const MAX_TRACKED: usize = 1 << 16;

impl NotifyTracker {
    fn settle(ctx: &TargetCtx, batch: u64, m: &mut HashMap<u64, Track>) {
        let complete = m.get(&batch).is_some_and(|t| {
            t.expected
                .is_some_and(|e| t.landed.saturating_add(t.refused) >= e)
        });
        if complete {
            if let Some(t) = m.remove(&batch) {
                if t.dropped {
                    // Refused when it arrived (and counted then).
                } else if t.refused == 0 {
                    let (tag, charge) = match t.tag {
                        Some((tag, c)) => (tag, Some(c)),
                        None => (Vec::new(), None),
                    };
                    ctx.notify.push(
                        Notification {
                            peer: ctx.peer,
                            tag,
                        },
                        charge,
                    );
                } else {
                    ctx.notify
                        .suppressed
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
    }

    fn entry(m: &mut HashMap<u64, Track>, batch: u64) -> Result<&mut Track, Error> {
        if !m.contains_key(&batch) && m.len() >= MAX_TRACKED {
            return Err(ProtocolError::TooManyTracked.into());
        }
        Ok(m.entry(batch).or_default())
    }

    /// A tracked slice landed.
    pub fn landed(&self, ctx: &TargetCtx, batch: u64) -> Result<(), Error> {
        let mut m = self.m.lock();
        Self::entry(&mut m, batch)?.landed += 1;
        Self::settle(ctx, batch, &mut m);
        Ok(())
    }

    /// The notification of a batch arrived (with the batch's slice count). Its tag is charged
    /// to the peer's budget until the application takes it; beyond the budget it is refused
    /// with `Error::ResourceLimit` (the batch's slices are still accounted for, and the tag is
    /// never delivered).
    pub fn notify(
        &self,
        ctx: &TargetCtx,
        batch: u64,
        slices: u32,
        tag: Vec<u8>,
    ) -> Result<(), Error> {
        let mut m = self.m.lock();
        let t = Self::entry(&mut m, batch)?;
        if t.expected.is_some() {
            return Err(ProtocolError::DuplicateNotify { batch }.into());
        }
        t.expected = Some(slices);
        let r = match ctx.budget.charge(tag.len() + NOTIFY_OVERHEAD) {
            Ok(c) => {
                t.tag = Some((tag, c));
                Ok(())
            }
            Err(e) => {
                t.dropped = true;
                ctx.notify
                    .refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Err(e)
            }
        };
        Self::settle(ctx, batch, &mut m);
        r
    }

    /// A tracked slice was refused: the batch's notification must never be delivered.
    pub fn refused(&self, ctx: &TargetCtx, batch: u64) {
        let mut m = self.m.lock();
        if let Ok(t) = Self::entry(&mut m, batch) {
            t.refused += 1;
        }
        Self::settle(ctx, batch, &mut m);
    }

    /// Forget everything (peer gone).
    pub fn clear(&self) {
        self.m.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notify::Notifications;

    fn ctx() -> (TargetCtx, Notifications) {
        let q = Arc::new(NotifyQueue::default());
        let ctx = TargetCtx {
            regions: Arc::new(RegionTable::default()),
            notify: q.clone(),
            peer: PeerId(1),
            tracker: Arc::new(NotifyTracker::default()),
            marks: Arc::new(CopyMarks::default()),
            gate: Arc::new(RegionGate::default()),
            budget: Budget::new(200),
        };
        (ctx, Notifications { q })
    }

    #[test]
    fn delivers_only_after_every_slice_in_any_order() {
        let (c, n) = ctx();
        let t = c.tracker.clone();
        t.landed(&c, 7).expect("landed");
        t.notify(&c, 7, 3, b"x".to_vec()).expect("notify");
        assert!(n.try_recv().is_none());
        t.landed(&c, 7).expect("landed");
        assert!(n.try_recv().is_none());
        t.landed(&c, 7).expect("landed");
        assert_eq!(n.try_recv().map(|x| x.tag), Some(b"x".to_vec()));
        // notification first, then slices
        t.notify(&c, 8, 1, b"y".to_vec()).expect("notify");
        assert!(n.try_recv().is_none());
        t.landed(&c, 8).expect("landed");
        assert_eq!(n.try_recv().map(|x| x.tag), Some(b"y".to_vec()));
        // zero slices: at once
        t.notify(&c, 9, 0, b"z".to_vec()).expect("notify");
        assert_eq!(n.try_recv().map(|x| x.tag), Some(b"z".to_vec()));
        assert!(t.m.lock().is_empty());
    }

    #[test]
    fn refused_slice_suppresses_the_notification_and_cleans_up() {
        let (c, n) = ctx();
        let t = c.tracker.clone();
        t.refused(&c, 5);
        t.notify(&c, 5, 3, b"no".to_vec()).expect("notify");
        t.landed(&c, 5).expect("landed");
        assert_eq!(t.m.lock().len(), 1);
        t.landed(&c, 5).expect("landed"); // arrives after the notification, on another lane
        assert!(n.try_recv().is_none());
        assert!(t.m.lock().is_empty());
        assert!(matches!(t.notify(&c, 6, 1, vec![]), Ok(())));
        assert!(matches!(
            t.notify(&c, 6, 1, vec![]),
            Err(Error::Protocol(_))
        ));
    }

    #[test]
    fn tags_are_charged_until_taken() {
        let (c, n) = ctx();
        let t = c.tracker.clone();
        t.notify(&c, 1, 0, vec![1; 100]).expect("fits");
        assert_eq!(c.budget.used(), 164);
        // 164 + 100 + 64 > 200: refused, and the batch's slice is still accounted for.
        assert!(matches!(
            t.notify(&c, 2, 1, vec![2; 100]),
            Err(Error::ResourceLimit { limit: 200, .. })
        ));
        t.landed(&c, 2).expect("landed");
        assert!(t.m.lock().is_empty());
        assert_eq!(n.try_recv().map(|x| x.tag.len()), Some(100));
        assert_eq!(c.budget.used(), 0, "taking it gave the bytes back");
        assert!(n.try_recv().is_none());
        t.notify(&c, 3, 0, vec![3; 100]).expect("fits again");
    }
}
