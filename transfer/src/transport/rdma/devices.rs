//! RDMA devices ([`Dev`]: context, PD, CQ, port, GID; [`Nic`]: a device as the engines of the
//! process share it) and their queue pairs ([`DevQp`], counted against the device's completion
//! queue budget); which devices to open (named, nearest a PCI device, or all) and how the
//! devices of two engines pair up.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use kvwire_verbs::{Context, Cq, GidSelection, LinkLayer, Mtu, Pd, Qp, QpCaps, Verbs, VerbsError};

use crate::config::EngineConfig;
use crate::error::Error;
use crate::wire::rdma::{LINK_ETH_V4, LINK_ETH_V6, LINK_IB};

/// Send queue depth per QP.
pub(super) const QP_DEPTH: u32 = 256;
/// Scatter-gather entries per work request asked of a QP (the device may allow fewer): with
/// 16 KiB KV blocks, 16 entries let one WR move 256 KiB of blocks that are scattered locally
/// and contiguous at the peer.
pub(super) const MAX_SGE: u32 = 16;
/// Completion queue entries per device (shared by every QP of the device, capped by the
/// device's limit). Sized as if every WR were signalled: at most `CQ entries / QP_DEPTH` QPs exist at once
/// on a device (counting QPs prepared for handshakes); beyond that a handshake does not offer
/// rdma.
const CQ_ENTRIES: u32 = 65536;

pub(super) struct Dev {
    pub(super) name: String,
    pub(super) _ctx: Context,
    pub(super) pd: Pd,
    pub(super) cq: Cq,
    pub(super) port: u8,
    pub(super) gid: GidSelection,
    pub(super) lid: u16,
    pub(super) mtu: Mtu,
    pub(super) link: u8,
    pub(super) cq_entries: usize,
    /// Local scatter-gather entries a WRITE and a READ may carry on this device's QPs.
    pub(super) sge_write: u32,
    pub(super) sge_read: u32,
    /// The largest memory region the device registers (bytes; 0: it did not say).
    pub(super) max_mr: u64,
    pub(super) live_qps: Arc<AtomicUsize>,
    /// WRs posted on this device's QPs and not completed yet (a hint for the completion
    /// thread's poll window).
    pub(super) inflight: Arc<AtomicUsize>,
}

/// A device opened for this process, shared by the engines that use it.
pub(super) struct Nic {
    pub(super) dev: Arc<Dev>,
    /// The completion thread's poll window in µs: the largest any engine using the device
    /// asked for.
    pub(super) poll_us: Arc<AtomicU64>,
    pub(super) stop: Arc<AtomicBool>,
}

impl std::ops::Deref for Nic {
    type Target = Dev;
    fn deref(&self) -> &Dev {
        &self.dev
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        // The last engine using the device let go: the completion thread ends at its next
        // wake-up and drops its reference, which closes the device.
        self.stop.store(true, Ordering::Release);
    }
}

/// A QP of a device, counted against the device's QP budget while it lives (every QP's
/// signalled WRs must fit the device's shared CQ).
pub(crate) struct DevQp {
    pub(super) qp: Qp,
    pub(super) live: Arc<AtomicUsize>,
}

impl std::ops::Deref for DevQp {
    type Target = Qp;
    fn deref(&self) -> &Qp {
        &self.qp
    }
}

impl Drop for DevQp {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Dev {
    /// A new RC QP, or an error when the CQ could not absorb one more QP's worth of WRs.
    pub(super) fn create_qp(&self) -> Result<DevQp, Error> {
        let max = (self.cq_entries / QP_DEPTH as usize).max(1);
        if self.live_qps.fetch_add(1, Ordering::AcqRel) >= max {
            self.live_qps.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Unsupported(format!(
                "RDMA device {}: {max} queue pairs in use (completion queue budget)",
                self.name
            )));
        }
        match self
            .pd
            .create_rc_qp(&self.cq, &self.cq, qp_caps(self.sge_write))
        {
            Ok(qp) => Ok(DevQp {
                qp,
                live: self.live_qps.clone(),
            }),
            Err(e) => {
                self.live_qps.fetch_sub(1, Ordering::AcqRel);
                Err(verbs_err(e))
            }
        }
    }
}

impl Dev {
    /// Opens device `name` (port 1 must be active); see `nics` for the one place that does.
    pub(super) fn open(verbs: &Verbs, name: &str) -> Result<Dev, VerbsError> {
        let ctx = verbs.open(name)?;
        let port = ctx.query_port(1)?;
        if !port.active {
            return Err(VerbsError::InvalidArgument(format!(
                "port 1 of {name} is not active"
            )));
        }
        let gid = ctx.select_gid(1)?;
        let pd = ctx.alloc_pd()?;
        let cq_entries = CQ_ENTRIES.min(ctx.max_cqe().max(1));
        let cq = ctx.create_cq(cq_entries)?;
        let sge_write = MAX_SGE.min(ctx.max_sge()).max(1);
        let sge_read = sge_write.min(ctx.max_sge_rd()).max(1);
        let max_mr = ctx.max_mr_size();
        Ok(Dev {
            name: name.to_string(),
            pd,
            cq,
            port: 1,
            link: link_class(port.link_layer, &gid),
            gid,
            lid: port.lid,
            mtu: port.active_mtu,
            _ctx: ctx,
            cq_entries: cq_entries as usize,
            sge_write,
            sge_read,
            max_mr,
            live_qps: Arc::new(AtomicUsize::new(0)),
            inflight: Arc::new(AtomicUsize::new(0)),
        })
    }
}

fn link_class(link: LinkLayer, gid: &GidSelection) -> u8 {
    match link {
        LinkLayer::Infiniband => LINK_IB,
        _ if gid.gid.ipv4().is_some() => LINK_ETH_V4,
        _ => LINK_ETH_V6,
    }
}

/// Splits a comma list of device names (blanks ignored, duplicates dropped, order kept).
pub(super) fn device_list(s: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for n in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if !out.iter().any(|x| x == n) {
            out.push(n.to_string());
        }
    }
    out
}

/// Natural order of device names: `mlx5_2` before `mlx5_10`.
pub(super) fn natural_key(name: &str) -> (String, u64, String) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, num) = name.split_at(name.len() - digits);
    (
        stem.to_string(),
        num.parse().unwrap_or(u64::MAX),
        name.to_string(),
    )
}

/// The devices the configuration names (`None` = every usable device).
pub(super) fn wanted_devices(cfg: &EngineConfig) -> Option<Vec<String>> {
    if !cfg.rdma_devices.is_empty() {
        let v = device_list(&cfg.rdma_devices.join(","));
        return (!v.is_empty()).then_some(v);
    }
    if let Some(d) = &cfg.rdma_device {
        let v = device_list(d);
        if !v.is_empty() {
            return Some(v);
        }
    }
    cfg.rdma_device_fallback
        .as_deref()
        .map(device_list)
        .filter(|v| !v.is_empty())
}

/// The sysfs path of the PCI device `near` names: a sysfs path, or a PCI address
/// (`0000:1b:00.0`, or with the 8-digit domain `nvidia-smi` prints), looked up under `bus`
/// (`/sys/bus/pci/devices`). `None` when sysfs does not know it.
pub(super) fn pci_sysfs_path(near: &str, bus: &Path) -> Option<PathBuf> {
    let near = near.trim();
    if near.is_empty() {
        return None;
    }
    if near.starts_with('/') {
        return std::fs::canonicalize(near).ok();
    }
    let mut addr = near.to_ascii_lowercase();
    // "00000000:1b:00.0" -> "0000:1b:00.0"
    if let Some((dom, rest)) = addr.split_once(':') {
        if dom.len() == 8 && dom.starts_with("0000") {
            addr = format!("{}:{rest}", &dom[4..]);
        }
    }
    std::fs::canonicalize(bus.join(addr)).ok()
}

/// Devices grouped by how near they sit to `near` in the PCI tree, nearest group first: the
/// more leading components a device's sysfs path shares with `near`'s, the nearer (under the
/// same PCIe switch before the same root port, before the same root complex). Devices without
/// a PCI path come last. Each group keeps the order of `devs`.
pub(super) fn nearness_groups(near: &Path, devs: &[(String, Option<PathBuf>)]) -> Vec<Vec<String>> {
    let common = |p: &Path| {
        near.components()
            .zip(p.components())
            .take_while(|(a, b)| a == b)
            .count()
    };
    let mut scored: Vec<(usize, &String)> = devs
        .iter()
        .map(|(name, path)| (path.as_deref().map_or(0, common), name))
        .collect();
    // Stable: equal scores keep the order of `devs`.
    scored.sort_by_key(|(score, _)| std::cmp::Reverse(*score));
    let mut groups: Vec<Vec<String>> = Vec::new();
    let mut last = None;
    for (score, name) in scored {
        if last != Some(score) {
            groups.push(Vec::new());
            last = Some(score);
        }
        if let Some(g) = groups.last_mut() {
            g.push(name.clone());
        }
    }
    groups
}

/// Pairs the devices of the side whose order decides (`first`, link classes) with the other
/// side's (`second`): device *i* takes the first unmatched device of the same class, scanning
/// from index *i*. Returns `(first index, second index)` in `first` order.
pub(super) fn pair_devices(first: &[u8], second: &[u8]) -> Vec<(usize, usize)> {
    let m = second.len();
    let mut used = vec![false; m];
    let mut out = Vec::new();
    if m == 0 {
        return out;
    }
    for (i, c) in first.iter().enumerate() {
        for k in 0..m {
            let j = (i + k) % m;
            if !used[j] && second[j] == *c {
                used[j] = true;
                out.push((i, j));
                break;
            }
        }
    }
    out
}

fn qp_caps(max_send_sge: u32) -> QpCaps {
    QpCaps {
        max_send_wr: QP_DEPTH,
        max_recv_wr: 1,
        max_send_sge,
        max_recv_sge: 1,
    }
}

pub(super) fn verbs_err(e: VerbsError) -> Error {
    Error::Io(std::io::Error::other(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_pairing_is_rail_aligned_and_the_same_from_both_sides() {
        let e4 = LINK_ETH_V4;
        // equal lists: rail to rail
        assert_eq!(
            pair_devices(&[e4, e4, e4], &[e4, e4, e4]),
            vec![(0, 0), (1, 1), (2, 2)]
        );
        // fewer remote devices: the extra local ones have no partner
        assert_eq!(pair_devices(&[e4, e4, e4], &[e4, e4]), vec![(0, 0), (1, 1)]);
        // link classes must match: IB never pairs with RoCE
        assert_eq!(
            pair_devices(&[LINK_IB, e4], &[e4, LINK_IB]),
            vec![(0, 1), (1, 0)]
        );
        assert!(pair_devices(&[LINK_IB], &[e4, LINK_ETH_V6]).is_empty());
        assert!(pair_devices(&[e4], &[]).is_empty());
        // the side that decides is the same for both (smaller nonce): transposing the result
        // from the other side gives the same pairs
        let a = [e4, LINK_IB, e4];
        let b = [LINK_IB, e4];
        let from_a = pair_devices(&a, &b);
        let seen_by_b: Vec<(usize, usize)> = from_a.iter().map(|&(x, y)| (y, x)).collect();
        assert_eq!(from_a, vec![(0, 1), (1, 0)]);
        assert_eq!(seen_by_b, vec![(1, 0), (0, 1)]);
    }

    #[test]
    fn the_nearest_devices_in_the_pci_tree_come_first() {
        let p = |s: &str| Some(PathBuf::from(s));
        // An HGX-like tree: GPU 0 and mlx5_0 under switch 18, mlx5_1 under switch 28 of the
        // same root complex, mlx5_2 on another root complex, rxe0 without a PCI device.
        let gpu = Path::new(
            "/sys/devices/pci0000:16/0000:16:01.0/0000:18:00.0/0000:19:00.0/0000:1b:00.0",
        );
        let devs = vec![
            (
                "mlx5_2".to_string(),
                p("/sys/devices/pci0000:a0/0000:a0:01.0/0000:a1:00.0"),
            ),
            ("rxe0".to_string(), None),
            (
                "mlx5_1".to_string(),
                p("/sys/devices/pci0000:16/0000:16:02.0/0000:28:00.0/0000:29:00.0"),
            ),
            (
                "mlx5_0".to_string(),
                p("/sys/devices/pci0000:16/0000:16:01.0/0000:18:00.0/0000:19:01.0/0000:1c:00.0"),
            ),
            (
                "mlx5_3".to_string(),
                p("/sys/devices/pci0000:16/0000:16:01.0/0000:18:00.0/0000:19:02.0/0000:1d:00.0"),
            ),
        ];
        assert_eq!(
            nearness_groups(gpu, &devs),
            vec![
                vec!["mlx5_0".to_string(), "mlx5_3".to_string()],
                vec!["mlx5_1".to_string()],
                vec!["mlx5_2".to_string()],
                vec!["rxe0".to_string()],
            ]
        );
        assert!(nearness_groups(gpu, &[]).is_empty());
        // Addresses resolve under a bus directory (here a scratch tree with a symlink, as sysfs
        // has), the nvidia-smi form included; unknown ones do not.
        let dir = std::env::temp_dir().join(format!("kvwire-pci-{}", std::process::id()));
        let target = dir.join("devices/pci0000:16/0000:1b:00.0");
        std::fs::create_dir_all(&target).unwrap();
        let bus = dir.join("bus");
        std::fs::create_dir_all(&bus).unwrap();
        let link = bus.join("0000:1b:00.0");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let want = std::fs::canonicalize(&target).ok();
        assert_eq!(pci_sysfs_path("0000:1B:00.0", &bus), want);
        assert_eq!(pci_sysfs_path("00000000:1b:00.0", &bus), want);
        assert_eq!(pci_sysfs_path("0000:99:00.0", &bus), None);
        assert_eq!(pci_sysfs_path(" ", &bus), None);
        assert_eq!(pci_sysfs_path(target.to_str().unwrap(), &bus), want);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn device_lists_and_natural_order() {
        assert_eq!(device_list(" rxe0, rxe1 ,,rxe0"), vec!["rxe0", "rxe1"]);
        assert!(device_list(" , ").is_empty());
        let mut v = vec!["mlx5_10", "mlx5_2", "mlx5_1", "irdma0"];
        v.sort_by_key(|n| natural_key(n));
        assert_eq!(v, vec!["irdma0", "mlx5_1", "mlx5_2", "mlx5_10"]);
        let cfg = EngineConfig {
            rdma_device: Some("a,b".into()),
            ..Default::default()
        };
        assert_eq!(wanted_devices(&cfg), Some(vec!["a".into(), "b".into()]));
        let cfg = EngineConfig {
            rdma_device: Some("a".into()),
            rdma_devices: vec!["c".into(), "d,e".into()],
            ..Default::default()
        };
        assert_eq!(
            wanted_devices(&cfg),
            Some(vec!["c".into(), "d".into(), "e".into()])
        );
    }
}
