//! D's step loop, as vLLM's scheduler runs it.
//!
//! A step first schedules the running requests (each decode is one token, a prefill chunk of
//! a local or recomputed request up to the token budget) and gives each the blocks its KV
//! needs after the step — a decoding request one more block every `block_tokens` tokens.
//! When the pool (free plus evictable cached blocks) cannot, the newest running request is
//! preempted (recompute: its blocks are freed, its computed full blocks stay cached, and it
//! goes to the front of the waiting queue to prefill its prompt and output again), and no
//! waiting request is scheduled in that step. Otherwise requests whose KV arrived are
//! promoted (one step after they were reported, async scheduling), then the waiting queue is
//! served in order: a P/D request the core allows to reserve gets its blocks (after its
//! prefix-cache hit), a local or preempted one its prefix hit and the blocks of its first
//! chunk; the first that does not fit stops the queue (an admission stall). Reserved blocks
//! of P/D requests whose KV has not arrived are not preemptible: they compete with
//! everything above.

use kvwire_connector::DEvent;

use super::{d_err, Cell, Ev, Running, Wait};
use crate::clock::ClockError;

impl Cell<'_> {
    pub(super) fn kick_d(&mut self) {
        if !self.d_stepping {
            self.d_stepping = true;
            let grid = self.cfg.d_idle_poll.max(1);
            let at = (self.now / grid + 1) * grid;
            self.at(at, Ev::DStep);
        }
    }

    /// Whether D's prefix cache holds `req`'s blocks (local requests always, P/D ones with
    /// the option).
    fn cacheable(&self, req: u64) -> Option<u64> {
        let s = &self.specs[req as usize];
        s.context.filter(|_| s.local || self.cfg.d_prefix_cache)
    }

    /// KV tokens of a running request after this step's tokens.
    fn kv_after(&self, r: &Running) -> u32 {
        if r.computed < r.target {
            r.computed + r.step_tokens
        } else {
            self.specs[r.req as usize].prompt_tokens + self.st[r.req as usize].d_generated
        }
    }

    /// KV tokens a running request has computed.
    fn kv_now(&self, r: &Running) -> u32 {
        if r.computed < r.target {
            r.computed
        } else {
            let p = self.specs[r.req as usize].prompt_tokens;
            (p + self.st[r.req as usize].d_generated)
                .saturating_sub(1)
                .max(p)
        }
    }

    pub(super) fn d_step(&mut self) -> Result<(), ClockError> {
        self.out.d_steps += 1;
        let now = self.now;
        let mut budget = self.cfg.d_token_budget;
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            let prefill = self.running[i].computed < self.running[i].target;
            let tokens = if prefill {
                (self.running[i].target - self.running[i].computed).min(budget)
            } else {
                budget.min(1)
            };
            self.running[i].step_tokens = tokens;
            self.running[i].step_prefill = prefill;
            if tokens == 0 {
                i += 1;
                continue;
            }
            let need = self
                .cfg
                .blocks_for(u64::from(self.kv_after(&self.running[i])))
                as usize;
            let have = self.running[i].blocks.len();
            if need > have {
                match self.d_pool.alloc(need - have) {
                    Some(b) => self.running[i].blocks.extend(b),
                    None => {
                        preempted = true;
                        let victim = self.running.len() - 1;
                        self.preempt(victim);
                        if victim == i {
                            break;
                        }
                        continue;
                    }
                }
            }
            budget -= tokens;
            i += 1;
        }
        if preempted {
            // vLLM schedules no waiting request in a step that preempted.
            for p in &mut self.to_promote {
                p.1 = p.1.saturating_sub(1);
            }
        } else {
            self.promote(&mut budget)?;
            self.admit(budget)?;
        }
        self.drain_d()?;
        let mut decodes = 0u64;
        let mut kv = 0u64;
        let mut prefill = 0u64;
        for r in self.running.iter().filter(|r| r.step_tokens > 0) {
            if r.step_prefill {
                prefill += self.cfg.prefill_ns(
                    self.cfg.d_prefill_per_token,
                    r.computed,
                    r.computed + r.step_tokens,
                );
            } else {
                decodes += 1;
                kv += u64::from(self.kv_after(r));
            }
        }
        let dur = if decodes == 0 && prefill == 0 {
            self.cfg.d_idle_poll
        } else {
            self.cfg.d_step_base
                + self.cfg.d_step_per_running * decodes
                + prefill
                + (self.cfg.d_step_per_kv_token * kv as f64) as u64
        };
        self.at(now + dur, Ev::DStepEnd);
        Ok(())
    }

    /// Requests whose KV arrived (reported one step ago) join the running batch.
    fn promote(&mut self, budget: &mut u32) -> Result<(), ClockError> {
        let now = self.now;
        let mut later = Vec::new();
        for (req, wait) in std::mem::take(&mut self.to_promote) {
            if wait > 0 {
                later.push((req, wait - 1));
                continue;
            }
            self.d
                .handle(DEvent::Promoted { req }, now)
                .map_err(d_err)?;
            let prompt = self.specs[req.0 as usize].prompt_tokens;
            let st = &mut self.st[req.0 as usize];
            if std::mem::take(&mut st.d_held) {
                self.out.pool.d.release(now, st.d_blocks.len() as u64);
            }
            self.d_waiting = self.d_waiting.saturating_sub(1);
            let mut blocks = std::mem::take(&mut st.d_prefix);
            blocks.append(&mut st.d_blocks);
            self.running.push(Running {
                req: req.0,
                target: prompt,
                computed: prompt,
                blocks,
                step_tokens: 1,
                step_prefill: false,
            });
            *budget = budget.saturating_sub(1);
            self.promoted_now.push(req);
        }
        self.to_promote = later;
        Ok(())
    }

    /// Serves D's waiting queue in order until a request does not fit.
    fn admit(&mut self, mut budget: u32) -> Result<(), ClockError> {
        let now = self.now;
        let mut stalled = false;
        while let Some(&w) = self.waiting.front() {
            match w {
                Wait::Reserve(req) => {
                    if !self.d.may_reserve(req) {
                        self.waiting.pop_front();
                        continue;
                    }
                    let pinned_before = self.st[req.0 as usize].prefix_set;
                    let hit = self.pd_prefix(req.0)?;
                    let n = (self.blocks_of(req.0) - hit) as usize;
                    let Some(blocks) = self.d_pool.alloc(n) else {
                        if !pinned_before && hit > 0 {
                            self.pd_unpin(req.0);
                        }
                        stalled = true;
                        break;
                    };
                    self.waiting.pop_front();
                    self.count_pd_lookup(req.0);
                    self.out.pool.d.hold(now, blocks.len() as u64);
                    let st = &mut self.st[req.0 as usize];
                    st.d_blocks = blocks.clone();
                    st.d_held = true;
                    self.d
                        .handle(DEvent::Reserved { req, blocks }, now)
                        .map_err(d_err)?;
                }
                Wait::Run(req) => {
                    if budget == 0 {
                        break;
                    }
                    let Some(tokens) = self.admit_run(req, budget) else {
                        stalled = true;
                        break;
                    };
                    self.waiting.pop_front();
                    budget -= tokens;
                }
            }
        }
        if stalled {
            self.out.admission_stalls += 1;
        }
        Ok(())
    }

    /// What a local (or preempted) request needs to start: its prefix hit and the blocks of
    /// its first chunk. `(hit blocks, blocks to allocate, hit blocks that are evictable now)`.
    fn run_need(&self, req: u64, budget: u32) -> (usize, usize, usize) {
        let spec = &self.specs[req as usize];
        let target = spec.prompt_tokens + self.st[req as usize].d_generated;
        let bt = self.cfg.block_tokens;
        let (h, cost) = match self.cacheable(req) {
            Some(ctx) => {
                let h = self.d_pool.hit(ctx, target, bt);
                (h, self.d_pool.pin_cost(ctx, h))
            }
            None => (0, 0),
        };
        let computed = h as u32 * bt;
        let tokens = (target - computed).min(budget);
        let need = self.cfg.blocks_for(u64::from(computed + tokens)) as usize - h;
        (h, need, cost)
    }

    /// Starts a local or preempted request: pins its prefix hit, allocates its first chunk's
    /// blocks and adds it to the running batch; `None` (nothing changed) when it does not fit.
    fn admit_run(&mut self, req: u64, budget: u32) -> Option<u32> {
        let (h, need, _) = self.run_need(req, budget);
        let spec = &self.specs[req as usize];
        let target = spec.prompt_tokens + self.st[req as usize].d_generated;
        let pins = match self.cacheable(req) {
            Some(ctx) => self.d_pool.pin(ctx, h),
            None => Vec::new(),
        };
        let Some(fresh) = self.d_pool.alloc(need) else {
            self.d_pool.release(&pins);
            return None;
        };
        let computed = h as u32 * self.cfg.block_tokens;
        let tokens = (target - computed).min(budget);
        let first_time = {
            let st = &self.st[req as usize];
            st.d_generated == 0 && st.served.preemptions == 0
        };
        if first_time {
            if spec.local && self.cacheable(req).is_some() {
                self.out.apc.local_query += u64::from(spec.prompt_tokens);
                self.out.apc.local_hit += u64::from(computed);
                let sv = &mut self.st[req as usize].served;
                sv.lookup_tokens = spec.prompt_tokens;
                sv.hit_tokens = computed;
            }
        } else {
            self.out.recompute_tokens += u64::from(target - computed);
        }
        let mut blocks = pins;
        blocks.extend(fresh);
        self.running.push(Running {
            req,
            target,
            computed,
            blocks,
            step_tokens: tokens,
            step_prefill: true,
        });
        Some(tokens)
    }

    /// Preempts running request `i` (recompute): its computed full blocks are cached (when
    /// its context is), its blocks freed, and it waits at the front of the queue.
    fn preempt(&mut self, i: usize) {
        let r = self.running.remove(i);
        let kv = self.kv_now(&r);
        self.release_running(&r, kv);
        self.out.preemptions += 1;
        self.st[r.req as usize].served.preemptions += 1;
        self.waiting.push_front(Wait::Run(r.req));
    }

    /// Caches the full blocks of `kv` computed tokens of `r` (when its context is cacheable)
    /// and drops its references to its blocks.
    fn release_running(&mut self, r: &Running, kv: u32) {
        if let Some(ctx) = self.cacheable(r.req) {
            let full = (kv / self.cfg.block_tokens) as usize;
            self.d_pool
                .store(ctx, &r.blocks[..full.min(r.blocks.len())]);
        }
        self.d_pool.release(&r.blocks);
    }

    pub(super) fn d_step_end(&mut self) -> Result<(), ClockError> {
        let now = self.now;
        for req in std::mem::take(&mut self.promoted_now) {
            self.d
                .handle(DEvent::FirstToken { req }, now)
                .map_err(d_err)?;
        }
        let mut still = Vec::with_capacity(self.running.len());
        for mut r in std::mem::take(&mut self.running) {
            if r.step_tokens == 0 {
                still.push(r);
                continue;
            }
            if r.step_prefill {
                r.computed += r.step_tokens;
            }
            r.step_tokens = 0;
            if r.computed < r.target {
                still.push(r);
                continue;
            }
            // The step sampled a token.
            let out = self.specs[r.req as usize].output_tokens.max(1);
            let st = &mut self.st[r.req as usize];
            st.d_generated += 1;
            if st.served.first_token.is_none() {
                st.served.first_token = Some(now);
            }
            if st.d_generated >= out {
                st.served.finished = Some(now);
                let kv = self.kv_now(&r);
                self.release_running(&r, kv);
                if self.specs[r.req as usize].local {
                    self.local_done += 1;
                }
                self.turn_done(r.req);
            } else {
                still.push(r);
            }
        }
        self.running = still;
        // get_finished at the end of the step: what completed during it is reported now,
        // promoted at the step after next (async scheduling).
        for req in std::mem::take(&mut self.to_report) {
            self.d
                .handle(DEvent::Reported { req }, now)
                .map_err(d_err)?;
            self.to_promote.push((req, 1));
        }
        self.drain_d()?;
        if !self.running.is_empty() || !self.to_promote.is_empty() || self.head_fits() {
            self.at(now, Ev::DStep);
        } else {
            self.d_stepping = false;
        }
        Ok(())
    }

    /// Whether the head of the waiting queue would get its blocks now.
    fn head_fits(&self) -> bool {
        let avail = self.d_pool.available();
        match self.waiting.front() {
            None => false,
            Some(&Wait::Reserve(r)) => {
                let st = &self.st[r.0 as usize];
                let n = self.blocks_of(r.0) as usize;
                let (h, cost) = match (self.cfg.d_prefix_cache, self.specs[r.0 as usize].context) {
                    _ if st.prefix_set => (st.d_prefix.len(), 0),
                    (true, Some(ctx)) => {
                        let h = self.d_pool.hit(
                            ctx,
                            self.specs[r.0 as usize].prompt_tokens,
                            self.cfg.block_tokens,
                        );
                        (h, self.d_pool.pin_cost(ctx, h))
                    }
                    _ => (0, 0),
                };
                n - h <= avail.saturating_sub(cost)
            }
            Some(&Wait::Run(r)) => {
                let (_, need, cost) = self.run_need(r, self.cfg.d_token_budget);
                need <= avail.saturating_sub(cost)
            }
        }
    }
}
