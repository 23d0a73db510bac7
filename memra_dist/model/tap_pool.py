"""The tap sinks of a batched engine's requests as slots of one pool, so a step's taps go into
every request's sink in one launch a tapped layer, and a shared draft forward gathers every
request's tap rows in one launch a layer.

Alone, a request's TapSink holds a (capacity, H) buffer per tapped layer (taps.py). In a
batched engine every request has its own, and both ends of the taps went request by request: a
step scattered each request's rows into its sink (requests x tapped layers copies), and the step
leader's shared DFlash ingest or EAGLE-3 forward gathered each request's rows (one `cat` a
request). On an H200 with 16 requests those calls, each giving up and taking back the GIL on the
leader's path, cost ~0.2 ms apiece (BENCHMARKS.md). Here a sink's buffer for layer t is
`bufs[t][slot]` of one (slots + 1, capacity, H) tensor, so every per-request reader and writer
runs unchanged on the view, and `scatter` / `gather` address every request's rows at once by
(slot, position). The pool is allocated at the first request (the engine's requests share one
capacity); the spare slot (`scratch`) takes the pad rows of the draft graphs
(specdec/drafters/dflash_pool_graph.py). A request that finds no slot (another capacity, the
pool full) keeps a sink of its own, and a step holding it scatters request by request.
"""

from __future__ import annotations

import threading

import torch

from ..device import to_device
from ..owner_slots import OwnerSlots
from .taps import TapSink

__all__ = ["TapPool", "pooled", "gather_rows"]


class TapPool:
    def __init__(self, layers, slots: int, hidden: int, device, dtype):
        self.layers = tuple(int(t) for t in layers)
        self.slots, self.hidden, self.device, self.dtype = slots, hidden, device, dtype
        self.scratch = slots
        self.bufs: dict[int, torch.Tensor] = {}
        self.capacity = 0
        self.owners = OwnerSlots(slots)
        self._lock = threading.Lock()  # the first sinks' allocation

    def sink(self, owner, capacity: int) -> TapSink | None:
        """`owner`'s sink (a request's BatchSlot) as views of its slot, the same slot while it
        holds one; None where it must keep its own (another capacity, no slot free)."""
        self.alloc(capacity)
        s = self.owners.take(owner) if capacity == self.capacity else None
        if s is None:
            return None
        sink = TapSink(self.layers, {t: b[s] for t, b in self.bufs.items()})
        sink.pool, sink.pool_slot = self, s
        return sink

    def alloc(self, capacity: int) -> None:
        """The pool's buffers, `capacity` rows a slot (once: later calls keep the first)."""
        with self._lock:
            if not self.bufs:
                self.bufs = {t: torch.zeros(self.slots + 1, capacity, self.hidden, device=self.device,
                                            dtype=self.dtype) for t in self.layers}
                self.capacity = capacity

    def give(self, owner) -> None:
        """The slot `owner` held back (its request left); a no-op for one that holds none."""
        self.owners.give(owner)

    def scatter(self, row_slots: torch.Tensor, pos: torch.Tensor, tapped: dict) -> None:
        """A step's tapped rows (row r of layer t: tapped[t][r]) into the slots row_slots[r] at
        positions pos[r]: one launch a layer."""
        n = row_slots.shape[0]
        for t, b in self.bufs.items():
            b.index_put_((row_slots, pos[:n]), tapped[t][:n].to(b.dtype))

    def gather(self, row_slots: torch.Tensor, pos: torch.Tensor, layers) -> torch.Tensor:
        """Rows (slot row_slots[r], position pos[r]) of `layers`, concatenated in that order:
        (rows, len(layers) * H), as each sink's `rows` concatenates them."""
        return torch.cat([self.bufs[t][row_slots, pos] for t in layers], dim=-1)


def pooled(sinks) -> TapPool | None:
    """The pool every one of these sinks is a slot of, else None (a None sink among them too)."""
    pool = getattr(sinks[0], "pool", None) if sinks else None
    if pool is None or any(getattr(s, "pool", None) is not pool for s in sinks):
        return None
    return pool


def gather_rows(sinks, ranges: list[tuple[int, int]], device) -> torch.Tensor:
    """Each sink's tap rows [lo, hi), in sink order, concatenated: (sum of rows, n_taps * H),
    as `torch.cat([s.rows(lo, hi) ...])`; for pooled sinks one gather a layer."""
    pool = pooled(sinks)
    if pool is None:
        return torch.cat([s.rows(lo, hi) for s, (lo, hi) in zip(sinks, ranges)])
    slots = to_device([s.pool_slot for s, (lo, hi) in zip(sinks, ranges) for _ in range(lo, hi)], device)
    pos = to_device([p for lo, hi in ranges for p in range(lo, hi)], device)
    return pool.gather(slots, pos, sinks[0].layers)
