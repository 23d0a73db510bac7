"""One-row GEMV and few-row GEMM in Triton: the decode and verify steps' weight reads, with the
SwiGLU gating folded in.

At M = 1 a linear layer is a pure weight stream. cuBLAS picks split-K kernels for the narrow
shapes of an 8B layer (o_proj, down_proj) and adds a reduce kernel after each; this kernel has
each program own BN whole output rows (no reduce, no atomics: deterministic) and stream its
slice of W once, evicting it from L2 (nothing rereads it). `silu_mul` computes the down
projection's input silu(g) * u from the gate-up output while loading it, so the gating costs
no kernel of its own; it rounds like the reference (silu in bf16, then the product in bf16).
`gemm_rows` does the same for the 2-16 rows of a verify (one tl.dot tile of rows per program).
Measured on an H200 against cuBLAS (benchmarks/decode_kernels.py, BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gemv", "gemm_rows", "CONFIGS", "MAX_ROWS"]


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_w,
                 BN: tl.constexpr, BK: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    nmask = rn < N
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        if EVEN:
            w = tl.load(W + rn[:, None] * stride_w + rk[None, :], eviction_policy="evict_first")
            if SILU_MUL:
                g = tl.load(X + rk).to(tl.float32)
                u = tl.load(X + K + rk)
            else:
                x = tl.load(X + rk)
        else:
            kmask = rk < K
            w = tl.load(W + rn[:, None] * stride_w + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0, eviction_policy="evict_first")
            if SILU_MUL:
                g = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
                u = tl.load(X + K + rk, mask=kmask, other=0.0)
            else:
                x = tl.load(X + rk, mask=kmask, other=0.0)
        if SILU_MUL:  # the reference's roundings: silu(g) to the input dtype, then times u
            s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
            x = (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=nmask)


# (BN, BK, warps, stages): the winners per 8B / 1B shape on an H200 and their neighbours
CONFIGS = [(8, 512, 4, 3), (16, 512, 4, 3), (16, 1024, 8, 1), (16, 1024, 8, 3), (8, 512, 4, 1),
           (32, 512, 8, 3)]
_even = triton.heuristics({"EVEN": lambda a: a["N"] % a["BN"] == 0 and a["K"] % a["BK"] == 0})(_gemv_kernel)
_tuned = triton.autotune(
    configs=[triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in CONFIGS],
    key=["N", "K", "SILU_MUL"])(_even)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x (1, K) [or (1, 2K) with `silu_mul`: gate then up] @ w (N, K)^T (+ bias) -> (1, N) in
    x's dtype. On CUDA the config is tuned once per shape (before any graph capture: the
    capture's warm-up runs first); elsewhere (Triton's interpreter, the CPU tests) it is fixed."""
    N, K = w.shape
    assert x.shape[0] == 1 and x.shape[-1] == (2 * K if silu_mul else K) and w.stride(1) == 1
    x = x.contiguous()
    y = torch.empty((1, N), device=x.device, dtype=x.dtype)
    b = bias if bias is not None else w  # unread without HAS_BIAS
    if x.device.type == "cuda":
        _tuned[lambda m: (triton.cdiv(N, m["BN"]),)](
            x, w, b, y, N, K, w.stride(0), SILU_MUL=silu_mul, HAS_BIAS=bias is not None)
        return y
    bn, bk = 16, 32  # the interpreter: few programs (each runs in Python), ragged edges still masked
    _even[(triton.cdiv(N, bn),)](x, w, b, y, N, K, w.stride(0), BN=bn, BK=bk, SILU_MUL=silu_mul,
                                 HAS_BIAS=bias is not None)
    return y


@triton.jit
def _rows_kernel(X, W, B, Y, M, N, K, stride_x, stride_w, stride_y,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SILU_MUL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, PRECISION: tl.constexpr):
    """A few rows (M <= BM) against W: each program streams BN rows of W once for all M rows."""
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    nmask, mmask = rn < N, rm < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < K
        if EVEN:
            w = tl.load(W + rn[:, None] * stride_w + rk[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(W + rn[:, None] * stride_w + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0, eviction_policy="evict_first")
        xm = mmask[:, None] & kmask[None, :]
        if SILU_MUL:
            g = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=xm, other=0.0)
            u = tl.load(X + rm[:, None] * stride_x + K + rk[None, :], mask=xm, other=0.0)
            gf = g.to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(u.dtype)
            x = (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
        else:
            x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=xm, other=0.0)
        acc += tl.dot(x, tl.trans(w).to(x.dtype), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


ROWS_CONFIGS = [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3), (16, 256, 4, 4),
                (128, 128, 8, 3)]
MAX_ROWS = 16  # the widest verify the row kernel takes (DFlash b16); wider steps use cuBLAS
_rows_even = triton.heuristics({"EVEN": lambda a: a["N"] % a["BN"] == 0 and a["K"] % a["BK"] == 0})(_rows_kernel)
_rows_tuned = triton.autotune(
    configs=[triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in ROWS_CONFIGS],
    key=["N", "K", "BM", "SILU_MUL"])(_rows_even)


def gemm_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              silu_mul: bool = False) -> torch.Tensor:
    """x (M, K) [(M, 2K) with `silu_mul`] @ w (N, K)^T (+ bias) -> (M, N), for 1 < M <= MAX_ROWS:
    the verify rows of a speculative round read the weights once, as a decode step does."""
    M = x.shape[0]
    N, K = w.shape
    assert 0 < M <= MAX_ROWS and x.shape[1] == (2 * K if silu_mul else K) and w.stride(1) == 1
    x = x.contiguous()
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    b = bias if bias is not None else w
    bm = 16  # tl.dot's smallest tile
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays exact; bf16 / fp16 ignore it
    if x.device.type == "cuda":
        _rows_tuned[lambda m: (triton.cdiv(N, m["BN"]),)](
            x, w, b, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BM=bm, SILU_MUL=silu_mul,
            HAS_BIAS=bias is not None, PRECISION=prec)
        return y
    _rows_even[(triton.cdiv(N, 32),)](x, w, b, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BM=bm, BN=32,
                                      BK=32, SILU_MUL=silu_mul, HAS_BIAS=bias is not None, PRECISION=prec)
    return y
