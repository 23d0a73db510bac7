"""`--ngram-first`: a network drafter (DFlash, EAGLE-3, MTP) that lets prompt lookup draft the
rounds where the context's suffix recurs: suffix-decoding style, per request and round.

Where a model's output copies its prompt (code edits, quoting, summaries), an n-gram lookup
drafts long accepted runs for nothing but host work, while the network pays a forward for drafts
no better; elsewhere the lookup finds nothing worth proposing and the network drafts. Each
round, the context's longest suffix that occurred earlier (ngram.py `NgramIndex.match`, up to
MAX_N tokens) decides: MIN_MATCH tokens or more, the n-gram proposal; else the network's.

The network's state stays its own: on an n-gram round its maintenance may be left out (the
network drafters catch up on every committed row when they next propose: base.py
`catches_up`), so a batched engine's loop skips it there as it does for a K-0 round
(batching/chain.py `skips_maint`), and the round drafts on the host, apart from the network's
shared forward (batching/chain_drafts.py). Drafts are deterministic either way (an n-gram's
are one-hot; the network's as it draws them), so acceptance, greedy or sampled, keeps the
target's distribution and the greedy ids are the target's.

`source_stats` counts the rounds, drafts and accepted drafts of each source (the request's
result `stats.drafts_by_source`); an n-gram round's accepted drafts are read from the context
that follows it (an accepted draft is the committed token; a rejected one never is).
"""

from __future__ import annotations

from .base import Drafter, Proposal
from .ngram import NgramIndex
from .wrapping import Wrapping

__all__ = ["NgramFirst", "MIN_MATCH", "MAX_N", "NGRAM_FIRST_DRAFTERS"]

MIN_MATCH = 4  # suffix tokens that must recur for the n-gram to draft the round
MAX_N = 8  # the longest suffix looked up
NGRAM_FIRST_DRAFTERS = ("dflash", "eagle3", "mtp")  # network drafters that catch up on skipped rounds


class NgramFirst(Wrapping):
    host_only = False

    def __init__(self, inner: Drafter, min_match: int | None = None):
        super().__init__(inner, f"{inner.name}+ngram")  # the network drafter
        self.index = NgramIndex(MAX_N, 1)
        self.min_match = MIN_MATCH if min_match is None else min_match
        self._pick: tuple[int, list[int]] | None = None  # (context length, n-gram drafts) decided for it
        self._open: tuple[int, list[int]] | None = None  # the latest n-gram round's (start, drafts), unscored
        self.counts = {"ngram": [0, 0, 0], "network": [0, 0]}  # rounds, drafted[, accepted]

    def host_round(self, context: list[int], k: int) -> bool:
        """Whether the round after `context` drafts from the n-gram lookup (decided once per context)."""
        if self._pick is None or self._pick[0] != len(context):
            self._score(context)
            n, toks = self.index.match(context, max(k, 0))
            self._pick = (len(context), toks if n >= self.min_match and toks else [])
        return bool(self._pick[1]) and k > 0

    def _score(self, context: list[int]) -> None:
        """The accepted drafts of the open n-gram round, read from the context that follows it."""
        if self._open is None or len(context) <= self._open[0]:
            return
        start, toks = self._open
        got = context[start:start + len(toks)]
        j = 0
        while j < len(got) and got[j] == toks[j]:
            j += 1
        self.counts["ngram"][2] += j
        self._open = None

    def reset(self) -> None:
        """A new request (an engine keeps its drafter from one request to the next): its counts from 0."""
        self._pick = self._open = None
        self.counts = {"ngram": [0, 0, 0], "network": [0, 0]}

    def propose(self, context, k, sp, gen) -> Proposal:
        if self.host_round(context, k):
            toks = self._pick[1][:k]
            self._open = (len(context), toks)
            self.counts["ngram"][0] += 1
            self.counts["ngram"][1] += len(toks)
            return Proposal(ids=toks)
        prop = self.inner.propose(context, k, sp, gen)
        self._count_net(prop, k)
        return prop

    def _count_net(self, prop: Proposal, k: int) -> None:
        if k > 0:
            self.counts["network"][0] += 1
            self.counts["network"][1] += prop.count()

    @staticmethod
    def propose_many(drafters, contexts, ks, sps, gens) -> list[Proposal]:
        """The network's shared forward for requests whose round is not an n-gram one (chain_drafts.py
        groups only those)."""
        props = Wrapping.inner_many(drafters, contexts, ks, sps, gens)
        for d, p, k in zip(drafters, props, ks):
            d._count_net(p, k)
        return props

    def source_stats(self, context: list[int], accepted: int) -> dict:
        """Rounds, drafts and accepted drafts by source, once the request ended with `context`
        and `accepted` drafts in all (the network's: the rest)."""
        self._score(context)
        r, d, a = self.counts["ngram"]
        nr, nd = self.counts["network"]
        return {"ngram": {"rounds": r, "drafted": d, "accepted": a},
                "network": {"rounds": nr, "drafted": nd, "accepted": max(accepted - a, 0)}}
