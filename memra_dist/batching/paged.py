"""The paged K/V of a batched engine and the view one batched forward takes of it.

`PagedKV` holds, per attention layer, K and V pools of `pool.rows` slots (blocks.py maps a
request's positions to slots) and one scratch slot past them, which no request owns: the rows
a graphed step pads with (graphs.py) write there. `BatchView` is what a batched forward's
layers read through `StepCtx.batch`: the slot each row writes, and per request (a segment of
consecutive rows) the slots of its positions 0 .. its last row, in position order.

Attention over a segment (model/attention.py `Attention._batched`) gathers the request's keys
and values in position order and runs the same arm a single request's forward runs: a prefill
chunk of more than PREFIX_MIN_ROWS rows the prefix attention over its [0, end) rows; decode and
verify rows the masked cached attention over a buffer of the request's capacity, its rows past
the written ones zero and masked. So each request's attention sees exactly the inputs it sees
alone (bitwise on CPU), whatever shares its forward.

On the kernels (a GPU's fast path, `kernels=True`), decode and verify segments of up to
PAGED_MAX_ROWS rows instead go through ONE launch of kernels/paged_attention.py for the whole
step, reading each request's keys through its block table (`PagedRows`); prefill chunks keep
the gather and the prefix attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.prefix_attention import PREFIX_MIN_ROWS
from .blocks import BlockPool

__all__ = ["PagedKV", "PagedLayer", "BatchView", "Segment", "PagedRows", "PAGED_MAX_ROWS"]

PAGED_MAX_ROWS = 16  # a decode / verify segment the paged kernel takes (K + 1 <= 16)


@dataclass
class PagedLayer:
    """One attention layer's K and V pools, each (slots, n_kv, head_dim), zero-filled."""

    k: torch.Tensor
    v: torch.Tensor

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class PagedKV:
    def __init__(self, stage, pool: BlockPool, device, dtype):
        self.pool = pool
        self.scratch = pool.rows  # the slot padded rows write (never in a block table)
        self.layers: dict[int, PagedLayer] = {}
        for i, blk in stage.layers.items():
            attn = blk.self_attn
            shape = (pool.rows + 1, attn.nkv, attn.hd)
            self.layers[int(i)] = PagedLayer(torch.zeros(shape, device=device, dtype=dtype),
                                             torch.zeros(shape, device=device, dtype=dtype))

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers.values())

    def slot_bytes(self) -> float:
        """Bytes one slot takes over every layer (K and V)."""
        return self.nbytes() / (self.pool.rows + 1)

    def save(self, slots: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The K/V of `slots` in every layer, copied to host memory (a preempted request's rows)."""
        idx = torch.tensor(slots, dtype=torch.long, device=next(iter(self.layers.values())).k.device)
        return [(layer.k.index_select(0, idx).cpu(), layer.v.index_select(0, idx).cpu())
                for layer in self.layers.values()]

    def restore(self, slots: list[int], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`save`'s rows written back at `slots` (the request's new blocks), bitwise."""
        for layer, (k, v) in zip(self.layers.values(), saved):
            idx = torch.tensor(slots, dtype=torch.long, device=layer.k.device)
            layer.k.index_copy_(0, idx, k.to(layer.k.device))
            layer.v.index_copy_(0, idx, v.to(layer.v.device))

    @staticmethod
    def row_bytes(stage, dtype) -> int:
        """Bytes one slot takes over every layer (K and V)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(2 * b.self_attn.nkv * b.self_attn.hd * size for b in stage.layers.values())


@dataclass
class Segment:
    """One request's rows [lo, hi) of the batched forward, at positions [start, start + hi - lo)."""

    lo: int
    hi: int
    start: int
    capacity: int  # the rows of the cache its attention runs over alone (the session's capacity)
    keys: torch.Tensor  # (start + hi - lo,) pool slots of positions 0 .. its last row
    mask: torch.Tensor | None = None  # (rows, capacity) decode / verify rows: key slot c <= the row's position
    prefix: int | None = None  # a prefill chunk: its first position (prefix attention)

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclass
class PagedRows:
    """The decode / verify segments one paged-kernel launch takes (kernels/paged_attention.py)."""

    lo: torch.Tensor  # (n,) int32 each segment's first row
    nrows: torch.Tensor  # (n,) int32 its rows
    table: torch.Tensor  # (n, blocks) int32 its block table (padded with block 0, never read)
    block: int
    max_rows: int
    max_len: int  # the longest capacity among them: the kernel's chunk grid


@dataclass
class BatchView:
    slots: torch.Tensor  # (T,) the pool slot each row writes
    segments: list[Segment] = field(default_factory=list)
    paged: PagedRows | None = None  # on the kernels: the segments the paged kernel attends

    @classmethod
    def build(cls, pool: BlockPool, parts: list[tuple[object, int, int, int]], device,
              kernels: bool = False) -> "BatchView":
        """parts: (request id, start, rows, width) in row order; width: the rows of the cache the
        request's attention runs over alone (its session's capacity). kernels: decode / verify
        segments of up to PAGED_MAX_ROWS rows go to the paged kernel (no gather, no mask)."""
        slots, segs, lo = [], [], 0
        paged: list[tuple[int, int, list[int], int]] = []
        for rid, start, rows, cap in parts:
            end = start + rows
            slots.extend(pool.slots(rid, start, end))
            if kernels and rows <= PAGED_MAX_ROWS:
                paged.append((lo, rows, pool.table(rid), cap))
                lo += rows
                continue
            keys = torch.tensor(pool.slots(rid, 0, end), dtype=torch.long, device=device)
            seg = Segment(lo, lo + rows, start, cap, keys)
            if rows > PREFIX_MIN_ROWS:
                seg.prefix = start
            else:
                pos = torch.arange(start, end, device=device)
                seg.mask = torch.arange(cap, device=device)[None, :] <= pos[:, None]
            segs.append(seg)
            lo += rows
        view = cls(torch.tensor(slots, dtype=torch.long, device=device), segs)
        if paged:
            width = max(len(t) for _, _, t, _ in paged)
            table = torch.tensor([t + [0] * (width - len(t)) for _, _, t, _ in paged], dtype=torch.int32)
            meta = torch.tensor([[a, n] for a, n, _, _ in paged], dtype=torch.int32)
            view.paged = PagedRows(meta[:, 0].contiguous().to(device), meta[:, 1].contiguous().to(device),
                                   table.to(device), pool.block, max(n for _, n, _, _ in paged),
                                   max(c for _, _, _, c in paged))
        return view
