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
step, reading each request's keys through its block table (`PagedRows`), and so do prefill
chunks of up to PREFILL_TAIL_ROWS rows (a prefix-cache hit's tail, a short prompt), each as
segments of PAGED_MAX_ROWS rows over its one table, as a graphed step takes them (graphs.py):
64 requests' 200-row tails in one eager step were 64 gathers and prefix attentions a layer,
~20,000 launches from Python a step (~0.3 s of host time, measured on an H100: the prefix
cache's batch job, BENCHMARKS.md). Longer chunks, and chunks past PAGED_TAIL_KEYS keys, keep the
gather and the prefix attention (cuDNN's, which the paged kernel's 16-row programs do not match
on long prompts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..model.prefix_attention import PREFIX_MIN_ROWS
from .blocks import BlockPool
from .take import PREFILL_TAIL_ROWS

__all__ = ["PagedKV", "PagedLayer", "PagedLatent", "RecurrentStates", "BatchView", "Segment", "PagedRows",
           "PAGED_MAX_ROWS"]

PAGED_MAX_ROWS = 16  # a decode / verify segment the paged kernel takes (K + 1 <= 16)
# an eager step's prefill chunk reading more keys than this keeps cuDNN's prefix attention: each of
# its 16-row segments' programs reads every key, which past a long prefix outgrows cuDNN's one pass
# (an estimate, not measured: the 64 x 200-row tails over 2k keys it was made for read ~2k each)
PAGED_TAIL_KEYS = 16384


@dataclass
class PagedLayer:
    """One attention layer's K and V pools, each (slots, n_kv, head_dim), zero-filled."""

    k: torch.Tensor
    v: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class PagedLatent:
    """One latent-attention layer's pools (model/mla.py: what MLALayer holds per position): the
    compressed KV latent (slots, rank) and the shared rotary key part (slots, dr)."""

    latent: torch.Tensor
    k_shared: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.latent, self.k_shared

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class RecurrentStates:
    """One linear-attention layer's states (model/kda.py KDAState), one per request: O(1) in a
    request's length, so not paged. Made when a request is admitted, dropped when it leaves,
    and kept on the device through a preemption (only pooled rows are swapped out); a rollback
    is the state's own length change at the request's next forward (KDAState.begin)."""

    def __init__(self, mixer, device, dtype):
        self.mixer, self.device, self.dtype = mixer, device, dtype
        self.of: dict = {}  # request id -> its state

    def admit(self, rid) -> None:
        self.of[rid] = self.mixer.new_state(0, self.device, self.dtype)

    def leave(self, rid) -> None:
        self.of.pop(rid, None)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return ()  # no pooled rows

    def nbytes(self) -> int:
        return 0  # per request: `PagedKV.request_bytes`


def _kind(attn) -> str:
    return getattr(attn, "mixer_class", "attn")


def _row_shapes(attn) -> list[tuple[int, ...]]:
    """The per-slot shape of each pool a mixer's cache rows take (a recurrent mixer: none)."""
    if _kind(attn) == "mla":
        return [(attn.rank,), (attn.dr,)]
    if _kind(attn) == "kda":
        return []
    return [(attn.nkv, attn.hd), (attn.nkv, attn.hd)]


class PagedKV:
    def __init__(self, stage, pool: BlockPool, device, dtype):
        self.pool = pool
        self.scratch = pool.rows  # the slot padded rows write (never in a block table)
        self.layers: dict[int, PagedLayer | PagedLatent | RecurrentStates] = {}
        for i, blk in stage.layers.items():
            attn = blk.self_attn
            if _kind(attn) == "kda":
                self.layers[int(i)] = RecurrentStates(attn, device, dtype)
                continue
            pools = [torch.zeros((pool.rows + 1, *s), device=device, dtype=dtype) for s in _row_shapes(attn)]
            self.layers[int(i)] = (PagedLatent if _kind(attn) == "mla" else PagedLayer)(*pools)
        self._states = [v for v in self.layers.values() if isinstance(v, RecurrentStates)]

    def admit(self, rid) -> None:
        """A request joins: its recurrent layers' states (zero: a fresh sequence)."""
        for st in self._states:
            st.admit(rid)

    def leave(self, rid) -> None:
        for st in self._states:
            st.leave(rid)

    @staticmethod
    def request_bytes(stage) -> int:
        """Bytes one request's recurrent states take over every layer (0 without such layers)."""
        return sum(b.self_attn.state_bytes() for b in stage.layers.values() if _kind(b.self_attn) == "kda")

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers.values())

    def slot_bytes(self) -> float:
        """Bytes one slot takes over every layer (K and V)."""
        return self.nbytes() / (self.pool.rows + 1)

    def save(self, slots: list[int], rid=None) -> list[tuple[torch.Tensor, ...]]:
        """The cache rows of `slots` in every layer, copied to host memory (a preempted request's rows)."""
        out = []
        for layer in self.layers.values():
            pools = layer.tensors()  # none for a recurrent layer (its states stay on the device)
            idx = torch.tensor(slots, dtype=torch.long, device=pools[0].device) if pools else None
            out.append(tuple(t.index_select(0, idx).cpu() for t in pools))
        return out

    def restore(self, slots: list[int], saved: list[tuple[torch.Tensor, ...]], rid=None) -> None:
        """`save`'s rows written back at `slots` (the request's new blocks), bitwise."""
        for layer, rows in zip(self.layers.values(), saved):
            pools = layer.tensors()
            idx = torch.tensor(slots, dtype=torch.long, device=pools[0].device) if pools else None
            for t, r in zip(pools, rows):
                t.index_copy_(0, idx, r.to(t.device))

    @staticmethod
    def row_bytes(stage, dtype) -> int:
        """Bytes one slot takes over every layer (K and V, or a latent layer's latent and shared key)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(size * sum(math.prod(s) for s in _row_shapes(b.self_attn)) for b in stage.layers.values())


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
    rid: object = None  # the request (a recurrent layer's state is its own)

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    def own_cache(self, pool: torch.Tensor) -> torch.Tensor:
        """Its rows of `pool` (slots, ...) in position order, in a buffer of its capacity, zero
        past them: the cache its attention reads alone (decode / verify rows, under `mask`)."""
        rows = pool.index_select(0, self.keys)
        buf = rows.new_zeros((self.capacity,) + rows.shape[1:])
        buf[:rows.shape[0]] = rows
        return buf


@dataclass
class PagedRows:
    """The decode / verify segments one paged-kernel launch takes (kernels/paged_attention.py)."""

    lo: torch.Tensor  # (n,) int32 each segment's first row
    nrows: torch.Tensor  # (n,) int32 its rows
    table: torch.Tensor  # (n, blocks) int32 its block table (padded with block 0, never read)
    block: int
    max_rows: int
    max_len: int  # the longest capacity among them: the kernel's chunk grid
    segments: int | None = None  # the launch's request slots (a graph's: its step's most requests; None: all of lo)


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
        segments of up to PAGED_MAX_ROWS rows and prefill chunks of up to PREFILL_TAIL_ROWS (as
        segments of PAGED_MAX_ROWS rows) go to the paged kernel (no gather, no mask)."""
        slots, segs, lo = [], [], 0
        paged: list[tuple[int, int, list[int], int]] = []
        for rid, start, rows, cap in parts:
            end = start + rows
            slots.extend(pool.slots(rid, start, end))
            if kernels and (rows <= PAGED_MAX_ROWS or (rows <= PREFILL_TAIL_ROWS and end <= PAGED_TAIL_KEYS)):
                tbl = pool.table(rid)
                for p in range(0, rows, PAGED_MAX_ROWS):  # (a chunk: several segments, one table)
                    paged.append((lo + p, min(PAGED_MAX_ROWS, rows - p), tbl, cap))
                lo += rows
                continue
            keys = torch.tensor(pool.slots(rid, 0, end), dtype=torch.long, device=device)
            seg = Segment(lo, lo + rows, start, cap, keys, rid=rid)
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
