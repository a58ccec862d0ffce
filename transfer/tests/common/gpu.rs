//! The GPU tests' first step: a CUDA context on device 0, or a loud skip (a failure with
//! `KVWIRE_REQUIRE_GPU=1`, as the GPU check sets).

use std::io::Write;
use std::sync::Arc;

use kvwire_transfer::cuda;

/// A context on device 0, or `None` after printing `SKIPPED` to stderr (uncaptured by libtest).
pub fn device_or_skip(test: &str) -> Option<Arc<cudarc::driver::CudaContext>> {
    match cuda::device_count() {
        Ok(n) if n > 0 => Some(cuda::context(0).expect("CUDA context")),
        other => {
            let why = match other {
                Ok(_) => "driver present, 0 devices".to_string(),
                Err(e) => e.to_string(),
            };
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: no CUDA device ({why}): {test} did not run"
            );
            let require = std::env::var("KVWIRE_REQUIRE_GPU").as_deref() == Ok("1");
            assert!(!require, "KVWIRE_REQUIRE_GPU=1 but no CUDA device: {why}");
            None
        }
    }
}
