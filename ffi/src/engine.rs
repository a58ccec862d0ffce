//! `kvwire.Engine` and its companions (`Region`, `RemoteRegion`, `Peer`, `Batch`,
//! `BatchStats`, `Notification`): a Pythonic shell over [`kvwire_transfer::Engine`].
//!
//! Every call that can block (connect, wait, receiving a notification) releases the GIL.

use std::net::SocketAddr;
use std::time::Duration;

use kvwire_transfer::{
    Access, Batch, BatchStats, Engine, EngineConfig, Op, Peer, RegionHandle, RegionId,
    RemoteRegion, TransportKind,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{invalid, to_py, TimeoutError};
use crate::rawmem;

/// Parses an access name: `"rw"`, `"wo"`, `"ro"`, `"local"` (long forms accepted).
pub fn parse_access(s: &str) -> PyResult<Access> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "rw" | "readwrite" | "read_write" => Access::ReadWrite,
        "wo" | "w" | "write" | "writeonly" | "write_only" => Access::WriteOnly,
        "ro" | "r" | "read" | "readonly" | "read_only" => Access::ReadOnly,
        "local" => Access::Local,
        other => {
            return Err(invalid(format!(
                "unknown access {other:?} (rw, wo, ro, local)"
            )))
        }
    })
}

/// Name of an access mode as Python sees it.
pub fn access_name(a: Access) -> &'static str {
    match a {
        Access::ReadWrite => "rw",
        Access::WriteOnly => "wo",
        Access::ReadOnly => "ro",
        Access::Local => "local",
    }
}

/// Parses a transport name: `"auto"`, `"tcp"`, `"shm"`, `"rdma"`, `"cuda_ipc"`.
pub fn parse_transport(s: &str) -> PyResult<TransportKind> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "auto" => TransportKind::Auto,
        "tcp" => TransportKind::Tcp,
        "shm" => TransportKind::Shm,
        "rdma" => TransportKind::Rdma,
        "cuda_ipc" => TransportKind::CudaIpc,
        other => {
            return Err(invalid(format!(
                "unknown transport {other:?} (auto, tcp, shm, rdma, cuda_ipc)"
            )))
        }
    })
}

/// Name of a transport as Python sees it.
pub fn transport_name(t: TransportKind) -> &'static str {
    match t {
        TransportKind::Auto => "auto",
        TransportKind::Tcp => "tcp",
        TransportKind::Shm => "shm",
        TransportKind::Rdma => "rdma",
        TransportKind::CudaIpc => "cuda_ipc",
        #[allow(unreachable_patterns)]
        _ => "other",
    }
}

/// Resolves `"host:port"` into a socket address (names resolved, first address taken).
pub fn resolve_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    use std::net::ToSocketAddrs;
    s.to_socket_addrs()
        .map_err(|e| format!("bad address {s:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("address {s:?} resolves to nothing"))
}

/// [`resolve_addr`] with a Python error.
pub fn parse_addr(s: &str) -> PyResult<SocketAddr> {
    resolve_addr(s).map_err(invalid)
}

/// Converts seconds (a Python float) into a duration, refusing negatives and NaN.
pub fn secs(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| {
        invalid(format!(
            "{what} must be a finite number of seconds >= 0, got {s}"
        ))
    })
}

/// A region registered with (or allocated by) a local engine.
#[pyclass(name = "Region", module = "kvwire", frozen)]
#[derive(Clone)]
pub struct PyRegion {
    pub(crate) handle: RegionHandle,
    /// Length in bytes.
    #[pyo3(get)]
    pub len: u64,
    /// Address of caller memory registered with `Engine.register` (None for `Engine.alloc`).
    #[pyo3(get)]
    pub addr: Option<u64>,
    /// Access granted to peers.
    #[pyo3(get)]
    pub access: &'static str,
}

#[pymethods]
impl PyRegion {
    /// The region's slot index (as peers see it).
    #[getter]
    fn index(&self) -> u32 {
        self.handle.id().index
    }
    /// The region's generation (as peers see it).
    #[getter]
    fn generation(&self) -> u32 {
        self.handle.id().generation
    }
    /// `(index, generation)`: the id peers use to name this region.
    #[getter]
    fn id(&self) -> (u32, u32) {
        (self.handle.id().index, self.handle.id().generation)
    }
    fn __repr__(&self) -> String {
        let id = self.handle.id();
        format!(
            "Region(index={}, generation={}, len={}, access={:?})",
            id.index, id.generation, self.len, self.access
        )
    }
}

/// A region a peer offers.
#[pyclass(name = "RemoteRegion", module = "kvwire", frozen)]
#[derive(Clone)]
pub struct PyRemoteRegion {
    /// Slot index on the remote engine.
    #[pyo3(get)]
    pub index: u32,
    /// Generation on the remote engine.
    #[pyo3(get)]
    pub generation: u32,
    /// Length in bytes.
    #[pyo3(get)]
    pub len: u64,
    /// What we may do with it: `"rw"`, `"wo"`, `"ro"`.
    #[pyo3(get)]
    pub access: &'static str,
}

impl From<RemoteRegion> for PyRemoteRegion {
    fn from(r: RemoteRegion) -> Self {
        PyRemoteRegion {
            index: r.id.index,
            generation: r.id.generation,
            len: r.len,
            access: access_name(r.access),
        }
    }
}

#[pymethods]
impl PyRemoteRegion {
    /// `(index, generation)`.
    #[getter]
    fn id(&self) -> (u32, u32) {
        (self.index, self.generation)
    }
    fn __repr__(&self) -> String {
        format!(
            "RemoteRegion(index={}, generation={}, len={}, access={:?})",
            self.index, self.generation, self.len, self.access
        )
    }
}

/// Extracts a remote region id from a `RemoteRegion`, a `Region` or an `(index, generation)`.
pub(crate) fn remote_id(ob: &Bound<'_, PyAny>) -> PyResult<RegionId> {
    if let Ok(r) = ob.cast::<PyRemoteRegion>() {
        let r = r.get();
        return Ok(RegionId {
            index: r.index,
            generation: r.generation,
        });
    }
    if let Ok(r) = ob.cast::<PyRegion>() {
        return Ok(r.get().handle.id());
    }
    let (index, generation): (u32, u32) = ob.extract().map_err(|_| {
        invalid("remote region must be a RemoteRegion, a Region or an (index, generation) tuple")
    })?;
    Ok(RegionId { index, generation })
}

/// Parses a list of `(local_region, local_offset, remote_region, remote_offset, length)`.
fn parse_ops(ops: &Bound<'_, PyAny>) -> PyResult<Vec<Op>> {
    let mut out = Vec::new();
    for item in ops.try_iter()? {
        let item = item?;
        let t: (Bound<'_, PyAny>, u64, Bound<'_, PyAny>, u64, u64) = item.extract().map_err(|_| {
            invalid("each op must be a tuple (local_region, local_offset, remote_region, remote_offset, length)")
        })?;
        let local =
            t.0.cast::<PyRegion>()
                .map_err(|_| invalid("an op's local region must be a kvwire.Region"))?
                .get()
                .handle;
        out.push(Op {
            local,
            local_offset: t.1,
            remote: remote_id(&t.2)?,
            remote_offset: t.3,
            len: t.4,
        });
    }
    Ok(out)
}

/// A connected peer.
#[pyclass(name = "Peer", module = "kvwire", frozen)]
pub struct PyPeer {
    pub(crate) peer: Peer,
}

#[pymethods]
impl PyPeer {
    /// The peer's id within our engine.
    #[getter]
    fn id(&self) -> u64 {
        self.peer.id().0
    }
    /// The transport chosen: `"tcp"` or `"shm"`.
    #[getter]
    fn transport(&self) -> &'static str {
        transport_name(self.peer.transport())
    }
    /// The peer's control-connection address, `"host:port"`.
    #[getter]
    fn remote_addr(&self) -> String {
        self.peer.remote_addr().to_string()
    }
    /// Whether the connection is still up.
    #[getter]
    fn alive(&self) -> bool {
        self.peer.is_alive()
    }
    /// Regions the peer offers to us (kept current).
    fn regions(&self) -> Vec<PyRemoteRegion> {
        self.peer.regions().into_iter().map(Into::into).collect()
    }
    fn __repr__(&self) -> String {
        format!(
            "Peer(id={}, transport={:?}, remote_addr={:?})",
            self.id(),
            self.transport(),
            self.remote_addr()
        )
    }
}

/// What a completed batch did.
#[pyclass(name = "BatchStats", module = "kvwire", frozen, get_all)]
#[derive(Clone)]
pub struct PyBatchStats {
    /// Payload bytes.
    pub bytes: u64,
    /// Ops submitted.
    pub ops: usize,
    /// Transfers after coalescing.
    pub writes: usize,
    /// Wire slices.
    pub slices: usize,
    /// Transport used.
    pub transport: &'static str,
}

impl From<BatchStats> for PyBatchStats {
    fn from(s: BatchStats) -> Self {
        PyBatchStats {
            bytes: s.bytes,
            ops: s.ops,
            writes: s.writes,
            slices: s.slices,
            transport: transport_name(s.transport),
        }
    }
}

#[pymethods]
impl PyBatchStats {
    fn __repr__(&self) -> String {
        format!(
            "BatchStats(bytes={}, ops={}, writes={}, slices={}, transport={:?})",
            self.bytes, self.ops, self.writes, self.slices, self.transport
        )
    }
}

/// The completion handle of one batch.
#[pyclass(name = "Batch", module = "kvwire", frozen)]
pub struct PyBatch {
    pub(crate) batch: Batch,
}

#[pymethods]
impl PyBatch {
    /// Blocks (GIL released) until the batch completes. With `timeout` (seconds), raises
    /// `kvwire.TimeoutError` if it is still running then; without, waits up to the batch's own
    /// deadline. Raises the batch's error if it failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyBatchStats> {
        match timeout {
            None => py
                .detach(|| self.batch.wait())
                .map(Into::into)
                .map_err(to_py),
            Some(t) => {
                let d = secs("timeout", t)?;
                match py.detach(|| self.batch.wait_timeout(d)) {
                    None => Err(TimeoutError::new_err(format!(
                        "batch still running after {t} s"
                    ))),
                    Some(r) => r.map(Into::into).map_err(to_py),
                }
            }
        }
    }
    /// Non-blocking: `None` while running, the stats when done; raises if it failed.
    fn poll(&self) -> PyResult<Option<PyBatchStats>> {
        match self.batch.poll() {
            None => Ok(None),
            Some(r) => r.map(|s| Some(s.into())).map_err(to_py),
        }
    }
    /// Whether the batch has completed (successfully or not).
    #[getter]
    fn done(&self) -> bool {
        self.batch.poll().is_some()
    }
}

/// A notification delivered to this engine.
#[pyclass(name = "Notification", module = "kvwire", frozen, get_all)]
pub struct PyNotification {
    /// Id of the sending peer (as this engine numbers it).
    pub peer: u64,
    /// The tag.
    pub tag: Py<PyBytes>,
}

#[pymethods]
impl PyNotification {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Notification(peer={}, tag={:?})",
            self.peer,
            self.tag.as_bytes(py)
        )
    }
}

/// A kvwire transfer engine.
///
/// `Engine(listen="127.0.0.1:0", secret=None, transport="auto", lanes=4, slice_size=1 MiB,
/// deadline=10.0, connect_timeout=5.0, rdma_near=None)`; `rdma_near` is the PCI address of the
/// device whose memory the engine moves (its GPU): RDMA then uses the NICs nearest it.
#[pyclass(name = "Engine", module = "kvwire", frozen)]
pub struct PyEngine {
    pub(crate) engine: Engine,
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (listen="127.0.0.1:0", secret=None, transport="auto", lanes=None, slice_size=None, deadline=None, connect_timeout=None, rdma_near=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        secret: Option<Vec<u8>>,
        transport: &str,
        lanes: Option<usize>,
        slice_size: Option<usize>,
        deadline: Option<f64>,
        connect_timeout: Option<f64>,
        rdma_near: Option<String>,
    ) -> PyResult<Self> {
        let mut cfg = EngineConfig {
            listen: parse_addr(listen)?,
            secret,
            transport: parse_transport(transport)?,
            // The KVWIRE_* knobs of the environment apply to engines made from Python.
            ..EngineConfig::from_env()
        };
        if let Some(l) = lanes {
            if l == 0 {
                return Err(invalid("lanes must be >= 1"));
            }
            cfg.lanes = l;
        }
        if let Some(s) = slice_size {
            if s == 0 {
                return Err(invalid("slice_size must be >= 1"));
            }
            cfg.slice_size = s;
        }
        if let Some(d) = deadline {
            cfg.default_deadline = secs("deadline", d)?;
        }
        if let Some(d) = connect_timeout {
            cfg.connect_timeout = secs("connect_timeout", d)?;
        }
        if let Some(n) = rdma_near {
            cfg.rdma_near = Some(n);
        }
        let engine = py.detach(|| Engine::new(cfg)).map_err(to_py)?;
        Ok(PyEngine { engine })
    }

    /// The bound listen address, `"host:port"`.
    #[getter]
    fn listen_addr(&self) -> String {
        self.engine.listen_addr().to_string()
    }

    /// The bound listen port.
    #[getter]
    fn port(&self) -> u16 {
        self.engine.listen_addr().port()
    }

    /// Allocates an engine-owned, zeroed region of `length` bytes.
    #[pyo3(signature = (length, access="rw"))]
    fn alloc(&self, length: usize, access: &str) -> PyResult<PyRegion> {
        let a = parse_access(access)?;
        let handle = self.engine.alloc_region(length, a).map_err(to_py)?;
        Ok(PyRegion {
            handle,
            len: length as u64,
            addr: None,
            access: access_name(a),
        })
    }

    /// Registers caller memory `[addr, addr+length)` (e.g. a CPU tensor's `data_ptr()`).
    /// The range must be mapped read+write in this process (checked); the caller keeps it alive
    /// until `unregister`. `pinned`: the memory is pinned by the CUDA driver (the metrics count
    /// it as `pinned`, not `host`).
    #[pyo3(signature = (addr, length, access="rw", pinned=false))]
    fn register(&self, addr: u64, length: u64, access: &str, pinned: bool) -> PyResult<PyRegion> {
        let a = parse_access(access)?;
        let handle = rawmem::register(&self.engine, addr, length, a, pinned).map_err(to_py)?;
        Ok(PyRegion {
            handle,
            len: length,
            addr: Some(addr),
            access: access_name(a),
        })
    }

    /// Registers `length` bytes of CUDA device memory at `addr` on device `device` (a CUDA
    /// tensor's `data_ptr()`), for same-host peers whose engines use the `cuda_ipc` transport:
    /// their writes and reads of it run on the GPU's copy engines. The memory must lie in one
    /// `cudaMalloc` allocation (PyTorch's caching allocator without expandable segments) and
    /// stay allocated until the region is unregistered. Host copies of it (`local_read`,
    /// tcp and shm peers) are refused.
    #[pyo3(signature = (addr, length, access="rw", device=0))]
    fn register_device(
        &self,
        addr: u64,
        length: u64,
        access: &str,
        device: usize,
    ) -> PyResult<PyRegion> {
        let a = parse_access(access)?;
        let handle = crate::cuda::register_device_region(&self.engine, addr, length, a, device)?;
        Ok(PyRegion {
            handle,
            len: length,
            addr: Some(addr),
            access: access_name(a),
        })
    }

    /// Unregisters a region; its id becomes stale for every peer.
    fn unregister(&self, region: &Bound<'_, PyRegion>) -> PyResult<()> {
        self.engine.unregister(region.get().handle).map_err(to_py)
    }

    /// Copies `data` into a local region at `offset`.
    fn local_write(&self, region: &Bound<'_, PyRegion>, offset: u64, data: &[u8]) -> PyResult<()> {
        self.engine
            .local_write(region.get().handle, offset, data)
            .map_err(to_py)
    }

    /// Reads `length` bytes of a local region at `offset`.
    fn local_read<'py>(
        &self,
        py: Python<'py>,
        region: &Bound<'_, PyRegion>,
        offset: u64,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let r = region.get();
        if (length as u64) > r.len {
            // Refused before allocating: a huge length must not exhaust memory.
            return Err(to_py(kvwire_transfer::Error::OutOfBounds {
                region: r.handle.id(),
                offset,
                len: length as u64,
                region_len: r.len,
            }));
        }
        let mut buf = vec![0u8; length];
        self.engine
            .local_read(region.get().handle, offset, &mut buf)
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &buf))
    }

    /// Connects to the engine listening at `"host:port"` (GIL released).
    fn connect(&self, py: Python<'_>, addr: &str) -> PyResult<PyPeer> {
        let a = parse_addr(addr)?;
        let peer = py.detach(|| self.engine.connect(a)).map_err(to_py)?;
        Ok(PyPeer { peer })
    }

    /// Fences the peer engine listening at `"host:port"` (as it announced itself): closes every
    /// connection between it and this engine, refuses its process's handshakes and lane joins
    /// from then on (`FencedError`; a restarted peer there is another process and is accepted),
    /// and returns once none of its copies into this engine's memory is
    /// still running (GIL released). See `kvwire_transfer::Engine::fence`.
    fn fence(&self, py: Python<'_>, addr: &str) -> PyResult<()> {
        let a = parse_addr(addr)?;
        py.detach(|| self.engine.fence(a)).map_err(to_py)
    }

    /// Lifts the fence of `"host:port"` (a new incarnation of the peer is accepted again);
    /// returns whether it was fenced.
    fn unfence(&self, addr: &str) -> PyResult<bool> {
        Ok(self.engine.unfence(parse_addr(addr)?))
    }

    /// Every connected peer (inbound ones included).
    fn peers(&self) -> Vec<PyPeer> {
        self.engine
            .peers()
            .into_iter()
            .map(|peer| PyPeer { peer })
            .collect()
    }

    /// Submits a batch of writes. `ops`: list of `(local_region, local_offset, remote_region,
    /// remote_offset, length)`; `notify`: a tag delivered to the peer after every byte landed;
    /// `deadline`: seconds (engine default when None). Returns a `Batch`.
    #[pyo3(signature = (peer, ops, notify=None, deadline=None))]
    fn write(
        &self,
        peer: &Bound<'_, PyPeer>,
        ops: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
        deadline: Option<f64>,
    ) -> PyResult<PyBatch> {
        let ops = parse_ops(ops)?;
        let d = deadline.map(|d| secs("deadline", d)).transpose()?;
        let batch = self
            .engine
            .write(&peer.get().peer, &ops, notify.as_deref(), d)
            .map_err(to_py)?;
        Ok(PyBatch { batch })
    }

    /// Opens a layer stream to `peer`: a request's KV cache sent layer by layer, each layer as
    /// soon as `LayerStream.layer_ready(layer)` says it is complete.
    ///
    /// Layout (both sides, from offset 0): `num_layers` layers back to back, each holding K and
    /// V of `num_blocks` blocks of `block_bytes` — `order="kv_major"`: `[2, num_blocks, ...]`
    /// per layer (all K blocks, then all V blocks); `"block_major"`: `[num_blocks, 2, ...]`.
    /// `src`: a `Region` (host memory, posted as is) or a `CudaSource` (device memory, staged
    /// through its `CudaStager`); `dst_region`: the peer's region (`RemoteRegion`, or
    /// `(index, generation)`). `src_blocks`/`dst_blocks`: block ids, one list for every layer
    /// or one list per layer; block `src_blocks[i]` of each part goes to `dst_blocks[i]`.
    /// `dst_blocks=None`: given later with `LayerStream.set_destination`. `notify`: a tag
    /// delivered to the peer once, after every layer landed. `deadline`: seconds for the
    /// whole stream (60 by default). `stager`: a `CudaStager` for `cuda_event`/`cuda_stream`
    /// readiness of a host source (a `CudaSource` brings its own).
    ///
    /// Raises `OutOfBoundsError` when a region is smaller than the layout, and
    /// `InvalidArgumentError` for a bad order, block id, or mismatched lists.
    #[pyo3(signature = (peer, src, dst_region, *, num_layers, num_blocks, block_bytes, src_blocks, order="kv_major", dst_blocks=None, notify=None, deadline=None, stager=None))]
    #[allow(clippy::too_many_arguments)]
    fn layer_stream(
        slf: &Bound<'_, Self>,
        peer: &Bound<'_, PyPeer>,
        src: &Bound<'_, PyAny>,
        dst_region: &Bound<'_, PyAny>,
        num_layers: usize,
        num_blocks: u32,
        block_bytes: u64,
        src_blocks: &Bound<'_, PyAny>,
        order: &str,
        dst_blocks: Option<&Bound<'_, PyAny>>,
        notify: Option<Vec<u8>>,
        deadline: Option<f64>,
        stager: Option<&Bound<'_, crate::cuda::PyCudaStager>>,
    ) -> PyResult<crate::layer::PyLayerStream> {
        crate::layer::open(
            slf,
            crate::layer::OpenArgs {
                peer,
                src,
                dst_region,
                num_layers,
                num_blocks,
                block_bytes,
                order,
                src_blocks,
                dst_blocks,
                notify,
                deadline,
                stager,
            },
        )
    }

    /// Submits a batch of reads (remote → local; the local region is the destination).
    #[pyo3(signature = (peer, ops, deadline=None))]
    fn read(
        &self,
        peer: &Bound<'_, PyPeer>,
        ops: &Bound<'_, PyAny>,
        deadline: Option<f64>,
    ) -> PyResult<PyBatch> {
        let ops = parse_ops(ops)?;
        let d = deadline.map(|d| secs("deadline", d)).transpose()?;
        let batch = self.engine.read(&peer.get().peer, &ops, d).map_err(to_py)?;
        Ok(PyBatch { batch })
    }

    /// Blocks (GIL released) until a notification arrives; raises `kvwire.TimeoutError` after
    /// `timeout` seconds.
    #[pyo3(signature = (timeout=1.0))]
    fn get_notification(&self, py: Python<'_>, timeout: f64) -> PyResult<PyNotification> {
        let d = secs("timeout", timeout)?;
        let q = self.engine.notifications();
        let n = py.detach(|| q.recv_timeout(d)).map_err(to_py)?;
        Ok(PyNotification {
            peer: n.peer.0,
            tag: PyBytes::new(py, &n.tag).unbind(),
        })
    }

    /// A notification if one is queued, else `None`.
    fn try_get_notification(&self, py: Python<'_>) -> Option<PyNotification> {
        self.engine
            .notifications()
            .try_recv()
            .map(|n| PyNotification {
                peer: n.peer.0,
                tag: PyBytes::new(py, &n.tag).unbind(),
            })
    }

    /// What peers learn about this engine: `{"addr", "regions": [RemoteRegion...]}`.
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = self.engine.descriptor();
        let out = PyDict::new(py);
        out.set_item("addr", d.addr.to_string())?;
        let regions: Vec<PyRemoteRegion> = d.regions.into_iter().map(Into::into).collect();
        out.set_item("regions", regions)?;
        Ok(out)
    }

    /// The engine's metrics as a dict: scalar counters and gauges, `"region_bytes_by_kind"`
    /// (`{"engine": .., "host": .., "pinned": ..}`), `"transports"`
    /// (`{"tcp": {...}, "shm": {...}, "rdma": {...}}`), `"latency"` (histograms: transport,
    /// size class, cumulative `(le_seconds, count)` buckets, sum, count), `"peers"`, `"errors"`
    /// (`{stage: {kind: count}}`) and `"prometheus_text"` (the exposition text).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.engine.metrics();
        let out = PyDict::new(py);
        for (k, v) in [
            ("inflight_bytes", m.inflight_bytes),
            ("inflight_slices", m.inflight_slices),
            ("inflight_batches", m.inflight_batches),
            ("lanes_reestablished", m.lanes_reestablished),
            ("reposts", m.reposts),
            ("registrations", m.registrations),
            ("registered_bytes", m.registered_bytes),
            ("unregistrations", m.unregistrations),
            ("regions", m.regions),
            ("region_bytes", m.region_bytes),
            ("connections_outbound", m.connections_outbound),
            ("connections_inbound", m.connections_inbound),
            ("disconnects", m.disconnects),
            ("peers_connected", m.peers_connected),
            ("notifications_delivered", m.notifications_delivered),
            ("notifications_dropped", m.notifications_dropped),
            ("notifications_suppressed", m.notifications_suppressed),
        ] {
            out.set_item(k, v)?;
        }
        out.set_item("registration_seconds", m.registration_seconds)?;
        let kinds = PyDict::new(py);
        for (k, n) in m.region_bytes_by_kind {
            kinds.set_item(k, n)?;
        }
        out.set_item("region_bytes_by_kind", kinds)?;
        let transports = PyDict::new(py);
        for t in &m.transports {
            let d = PyDict::new(py);
            d.set_item("write_bytes", t.write_bytes)?;
            d.set_item("read_bytes", t.read_bytes)?;
            d.set_item("write_batches", t.write_batches)?;
            d.set_item("read_batches", t.read_batches)?;
            d.set_item("ops", t.ops)?;
            d.set_item("slices", t.slices)?;
            d.set_item("failed_batches", t.failed_batches)?;
            transports.set_item(transport_name(t.transport), d)?;
        }
        out.set_item("transports", transports)?;
        let mut latency = Vec::with_capacity(m.latency.len());
        for h in &m.latency {
            let d = PyDict::new(py);
            d.set_item("transport", transport_name(h.transport))?;
            d.set_item("size", h.size_class)?;
            d.set_item("buckets", h.buckets.clone())?;
            d.set_item("sum_seconds", h.sum_seconds)?;
            d.set_item("count", h.count)?;
            latency.push(d);
        }
        out.set_item("latency", latency)?;
        let mut peers = Vec::with_capacity(m.peers.len());
        for p in &m.peers {
            let d = PyDict::new(py);
            d.set_item("id", p.id)?;
            d.set_item("remote_addr", p.remote_addr.to_string())?;
            d.set_item("transport", transport_name(p.transport))?;
            d.set_item("write_bytes", p.write_bytes)?;
            d.set_item("read_bytes", p.read_bytes)?;
            d.set_item("batches", p.batches)?;
            d.set_item("failed_batches", p.failed_batches)?;
            d.set_item("ops", p.ops)?;
            d.set_item("lanes_reestablished", p.lanes_reestablished)?;
            d.set_item("reposts", p.reposts)?;
            d.set_item("slice_sizes", p.slice_sizes)?;
            peers.push(d);
        }
        out.set_item("peers", peers)?;
        let errors = PyDict::new(py);
        for e in &m.errors {
            let stage = match errors.get_item(e.stage)? {
                Some(d) => d.cast_into::<PyDict>()?,
                None => {
                    let d = PyDict::new(py);
                    errors.set_item(e.stage, &d)?;
                    d
                }
            };
            stage.set_item(e.kind, e.count)?;
        }
        out.set_item("errors", errors)?;
        out.set_item("prometheus_text", m.to_prometheus_text())?;
        Ok(out)
    }

    /// Closes every connection and fails in-flight batches.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| self.engine.shutdown());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _a: Option<Bound<'_, PyAny>>,
        _b: Option<Bound<'_, PyAny>>,
        _c: Option<Bound<'_, PyAny>>,
    ) -> bool {
        self.shutdown(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("Engine(listen_addr={:?})", self.listen_addr())
    }
}
