//! Python exceptions: one class per kind of engine error, all under `kvwire.KvwireError`.

use kvwire_transfer::cuda::CudaError as DriverError;
use kvwire_transfer::layer::LayerError;
use kvwire_transfer::Error;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    kvwire,
    KvwireError,
    PyException,
    "Base class of every kvwire error."
);
create_exception!(
    kvwire,
    IoError,
    KvwireError,
    "An operating-system I/O error (socket, mmap...)."
);
create_exception!(
    kvwire,
    ProtocolError,
    KvwireError,
    "A peer broke the wire protocol (malformed frame...)."
);
create_exception!(
    kvwire,
    VersionMismatchError,
    KvwireError,
    "The peers speak different protocol versions."
);
create_exception!(
    kvwire,
    AuthError,
    KvwireError,
    "The shared-secret proof failed."
);
create_exception!(
    kvwire,
    OutOfBoundsError,
    KvwireError,
    "An access outside a region's bounds."
);
create_exception!(kvwire, UnknownRegionError, KvwireError, "No such region (never registered, not offered, or an address outside every registered buffer).");
create_exception!(
    kvwire,
    StaleRegionError,
    KvwireError,
    "The region was unregistered."
);
create_exception!(
    kvwire,
    AccessDeniedError,
    KvwireError,
    "The region does not allow this access."
);
create_exception!(
    kvwire,
    PeerDeadError,
    KvwireError,
    "The peer died or its connection broke."
);
create_exception!(kvwire, TimeoutError, KvwireError, "A deadline passed.");
create_exception!(
    kvwire,
    ShutdownError,
    KvwireError,
    "The engine was shut down."
);
create_exception!(
    kvwire,
    InvalidArgumentError,
    KvwireError,
    "An invalid argument."
);
create_exception!(kvwire, UnsupportedError, KvwireError, "Not available here.");
create_exception!(
    kvwire,
    ResourceLimitError,
    KvwireError,
    "A bound of the engine's limits was reached (handshakes, peers, lanes, notification bytes...)."
);
create_exception!(
    kvwire,
    FencedError,
    KvwireError,
    "The peer engine is fenced (Engine.fence): its connections are refused."
);
create_exception!(
    kvwire,
    ConnectorError,
    KvwireError,
    "The P/D connector core refused an event."
);

create_exception!(
    kvwire,
    AbortedError,
    KvwireError,
    "The layer stream was aborted (LayerStream.abort, or its handle was dropped)."
);
create_exception!(
    kvwire,
    LayerStreamError,
    KvwireError,
    "A layer stream failed: a layer's readiness (e.g. a CUDA event) or its staging copy failed."
);
create_exception!(
    kvwire,
    CudaError,
    KvwireError,
    "A CUDA driver call failed (a missing driver or device raises UnsupportedError instead)."
);

/// Converts an engine error into the matching Python exception.
pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Io(_) => IoError::new_err(msg),
        Error::Protocol(_) => ProtocolError::new_err(msg),
        Error::VersionMismatch { .. } => VersionMismatchError::new_err(msg),
        Error::AuthFailed => AuthError::new_err(msg),
        Error::OutOfBounds { .. } => OutOfBoundsError::new_err(msg),
        Error::UnknownRegion(_) => UnknownRegionError::new_err(msg),
        Error::StaleRegion(_) => StaleRegionError::new_err(msg),
        Error::AccessDenied(_) => AccessDeniedError::new_err(msg),
        Error::PeerDead(_) => PeerDeadError::new_err(msg),
        Error::Timeout => TimeoutError::new_err(msg),
        Error::Shutdown => ShutdownError::new_err(msg),
        Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        Error::Unsupported(_) => UnsupportedError::new_err(msg),
        Error::ResourceLimit { .. } => ResourceLimitError::new_err(msg),
        Error::Fenced { .. } => FencedError::new_err(msg),
        _ => KvwireError::new_err(msg),
    }
}

/// Converts a layer-stream error into the matching Python exception: engine errors as
/// [`to_py`], bad arguments and misuse (a layer made ready twice, a second destination) as
/// `InvalidArgumentError`, an abort as `AbortedError`, the stream deadline as `TimeoutError`,
/// readiness and staging failures as `LayerStreamError`.
pub fn layer_to_py(e: LayerError) -> PyErr {
    let msg = e.to_string();
    match e {
        LayerError::Engine(e) => to_py(e),
        LayerError::InvalidArgument(_) | LayerError::State(_) => InvalidArgumentError::new_err(msg),
        LayerError::Aborted(_) => AbortedError::new_err(msg),
        LayerError::Timeout => TimeoutError::new_err(msg),
        LayerError::Readiness { .. } | LayerError::Staging { .. } => LayerStreamError::new_err(msg),
        _ => KvwireError::new_err(msg),
    }
}

/// Converts a CUDA error: no driver or no (such) device → `UnsupportedError`, a failed driver
/// call → `CudaError`, a bad argument → `InvalidArgumentError`, an engine error as [`to_py`].
pub fn cuda_to_py(e: DriverError) -> PyErr {
    let msg = e.to_string();
    match e {
        DriverError::NoDriver | DriverError::NoDevice(_) => UnsupportedError::new_err(format!(
            "{msg}: CUDA sources need the NVIDIA driver (libcuda) and a device"
        )),
        // A driver without a usable device (cuInit: CUDA_ERROR_NO_DEVICE) is "no CUDA here".
        DriverError::Driver(ref m) if m.contains("NO_DEVICE") => {
            UnsupportedError::new_err(format!("{msg}: no CUDA device on this machine"))
        }
        DriverError::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        DriverError::Engine(e) => to_py(e),
        _ => CudaError::new_err(msg),
    }
}

/// `InvalidArgumentError` with a message.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    InvalidArgumentError::new_err(msg.into())
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvwireError", py.get_type::<KvwireError>())?;
    m.add("IoError", py.get_type::<IoError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add(
        "VersionMismatchError",
        py.get_type::<VersionMismatchError>(),
    )?;
    m.add("AuthError", py.get_type::<AuthError>())?;
    m.add("OutOfBoundsError", py.get_type::<OutOfBoundsError>())?;
    m.add("UnknownRegionError", py.get_type::<UnknownRegionError>())?;
    m.add("StaleRegionError", py.get_type::<StaleRegionError>())?;
    m.add("AccessDeniedError", py.get_type::<AccessDeniedError>())?;
    m.add("PeerDeadError", py.get_type::<PeerDeadError>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("ShutdownError", py.get_type::<ShutdownError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("ResourceLimitError", py.get_type::<ResourceLimitError>())?;
    m.add("FencedError", py.get_type::<FencedError>())?;
    m.add("ConnectorError", py.get_type::<ConnectorError>())?;
    m.add("AbortedError", py.get_type::<AbortedError>())?;
    m.add("LayerStreamError", py.get_type::<LayerStreamError>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    Ok(())
}
