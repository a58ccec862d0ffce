//! Hostile clients against a target's handshake: slots held by trickling sockets (finding 1),
//! an oracle before the client proved anything (6), bodies read before authentication (7),
//! host details before authentication (8). In each, a legitimate initiator completes a
//! verified transfer while the attack is in progress, and the target's resources stay within
//! bounds computed from its configuration. Timeouts are long: nothing passes by expiring.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use common::hostile::{
    config, connect_from, count_warnings, fd_bound, fd_count, good_transfer, limits, serial,
    task_count, thread_bound, wait_until, warnings, Peak, SECRET,
};
use common::raw_peer;
use kvwire_transfer::auth::KeyShare;
use kvwire_transfer::wire::{self, CtrlMsg};
use kvwire_transfer::{Access, Engine, Error, Limits, Resource, TransportKind};

/// What a refused socket reads: the error of its `Reject`, then the close (`None`: a close
/// without a `Reject`). Panics when it reads anything else.
fn refusal(s: &mut TcpStream) -> Option<Error> {
    let first = match wire::read_ctrl(s) {
        Ok(CtrlMsg::Reject { error }) => Some(wire::decode_error(&error, true).expect("error")),
        Ok(m) => panic!("expected a Reject, got {m:?}"),
        Err(Error::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            return None
        }
        Err(e) => panic!("expected a Reject or a close, got {e}"),
    };
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "bytes after the Reject");
    first
}

/// Whether the target answered (and closed) this socket already, without waiting: an evicted
/// socket has its `Reject` and close queued before the connection that evicted it is served.
fn answered(s: &mut TcpStream) -> Option<Option<Error>> {
    s.set_nonblocking(true).expect("nonblocking");
    let mut b = [0u8; 1];
    let ready = match s.peek(&mut b) {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(_) => true,
    };
    s.set_nonblocking(false).expect("blocking");
    ready.then(|| refusal(s))
}

fn slowloris(secret: Option<&[u8]>) {
    let _g = serial();
    count_warnings();
    let (fds0, tasks0, warn0) = (fd_count(), task_count(), warnings());
    let cfg = config(secret, limits());
    let t = Engine::new(cfg.clone()).expect("target");
    let r = t.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
    let sampler = Peak::start(&t, |t| t.metrics().handshakes_in_progress);
    let hello = raw_peer::hello(1, secret.is_some(), &KeyShare::random()).encode();

    // A: every slot held by a socket that sent one byte of its Hello, each from its own address.
    let mut held: Vec<TcpStream> = (2..10u8)
        .map(|ip| {
            let mut s = connect_from(ip, t.listen_addr());
            s.write_all(&hello[..1]).expect("one byte");
            s
        })
        .collect();
    wait_until("8 handshakes in progress", || {
        t.metrics().handshakes_in_progress == 8
    });
    let i = good_transfer(&t, r, 0, 1, config(secret, limits()));
    let m = t.metrics();
    // The control connection evicted one (its slot is free again before the lanes come).
    assert!(
        m.handshakes_evicted >= 1,
        "evictions: {}",
        m.handshakes_evicted
    );
    let mut evicted = 0;
    for s in &mut held {
        if let Some(e) = answered(s) {
            evicted += 1;
            if let Some(e) = e {
                assert!(
                    matches!(
                        e,
                        Error::ResourceLimit {
                            resource: Resource::Handshakes,
                            limit: 8
                        }
                    ),
                    "{e}"
                );
            }
        }
    }
    assert_eq!(evicted, m.handshakes_evicted, "every eviction was answered");

    // B: one address opens 20: at most 2 of them are held, the others are answered at once.
    let mut same: Vec<TcpStream> = Vec::new();
    for k in 0..20 {
        let before = t.metrics().handshakes_admitted;
        let mut s = connect_from(20, t.listen_addr());
        s.write_all(&hello[..1]).expect("one byte");
        same.push(s);
        wait_until("admitted", || t.metrics().handshakes_admitted > before);
        let _ = k;
    }
    for (k, s) in same.iter_mut().enumerate() {
        match answered(s) {
            Some(e) => {
                assert!(k < 18, "one of the two newest was evicted");
                if let Some(e) = e {
                    assert!(
                        matches!(
                            e,
                            Error::ResourceLimit {
                                resource: Resource::HandshakesPerAddress,
                                limit: 2
                            }
                        ),
                        "{e}"
                    );
                }
            }
            None => assert!(
                k >= 18,
                "socket {k} of the address was neither held nor answered"
            ),
        }
    }
    let i2 = good_transfer(&t, r, 1 << 16, 2, config(secret, limits()));

    // Bounds, while every attacker socket still holds on.
    let attackers = held.len() + same.len();
    let m = t.metrics();
    assert!(
        m.threads_live as usize <= thread_bound(&cfg),
        "threads {}",
        m.threads_live
    );
    let icfg = config(secret, limits());
    assert!(
        fd_count() <= fds0 + attackers + fd_bound(&cfg, 1) + 2 * fd_bound(&icfg, 1),
        "fds {} (baseline {fds0})",
        fd_count()
    );
    assert!(task_count() <= tasks0 + 1 + thread_bound(&cfg) + 2 * thread_bound(&icfg));
    assert!(sampler.finish() <= 8, "more than 8 handshakes in progress");
    // C: refusals and evictions are logged at a bounded rate.
    let events = m.handshakes_evicted + m.handshakes_refused;
    let lines = warnings() - warn0;
    let bound = u64::from(64 - events.leading_zeros()) + 2;
    assert!(
        lines <= bound,
        "{lines} warnings for {events} refusals (bound {bound})"
    );
    drop((i, i2));
}

#[test]
fn slowloris_handshakes_do_not_lock_out_initiators() {
    slowloris(Some(SECRET));
}

#[test]
fn slowloris_handshakes_do_not_lock_out_initiators_without_a_secret() {
    slowloris(None);
}

#[test]
fn responder_reveals_nothing_before_the_proof() {
    let _g = serial();
    let lim = Limits {
        auth_failures_per_ip: 4,
        ..limits()
    };
    let t = Engine::new(config(Some(SECRET), lim)).expect("target");
    let r = t.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
    let wrong_proof = CtrlMsg::Proof { mac: [0x55; 32] }.encode();
    let auth_failed = CtrlMsg::Reject {
        error: wire::encode_error(&Error::AuthFailed),
    }
    .encode();
    let mut challenges = Vec::new();
    for _ in 0..4 {
        let mut c = connect_from(2, t.listen_addr());
        c.write_all(&raw_peer::hello(7, true, &KeyShare::from_bytes([7; 32])).encode())
            .expect("hello");
        let (m, raw) = wire::read_ctrl_limited(&mut c, wire::ANY).expect("challenge");
        assert_eq!(
            raw.len(),
            12 + 65,
            "a Challenge is nonce, flag and key share"
        );
        match m {
            CtrlMsg::Challenge {
                nonce,
                auth_required,
                dh,
            } => {
                assert!(auth_required);
                challenges.push((nonce, dh));
            }
            m => panic!("expected Challenge, got {m:?}"),
        }
        c.write_all(&wrong_proof).expect("proof");
        // Byte for byte the Reject this test encodes itself, then the close: no value derived
        // from the secret can hide in it.
        let mut rest = Vec::new();
        let _ = c.read_to_end(&mut rest);
        assert_eq!(rest, auth_failed);
    }
    // The same Hello gets fresh values every time: nothing deterministic in the secret.
    challenges.sort();
    challenges.dedup();
    assert_eq!(challenges.len(), 4);
    // Without a secret the client is refused right after its Hello (no Challenge).
    let mut c = connect_from(3, t.listen_addr());
    c.write_all(&raw_peer::hello(1, false, &KeyShare::random()).encode())
        .expect("hello");
    let mut rest = Vec::new();
    let _ = c.read_to_end(&mut rest);
    assert_eq!(rest, auth_failed);
    // The address used up its failures: refused at accept, before anything was read.
    let mut c = connect_from(2, t.listen_addr());
    assert!(matches!(
        refusal(&mut c),
        Some(Error::ResourceLimit {
            resource: Resource::AuthFailures,
            limit: 4
        })
    ));
    // A legitimate initiator from another address is not throttled, during the guessing.
    let i = good_transfer(&t, r, 0, 3, config(Some(SECRET), limits()));
    assert_eq!(t.metrics().auth_failures, 5);
    drop(i);
}

/// Connects from `ip`, sends `prefix` and then a header of kind `kind` announcing `len` body
/// bytes (and nothing more); returns what the target answered.
fn header_only(t: &Engine, ip: u8, prefix: &[u8], kind: u8, len: u32) -> Option<Error> {
    let mut s = connect_from(ip, t.listen_addr());
    let mut h = CtrlMsg::LaneOk.encode();
    h[6] = kind;
    h[8..12].copy_from_slice(&len.to_le_bytes());
    if !prefix.is_empty() {
        s.write_all(prefix).expect("prefix");
        assert!(matches!(
            wire::read_ctrl(&mut s).expect("challenge"),
            CtrlMsg::Challenge { .. }
        ));
    }
    s.write_all(&h).expect("header");
    refusal(&mut s)
}

#[test]
fn preauth_bodies_are_capped() {
    let _g = serial();
    let t = Engine::new(config(Some(SECRET), limits())).expect("target");
    let r = t.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
    let hello = raw_peer::hello(1, true, &KeyShare::random()).encode();
    let mut transfers = Vec::new();
    for wave in 0..4u64 {
        for ip in 2..10u8 {
            // Each is refused from its 12-byte header alone: nothing waited for (or allocated)
            // the 32 MiB it announced, which were never sent.
            let got = match ip % 3 {
                0 => header_only(&t, ip, &[], wire::kind::HELLO, 32 << 20),
                1 => header_only(&t, ip, &hello, wire::kind::PROOF, 32 << 20),
                _ => header_only(&t, ip, &[], wire::kind::REGIONS_SET, 32 << 20),
            };
            assert!(matches!(got, Some(Error::Protocol(_))), "{got:?}");
        }
        if wave == 1 {
            transfers.push(good_transfer(&t, r, 0, 4, config(Some(SECRET), limits())));
        }
    }
    wait_until("no handshake in progress", || {
        t.metrics().handshakes_in_progress == 0
    });
}

#[test]
fn no_host_details_before_the_proof() {
    let _g = serial();
    let cfg = kvwire_transfer::EngineConfig {
        transport: TransportKind::Auto,
        ..config(Some(SECRET), limits())
    };
    let t = Engine::new(cfg).expect("target");
    let r = t.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
    let host = t.descriptor().host;
    // What an authenticated peer learns: the shm probe's address in the Accept's blobs.
    let raw = raw_peer::handshake(connect_from(2, t.listen_addr()), Some(SECRET), 1)
        .expect("authenticated handshake");
    let probe = match &raw.accept {
        CtrlMsg::Accept { blobs, host: h, .. } => {
            assert_eq!(h, &host, "the host is told after the proof");
            let b = blobs
                .iter()
                .find(|(k, _)| *k == wire::TRANSPORT_SHM)
                .map(|(_, b)| b.clone())
                .expect("shm blob");
            b[..8].to_vec()
        }
        m => panic!("{m:?}"),
    };
    // What an unauthenticated probe gets: everything until the close after a wrong proof.
    let mut c = connect_from(3, t.listen_addr());
    c.write_all(&raw_peer::hello(1, true, &KeyShare::random()).encode())
        .expect("hello");
    let (_, challenge) = wire::read_ctrl_limited(&mut c, wire::ANY).expect("challenge");
    assert_eq!(challenge.len(), 12 + 65);
    c.write_all(&CtrlMsg::Proof { mac: [1; 32] }.encode())
        .expect("proof");
    let mut seen = challenge;
    let _ = c.read_to_end(&mut seen);
    let has = |needle: &[u8]| !needle.is_empty() && seen.windows(needle.len()).any(|w| w == needle);
    for secret_of_the_host in [
        host.boot_id.as_bytes(),
        host.pid_ns.as_bytes(),
        host.mnt_ns.as_bytes(),
        &probe[..],
    ] {
        assert!(!has(secret_of_the_host), "leaked {secret_of_the_host:?}");
    }
    let i = good_transfer(&t, r, 0, 5, config(Some(SECRET), limits()));
    drop((i, raw));
}
