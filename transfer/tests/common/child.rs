//! A child process running one test of this test binary (the process's "entry" test), driven
//! over stdin/stdout: the child answers each command line with one line that starts with `KVW `
//! (libtest may print its own text before it on the same line), the first being `KVW READY ...`.

#![allow(dead_code)] // each test binary uses part of it

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// FNV-1a of `data`: what a child reports of its memory, for the parent to compare.
pub fn fnv(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The child's answer to `NOTIFY ms`: the tag of the next notification within `ms`
/// milliseconds (`KVW TAG ...`), or `KVW NOTAG`.
pub fn answer_notification(notes: &kvwire_transfer::Notifications, ms: &str) {
    match notes.recv_timeout(Duration::from_millis(ms.parse().unwrap_or(0))) {
        Ok(n) => println!("KVW TAG {}", String::from_utf8_lossy(&n.tag)),
        Err(_) => println!("KVW NOTAG"),
    }
}

/// The child process.
pub struct Child {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Child {
    /// Runs test `entry` of this binary (`ignored`: it is marked `#[ignore]`) with `env` set;
    /// returns the child and what followed `KVW READY ` on its first line.
    pub fn spawn(entry: &str, ignored: bool, env: &[(&str, String)]) -> (Child, String) {
        let mut cmd = Command::new(std::env::current_exe().expect("current exe"));
        if ignored {
            cmd.arg("--ignored");
        }
        cmd.args(["--exact", entry, "--nocapture", "--test-threads=1"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn child");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                let Ok(l) = l else { break };
                if let Some(i) = l.find("KVW ") {
                    if tx.send(l[i + 4..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let mut c = Child {
            child,
            stdin,
            lines: rx,
        };
        let first = c.line("start");
        let ready = first
            .strip_prefix("READY ")
            .unwrap_or_else(|| panic!("child said {first}"))
            .to_string();
        (c, ready)
    }

    fn line(&mut self, what: &str) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("child did not {what}"))
    }

    /// Sends a command; returns the answer line (without `KVW `).
    pub fn cmd(&mut self, c: &str) -> String {
        let stdin = self.stdin.as_mut().expect("child stdin");
        writeln!(stdin, "{c}").expect("child stdin");
        stdin.flush().expect("flush");
        self.line(&format!("answer {c}"))
    }

    /// The child's pid.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The child's process.
    pub fn process(&mut self) -> &mut std::process::Child {
        &mut self.child
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // The child ends when its stdin closes; one that does not is killed.
        drop(self.stdin.take());
        for _ in 0..500 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
