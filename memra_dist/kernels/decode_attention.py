"""Split-sequence attention over the KV cache for decode and verify rows (flash-decoding).

`cached_attention` (model/attention.py) is three kernels (QK^T, a masked softmax, PV) over the
cache's whole capacity. Here each program takes one KV head, a block of query rows (the `rep`
query heads of that KV head for each of the T rows, HF's head order kv * rep + r) and a chunk of
cache slots, and runs an online softmax over the slots up to the rows' positions: slots past
the furthest row's position are never read, so the cost follows the live length, not the
capacity. A second kernel merges the chunks' partial results. The number of chunks is fixed by
the capacity (a CUDA graph replays a fixed grid), but each program's share of the slots is
cut from the LIVE length, read on the device: the live slots are split evenly over the chunks
(in BC-slot steps), so an 8k context in a 128k cache still spreads over every program instead
of the first two chunks of 4096 (measured on an H200: a layer's attention 69 us -> ~13 us).
Scores and the softmax are fp32; the probabilities enter PV in the cache dtype, like the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["decode_attention", "chunking", "split_buffers", "merge_splits"]


@triton.jit
def _partial_kernel(Q, K, V, POS, PM, PL, PO, ROWS, stride_qt, stride_qh, stride_kc, stride_kh,
                    stride_vc, stride_vh, scale, n_chunks,
                    REP: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                    PRECISION: tl.constexpr):
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
    span = tl.cdiv(tl.cdiv(last + 1, n_chunks), BC) * BC  # this block's live slots over the chunks, in BC steps
    lo = c * span
    hi = tl.minimum(lo + span, last + 1)  # lo >= hi: nothing live here, the program exits
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
    top = tl.max(mc, 0)  # finite: chunk 0 always starts at slot 0, which every row reads
    wc = tl.where(cmask, tl.exp(mc - top), 0.0)
    d = tl.arange(0, HD)
    oc = tl.load(PO + base[:, None] * HD + d[None, :], mask=cmask[:, None], other=0.0)
    o = tl.sum(oc * wc[:, None], 0) / tl.sum(lc * wc, 0)
    t = m // REP
    tl.store(O + t * stride_ot + (h * REP + m % REP) * HD + d, o.to(O.dtype.element_ty))


def chunking(capacity: int, max_chunks: int = 64, min_chunk: int = 64) -> tuple[int, int]:
    """(chunk, n_chunks) for a cache of `capacity` slots: at most `max_chunks` programs per KV
    head and row block, as many as chunks of at least `min_chunk` slots (a power of two) would
    need at full capacity (the kernel then splits the live length over them)."""
    chunk = min_chunk
    while chunk * max_chunks < capacity:
        chunk *= 2
    return chunk, triton.cdiv(capacity, chunk)


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor,
                     chunk: int | None = None) -> torch.Tensor:
    """q (T, nh, hd) against the cache kc / vc (C, nkv, hd): row t reads slots 0..pos[t]
    (causal within the step's own rows, whose K/V are already written). -> (T, nh * hd)."""
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
    pm, pl, po, o = split_buffers(q, nkv, n_chunks)
    _partial_kernel[(nkv, n_chunks, triton.cdiv(rows, bm))](
        q, kc, vc, pos, pm, pl, po, rows, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1),
        vc.stride(0), vc.stride(1), hd ** -0.5, n_chunks, REP=rep, HD=hd, BM=bm, BC=min(64, chunk),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)  # fp32 stays fp32 (no TF32)
    merge_splits(pm, pl, po, o, nkv, rep, n_chunks)
    return o


def split_buffers(q: torch.Tensor, nkv: int, n_chunks: int):
    """The chunks' partial results for q (T, nh, hd) — running max, sum, fp32 output per
    (KV head, chunk, query row) — and the output (T, nh * hd)."""
    T, nh, hd = q.shape
    rows = T * (nh // nkv)
    pm = torch.empty(nkv * n_chunks * rows, device=q.device, dtype=torch.float32)
    po = torch.empty(nkv * n_chunks * rows * hd, device=q.device, dtype=torch.float32)
    return pm, torch.empty_like(pm), po, torch.empty((T, nh * hd), device=q.device, dtype=q.dtype)


def merge_splits(pm, pl, po, o: torch.Tensor, nkv: int, rep: int, n_chunks: int) -> None:
    """The chunks' partials merged into o, one program per (KV head, query row)."""
    rows = o.shape[0] * rep
    hd = o.shape[1] // (nkv * rep)
    _merge_kernel[(nkv, rows)](pm, pl, po, o, rows, n_chunks, o.stride(0), REP=rep, HD=hd,
                               NC=triton.next_power_of_2(n_chunks), num_warps=4)
