"""``ab.json`` and ``ab.md``."""

from __future__ import annotations

import json
import os


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _settled(st, what: str) -> str:
    """How a wait for quiet servers ended (:func:`kvwire.ab.engine.settle`): ``what`` is what
    the CPU seen while waiting would otherwise have been counted in."""
    if not st:
        return ""
    if st["settled"]:
        return f"quiet after {st['seconds']:.1f} s ({st['busy_cpu_s']:.2f} CPU s)"
    return f"**not quiet after {st['seconds']:.1f} s** ({st['busy_cpu_s']:.2f} CPU s, in {what})"


def _warm_up(g: str, w: dict) -> str:
    before = _settled(w.get("settle_before"), "the warm-up")
    after = _settled(w.get("settle"), "the first arm")
    return (g + (f" {before}, then" if before else "")
            + f" {w['seconds']:.1f} s, first TTFT {_ms((w['ttft_s'] or [None])[0])} ms"
            + (f", {w['errors']} errors" if w["errors"] else "") + (f", then {after}" if after else ""))


def markdown(ab: dict) -> str:
    lines = [f"# kvwire A/B — {ab['requests']} requests per arm, model {ab['model']}, block {ab['block_size']}, "
             f"{ab['host_cores']} cores{' (quick)' if ab['quick'] else ''}"
             + (f", stand-in compute {ab['standin_token_us']:g} µs per layer and token" if ab.get("standin_token_us") else ""),
             ""]
    lines.append("| arm | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms | E2E p50 / p90 ms | errors | outputs = single |")
    lines.append("|---|---|---|---|---|---|")
    for r in ab["arms"]:
        if r["status"] != "ran":
            lines.append(f"| {r['arm']} | {r['status'].upper()} | | | | |")
            continue
        o = r["replay"]["overall"]
        eq = r["outputs_equal_single"]
        lines.append(f"| {r['arm']} | {_ms(o['ttft_s']['p50'])} / {_ms(o['ttft_s']['p90'])} / {_ms(o['ttft_s']['p99'])} "
                     f"| {_ms(o['tpot_s']['p50'])} / {_ms(o['tpot_s']['p90'])} "
                     f"| {_ms(o['e2e_s']['p50'])} / {_ms(o['e2e_s']['p90'])} | {o['errors']} "
                     f"| {eq['equal']}/{eq['of']} |")
    ran = [r for r in ab["arms"] if r["status"] == "ran" and r.get("engine")]
    if ran:
        lines += ["", "What each arm cost its servers during the replay: busy engine-core step interval (stand-in "
                  "step events) and CPU seconds of every thread:", ""]
        lines.append("| arm | server | step p50 / p90 ms | busy steps | CPU s | threads | top threads (CPU s) |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in ran:
            for name, e in r["engine"].items():
                st, cpu = e.get("steps"), e["cpu"]
                top = ", ".join(f"{t['name']} {t['cpu_s']:.2f}" for t in cpu["by_thread"][:3])
                lines.append(f"| {r['arm']} | {name} | "
                             + (f"{_ms(st['p50_s'])} / {_ms(st['p90_s'])} | {st['count']}" if st else "- | -")
                             + f" | {cpu['total_s']:.2f} | {cpu['threads']} | {top} |")
    pd = [r for r in ab["arms"] if r["status"] == "ran" and r["group"] == "pd"]
    if pd:
        lines += ["", "P/D arms, from the connectors' timelines (D's clock; means of the decomposition):", ""]
        lines.append("| arm | decode_sent→first_token p50 / p90 ms | wait for P | reservation wait | exposed transfer "
                     "| report delay | promotion delay | first step | exposed tail p90 ms | D block-s | wire MB | failed |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in pd:
            t = r["timeline"]
            dec = t["decomposition_mean_s"]
            lines.append(f"| {r['arm']} | {_ms(t['clock_s']['p50'])} / {_ms(t['clock_s']['p90'])} | "
                         + " | ".join(_ms(dec[k]) for k in dec)
                         + f" | {_ms(t['exposed_tail_s']['p90'])} | {t['d_block_seconds']:.2f} "
                         f"| {t['wire_bytes'] / 1e6:.2f} | {t['failed']} |")
    warm = {}
    for r in ab["arms"]:
        if r.get("warmup"):
            warm.setdefault(r["group"], r["warmup"])
    if warm:
        lines += ["", "Warm-up before each group's arms (2 requests with other prompts, not in the figures above; "
                  "before and after it, a wait until the servers use no CPU — vLLM 0.33 runs start-up helpers "
                  "for seconds after it is ready): " + "; ".join(_warm_up(g, w) for g, w in warm.items())]
        for g, w in warm.items():
            lines += [f"- {g} warm-up error: {e}" for e in w.get("error_samples", ())]
    bad = [r for r in ab["arms"] if r["status"] != "ran"]
    for r in bad:
        lines += ["", f"**{r['arm']}: {r['status']}**", "", "```", r.get("error", "")[-800:], "```"]
    if not bad:
        lines += ["", "Every arm ran."]
    return "\n".join(lines) + "\n"


def write(ab: dict, out: str) -> None:
    with open(os.path.join(out, "ab.json"), "w", encoding="utf-8") as f:
        json.dump(ab, f, indent=2)
    with open(os.path.join(out, "ab.md"), "w", encoding="utf-8") as f:
        f.write(markdown(ab))
