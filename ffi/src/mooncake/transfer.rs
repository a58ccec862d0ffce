//! The transfer calls: one generic path (sync or async, write or read, one op or a batch) and
//! the table that makes `TransferEngine`'s seven transfer methods from it.

use std::sync::atomic::Ordering;

use kvwire_transfer::{Batch, Error, Op};
use pyo3::prelude::*;
use pyo3::PyClassInitializer;

use super::engine::TransferEngineBase;
use super::inner::{Inner, MError};
use super::segments::Remote;

impl Inner {
    /// Builds and submits one batch.
    pub(super) fn submit(
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
    pub(super) fn ops(
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
    pub(super) fn forget_if_stale(&self, target: &str, e: &Error) {
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
pub(super) struct Xfer<'a> {
    pub(super) target: &'a str,
    pub(super) locals: &'a [u64],
    pub(super) remotes: &'a [u64],
    pub(super) lens: &'a [u64],
    pub(super) write: bool,
}

/// How a transfer call completes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Mode {
    /// Blocks (GIL released) until every byte landed: 0 or -1.
    Sync,
    /// Submits and returns a batch id (> 0) for `transfer_check_status` /
    /// `get_batch_transfer_status`, or -1.
    Async,
}

impl TransferEngineBase {
    /// The one path of every transfer call: clears the last error, submits `x`, then waits
    /// (`Sync`) or files the batch under a new id (`Async`).
    pub(super) fn transfer(&self, py: Python<'_>, what: &str, mode: Mode, x: Xfer<'_>) -> i64 {
        self.last_error.clear();
        match mode {
            Mode::Sync => self.sync(py, what, x),
            Mode::Async => self.submit_async(py, what, x),
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

/// Which way a transfer call moves bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// Ours to the peer's.
    Write,
    /// The peer's to ours.
    Read,
}

/// The addresses or lengths of a call: one (`u64`) or a list (`Vec<u64>`).
trait Addrs {
    fn addrs(&self) -> &[u64];
}

impl Addrs for u64 {
    fn addrs(&self) -> &[u64] {
        std::slice::from_ref(self)
    }
}

impl Addrs for Vec<u64> {
    fn addrs(&self) -> &[u64] {
        self
    }
}

/// Makes `TransferEngine` from the table of transfer calls: per row, the Python name, the
/// names of its local-address, peer-address and length arguments and their type (`u64` for
/// one op, `Vec<u64>` for a batch), [`Mode`] and [`Dir`]. Every call takes
/// `(target_hostname, <the three>, transport_hint="")`; `transport_hint` is accepted and
/// ignored.
macro_rules! transfer_calls {
    ($(
        $(#[$doc:meta])*
        fn $name:ident($local:ident, $remote:ident, $len:ident: $ty:ty) => $mode:ident, $dir:ident;
    )*) => {
        /// Drop-in for `mooncake.engine.TransferEngine` (P2PHANDSHAKE mode: a peer is named by
        /// its `"host:rpc_port"`): the transfer calls here, everything else inherited from
        /// [`TransferEngineBase`].
        #[pyclass(module = "kvwire.mooncake", extends = TransferEngineBase, frozen)]
        pub struct TransferEngine;

        #[pymethods]
        impl TransferEngine {
            #[new]
            fn new() -> PyClassInitializer<Self> {
                PyClassInitializer::from(TransferEngineBase::default())
                    .add_subclass(TransferEngine)
            }

            $(
                $(#[$doc])*
                #[pyo3(signature = (target_hostname, $local, $remote, $len, transport_hint=""))]
                fn $name(
                    slf: &Bound<'_, Self>,
                    target_hostname: &str,
                    $local: $ty,
                    $remote: $ty,
                    $len: $ty,
                    transport_hint: &str,
                ) -> i64 {
                    let _ = transport_hint;
                    let x = Xfer {
                        target: target_hostname,
                        locals: $local.addrs(),
                        remotes: $remote.addrs(),
                        lens: $len.addrs(),
                        write: matches!(Dir::$dir, Dir::Write),
                    };
                    let base = slf.as_super().get();
                    base.transfer(slf.py(), stringify!($name), Mode::$mode, x)
                }
            )*
        }
    };
}

transfer_calls! {
    /// Writes `length` bytes from our `buffer` to the peer's `peer_buffer_address`; blocks
    /// (GIL released) until every byte landed. 0 or -1.
    fn transfer_sync_write(buffer, peer_buffer_address, length: u64) => Sync, Write;
    /// Reads `length` bytes of the peer's `peer_buffer_address` into our `buffer`. 0 or -1.
    fn transfer_sync_read(buffer, peer_buffer_address, length: u64) => Sync, Read;
    /// Many writes to one peer as one batch (coalesced where adjacent). 0 or -1.
    fn batch_transfer_sync_write(buffers, peer_buffer_addresses, lengths: Vec<u64>) => Sync, Write;
    /// Many reads from one peer as one batch. 0 or -1.
    fn batch_transfer_sync_read(buffers, peer_buffer_addresses, lengths: Vec<u64>) => Sync, Read;
    /// Submits a batch of writes; returns a batch id (> 0) or -1.
    fn batch_transfer_async_write(buffers, peer_buffer_addresses, lengths: Vec<u64>) => Async, Write;
    /// Submits a batch of reads; returns a batch id (> 0) or -1.
    fn batch_transfer_async_read(buffers, peer_buffer_addresses, lengths: Vec<u64>) => Async, Read;
    /// Submits one write; returns a batch id (> 0) or -1.
    fn transfer_submit_write(buffer, peer_buffer_address, length: u64) => Async, Write;
}
