"""One-row GEMV in Triton: the decode step's weight reads, with the SwiGLU gating folded in.

At M = 1 a linear layer is a pure weight stream. cuBLAS picks split-K kernels for the narrow
shapes of an 8B layer (o_proj, down_proj) and adds a reduce kernel after each; this kernel has
each program own BN whole output rows (no reduce, no atomics: deterministic) and stream its
slice of W once, evicting it from L2 (nothing rereads it). `silu_mul` computes the down
projection's input silu(g) * u from the gate-up output while loading it, so the gating costs
no kernel of its own; it rounds like the reference (silu in bf16, then the product in bf16).
`norm` folds the block's RMSNorm into the load of x: the pass that streams W also sums x^2, and
the 1 / rms factor (common to every k) scales the dot products at the end, so the norm costs
no pass and no kernel (it rounds once, where the reference rounds the normed x to the input
dtype). `residual` adds the block's residual stream before the one rounding of the store.
Measured on an H200 against cuBLAS (BENCHMARKS.md). Verify
rows (2 .. 16) take kernels/gemm_rows.py, the "swap AB" MMA form with the same folds: with
wider tiles and deeper pipelines than a first attempt (1.10-1.13x slower than cuBLAS), it
beats cuBLAS on every 8B shape (benchmarks/row_gemm_check.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import autotune

__all__ = ["gemv", "CONFIGS"]


@triton.jit
def _gemv_kernel(X, W, B, NW, R, Y, N, K, stride_w, eps,
                 BN: tl.constexpr, BK: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 NORM: tl.constexpr, HAS_RES: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    nmask = rn < N
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    ss = tl.zeros((BK,), dtype=tl.float32)  # NORM: the sum of squares of x, gathered on the same pass
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        if EVEN:
            w = tl.load(W + rn[:, None] * stride_w + rk[None, :], eviction_policy="evict_first")
            if SILU_MUL:
                g = tl.load(X + rk).to(tl.float32)
                u = tl.load(X + K + rk)
            else:
                x = tl.load(X + rk)
            if NORM:
                nw = tl.load(NW + rk)
        else:
            kmask = rk < K
            w = tl.load(W + rn[:, None] * stride_w + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0, eviction_policy="evict_first")
            if SILU_MUL:
                g = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
                u = tl.load(X + K + rk, mask=kmask, other=0.0)
            else:
                x = tl.load(X + rk, mask=kmask, other=0.0)
            if NORM:
                nw = tl.load(NW + rk, mask=kmask, other=0.0)
        if SILU_MUL:  # the reference's roundings: silu(g) to the input dtype, then times u
            s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
            x = (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
        if NORM:  # RMSNorm(x) = nw * x / rms(x): the 1 / rms factor is common to every k, applied at the end
            xf = x.to(tl.float32)
            ss += xf * xf
            acc += w.to(tl.float32) * (xf * nw.to(tl.float32))[None, :]
        else:
            acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    y = tl.sum(acc, 1)
    if NORM:
        y = y * tl.rsqrt(tl.sum(ss, 0) / K + eps)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)
    if HAS_RES:  # the block's residual stream: x + linear(...) in one rounding
        y += tl.load(R + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=nmask)


# (BN, BK, warps, stages): the winners per 8B / 1B shape on an H200 and their neighbours
CONFIGS = [(8, 512, 4, 3), (16, 512, 4, 3), (16, 1024, 8, 1), (16, 1024, 8, 3), (8, 512, 4, 1),
           (32, 512, 8, 3)]
_even = triton.heuristics({"EVEN": lambda a: a["N"] % a["BN"] == 0 and a["K"] % a["BK"] == 0})(_gemv_kernel)
_tuned = autotune(
    [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in CONFIGS],
    ["N", "K", "SILU_MUL", "NORM"], name="gemv")(_even)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, K) [or (1, 2K) with `silu_mul`: gate then up] @ w (N, K)^T (+ bias) -> (1, N) in
    x's dtype. `norm` (K,): the input goes through RMSNorm(norm, eps) first (the block's
    pre-norm folded in); `residual` (1, N): added to the output (the block's residual add
    folded in). On CUDA the config is tuned once per shape (before any graph capture: the
    capture's warm-up runs first); elsewhere (Triton's interpreter, the CPU tests) it is fixed."""
    N, K = w.shape
    assert x.shape[0] == 1 and x.shape[-1] == (2 * K if silu_mul else K) and w.stride(1) == 1
    assert not (silu_mul and norm is not None), "the gating and the pre-norm do not meet in one GEMV"
    assert residual is None or residual.numel() == N
    x = x.contiguous()
    y = torch.empty((1, N), device=x.device, dtype=x.dtype)
    b = bias if bias is not None else w  # unread without HAS_BIAS (and so on below)
    nw = norm if norm is not None else w
    r = residual.contiguous() if residual is not None else w
    flags = dict(SILU_MUL=silu_mul, HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RES=residual is not None)
    if x.device.type == "cuda":
        _tuned[lambda m: (triton.cdiv(N, m["BN"]),)](x, w, b, nw, r, y, N, K, w.stride(0), eps, **flags)
        return y
    bn, bk = 16, 32  # the interpreter: few programs (each runs in Python), ragged edges still masked
    _even[(triton.cdiv(N, bn),)](x, w, b, nw, r, y, N, K, w.stride(0), eps, BN=bn, BK=bk, **flags)
    return y
