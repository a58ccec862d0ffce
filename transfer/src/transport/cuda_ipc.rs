//! CUDA IPC transport for peers on one host: copies into a peer's device regions (and reads
//! out of them) run on this process's GPU, device to device through the copy engines (NVLink
//! or PCIe peer-to-peer); no host memory on the way, no CPU copy.
//!
//! A target's device regions (`cuda::register_device_region`) travel to same-host peers with
//! their allocation's IPC handle and offset (`WireRegion::ipc`). The initiator opens each
//! handle once per peer ([`IpcMapping`], bounds-checked against the region's length), queues
//! every copy of a batch on one stream of its own, waits for an event after the last one, and
//! only then lets go of the regions and sends the batch's notification (over the control
//! connection, with a fence, as shm does). The source may be device memory or host memory of
//! this engine (the driver reaches host memory through unified addressing).
//!
//! Everything else is the shm transport's: the per-peer state is a [`ShmPeer`] with this
//! transport's [`DeviceCopy`] plugged in, so transfers whose remote region is host memory go as
//! over shm, and withdrawals wait for running copies, queued device copies included. It is
//! offered when the CUDA driver loads; `Auto` picks it towards a same-host peer (reachable as
//! over shm) when this engine has a device region at the handshake.
//!
//! Copies run on the device of the first device region this engine copies from, else on
//! device 0; peer access is enabled lazily by the driver.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use parking_lot::Mutex;

use super::api::{EstablishCtx, PeerTransport, Transport};
use super::shm::{DeviceCopy, ShmPeer, ShmTransport};
use crate::batch::Xfer;
use crate::cuda::ipc::{DeviceCopier, IpcExport, IpcMapping};
use crate::cuda::{context, CudaError};
use crate::error::Error;
use crate::types::{Dir, RegionId, TransportKind};
use crate::wire::{HostIdentity, TRANSPORT_CUDA_IPC};

fn cuda_err(what: &str, e: CudaError) -> Error {
    match e {
        CudaError::InvalidArgument(m) => Error::InvalidArgument(format!("{what}: {m}")),
        CudaError::Engine(e) => e,
        e => Error::Io(std::io::Error::other(format!("{what}: {e}"))),
    }
}

/// What a peer's copies use, made at its first device copy.
struct Device {
    ctx: Arc<CudaContext>,
    copier: DeviceCopier,
    /// The peer's device regions opened so far (bounded by the peer's region table).
    maps: HashMap<RegionId, Arc<IpcMapping>>,
}

/// A peer's device copies.
struct IpcCopies {
    dev: Mutex<Option<Device>>,
}

impl IpcCopies {
    fn device<'a>(slot: &'a mut Option<Device>, x: &Xfer) -> Result<&'a mut Device, Error> {
        if slot.is_none() {
            let ordinal = x.local.mem.device_ipc().map_or(0, |(o, _)| o as usize);
            let ctx = context(ordinal).map_err(|e| cuda_err("CUDA context", e))?;
            let copier = DeviceCopier::new(ctx.clone()).map_err(|e| cuda_err("CUDA stream", e))?;
            *slot = Some(Device {
                ctx,
                copier,
                maps: HashMap::new(),
            });
        }
        Ok(slot.as_mut().expect("set just above"))
    }
}

impl DeviceCopy for IpcCopies {
    fn queue(&self, dir: Dir, x: &Xfer) -> Result<(), Error> {
        let ipc = x
            .remote
            .ipc
            .ok_or_else(|| Error::InvalidArgument("not a device region".into()))?;
        let n =
            usize::try_from(x.len).map_err(|_| Error::InvalidArgument("op too large".into()))?;
        let mut g = self.dev.lock();
        let d = Self::device(&mut g, x)?;
        let map = match d.maps.get(&x.remote.id) {
            Some(m) => m.clone(),
            None => {
                let exp = IpcExport {
                    handle: ipc.handle,
                    offset: ipc.offset,
                    len: x.remote.len,
                };
                let m = Arc::new(
                    IpcMapping::open(d.ctx.clone(), &exp)
                        .map_err(|e| cuda_err("opening the peer's device region", e))?,
                );
                d.maps.insert(x.remote.id, m.clone());
                m
            }
        };
        d.copier
            .region_copy(
                dir == Dir::Write,
                &x.local.mem,
                x.local_offset,
                &map,
                x.remote_offset,
                n,
            )
            .map_err(|e| cuda_err("device copy", e))
    }

    fn finish(&self) -> Result<(), Error> {
        match self.dev.lock().as_mut() {
            Some(d) => d.copier.finish().map_err(|e| cuda_err("device copy", e)),
            None => Ok(()),
        }
    }

    fn forget(&self, ids: &[RegionId]) {
        if let Some(d) = self.dev.lock().as_mut() {
            for id in ids {
                d.maps.remove(id); // closed once the copier let go of it
            }
        }
    }

    fn clear(&self) {
        if let Some(d) = self.dev.lock().as_mut() {
            d.maps.clear();
        }
    }
}

/// The CUDA IPC transport (same host only). Its handshake blob is shm's probe: the peer must be
/// reachable as over shm, since transfers to its host regions go that way.
pub(crate) struct CudaIpcTransport {
    shm: ShmTransport,
}

impl CudaIpcTransport {
    /// `None` when the CUDA driver does not load here.
    pub fn open() -> Option<Self> {
        crate::cuda::driver_present().then(|| CudaIpcTransport {
            shm: ShmTransport::new(),
        })
    }
}

impl Transport for CudaIpcTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::CudaIpc
    }
    fn bit(&self) -> u8 {
        TRANSPORT_CUDA_IPC
    }
    fn hello_blob(&self) -> Option<Vec<u8>> {
        self.shm.hello_blob()
    }
    fn usable_with(&self, remote_host: &HostIdentity, remote_blob: Option<&[u8]>) -> bool {
        self.shm.usable_with(remote_host, remote_blob)
    }
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error> {
        let copies = IpcCopies {
            dev: Mutex::new(None),
        };
        Ok(Arc::new(ShmPeer::new(
            ctx.remote_host.pid,
            ctx.ctrl,
            ctx.copy_tx,
            Some(Box::new(copies)),
        )))
    }
}
