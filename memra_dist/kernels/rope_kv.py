"""Rotary embedding and the KV-cache write of a decode / verify step in one kernel.

After the fused QKV projection a step's rows hold [q heads ; k heads ; v heads]. The reference
rotates q and k (a few elementwise kernels, even compiled) and writes k and v into the cache
with two index copies. Here one program per (row, head) loads its head's values once: a q head
is rotated into the returned q, a k head is rotated and stored at the row's cache slot, a v head
is stored there as it is. cos and sin are rounded to the input dtype as the reference does; the
rotation is computed in fp32 and rounded once (as the compiled reference does; eager bf16 rounds
each product too: a last-bit difference in bf16, none in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rope_kv_write"]


@triton.jit
def _rope_kv_kernel(QKV, COS, SIN, POS, QO, KC, VC, stride_t, stride_cs, stride_qo, stride_kc, stride_kh,
                    stride_vc, stride_vh, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)  # head: q heads, then k heads, then v heads (the fused projection's order)
    half: tl.constexpr = HD // 2
    d = tl.arange(0, HD)
    x = tl.load(QKV + t * stride_t + j * HD + d)
    if j < NH + NKV:  # rotate-half: out = x * cos + [-x2, x1] * sin
        partner = tl.load(QKV + t * stride_t + j * HD + (d + half) % HD)
        rot = tl.where(d < half, -partner, partner)
        c = tl.load(COS + t * stride_cs + d).to(x.dtype).to(tl.float32)  # cos / sin rounded as the reference
        s = tl.load(SIN + t * stride_cs + d).to(x.dtype).to(tl.float32)
        y = (x.to(tl.float32) * c + rot.to(tl.float32) * s).to(x.dtype)  # fp32, one rounding
        if j < NH:
            tl.store(QO + t * stride_qo + j * HD + d, y)
        else:
            p = tl.load(POS + t)
            tl.store(KC + p * stride_kc + (j - NH) * stride_kh + d, y)
    else:
        p = tl.load(POS + t)
        tl.store(VC + p * stride_vc + (j - NH - NKV) * stride_vh + d, x)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                  pos: torch.Tensor, nh: int) -> torch.Tensor:
    """qkv (T, (nh + 2 nkv) hd) -> the rotated q (T, nh, hd); the rotated k and v are written to
    kc / vc (C, nkv, hd) at rows `pos` (T,). cos / sin (T, hd) as `rope_rows` gives them."""
    T = qkv.shape[0]
    nkv, hd = kc.shape[1], kc.shape[2]
    assert qkv.shape[1] == (nh + 2 * nkv) * hd and qkv.stride(1) == 1 and cos.shape == (T, hd) == sin.shape
    assert hd & (hd - 1) == 0 and kc.stride(2) == 1 and vc.stride(2) == 1 and cos.stride() == sin.stride()
    q = torch.empty((T, nh, hd), device=qkv.device, dtype=qkv.dtype)
    _rope_kv_kernel[(T, nh + 2 * nkv)](qkv, cos, sin, pos, q, kc, vc, qkv.stride(0), cos.stride(0), q.stride(0),
                                       kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                                       NH=nh, NKV=nkv, HD=hd, num_warps=1)
    return q
