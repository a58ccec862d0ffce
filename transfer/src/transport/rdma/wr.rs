//! A work request as the transport keeps it, independent of the lane it ends up on: its local
//! pieces (a scatter-gather list), its remote address and the remote region's keys; and how
//! consecutive slices of a batch gather into one request.
//!
//! KV blocks that are scattered in P's cache and land in a run of D's blocks (or of a landing
//! pool's slots) are contiguous at the remote side only, so coalescing cannot merge them; one
//! WRITE with a scatter-gather list can: it reads its local pieces in order and writes them to
//! consecutive remote bytes (a READ scatters its remote bytes over its local pieces alike).
//! That cuts the work requests, and the CPU and completions they cost, by up to the
//! device's scatter-gather limit.

use std::sync::Arc;

use smallvec::SmallVec;

use kvwire_verbs::SendOp;

/// One local piece of a work request: an address and a length inside one chunk of the
/// region of the entry's `MrSet` (its lkey depends on the chunk and on the device the lane is
/// on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    pub(super) addr: u64,
    pub(super) len: u32,
    /// The chunk of the local registration it lies in (0 unless the region is registered in
    /// chunks).
    pub(super) chunk: u32,
}

/// A slice, independent of the lane (device pair) it ends up on.
#[derive(Clone)]
pub(super) struct Wr {
    pub(super) op: SendOp,
    /// Local pieces, in the order their bytes go to (or come from) the remote range; never
    /// empty.
    pub(super) local: SmallVec<[Piece; 1]>,
    /// Bytes of all local pieces.
    pub(super) len: u32,
    /// Remote address and the region's rkey per remote device (0 = unknown).
    pub(super) raddr: u64,
    pub(super) rkeys: Arc<[u32]>,
}

impl Wr {
    pub(super) fn new(op: SendOp, local: Piece, raddr: u64, rkeys: Arc<[u32]>) -> Wr {
        Wr {
            op,
            local: SmallVec::from_buf([local]),
            len: local.len,
            raddr,
            rkeys,
        }
    }

    /// Adds `p`, bound for remote address `raddr`, to this request when the remote range
    /// continues this one's, the total stays within `max_len` bytes, and the local pieces stay
    /// within `max_sge` (a piece that continues the last one in local memory, in the same
    /// chunk of the registration, extends it).
    /// The caller checks that both name the same local registration and remote region.
    pub(super) fn gather(&mut self, p: Piece, raddr: u64, max_sge: usize, max_len: u64) -> bool {
        let len = u64::from(self.len);
        if self.raddr.checked_add(len) != Some(raddr) || len + u64::from(p.len) > max_len {
            return false;
        }
        let Ok(total) = u32::try_from(len + u64::from(p.len)) else {
            return false;
        };
        let n = self.local.len();
        match self.local.last_mut() {
            Some(last)
                if last.chunk == p.chunk
                    && last.addr.checked_add(u64::from(last.len)) == Some(p.addr) =>
            {
                last.len += p.len; // ≤ total, which fits
            }
            _ if n >= max_sge => return false,
            _ => self.local.push(p),
        }
        self.len = total;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wr(addr: u64, len: u32, raddr: u64) -> Wr {
        Wr::new(SendOp::Write, p(addr, len), raddr, Arc::from([7u32]))
    }

    fn p(addr: u64, len: u32) -> Piece {
        Piece {
            addr,
            len,
            chunk: 0,
        }
    }

    #[test]
    fn scattered_pieces_with_a_contiguous_remote_range_gather_up_to_the_sge_limit() {
        let mut w = wr(0x1000, 16, 0x9000);
        // local blocks in reverse order, remote bytes in a row
        assert!(w.gather(p(0x0800, 16), 0x9010, 3, 1 << 20));
        assert!(w.gather(p(0x0400, 16), 0x9020, 3, 1 << 20));
        assert!(
            !w.gather(p(0x0200, 16), 0x9030, 3, 1 << 20),
            "a fourth entry"
        );
        assert_eq!(
            w.local.as_slice(),
            &[p(0x1000, 16), p(0x0800, 16), p(0x0400, 16)]
        );
        assert_eq!((w.len, w.raddr), (48, 0x9000));
    }

    #[test]
    fn a_piece_that_continues_the_last_one_locally_extends_it() {
        let mut w = wr(0x1000, 16, 0x9000);
        assert!(w.gather(p(0x1010, 32), 0x9010, 1, 1 << 20));
        assert_eq!(w.local.as_slice(), &[p(0x1000, 48)]);
        assert_eq!(w.len, 48);
        // one entry allowed, and the next piece does not continue it
        assert!(!w.gather(p(0x5000, 16), 0x9030, 1, 1 << 20));
        assert_eq!(w.len, 48);
    }

    #[test]
    fn a_piece_in_the_next_chunk_of_the_registration_is_another_entry() {
        let mut w = wr(0x1000, 16, 0x9000);
        let next = Piece {
            chunk: 1,
            ..p(0x1010, 16)
        };
        assert!(w.gather(next, 0x9010, 2, 1 << 20));
        assert_eq!(w.local.as_slice(), &[p(0x1000, 16), next]);
        assert!(
            !w.gather(p(0x1020, 16), 0x9020, 2, 1 << 20),
            "a third entry"
        );
    }

    #[test]
    fn a_gap_or_an_overlap_at_the_remote_side_or_too_many_bytes_start_a_new_request() {
        let mut w = wr(0x1000, 16, 0x9000);
        assert!(!w.gather(p(0x2000, 16), 0x9011, 8, 1 << 20), "gap");
        assert!(!w.gather(p(0x2000, 16), 0x9008, 8, 1 << 20), "overlap");
        assert!(!w.gather(p(0x2000, 16), 0x8ff0, 8, 1 << 20), "before");
        assert!(!w.gather(p(0x2000, 16), 0x9010, 8, 31), "over max_len");
        assert!(w.gather(p(0x2000, 16), 0x9010, 8, 32), "exactly max_len");
        let mut end = wr(0x1000, 16, u64::MAX - 15);
        assert!(
            !end.gather(p(0x2000, 16), 0, 8, 1 << 20),
            "remote address wraps"
        );
        let mut big = wr(0, u32::MAX, 0x1000);
        assert!(
            !big.gather(p(1 << 40, 1), 0x1000 + u64::from(u32::MAX), 8, u64::MAX),
            "over a u32 of bytes"
        );
        assert_eq!(w.local.len(), 2);
    }
}
