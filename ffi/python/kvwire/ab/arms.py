"""The arms of the A/B and the servers each needs."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("eager", "lazy", "jit", "land")
MODES = ("whole", "layerwise")


@dataclass(frozen=True)
class Arm:
    name: str
    group: str  # which servers: "single", "kv_both-mooncake", "kv_both-kvwire", "pd"
    params: dict = field(default_factory=dict)  # client kv_transfer_params (P/D arms)


def all_arms() -> list[Arm]:
    arms = [Arm("single", "single"), Arm("kv_both-mooncake", "kv_both-mooncake"), Arm("kv_both-kvwire", "kv_both-kvwire")]
    for policy in POLICIES:
        for mode in MODES:
            arms.append(Arm(f"pd-{policy}-{mode}", "pd", {"kvwire_policy": policy, "kvwire_send_mode": mode}))
    return arms


def pick(names: list[str] | None) -> list[Arm]:
    """The arms named (all when None); ``single`` always, first: it is the reference."""
    arms = all_arms()
    if not names:
        return arms
    known = {a.name for a in arms}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown arm(s) {', '.join(bad)}; arms: {', '.join(sorted(known))}")
    return [a for a in arms if a.name == "single" or a.name in names]


def kvwire_config(role: str, control: int, data: int, timelines: str, **extra) -> dict:
    """KvwireConnector's config for one server of an arm. ``connect_timeout`` is 30 s, not the
    default 5 s: on this 2-core machine a just-started server's control plane was seen taking
    over 5 s to answer the first dial (P then judged D unreachable and both sides failed the
    first requests; the e2e suite sets 60 s for the same reason)."""
    return {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.vllm", "kv_role": role,
            "kv_connector_extra_config": {"control_listen": f"127.0.0.1:{control}",
                                          "data_listen": f"127.0.0.1:{data}", "timeline_path": timelines,
                                          "land_pool_blocks": 256, "connect_timeout": 30, **extra}}


def mooncake_config() -> dict:
    return {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}
