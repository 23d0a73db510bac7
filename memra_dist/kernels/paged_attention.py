"""Split-sequence attention over a PAGED KV cache for many requests' decode and verify rows.

The batched engine (memra_dist/batching/) keeps K/V in a pool of fixed-size blocks; a request's
position p lives in slot table[p // BLOCK] * BLOCK + p % BLOCK. This is decode_attention.py's
flash-decoding over that layout, for every request of a step in ONE launch: each program takes
one KV head, one request (a segment of consecutive query rows, the `rep` query heads of its
KV head for each of them) and one chunk of that request's live positions, reads the keys
through the request's block table, and runs the same online softmax; the second kernel
(decode_attention.py's merge) combines the chunks per query row. The live length is per
request (its furthest row's position, read on the device), split evenly over the chunks, so
a short request in a batch of long ones costs its own length.

How many chunks: a step of many requests already gives the device programs to run (KV heads
x requests), so a request's length is split over only as many chunks as bring the launch to
about PROGRAMS programs (at most the capacity's `chunking`): on an H200 at the 8B's heads and
600 positions, 16 requests' verify rows of 5 took 42.5 us a layer over 10 chunks and 22 us over
2; 64 requests' decode rows 68 us over 10 and 46 us over 1 (BENCHMARKS.md).
The launch's request slots are the step's requests, not its rows: a graph (batching/graphs.py)
launches min(rows, its most requests) slots, padded ones with no rows; a slot a row cost 2x.

Rows are causal within a request's own step: row t reads positions 0..pos[t], whose K/V the
step has already written. Scores and the softmax are fp32, the probabilities enter PV in the
cache dtype, as in the single-request kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import chunking, merge_splits, split_buffers

__all__ = ["paged_attention", "batch_chunks", "PROGRAMS"]

PROGRAMS = 256  # a launch's partial programs to aim for (~2 a streaming multiprocessor on an H200)


def batch_chunks(nkv: int, segments: int, most: int) -> int:
    """The chunks each request's live length is split over: enough for ~PROGRAMS programs,
    at least 1, at most `most` (the capacity's chunk grid).

    >>> [batch_chunks(8, s, 10) for s in (1, 4, 16, 64)]
    [10, 8, 2, 1]
    """
    return max(1, min(most, -(-PROGRAMS // (nkv * segments))))


@triton.jit
def _paged_partial_kernel(Q, K, V, POS, LO, NROWS, TBL, PM, PL, PO, ROWS, stride_qt, stride_qh, stride_kc,
                          stride_kh, stride_vc, stride_vh, stride_tb, scale, n_chunks,
                          REP: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                          BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(0)  # KV head
    c = tl.program_id(1)  # chunk of the request's live positions
    s = tl.program_id(2)  # request (segment of rows)
    lo = tl.load(LO + s)
    rm = tl.arange(0, BM)  # local query row m: token row lo + m // REP, query head h * REP + m % REP
    mmask = rm < tl.load(NROWS + s) * REP
    t = lo + rm // REP
    d = tl.arange(0, HD)
    q = tl.load(Q + t[:, None] * stride_qt + (h * REP + rm % REP)[:, None] * stride_qh + d[None, :],
                mask=mmask[:, None], other=0.0)
    pos = tl.load(POS + t, mask=mmask, other=-1)
    last = tl.max(pos, 0)
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, HD), dtype=tl.float32)
    span = tl.cdiv(tl.cdiv(last + 1, n_chunks), BC) * BC
    p_lo = c * span
    p_hi = tl.minimum(p_lo + span, last + 1)
    for p0 in range(p_lo, p_hi, BC):
        rc = p0 + tl.arange(0, BC)  # positions
        live = rc < p_hi
        blk = tl.load(TBL + s * stride_tb + rc // BLOCK, mask=live, other=0)
        slot = blk.to(tl.int64) * BLOCK + rc % BLOCK  # int64: a large pool's offsets pass 2**31
        k = tl.load(K + slot[:, None] * stride_kc + h * stride_kh + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * stride_vc + h * stride_vh + d[None, :], mask=live[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BM, BC) fp32
        sc = tl.where(rc[None, :] <= pos[:, None], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    base = (h * n_chunks + c) * ROWS + lo * REP + rm  # the merge's global query row
    tl.store(PM + base, m_i, mask=mmask)
    tl.store(PL + base, l_i, mask=mmask)
    tl.store(PO + base[:, None] * HD + d[None, :], acc, mask=mmask[:, None])


def paged_attention(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, pos: torch.Tensor, lo: torch.Tensor,
                    nrows: torch.Tensor, table: torch.Tensor, block: int, max_rows: int, max_len: int,
                    chunk: int | None = None, segments: int | None = None, n_chunks: int | None = None,
                    num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q (T, nh, hd): the rows of n requests, request i's at [lo[i], lo[i] + nrows[i]) (at most
    `max_rows` each), at positions `pos` (T,); kp / vp (slots, nkv, hd) the pool; table (n, B)
    int32 each request's blocks (`block` slots each); `max_len`: the longest a request can be
    (sets the chunk grid). -> (T, nh * hd); rows outside every request hold garbage (the caller
    writes them: a prefill chunk's rows, attended elsewhere). `segments`: the launch's request
    slots (the first of lo / nrows; default all); `n_chunks`: the chunks a request's length is
    split over (default `batch_chunks`); `chunk`: the chunk grid's slots (default `chunking`)."""
    T, nh, hd = q.shape
    nkv = kp.shape[1]
    rep = nh // nkv
    n = lo.shape[0]
    assert hd & (hd - 1) == 0 and hd >= 16 and kp.stride(2) == 1 and vp.stride(2) == 1 and q.stride(2) == 1
    assert table.dtype == torch.int32 and table.shape[0] == n and table.stride(1) == 1
    if chunk is None:
        chunk, nc = chunking(max_len)
    else:
        nc = triton.cdiv(max_len, chunk)
    segments = segments or n
    n_chunks = n_chunks or batch_chunks(nkv, segments, nc)
    pm, pl, po, o = split_buffers(q, nkv, n_chunks)
    _paged_partial_kernel[(nkv, n_chunks, segments)](
        q, kp, vp, pos, lo, nrows, table, pm, pl, po, T * rep, q.stride(0), q.stride(1), kp.stride(0),
        kp.stride(1), vp.stride(0), vp.stride(1), table.stride(0), hd ** -0.5, n_chunks, REP=rep, HD=hd,
        BM=max(16, triton.next_power_of_2(max_rows * rep)), BC=min(64, chunk), BLOCK=block,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages)
    merge_splits(pm, pl, po, o, nkv, rep, n_chunks)
    return o
