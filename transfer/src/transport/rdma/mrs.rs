//! [`MrSet`]: a region's memory registrations, one per device; device regions registered with
//! the NICs (GPUDirect RDMA).

use std::time::Instant;

use crate::mem::{DmaBuf, RegionMem, RegionMrs};
use crate::region::RegionEntry;

/// A registered region: one MR per device and the memory they cover (kept alive next to them).
pub(crate) struct MrSet {
    /// Index = local device index.
    pub(super) mrs: RegionMrs,
    /// Offered to peers (remote rights granted).
    pub(super) offered: bool,
}

/// Registers device region `e` with every device of `pds` (`names` in the same order), in
/// chunks of `chunk` bytes (0: one registration): dma-buf first, the device address
/// (nvidia-peermem) second, see `mem::nic`. Timed and logged: it
/// runs when the region is added, off the request path. `None` when a device took neither
/// path: the region then has no memory region, so RDMA refuses work requests naming it (the
/// cuda_ipc transport still reaches it); the log says why.
pub(super) fn register_device<'a>(
    e: &RegionEntry,
    ordinal: u32,
    pds: impl IntoIterator<Item = &'a kvwire_verbs::Pd>,
    names: &[String],
    access: kvwire_verbs::Access,
    chunk: u64,
) -> Option<RegionMrs> {
    let t0 = Instant::now();
    let dmabuf = export(ordinal, &e.mem);
    match RegionMrs::register_device(&e.mem, pds, access, &dmabuf, chunk) {
        Ok((mrs, paths)) => {
            tracing::info!(
                region = ?e.id,
                device = ordinal,
                bytes = e.mem.len(),
                ?paths,
                ms = t0.elapsed().as_secs_f64() * 1e3,
                "rdma: device memory registered with the NICs (GPUDirect RDMA)"
            );
            Some(mrs)
        }
        Err(why) => {
            let nic = names.get(why.device).map_or("?", String::as_str);
            tracing::warn!(
                region = ?e.id,
                device = ordinal,
                nic,
                "rdma: device memory not registered with the NICs, RDMA refuses it (cuda_ipc \
                 still reaches it): {why}"
            );
            None
        }
    }
}

#[cfg(feature = "cuda")]
fn export(ordinal: u32, mem: &RegionMem) -> Result<DmaBuf, String> {
    crate::cuda::export_dmabuf(ordinal, mem.addr(), mem.len() as u64)
        .map(|(fd, offset)| DmaBuf { fd, offset })
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn export(_ordinal: u32, _mem: &RegionMem) -> Result<DmaBuf, String> {
    Err("kvwire was built without the cuda feature".into())
}
