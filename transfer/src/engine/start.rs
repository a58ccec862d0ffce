//! Starting an engine: configuration checks, transports, listener, threads.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::core::{Core, Engine, Handle, Logs};
use super::fence::RegionFences;
use super::fenced::FencedAddrs;
use super::listener::accept_loop;
use super::peer::EngineId;
use crate::batch::Timer;
use crate::config::EngineConfig;
use crate::error::Error;
use crate::gate::{AuthThrottle, ConnGate};
use crate::host::host_identity;
use crate::metrics::{self, EngineMetrics};
use crate::net::{spawn_counted, Threads};
use crate::notify::NotifyQueue;
use crate::region::RegionTable;
#[cfg(feature = "cuda")]
use crate::transport::cuda_ipc::CudaIpcTransport;
use crate::transport::rdma::RdmaTransport;
use crate::transport::shm::ShmTransport;
use crate::transport::tcp::TcpTransport;
use crate::transport::{CopyJob, Transport};
use crate::types::TransportKind;

impl Engine {
    /// Binds the listener and starts the acceptor.
    pub fn new(cfg: EngineConfig) -> Result<Engine, Error> {
        if cfg.lanes == 0 || cfg.lanes > 64 {
            return Err(Error::InvalidArgument(format!(
                "lanes must be 1..=64, got {}",
                cfg.lanes
            )));
        }
        if cfg.slice_size == 0 {
            return Err(Error::InvalidArgument("slice_size must be > 0".into()));
        }
        if cfg.secret.as_ref().is_some_and(|s| s.is_empty()) {
            return Err(Error::InvalidArgument(
                "empty secret (use None for no authentication)".into(),
            ));
        }
        if cfg.secret.as_ref().is_some_and(|s| s.len() < 16) {
            tracing::warn!(
                "the shared secret is shorter than 16 bytes: an attacker who can make this \
                 engine connect to it can guess it offline (generate one with \
                 `kvwire-bench secret`)"
            );
        }
        cfg.limits.validate().map_err(Error::InvalidArgument)?;
        let threads: Threads = Arc::new(AtomicU64::new(0));
        let mut transports: Vec<Box<dyn Transport>> = vec![Box::new(TcpTransport)];
        // Before shm: `Auto` takes the first usable one (and skips cuda_ipc without device
        // regions).
        #[cfg(feature = "cuda")]
        if matches!(cfg.transport, TransportKind::CudaIpc | TransportKind::Auto) {
            match CudaIpcTransport::open() {
                Some(t) => transports.push(Box::new(t)),
                None if cfg.transport == TransportKind::CudaIpc => {
                    return Err(Error::Unsupported(
                        "TransportKind::CudaIpc, but the CUDA driver does not load here".into(),
                    ))
                }
                None => {}
            }
        }
        #[cfg(not(feature = "cuda"))]
        if cfg.transport == TransportKind::CudaIpc {
            return Err(Error::Unsupported(
                "TransportKind::CudaIpc, but this build has no CUDA (feature `cuda`)".into(),
            ));
        }
        transports.push(Box::new(ShmTransport::new()));
        // Only engines that may use RDMA open a device (Tcp/Shm engines never offer it).
        if matches!(cfg.transport, TransportKind::Rdma | TransportKind::Auto) {
            match RdmaTransport::open(&cfg) {
                Ok(Some(t)) => transports.push(Box::new(t)),
                Ok(None) if cfg.transport == TransportKind::Rdma => {
                    return Err(Error::Unsupported(
                        "TransportKind::Rdma, but no RDMA device is usable here".into(),
                    ))
                }
                Ok(None) => {}
                Err(e) if cfg.transport == TransportKind::Rdma => return Err(e),
                Err(e) => tracing::info!(error = %e, "rdma not available; using tcp/shm"),
            }
        }
        let listener = TcpListener::bind(cfg.listen)?;
        let listen_addr = listener.local_addr()?;
        let metrics_listener = match cfg.metrics_addr {
            Some(a) => Some(TcpListener::bind(a)?),
            None => None,
        };
        let metrics_addr = match &metrics_listener {
            Some(l) => Some(l.local_addr()?),
            None => None,
        };
        let timer = Arc::new(Timer::default());
        timer.start(&threads)?;
        let (copy_tx, copy_rx) = crossbeam_channel::unbounded::<CopyJob>();
        spawn_counted("kvwire-copy".into(), &threads, move || {
            while let Ok(job) = copy_rx.recv() {
                job();
            }
        })?;
        let limits = cfg.limits.clone();
        let metrics_gate = metrics_listener.as_ref().map(|_| {
            ConnGate::new(
                limits.metrics_max_conns,
                (limits.metrics_max_conns / 2).max(1),
            )
        });
        let core = Arc::new(Core {
            cfg,
            listen_addr,
            listener,
            regions: Arc::new(RegionTable::default()),
            peers: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            fenced: FencedAddrs::new(limits.max_peers),
            reg_lock: Mutex::new(()),
            fences: RegionFences::default(),
            notify: Arc::new(NotifyQueue::default()),
            timer,
            shut: AtomicBool::new(false),
            host: host_identity(),
            next_batch: AtomicU64::new(1),
            next_peer: AtomicU64::new(1),
            gate: ConnGate::new(limits.max_handshakes, limits.max_handshakes_per_ip),
            throttle: AuthThrottle::new(limits.auth_failures_per_ip),
            peer_count: Arc::new(AtomicUsize::new(0)),
            threads: threads.clone(),
            logs: Logs::default(),
            metrics_gate: metrics_gate.clone(),
            copy_tx: Mutex::new(Some(copy_tx)),
            transports,
            metrics: Arc::new(EngineMetrics::default()),
            metrics_addr,
            id: EngineId::next(),
        });
        let c = core.clone();
        spawn_counted("kvwire-accept".into(), &threads, move || accept_loop(c))?;
        if let (Some(l), Some(gate)) = (metrics_listener, metrics_gate) {
            let wc = Arc::downgrade(&core);
            let render: metrics::Render = Arc::new(move || {
                let c = wc.upgrade()?;
                if c.shut.load(Ordering::Acquire) {
                    return None;
                }
                Some(c.metrics_snapshot().to_prometheus_text())
            });
            let wc = Arc::downgrade(&core);
            let server = metrics::Server {
                gate,
                render,
                alive: Box::new(move || {
                    wc.upgrade()
                        .is_some_and(|c| !c.shut.load(Ordering::Acquire))
                }),
                timeout: limits.metrics_conn_timeout,
                threads: threads.clone(),
            };
            spawn_counted("kvwire-metrics".into(), &threads, move || server.serve(l))?;
            tracing::info!(addr = ?metrics_addr, "metrics endpoint listening");
        }
        Ok(Engine {
            h: Arc::new(Handle { core }),
        })
    }
}
