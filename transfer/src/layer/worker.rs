//! The worker thread that runs a layer stream's state machine, and what it shares with the
//! stream's handle.
//!
//! Per layer: `waiting → ready (readiness fired, or a CUDA event a stager orders after) →
//! started (ready and destination known) → [staged chunks] → written → done`. The stream is
//! done when every layer is and, if a tag was given, the target has the notification (sent on
//! the last batch when nothing else is in flight, else as an empty batch after all others
//! completed, so the target never sees it before all bytes landed). Any failure (readiness,
//! staging, a batch, the deadline, an abort) fails every unfinished layer and the stream; the
//! worker then waits for what is in flight (bounded by the deadline) so that every staging
//! buffer is back in its pool before the failure is reported.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::{Condvar, Mutex};

use crate::batch::Batch;
use crate::engine::{Engine, Peer};
use crate::layer::error::LayerError;
use crate::layer::layout::{Extent, KvLayout, SrcSpace};
use crate::layer::readiness::{Readiness, ReadySignal};
use crate::layer::staging::{Lease, StageCopy, Stager};
use crate::types::{BatchStats, Op, RegionId};

use super::options::{BlockLists, LayerStats, StreamStats};

/// After a failure, how long past the deadline the worker still waits for in-flight work.
const SETTLE_GRACE: Duration = Duration::from_secs(5);

pub(super) struct SharedState {
    pub(super) layers: Vec<Option<Result<LayerStats, LayerError>>>,
    pub(super) result: Option<Result<StreamStats, LayerError>>,
    pub(super) ready_called: Vec<bool>,
    pub(super) dest_set: bool,
}

pub(super) struct Shared {
    pub(super) st: Mutex<SharedState>,
    pub(super) cv: Condvar,
}

pub(super) fn dup<T: Copy>(r: &Result<T, LayerError>) -> Result<T, LayerError> {
    match r {
        Ok(s) => Ok(*s),
        Err(e) => Err(e.duplicate()),
    }
}

pub(super) enum Msg {
    Ready(usize, Box<dyn Readiness>),
    Fired(usize, Result<(), String>),
    Dest(Vec<Vec<Extent>>),
    Staged {
        chunk: Chunk,
        lease: Lease,
        result: Result<(), String>,
    },
    Wake(u64),
    BufferFreed,
    Abort(String),
}

/// A piece of a layer that fits one staging buffer.
pub(super) struct Chunk {
    pub(super) layer: usize,
    pub(super) event: Option<u64>,
    pub(super) copies: Vec<StageCopy>,
    /// (buffer offset, destination, destination offset, len)
    pub(super) writes: Vec<(u64, RegionId, u64, u64)>,
}

pub(super) fn plan(
    layout: &KvLayout,
    src: &BlockLists,
    dst: &BlockLists,
) -> Result<Vec<Vec<Extent>>, LayerError> {
    let n = layout.num_layers();
    dst.check(n, "destination")?;
    (0..n)
        .map(|l| layout.layer_extents(l, src.layer(l), dst.layer(l)))
        .collect()
}

/// Cuts a layer's extents into chunks of at most `cap` bytes, packed in buffer order.
pub(super) fn chunk_layer(
    layer: usize,
    event: Option<u64>,
    extents: &[Extent],
    cap: u64,
) -> Vec<Chunk> {
    let mut out = Vec::new();
    let mut cur = Chunk {
        layer,
        event,
        copies: Vec::new(),
        writes: Vec::new(),
    };
    let mut fill = 0u64;
    for e in extents {
        let mut done = 0u64;
        while done < e.len {
            if fill == cap {
                out.push(std::mem::replace(
                    &mut cur,
                    Chunk {
                        layer,
                        event,
                        copies: Vec::new(),
                        writes: Vec::new(),
                    },
                ));
                fill = 0;
            }
            let n = (e.len - done).min(cap - fill);
            cur.copies.push(StageCopy {
                src: e.src,
                src_offset: e.src_offset + done,
                buf_offset: fill,
                len: n,
            });
            cur.writes.push((fill, e.dst, e.dst_offset + done, n));
            fill += n;
            done += n;
        }
    }
    if !cur.copies.is_empty() {
        out.push(cur);
    }
    out
}

#[derive(Default)]
pub(super) struct Slot {
    pub(super) fired: bool,
    pub(super) started: bool,
    pub(super) done: bool,
    pub(super) event: Option<u64>,
    /// Kept alive until the layer is done (it may own the CUDA event).
    pub(super) readiness: Option<Box<dyn Readiness>>,
    pub(super) outstanding: usize,
    pub(super) stats: LayerStats,
}

pub(super) struct InFlight {
    pub(super) batch: Batch,
    pub(super) layer: Option<usize>,
    pub(super) _lease: Option<Lease>,
}

pub(super) struct BatchWake {
    pub(super) key: u64,
    pub(super) tx: Sender<Msg>,
}

impl Wake for BatchWake {
    fn wake(self: Arc<Self>) {
        let _ = self.tx.send(Msg::Wake(self.key));
    }
}

pub(super) struct Worker {
    pub(super) engine: Engine,
    pub(super) peer: Peer,
    pub(super) tx: Sender<Msg>,
    pub(super) rx: Receiver<Msg>,
    pub(super) shared: Arc<Shared>,
    pub(super) deadline: Instant,
    pub(super) tag: Option<Vec<u8>>,
    pub(super) stager: Option<Arc<dyn Stager>>,
    pub(super) plans: Option<Vec<Vec<Extent>>>,
    pub(super) slots: Vec<Slot>,
    pub(super) queue: VecDeque<Chunk>,
    pub(super) inflight: HashMap<u64, InFlight>,
    pub(super) next_key: u64,
    pub(super) staging: usize,
    pub(super) waiting_buffer: bool,
    pub(super) failed: Option<LayerError>,
    pub(super) layers_done: usize,
    pub(super) tag_with_data: bool,
    pub(super) notify_posted: bool,
    pub(super) notify_done: bool,
    pub(super) stats: StreamStats,
}

impl Worker {
    pub(super) fn run(mut self) {
        let result = loop {
            if let Some(r) = self.finished() {
                break r;
            }
            let until = if self.failed.is_some() {
                self.deadline.max(Instant::now()) + SETTLE_GRACE
            } else {
                self.deadline
            };
            match self.rx.recv_deadline(until) {
                Ok(m) => self.handle(m),
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(e) = &self.failed {
                        // in-flight work did not settle in time; leases come back whenever
                        // their copies/batches end.
                        tracing::warn!(
                            inflight = self.inflight.len(),
                            staging = self.staging,
                            "layer stream gave up waiting for in-flight work"
                        );
                        break Err(e.duplicate());
                    }
                    self.fail(LayerError::Timeout);
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.fail(LayerError::State("stream channel closed".into()));
                    break Err(LayerError::State("stream channel closed".into()));
                }
            }
        };
        // release everything before reporting
        self.queue.clear();
        self.inflight.clear();
        for s in &mut self.slots {
            s.readiness = None;
        }
        let mut g = self.shared.st.lock();
        g.result = Some(result);
        drop(g);
        self.shared.cv.notify_all();
    }

    pub(super) fn finished(&self) -> Option<Result<StreamStats, LayerError>> {
        if let Some(e) = &self.failed {
            if self.inflight.is_empty() && self.staging == 0 {
                return Some(Err(e.duplicate()));
            }
            return None;
        }
        let all = self.layers_done == self.slots.len();
        if all && (self.tag.is_none() || self.tag_with_data || self.notify_done) {
            return Some(Ok(self.stats));
        }
        None
    }

    pub(super) fn remaining(&self) -> Duration {
        self.deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    }

    pub(super) fn handle(&mut self, m: Msg) {
        match m {
            Msg::Ready(l, r) => {
                if self.failed.is_some() {
                    return;
                }
                let ordered = self
                    .stager
                    .as_ref()
                    .is_some_and(|s| s.orders_after_events());
                match r.cuda_event() {
                    Some(ev) if ordered => {
                        let s = &mut self.slots[l];
                        s.event = Some(ev);
                        s.readiness = Some(r);
                        s.fired = true;
                        self.try_start(l);
                    }
                    _ => {
                        let tx = self.tx.clone();
                        r.notify(ReadySignal::new(move |res| {
                            let _ = tx.send(Msg::Fired(l, res));
                        }));
                    }
                }
            }
            Msg::Fired(l, res) => {
                if self.failed.is_some() {
                    return;
                }
                match res {
                    Ok(()) => {
                        self.slots[l].fired = true;
                        self.try_start(l);
                    }
                    Err(reason) => self.fail(LayerError::Readiness { layer: l, reason }),
                }
            }
            Msg::Dest(plans) => {
                if self.failed.is_some() {
                    return;
                }
                self.plans = Some(plans);
                for l in 0..self.slots.len() {
                    self.try_start(l);
                }
            }
            Msg::Staged {
                chunk,
                lease,
                result,
            } => {
                self.staging -= 1;
                if self.failed.is_some() {
                    return; // lease dropped here: back to the pool
                }
                match result {
                    Ok(()) => {
                        let region = lease.buffer().region;
                        let ops: Vec<Op> = chunk
                            .writes
                            .iter()
                            .map(|&(off, dst, doff, len)| Op {
                                local: region,
                                local_offset: off,
                                remote: dst,
                                remote_offset: doff,
                                len,
                            })
                            .collect();
                        self.post(Some(chunk.layer), &ops, Some(lease));
                    }
                    Err(reason) => {
                        drop(lease);
                        self.fail(LayerError::Staging {
                            layer: chunk.layer,
                            reason,
                        });
                    }
                }
            }
            Msg::Wake(key) => self.poll_batch(key),
            Msg::BufferFreed => {
                self.waiting_buffer = false;
                self.pump();
            }
            Msg::Abort(reason) => self.fail(LayerError::Aborted(reason)),
        }
    }

    pub(super) fn try_start(&mut self, l: usize) {
        if self.failed.is_some() {
            return;
        }
        let Some(plans) = self.plans.as_mut() else {
            return;
        };
        let s = &mut self.slots[l];
        if !s.fired || s.started {
            return;
        }
        s.started = true;
        let extents = std::mem::take(&mut plans[l]);
        if extents.is_empty() {
            self.layer_finished(l);
            return;
        }
        match self.stager.clone() {
            None => {
                let mut ops = Vec::with_capacity(extents.len());
                for e in &extents {
                    let SrcSpace::Region(h) = e.src else {
                        self.fail(LayerError::InvalidArgument(
                            "device source without a stager".into(),
                        ));
                        return;
                    };
                    ops.push(Op {
                        local: h,
                        local_offset: e.src_offset,
                        remote: e.dst,
                        remote_offset: e.dst_offset,
                        len: e.len,
                    });
                }
                self.slots[l].outstanding = 1;
                self.post(Some(l), &ops, None);
            }
            Some(st) => {
                let cap = st.pool().buffer_len();
                let chunks = chunk_layer(l, self.slots[l].event, &extents, cap);
                self.slots[l].outstanding = chunks.len();
                self.queue.extend(chunks);
                self.pump();
            }
        }
    }

    pub(super) fn pump(&mut self) {
        let Some(st) = self.stager.clone() else {
            return;
        };
        while !self.queue.is_empty() && self.failed.is_none() {
            let Some(lease) = st.pool().try_acquire() else {
                if !self.waiting_buffer {
                    self.waiting_buffer = true;
                    let tx = self.tx.clone();
                    st.pool().when_free(move || {
                        let _ = tx.send(Msg::BufferFreed);
                    });
                }
                return;
            };
            let Some(mut chunk) = self.queue.pop_front() else {
                return;
            };
            self.staging += 1;
            let copies = std::mem::take(&mut chunk.copies);
            let event = chunk.event;
            let tx = self.tx.clone();
            st.stage(
                event,
                copies,
                lease,
                Box::new(move |lease, result| {
                    let _ = tx.send(Msg::Staged {
                        chunk,
                        lease,
                        result,
                    });
                }),
            );
        }
    }

    /// Whether a batch posted now is the stream's last piece of work.
    pub(super) fn is_last_post(&self) -> bool {
        self.layers_done + 1 == self.slots.len()
            && self.slots.iter().all(|s| s.started)
            && self.queue.is_empty()
            && self.staging == 0
            && self.inflight.is_empty()
    }

    pub(super) fn post(&mut self, layer: Option<usize>, ops: &[Op], lease: Option<Lease>) {
        let tag = match (&self.tag, layer) {
            (Some(t), Some(_)) if self.is_last_post() => Some(t.as_slice()),
            (Some(t), None) => Some(t.as_slice()),
            _ => None,
        };
        match self
            .engine
            .write(&self.peer, ops, tag, Some(self.remaining()))
        {
            Ok(batch) => {
                if tag.is_some() && layer.is_some() {
                    self.tag_with_data = true;
                }
                let key = self.next_key;
                self.next_key += 1;
                self.inflight.insert(
                    key,
                    InFlight {
                        batch,
                        layer,
                        _lease: lease,
                    },
                );
                self.poll_batch(key);
            }
            Err(e) => {
                drop(lease);
                self.fail(LayerError::Engine(e));
            }
        }
    }

    pub(super) fn poll_batch(&mut self, key: u64) {
        let Some(f) = self.inflight.get_mut(&key) else {
            return;
        };
        let waker = Waker::from(Arc::new(BatchWake {
            key,
            tx: self.tx.clone(),
        }));
        let mut cx = Context::from_waker(&waker);
        let r = match Pin::new(&mut f.batch).poll(&mut cx) {
            Poll::Ready(r) => r,
            Poll::Pending => return,
        };
        let Some(f) = self.inflight.remove(&key) else {
            return;
        };
        let layer = f.layer;
        drop(f); // the lease (if any) goes back to the pool
        match r {
            Ok(bs) => self.batch_ok(layer, bs),
            Err(e) => self.fail(LayerError::Engine(e)),
        }
        self.pump();
    }

    pub(super) fn batch_ok(&mut self, layer: Option<usize>, bs: BatchStats) {
        let Some(l) = layer else {
            self.notify_done = true;
            return;
        };
        if self.failed.is_some() {
            return;
        }
        let s = &mut self.slots[l];
        s.stats.bytes += bs.bytes;
        s.stats.writes += bs.writes;
        s.stats.batches += 1;
        s.outstanding = s.outstanding.saturating_sub(1);
        if s.outstanding == 0 {
            self.layer_finished(l);
        }
    }

    pub(super) fn layer_finished(&mut self, l: usize) {
        let s = &mut self.slots[l];
        if s.done {
            return;
        }
        s.done = true;
        s.readiness = None;
        let ls = s.stats;
        self.stats.bytes += ls.bytes;
        self.stats.writes += ls.writes;
        self.stats.batches += ls.batches;
        self.layers_done += 1;
        {
            let mut g = self.shared.st.lock();
            g.layers[l] = Some(Ok(ls));
        }
        self.shared.cv.notify_all();
        if self.layers_done == self.slots.len()
            && self.tag.is_some()
            && !self.tag_with_data
            && !self.notify_posted
        {
            self.notify_posted = true;
            self.stats.separate_notify = true;
            self.post(None, &[], None);
        }
    }

    pub(super) fn fail(&mut self, e: LayerError) {
        if self.failed.is_some() {
            return;
        }
        tracing::debug!(error = %e, "layer stream failed");
        self.queue.clear();
        {
            let mut g = self.shared.st.lock();
            for (l, s) in self.slots.iter_mut().enumerate() {
                s.readiness = None;
                if !s.done {
                    g.layers[l] = Some(Err(e.duplicate()));
                }
            }
        }
        self.shared.cv.notify_all();
        self.failed = Some(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_respect_capacity_and_cover_everything() {
        let dst = RegionId {
            index: 1,
            generation: 1,
        };
        let ex = vec![
            Extent {
                src: SrcSpace::Device(0),
                src_offset: 0,
                dst,
                dst_offset: 1000,
                len: 250,
            },
            Extent {
                src: SrcSpace::Device(0),
                src_offset: 500,
                dst,
                dst_offset: 2000,
                len: 10,
            },
        ];
        let ch = chunk_layer(3, None, &ex, 100);
        assert_eq!(ch.len(), 3);
        let total: u64 = ch.iter().flat_map(|c| &c.copies).map(|c| c.len).sum();
        assert_eq!(total, 260);
        for c in &ch {
            assert!(c.copies.iter().map(|x| x.len).sum::<u64>() <= 100);
            assert_eq!(c.copies.len(), c.writes.len());
            for (cp, w) in c.copies.iter().zip(&c.writes) {
                assert_eq!(cp.buf_offset, w.0);
                assert_eq!(cp.len, w.3);
            }
        }
        assert_eq!(ch[2].writes.last(), Some(&(50, dst, 2000, 10)));
    }
}
