//! TCP transport: persistent multi-lane connections per peer, pipelined slices.
//!
//! Lanes carry requests in one direction only (the engine that opened them sends writes, read
//! requests and notifications; the accepting engine answers with acks, read data and errors), so
//! two engines writing to each other at once never wait on each other's socket buffers. Each
//! lane has a reader thread on both ends and a sender thread on the initiator end; small batches
//! are written inline by the submitting thread when the lane is idle (no thread hop).
//!
//! The target checks every write against its region table (exists, generation, access,
//! `offset + len` within the region, without overflow) before a byte lands; the payload is read
//! from the socket straight into region memory (only bytes already buffered with the header are
//! copied), and on the initiator the payload goes from region memory to the socket with one
//! gather `sendmsg` per group of frames.
//!
//! Every copy into or out of region memory (payload landing, read data sent or landed, payload
//! sent) runs inside the region's gate ([`RegionEntry::enter`]): once the region is
//! unregistered, later copies are refused with `Error::StaleRegion` and `unregister` waits for
//! the running ones, so no lane touches caller memory after it returned. Each lane thread also
//! marks the region it copies ([`CopyMarks`]), so a copy stuck on a stalled peer can be aborted.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::api::{EstablishCtx, OnDead, PeerTransport, Transport};
use super::marks::{mark_of, CopyMarks, Marked, MARK_ANY};
use super::target::TargetCtx;
use crate::batch::{BatchState, Pending, Posted, ReadSlice};
use crate::error::Error;
use crate::mem::{send_parts, IoPart, RegionMem};
use crate::region::{check_bounds, GateGuard, RegionEntry};
use crate::types::{BatchStats, Dir, RegionId, TransportKind};
use crate::wire::{
    self, CtrlMsg, FrameHeader, FrameKind, LaneSide, ProtocolError, Stage, FLAG_TRACKED,
    FRAME_HEADER_LEN, TRANSPORT_TCP,
};

/// Batches up to this many bytes are written by the submitting thread when a lane is idle.
const INLINE_MAX: u64 = 256 << 10;
/// Smallest slice when striping a batch over lanes.
const MIN_STRIPE: u64 = 64 << 10;
/// Receive buffer of a lane reader. Headers and small payloads arrive with one `read`; the
/// bytes of a large payload beyond what was buffered with its header go straight into region
/// memory, so at most this much of a payload is copied twice.
const READ_BUF: usize = 32 << 10;

// ---------------------------------------------------------------- frame reader

/// Buffered frame reader that reads large payloads straight into region memory.
pub(crate) struct FrameReader {
    s: TcpStream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl FrameReader {
    pub fn new(s: TcpStream) -> Self {
        FrameReader {
            s,
            buf: vec![0u8; READ_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Next header, `None` on a clean EOF at a frame boundary.
    pub fn header(&mut self) -> io::Result<Option<[u8; FRAME_HEADER_LEN]>> {
        while self.buffered() < FRAME_HEADER_LEN {
            if self.buf.len() - self.end < FRAME_HEADER_LEN {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let n = (&self.s).read(&mut self.buf[self.end..])?;
            if n == 0 {
                if self.buffered() == 0 {
                    return Ok(None);
                }
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed mid-header",
                ));
            }
            self.end += n;
        }
        let mut h = [0u8; FRAME_HEADER_LEN];
        h.copy_from_slice(&self.buf[self.start..self.start + FRAME_HEADER_LEN]);
        self.start += FRAME_HEADER_LEN;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok(Some(h))
    }

    /// Reads a `len`-byte payload into `mem` at `off` (bounds checked by `RegionMem`).
    pub fn payload_into(&mut self, mem: &RegionMem, off: u64, len: usize) -> io::Result<()> {
        let take = len.min(self.buffered());
        if take > 0 {
            mem.copy_in(off, &self.buf[self.start..self.start + take])?;
            self.start += take;
        }
        if take < len {
            mem.recv_into(self.s.as_fd(), off + take as u64, len - take)?;
        }
        Ok(())
    }

    /// Reads a payload into a vector (small, bounded payloads only).
    pub fn payload_vec(&mut self, len: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        let take = len.min(self.buffered());
        v[..take].copy_from_slice(&self.buf[self.start..self.start + take]);
        self.start += take;
        if take < len {
            (&self.s).read_exact(&mut v[take..])?;
        }
        Ok(v)
    }

    /// Skips a payload without landing it anywhere.
    pub fn discard(&mut self, mut len: usize) -> io::Result<()> {
        let take = len.min(self.buffered());
        self.start += take;
        len -= take;
        let mut scratch = [0u8; 8192];
        while len > 0 {
            let n = len.min(scratch.len());
            (&self.s).read_exact(&mut scratch[..n])?;
            len -= n;
        }
        Ok(())
    }
}

fn error_frame(batch: u64, e: &Error) -> Vec<u8> {
    let payload = wire::encode_error(e);
    let mut v = FrameHeader::simple(FrameKind::Error, batch, payload.len() as u32, 0)
        .encode()
        .to_vec();
    v.extend_from_slice(&payload);
    v
}

// ---------------------------------------------------------------- target side

/// Serves one accepted lane until it closes: lands writes, answers reads, tracks notifications.
pub(crate) fn serve_lane(s: TcpStream, ctx: TargetCtx) {
    let peer = ctx.peer;
    match serve_lane_inner(&s, &ctx) {
        Ok(()) => tracing::debug!(?peer, "lane closed"),
        Err(e) => tracing::warn!(?peer, error = %e, "lane closed on error"),
    }
    let _ = s.shutdown(Shutdown::Both);
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
                    check_bounds(h.region, h.offset, len, e.mem.len() as u64).map(|_| e)
                });
                // The payload lands inside the region's gate (refused once unregistered).
                let refused = match checked {
                    Ok(e) => match e.enter() {
                        Ok(g) => {
                            let m = Marked::new(&mark, mark_of(e.id));
                            rd.payload_into(&e.mem, h.offset, h.len as usize)?;
                            drop((m, g));
                            None
                        }
                        Err(err) => Some(err),
                    },
                    Err(err) => Some(err),
                };
                match refused {
                    None => {
                        if h.flags & FLAG_TRACKED != 0 {
                            ctx.tracker.landed(ctx, h.batch)?;
                        }
                        ack(&mut out, &mut last_ack, h.batch);
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
                    check_bounds(h.region, h.offset, len, e.mem.len() as u64).map(|_| e)
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
                            drop((m, g));
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

// ---------------------------------------------------------------- initiator side

struct OutFrame {
    hdr: [u8; FRAME_HEADER_LEN],
    /// Small bytes sent right after the header (notification tags).
    tail: Vec<u8>,
    payload: Option<(Arc<RegionEntry>, u64, usize)>,
}

struct Job {
    batch: Arc<BatchState>,
    tracked: bool,
    frames: Vec<OutFrame>,
}

struct LaneShared {
    s: TcpStream,
    wlock: Mutex<()>,
    queued: AtomicUsize,
    /// The sender's copy mark (set while a send reads region memory, under `wlock`).
    mark: Arc<AtomicU64>,
}

pub(crate) struct Lane {
    sh: Arc<LaneShared>,
    tx: Sender<Job>,
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

fn send_jobs(sh: &LaneShared, jobs: &[Job]) -> io::Result<()> {
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

fn sender_loop(sh: Arc<LaneShared>, rx: Receiver<Job>, on_dead: OnDead) {
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

fn reader_loop(s: TcpStream, pending: Arc<Pending>, on_dead: OnDead, mark: Arc<AtomicU64>) {
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

/// How to open lanes to a peer.
pub(crate) struct LaneTarget {
    pub addr: SocketAddr,
    pub token: [u8; 16],
    pub lanes: usize,
    pub timeout: Duration,
}

/// Per-peer TCP state: the lanes this engine opened to the peer (opened on first use for
/// inbound peers, at connect for outbound ones).
pub(crate) struct TcpPeer {
    target: LaneTarget,
    slice_size: u64,
    lanes: Mutex<Option<Arc<Vec<Lane>>>>,
    rr: AtomicUsize,
    closed: AtomicBool,
    pending: Arc<Pending>,
    on_dead: OnDead,
    marks: Arc<CopyMarks>,
}

impl TcpPeer {
    pub fn new(
        target: LaneTarget,
        slice_size: usize,
        pending: Arc<Pending>,
        on_dead: OnDead,
        marks: Arc<CopyMarks>,
    ) -> TcpPeer {
        TcpPeer {
            target,
            slice_size: slice_size.clamp(4096, wire::MAX_SLICE as usize) as u64,
            lanes: Mutex::new(None),
            rr: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            pending,
            on_dead,
            marks,
        }
    }

    /// Opens the lanes now (if not yet open).
    pub fn ensure_lanes(&self) -> Result<Arc<Vec<Lane>>, Error> {
        let mut g = self.lanes.lock();
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::PeerDead(
                self.pending
                    .closed_reason()
                    .unwrap_or_else(|| "closed".into()),
            ));
        }
        if let Some(l) = g.as_ref() {
            return Ok(l.clone());
        }
        let mut lanes = Vec::with_capacity(self.target.lanes);
        for i in 0..self.target.lanes.max(1) {
            let s = open_lane(&self.target, i as u16)?;
            let sh = Arc::new(LaneShared {
                s: s.try_clone()?,
                wlock: Mutex::new(()),
                queued: AtomicUsize::new(0),
                mark: self.marks.lane(),
            });
            let (tx, rx) = crossbeam_channel::unbounded();
            let (sh2, od) = (sh.clone(), self.on_dead.clone());
            std::thread::Builder::new()
                .name(format!("kvwire-tx{i}"))
                .spawn(move || sender_loop(sh2, rx, od))?;
            let (p, od, m) = (
                self.pending.clone(),
                self.on_dead.clone(),
                self.marks.lane(),
            );
            std::thread::Builder::new()
                .name(format!("kvwire-rx{i}"))
                .spawn(move || reader_loop(s, p, od, m))?;
            lanes.push(Lane { sh, tx });
        }
        let l = Arc::new(lanes);
        *g = Some(l.clone());
        Ok(l)
    }

    fn dispatch(
        &self,
        lanes: &[Lane],
        per_lane: Vec<Vec<OutFrame>>,
        batch: &Arc<BatchState>,
        tracked: bool,
        inline_ok: bool,
    ) -> Result<(), Error> {
        for (i, frames) in per_lane.into_iter().enumerate() {
            if frames.is_empty() {
                continue;
            }
            let lane = &lanes[i];
            let job = Job {
                batch: batch.clone(),
                tracked,
                frames,
            };
            if inline_ok && lane.sh.queued.load(Ordering::Acquire) == 0 {
                if let Some(g) = lane.sh.wlock.try_lock() {
                    drop(g);
                    if let Err(e) = send_jobs(&lane.sh, std::slice::from_ref(&job)) {
                        let reason = format!("lane send failed: {e}");
                        (self.on_dead)(reason.clone());
                        return Err(Error::PeerDead(reason));
                    }
                    continue;
                }
            }
            lane.sh.queued.fetch_add(1, Ordering::AcqRel);
            if lane.tx.send(job).is_err() {
                lane.sh.queued.fetch_sub(1, Ordering::AcqRel);
                return Err(Error::PeerDead("lane sender stopped".into()));
            }
        }
        Ok(())
    }

    fn stripe(&self, total: u64, nlanes: usize) -> u64 {
        if total <= self.slice_size * nlanes as u64 {
            let per = total.div_ceil(nlanes as u64).max(MIN_STRIPE);
            per.min(self.slice_size)
        } else {
            self.slice_size
        }
    }
}

fn open_lane(t: &LaneTarget, lane: u16) -> Result<TcpStream, Error> {
    let mut s = TcpStream::connect_timeout(&t.addr, t.timeout)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(t.timeout))?;
    s.set_write_timeout(Some(t.timeout))?;
    s.write_all(
        &CtrlMsg::LaneJoin {
            token: t.token,
            lane,
        }
        .encode(),
    )?;
    match wire::read_ctrl(&mut s)? {
        CtrlMsg::LaneOk => {}
        CtrlMsg::Reject { error } => return Err(wire::decode_error(&error, true)?),
        m => {
            return Err(ProtocolError::Unexpected {
                stage: Stage::LaneJoinAnswer,
                got: Some(Box::new(m)),
            }
            .into())
        }
    }
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    Ok(s)
}

impl PeerTransport for TcpPeer {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn post(&self, b: Posted, pending: &Arc<Pending>) -> Result<Arc<BatchState>, Error> {
        let lanes = self.ensure_lanes()?;
        let n = lanes.len();
        let stripe = self.stripe(b.bytes, n);
        let small = b.bytes <= INLINE_MAX;
        let first = self.rr.fetch_add(1, Ordering::Relaxed) % n;
        let mut per_lane: Vec<Vec<OutFrame>> = (0..n).map(|_| Vec::new()).collect();
        let mut reads: Vec<ReadSlice> = Vec::new();
        let mut slices = 0usize;
        let mut lane_i = first;
        let flags = if b.notify.is_some() { FLAG_TRACKED } else { 0 };
        for x in &b.xfers {
            let mut done = 0u64;
            while done < x.len {
                let len = (x.len - done).min(stripe);
                let hdr = FrameHeader {
                    kind: if b.dir == Dir::Write {
                        FrameKind::Write
                    } else {
                        FrameKind::ReadReq
                    },
                    flags,
                    batch: b.id,
                    region: x.remote.id,
                    offset: x.remote_offset + done,
                    len: len as u32,
                    aux: slices as u32,
                };
                let payload = match b.dir {
                    Dir::Write => Some((x.local.clone(), x.local_offset + done, len as usize)),
                    Dir::Read => {
                        reads.push(ReadSlice {
                            local: x.local.clone(),
                            offset: x.local_offset + done,
                            len: len as u32,
                        });
                        None
                    }
                };
                per_lane[lane_i].push(OutFrame {
                    hdr: hdr.encode(),
                    tail: Vec::new(),
                    payload,
                });
                slices += 1;
                done += len;
                if !small {
                    lane_i = (lane_i + 1) % n;
                }
            }
        }
        let mut parts = slices as u32;
        if let Some(tag) = &b.notify {
            // The notification follows the slices on the last lane used; the target counts the
            // slices landed on every lane before delivering it.
            let last = if slices == 0 || small {
                first
            } else {
                (lane_i + n - 1) % n
            };
            let hdr = FrameHeader::simple(FrameKind::Notify, b.id, tag.len() as u32, slices as u32)
                .encode();
            per_lane[last].push(OutFrame {
                hdr,
                tail: tag.clone(),
                payload: None,
            });
            parts += 1;
        }
        let stats = BatchStats {
            bytes: b.bytes,
            ops: b.ops,
            writes: b.xfers.len(),
            slices,
            transport: TransportKind::Tcp,
        };
        let st = BatchState::new(b.id, parts, stats, b.deadline, reads, &b.timer).posted_as(&b);
        pending.insert(&st)?;
        if parts == 0 {
            st.complete_now();
            return Ok(st);
        }
        self.dispatch(&lanes, per_lane, &st, flags != 0, small)?;
        Ok(st)
    }

    fn warm_up(&self) -> Result<(), Error> {
        self.ensure_lanes().map(|_| ())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if let Some(l) = self.lanes.lock().take() {
            for lane in l.iter() {
                let _ = lane.sh.s.shutdown(Shutdown::Both);
            }
        }
    }
}

/// The TCP transport (always available).
pub(crate) struct TcpTransport;

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn bit(&self) -> u8 {
        TRANSPORT_TCP
    }
    fn establish(&self, ctx: EstablishCtx<'_>) -> Result<Arc<dyn PeerTransport>, Error> {
        Ok(Arc::new(TcpPeer::new(
            LaneTarget {
                addr: ctx.lane_addr,
                token: ctx.remote_token,
                lanes: ctx.cfg.lanes,
                timeout: ctx.cfg.connect_timeout,
            },
            ctx.cfg.slice_size,
            ctx.pending,
            ctx.on_dead,
            ctx.marks,
        )))
    }
}
