"""Token-id prompts for a trace, so that the prefix reuse the trace describes happens for real.

A session's turn ``k`` is the first ``cached_tokens`` of turn ``k-1``'s prompt followed by fresh
tokens (seeded by the session and the turn) up to ``prompt_tokens``: a server with a prefix
cache finds that prefix cached. Tokens are drawn from ``[low, vocab)``.
"""

from __future__ import annotations

import hashlib
import random


class PromptBook:
    def __init__(self, vocab: int, low: int = 10, seed: int = 0):
        if vocab <= low + 1:
            raise ValueError(f"vocab {vocab} leaves no tokens above {low}")
        self.vocab, self.low, self.seed = vocab, low, seed
        self._last: dict[str, list[int]] = {}

    def _fresh(self, session: str, turn: int, n: int) -> list[int]:
        h = hashlib.blake2b(f"{self.seed}/{session}/{turn}".encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(h, "little"))
        return [rng.randrange(self.low, self.vocab) for _ in range(n)]

    def prompt(self, turn) -> list[int]:
        """The token ids of one turn (turns of a session in order)."""
        prev = self._last.get(turn.session, [])
        keep = prev[:min(turn.cached_tokens, len(prev), turn.prompt_tokens)]
        ids = keep + self._fresh(turn.session, turn.turn, turn.prompt_tokens - len(keep))
        self._last[turn.session] = ids
        return ids
