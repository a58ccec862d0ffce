//! [`MrSet`]: a region's memory registrations, one per device.

use crate::mem::RegionMrs;

/// A registered region: one MR per device and the memory they cover (kept alive next to them).
pub(crate) struct MrSet {
    /// Index = local device index.
    pub(super) mrs: RegionMrs,
    /// Offered to peers (remote rights granted).
    pub(super) offered: bool,
}
