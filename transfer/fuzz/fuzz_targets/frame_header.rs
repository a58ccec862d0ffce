//! Data-lane frame headers: decode or refuse, never panic; what decodes encodes back.
#![no_main]

use kvwire_transfer::wire::FrameHeader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = FrameHeader::decode(data) {
        assert_eq!(&h.encode()[..], &data[..40], "round trip");
    }
});
