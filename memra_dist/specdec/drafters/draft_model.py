"""`model`: a smaller checkpoint of the same vocabulary drafts autoregressively, with its own
cache; maintenance rolls that cache back to the prefix it shares with the committed context."""

from __future__ import annotations

import torch

from ...runner import ModelRunner
from ..sampling import SamplingParams, probs
from .base import EMPTY, Drafter, Proposal

__all__ = ["ModelDrafter"]


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.device = runner.device
        self.cached: list[int] = []  # the token ids whose rows sit in the draft cache, in order
        self.safe = 0  # cached[:safe] is known to equal the committed context

    def alloc(self, capacity: int) -> float:
        self.runner.alloc(capacity)
        self.cached, self.safe = [], 0
        return self.runner.cache.nbytes() / 2**20

    def prime(self, prompt: list[int]) -> None:
        # ingest all but the last prompt token; propose() feeds the pending tail
        if len(prompt) > 1:
            self.runner.forward(torch.tensor(prompt[:-1]), 0)
            self.cached = list(prompt[:-1])

    def propose(self, context, k, sp: SamplingParams, gen) -> Proposal:
        if k == 0:
            return EMPTY
        feed = context[len(self.cached):]  # >= 1 token: maintain keeps the last one out
        logits = self.runner.forward(torch.tensor(feed), len(self.cached))[-1:]  # (1, V)
        self.cached.extend(feed)
        if sp.greedy:
            return self._greedy_chain(logits, k)
        toks, qs = [], []
        for i in range(k):
            q = probs(logits, sp)  # (1, V)
            t = int(torch.multinomial(q[0].cpu(), 1, generator=gen))
            qs.append(q[0])
            toks.append(t)
            if i + 1 < k:
                logits = self.runner.forward(torch.tensor([t]), len(self.cached))
                self.cached.append(t)
        return Proposal(torch.tensor(toks, dtype=torch.long), torch.stack(qs))

    def _greedy_chain(self, logits: torch.Tensor, k: int) -> Proposal:
        """K greedy steps with the argmax kept on the drafter's device: each step's token
        feeds the next forward directly, and the K tokens come back to the host once."""
        toks = []
        start = len(self.cached)
        for i in range(k):
            t = logits[-1].argmax().view(1)  # (1,) int64 on the device
            toks.append(t)
            if i + 1 < k:
                logits = self.runner.forward(t, start + i)
        ids = torch.cat(toks).cpu()  # the one readback of the chain
        self.cached.extend(ids[:k - 1].tolist())
        return Proposal(ids)

    def maintain(self, context) -> None:
        m = self.safe
        lim = min(len(self.cached), len(context) - 1)
        while m < lim and self.cached[m] == context[m]:
            m += 1
        if m < len(self.cached):
            self.runner.rollback(m)
            del self.cached[m:]
        self.safe = m

    def drain(self) -> None:
        self.runner.drain()
