//! `kvwire._kvwire`: the native half of the `kvwire` Python package.
//!
//! * [`engine`]: `kvwire.Engine` over the transfer engine.
//! * [`mooncake`]: `kvwire.mooncake.TransferEngine`, a drop-in for `mooncake.engine.TransferEngine`.
//! * [`layer`]: `kvwire.LayerStream` (layer-by-layer sends).
//! * [`cuda`]: `kvwire.CudaStager` and `kvwire.CudaSource` (CUDA device memory as a source).
//! * [`core`]: the P/D connector core (decode and prefill state machines) for the vLLM connector.
//!
//! Errors become exceptions of the `kvwire.KvwireError` hierarchy, defined in the Python module
//! `kvwire.errors` and raised from here ([`errors`]); blocking calls release the GIL.

pub mod core;
pub mod core_actions;
pub mod core_metrics;
pub mod cuda;
pub mod engine;
pub mod errors;
pub mod layer;
pub mod mooncake;
pub mod rawmem;

use pyo3::prelude::*;

/// RDMA device contexts open in this process now: each device is opened once per process and
/// shared by every engine in it that uses it.
#[pyfunction]
fn rdma_contexts_open() -> usize {
    kvwire_transfer::verbs::contexts_open()
}

/// The extension module.
#[pymodule]
fn _kvwire(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PyRegion>()?;
    m.add_class::<engine::PyRemoteRegion>()?;
    m.add_class::<engine::PyPeer>()?;
    m.add_class::<engine::PyBatch>()?;
    m.add_class::<engine::PyBatchStats>()?;
    m.add_class::<engine::PyNotification>()?;
    m.add_class::<mooncake::TransferEngine>()?;
    layer::register(m)?;
    core::register(m)?;
    core_actions::register(m)?;
    m.add_function(wrap_pyfunction!(rdma_contexts_open, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
