"""The drafter interface every proposer implements (one proposer per file)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import SamplingParams

__all__ = ["Drafter", "Proposal", "EMPTY"]


@dataclass
class Proposal:
    # (k',) int64 drafted ids, k' <= k (0 = plain decode this round); on the drafter's device for a
    # graphed greedy drafter (the session reads them back with the verify's argmax), else on the host
    tokens: torch.Tensor
    q: torch.Tensor | None = None  # (k', V) draft probabilities; None = deterministic (one-hot)


EMPTY = Proposal(torch.zeros(0, dtype=torch.long))


class Drafter:
    """Lifecycle per session: alloc(capacity) -> prime(prompt, chunks) -> rounds of
    propose(context, k) ... maintain(context) (after each round's accept)."""

    name = "base"
    device: torch.device | None = None  # device the drafter's state lives on (None: host only)
    host_only = False  # propose / maintain touch nothing but host lists (batching/chain.py may run them)
    # the step leader may run a batched greedy request's rounds (batching/chain.py): host drafters,
    # and device drafters that draft many requests in one forward (`batched`)
    chains = False
    # maintain_many(drafters, contexts) / propose_many(drafters, contexts, ks, sps, gens) -> each one's
    # Proposal (its drafts on the host; greedy, or drawn with its generator): the chained requests of
    # a step that share this drafter's network, in one forward each
    batched = False
    # its propose catches up on every committed row its maintain skipped (DFlash's ingest from its
    # n, EAGLE-3's and MTP's from theirs): a round of K 0 (--spec-k auto) may leave maintain out
    catches_up = False

    @property
    def batch_key(self):
        """What the drafters of one batched forward share (their network): requests whose
        drafters' keys are the same object draft together."""
        return getattr(self, "net", self)

    def alloc(self, capacity: int) -> float:
        """Allocate per-session state; returns the MB allocated (the profile's draft_kv_mb)."""
        return 0.0

    def prime(self, prompt: list[int], chunks: list[tuple[int, int]] | None = None) -> None:
        """Ingest the prompt (draft_prime), in the target's prefill chunks ([lo, hi) row
        ranges over the prompt, specdec/chunks.py; None: one chunk), so the drafter's working
        memory is bounded as the target's is."""

    def propose(self, context: list[int], k: int, sp: SamplingParams, gen: torch.Generator) -> Proposal:
        raise NotImplementedError

    def maintain(self, context: list[int]) -> None:
        """Draft-source maintenance after a round: drop state past the committed context."""

    def drain(self) -> None:
        """Drain the drafter's device stream (a no-op for host-only drafters)."""
