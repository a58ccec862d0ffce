//! Regions registered in chunks (`EngineConfig::rdma_mr_chunk`, or a NIC's `max_mr_size`):
//! writes and reads that cross the chunk boundaries of both ends, which do not line up, cut
//! exactly there and land byte for byte; every device's keys of every chunk reach the peer;
//! a region that would need too many chunks is refused with a typed error.

use super::*;

/// The target's chunk and the initiator's: whole pages, neither a multiple of the other.
const T_CHUNK: u64 = 10 * 4096;
const I_CHUNK: u64 = 16 * 4096;
const LEN: usize = 1 << 20;

fn chunked(dev_t: &[&str], dev_i: &[&str]) -> (Engine, Engine, Peer, RegionHandle, RegionHandle) {
    let cfg = |chunk| EngineConfig {
        rdma_mr_chunk: Some(chunk),
        ..EngineConfig::from_env()
    };
    let target = engine_cfg(dev_t, TransportKind::Rdma, 4, 64 << 10, cfg(T_CHUNK));
    let init = engine_cfg(dev_i, TransportKind::Rdma, 4, 64 << 10, cfg(I_CHUNK));
    let dst = target.alloc_region(LEN, Access::ReadWrite).expect("dst");
    let src = init.alloc_region(LEN, Access::ReadWrite).expect("src");
    let peer = init.connect(target.listen_addr()).expect("connect");
    assert_eq!(peer.transport(), TransportKind::Rdma);
    (target, init, peer, dst, src)
}

/// Work requests of one op of `len` bytes to remote offset `ro`: one per stretch between the
/// target's chunk boundaries (each shorter than a slice; where the initiator's chunk ends inside
/// one, the request carries a second scatter entry with the next chunk's key, which the device
/// checks).
fn requests(ro: u64, len: u64) -> usize {
    (1..len).filter(|i| (ro + i) % T_CHUNK == 0).count() + 1
}

pub fn chunked_registrations(dev_t: &str, dev_i: &str) {
    let (target, init, peer, dst, src) = chunked(&[dev_t], &[dev_i]);
    let rid = target.region_id(dst);
    // One op over most of both regions, at odd offsets: every chunk boundary of both ends.
    let (lo, ro, n) = (12_345u64, 777u64, 900_000u64);
    let data = pattern(4100, n as usize);
    init.local_write(src, lo, &data).expect("fill");
    let op = Op {
        local: src,
        local_offset: lo,
        remote: rid,
        remote_offset: ro,
        len: n,
    };
    let st = init
        .write(&peer, &[op], None, None)
        .expect("submit")
        .wait()
        .expect("write across the chunks");
    assert_eq!(
        st.slices,
        requests(ro, n),
        "one request per stretch of the target's chunks"
    );
    check_eq(
        "write across chunks",
        &read_back(&target, dst, ro, n as usize),
        &data,
    );
    // READ it back elsewhere: the cuts at the other offsets.
    let back = Op {
        local_offset: 3,
        ..op
    };
    init.local_write(src, 0, &vec![0; LEN]).expect("clear");
    let st = init
        .read(&peer, &[back], None)
        .expect("submit read")
        .wait()
        .expect("read across the chunks");
    assert_eq!(st.slices, requests(ro, n));
    check_eq(
        "read across chunks",
        &read_back(&init, src, 3, n as usize),
        &data,
    );
    // Blocks scattered locally in reverse, landing in a run at the target: gathered requests,
    // cut where a block or the run crosses a chunk.
    const BLOCK: u64 = 12 << 10;
    let ops: Vec<Op> = (0..40u64)
        .map(|b| Op {
            local: src,
            local_offset: (40 - b) * 2 * BLOCK,
            remote: rid,
            remote_offset: 5 + b * BLOCK,
            len: BLOCK,
        })
        .collect();
    for (b, o) in ops.iter().enumerate() {
        init.local_write(
            src,
            o.local_offset,
            &pattern(4200 + b as u64, BLOCK as usize),
        )
        .expect("fill block");
    }
    init.write(&peer, &ops, None, None)
        .expect("submit blocks")
        .wait()
        .expect("scattered blocks across chunks");
    for (b, o) in ops.iter().enumerate() {
        check_eq(
            &format!("block {b}"),
            &read_back(&target, dst, o.remote_offset, BLOCK as usize),
            &pattern(4200 + b as u64, BLOCK as usize),
        );
    }
    println!(
        "chunks of {T_CHUNK} B (target) and {I_CHUNK} B (initiator): {n} B in {} requests each \
         way, 40 scattered blocks: every byte verified",
        requests(ro, n)
    );
    drop(peer);

    // Two devices each: the keys of every chunk on the second device come in a key answer,
    // and once they did the second device's lanes carry the chunked region too.
    let (target, init, peer, dst, src) = chunked(&[dev_t, dev_i], &[dev_i, dev_t]);
    let rid = target.region_id(dst);
    let mut rounds = 0u64;
    loop {
        let data = pattern(4300 + rounds, 300_001);
        init.local_write(src, 1, &data).expect("fill");
        let op = Op {
            local: src,
            local_offset: 1,
            remote: rid,
            remote_offset: 40_000,
            len: data.len() as u64,
        };
        init.write(&peer, &[op], None, None)
            .expect("submit")
            .wait()
            .expect("write over two devices");
        check_eq(
            "two devices",
            &read_back(&target, dst, 40_000, data.len()),
            &data,
        );
        rounds += 1;
        let dc = peer.device_counters();
        if dc.iter().all(|(_, n)| *n > 0) {
            println!("two devices, chunked region: {dc:?} work requests after {rounds} writes");
            break;
        }
        assert!(
            rounds < 200,
            "the second device never carried a chunk: {dc:?}"
        );
    }

    // More chunks than a key message holds: refused, nothing registered.
    let small = engine_cfg(
        &[dev_t],
        TransportKind::Rdma,
        2,
        64 << 10,
        EngineConfig {
            rdma_mr_chunk: Some(4096),
            ..EngineConfig::from_env()
        },
    );
    match small.alloc_region(
        (kvwire_transfer::wire::MAX_MR_CHUNKS + 1) * 4096,
        Access::ReadWrite,
    ) {
        Err(Error::Unsupported(why)) => assert!(why.contains("RDMA registrations"), "{why}"),
        other => panic!("a region of too many chunks: {other:?}"),
    }
    small
        .alloc_region(
            kvwire_transfer::wire::MAX_MR_CHUNKS * 4096,
            Access::ReadWrite,
        )
        .expect("as many chunks as a key message holds");
    println!("CHUNKED-REGISTRATIONS-OK");
}
