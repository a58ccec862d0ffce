//! The metrics endpoint's request parser: never a panic; a request is complete only with its
//! blank line, and too large only beyond the bound.
#![no_main]

use kvwire_transfer::metrics::{parse_request, Request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let r = parse_request(data);
    let complete = data.windows(4).any(|w| w == b"\r\n\r\n");
    if !complete && data.len() < 8192 {
        assert_eq!(r, Request::Incomplete);
    }
});
