//! The second-stage decoders (engine messages, RDMA control messages, RDMA and shm handshake
//! blobs): never a panic.
#![no_main]

use kvwire_transfer::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (lanes, devs) = match data.first() {
        Some(b) => (usize::from(b & 0x3f) + 1, usize::from(b >> 6) + 1),
        None => (1, 1),
    };
    wire::decode_second_stage(data, lanes, devs);
});
