"""Backends: a vLLM server the proxy sends requests to, with what it knows of its health and load.

A backend is named on the command line as ``URL[,key=value...]``::

    http://10.0.0.1:8000,control=10.0.0.1:7100                 # kvwire style: its control address
    http://10.0.0.1:8000,bootstrap=http://10.0.0.1:8998,engine_id=p0   # MooncakeConnector style

``control`` is the kvwire connector's ``control_listen`` (as the other side dials it);
``bootstrap`` and ``engine_id`` are a P's MooncakeConnector bootstrap endpoint and engine id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

KEYS = ("control", "bootstrap", "engine_id")


class BackendError(ValueError):
    """A backend specification that cannot be used."""


@dataclass
class Backend:
    url: str
    role: str  # "p" or "d"
    control: str | None = None
    bootstrap: str | None = None
    engine_id: str | None = None
    healthy: bool = True
    inflight: int = 0  # requests this proxy has in flight on it
    load: dict = field(default_factory=dict)  # {"waiting": n, "running": n} from its /metrics
    checked_at: float = 0.0
    last_error: str | None = None

    @property
    def name(self) -> str:
        return self.url

    def load_now(self) -> dict:
        """What the record of a request keeps of this backend's load when it is sent there."""
        out = {k: v for k, v in self.load.items() if k in ("waiting", "running")}
        out["inflight"] = self.inflight
        return out

    def status(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy, "inflight": self.inflight,
                "load": dict(self.load), "last_error": self.last_error,
                "checked_s_ago": round(time.monotonic() - self.checked_at, 3) if self.checked_at else None}


def parse_backend(spec: str, role: str) -> Backend:
    """``URL[,key=value...]`` (see the module docstring)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise BackendError(f"empty {role.upper()} backend")
    url = parts[0].rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1]) == 0:
        raise BackendError(f"{role.upper()} backend {spec!r}: the first item must be its http:// URL")
    kw = {}
    for p in parts[1:]:
        k, sep, v = p.partition("=")
        if not sep or k not in KEYS or not v:
            raise BackendError(f"{role.upper()} backend {spec!r}: {p!r} is not one of "
                               + ", ".join(f"{k}=..." for k in KEYS))
        kw[k] = v
    return Backend(url=url, role=role, **kw)


def parse_metrics(text: str) -> dict:
    """``waiting`` and ``running`` (summed over label sets) from a vLLM ``/metrics`` page."""
    want = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running"}
    out: dict = {}
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.partition("{")[0]
        key = want.get(name)
        if key is None:
            continue
        try:
            out[key] = out.get(key, 0) + int(float(value))
        except ValueError:
            continue
    return out
