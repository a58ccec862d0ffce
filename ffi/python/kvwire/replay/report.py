"""The replay's figures: TTFT, TPOT and E2E percentiles overall and per prompt class."""

from __future__ import annotations

import math

#: (name, lowest prompt tokens, highest + 1)
CLASSES = (("<5k", 0, 5000), ("5-20k", 5000, 20000), ("20-50k", 20000, 50000), (">50k", 50000, math.inf))
METRICS = ("ttft_s", "tpot_s", "e2e_s")
QUANTILES = (50, 90, 99)


def quantile(xs: list, q: float) -> float | None:
    """The ``q``-th percentile, linear between closest ranks (None for no values)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results) -> dict:
    def block(rs):
        out = {"requests": len(rs), "errors": sum(1 for r in rs if r.error)}
        ok = [r for r in rs if not r.error]
        for m in METRICS:
            vals = [getattr(r, m) for r in ok if getattr(r, m) is not None]
            out[m] = {f"p{q}": quantile(vals, q) for q in QUANTILES}
        return out

    report = {"overall": block(list(results)), "classes": {}}
    for name, lo, hi in CLASSES:
        rs = [r for r in results if lo <= r.prompt_tokens < hi]
        if rs:
            report["classes"][name] = block(rs)
    report["error_samples"] = [f"{r.session} turn {r.turn} (line {r.line}): {r.error}"
                               for r in results if r.error][:10]
    prompt = sum(r.prompt_tokens for r in results)
    report["prompt_tokens"] = prompt
    report["cached_tokens"] = sum(r.cached_tokens for r in results)
    report["reuse"] = report["cached_tokens"] / prompt if prompt else 0.0
    return report


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def markdown(report: dict) -> str:
    head = "| class | requests | errors | " + " | ".join(
        f"{m[:-2].upper()} p{q} ms" for m in METRICS for q in QUANTILES) + " |"
    lines = [head, "|" + "---|" * (3 + len(METRICS) * len(QUANTILES))]
    rows = [("all", report["overall"])] + list(report["classes"].items())
    for name, b in rows:
        lines.append(f"| {name} | {b['requests']} | {b['errors']} | " + " | ".join(
            _ms(b[m][f"p{q}"]) for m in METRICS for q in QUANTILES) + " |")
    lines.append("")
    lines.append(f"prompt tokens {report['prompt_tokens']}, of them a prefix of the session's previous turn "
                 f"{report['cached_tokens']} ({report['reuse'] * 100:.1f} %)")
    for e in report["error_samples"]:
        lines.append(f"- error: {e}")
    return "\n".join(lines) + "\n"
