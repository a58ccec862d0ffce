"""The model/layout descriptor P and D compare before any byte is written.

P computes D's offsets from its own block size and layout, so a mismatch in any of these
silently corrupts the KV cache; the connector exchanges a :func:`describe` of each side in its
hello and refuses to transfer between instances whose descriptors differ (:func:`mismatch`).
"""

from __future__ import annotations

#: The fields compared, in the order they are reported.
FIELDS = ("dtype", "block_size", "layers", "kv_heads", "head_size", "layout", "block_bytes", "tp")


def describe(vllm_config, layers: int, tp: int, layout: str | None = None, block_bytes: int | None = None) -> dict:
    """This instance's descriptor. ``kv_heads`` is per TP rank (what one rank's cache holds);
    ``layout`` and ``block_bytes`` come from the workers' KV tensors when known."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    try:
        kv_heads = int(mc.get_num_kv_heads(pc))
    except Exception:  # noqa: BLE001 - a config without the method (tests)
        kv_heads = None
    try:
        head_size = int(mc.get_head_size())
    except Exception:  # noqa: BLE001
        head_size = None
    dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if dtype in ("auto", "None"):
        dtype = str(mc.dtype).removeprefix("torch.")
    return {"dtype": dtype, "block_size": int(vllm_config.cache_config.block_size), "layers": int(layers),
            "kv_heads": kv_heads, "head_size": head_size, "layout": layout, "block_bytes": block_bytes,
            "tp": int(tp)}


def mismatch(ours: dict, theirs: dict) -> list[str]:
    """The differences, one ``"field: ours vs theirs"`` each (empty: compatible). A field one
    side does not know (``None``) is not compared."""
    out = []
    for f in FIELDS:
        a, b = ours.get(f), theirs.get(f)
        if a is not None and b is not None and a != b:
            out.append(f"{f}: {a} vs {b}")
    return out
