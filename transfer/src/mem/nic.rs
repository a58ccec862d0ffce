//! Region memory registered with RDMA devices: [`RegionMrs`], one memory region per device.
//!
//! Host memory is registered by its address (`ibv_reg_mr`). Device memory (GPUDirect RDMA) is
//! registered on each device by the first of two paths that the device takes:
//! 1. **dma-buf**: the range exported once by the CUDA driver (`cuMemGetHandleForAddressRange`
//!    over the page-aligned span around it) and registered with `ibv_reg_dmabuf_mr` at the
//!    region's device address as its I/O virtual address, so peers address it the way they
//!    address host regions (announced address + offset);
//! 2. **device address**: `ibv_reg_mr` on the device pointer, which the kernel can pin only
//!    where nvidia-peermem is loaded.
//!
//! When a device takes neither, [`RegionMrs::register_device`] fails with both reasons
//! ([`DeviceRefused`]) and nothing stays registered. Registration runs when the region is
//! added, never on the request path.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use super::RegionMem;

/// A dma-buf of device memory: the file and where the region starts in it.
#[derive(Debug)]
pub(crate) struct DmaBuf {
    pub(crate) fd: OwnedFd,
    pub(crate) offset: u64,
}

/// How device memory reached a device's NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GpuDirect {
    /// `ibv_reg_dmabuf_mr` on the CUDA driver's dma-buf.
    DmaBuf,
    /// `ibv_reg_mr` on the device address (nvidia-peermem).
    PeerMem,
}

/// Device memory that a device registered by neither path, and why.
#[derive(Debug, thiserror::Error)]
#[error(
    "RDMA device {device}: dma-buf: {dmabuf}; device address (needs nvidia-peermem): {peermem}"
)]
pub(crate) struct DeviceRefused {
    /// Index of the device (local device order).
    pub(crate) device: usize,
    pub(crate) dmabuf: String,
    pub(crate) peermem: String,
}

/// A region's memory registered with RDMA protection domains: per device (index = local device
/// index), one memory region per chunk of `chunk` bytes (one chunk, the whole region, unless a
/// NIC limits how large a registration may be), kept next to the memory they cover. Field order
/// matters: the MRs are deregistered (dropped) before the last reference to the memory goes.
pub(crate) struct RegionMrs {
    per_dev: Vec<Vec<kvwire_verbs::Mr>>,
    chunk: u64,
    _mem: Arc<RegionMem>,
}

/// The length of the chunks `len` bytes are registered in: `chunk`, or (0) all of them.
fn chunk_len(len: usize, chunk: u64) -> u64 {
    if chunk == 0 {
        len as u64
    } else {
        chunk
    }
}

/// The `(offset, length)` of each chunk of `chunk` bytes (0: one) of `len` bytes.
fn chunks_of(len: usize, chunk: u64) -> impl Iterator<Item = (usize, usize)> {
    let step = usize::try_from(chunk)
        .ok()
        .filter(|c| *c > 0)
        .unwrap_or(len)
        .max(1);
    (0..len)
        .step_by(step)
        .map(move |at| (at, step.min(len - at)))
}

impl RegionMrs {
    /// Registers host memory `mem` with every protection domain of `pds`, in order, in chunks
    /// of `chunk` bytes (0: one registration). On a failure, the index of the domain that
    /// refused it and the verbs error (registrations made before it are undone when they drop).
    pub(crate) fn register<'a>(
        mem: &Arc<RegionMem>,
        pds: impl IntoIterator<Item = &'a kvwire_verbs::Pd>,
        access: kvwire_verbs::Access,
        chunk: u64,
    ) -> Result<RegionMrs, (usize, kvwire_verbs::VerbsError)> {
        let mut per_dev = Vec::new();
        for (i, pd) in pds.into_iter().enumerate() {
            let mut mrs = Vec::new();
            for (at, n) in chunks_of(mem.len(), chunk) {
                // SAFETY: the memory `mem.addr() .. + mem.len()` (this chunk lies in it) is
                // owned (memfd mapping) or promised valid by `Engine::register_raw`'s contract
                // for as long as the `RegionMem` lives; this `RegionMrs` holds that
                // `Arc<RegionMem>` next to every MR of it (dropped after them), and every work
                // request naming one of the MRs holds the transport's `MrSet` that owns this
                // value, so the memory outlives the registrations and every use of it by the
                // NICs. The engine never hands out Rust references into region memory (copies
                // go through `RegionMem`), so concurrent NIC access races with no Rust
                // reference.
                let mr = unsafe { pd.register_raw((mem.addr() + at as u64) as *mut u8, n, access) }
                    .map_err(|e| (i, e))?;
                mrs.push(mr);
            }
            per_dev.push(mrs);
        }
        Ok(RegionMrs {
            per_dev,
            chunk: chunk_len(mem.len(), chunk),
            _mem: mem.clone(),
        })
    }

    /// Registers device memory `mem` (a device region) with every protection domain of `pds`
    /// (GPUDirect RDMA, see the module docs), in chunks of `chunk` bytes (0: one registration);
    /// `dmabuf` is the region exported by the CUDA driver, or why it could not be. Returns the
    /// path each device took.
    pub(crate) fn register_device<'a>(
        mem: &Arc<RegionMem>,
        pds: impl IntoIterator<Item = &'a kvwire_verbs::Pd>,
        access: kvwire_verbs::Access,
        dmabuf: &Result<DmaBuf, String>,
        chunk: u64,
    ) -> Result<(RegionMrs, Vec<GpuDirect>), DeviceRefused> {
        let dptr = mem.addr();
        let mut per_dev = Vec::new();
        let mut paths = Vec::new();
        for (i, pd) in pds.into_iter().enumerate() {
            let mut mrs = Vec::new();
            for (at, n) in chunks_of(mem.len(), chunk) {
                // SAFETY: `mem` is device memory the caller of `cuda::register_device_region`
                // keeps allocated while the region lives (that function's contract), and this
                // chunk lies in it; this `RegionMrs` holds the `Arc<RegionMem>` next to every
                // MR (dropped after them) and every work request naming an MR holds the
                // transport's `MrSet` owning this value, so the memory outlives the
                // registrations. The dma-buf covers the region (the driver exported the span
                // around it) and the kernel keeps its own reference for as long as the MR
                // lives. The host never dereferences the device address.
                let (mr, path) = unsafe {
                    register_device_on(
                        &PdAccess(pd, access),
                        dmabuf,
                        at as u64,
                        dptr + at as u64,
                        n,
                    )
                }
                .map_err(|(dmabuf, peermem)| DeviceRefused {
                    device: i,
                    dmabuf,
                    peermem,
                })?;
                if mrs.is_empty() {
                    paths.push(path);
                }
                mrs.push(mr);
            }
            per_dev.push(mrs);
        }
        Ok((
            RegionMrs {
                per_dev,
                chunk: chunk_len(mem.len(), chunk),
                _mem: mem.clone(),
            },
            paths,
        ))
    }

    /// The memory region of chunk `chunk` on local device `dev`.
    pub(crate) fn get(&self, dev: usize, chunk: usize) -> Option<&kvwire_verbs::Mr> {
        self.per_dev.get(dev)?.get(chunk)
    }

    /// Every chunk's memory region on local device `dev`, in order.
    pub(crate) fn chunks_on(&self, dev: usize) -> &[kvwire_verbs::Mr] {
        self.per_dev.get(dev).map_or(&[], Vec::as_slice)
    }

    /// Bytes per chunk (chunk `i` starts at `i * chunk_len()`; one chunk: the region's length).
    pub(crate) fn chunk_len(&self) -> u64 {
        self.chunk
    }
}

/// One device's registration calls: `kvwire_verbs::Pd` with the region's rights, a stand-in in
/// the tests.
trait Nic {
    type Mr;

    /// Registers `len` bytes at address `addr` (host memory, or device memory with
    /// nvidia-peermem).
    ///
    /// # Safety
    /// The memory must stay allocated while the returned MR lives.
    unsafe fn reg_addr(&self, addr: u64, len: usize) -> Result<Self::Mr, String>;

    /// Registers `len` bytes of `buf` from `at` past its offset, addressed by peers from `iova`.
    ///
    /// # Safety
    /// As [`Nic::reg_addr`], for the memory behind the dma-buf.
    unsafe fn reg_dmabuf(
        &self,
        buf: &DmaBuf,
        at: u64,
        len: usize,
        iova: u64,
    ) -> Result<Self::Mr, String>;
}

struct PdAccess<'a>(&'a kvwire_verbs::Pd, kvwire_verbs::Access);

impl Nic for PdAccess<'_> {
    type Mr = kvwire_verbs::Mr;

    unsafe fn reg_addr(&self, addr: u64, len: usize) -> Result<Self::Mr, String> {
        // SAFETY: forwarded: the caller keeps the memory allocated while the MR lives.
        unsafe { self.0.register_raw(addr as *mut u8, len, self.1) }.map_err(|e| e.to_string())
    }

    unsafe fn reg_dmabuf(
        &self,
        buf: &DmaBuf,
        at: u64,
        len: usize,
        iova: u64,
    ) -> Result<Self::Mr, String> {
        // SAFETY: forwarded: the caller keeps the memory behind the dma-buf allocated while
        // the MR lives; the fd is open for the call.
        unsafe {
            self.0
                .register_dmabuf(buf.fd.as_raw_fd(), buf.offset + at, len, iova, self.1)
        }
        .map_err(|e| e.to_string())
    }
}

/// Registers device memory `dptr..dptr+len`, `at` bytes into the region, on `nic`: the
/// dma-buf (from `at` past the region's start in it) when there is one and the NIC takes it,
/// else the device address. `Err((dma-buf reason, device-address reason))`.
///
/// # Safety
/// As [`Nic::reg_addr`]: the device memory stays allocated while the MR lives.
unsafe fn register_device_on<N: Nic>(
    nic: &N,
    dmabuf: &Result<DmaBuf, String>,
    at: u64,
    dptr: u64,
    len: usize,
) -> Result<(N::Mr, GpuDirect), (String, String)> {
    let refused = match dmabuf {
        // SAFETY: forwarded from the caller.
        Ok(buf) => match unsafe { nic.reg_dmabuf(buf, at, len, dptr) } {
            Ok(mr) => return Ok((mr, GpuDirect::DmaBuf)),
            Err(e) => e,
        },
        Err(e) => e.clone(),
    };
    // SAFETY: forwarded from the caller.
    match unsafe { nic.reg_addr(dptr, len) } {
        Ok(mr) => Ok((mr, GpuDirect::PeerMem)),
        Err(e) => Err((refused, e)),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// What a stand-in NIC registered: (path, address or iova, dma-buf offset, length).
    type Reg = (GpuDirect, u64, u64, usize);

    struct FakeNic {
        dmabuf_ok: bool,
        addr_ok: bool,
        calls: RefCell<Vec<&'static str>>,
    }

    impl FakeNic {
        fn new(dmabuf_ok: bool, addr_ok: bool) -> FakeNic {
            FakeNic {
                dmabuf_ok,
                addr_ok,
                calls: RefCell::new(Vec::new()),
            }
        }
    }

    impl Nic for FakeNic {
        type Mr = Reg;

        unsafe fn reg_addr(&self, addr: u64, len: usize) -> Result<Reg, String> {
            self.calls.borrow_mut().push("addr");
            if self.addr_ok {
                Ok((GpuDirect::PeerMem, addr, 0, len))
            } else {
                Err("Bad address (os error 14)".into())
            }
        }

        unsafe fn reg_dmabuf(
            &self,
            buf: &DmaBuf,
            at: u64,
            len: usize,
            iova: u64,
        ) -> Result<Reg, String> {
            self.calls.borrow_mut().push("dmabuf");
            if self.dmabuf_ok {
                Ok((GpuDirect::DmaBuf, iova, buf.offset + at, len))
            } else {
                Err("Operation not supported (os error 95)".into())
            }
        }
    }

    fn dmabuf(offset: u64) -> Result<DmaBuf, String> {
        let fd = OwnedFd::from(std::fs::File::open("/dev/null").expect("/dev/null"));
        Ok(DmaBuf { fd, offset })
    }

    const DPTR: u64 = 0x7f00_0000_1200;

    fn register(
        nic: &FakeNic,
        buf: &Result<DmaBuf, String>,
    ) -> Result<(Reg, GpuDirect), (String, String)> {
        // SAFETY: the stand-in NIC never touches the (made-up) address.
        unsafe { register_device_on(nic, buf, 0, DPTR, 1 << 20) }
    }

    #[test]
    fn the_dmabuf_comes_first_at_the_device_address() {
        let nic = FakeNic::new(true, true);
        let (reg, path) = register(&nic, &dmabuf(0x200)).expect("registered");
        assert_eq!(path, GpuDirect::DmaBuf);
        assert_eq!(reg, (GpuDirect::DmaBuf, DPTR, 0x200, 1 << 20));
        assert_eq!(*nic.calls.borrow(), ["dmabuf"]);
    }

    #[test]
    fn a_later_chunk_is_registered_that_far_into_the_dmabuf_and_the_device() {
        let nic = FakeNic::new(true, true);
        let at = 3 << 20;
        // SAFETY: the stand-in NIC never touches the (made-up) address.
        let (reg, _) = unsafe { register_device_on(&nic, &dmabuf(0x200), at, DPTR + at, 4096) }
            .expect("registered");
        assert_eq!(reg, (GpuDirect::DmaBuf, DPTR + at, 0x200 + at, 4096));
    }

    #[test]
    fn chunks_cover_the_region_once_the_last_one_shorter() {
        let v: Vec<_> = chunks_of(10_000, 4096).collect();
        assert_eq!(v, [(0, 4096), (4096, 4096), (8192, 1808)]);
        assert_eq!(chunks_of(10_000, 0).collect::<Vec<_>>(), [(0, 10_000)]);
        assert_eq!(chunks_of(4096, 4096).collect::<Vec<_>>(), [(0, 4096)]);
        assert_eq!(chunks_of(100, 1 << 40).collect::<Vec<_>>(), [(0, 100)]);
    }

    #[test]
    fn a_nic_that_refuses_the_dmabuf_gets_the_device_address() {
        let nic = FakeNic::new(false, true);
        let (reg, path) = register(&nic, &dmabuf(0)).expect("registered");
        assert_eq!((path, reg.1), (GpuDirect::PeerMem, DPTR));
        assert_eq!(*nic.calls.borrow(), ["dmabuf", "addr"]);
    }

    #[test]
    fn without_a_dmabuf_the_device_address_is_tried() {
        let nic = FakeNic::new(true, true);
        let (_, path) = register(&nic, &Err("no CUDA driver".into())).expect("registered");
        assert_eq!(path, GpuDirect::PeerMem);
        assert_eq!(*nic.calls.borrow(), ["addr"]);
    }

    #[test]
    fn both_refused_gives_both_reasons() {
        let nic = FakeNic::new(false, false);
        let (dmabuf_why, addr_why) = register(&nic, &dmabuf(0)).expect_err("refused");
        assert!(dmabuf_why.contains("os error 95"), "{dmabuf_why}");
        assert!(addr_why.contains("os error 14"), "{addr_why}");
        let e = DeviceRefused {
            device: 1,
            dmabuf: dmabuf_why,
            peermem: addr_why,
        };
        let text = e.to_string();
        assert!(
            text.starts_with("RDMA device 1: dma-buf: Operation not supported"),
            "{text}"
        );
        assert!(text.contains("nvidia-peermem): Bad address"), "{text}");
    }
}

#[cfg(test)]
#[path = "../../tests/vm_common/mod.rs"]
mod vm_common;

/// Device regions over RDMA on real verbs (SoftRoCE, in the VM of `tests/vm/run.sh`), with host
/// memory standing in for the GPU's: without a CUDA driver the dma-buf export fails, so each
/// NIC registers the region by its address — the path nvidia-peermem opens for device memory.
/// What runs is the engine's side of GPUDirect RDMA: registration when the region is added,
/// its key announced, work requests posted from and into it, bounds, host copies refused.
/// Every byte checked at the receiving end.
#[cfg(test)]
mod vm_tests {
    use std::time::Duration;

    use super::super::RegionMem;
    use super::vm_common::{pattern, run_in_vm, Vm};
    use crate::types::DeviceIpc;
    use crate::{Access, Engine, EngineConfig, Error, Op, TransportKind};

    const NAME: &str = "mem::nic::vm_tests::device_regions_over_rdma_in_softroce_vm";
    const LEN: usize = 4 << 20;

    fn engine(dev: &str) -> Engine {
        Engine::new(EngineConfig {
            transport: TransportKind::Rdma,
            lanes: 2,
            rdma_device: Some(dev.into()),
            default_deadline: Duration::from_secs(60),
            ..EngineConfig::from_env()
        })
        .unwrap_or_else(|e| panic!("engine on {dev}: {e}"))
    }

    /// `data` in host memory that stands in for device memory (leaked: the NIC may hold it
    /// until the process ends), as a device region.
    fn standin(data: &[u8]) -> (u64, RegionMem) {
        let buf: &'static mut [u8] = Box::leak(data.to_vec().into_boxed_slice());
        let ptr = buf.as_mut_ptr() as u64;
        let ipc = DeviceIpc {
            handle: [9; 64],
            offset: 0,
        };
        // SAFETY: the memory is leaked, so it stays allocated for the rest of the process; the
        // engine never dereferences a device region on the host; the test reads it only when no
        // transfer is in flight (`bytes_at`).
        let mem = unsafe { RegionMem::device(ptr, data.len(), 0, ipc) }.expect("stand-in");
        (ptr, mem)
    }

    fn bytes_at(ptr: u64, len: usize) -> Vec<u8> {
        // SAFETY: `ptr..ptr+len` lies in a leaked stand-in buffer and no transfer is in flight.
        unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }.to_vec()
    }

    #[test]
    fn device_regions_over_rdma_in_softroce_vm() {
        if let Vm::Guest = run_in_vm(NAME, "GPUDIRECT-STANDIN-OK") {
            in_guest();
        }
    }

    fn in_guest() {
        let target = engine("rxe0");
        let init = engine("rxe1");
        let (t_ptr, t_mem) = standin(&vec![0; LEN]);
        let dev_dst = target
            .register_mem(t_mem, Access::ReadWrite)
            .expect("device region on the target");
        let host_dst = target.alloc_region(LEN, Access::ReadWrite).expect("host");
        let src_data = pattern(2, LEN);
        let (_, i_mem) = standin(&src_data);
        let dev_src = init
            .register_mem(i_mem, Access::Local)
            .expect("device region on the initiator");
        let host_src = init.alloc_region(LEN, Access::Local).expect("host");
        let peer = init.connect(target.listen_addr()).expect("connect");
        let op = |local, local_offset, remote, remote_offset, len: usize| Op {
            local,
            local_offset,
            remote,
            remote_offset,
            len: len as u64,
        };

        // Host memory into the target's device region.
        let data = pattern(1, LEN);
        init.local_write(host_src, 0, &data).expect("fill");
        let w = op(host_src, 0, target.region_id(dev_dst), 0, LEN);
        let st = init.write(&peer, &[w], None, None).expect("submit");
        let st = st.wait().expect("write into the device region");
        assert_eq!((st.transport, st.bytes), (TransportKind::Rdma, LEN as u64));
        assert!(bytes_at(t_ptr, LEN) == data, "device region bytes");

        // The initiator's device region into the target's host memory, at odd offsets.
        let n = (1 << 20) + 3;
        let w = op(dev_src, 4099, target.region_id(host_dst), 17, n);
        init.write(&peer, &[w], None, None)
            .expect("submit")
            .wait()
            .expect("write from the device region");
        let mut got = vec![0; n];
        target
            .local_read(host_dst, 17, &mut got)
            .expect("read back");
        assert!(
            got == src_data[4099..4099 + n],
            "bytes from the device region"
        );

        // A READ of the target's device region into host memory.
        let r = op(host_src, 0, target.region_id(dev_dst), 100, 65_536);
        init.read(&peer, &[r], None)
            .expect("submit")
            .wait()
            .expect("read of the device region");
        let mut got = vec![0; 65_536];
        init.local_read(host_src, 0, &mut got).expect("read back");
        assert!(
            got == data[100..100 + 65_536],
            "bytes read from the device region"
        );

        // Out of bounds on a device region: refused at submit; the next batch is fine.
        let bad = op(dev_src, LEN as u64 - 8, target.region_id(host_dst), 0, 16);
        assert!(matches!(
            init.write(&peer, &[bad], None, None),
            Err(Error::OutOfBounds { .. })
        ));
        let w = op(dev_src, 0, target.region_id(dev_dst), 0, 4096);
        init.write(&peer, &[w], None, None)
            .expect("submit")
            .wait()
            .expect("write after the refusal");
        assert!(
            bytes_at(t_ptr, 4096) == src_data[..4096],
            "device to device"
        );
        // The host never copies device memory.
        let mut one = [0u8; 1];
        assert!(target.local_read(dev_dst, 0, &mut one).is_err());
        println!("GPUDIRECT-STANDIN-OK");
    }
}
