//! The responder's side of a connection before the initiator proved anything (Hello or
//! LaneJoin first, then the proof), over arbitrary bytes: never a panic, never "proved" without
//! the secret, and nothing written but a Challenge, a LaneChallenge or a Reject.
#![no_main]

use kvwire_transfer::session::fuzzing;
use kvwire_transfer::wire::{self, CtrlMsg};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let psk: Option<&[u8]> = match data.first() {
        Some(b) if b & 1 == 1 => None,
        _ => Some(b"fuzz-secret"),
    };
    let input = data.get(1..).unwrap_or_default();
    let (proved, out) = fuzzing::responder(input, psk);
    assert!(!proved || psk.is_none(), "proved the secret from fuzz bytes");
    let mut cur = std::io::Cursor::new(&out[..]);
    while (cur.position() as usize) < out.len() {
        match wire::read_ctrl(&mut cur).expect("our own output decodes") {
            CtrlMsg::Challenge { .. } | CtrlMsg::LaneChallenge { .. } | CtrlMsg::Reject { .. } => {}
            m => panic!("sent {m:?} before a proof"),
        }
    }
});
