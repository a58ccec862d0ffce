//! Shared test helpers: byte patterns (from `kvwire-testkit`) and a target engine running in a child process
//! (the test binary re-executed with `KVWIRE_TEST_CHILD=1`, driven over stdin/stdout); races
//! against `unregister` ([`race`]), a hand-written tcp peer ([`raw_peer`]) and the helpers of
//! the hostile-client tests ([`hostile`]).
#![allow(dead_code)]

pub mod child;
pub mod hostile;
pub mod race;
pub mod raw_peer;

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

pub use child::Child;

use kvwire_transfer::{Access, Engine, EngineConfig, Op, RegionHandle, RegionId};

/// The seeded byte pattern every test writes and checks: `pattern(seed, start, len)` is `len`
/// bytes of the stream `seed` from byte `start`; `mismatch(seed, start, data)` the first byte of
/// `data` that differs from it.
pub use kvwire_testkit::pattern::{bytes as pattern, mismatch};

/// `len` bytes at `off` of `local` to or from the same offset of `remote`.
pub fn op_at(local: RegionHandle, remote: RegionId, off: u64, len: u64) -> Op {
    Op {
        local,
        local_offset: off,
        remote,
        remote_offset: off,
        len,
    }
}

/// Runs the child side when this process is a re-executed child; returns false otherwise.
pub fn child_entry() -> bool {
    if std::env::var("KVWIRE_TEST_CHILD").ok().as_deref() != Some("1") {
        return false;
    }
    if let Err(e) = run_child() {
        println!("KVW ERROR {e}");
    }
    std::process::exit(0);
}

fn parse_access(s: &str) -> Access {
    match s {
        "rw" => Access::ReadWrite,
        "w" => Access::WriteOnly,
        "r" => Access::ReadOnly,
        _ => Access::Local,
    }
}

fn run_child() -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = EngineConfig::default();
    if let Ok(s) = std::env::var("KVWIRE_CHILD_SECRET") {
        cfg.secret = Some(s.into_bytes());
    }
    let e = Engine::new(cfg)?;
    // Regions: "len:access[:raw],..." allocated in order (indices 0..n on a fresh engine).
    let mut regions: Vec<RegionHandle> = Vec::new();
    // Caller memory of raw regions (address, length), by region index.
    let mut raws: Vec<Option<(usize, usize)>> = Vec::new();
    let spec = std::env::var("KVWIRE_CHILD_REGIONS").unwrap_or_else(|_| "4194304:rw".into());
    for r in spec.split(',') {
        let f: Vec<&str> = r.split(':').collect();
        let len: usize = f[0].parse()?;
        let access = parse_access(f.get(1).copied().unwrap_or("rw"));
        let h = if f.get(2) == Some(&"raw") {
            let mem: &'static mut [u8] = Box::leak(vec![0u8; len].into_boxed_slice());
            raws.push(Some((mem.as_mut_ptr() as usize, len)));
            // SAFETY: leaked memory lives for the rest of the process; never referenced again
            // (except through `raw_slice` once the region is unregistered).
            unsafe { e.register_raw(mem.as_mut_ptr(), len, access)? }
        } else {
            raws.push(None);
            e.alloc_region(len, access)?
        };
        regions.push(h);
    }
    println!("KVW READY {}", e.listen_addr());
    std::io::stdout().flush()?;
    let notes = e.notifications();
    let mut watcher: Option<std::thread::JoinHandle<(u64, u64)>> = None;
    let mut journal: Option<std::thread::JoinHandle<String>> = None;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> u64 { w.get(i).and_then(|s| s.parse().ok()).unwrap_or(0) };
        let reply = match w.first().copied() {
            Some("fill") => {
                let (r, off, len, seed) = (num(1) as usize, num(2), num(3) as usize, num(4));
                e.local_write(regions[r], off, &pattern(seed, off, len))?;
                "OK".to_string()
            }
            Some("check") => {
                let (r, off, len, seed) = (num(1) as usize, num(2), num(3) as usize, num(4));
                let mut buf = vec![0u8; len];
                e.local_read(regions[r], off, &mut buf)?;
                match mismatch(seed, off, &buf) {
                    None => "OK".to_string(),
                    Some(i) => format!("BAD at {}", off + i as u64),
                }
            }
            Some("zero") => {
                let (r, off, len) = (num(1) as usize, num(2), num(3) as usize);
                let mut buf = vec![0u8; len];
                e.local_read(regions[r], off, &mut buf)?;
                if buf.iter().all(|b| *b == 0) {
                    "OK".to_string()
                } else {
                    "NONZERO".to_string()
                }
            }
            Some("notify") => {
                // Receive n notifications; each tag is "region off len seed"; check the bytes
                // the moment the tag is seen.
                let (n, timeout_ms) = (num(1), num(2));
                let (mut ok, mut bad) = (0, 0);
                for _ in 0..n {
                    match notes.recv_timeout(Duration::from_millis(timeout_ms)) {
                        Ok(note) => {
                            let tag = String::from_utf8_lossy(&note.tag).to_string();
                            let t: Vec<u64> = tag
                                .split_whitespace()
                                .filter_map(|x| x.parse().ok())
                                .collect();
                            if t.len() != 4 {
                                bad += 1;
                                continue;
                            }
                            let mut buf = vec![0u8; t[2] as usize];
                            e.local_read(regions[t[0] as usize], t[1], &mut buf)?;
                            if mismatch(t[3], t[1], &buf).is_none() {
                                ok += 1;
                            } else {
                                bad += 1;
                            }
                        }
                        Err(_) => break,
                    }
                }
                format!("NOTIFIED {ok} {bad}")
            }
            Some("watch") => {
                // Like "notify", but in the background while the parent transfers: each tag's
                // bytes are checked the moment the tag is delivered.
                let (n, timeout_ms) = (num(1), num(2));
                let (e2, notes2, regions2) = (e.clone(), notes.clone(), regions.clone());
                watcher = Some(std::thread::spawn(move || {
                    let (mut ok, mut bad) = (0, 0);
                    for _ in 0..n {
                        let Ok(note) = notes2.recv_timeout(Duration::from_millis(timeout_ms))
                        else {
                            break;
                        };
                        let tag = String::from_utf8_lossy(&note.tag).to_string();
                        let t = tag_fields(&tag);
                        let good = t.len() == 4 && landed(&e2, &regions2, &t);
                        if good {
                            ok += 1;
                        } else {
                            bad += 1;
                        }
                    }
                    (ok, bad)
                }));
                "OK".to_string()
            }
            Some("journal") => {
                // Like "watch", and keeps every tag in arrival order (for "journal_result").
                let (n, timeout_ms) = (num(1), num(2));
                let (e2, notes2, regions2) = (e.clone(), notes.clone(), regions.clone());
                journal = Some(std::thread::spawn(move || {
                    let (mut ok, mut bad) = (0u64, 0u64);
                    let mut tags = Vec::new();
                    for _ in 0..n {
                        let Ok(note) = notes2.recv_timeout(Duration::from_millis(timeout_ms))
                        else {
                            break;
                        };
                        let tag = String::from_utf8_lossy(&note.tag).to_string();
                        let t = tag_fields(&tag);
                        let good = landed(&e2, &regions2, &t);
                        if good {
                            ok += 1;
                        } else {
                            bad += 1;
                        }
                        tags.push(tag);
                    }
                    // Anything beyond the n expected is a duplicate or a stray.
                    let extra =
                        std::iter::from_fn(|| notes2.recv_timeout(Duration::from_millis(200)).ok())
                            .take(1000)
                            .count();
                    format!("JOURNAL {ok} {bad} {extra}|{}", tags.join("|"))
                }));
                "OK".to_string()
            }
            Some("journal_result") => match journal.take().map(|h| h.join()) {
                Some(Ok(s)) => s,
                _ => "NO JOURNAL".to_string(),
            },
            Some("unregister_guard") => {
                // Unregisters raw region r, then at once overwrites its memory with the guard
                // pattern `seed` (no peer may write into it any more).
                let (r, seed) = (num(1) as usize, num(2));
                let raw = raws.get(r).copied().flatten();
                let guard = pattern(seed, 0, raw.map_or(0, |(_, len)| len));
                match (e.unregister(regions[r]), raw) {
                    (Ok(()), Some((addr, len))) => {
                        raw_slice(addr, len).copy_from_slice(&guard);
                        "OK".to_string()
                    }
                    (Ok(()), None) => "NOT RAW".to_string(),
                    (Err(err), _) => format!("ERR {err}"),
                }
            }
            Some("check_guard") => {
                let (r, seed) = (num(1) as usize, num(2));
                match raws.get(r).copied().flatten() {
                    Some((addr, len)) => match mismatch(seed, 0, raw_slice(addr, len)) {
                        None => "OK".to_string(),
                        Some(i) => format!("BAD at {i}"),
                    },
                    None => "NOT RAW".to_string(),
                }
            }
            Some("watch_result") => match watcher.take().map(|h| h.join()) {
                Some(Ok((ok, bad))) => format!("NOTIFIED {ok} {bad}"),
                _ => "NO WATCHER".to_string(),
            },
            Some("alloc") => {
                let h = e.alloc_region(num(1) as usize, Access::ReadWrite)?;
                regions.push(h);
                format!("INDEX {} {}", regions.len() - 1, e.region_id(h).index)
            }
            Some("unregister") => {
                e.unregister(regions[num(1) as usize])?;
                "OK".to_string()
            }
            Some("peers") => format!("PEERS {}", e.peers().len()),
            Some("exit") | None => break,
            Some(other) => format!("UNKNOWN {other}"),
        };
        println!("KVW {reply}");
        std::io::stdout().flush()?;
    }
    Ok(())
}

/// The numbers of a notification tag `"region offset len seed ..."`.
fn tag_fields(tag: &str) -> Vec<u64> {
    tag.split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect()
}

/// Whether the bytes a tag names (`region offset len seed`) hold their pattern now; an empty
/// range always has.
fn landed(e: &Engine, regions: &[RegionHandle], t: &[u64]) -> bool {
    t.len() >= 4
        && (t[2] == 0 || {
            let mut buf = vec![0u8; t[2] as usize];
            e.local_read(regions[t[0] as usize], t[1], &mut buf).is_ok()
                && mismatch(t[3], t[1], &buf).is_none()
        })
}

/// The leaked memory of a raw region, for use only once the region is unregistered.
fn raw_slice(addr: usize, len: usize) -> &'static mut [u8] {
    // SAFETY: `addr..addr+len` is a leaked allocation of the child (see `run_child`), alive for
    // the rest of the process; callers use it only after `unregister` returned Ok, after which
    // the engine promises no peer writes into it, and one command at a time (no other reference).
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

/// A target engine in a child process.
pub struct Target {
    child: Child,
    /// Its listen address.
    pub addr: SocketAddr,
}

impl Target {
    /// Spawns a child (`test_name` must be the test function calling `child_entry`).
    pub fn spawn(test_name: &str, regions: &str, secret: Option<&str>) -> Target {
        let mut env = vec![
            ("KVWIRE_TEST_CHILD", "1".to_string()),
            ("KVWIRE_CHILD_REGIONS", regions.to_string()),
        ];
        if let Some(s) = secret {
            env.push(("KVWIRE_CHILD_SECRET", s.to_string()));
        }
        let (child, ready) = Child::spawn(test_name, false, &env);
        Target {
            child,
            addr: ready.parse().expect("addr"),
        }
    }

    /// Sends a command, returns the reply line.
    pub fn cmd(&mut self, c: &str) -> String {
        self.child.cmd(c)
    }

    /// Kills the child (SIGKILL).
    pub fn kill(&mut self) {
        let _ = self.child.process().kill();
        let _ = self.child.process().wait();
    }

    /// Sends a signal to the child.
    pub fn signal(&self, sig: i32) {
        // Through kill(1): the tests do not depend on libc.
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status();
    }

    /// Sends SIGSTOP and returns once every thread of the child is stopped (`kill` returns
    /// when the signal is queued, not when each thread has stopped). Bounded: 10 s.
    pub fn stop(&self) {
        self.signal(19);
        let tasks = format!("/proc/{}/task", self.pid());
        let all_stopped = || -> bool {
            let Ok(dir) = std::fs::read_dir(&tasks) else {
                return false;
            };
            dir.filter_map(Result::ok).all(|t| {
                std::fs::read_to_string(t.path().join("stat"))
                    .ok()
                    .and_then(|s| {
                        // state is the field after the ")" that closes the command name
                        s.rfind(')')
                            .and_then(|i| s[i + 1..].split_whitespace().next().map(String::from))
                    })
                    .is_some_and(|state| state == "T" || state == "t")
            })
        };
        let t0 = std::time::Instant::now();
        while !all_stopped() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "child {} did not stop after SIGSTOP",
                self.pid()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Child pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.process().kill();
    }
}
