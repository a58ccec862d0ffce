//! Layer streams between two processes on loopback (tcp and shm), host memory, simulated
//! layer compute. Every destination byte is checked against the expected image by the target
//! process (FNV-1a hash of its whole region), and the source is re-read and checked too.
//!
//! The target is this test binary re-executed with `--ignored --exact child_target_entry`.

#[path = "common/child.rs"]
mod child;
#[cfg(feature = "cuda")]
#[path = "common/gpu.rs"]
mod gpu;

use std::io::BufRead;
use std::sync::Arc;
use std::time::Duration;

use child::{fnv, Child};

use kvwire_testkit::pattern;
use kvwire_transfer::layer::{
    synthetic_block_tables, BlockLists, HostFlag, HostStager, Immediate, KvLayout, KvOrder,
    KvPlacement, LayerError, LayerStream, SrcSpace, StagingPool, StreamOptions,
};
use kvwire_transfer::{Access, Engine, EngineConfig, Peer, RegionHandle, RegionId, TransportKind};

const CHILD_ENV: &str = "KVWIRE_LAYER_TEST_CHILD";

fn transport_name(t: TransportKind) -> &'static str {
    match t {
        TransportKind::Shm => "shm",
        _ => "tcp",
    }
}

/// Each test below twice, over tcp and over shm: module `name` with tests `tcp` and `shm`,
/// each calling `body(transport, args...)`.
macro_rules! over_tcp_and_shm {
    ($($name:ident => $body:ident($($arg:expr),*);)*) => {$(
        mod $name {
            use super::*;
            #[test]
            fn tcp() {
                $body(TransportKind::Tcp $(, $arg)*);
            }
            #[test]
            fn shm() {
                $body(TransportKind::Shm $(, $arg)*);
            }
        }
    )*};
}

over_tcp_and_shm! {
    random_tables_land_at_the_right_blocks => random_tables();
    layers_ready_before_and_after_destination => ready_before_and_after_destination();
    out_of_order_readiness => out_of_order(false);
    out_of_order_readiness_staged => out_of_order(true);
    abort_mid_stream_frees_staging_buffers => abort_mid_stream();
}

/// The target process: one write-only region; answers HASH/ZERO/NOTIFY on stdin.
#[test]
#[ignore = "entry point of the target process (run by the other tests)"]
fn child_target_entry() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let len: usize = std::env::var("KVWIRE_LAYER_TEST_LEN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 20);
    let transport = match std::env::var("KVWIRE_LAYER_TEST_TRANSPORT").as_deref() {
        Ok("shm") => TransportKind::Shm,
        _ => TransportKind::Tcp,
    };
    let engine = Engine::new(EngineConfig {
        transport,
        ..EngineConfig::default()
    })
    .unwrap();
    let region = engine.alloc_region(len, Access::WriteOnly).unwrap();
    let notes = engine.notifications();
    println!("KVW READY {}", engine.listen_addr());
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["HASH", off, n] => {
                let (off, n): (u64, usize) = (off.parse().unwrap(), n.parse().unwrap());
                let mut buf = vec![0u8; n];
                engine.local_read(region, off, &mut buf).unwrap();
                println!("KVW HASH {}", fnv(&buf));
            }
            ["ZERO"] => {
                engine.local_write(region, 0, &vec![0u8; len]).unwrap();
                println!("KVW OK");
            }
            ["NOTIFY", ms] => child::answer_notification(&notes, ms),
            _ => println!("KVW ERR"),
        }
    }
}

struct Target {
    child: Child,
    addr: std::net::SocketAddr,
}

impl Target {
    fn spawn(len: usize, transport: TransportKind) -> Target {
        let env = [
            (CHILD_ENV, "1".to_string()),
            ("KVWIRE_LAYER_TEST_LEN", len.to_string()),
            (
                "KVWIRE_LAYER_TEST_TRANSPORT",
                transport_name(transport).to_string(),
            ),
        ];
        let (child, ready) = Child::spawn("child_target_entry", true, &env);
        Target {
            child,
            addr: ready.trim().parse().unwrap(),
        }
    }

    fn hash(&mut self, off: u64, len: u64) -> u64 {
        let r = self.child.cmd(&format!("HASH {off} {len}"));
        r.strip_prefix("HASH ").expect(&r).parse().unwrap()
    }

    fn notification(&mut self, ms: u64) -> Option<String> {
        let r = self.child.cmd(&format!("NOTIFY {ms}"));
        r.strip_prefix("TAG ").map(str::to_string)
    }

    fn zero(&mut self) {
        assert_eq!(self.child.cmd("ZERO"), "OK");
    }
}

/// One side of a test setup: initiator engine connected to a target process.
struct Setup {
    engine: Engine,
    peer: Peer,
    target: Target,
    dst: RegionId,
    src: RegionHandle,
    layers: usize,
    nb: u32,
    bb: u64,
    len: u64,
}

impl Setup {
    fn new(transport: TransportKind, layers: usize, nb: u32, bb: u64) -> Setup {
        let len = KvPlacement::<u32>::packed_len(layers, nb, bb).unwrap();
        let target = Target::spawn(len as usize, transport);
        let engine = Engine::new(EngineConfig {
            transport,
            ..EngineConfig::default()
        })
        .unwrap();
        let peer = engine.connect(target.addr).unwrap();
        assert_eq!(peer.transport(), transport);
        let dst = peer.regions()[0].id;
        let src = engine.alloc_region(len as usize, Access::Local).unwrap();
        Setup {
            engine,
            peer,
            target,
            dst,
            src,
            layers,
            nb,
            bb,
            len,
        }
    }

    fn fill_src(&self, seed: u64) -> Vec<u8> {
        let img = pattern::bytes(seed, 0, self.len as usize);
        self.engine.local_write(self.src, 0, &img).unwrap();
        img
    }

    fn layout(&self, order: KvOrder) -> Arc<KvLayout> {
        let s = KvPlacement::packed(
            SrcSpace::Region(self.src),
            0,
            self.layers,
            self.nb,
            self.bb,
            order,
        )
        .unwrap();
        let d = KvPlacement::packed(self.dst, 0, self.layers, self.nb, self.bb, order).unwrap();
        Arc::new(KvLayout::new(s, d, self.bb).unwrap())
    }

    /// The destination image expected after sending `src_blocks → dst_blocks` for `layers`,
    /// computed block by block from the placement formula (not from the extents).
    fn expected(
        &self,
        img: &[u8],
        order: KvOrder,
        layers: &[usize],
        src_blocks: &[u32],
        dst_blocks: &[u32],
    ) -> Vec<u8> {
        let mut out = vec![0u8; self.len as usize];
        let nb = u64::from(self.nb);
        let bb = self.bb;
        for &l in layers {
            for p in 0..2u64 {
                for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
                    let off = |b: u64| match order {
                        KvOrder::KvMajor => l as u64 * 2 * nb * bb + p * nb * bb + b * bb,
                        KvOrder::BlockMajor => l as u64 * 2 * nb * bb + b * 2 * bb + p * bb,
                    };
                    let (so, d_o) = (off(u64::from(s)) as usize, off(u64::from(d)) as usize);
                    out[d_o..d_o + bb as usize].copy_from_slice(&img[so..so + bb as usize]);
                }
            }
        }
        out
    }

    fn check_both_ends(&mut self, img: &[u8], expected: &[u8]) {
        let mut again = vec![0u8; self.len as usize];
        self.engine.local_read(self.src, 0, &mut again).unwrap();
        assert!(again == img, "source bytes changed");
        assert_eq!(
            self.target.hash(0, self.len),
            fnv(expected),
            "destination image differs"
        );
    }
}

fn shuffled(v: &mut [u32], seed: u64) {
    let mut s = seed | 1;
    for i in (1..v.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
}

fn random_tables(transport: TransportKind) {
    let mut st = Setup::new(transport, 6, 512, 256);
    for (round, order) in [KvOrder::KvMajor, KvOrder::BlockMajor, KvOrder::KvMajor]
        .into_iter()
        .enumerate()
    {
        let seed = 100 + round as u64;
        st.target.zero();
        let img = st.fill_src(seed);
        let (src, mut dst) = synthetic_block_tables(120, st.nb, 24, st.nb, 16, seed).unwrap();
        if round == 2 {
            shuffled(&mut dst, seed); // fully scattered destination
        }
        let layout = st.layout(order);
        let tag = format!("req-{round}");
        let s = LayerStream::open(
            &st.engine,
            &st.peer,
            layout.clone(),
            BlockLists::Shared(src.clone()),
            Some(BlockLists::Shared(dst.clone())),
            StreamOptions {
                tag: Some(tag.clone().into_bytes()),
                ..StreamOptions::default()
            },
        )
        .unwrap();
        for l in 0..st.layers {
            s.layer_ready(l, Immediate).unwrap();
        }
        let stats = s.wait().unwrap();
        assert_eq!(stats.bytes, 120 * 2 * st.bb * st.layers as u64);
        let naive = 120 * 2 * st.layers;
        let planned: usize = layout
            .request_extents(&src, &dst)
            .unwrap()
            .iter()
            .map(Vec::len)
            .sum();
        assert!(
            stats.writes <= planned,
            "engine writes {} > planned {planned}",
            stats.writes
        );
        if round < 2 {
            assert!(
                stats.writes * 5 <= naive,
                "writes {} naive {naive}",
                stats.writes
            );
        }
        assert_eq!(st.target.notification(5000).as_deref(), Some(tag.as_str()));
        let exp = st.expected(&img, order, &(0..st.layers).collect::<Vec<_>>(), &src, &dst);
        st.check_both_ends(&img, &exp);
    }
}

fn ready_before_and_after_destination(transport: TransportKind) {
    let mut st = Setup::new(transport, 8, 256, 128);
    let img = st.fill_src(7);
    let (src, dst) = synthetic_block_tables(40, st.nb, 8, st.nb, 8, 7).unwrap();
    let layout = st.layout(KvOrder::KvMajor);
    let s = LayerStream::open(
        &st.engine,
        &st.peer,
        layout,
        BlockLists::Shared(src.clone()),
        None,
        StreamOptions::default(),
    )
    .unwrap();
    let flags: Vec<HostFlag> = (0..st.layers).map(|_| HostFlag::new()).collect();
    for (l, f) in flags.iter().enumerate() {
        s.layer_ready(l, f.clone()).unwrap();
    }
    // half the layers finish computing before D's block ids are known
    for f in &flags[..4] {
        f.set();
    }
    // without a destination nothing can have been written
    assert!(s.wait_layer_timeout(0, Duration::from_millis(50)).is_none());
    assert!(s.poll().is_none());
    // a bad destination is refused and the stream keeps waiting for a good one
    assert!(matches!(
        s.set_destination(BlockLists::Shared(vec![0; 3])),
        Err(LayerError::InvalidArgument(_))
    ));
    s.set_destination(BlockLists::Shared(dst.clone())).unwrap();
    assert!(matches!(
        s.set_destination(BlockLists::Shared(dst.clone())),
        Err(LayerError::State(_))
    ));
    for l in 0..4 {
        s.wait_layer_timeout(l, Duration::from_secs(10))
            .unwrap()
            .unwrap();
    }
    // the others are not ready, so they cannot have landed
    assert!(s.poll_layer(4).is_none() && s.poll_layer(7).is_none());
    for f in &flags[4..] {
        f.set();
    }
    s.wait().unwrap();
    let exp = st.expected(
        &img,
        KvOrder::KvMajor,
        &(0..st.layers).collect::<Vec<_>>(),
        &src,
        &dst,
    );
    st.check_both_ends(&img, &exp);
}

fn out_of_order(transport: TransportKind, staged: bool) {
    let mut st = Setup::new(transport, 8, 256, 512);
    let img = st.fill_src(11);
    let (src, dst) = synthetic_block_tables(64, st.nb, 16, st.nb, 32, 11).unwrap();
    let layout = st.layout(KvOrder::KvMajor);
    // staging buffers smaller than a layer (64 blocks × 2 × 512 B = 64 KiB): several chunks
    let pool = StagingPool::host(&st.engine, 2, 24 * 1024).unwrap();
    let opts = StreamOptions {
        tag: Some(b"ooo".to_vec()),
        stager: staged.then(|| Arc::new(HostStager::new(st.engine.clone(), pool.clone())) as _),
        ..StreamOptions::default()
    };
    let s = LayerStream::open(
        &st.engine,
        &st.peer,
        layout,
        BlockLists::Shared(src.clone()),
        Some(BlockLists::Shared(dst.clone())),
        opts,
    )
    .unwrap();
    let flags: Vec<HostFlag> = (0..st.layers).map(|_| HostFlag::new()).collect();
    // readiness handed over in a scrambled order, fired in yet another
    for l in [3usize, 0, 7, 1, 6, 2, 5, 4] {
        s.layer_ready(l, flags[l].clone()).unwrap();
    }
    let order = [6usize, 2, 7, 0, 5, 1, 4, 3];
    for (i, &l) in order.iter().enumerate() {
        flags[l].set();
        let ls = s
            .wait_layer_timeout(l, Duration::from_secs(10))
            .unwrap()
            .unwrap();
        assert_eq!(ls.bytes, 64 * 2 * 512);
        // layers not yet set cannot have completed, nor can the stream
        for &later in &order[i + 1..] {
            assert!(s.poll_layer(later).is_none());
        }
        if i + 1 < order.len() {
            assert!(s.poll().is_none());
            assert_eq!(
                st.target.notification(1),
                None,
                "notification before all layers landed"
            );
        }
    }
    let stats = s.wait().unwrap();
    assert_eq!(stats.bytes, 8 * 64 * 2 * 512);
    assert_eq!(st.target.notification(5000).as_deref(), Some("ooo"));
    let exp = st.expected(
        &img,
        KvOrder::KvMajor,
        &(0..st.layers).collect::<Vec<_>>(),
        &src,
        &dst,
    );
    st.check_both_ends(&img, &exp);
    assert_eq!(pool.in_use(), 0, "staging buffers leaked");
    if staged {
        assert!(
            pool.leased_total() >= 8 * 3,
            "expected several chunks per layer, got {}",
            pool.leased_total()
        );
        assert!(stats.batches >= 8 * 3);
    }
}

#[test]
fn per_layer_block_lists_tcp() {
    let mut st = Setup::new(TransportKind::Tcp, 4, 128, 256);
    let img = st.fill_src(21);
    let layout = st.layout(KvOrder::BlockMajor);
    let mut src = Vec::new();
    let mut dst = Vec::new();
    for l in 0..4u64 {
        // a different number of blocks per layer, the last layer with none
        let n = if l == 3 { 0 } else { 10 + 7 * l as usize };
        let (s, d) = synthetic_block_tables(n, st.nb, 5, st.nb, 3, 40 + l).unwrap();
        src.push(s);
        dst.push(d);
    }
    let s = LayerStream::open(
        &st.engine,
        &st.peer,
        layout,
        BlockLists::PerLayer(src.clone()),
        None,
        StreamOptions {
            tag: Some(b"per-layer".to_vec()),
            ..StreamOptions::default()
        },
    )
    .unwrap();
    // a destination with the wrong number of layers is refused
    assert!(matches!(
        s.set_destination(BlockLists::PerLayer(dst[..2].to_vec())),
        Err(LayerError::InvalidArgument(_))
    ));
    for l in (0..4).rev() {
        s.layer_ready(l, Immediate).unwrap();
    }
    s.set_destination(BlockLists::PerLayer(dst.clone()))
        .unwrap();
    let stats = s.wait().unwrap();
    assert_eq!(stats.bytes, (10 + 17 + 24) * 2 * 256);
    assert_eq!(st.target.notification(5000).as_deref(), Some("per-layer"));
    let span = (2 * 128 * 256) as usize;
    let mut exp = vec![0u8; st.len as usize];
    for l in 0..4 {
        let e = st.expected(&img, KvOrder::BlockMajor, &[l], &src[l], &dst[l]);
        exp[l * span..(l + 1) * span].copy_from_slice(&e[l * span..(l + 1) * span]);
    }
    st.check_both_ends(&img, &exp);
}

/// A stager that says it orders copies after CUDA events on the device (as the CUDA stager
/// does), copying host memory and recording which events it was asked to wait for.
struct EventOrderedStager {
    inner: HostStager,
    seen: std::sync::Mutex<Vec<Option<u64>>>,
}

impl kvwire_transfer::layer::Stager for EventOrderedStager {
    fn pool(&self) -> &Arc<StagingPool> {
        self.inner.pool()
    }
    fn orders_after_events(&self) -> bool {
        true
    }
    fn stage(
        &self,
        after_event: Option<u64>,
        copies: Vec<kvwire_transfer::layer::StageCopy>,
        lease: kvwire_transfer::layer::Lease,
        done: kvwire_transfer::layer::StageDone,
    ) {
        self.seen.lock().unwrap().push(after_event);
        self.inner.stage(after_event, copies, lease, done)
    }
    fn can_read(&self, src: SrcSpace) -> bool {
        self.inner.can_read(src)
    }
}

/// A readiness carrying a (fake) CUDA event; waiting for it on the host would be wrong.
struct FakeEvent(u64);

impl kvwire_transfer::layer::Readiness for FakeEvent {
    fn notify(self: Box<Self>, signal: kvwire_transfer::layer::ReadySignal) {
        signal.fire(Err("host wait on a device-ordered event".into()));
    }
    fn cuda_event(&self) -> Option<u64> {
        Some(self.0)
    }
}

#[test]
fn device_ordered_events_are_not_waited_on_the_host() {
    use kvwire_transfer::layer::Stager;
    let mut st = Setup::new(TransportKind::Shm, 4, 64, 1024);
    let img = st.fill_src(31);
    let (src, dst) = synthetic_block_tables(20, st.nb, 6, st.nb, 6, 31).unwrap();
    let pool = StagingPool::host(&st.engine, 2, 16 * 1024).unwrap();
    let stager = Arc::new(EventOrderedStager {
        inner: HostStager::new(st.engine.clone(), pool.clone()),
        seen: std::sync::Mutex::new(Vec::new()),
    });
    let s = LayerStream::open(
        &st.engine,
        &st.peer,
        st.layout(KvOrder::KvMajor),
        BlockLists::Shared(src.clone()),
        None,
        StreamOptions {
            stager: Some(stager.clone()),
            ..StreamOptions::default()
        },
    )
    .unwrap();
    for l in 0..4 {
        s.layer_ready(l, FakeEvent(0xE0 + l as u64)).unwrap();
    }
    s.set_destination(BlockLists::Shared(dst.clone())).unwrap();
    s.wait().unwrap();
    let mut seen: Vec<u64> = stager
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.unwrap())
        .collect();
    seen.dedup();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen, vec![0xE0, 0xE1, 0xE2, 0xE3]);
    assert_eq!(stager.pool().in_use(), 0);
    let exp = st.expected(&img, KvOrder::KvMajor, &[0, 1, 2, 3], &src, &dst);
    st.check_both_ends(&img, &exp);
}

fn abort_mid_stream(transport: TransportKind) {
    let mut st = Setup::new(transport, 8, 256, 512);
    let img = st.fill_src(13);
    let (src, dst) = synthetic_block_tables(64, st.nb, 16, st.nb, 32, 13).unwrap();
    let layout = st.layout(KvOrder::KvMajor);
    let pool = StagingPool::host(&st.engine, 2, 16 * 1024).unwrap();
    let opts = StreamOptions {
        tag: Some(b"never".to_vec()),
        stager: Some(Arc::new(HostStager::new(st.engine.clone(), pool.clone()))),
        ..StreamOptions::default()
    };
    let s = LayerStream::open(
        &st.engine,
        &st.peer,
        layout,
        BlockLists::Shared(src.clone()),
        Some(BlockLists::Shared(dst.clone())),
        opts,
    )
    .unwrap();
    let flags: Vec<HostFlag> = (0..st.layers).map(|_| HostFlag::new()).collect();
    for (l, f) in flags.iter().enumerate() {
        s.layer_ready(l, f.clone()).unwrap();
    }
    for f in &flags[..3] {
        f.set();
    }
    s.wait_layer_timeout(0, Duration::from_secs(10))
        .unwrap()
        .unwrap();
    s.abort("decode side went away");
    let err = s.wait().unwrap_err();
    assert!(matches!(err, LayerError::Aborted(_)), "{err}");
    assert_eq!(pool.in_use(), 0, "staging buffers not returned after abort");
    for l in 3..8 {
        assert!(matches!(s.poll_layer(l), Some(Err(LayerError::Aborted(_)))));
    }
    // layers made ready after the abort are refused, and nothing more is sent
    for f in &flags[3..] {
        f.set();
    }
    assert!(s.layer_ready(0, Immediate).is_err());
    assert_eq!(
        st.target.notification(300),
        None,
        "aborted stream notified the target"
    );
    // layer 0 landed completely before the abort
    let exp0 = st.expected(&img, KvOrder::KvMajor, &[0], &src, &dst);
    let l0 = 2 * 256 * 512u64;
    assert_eq!(st.target.hash(0, l0), fnv(&exp0[..l0 as usize]));
    // and the untouched layers stay zero
    let tail = &exp0[(4 * l0) as usize..];
    assert!(tail.iter().all(|&b| b == 0));
    assert_eq!(st.target.hash(4 * l0, 4 * l0), fnv(tail));
}

#[test]
fn readiness_failure_and_dropped_handle_fail_the_request() {
    let st = Setup::new(TransportKind::Tcp, 4, 64, 256);
    st.fill_src(5);
    let layout = st.layout(KvOrder::KvMajor);
    let pool = StagingPool::host(&st.engine, 2, 8 * 1024).unwrap();
    let blocks: Vec<u32> = (0..16).collect();
    let open = || {
        LayerStream::open(
            &st.engine,
            &st.peer,
            layout.clone(),
            BlockLists::Shared(blocks.clone()),
            Some(BlockLists::Shared(blocks.clone())),
            StreamOptions {
                stager: Some(Arc::new(HostStager::new(st.engine.clone(), pool.clone()))),
                ..StreamOptions::default()
            },
        )
        .unwrap()
    };
    let s = open();
    let f = HostFlag::new();
    s.layer_ready(0, Immediate).unwrap();
    s.layer_ready(1, f.clone()).unwrap();
    assert!(matches!(
        s.layer_ready(1, Immediate),
        Err(LayerError::State(_))
    ));
    assert!(matches!(
        s.layer_ready(9, Immediate),
        Err(LayerError::InvalidArgument(_))
    ));
    f.fail("kernel error");
    assert!(matches!(
        s.wait(),
        Err(LayerError::Readiness { layer: 1, .. })
    ));
    assert_eq!(pool.in_use(), 0);
    // a stream whose handle is dropped mid-way releases its buffers too
    let s = open();
    let flags: Vec<HostFlag> = (0..4).map(|_| HostFlag::new()).collect();
    for (l, f) in flags.iter().enumerate() {
        s.layer_ready(l, f.clone()).unwrap();
    }
    flags[0].set();
    s.wait_layer_timeout(0, Duration::from_secs(10))
        .unwrap()
        .unwrap();
    drop(s);
    // the worker settles asynchronously after a drop: wait for the pool (polled; the bound,
    // 60 s, only stops a hang)
    let mut n = 0;
    while pool.in_use() != 0 && n < 6000 {
        std::thread::sleep(Duration::from_millis(10));
        n += 1;
    }
    assert_eq!(pool.in_use(), 0, "dropped stream leaked staging buffers");
    // a device source without a stager is refused at open
    let dev = KvPlacement::packed(SrcSpace::Device(0), 0, 4, 64, 256, KvOrder::KvMajor).unwrap();
    let d = KvPlacement::packed(st.dst, 0, 4, 64, 256, KvOrder::KvMajor).unwrap();
    let l = Arc::new(KvLayout::new(dev, d, 256).unwrap());
    assert!(matches!(
        LayerStream::open(
            &st.engine,
            &st.peer,
            l,
            BlockLists::Shared(vec![1]),
            None,
            StreamOptions::default()
        ),
        Err(LayerError::InvalidArgument(_))
    ));
}

#[test]
fn dead_peer_fails_the_stream() {
    let mut st = Setup::new(TransportKind::Tcp, 4, 64, 256);
    st.fill_src(9);
    let layout = st.layout(KvOrder::KvMajor);
    let blocks: Vec<u32> = (0..32).collect();
    let s = LayerStream::open(
        &st.engine,
        &st.peer,
        layout,
        BlockLists::Shared(blocks.clone()),
        Some(BlockLists::Shared(blocks)),
        StreamOptions {
            tag: Some(b"x".to_vec()),
            deadline: Duration::from_secs(10),
            ..StreamOptions::default()
        },
    )
    .unwrap();
    s.layer_ready(0, Immediate).unwrap();
    s.wait_layer_timeout(0, Duration::from_secs(10))
        .unwrap()
        .unwrap();
    let _ = st.target.child.process().kill();
    let _ = st.target.child.process().wait();
    for l in 1..4 {
        s.layer_ready(l, Immediate).unwrap();
    }
    let err = s.wait().unwrap_err();
    assert!(
        matches!(err, LayerError::Engine(_) | LayerError::Timeout),
        "{err}"
    );
    assert!(s.poll_layer(3).unwrap().is_err());
}

/// Device memory: vLLM-shaped KV (one `[2, num_blocks, 16, 4, 128]` fp16 tensor per layer)
/// allocated with cudarc, each layer "computed" by an async upload on a compute stream and
/// announced with an event recorded after it; staged through pinned buffers and streamed to
/// a target process over tcp and shm; every byte checked there.
#[cfg(feature = "cuda")]
#[test]
fn cuda_device_kv_streams_layers() {
    use kvwire_transfer::cuda::{self, CudaStager, EventReadiness};
    use kvwire_transfer::layer::Stager;
    let Some(ctx) = gpu::device_or_skip("cuda_device_kv_streams_layers") else {
        return;
    };
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let (layers, nb, bb) = (8usize, 64u32, 16 * 1024u64);
        let mut st = Setup::new(transport, layers, nb, bb);
        let img = pattern::bytes(77, 0, st.len as usize);
        let per_layer = 2 * u64::from(nb) * bb;
        let compute = ctx.new_stream().unwrap();
        let stager = CudaStager::new(&st.engine, ctx.clone(), 3, 96 * 1024).unwrap();
        let mut tensors = Vec::new();
        let mut src_layers = Vec::new();
        for _ in 0..layers {
            let t = compute.alloc_zeros::<u8>(per_layer as usize).unwrap();
            let p = cuda::device_ptr(&t, &compute);
            // SAFETY: `t` stays alive (in `tensors`) until the stream below is finished.
            let space = unsafe { stager.register_device(p, per_layer) }.unwrap();
            src_layers.push(vec![(space, 0), (space, u64::from(nb) * bb)]);
            tensors.push(t);
        }
        let src = KvPlacement {
            layers: src_layers,
            block_stride: bb,
            num_blocks: nb,
        };
        let dst = KvPlacement::packed(st.dst, 0, layers, nb, bb, KvOrder::KvMajor).unwrap();
        let layout = Arc::new(KvLayout::new(src, dst, bb).unwrap());
        let (sb, db) = synthetic_block_tables(40, nb, 8, nb, 8, 3).unwrap();
        let s = LayerStream::open(
            &st.engine,
            &st.peer,
            layout,
            BlockLists::Shared(sb.clone()),
            Some(BlockLists::Shared(db.clone())),
            StreamOptions {
                tag: Some(b"gpu".to_vec()),
                stager: Some(stager.clone()),
                ..StreamOptions::default()
            },
        )
        .unwrap();
        for (l, t) in tensors.iter_mut().enumerate() {
            let part = &img[l * per_layer as usize..(l + 1) * per_layer as usize];
            // the layer's "compute"
            compute.memcpy_htod(part, t).unwrap();
            let ev =
                EventReadiness::record_on_stream(ctx.clone(), stager.waiter(), &compute).unwrap();
            s.layer_ready(l, ev).unwrap();
        }
        let stats = s.wait().unwrap();
        assert_eq!(stats.bytes, 40 * 2 * bb * layers as u64);
        assert_eq!(st.target.notification(5000).as_deref(), Some("gpu"));
        let exp = st.expected(
            &img,
            KvOrder::KvMajor,
            &(0..layers).collect::<Vec<_>>(),
            &sb,
            &db,
        );
        assert_eq!(
            st.target.hash(0, st.len),
            fnv(&exp),
            "destination image differs ({transport:?})"
        );
        assert_eq!(stager.pool().in_use(), 0);
        eprintln!(
            "cuda_device_kv_streams_layers: {transport:?} ok, {} writes, {} batches",
            stats.writes, stats.batches
        );
    }
}
