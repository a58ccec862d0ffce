//! D's host side of the connector: arrivals, the core's actions (reservation, landing slots
//! of `land`, the local copy before a `land` request is reported), layers landing on D and
//! their checks.

use kvwire_connector::{DAction, DEvent, RequestId};

use super::{d_err, Cell, Ev, ServedRecord, Wait, P_PEER};
use crate::clock::ClockError;

impl Cell<'_> {
    pub(super) fn d_arrive(&mut self, req: u64) -> Result<(), ClockError> {
        let src = self.src_load(req);
        let blocks = self.blocks_of(req);
        let spec = &self.specs[req as usize];
        let st = &mut self.st[req as usize];
        st.load = (self.d_waiting, self.running.len() as u32);
        st.src = src;
        st.d_live = true;
        st.host.context_wire_bytes =
            u64::from(blocks) * u64::from(self.cfg.layers) * self.dp.layer_block_bytes();
        st.served = ServedRecord {
            req,
            local: false,
            arrival: self.now,
            output_tokens: spec.output_tokens.max(1),
            ..ServedRecord::default()
        };
        self.d_waiting += 1;
        self.d
            .handle(
                DEvent::Arrived {
                    req: RequestId(req),
                    peer: P_PEER,
                    tokens: spec.prompt_tokens,
                    blocks,
                },
                self.now,
            )
            .map_err(d_err)?;
        self.drain_d()
    }

    pub(super) fn local_arrive(&mut self, req: u64) {
        let out = self.specs[req as usize].output_tokens.max(1);
        self.st[req as usize].served = ServedRecord {
            req,
            local: true,
            arrival: self.now,
            output_tokens: out,
            ..ServedRecord::default()
        };
        self.waiting.push_back(Wait::Run(req));
        self.kick_d();
    }

    /// D's prefix-cache hit for a P/D request, looked up once (with
    /// [`crate::clock::ClockConfig::d_prefix_cache`]): pins the blocks and tells the core.
    /// Returns the blocks D holds already.
    pub(super) fn pd_prefix(&mut self, req: u64) -> Result<u32, ClockError> {
        let st = &self.st[req as usize];
        if st.prefix_set || !self.cfg.d_prefix_cache {
            return Ok(st.d_prefix.len() as u32);
        }
        let spec = &self.specs[req as usize];
        let Some(ctx) = spec.context else {
            return Ok(0);
        };
        let h = self
            .d_pool
            .hit(ctx, spec.prompt_tokens, self.cfg.block_tokens);
        let pinned = self.d_pool.pin(ctx, h);
        let st = &mut self.st[req as usize];
        st.prefix_set = true;
        st.host.prefix_tokens = h as u32 * self.cfg.block_tokens;
        st.d_prefix = pinned;
        self.d
            .handle(
                DEvent::PrefixHit {
                    req: RequestId(req),
                    blocks: h as u32,
                },
                self.now,
            )
            .map_err(d_err)?;
        Ok(h as u32)
    }

    /// Gives back a prefix pinned by [`Cell::pd_prefix`] for a reservation that did not
    /// get its blocks (it is looked up again next time).
    pub(super) fn pd_unpin(&mut self, req: u64) {
        let st = &mut self.st[req as usize];
        let pins = std::mem::take(&mut st.d_prefix);
        st.prefix_set = false;
        st.host.prefix_tokens = 0;
        self.d_pool.release(&pins);
    }

    /// Counts a P/D request's prefix lookup (once its reservation or landing went through).
    pub(super) fn count_pd_lookup(&mut self, req: u64) {
        let st = &mut self.st[req as usize];
        if std::mem::replace(&mut st.apc_counted, true) {
            return;
        }
        if self.cfg.d_prefix_cache && self.specs[req as usize].context.is_some() {
            let (q, h) = (
                self.specs[req as usize].prompt_tokens,
                self.st[req as usize].host.prefix_tokens,
            );
            self.out.apc.pd_query += u64::from(q);
            self.out.apc.pd_hit += u64::from(h);
            let sv = &mut self.st[req as usize].served;
            sv.lookup_tokens = q;
            sv.hit_tokens = h;
        }
    }

    /// A whole layer of `req` landed on D: checks its bytes and tells the core.
    pub(super) fn land(
        &mut self,
        req: u64,
        layer: u16,
        model_bytes: u64,
    ) -> Result<(), ClockError> {
        self.landings += 1;
        let (dst, landing, want) = {
            let st = &self.st[req as usize];
            let landing = !st.slots.is_empty();
            let dst = if landing {
                st.slots.clone()
            } else {
                st.d_blocks.clone()
            };
            // The destination covers the request's blocks after D's prefix.
            let n = st.crcs.blocks();
            let want = st.crcs.range(layer, n - dst.len().min(n), n);
            (dst, landing, want)
        };
        if self.cfg.fault_corrupt_landing == Some(self.landings) {
            if let Some(&b) = dst.first() {
                self.dp.corrupt_d(b, layer, landing)?;
            }
        }
        let got = self.dp.landed_crc(&dst, layer, landing)?;
        let layers = self.cfg.layers;
        let st = &mut self.st[req as usize];
        st.layers_landed += 1;
        if Some(got) == want {
            st.layers_ok += 1;
            self.out.bytes_verified += dst.len() as u64 * self.dp.layer_block_bytes();
        } else {
            self.out.corrupt_layers += 1;
        }
        if st.layers_landed == layers && !landing {
            st.host.kv_ready = Some(self.now);
        }
        self.d
            .handle(
                DEvent::LayerLanded {
                    req: RequestId(req),
                    layer,
                    bytes: model_bytes,
                },
                self.now,
            )
            .map_err(d_err)?;
        self.drain_d()
    }

    /// Streaming: a run of `blocks` blocks of `layer` landed; the layer is whole once every
    /// run did.
    pub(super) fn piece_landed(
        &mut self,
        req: u64,
        layer: u16,
        blocks: u32,
        bytes: u64,
    ) -> Result<(), ClockError> {
        let l = usize::from(layer);
        let st = &mut self.st[req as usize];
        st.landed_blocks[l] += blocks;
        st.layer_bytes[l] += bytes;
        let first = st.dest.as_ref().map_or(0, |d| d.first);
        if st.landed_blocks[l] < st.crcs.blocks() as u32 - first {
            return Ok(());
        }
        let total = st.layer_bytes[l];
        if st.core_issued[l] {
            let at = self.now + self.cfg.msg_latency;
            self.at(at, Ev::Settle(req, layer, total));
        }
        self.land(req, layer, total)
    }

    /// `land`: copies the landing slots into the reserved KV blocks through D's engine,
    /// checks every layer there again, and reports the request once the copy's virtual time
    /// has passed.
    fn copy_landing(&mut self, req: u64) -> Result<(), ClockError> {
        let layers = self.cfg.layers;
        let (slots, blocks) = {
            let st = &self.st[req as usize];
            (st.slots.clone(), st.d_blocks.clone())
        };
        let bytes = self.dp.copy_landing(&slots, &blocks, layers)?;
        let mut ok = true;
        for layer in 0..layers {
            let st = &self.st[req as usize];
            let n = st.crcs.blocks();
            let want = st.crcs.range(layer, n - blocks.len().min(n), n);
            let got = self.dp.landed_crc(&blocks, layer, false)?;
            if Some(got) == want {
                self.out.copy_bytes_verified += blocks.len() as u64 * self.dp.layer_block_bytes();
            } else {
                ok = false;
                self.out.corrupt_layers += 1;
            }
        }
        let model = bytes as f64 * self.cfg.transfer_scale;
        let ns = (model / self.cfg.land_copy_bytes_per_s * 1e9).ceil() as u64;
        let st = &mut self.st[req as usize];
        st.copy_ok = ok;
        st.host.copy_ns = ns;
        let at = self.now + ns.max(1);
        self.at(at, Ev::CopyDone(req));
        Ok(())
    }

    pub(super) fn copy_done(&mut self, req: u64) {
        let now = self.now;
        let st = &mut self.st[req as usize];
        let slots = std::mem::take(&mut st.slots);
        if std::mem::take(&mut st.land_held) {
            self.out.pool.land.release(now, slots.len() as u64);
        }
        st.host.kv_ready = Some(now);
        self.land_pool.release(&slots);
        self.to_report.push(RequestId(req));
        self.kick_d();
    }

    pub(super) fn drain_d(&mut self) -> Result<(), ClockError> {
        let mut kick = false;
        while let Some(a) = self.d.poll_action() {
            match a {
                DAction::Send { msg, .. } => self.send(false, &msg)?,
                DAction::MayReserve { req, .. } => {
                    self.waiting.push_back(Wait::Reserve(req));
                    kick = true;
                }
                DAction::MayLand { req, blocks } => {
                    // The landing pool is host memory apart from the KV cache: taken at once,
                    // or the request falls back to lazy.
                    let hit = self.pd_prefix(req.0)?;
                    self.count_pd_lookup(req.0);
                    let n = blocks.saturating_sub(hit) as usize;
                    let ev = match self.land_pool.alloc(n) {
                        Some(slots) => {
                            self.out.landings += 1;
                            self.out.pool.land.hold(self.now, slots.len() as u64);
                            let st = &mut self.st[req.0 as usize];
                            st.slots = slots.clone();
                            st.land_held = true;
                            st.host.landed = true;
                            DEvent::Landing { req, slots }
                        }
                        None => {
                            self.out.land_fallbacks += 1;
                            DEvent::LandFallback { req }
                        }
                    };
                    self.d.handle(ev, self.now).map_err(d_err)?;
                }
                DAction::ReleaseLanding { req, slots } => {
                    let st = &mut self.st[req.0 as usize];
                    if st.slots != slots {
                        return Err(ClockError::Protocol(format!(
                            "request {req:?}: landing slots released, not those given"
                        )));
                    }
                    st.slots.clear();
                    if std::mem::take(&mut st.land_held) {
                        self.out.pool.land.release(self.now, slots.len() as u64);
                    }
                    self.land_pool.release(&slots);
                }
                DAction::ReportFinished { req } => {
                    if self.st[req.0 as usize].slots.is_empty() {
                        self.to_report.push(req);
                        kick = true;
                    } else {
                        self.copy_landing(req.0)?;
                    }
                }
                DAction::ReleaseBlocks { req, .. } | DAction::ReportFailed { req, .. } => {
                    return Err(ClockError::Protocol(format!(
                        "request {req:?} failed on D (no failures are injected)"
                    )))
                }
                DAction::DisconnectPeer { .. } => {
                    return Err(ClockError::Protocol("D disconnected P".into()))
                }
            }
        }
        while let Some(rec) = self.d.poll_timeline() {
            self.d_records.push(rec);
        }
        if let Some(t) = self.d.poll_timeout() {
            if self.d_wake.is_none_or(|w| t < w) {
                self.d_wake = Some(t);
                self.at(t.max(self.now), Ev::DWake(t));
            }
        }
        if kick {
            self.kick_d();
        }
        Ok(())
    }
}
