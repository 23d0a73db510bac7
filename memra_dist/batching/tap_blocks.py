"""The tap rows of the prefix cache's blocks: what lets a tap drafter's requests reuse prompts.

A tap drafter (DFlash, EAGLE-3, MTP) reads the target's hidden states at chosen layers for every
position of its request (model/taps.py): its draft cache is primed from them. Those rows are a
function of the tokens up to their position, exactly as the K/V rows are, so they can be cached
with the blocks: a request that shares a prompt's cached K/V blocks (prefix_cache.py) gets the
tap rows of those positions from here instead of running the target over them.

The store is one (blocks, block, H) tensor per tapped layer, indexed by the K/V pool's block
ids (blocks.py). A block's tap rows are saved once, when the block is registered under its hash
(`BlockPool.publish` returns those blocks), from the request's own sink; a request admitted with
cached blocks has their rows loaded into its sink at positions [0, cached rows). A block is only
re-registered after it was evicted, which never happens while a request holds it, so a load
never reads rows another save is overwriting. Saves and loads are device copies queued on the
stream the steps run on, behind the step that wrote the rows and ahead of the drafter's prime.
The drafter still primes its own draft cache over the whole prompt (its network is small
against the target's); the target's prefill of the shared rows is what the cache saves.
"""

from __future__ import annotations

import torch

from ..device import to_device

__all__ = ["TapBlocks"]


class TapBlocks:
    def __init__(self, layers, blocks: int, block: int, hidden: int, device, dtype):
        self.layers = tuple(int(t) for t in layers)
        self.block = block
        self.store = {t: torch.zeros(blocks, block, hidden, device=device, dtype=dtype) for t in self.layers}

    @staticmethod
    def row_bytes(layers, hidden: int, dtype) -> int:
        """What the store adds to each K/V row of the pool."""
        return len(tuple(layers)) * hidden * torch.tensor([], dtype=dtype).element_size()

    def save(self, sink, placed: list[tuple[int, int]]) -> None:
        """The sink's rows of each (block index in its request's table, block id) into the store."""
        if not placed or sink is None:
            return
        dev = next(iter(self.store.values())).device
        idx, ids = to_device([i for i, _ in placed], dev), to_device([b for _, b in placed], dev)
        n = max(i for i, _ in placed) + 1
        for t, st in self.store.items():
            rows = sink.bufs[t][:n * self.block].view(n, self.block, -1)
            st.index_copy_(0, ids, rows.index_select(0, idx).to(st.dtype))

    def load(self, sink, table: list[int]) -> None:
        """The stored rows of blocks `table` (a request's leading cached blocks, in order) into
        the sink at positions [0, len(table) x block)."""
        if not table or sink is None:
            return
        ids = to_device(table, next(iter(self.store.values())).device)
        n = len(table) * self.block
        for t, st in self.store.items():
            sink.bufs[t][:n].copy_(st.index_select(0, ids).view(n, -1))

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.store.values())
