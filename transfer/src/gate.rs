//! Admission of accepted connections that have not proved anything yet ([`ConnGate`]: the
//! engine's handshakes and lane joins, the metrics endpoint's requests), and the per-address
//! throttle of failed proofs ([`AuthThrottle`]).
//!
//! A gate holds at most `max_total` connections, at most `max_per_ip` of one source address.
//! A new connection beyond either bound evicts the one that made the least progress (its
//! stage), from the address with the most connections, oldest first; only when every admitted
//! connection is past the point where it can be evicted is the new one refused. The evicted
//! (or refused) connection is answered and closed by the caller, never left waiting.

use std::cmp::Reverse;
use std::collections::HashMap;
use std::net::{IpAddr, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::limits::Resource;

/// Stage: accepted, nothing read yet.
pub(crate) const STAGE_OPENED: u8 = 0;
/// Stage: the first message was read (a `Hello` or a `LaneJoin`).
pub(crate) const STAGE_FIRST: u8 = 1;
/// Stage: our challenge went out; the peer's proof is awaited.
pub(crate) const STAGE_AWAITING_PROOF: u8 = 2;
/// Stage: the peer proved itself (or the request is being answered); never evicted.
pub(crate) const STAGE_PROTECTED: u8 = 3;

struct SlotInfo {
    ip: IpAddr,
    stage: Arc<AtomicU8>,
    /// A clone of the connection, to answer and close it when evicted.
    evict: TcpStream,
}

#[derive(Default)]
struct GateInner {
    slots: HashMap<u64, SlotInfo>,
    per_ip: HashMap<IpAddr, usize>,
    next: u64,
}

/// Counters of a gate (exported as metrics).
#[derive(Default)]
pub(crate) struct GateStats {
    /// Connections admitted.
    pub admitted: AtomicU64,
    /// Connections evicted to admit newer ones.
    pub evicted: AtomicU64,
    /// Connections refused: the gate was full of connections that cannot be evicted.
    pub refused_total: AtomicU64,
    /// Connections refused: their address had its bound of connections that cannot be evicted.
    pub refused_per_ip: AtomicU64,
    /// Admitted connections that ran past their deadline.
    pub timed_out: AtomicU64,
}

/// Bounded admission of unauthenticated connections (see the module docs).
pub(crate) struct ConnGate {
    max_total: usize,
    max_per_ip: usize,
    inner: Mutex<GateInner>,
    pub stats: GateStats,
}

/// An admitted connection's place in its gate; freed when dropped (or when evicted).
pub(crate) struct Slot {
    gate: Arc<ConnGate>,
    id: u64,
    stage: Arc<AtomicU8>,
}

impl Slot {
    /// Records the connection's progress (see the `STAGE_*` values).
    pub fn set(&self, stage: u8) {
        self.stage.store(stage, Ordering::Release);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut g = self.gate.inner.lock();
        if let Some(info) = g.slots.remove(&self.id) {
            dec(&mut g.per_ip, info.ip);
        }
    }
}

fn dec(per_ip: &mut HashMap<IpAddr, usize>, ip: IpAddr) {
    if let Some(n) = per_ip.get_mut(&ip) {
        *n -= 1;
        if *n == 0 {
            per_ip.remove(&ip);
        }
    }
}

/// What [`ConnGate::admit`] decided.
pub(crate) struct Admitted {
    /// The new connection's slot.
    pub slot: Slot,
    /// A connection evicted to make room, and the bound that made room necessary (to be
    /// answered and closed by the caller).
    pub evicted: Option<(TcpStream, Resource)>,
}

impl ConnGate {
    pub fn new(max_total: usize, max_per_ip: usize) -> Arc<ConnGate> {
        Arc::new(ConnGate {
            max_total: max_total.max(1),
            max_per_ip: max_per_ip.clamp(1, max_total.max(1)),
            inner: Mutex::new(GateInner::default()),
            stats: GateStats::default(),
        })
    }

    /// Connections admitted now.
    pub fn in_progress(&self) -> usize {
        self.inner.lock().slots.len()
    }

    /// Admits connection `s` from `ip`, evicting another one if a bound is reached; `Err`
    /// with the bound when nothing can be evicted.
    pub fn admit(self: &Arc<Self>, s: &TcpStream, ip: IpAddr) -> Result<Admitted, Resource> {
        let evict_clone = s.try_clone().map_err(|_| Resource::Handshakes)?;
        let mut g = self.inner.lock();
        let mut evicted = None;
        if g.per_ip.get(&ip).copied().unwrap_or(0) >= self.max_per_ip {
            match Self::victim(&g, Some(ip)) {
                Some(v) => {
                    evicted = Some((Self::remove(&mut g, v), Resource::HandshakesPerAddress))
                }
                None => {
                    self.stats.refused_per_ip.fetch_add(1, Ordering::Relaxed);
                    return Err(Resource::HandshakesPerAddress);
                }
            }
        } else if g.slots.len() >= self.max_total {
            match Self::victim(&g, None) {
                Some(v) => evicted = Some((Self::remove(&mut g, v), Resource::Handshakes)),
                None => {
                    self.stats.refused_total.fetch_add(1, Ordering::Relaxed);
                    return Err(Resource::Handshakes);
                }
            }
        }
        if evicted.is_some() {
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        }
        let id = g.next;
        g.next += 1;
        let stage = Arc::new(AtomicU8::new(STAGE_OPENED));
        g.slots.insert(
            id,
            SlotInfo {
                ip,
                stage: stage.clone(),
                evict: evict_clone,
            },
        );
        *g.per_ip.entry(ip).or_insert(0) += 1;
        self.stats.admitted.fetch_add(1, Ordering::Relaxed);
        Ok(Admitted {
            slot: Slot {
                gate: self.clone(),
                id,
                stage,
            },
            evicted,
        })
    }

    /// The connection to evict: least progress first, from the address holding the most
    /// connections, oldest first (only from `ip` when given).
    fn victim(g: &GateInner, ip: Option<IpAddr>) -> Option<u64> {
        g.slots
            .iter()
            .filter(|(_, s)| ip.is_none_or(|ip| s.ip == ip))
            .map(|(id, s)| (s.stage.load(Ordering::Acquire), s, *id))
            .filter(|(stage, _, _)| *stage < STAGE_PROTECTED)
            .min_by_key(|(stage, s, id)| {
                (
                    *stage,
                    Reverse(g.per_ip.get(&s.ip).copied().unwrap_or(0)),
                    *id,
                )
            })
            .map(|(_, _, id)| id)
    }

    fn remove(g: &mut GateInner, id: u64) -> TcpStream {
        let info = g.slots.remove(&id).unwrap_or_else(|| unreachable!());
        dec(&mut g.per_ip, info.ip);
        info.evict
    }
}

/// Failed proofs per source address and minute (see `Limits::auth_failures_per_ip`), for at
/// most [`THROTTLE_ADDRESSES`] addresses (the oldest windows are forgotten first).
pub(crate) struct AuthThrottle {
    limit: u32,
    m: Mutex<HashMap<IpAddr, (u32, Instant)>>,
}

/// The throttle's window.
const WINDOW: Duration = Duration::from_secs(60);
/// Addresses the throttle remembers.
const THROTTLE_ADDRESSES: usize = 4096;

impl AuthThrottle {
    pub fn new(limit: u32) -> AuthThrottle {
        AuthThrottle {
            limit,
            m: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `ip` has used up its failures for this window.
    pub fn blocked(&self, ip: IpAddr) -> bool {
        let m = self.m.lock();
        m.get(&ip)
            .is_some_and(|(n, t)| *n >= self.limit && t.elapsed() < WINDOW)
    }

    /// Counts a failed proof from `ip`.
    pub fn failed(&self, ip: IpAddr) {
        let mut m = self.m.lock();
        let now = Instant::now();
        if !m.contains_key(&ip) && m.len() >= THROTTLE_ADDRESSES {
            m.retain(|_, (_, t)| now.duration_since(*t) < WINDOW);
            if m.len() >= THROTTLE_ADDRESSES {
                if let Some(old) = m.iter().min_by_key(|(_, (_, t))| *t).map(|(ip, _)| *ip) {
                    m.remove(&old);
                }
            }
        }
        let e = m.entry(ip).or_insert((0, now));
        if now.duration_since(e.1) >= WINDOW {
            *e = (0, now);
        }
        e.0 = e.0.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener};

    fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        (c, s)
    }

    #[test]
    fn evicts_least_progress_and_refuses_when_all_are_protected() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let g = ConnGate::new(2, 2);
        let a = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        let b = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));
        let (_c1, s1) = pair(&l);
        let (_c2, s2) = pair(&l);
        let (_c3, s3) = pair(&l);
        let first = g.admit(&s1, a).expect("admit");
        let second = g.admit(&s2, a).expect("admit");
        first.slot.set(STAGE_AWAITING_PROOF);
        // Full: the second (less progress) goes.
        let third = g.admit(&s3, b).expect("admit");
        assert!(third.evicted.is_some());
        assert_eq!(g.in_progress(), 2);
        drop(second); // its slot was taken already: nothing changes
        assert_eq!(g.in_progress(), 2);
        first.slot.set(STAGE_PROTECTED);
        third.slot.set(STAGE_PROTECTED);
        let (_c4, s4) = pair(&l);
        assert_eq!(g.admit(&s4, b).err(), Some(Resource::Handshakes));
        drop(first);
        assert_eq!(g.in_progress(), 1);
        assert!(g.admit(&s4, a).is_ok());
    }

    #[test]
    fn per_address_bound_evicts_only_that_address() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let g = ConnGate::new(8, 1);
        let a = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        let b = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));
        let (_c1, s1) = pair(&l);
        let (_c2, s2) = pair(&l);
        let (_c3, s3) = pair(&l);
        let _x = g.admit(&s1, b).expect("admit");
        let y = g.admit(&s2, a).expect("admit");
        y.slot.set(STAGE_PROTECTED);
        assert_eq!(g.admit(&s3, a).err(), Some(Resource::HandshakesPerAddress));
        drop(y);
        let z = g.admit(&s3, a).expect("admit");
        assert!(z.evicted.is_none());
    }

    #[test]
    fn throttle_counts_per_address() {
        let t = AuthThrottle::new(2);
        let a = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        assert!(!t.blocked(a));
        t.failed(a);
        t.failed(a);
        assert!(t.blocked(a));
        assert!(!t.blocked(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    }
}
