//! A target process on loopback, started by re-executing this binary in serve mode; used
//! when `kvwire-bench transfer` is given neither `--target` nor `--serve`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::BenchError;

/// The line a serving target prints on stdout once it accepts connections.
pub const READY_PREFIX: &str = "KVWIRE_BENCH_READY ";
/// Environment variable carrying the shared secret to a child target.
pub const SECRET_ENV: &str = "KVWIRE_BENCH_SECRET";

/// A child process serving as the target.
pub struct LocalTarget {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: SocketAddr,
}

impl LocalTarget {
    /// Starts `exe transfer --serve --listen 127.0.0.1:0 --exit-on-stdin-eof ...` and waits
    /// (at most 60 s) for its ready line.
    pub fn spawn(
        exe: &Path,
        transport: &str,
        region_len: u64,
        secret: Option<&str>,
    ) -> Result<LocalTarget, BenchError> {
        let mut cmd = Command::new(exe);
        cmd.args([
            "transfer",
            "--serve",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            transport,
            "--region-size",
            &region_len.to_string(),
            "--exit-on-stdin-eof",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        cmd.env_remove(SECRET_ENV);
        if let Some(s) = secret {
            cmd.env(SECRET_ENV, s);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| BenchError::Spawn(format!("starting {}: {e}", exe.display())))?;
        let stdin = child.stdin.take();
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(BenchError::Spawn("no stdout pipe".into()));
        };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // forward the ready address, then keep draining so the child never blocks
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(a) = line.strip_prefix(READY_PREFIX) {
                    let _ = tx.send(a.trim().to_string());
                } else {
                    tracing::debug!(target: "kvwire_bench::target", "{line}");
                }
            }
        });
        let mut me = LocalTarget {
            child,
            stdin,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(a) => {
                    me.addr = a
                        .parse()
                        .map_err(|_| BenchError::Spawn(format!("bad ready line address {a:?}")))?;
                    return Ok(me);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(BenchError::Spawn(
                        "the target process exited before it was ready (see its errors above)"
                            .into(),
                    ))
                }
            }
            if let Ok(Some(st)) = me.child.try_wait() {
                return Err(BenchError::Spawn(format!(
                    "the target process exited early: {st}"
                )));
            }
            if Instant::now() > deadline {
                return Err(BenchError::Timeout(
                    "the local target process to start".into(),
                ));
            }
        }
    }

    /// The target's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes the target's stdin (it exits on EOF) and waits up to 10 s for it.
    pub fn finish(mut self) -> Result<(), BenchError> {
        self.stdin.take();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.child.try_wait()? {
                Some(st) if st.success() => return Ok(()),
                Some(st) => {
                    return Err(BenchError::Spawn(format!(
                        "the target process exited with {st}"
                    )))
                }
                None if Instant::now() > deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(BenchError::Timeout(
                        "the local target process to exit".into(),
                    ));
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for LocalTarget {
    fn drop(&mut self) {
        self.stdin.take();
        if let Ok(None) = self.child.try_wait() {
            std::thread::sleep(Duration::from_millis(200));
            if let Ok(None) = self.child.try_wait() {
                let _ = self.child.kill();
            }
            let _ = self.child.wait();
        }
    }
}
