"""Which P and which D serve a request.

A policy is an object with ``pick(prefill, decode, info) -> (p, d)``: ``prefill`` and
``decode`` are the healthy backends (:class:`kvwire.proxy.backends.Backend`, never empty),
``info`` a :class:`RequestInfo`; ``p`` may be None to keep the request on D alone (no
disaggregation, no ``kv_transfer_params``). Built in:

* ``round_robin`` — each in turn, P and D independently;
* ``least_load`` — fewest requests (this proxy's in flight plus the backend's running and
  waiting from its last ``/metrics``), ties in turn;
* ``pdsep`` — a reference PD-separation gate. Requests of one session (the body's ``user``,
  or an ``X-Session-Id`` header) go back to the D and P that served its last turn while they
  are healthy (else least loaded), and the gate assumes their prefix caches still hold that
  turn's prompt: the *uncached tail* on D is the prompt minus it. A tail under
  ``--pdsep-min-tokens`` stays on D. Otherwise, with the router's cost model (``--cost``,
  :mod:`kvwire.costs`), it compares the predicted decode_sent→first_token clock through P
  (transfer of the whole prompt's KV, P's own uncached tail and queue, D's step) with what the
  tail costs on D itself (``prefill_s_per_token`` × tail and D's step, plus the stall it imposes
  on D's running requests, weighted by ``--pdsep-interference``), and takes the cheaper;
* ``module:callable`` — ``callable(options)`` returns the policy (``options`` is the parsed
  command line).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


class PolicyError(ValueError):
    """A policy that cannot be loaded or configured."""


@dataclass
class RequestInfo:
    path: str
    prompt_tokens: int
    estimated: bool  # prompt_tokens counted from text, not token ids
    session: str | None = None


class RoundRobin:
    def __init__(self):
        self._n = {"p": 0, "d": 0}

    def _next(self, role, backends):
        b = backends[self._n[role] % len(backends)]
        self._n[role] += 1
        return b

    def pick(self, prefill, decode, info):
        return self._next("p", prefill), self._next("d", decode)


def _busy(b) -> int:
    return b.inflight + int(b.load.get("running", 0)) + int(b.load.get("waiting", 0))


class LeastLoad(RoundRobin):
    def _least(self, role, backends):
        low = min(_busy(b) for b in backends)
        return self._next(role, [b for b in backends if _busy(b) == low])

    def pick(self, prefill, decode, info):
        return self._least("p", prefill), self._least("d", decode)


class PdSepGate(LeastLoad):
    #: sessions remembered (least recently used go first)
    MAX_SESSIONS = 65536

    def __init__(self, model, *, bytes_per_token: int, layers: int, min_tokens: int = 0,
                 interference: float = 1.0, quantile: str = "p50"):
        super().__init__()
        self.model = model
        self.bytes_per_token = bytes_per_token
        self.layers = layers
        self.min_tokens = min_tokens
        self.interference = interference
        self.quantile = quantile
        self.decisions = {"pd": 0, "local": 0}
        self.sessions: dict[str, dict] = {}  # session -> {"p": url, "d": url, "p_tokens": n, "d_tokens": n}

    def costs(self, p, d, tokens: int, p_tail: int, d_tail: int) -> tuple[float, float]:
        """(predicted clock through P, predicted cost of the tail's prefill on D), seconds."""
        dw, dr = int(d.load.get("waiting", 0)), int(d.load.get("running", 0)) + d.inflight
        pw = int(p.load.get("waiting", 0)) + int(p.load.get("running", 0)) + p.inflight
        t_pd = self.model.predict(bytes=tokens * self.bytes_per_token, layers=self.layers, dst_waiting=dw,
                                  dst_running=dr, prefill_tokens=p_tail, src_waiting=pw, quantile=self.quantile)
        t = self.model.terms[self.quantile]
        prefill = t.prefill_s_per_token * d_tail
        t_local = prefill + t.d_step_s * (1 + dr) + t.d_queue_s_per_waiting * dw + self.interference * dr * prefill
        return t_pd, t_local

    @staticmethod
    def _sticky(url, backends):
        return next((b for b in backends if b.url == url), None) if url else None

    def pick(self, prefill, decode, info):
        p, d = super().pick(prefill, decode, info)
        seen = self.sessions.pop(info.session, None) if info.session else None
        seen = seen or {}
        d = self._sticky(seen.get("d"), decode) or d
        p = self._sticky(seen.get("p"), prefill) or p
        tokens = info.prompt_tokens
        d_tail = tokens - min(tokens, seen.get("d_tokens", 0)) if d.url == seen.get("d") else tokens
        p_tail = tokens - min(tokens, seen.get("p_tokens", 0)) if p.url == seen.get("p") else tokens
        local = d_tail < self.min_tokens
        if not local:
            t_pd, t_local = self.costs(p, d, tokens, p_tail, d_tail)
            local = t_local < t_pd
        self.decisions["local" if local else "pd"] += 1
        if info.session:
            seen = dict(seen, d=d.url, d_tokens=tokens)
            if not local:
                seen.update(p=p.url, p_tokens=tokens)
            self.sessions[info.session] = seen
            if len(self.sessions) > self.MAX_SESSIONS:
                self.sessions.pop(next(iter(self.sessions)))
        return (None if local else p), d


BUILT_IN = ("round_robin", "least_load", "pdsep")


def load_policy(name: str, options):
    """The policy called ``name`` (one of :data:`BUILT_IN`, or ``module:callable``)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "pdsep":
        from kvwire.costs import CostModel, CostModelError

        if not getattr(options, "cost", None):
            raise PolicyError("policy pdsep needs --cost cost.json (written by kvwire-bench calibrate)")
        try:
            model = CostModel.load(options.cost)
        except (OSError, CostModelError) as e:
            raise PolicyError(f"policy pdsep: {options.cost}: {e}") from e
        if options.kv_bytes_per_token <= 0 or options.layers <= 0:
            raise PolicyError("policy pdsep needs --kv-bytes-per-token and --layers of the served model")
        return PdSepGate(model, bytes_per_token=options.kv_bytes_per_token, layers=options.layers,
                         min_tokens=options.pdsep_min_tokens, interference=options.pdsep_interference,
                         quantile=options.pdsep_quantile)
    mod, sep, attr = name.partition(":")
    if not sep or not mod or not attr:
        raise PolicyError(f"policy {name!r} is not one of {', '.join(BUILT_IN)} nor module:callable")
    try:
        factory = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise PolicyError(f"policy {name!r}: {e}") from e
    policy = factory(options)
    if not callable(getattr(policy, "pick", None)):
        raise PolicyError(f"policy {name!r}: {attr}(options) returned {policy!r}, which has no pick()")
    return policy
