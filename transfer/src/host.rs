//! This engine's host identity: boot id, pid and mount namespaces, process id (see
//! [`HostIdentity::same_host`]).

use crate::wire::HostIdentity;

fn read_trim(p: &str) -> String {
    std::fs::read_to_string(p)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn link(p: &str) -> String {
    std::fs::read_link(p)
        .map(|l| l.to_string_lossy().into_owned())
        .unwrap_or_default()
}

pub(crate) fn host_identity() -> HostIdentity {
    HostIdentity {
        boot_id: read_trim("/proc/sys/kernel/random/boot_id"),
        pid_ns: link("/proc/self/ns/pid"),
        mnt_ns: link("/proc/self/ns/mnt"),
        pid: std::process::id(),
    }
}
