//! `kvwire.LayerStream`: a request's KV cache streamed layer by layer
//! ([`kvwire_transfer::layer`]), from host memory or from CUDA device memory staged through
//! pinned host buffers (`kvwire.CudaSource`, see [`crate::cuda`]).
//!
//! Both sides use the packed layout (`KvPlacement::packed`): every layer holds K and V of
//! `num_blocks` blocks of `block_bytes`, layers back to back from offset 0 of the source and of
//! the destination region. Python objects whose memory a stream reads (a `CudaSource` and the
//! tensor behind it, a `torch.cuda.Event`) are held by the stream's worker until it ended, so
//! they cannot be freed while a copy may still read them.
//!
//! Without a CUDA driver every CUDA entry point raises `kvwire.UnsupportedError`; no driver
//! call is made before `kvwire_transfer::cuda::context` checked that the driver loads.

use std::sync::Arc;
use std::time::Duration;

use kvwire_transfer::cuda::CudaStager;
use kvwire_transfer::layer::{
    BlockLists, Immediate, KvLayout, KvOrder, KvPlacement, LayerStats, LayerStream, Readiness,
    SrcSpace, Stager, StreamOptions, StreamStats,
};
use kvwire_transfer::RegionId;
use pyo3::prelude::*;

use crate::cuda::{HeldStager, PyCudaSource, PyCudaStager};
use crate::engine::{remote_id, secs, PyEngine, PyPeer, PyRegion, PyRemoteRegion};
use crate::errors::{invalid, layer_to_py, OutOfBoundsError, TimeoutError};

/// What one layer sent.
#[pyclass(name = "LayerStats", module = "kvwire", frozen, get_all)]
#[derive(Clone)]
pub struct PyLayerStats {
    /// Payload bytes.
    pub bytes: u64,
    /// Writes after coalescing.
    pub writes: usize,
    /// Batches (one per layer from host memory; one per staged chunk from device memory).
    pub batches: usize,
}

impl From<LayerStats> for PyLayerStats {
    fn from(s: LayerStats) -> Self {
        PyLayerStats {
            bytes: s.bytes,
            writes: s.writes,
            batches: s.batches,
        }
    }
}

#[pymethods]
impl PyLayerStats {
    fn __repr__(&self) -> String {
        format!(
            "LayerStats(bytes={}, writes={}, batches={})",
            self.bytes, self.writes, self.batches
        )
    }
}

/// What a finished stream sent.
#[pyclass(name = "StreamStats", module = "kvwire", frozen, get_all)]
#[derive(Clone)]
pub struct PyStreamStats {
    /// Payload bytes, all layers.
    pub bytes: u64,
    /// Writes after coalescing, all layers.
    pub writes: usize,
    /// Data batches, all layers.
    pub batches: usize,
    /// Per layer, in layer order.
    pub layers: Vec<PyLayerStats>,
    /// Whether the notification went in a batch of its own.
    pub separate_notify: bool,
}

#[pymethods]
impl PyStreamStats {
    fn __repr__(&self) -> String {
        format!(
            "StreamStats(bytes={}, writes={}, batches={}, layers={}, separate_notify={})",
            self.bytes,
            self.writes,
            self.batches,
            self.layers.len(),
            if self.separate_notify {
                "True"
            } else {
                "False"
            }
        )
    }
}

/// A request's KV cache sent layer by layer to one peer (`Engine.layer_stream`).
///
/// Call `layer_ready(layer)` as each layer's compute finishes (in any order, each layer once);
/// a layer goes out as soon as it is ready and the destination blocks are known
/// (`set_destination`, when they were not given at open). The notification tag reaches the
/// peer once, after every layer landed. `wait()` returns the `StreamStats`; a failure (abort,
/// deadline, dead peer...) is raised from `wait`/`poll` once nothing is in flight any more.
/// Dropping the stream before it finished aborts it.
#[pyclass(name = "LayerStream", module = "kvwire", frozen)]
pub struct PyLayerStream {
    stream: LayerStream,
    /// For CUDA readiness (`cuda_event=`/`cuda_stream=`): the context and event waiter.
    cuda: Option<Arc<CudaStager>>,
    /// The source (Region or CudaSource), held while the handle lives.
    _src: Py<PyAny>,
}

impl PyLayerStream {
    fn stats(&self, s: StreamStats) -> PyResult<PyStreamStats> {
        let mut layers = Vec::with_capacity(s.layers);
        for l in 0..s.layers {
            match self.stream.poll_layer(l) {
                Some(Ok(ls)) => layers.push(ls.into()),
                Some(Err(e)) => return Err(layer_to_py(e)),
                None => return Err(invalid(format!("layer {l} has no result"))),
            }
        }
        Ok(PyStreamStats {
            bytes: s.bytes,
            writes: s.writes,
            batches: s.batches,
            layers,
            separate_notify: s.separate_notify,
        })
    }
}

#[pymethods]
impl PyLayerStream {
    /// Number of layers.
    #[getter]
    fn num_layers(&self) -> usize {
        self.stream.num_layers()
    }

    /// Marks layer `layer` complete. With no CUDA argument it is ready now. With
    /// `cuda_stream` (a raw `CUstream` int such as `torch.cuda.current_stream().cuda_stream`,
    /// or the `torch.cuda.Stream` itself) an event is recorded on that stream now: the layer
    /// goes out once the work queued so far on it is done. With `cuda_event` (a raw `CUevent`
    /// int from `torch.cuda.Event().cuda_event`, or the `torch.cuda.Event`, which is then kept
    /// alive), the layer goes out once that already-recorded event completed. CUDA arguments
    /// need a `CudaSource` or `stager=` at open; from device memory the copy is ordered after
    /// the event on the device, the host never waits for the layer.
    #[pyo3(signature = (layer, cuda_event=None, cuda_stream=None))]
    fn layer_ready(
        &self,
        layer: usize,
        cuda_event: Option<&Bound<'_, PyAny>>,
        cuda_stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let readiness: Box<dyn Readiness> = match (cuda_event, cuda_stream) {
            (None, None) => Box::new(Immediate),
            (Some(_), Some(_)) => {
                return Err(invalid("pass cuda_event or cuda_stream, not both"));
            }
            (ev, st) => {
                let Some(stager) = &self.cuda else {
                    return Err(invalid(
                        "cuda_event/cuda_stream need a CudaSource as src or stager= at open",
                    ));
                };
                if layer >= self.stream.num_layers() {
                    return Err(invalid(format!(
                        "layer {layer} out of range ({} layers)",
                        self.stream.num_layers()
                    )));
                }
                crate::cuda::readiness(stager, ev, st)?
            }
        };
        self.stream
            .layer_ready_boxed(layer, readiness)
            .map_err(layer_to_py)
    }

    /// The destination block ids, when not given at open: one list for every layer or one
    /// list per layer, each as long as the matching source list. Raises on a bad list (the
    /// stream keeps waiting for a valid one) or if the destination was already set.
    fn set_destination(&self, dst_blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let d = parse_blocks(dst_blocks, "dst_blocks")?;
        self.stream.set_destination(d).map_err(layer_to_py)
    }

    /// Blocks (GIL released) until every layer landed and the peer was notified; returns the
    /// `StreamStats`. With `timeout` (seconds), raises `kvwire.TimeoutError` if it is still
    /// running then (the stream goes on). Raises the stream's error if it failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyStreamStats> {
        let r = match timeout {
            None => py.detach(|| self.stream.wait()),
            Some(t) => {
                let d = secs("timeout", t)?;
                match py.detach(|| self.stream.wait_timeout(d)) {
                    Some(r) => r,
                    None => {
                        return Err(TimeoutError::new_err(format!(
                            "layer stream still running after {t} s"
                        )))
                    }
                }
            }
        };
        let s = r.map_err(layer_to_py)?;
        self.stats(s)
    }

    /// Blocks (GIL released) until layer `layer` landed; returns its `LayerStats`. Raises
    /// `kvwire.TimeoutError` after `timeout` seconds, or the layer's error.
    #[pyo3(signature = (layer, timeout=None))]
    fn wait_layer(
        &self,
        py: Python<'_>,
        layer: usize,
        timeout: Option<f64>,
    ) -> PyResult<PyLayerStats> {
        let r = match timeout {
            None => py.detach(|| loop {
                if let Some(r) = self
                    .stream
                    .wait_layer_timeout(layer, Duration::from_secs(3600))
                {
                    return r;
                }
            }),
            Some(t) => {
                let d = secs("timeout", t)?;
                match py.detach(|| self.stream.wait_layer_timeout(layer, d)) {
                    Some(r) => r,
                    None => {
                        return Err(TimeoutError::new_err(format!(
                            "layer {layer} still in flight after {t} s"
                        )))
                    }
                }
            }
        };
        r.map(Into::into).map_err(layer_to_py)
    }

    /// Non-blocking: `None` while running, the `StreamStats` when done; raises if it failed.
    fn poll(&self) -> PyResult<Option<PyStreamStats>> {
        match self.stream.poll() {
            None => Ok(None),
            Some(r) => self.stats(r.map_err(layer_to_py)?).map(Some),
        }
    }

    /// Whether the stream finished (successfully or not).
    #[getter]
    fn done(&self) -> bool {
        self.stream.poll().is_some()
    }

    /// Aborts the stream: layers not yet sent are dropped, `wait` raises `AbortedError` (once
    /// writes already in flight ended) and no notification is sent.
    #[pyo3(signature = (reason="aborted"))]
    fn abort(&self, reason: &str) {
        self.stream.abort(reason);
    }

    fn __repr__(&self) -> String {
        format!(
            "LayerStream(num_layers={}, done={})",
            self.stream.num_layers(),
            if self.done() { "True" } else { "False" }
        )
    }
}

/// Parses one list of block ids (for every layer) or one list per layer.
fn parse_blocks(ob: &Bound<'_, PyAny>, what: &str) -> PyResult<BlockLists> {
    if let Ok(v) = ob.extract::<Vec<u32>>() {
        return Ok(BlockLists::Shared(v));
    }
    if let Ok(v) = ob.extract::<Vec<Vec<u32>>>() {
        return Ok(BlockLists::PerLayer(v));
    }
    Err(invalid(format!(
        "{what} must be a list of block ids (ints in 0..2**32), or one such list per layer"
    )))
}

fn parse_order(s: &str) -> PyResult<KvOrder> {
    match s.to_ascii_lowercase().replace('-', "_").as_str() {
        "kv_major" => Ok(KvOrder::KvMajor),
        "block_major" => Ok(KvOrder::BlockMajor),
        other => Err(invalid(format!(
            "unknown order {other:?} (kv_major, block_major)"
        ))),
    }
}

fn too_small(what: &str, len: u64, need: u64) -> PyErr {
    OutOfBoundsError::new_err(format!(
        "{what} of {len} bytes is smaller than the layout ({need} bytes)"
    ))
}

/// The arguments of `Engine.layer_stream` (see its docs).
pub(crate) struct OpenArgs<'a, 'py> {
    pub peer: &'a Bound<'py, PyPeer>,
    pub src: &'a Bound<'py, PyAny>,
    pub dst_region: &'a Bound<'py, PyAny>,
    pub num_layers: usize,
    pub num_blocks: u32,
    pub block_bytes: u64,
    pub order: &'a str,
    pub src_blocks: &'a Bound<'py, PyAny>,
    pub dst_blocks: Option<&'a Bound<'py, PyAny>>,
    pub notify: Option<Vec<u8>>,
    pub deadline: Option<f64>,
    pub stager: Option<&'a Bound<'py, PyCudaStager>>,
}

/// `Engine.layer_stream`.
pub(crate) fn open(engine: &Bound<'_, PyEngine>, a: OpenArgs<'_, '_>) -> PyResult<PyLayerStream> {
    let order = parse_order(a.order)?;
    if a.num_layers == 0 {
        return Err(invalid("num_layers must be >= 1"));
    }
    if a.block_bytes == 0 {
        return Err(invalid("block_bytes must be >= 1"));
    }
    let need = KvPlacement::<SrcSpace>::packed_len(a.num_layers, a.num_blocks, a.block_bytes)
        .ok_or_else(|| invalid("layout size overflows 64 bits"))?;

    // The source and, for device memory, its stager.
    let (space, src_stager) = if let Ok(r) = a.src.cast::<PyRegion>() {
        let r = r.get();
        if r.len < need {
            return Err(too_small("source region", r.len, need));
        }
        (SrcSpace::Region(r.handle), None)
    } else if let Ok(c) = a.src.cast::<PyCudaSource>() {
        let c = c.get();
        if c.len < need {
            return Err(too_small("CUDA source", c.len, need));
        }
        (c.space, Some(c.stager.bind(a.src.py()).clone()))
    } else {
        return Err(invalid(
            "src must be a kvwire.Region (host memory) or a kvwire.CudaSource",
        ));
    };
    let stager = match (src_stager, a.stager) {
        (Some(s), Some(k)) if !s.is(k) => {
            return Err(invalid(
                "stager= differs from the stager the CudaSource was registered with",
            ))
        }
        (Some(s), _) => Some(s),
        (None, k) => k.cloned(),
    };
    if let Some(s) = &stager {
        if !s.get().engine.bind(a.src.py()).is(engine) {
            return Err(invalid(
                "the CudaStager belongs to another Engine (its staging buffers are registered there)",
            ));
        }
    }

    // The destination region.
    let dst: RegionId = remote_id(a.dst_region)?;
    let dst_len = if let Ok(r) = a.dst_region.cast::<PyRemoteRegion>() {
        Some(r.get().len)
    } else if let Ok(r) = a.dst_region.cast::<PyRegion>() {
        Some(r.get().len)
    } else {
        None
    };
    if let Some(len) = dst_len {
        if len < need {
            return Err(too_small("destination region", len, need));
        }
    }

    let src_place = KvPlacement::packed(space, 0, a.num_layers, a.num_blocks, a.block_bytes, order)
        .map_err(layer_to_py)?;
    let dst_place = KvPlacement::packed(dst, 0, a.num_layers, a.num_blocks, a.block_bytes, order)
        .map_err(layer_to_py)?;
    let layout = KvLayout::new(src_place, dst_place, a.block_bytes).map_err(layer_to_py)?;

    let src_lists = parse_blocks(a.src_blocks, "src_blocks")?;
    let bad = match &src_lists {
        BlockLists::Shared(v) => v.iter().find(|&&b| b >= a.num_blocks),
        BlockLists::PerLayer(v) => v.iter().flatten().find(|&&b| b >= a.num_blocks),
    };
    if let Some(b) = bad {
        return Err(invalid(format!(
            "source block {b} out of range ({} blocks)",
            a.num_blocks
        )));
    }
    let dst_lists = a
        .dst_blocks
        .map(|d| parse_blocks(d, "dst_blocks"))
        .transpose()?;
    let deadline = a
        .deadline
        .map(|d| secs("deadline", d))
        .transpose()?
        .unwrap_or(StreamOptions::default().deadline);

    let cuda = stager.as_ref().map(|s| s.get().stager.clone());
    let stream_stager: Option<Arc<dyn Stager>> = match space {
        SrcSpace::Device(_) => cuda.clone().map(|inner| {
            Arc::new(HeldStager {
                inner,
                _hold: a.src.clone().unbind(),
            }) as Arc<dyn Stager>
        }),
        SrcSpace::Region(_) => None,
    };
    let opts = StreamOptions {
        tag: a.notify,
        deadline,
        stager: stream_stager,
    };
    let stream = LayerStream::open(
        &engine.get().engine,
        &a.peer.get().peer,
        Arc::new(layout),
        src_lists,
        dst_lists,
        opts,
    )
    .map_err(layer_to_py)?;
    Ok(PyLayerStream {
        stream,
        cuda,
        _src: a.src.clone().unbind(),
    })
}

/// Adds the classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLayerStream>()?;
    m.add_class::<PyLayerStats>()?;
    m.add_class::<PyStreamStats>()?;
    m.add_class::<PyCudaStager>()?;
    m.add_class::<PyCudaSource>()?;
    Ok(())
}
