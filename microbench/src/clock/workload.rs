//! Request mixes for the clock bench: a synthetic agentic mix, sessions of turns (the study's
//! trace statistics), fixed prompt lengths, local (kv_both) requests next to the P/D ones, and
//! trace files ([`super::trace`]).

use kvwire_connector::{Nanos, SEC};
use kvwire_testkit::rng::Rng;

/// One request of a run, the same for every cell of the matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    /// Arrival at the router (virtual nanoseconds from the start of the run).
    pub arrival: Nanos,
    /// Prompt tokens (the whole context: what D needs and what is transferred).
    pub prompt_tokens: u32,
    /// Tokens P already has cached (P prefills only `prompt_tokens - cached_tokens`).
    pub cached_tokens: u32,
    /// Output tokens D decodes.
    pub output_tokens: u32,
    /// The context this prompt extends: requests with the same value are turns of one
    /// conversation, each prompt beginning with the previous turn's prompt and output, so D's
    /// prefix cache (keyed by it) can hold their common prefix. `None`: nothing to reuse on D.
    pub context: Option<u64>,
    /// A local request of a kv_both D: it arrives on D alone and D computes its prompt (no P,
    /// no transfer), next to the P/D requests.
    pub local: bool,
    /// The conversation the request is a turn of (requests of a session come in list order).
    pub session: Option<u64>,
    /// Closed loop: the request is sent this long after the previous request of its session
    /// got its last token (the user's or tool's think time), not at `arrival` (which only
    /// orders the list).
    pub think: Option<Nanos>,
}

impl RequestSpec {
    /// A P/D request with no context on D.
    pub fn new(arrival: Nanos, prompt_tokens: u32, cached_tokens: u32, output_tokens: u32) -> Self {
        RequestSpec {
            arrival,
            prompt_tokens,
            cached_tokens,
            output_tokens,
            context: None,
            local: false,
            session: None,
            think: None,
        }
    }

    /// Tokens P must prefill.
    pub fn uncached(&self) -> u32 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
}

/// Context ids of local requests have this bit set (theirs and the P/D requests' never meet).
pub const LOCAL_CONTEXT: u64 = 1 << 63;

/// Parameters of the synthetic agentic mix: sessions whose context grows turn by turn, with
/// a high probability that P still holds the previous turn (prefix reuse), Poisson arrivals.
#[derive(Clone, Debug)]
pub struct AgenticMix {
    /// Sessions active at once (each arrival picks one at random).
    pub sessions: usize,
    /// Shortest context.
    pub min_tokens: u32,
    /// Longest context; a session that would exceed it starts over.
    pub max_tokens: u32,
    /// Tokens added per turn, uniform in the range.
    pub turn_tokens: (u32, u32),
    /// Probability that P has the previous context cached.
    pub reuse: f64,
    /// Output tokens, uniform in the range.
    pub output_tokens: (u32, u32),
    /// Poisson arrival rate, requests per second.
    pub arrival_rate: f64,
}

impl AgenticMix {
    /// The default mix: 48 sessions, contexts 1k–50k tokens, 500–4000 new tokens a turn, 93%
    /// reuse (the intra-session reuse of the seed study's agentic trace), 16–96 output tokens.
    pub fn standard(arrival_rate: f64) -> Self {
        AgenticMix {
            sessions: 48,
            min_tokens: 1_000,
            max_tokens: 50_000,
            turn_tokens: (500, 4_000),
            reuse: 0.93,
            output_tokens: (16, 96),
            arrival_rate,
        }
    }

    /// Generates `n` requests from `seed` (deterministic). A turn's context id names its
    /// session and how often the session started over; the new tokens of a turn stand for the
    /// previous turn's output and the new input.
    pub fn generate(&self, n: usize, seed: u64) -> Vec<RequestSpec> {
        self.generate_bounded(Some(n), None, seed, false)
    }

    /// Local requests of this mix (their own sessions; [`RequestSpec::local`]) arriving in
    /// `[0, until]`.
    pub fn generate_local(&self, until: Nanos, seed: u64) -> Vec<RequestSpec> {
        self.generate_bounded(None, Some(until), seed, true)
    }

    fn generate_bounded(
        &self,
        n: Option<usize>,
        until: Option<Nanos>,
        seed: u64,
        local: bool,
    ) -> Vec<RequestSpec> {
        let mut rng = Rng::new(seed);
        let min = u64::from(self.min_tokens.max(1));
        let max = u64::from(self.max_tokens.max(self.min_tokens.max(1)));
        let mut ctx: Vec<u32> = (0..self.sessions.max(1))
            .map(|_| rng.range(min, (max / 4).max(min)) as u32)
            .collect();
        let mut epoch = vec![0u64; ctx.len()];
        let mut t: Nanos = 0;
        let mut out = Vec::new();
        while n.is_none_or(|n| out.len() < n) && until.is_none_or(|u| t <= u) {
            let i = rng.range(0, ctx.len() as u64 - 1) as usize;
            let add = rng.range(
                u64::from(self.turn_tokens.0),
                u64::from(self.turn_tokens.1.max(self.turn_tokens.0)),
            ) as u32;
            let mut prompt = ctx[i].saturating_add(add);
            let mut cached = if rng.chance(self.reuse) { ctx[i] } else { 0 };
            if u64::from(prompt) > max {
                prompt = rng.range(min, (min * 8).min(max)) as u32;
                cached = 0;
                epoch[i] += 1;
            }
            ctx[i] = prompt;
            let output = rng.range(
                u64::from(self.output_tokens.0.max(1)),
                u64::from(self.output_tokens.1.max(self.output_tokens.0.max(1))),
            ) as u32;
            let mut spec = RequestSpec::new(t, prompt, cached, output);
            spec.context = Some(context_id(i, epoch[i], local));
            spec.local = local;
            out.push(spec);
            let gap = (rng.exp(1.0 / self.arrival_rate.max(1e-6)) * 1e9) as Nanos;
            t += gap.max(1);
        }
        out
    }
}

fn context_id(session: usize, epoch: u64, local: bool) -> u64 {
    let id = ((session as u64) << 32) | (epoch & 0xffff_ffff);
    if local {
        id | LOCAL_CONTEXT
    } else {
        id
    }
}

/// Sessions of turns, closed loop: each session starts at a uniform time in `[0, span]`, has
/// a geometric number of turns, and a later turn is sent a think time (exponential, mean
/// `gap_s`) after the previous one got its last token, as an agent sends its next call when
/// the answer is back. The first turn's context is uniform in `first_tokens`; each later turn
/// adds `growth` × the context (the previous output and the new input), so a later turn
/// reuses `1 / (1 + growth)` of its prompt; a context past `max_tokens` starts the session
/// over. The model of the seed study's agentic trace ([`SessionMix::study`]).
#[derive(Clone, Debug)]
pub struct SessionMix {
    /// Sessions.
    pub sessions: usize,
    /// Mean turns per session (geometric, at least 1).
    pub turns_mean: f64,
    /// Context of a first turn, uniform in the range.
    pub first_tokens: (u32, u32),
    /// New tokens of a later turn, as a fraction of the previous context: exponential with
    /// this mean (at most 1).
    pub growth: f64,
    /// Longest context; a session that would exceed it starts over.
    pub max_tokens: u32,
    /// Mean think time between a turn's last token and the session's next turn, seconds.
    pub gap_s: f64,
    /// Sessions start uniformly in `[0, span_s]`.
    pub span_s: f64,
    /// Probability that P has the previous turn's context cached.
    pub p_reuse: f64,
    /// Output tokens, uniform in the range.
    pub output_tokens: (u32, u32),
}

impl SessionMix {
    /// One engine's share of the seed study's w600 trace (see [`super::ClockConfig::study`] for
    /// every number and where it comes from): 34 sessions (274 / 8) of 4.43 turns on average
    /// (1214 / 274), first contexts 6k–58k tokens growing 7.5% a turn (93% reuse; mean context
    /// about 44k tokens = 53.3M / 1214), sessions started over the first 600 s (the 600 s cut
    /// holds every first turn), 5 s of think time between turns, P holding the previous turn
    /// with the seeds' 93%, 32–350 output tokens (mean 191).
    pub fn study() -> Self {
        SessionMix {
            sessions: 34,
            turns_mean: 1214.0 / 274.0,
            first_tokens: (6_000, 58_000),
            growth: 0.075,
            max_tokens: 120_000,
            gap_s: 5.0,
            span_s: 600.0,
            p_reuse: 0.93,
            output_tokens: (32, 350),
        }
    }

    /// The requests of every session, by arrival. `local`: they are D's own requests.
    pub fn generate(&self, seed: u64, local: bool) -> Vec<RequestSpec> {
        let mut rng = Rng::new(seed);
        let q = 1.0 / self.turns_mean.max(1.0);
        let mut out = Vec::new();
        for s in 0..self.sessions {
            let mut t = (rng.f64() * self.span_s * SEC as f64) as Nanos;
            let mut epoch = 0u64;
            let mut ctx = 0u32;
            let mut prev_out = 0u32;
            let mut turn = 0u32;
            loop {
                let first = rng.range(
                    u64::from(self.first_tokens.0.max(1)),
                    u64::from(self.first_tokens.1.max(self.first_tokens.0.max(1))),
                ) as u32;
                let g = rng.exp(self.growth).min(1.0);
                let grown = f64::from(ctx) * (1.0 + g) + f64::from(prev_out);
                let (prompt, cached) = if turn == 0 || grown > f64::from(self.max_tokens) {
                    if turn > 0 {
                        epoch += 1;
                    }
                    (first, 0)
                } else {
                    let p = (grown.ceil() as u32).max(ctx + 1);
                    (p, if rng.chance(self.p_reuse) { ctx } else { 0 })
                };
                let output = rng.range(
                    u64::from(self.output_tokens.0.max(1)),
                    u64::from(self.output_tokens.1.max(self.output_tokens.0.max(1))),
                ) as u32;
                let think = ((rng.exp(self.gap_s) * SEC as f64) as Nanos).max(1);
                let mut spec = RequestSpec::new(t, prompt, cached, output);
                spec.context = Some(context_id(s, epoch, local));
                spec.session = Some(context_id(s, 0, local));
                spec.think = (turn > 0).then_some(think);
                spec.local = local;
                out.push(spec);
                ctx = prompt;
                prev_out = output;
                turn += 1;
                if rng.chance(q) {
                    break;
                }
                // Orders the list only: a later turn is sent `think` after the previous one ends.
                t += think;
            }
        }
        out.sort_by_key(|r| r.arrival);
        out
    }
}

/// Fixed prompt lengths: request `k` has `prompts[k % len]` tokens, none cached on P, and
/// arrives at `k / rate` seconds (evenly spaced, so that the figures of one length are not
/// mixed with queueing behind another).
pub fn fixed_prompts(prompts: &[u32], n: usize, rate: f64, output_tokens: u32) -> Vec<RequestSpec> {
    if prompts.is_empty() {
        return Vec::new();
    }
    let gap = (SEC as f64 / rate.max(1e-9)) as Nanos;
    (0..n)
        .map(|k| {
            RequestSpec::new(
                k as Nanos * gap,
                prompts[k % prompts.len()].max(1),
                0,
                output_tokens.max(1),
            )
        })
        .collect()
}

/// The P/D requests and the local ones in one list, by arrival (P/D first at a tie, each list
/// keeping its own order).
pub fn merge(pd: Vec<RequestSpec>, local: Vec<RequestSpec>) -> Vec<RequestSpec> {
    let mut v = pd;
    v.extend(local);
    v.sort_by_key(|r| (r.arrival, r.local));
    v
}
