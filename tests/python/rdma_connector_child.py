"""Child process of ``test_vllm_rdma.py``: a kv_both D and a kv_both P (``KvwireConnector`` in
vLLM's real Scheduler, one process, the harness of ``vllm_harness``) whose data engines run
transport ``rdma`` on the in-process loopback RDMA device (``KVWIRE_IBVERBS_PATH``, set by the
parent with ``KVWIRE_LOOPBACK_DEVICES``). One request moves P → D; prints one JSON line: the
device contexts open in the process (counted by the verbs layer), this process's kvwire
threads by name, the data peers' transports, and whether D's cache holds P's bytes."""

import collections
import json
import os
import sys

import kvwire
from vllm_harness import (RequestStatus, assert_no_leak, d_request, holds, model_dir, open_pair, p_fill, p_request,
                          run_until)


def threads() -> collections.Counter:
    """This process's threads by name (Linux's 15-byte names), those of kvwire's Rust threads."""
    names = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:
            continue  # the thread ended meanwhile
    return collections.Counter({n: k for n, k in names.items() if n.startswith(("rdma-", "kvwire"))})


def main() -> int:
    sides = []
    try:
        d, p = open_pair(sides, model_dir(), {"transport": "rdma", "policy": "lazy"},
                         {"transport": "rdma", "send_mode": "layerwise"}, roles=("kv_both", "kv_both"))
        dreq = d_request("r1", p)
        d.sched.add_request(dreq)
        d.step()
        p.sched.add_request(p_request("r1", d))
        ran = run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d.step)
        blocks = d.sched.kv_cache_manager.get_block_ids("d/r1")[0] if ran else []
        out = {"ran": ran, "blocks": len(blocks), "bytes_ok": ran and holds(d.kv, "r1", blocks),
               "transports": sorted(peer.transport for peer in p.worker._worker.peers.values()),
               "contexts": kvwire.rdma_contexts_open(), "threads": dict(threads())}
        run_until(lambda: dreq.is_finished() and not p.sched.requests, lambda: p.step(p_fill), d.step)
        assert_no_leak(d)
        assert_no_leak(p)
        print("RESULT " + json.dumps(out), flush=True)
        return 0
    finally:
        for s in sides:
            s.close()


if __name__ == "__main__":
    sys.exit(main())
