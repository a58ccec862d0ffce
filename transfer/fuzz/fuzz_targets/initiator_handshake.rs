//! The initiator's side (handshake up to its proof, then a lane join) against arbitrary
//! responder bytes: never a panic, a proof only to a responder that required one, and no lane
//! proof to a listener that did not prove the lane key.
#![no_main]

use kvwire_transfer::session::fuzzing;
use kvwire_transfer::wire::{self, CtrlMsg};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let out = fuzzing::initiator(data, Some(b"fuzz-secret"));
    let mut cur = std::io::Cursor::new(&out[..]);
    let mut sent = Vec::new();
    while (cur.position() as usize) < out.len() {
        sent.push(wire::read_ctrl(&mut cur).expect("our own output decodes"));
    }
    let mut input = std::io::Cursor::new(data);
    let required = matches!(
        wire::read_ctrl(&mut input),
        Ok(CtrlMsg::Challenge {
            auth_required: true,
            ..
        })
    );
    if sent.iter().any(|m| matches!(m, CtrlMsg::Proof { .. })) {
        assert!(required, "proved the secret to a responder that did not ask");
    }
    // A lane proof needs the listener's MAC under a key the fuzzer does not know.
    assert!(!sent.iter().any(|m| matches!(m, CtrlMsg::LaneProof { .. })));
});
