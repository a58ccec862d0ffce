//! Configuration of a clock run and its presets (`full`, `quick`, `study`).

use std::time::Duration;

use kvwire_connector::{Nanos, Policy, SendMode, MS, SEC};
use kvwire_transfer::TransportKind;

use super::{LinkSpeed, Scenario};

/// Which preset a configuration started from (written into the report).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// [`ClockConfig::full`].
    Full,
    /// [`ClockConfig::quick`].
    Quick,
    /// [`ClockConfig::study`].
    Study,
}

impl Preset {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Full => "full",
            Preset::Quick => "quick",
            Preset::Study => "study",
        }
    }
}

/// Everything a run depends on.
#[derive(Clone, Debug)]
pub struct ClockConfig {
    /// The preset it started from.
    pub preset: Preset,
    /// Seed of the workload.
    pub seed: u64,
    /// Scenario.
    pub scenario: Scenario,
    /// Transport of the data path.
    pub transport: TransportKind,
    /// Policies to run.
    pub policies: Vec<Policy>,
    /// Send modes to run.
    pub send_modes: Vec<SendMode>,
    /// Model layers.
    pub layers: u16,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// KV bytes per token (all layers) of the modelled model.
    pub model_bytes_per_token: u64,
    /// KV bytes per token (all layers) actually moved by the bench.
    pub wire_bytes_per_token: u64,
    /// Factor from measured wall time of a transfer to its virtual duration.
    pub transfer_scale: f64,
    /// Blocks in P's pool.
    pub p_pool_blocks: u32,
    /// Blocks in D's pool.
    pub d_pool_blocks: u32,
    /// Slots in D's landing pool (policy `land`), blocks of the same size, apart from the KV
    /// pool.
    pub land_pool_blocks: u32,
    /// Modelled speed of D's local copy of landing slots into KV blocks, bytes/s.
    pub land_copy_bytes_per_s: f64,
    /// Fixed cost of a P step.
    pub p_step_base: Nanos,
    /// P step cost per uncached token.
    pub p_step_per_token: Nanos,
    /// Attention term of a prefill step, ns: computing context positions `[s, e)` of a request
    /// costs `p_step_per_token_sq × (e² − s²) / 2` more (0: linear in the tokens).
    pub p_step_per_token_sq: f64,
    /// Most uncached tokens per P step (a longer prompt runs alone) when not chunked.
    pub p_token_budget: u32,
    /// Chunked prefill: P computes at most this many tokens per step, a longer prompt in
    /// several chunks, one per step (0: whole prompts, [`ClockConfig::p_token_budget`]).
    pub chunk_tokens: u32,
    /// Fixed cost of a D step with requests running.
    pub d_step_base: Nanos,
    /// D step cost per running request.
    pub d_step_per_running: Nanos,
    /// D step cost per token of KV a decoding request reads, ns.
    pub d_step_per_kv_token: f64,
    /// D's prefill cost per token (local prompts and recomputation after preemption); the
    /// attention term is P's.
    pub d_prefill_per_token: Nanos,
    /// Most tokens D computes per step (decodes count one; vLLM's `max_num_batched_tokens`).
    pub d_token_budget: u32,
    /// D's prefix cache serves P/D requests: a later turn finds its session's previous
    /// context on D ([`kvwire_connector::DEvent::PrefixHit`]) and P sends only the rest.
    /// (Local requests always use D's prefix cache, as vLLM's automatic prefix caching.)
    pub d_prefix_cache: bool,
    /// Idle D loop period.
    pub d_idle_poll: Nanos,
    /// One-way latency of control messages.
    pub msg_latency: Nanos,
    /// Bound on virtual time of one cell.
    pub max_virtual: Nanos,
    /// Bound on wall time of one cell.
    pub max_wall: Duration,
    /// Which measured speed turns a layer's bytes into virtual time.
    pub link_speed: LinkSpeed,
    /// A link of this speed (GB/s of modelled bytes) instead of the measured one: every cell
    /// runs on a frozen link of this speed plus the measured fixed cost of a batch (bytes are
    /// still moved and checked for real).
    pub link_gbps: Option<f64>,
    /// Local requests per second in the workload (information for the report: the requests
    /// themselves are in the request list).
    pub local_rate: f64,
    /// Fault injection (tests): corrupt D's copy of the n-th landing (1-based) before it is
    /// checked.
    pub fault_corrupt_landing: Option<u64>,
}

impl ClockConfig {
    /// The full run: 8 layers of the seed model's 96 KiB/token moved at 1 KiB/token (scale
    /// 96: a layer of a mean request is about 1.7 MB on the wire, so the engine's fixed cost
    /// per batch is a small part of its measured time), 128-token blocks, P prefill `5 ms + 80
    /// µs/token` under a 16k-token budget (about 12k tokens/s: an estimate for a 3B-active MoE
    /// on an H20-class GPU, not a measurement), whole-prompt steps, D step `10 ms + 0.1
    /// ms/running`, D pool of 2048 blocks (262k tokens), landing pool of a quarter of it, P
    /// pool of 4096, no D prefix cache for P/D requests.
    pub fn full(seed: u64) -> Self {
        let model = 96 * 1024;
        let wire = 1024;
        ClockConfig {
            preset: Preset::Full,
            seed,
            scenario: Scenario::Pd,
            transport: TransportKind::Auto,
            policies: Policy::ALL.to_vec(),
            send_modes: vec![SendMode::Whole, SendMode::Layerwise],
            layers: 8,
            block_tokens: 128,
            model_bytes_per_token: model,
            wire_bytes_per_token: wire,
            transfer_scale: model as f64 / wire as f64,
            p_pool_blocks: 4096,
            d_pool_blocks: 2048,
            land_pool_blocks: 2048 / 4,
            land_copy_bytes_per_s: H2D_BYTES_PER_S,
            p_step_base: 5 * MS,
            p_step_per_token: 80_000,
            p_step_per_token_sq: 0.0,
            p_token_budget: 16_384,
            chunk_tokens: 0,
            d_step_base: 10 * MS,
            d_step_per_running: 100_000,
            d_step_per_kv_token: 0.0,
            d_prefill_per_token: 80_000,
            d_token_budget: VLLM_BATCHED_TOKENS,
            d_prefix_cache: false,
            d_idle_poll: MS,
            msg_latency: 50_000,
            max_virtual: 100_000 * SEC,
            max_wall: Duration::from_secs(600),
            link_speed: LinkSpeed::Frozen,
            link_gbps: None,
            local_rate: 0.0,
            fault_corrupt_landing: None,
        }
    }

    /// A run of seconds for tests (debug builds included): 64 B/token on the wire, stretched
    /// only ×8 (so the modelled KV is 512 B/token: the link stays far from saturation even
    /// with an unoptimised engine, and the ordering of the cells comes from the policies, not
    /// from transfer noise), smaller pools.
    pub fn quick(seed: u64) -> Self {
        let mut c = Self::full(seed);
        c.preset = Preset::Quick;
        c.wire_bytes_per_token = 64;
        c.model_bytes_per_token = 64 * 8;
        c.transfer_scale = 8.0;
        c.p_pool_blocks = 1024;
        c.d_pool_blocks = 400;
        c.land_pool_blocks = 100;
        c.max_wall = Duration::from_secs(120);
        c
    }

    /// The seed study's setup: one P/D pair of its 8 kv_both engines on 8×H20 serving
    /// Qwen3-Coder-30B-A3B (48 layers, 96 KiB of KV per token): D serves its own share of the
    /// w600 trace as local requests, and a quarter of P's share decodes on it as P/D requests
    /// ([`super::workload::SessionMix::study`], closed-loop sessions of turns). Every number that is not in the seeds is in
    /// [`ClockConfig::assumptions`], with where it comes from; the report prints them.
    pub fn study(seed: u64) -> Self {
        let mut c = Self::full(seed);
        c.preset = Preset::Study;
        c.layers = 48;
        c.wire_bytes_per_token = 96;
        c.transfer_scale = c.model_bytes_per_token as f64 / 96.0;
        c.d_pool_blocks = STUDY_D_POOL_BLOCKS;
        c.p_pool_blocks = STUDY_D_POOL_BLOCKS;
        c.land_pool_blocks = STUDY_D_POOL_BLOCKS / 4;
        c.p_step_base = 5 * MS;
        c.p_step_per_token = 75_500;
        c.p_step_per_token_sq = 5.06;
        c.chunk_tokens = VLLM_BATCHED_TOKENS;
        c.d_step_base = 12 * MS;
        c.d_step_per_running = 300_000;
        c.d_step_per_kv_token = 24.6;
        c.d_prefill_per_token = 75_500;
        c.d_prefix_cache = true;
        c.link_gbps = Some(2.7);
        c.local_rate = STUDY_RATE;
        c.max_wall = Duration::from_secs(1800);
        c
    }

    /// Bytes of one block of one layer moved on the wire.
    pub fn layer_block_bytes(&self) -> u64 {
        let b = self.wire_bytes_per_token * u64::from(self.block_tokens) / u64::from(self.layers);
        b.div_ceil(8) * 8
    }

    /// Blocks of `tokens` tokens (at least one).
    pub fn blocks_for(&self, tokens: u64) -> u32 {
        tokens.div_ceil(u64::from(self.block_tokens.max(1))).max(1) as u32
    }

    /// Virtual cost of computing context positions `[s, e)` of one request: `per_token` per
    /// token plus the attention term.
    pub fn prefill_ns(&self, per_token: Nanos, s: u32, e: u32) -> Nanos {
        let n = u64::from(e.saturating_sub(s));
        let (s, e) = (f64::from(s), f64::from(e));
        let sq = self.p_step_per_token_sq * (e * e - s * s) / 2.0;
        per_token * n + sq.max(0.0) as Nanos
    }

    /// The numbers of the [`Preset::Study`] preset that are not in the seeds: `(parameter,
    /// value, where it comes from)`. Empty for the other presets.
    pub fn assumptions(&self) -> Vec<(&'static str, String, &'static str)> {
        if self.preset != Preset::Study {
            return Vec::new();
        }
        STUDY_ASSUMPTIONS
            .iter()
            .map(|&(k, v, why)| (k, v.to_string(), why))
            .collect()
    }
}

/// vLLM's `max_num_batched_tokens` (and so its prefill chunk) for online serving.
pub const VLLM_BATCHED_TOKENS: u32 = 8_192;

/// H2D copy speed measured on an H20 (the CPU-tier bench of the anchors), bytes/s.
pub const H2D_BYTES_PER_S: f64 = 54e9;

/// D's KV pool in the study preset, 128-token blocks (see [`STUDY_ASSUMPTIONS`]).
pub const STUDY_D_POOL_BLOCKS: u32 = 3_690;

/// Requests per second one engine of the study receives (807 requests in the trace's first
/// 600 s, over 8 engines).
pub const STUDY_RATE: f64 = 807.0 / 600.0 / 8.0;

/// P/D requests per second of the study preset: a quarter of one engine's share (P's), next
/// to D's own whole share as local traffic ([`ClockConfig::study`]).
pub const STUDY_PD_RATE: f64 = STUDY_RATE / 4.0;

/// What the study measured for Mooncake (seeds): `decode_sent → first_token` p50 and p90,
/// seconds, and the APC lost by running kv_both, percentage points.
pub const STUDY_MOONCAKE: StudyFigures = StudyFigures {
    clock_p50_s: 1.1,
    clock_p90_s: 6.7,
    apc_delta_pp: -1.1,
};

/// The study's Mooncake figures.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct StudyFigures {
    /// `decode_sent → first_token` p50, s.
    pub clock_p50_s: f64,
    /// `decode_sent → first_token` p90, s.
    pub clock_p90_s: f64,
    /// APC (prefix-cache hit rate) of kv_both minus plain vLLM, percentage points.
    pub apc_delta_pp: f64,
}

/// The study preset's numbers that are not in the seeds (the seeds give: Qwen3-Coder-30B-A3B,
/// 96 KiB of KV per token, 48 layers, 8 engines on 8×H20, the w600 trace's 1214 requests,
/// 274 sessions, 53.3M tokens, 93% intra-session reuse, its first 600 s holding 807
/// requests, Mooncake's cost model 0.3 s + bytes / 2.7 GB/s, and the figures it is compared
/// with).
pub const STUDY_ASSUMPTIONS: &[(&str, &str, &str)] = &[
    ("engines simulated", "1 P + 1 D",
     "one P/D pair of the 8 engines; the router gives each engine 1/8 of the trace"),
    ("P/D requests", "a quarter of one engine's share (~0.04/s, 8-9 sessions)",
     "one engine's share is 807 requests / 600 s / 8 engines, 274 / 8 sessions; a quarter of P's share decodes on this D (half a share already makes D's pool the bottleneck in this model; the study's PD-sep fired on 0.2-0.4% of requests). --rate sets it"),
    ("local requests", "D's own share (~0.17/s, 34 sessions)",
     "kv_both: D keeps serving its 1/8 of the trace, prompts computed on D. --local-rate sets it"),
    ("turns per session", "geometric, mean 4.43", "1214 / 274"),
    ("context", "first turn 6k-58k tokens, +7.5% a turn, at most 120k",
     "+7.5% a turn is the 93% reuse; the mean context comes out near 53.3M / 1214 = 43.9k tokens"),
    ("think time", "exponential, mean 5 s, closed loop (a turn is sent after the previous one's last token)",
     "calibrated: plain vLLM's APC in this model falls as sessions overlap more (seeds 1-3: 69-75% at 5 s, 58-68% at 30 s); 5 s comes nearest the study's 79.4%. --turn-gap-s sets it"),
    ("P holds the previous turn", "93%", "the seeds' intra-session reuse"),
    ("output tokens", "uniform 32-350 (mean 191)",
     "(E2E mean - TTFT mean) / TPOT of the study's LPWL run: (8116 - 3398) ms / ~25 ms"),
    ("block", "128 tokens",
     "vLLM uses 16; 128 keeps a mean context at ~340 blocks for the bench (reservation granularity error < 0.3% of a mean context)"),
    ("D and P KV pool", "3690 blocks = 472k tokens",
     "H20 96 GB x 0.9 - ~32 GB of FP8 weights - ~8 GB activations and graphs = ~46 GB / 96 KiB. With bf16 weights (~21.5 GB, 1710 blocks) plain vLLM thrashes in this model (APC 41%, TTFT p50 18 s), which the study did not see (APC 79.4%)"),
    ("landing pool", "1/4 of D's pool (host memory)", "the --land-pool-blocks default"),
    ("landing copy", "54 GB/s", "H2D measured on an H20 (anchors, CPU tier)"),
    ("link", "2.7 GB/s frozen + this host's per-batch cost",
     "the seeds' Mooncake cost model; the anchors' H20 bench saw ~3 GB/s under load"),
    ("prefill", "75.5 us/token + 5.06 ns x (e^2 - s^2)/2",
     "fitted to the anchors' single-H20 TTFT: 78 ms at 1k, 15.2 s at 64k tokens"),
    ("prefill chunk", "8192 tokens", "vLLM's max_num_batched_tokens default"),
    ("D decode step", "12 ms + 0.3 ms/running + 24.6 ns per KV token read",
     "96 KiB / 4.0 TB/s H20 HBM per KV token; base set so TPOT at the preset's batch is near the study's 17 ms"),
    ("D step token budget", "8192", "vLLM's max_num_batched_tokens default"),
    ("D prefix cache", "on (LRU over D's pool)", "vLLM's automatic prefix caching, on by default"),
    ("control messages", "50 us one way", "the clock's default; Mooncake's ZMQ adds 2-3 ms (anchors), not modelled"),
    ("P's own local traffic", "not modelled", "P only prefills P/D requests: wait for P is a lower bound"),
];

impl Default for ClockConfig {
    fn default() -> Self {
        Self::full(1)
    }
}

/// Time-independent check of a configuration.
pub(super) fn check(cfg: &ClockConfig) -> Result<(), super::ClockError> {
    use super::ClockError;
    if cfg.layers == 0 || cfg.block_tokens == 0 || cfg.wire_bytes_per_token == 0 {
        return Err(ClockError::Config(
            "layers, block tokens and wire bytes per token must be positive".into(),
        ));
    }
    if !(cfg.transfer_scale.is_finite() && cfg.transfer_scale > 0.0) {
        return Err(ClockError::Config("transfer scale must be positive".into()));
    }
    if cfg.link_gbps.is_some_and(|g| !(g.is_finite() && g > 0.0)) {
        return Err(ClockError::Config("link speed must be positive".into()));
    }
    if !(cfg.land_copy_bytes_per_s.is_finite() && cfg.land_copy_bytes_per_s > 0.0) {
        return Err(ClockError::Config(
            "landing copy speed must be positive".into(),
        ));
    }
    if cfg.d_token_budget == 0 {
        return Err(ClockError::Config(
            "D's token budget must be positive".into(),
        ));
    }
    Ok(())
}
