//! Devices: listing and sysfs locality, the opened device context, ports and GIDs.

use std::fs;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::VerbsError;
use crate::library::{ibv_fn, Lib};
use crate::sys;

/// sysfs directory of RDMA devices.
const SYSFS_IB: &str = "/sys/class/infiniband";

/// A device as listed by libibverbs, with what sysfs says about where it sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name (`mlx5_0`, `rxe0`, ...).
    pub name: String,
    /// Node GUID (host byte order).
    pub guid: u64,
    /// NUMA node of the device's PCI function, when sysfs reports one (not -1).
    pub numa_node: Option<u32>,
    /// PCI address (`0000:17:00.0`) of the device, when it is a PCI device.
    pub pci_address: Option<String>,
    /// Full sysfs path of the PCI device (shows the PCIe switch hierarchy:
    /// `/sys/devices/pci0000:16/0000:16:01.0/0000:17:00.0`).
    pub pci_path: Option<PathBuf>,
    /// Network interfaces bound to the device (RoCE netdevs; `parent` for soft devices).
    pub netdevs: Vec<String>,
}

impl DeviceInfo {
    pub(crate) fn from_sysfs(name: String, guid: u64) -> DeviceInfo {
        let dir = Path::new(SYSFS_IB).join(&name);
        Self::from_sysfs_dir(name, guid, &dir)
    }

    /// Reads locality from a device directory laid out like `/sys/class/infiniband/<dev>`.
    /// Missing files mean "unknown", never an error.
    pub(crate) fn from_sysfs_dir(name: String, guid: u64, dir: &Path) -> DeviceInfo {
        let dev = dir.join("device");
        let numa_node = fs::read_to_string(dev.join("numa_node"))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        let pci_path = fs::canonicalize(&dev).ok();
        let pci_address = pci_path
            .as_ref()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| looks_like_pci_address(n));
        let mut netdevs: Vec<String> = fs::read_dir(dev.join("net"))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        if netdevs.is_empty() {
            if let Ok(parent) = fs::read_to_string(dir.join("parent")) {
                let parent = parent.trim();
                if !parent.is_empty() {
                    netdevs.push(parent.to_string());
                }
            }
        }
        netdevs.sort();
        DeviceInfo {
            name,
            guid,
            numa_node,
            pci_address,
            pci_path,
            netdevs,
        }
    }
}

fn looks_like_pci_address(s: &str) -> bool {
    // dddd:bb:dd.f
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

/// A 128-bit GID (IB GID, or the RoCE address of a netdev IP).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// True for the all-zero GID (an empty table entry).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The IPv4 address when this is an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        let g = &self.0;
        if g[..10] == [0; 10] && g[10] == 0xff && g[11] == 0xff {
            Some(std::net::Ipv4Addr::new(g[12], g[13], g[14], g[15]))
        } else {
            None
        }
    }
}

impl std::fmt::Debug for Gid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", std::net::Ipv6Addr::from(self.0))
    }
}

impl std::fmt::Display for Gid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// What kind of traffic a GID table entry is for (sysfs `gid_attrs/types/<index>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidKind {
    /// InfiniBand (native IB link layer).
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable): what RoCE fabrics use.
    RoceV2,
    /// sysfs did not say.
    Unknown,
}

impl GidKind {
    fn parse(s: &str) -> GidKind {
        match s.trim() {
            "RoCE v2" => GidKind::RoceV2,
            "IB/RoCE v1" => GidKind::RoceV1,
            _ => GidKind::Unknown,
        }
    }
}

/// The GID a QP should use as its source: index into the port's table, value and kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidSelection {
    /// Index in the port's GID table (`sgid_index`).
    pub index: u8,
    /// The GID itself (what the peer puts in its `dgid`).
    pub gid: Gid,
    /// Its kind.
    pub kind: GidKind,
}

/// Picks the source GID: on Ethernet, a RoCE v2 entry, preferring IPv4-mapped ones (the usual
/// fabric addressing) over IPv6 and link-local ones; on IB, index 0.
pub(crate) fn choose_gid(link: LinkLayer, entries: &[(u8, Gid, GidKind)]) -> Option<GidSelection> {
    let usable = entries.iter().filter(|(_, g, _)| !g.is_zero());
    let pick = |(index, gid, kind): &(u8, Gid, GidKind)| GidSelection {
        index: *index,
        gid: *gid,
        kind: *kind,
    };
    if link == LinkLayer::Infiniband {
        return usable
            .clone()
            .find(|(i, _, _)| *i == 0)
            .or_else(|| usable.clone().next())
            .map(|e| {
                let mut s = pick(e);
                s.kind = GidKind::Ib;
                s
            });
    }
    let is_link_local = |g: &Gid| g.0[0] == 0xfe && (g.0[1] & 0xc0) == 0x80;
    let rank = |(_, g, k): &&(u8, Gid, GidKind)| -> u8 {
        match (k, g.ipv4().is_some(), is_link_local(g)) {
            (GidKind::RoceV2, true, _) => 0,
            (GidKind::RoceV2, false, false) => 1,
            (GidKind::RoceV2, false, true) => 2,
            (GidKind::Unknown, true, _) => 3,
            (GidKind::Unknown, _, _) => 4,
            (GidKind::RoceV1, _, _) | (GidKind::Ib, _, _) => 5,
        }
    };
    // lowest rank wins; among equals, the lowest index (stable min_by_key keeps the first)
    usable.min_by_key(|e| (rank(e), e.0)).map(pick)
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID (GID optional).
    Infiniband,
    /// Ethernet: RoCE, addressed by GID.
    Ethernet,
    /// Unspecified by the provider (treated like InfiniBand by libibverbs).
    Unspecified,
}

/// Path MTU of a port or connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    M256,
    /// 512 bytes.
    M512,
    /// 1024 bytes.
    M1024,
    /// 2048 bytes.
    M2048,
    /// 4096 bytes.
    M4096,
}

impl Mtu {
    pub(crate) fn from_raw(raw: u32) -> Option<Mtu> {
        Some(match raw {
            sys::IBV_MTU_256 => Mtu::M256,
            sys::IBV_MTU_512 => Mtu::M512,
            sys::IBV_MTU_1024 => Mtu::M1024,
            sys::IBV_MTU_2048 => Mtu::M2048,
            sys::IBV_MTU_4096 => Mtu::M4096,
            _ => return None,
        })
    }

    pub(crate) fn raw(self) -> u32 {
        match self {
            Mtu::M256 => sys::IBV_MTU_256,
            Mtu::M512 => sys::IBV_MTU_512,
            Mtu::M1024 => sys::IBV_MTU_1024,
            Mtu::M2048 => sys::IBV_MTU_2048,
            Mtu::M4096 => sys::IBV_MTU_4096,
        }
    }

    /// Size in bytes.
    pub fn bytes(self) -> usize {
        256 << (self.raw() - 1)
    }
}

/// What `ibv_query_port` reports that kvwire uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (1-based).
    pub port: u8,
    /// Raw `ibv_port_state` (4 = ACTIVE).
    pub state: u32,
    /// True when the port is ACTIVE.
    pub active: bool,
    /// Active MTU.
    pub active_mtu: Mtu,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// LID (InfiniBand only; 0 on RoCE).
    pub lid: u16,
    /// Number of GID table entries.
    pub gid_table_len: u32,
    /// Largest message the port accepts.
    pub max_msg_size: u32,
}

/// Device limits kvwire sizes its queues with (`ibv_query_device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceLimits {
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_sge_rd: u32,
    pub max_cqe: u32,
    pub max_qp_rd_atom: u8,
    pub max_qp_init_rd_atom: u8,
    pub max_mr_size: u64,
    pub phys_port_cnt: u8,
}

pub(crate) struct ContextInner {
    pub(crate) lib: Arc<Lib>,
    pub(crate) ctx: NonNull<sys::ibv_context>,
    pub(crate) info: DeviceInfo,
    pub(crate) limits: DeviceLimits,
}

// SAFETY: an `ibv_context` may be used from any thread: libibverbs and its providers lock
// internally around every verb that touches shared context state (documented thread safety
// of libibverbs, "all verbs are thread safe"). The pointer is never exposed mutably.
unsafe impl Send for ContextInner {}
// SAFETY: see `Send`; concurrent verbs on one context are allowed by libibverbs.
unsafe impl Sync for ContextInner {}

/// Device contexts of this process open now, and opened since it started (every
/// [`Context`] counts once, whichever library loaded it): what a test reads to check that a
/// process opens each device once, however many engines use it.
static CONTEXTS_OPEN: AtomicUsize = AtomicUsize::new(0);
static CONTEXTS_OPENED: AtomicU64 = AtomicU64::new(0);

/// Device contexts open in this process now.
pub fn contexts_open() -> usize {
    CONTEXTS_OPEN.load(Ordering::Acquire)
}

/// Device contexts opened in this process since it started (closed ones included).
pub fn contexts_opened() -> u64 {
    CONTEXTS_OPENED.load(Ordering::Acquire)
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        CONTEXTS_OPEN.fetch_sub(1, Ordering::AcqRel);
        if let Ok(close) = &self.lib.raw.ibv_close_device {
            // SAFETY: every child resource holds an `Arc<ContextInner>`, so none is alive any
            // more; the context was opened by `ibv_open_device` and is closed exactly once.
            let rc = unsafe { close(self.ctx.as_ptr()) };
            if rc != 0 {
                tracing::warn!(device = %self.info.name, rc, "ibv_close_device failed");
            }
        }
    }
}

/// An opened RDMA device. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.info.name)
            .finish()
    }
}

impl Context {
    pub(crate) fn open(
        lib: Arc<Lib>,
        dev: *mut sys::ibv_device,
        info: DeviceInfo,
    ) -> Result<Context, VerbsError> {
        let open = ibv_fn!(lib, ibv_open_device);
        let close = ibv_fn!(lib, ibv_close_device);
        let query = ibv_fn!(lib, ibv_query_device);
        // SAFETY: `dev` is an element of a device list that is alive during this call.
        let raw = unsafe { open(dev) };
        let ctx = NonNull::new(raw).ok_or_else(|| VerbsError::last_os("ibv_open_device"))?;
        let mut attr = sys::ibv_device_attr::default();
        // SAFETY: `ctx` is a freshly opened context; `attr` is a valid, writable struct of
        // the type the function fills.
        let rc = unsafe { query(ctx.as_ptr(), &mut attr) };
        if rc != 0 {
            // SAFETY: the context was opened above and nothing else references it.
            unsafe { close(ctx.as_ptr()) };
            return Err(VerbsError::from_errno("ibv_query_device", rc));
        }
        let clamp_u32 = |v: i32| u32::try_from(v).unwrap_or(0);
        let clamp_u8 = |v: i32| u8::try_from(v.clamp(0, 255)).unwrap_or(0);
        let limits = DeviceLimits {
            max_qp_wr: clamp_u32(attr.max_qp_wr),
            max_sge: clamp_u32(attr.max_sge),
            max_sge_rd: clamp_u32(attr.max_sge_rd),
            max_cqe: clamp_u32(attr.max_cqe),
            max_qp_rd_atom: clamp_u8(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: clamp_u8(attr.max_qp_init_rd_atom),
            max_mr_size: attr.max_mr_size,
            phys_port_cnt: attr.phys_port_cnt,
        };
        CONTEXTS_OPEN.fetch_add(1, Ordering::AcqRel);
        CONTEXTS_OPENED.fetch_add(1, Ordering::AcqRel);
        Ok(Context {
            inner: Arc::new(ContextInner {
                lib,
                ctx,
                info,
                limits,
            }),
        })
    }

    /// The device this context was opened on.
    pub fn device(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// Number of physical ports.
    pub fn port_count(&self) -> u8 {
        self.inner.limits.phys_port_cnt
    }

    /// Largest number of scatter-gather entries per send/recv request.
    pub fn max_sge(&self) -> u32 {
        self.inner.limits.max_sge
    }

    /// Largest number of scatter-gather entries per RDMA READ request.
    pub fn max_sge_rd(&self) -> u32 {
        self.inner.limits.max_sge_rd
    }

    /// Largest number of outstanding work requests per queue.
    pub fn max_qp_wr(&self) -> u32 {
        self.inner.limits.max_qp_wr
    }

    /// Largest memory region one registration may cover, in bytes (0: the device did not
    /// say).
    pub fn max_mr_size(&self) -> u64 {
        self.inner.limits.max_mr_size
    }

    /// Largest CQ size.
    pub fn max_cqe(&self) -> u32 {
        self.inner.limits.max_cqe
    }

    /// Queries port `port` (1-based).
    pub fn query_port(&self, port: u8) -> Result<PortInfo, VerbsError> {
        let query = ibv_fn!(self.inner.lib, ibv_query_port);
        // The full struct is zeroed and passed where the exported symbol expects the
        // `_compat_ibv_port_attr` prefix (exactly what the header's inline wrapper does when the
        // provider has no extended query_port).
        let mut attr = sys::ibv_port_attr::default();
        // SAFETY: the context is open; `attr` is larger than (and starts with the same fields
        // as) `_compat_ibv_port_attr`, so the library writes within it.
        let rc = unsafe {
            query(
                self.inner.ctx.as_ptr(),
                port,
                (&mut attr as *mut sys::ibv_port_attr).cast::<sys::_compat_ibv_port_attr>(),
            )
        };
        if rc != 0 {
            return Err(VerbsError::from_errno("ibv_query_port", rc));
        }
        let link_layer = match u32::from(attr.link_layer) {
            sys::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
            sys::IBV_LINK_LAYER_INFINIBAND => LinkLayer::Infiniband,
            _ => LinkLayer::Unspecified,
        };
        Ok(PortInfo {
            port,
            state: attr.state,
            active: attr.state == sys::IBV_PORT_ACTIVE,
            active_mtu: Mtu::from_raw(attr.active_mtu).unwrap_or(Mtu::M1024),
            link_layer,
            lid: attr.lid,
            gid_table_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
            max_msg_size: attr.max_msg_sz,
        })
    }

    /// Reads GID table entry `index` of `port`.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<Gid, VerbsError> {
        let query = ibv_fn!(self.inner.lib, ibv_query_gid);
        let mut gid = sys::ibv_gid::default();
        // SAFETY: the context is open; `gid` is a valid 16-byte out-parameter.
        let rc = unsafe { query(self.inner.ctx.as_ptr(), port, i32::from(index), &mut gid) };
        if rc != 0 {
            return Err(VerbsError::from_errno("ibv_query_gid", rc));
        }
        // SAFETY: `raw` is the 16-byte view of the union; every bit pattern is valid.
        Ok(Gid(unsafe { gid.raw }))
    }

    /// Chooses the source GID of `port`: on RoCE, the RoCE v2 entry (IPv4-mapped first), using
    /// sysfs `gid_attrs/types` where present; on InfiniBand, entry 0.
    pub fn select_gid(&self, port: u8) -> Result<GidSelection, VerbsError> {
        let info = self.query_port(port)?;
        let types_dir = Path::new(SYSFS_IB)
            .join(&self.inner.info.name)
            .join("ports")
            .join(port.to_string())
            .join("gid_attrs/types");
        let len = info.gid_table_len.min(256);
        let mut entries = Vec::new();
        for i in 0..len {
            let Ok(index) = u8::try_from(i) else { break };
            let Ok(gid) = self.query_gid(port, index) else {
                continue;
            };
            if gid.is_zero() {
                continue;
            }
            let kind = fs::read_to_string(types_dir.join(i.to_string()))
                .map(|s| GidKind::parse(&s))
                .unwrap_or(GidKind::Unknown);
            entries.push((index, gid, kind));
        }
        choose_gid(info.link_layer, &entries).ok_or_else(|| VerbsError::NoUsableGid {
            device: self.inner.info.name.clone(),
            port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: u8, b: u8, c: u8, d: u8) -> Gid {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[a, b, c, d]);
        Gid(g)
    }

    fn link_local() -> Gid {
        let mut g = [0u8; 16];
        g[0] = 0xfe;
        g[1] = 0x80;
        g[15] = 7;
        Gid(g)
    }

    #[test]
    fn roce_prefers_v2_ipv4_then_v2_then_unknown() {
        let entries = [
            (0, link_local(), GidKind::RoceV1),
            (1, link_local(), GidKind::RoceV2),
            (2, v4(10, 0, 0, 1), GidKind::RoceV1),
            (3, v4(10, 0, 0, 1), GidKind::RoceV2),
        ];
        let s = choose_gid(LinkLayer::Ethernet, &entries).expect("a gid");
        assert_eq!((s.index, s.kind), (3, GidKind::RoceV2));
        assert_eq!(s.gid.ipv4(), Some(std::net::Ipv4Addr::new(10, 0, 0, 1)));
        // no v4-mapped v2: the link-local v2 entry
        let s = choose_gid(LinkLayer::Ethernet, &entries[..2]).expect("a gid");
        assert_eq!(s.index, 1);
        // sysfs without types (rxe on old kernels): first IPv4-mapped
        let unknown = [
            (0, link_local(), GidKind::Unknown),
            (1, v4(10, 0, 0, 2), GidKind::Unknown),
        ];
        assert_eq!(
            choose_gid(LinkLayer::Ethernet, &unknown).map(|s| s.index),
            Some(1)
        );
        assert_eq!(choose_gid(LinkLayer::Ethernet, &[]), None);
        let zero = [(0, Gid::default(), GidKind::RoceV2)];
        assert_eq!(choose_gid(LinkLayer::Ethernet, &zero), None);
    }

    #[test]
    fn infiniband_uses_index_zero() {
        let entries = [
            (0, link_local(), GidKind::Unknown),
            (1, v4(1, 2, 3, 4), GidKind::RoceV2),
        ];
        let s = choose_gid(LinkLayer::Infiniband, &entries).expect("a gid");
        assert_eq!((s.index, s.kind), (0, GidKind::Ib));
    }

    #[test]
    fn mtu_bytes() {
        assert_eq!(Mtu::M256.bytes(), 256);
        assert_eq!(Mtu::M1024.bytes(), 1024);
        assert_eq!(Mtu::M4096.bytes(), 4096);
        assert_eq!(Mtu::from_raw(9), None);
    }

    #[test]
    fn sysfs_locality_is_read_where_present_and_absent_is_unknown() {
        let root = std::env::temp_dir().join(format!("kvwire-verbs-sysfs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        // a PCI device reached through a switch, like mlx5 on an H20 node
        let pci = root.join("devices/pci0000:16/0000:16:01.0/0000:17:00.0");
        fs::create_dir_all(pci.join("net/ens1np0")).expect("mkdir");
        fs::write(pci.join("numa_node"), "1\n").expect("write");
        let ib = root.join("class/infiniband/mlx5_0");
        fs::create_dir_all(&ib).expect("mkdir");
        std::os::unix::fs::symlink(&pci, ib.join("device")).expect("symlink");
        let info = DeviceInfo::from_sysfs_dir("mlx5_0".into(), 7, &ib);
        assert_eq!(info.numa_node, Some(1));
        assert_eq!(info.pci_address.as_deref(), Some("0000:17:00.0"));
        assert!(info
            .pci_path
            .as_ref()
            .is_some_and(|p| p.ends_with("0000:16:01.0/0000:17:00.0")));
        assert_eq!(info.netdevs, vec!["ens1np0".to_string()]);

        // a soft device: no PCI function, parent netdev, numa_node -1 elsewhere
        let rxe = root.join("class/infiniband/rxe0");
        fs::create_dir_all(&rxe).expect("mkdir");
        fs::write(rxe.join("parent"), "veth0\n").expect("write");
        let info = DeviceInfo::from_sysfs_dir("rxe0".into(), 0, &rxe);
        assert_eq!(info.numa_node, None);
        assert_eq!(info.pci_address, None);
        assert_eq!(info.netdevs, vec!["veth0".to_string()]);

        let nodev = DeviceInfo::from_sysfs_dir("x".into(), 0, &root.join("nope"));
        assert_eq!(nodev.numa_node, None);
        assert!(nodev.netdevs.is_empty());
        let _ = fs::remove_dir_all(&root);
    }
}
