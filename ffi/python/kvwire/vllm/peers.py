"""Who the peers are: the scheduler's book of engines (engine id and incarnation, see
:mod:`kvwire.vllm.envelope`), the core peer number each maps to, the addresses they advertise and
were reached at, whether an address can be reached, and whether a peer's KV layout matches ours.

A restart (the same engine id in a new incarnation) is a new core peer; an address whose
connection was lost is identified afresh (its next hello reply says who is there) before a
request binds to it. A mixin of :class:`kvwire.vllm.scheduler.SchedulerSide`, whose lock is held
around every call.
"""

from __future__ import annotations

import logging

from kvwire.vllm import descriptor as _desc
from kvwire.vllm import envelope as env

logger = logging.getLogger("kvwire.vllm")


class PeerBook:
    """Peer identity and reachability (see the module docstring)."""

    def _init_peers(self) -> None:
        # peers: core peer number <-> engine id / address we reach it at
        self.pid_of_engine: dict[str, int] = {}
        self.addr_of_pid: dict[int, str] = {}  # the address the peer advertises
        self.dialled_of_pid: dict[int, str] = {}  # the address we reached it at
        self.unreachable: set[str] = set()  # addresses that could not be dialled
        # addresses whose engine answered our hello on the connection now up (see _pid_for_addr)
        self.answered: set[str] = set()
        self.redial_of: dict[str, int] = {}  # D request -> failed dials of its P's address when it asked
        self.identity_wait: dict[str, int] = {}  # D request -> when it began to wait for its P's hello reply
        self.engine_of_pid: dict[int, str] = {}
        self.heard: set[int] = set()
        self.incompatible: dict[int, list[str]] = {}
        self._next_pid = 1
        self.fenced: dict[str, list] = {}  # engine id -> its data addresses fenced
        self.inc_of_engine: dict[str, int] = {}  # the incarnation of its last message
        self.restarted: set[str] = set()  # engines heard in a new incarnation since the last actions
        self.given_up_at: dict = {}  # peer -> when a core last gave it up (one log line for all cores)

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

    def _on_incarnation(self, e, now: int) -> None:
        """Every message names its engine's incarnation: a new one means the engine restarted."""
        prev = self.inc_of_engine.get(e.engine_id)
        self.inc_of_engine[e.engine_id] = e.incarnation
        if prev is None or prev == e.incarnation:
            return
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

    def _on_hello(self, e, now: int) -> None:
        """A peer's hello or its reply to ours: its identity, layout and data addresses."""
        if e.kind == env.HELLO_REPLY:
            reached = (e.hello or {}).get("reached_as")  # this reply's, not the latest
            if isinstance(reached, str):
                # again here, in order: a refused dial handled just before may have unset it
                self.control.engine_at[reached] = e.engine_id
                self.answered.add(reached)
        pid = self._pid_for_engine(e.engine_id, e.control)
        self.heard.add(pid)
        self._check_peer(pid, self.control.peer_hello.get(e.engine_id, {}))
        # P requests waiting for this peer's identity (their D address answered)
        for st in list(self.p_reqs.values()):
            if st.pid is None and st.addr is not None and self.control.engine_at.get(st.addr) == e.engine_id:
                self._bind_p_peer(st, pid, now)

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

    def _log_given_up(self, role: str, peer, action, now: int) -> None:
        """A core gave a peer up (its connections are torn down, its requests failed): why, in
        the log, once for all the cores that give it up together (one per policy or send mode).
        A peer the host reported down was logged when it was reported."""
        last = self.given_up_at.get(peer)
        self.given_up_at[peer] = now
        if last is not None and now - last < 1_000_000_000:
            return
        level = logging.INFO if action.reported else logging.WARNING
        logger.log(level, "kvwire: %s %s given up: %s; its requests fail and its connections are torn down",
                   role, peer, action.cause)

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

    def _send(self, pid: int, kind: int, data: bytes) -> None:
        addr = self.dialled_of_pid.get(pid) or self.addr_of_pid.get(pid)
        if addr is None:
            eid = self.engine_of_pid.get(pid)
            addr = self.control.addr_of.get(eid) if eid else None
        if addr is None:
            logger.warning("kvwire: no address for peer %s: message dropped", pid)
            return
        self.control.send(addr, kind, data, droppable=env.message_request(data) is None)
