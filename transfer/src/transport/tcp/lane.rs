//! The initiator side of a lane: frames, gathered sends from region memory (inside the
//! regions' gates), the sender thread and the reader thread (acks, read data, errors).

use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::reader::FrameReader;
use crate::batch::{BatchState, Pending};
use crate::error::Error;
use crate::mem::{send_parts, IoPart};
use crate::region::{GateGuard, RegionEntry};
use crate::transport::api::OnDead;
use crate::transport::marks::{mark_of, Marked, MARK_ANY};
use crate::types::RegionId;
use crate::wire::{self, FrameHeader, FrameKind, LaneSide, ProtocolError, FRAME_HEADER_LEN};

pub(super) struct OutFrame {
    pub hdr: [u8; FRAME_HEADER_LEN],
    /// Small bytes sent right after the header (notification tags).
    pub tail: Vec<u8>,
    pub payload: Option<(Arc<RegionEntry>, u64, usize)>,
}

pub(super) struct Job {
    pub batch: Arc<BatchState>,
    pub tracked: bool,
    pub frames: Vec<OutFrame>,
}

pub(super) struct LaneShared {
    pub s: TcpStream,
    pub wlock: Mutex<()>,
    pub queued: AtomicUsize,
    /// The sender's copy mark (set while a send reads region memory, under `wlock`).
    pub mark: Arc<AtomicU64>,
}

pub(super) struct Lane {
    pub sh: Arc<LaneShared>,
    pub tx: Sender<Job>,
}

/// What [`send_jobs`] does with one job.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sending {
    /// Frames as they are.
    Frames,
    /// Nothing (the batch failed and carries no notification: nobody waits for its bytes).
    Skip,
    /// Its payload frames replaced by [`poison_frame`]s (a local region of a batch with a
    /// notification was unregistered: the target must still account for every slice).
    Poison,
}

/// A write frame the target refuses (an id no region ever has, no payload), standing for a
/// tracked slice whose bytes cannot be sent: the target counts it as refused, so the batch's
/// notification is suppressed and its tracking ends.
fn poison_frame(hdr: &[u8; FRAME_HEADER_LEN]) -> io::Result<[u8; FRAME_HEADER_LEN]> {
    let mut h = FrameHeader::decode(hdr).map_err(|e| io::Error::other(e.to_string()))?;
    h.region = RegionId {
        index: u32::MAX,
        generation: 0,
    };
    h.offset = 0;
    h.len = 0;
    Ok(h.encode())
}

pub(super) fn send_jobs(sh: &LaneShared, jobs: &[Job]) -> io::Result<()> {
    // Payloads are read from region memory inside their regions' gates, entered under the
    // lane's write lock (so the lane's mark covers them) and held until the bytes are in the
    // socket; a job whose local region was unregistered meanwhile fails.
    let _g = sh.wlock.lock();
    let _m = Marked::new(&sh.mark, MARK_ANY);
    let mut guards: Vec<GateGuard<'_>> = Vec::new();
    let mut plan: Vec<Sending> = Vec::with_capacity(jobs.len());
    let mut poisoned: Vec<[u8; FRAME_HEADER_LEN]> = Vec::new();
    for j in jobs {
        if j.batch.is_done() && !j.tracked {
            // Failed or timed out: nobody waits for these bytes. (Slices of batches with a
            // notification still go, so the target can account for every slice.)
            plan.push(Sending::Skip);
            continue;
        }
        let start = guards.len();
        let mut last: Option<&Arc<RegionEntry>> = None;
        let mut refused = None;
        for f in &j.frames {
            if let Some((e, _, _)) = &f.payload {
                if last.is_some_and(|l| Arc::ptr_eq(l, e)) {
                    continue;
                }
                match e.enter() {
                    Ok(g) => guards.push(g),
                    Err(err) => {
                        refused = Some(err);
                        break;
                    }
                }
                last = Some(e);
            }
        }
        match refused {
            None => plan.push(Sending::Frames),
            Some(err) => {
                guards.truncate(start);
                j.batch.fail(err);
                if j.tracked {
                    for f in j.frames.iter().filter(|f| f.payload.is_some()) {
                        poisoned.push(poison_frame(&f.hdr)?);
                    }
                    plan.push(Sending::Poison);
                } else {
                    plan.push(Sending::Skip);
                }
            }
        }
    }
    let mut parts: Vec<IoPart<'_>> =
        Vec::with_capacity(jobs.iter().map(|j| j.frames.len() * 2).sum());
    let mut poison = poisoned.iter();
    for (j, how) in jobs.iter().zip(&plan) {
        for f in &j.frames {
            match (*how, &f.payload) {
                (Sending::Skip, _) => break,
                (Sending::Frames, Some((e, off, len))) => {
                    parts.push(IoPart::Bytes(&f.hdr));
                    parts.push(IoPart::Bytes(&f.tail));
                    parts.push(IoPart::Region(&e.mem, *off, *len));
                }
                (Sending::Poison, Some(_)) => {
                    if let Some(p) = poison.next() {
                        parts.push(IoPart::Bytes(p));
                    }
                }
                (_, None) => {
                    parts.push(IoPart::Bytes(&f.hdr));
                    parts.push(IoPart::Bytes(&f.tail));
                }
            }
        }
    }
    if parts.is_empty() {
        return Ok(());
    }
    send_parts(sh.s.as_fd(), &parts)
}

pub(super) fn sender_loop(sh: Arc<LaneShared>, rx: Receiver<Job>, on_dead: OnDead) {
    while let Ok(job) = rx.recv() {
        let mut jobs = vec![job];
        while jobs.len() < 64 {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        let r = send_jobs(&sh, &jobs);
        sh.queued.fetch_sub(jobs.len(), Ordering::AcqRel);
        if let Err(e) = r {
            on_dead(format!("lane send failed: {e}"));
            let _ = sh.s.shutdown(Shutdown::Both);
            return;
        }
    }
}

pub(super) fn reader_loop(
    s: TcpStream,
    pending: Arc<Pending>,
    on_dead: OnDead,
    mark: Arc<AtomicU64>,
) {
    let reason = match reader_loop_inner(s, &pending, &mark) {
        Ok(()) => "peer closed the lane".to_string(),
        Err(e) => format!("lane failed: {e}"),
    };
    on_dead(reason);
}

fn reader_loop_inner(s: TcpStream, pending: &Pending, mark: &AtomicU64) -> Result<(), Error> {
    let mut rd = FrameReader::new(s);
    loop {
        let hb = match rd.header()? {
            Some(h) => h,
            None => return Ok(()),
        };
        let h = FrameHeader::decode(&hb)?;
        match h.kind {
            FrameKind::Ack => {
                if let Some(b) = pending.get(h.batch) {
                    b.parts_done(h.aux.max(1));
                }
            }
            FrameKind::Error => {
                let payload = rd.payload_vec(h.len as usize)?;
                let err = wire::decode_error(&payload, true)?;
                if h.batch == 0 {
                    return Err(ProtocolError::LaneClosedByPeer {
                        reason: err.to_string(),
                    }
                    .into());
                }
                if let Some(b) = pending.get(h.batch) {
                    b.fail(err);
                }
            }
            FrameKind::ReadData => {
                let b = pending.get(h.batch);
                let slice = b.as_ref().and_then(|b| b.reads.get(h.aux as usize));
                match (b.as_ref(), slice) {
                    (Some(b), Some(sl)) => {
                        if sl.len != h.len {
                            return Err(ProtocolError::ReadSliceLength {
                                slice: h.aux,
                                len: h.len,
                                requested: sl.len,
                            }
                            .into());
                        }
                        // Lands inside the local region's gate (refused once unregistered).
                        match sl.local.enter() {
                            Ok(g) => {
                                let m = Marked::new(mark, mark_of(sl.local.id));
                                rd.payload_into(&sl.local.mem, sl.offset, sl.len as usize)?;
                                drop((m, g));
                                b.part_done();
                            }
                            Err(err) => {
                                rd.discard(h.len as usize)?;
                                b.fail(err);
                            }
                        }
                    }
                    _ => rd.discard(h.len as usize)?,
                }
            }
            k => {
                return Err(ProtocolError::WrongLane {
                    kind: k,
                    side: LaneSide::Initiator,
                }
                .into())
            }
        }
    }
}
