//! Verbs self-test across two RDMA devices (in CI: rxe0 and rxe1 of the SoftRoCE VM, see
//! `tests/vm/run.sh`).
//!
//! Opens both devices, registers a buffer on each, connects one RC QP per device to the other
//! over the devices' RoCE v2 GIDs, and checks, verifying every byte at the target:
//! RDMA WRITE of 4 KiB..4 MiB, scatter-gather writes and reads, WRITE WITH IMMEDIATE (the
//! receive completion carries the value and the data is there when it arrives), RDMA READ,
//! a bad rkey and an out-of-bounds remote address (typed `RemoteAccess` completions, not a
//! hang), QP re-creation and a good write after it, and finally pipelined WRITE bandwidth at
//! 64 KiB and 1 MiB.
//!
//! Usage: `rdma_selftest [--dev-a rxe1] [--dev-b rxe0] [--iters-64k 1000] [--iters-1m 64]
//! [--only write,sg,imm,read,errors,deadpeer,flush,bw]`
//! (A writes to B). Without the devices it prints `SKIPPED: ...` and exits 0, or 1 when
//! `KVWIRE_REQUIRE_RDMA=1`. Exit status 0 = every check passed.

use std::error::Error;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvwire_transfer::verbs::{
    Access, Completion, CompletionOp, ConnectParams, Context, Cq, GidSelection, PortInfo, Qp,
    QpCaps, RegisteredBuffer, SendOp, SendRequest, Sge, Verbs, VerbsError, WcStatus,
};

type R<T> = Result<T, Box<dyn Error>>;

const BUF: usize = 16 << 20;
const WAIT: Duration = Duration::from_secs(60);
const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

struct Side {
    name: String,
    ctx: Context,
    port: PortInfo,
    gid: GidSelection,
    pd: kvwire_transfer::verbs::Pd,
    scq: Cq,
    rcq: Cq,
    qp: Qp,
    buf: RegisteredBuffer,
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    kvwire_testkit::pattern::bytes(seed, 0, len)
}

fn read(buf: &RegisteredBuffer, off: usize, len: usize) -> R<Vec<u8>> {
    let mut v = vec![0u8; len];
    buf.copy_out(off, &mut v)?;
    Ok(v)
}

fn check_eq(what: &str, got: &[u8], want: &[u8]) -> R<()> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()).into());
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        return Err(format!(
            "{what}: first mismatch at byte {i} (got {:#04x}, want {:#04x})",
            got[i], want[i]
        )
        .into());
    }
    Ok(())
}

fn open_side(verbs: &Verbs, name: &str) -> R<Side> {
    let ctx = verbs.open(name)?;
    let port = ctx.query_port(1)?;
    if !port.active {
        return Err(format!("{name} port 1 not active: {port:?}").into());
    }
    let gid = ctx.select_gid(1)?;
    let pd = ctx.alloc_pd()?;
    let scq = ctx.create_cq(1024)?;
    let rcq = ctx.create_cq(1024)?;
    let qp = pd.create_rc_qp(&scq, &rcq, caps(&ctx))?;
    let buf = pd.register_buffer(BUF, Access::all_rdma())?;
    println!(
        "device {name}: {:?} gid[{}]={} ({:?}) mtu={} max_sge={} qp={} caps={:?} numa={:?} netdevs={:?}",
        port.link_layer,
        gid.index,
        gid.gid,
        gid.kind,
        port.active_mtu.bytes(),
        ctx.max_sge(),
        qp.qpn(),
        qp.caps(),
        ctx.device().numa_node,
        ctx.device().netdevs
    );
    Ok(Side {
        name: name.to_string(),
        ctx,
        port,
        gid,
        pd,
        scq,
        rcq,
        qp,
        buf,
    })
}

fn caps(ctx: &Context) -> QpCaps {
    QpCaps {
        max_send_wr: 256,
        max_recv_wr: 256,
        max_send_sge: ctx.max_sge().min(16),
        max_recv_sge: 1,
    }
}

fn connect(a: &Side, b: &Side, round: u32) -> R<()> {
    let psn_a = 0x1000 + round * 77;
    let psn_b = 0x2000 + round * 91;
    let ea = a.qp.endpoint(a.gid.gid, a.port.lid, psn_a);
    let eb = b.qp.endpoint(b.gid.gid, b.port.lid, psn_b);
    // through the wire encoding, as a handshake would carry them
    let ea = kvwire_transfer::verbs::Endpoint::from_bytes(&ea.to_bytes())?;
    let eb = kvwire_transfer::verbs::Endpoint::from_bytes(&eb.to_bytes())?;
    let mtu = a.port.active_mtu.min(b.port.active_mtu);
    a.qp.connect(&ConnectParams::new(1, a.gid.index, mtu, eb, psn_a))?;
    b.qp.connect(&ConnectParams::new(1, b.gid.index, mtu, ea, psn_b))?;
    Ok(())
}

fn recreate_qps(a: &mut Side, b: &mut Side, round: u32) -> R<()> {
    // drain whatever the failed QPs left, then replace them (old ones are destroyed on drop)
    let mut junk = Vec::new();
    for cq in [&a.scq, &a.rcq, &b.scq, &b.rcq] {
        cq.poll(&mut junk, 1024)?;
    }
    a.qp = a.pd.create_rc_qp(&a.scq, &a.rcq, caps(&a.ctx))?;
    b.qp = b.pd.create_rc_qp(&b.scq, &b.rcq, caps(&b.ctx))?;
    connect(a, b, round)
}

/// Waits for the completion of `wr_id` on `cq` (other completions are returned too).
fn wait_for(cq: &Cq, wr_id: u64) -> R<Completion> {
    let deadline = Instant::now() + WAIT;
    let mut got = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no completion for wr {wr_id} within {WAIT:?}").into());
        }
        got.clear();
        cq.wait(&mut got, 64, left)?;
        if let Some(c) = got.iter().find(|c| c.wr_id == wr_id) {
            return Ok(c.clone());
        }
        for c in &got {
            if let Err(e) = &c.result {
                return Err(
                    format!("unexpected error completion while waiting for {wr_id}: {e}").into(),
                );
            }
        }
    }
}

/// Waits until every id of `ids` has completed on `cq`; returns their completions.
fn wait_all(cq: &Cq, ids: &[u64]) -> R<Vec<Completion>> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    let mut got = Vec::new();
    while out.len() < ids.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("{}/{} completions within {WAIT:?}", out.len(), ids.len()).into());
        }
        got.clear();
        cq.wait(&mut got, 64, left)?;
        for c in got.drain(..) {
            if !ids.contains(&c.wr_id) {
                return Err(format!("unexpected completion {c:?}").into());
            }
            out.push(c);
        }
    }
    Ok(out)
}

fn expect_ok(c: &Completion, op: CompletionOp) -> R<()> {
    match &c.result {
        Ok(o) if *o == op => Ok(()),
        other => Err(format!("wr {}: expected Ok({op:?}), got {other:?}", c.wr_id).into()),
    }
}

/// RDMA WRITE `len` bytes from A's `src_off` to B's `dst_off`, with guard bytes around the
/// target checked untouched.
fn write_and_verify(
    a: &Side,
    b: &Side,
    wr_id: u64,
    src_off: usize,
    dst_off: usize,
    len: usize,
) -> R<()> {
    let data = pattern(wr_id, len);
    a.buf.copy_in(src_off, &data)?;
    let guard = 64.min(dst_off);
    b.buf.fill(dst_off - guard, guard + len + 64, 0xEE)?;
    a.qp.post_write(
        wr_id,
        &[a.buf.mr().sge(src_off, len)?],
        b.buf.mr().remote(dst_off, len)?,
        true,
    )?;
    expect_ok(&wait_for(&a.scq, wr_id)?, CompletionOp::RdmaWrite)?;
    check_eq(
        &format!("write {len}B"),
        &read(&b.buf, dst_off, len)?,
        &data,
    )?;
    let before = read(&b.buf, dst_off - guard, guard)?;
    let after = read(&b.buf, dst_off + len, 64)?;
    if before.iter().chain(after.iter()).any(|&x| x != 0xEE) {
        return Err(format!("write {len}B touched bytes outside its target").into());
    }
    Ok(())
}

fn test_write_sizes(a: &Side, b: &Side) -> R<()> {
    let sizes = [
        4 * KIB,
        8 * KIB,
        16 * KIB,
        64 * KIB,
        256 * KIB,
        MIB,
        4 * MIB,
    ];
    for (i, &len) in sizes.iter().enumerate() {
        // aligned, then odd offsets on both sides
        write_and_verify(a, b, 100 + i as u64, 0, 4096, len)?;
        write_and_verify(a, b, 200 + i as u64, 123, MIB + 4097, len)?;
    }
    println!("PASS write sizes 4KiB..4MiB (aligned and odd offsets, guards intact)");
    Ok(())
}

fn test_sg(a: &Side, b: &Side) -> R<()> {
    let max = a.qp.caps().max_send_sge as usize;
    // shape 1: three uneven pieces from far apart
    let pieces: Vec<(usize, usize)> = vec![(0, 4096), (65536, 12288), (300_001, 1000)];
    // shape 2: KV-cache-like, every other 16 KiB block of 2*max blocks
    let blocks: Vec<(usize, usize)> = (0..max)
        .map(|k| (2 * MIB + 2 * k * 16 * KIB, 16 * KIB))
        .collect();
    // shape 3: many tiny pieces
    let tiny: Vec<(usize, usize)> = (0..max).map(|k| (5 * MIB + k * 100, 37)).collect();
    for (n, shape) in [pieces, blocks, tiny].iter().enumerate() {
        let mut want = Vec::new();
        let mut sges: Vec<Sge> = Vec::new();
        for (k, &(off, len)) in shape.iter().enumerate() {
            let d = pattern(1000 + (n * 100 + k) as u64, len);
            a.buf.copy_in(off, &d)?;
            want.extend_from_slice(&d);
            sges.push(a.buf.mr().sge(off, len)?);
        }
        let dst = 8 * MIB + 333;
        b.buf.fill(dst, want.len() + 64, 0)?;
        let wr = 300 + n as u64;
        a.qp.post_write(wr, &sges, b.buf.mr().remote(dst, want.len())?, true)?;
        expect_ok(&wait_for(&a.scq, wr)?, CompletionOp::RdmaWrite)?;
        check_eq(
            &format!("sg write shape {n} ({} sges)", sges.len()),
            &read(&b.buf, dst, want.len())?,
            &want,
        )?;
        if read(&b.buf, dst + want.len(), 64)?.iter().any(|&x| x != 0) {
            return Err(format!("sg write shape {n} overran").into());
        }
        // and back: READ the contiguous remote bytes scattered into fresh local pieces
        let mut back_sges = Vec::new();
        let mut back_offs = Vec::new();
        for (k, &(_, len)) in shape.iter().enumerate() {
            let off = 10 * MIB + k * 40 * KIB;
            a.buf.fill(off, len, 0)?;
            back_sges.push(a.buf.mr().sge(off, len)?);
            back_offs.push((off, len));
        }
        let wr = 350 + n as u64;
        a.qp.post_read(wr, &back_sges, b.buf.mr().remote(dst, want.len())?)?;
        expect_ok(&wait_for(&a.scq, wr)?, CompletionOp::RdmaRead)?;
        let mut got = Vec::new();
        for (off, len) in back_offs {
            got.extend(read(&a.buf, off, len)?);
        }
        check_eq(&format!("sg read shape {n}"), &got, &want)?;
    }
    println!("PASS scatter-gather write+read (3 uneven, {max}x16KiB blocks, {max}x37B)");
    Ok(())
}

fn test_write_with_imm(a: &Side, b: &Side) -> R<()> {
    let n = 8u32;
    let len = 256 * KIB;
    for i in 0..n {
        b.qp.post_recv(5000 + u64::from(i), &[])?;
    }
    let mut datas = Vec::new();
    for i in 0..n {
        let off = i as usize * len;
        let d = pattern(u64::from(0xABC0 + i), len);
        a.buf.copy_in(off, &d)?;
        b.buf.fill(off, len, 0)?;
        datas.push(d);
    }
    for i in 0..n {
        let off = i as usize * len;
        a.qp.post_send(&[SendRequest {
            wr_id: 400 + u64::from(i),
            op: SendOp::WriteWithImm(0x5EED_0000 + i),
            local: &[a.buf.mr().sge(off, len)?],
            remote: b.buf.mr().remote(off, len)?,
            signaled: true,
        }])?;
    }
    // receiver side: each immediate names the slice whose bytes must already be there
    let mut seen = 0u32;
    let deadline = Instant::now() + WAIT;
    let mut got = Vec::new();
    while seen < n {
        got.clear();
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("only {seen}/{n} immediates arrived").into());
        }
        if let Err(e) = b.rcq.wait(&mut got, 64, left) {
            let mut sender = Vec::new();
            a.scq.poll(&mut sender, 64)?;
            return Err(format!(
                "{seen}/{n} immediates arrived ({e}); sender completions: {sender:?}"
            )
            .into());
        }
        for c in &got {
            expect_ok(c, CompletionOp::RecvRdmaWithImm)?;
            let imm = c.imm.ok_or("recv completion without immediate")?;
            let i = imm.wrapping_sub(0x5EED_0000);
            if i >= n || imm != 0x5EED_0000 + seen {
                return Err(
                    format!("immediate {imm:#x} out of order (expected index {seen})").into(),
                );
            }
            let off = i as usize * len;
            check_eq(
                &format!("write-imm slice {i}"),
                &read(&b.buf, off, len)?,
                &datas[i as usize],
            )?;
            if c.byte_len as usize != len {
                println!(
                    "note: write-imm recv byte_len={} (payload {len})",
                    c.byte_len
                );
            }
            seen += 1;
        }
    }
    let ids: Vec<u64> = (0..n).map(|i| 400 + u64::from(i)).collect();
    for c in wait_all(&a.scq, &ids)? {
        expect_ok(&c, CompletionOp::RdmaWrite)?;
    }
    println!("PASS write-with-imm x{n} (imm in order, data verified on arrival)");
    Ok(())
}

fn test_read(a: &Side, b: &Side) -> R<()> {
    let sizes = [4 * KIB, 64 * KIB, MIB, 4 * MIB];
    for (i, &len) in sizes.iter().enumerate() {
        let d = pattern(7000 + i as u64, len);
        let src = 6 * MIB + 11;
        b.buf.copy_in(src, &d)?;
        a.buf.fill(0, len, 0)?;
        let wr = 600 + i as u64;
        a.qp.post_read(wr, &[a.buf.mr().sge(0, len)?], b.buf.mr().remote(src, len)?)?;
        expect_ok(&wait_for(&a.scq, wr)?, CompletionOp::RdmaRead)?;
        check_eq(&format!("read {len}B"), &read(&a.buf, 0, len)?, &d)?;
    }
    println!("PASS read sizes 4KiB..4MiB");
    Ok(())
}

fn expect_remote_access_error(a: &Side, wr_id: u64) -> R<()> {
    let c = wait_for(&a.scq, wr_id)?;
    match &c.result {
        Err(e) if e.status == WcStatus::RemoteAccess => {
            println!("  -> typed error: {e}");
            Ok(())
        }
        other => Err(format!("expected RemoteAccess error, got {other:?}").into()),
    }
}

fn test_errors_and_recreate(a: &mut Side, b: &mut Side) -> R<()> {
    // local bounds are refused before anything is posted
    match a.buf.mr().sge(BUF - 10, 100) {
        Err(VerbsError::OutOfBounds { .. }) => {}
        other => return Err(format!("local OOB sge: expected OutOfBounds, got {other:?}").into()),
    }
    let too_many = vec![a.buf.mr().sge(0, 8)?; a.qp.caps().max_send_sge as usize + 1];
    match a
        .qp
        .post_write(1, &too_many, b.buf.mr().remote(0, 8)?, true)
    {
        Err(VerbsError::TooManySge { .. }) => {}
        other => return Err(format!("too many sges: expected TooManySge, got {other:?}").into()),
    }

    // bad rkey
    let len = 4096;
    b.buf.fill(0, len, 0x11)?;
    a.buf.copy_in(0, &pattern(42, len))?;
    let mut remote = b.buf.mr().remote(0, len)?;
    remote.rkey ^= 0x00A5_5A00;
    a.qp.post_write(900, &[a.buf.mr().sge(0, len)?], remote, true)?;
    expect_remote_access_error(a, 900)?;
    if read(&b.buf, 0, len)?.iter().any(|&x| x != 0x11) {
        return Err("bad-rkey write modified the target".into());
    }
    println!("PASS bad rkey -> RemoteAccess completion, target untouched");

    recreate_qps(a, b, 1)?;
    // out-of-bounds remote address: the tail of the write falls past B's region
    let remote = b.buf.mr().remote(0, 1)?.offset((BUF - 100) as u64);
    a.qp.post_write(901, &[a.buf.mr().sge(0, len)?], remote, true)?;
    expect_remote_access_error(a, 901)?;
    println!("PASS out-of-bounds remote address -> RemoteAccess completion");

    recreate_qps(a, b, 2)?;
    write_and_verify(a, b, 902, 0, 4096, 256 * KIB)?;
    println!("PASS QP re-creation, good write verified after errors");

    Ok(())
}

/// A dead peer: B's QP disappears (replaced by an unconnected one); A's write must end in a
/// typed `RetryExceeded` completion after its retries, not hang.
fn test_dead_peer(a: &mut Side, b: &mut Side) -> R<()> {
    let len = 4096;
    b.qp = b.pd.create_rc_qp(&b.scq, &b.rcq, caps(&b.ctx))?;
    let t = Instant::now();
    a.qp.post_write(
        903,
        &[a.buf.mr().sge(0, len)?],
        b.buf.mr().remote(0, len)?,
        true,
    )?;
    let c = wait_for(&a.scq, 903)?;
    match &c.result {
        Err(e) if e.status == WcStatus::RetryExceeded => {
            println!(
                "  -> typed error after {:.2} s: {e}",
                t.elapsed().as_secs_f64()
            )
        }
        other => return Err(format!("dead peer: expected RetryExceeded, got {other:?}").into()),
    }
    println!("PASS dead peer -> RetryExceeded completion");
    recreate_qps(a, b, 3)?;
    write_and_verify(a, b, 904, 0, 4096, 64 * KIB)?;
    println!("PASS good write after dead-peer recovery");
    Ok(())
}

/// Moving a QP to the error state flushes its outstanding receives (`WrFlush`), the way a
/// transport drains a QP before destroying it.
fn test_flush(a: &mut Side, b: &mut Side) -> R<()> {
    let ids: Vec<u64> = (0..4).map(|i| 7000 + i).collect();
    for &id in &ids {
        b.qp.post_recv(id, &[])?;
    }
    b.qp.set_error()?;
    for c in wait_all(&b.rcq, &ids)? {
        match &c.result {
            Err(e) if e.status == WcStatus::WrFlush => {}
            other => return Err(format!("flush: expected WrFlush, got {other:?}").into()),
        }
    }
    println!("PASS set_error flushes outstanding receives (4 x WrFlush)");
    recreate_qps(a, b, 4)?;
    write_and_verify(a, b, 905, 0, 4096, 16 * KIB)?;
    Ok(())
}

fn bandwidth(a: &Side, b: &Side, len: usize, iters: usize) -> R<f64> {
    let slots = (BUF / len).min(iters).max(1);
    for s in 0..slots {
        a.buf.copy_in(s * len, &pattern(9000 + s as u64, len))?;
    }
    b.buf.fill(0, slots * len, 0)?;
    let depth = (a.qp.caps().max_send_wr as usize).min(128);
    let sges: Vec<Sge> = (0..slots)
        .map(|s| a.buf.mr().sge(s * len, len))
        .collect::<Result<_, _>>()?;
    let remotes = (0..slots)
        .map(|s| b.buf.mr().remote(s * len, len))
        .collect::<Result<Vec<_>, _>>()?;
    let (mut posted, mut done) = (0usize, 0usize);
    let mut got = Vec::new();
    let t0 = Instant::now();
    while done < iters {
        while posted < iters && posted - done < depth {
            let s = posted % slots;
            a.qp.post_write(posted as u64, &sges[s..s + 1], remotes[s], true)?;
            posted += 1;
        }
        got.clear();
        a.scq.wait(&mut got, 64, WAIT)?;
        for c in &got {
            expect_ok(c, CompletionOp::RdmaWrite)?;
        }
        done += got.len();
    }
    let secs = t0.elapsed().as_secs_f64();
    for s in 0..slots {
        check_eq(
            &format!("bw slot {s}"),
            &read(&b.buf, s * len, len)?,
            &pattern(9000 + s as u64, len),
        )?;
    }
    let mbps = (len * iters) as f64 / secs / 1e6;
    println!(
        "SELFTEST-BW op=write size={len} iters={iters} depth={depth} bytes={} secs={secs:.3} MB/s={mbps:.1} (all {slots} target slots verified)",
        len * iters
    );
    Ok(mbps)
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Runs the self-test; `Ok(false)` means skipped (devices missing), `Err` a failed check.
pub fn run(args: &[String]) -> R<bool> {
    let dev_a = arg(args, "--dev-a")
        .unwrap_or_else(|| std::env::var("KVWIRE_RXE_DEV1").unwrap_or_else(|_| "rxe1".into()));
    let dev_b = arg(args, "--dev-b")
        .unwrap_or_else(|| std::env::var("KVWIRE_RXE_DEV0").unwrap_or_else(|_| "rxe0".into()));
    let iters_64k: usize = arg(args, "--iters-64k")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1000);
    let iters_1m: usize = arg(args, "--iters-1m")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(64);

    let verbs = match Verbs::load() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("SKIPPED: libibverbs not available: {e}");
            return Ok(false);
        }
    };
    let devices = verbs.devices()?;
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    if !names.contains(&dev_a.as_str()) || !names.contains(&dev_b.as_str()) {
        eprintln!("SKIPPED: need devices {dev_a} and {dev_b}, have {names:?}");
        return Ok(false);
    }
    let t0 = Instant::now();
    let mut a = open_side(&verbs, &dev_a)?;
    let mut b = open_side(&verbs, &dev_b)?;
    connect(&a, &b, 0)?;
    println!(
        "connected {} qp {} -> {} qp {}",
        a.name,
        a.qp.qpn(),
        b.name,
        b.qp.qpn()
    );
    let only = arg(args, "--only");
    let on = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|x| x == name))
    };
    if on("write") {
        test_write_sizes(&a, &b)?;
    }
    if on("sg") {
        test_sg(&a, &b)?;
    }
    if on("imm") {
        test_write_with_imm(&a, &b)?;
    }
    if on("read") {
        test_read(&a, &b)?;
    }
    if on("errors") {
        test_errors_and_recreate(&mut a, &mut b)?;
    }
    if on("deadpeer") {
        test_dead_peer(&mut a, &mut b)?;
    }
    if on("flush") {
        test_flush(&mut a, &mut b)?;
    }
    if on("bw") {
        bandwidth(&a, &b, 64 * KIB, iters_64k)?;
        bandwidth(&a, &b, MIB, iters_1m)?;
    }
    println!(
        "SELFTEST-OK all checks passed in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(true)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let require = std::env::var("KVWIRE_REQUIRE_RDMA").is_ok_and(|v| v == "1");
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) if require => {
            eprintln!("KVWIRE_REQUIRE_RDMA=1: skipping is a failure");
            ExitCode::from(1)
        }
        Ok(false) => ExitCode::SUCCESS,
        Err(e) => {
            println!("SELFTEST-FAIL {e}");
            ExitCode::from(1)
        }
    }
}
