#!/usr/bin/env python3
"""Side-by-side table: kvwire vs the peer engines and ceilings of ONE run_all pass.

Usage: python3 compare.py RUN_DIR     (a results/run_<stamp>/ directory holding summary.txt,
                                       mooncake_tcp.json, nixl_ucx_*.json, kvwire_*.json)
Prints markdown. GB/s = 1e9 B/s. Figures come only from the files; a missing one prints '-'.

Targets checked (as ratios within the run):
  tcp: serial GB/s >= 0.9 x tcp_write_ack GB/s at every size >= 64 KiB
       4 KiB serial p50 <= 1.4 x tcp_write_ack 4 KiB p50
       KV-layer GB/s (median round) >= 0.9 x iperf3 -P 1
       batch-8 GB/s >= 0.9 x iperf3 -P 1 at sizes >= 1 MiB
       serial GB/s >= 2 x Mooncake TE tcp serial GB/s at 4 KiB and 64 KiB
  shm: serial GB/s >= 0.9 x CMA (process_vm_writev, shm_bench best of 3) at sizes >= 64 KiB
       serial and batch GB/s >= NIXL UCX sm at every size; KV >= NIXL UCX sm
       4 KiB serial p50 <= 5 us
  cpu: tcp CPU s/GB (initiator + target) <= 0.5 x Mooncake TE's at every size >= 64 KiB
       shm CPU s/GB <= one single-thread memcpy pass's at every size >= 64 KiB
"""
import json
import os
import re
import sys

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB]


def hsize(n):
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def sections(text):
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"== (\S+)", line)
        if m:
            cur = m.group(1)
            out[cur] = []
        elif cur:
            out[cur].append(line)
    return out


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def peer_rows(d):
    """mooncake/nixl json -> {size: (p50_us, serial_GBps, batch_GBps)}, kv (p50_us, GBps)."""
    if not d:
        return {}, None
    rows = {r["size"]: (r["p50_us"], r["serial_GBps"], r["batch_GBps"]) for r in d.get("sizes", [])}
    k = d.get("kv")
    kv = (k["layer_p50_us"], k["GBps_median_round"]) if k else None
    return rows, kv


def kvwire_rows(d):
    """kvwire json -> {size: (p50_us, serial_GBps, batch_GBps)}, kv (p50_us, GBps), verified."""
    if not d:
        return {}, None, None
    ser = {r["size"]: r for r in d["results"] if r["pattern"] == "serial"}
    bat = {r["size"]: r for r in d["results"] if r["pattern"] == "batch"}
    rows = {s: (ser[s]["p50_us"], ser[s]["gbps"], bat[s]["gbps"] if s in bat else None) for s in ser}
    kv = None
    for r in d["results"]:
        if r["pattern"] == "kv_layer":
            kv = (r["p50_us"], r.get("kv", {}).get("gbps_median_round", r["gbps"]))
    return rows, kv, d.get("verified")


def cpu_rows(d, kind):
    """{size: CPU s/GB initiator+target of the serial writes}, and of the KV layer, from a kvwire
    (kind 'kvwire') or peer json; a side not reported makes the sum None."""
    if not d:
        return {}, None

    def both(c):
        if not isinstance(c, dict) or c.get("initiator") is None or c.get("target") is None:
            return None
        return c["initiator"] + c["target"]

    if kind == "kvwire":
        rows = {r["size"]: both(r.get("cpu_s_per_gb")) for r in d["results"] if r["pattern"] == "serial"}
        kv = next((both(r.get("cpu_s_per_gb")) for r in d["results"] if r["pattern"] == "kv_layer"), None)
        return rows, kv
    rows = {r["size"]: both(r.get("cpu_s_per_GB_serial")) for r in d.get("sizes", [])}
    return rows, both((d.get("kv") or {}).get("cpu_s_per_GB"))


def timed_notes(d):
    """'serial 0, batch 0, kv_layer 240' from a kvwire json (old files: 'not reported')."""
    if not d:
        return "no data"
    per = {}
    for r in d.get("results", []):
        if "timed_notifications" not in r:
            return "not reported"
        per[r["pattern"]] = per.get(r["pattern"], 0) + r["timed_notifications"]
    return ", ".join(f"{k} {v}" for k, v in per.items())


def f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def main():
    run = sys.argv[1]
    summ = open(os.path.join(run, "summary.txt")).read()
    sec = sections(summ)
    twa, cma, iperf, memcpy = {}, {}, {}, {}
    for ln in sec.get("tcp_write_ack", []):
        p = ln.split()
        if len(p) >= 5 and p[0].isdigit():
            twa[int(p[0])] = (float(p[2]), float(p[4]))  # p50_us, GB/s
    for ln in sec.get("shm", []):
        p = ln.split()
        if len(p) >= 4 and p[0] == "cma-write" and p[1].isdigit():
            cma[int(p[1])] = float(p[2])  # best of 3, as RESULTS.md's aggregate uses
    for ln in sec.get("iperf3", []):
        m = re.match(r"iperf3 (.+?)\s*:\s*([0-9.]+) Gbit/s =\s*([0-9.]+) GB/s", ln)
        if m:
            iperf[m.group(1).strip()] = float(m.group(3))
    for ln in sec.get("memcpy", []):
        p = ln.split()
        if len(p) >= 2 and p[0].isdigit():
            memcpy[int(p[0])] = float(p[1])
    mc, mc_kv = peer_rows(load_json(os.path.join(run, "mooncake_tcp.json")))
    nt, nt_kv = peer_rows(load_json(os.path.join(run, "nixl_ucx_tcp.json")))
    ns, ns_kv = peer_rows(load_json(os.path.join(run, "nixl_ucx_shm.json")))
    kt, kt_kv, kt_ok = kvwire_rows(load_json(os.path.join(run, "kvwire_tcp.json")))
    ks, ks_kv, ks_ok = kvwire_rows(load_json(os.path.join(run, "kvwire_shm.json")))
    c_mc, c_mc_kv = cpu_rows(load_json(os.path.join(run, "mooncake_tcp.json")), "peer")
    c_nt, c_nt_kv = cpu_rows(load_json(os.path.join(run, "nixl_ucx_tcp.json")), "peer")
    c_ns, c_ns_kv = cpu_rows(load_json(os.path.join(run, "nixl_ucx_shm.json")), "peer")
    c_kt, c_kt_kv = cpu_rows(load_json(os.path.join(run, "kvwire_tcp.json")), "kvwire")
    c_ks, c_ks_kv = cpu_rows(load_json(os.path.join(run, "kvwire_shm.json")), "kvwire")
    memcpy_cpu = {sz: 1.0 / g for sz, g in memcpy.items() if g > 0}  # one single-thread pass, s/GB
    ip1 = iperf.get("-P 1")
    loads = re.findall(r"== (\S+)\s+\[(\S+) loadavg ([0-9. ]+)\]", summ)

    print(f"# kvwire vs peers, one run: `{run}`\n")
    print(summ.splitlines()[0] if summ else "")
    print("\nStart of each entry (time, 1/5/15-min loadavg): " + "; ".join(f"{n} {t} [{l.strip()}]" for n, t, l in loads))
    print(f"\nkvwire verified every byte: tcp={kt_ok}, shm={ks_ok}. GB/s = 1e9 B/s. p50 in microseconds.")
    print("kvwire GB/s = bytes / summed submit-to-completion time (data generation and checks between "
          "operations excluded); tcp_write_ack and the peer scripts divide by their loop's wall time. "
          "CMA = shm_bench cma-write best of 3.")
    for name, d in (("tcp", load_json(os.path.join(run, "kvwire_tcp.json"))),
                    ("shm", load_json(os.path.join(run, "kvwire_shm.json")))):
        print(f"kvwire {name} notifications inside timed sections: " + timed_notes(d) + ".")
    if all(timed_notes(load_json(os.path.join(run, f))) not in ("not reported", "no data")
           for f in ("kvwire_tcp.json", "kvwire_shm.json")):
        print("kvwire serial/batch writes carry no notification (as the peers'); the target checks every byte "
          "from records (ranges + CRC-32) sent as tag-only batches between timed operations; destinations "
          "cycle through a window of max(1 MiB, 8 slots) (tcp_write_ack: 2 slots, NIXL: 8). "
          "kvwire KV layer: one notification per layer inside the timed section, as the connector sends.")

    print("\n## TCP (127.0.0.1)\n")
    print("| size | kvwire p50 | kvwire serial | kvwire batch-8 | tcp_write_ack p50 | tcp_write_ack GB/s | iperf3 -P1 | Mooncake TE p50 | Mooncake serial | Mooncake batch-8 | NIXL UCX tcp serial | NIXL UCX tcp batch-8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in SIZES:
        k = kt.get(s, (None, None, None))
        t = twa.get(s, (None, None))
        m = mc.get(s, (None, None, None))
        n = nt.get(s, (None, None, None))
        print(f"| {hsize(s)} | {f(k[0], 1)} | {f(k[1])} | {f(k[2])} | {f(t[0], 1)} | {f(t[1])} | {f(ip1)} | {f(m[0], 1)} | {f(m[1])} | {f(m[2])} | {f(n[1])} | {f(n[2])} |")
    print("\n## Shared memory / same host\n")
    print("| size | kvwire shm p50 | kvwire shm serial | kvwire shm batch-8 | CMA process_vm_writev | memcpy 1-thread | NIXL UCX sm p50 | NIXL sm serial | NIXL sm batch-8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in SIZES:
        k = ks.get(s, (None, None, None))
        n = ns.get(s, (None, None, None))
        print(f"| {hsize(s)} | {f(k[0], 1)} | {f(k[1])} | {f(k[2])} | {f(cma.get(s))} | {f(memcpy.get(s))} | {f(n[0], 1)} | {f(n[1])} | {f(n[2])} |")
    print("\n## KV layer (48 layers x 32 writes of 256 KiB, one batch per layer; GB/s = median round)\n")
    print("| engine | layer p50 us | GB/s |\n|---|---|---|")
    for name, kv in (("kvwire tcp", kt_kv), ("Mooncake TE tcp", mc_kv), ("NIXL UCX tcp", nt_kv),
                     ("kvwire shm", ks_kv), ("NIXL UCX sm", ns_kv)):
        print(f"| {name} | {f(kv[0] if kv else None, 0)} | {f(kv[1] if kv else None)} |")
    print(f"| iperf3 -P 1 (ceiling) | - | {f(ip1)} |")

    print("\n## CPU seconds per GB moved (initiator + target processes, all threads; serial writes)\n")
    print("kvwire: the initiator's CPU inside its timed sections, the target's between the verdicts around the "
          "row less its verifier thread's; Mooncake TE and NIXL: both processes' getrusage over their serial "
          "loop. One memcpy pass = 1 / memcpy 1-thread GB/s.\n")
    print("| size | kvwire tcp | Mooncake TE tcp | NIXL UCX tcp | kvwire shm | NIXL UCX sm | one memcpy pass |")
    print("|---|---|---|---|---|---|---|")
    for sz in SIZES:
        print(f"| {hsize(sz)} | {f(c_kt.get(sz), 2)} | {f(c_mc.get(sz), 2)} | {f(c_nt.get(sz), 2)} | "
              f"{f(c_ks.get(sz), 2)} | {f(c_ns.get(sz), 2)} | {f(memcpy_cpu.get(sz), 2)} |")
    print(f"| KV layer | {f(c_kt_kv, 2)} | {f(c_mc_kv, 2)} | {f(c_nt_kv, 2)} | {f(c_ks_kv, 2)} | {f(c_ns_kv, 2)} | - |")

    checks = []  # (target, measured ratio or value, threshold, op)

    def add(name, val, thr, ge=True):
        ok = None if val is None else (val >= thr if ge else val <= thr)
        checks.append((name, val, thr, ge, ok))

    for s in SIZES[1:]:
        add(f"tcp serial {hsize(s)} / tcp_write_ack", ratio(kt.get(s, (0, None))[1], twa.get(s, (0, None))[1]), 0.9)
    add("tcp 4 KiB p50 / tcp_write_ack p50", ratio(kt.get(4 * KIB, (None,))[0], twa.get(4 * KIB, (None,))[0]), 1.4, ge=False)
    add("tcp KV layer / iperf3 -P1", ratio(kt_kv[1] if kt_kv else None, ip1), 0.9)
    for s in SIZES[2:]:
        add(f"tcp batch-8 {hsize(s)} / iperf3 -P1", ratio(kt.get(s, (0, 0, None))[2], ip1), 0.9)
    for s in SIZES[:2]:
        add(f"tcp serial {hsize(s)} / Mooncake TE serial", ratio(kt.get(s, (0, None))[1], mc.get(s, (0, None))[1]), 2.0)
    for s in SIZES[1:]:
        add(f"shm serial {hsize(s)} / CMA", ratio(ks.get(s, (0, None))[1], cma.get(s)), 0.9)
    for s in SIZES:
        add(f"shm serial {hsize(s)} / NIXL UCX sm serial", ratio(ks.get(s, (0, None))[1], ns.get(s, (0, None))[1]), 1.0)
        add(f"shm batch-8 {hsize(s)} / NIXL UCX sm batch-8", ratio(ks.get(s, (0, 0, None))[2], ns.get(s, (0, 0, None))[2]), 1.0)
    add("shm KV layer / NIXL UCX sm KV", ratio(ks_kv[1] if ks_kv else None, ns_kv[1] if ns_kv else None), 1.0)
    add("shm 4 KiB p50 (us)", ks.get(4 * KIB, (None,))[0], 5.0, ge=False)
    for sz in SIZES[1:]:
        add(f"tcp CPU/GB {hsize(sz)} / Mooncake TE CPU/GB", ratio(c_kt.get(sz), c_mc.get(sz)), 0.5, ge=False)
    for sz in SIZES[1:]:
        add(f"shm CPU/GB {hsize(sz)} / one memcpy pass", ratio(c_ks.get(sz), memcpy_cpu.get(sz)), 1.0, ge=False)

    print("\n## Targets (ratios measured in this run)\n")
    print("| target | measured | needed | result |\n|---|---|---|---|")
    for name, val, thr, ge, ok in checks:
        res = "no data" if ok is None else ("PASS" if ok else "FAIL")
        print(f"| {name} | {f(val, 2)} | {'>=' if ge else '<='} {thr} | {res} |")
    npass = sum(1 for c in checks if c[4])
    nfail = sum(1 for c in checks if c[4] is False)
    print(f"\n{npass} pass, {nfail} fail, {len(checks) - npass - nfail} without data.")


if __name__ == "__main__":
    main()
