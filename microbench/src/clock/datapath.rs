//! The real data path of the clock bench: a P engine and a D engine of the kvwire transfer
//! engine in this process, connected over loopback (tcp or shm), P with one region holding its
//! KV block pool, D with two (its KV block pool, and the landing pool of policy `land`), and
//! every byte checked on both ends.
//!
//! Layout of a pool region: `layer` major, then block: the bytes of `(block, layer)` are at
//! `(layer × pool_blocks + block) × layer_block_bytes`. One layer of a request is one batch of
//! one op per block (the engine coalesces blocks adjacent on both sides), with a notification
//! tag `(request, layer)` that D's engine delivers only after every byte landed.
//!
//! Patterns: the bytes of `(request, layer, i-th block of the request)` are the seekable
//! stream of [`crate::pattern::fill`] with a seed derived from the run, request, layer and `i`:
//! P writes them into its blocks when it schedules the request ("prefill computes the KV");
//! before posting a layer, P reads its blocks back and checks their CRC-32 against the
//! pattern's (no other request overwrote them); when the layer lands, D reads its destination
//! blocks and checks their CRC-32 against the same value. Stale bytes of an earlier request in
//! a reused D block, a write to the wrong block, or a short write all fail the check. A layer
//! may also travel as several batches of runs of its blocks (chunked prefill streams each
//! chunk's blocks); the CRC of any run follows from the per-block CRCs kept at staging
//! ([`StagedCrcs`]). A `land` request lands in slots of the landing pool, is checked there,
//! copied by D's engine into its KV blocks ([`DataPath::copy_landing`]) and checked again.

use std::time::{Duration, Instant};

use kvwire_transfer::{Access, Engine, EngineConfig, Op, Peer, RegionHandle, TransportKind};

use super::{ClockConfig, ClockError};
use crate::pattern::fill;

/// Deadline of one layer's batch and of waiting for its notification.
const DEADLINE: Duration = Duration::from_secs(20);

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn seed_of(run: u64, req: u64, layer: u16, i: u32) -> u64 {
    mix(run
        ^ mix(req.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (u64::from(layer) << 48))
        ^ u64::from(i).wrapping_mul(0xD1B5_4A32_D192_ED03))
}

/// What one layer's transfer did, as measured.
#[derive(Clone, Copy, Debug)]
pub struct LayerTransfer {
    /// Wall time from posting the batch to D's engine delivering its notification.
    pub wall: Duration,
    /// Payload bytes.
    pub bytes: u64,
    /// Writes after coalescing.
    pub writes: usize,
    /// CRC-32 P read back from its blocks before posting (equal to the pattern's).
    pub crc: u32,
}

/// Blocks of each pool of the data path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pools {
    /// P's KV pool.
    pub p: u32,
    /// D's KV pool.
    pub d: u32,
    /// D's landing pool (policy `land`).
    pub land: u32,
}

/// The CRC-32 of every block of every layer of one staged request.
#[derive(Clone, Debug, Default)]
pub struct StagedCrcs {
    blocks: usize,
    lbb: u64,
    crcs: Vec<u32>,
}

impl StagedCrcs {
    /// The CRC-32 of the pattern of blocks `a..b` (request block indices) of `layer`, as
    /// they lie back to back; `None` outside the request.
    pub fn range(&self, layer: u16, a: usize, b: usize) -> Option<u32> {
        if a > b || b > self.blocks {
            return None;
        }
        let base = usize::from(layer) * self.blocks;
        let all = self.crcs.get(base + a..base + b)?;
        let mut h = crc32fast::Hasher::new();
        for &c in all {
            h.combine(&crc32fast::Hasher::new_with_initial_len(c, self.lbb));
        }
        Some(h.finalize())
    }

    /// Blocks of the request.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

#[derive(Clone, Copy)]
enum Side {
    P,
    D,
    Landing,
}

/// The two engines, their pool regions and the connection P → D.
pub struct DataPath {
    p: Engine,
    d: Engine,
    peer: Peer,
    p_region: RegionHandle,
    d_region: RegionHandle,
    d_region_id: kvwire_transfer::RegionId,
    land_region: RegionHandle,
    land_region_id: kvwire_transfer::RegionId,
    p_pool: u32,
    d_pool: u32,
    land_pool: u32,
    lbb: u64,
    run: u64,
    transport: String,
    scratch: Vec<u8>,
    tag_seq: u64,
    recent_ns_per_byte: std::collections::VecDeque<f64>,
    frozen_ns_per_byte: Option<f64>,
}

/// Layers in the window of [`DataPath::typical_ns_per_byte`].
pub const RATE_WINDOW: usize = 64;

impl DataPath {
    /// The data path of a clock run of `cfg` (its transport, layers, pools and block size;
    /// the pattern seed derives from the run's seed).
    pub fn for_config(cfg: &ClockConfig) -> Result<DataPath, ClockError> {
        DataPath::new(
            cfg.transport,
            cfg.layers,
            Pools {
                p: cfg.p_pool_blocks,
                d: cfg.d_pool_blocks,
                land: cfg.land_pool_blocks,
            },
            cfg.layer_block_bytes(),
            cfg.seed ^ 0xC10C,
        )
    }

    /// Starts both engines with `transport`, allocates the pools (`pools` blocks of `layers ×
    /// layer_block_bytes` each: P's, D's KV pool and D's landing pool) and connects P to D.
    pub fn new(
        transport: TransportKind,
        layers: u16,
        pools: Pools,
        layer_block_bytes: u64,
        run: u64,
    ) -> Result<DataPath, ClockError> {
        let Pools {
            p: p_pool,
            d: d_pool,
            land: land_pool,
        } = pools;
        if layer_block_bytes == 0 || layer_block_bytes % 8 != 0 {
            return Err(ClockError::Config(format!(
                "bytes per block per layer ({layer_block_bytes}) must be a positive multiple of 8"
            )));
        }
        let eng = |what: &'static str| move |e| ClockError::Engine { what, source: e };
        let eng_err = eng;
        let cfg = EngineConfig {
            transport,
            ..EngineConfig::from_env()
        };
        let d = Engine::new(cfg.clone()).map_err(eng("starting D's engine"))?;
        let p = Engine::new(cfg).map_err(eng("starting P's engine"))?;
        let p_len = u64::from(p_pool) * u64::from(layers) * layer_block_bytes;
        let d_len = u64::from(d_pool) * u64::from(layers) * layer_block_bytes;
        let p_region = p
            .alloc_region(p_len as usize, Access::Local)
            .map_err(eng("allocating P's pool"))?;
        let d_region = d
            .alloc_region(d_len as usize, Access::WriteOnly)
            .map_err(eng("allocating D's pool"))?;
        // The landing pool is a region of its own (at least one block, so that it exists).
        let land_len = u64::from(land_pool.max(1)) * u64::from(layers) * layer_block_bytes;
        let land_region = d
            .alloc_region(land_len as usize, Access::WriteOnly)
            .map_err(eng("allocating D's landing pool"))?;
        let peer = p
            .connect(d.listen_addr())
            .map_err(eng("connecting P to D"))?;
        let transport = kvwire_transfer::metrics::transport_label(peer.transport()).to_string();
        // Touch every page of both pools once, so that no measured transfer pays for first
        // faults of fresh memory (the first cell would otherwise look slower than the rest).
        let zeros = vec![0u8; 1 << 20];
        for (eng, region, len) in [
            (&p, p_region, p_len),
            (&d, d_region, d_len),
            (&d, land_region, land_len),
        ] {
            let mut off = 0u64;
            while off < len {
                let n = (len - off).min(zeros.len() as u64) as usize;
                eng.local_write(region, off, &zeros[..n])
                    .map_err(eng_err("touching the pools"))?;
                off += n as u64;
            }
        }
        // And write all of D's pool once through the engine: the transport's own mappings of
        // D's memory (shm maps the target's region into P) fault in here, not in a cell.
        let d_region_id = d.region_id(d_region);
        let land_region_id = d.region_id(land_region);
        let chunk = (4u64 << 20).min(p_len).max(8);
        for (remote, len) in [(d_region_id, d_len), (land_region_id, land_len)] {
            let mut off = 0u64;
            while off < len {
                let mut ops = Vec::new();
                while off < len && ops.len() < 16 {
                    let n = (len - off).min(chunk);
                    ops.push(Op {
                        local: p_region,
                        local_offset: 0,
                        remote,
                        remote_offset: off,
                        len: n,
                    });
                    off += n;
                }
                p.write(&peer, &ops, None, Some(DEADLINE))
                    .and_then(|b| b.wait())
                    .map_err(eng_err("warming up the data path"))?;
            }
        }
        Ok(DataPath {
            d_region_id,
            land_region_id,
            p,
            d,
            peer,
            p_region,
            d_region,
            land_region,
            p_pool,
            d_pool,
            land_pool: land_pool.max(1),
            lbb: layer_block_bytes,
            run,
            transport,
            scratch: Vec::new(),
            tag_seq: 0,
            recent_ns_per_byte: std::collections::VecDeque::with_capacity(RATE_WINDOW),
            frozen_ns_per_byte: None,
        })
    }

    /// The transport the engines chose.
    pub fn transport(&self) -> &str {
        &self.transport
    }

    /// Bytes of one block of one layer.
    pub fn layer_block_bytes(&self) -> u64 {
        self.lbb
    }

    fn off(&self, pool: u32, block: u32, layer: u16) -> u64 {
        (u64::from(layer) * u64::from(pool) + u64::from(block)) * self.lbb
    }

    fn pattern_crc(&mut self, req: u64, layer: u16, n: usize) -> u32 {
        let mut h = crc32fast::Hasher::new();
        self.scratch.resize(self.lbb as usize, 0);
        for i in 0..n {
            fill(
                &mut self.scratch,
                seed_of(self.run, req, layer, i as u32),
                0,
            );
            h.update(&self.scratch);
        }
        h.finalize()
    }

    /// Writes the request's pattern into P's `blocks` for every layer; returns the CRC-32 of
    /// every block of every layer, from which the CRC of any run of blocks follows
    /// ([`StagedCrcs::range`]).
    pub fn stage(
        &mut self,
        req: u64,
        layers: u16,
        blocks: &[u32],
    ) -> Result<StagedCrcs, ClockError> {
        let mut crcs = Vec::with_capacity(layers as usize * blocks.len());
        self.scratch.resize(self.lbb as usize, 0);
        for layer in 0..layers {
            for (i, &b) in blocks.iter().enumerate() {
                fill(
                    &mut self.scratch,
                    seed_of(self.run, req, layer, i as u32),
                    0,
                );
                crcs.push(crc32fast::hash(&self.scratch));
                let off = self.off(self.p_pool, b, layer);
                self.p
                    .local_write(self.p_region, off, &self.scratch)
                    .map_err(|e| ClockError::Engine {
                        what: "staging P's blocks",
                        source: e,
                    })?;
            }
        }
        Ok(StagedCrcs {
            blocks: blocks.len(),
            lbb: self.lbb,
            crcs,
        })
    }

    fn crc_of(&mut self, side: Side, blocks: &[u32], layer: u16) -> Result<u32, ClockError> {
        let mut h = crc32fast::Hasher::new();
        self.scratch.resize(self.lbb as usize, 0);
        for &b in blocks {
            let (eng, region, pool) = match side {
                Side::P => (&self.p, self.p_region, self.p_pool),
                Side::D => (&self.d, self.d_region, self.d_pool),
                Side::Landing => (&self.d, self.land_region, self.land_pool),
            };
            let off = (u64::from(layer) * u64::from(pool) + u64::from(b)) * self.lbb;
            eng.local_read(region, off, &mut self.scratch)
                .map_err(|e| ClockError::Engine {
                    what: "reading blocks back",
                    source: e,
                })?;
            h.update(&self.scratch);
        }
        Ok(h.finalize())
    }

    /// Transfers one layer (or a run of its blocks): checks P's source blocks against
    /// `expected_crc`, posts one batch `src[i] → dst[i]` (`dst` in D's KV pool, or in its
    /// landing pool when `landing`) with a notification, waits for the batch and for D's engine
    /// to deliver the notification, and returns what was measured. A source mismatch is
    /// [`ClockError::Corrupt`].
    pub fn transfer(
        &mut self,
        req: u64,
        layer: u16,
        src: &[u32],
        dst: &[u32],
        landing: bool,
        expected_crc: u32,
    ) -> Result<LayerTransfer, ClockError> {
        if src.len() != dst.len() {
            return Err(ClockError::Config(format!(
                "request {req} layer {layer}: {} source blocks for {} destination blocks",
                src.len(),
                dst.len()
            )));
        }
        let crc = self.crc_of(Side::P, src, layer)?;
        if crc != expected_crc {
            return Err(ClockError::Corrupt(format!(
                "request {req} layer {layer}: P's blocks hold crc {crc:08x}, pattern {expected_crc:08x}"
            )));
        }
        let (remote, pool) = if landing {
            (self.land_region_id, self.land_pool)
        } else {
            (self.d_region_id, self.d_pool)
        };
        let ops: Vec<Op> = src
            .iter()
            .zip(dst)
            .map(|(&s, &d)| Op {
                local: self.p_region,
                local_offset: self.off(self.p_pool, s, layer),
                remote,
                remote_offset: self.off(pool, d, layer),
                len: self.lbb,
            })
            .collect();
        self.tag_seq += 1;
        let mut tag = Vec::with_capacity(18);
        tag.extend_from_slice(&req.to_le_bytes());
        tag.extend_from_slice(&layer.to_le_bytes());
        tag.extend_from_slice(&self.tag_seq.to_le_bytes());
        let notes = self.d.notifications();
        let t0 = Instant::now();
        let stats = self
            .p
            .write(&self.peer, &ops, Some(&tag), Some(DEADLINE))
            .and_then(|b| b.wait())
            .map_err(|e| ClockError::Engine {
                what: "writing a layer",
                source: e,
            })?;
        let note = notes
            .recv_timeout(DEADLINE)
            .map_err(|e| ClockError::Engine {
                what: "waiting for D's notification",
                source: e,
            })?;
        let wall = t0.elapsed();
        if note.tag != tag {
            return Err(ClockError::Corrupt(format!(
                "request {req} layer {layer}: D got notification {:?}, expected {:?}",
                note.tag, tag
            )));
        }
        Ok(LayerTransfer {
            wall,
            bytes: stats.bytes,
            writes: stats.writes,
            crc,
        })
    }

    /// Records a measured layer (`wall` minus the fixed cost, over its bytes) in the window
    /// and returns the median wall nanoseconds per byte of the last [`RATE_WINDOW`] layers:
    /// the transport's speed on this host, with single preemptions of the measuring thread
    /// (milliseconds on a shared 2-core machine) filtered out.
    pub fn typical_ns_per_byte(&mut self, variable: Duration, bytes: u64) -> f64 {
        if let Some(f) = self.frozen_ns_per_byte {
            return f;
        }
        if bytes > 0 {
            if self.recent_ns_per_byte.len() == RATE_WINDOW {
                self.recent_ns_per_byte.pop_front();
            }
            self.recent_ns_per_byte
                .push_back(variable.as_nanos() as f64 / bytes as f64);
        }
        let mut v: Vec<f64> = self.recent_ns_per_byte.iter().copied().collect();
        if v.is_empty() {
            return 0.0;
        }
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    /// From now on [`DataPath::typical_ns_per_byte`] returns the current median, whatever is
    /// measured later.
    pub fn freeze_speed(&mut self) {
        let v = self.typical_ns_per_byte(Duration::ZERO, 0);
        self.frozen_ns_per_byte = Some(v);
    }

    /// From now on [`DataPath::typical_ns_per_byte`] returns `ns_per_byte`: a link of a given
    /// speed ([`ClockConfig::link_gbps`]) instead of the measured one.
    pub fn freeze_speed_at(&mut self, ns_per_byte: f64) {
        self.frozen_ns_per_byte = Some(ns_per_byte);
    }

    /// Forgets the measured layers of the speed window.
    pub fn clear_speed_window(&mut self) {
        self.recent_ns_per_byte.clear();
    }

    /// The frozen speed, if frozen.
    pub fn frozen_ns_per_byte(&self) -> Option<f64> {
        self.frozen_ns_per_byte
    }

    /// D's check of a landed layer: the CRC-32 of its destination blocks (in the landing pool
    /// when `landing`).
    pub fn landed_crc(
        &mut self,
        blocks: &[u32],
        layer: u16,
        landing: bool,
    ) -> Result<u32, ClockError> {
        let side = if landing { Side::Landing } else { Side::D };
        self.crc_of(side, blocks, layer)
    }

    /// The CRC-32 the pattern of `(req, layer)` over `n` blocks has (for tests of the check).
    pub fn expected_crc(&mut self, req: u64, layer: u16, n: usize) -> u32 {
        self.pattern_crc(req, layer, n)
    }

    /// D's local copy of a `land` request: every layer of landing slot `slots[i]` into KV
    /// block `blocks[i]`, read and written through D's engine. Returns the bytes copied.
    pub fn copy_landing(
        &mut self,
        slots: &[u32],
        blocks: &[u32],
        layers: u16,
    ) -> Result<u64, ClockError> {
        if slots.len() != blocks.len() {
            return Err(ClockError::Config(format!(
                "{} landing slots copied into {} blocks",
                slots.len(),
                blocks.len()
            )));
        }
        let eng = |e| ClockError::Engine {
            what: "copying landing slots into KV blocks",
            source: e,
        };
        self.scratch.resize(self.lbb as usize, 0);
        let mut bytes = 0u64;
        for layer in 0..layers {
            for (&s, &b) in slots.iter().zip(blocks) {
                let from = self.off(self.land_pool, s, layer);
                let to = self.off(self.d_pool, b, layer);
                self.d
                    .local_read(self.land_region, from, &mut self.scratch)
                    .map_err(eng)?;
                self.d
                    .local_write(self.d_region, to, &self.scratch)
                    .map_err(eng)?;
                bytes += self.lbb;
            }
        }
        Ok(bytes)
    }

    /// Flips one byte of D's block `block` (a landing slot when `landing`), layer `layer`
    /// (fault injection: proves the check catches corruption).
    pub fn corrupt_d(&mut self, block: u32, layer: u16, landing: bool) -> Result<(), ClockError> {
        let (region, pool) = if landing {
            (self.land_region, self.land_pool)
        } else {
            (self.d_region, self.d_pool)
        };
        let off = self.off(pool, block, layer);
        let mut b = [0u8; 1];
        // D's regions are write-only for peers, but D's own engine reads and writes them.
        self.d
            .local_read(region, off, &mut b)
            .and_then(|_| self.d.local_write(region, off, &[b[0] ^ 0x5a]))
            .map_err(|e| ClockError::Engine {
                what: "injecting corruption",
                source: e,
            })
    }

    /// The engine's fixed cost of one layer batch on this host: the median wall time of
    /// `rounds` one-block batches (8 bytes, with a notification), posted and waited one at a
    /// time. It writes the first 8 bytes of both pools: run it before staging requests, or
    /// between cells.
    pub fn probe_fixed_cost(&mut self, rounds: usize) -> Result<Duration, ClockError> {
        let mut v = Vec::with_capacity(rounds.max(1));
        let notes = self.d.notifications();
        for i in 0..rounds.max(1) {
            let op = Op {
                local: self.p_region,
                local_offset: 0,
                remote: self.d_region_id,
                remote_offset: 0,
                len: 8,
            };
            let tag = (u64::MAX - i as u64).to_le_bytes();
            let t0 = Instant::now();
            self.p
                .write(&self.peer, &[op], Some(&tag), Some(DEADLINE))
                .and_then(|b| b.wait())
                .map_err(|e| ClockError::Engine {
                    what: "probing the fixed cost of a batch",
                    source: e,
                })?;
            let note = notes
                .recv_timeout(DEADLINE)
                .map_err(|e| ClockError::Engine {
                    what: "probing the fixed cost of a batch",
                    source: e,
                })?;
            v.push(t0.elapsed());
            if note.tag != tag {
                return Err(ClockError::Corrupt(format!(
                    "probe notification {:?}, expected {tag:?}",
                    note.tag
                )));
            }
        }
        v.sort_unstable();
        Ok(v[v.len() / 2])
    }

    /// Shuts both engines down.
    pub fn shutdown(&self) {
        self.p.shutdown();
        self.d.shutdown();
    }
}
