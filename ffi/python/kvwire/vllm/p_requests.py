"""P's requests: what the scheduler hooks of a producer do with a request whose KV goes to a D
(``on_new_request``, ``build_connector_meta``'s prefill chunks, ``request_finished``), the
workers' reports of what they computed and wrote, and what P's cores ask for (sends, the
destination blocks handed to the workers, cancels, released blocks).

A request is known here from the moment vLLM queues it; its D is named by the request's
control address or, MooncakeConnector style, by D's first message. A mixin of
:class:`kvwire.vllm.scheduler.SchedulerSide`, whose lock is held around every call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from time import monotonic_ns as _now

import kvwire
from kvwire import core as kcore
from kvwire.vllm import compat
from kvwire.vllm import envelope as env
from kvwire.vllm import options as _opts

logger = logging.getLogger("kvwire.vllm")


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
    cached: int | None = None  # prompt tokens P found in its prefix cache when it first scheduled it
    unreachable: bool = False
    finished_at: int = 0
    # workers' reports (all ranks) that came before the core knew the request: (what, layer, bytes, t)
    early_reports: list = field(default_factory=list)


class PRequests:
    """P's side of the scheduler hooks (see the module docstring)."""

    def _init_p(self) -> None:
        self.p_reqs: dict[str, _PReq] = {}
        self.p_by_key: dict[int, _PReq] = {}
        # (key, what, layer) -> {rank: report} of what the workers reported
        self.p_reports: dict[tuple, dict] = {}

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
        key = env.request_key(pp.transfer_id)
        pid = self._pid_for_addr(pp.remote_control) if pp.remote_control else None
        st = _PReq(req=request.request_id, key=key, pid=pid, addr=pp.remote_control, mode=mode, core=self.p_core(mode),
                   prompt=request.num_prompt_tokens, transfer_id=pp.transfer_id)
        loads = compat.scheduler_loads(request, queued_tokens=True)
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

    def _bind_p_peer(self, st: _PReq, pid: int, now: int) -> None:
        """MooncakeConnector-style P request: D's first message names the D."""
        st.pid = pid
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
            if st.cached is None:
                st.cached = new.num_computed_tokens
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

    def _expire_unbound(self, now: int) -> None:
        """P requests that finished their prefill while D was unknown, and D never showed up:
        their blocks go back after block_ids_timeout."""
        ttl = int(self.opts.timeouts["block_ids_timeout"] * 1e9)
        for st in list(self.p_reqs.values()):
            if not st.scheduled and st.finished and (st.unreachable or now - st.finished_at > ttl):
                logger.warning("kvwire: request %s: no D came for it; its blocks are released", st.req)
                self.out_sending.add(st.req)
                self._forget_p(st)

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
            self._log_given_up("D", self.engine_of_pid.get(a.peer, a.peer), a, now)
            hello = self.control.peer_hello.get(self.engine_of_pid.get(a.peer, ""), {})
            self._to_workers({"op": "drop", "addrs": hello.get("data") or []})

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

    def _forget_p(self, st: _PReq) -> None:
        self.p_reqs.pop(st.req, None)
        self.p_by_key.pop(st.key, None)
        for k in [k for k in self.p_reports if k[0] == st.key]:
            del self.p_reports[k]
        self._remember(("p", st.key), st)

    def _p_finished(self, pst: _PReq, request, now: int):
        """``request_finished`` of a P request: whether its blocks are held, and the params for D."""
        from vllm.v1.request import RequestStatus

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
