"""A few rows through routed MoE experts in two Triton kernels: per-slot GEMVs over the chosen
experts' weights, read in place.

`Experts.forward_grouped` (model/moe.py) sorts the (row, expert) slots, builds offsets and runs
torch._grouped_mm. At decode widths (a row, top-8 of 256 DeepSeek-V3 experts) that grouped GEMM
streamed the experts at 2.4 TB/s on an H200 (these kernels: 3.9 TB/s), and the bookkeeping
around it was ~20 more kernels (BENCHMARKS.md). Here:

  `_up_kernel`    program (n-block, slot s): y[s] = W_gu[idx[s]] @ x[s // k], the GEMV of
                  kernels/gemv.py with the weight pointer offset by the slot's expert;
  `_down_kernel`  program (n-block, row t): the row's k experts in ascending id (the reference's
                  summation order, found in the kernel: no sort), each a GEMV of
                  silu(g) * u (computed while loading, as gemv.py's gating) against
                  W_down[e], rounded as the grouped path rounds (the expert's output, its
                  routing weight's product, the running sum: each to the input dtype), then
                  the shared experts' output added (`shared`).

Each slot reads its expert's rows once; rows that pick the same expert read it once each, so
this form is for a few rows (decode, verify, a drafter's steps: kernels/ops.py MAX_MOE_ROWS),
the grouped GEMM for prefills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import CONFIGS
from .tuning import autotune

__all__ = ["moe_experts"]


@triton.jit
def _up_kernel(X, W, IDX, Y, N, K, stride_xt, stride_we, stride_wn, TOPK: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)  # slot: row s // TOPK, its expert idx[s]
    e = tl.load(IDX + s).to(tl.int64)
    xrow = X + (s // TOPK) * stride_xt
    wb = W + e * stride_we
    rn = pid * BN + tl.arange(0, BN)
    nmask = rn < N
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        if EVEN:
            w = tl.load(wb + rn[:, None] * stride_wn + rk[None, :], eviction_policy="evict_first")
            x = tl.load(xrow + rk)
        else:
            kmask = rk < K
            w = tl.load(wb + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0, eviction_policy="evict_first")
            x = tl.load(xrow + rk, mask=kmask, other=0.0)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    tl.store(Y + s * N + rn, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=nmask)


@triton.jit
def _down_kernel(G, W, IDX, WT, S, Y, N, K, stride_we, stride_wn, TOPK: tl.constexpr, KP: tl.constexpr,
                 HAS_SHARED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.program_id(1)  # token row
    rn = pid * BN + tl.arange(0, BN)
    nmask = rn < N
    lane = tl.arange(0, KP)
    lmask = lane < TOPK
    big = 1 << 62
    ids = tl.load(IDX + t * TOPK + lane, mask=lmask, other=big).to(tl.int64)
    wts = tl.load(WT + t * TOPK + lane, mask=lmask, other=0.0).to(tl.float32)
    out = tl.zeros((BN,), dtype=tl.float32)  # the running sum, rounded to the output dtype at every add
    prev = tl.full((), -1, dtype=tl.int64)
    for _j in tl.static_range(TOPK):
        cur = tl.min(tl.where(ids > prev, ids, big), 0)  # the next expert up (a row's experts are distinct)
        hit = ids == cur
        slot = t * TOPK + tl.sum(tl.where(hit, lane, 0), 0)
        wj = tl.sum(tl.where(hit, wts, 0.0), 0)
        grow = G + slot * (2 * K)  # the slot's gate then up
        wb = W + cur * stride_we
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            if EVEN:
                w = tl.load(wb + rn[:, None] * stride_wn + rk[None, :], eviction_policy="evict_first")
                g = tl.load(grow + rk).to(tl.float32)
                u = tl.load(grow + K + rk)
            else:
                kmask = rk < K
                w = tl.load(wb + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                            other=0.0, eviction_policy="evict_first")
                g = tl.load(grow + rk, mask=kmask, other=0.0).to(tl.float32)
                u = tl.load(grow + K + rk, mask=kmask, other=0.0)
            sg = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # silu(g) in the input dtype, then times u (the reference)
            x = (sg.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
            acc += w.to(tl.float32) * x[None, :].to(tl.float32)
        ys = tl.sum(acc, 1).to(Y.dtype.element_ty).to(tl.float32)  # the expert's output
        p = (ys * wj).to(Y.dtype.element_ty).to(tl.float32)  # times its routing weight
        out = (out + p).to(Y.dtype.element_ty).to(tl.float32)
        prev = cur
    if HAS_SHARED:
        out += tl.load(S + t * N + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(Y + t * N + rn, out.to(Y.dtype.element_ty), mask=nmask)


def _even(a) -> bool:
    return a["N"] % a["BN"] == 0 and a["K"] % a["BK"] == 0


_configs = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in CONFIGS]
_up = triton.heuristics({"EVEN": _even})(_up_kernel)
_down = triton.heuristics({"EVEN": _even})(_down_kernel)
_up_tuned = autotune(_configs, ["N", "K", "TOPK"], name="moe_up")(_up)
_down_tuned = autotune(_configs, ["N", "K", "TOPK"], name="moe_down")(_down)


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                idx: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, H); gate_up (E, 2I, H) (gate rows, then up); down (E, H, I); weights / idx (T, k)
    the router's (fp32 weights, expert ids) -> (T, H) in x's dtype: the sum over each row's
    experts (ascending id) of weight * down(silu(gate) * up), plus `shared` (T, H) when given."""
    T, H = x.shape
    E, I2, _ = gate_up.shape
    k = idx.shape[1]
    assert gate_up.stride(2) == 1 and down.stride(2) == 1 and down.shape[1] == H and down.shape[2] * 2 == I2
    x = x.contiguous()
    ids = idx.reshape(-1).contiguous()
    wts = weights.reshape(-1).contiguous()
    gu = torch.empty((T * k, I2), device=x.device, dtype=x.dtype)
    y = torch.empty((T, H), device=x.device, dtype=x.dtype)
    s = shared.contiguous() if shared is not None else y  # unread without HAS_SHARED
    kp = triton.next_power_of_2(k)
    if x.device.type == "cuda":
        _up_tuned[lambda m: (triton.cdiv(I2, m["BN"]), T * k)](
            x, gate_up, ids, gu, I2, H, x.stride(0), gate_up.stride(0), gate_up.stride(1), TOPK=k)
        _down_tuned[lambda m: (triton.cdiv(H, m["BN"]), T)](
            gu, down, ids, wts, s, y, H, I2 // 2, down.stride(0), down.stride(1), TOPK=k, KP=kp,
            HAS_SHARED=shared is not None)
        return y
    bn, bk = 16, 32  # the interpreter: few programs (each runs in Python), ragged edges still masked
    _up[(triton.cdiv(I2, bn), T * k)](x, gate_up, ids, gu, I2, H, x.stride(0), gate_up.stride(0), gate_up.stride(1),
                                      TOPK=k, BN=bn, BK=bk)
    _down[(triton.cdiv(H, bn), T)](gu, down, ids, wts, s, y, H, I2 // 2, down.stride(0), down.stride(1), TOPK=k,
                                   KP=kp, HAS_SHARED=shared is not None, BN=bn, BK=bk)
    return y
