//! Steps shared by the connector's metrics and event tests: one P peer, a D core fed by hand.
#![allow(dead_code)] // each test binary uses its own subset

use kvwire_connector::msg::Message;
use kvwire_connector::*;

pub const P: PeerId = PeerId(7);
pub const D: PeerId = PeerId(0);
pub const LAYERS: u16 = 2;

pub fn drain_d(d: &mut DSide) -> Vec<DAction> {
    std::iter::from_fn(|| d.poll_action()).collect()
}

pub fn drain_p(p: &mut PSide) -> Vec<PAction> {
    std::iter::from_fn(|| p.poll_action()).collect()
}

pub fn arrive(d: &mut DSide, req: u64, blocks: u32, now: Nanos) {
    let ev = DEvent::Arrived {
        req: RequestId(req),
        peer: P,
        tokens: blocks * 16,
        blocks,
    };
    d.handle(ev, now).unwrap();
}

pub fn from_p(d: &mut DSide, msg: Message, now: Nanos) {
    d.handle(DEvent::Message { from: P, msg }, now).unwrap();
}

pub fn started(d: &mut DSide, req: u64, blocks: u32, now: Nanos) {
    let msg = Message::Started {
        req: RequestId(req),
        layers: LAYERS,
        blocks,
    };
    from_p(d, msg, now);
}

pub fn reserve(d: &mut DSide, req: u64, blocks: &[u32], now: Nanos) {
    let ev = DEvent::Reserved {
        req: RequestId(req),
        blocks: blocks.to_vec(),
    };
    d.handle(ev, now).unwrap();
}
