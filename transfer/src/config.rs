//! Engine configuration.

use std::net::SocketAddr;
use std::time::Duration;

use crate::types::TransportKind;

/// Engine configuration. `EngineConfig::default()` listens on an ephemeral loopback port.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Listen address (port 0 = ephemeral).
    pub listen: SocketAddr,
    /// Shared secret; `None` = no authentication.
    pub secret: Option<Vec<u8>>,
    /// Transport selection.
    pub transport: TransportKind,
    /// TCP connections per peer.
    pub lanes: usize,
    /// Largest slice in bytes (writes larger than this are cut and striped over lanes).
    pub slice_size: usize,
    /// Deadline for batches submitted with `None`.
    pub default_deadline: Duration,
    /// Deadline for connecting and the handshake.
    pub connect_timeout: Duration,
    /// RDMA device to use (e.g. `mlx5_0`, `rxe0`; a comma list names several). Ignored when
    /// [`EngineConfig::rdma_devices`] is not empty; `None` = `$KVWIRE_RDMA_DEVICE` (also a
    /// comma list), else every device with an active port. RDMA is offered only when
    /// libibverbs loads (`$KVWIRE_IBVERBS_PATH` overrides its path) and a device is usable; a
    /// named device that cannot be opened makes `Engine::new` fail.
    pub rdma_device: Option<String>,
    /// RDMA devices to use, in order (slices are striped over queue pairs on all of them);
    /// empty = [`EngineConfig::rdma_device`], `$KVWIRE_RDMA_DEVICE`, else every device with an
    /// active port. On multi-NIC nodes name the NICs close to the memory being transferred
    /// (see `docs/rdma_hardware_plan.md`).
    pub rdma_devices: Vec<String>,
    /// Record engine metrics ([`crate::Engine::metrics`]); `false` skips every per-batch
    /// counter update (the snapshot then shows zeros for batch counters).
    pub metrics: bool,
    /// Serve the metrics in the Prometheus text format at `GET /metrics` on this address
    /// (`None` = no endpoint; port 0 = ephemeral, see [`crate::Engine::metrics_addr`]).
    pub metrics_addr: Option<SocketAddr>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            secret: None,
            transport: TransportKind::Auto,
            lanes: 4,
            slice_size: 1 << 20,
            default_deadline: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            rdma_device: None,
            rdma_devices: Vec::new(),
            metrics: true,
            metrics_addr: None,
        }
    }
}
