//! The Python class: engine set-up, memory registration, managed buffers, batch status, and
//! the calls `TransferEngine` inherits (every Mooncake method but the transfer calls of
//! [`super::transfer`]).

use std::collections::HashMap;
use std::sync::atomic::AtomicI64;
use std::sync::Arc;
use std::time::Duration;

use kvwire_transfer::{Access, Engine, EngineConfig, Error, TransportKind};
use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::addrmap::META_LEN;
use super::inner::{Inner, Local, MError};
use super::transfer::{Mode, Xfer};
use crate::engine::{resolve_addr, transport_name};
use crate::rawmem::ManagedBuffer;

/// Splits Mooncake's `local_hostname` (`"host"`, `"host:port"`, `"[v6]:port"`, bare IPv6) into
/// the host part and the address to listen on (port 0 when none is given).
fn split_hostname(s: &str) -> (String, String) {
    if let Ok(a) = s.parse::<std::net::SocketAddr>() {
        return (a.ip().to_string(), s.to_string());
    }
    if s.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_ipv6()) {
        return (s.to_string(), format!("[{s}]:0"));
    }
    match s.rsplit_once(':') {
        Some((h, p)) if p.parse::<u16>().is_ok() => (h.to_string(), s.to_string()),
        _ => (s.to_string(), format!("{s}:0")),
    }
}

/// The reason of the failure of the engine's latest call that can fail (see the module
/// documentation); empty when it succeeded.
#[derive(Default)]
pub(super) struct LastError(Mutex<String>);

impl LastError {
    /// A call that can fail starts.
    pub(super) fn clear(&self) {
        self.0.lock().clear();
    }

    /// It failed.
    pub(super) fn set(&self, msg: String) {
        *self.0.lock() = msg;
    }

    pub(super) fn get(&self) -> String {
        self.0.lock().clone()
    }
}

/// The state and every method of the drop-in but its transfer calls, which
/// [`super::TransferEngine`] adds from one table (`kvwire.mooncake.TransferEngine` is this
/// class's only subclass; this one is not constructed from Python).
#[pyclass(module = "kvwire.mooncake", subclass, frozen)]
#[derive(Default)]
pub struct TransferEngineBase {
    inner: RwLock<Option<Arc<Inner>>>,
    pub(super) last_error: LastError,
}

impl TransferEngineBase {
    pub(super) fn get(&self) -> Result<Arc<Inner>, MError> {
        self.inner.read().clone().ok_or(MError::NotInitialized)
    }

    /// Records and logs a failure; returns `code`.
    pub(super) fn fail(&self, py: Python<'_>, what: &str, e: MError, code: i64) -> i64 {
        let msg = format!("{what}: {e}");
        if let Ok(logging) = py.import("logging") {
            if let Ok(logger) = logging.call_method1("getLogger", ("kvwire.mooncake",)) {
                let _ = logger.call_method1("warning", (msg.clone(),));
            }
        }
        self.last_error.set(msg);
        code
    }

    pub(super) fn run<T>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&Inner) -> Result<T, MError> + Send,
        ok: impl FnOnce(T) -> i64,
    ) -> i64
    where
        T: Send,
    {
        let r = self.get().and_then(|inner| py.detach(|| f(&inner)));
        match r {
            Ok(v) => ok(v),
            Err(e) => self.fail(py, what, e, -1),
        }
    }
}

#[pymethods]
impl TransferEngineBase {
    /// Starts the engine. `local_hostname`: `"host"` or `"host:port"` to listen on (port 0 or
    /// none = ephemeral; read it back with `get_rpc_port`). `metadata_server` must be
    /// `"P2PHANDSHAKE"` (peers are named `"host:rpc_port"`; no metadata service). `protocol`:
    /// `"tcp"` forces TCP, `"shm"` shared memory, anything else (`"rdma"`...) lets kvwire choose
    /// (shm on one host, else TCP; see `transport`). `device_name` is accepted and ignored.
    /// Returns 0, or -1 on failure.
    #[pyo3(signature = (local_hostname, metadata_server="P2PHANDSHAKE", protocol="tcp", device_name=""))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = device_name;
        if self.inner.read().is_some() {
            return self.fail(
                py,
                "initialize",
                MError::Other("already initialized".into()),
                -1,
            );
        }
        if !metadata_server.eq_ignore_ascii_case("P2PHANDSHAKE") {
            return self.fail(
                py,
                "initialize",
                MError::Other(format!(
                    "metadata server {metadata_server:?} unsupported: only P2PHANDSHAKE"
                )),
                -1,
            );
        }
        let (host, listen) = split_hostname(local_hostname);
        let listen = match resolve_addr(&listen) {
            Ok(a) => a,
            Err(e) => return self.fail(py, "initialize", MError::Other(e), -1),
        };
        let transport = match protocol.to_ascii_lowercase().as_str() {
            "tcp" => TransportKind::Tcp,
            "shm" => TransportKind::Shm,
            // Mooncake's same-node GPU transports: CUDA IPC between device buffers
            "nvlink" | "nvlink_intra" | "cuda_ipc" => TransportKind::CudaIpc,
            _ => TransportKind::Auto,
        };
        let timeout = std::env::var("MC_TRANSFER_TIMEOUT")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .unwrap_or(Duration::from_secs(30));
        let cfg = EngineConfig {
            listen,
            transport,
            default_deadline: timeout,
            // The KVWIRE_* knobs of the environment apply to the drop-in's engine.
            ..EngineConfig::from_env()
        };
        let res = py.detach(|| -> Result<Inner, MError> {
            let engine = Engine::new(cfg)?;
            let meta = engine.alloc_region(META_LEN, Access::ReadOnly)?;
            let inner = Inner {
                hostname: String::new(),
                engine,
                meta,
                local: Mutex::new(Local::default()),
                remotes: Mutex::new(HashMap::new()),
                scratch: Mutex::new(None),
                batches: Mutex::new(HashMap::new()),
                next_batch: AtomicI64::new(1),
                timeout,
            };
            inner.publish(&mut inner.local.lock())?;
            Ok(inner)
        });
        match res {
            Ok(mut inner) => {
                let port = inner.engine.listen_addr().port();
                inner.hostname = if host.contains(':') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                };
                *self.inner.write() = Some(Arc::new(inner));
                0
            }
            Err(e) => self.fail(py, "initialize", e, -1),
        }
    }

    /// Same as `initialize`; `metadata_type` must be `"p2p"` or empty.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type=""))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
        metadata_type: &str,
    ) -> i64 {
        self.last_error.clear();
        if !metadata_type.is_empty()
            && !metadata_type.eq_ignore_ascii_case("p2p")
            && !metadata_type.eq_ignore_ascii_case("P2PHANDSHAKE")
        {
            return self.fail(
                py,
                "initialize_ext",
                MError::Other(format!("metadata type {metadata_type:?} unsupported")),
                -1,
            );
        }
        self.initialize(py, local_hostname, metadata_server, protocol, device_name)
    }

    /// The port peers reach this engine on (`"host:port"` is its session name), or -1.
    fn get_rpc_port(&self) -> i64 {
        self.inner
            .read()
            .as_ref()
            .map_or(-1, |i| i64::from(i.engine.listen_addr().port()))
    }

    /// This engine's session name, `"host:rpc_port"` (empty before `initialize`).
    fn get_local_hostname(&self) -> String {
        self.inner
            .read()
            .as_ref()
            .map_or(String::new(), |i| i.hostname.clone())
    }

    /// The transport of the first connected peer (`"tcp"` or `"shm"`); `"auto"` before any
    /// peer, None before `initialize`.
    #[getter]
    fn transport(&self) -> Option<&'static str> {
        self.inner
            .read()
            .as_ref()
            .map(|i| match i.engine.peers().first() {
                Some(p) => transport_name(p.transport()),
                None => "auto",
            })
    }

    /// Why the engine's latest call that can fail failed (kvwire extension): empty when it
    /// succeeded, as every such method clears it when it starts (or when none was made yet).
    fn last_error(&self) -> String {
        self.last_error.get()
    }

    /// Registers `[buffer_addr, buffer_addr+capacity)` (must be mapped read+write; the caller
    /// keeps it alive until `unregister_memory`). Returns 0 or -1.
    #[pyo3(signature = (buffer_addr, capacity, location="*"))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: u64,
        capacity: u64,
        location: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = location;
        self.run(
            py,
            "register_memory",
            |i| i.register(buffer_addr, capacity, None),
            |_| 0,
        )
    }

    /// Unregisters the buffer registered at `buffer_addr`. Returns 0 or -1.
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: u64) -> i64 {
        self.last_error.clear();
        self.run(
            py,
            "unregister_memory",
            |i| i.unregister(buffer_addr),
            |_| 0,
        )
    }

    /// Registers several buffers; stops at the first failure. Returns 0 or -1.
    #[pyo3(signature = (buffer_addresses, capacities, location="*"))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: Vec<u64>,
        capacities: Vec<u64>,
        location: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = location;
        if buffer_addresses.len() != capacities.len() {
            return self.fail(
                py,
                "batch_register_memory",
                MError::Other("addresses and capacities differ in count".into()),
                -1,
            );
        }
        self.run(
            py,
            "batch_register_memory",
            |i| {
                for (&a, &c) in buffer_addresses.iter().zip(&capacities) {
                    i.register(a, c, None)?;
                }
                Ok(())
            },
            |_| 0,
        )
    }

    /// Unregisters several buffers. Returns 0 or -1 (after trying them all).
    fn batch_unregister_memory(&self, py: Python<'_>, buffer_addresses: Vec<u64>) -> i64 {
        self.last_error.clear();
        self.run(
            py,
            "batch_unregister_memory",
            |i| {
                let mut first = None;
                for &a in &buffer_addresses {
                    if let Err(e) = i.unregister(a) {
                        first.get_or_insert(e);
                    }
                }
                first.map_or(Ok(()), Err)
            },
            |_| 0,
        )
    }

    /// Allocates and registers a zeroed buffer; returns its address, or 0 on failure.
    fn allocate_managed_buffer(&self, py: Python<'_>, length: usize) -> u64 {
        self.last_error.clear();
        let r = self.get().and_then(|i| {
            let m = ManagedBuffer::new(length).map_err(MError::Other)?;
            let addr = m.addr();
            let len = m.len() as u64;
            i.register(addr, len, Some(m))?;
            Ok(addr)
        });
        match r {
            Ok(a) => a,
            Err(e) => {
                self.fail(py, "allocate_managed_buffer", e, 0);
                0
            }
        }
    }

    /// Unregisters and frees a managed buffer. Returns 0 or -1.
    fn free_managed_buffer(&self, py: Python<'_>, buffer_addr: u64, length: usize) -> i64 {
        self.last_error.clear();
        self.run(
            py,
            "free_managed_buffer",
            |i| {
                let known = i.local.lock().managed.get(&buffer_addr).map(|m| m.len());
                match known {
                    Some(l) if l == length => i.unregister(buffer_addr),
                    Some(l) => Err(MError::Other(format!(
                        "managed buffer {buffer_addr:#x} has length {l}, not {length}"
                    ))),
                    None => Err(MError::Other(format!(
                        "no managed buffer at {buffer_addr:#x}"
                    ))),
                }
            },
            |_| 0,
        )
    }

    /// Copies `length` bytes of `src` into our registered memory at `dest_address`. 0 or -1.
    fn write_bytes_to_buffer(
        &self,
        py: Python<'_>,
        dest_address: u64,
        src: &[u8],
        length: usize,
    ) -> i64 {
        self.last_error.clear();
        if length > src.len() {
            return self.fail(
                py,
                "write_bytes_to_buffer",
                MError::Other(format!("length {length} > {} bytes given", src.len())),
                -1,
            );
        }
        self.run(
            py,
            "write_bytes_to_buffer",
            |i| {
                let (h, off) = i.local_op(dest_address, length as u64)?;
                Ok(i.engine.local_write(h, off, &src[..length])?)
            },
            |_| 0,
        )
    }

    /// Reads `length` bytes of our registered memory at `source_address` (raises
    /// `kvwire.InvalidArgumentError` outside registered memory).
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: u64,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let inner = self
            .get()
            .map_err(|e| crate::errors::KvwireError::new_err(e.to_string()))?;
        let (h, off) = inner
            .local_op(source_address, length as u64)
            .map_err(|e| crate::errors::invalid(e.to_string()))?;
        let mut out = vec![0u8; length];
        inner
            .engine
            .local_read(h, off, &mut out)
            .map_err(crate::errors::to_py)?;
        Ok(PyBytes::new(py, &out))
    }

    /// Address of the first (lowest) buffer the peer `segment_name` registered, or 0.
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: &str) -> u64 {
        self.last_error.clear();
        let r = self.get().and_then(|i| {
            py.detach(|| {
                let r = i.remote(segment_name)?;
                let map = i.fetch_map(&r.peer)?;
                map.first()
                    .map(|e| e.base)
                    .ok_or_else(|| MError::Other("peer registered no buffer".into()))
            })
        });
        match r {
            Ok(a) => a,
            Err(e) => {
                self.fail(py, "get_first_buffer_address", e, 0);
                0
            }
        }
    }

    /// `opcode` 0 = read, 1 = write (`kvwire.mooncake.TransferOpcode`). `notify` is not
    /// supported (-1).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify=None, transport_hint=""))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        opcode: i64,
        notify: Option<Bound<'_, PyAny>>,
        transport_hint: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = transport_hint;
        if notify.is_some() {
            return self.fail(
                py,
                "transfer_sync",
                MError::Other("notify is not supported".into()),
                -1,
            );
        }
        let write = match opcode {
            0 => false,
            1 => true,
            o => {
                return self.fail(
                    py,
                    "transfer_sync",
                    MError::Other(format!("unknown opcode {o}")),
                    -1,
                )
            }
        };
        let x = Xfer {
            target: target_hostname,
            locals: &[buffer],
            remotes: &[peer_buffer_address],
            lens: &[length],
            write,
        };
        self.transfer(py, "transfer_sync", Mode::Sync, x)
    }

    /// 1 completed, 0 running, -1 failed, -2 timed out (or unknown id: -1). A finished batch
    /// is forgotten once its status has been returned.
    fn transfer_check_status(&self, py: Python<'_>, batch_id: i64) -> i64 {
        self.last_error.clear();
        let inner = match self.get() {
            Ok(i) => i,
            Err(e) => return self.fail(py, "transfer_check_status", e, -1),
        };
        let mut batches = inner.batches.lock();
        let Some(bs) = batches.get(&batch_id) else {
            drop(batches);
            return self.fail(
                py,
                "transfer_check_status",
                MError::Other(format!("unknown batch id {batch_id}")),
                -1,
            );
        };
        let mut code = 1;
        for b in bs {
            match b.poll() {
                None => return 0,
                Some(Ok(_)) => {}
                Some(Err(Error::Timeout)) => code = code.min(-2),
                Some(Err(_)) => code = -1,
            }
        }
        batches.remove(&batch_id);
        drop(batches);
        if code < 0 {
            self.fail(
                py,
                "transfer_check_status",
                MError::Other(format!("batch {batch_id} failed")),
                code,
            )
        } else {
            code
        }
    }

    /// Waits (GIL released) for every batch id; 0 if all succeeded, -1 otherwise.
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<i64>) -> i64 {
        self.last_error.clear();
        self.run(
            py,
            "get_batch_transfer_status",
            |i| {
                let mut taken = Vec::new();
                {
                    let mut m = i.batches.lock();
                    for id in &batch_ids {
                        let b = m
                            .remove(id)
                            .ok_or_else(|| MError::Other(format!("unknown batch id {id}")))?;
                        taken.extend(b);
                    }
                }
                let mut first = None;
                for b in taken {
                    if let Err(e) = b.wait() {
                        first.get_or_insert(MError::from(e));
                    }
                }
                first.map_or(Ok(()), Err)
            },
            |_| 0,
        )
    }

    /// Shuts the engine down (kvwire extension); later calls fail.
    fn shutdown(&self, py: Python<'_>) {
        if let Some(i) = self.inner.write().take() {
            py.detach(|| i.engine.shutdown());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames() {
        assert_eq!(
            split_hostname("127.0.0.1"),
            ("127.0.0.1".into(), "127.0.0.1:0".into())
        );
        assert_eq!(
            split_hostname("127.0.0.1:1234"),
            ("127.0.0.1".into(), "127.0.0.1:1234".into())
        );
        assert_eq!(
            split_hostname("localhost"),
            ("localhost".into(), "localhost:0".into())
        );
        assert_eq!(split_hostname("::1"), ("::1".into(), "[::1]:0".into()));
        assert_eq!(split_hostname("[::1]:5"), ("::1".into(), "[::1]:5".into()));
    }
}
