"""The scheduler half of ``KvwireConnector``: the P/D protocol cores, driven off the scheduler
thread.

vLLM's scheduler hooks (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``, ``request_finished``) only feed events
into the cores and read what they decided, under one lock; they never wait on the network. The
connector's own **driver thread** takes the peers' messages from the control plane
(:mod:`kvwire.vllm.control`), feeds them into the cores, handles their deadlines and sends what
they ask for. So block ids, transfers, completion reports and heartbeats move while the engine
is idle (vLLM 0.18.1 stops stepping an idle engine; 0.33 keeps a P stepping only while
``has_pending_push_work`` says so).

Data does not go through here either: D's block ids go from the driver straight to P's workers
(a ``WORK`` message to each TP rank's data engine), which write every (chunk, layer) piece as
soon as their forward computed it (:mod:`kvwire.vllm.worker`), and report back (``REPORT``).

Cores: one per reservation policy (D) and per send mode (P), created on first use, so a request
can override the instance's policy or send mode in its ``kv_transfer_params``. Peers are
identified by their engine id and incarnation (:mod:`kvwire.vllm.envelope`), mapped to the
cores' peer numbers here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import kvwire
from kvwire import core as kcore
from kvwire.vllm import compat
from kvwire.vllm import descriptor as _desc
from kvwire.vllm import envelope as env
from kvwire.vllm import options as _opts
from kvwire.vllm import stats as _stats
from kvwire.vllm.control import ControlPlane
from kvwire.vllm.stats import KvwireConnectorStats
from kvwire.vllm.timeline import TimelineWriter

logger = logging.getLogger("kvwire.vllm")

#: Messages kept per request that arrive before the request is known here (and in total).
EARLY_PER_KEY, EARLY_MAX = 64, 65536


def request_key(transfer_id: str) -> int:
    """The 64-bit request id both sides derive from the shared transfer id."""
    return int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little")


def _now() -> int:
    return time.monotonic_ns()


def scheduler_loads() -> dict:
    """``{"waiting": n, "running": n}`` of the vLLM scheduler that is calling the connector (its
    frame is on the stack; read-only, best effort: ``{}`` when it is not found)."""
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            break
        s = f.f_locals.get("self")
        if s is not None and hasattr(s, "waiting") and hasattr(s, "running"):
            try:
                return {"waiting": len(s.waiting), "running": len(s.running)}
            except TypeError:
                return {}
        f = f.f_back
    return {}


@dataclass
class _DReq:
    req: str
    key: int
    pid: int
    policy: str
    core: object
    prompt: int
    blocks: int
    transfer_id: str
    hit: int = 0  # blocks of the local prefix hit told to the core
    failed_early: bool = False
    delayed: bool = False  # aborted by vLLM, blocks held until the core releases them
    recv_sent: bool = False  # listed in finished_recving, the workers' report not back
    reported: bool = False
    promoted: bool = False
    first_pending: bool = False
    slots: list | None = None  # land: landing-pool slots
    loads: dict = field(default_factory=dict)
    request: object = None  # vLLM's Request (see build_connector_meta)


@dataclass
class _PReq:
    req: str
    key: int
    pid: int | None  # None until D is known (MooncakeConnector-style params, or its hello)
    addr: str | None  # D's control address from the request, if any
    mode: str
    core: object
    prompt: int
    transfer_id: str
    blocks: list = field(default_factory=list)
    scheduled: bool = False
    queued_sent: bool = False
    finished: bool = False  # vLLM finished it (blocks held until sent)
    delayed: bool = False
    loads: dict = field(default_factory=dict)
    first_write_ns: int | None = None
    unreachable: bool = False
    finished_at: int = 0
    # workers' reports (all ranks) that came before the core knew the request: (what, layer, bytes, t)
    early_reports: list = field(default_factory=list)


class SchedulerSide:
    """See the module docstring."""

    def __init__(self, c):
        o = c.opts
        self.c = c
        self.opts = o
        kt = c._vllm_config.kv_transfer_config
        self.engine_id = str(getattr(kt, "engine_id", None) or f"kvwire-{random.getrandbits(48):012x}")
        self.incarnation = random.getrandbits(63) | 1
        self.lock = threading.RLock()
        self.descriptor = _desc.describe(c._vllm_config, c._layers, c._tp)
        self.rank_addrs: list[str] = []  # our workers' data addresses, in rank order
        self.worker_ctl: list[str] = []  # our workers' control addresses (their work goes there)
        self.control = ControlPlane(engine_id=self.engine_id, incarnation=self.incarnation,
                                    listen=o.control_listen, secret=o.secret, transport="tcp",
                                    advertise_host=o.advertise_host,
                                    connect_timeout=o.timeouts["connect_timeout"], hello=self._hello,
                                    name="sched")
        if c._tp == 1 and not o.data_listen.endswith(":0"):
            self.rank_addrs = [o.data_listen]
        self.d_cores: dict[str, object] = {}
        self.p_cores: dict[str, object] = {}
        # peers: core peer number <-> engine id / address we reach it at
        self.pid_of_engine: dict[str, int] = {}
        self.addr_of_pid: dict[int, str] = {}  # the address the peer advertises
        self.dialled_of_pid: dict[int, str] = {}  # the address we reached it at
        self.unreachable: set[str] = set()  # addresses that could not be dialled
        # addresses whose engine answered our hello on the connection now up (see _pid_for_addr)
        self.answered: set[str] = set()
        self.redial_of: dict[str, int] = {}  # D request -> failed dials of its P's address when it asked
        self.engine_of_pid: dict[int, str] = {}
        self.heard: set[int] = set()
        self.incompatible: dict[int, list[str]] = {}
        self._next_pid = 1
        # requests
        self.d_reqs: dict[str, _DReq] = {}
        self.d_by_key: dict[int, _DReq] = {}
        self.p_reqs: dict[str, _PReq] = {}
        self.p_by_key: dict[int, _PReq] = {}
        self.early: dict[int, list] = {}
        self.early_n = 0
        # requests that ended, kept briefly for their timeline records (which come after)
        self.ended: dict[tuple, object] = {}
        # P: (key, layer) -> {rank: report} of what the workers reported
        self.p_reports: dict[tuple, dict] = {}
        # D's landing pool (policy land): free slot ids
        self.land_free = list(range(o.land_pool_blocks - 1, -1, -1))
        # bootstrap endpoints (MooncakeConnector style) -> resolved control address or error
        self.resolved: dict[str, str | Exception | None] = {}
        # for the workers, drained into the next step's metadata
        self.out_recv: set[str] = set()
        self.out_failed: dict[str, list] = {}
        self.out_sending: set[str] = set()
        self.out_land: dict[str, tuple] = {}
        self.out_fence: list[str] = []
        self.out_unfence: list[str] = []  # lifted after this step's fences
        self.fenced: dict[str, list] = {}  # engine id -> its data addresses fenced
        self.inc_of_engine: dict[str, int] = {}  # the incarnation of its last message
        self.restarted: set[str] = set()  # engines heard in a new incarnation since the last actions
        self.stats_at = None
        self.stats_pending = False  # requests moved since the last snapshot
        self.deltas = _stats.DeltaTracker("scheduler")
        self.timeline = None
        if o.timeline_path:
            role = "pd" if c._is_producer and c._is_consumer else ("p" if c._is_producer else "d")
            self.timeline = TimelineWriter(o.timeline_path, self.engine_id, role, o.timeline_max_bytes, o.timeline_files)
        self.bootstrap = None
        if c._is_producer and o.bootstrap_port:
            from kvwire.vllm.bootstrap import BootstrapServer

            self.bootstrap = BootstrapServer(o.bootstrap_port, lambda: {"engine_id": self.engine_id,
                                                                        "kvwire_control": self.control.addr})
        # The configured policy's and send mode's cores exist from the start (their gauges are
        # in the stats at once); others appear with the first request that asks for them.
        if c._is_consumer:
            self.d_core(o.policy)
        if c._is_producer:
            self.p_core(o.send_mode)
        self._stop = False
        self._driver = threading.Thread(target=self._drive, name="kvwire-driver", daemon=True)
        self._driver.start()

    # ---- identity ----
    def _hello(self) -> dict:
        return {"role": "p" if self.c._is_producer else "d", "both": self.c._is_producer and self.c._is_consumer,
                "descriptor": self.descriptor, "data": list(self.rank_addrs), "engine_id": self.engine_id}

    def _pid_for_addr(self, addr: str) -> int | None:
        """The core peer number of the engine at ``addr`` (an address from a request), or None
        while its identity is not known yet: the first use of an address dials it and waits for
        the engine there to answer our hello (one round trip, once per peer). An address that
        cannot be reached is in ``self.unreachable``."""
        eid = self.control.engine_at.get(addr)
        if eid is None or addr not in self.answered:
            # Unknown, or its connection was lost since it last answered (it may have restarted:
            # the same engine id in a new incarnation): its next hello reply says who is there.
            self.control.probe(addr)
            return None
        pid = self._pid_for_engine(eid, self.control.addr_of.get(eid, addr))
        self.dialled_of_pid.setdefault(pid, addr)
        return pid

    def _pid_for_engine(self, eid: str, control: str) -> int:
        """The core peer number of engine ``eid``."""
        pid = self.pid_of_engine.get(eid)
        if pid is None:
            pid = self._next_pid
            self._next_pid += 1
            self.pid_of_engine[eid] = pid
            self.engine_of_pid[pid] = eid
        if control:
            self.addr_of_pid[pid] = control
        return pid

    # ---- cores ----
    def d_core(self, policy: str):
        core = self.d_cores.get(policy)
        if core is None:
            core = self.d_cores[policy] = kcore.DCore(
                policy, self.c._layers, transport="kvwire", incarnation=self.incarnation,
                **self.opts.core_timeouts(_opts.D_TIMEOUTS))
        return core

    def p_core(self, mode: str):
        core = self.p_cores.get(mode)
        if core is None:
            core = self.p_cores[mode] = kcore.PCore(
                mode, self.c._layers, transport="kvwire", incarnation=self.incarnation, announce_destination=True,
                **self.opts.core_timeouts(_opts.P_TIMEOUTS))
        return core

    def _cores(self):
        return list(self.d_cores.values()) + list(self.p_cores.values())

    # ---- driver thread ----
    def _drive(self) -> None:
        while not self._stop:
            now = _now()
            due = [t for core in self._cores() if (t := core.poll_timeout()) is not None]
            wait = 0.5 if not due else max(0.0, min(0.5, (min(due) - now) / 1e9))
            msgs, evs = self.control.recv(wait)
            if self._stop:
                break
            with self.lock:
                now = _now()
                for e in msgs:
                    self._on_envelope(e, now)
                for kind, addr in evs:
                    self._on_reachability(kind, addr, now)
                for core in self._cores():
                    t = core.poll_timeout()
                    if t is not None and t <= now:
                        core.handle_timeout(now)
                self._expire_early(now)
                self._expire_unbound(now)
                self._run_actions(now)

    def _on_reachability(self, kind: str, addr: str, now: int) -> None:
        """An address that cannot be dialled before its engine ever answered: requests naming
        it fail (a dead peer or a wrong address) once a dial made after they arrived failed too,
        instead of waiting for a deadline. A peer known before is judged by its heartbeats; a
        lost connection means its engine is identified afresh before the next request binds."""
        if kind == "reachable":
            self.unreachable.discard(addr)
            return
        self.answered.discard(addr)
        if kind == "refused":
            eid = self.control.engine_at.get(addr)
            pid = self.pid_of_engine.get(eid) if eid else None
            if pid is not None:
                logger.warning("kvwire: peer %s at %s refuses connections: it is down", eid, addr)
                for core in self._cores():
                    self._core_call(core.peer_down, pid, now, quiet=True)
            if eid is not None:
                # Whoever answers there next is identified afresh (a restart is a new peer):
                # requests naming the address wait for its hello instead of joining the dead one.
                self.control.engine_at.pop(addr, None)
        elif addr not in self.control.engine_at:
            self.unreachable.add(addr)
            for st in list(self.p_reqs.values()):
                if st.pid is None and st.addr == addr:
                    logger.warning("kvwire: request %s: D at %s cannot be reached", st.req, addr)
                    st.unreachable = True

    def _on_envelope(self, e, now: int) -> None:
        if e.kind == env.REPORT:
            self._on_report(e.payload)
            return
        prev = self.inc_of_engine.get(e.engine_id)
        self.inc_of_engine[e.engine_id] = e.incarnation
        if prev is not None and prev != e.incarnation:
            self.restarted.add(e.engine_id)
            # A new incarnation of that engine: a fence left on the old one is lifted (the old
            # process is gone, and the new one's data engine announces the same addresses).
            self.out_unfence.extend(self.fenced.pop(e.engine_id, []))
            # The old incarnation's requests end with it; the new one is a new core peer, so
            # requests that meet it from now on are not failed as the old one's.
            old = self.pid_of_engine.pop(e.engine_id, None)
            if old is not None:
                logger.warning("kvwire: peer %s restarted (incarnation %x -> %x)", e.engine_id, prev, e.incarnation)
                for core in self._cores():
                    self._core_call(core.peer_down, old, now, quiet=True)
        if e.kind in (env.HELLO, env.HELLO_REPLY):
            if e.kind == env.HELLO_REPLY:
                reached = self.control.peer_hello.get(e.engine_id, {}).get("reached_as")
                if isinstance(reached, str):
                    self.answered.add(reached)
            pid = self._pid_for_engine(e.engine_id, e.control)
            self.heard.add(pid)
            self._check_peer(pid, self.control.peer_hello.get(e.engine_id, {}))
            # P requests waiting for this peer's identity (their D address answered)
            for st in list(self.p_reqs.values()):
                if st.pid is None and st.addr is not None and self.control.engine_at.get(st.addr) == e.engine_id:
                    self._bind_p_peer(st, pid, now)
            return
        if e.kind not in (env.TO_P, env.TO_D):
            return
        pid = self._pid_for_engine(e.engine_id, e.control)
        self.heard.add(pid)
        to_p = e.kind == env.TO_P
        key = env.message_request(e.payload)
        if key is None:  # a heartbeat: every core of that side hears it
            for core in (self.p_cores if to_p else self.d_cores).values():
                self._feed(core, pid, e.payload, now)
            return
        if to_p:
            st = self.p_by_key.get(key)
            if st is not None and st.pid is None:
                self._bind_p_peer(st, pid, now)
            core = st.core if st is not None and st.scheduled else None
        else:
            st = self.d_by_key.get(key)
            core = st.core if st is not None else None
        if core is None:
            self._buffer_early(key, to_p, pid, e.payload, now)
            return
        self._feed(core, pid, e.payload, now)

    def _feed(self, core, pid: int, payload: bytes, now: int) -> None:
        try:
            core.message(pid, payload, now)
        except kvwire.ConnectorError as err:
            logger.warning("kvwire: message from peer %s refused: %s", self.engine_of_pid.get(pid, pid), err)

    def _buffer_early(self, key: int, to_p: bool, pid: int, payload: bytes, now: int) -> None:
        lst = self.early.setdefault(key, [])
        if len(lst) >= EARLY_PER_KEY or self.early_n >= EARLY_MAX:
            return
        lst.append((to_p, pid, payload, now))
        self.early_n += 1

    def _replay_early(self, key: int, to_p: bool, core, now: int) -> None:
        lst = self.early.pop(key, None)
        if not lst:
            return
        self.early_n -= len(lst)
        for is_p, pid, payload, _ in lst:
            if is_p == to_p:
                self._feed(core, pid, payload, now)

    def _expire_early(self, now: int) -> None:
        if not self.early:
            return
        ttl = int(self.opts.timeouts["orphan_timeout"] * 1e9)
        for key in [k for k, v in self.early.items() if v and now - v[0][3] > ttl]:
            self.early_n -= len(self.early.pop(key))

    def _expire_unbound(self, now: int) -> None:
        """P requests that finished their prefill while D was unknown, and D never showed up:
        their blocks go back after block_ids_timeout."""
        ttl = int(self.opts.timeouts["block_ids_timeout"] * 1e9)
        for st in list(self.p_reqs.values()):
            if not st.scheduled and st.finished and (st.unreachable or now - st.finished_at > ttl):
                logger.warning("kvwire: request %s: no D came for it; its blocks are released", st.req)
                self.out_sending.add(st.req)
                self._forget_p(st)

    def _check_peer(self, pid: int, hello: dict) -> None:
        theirs = hello.get("descriptor") or {}
        bad = _desc.mismatch(self.descriptor, theirs)
        if bad and pid not in self.incompatible:
            logger.error("kvwire: peer %s (%s) is incompatible with this instance, no KV is transferred "
                         "between them: %s", self.engine_of_pid.get(pid, pid), self.addr_of_pid.get(pid), "; ".join(bad))
        if bad:
            self.incompatible[pid] = bad
        else:
            self.incompatible.pop(pid, None)

    def _bind_p_peer(self, st: _PReq, pid: int, now: int) -> None:
        """MooncakeConnector-style P request: D's first message names the D."""
        st.pid = pid
        self._p_queued(st, now)

    # ---- actions ----
    def _send(self, pid: int, kind: int, data: bytes) -> None:
        addr = self.dialled_of_pid.get(pid) or self.addr_of_pid.get(pid)
        if addr is None:
            eid = self.engine_of_pid.get(pid)
            addr = self.control.addr_of.get(eid) if eid else None
        if addr is None:
            logger.warning("kvwire: no address for peer %s: message dropped", pid)
            return
        self.control.send(addr, kind, data, droppable=env.message_request(data) is None)

    def _run_actions(self, now: int) -> None:
        for policy, core in list(self.d_cores.items()):
            for a in core.poll_actions():
                self._d_action(core, a, now)
            for rec in core.poll_timeline():
                self._record(rec, "d")
        for mode, core in list(self.p_cores.items()):
            for a in core.poll_actions():
                self._p_action(core, a, now)
            for rec in core.poll_timeline():
                self._record(rec, "p")
        self.restarted.clear()

    def _d_action(self, core, a, now: int) -> None:
        if isinstance(a, kcore.Send):
            self._send(a.peer, env.TO_P, a.data)
            return
        st = self.d_by_key.get(getattr(a, "req", None))
        if isinstance(a, kcore.MayLand):
            if st is not None and len(self.land_free) >= a.blocks:
                st.slots = [self.land_free.pop() for _ in range(a.blocks)]
                self._core_call(core.landing, a.req, st.slots, now)
            else:
                self._core_call(core.land_fallback, a.req, now)
        elif isinstance(a, kcore.ReleaseLanding):
            self.land_free.extend(a.slots)
            if st is not None:
                st.slots = None
        elif isinstance(a, kcore.ReportFinished):
            if st is not None:
                if st.slots is not None:  # land: the workers copy the slots into the blocks first
                    self.out_land[st.req] = (list(st.slots), list(core.reserved_blocks(a.req)))
                self.out_recv.add(st.req)
        elif isinstance(a, kcore.ReportFailed):
            if st is None:
                return
            if st.delayed:
                pass  # vLLM aborted it already: its blocks are freed through the release path
            elif a.blocks:
                self.out_failed[st.req] = list(a.blocks)
            else:
                st.failed_early = True
            logger.warning("kvwire: request %s failed on D: %s", st.req, a.reason)
        elif isinstance(a, kcore.ReleaseBlocks):
            if st is not None and st.delayed:
                st.delayed = False
                self.out_sending.add(st.req)
                self._forget_d(st)
        elif isinstance(a, kcore.DisconnectPeer):
            # Nothing of that P may land any more: its workers' connections to ours are fenced
            # before the blocks the core releases next are reused.
            eid = self.engine_of_pid.get(a.peer, "")
            addrs = list(self.control.peer_hello.get(eid, {}).get("data") or [])
            self.out_fence.extend(addrs)
            if eid in self.restarted:
                # A new incarnation of it was heard since the last actions: the old process is gone,
                # closing its connections (and waiting for its copies) is all the fence is for.
                self.out_unfence.extend(addrs)
            elif eid:
                # It may still be alive: refused until a new incarnation of it shows up.
                self.fenced[eid] = addrs
        # MayReserve: polled in get_num_new_matched_tokens

    def _p_action(self, core, a, now: int) -> None:
        if isinstance(a, kcore.Send):
            self._send(a.peer, env.TO_D, a.data)
            return
        st = self.p_by_key.get(getattr(a, "req", None))
        if isinstance(a, kcore.Destination):
            self._p_destination(core, st, a, now)
        elif isinstance(a, kcore.ReleaseBlocks):
            if st is not None:
                if st.delayed:
                    self.out_sending.add(st.req)
                self._forget_p(st)
        elif isinstance(a, kcore.CancelTransfers):
            self._to_workers({"op": "cancel", "key": a.req})
        elif isinstance(a, kcore.ReportFailed):
            logger.warning("kvwire: request %s failed on P: %s", st.req if st else a.req, a.reason)
            self._to_workers({"op": "cancel", "key": a.req})
        elif isinstance(a, kcore.DisconnectPeer):
            hello = self.control.peer_hello.get(self.engine_of_pid.get(a.peer, ""), {})
            self._to_workers({"op": "drop", "addrs": hello.get("data") or []})
        # Transfer: the workers move each (chunk, layer) themselves once they have the
        # destination; the core's transfer is settled by their LAYER_SENT reports.

    def _p_destination(self, core, st: _PReq | None, a, now: int) -> None:
        eid = self.engine_of_pid.get(a.peer)
        hello = self.control.peer_hello.get(eid, {}) if eid else {}
        bad = self.incompatible.get(a.peer)
        data = hello.get("data") or []
        if st is None:
            return
        if not hello or bad or len(data) != self.c._tp:
            why = ("incompatible: " + "; ".join(bad)) if bad else (
                "no hello from D yet" if not hello else
                f"D announced {len(data)} data address(es), one per tensor parallel rank, this P has {self.c._tp}")
            logger.warning("kvwire: request %s: no transfer to D %s (%s)", st.req, eid or a.peer, why)
            for layer in range(self.c._layers):
                self._core_call(core.transfer_failed, a.req, layer, now, quiet=True)
            return
        self._to_workers({"op": "dst", "key": a.req, "first": a.first, "dst": list(a.dst),
                          "landing": a.landing, "d_data": data})

    def _to_workers(self, work: dict) -> None:
        payload = env.to_json(work)
        for addr in self.worker_ctl:
            self.control.send(addr, env.WORK, payload)

    def _core_call(self, fn, *args, quiet: bool = False) -> bool:
        """Feeds one event into a core; False (logged unless ``quiet``) when the core refused it."""
        try:
            fn(*args)
            return True
        except kvwire.ConnectorError as e:
            if not quiet:
                logger.warning("kvwire: %s refused: %s", getattr(fn, "__name__", fn), e)
            return False

    def _on_report(self, payload: bytes) -> None:
        try:
            what, key, layer, ok, nbytes, rank, t = env.parse_report(payload)
        except ValueError:
            self.control.bad_messages += 1
            return
        if rank >= self.c._tp:
            self.control.bad_messages += 1
            return
        st = self.p_by_key.get(key)
        if st is None:
            return
        if what == env.FIRST_BYTE:
            st.first_write_ns = t if st.first_write_ns is None else min(st.first_write_ns, t)
            return
        slot = self.p_reports.setdefault((key, what, layer), {})
        if rank in slot:
            return
        slot[rank] = (ok, nbytes, t)
        if len(slot) < self.c._tp:
            return
        del self.p_reports[(key, what, layer)]
        t_all = max(v[2] for v in slot.values())
        ok = all(v[0] for v in slot.values())
        nbytes = sum(v[1] for v in slot.values())
        if not st.scheduled:
            st.early_reports.append((what, layer, ok, nbytes, t_all))
            return
        self._apply_report(st, what, layer, ok, nbytes, t_all)

    def _apply_report(self, st: _PReq, what: int, layer: int, ok: bool, nbytes: int, t_all: int) -> None:
        key = st.key
        if what == env.LAYER_READY:
            self._core_call(st.core.layer_ready, key, layer, t_all, quiet=True)
        elif what == env.PREFILL_DONE:
            self._core_call(st.core.prefill_done, key, t_all, quiet=True)
        elif what == env.LAYER_SENT:
            if ok:
                self._core_call(st.core.transfer_done, key, layer, nbytes, t_all, quiet=True)
            else:
                self._core_call(st.core.transfer_failed, key, layer, t_all, quiet=True)

    def _record(self, line: str, side: str) -> None:
        if self.timeline is None:
            return
        try:
            rec = json.loads(line)
        except ValueError:
            return
        key = rec.get("req")
        st = (self.d_by_key if side == "d" else self.p_by_key).get(key) or self.ended.get((side, key))
        rec["role"] = side
        rec["engine_id"] = self.engine_id
        if st is not None:
            rec["transfer_id"] = st.transfer_id
            rec.update(st.loads)
            pid = st.pid
            if side == "p" and st.first_write_ns is not None:
                rec["p_first_write"] = st.first_write_ns
            if pid is not None:
                eid = self.engine_of_pid.get(pid)
                rec["peer_engine_id"] = eid
                if eid:
                    off, err = self.control.clock_of(eid)
                    rec["clock_offset_ns"], rec["clock_error_ns"] = off, err
        self.timeline.put(rec)

    def _forget_d(self, st: _DReq) -> None:
        self.d_reqs.pop(st.req, None)
        self.d_by_key.pop(st.key, None)
        self._remember(("d", st.key), st)

    def _forget_p(self, st: _PReq) -> None:
        self.p_reqs.pop(st.req, None)
        self.p_by_key.pop(st.key, None)
        for k in [k for k in self.p_reports if k[0] == st.key]:
            del self.p_reports[k]
        self._remember(("p", st.key), st)

    def _remember(self, k, st) -> None:
        self.ended[k] = st
        if len(self.ended) > 4096:
            for old in list(self.ended)[:1024]:
                del self.ended[old]

    # ---- D: vLLM hooks ----
    def _resolve_bootstrap(self, url: str) -> None:
        def run():
            try:
                with urllib.request.urlopen(url.rstrip("/") + "/query", timeout=self.opts.timeouts["connect_timeout"]) as r:
                    info = json.loads(r.read())
                ent = info.get("0") or next(iter(info.values()))
                addr = ent.get("kvwire_control")
                if not addr:
                    raise ValueError(f"{url} is not a kvwire P (no kvwire_control in its /query answer)")
                self.resolved[url] = addr
            except Exception as e:  # noqa: BLE001 - any failure is an answer for the request
                logger.warning("kvwire: bootstrap %s: %s", url, e)
                self.resolved[url] = e

        self.resolved[url] = None
        threading.Thread(target=run, name="kvwire-bootstrap", daemon=True).start()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self.c._is_consumer:
            return 0, False
        params = getattr(request, "kv_transfer_params", None) or {}
        try:
            dp = _opts.d_params(params, request.request_id)
        except kvwire.InvalidArgumentError as e:
            logger.warning("kvwire: request %s: %s", request.request_id, e)
            return 0, False
        if dp is None:
            return 0, False
        req = request.request_id
        bs = self.c._block_size
        tokens = request.num_prompt_tokens - num_computed_tokens
        with self.lock:
            st = self.d_reqs.get(req)
            if st is None:
                addr = dp.remote_control
                if addr is None:
                    r = self.resolved.get(dp.bootstrap, "missing")
                    if r == "missing":
                        self._resolve_bootstrap(dp.bootstrap)
                        return None, False
                    if r is None:
                        return None, False  # resolving
                    if isinstance(r, Exception):
                        return self._fail_early(request, dp, tokens)
                    addr = r
                if addr in self.unreachable:
                    # A verdict older than this request is not its answer (P may have come back
                    # since, and nothing dials an idle address): one fresh dial decides.
                    seen = self.redial_of.get(req)
                    if seen is None:
                        self.redial_of[req] = self.control.probe(addr, now=True)
                        return None, False
                    if self.control.failed_dials(addr) <= seen:
                        return None, False  # that dial is on its way
                    self.redial_of.pop(req, None)
                    logger.warning("kvwire: request %s: P at %s cannot be reached", req, addr)
                    return self._fail_early(request, dp, tokens)
                self.redial_of.pop(req, None)
                pid = self._pid_for_addr(addr)
                if pid is None:
                    return None, False  # P's identity is on its way (first request to it)
                policy = dp.policy or self.opts.policy
                core = self.d_core(policy)
                key = request_key(dp.transfer_id)
                blocks = -(-request.num_prompt_tokens // bs)
                now = _now()
                st = _DReq(req=req, key=key, pid=pid, policy=policy, core=core, prompt=request.num_prompt_tokens,
                           blocks=blocks, transfer_id=dp.transfer_id, request=request)
                loads = scheduler_loads()
                st.loads = {f"d_{k}": v for k, v in loads.items()}
                if pid in self.incompatible:
                    logger.warning("kvwire: request %s: P %s is incompatible: %s", req, addr, "; ".join(self.incompatible[pid]))
                    # P learns of it (its Announce, then its Abort) and frees its blocks; here the
                    # request takes the load-error path without a block reserved.
                    if self._core_call(core.arrived, key, pid, max(tokens, 1), blocks, now, quiet=True):
                        self._core_call(core.abort, key, now, quiet=True)
                        self._run_actions(now)
                    st.failed_early = True
                    self.d_reqs[req] = st
                    return tokens, True
                if dp.remote_engine_id and self.pid_of_engine.get(dp.remote_engine_id, pid) != pid:
                    logger.warning("kvwire: request %s: remote_engine_id %s is not the engine at %s",
                                   req, dp.remote_engine_id, addr)
                try:
                    core.arrived(key, pid, max(tokens, 1), blocks, now)
                except kvwire.ConnectorError as e:
                    logger.warning("kvwire: request %s refused: %s", req, e)
                    return 0, False
                self.d_reqs[req] = st
                self.d_by_key[key] = st
                self._set_hit(st, num_computed_tokens // bs, now)
                self._replay_early(key, False, core, now)
                self._run_actions(now)
            if st.failed_early:
                return tokens, True
            hit = num_computed_tokens // bs
            if hit != st.hit:
                self._set_hit(st, hit, _now())
            if st.core.may_reserve(st.key):
                return tokens, True
            return None, False

    def _fail_early(self, request, dp, tokens):
        st = _DReq(req=request.request_id, key=request_key(dp.transfer_id), pid=0, policy=self.opts.policy,
                   core=None, prompt=request.num_prompt_tokens, blocks=0, transfer_id=dp.transfer_id, failed_early=True,
                   request=request)
        self.d_reqs[st.req] = st
        return tokens, True

    def _set_hit(self, st: _DReq, hit: int, now: int) -> None:
        hit = min(hit, st.blocks - 1)
        if hit == st.hit:
            return
        if self._core_call(st.core.prefix_hit, st.key, hit, now, quiet=True) or hit == 0:
            st.hit = hit

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        req = request.request_id
        with self.lock:
            st = self.d_reqs.get(req)
            if st is not None and num_external_tokens > 0:
                ids = compat.block_ids_group0(blocks)
                hit = (request.num_prompt_tokens - num_external_tokens) // self.c._block_size
                new = ids[hit:]
                now = _now()
                if st.failed_early:
                    self.out_failed[req] = new
                    self._forget_d(st)
                    return
                if st.slots is not None and hit != st.hit:
                    # land: the KV landed for blocks st.hit.. ; a different local hit now cannot
                    # be filled from the landing pool
                    logger.warning("kvwire: request %s: local prefix hit changed from %d to %d blocks while its "
                                   "KV landed: it fails", req, st.hit, hit)
                    self._core_call(st.core.abort, st.key, now, quiet=True)
                    self.out_failed[req] = new
                    self._forget_d(st)
                    return
                if hit != st.hit:
                    self._set_hit(st, hit, now)
                if not self._core_call(st.core.reserved, st.key, new, now):
                    self._core_call(st.core.abort, st.key, now, quiet=True)
                    self.out_failed[req] = new
                self._run_actions(now)
                return
            if st is None and self.c._is_producer:
                self._p_register(request)

    # ---- P: vLLM hooks ----
    def on_new_request(self, request) -> None:
        """P learns of a request as soon as vLLM queues it (``on_new_request``; on 0.18.1 through
        :func:`compat.backport_on_new_request`), so D hears it is queued (and stops counting its
        wait-for-P deadline) however long it waits for a slot."""
        if not self.c._is_producer:
            return
        with self.lock:
            self._p_register(request)
            self._run_actions(_now())

    def _p_register(self, request) -> None:
        params = getattr(request, "kv_transfer_params", None) or {}
        try:
            pp = _opts.p_params(params, request.request_id)
        except kvwire.InvalidArgumentError as e:
            logger.warning("kvwire: request %s: %s", request.request_id, e)
            return
        if pp is None or request.request_id in self.p_reqs:
            return
        mode = pp.send_mode or self.opts.send_mode
        key = request_key(pp.transfer_id)
        pid = self._pid_for_addr(pp.remote_control) if pp.remote_control else None
        st = _PReq(req=request.request_id, key=key, pid=pid, addr=pp.remote_control, mode=mode, core=self.p_core(mode),
                   prompt=request.num_prompt_tokens, transfer_id=pp.transfer_id)
        loads = scheduler_loads()
        st.loads = {f"p_{k}": v for k, v in loads.items()}
        self.p_reqs[st.req] = st
        self.p_by_key[key] = st
        now = _now()
        if pid is None:
            # MooncakeConnector style: D's first message (already here, or later) names D
            for is_p, p2, _, _ in self.early.get(key, []):
                if is_p:
                    pid = st.pid = p2
                    break
        if st.pid is not None:
            self._p_queued(st, now)

    def _p_queued(self, st: _PReq, now: int) -> None:
        if not st.queued_sent:
            st.queued_sent = True
            self._core_call(st.core.queued, st.key, st.pid, now, quiet=True)
        if st.blocks and not st.scheduled:
            self._p_schedule(st, now)

    def _p_schedule(self, st: _PReq, now: int) -> None:
        n = -(-st.prompt // self.c._block_size)
        # The core needs the request's block count now (its Started message carries it); the
        # ids of blocks of later chunks are not allocated yet. The workers take the real ids from
        # each step's metadata; the core's copies are never used to move data here.
        placeholder = (list(st.blocks) + [0] * n)[:n]
        if self._core_call(st.core.scheduled, st.key, st.pid, st.prompt, placeholder, now):
            st.scheduled = True
            self._replay_early(st.key, True, st.core, now)
            for rep in st.early_reports:
                self._apply_report(st, *rep)
            st.early_reports = []

    def build_connector_meta(self, so):
        from kvwire.vllm.connector import KvwireConnectorMetadata

        with self.lock:
            now = _now()
            chunks = []
            if self.p_reqs:
                chunks = self._p_chunks(so, now)
            if self.d_reqs:
                for new in so.scheduled_new_reqs:
                    st = self.d_reqs.get(new.req_id)
                    if st is not None and st.reported and not st.promoted:
                        if self._core_call(st.core.promoted, st.key, now, quiet=True):
                            st.promoted = True
                            st.first_pending = True
            self._run_actions(now)
            for r in self.out_failed:
                st = self.d_reqs.get(r)
                if st is not None:
                    compat.count_uncached(st.request)
            meta = KvwireConnectorMetadata(
                finished_recving=self.out_recv,
                recv_block_ids={r: list(self.d_reqs[r].core.reserved_blocks(self.d_reqs[r].key))
                                for r in self.out_recv if r in self.d_reqs and self.d_reqs[r].core is not None},
                failed_recving=self.out_failed,
                finished_sending=self.out_sending,
                p_chunks=chunks,
                land_copies=self.out_land,
                fences=self.out_fence,
                unfences=self.out_unfence,
            )
            for r in self.out_recv:
                if r in self.d_reqs:
                    self.d_reqs[r].recv_sent = True
            self.out_recv, self.out_failed, self.out_sending, self.out_land = set(), {}, set(), {}
            self.out_fence, self.out_unfence = [], []
            return meta

    def _p_chunks(self, so, now: int) -> list:
        """The prefill chunks of P requests computed in this step: ``(req, key, lo, hi, prompt,
        block ids, send mode, last)``."""
        out = []
        sched = so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:
            st = self.p_reqs.get(new.req_id)
            if st is None:
                continue
            st.blocks = list(new.block_ids[0]) if new.block_ids else []
            out.append(self._chunk(st, new.num_computed_tokens, sched.get(new.req_id, 0), now))
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            st = self.p_reqs.get(rid)
            if st is None:
                continue
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                st.blocks = list(nb[0]) if nb else []
            elif nb:
                st.blocks.extend(nb[0])
            lo = cr.num_computed_tokens[i]
            if lo < st.prompt:
                out.append(self._chunk(st, lo, sched.get(rid, 0), now))
        return [c for c in out if c is not None]

    def _chunk(self, st: _PReq, lo: int, n: int, now: int):
        hi = min(lo + n, st.prompt)
        if hi <= lo:
            return None
        if not st.scheduled and st.pid is not None:
            self._p_queued(st, now)
        return (st.req, st.key, lo, hi, st.prompt, list(st.blocks), st.mode, hi >= st.prompt)

    def update_connector_output(self, out):
        recv = out.finished_recving or ()
        with self.lock:
            if not (recv or any(s.first_pending for s in self.d_reqs.values())):
                return
            now = _now()
            for st in list(self.d_reqs.values()):
                if st.first_pending:
                    st.first_pending = False
                    self._core_call(st.core.first_token, st.key, now, quiet=True)
            for req in recv:
                st = self.d_reqs.get(req)
                if st is None:
                    continue
                st.recv_sent = False
                if st.slots is not None:  # land: the copy is done, the slots are free again
                    self.land_free.extend(st.slots)
                    st.slots = None
                if st.core is None or not self._core_call(st.core.reported, st.key, now, quiet=True):
                    self._forget_d(st)  # a failed request reported through the load-error path
                else:
                    st.reported = True
            self._run_actions(now)

    def request_finished(self, request, block_ids):
        req = request.request_id
        from vllm.v1.request import RequestStatus

        with self.lock:
            now = _now()
            self.redial_of.pop(req, None)
            st = self.d_reqs.get(req)
            if st is not None:
                return self._d_finished(st, now)
            pst = self.p_reqs.get(req)
            if pst is None:
                return False, None
            if request.status != RequestStatus.FINISHED_ABORTED and not pst.scheduled and pst.blocks \
                    and not pst.unreachable:
                # Prefilled before D was known (its hello, or its first message with
                # MooncakeConnector-style params): the blocks wait for D, up to block_ids_timeout.
                pst.finished = pst.delayed = True
                pst.finished_at = now
                return True, {"transfer_id": pst.transfer_id}
            if request.status == RequestStatus.FINISHED_ABORTED or not pst.scheduled:
                scheduled = pst.scheduled
                if scheduled:
                    pst.delayed = True  # transfers may be reading the blocks: wait for release
                self._core_call(pst.core.abort, pst.key, now, quiet=True)
                self._to_workers({"op": "cancel", "key": pst.key})
                self._run_actions(now)
                if scheduled and pst.req in self.p_reqs:
                    return True, None
                self._forget_p(pst)
                return False, None
            pst.finished = True
            pst.delayed = True
            self._run_actions(now)
            return True, {"transfer_id": pst.transfer_id}

    def _d_finished(self, st: _DReq, now: int):
        if st.core is None or st.failed_early:
            self._forget_d(st)
            return False, None
        if st.promoted:  # a normal end: the blocks are the request's
            if st.first_pending:
                st.first_pending = False
                self._core_call(st.core.first_token, st.key, now, quiet=True)
            self._core_call(st.core.abort, st.key, now, quiet=True)
            self._forget_d(st)
            return False, None
        if st.req in self.out_recv or st.recv_sent or st.reported:
            # Every layer landed: no write is in flight; vLLM frees the blocks on its one report.
            if st.req in self.out_recv:
                self.out_recv.discard(st.req)
                self.out_sending.add(st.req)
            self._forget_d(st)
            self._core_call(st.core.abort, st.key, now, quiet=True)
            self._run_actions(now)
            return False, None
        held = bool(st.core.reserved_blocks(st.key)) and st.slots is None
        if held:
            st.delayed = True
        self._core_call(st.core.abort, st.key, now, quiet=True)
        self._run_actions(now)
        if held and st.req in self.d_reqs:
            return True, None
        self._forget_d(st)
        return False, None

    # ---- misc ----
    def set_rank_addrs(self, metadata) -> None:
        from kvwire.vllm.worker import KvwireHandshake

        tp = self.c._tp
        addrs, layouts, ctls = {}, {}, {}
        for rank, m in (metadata or {}).items():
            if isinstance(m, KvwireHandshake) and m.tp == tp and m.rank == rank:
                addrs[rank] = m.data_addr
                layouts[rank] = (m.layout, m.block_bytes)
                ctls[rank] = m.control_addr
        if sorted(addrs) != list(range(tp)):
            logger.error("kvwire: data addresses of tensor parallel ranks %s reported, expected 0..%d: "
                         "P cannot write into this instance's KV caches", sorted(addrs), tp - 1)
            return
        with self.lock:
            self.rank_addrs = [addrs[r] for r in range(tp)]
            self.worker_ctl = [ctls[r] for r in range(tp) if ctls[r]]
            layout, bb = layouts[0]
            self.descriptor = _desc.describe(self.c._vllm_config, self.c._layers, tp, layout, bb)

    def has_pending_work(self) -> bool:
        with self.lock:
            return bool(self.out_sending or any(s.delayed for s in self.p_reqs.values()))

    def stats(self):
        now = _now()
        with self.lock:
            busy = bool(self.d_reqs or self.p_reqs)
        if self.stats_at is not None and now - self.stats_at < self.opts.stats_interval_ns:
            # Rate-limited; but the first step after the last request left flushes what changed
            # since the last snapshot, so that no gauge is left stale while the engine sits idle.
            if busy or not self.stats_pending:
                self.stats_pending |= busy
                return None
        self.stats_at = now
        self.stats_pending = busy  # something may still change after this snapshot
        with self.lock:
            flat = [_stats.flatten_d(core.metrics(now)) for core in self.d_cores.values()]
            flat += [_stats.flatten_p(core.metrics()) for core in self.p_cores.values()]
        counters, hists, gauges = _stats.merge(flat)
        st = KvwireConnectorStats(data=self.deltas.delta(counters, hists, gauges))
        return None if st.is_empty() else st

    def close(self) -> None:
        self._stop = True
        self.control.wake()
        self._driver.join(timeout=2.0)
        self.control.close()
        if self.timeline is not None:
            self.timeline.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
