//! What a simulation run depends on: the workload, the network, the failures injected and the
//! cores' configuration.

use kvwire_connector::{DConfig, Nanos, PConfig, PeerId, Policy, RequestId, SendMode, MS, SEC};

/// The D engine's peer id as P cores see it.
pub const D_PEER: PeerId = PeerId(0);

/// Prompt-length mix.
#[derive(Clone, Debug)]
pub enum Workload {
    /// Every prompt has `tokens` tokens and nothing is cached on P.
    Fixed {
        /// Prompt tokens.
        tokens: u32,
    },
    /// Agentic sessions: a context that grows turn by turn from `min_tokens` toward
    /// `max_tokens`; P has the previous turn cached with probability `reuse`, so it prefills
    /// only the new tokens, while the whole context is transferred.
    Agentic {
        /// Sessions active at once (each arrival picks one).
        sessions: usize,
        /// Shortest initial context.
        min_tokens: u32,
        /// Longest context.
        max_tokens: u32,
        /// Tokens added per turn (uniform in `[step.0, step.1]`).
        step: (u32, u32),
        /// Probability that P has the previous context cached.
        reuse: f64,
    },
}

/// Network model.
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// One-way latency of messages and data.
    pub latency: Nanos,
    /// Extra uniform jitter on messages (FIFO order is kept).
    pub jitter: Nanos,
    /// Data link bandwidth per P, bytes per second.
    pub bandwidth: u64,
    /// Probability a control message is lost.
    pub loss: f64,
}

/// Injected failures.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Crashes per P engine per simulated second.
    pub p_crash_per_s: f64,
    /// Downtime before a crashed P restarts.
    pub p_restart_after: Nanos,
    /// Probability the transport tells D at once that a crashed P is gone.
    pub peer_down_notify: f64,
    /// Fraction of requests the D host aborts at a random time after arrival.
    pub d_abort: f64,
    /// Probability a layer transfer fails.
    pub transfer_error: f64,
    /// Probability a layer transfer hangs until the engine's deadline.
    pub transfer_hang: f64,
    /// The transfer engine's per-transfer deadline (a hung transfer fails then).
    pub transfer_deadline: Nanos,
}

/// Everything a run depends on.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// PRNG seed.
    pub seed: u64,
    /// Requests to generate.
    pub requests: usize,
    /// D's reservation policy.
    pub policy: Policy,
    /// P's send mode.
    pub send_mode: SendMode,
    /// Prompt mix.
    pub workload: Workload,
    /// Poisson arrival rate, requests per second.
    pub arrival_rate: f64,
    /// Number of P engines.
    pub n_p: usize,
    /// Model layers.
    pub layers: u16,
    /// Tokens per block.
    pub block_tokens: u32,
    /// KV bytes per token over all layers.
    pub kv_bytes_per_token: u64,
    /// Blocks in each P pool.
    pub p_pool_blocks: u32,
    /// Blocks in the D pool.
    pub d_pool_blocks: u32,
    /// Slots in D's landing pool (policy `land`).
    pub land_pool_blocks: u32,
    /// Fixed cost of a P step.
    pub p_step_overhead: Nanos,
    /// P prefill cost per uncached token.
    pub p_ns_per_token: Nanos,
    /// Most uncached tokens per P step (a longer prompt runs alone).
    pub p_token_budget: u32,
    /// Fixed cost of a D step with requests running.
    pub d_step_base: Nanos,
    /// Extra D step cost per running request.
    pub d_step_per_running: Nanos,
    /// Idle D loop period (vLLM sleeps 1 ms between empty steps).
    pub d_idle_poll: Nanos,
    /// vLLM async scheduling: a request reported finished at the end of step N is promoted at
    /// step N+2 instead of N+1.
    pub d_async_scheduling: bool,
    /// Output tokens per request, uniform in the range.
    pub decode_tokens: (u32, u32),
    /// Network.
    pub net: NetConfig,
    /// Failures.
    pub faults: Faults,
    /// D core configuration (`policy` and `layers` are overwritten from this config).
    pub d_cfg: DConfig,
    /// P core configuration (`send_mode` and `layers` are overwritten).
    pub p_cfg: PConfig,
    /// Stop at the first invariant violation (checked after every event).
    pub strict: bool,
    /// Simulated time after which a run that has not drained stops with a violation.
    pub max_sim_time: Nanos,
    /// A deliberate host bug, to show that the invariant checks catch it.
    pub host_bug: Option<HostBug>,
    /// Print to stderr every event and action about this request (debugging aid).
    pub trace: Option<RequestId>,
}

/// Deliberately wrong host behaviour (for tests proving the checks can fail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostBug {
    /// D frees a failed request's blocks as soon as it sends P an `Abort`, without waiting for
    /// P's confirmation (what a connector with only a timeout would do). Writes still in flight
    /// then land in freed blocks.
    FreeOnAbortSent,
    /// D frees the blocks of `ReportFailed` although `ReleaseBlocks` already freed them.
    DoubleFreeOnFailure,
}

impl SimConfig {
    /// A mixed agentic workload with every kind of failure injected.
    pub fn faulty(seed: u64, policy: Policy, send_mode: SendMode, requests: usize) -> Self {
        let mut d_cfg = DConfig::new(policy, 8);
        d_cfg.transport = "sim".into();
        d_cfg.heartbeat_interval = 250 * MS;
        d_cfg.peer_timeout = 2 * SEC;
        d_cfg.wait_for_p_timeout = 20 * SEC;
        d_cfg.request_timeout = 40 * SEC;
        d_cfg.drain_timeout = 10 * SEC;
        d_cfg.orphan_timeout = 5 * SEC;
        d_cfg.tombstone_ttl = 60 * SEC;
        let mut p_cfg = PConfig::new(send_mode, 8);
        p_cfg.transport = "sim".into();
        p_cfg.heartbeat_interval = 250 * MS;
        p_cfg.peer_timeout = 2 * SEC;
        p_cfg.request_timeout = 40 * SEC;
        p_cfg.block_ids_timeout = 10 * SEC;
        p_cfg.transfer_timeout = 3 * SEC;
        p_cfg.drain_timeout = 10 * SEC;
        p_cfg.orphan_timeout = 20 * SEC;
        SimConfig {
            seed,
            requests,
            policy,
            send_mode,
            workload: Workload::Agentic {
                sessions: 64,
                min_tokens: 1_000,
                max_tokens: 50_000,
                step: (500, 4_000),
                reuse: 0.9,
            },
            arrival_rate: 12.0,
            n_p: 2,
            layers: 8,
            block_tokens: 128,
            kv_bytes_per_token: 96 * 1024,
            p_pool_blocks: 4_096,
            d_pool_blocks: 8_192,
            land_pool_blocks: 4_096,
            p_step_overhead: 5 * MS,
            p_ns_per_token: 20_000,
            p_token_budget: 16_384,
            d_step_base: 10 * MS,
            d_step_per_running: 50_000,
            d_idle_poll: MS,
            d_async_scheduling: true,
            decode_tokens: (8, 32),
            net: NetConfig {
                latency: 50_000,
                jitter: 20_000,
                bandwidth: 25_000_000_000,
                loss: 0.0005,
            },
            faults: Faults {
                p_crash_per_s: 1.0 / 200.0,
                p_restart_after: 2 * SEC,
                peer_down_notify: 0.5,
                d_abort: 0.02,
                transfer_error: 0.003,
                transfer_hang: 0.001,
                transfer_deadline: 2 * SEC,
            },
            d_cfg,
            p_cfg,
            strict: true,
            max_sim_time: 100_000 * SEC,
            host_bug: None,
            trace: None,
        }
    }

    /// No failures, fixed 8k-token prompts, one P loaded to about 95%: P queues, which is
    /// where the reservation policies differ.
    pub fn queueing(seed: u64, policy: Policy, send_mode: SendMode, requests: usize) -> Self {
        let mut c = Self::faulty(seed, policy, send_mode, requests);
        c.faults = Faults {
            transfer_deadline: 2 * SEC,
            ..Faults::default()
        };
        c.net.loss = 0.0;
        c.n_p = 1;
        c.workload = Workload::Fixed { tokens: 8_192 };
        // One prefill of 8k tokens: 5 ms + 8192 × 20 µs ≈ 169 ms → capacity ≈ 5.9 req/s.
        c.p_token_budget = 8_192;
        c.arrival_rate = 5.6;
        c.d_pool_blocks = 32_768;
        c.p_pool_blocks = 32_768;
        c.d_cfg.wait_for_p_timeout = 600 * SEC;
        c.d_cfg.request_timeout = 600 * SEC;
        c.p_cfg.request_timeout = 600 * SEC;
        c.p_cfg.orphan_timeout = 600 * SEC;
        c
    }
}
