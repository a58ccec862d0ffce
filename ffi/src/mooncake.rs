//! `kvwire.mooncake.TransferEngine`: the method names, signatures and return conventions of
//! `mooncake.engine.TransferEngine` (what vLLM's MooncakeConnector and SGLang call), over a
//! kvwire engine.
//!
//! Mooncake names remote memory by raw virtual address; kvwire peers only see region ids. So
//! each drop-in engine publishes an **address map** — `(base address, length, region id)` of
//! every buffer it registered — in a small read-only metadata region of its own, which peers
//! read over kvwire itself (an ordinary engine read) when they meet an address they cannot
//! place. An address (range) outside the peer's registered buffers is refused, as is a local
//! buffer outside ours.
//!
//! Metadata region layout (little endian): a 32-byte header `magic "KVWMOON1" | seq u64 |
//! count u32 | reserved u32 | reserved u64`, then `count` entries `base u64 | len u64 |
//! region index u32 | region generation u32`. The writer makes `seq` odd while it rewrites the
//! entries and even afterwards; a reader accepts a snapshot only if `seq` was even and unchanged
//! across the read of the entries and a re-read of the header.
//!
//! Return conventions follow Mooncake: `0` success, negative failure (the reason is logged on
//! the `kvwire.mooncake` Python logger and kept for [`TransferEngine::last_error`]).
//!
//! `last_error` describes the outcome of the engine's latest call that can fail, from whichever
//! thread: every such method clears the reason when it starts and sets it when it fails, so it
//! is empty after a success (and a failure is not reported again after a later success). With
//! calls running on several threads at once it is the one that finished last.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvwire_transfer::{
    Access, Batch, Engine, EngineConfig, Error, Op, Peer, RegionHandle, RegionId, TransportKind,
};
use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::engine::{resolve_addr, transport_name};
use crate::rawmem::{self, ManagedBuffer};

const MAGIC: &[u8; 8] = b"KVWMOON1";
const HEADER: usize = 32;
const ENTRY: usize = 24;
/// Most buffers one drop-in engine can publish.
pub const MAX_ENTRIES: usize = 16_384;
/// Size of the metadata region (identifies it among a peer's read-only regions).
pub const META_LEN: usize = HEADER + MAX_ENTRIES * ENTRY;
/// 1 ms polls waiting for the peer's region announcements to catch up with its address map.
const REGION_SYNC_POLLS: usize = 2000;
/// Snapshot attempts before giving up on a peer's address map (it is being rewritten).
const META_RETRIES: usize = 50;

/// Why a drop-in call failed (turned into a negative return code and a log line).
#[derive(Debug)]
enum MError {
    NotInitialized,
    Engine(Error),
    Other(String),
}

impl std::fmt::Display for MError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MError::NotInitialized => write!(f, "engine not initialized (call initialize first)"),
            MError::Engine(e) => write!(f, "{e}"),
            MError::Other(s) => write!(f, "{s}"),
        }
    }
}

impl From<Error> for MError {
    fn from(e: Error) -> Self {
        MError::Engine(e)
    }
}

/// One entry of an address map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MapEntry {
    base: u64,
    len: u64,
    id: RegionId,
}

/// Finds the entry holding `[addr, addr+len)`; `map` is sorted by base.
fn lookup(map: &[MapEntry], addr: u64, len: u64) -> Option<(MapEntry, u64)> {
    let i = map.partition_point(|e| e.base <= addr);
    let e = *map.get(i.checked_sub(1)?)?;
    let off = addr - e.base;
    let end = off.checked_add(len)?;
    (end <= e.len).then_some((e, off))
}

fn encode_entries(entries: &[MapEntry]) -> Vec<u8> {
    let mut v = Vec::with_capacity(entries.len() * ENTRY);
    for e in entries {
        v.extend_from_slice(&e.base.to_le_bytes());
        v.extend_from_slice(&e.len.to_le_bytes());
        v.extend_from_slice(&e.id.index.to_le_bytes());
        v.extend_from_slice(&e.id.generation.to_le_bytes());
    }
    v
}

fn header(seq: u64, count: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h[16..20].copy_from_slice(&count.to_le_bytes());
    h
}

/// Parses a header: `(seq, count)`.
fn parse_header(b: &[u8]) -> Result<(u64, usize), String> {
    if b.len() < HEADER || &b[..8] != MAGIC {
        return Err("peer's metadata region has no kvwire address map".into());
    }
    let seq = u64::from_le_bytes(b[8..16].try_into().map_err(|_| "short header")?);
    let count = u32::from_le_bytes(b[16..20].try_into().map_err(|_| "short header")?) as usize;
    if count > MAX_ENTRIES {
        return Err(format!(
            "peer's address map claims {count} entries (max {MAX_ENTRIES})"
        ));
    }
    Ok((seq, count))
}

fn parse_entries(b: &[u8], count: usize) -> Result<Vec<MapEntry>, String> {
    if b.len() < count * ENTRY {
        return Err("truncated address map".into());
    }
    let mut v = Vec::with_capacity(count);
    for c in b.chunks_exact(ENTRY).take(count) {
        let f8 = |r: std::ops::Range<usize>| -> u64 {
            c[r].iter()
                .rev()
                .fold(0u64, |a, &x| (a << 8) | u64::from(x))
        };
        let base = f8(0..8);
        let len = f8(8..16);
        if base.checked_add(len).is_none() {
            return Err(format!("address map entry {base:#x}+{len} overflows"));
        }
        v.push(MapEntry {
            base,
            len,
            id: RegionId {
                index: f8(16..20) as u32,
                generation: f8(20..24) as u32,
            },
        });
    }
    v.sort_by_key(|e| e.base);
    Ok(v)
}

/// Our registered buffers.
#[derive(Default)]
struct Local {
    /// base address → (handle, length).
    regions: BTreeMap<u64, (RegionHandle, u64)>,
    managed: HashMap<u64, ManagedBuffer>,
    seq: u64,
}

/// A peer we transfer to, with its address map.
struct Remote {
    peer: Peer,
    map: RwLock<Vec<MapEntry>>,
}

struct Inner {
    engine: Engine,
    hostname: String,
    meta: RegionHandle,
    local: Mutex<Local>,
    remotes: Mutex<HashMap<String, Arc<Remote>>>,
    /// Serialises address-map reads (they share one scratch region).
    scratch: Mutex<Option<RegionHandle>>,
    batches: Mutex<HashMap<i64, Vec<Batch>>>,
    next_batch: AtomicI64,
    timeout: Duration,
}

impl Inner {
    /// Rewrites our address map (call with `local` locked).
    fn publish(&self, local: &mut Local) -> Result<(), MError> {
        let entries: Vec<MapEntry> = local
            .regions
            .iter()
            .map(|(&base, &(h, len))| MapEntry {
                base,
                len,
                id: h.id(),
            })
            .collect();
        if entries.len() > MAX_ENTRIES {
            return Err(MError::Other(format!(
                "more than {MAX_ENTRIES} registered buffers"
            )));
        }
        local.seq += 1; // odd: being rewritten
        self.engine
            .local_write(self.meta, 0, &header(local.seq, 0))?;
        self.engine
            .local_write(self.meta, HEADER as u64, &encode_entries(&entries))?;
        local.seq += 1; // even: stable
        self.engine
            .local_write(self.meta, 0, &header(local.seq, entries.len() as u32))?;
        Ok(())
    }

    fn register(&self, addr: u64, len: u64, managed: Option<ManagedBuffer>) -> Result<(), MError> {
        let mut local = self.local.lock();
        let end = addr
            .checked_add(len)
            .ok_or_else(|| MError::Other(format!("{addr:#x} + {len} overflows")))?;
        if let Some((&b, &(_, l))) = local.regions.range(..end).next_back() {
            if b + l > addr {
                return Err(MError::Other(format!(
                    "buffer {addr:#x}+{len} overlaps the registered buffer {b:#x}+{l}"
                )));
            }
        }
        let h = rawmem::register(&self.engine, addr, len, Access::ReadWrite)?;
        local.regions.insert(addr, (h, len));
        if let Some(m) = managed {
            local.managed.insert(addr, m);
        }
        if let Err(e) = self.publish(&mut local) {
            local.regions.remove(&addr);
            let _ = self.engine.unregister(h);
            return Err(e);
        }
        Ok(())
    }

    fn unregister(&self, addr: u64) -> Result<(), MError> {
        let mut local = self.local.lock();
        let (h, _) = local
            .regions
            .remove(&addr)
            .ok_or_else(|| MError::Other(format!("no buffer registered at {addr:#x}")))?;
        self.engine.unregister(h)?;
        local.managed.remove(&addr);
        self.publish(&mut local)
    }

    fn local_op(&self, addr: u64, len: u64) -> Result<(RegionHandle, u64), MError> {
        let local = self.local.lock();
        if let Some((&b, &(h, l))) = local.regions.range(..=addr).next_back() {
            let off = addr - b;
            if off.checked_add(len).is_some_and(|e| e <= l) {
                return Ok((h, off));
            }
        }
        Err(MError::Engine(Error::InvalidArgument(format!(
            "local buffer {addr:#x}+{len} is not inside a registered buffer"
        ))))
    }

    /// The peer named `host:port`, connected on first use (or after it died).
    fn remote(&self, target: &str) -> Result<Arc<Remote>, MError> {
        if let Some(r) = self.remotes.lock().get(target) {
            if r.peer.is_alive() {
                return Ok(r.clone());
            }
        }
        let addr = resolve_addr(target).map_err(MError::Other)?;
        let peer = self.engine.connect(addr)?;
        let r = Arc::new(Remote {
            peer,
            map: RwLock::new(Vec::new()),
        });
        r.map.write().clone_from(&self.fetch_map(&r.peer)?);
        self.remotes.lock().insert(target.to_string(), r.clone());
        Ok(r)
    }

    /// Reads the peer's address map, then waits (bounded) until the engine's view of the
    /// peer's regions includes every region the map names: the map and the region
    /// announcements travel separately, so a buffer the peer registered just now may be in
    /// its map before its announcement reached us.
    fn fetch_map(&self, peer: &Peer) -> Result<Vec<MapEntry>, MError> {
        let map = self.read_map(peer)?;
        for _ in 0..REGION_SYNC_POLLS {
            let known: std::collections::HashSet<RegionId> =
                peer.regions().into_iter().map(|r| r.id).collect();
            if map.iter().all(|e| known.contains(&e.id)) || !peer.is_alive() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(map)
    }

    /// Reads a consistent snapshot of the peer's address map.
    fn read_map(&self, peer: &Peer) -> Result<Vec<MapEntry>, MError> {
        let meta = peer
            .regions()
            .into_iter()
            .find(|r| r.access == Access::ReadOnly && r.len == META_LEN as u64)
            .ok_or_else(|| {
                MError::Other(
                    "peer offers no kvwire address map (not a kvwire mooncake engine?)".into(),
                )
            })?;
        let mut scratch = self.scratch.lock();
        let s = match *scratch {
            Some(s) => s,
            None => {
                let s = self.engine.alloc_region(META_LEN, Access::Local)?;
                *scratch = Some(s);
                s
            }
        };
        let read = |len: u64| -> Result<Vec<u8>, MError> {
            let op = Op {
                local: s,
                local_offset: 0,
                remote: meta.id,
                remote_offset: 0,
                len,
            };
            self.engine.read(peer, &[op], Some(self.timeout))?.wait()?;
            let mut out = vec![0u8; len as usize];
            self.engine.local_read(s, 0, &mut out)?;
            Ok(out)
        };
        for _ in 0..META_RETRIES {
            let (seq, count) = parse_header(&read(HEADER as u64)?).map_err(MError::Other)?;
            if seq % 2 == 1 {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            let all = read((HEADER + count * ENTRY) as u64)?;
            let (seq2, count2) = parse_header(&all).map_err(MError::Other)?;
            let (seq3, _) = parse_header(&read(HEADER as u64)?).map_err(MError::Other)?;
            if seq2 == seq && seq3 == seq && count2 == count {
                return parse_entries(&all[HEADER..], count).map_err(MError::Other);
            }
        }
        Err(MError::Engine(Error::Timeout))
    }

    /// Maps a peer address range to `(region id, offset)`, refreshing the map once on a miss.
    fn remote_op(&self, r: &Remote, addr: u64, len: u64) -> Result<(RegionId, u64), MError> {
        if let Some((e, off)) = lookup(&r.map.read(), addr, len) {
            return Ok((e.id, off));
        }
        let fresh = self.fetch_map(&r.peer)?;
        let found = lookup(&fresh, addr, len);
        *r.map.write() = fresh;
        found.map(|(e, off)| (e.id, off)).ok_or_else(|| {
            MError::Engine(Error::InvalidArgument(format!(
                "peer address {addr:#x}+{len} is not inside a buffer the peer registered"
            )))
        })
    }

    /// Builds and submits one batch.
    fn submit(
        &self,
        target: &str,
        locals: &[u64],
        remotes: &[u64],
        lens: &[u64],
        write: bool,
    ) -> Result<Batch, MError> {
        if locals.len() != remotes.len() || locals.len() != lens.len() {
            return Err(MError::Other(format!(
                "buffers, peer addresses and lengths differ in count ({}, {}, {})",
                locals.len(),
                remotes.len(),
                lens.len()
            )));
        }
        let r = self.remote(target)?;
        let mut retried = false;
        loop {
            let ops = self.ops(&r, locals, remotes, lens)?;
            let res = if write {
                self.engine.write(&r.peer, &ops, None, Some(self.timeout))
            } else {
                self.engine.read(&r.peer, &ops, Some(self.timeout))
            };
            match res {
                Ok(b) => return Ok(b),
                // The peer re-registered its buffers since we read its map (e.g. vLLM's
                // unregister_kv_caches/restore_kv_caches around sleep mode): same addresses,
                // new region ids. Read the map again and rebuild the batch, once.
                Err(Error::StaleRegion(_) | Error::UnknownRegion(_)) if !retried => {
                    retried = true;
                    let fresh = self.fetch_map(&r.peer)?;
                    *r.map.write() = fresh;
                }
                Err(e) => {
                    self.forget_if_stale(target, &e);
                    return Err(e.into());
                }
            }
        }
    }

    /// Maps every (local, peer, length) triple to an engine op; zero lengths are skipped.
    fn ops(
        &self,
        r: &Remote,
        locals: &[u64],
        remotes: &[u64],
        lens: &[u64],
    ) -> Result<Vec<Op>, MError> {
        let mut ops = Vec::with_capacity(locals.len());
        for ((&l, &p), &n) in locals.iter().zip(remotes).zip(lens) {
            if n == 0 {
                continue;
            }
            let (local, local_offset) = self.local_op(l, n)?;
            let (remote, remote_offset) = self.remote_op(r, p, n)?;
            ops.push(Op {
                local,
                local_offset,
                remote,
                remote_offset,
                len: n,
            });
        }
        Ok(ops)
    }

    /// Drops a cached peer whose map went stale or whose connection died.
    fn forget_if_stale(&self, target: &str, e: &Error) {
        if matches!(
            e,
            Error::StaleRegion(_) | Error::UnknownRegion(_) | Error::PeerDead(_)
        ) {
            self.remotes.lock().remove(target);
        }
    }
}

/// One transfer request of the Python API: parallel lists of local addresses, peer addresses
/// and lengths towards one peer.
struct Xfer<'a> {
    target: &'a str,
    locals: &'a [u64],
    remotes: &'a [u64],
    lens: &'a [u64],
    write: bool,
}

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
struct LastError(Mutex<String>);

impl LastError {
    /// A call that can fail starts.
    fn clear(&self) {
        self.0.lock().clear();
    }

    /// It failed.
    fn set(&self, msg: String) {
        *self.0.lock() = msg;
    }

    fn get(&self) -> String {
        self.0.lock().clone()
    }
}

/// Drop-in for `mooncake.engine.TransferEngine` (P2PHANDSHAKE mode: a peer is named by its
/// `"host:rpc_port"`).
#[pyclass(module = "kvwire.mooncake", frozen)]
pub struct TransferEngine {
    inner: RwLock<Option<Arc<Inner>>>,
    last_error: LastError,
}

impl TransferEngine {
    fn get(&self) -> Result<Arc<Inner>, MError> {
        self.inner.read().clone().ok_or(MError::NotInitialized)
    }

    /// Records and logs a failure; returns `code`.
    fn fail(&self, py: Python<'_>, what: &str, e: MError, code: i64) -> i64 {
        let msg = format!("{what}: {e}");
        if let Ok(logging) = py.import("logging") {
            if let Ok(logger) = logging.call_method1("getLogger", ("kvwire.mooncake",)) {
                let _ = logger.call_method1("warning", (msg.clone(),));
            }
        }
        self.last_error.set(msg);
        code
    }

    fn run<T>(
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

    fn sync(&self, py: Python<'_>, what: &str, x: Xfer<'_>) -> i64 {
        let target = x.target;
        self.run(
            py,
            what,
            |inner| {
                let b = inner.submit(x.target, x.locals, x.remotes, x.lens, x.write)?;
                b.wait().map_err(|e| {
                    inner.forget_if_stale(target, &e);
                    MError::from(e)
                })
            },
            |_| 0,
        )
    }

    fn submit_async(&self, py: Python<'_>, what: &str, x: Xfer<'_>) -> i64 {
        let r = self.get().and_then(|inner| {
            py.detach(|| {
                inner
                    .submit(x.target, x.locals, x.remotes, x.lens, x.write)
                    .map(|b| (inner.clone(), b))
            })
        });
        match r {
            Ok((inner, b)) => {
                let id = inner.next_batch.fetch_add(1, Ordering::Relaxed);
                inner.batches.lock().insert(id, vec![b]);
                id
            }
            Err(e) => self.fail(py, what, e, -1),
        }
    }
}

#[pymethods]
impl TransferEngine {
    #[new]
    fn new() -> Self {
        TransferEngine {
            inner: RwLock::new(None),
            last_error: LastError::default(),
        }
    }

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

    /// Writes `length` bytes from our `buffer` to the peer's `peer_buffer_address`; blocks
    /// (GIL released) until every byte landed. 0 or -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint=""))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = transport_hint;
        self.sync(
            py,
            "transfer_sync_write",
            Xfer {
                target: target_hostname,
                locals: &[buffer],
                remotes: &[peer_buffer_address],
                lens: &[length],
                write: true,
            },
        )
    }

    /// Reads `length` bytes of the peer's `peer_buffer_address` into our `buffer`. 0 or -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint=""))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = transport_hint;
        self.sync(
            py,
            "transfer_sync_read",
            Xfer {
                target: target_hostname,
                locals: &[buffer],
                remotes: &[peer_buffer_address],
                lens: &[length],
                write: false,
            },
        )
    }

    /// Many writes to one peer as one batch (coalesced where adjacent). 0 or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = transport_hint;
        self.sync(
            py,
            "batch_transfer_sync_write",
            Xfer {
                target: target_hostname,
                locals: &buffers,
                remotes: &peer_buffer_addresses,
                lens: &lengths,
                write: true,
            },
        )
    }

    /// Many reads from one peer as one batch. 0 or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = transport_hint;
        self.sync(
            py,
            "batch_transfer_sync_read",
            Xfer {
                target: target_hostname,
                locals: &buffers,
                remotes: &peer_buffer_addresses,
                lens: &lengths,
                write: false,
            },
        )
    }

    /// Submits a batch of writes; returns a batch id (> 0) or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = transport_hint;
        self.submit_async(
            py,
            "batch_transfer_async_write",
            Xfer {
                target: target_hostname,
                locals: &buffers,
                remotes: &peer_buffer_addresses,
                lens: &lengths,
                write: true,
            },
        )
    }

    /// Submits a batch of reads; returns a batch id (> 0) or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = transport_hint;
        self.submit_async(
            py,
            "batch_transfer_async_read",
            Xfer {
                target: target_hostname,
                locals: &buffers,
                remotes: &peer_buffer_addresses,
                lens: &lengths,
                write: false,
            },
        )
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
        self.sync(py, "transfer_sync", x)
    }

    /// Submits one write; returns a batch id (> 0) or -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint=""))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> i64 {
        self.last_error.clear();
        let _ = transport_hint;
        self.submit_async(
            py,
            "transfer_submit_write",
            Xfer {
                target: target_hostname,
                locals: &[buffer],
                remotes: &[peer_buffer_address],
                lens: &[length],
                write: true,
            },
        )
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

    #[test]
    fn lookup_bounds() {
        let id = |i| RegionId {
            index: i,
            generation: 1,
        };
        let map = vec![
            MapEntry {
                base: 100,
                len: 50,
                id: id(1),
            },
            MapEntry {
                base: 1000,
                len: 10,
                id: id(2),
            },
        ];
        assert_eq!(
            lookup(&map, 100, 50).map(|(e, o)| (e.id, o)),
            Some((id(1), 0))
        );
        assert_eq!(
            lookup(&map, 120, 30).map(|(e, o)| (e.id, o)),
            Some((id(1), 20))
        );
        assert!(lookup(&map, 120, 31).is_none());
        assert!(lookup(&map, 99, 1).is_none());
        assert!(lookup(&map, 150, 1).is_none());
        assert_eq!(
            lookup(&map, 1009, 1).map(|(e, o)| (e.id, o)),
            Some((id(2), 9))
        );
        assert!(lookup(&map, u64::MAX, 2).is_none());
        assert!(lookup(&[], 0, 1).is_none());
    }

    #[test]
    fn map_roundtrip_and_bad_input() {
        let e = vec![MapEntry {
            base: 4096,
            len: 8192,
            id: RegionId {
                index: 3,
                generation: 7,
            },
        }];
        let mut b = header(2, 1).to_vec();
        b.extend(encode_entries(&e));
        let (seq, count) = parse_header(&b).unwrap();
        assert_eq!((seq, count), (2, 1));
        assert_eq!(parse_entries(&b[HEADER..], count).unwrap(), e);
        assert!(parse_header(&[0u8; HEADER]).is_err());
        assert!(parse_header(&b[..10]).is_err());
        assert!(parse_header(&header(0, (MAX_ENTRIES + 1) as u32)).is_err());
        assert!(parse_entries(&b[HEADER..HEADER + 5], 1).is_err());
        let bad = encode_entries(&[MapEntry {
            base: u64::MAX,
            len: 2,
            id: RegionId {
                index: 0,
                generation: 0,
            },
        }]);
        assert!(parse_entries(&bad, 1).is_err());
    }
}
