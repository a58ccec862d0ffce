//! `kvwire-bench cuda-ipc`: device-to-device copies into another process's GPU memory over
//! CUDA IPC, next to device-to-device copies within one process, same bytes, same run.
//!
//! This process is P: it allocates a source buffer on `--device` (0) (`cuMemAlloc`, as PyTorch's
//! allocator does) and a local destination of the same size (the baseline). A child process
//! (this binary re-executed as `cuda-ipc --child`) is D: it allocates its own buffer (on
//! `--d-device`, P's device by default: another GPU puts NVLink in the path), exports
//! it (`cuIpcGetMemHandle`) and prints the handle; P opens it once. Per chunk size, P fills
//! its source with a pattern of that size's seed (not timed), then times `--rounds` copies of
//! the whole buffer in chunks of that size, alternating IPC and local rounds, each finished by
//! an event on the copy stream; D checksums what it holds (CRC32 of the whole buffer, copied
//! to the host) and P the same of its local destination, both against the source's. Then the
//! source gets a pattern of another seed and the same copies into D run as batches
//! (`cuMemcpyBatchAsync`), checked the same way.
//! Without a CUDA device: "skipped: no CUDA device" (an error under `KVWIRE_REQUIRE_GPU=1`).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use kvwire_bench::plan::parse_size;
use kvwire_bench::BenchError;
use kvwire_transfer::cuda::driver_api::CudaContext;
use kvwire_transfer::cuda::ipc::{
    DeviceBuffer, DeviceCopier, IpcExport, IpcMapping, IPC_HANDLE_LEN,
};
use kvwire_transfer::cuda::{self, CudaError};
use serde_json::json;

#[derive(Args)]
pub struct CudaIpcArgs {
    /// Bytes of each buffer.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    bytes: u64,
    /// Chunk sizes of the copies, comma separated (`all`: the whole buffer in one copy).
    #[arg(long, value_delimiter = ',', default_value = "64K,1M,16M,all")]
    chunks: Vec<String>,
    /// P's CUDA device (source and local baseline).
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// D's CUDA device (another one: copies over NVLink or PCIe peer-to-peer) [default: P's].
    #[arg(long)]
    d_device: Option<usize>,
    /// Timed rounds per chunk size and side (after one warm-up round each).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// The exporting process (internal).
    #[arg(long, hide = true)]
    child: bool,
}

fn ce(what: &str) -> impl Fn(CudaError) -> BenchError + '_ {
    move |e| BenchError::Plan(format!("cuda ({what}): {e}"))
}

pub fn run(a: &CudaIpcArgs) -> Result<ExitCode, BenchError> {
    let require = std::env::var("KVWIRE_REQUIRE_GPU").as_deref() == Ok("1");
    let dev = if a.child {
        a.d_device.unwrap_or(a.device)
    } else {
        a.device
    };
    let ctx = match cuda::device_count() {
        Ok(n) if n > dev => cuda::context(dev).map_err(ce("context"))?,
        other => {
            let why = match other {
                Ok(n) => format!("no CUDA device {dev} ({n} found)"),
                Err(e) => e.to_string(),
            };
            if require {
                return Err(BenchError::Plan(format!("KVWIRE_REQUIRE_GPU=1 but {why}")));
            }
            println!("cuda-ipc: skipped: {why}");
            return Ok(ExitCode::SUCCESS);
        }
    };
    let len = usize::try_from(a.bytes)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| BenchError::Plan("--bytes must be at least 1".into()))?;
    if a.child {
        return child(ctx, len);
    }
    let chunks = a
        .chunks
        .iter()
        .map(|c| match c.as_str() {
            "all" => Ok(len),
            s => parse_size(s).map(|v| v.clamp(1, len as u64) as usize),
        })
        .collect::<Result<Vec<usize>, String>>()
        .map_err(BenchError::Plan)?;
    let d_dev = a.d_device.unwrap_or(a.device);
    let mut d = Exporter::spawn(len, d_dev)?;
    let exp = d.export.clone();
    let mapping = Arc::new(IpcMapping::open(ctx.clone(), &exp).map_err(ce("open the handle"))?);
    let src = Arc::new(DeviceBuffer::alloc(ctx.clone(), len).map_err(ce("alloc"))?);
    let local = Arc::new(DeviceBuffer::alloc(ctx.clone(), len).map_err(ce("alloc"))?);
    let mut copier = DeviceCopier::new(ctx.clone()).map_err(ce("stream"))?;
    let name = ctx.name().unwrap_or_else(|_| "?".into());
    println!(
        "cuda-ipc on {name}: {} MiB buffers, D in process {}",
        len >> 20,
        d.pid()
    );
    println!(
        "copies: one cuMemcpyAsync per chunk (ipc, local); batched: cuMemcpyBatchAsync, {} per call ({})",
        kvwire_transfer::cuda::ipc::BATCH_MAX,
        if kvwire_transfer::cuda::ipc::batch_copies_supported() {
            "supported by this driver"
        } else {
            "NOT supported by this driver: one by one"
        }
    );
    println!(
        "{:>10} {:>14} {:>14} {:>8} {:>16} {:>9}",
        "chunk", "ipc GB/s p50", "local GB/s p50", "ratio", "batched GB/s p50", "verified"
    );
    let mut host = vec![0u8; len];
    let mut rows = Vec::new();
    let mut all_ok = true;
    for (i, &chunk) in chunks.iter().enumerate() {
        let seed = 0x1bc0_0000 + i as u64;
        kvwire_testkit::pattern::fill(&mut host, seed, 0);
        let want = crc32fast::hash(&host);
        src.upload(0, &host).map_err(ce("upload"))?;
        let (mut ipc, mut loc, mut bat) = (Vec::new(), Vec::new(), Vec::new());
        let ops: Vec<(u64, usize, usize)> = (0..len)
            .step_by(chunk)
            .map(|off| (off as u64, off, chunk.min(len - off)))
            .collect();
        for round in 0..=a.rounds {
            let t = Instant::now();
            for off in (0..len).step_by(chunk) {
                let n = chunk.min(len - off);
                copier
                    .to_mapping(&mapping, off as u64, &src, off, n)
                    .map_err(ce("copy"))?;
            }
            copier.finish().map_err(ce("finish"))?;
            let ti = t.elapsed().as_secs_f64();
            let t = Instant::now();
            for off in (0..len).step_by(chunk) {
                let n = chunk.min(len - off);
                copier
                    .to_buffer(&local, off, &src, off, n)
                    .map_err(ce("copy"))?;
            }
            copier.finish().map_err(ce("finish"))?;
            let tl = t.elapsed().as_secs_f64();
            if round > 0 {
                ipc.push(len as f64 / ti / 1e9);
                loc.push(len as f64 / tl / 1e9);
            }
        }
        let d_sum = d.checksum()?;
        local.download(0, &mut host).map_err(ce("download"))?;
        let mut ok = d_sum == want && crc32fast::hash(&host) == want;
        // The batches with a source of another seed, so that D's checksum shows their bytes.
        kvwire_testkit::pattern::fill(&mut host, seed ^ 0xba7c, 0);
        let want = crc32fast::hash(&host);
        src.upload(0, &host).map_err(ce("upload"))?;
        for round in 0..=a.rounds {
            let t = Instant::now();
            copier
                .to_mapping_batch(&mapping, &src, &ops)
                .map_err(ce("batch copy"))?;
            copier.finish().map_err(ce("finish"))?;
            let tb = t.elapsed().as_secs_f64();
            if round > 0 {
                bat.push(len as f64 / tb / 1e9);
            }
        }
        ok &= d.checksum()? == want;
        all_ok &= ok;
        let (pi, pl, pb) = (median(&mut ipc), median(&mut loc), median(&mut bat));
        println!(
            "{:>10} {:>14.1} {:>14.1} {:>8.2} {:>16.1} {:>9}",
            chunk,
            pi,
            pl,
            pi / pl,
            pb,
            if ok { "yes" } else { "NO" }
        );
        rows.push(json!({
            "chunk": chunk, "ipc_gbps_p50": pi, "local_gbps_p50": pl, "ratio": pi / pl,
            "ipc_batched_gbps_p50": pb, "ipc_gbps": ipc, "local_gbps": loc,
            "ipc_batched_gbps": bat, "verified": ok,
        }));
    }
    drop(copier);
    drop(mapping);
    d.exit();
    if let Some(p) = &a.json {
        let v = json!({"device": name, "p_device": a.device, "d_device": d_dev, "bytes": len,
                       "rounds": a.rounds, "rows": rows});
        std::fs::write(p, serde_json::to_string_pretty(&v).unwrap_or_default())?;
    }
    if !all_ok {
        eprintln!("cuda-ipc: FAILED: a destination does not hold the source's bytes");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The child: allocates and exports its buffer, then answers `SUM` with the CRC32 of what it
/// holds until `EXIT` or end of input.
fn child(ctx: Arc<CudaContext>, len: usize) -> Result<ExitCode, BenchError> {
    let buf = DeviceBuffer::alloc(ctx, len).map_err(ce("alloc"))?;
    let exp = buf.export().map_err(ce("export"))?;
    let hex: String = exp.handle.iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "EXPORT {hex} {} {}", exp.offset, exp.len)?;
    out.flush()?;
    let mut host = vec![0u8; len];
    for line in std::io::stdin().lock().lines() {
        match line?.trim() {
            "SUM" => {
                buf.download(0, &mut host).map_err(ce("download"))?;
                writeln!(out, "SUM {:08x}", crc32fast::hash(&host))?;
                out.flush()?;
            }
            _ => break,
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The child process D, driven over its stdin/stdout.
struct Exporter {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    export: IpcExport,
}

impl Exporter {
    fn spawn(len: usize, device: usize) -> Result<Self, BenchError> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .args(["cuda-ipc", "--child", "--bytes", &len.to_string()])
            .args(["--d-device", &device.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(
            child
                .stdout
                .take()
                .ok_or_else(|| BenchError::Target("the exporting process has no stdout".into()))?,
        );
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let export = parse_export(&line)
            .ok_or_else(|| BenchError::Target(format!("the exporting process said {line:?}")))?;
        Ok(Exporter {
            child,
            stdin,
            stdout,
            export,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The CRC32 of D's whole buffer.
    fn checksum(&mut self) -> Result<u32, BenchError> {
        let w = self
            .stdin
            .as_mut()
            .ok_or_else(|| BenchError::Target("the exporting process is gone".into()))?;
        writeln!(w, "SUM")?;
        w.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        line.trim()
            .strip_prefix("SUM ")
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .ok_or_else(|| BenchError::Target(format!("the exporting process said {line:?}")))
    }

    fn exit(mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        if self.stdin.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `EXPORT <128 hex digits> <offset> <len>`.
fn parse_export(line: &str) -> Option<IpcExport> {
    let mut it = line.split_whitespace();
    if it.next()? != "EXPORT" {
        return None;
    }
    let hex = it.next()?;
    if hex.len() != 2 * IPC_HANDLE_LEN {
        return None;
    }
    let mut handle = [0u8; IPC_HANDLE_LEN];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(IpcExport {
        handle,
        offset: it.next()?.parse().ok()?,
        len: it.next()?.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_lines_parse_and_bad_ones_do_not() {
        let hex: String = (0..64u8).map(|b| format!("{b:02x}")).collect();
        let e = parse_export(&format!("EXPORT {hex} 0 4096\n")).expect("parses");
        assert_eq!(e.handle[63], 63);
        assert_eq!((e.offset, e.len), (0, 4096));
        assert!(parse_export(&format!("EXPORT {} 0 4096", &hex[2..])).is_none());
        assert!(parse_export(&format!("EXPORT {hex} 0")).is_none());
        assert!(parse_export("SUM 0").is_none());
    }
}
