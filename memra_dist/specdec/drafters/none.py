"""`none`: propose nothing, so every round verifies one row - plain autoregressive decoding
through the same session (the baseline the speculative drafters are compared to)."""

from __future__ import annotations

from .base import EMPTY, Drafter, Proposal

__all__ = ["NoDrafter"]


class NoDrafter(Drafter):
    name = "none"

    def propose(self, context, k, sp, gen) -> Proposal:
        return EMPTY
