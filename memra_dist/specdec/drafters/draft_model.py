"""`model`: a smaller checkpoint of the same vocabulary drafts autoregressively, with its own
cache; maintenance rolls that cache back to the prefix it shares with the committed context.

Greedy rounds of the run's K replay one CUDA graph for the catch-up forward of the pending
tokens and the whole chain of K - 1 one-row forwards when the draft runner captures its steps
(chain_graph.py, captured at alloc); other rounds (a shortened k, sampling, CPU) step through
`runner.forward`.

In a batched engine each request's drafter runs over a slot of the draft model's own batcher
(batching/slot.py), and the engine loop runs its rounds (batching/chain.py): `propose_many`
drafts every chained request of a step together, each draft step ONE batched forward of the
draft model for all of them (the catch-up rows first, then one row a request still drafting),
so --spec-k auto chooses their K as it does the tap drafters'."""

from __future__ import annotations

import torch

from ...runner import ModelRunner
from ..sampling import SamplingParams, draw_drafts, probs
from .chain_picks import draw_requests
from .base import EMPTY, PARK, Drafter, Proposal
from .chain_graph import chain_graph

__all__ = ["ModelDrafter"]


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, runner: ModelRunner, k: int = 0):
        """`k`: the run's K, the chain length the greedy chain graph is captured for (0: none)."""
        self.runner = runner
        self.device = runner.device
        self.k = k
        self.chain = None  # the greedy chain's CUDA graph (chain_graph.py), when the runner captures its steps
        self.cached: list[int] = []  # the token ids whose rows sit in the draft cache, in order
        self._fed: torch.Tensor | None = None  # a greedy chain's drafts fed back, on the device until maintain
        self.safe = 0  # cached[:safe] is known to equal the committed context

    @property
    def chains(self) -> bool:
        """Its rounds may run in the engine loop: where its runner is a draft batcher's slot."""
        return hasattr(self.runner, "batcher")

    batched = chains  # ... and the loop drafts a step's chained requests together (propose_many)

    @property
    def batch_key(self):
        return self.runner.batcher

    @staticmethod
    def maintain_many(drafters, contexts) -> None:
        for d, context in zip(drafters, contexts):
            d.maintain(context)

    @staticmethod
    def propose_many(drafters, contexts, ks, sps, gens) -> list[Proposal]:
        """Each drafter's `propose(context, k, sp, gen)`, the draft steps of all of them batched:
        the catch-up rows of every request in one forward of the draft batcher, then step i's
        one row of every request still drafting (k > i) in one forward, each request's draws
        from its own generator in the order its own propose draws them (a step's sampled draws
        made together on the device, one readback: chain_picks.py `draw_requests`). A request whose rows
        found no room in the draft pool without waiting gets `PARK` (its session drafts that
        round itself; its drafter's rows past its context go at that propose's maintain)."""
        from ...batching.slot import BatchSlot  # noqa: PLC0415

        live = [i for i, k in enumerate(ks) if k > 0]
        parked: set[int] = set()
        toks: dict[int, list] = {i: [] for i in live}
        qs: dict[int, list] = {i: [] for i in live}
        rows = {}
        for i in live:
            d = drafters[i]
            d.maintain(contexts[i])  # (a no-op after its maintenance; see `propose`)
            rows[i] = torch.tensor(contexts[i][len(d.cached):])  # >= 1 token: maintain keeps the last one out
        while live:
            logits = BatchSlot.forward_many([drafters[i].runner for i in live], [rows[i] for i in live],
                                            [len(drafters[i].cached) for i in live])
            nxt = []
            samp = [(i, lg) for i, lg in zip(live, logits) if lg is not None and not sps[i].greedy]
            drawn = dict(zip((i for i, _ in samp), draw_requests(  # the step's sampled draws at once, one readback
                [lg[-1:].float() for _, lg in samp], [sps[i] for i, _ in samp], [gens[i] for i, _ in samp],
                drafters[samp[0][0]].name, samp[0][1].device))) if samp else {}
            for i, lg in zip(live, logits):
                if lg is None:
                    parked.add(i)
                    continue
                d, sp = drafters[i], sps[i]
                d.cached.extend(rows[i].tolist())
                if sp.greedy:
                    t = int(d._argmax(lg))
                else:
                    t = int(drawn[i].tokens[0])
                    qs[i].append(drawn[i].q[0])
                toks[i].append(t)
                if len(toks[i]) < ks[i]:
                    rows[i] = torch.tensor([t])
                    nxt.append(i)
            live = nxt
        out = []
        for i, k in enumerate(ks):
            if k == 0:
                out.append(EMPTY)
            elif i in parked:
                out.append(PARK)
            elif sps[i].greedy:
                out.append(Proposal(torch.tensor(toks[i], dtype=torch.long)))
            else:
                out.append(Proposal(torch.tensor(toks[i], dtype=torch.long), torch.stack(qs[i])))
        return out

    def alloc(self, capacity: int) -> float:
        if self.chain is not None and self.chain.capacity != capacity:
            self.chain = None  # a new cache comes: drop the graph over the old one first
        self.runner.alloc(capacity)
        self.cached, self.safe, self._fed = [], 0, None
        if self.chain is None or not self.chain.over(self.runner.cache):
            self.chain = None
            self.chain = chain_graph(self.runner, self.k)  # captured here, none inside a round
        return self.runner.kv_mb()

    def prime(self, prompt: list[int], chunks: list[tuple[int, int]] | None = None) -> None:
        # ingest all but the last prompt token, chunk by chunk (only each chunk's last row
        # reaches the lm_head); propose() feeds the pending tail
        n = len(prompt) - 1
        ids = torch.tensor(prompt)
        skip = getattr(self.runner, "cached_rows", 0)  # a batched draft slot's rows shared from the prefix cache
        for lo, hi in chunks or [(0, n)]:
            lo = max(lo, skip)
            if lo < min(hi, n):
                self.runner.forward(ids[lo:min(hi, n)], lo, last=True)
        self.cached = list(prompt[:-1])

    def propose(self, context, k, sp: SamplingParams, gen) -> Proposal:
        if k == 0:
            return EMPTY
        # a propose with no maintain since the last one (a bench's wrapper; a batched engine's
        # round run by the session after the loop's proposal for it was dropped: its request parked)
        self.maintain(context)
        feed = context[len(self.cached):]  # >= 1 token: maintain keeps the last one out
        if sp.greedy and self.chain is not None and k == self.chain.k and self.chain.feeds(len(feed)):
            ids = self.chain.run_feed(feed, len(self.cached))  # catch-up + chain: one replay, no readback
            self.cached.extend(feed)
            self._fed = ids[:k - 1]
            return Proposal(ids)
        logits = self.runner.forward(torch.tensor(feed), len(self.cached))[-1:]  # (1, V)
        self.cached.extend(feed)
        if sp.greedy:
            return self._greedy_chain(logits, k)
        toks, qs = [], []
        for i in range(k):
            t, q = self._draw(logits, sp, gen)
            qs.append(q)
            toks.append(t)
            if i + 1 < k:
                logits = self.runner.forward(torch.tensor([t]), len(self.cached))
                self.cached.append(t)
        return Proposal(torch.tensor(toks, dtype=torch.long), torch.stack(qs))

    def _greedy_chain(self, logits: torch.Tensor, k: int) -> Proposal:
        """K greedy steps with the argmax kept on the drafter's device: each step's token
        feeds the next forward directly, and the K tokens come back to the host once. At the
        run's K with a chain graph, the K - 1 forwards are one replay."""
        start = len(self.cached)
        t = self._argmax(logits)
        if self.chain is not None and k == self.chain.k:
            ids = self.chain.run(t, start)
        else:
            toks = [t]
            for i in range(k - 1):
                logits = self.runner.forward(t, start + i)
                t = self._argmax(logits)
                toks.append(t)
            ids = torch.cat(toks)
        self._fed = ids[:k - 1]
        return Proposal(ids)

    def _draw(self, logits: torch.Tensor, sp: SamplingParams, gen) -> tuple[int, torch.Tensor]:
        """A sampled draft from the last row's logits (1, V): (its id, the draft distribution q (V,))."""
        q = probs(logits, sp)  # (1, V)
        return int(draw_drafts(q[:1], gen, self.name)[0]), q[0]

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The last row's argmax as a (1,) int64: on the drafter's device, or, when the forward
        was a batched step's (batching/slot.py), from the argmaxes the step already read back
        (no device op, no readback of this request's own)."""
        rows = getattr(self.runner, "greedy_rows", None)
        if rows is not None:
            return torch.tensor([int(rows[0][-1])], dtype=torch.long)
        return logits[-1].argmax().view(1)

    def _settle(self) -> None:
        """The greedy chain's fed drafts (rows in the draft cache) into `cached`. They stay on
        the device through the round (the verify reads them there, the accept reads them back
        with its own); here, after that readback, the copy waits on nothing."""
        if self._fed is not None:
            self.cached.extend(self._fed.tolist())
            self._fed = None

    def maintain(self, context) -> None:
        self._settle()
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
