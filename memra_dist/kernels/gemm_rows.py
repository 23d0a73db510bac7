"""A verify step's few rows (2 .. 16), or a batched step's (up to 128), through a linear layer
in one Triton kernel, with the
same folds as the one-row GEMV (kernels/gemv.py): the block's RMSNorm on the input, the
SwiGLU gating on the input, the residual add on the output; and `glu`, the gate-up projection
that writes silu(gate) * up itself (each program computes matching gate and up columns), so
the down projection reads the gated rows plainly. Measured on an H200 (row_gemm_check.py,
BENCHMARKS.md): the gating on the down projection's input load ran at half speed there.

Each program owns BN whole output rows (no split-K, no reduce kernel) and streams its slice of
W once (evicted from L2); the MMA runs "swap AB": the weight tile (BN, BK), as it lies in memory,
is the row operand and the rows' input tile (BK, 16) the column operand, so 16 rows cost one MMA
column block. The input rows are re-read from L2 by every program (at most BM x K values).
A step of more than 16 rows (a batched step: many requests' decode or verify rows) takes a
wider column block, BM = the next power of two (32, 64, 128), with its own tuned configs: the
weight is still streamed once, and the folds keep the norms and residual adds out of the
step's kernel count (benchmarks/row_gemm_check.py measures it against cuBLAS).
With `norm`, the pass sums each row's squares and the MMA takes x * norm_weight; the per-row
1 / rms scales the result at the end (the norm rounds once, where the reference rounds the
normed rows to the input dtype). Rows past M are masked: a (M, K) input of any M <= BM runs the
same kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import autotune

__all__ = ["gemm_rows", "ROW_CONFIGS", "WIDE_CONFIGS", "MAX_ROWS", "BATCH_ROWS", "row_block"]

MAX_ROWS = 16  # a single request's verify rows (K + 1): one column block of 16
BATCH_ROWS = 128  # a batched step's rows: up to 128 in one program's column block


def row_block(m: int) -> int:
    """The kernel's column block for m rows: 16 up to 16 rows, else the next power of two.

    >>> [row_block(m) for m in (1, 16, 17, 33, 80, 128)]
    [16, 16, 32, 64, 128, 128]
    """
    return max(MAX_ROWS, triton.next_power_of_2(m))


@triton.jit
def _rows_kernel(X, W, B, NW, R, Y, M, N, K, stride_xm, stride_w, eps,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SILU_MUL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, GLU: tl.constexpr,
                 EVEN: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    nmask = rn < N
    rm = tl.arange(0, BM)
    mmask = rm < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)  # GLU only
    ss = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < K
        xm = mmask[None, :] & kmask[:, None]
        xp = X + rm[None, :] * stride_xm + rk[:, None]  # (BK, BM): the rows' inputs, transposed
        if EVEN:
            w = tl.load(W + rn[:, None] * stride_w + rk[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(W + rn[:, None] * stride_w + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0, eviction_policy="evict_first")
        if SILU_MUL:  # gate in [0, K), up in [K, 2K): the reference's roundings
            g = tl.load(xp, mask=xm, other=0.0).to(tl.float32)
            u = tl.load(xp + K, mask=xm, other=0.0)
            s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
            x = (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
        else:
            x = tl.load(xp, mask=xm, other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, 0)
            nw = tl.load(NW + rk, mask=kmask, other=0.0).to(tl.float32)
            x = (xf * nw[:, None]).to(w.dtype)
        acc += tl.dot(w, x.to(w.dtype), input_precision=PRECISION)  # (BN, BK) @ (BK, BM)
        if GLU:  # the up rows N .. 2N - 1 of the same columns: a second tile, a second accumulator
            if EVEN:
                wu = tl.load(W + (rn + N)[:, None] * stride_w + rk[None, :], eviction_policy="evict_first")
            else:
                wu = tl.load(W + (rn + N)[:, None] * stride_w + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                             other=0.0, eviction_policy="evict_first")
            acc_u += tl.dot(wu, x.to(w.dtype), input_precision=PRECISION)
    y = acc
    if NORM:
        y = y * tl.rsqrt(ss / K + eps)[None, :]
        if GLU:
            acc_u = acc_u * tl.rsqrt(ss / K + eps)[None, :]
    if GLU:  # silu(gate) * up with the reference's roundings: gate, up, silu, product each to the dtype
        g = y.to(Y.dtype.element_ty).to(tl.float32)
        u = acc_u.to(Y.dtype.element_ty)
        sg = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty)
        y = sg.to(tl.float32) * u.to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
    om = nmask[:, None] & mmask[None, :]
    if HAS_RES:
        y += tl.load(R + rm[None, :] * N + rn[:, None], mask=om, other=0.0).to(tl.float32)
    tl.store(Y + rm[None, :] * N + rn[:, None], y.to(Y.dtype.element_ty), mask=om)


# (BN, BK, warps, stages), tried on an H200 at the 8B shapes (benchmarks/row_gemm_check.py)
ROW_CONFIGS = [(bn, bk, 4, st) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4, 6)] + \
    [(64, 128, 8, 4), (128, 128, 8, 4), (32, 512, 4, 3), (16, 512, 4, 3)]
_even = triton.heuristics({"EVEN": lambda a: a["N"] % a["BN"] == 0 and a["K"] % a["BK"] == 0})(_rows_kernel)
SMALL_WEIGHT = 1 << 22  # elements (8 MB in bf16): a tiny model's weight, launch-bound whatever its config


def small_first(configs, named_args, **kwargs):
    """A weight of at most SMALL_WEIGHT elements takes the first config untried: each config
    tried is a compile and a benchmark, which a fresh machine's first batched steps paid for
    every (shape, fold, column block) key (the GPU smoke's `batch` row: its first token
    1.7 -> 14.5 s once the wide blocks came, with eight configs each)."""
    return configs[:1] if named_args["N"] * named_args["K"] <= SMALL_WEIGHT else configs


_tuned = autotune(
    [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in ROW_CONFIGS],
    ["N", "K", "SILU_MUL", "NORM", "GLU"], prune=small_first, name="gemm_rows")(_even)
# wider column blocks (BM 32 .. 128): a bigger input tile per stage (shared memory: (BN + BM) x BK
# x 2 bytes a stage). The configs that won some 8B shape at 32 or 64 rows on an H200 out of eight
# tried (row_gemm_check.py), after a small-register one (the gate-up's two accumulators; a tiny
# weight's only config: small_first): each config tried is a compile and a benchmark on a fresh
# machine's first batched step
WIDE_CONFIGS = [(64, 64, 4, 4), (64, 128, 8, 4), (32, 256, 4, 3), (128, 64, 8, 4), (32, 128, 4, 4)]
_wide = autotune(
    [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in WIDE_CONFIGS],
    ["N", "K", "SILU_MUL", "NORM", "GLU", "BM"], prune=small_first, name="gemm_rows_wide")(_even)


def gemm_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
              norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
              glu: bool = False) -> torch.Tensor:
    """x (M, K) [(M, 2K) with `silu_mul`], M <= BATCH_ROWS, @ w (N, K)^T (+ bias) (+ residual (M, N))
    -> (M, N) in x's dtype; `norm` (K,): RMSNorm(norm, eps) on the input first. gemv.py's
    arguments, for a few rows. `glu`: w is a fused gate-up weight (2N', K), gate rows first,
    and the result is silu(x Wg^T) * (x Wu^T), (M, N') (a SwiGLU's input to its down
    projection: no bias, no residual)."""
    M = x.shape[0]
    N, K = w.shape
    if glu:
        assert N % 2 == 0 and bias is None and residual is None and not silu_mul
        N //= 2
    assert 1 <= M <= BATCH_ROWS and x.shape[-1] == (2 * K if silu_mul else K) and w.stride(1) == 1
    assert not (silu_mul and norm is not None), "the gating and the pre-norm do not meet in one kernel"
    x = x.contiguous()
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    b = bias if bias is not None else w
    nw = norm if norm is not None else w
    r = residual.contiguous() if residual is not None else w
    assert residual is None or tuple(r.shape) == (M, N)
    flags = dict(SILU_MUL=silu_mul, HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RES=residual is not None,
                 GLU=glu, PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    bm = row_block(M)
    if x.device.type == "cuda":
        (_tuned if bm == MAX_ROWS else _wide)[lambda m: (triton.cdiv(N, m["BN"]),)](
            x, w, b, nw, r, y, M, N, K, x.stride(0), w.stride(0), eps, BM=bm, **flags)
        return y
    bn, bk = 16, 32  # the interpreter
    _even[(triton.cdiv(N, bn),)](x, w, b, nw, r, y, M, N, K, x.stride(0), w.stride(0), eps, BM=bm,
                                 BN=bn, BK=bk, **flags)
    return y
