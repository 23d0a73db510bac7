"""Split-sequence attention over the KV cache for decode and verify rows (flash-decoding).

`cached_attention` (model/attention.py) is three kernels (QK^T, a masked softmax, PV) over the
cache's whole capacity. Here each program takes one KV head, a block of query rows (the `rep`
query heads of that KV head for each of the T rows, HF's head order kv * rep + r) and a chunk of
cache slots, and runs an online softmax over the slots up to the rows' positions: slots past
the furthest row's position are never read, so the cost follows the live length, not the
capacity. The last program of a row block to finish merges the chunks' partial results (a
ticket counter per row block, back at zero when it is done): one kernel a layer, not two. The
number of chunks is fixed by the capacity (a CUDA graph replays a fixed grid); chunks wholly past
the length skip their loop and only take their ticket.
Scores and the softmax are fp32; the probabilities enter PV in the cache dtype, like the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["decode_attention", "chunking", "tickets", "MERGE"]

MERGE = "fused"  # where the chunks' partials are merged (decode_attention's `merge`)


@triton.jit
def _split_kernel(Q, K, V, POS, PM, PL, PO, O, TICKET, ROWS, stride_qt, stride_qh, stride_kc, stride_kh,
                  stride_vc, stride_vh, stride_ot, scale, n_chunks,
                  REP: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr,
                  PRECISION: tl.constexpr, FUSED_MERGE: tl.constexpr, G: tl.constexpr):
    h = tl.program_id(0)  # KV head
    c = tl.program_id(1)  # chunk of cache slots
    mb = tl.program_id(2)  # block of query rows (row m: token row m // REP, query head h * REP + m % REP)
    rm = mb * BM + tl.arange(0, BM)
    mmask = rm < ROWS
    t = rm // REP
    d = tl.arange(0, HD)
    q = tl.load(Q + t[:, None] * stride_qt + (h * REP + rm % REP)[:, None] * stride_qh + d[None, :],
                mask=mmask[:, None], other=0.0)
    pos = tl.load(POS + t, mask=mmask, other=-1)
    last = tl.max(pos, 0)  # the furthest slot any row of the block may read
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, HD), dtype=tl.float32)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, last + 1)
    for s0 in range(lo, hi, BC):
        rc = s0 + tl.arange(0, BC)
        live = rc < hi
        k = tl.load(K + rc[:, None] * stride_kc + h * stride_kh + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(V + rc[:, None] * stride_vc + h * stride_vh + d[None, :], mask=live[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BM, BC) fp32
        sc = tl.where(rc[None, :] <= pos[:, None], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: no NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    base = (h * n_chunks + c) * ROWS + rm
    tl.store(PM + base, m_i, mask=mmask)
    tl.store(PL + base, l_i, mask=mmask)
    tl.store(PO + base[:, None] * HD + d[None, :], acc, mask=mmask[:, None])
    if FUSED_MERGE:
        # The merge: the last of the row block's n_chunks programs to finish folds the live chunks'
        # partials, G at a time in chunk order (the same sums whichever program that is:
        # deterministic; chunks past `last` hold nothing and are skipped). The barrier orders all of
        # this program's stores before its ticket, whose release makes them visible to the merging
        # program; its acquire, and loads that skip L1, read them back.
        tl.debug_barrier()
        ticket = TICKET + h * tl.num_programs(2) + mb
        if tl.atomic_add(ticket, 1, sem="acq_rel") == n_chunks - 1:
            n_live = tl.minimum(n_chunks, last // CHUNK + 1)
            cg = tl.arange(0, G)
            m_run = tl.full((BM,), float("-inf"), dtype=tl.float32)
            l_run = tl.zeros((BM,), dtype=tl.float32)
            o = tl.zeros((BM, HD), dtype=tl.float32)
            for c0 in range(0, n_live, G):
                cs = c0 + cg
                live2 = (cs < n_live)[:, None] & mmask[None, :]  # (G, BM)
                b2 = (h * n_chunks + cs[:, None]) * ROWS + rm[None, :]
                mc = tl.load(PM + b2, mask=live2, other=float("-inf"), cache_modifier=".cg")
                lc = tl.load(PL + b2, mask=live2, other=0.0, cache_modifier=".cg")
                oc = tl.load(PO + b2[:, :, None] * HD + d[None, None, :], mask=live2[:, :, None], other=0.0,
                             cache_modifier=".cg")  # (G, BM, HD)
                m_new = tl.maximum(m_run, tl.max(mc, 0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                a = tl.exp(m_run - m_safe)
                w = tl.exp(mc - m_safe[None, :])  # (G, BM)
                l_run = l_run * a + tl.sum(lc * w, 0)
                o = o * a[:, None] + tl.sum(oc * w[:, :, None], 0)
                m_run = m_new
            o = o / tl.where(mmask, l_run, 1.0)[:, None]  # > 0 on live rows: chunk 0 holds slot 0, read by all
            tl.store(O + t[:, None] * stride_ot + (h * REP + rm % REP)[:, None] * HD + d[None, :],
                     o.to(O.dtype.element_ty), mask=mmask[:, None])
            tl.atomic_xchg(ticket, 0)  # back to zero for the next call (or graph replay)


@triton.jit
def _merge_kernel(PM, PL, PO, O, ROWS, n_chunks, stride_ot,
                  REP: tl.constexpr, HD: tl.constexpr, NC: tl.constexpr):
    h = tl.program_id(0)
    m = tl.program_id(1)  # query row m of KV head h
    cs = tl.arange(0, NC)
    cmask = cs < n_chunks
    base = (h * n_chunks + cs) * ROWS + m
    mc = tl.load(PM + base, mask=cmask, other=float("-inf"))
    lc = tl.load(PL + base, mask=cmask, other=0.0)
    top = tl.max(mc, 0)  # finite: chunk 0 always holds slot 0, which every row reads
    wc = tl.where(cmask, tl.exp(mc - top), 0.0)
    d = tl.arange(0, HD)
    oc = tl.load(PO + base[:, None] * HD + d[None, :], mask=cmask[:, None], other=0.0)
    o = tl.sum(oc * wc[:, None], 0) / tl.sum(lc * wc, 0)
    t = m // REP
    tl.store(O + t * stride_ot + (h * REP + m % REP) * HD + d, o.to(O.dtype.element_ty))


def chunking(capacity: int, max_chunks: int = 64, min_chunk: int = 64) -> tuple[int, int]:
    """(chunk, n_chunks) for a cache of `capacity` slots: chunks of at least `min_chunk` slots
    (a power of two), at most `max_chunks` of them."""
    chunk = min_chunk
    while chunk * max_chunks < capacity:
        chunk *= 2
    return chunk, triton.cdiv(capacity, chunk)


def tickets(n_kv: int, rows: int, device) -> torch.Tensor:
    """The zeroed int32 counters one caller's split attention needs for up to `rows` query rows
    (token rows x query heads per KV head). Each call leaves them at zero again; a caller keeps
    its own (two streams must not share one) and allocates it outside any graph capture."""
    return torch.zeros(n_kv * triton.cdiv(rows, 16), device=device, dtype=torch.int32)


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor,
                     ticket: torch.Tensor | None = None, chunk: int | None = None,
                     merge: str = MERGE) -> torch.Tensor:
    """q (T, nh, hd) against the cache kc / vc (C, nkv, hd): row t reads slots 0..pos[t]
    (causal within the step's own rows, whose K/V are already written). -> (T, nh * hd).
    `ticket`: the caller's counters (`tickets`); a fresh zeroed set when None. `merge`: "fused"
    (in the same kernel) or "kernel" (a second kernel: benchmarks/kernels_gpu_check.py times both)."""
    T, nh, hd = q.shape
    C, nkv = kc.shape[0], kc.shape[1]
    rep = nh // nkv
    assert hd & (hd - 1) == 0 and hd >= 16 and kc.stride(2) == 1 and vc.stride(2) == 1 and q.stride(2) == 1
    if chunk is None:
        chunk, n_chunks = chunking(C)
    else:
        n_chunks = triton.cdiv(C, chunk)
    rows = T * rep
    bm = max(16, min(64, triton.next_power_of_2(rows)))
    bc = min(64, chunk)
    n_mb = triton.cdiv(rows, bm)
    dev = q.device
    if ticket is None:
        ticket = tickets(nkv, rows, dev)
    assert ticket.dtype == torch.int32 and ticket.numel() >= nkv * n_mb, "the ticket row is too short for these rows"
    pm = torch.empty(nkv * n_chunks * rows, device=dev, dtype=torch.float32)
    pl = torch.empty_like(pm)
    po = torch.empty(nkv * n_chunks * rows * hd, device=dev, dtype=torch.float32)
    o = torch.empty((T, nh * hd), device=dev, dtype=q.dtype)
    _split_kernel[(nkv, n_chunks, n_mb)](
        q, kc, vc, pos, pm, pl, po, o, ticket, rows, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1),
        vc.stride(0), vc.stride(1), o.stride(0), hd ** -0.5, n_chunks, REP=rep, HD=hd, BM=bm, BC=bc,
        CHUNK=chunk, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32
        FUSED_MERGE=merge == "fused", G=4, num_warps=4)
    if merge != "fused":
        _merge_kernel[(nkv, rows)](pm, pl, po, o, rows, n_chunks, o.stride(0), REP=rep, HD=hd,
                                   NC=triton.next_power_of_2(n_chunks), num_warps=4)
    return o
