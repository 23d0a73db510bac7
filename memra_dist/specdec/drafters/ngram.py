"""`ngram`: prompt lookup. Find the latest earlier occurrence of the context's last n tokens
(n from `max_n` down to `min_n`) and propose the tokens that followed it.

`lookup` is the plain reference (a scan of the whole context: milliseconds at a 4k context);
`NgramIndex` gives the same answer from a dict of each n-gram's latest start, updated with
the tokens a round appends, so a proposal costs microseconds whatever the context length."""

from __future__ import annotations

from .base import EMPTY, Drafter, Proposal

__all__ = ["NgramDrafter", "NgramIndex", "lookup"]


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


class NgramIndex:
    """lookup() incrementally. For each n, the latest start of every n-gram that ends before
    the context's last token (the suffix itself is not an earlier occurrence). The context
    only grows within a session; a shorter or different one starts the index over.

    >>> ix = NgramIndex(3, 1)
    >>> ix.lookup([1, 2, 3, 9, 1, 2], 2)
    [3, 9]
    """

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.ends = 0  # n-grams ending (exclusive) at positions < self.ends are indexed
        self.head: list[int] = []  # the first tokens seen, to notice a different context

    def _reset(self) -> None:
        for d in self.latest.values():
            d.clear()
        self.ends, self.head = 0, []

    def _extend(self, context: list[int], upto: int) -> None:
        for e in range(self.ends + 1, upto + 1):  # n-grams ending (exclusive) at e, in order
            for n, d in self.latest.items():
                if e - n >= 0:
                    d[tuple(context[e - n:e])] = e - n  # later starts overwrite: the latest wins
        self.ends = max(self.ends, upto)

    def lookup(self, context: list[int], k: int) -> list[int]:
        return self.match(context, k)[1]

    def match(self, context: list[int], k: int) -> tuple[int, list[int]]:
        """(n, tokens): the length of the longest suffix that recurred earlier (0: none) and the
        up-to-k tokens that followed its latest occurrence (what `lookup` proposes).

        >>> NgramIndex(4, 1).match([5, 1, 2, 3, 9, 1, 2, 3], 2)
        (3, [9, 1])
        """
        L = len(context)
        if L < self.ends + 1 or context[:len(self.head)] != self.head:
            self._reset()
        if not self.head:
            self.head = list(context[:8])
        self._extend(context, L - 1)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            s = self.latest[n].get(tuple(context[L - n:]))
            if s is not None:
                return n, context[s + n:s + n + k]
        return 0, []


class NgramDrafter(Drafter):
    name = "ngram"
    host_only = True  # nothing but the host
    chains = True  # a batched greedy request's rounds run in the step leader (batching/chain.py)

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.index = NgramIndex(max_n, min_n)

    def propose(self, context, k, sp, gen) -> Proposal:
        toks = self.index.lookup(context, k)
        return Proposal(ids=toks) if toks else EMPTY
