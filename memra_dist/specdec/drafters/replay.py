"""`replay` - a BENCHMARKING TOOL, not a drafter for real use: it proposes a recorded target
continuation, corrupting each proposed token with probability `corrupt`, so the engine can
be measured at a controlled acceptance (about 1 - corrupt per token under greedy)."""

from __future__ import annotations

import torch

from .base import EMPTY, Drafter, Proposal

__all__ = ["ReplayDrafter"]


class ReplayDrafter(Drafter):
    name = "replay"
    host_only = True  # nothing but the host
    chains = True  # a batched greedy request's rounds run in the step leader (batching/chain.py)

    def __init__(self, recorded: list[int], prompt_len: int, vocab_size: int, corrupt: float = 0.0, seed: int = 0):
        if not 0.0 <= corrupt <= 1.0:
            raise ValueError("corrupt must be in [0, 1]")
        self.recorded, self.prompt_len, self.vocab = list(recorded), prompt_len, vocab_size
        self.corrupt = corrupt
        self.gen = torch.Generator().manual_seed(seed)  # its own stream: sampling draws stay the target's

    def propose(self, context, k, sp, gen) -> Proposal:
        at = len(context) - self.prompt_len
        toks = torch.tensor(self.recorded[at:at + k], dtype=torch.long)
        if toks.numel() == 0:
            return EMPTY
        if self.corrupt > 0:
            hit = torch.rand(toks.shape[0], generator=self.gen) < self.corrupt
            shift = torch.randint(1, self.vocab, toks.shape, generator=self.gen)
            toks = torch.where(hit, (toks + shift) % self.vocab, toks)  # a different id
        return Proposal(toks)
