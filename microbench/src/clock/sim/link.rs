//! Control messages and transfers on the virtual clock: messages over a simulated link (fixed
//! latency, FIFO per direction), layers (or runs of a layer's blocks) moved through the real
//! engines at once, their virtual duration from the measured (or frozen) link speed,
//! serialized on the one P→D link.

use std::sync::Arc;

use kvwire_connector::{Message, Nanos};

use super::p_engine::dst_of;
use super::{Cell, Ev};
use crate::clock::{ClockError, LinkSpeed};

impl Cell<'_> {
    /// A control message over a simulated link: fixed latency, FIFO per direction.
    pub(super) fn send(&mut self, to_d: bool, msg: &Message) -> Result<(), ClockError> {
        let bytes = msg
            .encode()
            .map_err(|e| ClockError::Protocol(format!("encoding {msg:?}: {e}")))?;
        let last = if to_d {
            &mut self.last_to_d
        } else {
            &mut self.last_to_p
        };
        let at = (self.now + self.cfg.msg_latency).max(*last);
        *last = at;
        let ev = if to_d {
            Ev::MsgToD(bytes)
        } else {
            Ev::MsgToP(bytes)
        };
        self.at(at, ev);
        Ok(())
    }

    /// Moves a whole layer through the real engines now (the core's `Transfer`); it lands
    /// after its virtual duration and settles on P one control latency later.
    pub(super) fn transfer(
        &mut self,
        req: u64,
        layer: u16,
        src: Arc<[u32]>,
        dst: Arc<[u32]>,
        landing: bool,
    ) -> Result<(), ClockError> {
        let n = self.st[req as usize].crcs.blocks();
        let first = n.saturating_sub(src.len());
        let (end, model_bytes) = self.post(req, layer, &src, &dst, landing, first)?;
        self.at(end, Ev::Land(req, layer, model_bytes));
        self.at(
            end + self.cfg.msg_latency,
            Ev::Settle(req, layer, model_bytes),
        );
        Ok(())
    }

    /// Streaming: moves request blocks `a..b` of `layer` to D's destination of them.
    pub(super) fn transfer_piece(
        &mut self,
        req: u64,
        layer: u16,
        a: u32,
        b: u32,
    ) -> Result<(), ClockError> {
        let st = &self.st[req as usize];
        let Some(dest) = st.dest.clone() else {
            return Err(ClockError::Protocol(format!(
                "request {req}: a chunk posted before D's destination"
            )));
        };
        let src: Arc<[u32]> = Arc::from(&st.p_blocks[a as usize..b as usize]);
        let dst = dst_of(&dest, a, b);
        let (end, model_bytes) = self.post(req, layer, &src, &dst, dest.landing, a as usize)?;
        self.at(
            end,
            Ev::Piece {
                req,
                layer,
                blocks: b - a,
                bytes: model_bytes,
            },
        );
        Ok(())
    }

    /// Moves `src → dst` of `layer` (request blocks from `first` on) through the engines,
    /// checked against the pattern; returns when it lands on the virtual clock and its
    /// modelled bytes.
    fn post(
        &mut self,
        req: u64,
        layer: u16,
        src: &[u32],
        dst: &[u32],
        landing: bool,
        first: usize,
    ) -> Result<(Nanos, u64), ClockError> {
        let crc = self.st[req as usize]
            .crcs
            .range(layer, first, first + src.len())
            .ok_or_else(|| ClockError::Protocol(format!("no pattern for {req}/{layer}")))?;
        let t = self.dp.transfer(req, layer, src, dst, landing, crc)?;
        self.out.batches += 1;
        self.out.writes += t.writes as u64;
        self.out.ops += src.len() as u64;
        self.out.transfer_wall += t.wall;
        self.out.wire_bytes += t.bytes;
        // The fixed cost of a batch is not stretched; the part that grows with bytes is, at
        // the speed measured on this layer (raw) or the median over recent layers.
        let fixed = self.fixed.min(t.wall);
        let variable = t.wall - fixed;
        // Frozen: nothing measured on this layer may reach the virtual clock (a layer faster
        // than the probed fixed cost would otherwise shorten it), so every run of the same
        // workload gets the same timeline whatever the host's load.
        let fixed = match self.cfg.link_speed {
            LinkSpeed::Frozen => self.fixed,
            LinkSpeed::Raw | LinkSpeed::Window => fixed,
        };
        let typical = self.dp.typical_ns_per_byte(variable, t.bytes);
        let var_ns = match self.cfg.link_speed {
            LinkSpeed::Raw => variable.as_nanos() as f64,
            LinkSpeed::Window | LinkSpeed::Frozen => typical * t.bytes as f64,
        };
        self.out.layer_wall_us.push(t.wall.as_secs_f64() * 1e6);
        let virt = fixed.as_nanos() as Nanos + (var_ns * self.cfg.transfer_scale) as Nanos;
        let start = self.now.max(self.link_free);
        let end = start + virt.max(1);
        self.link_free = end;
        let model_bytes = (t.bytes as f64 * self.cfg.transfer_scale) as u64;
        let last_layer = layer + 1 == self.cfg.layers;
        let h = &mut self.st[req as usize].host;
        h.wire_bytes += t.bytes;
        h.batches += 1;
        if layer == 0 && h.first_layer0_landed.is_none() {
            h.first_layer0_landed = Some(end);
        }
        if last_layer {
            h.last_batch_ns = end - start;
        }
        Ok((end, model_bytes))
    }
}
