//! Error payloads of `Reject` messages and error frames: decode or refuse, never panic; an
//! error that decodes re-encodes to one of the same kind (messages of peers get a prefix).
#![no_main]

use kvwire_transfer::metrics::error_kind;
use kvwire_transfer::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for flip in [false, true] {
        if let Ok(e) = wire::decode_error(data, flip) {
            let again = wire::decode_error(&wire::encode_error(&e), false).expect("re-encoded");
            assert_eq!(error_kind(&again), error_kind(&e), "{e} became {again}");
        }
    }
});
