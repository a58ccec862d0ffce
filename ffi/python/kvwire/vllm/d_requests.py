"""D's requests: what the scheduler hooks of a consumer do with a request whose KV comes from
a P (``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``update_connector_output``,
``request_finished``), and what D's cores ask for (sends, landing-pool slots, reports of
finished or failed loads, released blocks, fences on a P that is gone).

A request is known here from its first ``get_num_new_matched_tokens`` on: its P is resolved
(bootstrap URL or control address), identified (:mod:`kvwire.vllm.peers`), and the request is
told to the core of its reservation policy, which decides when vLLM may reserve its blocks. A
mixin of :class:`kvwire.vllm.scheduler.SchedulerSide`, whose lock is held around every call.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from dataclasses import dataclass, field
from time import monotonic_ns as _now

import kvwire
from kvwire import core as kcore
from kvwire.vllm import compat
from kvwire.vllm import envelope as env
from kvwire.vllm import options as _opts

logger = logging.getLogger("kvwire.vllm")


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
    slots: list | None = None  # landing-pool slots (land, or bounce)
    # The slots are ours to free, at the workers' report of the request, not the core's: P
    # writes nothing more into them, but the workers' copies out of them may still run.
    own_slots: bool = False
    # A staged D's eager/lazy/jit: P writes into the slots (the core's "blocks"), vLLM's KV
    # blocks are these, and each landed layer is copied from the one into the other.
    bounce: bool = False
    kv_blocks: list | None = None
    copied: set = field(default_factory=set)  # layers handed to the workers to copy
    loads: dict = field(default_factory=dict)
    request: object = None  # vLLM's Request (see build_connector_meta)


class DRequests:
    """D's side of the scheduler hooks (see the module docstring)."""

    def _init_d(self, land_pool_blocks: int, staged_pool: bool = False, staged_mirror: bool = False) -> None:
        self.d_reqs: dict[str, _DReq] = {}
        self.d_by_key: dict[int, _DReq] = {}
        # D's landing pool (policy land): free slot ids
        self.land_slots = land_pool_blocks
        self.land_free = list(range(land_pool_blocks - 1, -1, -1))
        # A staged D with a bounded landing pool (staging.py): every request lands in it (see
        # kvwire.vllm.landing); a land request the pool cannot take now waits here for slots
        # (FIFO: (key, blocks)) instead of falling back; any other waits for its reservation
        self.staged_pool = staged_pool
        # A staged D with a landing mirror: P writes into the mirror's copy of the KV blocks, and
        # each landed layer is copied from it into the same blocks (kvwire.vllm.landing)
        self.staged_mirror = staged_mirror
        self.land_waiting: list[tuple[int, int]] = []
        # req -> slots to free when the workers report the request (its copies are done)
        self.slots_at_report: dict[str, list] = {}
        # layers handed to the workers' landing copies, while the request was still landing or
        # once it was complete (d_landing_copied_layers)
        self.copied_layers = {"landing": 0, "complete": 0}
        # bootstrap endpoints (MooncakeConnector style) -> resolved control address or error
        self.resolved: dict[str, str | Exception | None] = {}

    def _d_promote(self, so, now: int) -> None:
        """Requests whose KV was reported are scheduled to run in this step: the core hears it."""
        for new in so.scheduled_new_reqs:
            st = self.d_reqs.get(new.req_id)
            if st is not None and st.reported and not st.promoted:
                if self._core_call(st.core.promoted, st.key, now, quiet=True):
                    st.promoted = True
                    st.first_pending = True

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
                    # P's identity is on its way (the first request to it, or P restarted), but an
                    # engine that never answers our hello must not hold the request forever
                    now = _now()
                    since = self.identity_wait.setdefault(req, now)
                    if now - since < self.opts.timeouts["wait_for_p_timeout"] * 1e9:
                        return None, False
                    self.identity_wait.pop(req, None)
                    logger.warning("kvwire: request %s: the engine at %s did not answer our hello in %.0f s",
                                   req, addr, self.opts.timeouts["wait_for_p_timeout"])
                    return self._fail_early(request, dp, tokens)
                self.identity_wait.pop(req, None)
                policy = dp.policy or self.opts.policy
                core = self.d_core(policy)
                key = env.request_key(dp.transfer_id)
                blocks = -(-request.num_prompt_tokens // bs)
                now = _now()
                st = _DReq(req=req, key=key, pid=pid, policy=policy, core=core, prompt=request.num_prompt_tokens,
                           blocks=blocks, transfer_id=dp.transfer_id, request=request,
                           bounce=self.staged_pool and policy != "land")
                loads = compat.scheduler_loads()
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
                if st.bounce and not self._bounce_slots(st, st.blocks - st.hit, _now()):
                    return (tokens, True) if st.failed_early else (None, False)
                return tokens, True
            return None, False

    def _bounce_slots(self, st: _DReq, need: int, now: int) -> bool:
        """A bounce request about to be reserved takes ``need`` slots of the pool (before vLLM
        allocates its blocks, so that it never holds blocks it cannot receive into). False:
        not now (a request that can never fit fails, ``st.failed_early``)."""
        if st.slots is not None and len(st.slots) == need:
            return True
        if st.slots is not None:
            self._free_slots(st.slots, now)  # the local prefix hit changed: another count
            st.slots = None
        if need > self.land_slots:
            logger.warning("kvwire: request %s needs %d blocks, D's landing pool has %d slots (staging_mb, "
                           "land_pool_blocks): it fails", st.req, need, self.land_slots)
            self._core_call(st.core.abort, st.key, now, quiet=True)
            self._run_actions(now)
            st.failed_early = True
            return False
        if len(self.land_free) < need or self.land_waiting:
            return False
        st.slots = [self.land_free.pop() for _ in range(need)]
        return True

    def _fail_early(self, request, dp, tokens):
        st = _DReq(req=request.request_id, key=env.request_key(dp.transfer_id), pid=0, policy=self.opts.policy,
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
                if st.bounce:
                    if hit != st.hit:
                        self._set_hit(st, hit, now)
                    if not self._bounce_slots(st, len(new), now):
                        logger.warning("kvwire: request %s: no landing slots for its %d blocks", req, len(new))
                        self._core_call(st.core.abort, st.key, now, quiet=True)
                        self.out_failed[req] = new
                        self._forget_d(st)
                        self._run_actions(now)
                        return
                    st.kv_blocks, st.own_slots = list(new), True
                    if not self._core_call(st.core.reserved, st.key, list(st.slots), now):
                        self._core_call(st.core.abort, st.key, now, quiet=True)
                        self.out_failed[req] = new
                    self._run_actions(now)
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

    def update_connector_output(self, out):
        recv = out.finished_recving or ()
        sending = out.finished_sending or ()
        with self.lock:
            if not (recv or any(s.first_pending for s in self.d_reqs.values())
                    or (sending and self.slots_at_report)):
                return
            now = _now()
            for req in (*recv, *sending):  # the workers' copies out of its slots are over
                if req in self.slots_at_report:
                    self._free_slots(self.slots_at_report.pop(req), now)
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
                    self._free_slots(st.slots, now)
                    st.slots = None
                if st.core is None or not self._core_call(st.core.reported, st.key, now, quiet=True):
                    self._forget_d(st)  # a failed request reported through the load-error path
                else:
                    st.reported = True
            self._run_actions(now)

    def _free_slots(self, slots: list, now: int) -> None:
        """Landing slots are free again; requests waiting for slots take them in arrival order."""
        self.land_free.extend(slots)
        while self.land_waiting:
            key, blocks = self.land_waiting[0]
            st = self.d_by_key.get(key)
            if st is None or st.core is None or st.slots is not None:
                self.land_waiting.pop(0)  # ended meanwhile
                continue
            if len(self.land_free) < blocks:
                return
            self.land_waiting.pop(0)
            st.slots = [self.land_free.pop() for _ in range(blocks)]
            if not self._core_call(st.core.landing, key, st.slots, now, quiet=True):
                self.land_free.extend(st.slots)  # the request failed meanwhile
                st.slots = None

    def _d_action(self, core, a, now: int) -> None:
        if isinstance(a, kcore.Send):
            self._send(a.peer, env.TO_P, a.data)
            return
        st = self.d_by_key.get(getattr(a, "req", None))
        if isinstance(a, kcore.MayLand):
            if st is not None and len(self.land_free) >= a.blocks and not self.land_waiting:
                st.slots = [self.land_free.pop() for _ in range(a.blocks)]
                self._core_call(core.landing, a.req, st.slots, now)
            elif not self.staged_pool:
                self._core_call(core.land_fallback, a.req, now)
            elif st is None:
                pass
            elif a.blocks > self.land_slots:
                # without a mirror there is nothing to fall back to: the load-error path
                logger.warning("kvwire: request %s needs %d blocks, D's landing pool has %d slots (staging_mb, "
                               "land_pool_blocks): it fails", st.req, a.blocks, self.land_slots)
                self._core_call(core.abort, a.req, now, quiet=True)
            else:
                self.land_waiting.append((a.req, a.blocks))  # P holds its KV until slots free
        elif isinstance(a, kcore.ReleaseLanding):
            self._free_slots(a.slots, now)
            if st is not None:
                st.slots = None
        elif isinstance(a, kcore.ReportFinished):
            if st is not None:
                src = self._copied_as_landed(st)
                if src is not None:  # the layers not yet copied, copied now
                    rest = set(core.landed_layers(a.req)) - st.copied
                    st.copied |= rest
                    self.copied_layers["complete"] += len(rest)
                    done = self.out_land.get(st.req)
                    layers = sorted(rest | set(done[2] if done else ()))
                    self.out_land[st.req] = (*src, layers)
                elif st.slots is not None:  # land: the workers copy the slots into the blocks first
                    st.own_slots = True
                    self.copied_layers["complete"] += len(core.landed_layers(a.req))
                    self.out_land[st.req] = (list(st.slots), list(core.reserved_blocks(a.req)), None)
                self.out_recv.add(st.req)
        elif isinstance(a, kcore.ReportFailed):
            if st is None:
                return
            if st.delayed:
                pass  # vLLM aborted it already: its blocks are freed through the release path
            elif a.blocks:
                self.out_failed[st.req] = list(st.kv_blocks if st.bounce else a.blocks)
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
            self._log_given_up("P", eid or a.peer, a, now)
            addrs = list(self.control.peer_hello.get(eid, {}).get("data") or [])
            self.out_fence.extend(addrs)
            if eid in self.restarted:
                # A new incarnation of it was heard since the last actions: the old process is gone,
                # closing its connections (and waiting for its copies) is all the fence is for.
                self.out_unfence.extend(addrs)
            elif eid:
                # It may still be alive: refused until a new incarnation of it shows up.
                self.fenced[eid] = addrs

    def _copied_as_landed(self, st: _DReq):
        """``(slots or None, KV blocks)`` of a request whose layers the workers copy into its
        KV blocks as they land: a bounce request's slots, or (``None``) the same blocks of a
        staged D's mirror for a request that lands in its reserved blocks (not land's pool);
        ``None`` for any other."""
        if st.bounce:
            return None if st.kv_blocks is None else (list(st.slots), list(st.kv_blocks))
        if not self.staged_mirror or st.slots is not None or st.core is None:
            return None
        blocks = list(st.core.reserved_blocks(st.key))
        return (None, blocks) if blocks else None

    def _d_landed_layers(self) -> None:
        """Staged D: the layers landed since the last step go to the workers' copies."""
        for st in self.d_reqs.values():
            if st.delayed or st.recv_sent or st.reported or st.core is None:
                continue
            if not (st.bounce or self.staged_mirror):
                continue
            new = [x for x in st.core.landed_layers(st.key) if x not in st.copied]
            src = self._copied_as_landed(st) if new else None
            if src is not None:
                st.copied.update(new)
                self.copied_layers["landing"] += len(new)
                self.out_land[st.req] = (*src, new)

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
        # KV blocks P may still write into, or (bounce) that copies from the slots may fill
        held = bool(st.core.reserved_blocks(st.key)) and (st.slots is None or st.kv_blocks is not None)
        if held:
            st.delayed = True
        self._core_call(st.core.abort, st.key, now, quiet=True)
        self._run_actions(now)
        if held and st.req in self.d_reqs:
            return True, None
        self._forget_d(st)
        return False, None

    def _forget_d(self, st: _DReq) -> None:
        if st.slots is not None:
            if st.own_slots:  # freed when the workers report the request
                self.slots_at_report[st.req] = st.slots
            elif st.bounce:  # never offered to P
                self._free_slots(st.slots, _now())
            st.slots = None  # else (land) the core gives them back (ReleaseLanding)
        self.d_reqs.pop(st.req, None)
        self.d_by_key.pop(st.key, None)
        self._remember(("d", st.key), st)
