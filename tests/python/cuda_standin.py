"""A recording stand-in for ``torch.cuda``, and a CPU stand-in for the events of stream copies,
shared by the staging, landing and device-mode tests."""


class StandInCuda:
    """Stands in for ``torch.cuda`` (``staging.cuda``) and logs what the CUDA branch of
    DeviceCopies asks of it; the copies themselves run on CPU tensors (non_blocking is a no-op)."""

    def __init__(self):
        log = []
        self.log, self.current = log, None

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name

            def wait_event(self, ev):
                log.append(("wait", self.name, ev.name))

            def synchronize(self):
                log.append(("sync", self.name))

        class Event:
            made = 0

            def __init__(self):
                Event.made += 1
                self.name, self.stream = f"e{Event.made}", None

            def record(self, stream):
                self.stream = stream.name
                log.append(("record", stream.name, self.name))

            def query(self):
                log.append(("query", self.name))
                return self.stream is not None

            def synchronize(self):
                log.append(("sync", self.name))

        class Cudart:
            def cudaHostRegister(self, ptr, nbytes, flags):
                log.append(("pin", ptr, nbytes, flags))
                return 0

            def cudaHostUnregister(self, ptr):
                log.append(("unpin", ptr))
                return 0

        self.Stream, self.Event, self._cudart = Stream, Event, Cudart()
        self.compute = Stream(name="compute")

    def cudart(self):
        return self._cudart

    def set_device(self, device):
        self.log.append(("set_device", str(device)))

    def current_stream(self, device=None):
        return self.current or self.compute

    def stream(self, s):
        cuda = self

        class Ctx:
            def __enter__(self):
                self.prev, cuda.current = cuda.current, s
                cuda.log.append(("enter", s.name))

            def __exit__(self, *exc):
                cuda.current = self.prev
                cuda.log.append(("exit", s.name))

        return Ctx()


class Deferred:
    """Stands in for a CUDA event on CPU: the copies behind it run only when it completes, after
    ``polls`` queries (or at ``synchronize``), as stream copies complete later than enqueued."""

    def __init__(self, pairs, polls):
        self.pairs, self.polls, self.done = list(pairs), polls, False

    def _run(self):
        if not self.done:
            for dst, src in self.pairs:
                dst.copy_(src)
            self.done = True

    def query(self):
        self.polls -= 1
        if self.polls <= 0:
            self._run()
        return self.done

    def synchronize(self):
        self._run()


def defer_copies(st, polls):
    """Makes the copies of ``st`` (a staging, or anything with a ``dev``) complete only after
    ``polls`` queries (``float("inf")``: only at ``synchronize``); returns the events made."""
    made = []

    def copy(after, pairs):
        ev = Deferred(pairs, polls)
        made.append(ev)
        return ev

    st.dev.copy = copy
    return made
