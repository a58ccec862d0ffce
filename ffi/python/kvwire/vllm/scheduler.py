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
cores' peer numbers in :mod:`kvwire.vllm.peers`. What the hooks do with a request is in
:mod:`kvwire.vllm.d_requests` (D) and :mod:`kvwire.vllm.p_requests` (P); this module holds the
driver, the routing of messages and core actions, and what is common to both.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from time import monotonic_ns as _now

import kvwire
from kvwire import core as kcore
from kvwire.vllm import compat
from kvwire.vllm import descriptor as _desc
from kvwire.vllm import envelope as env
from kvwire.vllm import options as _opts
from kvwire.vllm import stats as _stats
from kvwire.vllm.control import ControlPlane
from kvwire.vllm.d_requests import DRequests
from kvwire.vllm.envelope import request_key  # noqa: F401 - re-exported
from kvwire.vllm.p_requests import PRequests
from kvwire.vllm.peers import PeerBook
from kvwire.vllm.stats import KvwireConnectorStats
from kvwire.vllm.timeline import TimelineWriter

logger = logging.getLogger("kvwire.vllm")

#: Messages kept per request that arrive before the request is known here (and in total).
EARLY_PER_KEY, EARLY_MAX = 64, 65536


class SchedulerSide(PeerBook, DRequests, PRequests):
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
        self._init_peers()
        self._init_d(o.land_pool_blocks if c._d_pool is None else c._d_pool, c._d_pool is not None, c._d_mirror)
        self._init_p()
        self.early: dict[int, list] = {}
        self.early_n = 0
        # requests that ended, kept briefly for their timeline records (which come after)
        self.ended: dict[tuple, object] = {}
        # for the workers, drained into the next step's metadata
        self.out_recv: set[str] = set()
        self.out_failed: dict[str, list] = {}
        self.out_sending: set[str] = set()
        self.out_land: dict[str, tuple] = {}
        self.out_fence: list[str] = []
        self.out_unfence: list[str] = []  # lifted after this step's fences
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

    def _drive(self) -> None:
        while not self._stop:
            now = _now()
            due = [t for core in self._cores() if (t := core.poll_timeout()) is not None]
            wait = 0.5 if not due else max(0.0, min(0.5, (min(due) - now) / 1e9))
            items = self.control.recv_ordered(wait)
            if self._stop:
                break
            with self.lock:
                now = _now()
                # in the order they happened: a hello reply after a failed dial stands
                for is_event, x in items:
                    if is_event:
                        self._on_reachability(x[0], x[1], now)
                    else:
                        self._on_envelope(x, now)
                for core in self._cores():
                    t = core.poll_timeout()
                    if t is not None and t <= now:
                        core.handle_timeout(now)
                self._expire_early(now)
                self._expire_unbound(now)
                self._run_actions(now)

    def _on_envelope(self, e, now: int) -> None:
        if e.kind == env.REPORT:
            self._on_report(e.payload)
            return
        self._on_incarnation(e, now)
        if e.kind in (env.HELLO, env.HELLO_REPLY):
            self._on_hello(e, now)
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
        if st is None:
            # A request this side forgot: its core answers from its memory of it (an Abort of
            # one that ended is confirmed, so the peer frees its blocks at once; without the
            # answer it would wait out its drain and give this engine up).
            old = self.ended.get(("p" if to_p else "d", key))
            core = getattr(old, "core", None) if getattr(old, "pid", None) == pid else None
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
            if side == "p" and st.cached is not None:
                rec["p_cached_tokens"] = st.cached
            if pid is not None:
                eid = self.engine_of_pid.get(pid)
                rec["peer_engine_id"] = eid
                if eid:
                    off, err = self.control.clock_of(eid)
                    rec["clock_offset_ns"], rec["clock_error_ns"] = off, err
        self.timeline.put(rec)

    def _remember(self, k, st) -> None:
        self.ended[k] = st
        if len(self.ended) > 4096:
            for old in list(self.ended)[:1024]:
                del self.ended[old]

    def build_connector_meta(self, so):
        from kvwire.vllm.connector import KvwireConnectorMetadata

        with self.lock:
            now = _now()
            chunks = []
            if self.p_reqs:
                chunks = self._p_chunks(so, now)
            if self.d_reqs:
                self._d_promote(so, now)
            self._run_actions(now)
            if self.staged_pool or self.staged_mirror:
                self._d_landed_layers()
            for r in self.out_failed:
                st = self.d_reqs.get(r)
                if st is not None:
                    compat.count_uncached(st.request)
            meta = KvwireConnectorMetadata(
                finished_recving=self.out_recv,
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

    def request_finished(self, request, block_ids):
        with self.lock:
            now = _now()
            self.redial_of.pop(request.request_id, None)
            self.identity_wait.pop(request.request_id, None)
            st = self.d_reqs.get(request.request_id)
            if st is not None:
                return self._d_finished(st, now)
            pst = self.p_reqs.get(request.request_id)
            if pst is None:
                return False, None
            return self._p_finished(pst, request, now)

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
            if self.c._is_consumer:
                flat.append(({f"d_landing_copied_layers|{k}": n for k, n in self.copied_layers.items()}, {}, {}))
        counters, hists, gauges = _stats.merge(flat)
        if self.c._is_consumer:  # every slot taken, by land and by a staged D's other policies
            with self.lock:
                gauges["d_landing_slots"] = self.land_slots - len(self.land_free)
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
