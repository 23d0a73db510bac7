"""Two RMSNorms side by side in one kernel: EAGLE-3's attention input [norm_a(a) ; norm_b(b)]
(model/eagle3.py: the token's embedding and the fed-back hidden, each with its own norm), and
optionally norm_b(b) on its own (the residual when `norm_before_residual`). The eager layer
runs two norms of ~6 kernels each and a concatenation; a drafter's chained step is one row, so
those launches cost more than their arithmetic.

Each program takes one row. The reference's roundings (model/layers.py RMSNorm): the mean of
squares and the scale in fp32, the normed row rounded to the input dtype, then times the
weight in that dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pair_rmsnorm"]


@triton.jit
def _norm_half(X, W, row, H, eps, BH: tl.constexpr):
    c = tl.arange(0, BH)
    m = c < H
    x = tl.load(X + row * H + c, mask=m, other=0.0)
    xf = x.to(tl.float32)
    h = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)).to(x.dtype)
    w = tl.load(W + c, mask=m, other=0.0)
    return (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype), c, m


@triton.jit
def _pair_kernel(A, B, WA, WB, Y, BN, H, eps_a, eps_b, BH: tl.constexpr, KEEP_B: tl.constexpr):
    row = tl.program_id(0)
    ya, c, m = _norm_half(A, WA, row, H, eps_a, BH)
    yb, _, _ = _norm_half(B, WB, row, H, eps_b, BH)
    tl.store(Y + row * 2 * H + c, ya, mask=m)
    tl.store(Y + row * 2 * H + H + c, yb, mask=m)
    if KEEP_B:
        tl.store(BN + row * H + c, yb, mask=m)


def pair_rmsnorm(a: torch.Tensor, b: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, eps_a: float, eps_b: float,
                 keep_b: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """a, b (T, H) -> ([norm_a(a) ; norm_b(b)] (T, 2H), norm_b(b) (T, H) with `keep_b`, else None)."""
    T, H = a.shape
    assert b.shape == (T, H) and wa.shape == (H,) == wb.shape
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty((T, 2 * H), device=a.device, dtype=a.dtype)
    bn = torch.empty((T, H), device=a.device, dtype=a.dtype) if keep_b else y
    _pair_kernel[(T,)](a, b, wa, wb, y, bn, H, eps_a, eps_b, BH=triton.next_power_of_2(H), KEEP_B=keep_b,
                       num_warps=4 if H <= 4096 else 8)
    return y, (bn if keep_b else None)
