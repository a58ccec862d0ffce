//! Submitting batches: every op checked as the caller wrote it, then coalesced and handed to
//! the peer's transport.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::core::Engine;
use super::peer::Peer;
use crate::batch::{Batch, Posted, Xfer, DEFAULT_WAIT_SPIN, MAX_WAIT_SPIN};
use crate::coalesce::coalesce;
use crate::error::Error;
use crate::metrics::{self};
use crate::region::{check_bounds, RegionEntry};
use crate::types::{Dir, Op, RegionHandle, TransportKind};
use crate::wire::{self};

impl Engine {
    /// Submits a batch of writes (local → remote), with an optional notification delivered to
    /// the target after every byte landed. One completion for the whole batch.
    ///
    /// Notification guarantees, on every transport:
    /// * a notification is delivered at most once, and only after every byte of its batch
    ///   landed; a batch with a refused slice never delivers it;
    /// * when the batch completes successfully, its notification is already queued at the
    ///   target ([`Engine::notifications`]). Hence notifications follow completion order: if
    ///   batch A completed before batch B was submitted (to the same target engine, from any
    ///   thread or peer connection), A's notification is received before B's. Batches in flight
    ///   at the same time carry no order between each other (TCP spreads them over lanes),
    ///   except over shm, where batches submitted one after the other to a peer are notified in
    ///   submission order.
    ///
    /// A failed batch (deadline, dead peer) may or may not have delivered its notification.
    pub fn write(
        &self,
        peer: &Peer,
        ops: &[Op],
        notify: Option<&[u8]>,
        deadline: Option<Duration>,
    ) -> Result<Batch, Error> {
        if let Some(t) = notify {
            if t.len() > wire::MAX_TAG as usize {
                return Err(Error::InvalidArgument(format!(
                    "notification tag of {} bytes exceeds {}",
                    t.len(),
                    wire::MAX_TAG
                )));
            }
        }
        self.submit(peer, ops, notify.map(|t| t.to_vec()), deadline, Dir::Write)
    }

    /// Submits a batch of reads (remote → local). `Op::local` is the destination.
    pub fn read(
        &self,
        peer: &Peer,
        ops: &[Op],
        deadline: Option<Duration>,
    ) -> Result<Batch, Error> {
        self.submit(peer, ops, None, deadline, Dir::Read)
    }

    fn submit(
        &self,
        peer: &Peer,
        ops: &[Op],
        notify: Option<Vec<u8>>,
        deadline: Option<Duration>,
        dir: Dir,
    ) -> Result<Batch, Error> {
        let r = self.submit_inner(peer, ops, notify, deadline, dir);
        if let Err(e) = &r {
            self.core().metrics.error(metrics::STAGE_SUBMIT, e);
            if tracing::enabled!(tracing::Level::DEBUG) {
                tracing::debug!(peer = peer.id().0, ?dir, ops = ops.len(), error = %e, "batch refused");
            }
        } else if tracing::enabled!(tracing::Level::TRACE) {
            tracing::trace!(
                peer = peer.id().0,
                transport = metrics::transport_label(peer.transport()),
                ?dir,
                ops = ops.len(),
                "batch submitted"
            );
        }
        r
    }

    fn submit_inner(
        &self,
        peer: &Peer,
        ops: &[Op],
        notify: Option<Vec<u8>>,
        deadline: Option<Duration>,
        dir: Dir,
    ) -> Result<Batch, Error> {
        let core = self.core();
        core.check_open()?;
        let p = &peer.inner;
        if p.engine != core.id {
            return Err(Error::InvalidArgument(
                "peer belongs to another engine".into(),
            ));
        }
        if let Some(r) = p.pending.closed_reason() {
            return Err(Error::PeerDead(r));
        }
        // Declared dead, its batches not yet failed (kill_peer sets the flag first): a peer
        // that is not alive refuses new work with PeerDead, never with a region error.
        if p.dead.load(Ordering::Acquire) {
            return Err(Error::PeerDead("peer is being closed".into()));
        }
        let start = Instant::now();
        let deadline = start + deadline.unwrap_or(core.cfg.default_deadline);
        let write = dir == Dir::Write;
        // Check every op as submitted (errors name the caller's op), then coalesce.
        let mut cache: Vec<Arc<RegionEntry>> = Vec::new();
        let mut local = |h: RegionHandle| -> Result<Arc<RegionEntry>, Error> {
            if let Some(e) = cache.iter().find(|e| e.id == h.id()) {
                return Ok(e.clone());
            }
            let e = core.regions.get(h.id())?;
            cache.push(e.clone());
            Ok(e)
        };
        {
            let remote = p.remote.read();
            for op in ops {
                let e = local(op.local)?;
                check_bounds(op.local.id(), op.local_offset, op.len, e.mem.len() as u64)?;
                // RDMA moves device memory its NICs registered (GPUDirect) and refuses the rest.
                let reaches_device = matches!(p.kind, TransportKind::CudaIpc | TransportKind::Rdma);
                if !reaches_device && e.mem.device_ipc().is_some() {
                    return Err(Error::Unsupported(format!(
                        "local region {:?} is device memory; only the cuda_ipc and rdma \
                         transports move it (this peer uses {})",
                        e.id,
                        metrics::transport_label(p.kind)
                    )));
                }
                remote.check(op.remote, op.remote_offset, op.len, write)?;
            }
        }
        let merged = coalesce(ops);
        let mut xfers = Vec::with_capacity(merged.len());
        let mut bytes = 0u64;
        {
            let remote = p.remote.read();
            for op in &merged {
                let r = remote.check(op.remote, op.remote_offset, op.len, write)?;
                xfers.push(Xfer {
                    local: local(op.local)?,
                    local_offset: op.local_offset,
                    remote: r,
                    remote_offset: op.remote_offset,
                    len: op.len,
                });
                bytes += op.len;
            }
        }
        let posted = Posted {
            id: core.next_batch.fetch_add(1, Ordering::Relaxed),
            dir,
            xfers,
            notify,
            ops: ops.len(),
            bytes,
            deadline,
            timer: core.timer.clone(),
            start,
            spin: core
                .cfg
                .wait_spin
                .unwrap_or(DEFAULT_WAIT_SPIN)
                .min(MAX_WAIT_SPIN),
        };
        let state = p.transport.post(posted, &p.pending)?;
        Ok(Batch { state })
    }
}

/// Device memory over transports that cannot reach it, without a GPU: a device region whose
/// address is never dereferenced (every path must refuse it before any copy).
#[cfg(test)]
mod device_refusal_tests {
    use super::*;
    use crate::config::EngineConfig;
    use crate::mem::RegionMem;
    use crate::types::Access;

    fn fake_device() -> RegionMem {
        RegionMem::unreachable_device(1 << 16)
    }

    /// The first 4 KiB of `local` to the first 4 KiB of `remote`.
    fn first_4k(local: RegionHandle, remote: crate::types::RegionId) -> Op {
        Op {
            local,
            local_offset: 0,
            remote,
            remote_offset: 0,
            len: 4096,
        }
    }

    fn tcp() -> Engine {
        Engine::new(EngineConfig {
            transport: TransportKind::Tcp,
            ..EngineConfig::default()
        })
        .expect("engine")
    }

    #[test]
    fn tcp_refuses_device_memory_on_both_ends_and_keeps_the_peer() {
        let (target, init) = (tcp(), tcp());
        let dev_dst = target
            .register_mem(fake_device(), Access::ReadWrite)
            .expect("register");
        let host_dst = target
            .alloc_region(1 << 16, Access::ReadWrite)
            .expect("alloc");
        let dev_src = init
            .register_mem(fake_device(), Access::Local)
            .expect("register");
        let host_src = init.alloc_region(1 << 16, Access::Local).expect("alloc");
        init.local_write(host_src, 0, &[7u8; 4096]).expect("fill");
        assert_eq!(init.metrics().region_bytes_by_kind[3], ("device", 1 << 16));
        let peer = init.connect(target.listen_addr()).expect("connect");
        let op = |local, remote| first_4k(local, target.region_id(remote));
        // Our device memory over tcp: refused at submit, nothing sent.
        match init.write(&peer, &[op(dev_src, host_dst)], None, None) {
            Err(Error::Unsupported(m)) => assert!(m.contains("device memory"), "{m}"),
            other => panic!("expected Unsupported, got {other:?}"),
        }
        // The target's device memory: refused by the target before a byte lands, as a bad
        // range is; writes and reads.
        let w = init.write(&peer, &[op(host_src, dev_dst)], None, None);
        assert!(w.and_then(|b| b.wait()).is_err());
        let r = init.read(&peer, &[op(host_src, dev_dst)], None);
        assert!(r.and_then(|b| b.wait()).is_err());
        // The peer is fine: host to host still works, every byte.
        init.write(&peer, &[op(host_src, host_dst)], None, None)
            .expect("write")
            .wait()
            .expect("host write");
        let mut got = [0u8; 4096];
        target.local_read(host_dst, 0, &mut got).expect("read");
        assert_eq!(got, [7u8; 4096]);
        assert!(target.local_read(dev_dst, 0, &mut got).is_err());
    }

    #[test]
    fn shm_refuses_a_peer_device_region_and_keeps_the_peer() {
        let cfg = |transport| EngineConfig {
            transport,
            ..EngineConfig::default()
        };
        let target = Engine::new(cfg(TransportKind::Auto)).expect("engine");
        let init = Engine::new(cfg(TransportKind::Shm)).expect("engine");
        let dev_dst = target
            .register_mem(fake_device(), Access::ReadWrite)
            .expect("register");
        let host_dst = target
            .alloc_region(1 << 16, Access::ReadWrite)
            .expect("alloc");
        let src = init.alloc_region(1 << 16, Access::Local).expect("alloc");
        init.local_write(src, 0, &[9u8; 4096]).expect("fill");
        let peer = init.connect(target.listen_addr()).expect("connect");
        assert_eq!(peer.transport(), TransportKind::Shm);
        let op = |remote| first_4k(src, target.region_id(remote));
        let w = init.write(&peer, &[op(dev_dst)], Some(b"no"), None);
        match w.and_then(|b| b.wait()) {
            Err(Error::Unsupported(m)) => assert!(m.contains("cuda_ipc"), "{m}"),
            other => panic!("expected Unsupported, got {other:?}"),
        }
        init.write(&peer, &[op(host_dst)], Some(b"yes"), None)
            .expect("write")
            .wait()
            .expect("host write");
        let n = target
            .notifications()
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("notification");
        assert_eq!(n.tag, b"yes", "no notification of the refused batch");
        let mut got = [0u8; 4096];
        target.local_read(host_dst, 0, &mut got).expect("read");
        assert_eq!(got, [9u8; 4096]);
    }
}
