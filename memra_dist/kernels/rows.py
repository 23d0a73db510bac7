"""A block's elementwise work over many rows, one pass each: RMSNorm, the residual add fused with
the next norm, and SwiGLU's silu(g) * u.

A prefill chunk (or a batched step past the folded row GEMMs' 64 rows) runs its projections on
cuBLAS; what lies between them ran as the reference's eager ops: RMSNorm alone is six kernels
(a cast to fp32, square, mean, rsqrt, scale, cast back, times the weight) each writing a full
fp32 or bf16 copy of the rows, and the gating two (silu, then the product). In an eager 8B step
of 16k rows those passes took ~1/3 of the device time against the GEMMs' ~3/5 (H100 profile,
BENCHMARKS.md). Here each is one read of its inputs and one write of its outputs.

Each rounds as the reference does (model/layers.py): the mean of squares and the scale in fp32,
the normed row rounded to the input dtype, then times the weight in that dtype; the residual
sum rounded to the dtype before it is normed; silu(g) rounded to the dtype, then the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm_rows", "add_rms_norm_rows", "silu_mul_rows"]

GLU_BLOCK = 1024  # gated columns a program takes


@triton.jit
def _norm_kernel(X, R, W, S, Y, H, eps, BH: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BH)
    m = c < H
    x = tl.load(X + row * H + c, mask=m, other=0.0)
    if HAS_RES:  # s = x + r, rounded to the dtype as the reference's add is; kept as the new residual
        r = tl.load(R + row * H + c, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(S + row * H + c, x, mask=m)
    xf = x.to(tl.float32)
    h = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)).to(x.dtype)
    w = tl.load(W + c, mask=m, other=0.0)
    tl.store(Y + row * H + c, (w.to(tl.float32) * h.to(tl.float32)).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _glu_kernel(GU, Y, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    g = tl.load(GU + row * 2 * I + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * I + I + c, mask=m, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(Y + row * I + c, (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=m)


def _warps(bh: int) -> int:
    return 4 if bh <= 2048 else 8 if bh <= 8192 else 16


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float, r: torch.Tensor | None):
    H = x.shape[-1]
    assert w.shape == (H,), (tuple(w.shape), H)
    x2 = x.reshape(-1, H).contiguous()
    rows = x2.shape[0]
    y = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(w.dtype, x.dtype))
    s = None
    if r is not None:
        r2 = r.reshape(-1, H).contiguous()
        s = torch.empty_like(x2)
    if rows:
        bh = triton.next_power_of_2(H)
        _norm_kernel[(rows,)](x2, r2 if r is not None else x2, w, s if s is not None else x2, y, H, eps,
                              BH=bh, HAS_RES=r is not None, num_warps=_warps(bh))
    return y.view(x.shape), (s.view(x.shape) if s is not None else None)


def rms_norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., H) with weight w (H,): one pass."""
    return _norm(x, w, eps, None)[0]


def add_rms_norm_rows(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) for s = x + r: a block's residual add and the next half's pre-norm in one pass."""
    assert x.shape == r.shape and x.dtype == r.dtype, (tuple(x.shape), tuple(r.shape), x.dtype, r.dtype)
    y, s = _norm(x, w, eps, r)
    return s, y


def silu_mul_rows(gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for gu = [g ; u] (..., 2I) (the fused gate-up projection's output) -> (..., I)."""
    inter = gu.shape[-1] // 2
    g2 = gu.reshape(-1, 2 * inter).contiguous()
    y = torch.empty((g2.shape[0], inter), device=gu.device, dtype=gu.dtype)
    if g2.shape[0]:
        _glu_kernel[(g2.shape[0], triton.cdiv(inter, GLU_BLOCK))](g2, y, inter, BLOCK=GLU_BLOCK, num_warps=4)
    return y.view(*gu.shape[:-1], inter)
