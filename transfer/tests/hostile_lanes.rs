//! Hostile clients against data lanes and peers: a passive observer replaying a recorded lane
//! join (finding 2), lane churn and lanes beyond what a peer announced (3), more peers than
//! the limit (3). A legitimate initiator completes a verified transfer while the attack is in
//! progress; the target's resources stay within bounds computed from its configuration.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use common::hostile::{
    config, connect_from, fd_bound, fd_count, good_transfer, limits, serial, task_count,
    thread_bound, wait_until, write_checked, Peak, SECRET,
};
use common::mismatch;
use common::raw_peer::{self, write_header};
use kvwire_transfer::wire::{self, CtrlMsg};
use kvwire_transfer::{Access, Engine, Error, Limits, Resource};

/// Bytes of one relayed connection: client to target, target to client.
type Recording = (Arc<Mutex<Vec<u8>>>, Arc<Mutex<Vec<u8>>>);

/// A relay on loopback that forwards every connection to `to` and records both directions.
fn relay(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<Recording>>>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let all: Arc<Mutex<Vec<Recording>>> = Arc::default();
    let all2 = all.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            let t = TcpStream::connect(to).expect("relay to the target");
            let rec: Recording = Default::default();
            all2.lock().expect("lock").push(rec.clone());
            let pump = |mut from: TcpStream, mut to: TcpStream, log: Arc<Mutex<Vec<u8>>>| {
                std::thread::spawn(move || {
                    let mut b = [0u8; 65536];
                    while let Ok(n) = from.read(&mut b) {
                        if n == 0 {
                            break;
                        }
                        log.lock().expect("lock").extend_from_slice(&b[..n]);
                        if to.write_all(&b[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            };
            pump(
                c.try_clone().expect("clone"),
                t.try_clone().expect("clone"),
                rec.0,
            );
            pump(t, c, rec.1);
        }
    });
    (addr, all)
}

/// The control messages at the start of recorded bytes.
fn messages(b: &[u8]) -> Vec<(CtrlMsg, Vec<u8>)> {
    let mut cur = std::io::Cursor::new(b);
    let mut v = Vec::new();
    while let Ok(m) = wire::read_ctrl_limited(&mut cur, wire::ANY) {
        v.push(m);
    }
    v
}

#[test]
fn passive_observer_cannot_open_a_lane() {
    let _g = serial();
    let t = Engine::new(config(Some(SECRET), limits())).expect("target");
    let r = t.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
    let (via, recorded) = relay(t.listen_addr());
    // A legitimate initiator, every byte of its connections recorded on the way.
    let i = Engine::new(config(Some(SECRET), limits())).expect("initiator");
    let src = i.alloc_region(4096, Access::Local).expect("alloc");
    let p = i.connect(via).expect("connect through the relay");
    write_checked((&i, &p, src), (&t, r, 0), 6, 4096);
    assert_eq!(t.metrics().lanes_open, 2);
    // The observer's copy of lane 0: LaneJoin, LaneProof one way, LaneChallenge the other.
    let lane = recorded.lock().expect("lock")[1].clone();
    let up = messages(&lane.0.lock().expect("lock"));
    let down = messages(&lane.1.lock().expect("lock"));
    let (join, proof) = (&up[0].1, &up[1].1);
    let (sid, old_nonce) = match (&up[0].0, &down[0].0) {
        (CtrlMsg::LaneJoin { sid, .. }, CtrlMsg::LaneChallenge { nonce, .. }) => (*sid, *nonce),
        m => panic!("unexpected recording {m:?}"),
    };
    // Replayed: the listener's challenge is fresh, so the recorded proof is refused.
    let mut s = connect_from(2, t.listen_addr());
    s.write_all(join).expect("replay join");
    match wire::read_ctrl(&mut s).expect("challenge") {
        CtrlMsg::LaneChallenge { nonce, .. } => assert_ne!(nonce, old_nonce),
        m => panic!("expected LaneChallenge, got {m:?}"),
    }
    s.write_all(proof).expect("replay proof");
    match wire::read_ctrl(&mut s).expect("answer") {
        CtrlMsg::Reject { error } => {
            assert!(matches!(
                wire::decode_error(&error, true),
                Ok(Error::AuthFailed)
            ))
        }
        m => panic!("a replayed proof got {m:?}"),
    }
    // Frames sent anyway land nowhere.
    let junk = vec![0xEE; 4096];
    let mut f = write_header(t.region_id(r), 0, junk.len(), 1).to_vec();
    f.extend_from_slice(&junk);
    let _ = s.write_all(&f);
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    // The recorded session id with a proof of its own: refused too.
    let mut s = connect_from(2, t.listen_addr());
    s.write_all(
        &CtrlMsg::LaneJoin {
            sid,
            lane: 1,
            nonce: [3; 32],
        }
        .encode(),
    )
    .expect("join");
    assert!(matches!(
        wire::read_ctrl(&mut s),
        Ok(CtrlMsg::LaneChallenge { .. })
    ));
    s.write_all(&CtrlMsg::LaneProof { mac: [9; 32] }.encode())
        .expect("proof");
    assert!(matches!(
        wire::read_ctrl(&mut s),
        Ok(CtrlMsg::Reject { .. })
    ));
    let mut buf = vec![0u8; 4096];
    t.local_read(r, 0, &mut buf).expect("read");
    assert_eq!(mismatch(6, 0, &buf), None, "the target region changed");
    assert_eq!(t.metrics().lanes_open, 2, "only the legitimate lanes");
    assert_eq!(t.metrics().auth_failures, 2);
    let i2 = good_transfer(&t, r, 1 << 16, 7, config(Some(SECRET), limits()));
    drop((i, i2));
}

#[test]
fn lane_churn_releases_fds_and_caps_lanes() {
    let _g = serial();
    let cfg = config(Some(SECRET), limits());
    let t = Engine::new(cfg.clone()).expect("target");
    let r = t.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
    let raw =
        raw_peer::handshake(connect_from(2, t.listen_addr()), Some(SECRET), 2).expect("handshake");
    let fds0 = fd_count();
    let sampler = Peak::start(&t, |t| t.metrics().lanes_open);
    let legit = {
        let t = t.clone();
        std::thread::spawn(move || {
            drop(good_transfer(&t, r, 0, 8, config(Some(SECRET), limits())));
        })
    };
    for _ in 0..1000 {
        let mut s = connect_from(2, t.listen_addr());
        raw_peer::join(&mut s, &raw.cred, 0).expect("join");
        drop(s);
        wait_until("the lane is gone", || {
            t.metrics().peers.iter().all(|p| p.lanes_open == 0)
        });
    }
    legit.join().expect("legitimate transfer");
    // Every lane's descriptors were released with it (the legitimate engine is gone too).
    wait_until("descriptors back to the baseline", || {
        fd_count() <= fds0 + 1
    });
    // Lanes beyond what the peer announced, or open twice, are refused.
    let mut a = connect_from(2, t.listen_addr());
    raw_peer::join(&mut a, &raw.cred, 0).expect("lane 0");
    let mut b = connect_from(2, t.listen_addr());
    raw_peer::join(&mut b, &raw.cred, 1).expect("lane 1");
    let mut again = connect_from(2, t.listen_addr());
    let e = raw_peer::join(&mut again, &raw.cred, 0).expect_err("lane 0 twice");
    assert!(e.to_string().contains("lane 0 already open"), "{e}");
    for lane in [2, 5, 1000] {
        let mut c = connect_from(2, t.listen_addr());
        let e = raw_peer::join(&mut c, &raw.cred, lane).expect_err("beyond");
        assert!(
            matches!(
                e,
                Error::ResourceLimit {
                    resource: Resource::Lanes,
                    limit: 2
                }
            ),
            "{e}"
        );
    }
    let most = sampler.finish();
    assert!(most <= 2 + 2, "legit lanes plus the peer's two");
    let m = t.metrics();
    assert_eq!(m.lanes_refused, 4);
    assert!(m.threads_live as usize <= thread_bound(&cfg));
    drop((a, b, raw));
}

#[test]
fn peers_are_capped() {
    let _g = serial();
    let (fds0, tasks0) = (fd_count(), task_count());
    // Every peer dials from 127.0.0.1: the per-address handshake cap (whose slot the target
    // frees only after the initiator's connect has returned) is not what this test is about.
    let cfg = config(
        Some(SECRET),
        Limits {
            max_handshakes_per_ip: 8,
            ..limits()
        },
    );
    let t = Engine::new(cfg.clone()).expect("target");
    let r = t.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
    let legit = Engine::new(config(Some(SECRET), limits())).expect("engine");
    let src = legit.alloc_region(4096, Access::Local).expect("alloc");
    let p = legit.connect(t.listen_addr()).expect("first peer");
    // Three more hold on; then the target is full.
    let holders: Vec<Engine> = (0..3)
        .map(|_| {
            let e = Engine::new(config(Some(SECRET), limits())).expect("engine");
            e.connect(t.listen_addr()).expect("within the limit");
            e
        })
        .collect();
    let late = Engine::new(config(Some(SECRET), limits())).expect("engine");
    for _ in 0..3 {
        assert!(matches!(
            late.connect(t.listen_addr()),
            Err(Error::ResourceLimit {
                resource: Resource::Peers,
                limit: 4
            })
        ));
    }
    // A raw client is refused after its proof, in place of the Accept.
    let e = raw_peer::handshake(connect_from(2, t.listen_addr()), Some(SECRET), 1)
        .err()
        .expect("refused");
    assert!(matches!(
        e,
        Error::ResourceLimit {
            resource: Resource::Peers,
            ..
        }
    ));
    write_checked((&legit, &p, src), (&t, r, 0), 9, 4096);
    let m = t.metrics();
    assert_eq!(m.peers_connected, 4);
    assert_eq!(m.peers_refused, 4);
    assert!(m.threads_live as usize <= thread_bound(&cfg));
    let ecfg = config(Some(SECRET), limits());
    assert!(fd_count() <= fds0 + 1 + fd_bound(&cfg, 1) + 5 * fd_bound(&ecfg, 1));
    assert!(task_count() <= tasks0 + thread_bound(&cfg) + 5 * thread_bound(&ecfg));
    drop((holders, late, legit));
}
