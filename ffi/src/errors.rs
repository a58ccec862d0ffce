//! Python exceptions: one class per kind of engine error, all under `kvwire.KvwireError`.
//!
//! The classes are defined once, in the Python module `kvwire.errors` (a table of name,
//! builtin base and doc; `kvwire` re-exports them). Here they are only named, to be raised:
//! each is looked up from `kvwire.errors` the first time, then kept.

use kvwire_transfer::cuda::CudaError as DriverError;
use kvwire_transfer::layer::LayerError;
use kvwire_transfer::Error;
use pyo3::prelude::*;

/// Each named class of `kvwire.errors` as a Rust exception type (`X::new_err(msg)`), looked up
/// from that module the first time it is raised.
macro_rules! from_errors_module {
    ($($name:ident),* $(,)?) => {
        $(pyo3::import_exception!(kvwire.errors, $name);)*
    };
}

from_errors_module!(
    KvwireError,
    IoError,
    ProtocolError,
    VersionMismatchError,
    AuthError,
    OutOfBoundsError,
    UnknownRegionError,
    StaleRegionError,
    AccessDeniedError,
    PeerDeadError,
    TimeoutError,
    ShutdownError,
    InvalidArgumentError,
    UnsupportedError,
    ResourceLimitError,
    FencedError,
    ConnectorError,
    AbortedError,
    LayerStreamError,
    CudaError,
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
