//! Hostile clients against the `/metrics` endpoint (finding 10): idle and trickling
//! connections do not delay a real scrape, which is answered while they are connected; the
//! endpoint's connections and threads stay within `Limits::metrics_max_conns`; the engine's
//! data path is unaffected (a verified transfer meanwhile).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use common::hostile::{
    config, connect_from, good_transfer, limits, serial, thread_bound, wait_until, Peak, HANG,
    SECRET,
};
use kvwire_transfer::{Access, Engine, EngineConfig};
use prometheus_parse::{Scrape, Value};

/// Whether the endpoint answered (a 503, or a close) this socket already, without waiting.
fn answered(s: &mut TcpStream) -> bool {
    s.set_nonblocking(true).expect("nonblocking");
    let mut b = [0u8; 1];
    let ready = !matches!(s.peek(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).expect("blocking");
    if ready {
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out);
        assert!(
            out.is_empty() || text.starts_with("HTTP/1.1 503"),
            "{text:?}"
        );
    }
    ready
}

fn scrape(addr: SocketAddr) -> Scrape {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(HANG)).expect("timeout");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    let (head, body) = out.split_once("\r\n\r\n").expect("head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("exposition")
}

#[test]
fn scrape_answers_while_idle_clients_are_connected() {
    let _g = serial();
    let cfg = EngineConfig {
        metrics_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..config(Some(SECRET), limits())
    };
    let t = Engine::new(cfg.clone()).expect("engine");
    let r = t.alloc_region(1 << 20, Access::ReadWrite).expect("alloc");
    let addr = t.metrics_addr().expect("endpoint");
    let sampler = Peak::start(&t, |t| t.metrics().metrics_conns_live);
    // Ten clients that send nothing and two that trickle an incomplete request, each from its
    // own address; the endpoint serves 4 at once.
    let mut idle: Vec<TcpStream> = (0..12u8)
        .map(|k| {
            let mut s = connect_from(2 + k, addr);
            if k >= 10 {
                s.write_all(b"GET /met").expect("trickle");
            }
            s
        })
        .collect();
    wait_until("8 evicted", || t.metrics().metrics_conns_evicted == 8);
    for (k, s) in idle.iter_mut().enumerate() {
        assert_eq!(
            answered(s),
            k < 8,
            "client {k}: the oldest are evicted, the rest held"
        );
    }
    // A real scrape, while four of them hold their connections.
    let legit = {
        let t = t.clone();
        std::thread::spawn(move || {
            drop(good_transfer(&t, r, 0, 20, config(Some(SECRET), limits())))
        })
    };
    let s = scrape(addr);
    let live = s
        .samples
        .iter()
        .find(|x| x.metric == "kvwire_metrics_connections")
        .map(|x| x.value.clone());
    assert!(
        matches!(live, Some(Value::Gauge(v)) if v <= 4.0),
        "{live:?}"
    );
    legit.join().expect("legitimate transfer");
    let most = sampler.finish();
    assert!(most <= 4);
    let m = t.metrics();
    assert_eq!(m.metrics_conns_evicted, 9, "the scrape evicted one more");
    assert!(m.threads_live as usize <= thread_bound(&cfg));
    drop(idle);
}
