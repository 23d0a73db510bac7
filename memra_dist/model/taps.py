"""Taps: the hidden states of chosen target layers, kept for the rows a forward ran.

A tap id t names the OUTPUT of decoder layer t (HF `hidden_states[t + 1]`): the residual
stream after block t, before the final norm (for the last layer HF's `hidden_states[L]` is
after the final norm; a tap is not). A `TapSink` holds one preallocated
(capacity, H) buffer per tapped layer; the stage's forward writes each tapped layer's
output rows at the rows' positions (`index_copy_` at the positions tensor), so a tapped
forward has static shapes, no host readback, and is capturable in a CUDA graph exactly as
the cache writes are. Rows past the committed length are stale (a rejected verify wrote
them) until a later forward overwrites them: readers take committed rows only.

The sink lives on the stage's cache (`StageCache.taps`), so every session slot has its own.
At pp > 1 each stage holds the taps of its own layers (`stage_taps`) and ships them with its
activations: a stage receives the taps of the stages before it (`shipped_before`), appends
its own (`gather(pos)`) and sends both on, so the head gets every remote tap of a forward's
rows right behind the hidden rows, and writes them into its own sink, which holds every
tapped layer. Only committed rows are read, and every forward rewrites its rows, so a
rollback needs nothing shipped.
"""

from __future__ import annotations

import torch

__all__ = ["TapSink", "FINAL", "stage_taps", "shipped_before"]

# The tap id of the head stage's hidden state AFTER the final norm (what lm_head reads; HF's
# `hidden_states[-1]`): an MTP drafter's input. Kept by the stage that owns the head.
FINAL = -1


class TapSink:
    """Per-layer tap buffers, each (capacity, H), written by position."""

    def __init__(self, layers: tuple[int, ...], bufs: dict[int, torch.Tensor]):
        self.layers = tuple(layers)  # the tap order (the drafter's feature order)
        self.bufs = bufs  # layer -> (capacity, H); only this sink's layers (a subset at pp > 1)

    @classmethod
    def alloc(cls, layers, capacity: int, hidden: int, device, dtype) -> "TapSink":
        layers = tuple(int(t) for t in layers)
        if len(set(layers)) != len(layers):
            raise ValueError(f"duplicate tap layers {layers}")
        return cls(layers, {t: torch.zeros(capacity, hidden, device=device, dtype=dtype) for t in layers})

    @property
    def capacity(self) -> int:
        return next(iter(self.bufs.values())).shape[0] if self.bufs else 0

    def wants(self, layer: int) -> bool:
        return layer in self.bufs

    def write(self, layer: int, pos: torch.Tensor, h: torch.Tensor) -> None:
        """Layer `layer`'s output rows h (T, H) at positions pos (T,): one device copy."""
        self.bufs[layer].index_copy_(0, pos, h.to(self.bufs[layer].dtype))

    def rows(self, start: int, end: int) -> torch.Tensor:
        """The taps of rows [start, end), concatenated in tap order: (end - start, n_taps * H).
        A device tensor (no readback)."""
        return torch.cat([self.bufs[t][start:end] for t in self.layers], dim=-1)

    def gather(self, pos: torch.Tensor) -> torch.Tensor:
        """This sink's layers' rows at `pos`, concatenated in tap order: (T, n_local * H)
        (what a pipeline stage will ship to the head with its activations)."""
        return torch.cat([self.bufs[t].index_select(0, pos) for t in self.layers if t in self.bufs], dim=-1)

    def subset(self, first: int, last: int) -> "TapSink":
        """The stage-local view over layers [first, last): the same buffers, fewer layers."""
        keep = tuple(t for t in self.layers if first <= t < last)
        return TapSink(keep, {t: self.bufs[t] for t in keep})

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values())


def stage_taps(layers, stages, s: int) -> tuple[int, ...]:
    """The tap layers pipeline stage `s` holds, in tap order; FINAL is the last stage's (the
    head's).

    >>> stage_taps((1, 8, 15, FINAL), [(0, 8), (8, 16)], 0), stage_taps((1, 8, 15, FINAL), [(0, 8), (8, 16)], 1)
    ((1,), (8, 15, -1))
    """
    first, last = stages[s]
    return tuple(t for t in layers if (t != FINAL and first <= t < last) or (t == FINAL and s == len(stages) - 1))


def shipped_before(layers, stages, s: int) -> tuple[int, ...]:
    """The taps stage `s` receives behind its input rows: stages 0 .. s-1's, stage by stage,
    each in tap order (the order the columns arrive in).

    >>> shipped_before((15, 1, 8), [(0, 4), (4, 12), (12, 16)], 2)
    (1, 8)
    """
    return tuple(t for i in range(s) for t in stage_taps(layers, stages, i))
