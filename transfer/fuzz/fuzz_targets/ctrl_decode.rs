//! Control messages: any bytes decode or are refused, never panic; what decodes encodes back
//! to the same kind and body (the header's version and reserved byte aside: a `Reject` of any
//! version decodes, and the reserved byte is not checked).
#![no_main]

use kvwire_transfer::wire::CtrlMsg;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = CtrlMsg::decode(data) {
        let enc = m.encode();
        assert_eq!(enc[6], data[6], "kind");
        assert_eq!(enc[8..], data[8..], "round trip");
    }
    if let Some((k, body)) = data.split_first() {
        if let Ok(m) = CtrlMsg::decode_body(*k, body) {
            assert_eq!(CtrlMsg::decode_body(m.kind(), &m.encode()[12..]).ok(), Some(m));
        }
    }
});
