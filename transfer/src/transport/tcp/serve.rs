//! The target side of a lane: every write checked against the region table before a byte
//! lands, reads answered from region memory, notifications tracked, acks merged.

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;

use super::reader::FrameReader;
use crate::error::Error;
use crate::mem::{send_parts, IoPart};
use crate::region::{check_bounds, RegionEntry};
use crate::transport::marks::{mark_of, Marked};
use crate::transport::target::TargetCtx;
use crate::wire::{
    self, FrameHeader, FrameKind, LaneSide, ProtocolError, FLAG_TRACKED, FRAME_HEADER_LEN,
};

fn error_frame(batch: u64, e: &Error) -> Vec<u8> {
    let payload = wire::encode_error(e);
    let mut v = FrameHeader::simple(FrameKind::Error, batch, payload.len() as u32, 0)
        .encode()
        .to_vec();
    v.extend_from_slice(&payload);
    v
}

/// Serves one accepted lane until it closes: lands writes, answers reads, tracks notifications.
pub(crate) fn serve_lane(s: TcpStream, ctx: TargetCtx) {
    let peer = ctx.peer;
    match serve_lane_inner(&s, &ctx) {
        Ok(()) => tracing::debug!(?peer, "lane closed"),
        Err(e) => tracing::debug!(?peer, error = %e, "lane closed on error"),
    }
    let _ = s.shutdown(Shutdown::Both);
}

/// Enters the peer's gate for one copy; once the peer is closed or fenced the lane ends here.
fn peer_gate(ctx: &TargetCtx) -> Result<crate::region::GateGuard<'_>, Error> {
    ctx.gate
        .enter()
        .ok_or_else(|| Error::PeerDead("peer closed".into()))
}

fn serve_lane_inner(s: &TcpStream, ctx: &TargetCtx) -> Result<(), Error> {
    let mut rd = FrameReader::new(s.try_clone()?);
    let mark = ctx.marks.lane();
    let mut w = s;
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    // Position in `out` of the last ack frame and its batch: consecutive acks of one batch are
    // merged into one frame whose `aux` counts them.
    let mut last_ack: Option<(u64, usize)> = None;
    let ack = |out: &mut Vec<u8>, last: &mut Option<(u64, usize)>, batch: u64| {
        if let Some((b, pos)) = *last {
            if b == batch && pos + FRAME_HEADER_LEN == out.len() {
                FrameHeader::bump_ack(&mut out[pos..]);
                return;
            }
        }
        *last = Some((batch, out.len()));
        out.extend_from_slice(&FrameHeader::simple(FrameKind::Ack, batch, 0, 1).encode());
    };
    loop {
        // Acks are gathered while more frames are already buffered, and flushed before blocking.
        if rd.buffered() < FRAME_HEADER_LEN && !out.is_empty() {
            w.write_all(&out)?;
            out.clear();
            last_ack = None;
        }
        let hb = match rd.header()? {
            Some(h) => h,
            None => return Ok(()),
        };
        let h = match FrameHeader::decode(&hb) {
            Ok(h) => h,
            Err(e) => {
                out.extend_from_slice(&error_frame(0, &e));
                let _ = w.write_all(&out);
                return Err(e);
            }
        };
        match h.kind {
            FrameKind::Write => {
                let len = h.len as u64;
                let checked = ctx.regions.get_remote(h.region, true).and_then(|e| {
                    check_bounds(h.region, h.offset, len, e.mem.len() as u64)?;
                    host_memory(e)
                });
                // The payload lands inside the region's gate (refused once unregistered).
                let refused = match checked {
                    Ok(e) => match e.enter() {
                        Ok(g) => {
                            let pg = peer_gate(ctx)?;
                            let m = Marked::new(&mark, mark_of(e.id));
                            rd.payload_into(&e.mem, h.offset, h.len as usize)?;
                            drop((m, g, pg));
                            None
                        }
                        Err(err) => Some(err),
                    },
                    Err(err) => Some(err),
                };
                match refused {
                    None => {
                        let tracked = if h.flags & FLAG_TRACKED != 0 {
                            ctx.tracker.landed(ctx, h.batch)
                        } else {
                            Ok(())
                        };
                        match tracked {
                            Ok(()) => ack(&mut out, &mut last_ack, h.batch),
                            Err(err) => out.extend_from_slice(&error_frame(h.batch, &err)),
                        }
                    }
                    Some(err) => {
                        tracing::debug!(batch = h.batch, error = %err, "refused write slice");
                        rd.discard(h.len as usize)?;
                        if h.flags & FLAG_TRACKED != 0 {
                            ctx.tracker.refused(ctx, h.batch);
                        }
                        out.extend_from_slice(&error_frame(h.batch, &err));
                    }
                }
            }
            FrameKind::ReadReq => {
                let len = h.len as u64;
                let checked = ctx.regions.get_remote(h.region, false).and_then(|e| {
                    check_bounds(h.region, h.offset, len, e.mem.len() as u64)?;
                    host_memory(e)
                });
                if !out.is_empty() {
                    w.write_all(&out)?;
                    out.clear();
                    last_ack = None;
                }
                // The data is sent from region memory inside the region's gate.
                let refused = match checked {
                    Ok(e) => match e.enter() {
                        Ok(g) => {
                            let pg = peer_gate(ctx)?;
                            let m = Marked::new(&mark, mark_of(e.id));
                            let hdr =
                                FrameHeader::simple(FrameKind::ReadData, h.batch, h.len, h.aux)
                                    .encode();
                            send_parts(
                                s.as_fd(),
                                &[
                                    IoPart::Bytes(&hdr),
                                    IoPart::Region(&e.mem, h.offset, h.len as usize),
                                ],
                            )?;
                            drop((m, g, pg));
                            None
                        }
                        Err(err) => Some(err),
                    },
                    Err(err) => Some(err),
                };
                if let Some(err) = refused {
                    out.extend_from_slice(&error_frame(h.batch, &err));
                }
            }
            FrameKind::Notify => {
                let tag = rd.payload_vec(h.len as usize)?;
                match ctx.tracker.notify(ctx, h.batch, h.aux, tag) {
                    Ok(()) => ack(&mut out, &mut last_ack, h.batch),
                    Err(err) => out.extend_from_slice(&error_frame(h.batch, &err)),
                }
            }
            FrameKind::Ack | FrameKind::ReadData | FrameKind::Error => {
                let e = Error::from(ProtocolError::WrongLane {
                    kind: h.kind,
                    side: LaneSide::Target,
                });
                out.extend_from_slice(&error_frame(0, &e));
                let _ = w.write_all(&out);
                return Err(e);
            }
        }
    }
}

/// A region tcp may copy into or out of: not device memory (refused like a bad range, before a
/// byte lands, with the lane kept).
fn host_memory(e: Arc<RegionEntry>) -> Result<Arc<RegionEntry>, Error> {
    if e.mem.device_ipc().is_some() {
        return Err(Error::Unsupported(format!(
            "region {:?} is device memory: tcp cannot reach it",
            e.id
        )));
    }
    Ok(e)
}
