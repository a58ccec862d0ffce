//! [`LayerStream`]: the handle of a layer stream (its worker thread is in `worker`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};

use crate::engine::{Engine, Peer};
use crate::layer::error::LayerError;
use crate::layer::layout::{KvLayout, SrcSpace};
use crate::layer::readiness::Readiness;

use super::options::{BlockLists, LayerStats, StreamOptions, StreamStats};
use super::worker::{dup, plan, Msg, Shared, SharedState, Slot, Worker};

/// A request's KV cache, streamed layer by layer to one peer. See the module docs.
///
/// Dropping the handle before the stream finished aborts it.
pub struct LayerStream {
    tx: Sender<Msg>,
    shared: Arc<Shared>,
    layout: Arc<KvLayout>,
    src: BlockLists,
}

impl std::fmt::Debug for LayerStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerStream")
            .field("layers", &self.layout.num_layers())
            .field("done", &self.shared.st.lock().result.is_some())
            .finish()
    }
}

impl LayerStream {
    /// Opens a stream to `peer` for the blocks `src` (and `dst`, when already known) of
    /// `layout`, and starts its worker thread.
    pub fn open(
        engine: &Engine,
        peer: &Peer,
        layout: Arc<KvLayout>,
        src: BlockLists,
        dst: Option<BlockLists>,
        opts: StreamOptions,
    ) -> Result<LayerStream, LayerError> {
        let n = layout.num_layers();
        src.check(n, "source")?;
        let needs_stager = layout
            .src()
            .layers
            .iter()
            .flatten()
            .any(|(s, _)| matches!(s, SrcSpace::Device(_)));
        match &opts.stager {
            None if needs_stager => {
                return Err(LayerError::InvalidArgument(
                    "source in device memory needs a stager (or register it with the engine)"
                        .into(),
                ))
            }
            Some(st) => {
                if let Some((s, _)) = layout
                    .src()
                    .layers
                    .iter()
                    .flatten()
                    .find(|(s, _)| !st.can_read(*s))
                {
                    return Err(LayerError::InvalidArgument(format!(
                        "the stager cannot read {s:?}"
                    )));
                }
            }
            None => {}
        }
        if let Some(t) = &opts.tag {
            if t.len() > crate::wire::MAX_TAG as usize {
                return Err(LayerError::InvalidArgument(format!(
                    "tag of {} bytes is too long",
                    t.len()
                )));
            }
        }
        let plans = match &dst {
            Some(d) => Some(plan(&layout, &src, d)?),
            None => None,
        };
        let shared = Arc::new(Shared {
            st: Mutex::new(SharedState {
                layers: (0..n).map(|_| None).collect(),
                result: None,
                ready_called: vec![false; n],
                dest_set: plans.is_some(),
            }),
            cv: Condvar::new(),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = Worker {
            engine: engine.clone(),
            peer: peer.clone(),
            tx: tx.clone(),
            rx,
            shared: shared.clone(),
            deadline: Instant::now() + opts.deadline,
            tag: opts.tag,
            stager: opts.stager,
            plans,
            slots: (0..n).map(|_| Slot::default()).collect(),
            queue: VecDeque::new(),
            inflight: HashMap::new(),
            next_key: 0,
            staging: 0,
            waiting_buffer: false,
            failed: None,
            layers_done: 0,
            tag_with_data: false,
            notify_posted: false,
            notify_done: false,
            stats: StreamStats {
                layers: n,
                ..StreamStats::default()
            },
        };
        std::thread::Builder::new()
            .name("kvwire-layers".into())
            .spawn(move || worker.run())
            .map_err(|e| LayerError::Engine(crate::error::Error::Io(e)))?;
        Ok(LayerStream {
            tx,
            shared,
            layout,
            src,
        })
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layout.num_layers()
    }

    /// Layer `layer` is complete once `readiness` fires; it is sent then (or when the
    /// destination arrives, if later). Each layer once.
    pub fn layer_ready(&self, layer: usize, readiness: impl Readiness) -> Result<(), LayerError> {
        self.layer_ready_boxed(layer, Box::new(readiness))
    }

    /// [`LayerStream::layer_ready`] with a boxed readiness.
    pub fn layer_ready_boxed(
        &self,
        layer: usize,
        readiness: Box<dyn Readiness>,
    ) -> Result<(), LayerError> {
        {
            let mut g = self.shared.st.lock();
            if let Some(r) = &g.result {
                return Err(match r {
                    Ok(_) => LayerError::State("stream already finished".into()),
                    Err(e) => e.duplicate(),
                });
            }
            match g.ready_called.get_mut(layer) {
                None => {
                    return Err(LayerError::InvalidArgument(format!(
                        "layer {layer} out of range ({} layers)",
                        self.num_layers()
                    )))
                }
                Some(true) => {
                    return Err(LayerError::State(format!("layer {layer} made ready twice")))
                }
                Some(c) => *c = true,
            }
        }
        self.tx
            .send(Msg::Ready(layer, readiness))
            .map_err(|_| LayerError::State("stream worker is gone".into()))
    }

    /// The destination block ids (D's reservation), when they were not known at `open`.
    /// Checked against the layout at once; an error leaves the stream waiting for a valid
    /// destination.
    pub fn set_destination(&self, dst: BlockLists) -> Result<(), LayerError> {
        let plans = plan(&self.layout, &self.src, &dst)?;
        {
            let mut g = self.shared.st.lock();
            if g.dest_set {
                return Err(LayerError::State("destination already set".into()));
            }
            if let Some(Err(e)) = &g.result {
                return Err(e.duplicate());
            }
            g.dest_set = true;
        }
        self.tx
            .send(Msg::Dest(plans))
            .map_err(|_| LayerError::State("stream worker is gone".into()))
    }

    /// Aborts the stream: unsent layers are dropped, the stream and every unfinished layer
    /// fail with [`LayerError::Aborted`]; staging buffers go back once in-flight writes end.
    pub fn abort(&self, reason: &str) {
        let _ = self.tx.send(Msg::Abort(reason.to_string()));
    }

    /// Blocks until the stream finished (every layer landed and the target was notified, or
    /// it failed and released everything).
    pub fn wait(&self) -> Result<StreamStats, LayerError> {
        let mut g = self.shared.st.lock();
        loop {
            if let Some(r) = &g.result {
                return dup(r);
            }
            self.shared.cv.wait(&mut g);
        }
    }

    /// Waits at most `d`; `None` = still running.
    pub fn wait_timeout(&self, d: Duration) -> Option<Result<StreamStats, LayerError>> {
        let until = Instant::now() + d;
        let mut g = self.shared.st.lock();
        loop {
            if let Some(r) = &g.result {
                return Some(dup(r));
            }
            if self.shared.cv.wait_until(&mut g, until).timed_out() {
                return g.result.as_ref().map(dup);
            }
        }
    }

    /// Non-blocking: the stream's result if finished.
    pub fn poll(&self) -> Option<Result<StreamStats, LayerError>> {
        self.shared.st.lock().result.as_ref().map(dup)
    }

    /// Non-blocking: layer `layer`'s result if it finished (landed or failed).
    pub fn poll_layer(&self, layer: usize) -> Option<Result<LayerStats, LayerError>> {
        self.shared.st.lock().layers.get(layer)?.as_ref().map(dup)
    }

    /// Blocks until layer `layer` landed or failed, at most `d` (`None` = still running).
    pub fn wait_layer_timeout(
        &self,
        layer: usize,
        d: Duration,
    ) -> Option<Result<LayerStats, LayerError>> {
        let until = Instant::now() + d;
        let mut g = self.shared.st.lock();
        loop {
            match g.layers.get(layer) {
                None => {
                    return Some(Err(LayerError::InvalidArgument(format!(
                        "layer {layer} out of range"
                    ))));
                }
                Some(Some(r)) => return Some(dup(r)),
                Some(None) => {}
            }
            if self.shared.cv.wait_until(&mut g, until).timed_out() {
                return g.layers.get(layer).and_then(|r| r.as_ref().map(dup));
            }
        }
    }
}

impl Drop for LayerStream {
    fn drop(&mut self) {
        if self.shared.st.lock().result.is_none() {
            let _ = self.tx.send(Msg::Abort("stream handle dropped".into()));
        }
    }
}
