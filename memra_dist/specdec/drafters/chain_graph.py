"""The model drafter's greedy chain as ONE CUDA graph (draft_model.py `_greedy_chain`).

A round of the `model` drafter feeds its pending context tokens (the catch-up forward, a
step graph of the draft runner), then drafts K tokens greedily: K - 1 one-row forwards, each
fed the previous step's argmax. Replaying the runner's 1-row step graph K - 1 times costs a
launch, a position write and an output copy per step; this graph holds the whole chain:

  inputs   `tok`   (1,) the first draft (the catch-up logits' argmax, copied on the device)
           `start` (1,) the position of the first chain row (`row.start`, host_row.py: one
                        pinned copy before each replay)
  body     ids[0] = tok
           for i < K - 1: ids[i+1] = argmax(stage(ids[i], start + i))   (positions added on
                          the device; the draft cache's rows start .. start + K - 2 written
                          as the eager steps write them)
  output   `ids`   (K,) the K drafted ids, a static buffer read back once per round

The round's catch-up forward is in the graph too, for the feeds a steady state has: after a
verify the pending tokens are 1 (a draft was rejected: the target's token) or 2 (all K
accepted: the last draft and the bonus). `run_feed` takes those ids: one host-to-device copy
of [ids, start] from a pinned row, one replay, one readback: the catch-up's own replay, its
logits copy and the argmax launch no longer sit between the accept's readback and the chain
while the device waits. Other feeds (a longer one) take the catch-up step and `run`.

No Python value of a round is baked in: the positions, the causal mask and the rotary rows
all derive from `start` on the device. The cache's host bookkeeping (`cache.begin` per step:
the length, the capacity check) runs on the host before the replay. Captured once at the
drafter's allocation for the run's K (the warm-ups write rows 0 .. K-2 of the fresh cache,
rewritten by the prime before anything reads them, as graphs.StepGraphs.warm's do; the feed
graphs' rows 0 .. K, likewise); a
round asking for another k (the end of a request) runs the per-step path instead.

Only for a runner that captures its own steps (`runner.graphs`, CUDA with graphs on) whose
layers are all attention-family mixers: a recurrent state (KDA) keeps per-forward bookkeeping
in `begin`, which one replay of K - 1 steps would not reproduce. The compiled blocks are used
when the runner compiles them (as graphs.StepGraphs._eager does). The eager per-step chain
stays the reference (CPU, tests: tests/test_model_chain_graph.py replays an emulated capture).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ...graphs import compiled_blocks, hold_collector
from .dflash_graph import _CudaGraph
from .host_row import HostRow

__all__ = ["ChainGraph", "chain_graph", "chain_eligible", "ATTENTION_MIXERS", "FEEDS"]

ATTENTION_MIXERS = ("attn", "mla")  # states that roll back by length alone: `begin` is a no-op per layer
FEEDS = (1, 2)  # the catch-up feeds of a steady state (after a rejection; after all K accepted)


class ChainGraph:
    def __init__(self, runner, k: int, graph_cls=_CudaGraph, pool=None):
        """K - 1 chained one-row steps of `runner` over its current cache, captured now.
        `graph_cls(fn, pool)` captures fn and exposes `.out` and `.replay()` (tests pass an
        emulated one); `pool`: a graph pool handle to share (a fresh one when None on CUDA)."""
        if k < 2:
            raise ValueError(f"a chain graph drafts k >= 2 tokens (got {k})")
        self.r, self.k = runner, k
        self._cache = weakref.ref(runner.cache)  # the cache the graph bakes in (not kept alive by it)
        self.capacity = runner.cache.capacity
        dev = runner.device
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.ids = torch.zeros(k, dtype=torch.long, device=dev)
        if pool is None and graph_cls is _CudaGraph:
            pool = torch.cuda.graph_pool_handle()
        self.pool = pool
        # the graphs' host inputs, [fed ids ..., start], in one pinned copy (`row.start`: the first
        # row's position, which every graph here reads)
        self.row = HostRow(max(FEEDS), dev)
        self.base = torch.arange(max(FEEDS), device=dev)
        on_dev = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with on_dev, torch.inference_mode(), hold_collector():  # the captures' streams on the runner's device
            self.graph = graph_cls(self._body, pool)
            self.fed = {r: graph_cls(lambda r=r: self._feed_body(r), pool) for r in FEEDS
                        if r + k - 1 <= self.capacity}

    def over(self, cache) -> bool:
        """Whether the graph was captured over this cache (a new cache needs a new graph)."""
        return cache is not None and self._cache() is cache

    def _chain(self, first: int) -> torch.Tensor:
        """ids[1 ..] from ids[0]: the K - 1 one-row forwards at rows start + first + i."""
        st, cache = self.r.stage, self.r.cache
        for i in range(self.k - 1):
            pos = self.row.start + (first + i)  # (1,): a fresh (aligned) tensor, as a step's own
            h = st(self.ids[i:i + 1], pos, cache, None)
            self.ids[i + 1:i + 2].copy_(st.logits(h)[-1].argmax().view(1))
        return self.ids

    def _body(self) -> torch.Tensor:
        with compiled_blocks(self.r.stage):  # the compiled blocks, as the step graphs capture them
            self.ids[:1].copy_(self.tok)
            return self._chain(0)

    def _feed_body(self, r: int) -> torch.Tensor:
        """The catch-up forward of the r fed ids at rows start .. start + r - 1, then the chain."""
        st, cache = self.r.stage, self.r.cache
        with compiled_blocks(st):
            h = st(self.row.ids[:r], self.row.start + self.base[:r], cache, None)
            self.ids[:1].copy_(st.logits(h)[-1].argmax().view(1))  # every row's logits, as runner.forward's
            return self._chain(r)

    def feeds(self, n: int) -> bool:
        """Whether a catch-up of n fed tokens replays with its chain (`run_feed`)."""
        return n in self.fed

    @torch.inference_mode()
    def run_feed(self, feed: list[int], start: int) -> torch.Tensor:
        """The catch-up forward of `feed` (host ids, `feeds(len(feed))`) at rows start .. and
        the chain after it -> the K drafted ids (the static (K,) device buffer)."""
        r, cache = len(feed), self.r.cache
        cache.begin(start, r)  # the host bookkeeping the eager steps would do
        for i in range(self.k - 1):
            cache.begin(start + r + i, 1)
        self.row.load(feed, start)
        self.fed[r].replay()
        return self.ids

    @torch.inference_mode()
    def run(self, tok: torch.Tensor, start: int) -> torch.Tensor:
        """The chain from `tok` ((1,) device id: the first draft) with its K - 1 forwards at
        rows start .. start + K - 2 -> the K drafted ids (the static (K,) device buffer:
        read it before the next replay)."""
        cache = self.r.cache
        for i in range(self.k - 1):  # the host bookkeeping each eager step would do
            cache.begin(start + i, 1)
        self.row.load((), start)
        self.tok.copy_(tok)  # device to device, in stream order
        self.graph.replay()
        return self.ids


def chain_eligible(runner, k: int) -> bool:
    """Whether the runner's greedy chain of k drafts may be one graph: k >= 2, a whole model
    (embedding and head), every layer an attention-family mixer, the cache long enough for
    the capture's warm-up rows."""
    st = runner.stage
    return (k >= 2 and st.has_embed and st.has_head and runner.cache is not None
            and k - 1 <= runner.cache.capacity
            and all(getattr(b.self_attn, "mixer_class", None) in ATTENTION_MIXERS for b in st.layers.values()))


def chain_graph(runner, k: int) -> ChainGraph | None:
    """The chain graph for k drafts over the runner's current cache when the runner captures
    its steps (CUDA, graphs on) and the chain is eligible, else None. Shares the step graphs'
    pool when they have one (replays are sequential on one stream; the step graphs' outputs
    are static buffers the allocator keeps)."""
    g = getattr(runner, "graphs", None)
    if g is None or runner.device.type != "cuda" or not chain_eligible(runner, k):
        return None
    return ChainGraph(runner, k, pool=g.pool)
