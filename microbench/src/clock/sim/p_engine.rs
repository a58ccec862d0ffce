//! P's step loop and P's connector actions.
//!
//! Whole-prompt steps (`chunk_tokens` 0) batch queued requests under a token budget; layer `l`
//! of every request in the step is ready at `(l+1)/L` of the step. Chunked prefill computes at
//! most `chunk_tokens` tokens a step, requests already started first (vLLM's running queue),
//! so a long prompt takes one chunk per step: the core hears `Scheduled` at the first chunk,
//! `LayerReady` when the last chunk passes a layer, `PrefillDone` after the last chunk. With
//! layerwise send the host streams itself ([`kvwire_connector::PAction::Destination`]): once a
//! chunk's forward passed layer `l`, that chunk's completed blocks of layer `l` go out (a block
//! split by the chunk boundary goes with the next chunk), and the core hears `TransferDone`
//! when the last run of a layer landed.

use std::sync::Arc;

use kvwire_connector::{PAction, PEvent, RequestId};

use super::{p_err, Cell, Dest, Ev, SrcLoad, D_PEER};
use crate::clock::{ClockError, Scenario};

impl Cell<'_> {
    fn uncached_of(&self, req: u64) -> u32 {
        if self.cfg.scenario == Scenario::Migration {
            // The KV is already cached on the source: nothing to compute.
            0
        } else {
            self.specs[req as usize].uncached()
        }
    }

    /// Allocates P's blocks, writes the request's pattern into them and tells the core.
    fn p_schedule(&mut self, req: u64, blocks: Vec<u32>) -> Result<(), ClockError> {
        let layers = usize::from(self.cfg.layers);
        let crcs = self.dp.stage(req, self.cfg.layers, &blocks)?;
        let spec = &self.specs[req as usize];
        let st = &mut self.st[req as usize];
        st.crcs = crcs;
        st.p_blocks = blocks.clone();
        st.ready_upto = vec![0; layers];
        st.sent_upto = vec![0; layers];
        st.core_issued = vec![false; layers];
        st.landed_blocks = vec![0; layers];
        st.layer_bytes = vec![0; layers];
        self.p
            .handle(
                PEvent::Scheduled {
                    req: RequestId(req),
                    peer: D_PEER,
                    tokens: spec.prompt_tokens,
                    blocks,
                },
                self.now,
            )
            .map_err(p_err)
    }

    pub(super) fn p_try_step(&mut self) -> Result<(), ClockError> {
        if self.p_busy {
            return Ok(());
        }
        if self.cfg.chunk_tokens > 0 {
            return self.p_try_chunked_step();
        }
        let mut batch = Vec::new();
        let mut tokens = 0u64;
        let mut cost = self.cfg.p_step_base;
        while let Some(&req) = self.p_queue.front() {
            let uncached = self.uncached_of(req);
            if !batch.is_empty()
                && tokens + u64::from(uncached) > u64::from(self.cfg.p_token_budget)
            {
                break;
            }
            let n = self.blocks_of(req) as usize;
            let Some(blocks) = self.p_pool.alloc(n) else {
                break;
            };
            self.p_queue.pop_front();
            tokens += u64::from(uncached);
            let s = self.specs[req as usize].prompt_tokens - uncached;
            cost += self
                .cfg
                .prefill_ns(self.cfg.p_step_per_token, s, s + uncached);
            self.p_schedule(req, blocks)?;
            batch.push((req, uncached, true));
        }
        if batch.is_empty() {
            return self.drain_p();
        }
        let dur = cost;
        let layers = u64::from(self.cfg.layers);
        for &(req, _, _) in &batch {
            for l in 0..self.cfg.layers {
                let t = self.now + dur * (u64::from(l) + 1) / layers;
                self.at(t, Ev::PLayerReady(req, l));
            }
        }
        self.p_start_step(batch, dur)
    }

    fn p_start_step(&mut self, batch: Vec<(u64, u32, bool)>, dur: u64) -> Result<(), ClockError> {
        self.p_busy = true;
        self.p_batch = batch;
        self.p_step = (self.now, dur.max(1));
        self.at(self.now + dur, Ev::PStepEnd);
        self.drain_p()
    }

    /// A chunked step: the started requests' next chunks first, then new requests, up to
    /// `chunk_tokens` tokens.
    fn p_try_chunked_step(&mut self) -> Result<(), ClockError> {
        let mut left = self.cfg.chunk_tokens;
        let mut batch = Vec::new();
        let mut cost = self.cfg.p_step_base;
        let partial: Vec<u64> = self.p_partial.iter().copied().collect();
        for req in partial {
            if left == 0 {
                break;
            }
            let remaining = self.uncached_of(req) - self.st[req as usize].p_done_tokens;
            let take = remaining.min(left);
            left -= take;
            batch.push((req, take, take == remaining));
        }
        while let Some(&req) = self.p_queue.front() {
            let uncached = self.uncached_of(req);
            if left == 0 && uncached > 0 {
                break;
            }
            let n = self.blocks_of(req) as usize;
            let Some(blocks) = self.p_pool.alloc(n) else {
                break;
            };
            self.p_queue.pop_front();
            self.p_schedule(req, blocks)?;
            let take = uncached.min(left);
            left -= take;
            if take < uncached {
                self.p_partial.push_back(req);
            }
            batch.push((req, take, take == uncached));
        }
        if batch.is_empty() {
            return self.drain_p();
        }
        let bt = self.cfg.block_tokens;
        let layers = u64::from(self.cfg.layers);
        let mut events = Vec::with_capacity(batch.len());
        for &(req, take, last) in &batch {
            let spec = &self.specs[req as usize];
            let s =
                spec.prompt_tokens - self.uncached_of(req) + self.st[req as usize].p_done_tokens;
            cost += self.cfg.prefill_ns(self.cfg.p_step_per_token, s, s + take);
            // Blocks complete after this chunk; a block split by the boundary waits for the
            // next chunk.
            let upto = if last {
                self.blocks_of(req)
            } else {
                (s + take) / bt
            };
            events.push((req, upto, last));
        }
        let dur = cost;
        for (req, upto, last) in events {
            for layer in 0..self.cfg.layers {
                let t = self.now + dur * (u64::from(layer) + 1) / layers;
                self.at(
                    t,
                    Ev::PChunkLayer {
                        req,
                        layer,
                        upto,
                        last,
                    },
                );
            }
        }
        self.p_start_step(batch, dur)
    }

    pub(super) fn p_step_end(&mut self) -> Result<(), ClockError> {
        for (req, take, last) in std::mem::take(&mut self.p_batch) {
            let st = &mut self.st[req as usize];
            st.p_done_tokens += take;
            st.host.chunks += 1;
            if !last {
                continue;
            }
            if !st.p_blocks.is_empty() {
                st.p_held = true;
                self.out.pool.p.hold(self.now, st.p_blocks.len() as u64);
            }
            self.p_partial.retain(|&r| r != req);
            self.p
                .handle(
                    PEvent::PrefillDone {
                        req: RequestId(req),
                    },
                    self.now,
                )
                .map_err(p_err)?;
            if self.cfg.scenario == Scenario::Migration {
                // PD-sep migration: the decode request is sent once prefill is done.
                let at = self.now + self.cfg.msg_latency;
                self.at(at, Ev::DRecv(req));
            }
        }
        self.p_busy = false;
        self.drain_p()?;
        self.p_try_step()
    }

    /// A chunk of `req` passed `layer`: `upto` of its blocks are complete in that layer.
    pub(super) fn p_chunk_layer(
        &mut self,
        req: u64,
        layer: u16,
        upto: u32,
        last: bool,
    ) -> Result<(), ClockError> {
        {
            let r = &mut self.st[req as usize].ready_upto[usize::from(layer)];
            *r = (*r).max(upto);
        }
        if last {
            self.p_layer_ready(req, layer)?;
        }
        if self.streaming {
            self.stream(req, layer)?;
        }
        Ok(())
    }

    /// Posts the blocks of `layer` that are complete on P and not sent yet, once D's
    /// destination is known.
    fn stream(&mut self, req: u64, layer: u16) -> Result<(), ClockError> {
        let l = usize::from(layer);
        let st = &self.st[req as usize];
        let Some(first) = st.dest.as_ref().map(|d| d.first) else {
            return Ok(());
        };
        let a = st.sent_upto[l].max(first);
        let b = st.ready_upto[l];
        if b > a {
            self.st[req as usize].sent_upto[l] = b;
            self.transfer_piece(req, layer, a, b)?;
        }
        Ok(())
    }

    /// Layer `layer` of `req` is ready on P.
    pub(super) fn p_layer_ready(&mut self, req: u64, layer: u16) -> Result<(), ClockError> {
        let req = RequestId(req);
        self.p_handle(PEvent::LayerReady { req, layer })
    }

    /// Feeds P's core `ev` now, then carries out what it asks.
    pub(super) fn p_handle(&mut self, ev: PEvent) -> Result<(), ClockError> {
        self.p.handle(ev, self.now).map_err(p_err)?;
        self.drain_p()
    }

    pub(super) fn drain_p(&mut self) -> Result<(), ClockError> {
        let mut freed = false;
        while let Some(a) = self.p.poll_action() {
            match a {
                PAction::Send { msg, .. } => self.send(true, &msg)?,
                PAction::Transfer {
                    req,
                    layer,
                    src,
                    dst,
                    landing,
                    ..
                } => {
                    if self.streaming {
                        self.core_issued(req.0, layer);
                    } else {
                        self.transfer(req.0, layer, src, dst, landing)?;
                    }
                }
                PAction::Destination {
                    req,
                    first,
                    dst,
                    landing,
                    ..
                } => {
                    if self.streaming {
                        self.st[req.0 as usize].dest = Some(Dest {
                            first,
                            dst,
                            landing,
                        });
                        for layer in 0..self.cfg.layers {
                            self.stream(req.0, layer)?;
                        }
                    }
                }
                PAction::ReleaseBlocks { req, blocks } => {
                    let st = &mut self.st[req.0 as usize];
                    // With a prefix hit on D, the core sent (and releases) only the suffix;
                    // P's engine frees every block of the request.
                    if blocks.is_empty() || !st.p_blocks.ends_with(&blocks) {
                        return Err(ClockError::Protocol(format!(
                            "P released blocks it did not give for {req:?}"
                        )));
                    }
                    let all = std::mem::take(&mut st.p_blocks);
                    if std::mem::take(&mut st.p_held) {
                        self.out.pool.p.release(self.now, all.len() as u64);
                    }
                    self.p_pool.release(&all);
                    freed = true;
                }
                PAction::ReportFinished { .. } => {}
                PAction::CancelTransfers { req } | PAction::ReportFailed { req, .. } => {
                    return Err(ClockError::Protocol(format!(
                        "request {req:?} failed on P (no failures are injected)"
                    )))
                }
                PAction::DisconnectPeer { .. } => {
                    return Err(ClockError::Protocol("P disconnected D".into()))
                }
            }
        }
        while let Some(rec) = self.p.poll_timeline() {
            if let Some(slot) = self.p_records.get_mut(rec.req.0 as usize) {
                *slot = Some(rec);
            }
        }
        if let Some(t) = self.p.poll_timeout() {
            if self.p_wake.is_none_or(|w| t < w) {
                self.p_wake = Some(t);
                self.at(t.max(self.now), Ev::PWake(t));
            }
        }
        if freed && !self.p_busy && !self.p_queue.is_empty() {
            self.p_try_step()?;
        }
        Ok(())
    }

    /// Streaming: the core issued `layer` (its last chunk passed it and D's destination is
    /// known); it settles once every run of the layer landed.
    fn core_issued(&mut self, req: u64, layer: u16) {
        let l = usize::from(layer);
        let st = &mut self.st[req as usize];
        st.core_issued[l] = true;
        let first = st.dest.as_ref().map_or(0, |d| d.first);
        let want = st.crcs.blocks() as u32 - first;
        if st.landed_blocks[l] == want {
            let bytes = st.layer_bytes[l];
            let at = self.now + self.cfg.msg_latency;
            self.at(at, Ev::Settle(req, layer, bytes));
        }
    }

    /// What a router knows of P when `req` reaches D: the requests queued on P ahead of it
    /// (all of P's queue when P has not received it yet), the step P is running and the chunks
    /// still to come of started requests, and the request's own prefill work.
    pub(super) fn src_load(&self, req: u64) -> SrcLoad {
        let migration = self.cfg.scenario == Scenario::Migration;
        let uncached = |r: u64| u64::from(self.uncached_of(r));
        let layers = u64::from(self.cfg.layers.max(1));
        let model_bytes = |r: u64| {
            u64::from(self.blocks_of(r))
                * u64::from(self.cfg.block_tokens)
                * self.cfg.model_bytes_per_token
        };
        let mut s = SrcLoad::default();
        // Once P runs the request, everything still queued on P is behind it.
        let started = (self.p_busy && self.p_batch.iter().any(|b| b.0 == req))
            || self.p_partial.contains(&req);
        let ahead = if started { 0 } else { self.p_queue.len() };
        for &r in self.p_queue.iter().take(ahead).take_while(|&&r| r != req) {
            s.waiting += 1;
            s.queued_tokens += uncached(r);
            s.pending_bytes += model_bytes(r);
        }
        if self.p_busy {
            let (start, dur) = self.p_step;
            let ready = (u128::from(self.now.saturating_sub(start)) * u128::from(layers)
                / u128::from(dur))
            .min(u128::from(layers)) as u64;
            for &(r, take, _) in self.p_batch.iter().filter(|b| b.0 != req) {
                s.running += 1;
                let after =
                    uncached(r).saturating_sub(u64::from(self.st[r as usize].p_done_tokens + take));
                s.running_tokens += u64::from(take) * (layers - ready) / layers + after;
                s.pending_bytes += model_bytes(r);
            }
        }
        // Prefilled, blocks still held on P: the layers not landed yet are still to go.
        for (r, st) in self.st.iter().enumerate() {
            if st.p_held && r as u64 != req {
                let left = layers.saturating_sub(u64::from(st.layers_landed));
                s.pending_bytes += model_bytes(r as u64) * left / layers;
            }
        }
        let spec = &self.specs[req as usize];
        s.prefill_tokens = uncached(req) as u32;
        s.cached_tokens = if migration {
            spec.prompt_tokens
        } else {
            spec.cached_tokens.min(spec.prompt_tokens)
        };
        s
    }
}

/// The destination blocks of request blocks `a..b` (`dst[i]` is request block `first + i`).
pub(super) fn dst_of(dest: &Dest, a: u32, b: u32) -> Arc<[u32]> {
    Arc::from(&dest.dst[(a - dest.first) as usize..(b - dest.first) as usize])
}
