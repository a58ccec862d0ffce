"""``kv_connector_extra_config`` and ``kv_transfer_params``: what the connector accepts.

Extra config (every timeout in seconds; defaults chosen so that a loaded cluster survives them,
see :data:`TIMEOUTS`):

* ``policy``: ``eager`` | ``lazy`` (default) | ``jit`` | ``land``; ``send_mode``: ``whole``
  (default) | ``layerwise``. A request may override both in its ``kv_transfer_params``
  (``kvwire_policy``, ``kvwire_send_mode``): one deployment can A/B them per request.
* ``control_listen`` (scheduler), ``data_listen`` (worker; TP rank r listens on port + r),
  ``advertise_host`` (what peers are told to connect to when a listen host is ``0.0.0.0``;
  default: this host's address towards the peer), ``secret``, ``transport`` (of the data
  engines; control messages always go over TCP, so no control engine opens an RDMA device),
  ``layers``.
* ``rdma_near``: the PCI address of the device whose memory a worker's data engine moves; its
  RDMA transport then opens only the NICs nearest it in the PCI tree (``auto``, the default:
  the worker's CUDA device when it has one, else every active NIC; ``""``: every active NIC).
  Named NICs (``KVWIRE_RDMA_DEVICE``) win over it.
* ``land_pool_blocks``: slots of D's landing pool, per layer, in host memory (GPU memory with
  ``staging: device`` and a CUDA cache) (default 1024
  with policy ``land``, else 0; set it to let requests override the policy to ``land``).
* ``timeline_path``: a directory; each engine and role writes its timeline there as JSON lines
  (bounded buffer, rotated by size: ``timeline_max_mb``, default 64; ``timeline_files``,
  default 4).
* ``stats_interval``, ``staging`` (``auto``, ``always``, ``never``, or ``device``: CUDA caches
  registered as device regions, reached by ``cuda_ipc`` on one host and by RDMA with GPUDirect
  across hosts), ``staging_mb``, ``d_landing`` (``pool``, the default, or ``mirror``: where a
  staged D lands P's writes): see :mod:`kvwire.vllm.staging`.
* ``bootstrap_port`` (P, MooncakeConnector compatibility): the port of the HTTP bootstrap
  endpoint that a router written for MooncakeConnector queries (``GET /query``); default
  ``$VLLM_MOONCAKE_BOOTSTRAP_PORT`` or 8998; ``0`` turns it off.

``kv_transfer_params`` (per request), kvwire's style:

* D: ``{"do_remote_prefill": true, "transfer_id": X, "remote_control": "P-host:port"}``
* P: ``{"do_remote_decode": true, "transfer_id": X, "remote_control": "D-host:port"}``

and vLLM MooncakeConnector's style, accepted unchanged:

* D: ``{"do_remote_prefill": true, "transfer_id": X, "remote_engine_id": E,
  "remote_bootstrap_addr": "http://P-host:8998"}`` — D asks P's bootstrap endpoint for P's
  control address (once per P, off the scheduler thread) and checks P's engine id;
* P: ``{"do_remote_decode": true, "transfer_id": X}`` — P learns D from D's first message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import kvwire

POLICIES = ("eager", "lazy", "jit", "land")
SEND_MODES = ("whole", "layerwise")

#: Timeouts (seconds) and their defaults. The users' TTFT tail under load is 40-45 s (p99, in
#: the study); nothing that a healthy but loaded cluster does may hit a default:
#: * ``heartbeat_interval`` 1 s, ``peer_timeout`` 15 s: heartbeats go from the connector's own
#:   thread, not from scheduler steps, so silence means a dead, partitioned or stalled peer; 15 s
#:   rides out GIL stalls of a busy engine core and short network hiccups. A silent peer's
#:   requests fail (those whose blocks it may still write drain first), but it is not given up
#:   for its silence: only a drain that times out tears its connection down (and on D fences
#:   it), so a peer that was only stalled keeps serving.
#: * ``wait_for_p_timeout`` 60 s: arrival on D until P acknowledges the request (P reports it
#:   queued as soon as its scheduler knows it); afterwards D waits as long as P is alive.
#: * ``request_timeout`` 600 s: arrival until every layer landed, a bound on a stuck request.
#: * ``block_ids_timeout`` 300 s (P): prefill done until D's block ids; a lazy/jit D under
#:   memory pressure reserves late.
#: * ``transfer_timeout`` 60 s (P): no progress while writes are in flight.
#: * ``drain_timeout`` 30 s: a failed request's blocks wait this long for the peer's
#:   confirmation before its connection is torn down.
#: * ``orphan_timeout`` 600 s: messages for a request the receiver has not seen yet (P's queue
#:   can hold a request for a long time after D announced it).
#: * ``connect_timeout`` 5 s: one connection attempt (in the control plane's own threads).
TIMEOUTS = {
    "heartbeat_interval": 1.0,
    "peer_timeout": 15.0,
    "wait_for_p_timeout": 60.0,
    "request_timeout": 600.0,
    "block_ids_timeout": 300.0,
    "transfer_timeout": 60.0,
    "drain_timeout": 30.0,
    "orphan_timeout": 600.0,
    "tombstone_ttl": 600.0,
    "connect_timeout": 5.0,
}
D_TIMEOUTS = ("heartbeat_interval", "peer_timeout", "wait_for_p_timeout", "request_timeout",
              "drain_timeout", "orphan_timeout", "tombstone_ttl")
P_TIMEOUTS = ("heartbeat_interval", "peer_timeout", "request_timeout", "block_ids_timeout",
              "transfer_timeout", "drain_timeout", "orphan_timeout", "tombstone_ttl")


def _seconds(extra: dict, name: str) -> float:
    raw = extra.get(name, TIMEOUTS[name])
    try:
        v = float(raw)
    except (TypeError, ValueError):
        v = -1.0
    if not (v > 0 and v < 1e9):
        raise kvwire.InvalidArgumentError(f"{name} must be a number of seconds > 0, got {raw!r}")
    return v


def _int(extra: dict, name: str, default: int, lo: int = 0) -> int:
    raw = extra.get(name, default)
    try:
        v = int(raw)
    except (TypeError, ValueError):
        v = lo - 1
    if v < lo:
        raise kvwire.InvalidArgumentError(f"{name} must be an integer >= {lo}, got {raw!r}")
    return v


@dataclass
class Options:
    """The parsed extra config of one connector instance."""

    policy: str
    send_mode: str
    timeouts: dict
    control_listen: str
    data_listen: str
    advertise_host: str | None
    secret: bytes | None
    transport: str
    rdma_near: str
    land_pool_blocks: int
    timeline_path: str | None
    timeline_max_bytes: int
    timeline_files: int
    bootstrap_port: int
    stats_interval_ns: int

    @classmethod
    def parse(cls, extra: dict) -> "Options":
        policy = extra.get("policy", "lazy")
        if policy not in POLICIES:
            raise kvwire.InvalidArgumentError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        mode = extra.get("send_mode", "whole")
        if mode not in SEND_MODES:
            raise kvwire.InvalidArgumentError(f"send_mode must be one of {', '.join(SEND_MODES)}, got {mode!r}")
        unknown = [k for k in extra if k.endswith("_timeout") and k not in TIMEOUTS]
        if unknown:
            raise kvwire.InvalidArgumentError(f"unknown timeout(s) {unknown}; known: {sorted(TIMEOUTS)}")
        secret = extra.get("secret")
        try:
            interval = float(extra.get("stats_interval", 0.1))
        except (TypeError, ValueError):
            interval = -1.0
        if not (interval >= 0 and interval < 1e9):
            raise kvwire.InvalidArgumentError(
                f"stats_interval must be a number of seconds >= 0, got {extra.get('stats_interval')!r}")
        bport = extra.get("bootstrap_port", os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", 8998))
        return cls(
            policy=policy,
            send_mode=mode,
            timeouts={k: _seconds(extra, k) for k in TIMEOUTS},
            control_listen=str(extra.get("control_listen", "127.0.0.1:0")),
            data_listen=str(extra.get("data_listen", "127.0.0.1:0")),
            advertise_host=extra.get("advertise_host") or None,
            secret=secret.encode() if isinstance(secret, str) else secret,
            transport=str(extra.get("transport", "auto")),
            rdma_near=str(extra.get("rdma_near", "auto")),
            land_pool_blocks=_int(extra, "land_pool_blocks", 1024 if policy == "land" else 0),
            timeline_path=extra.get("timeline_path") or None,
            timeline_max_bytes=int(float(extra.get("timeline_max_mb", 64)) * (1 << 20)),
            timeline_files=_int(extra, "timeline_files", 4, lo=1),
            bootstrap_port=_int({"bootstrap_port": bport}, "bootstrap_port", 8998),
            stats_interval_ns=int(interval * 1e9),
        )

    def core_timeouts(self, names) -> dict:
        return {n: self.timeouts[n] for n in names}


@dataclass
class DParams:
    """A D request's ``kv_transfer_params``."""

    transfer_id: str
    remote_control: str | None  # P's control address (kvwire style)
    bootstrap: str | None  # P's bootstrap endpoint (MooncakeConnector style)
    remote_engine_id: str | None
    policy: str | None


@dataclass
class PParams:
    """A P request's ``kv_transfer_params``."""

    transfer_id: str
    remote_control: str | None  # D's control address; None in MooncakeConnector style
    send_mode: str | None


def _override(params: dict, key: str, allowed) -> str | None:
    v = params.get(key)
    if v is None:
        return None
    if v not in allowed:
        raise kvwire.InvalidArgumentError(f"{key} must be one of {', '.join(allowed)}, got {v!r}")
    return v


def d_params(params: dict, req_id: str) -> DParams | None:
    """The D side of ``kv_transfer_params``, or None if the request is not a remote prefill.
    Raises ``kvwire.InvalidArgumentError`` for one that names no P."""
    if not params or not params.get("do_remote_prefill"):
        return None
    rc = params.get("remote_control")
    boot = params.get("remote_bootstrap_addr")
    if not rc and not boot:
        raise kvwire.InvalidArgumentError(
            "do_remote_prefill needs remote_control (kvwire) or remote_bootstrap_addr (MooncakeConnector)")
    return DParams(transfer_id=str(params.get("transfer_id", req_id)), remote_control=str(rc) if rc else None,
                   bootstrap=str(boot) if boot and not rc else None,
                   remote_engine_id=params.get("remote_engine_id"),
                   policy=_override(params, "kvwire_policy", POLICIES))


def p_params(params: dict, req_id: str) -> PParams | None:
    """The P side of ``kv_transfer_params``, or None if the request is not sent to a D."""
    if not params or not params.get("do_remote_decode"):
        return None
    rc = params.get("remote_control")
    return PParams(transfer_id=str(params.get("transfer_id", req_id)), remote_control=str(rc) if rc else None,
                   send_mode=_override(params, "kvwire_send_mode", SEND_MODES))
