"""The ``kv_transfer_params`` the proxy gives P and D, in each connector's style.

``kvwire``: P names D's control address and D names P's (``remote_control``); each side's
connector dials the other. ``mooncake`` (vLLM MooncakeConnector's, which kvwire's connector
also reads): D names P's bootstrap endpoint and engine id, and P learns D from D's first
message. Keys the client put in its own ``kv_transfer_params`` (``kvwire_policy``,
``kvwire_send_mode``, ...) are passed to both; the proxy's own keys win.
"""

from __future__ import annotations

STYLES = ("kvwire", "mooncake")


class StyleError(ValueError):
    """The chosen backends lack what the style needs."""


def p_params(style: str, transfer_id: str, p, d, client: dict | None = None) -> dict:
    out = dict(client or {})
    out.update({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id})
    if style == "kvwire":
        if not d.control:
            raise StyleError(f"D backend {d.url} has no control= address (needed in kvwire style)")
        out["remote_control"] = d.control
    return out


def d_params(style: str, transfer_id: str, p, d, client: dict | None = None) -> dict:
    out = dict(client or {})
    out.update({"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id})
    if style == "kvwire":
        if not p.control:
            raise StyleError(f"P backend {p.url} has no control= address (needed in kvwire style)")
        out["remote_control"] = p.control
    else:
        if not p.bootstrap:
            raise StyleError(f"P backend {p.url} has no bootstrap= endpoint (needed in mooncake style)")
        out["remote_bootstrap_addr"] = p.bootstrap
        if p.engine_id:
            out["remote_engine_id"] = p.engine_id
    return out


def check_style(style: str, prefill, decode) -> None:
    """Every backend has what the style needs (raised at start-up, not per request)."""
    if style not in STYLES:
        raise StyleError(f"style {style!r} is not one of {', '.join(STYLES)}")
    for p in prefill:
        for d in decode:
            p_params(style, "check", p, d)
            d_params(style, "check", p, d)
