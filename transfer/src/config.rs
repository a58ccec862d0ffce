//! Engine configuration, and the only place in this crate that reads `KVWIRE_*` environment
//! variables ([`EngineConfig::from_env`]).

use std::net::SocketAddr;
use std::time::Duration;

use crate::limits::Limits;
use crate::types::TransportKind;

/// Environment variable of [`EngineConfig::wait_spin`] (µs).
pub(crate) const WAIT_SPIN_ENV: &str = "KVWIRE_WAIT_SPIN_US";
/// Environment variable of [`EngineConfig::prefer_rdma`] (`1` = prefer).
pub(crate) const PREFER_RDMA_ENV: &str = "KVWIRE_PREFER_RDMA";
/// Environment variable of [`EngineConfig::rdma_device_fallback`] (a name or a comma list).
pub(crate) const RDMA_DEVICE_ENV: &str = "KVWIRE_RDMA_DEVICE";
/// Environment variable of [`EngineConfig::rdma_near`] (a PCI address or sysfs path).
const RDMA_NEAR_ENV: &str = "KVWIRE_RDMA_NEAR";
/// Environment variable of [`EngineConfig::rdma_signal_every`].
const RDMA_SIGNAL_ENV: &str = "KVWIRE_RDMA_SIGNAL_EVERY";
/// Environment variable of [`EngineConfig::rdma_max_sge`].
const RDMA_MAX_SGE_ENV: &str = "KVWIRE_RDMA_MAX_SGE";
/// Environment variable of [`EngineConfig::rdma_mr_chunk`] (bytes).
const RDMA_MR_CHUNK_ENV: &str = "KVWIRE_RDMA_MR_CHUNK";
/// Environment variable of [`EngineConfig::rdma_slice_max`] (bytes).
const RDMA_SLICE_MAX_ENV: &str = "KVWIRE_RDMA_SLICE_MAX";
/// Environment variable of [`EngineConfig::rdma_poll`] (µs).
pub(crate) const RDMA_POLL_ENV: &str = "KVWIRE_RDMA_POLL_US";
/// Environment variable of [`EngineConfig::ibverbs_path`] (the same one
/// `kvwire_verbs::Verbs::load` reads).
pub(crate) const IBVERBS_PATH_ENV: &str = kvwire_verbs::LIBRARY_ENV;

/// Engine configuration. `EngineConfig::default()` listens on an ephemeral loopback port and
/// reads nothing from the environment; [`EngineConfig::from_env`] is the default with the
/// `KVWIRE_*` knobs of the environment filled in (start from it, `..EngineConfig::from_env()`,
/// where those knobs should apply).
///
/// The knob fields are `Option`s: `None` is the built-in default.
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
    /// Largest slice in bytes (writes larger than this are cut and striped over lanes). RDMA
    /// starts here and may grow a peer's slices up to [`EngineConfig::rdma_slice_max`].
    pub slice_size: usize,
    /// Deadline for batches submitted with `None`.
    pub default_deadline: Duration,
    /// Deadline for connecting and the whole handshake (or lane join) this engine initiates.
    pub connect_timeout: Duration,
    /// RDMA device to use (e.g. `mlx5_0`, `rxe0`; a comma list names several). Ignored when
    /// [`EngineConfig::rdma_devices`] is not empty; `None` (or a blank list) =
    /// [`EngineConfig::rdma_device_fallback`], else every device with an active port. RDMA is
    /// offered only when libibverbs loads ([`EngineConfig::ibverbs_path`]) and a device is
    /// usable; a named device that cannot be opened makes `Engine::new` fail.
    pub rdma_device: Option<String>,
    /// RDMA devices to use, in order (slices are striped over queue pairs on all of them);
    /// empty = [`EngineConfig::rdma_device`], [`EngineConfig::rdma_device_fallback`], else
    /// every device with an active port. On multi-NIC nodes name the NICs close to the memory
    /// being transferred (see `docs/rdma_hardware_plan.md`).
    pub rdma_devices: Vec<String>,
    /// Record engine metrics ([`crate::Engine::metrics`]); `false` skips every per-batch
    /// counter update (the snapshot then shows zeros for batch counters).
    pub metrics: bool,
    /// Serve the metrics in the Prometheus text format at `GET /metrics` on this address
    /// (`None` = no endpoint; port 0 = ephemeral, see [`crate::Engine::metrics_addr`]).
    pub metrics_addr: Option<SocketAddr>,
    /// How long [`crate::Batch::wait`] checks the completion flag before it parks the thread
    /// (a small write completes within about one round trip, and waking a parked thread costs
    /// about as much again); capped at 1 ms, zero = never spin. `None` = 30 µs.
    /// Environment: `KVWIRE_WAIT_SPIN_US` (µs; a value that is not a number is ignored).
    pub wait_spin: Option<Duration>,
    /// With [`TransportKind::Auto`], try RDMA before shared memory towards a peer on the same
    /// host (`true`). `None` = `false` (shared memory first on one host, RDMA to other hosts).
    /// Environment: `KVWIRE_PREFER_RDMA` (`1` = `true`, anything else `false`).
    pub prefer_rdma: Option<bool>,
    /// RDMA devices (a name or a comma list) used when neither
    /// [`EngineConfig::rdma_devices`] nor [`EngineConfig::rdma_device`] names one. `None` (or
    /// a blank list) = every device with an active port. Environment: `KVWIRE_RDMA_DEVICE`.
    pub rdma_device_fallback: Option<String>,
    /// The PCI device whose memory this engine moves, usually its GPU: a PCI address
    /// (`0000:1b:00.0`; an 8-digit domain as `nvidia-smi` prints it is accepted) or a sysfs path.
    /// When no RDMA device is named, the engine opens only the active devices nearest it in the
    /// PCI tree (the most leading sysfs path components in common: a NIC under the GPU's PCIe
    /// switch before one under the same root port, before one elsewhere) instead of every
    /// active device. `None` (or blank) = every active device; an address sysfs does not know
    /// is logged and treated as `None`. Environment: `KVWIRE_RDMA_NEAR`.
    pub rdma_near: Option<String>,
    /// RDMA: signal one WRITE in this many of a chain (every READ and the last work request of
    /// every chain are always signalled); capped at the queue pair depth (256). `None` (or 0) =
    /// 16; 1 = every work request. Environment: `KVWIRE_RDMA_SIGNAL_EVERY` (a value that is not
    /// a number is ignored, with a warning).
    ///
    /// A signalled WRITE's successful completion retires the unsignalled ones before it on its
    /// queue pair (RC completes in order, and a failed or flushed work request always reports
    /// on its own); when it fails or is flushed, the ones it covers are posted again, never
    /// inferred done. READs stay signalled: rxe (Linux 6.1) reports a READ *successful* whose
    /// data never landed and moves its QP to the error state without an error completion when
    /// packets are dropped under load (`tests/rdma_read_stress_vm.rs`); the engine posts the
    /// READ the QP reported last again, which needs every READ's own completion. (When READs
    /// too were signalled one in 16, in-VM runs over two devices saw READ batches complete
    /// with a slice unwritten; WRITEs always verified.)
    pub rdma_signal_every: Option<u64>,
    /// RDMA: the most local pieces one work request gathers (a scatter-gather list). Slices
    /// that are contiguous at the peer but not locally (KV blocks scattered in P's cache bound
    /// for a run of D's blocks) go as one WRITE, or one READ, of up to this many pieces and
    /// `slice_size` bytes, instead of one work request each. `None` (or 0) = 16, lowered to
    /// what the devices allow; 1 = one piece per work request. Environment:
    /// `KVWIRE_RDMA_MAX_SGE` (a value that is not a number is ignored, with a warning).
    pub rdma_max_sge: Option<u64>,
    /// RDMA: how long a completion thread keeps polling its completion queue after a
    /// completion while work requests are still on the NIC, before it arms the queue and
    /// sleeps; capped at 10 ms. `None` = zero: never (in the SoftRoCE VM a 200 µs window halved
    /// serial 64 KiB throughput, the spinning thread taking a vCPU from the emulated NIC; to be
    /// measured on real NICs). Environment: `KVWIRE_RDMA_POLL_US` (µs; a value that is not a
    /// number is ignored, with a warning).
    pub rdma_poll: Option<Duration>,
    /// RDMA: the largest memory registration, in bytes. A region larger than this, or than a
    /// device's `max_mr_size`, is registered in chunks of that many bytes (rounded down to
    /// whole pages), each with its own keys; work requests never cross a chunk, at either end.
    /// `None` (or 0) = the devices' limit. Environment: `KVWIRE_RDMA_MR_CHUNK` (bytes; a value
    /// that is not a number is ignored, with a warning).
    pub rdma_mr_chunk: Option<u64>,
    /// RDMA: the largest slice a peer's slices grow to. Each peer starts cutting at
    /// [`EngineConfig::slice_size`] and, where its large batches (two work requests per lane or
    /// more) move faster with slices twice as big — the per-request cost, not the wire, is the
    /// limit —, doubles it, up to this size, and settles on the last doubling that raised the
    /// rate by 10% (tried again every 64 windows of at least 8 batches and 50 ms; see the RDMA transport's
    /// `slice` module). `None` (or 0) = 16 × `slice_size`, at most 64 MiB; a value at or below
    /// `slice_size` keeps every slice at `slice_size`. Environment: `KVWIRE_RDMA_SLICE_MAX`
    /// (bytes; a value that is not a number is ignored, with a warning).
    pub rdma_slice_max: Option<u64>,
    /// Path or soname of libibverbs, loaded at run time. `None` (or empty) =
    /// `libibverbs.so.1`. Environment: `KVWIRE_IBVERBS_PATH`.
    pub ibverbs_path: Option<String>,
    /// Bounds on what peers may make this engine hold (handshakes, peers, lanes, notification
    /// and region-table bytes, control queues, idle time, metrics connections).
    pub limits: Limits,
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
            wait_spin: None,
            prefer_rdma: None,
            rdma_device_fallback: None,
            rdma_near: None,
            rdma_signal_every: None,
            rdma_max_sge: None,
            rdma_poll: None,
            rdma_mr_chunk: None,
            rdma_slice_max: None,
            ibverbs_path: None,
            limits: Limits::default(),
        }
    }
}

impl EngineConfig {
    /// The default configuration with every knob whose `KVWIRE_*` environment variable is set
    /// filled in from it (see each field). This is the only code of the engine that reads the
    /// environment: [`EngineConfig::default`] and `Engine::new` do not.
    pub fn from_env() -> Self {
        EngineConfig {
            wait_spin: std::env::var(WAIT_SPIN_ENV)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .map(Duration::from_micros),
            prefer_rdma: std::env::var(PREFER_RDMA_ENV).ok().map(|v| v == "1"),
            rdma_device_fallback: std::env::var(RDMA_DEVICE_ENV).ok(),
            rdma_near: std::env::var(RDMA_NEAR_ENV).ok(),
            rdma_signal_every: number_knob(RDMA_SIGNAL_ENV),
            rdma_max_sge: number_knob(RDMA_MAX_SGE_ENV),
            rdma_poll: number_knob(RDMA_POLL_ENV).map(Duration::from_micros),
            rdma_mr_chunk: number_knob(RDMA_MR_CHUNK_ENV),
            rdma_slice_max: number_knob(RDMA_SLICE_MAX_ENV),
            ibverbs_path: match std::env::var_os(IBVERBS_PATH_ENV) {
                Some(p) if !p.is_empty() => Some(p.to_string_lossy().into_owned()),
                _ => None,
            },
            ..EngineConfig::default()
        }
    }

    /// RDMA: the slice size a peer starts at ([`EngineConfig::slice_size`]) and the largest it
    /// may grow to ([`EngineConfig::rdma_slice_max`], or its default), both within 1 GiB.
    pub fn rdma_slices(&self) -> (u64, u64) {
        let slice = (self.slice_size as u64).clamp(1, MAX_RDMA_SLICE);
        let max = match self.rdma_slice_max {
            Some(m) if m > 0 => m,
            _ => (slice * RDMA_SLICE_GROWTH).min(RDMA_SLICE_MAX_DEFAULT),
        };
        (slice, max.clamp(slice, MAX_RDMA_SLICE))
    }
}

/// The largest RDMA slice: 1 GiB (a WR's length is 32 bits).
const MAX_RDMA_SLICE: u64 = 1 << 30;
/// The default largest slice RDMA grows to: this many times the configured slice, ...
const RDMA_SLICE_GROWTH: u64 = 16;
/// ... and at most this.
const RDMA_SLICE_MAX_DEFAULT: u64 = 64 << 20;

/// A numeric knob: `None` when unset, or (with a warning) when it is not a number.
fn number_knob(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse::<u64>() {
        Ok(n) => Some(n),
        Err(_) => {
            // The RDMA transport read these knobs before they moved here: same event, target.
            tracing::warn!(
                target: "kvwire_transfer::transport::rdma",
                var = name,
                value = %v,
                "not a number; using the default"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::EngineConfig;

    fn bounds(slice_size: usize, rdma_slice_max: Option<u64>) -> (u64, u64) {
        EngineConfig {
            slice_size,
            rdma_slice_max,
            ..EngineConfig::default()
        }
        .rdma_slices()
    }

    #[test]
    fn slices_grow_sixteenfold_by_default_at_most_to_64_mib() {
        assert_eq!(bounds(64 << 10, None), (64 << 10, 1 << 20));
        assert_eq!(bounds(1 << 20, Some(0)), (1 << 20, 16 << 20));
        assert_eq!(bounds(8 << 20, None), (8 << 20, 64 << 20));
        assert_eq!(bounds(128 << 20, None), (128 << 20, 128 << 20));
        // Asked: taken as is, never below the slice, never past 1 GiB.
        assert_eq!(bounds(1 << 20, Some(4 << 20)), (1 << 20, 4 << 20));
        assert_eq!(bounds(1 << 20, Some(1)), (1 << 20, 1 << 20));
        assert_eq!(bounds(4 << 30, Some(u64::MAX)), (1 << 30, 1 << 30));
    }
}
