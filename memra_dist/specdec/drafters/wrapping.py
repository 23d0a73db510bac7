"""A drafter that wraps another (`inner`): what it does not change is the inner drafter's.

`NgramFirst` (ngram_first.py) lets prompt lookup draft some rounds of a network drafter; the
bench's `TapReplay` (bench/tap_replay.py) pays a real drafter's forwards and replays recorded
drafts. Both hand their inner drafter its lifecycle (alloc, prime, maintain, drain), its
batching (the step leader's chains, the shared forwards of `maintain_many` over the inner
drafters, the key of the network they share) and the first-token profile's timer; each
overrides only how a round's drafts are chosen (`propose`, `propose_many`)."""

from __future__ import annotations

from .base import Drafter, prime_all

__all__ = ["Wrapping"]


class Wrapping(Drafter):
    def __init__(self, inner: Drafter, name: str):
        self.inner = inner
        self.name = name
        self.device = inner.device

    # in a batched engine the wrapped requests draft with the other requests of the inner network
    @property
    def chains(self) -> bool:
        return getattr(self.inner, "chains", False)

    @property
    def batched(self) -> bool:
        return getattr(self.inner, "batched", False)

    @property
    def catches_up(self) -> bool:
        return getattr(self.inner, "catches_up", False)

    @property
    def pre_maintains(self) -> bool:
        return getattr(self.inner, "pre_maintains", False)

    @staticmethod
    def pre_maintain_many(drafters, rows) -> int:
        return type(drafters[0].inner).pre_maintain_many([d.inner for d in drafters], rows)

    @property
    def drafts_early(self) -> bool:
        return getattr(self.inner, "drafts_early", False)

    @staticmethod
    def draft_early_many(drafters, verify, pred, ids) -> int:
        return type(drafters[0].inner).draft_early_many([d.inner for d in drafters], verify, pred, ids)

    def drop_pre(self) -> None:
        self.inner.drop_pre()

    @property
    def loop_prime(self) -> bool:
        return getattr(self.inner, "loop_prime", False)

    @property
    def batch_key(self):
        return self.inner.batch_key

    @property
    def forwards_per_draft(self) -> int:
        return getattr(self.inner, "forwards_per_draft", -1)

    @property
    def ttft_depth(self):
        """The first-token profile's timer, lent to the inner drafter's prime (phase/first_token.py `lend`)."""
        return getattr(self.inner, "ttft_depth", None)

    @ttft_depth.setter
    def ttft_depth(self, timer) -> None:
        if hasattr(self.inner, "ttft_depth"):
            self.inner.ttft_depth = timer

    def alloc(self, capacity: int) -> float:
        return self.inner.alloc(capacity)

    def reset(self) -> None:
        """A new request: the wrapper's own state from the start (the inner drafter's is primed)."""

    def prime(self, prompt: list[int], chunks=None) -> None:
        self.reset()
        self.inner.prime(prompt, chunks)

    @staticmethod
    def prime_many(drafters, prompts, chunks, rows: int = 0) -> None:
        for d in drafters:
            d.reset()
        prime_all([d.inner for d in drafters], prompts, chunks, rows)

    def maintain(self, context) -> None:
        self.inner.maintain(context)

    def drain(self) -> None:
        self.inner.drain()

    @staticmethod
    def maintain_many(drafters, contexts) -> None:
        type(drafters[0].inner).maintain_many([d.inner for d in drafters], contexts)

    @staticmethod
    def inner_many(drafters, contexts, ks, sps, gens, **kw):
        """The inner network's shared forward for `drafters` (each one's Proposal)."""
        return type(drafters[0].inner).propose_many([d.inner for d in drafters], contexts, ks, sps, gens, **kw)
