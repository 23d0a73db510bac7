"""Rotary embedding and the KV-cache write of a decode / verify step in one kernel.

After the fused QKV projection a step's rows hold [q heads ; k heads ; v heads]. The reference
rotates q and k (a few elementwise kernels, even compiled) and writes k and v into the cache
with two index copies. Here one program per (row, head) loads its head's values once: a q head
is rotated into the returned q, a k head is rotated and stored at the row's cache slot, a v head
is stored there as it is. cos and sin are rounded to the input dtype as the reference does; the
rotation is computed in fp32 and rounded once (as the compiled reference does; eager bf16 rounds
each product too: a last-bit difference in bf16, none in fp32).

Two variants the families need ride the same pass:
- q / k norms (qwen3, glm4_moe's `use_qk_norm`): each q and k head is RMS-normalized over its
  head dimension before it rotates, as `RMSNorm` does it (the sum of squares in fp32, the
  normalized value rounded to the input dtype, then times the norm's weight, rounded);
- partial rotary (glm4_moe: `rot` < head dim): only the first `rot` dimensions rotate (rotate-half
  within them), the rest pass through, as `apply_rope` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rope_kv_write"]


@triton.jit
def _rope_kv_kernel(QKV, COS, SIN, POS, QO, KC, VC, QN, KN, eps, stride_t, stride_cs, stride_qo, stride_kc,
                    stride_kh, stride_vc, stride_vh, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                    ROT: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)  # head: q heads, then k heads, then v heads (the fused projection's order)
    half: tl.constexpr = ROT // 2
    d = tl.arange(0, HD)
    row = QKV + t * stride_t + j * HD
    x = tl.load(row + d)
    if j < NH + NKV:  # rotate-half over the first ROT dims: out = x * cos + [-x2, x1] * sin
        rotates = d < ROT
        pd = tl.where(rotates, (d + half) % ROT, d)
        partner = tl.load(row + pd)
        if NORM:  # RMSNorm over the head first (q_norm on q heads, k_norm on k heads)
            xf = x.to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HD + eps)
            if j < NH:
                w = tl.load(QN + d).to(tl.float32)
                wp = tl.load(QN + pd).to(tl.float32)
            else:
                w = tl.load(KN + d).to(tl.float32)
                wp = tl.load(KN + pd).to(tl.float32)
            x = (w * (xf * r).to(x.dtype).to(tl.float32)).to(x.dtype)
            partner = (wp * (partner.to(tl.float32) * r).to(x.dtype).to(tl.float32)).to(x.dtype)
        rot = tl.where(d < half, -partner, partner)
        c = tl.load(COS + t * stride_cs + d, mask=rotates, other=1.0).to(x.dtype).to(tl.float32)  # cos / sin
        s = tl.load(SIN + t * stride_cs + d, mask=rotates, other=0.0).to(x.dtype).to(tl.float32)  # as the reference
        y = tl.where(rotates, (x.to(tl.float32) * c + rot.to(tl.float32) * s).to(x.dtype), x)  # fp32, one rounding
        if j < NH:
            tl.store(QO + t * stride_qo + j * HD + d, y)
        else:
            p = tl.load(POS + t)
            tl.store(KC + p * stride_kc + (j - NH) * stride_kh + d, y)
    else:
        p = tl.load(POS + t)
        tl.store(VC + p * stride_vc + (j - NH - NKV) * stride_vh + d, x)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                  pos: torch.Tensor, nh: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 0.0) -> torch.Tensor:
    """qkv (T, (nh + 2 nkv) hd) -> the rotated q (T, nh, hd); the rotated k and v are written to
    kc / vc (C, nkv, hd) at rows `pos` (T,). cos / sin (T, rot) as `rope_rows` gives them: rot < hd
    rotates the first rot dims of each head only. q_norm / k_norm (hd,): the heads' RMSNorm
    weights (with eps), applied to q and k before they rotate."""
    T = qkv.shape[0]
    nkv, hd = kc.shape[1], kc.shape[2]
    rot = cos.shape[1]
    assert qkv.shape[1] == (nh + 2 * nkv) * hd and qkv.stride(1) == 1 and cos.shape == (T, rot) == sin.shape
    assert hd & (hd - 1) == 0 and kc.stride(2) == 1 and vc.stride(2) == 1 and cos.stride() == sin.stride()
    assert rot % 2 == 0 and 0 < rot <= hd and (q_norm is None) == (k_norm is None)
    q = torch.empty((T, nh, hd), device=qkv.device, dtype=qkv.dtype)
    norm = q_norm is not None
    qn, kn = (q_norm, k_norm) if norm else (qkv, qkv)  # (unread without NORM)
    _rope_kv_kernel[(T, nh + 2 * nkv)](qkv, cos, sin, pos, q, kc, vc, qn, kn, float(eps), qkv.stride(0),
                                       cos.stride(0), q.stride(0), kc.stride(0), kc.stride(1), vc.stride(0),
                                       vc.stride(1), NH=nh, NKV=nkv, HD=hd, ROT=rot, NORM=norm, num_warps=1)
    return q
