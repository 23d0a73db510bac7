"""The draft caches of a batched engine's tap drafters, in one pool, and the attention of many
requests' draft rows over it in one launch each.

Alone, a DFlash or EAGLE-3 drafter keeps its draft K/V in tensors of its own. In a batched
engine the step leader drafts a step's requests together (batching/chain_drafts.py), and with
caches of their own every request's K/V write and attention was its own few launches a layer:
16 requests, ~12 launches each a layer, eager, on the leader's path between two steps. Here
every request's drafter of one engine takes a slot of one pool: layer i's K/V of slot s is
`k[i, s]` (capacity rows, as its own tensor would be), so its solo code runs unchanged on the
view, and a shared forward writes every request's rows with one `index_put_` and attends over
every request's cache with one gather and two batched GEMMs (`pooled_attention`), each row under
its own request's mask. The pool is allocated at the first request (every request of an engine
has the same capacity) and holds `slots` requests (the engine's --max-batch: no more are in
flight); a drafter that finds no slot (another capacity, the pool full) keeps caches of its own
and drafts on the per-request path.
"""

from __future__ import annotations

import threading

import torch

from ...cache import KVLayer
from ...device import to_device
from ...owner_slots import OwnerSlots

__all__ = ["DraftPool", "pooled_attention", "paged_pool_attention", "pool_of"]


class DraftPool:
    def __init__(self, slots: int, layers: int, n_kv: int, head_dim: int, device, dtype):
        """`slots` requests' caches, and one spare (`scratch`, never handed out: a graph's pad
        requests write and read it, dflash_pool_graph.py)."""
        self.slots, self.layers, self.n_kv, self.head_dim = slots, layers, n_kv, head_dim
        self.device, self.dtype = device, dtype
        self.k: torch.Tensor | None = None  # (layers, slots + 1, rows, n_kv, head_dim), zero-filled
        self.v: torch.Tensor | None = None
        self.rows = 0
        self.scratch = slots
        # the shared forwards' CUDA graphs over this pool, where captured: DFlash's block
        # (dflash_pool_graph.py) or EAGLE-3's chains (eagle3_pool_graph.py)
        self.graphs = None
        self.ingest_graphs = None  # ... and the shared maintenance's
        self.owners = OwnerSlots(slots)
        self._lock = threading.Lock()  # the first drafters' allocation

    def take(self, drafter, rows: int) -> list[KVLayer] | None:
        """The drafter's per-layer K/V as views of a slot (`drafter.pool_slot` set), or None
        where it must keep its own (another row count than the pool's; no slot free). The slot
        is its request's (`drafter.target`, the request's BatchSlot) until `give(that slot)`."""
        self.alloc(rows)
        s = self.owners.take(drafter.target) if rows == self.rows else None
        if s is None:
            return None
        drafter.pool_slot = s
        return [KVLayer(self.k[i, s], self.v[i, s]) for i in range(self.layers)]

    def alloc(self, rows: int) -> None:
        """The pool's tensors, `rows` a slot (once: later calls keep the first row count;
        called by the backend before any request, or by the first request's drafter)."""
        with self._lock:
            if self.k is not None:
                return
            shape = (self.layers, self.slots + 1, rows, self.n_kv, self.head_dim)
            # zeros, not empty: masked rows still enter the P@V product (0 * NaN = NaN)
            self.k = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self.v = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self.rows = rows

    def give(self, owner) -> None:
        """The slot a request held back (`owner`: its BatchSlot; the request ended); a no-op
        for one that holds none."""
        self.owners.give(owner)

    def index(self, drafters) -> torch.Tensor:
        """(n,) the drafters' slots on the device."""
        return to_device([d.pool_slot for d in drafters], self.device)


def pool_of(drafters) -> DraftPool | None:
    """The pool every one of these drafters holds a slot of, else None (the per-request path)."""
    pool = getattr(drafters[0], "pool", None)
    if pool is None:
        return None
    for d in drafters:
        if getattr(d, "pool", None) is not pool or getattr(d, "pool_slot", None) is None:
            return None
    return pool


def pooled_attention(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, idx: torch.Tensor, lim: torch.Tensor,
                     L: int) -> torch.Tensor:
    """n requests' rows over their own caches in a pool, each row under its own limit.

    q (n, T, nh, hd); kp / vp (slots, rows, nkv, hd): one layer of the pool; idx (n,) each
    request's slot; lim (n, T): row t of request r reads the slots < lim[r, t]; L (host int) >=
    every limit. -> (n, T, nh * hd). The math of model/attention.py `cached_attention` (GQA as
    extra query rows of each KV head, two GEMMs in the cache dtype, an fp32 softmax) with a
    leading request dimension, over the first L slots of each request's cache only."""
    n, T, nh, hd = q.shape
    nkv = kp.shape[2]
    rep = nh // nkv
    kc = kp[:, :L].index_select(0, idx).transpose(1, 2)  # (n, nkv, L, hd)
    vc = vp[:, :L].index_select(0, idx).transpose(1, 2)
    qg = q.view(n, T, nkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(n, nkv, rep * T, hd)
    scores = torch.matmul(qg, kc.transpose(2, 3)).float() * (hd ** -0.5)  # (n, nkv, rep * T, L)
    mask = torch.arange(L, device=q.device)[None, None, :] < lim[:, :, None]  # (n, T, L)
    scores = scores.view(n, nkv, rep, T, L).masked_fill(~mask[:, None, None], float("-inf")).view(n, nkv, rep * T, L)
    p = torch.softmax(scores, dim=-1).to(vc.dtype)
    o = torch.matmul(p, vc)  # (n, nkv, rep * T, hd)
    return o.view(n, nkv, rep, T, hd).permute(0, 3, 1, 2, 4).reshape(n, T, nh * hd)


def paged_pool_attention(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, idx: torch.Tensor, lim: torch.Tensor,
                         rows: int) -> torch.Tensor:
    """`pooled_attention` on our paged kernel (kernels/paged_attention.py), for the pool graphs
    on a GPU's fast path: q (n, T, nh, hd), kp / vp (slots, rows, nkv, hd) one layer of the
    pool, idx (n,) each request's slot, lim (n, T) each row's limit -> (n, T, nh * hd). Each
    request's slot is one block of `rows` slots of the flattened pool (its table: its slot), each
    row a query at position lim - 1, so it reads that request's keys below its limit and no
    others: the live rows only, where `pooled_attention` gathers and scores every row of each
    slot (a graph's shapes are static: each slot's whole capacity, 4k rows at --ctx 4096)."""
    from ...kernels.paged_attention import paged_attention  # noqa: PLC0415 (Triton: only where installed)

    n, T, nh, hd = q.shape
    nkv = kp.shape[2]
    lo = torch.arange(0, n * T, T, device=q.device, dtype=torch.int32)
    nrows = torch.full((n,), T, device=q.device, dtype=torch.int32)
    table = idx.to(torch.int32).view(n, 1)
    pos = (lim - 1).reshape(-1)
    o = paged_attention(q.reshape(n * T, nh, hd), kp.view(-1, nkv, hd), vp.view(-1, nkv, hd), pos, lo, nrows,
                        table, rows, T, rows)
    return o.view(n, T, nh * hd)
