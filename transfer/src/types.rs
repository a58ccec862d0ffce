//! The engine's plain vocabulary: the values the API, the transports and the wire all name.
//! Nothing here depends on another module of the crate.

/// Which transport to use towards peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Shared memory when both peers run on one host (same boot id and namespaces), TCP otherwise.
    Auto,
    /// Always TCP.
    Tcp,
    /// Always shared memory; connecting to a peer on another host fails with `Error::Unsupported`.
    Shm,
    /// Always RDMA (RC queue pairs); `Engine::new` fails with `Error::Unsupported` when no
    /// RDMA device is usable here. `Auto` uses RDMA towards peers that offer it when shm is
    /// not possible (another host), or first with `EngineConfig::prefer_rdma`.
    Rdma,
    /// CUDA IPC for peers on one host: copies into a peer's device regions (registered with
    /// `cuda::register_device`) run on the GPU's copy engines, other regions go as over shm.
    /// `Engine::new` fails with `Error::Unsupported` without a CUDA driver. `Auto` uses it
    /// towards a same-host peer when both sides have device regions at the handshake.
    CudaIpc,
}

/// How a same-host peer opens a device region (CUDA IPC): the handle of the allocation the
/// region lies in and the region's offset from the allocation's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceIpc {
    /// The allocation's CUDA IPC memory handle.
    pub handle: [u8; 64],
    /// Offset of the region from the allocation's base.
    pub offset: u64,
}

/// One transfer of a batch: `len` bytes between `(local, local_offset)` and
/// `(remote, remote_offset)` (direction given by `Engine::write`/`Engine::read`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Op {
    /// Local region (source of a write, destination of a read).
    pub local: RegionHandle,
    /// Offset in the local region.
    pub local_offset: u64,
    /// Remote region id, as the peer offers it.
    pub remote: RegionId,
    /// Offset in the remote region.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Direction of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    /// Local → remote.
    Write,
    /// Remote → local.
    Read,
}

/// Identifies a peer within one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// A local handle to a registered region (slot index + generation). Cheap to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionHandle {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl RegionHandle {
    /// The id under which peers see this region.
    pub fn id(&self) -> RegionId {
        RegionId {
            index: self.index,
            generation: self.generation,
        }
    }
}

/// The name of a region as peers see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionId {
    /// Slot index in the owner's region table.
    pub index: u32,
    /// Generation of the slot when the region was registered.
    pub generation: u32,
}

/// What remote peers may do with a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Remote peers may write and read.
    ReadWrite,
    /// Remote peers may write only.
    WriteOnly,
    /// Remote peers may read only.
    ReadOnly,
    /// Not offered to peers at all (local source/destination buffers).
    Local,
}

impl Access {
    /// Whether a remote peer may write into a region with this access.
    pub fn remote_write(self) -> bool {
        matches!(self, Access::ReadWrite | Access::WriteOnly)
    }
    /// Whether a remote peer may read from a region with this access.
    pub fn remote_read(self) -> bool {
        matches!(self, Access::ReadWrite | Access::ReadOnly)
    }
    /// Whether the region is offered to peers at all.
    pub fn offered(self) -> bool {
        !matches!(self, Access::Local)
    }
}

/// A region a remote peer offers to us.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// The region's id on the remote engine.
    pub id: RegionId,
    /// Its length in bytes.
    pub len: u64,
    /// What we may do with it.
    pub access: Access,
}

/// What a completed batch did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchStats {
    /// Payload bytes.
    pub bytes: u64,
    /// Ops submitted.
    pub ops: usize,
    /// Transfers after coalescing.
    pub writes: usize,
    /// Wire slices (TCP frames with payload; shm copies).
    pub slices: usize,
    /// Transport that carried the batch.
    pub transport: TransportKind,
}
