//! The target side of a data path: region checks and notification accounting
//! ([`TargetCtx`], [`NotifyTracker`]).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::marks::CopyMarks;
use crate::error::Error;
use crate::notify::{Notification, NotifyQueue};
use crate::region::RegionTable;
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
}

#[derive(Default)]
struct Track {
    landed: u32,
    refused: u32,
    expected: Option<u32>,
    tag: Option<Vec<u8>>,
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
                if t.refused == 0 {
                    ctx.notify.push(Notification {
                        peer: ctx.peer,
                        tag: t.tag.unwrap_or_default(),
                    });
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

    /// The notification of a batch arrived (with the batch's slice count).
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
        t.tag = Some(tag);
        Self::settle(ctx, batch, &mut m);
        Ok(())
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
}
