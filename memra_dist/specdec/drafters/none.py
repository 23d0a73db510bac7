"""`none`: propose nothing, so every round verifies one row - plain autoregressive decoding
through the same session (the baseline the speculative drafters are compared to)."""

from __future__ import annotations

from .base import EMPTY, Drafter, Proposal

__all__ = ["NoDrafter"]


class NoDrafter(Drafter):
    name = "none"
    host_only = True  # nothing but the host
    chains = True  # a batched greedy request's rounds run in the step leader (batching/chain.py)

    def propose(self, context, k, sp, gen) -> Proposal:
        return EMPTY
