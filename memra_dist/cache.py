"""Preallocated per-stage cache: one state per layer, a shared length, commit + rollback.

Attention-class states (KV rows, MLA latents) roll back by length alone: the next forward
writes its rows from the accepted length on, and the attention mask (key position <= query
position) never lets a row past the length be read, so rollback touches no tensor.
Recurrent states (KDA) cannot be truncated; they implement `rollback(new_len)` themselves
from what their last forward kept (see model/kda.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .errors import UserError

__all__ = ["KVLayer", "LayerState", "StageCache"]


class LayerState(Protocol):
    def begin(self, start: int, rows: int) -> None: ...  # a forward of `rows` rows at `start`
    def rollback(self, new_len: int) -> None: ...
    def nbytes(self) -> int: ...


@dataclass
class KVLayer:
    """K and V rows of one attention layer, each (capacity, n_kv, head_dim), zero-filled."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def alloc(cls, capacity: int, n_kv: int, head_dim: int, device, dtype) -> "KVLayer":
        shape = (capacity, n_kv, head_dim)
        # zeros, not empty: masked rows still enter the P@V product, and 0 * NaN = NaN
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    def begin(self, start: int, rows: int) -> None:
        pass

    def rollback(self, new_len: int) -> None:
        pass

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class StageCache:
    """The states of the layers one engine owns, the committed length and the capacity."""

    capacity: int
    layers: dict[int, LayerState] = field(default_factory=dict)
    length: int = 0
    taps: object | None = None  # model/taps.py TapSink: tapped layers' outputs by position (None: off)

    def begin(self, start: int, rows: int) -> None:
        """Called before a forward writes `rows` rows from `start` (start <= length)."""
        if start + rows > self.capacity:
            raise UserError(
                f"context full: {start + rows} rows needed, the session context holds {self.capacity}"
            )
        for st in self.layers.values():
            st.begin(start, rows)
        self.length = start + rows

    def rollback(self, new_len: int) -> None:
        """Keep the first `new_len` rows; rows past it are as if never written."""
        if not 0 <= new_len <= self.length:
            raise ValueError(f"rollback to {new_len} outside [0, {self.length}]")
        for st in self.layers.values():
            st.rollback(new_len)
        self.length = new_len

    def nbytes(self) -> int:
        return sum(st.nbytes() for st in self.layers.values())
