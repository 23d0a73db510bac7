"""Two attention outputs over disjoint key sets merged by their log-sum-exps, in one pass.

A prefill chunk over a cached prefix runs cuDNN's attention twice (model/prefix_attention.py):
the chunk against its prefix (every key visible) and against itself (the causal square), each
returning its output (1, heads, rows, d) and the log-sum-exp of its scores (1, heads, rows).
The softmax over both key sets is their outputs weighted by exp(lse - max): as torch ops that is
~8 passes over fp32 copies of the outputs (each chunk's 4 MB a head of bf16 read and written
as 8 MB fp32 several times: by the bytes ~2 GB a layer for an 8k-row chunk of 32 heads, about
0.7 ms at an H100's bandwidth and ~65 ms of a 32k prompt's first token; an estimate, not yet
measured). Here one program a row reads both outputs and both lse rows of every head once and
writes the merged row into the (rows, heads, d) layout the projection after it reads.

It computes what the reference does (fp32 weights, o1 * w1 + o2 * w2 over w1 + w2, rounded to
the output dtype once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_attention"]


# one build whatever the chunk's rows: the strides (a log-sum-exp's head stride is the chunk's
# rows) would otherwise specialise on their divisibility, a build per kind of chunk
@triton.jit(do_not_specialize=["NH", "D", "s1h", "s1t", "s2h", "s2t", "l1h", "l1t", "l2h", "l2t"])
def _merge_kernel(O1, L1, O2, L2, Y, NH, D, s1h, s1t, s2h, s2t, l1h, l1t, l2h, l2t,
                  BH: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    mh = h < NH
    m = mh[:, None] & (d[None, :] < D)
    a = tl.load(L1 + h * l1h + t * l1t, mask=mh, other=0.0)
    b = tl.load(L2 + h * l2h + t * l2t, mask=mh, other=0.0)
    top = tl.maximum(a, b)
    w1 = tl.exp(a - top)
    w2 = tl.exp(b - top)
    o1 = tl.load(O1 + h[:, None] * s1h + t * s1t + d[None, :], mask=m, other=0.0).to(tl.float32)
    o2 = tl.load(O2 + h[:, None] * s2h + t * s2t + d[None, :], mask=m, other=0.0).to(tl.float32)
    o = (o1 * w1[:, None] + o2 * w2[:, None]) / (w1 + w2)[:, None]
    tl.store(Y + t * NH * D + h[:, None] * D + d[None, :], o.to(Y.dtype.element_ty), mask=m)


def merge_attention(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """model/prefix_attention.py's `merge_parts` in one pass -> a contiguous (T, nh, d) tensor:
    any strides of the (1, nh, T, d) outputs and (1, nh, T) fp32 log-sum-exps, the outputs'
    last dim contiguous (made so where it is not)."""
    _, nh, T, D = o1.shape
    if o1.stride(-1) != 1:
        o1 = o1.contiguous()
    if o2.stride(-1) != 1:
        o2 = o2.contiguous()
    y = torch.empty((T, nh, D), device=o1.device, dtype=dtype)
    if T:
        bh, bd = triton.next_power_of_2(nh), triton.next_power_of_2(D)
        _merge_kernel[(T,)](o1, l1, o2, l2, y, nh, D, o1.stride(1), o1.stride(2), o2.stride(1), o2.stride(2),
                            l1.stride(1), l1.stride(2), l2.stride(1), l2.stride(2),
                            BH=bh, BD=bd, num_warps=4 if bh * bd <= 4096 else 8)
    return y
