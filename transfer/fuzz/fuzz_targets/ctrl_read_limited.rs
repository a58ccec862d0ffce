//! The bounded stream reader, with the expectations the engine reads with before and after
//! authentication: never a panic, never an allocation beyond the bound of what it expects
//! (a counting allocator checks the largest allocation made while reading).
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvwire_transfer::wire::{self, body, kind, Expect, Stage};
use libfuzzer_sys::fuzz_target;

struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, only recording sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LARGEST.fetch_max(n, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

const FIRST: Expect<'static> = Expect {
    stage: Stage::FirstMessage,
    kinds: &[(kind::HELLO, body::HELLO), (kind::LANE_JOIN, body::LANE_JOIN)],
};

const CONTROL: Expect<'static> = Expect {
    stage: Stage::Control,
    kinds: &[
        (kind::REGIONS_ADDED, body::regions(4096)),
        (kind::REGIONS_SET, body::regions(4096)),
        (kind::REGIONS_REMOVED, 4 + 8 * 4096),
        (kind::NOTIFY, 4 + wire::MAX_TAG),
        (kind::TRANSPORT, 5 + wire::MAX_TRANSPORT_MSG as u32),
    ],
};

fuzz_target!(|data: &[u8]| {
    for (expect, bound) in [(FIRST, 8 << 10), (CONTROL, 1 << 20)] {
        let mut cur = std::io::Cursor::new(data);
        LARGEST.store(0, Ordering::Relaxed);
        // Messages in a row, as a connection would carry them.
        for _ in 0..4 {
            if wire::read_ctrl_limited(&mut cur, expect).is_err() {
                break;
            }
        }
        let largest = LARGEST.load(Ordering::Relaxed);
        assert!(largest <= bound, "allocated {largest} bytes (bound {bound})");
    }
});
