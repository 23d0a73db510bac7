"""`ngram`: prompt lookup. Find the latest earlier occurrence of the context's last n tokens
(n from `max_n` down to `min_n`) and propose the tokens that followed it."""

from __future__ import annotations

import torch

from .base import EMPTY, Drafter, Proposal

__all__ = ["NgramDrafter", "lookup"]


def lookup(context: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Pure: the up-to-k tokens after the most recent earlier match of the longest suffix.

    >>> lookup([1, 2, 3, 9, 1, 2], 2)
    [3, 9]
    """
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = context[L - n:]
        for s in range(L - n - 1, -1, -1):  # latest earlier start first
            if context[s:s + n] == tail:
                return context[s + n:s + n + k]
    return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, context, k, sp, gen) -> Proposal:
        toks = lookup(context, k, self.max_n, self.min_n)
        return Proposal(torch.tensor(toks, dtype=torch.long)) if toks else EMPTY
