"""The stand-in model: deterministic K/V and a next token read from the KV cache.

* Position ``p`` of a sequence carries a rolling hash ``h[p]`` of the token ids ``0..p``
  (:func:`prefix_hashes`).
* Its K and V in layer ``l`` are small integers (exact in fp16, bf16 and fp32) computed from
  ``(h[p], l)`` (:func:`kv_values`): the same on every instance for the same tokens.
* The next token after ``n`` positions is a hash of the K/V bytes of positions ``0..n-1`` of
  every layer *as read from the cache* (:func:`next_token`), so one wrong byte anywhere in a
  sequence's KV changes what is generated.

:func:`reference_generate` runs the whole model in memory: what a correct single instance
outputs for a prompt (tests compare servers against it).
"""

from __future__ import annotations

import hashlib

import numpy as np

MASK = (1 << 64) - 1
# Generated tokens avoid 0..FIRST_TOKEN-1 (padding, BOS/EOS and other specials of the tiny
# model config below).
FIRST_TOKEN = 16


def _mix(x: int) -> int:
    """splitmix64's finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def prefix_hashes(tokens, start_hash: int = 0) -> list[int]:
    """``h[i]`` for each token, continuing from ``start_hash`` (the hash before the first)."""
    out = []
    h = start_hash
    for t in tokens:
        h = _mix(h ^ (int(t) * 0x2545F4914F6CDD1D & MASK))
        out.append(h)
    return out


def kv_values(hashes, layer: int, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V (float32 arrays ``[len(hashes), heads, head_dim]``, integers in [-63, 63]) of the
    positions with these prefix hashes, in ``layer``."""
    h = np.asarray(hashes, dtype=np.uint64).reshape(-1, 1)
    n = heads * head_dim
    idx = np.arange(2 * n, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        x = h ^ np.uint64((0xD6E8FEB86659FD93 * (layer + 1)) & MASK)
        x = x * (idx * np.uint64(2) + np.uint64(0x9E3779B97F4A7C15 & MASK))
        x ^= x >> np.uint64(29)
        x = x * np.uint64(0xBF58476D1CE4E5B9)
    vals = ((x >> np.uint64(40)) % np.uint64(127)).astype(np.int64) - 63
    vals = vals.astype(np.float32)
    k = vals[:, :n].reshape(-1, heads, head_dim)
    v = vals[:, n:].reshape(-1, heads, head_dim)
    return k, v


def next_token(layer_bytes, vocab_size: int) -> int:
    """The token chosen from the K/V bytes of a sequence (one ``bytes`` per layer, in layer
    order, each the K and V of positions ``0..n-1`` as :func:`kv_bytes` lays them out)."""
    d = hashlib.blake2b(digest_size=8)
    for b in layer_bytes:
        d.update(len(b).to_bytes(8, "little"))
        d.update(b)
    span = vocab_size - FIRST_TOKEN
    return FIRST_TOKEN + int.from_bytes(d.digest(), "little") % span


def kv_bytes(k: np.ndarray, v: np.ndarray, dtype: str) -> bytes:
    """The canonical byte string of K and V (``[n, heads, head_dim]`` each) of one layer: K then
    V, position-major, in the model's dtype (so the bytes read back from a cache and the bytes
    computed here compare equal)."""
    import torch

    t = torch.from_numpy(np.stack([k, v])).to(getattr(torch, dtype))
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def reference_generate(prompt, max_tokens: int, *, layers: int, heads: int, head_dim: int,
                       vocab_size: int, dtype: str = "bfloat16") -> list[int]:
    """What a correct single instance generates for ``prompt`` (greedy, ``max_tokens``)."""
    tokens = list(prompt)
    hashes = prefix_hashes(tokens)
    out = []
    for _ in range(max_tokens):
        per_layer = []
        for layer in range(layers):
            k, v = kv_values(hashes, layer, heads, head_dim)
            per_layer.append(kv_bytes(k, v, dtype))
        t = next_token(per_layer, vocab_size)
        out.append(t)
        tokens.append(t)
        hashes += prefix_hashes([t], hashes[-1] if hashes else 0)
    return out


def model_config(layers: int = 2, kv_heads: int = 2, head_dim: int = 16, vocab_size: int = 1000,
                 dtype: str = "bfloat16", max_position: int = 65536) -> dict:
    """A tiny Llama ``config.json`` for ``--load-format dummy`` (no weights are ever loaded: the
    stand-in worker has no model)."""
    heads = kv_heads * 2
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": heads * head_dim, "head_dim": head_dim, "intermediate_size": 128,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers, "vocab_size": vocab_size,
        "max_position_embeddings": max_position, "torch_dtype": dtype,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }


def write_model_dir(path: str, **kw) -> str:
    """Writes :func:`model_config` to ``path/config.json``; returns ``path``."""
    import json
    import os

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model_config(**kw), f, indent=1)
    return path
