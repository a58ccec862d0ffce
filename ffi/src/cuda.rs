//! The CUDA half of the Python API: `kvwire.CudaStager` (pinned host staging buffers and a side
//! stream of one device), `kvwire.CudaSource` (device memory a layer stream reads), and the
//! readiness of a layer from a caller's CUDA stream or event. The FFI crate's only CUDA code:
//! every `unsafe` call of it is here, each stating the caller's contract it relies on.
//!
//! Without a CUDA driver every entry point raises `kvwire.UnsupportedError`; no driver call is
//! made before `kvwire_transfer::cuda::context` checked that the driver loads.

use std::sync::Arc;

use kvwire_transfer::cuda::{self, CudaStager, EventReadiness};
use kvwire_transfer::layer::{
    Immediate, Lease, Readiness, ReadySignal, SrcSpace, StageCopy, StageDone, Stager, StagingPool,
};
use pyo3::prelude::*;

use crate::engine::PyEngine;
use crate::errors::{cuda_to_py, invalid};

const MIB: f64 = (1u64 << 20) as f64;

/// A CUDA stager that also keeps a Python object (the source and the tensor behind it) alive
/// for as long as a stream's worker holds the stager, i.e. until every copy from it ended.
pub(crate) struct HeldStager {
    pub(crate) inner: Arc<CudaStager>,
    pub(crate) _hold: Py<PyAny>,
}

impl Stager for HeldStager {
    fn pool(&self) -> &Arc<StagingPool> {
        self.inner.pool()
    }
    fn orders_after_events(&self) -> bool {
        self.inner.orders_after_events()
    }
    fn stage(
        &self,
        after_event: Option<u64>,
        copies: Vec<StageCopy>,
        lease: Lease,
        done: StageDone,
    ) {
        self.inner.stage(after_event, copies, lease, done)
    }
    fn can_read(&self, src: SrcSpace) -> bool {
        self.inner.can_read(src)
    }
}

/// A readiness that keeps a Python object (a `torch.cuda.Event`) alive until the layer no
/// longer needs its event.
struct HeldReadiness {
    inner: Box<dyn Readiness>,
    hold: Option<Py<PyAny>>,
}

impl Readiness for HeldReadiness {
    fn notify(self: Box<Self>, signal: ReadySignal) {
        let HeldReadiness { inner, hold } = *self;
        inner.notify(ReadySignal::new(move |r| {
            drop(hold);
            signal.fire(r);
        }));
    }
    fn cuda_event(&self) -> Option<u64> {
        self.inner.cuda_event()
    }
}

/// Pinned host staging buffers for sending CUDA device memory over the engine.
///
/// `CudaStager(engine, device=0, buffers=4, buffer_mb=16)`: `buffers` page-locked host
/// buffers of `buffer_mb` MiB each, registered with `engine`, and a side stream of CUDA device
/// `device` that copies layer chunks into them (after the layer's CUDA event, on the device).
/// Two or more buffers overlap the copy of one chunk with the send of the previous one.
/// Raises `UnsupportedError` where there is no CUDA driver or no such device.
#[pyclass(name = "CudaStager", module = "kvwire", frozen)]
pub struct PyCudaStager {
    pub(crate) stager: Arc<CudaStager>,
    pub(crate) engine: Py<PyEngine>,
    /// The CUDA device ordinal.
    #[pyo3(get)]
    device: usize,
    /// Number of staging buffers.
    #[pyo3(get)]
    buffers: usize,
    /// Bytes per staging buffer.
    #[pyo3(get)]
    buffer_bytes: usize,
}

#[pymethods]
impl PyCudaStager {
    #[new]
    #[pyo3(signature = (engine, device=0, buffers=4, buffer_mb=16.0))]
    fn new(
        py: Python<'_>,
        engine: &Bound<'_, PyEngine>,
        device: usize,
        buffers: usize,
        buffer_mb: f64,
    ) -> PyResult<Self> {
        if buffers == 0 {
            return Err(invalid("buffers must be >= 1"));
        }
        let bytes = buffer_mb * MIB;
        if !bytes.is_finite() || bytes < 1.0 || bytes > (1u64 << 40) as f64 {
            return Err(invalid(format!(
                "buffer_mb must be > 0 and at most 1 TiB, got {buffer_mb}"
            )));
        }
        let buffer_bytes = bytes as usize;
        let eng = engine.get().engine.clone();
        let stager = py
            .detach(|| {
                let ctx = cuda::context(device)?;
                CudaStager::new(&eng, ctx, buffers, buffer_bytes)
            })
            .map_err(cuda_to_py)?;
        Ok(PyCudaStager {
            stager,
            engine: engine.clone().unbind(),
            device,
            buffers,
            buffer_bytes,
        })
    }

    /// The engine the staging buffers are registered with.
    #[getter]
    fn engine(&self, py: Python<'_>) -> Py<PyEngine> {
        self.engine.clone_ref(py)
    }

    /// Makes `length` bytes of device memory at `ptr` (e.g. a CUDA tensor's `data_ptr()`)
    /// a layer-stream source; offsets in the layout are relative to `ptr`.
    ///
    /// The memory must be on this stager's device and stay allocated while streams read it:
    /// pass the object that owns it as `keepalive` (``kvwire.register_tensor`` passes the
    /// tensor) and the returned `CudaSource`, and every stream reading from it, hold a
    /// reference to it.
    #[pyo3(signature = (ptr, length, keepalive=None))]
    fn register(
        slf: &Bound<'_, Self>,
        ptr: u64,
        length: u64,
        keepalive: Option<Py<PyAny>>,
    ) -> PyResult<PyCudaSource> {
        if ptr == 0 || length == 0 {
            return Err(invalid(format!(
                "device memory must be non-null and non-empty (ptr={ptr:#x}, length={length})"
            )));
        }
        let me = slf.get();
        // SAFETY: the caller of `CudaStager.register` promises (documented above) that
        // `ptr..ptr+length` is device memory of this stager's device that stays allocated while
        // streams read it; `keepalive` (the tensor, for `register_tensor`) is held by the
        // returned CudaSource, and every stream reading it holds the CudaSource until its
        // worker ended (`HeldStager`), so the owner cannot free it under a copy.
        let space = unsafe { me.stager.register_device(ptr, length) }.map_err(cuda_to_py)?;
        Ok(PyCudaSource {
            stager: slf.clone().unbind(),
            space,
            ptr,
            len: length,
            _keepalive: keepalive,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "CudaStager(device={}, buffers={}, buffer_bytes={})",
            self.device, self.buffers, self.buffer_bytes
        )
    }
}

/// CUDA device memory registered with a `CudaStager` (`CudaStager.register` or
/// `kvwire.register_tensor`): a `src` for `Engine.layer_stream`. Holds the stager and the
/// object owning the memory.
#[pyclass(name = "CudaSource", module = "kvwire", frozen)]
pub struct PyCudaSource {
    pub(crate) stager: Py<PyCudaStager>,
    pub(crate) space: SrcSpace,
    /// Device address.
    #[pyo3(get)]
    ptr: u64,
    /// Length in bytes.
    #[pyo3(get)]
    pub(crate) len: u64,
    _keepalive: Option<Py<PyAny>>,
}

#[pymethods]
impl PyCudaSource {
    /// The stager it was registered with.
    #[getter]
    fn stager(&self, py: Python<'_>) -> Py<PyCudaStager> {
        self.stager.clone_ref(py)
    }
    fn __repr__(&self) -> String {
        format!(
            "CudaSource(device={}, ptr={:#x}, len={})",
            self.stager.get().device,
            self.ptr,
            self.len
        )
    }
}

/// Extracts a raw CUDA handle: an int, or an object with the attribute `attr` holding one
/// (`torch.cuda.Event().cuda_event`, `torch.cuda.Stream().cuda_stream`).
fn raw_handle(ob: &Bound<'_, PyAny>, attr: &str) -> PyResult<u64> {
    let v = if ob.hasattr(attr)? {
        ob.getattr(attr)?
    } else {
        ob.clone()
    };
    v.extract::<u64>().map_err(|_| {
        invalid(format!(
            "{attr} must be a raw handle (an int) or an object with a .{attr} attribute"
        ))
    })
}

/// The readiness of a layer from a caller's CUDA work: `stream` (an event is recorded on it
/// now) or `event` (recorded by the caller), on `stager`'s device; neither: ready now.
pub(crate) fn readiness(
    stager: &Arc<CudaStager>,
    ev: Option<&Bound<'_, PyAny>>,
    st: Option<&Bound<'_, PyAny>>,
) -> PyResult<Box<dyn Readiness>> {
    let (ctx, waiter) = (stager.context(), stager.waiter());
    if let Some(ob) = st {
        let raw = raw_handle(ob, "cuda_stream")?;
        // SAFETY: the documented contract of `layer_ready(cuda_stream=)`: a live
        // `CUstream` of the stager's device (0 = the legacy default stream); it is
        // used only within this call, to record an event we own.
        let r = unsafe { EventReadiness::record_on(ctx, waiter, raw) }.map_err(cuda_to_py)?;
        Ok(Box::new(r))
    } else if let Some(ob) = ev {
        let raw = raw_handle(ob, "cuda_event")?;
        // SAFETY: the documented contract of `layer_ready(cuda_event=)`: a recorded
        // `CUevent` of the stager's device. When the `torch.cuda.Event` object is
        // passed, `HeldReadiness` holds it until the stream no longer uses the
        // event, so it is not destroyed while waited on.
        let r = unsafe { EventReadiness::borrowed(ctx, waiter, raw) };
        Ok(Box::new(HeldReadiness {
            inner: Box::new(r),
            hold: Some(ob.clone().unbind()),
        }))
    } else {
        Ok(Box::new(Immediate))
    }
}

/// Registers `len` bytes of device memory at `addr` (device `device`) with `engine` as a device
/// region (for same-host peers with the `cuda_ipc` transport). A wrong address is refused by the
/// driver's lookup of its allocation (`CudaError::InvalidArgument` or `Driver`), not dereferenced.
pub(crate) fn register_device(
    engine: &kvwire_transfer::Engine,
    addr: u64,
    len: u64,
    access: kvwire_transfer::Access,
    device: usize,
) -> Result<kvwire_transfer::RegionHandle, cuda::CudaError> {
    let len = usize::try_from(len)
        .map_err(|_| cuda::CudaError::InvalidArgument("length too large".into()))?;
    let ctx = cuda::context(device)?;
    // SAFETY: the callers' contract, stated on every Python entry point that takes an address
    // (`Engine.register_device`, Mooncake's `register_memory`): the memory stays allocated until
    // the region is unregistered. The driver checks that `addr` names a device allocation of
    // `len` bytes before anything is registered.
    unsafe { cuda::register_device_region(engine, &ctx, addr, len, access) }
}

/// [`register_device`] for Python (errors as `kvwire` exceptions).
pub(crate) fn register_device_region(
    engine: &kvwire_transfer::Engine,
    addr: u64,
    len: u64,
    access: kvwire_transfer::Access,
    device: usize,
) -> PyResult<kvwire_transfer::RegionHandle> {
    register_device(engine, addr, len, access, device).map_err(cuda_to_py)
}

/// The CUDA device whose memory `addr` is; `None` for other addresses and without a driver.
pub(crate) fn device_of(addr: u64) -> Option<usize> {
    cuda::device_ordinal(addr).ok().flatten()
}
