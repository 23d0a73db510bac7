"""Attention for a chunk of contiguous rows over a cached prefix, never holding the
(rows x context) score matrix of the whole prompt.

A prefill chunk of T rows at positions [start, start + T) attends to the cache rows
[0, start + T): row t sees keys 0 .. start + t, i.e. the causal mask aligned to the BOTTOM
RIGHT of the (T, start + T) score block (a chunk with no prefix, start = 0, is the plain
causal square). Three arms, picked by a registry on (device, dtype), not by scattered checks:

  cudnn    CUDA, fp16 / bf16, one head dim <= 128 (not MLA), cuDNN 9: a chunk with no prefix is
           the causal square on torch's SDPA (enable_gqa; ~585-610 TFLOP/s measured on an
           H200 at 8k-32k rows); a chunk over a prefix is cuDNN's fused attention in two calls,
           the chunk against its prefix (every key visible) and against itself (the causal
           square, where top-left and bottom-right alignment agree), merged by their
           log-sum-exps (in one pass where our kernels run: kernels/merge.py), grouped K/V
           heads read in place (~530-540 TFLOP/s at 8k rows over a 24k-120k prefix, against
           FlashAttention-2's ~345; BENCHMARKS.md).
  flash    CUDA, fp16 / bf16, head dims <= 256: torch's FlashAttention-2 kernel
           (`aten::_scaled_dot_product_flash_attention`), whose causal flag is bottom-right
           aligned when there are more keys than queries, with grouped K/V heads read in
           place (no repeated copy); a value head narrower than the query / key head (MLA)
           is zero-padded to it and the padding dropped from the output.
  blocked  everything else (CPU, fp32): the rows in blocks of `block_rows(...)` queries, each
           block against only the keys it can see, an fp32 softmax; working memory is
           O(block x context), set by SCORE_BUDGET, whatever the chunk.

Both take q (T, nh, dqk), k (S, nkv, dqk), v (S, nkv, dv) with S = start + T (strided cache
views are fine) and return (T, nh, dv). GQA: query head h reads K/V head h // (nh // nkv)
(HF's layout).
"""

from __future__ import annotations

import torch

__all__ = ["prefix_attention", "prefix_arm", "merge_parts", "blocked_attention", "block_rows", "SCORE_BUDGET",
           "PREFIX_MIN_ROWS"]

SCORE_BUDGET = 1 << 25  # fp32 scores one block of the blocked arm may hold (128 MiB)
# forwards of more rows than this take the prefix path (prefill chunks); fewer (decode, verify
# rows: at most MAX_K + 1 = 33) keep the step kernels / the masked reference, graph-safe
PREFIX_MIN_ROWS = 33


def block_rows(nh: int, keys: int, budget: int = SCORE_BUDGET) -> int:
    """Query rows per block so that one block's scores (nh x rows x keys fp32) fit `budget`.

    >>> block_rows(32, 1 << 15)
    32
    >>> block_rows(4, 10)
    838860
    """
    return max(1, budget // max(1, nh * keys))


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                      budget: int = SCORE_BUDGET) -> torch.Tensor:
    """The reference arm: q (T, nh, dqk), k (S, nkv, dqk), v (S, nkv, dv), S = start + T -> (T, nh, dv).
    Query blocks; each block [a, b) reads keys [0, start + b) under the bottom-right mask."""
    T, nh, _ = q.shape
    nkv, dv = k.shape[1], v.shape[-1]
    rep = nh // nkv
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # (nkv, S, d) strided views, no copy
    out = q.new_empty(T, nh, dv)
    step = block_rows(nh, start + T, budget)
    for a in range(0, T, step):
        b = min(T, a + step)
        n, keys = b - a, start + b  # this block sees keys [0, start + b)
        qg = q[a:b].reshape(n, nkv, rep, -1).permute(1, 2, 0, 3).reshape(nkv, rep * n, -1)  # (nkv, rep*n, dqk)
        # the scores are scaled and masked in place, and each block's scores / probabilities are
        # freed before the next block's: at most two (budget-sized) score blocks live at once
        s = torch.matmul(qg, kh[:, :keys].transpose(1, 2)).float().mul_(scale)  # (nkv, rep*n, keys)
        rows = torch.arange(start + a, start + b, device=q.device)  # the block's positions
        hide = torch.arange(keys, device=q.device)[None, :] > rows[:, None]  # (n, keys): key after the row
        s.view(nkv, rep, n, keys).masked_fill_(hide, float("-inf"))
        p = torch.softmax(s, dim=-1).to(v.dtype)
        del s
        o = torch.matmul(p, vh[:, :keys])  # (nkv, rep*n, dv)
        del p
        out[a:b] = o.view(nkv, rep, n, dv).permute(2, 0, 1, 3).reshape(n, nh, dv)
    return out


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:  # MLA: values narrower than queries / keys; FlashAttention-2 wants one head dim
        v = torch.nn.functional.pad(v, (0, dqk - dv))
    # (1, heads, rows, d) views of the (rows, heads, d) layouts: the last dim stays contiguous
    o = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        0.0, True, False, scale=scale)[0]  # (1, nh, T, d); causal: bottom-right when S > T
    return o[0].transpose(0, 1)[..., :dv]  # (T, nh, dv)


def _flash_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and v.shape[-1] <= q.shape[-1]
            and q.shape[1] % k.shape[1] == 0)


def _cudnn_part(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """qh (1, nh, T, d) against k, v (S, nkv, d) -> (out (1, nh, T, d), log-sum-exp (1, nh, T) fp32)."""
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True, 0.0, causal, False, scale=scale)[:2]
    return o, lse.reshape(o.shape[:3]).float()


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    qh = q.transpose(0, 1)[None]  # (1, nh, T, d)
    if start == 0:  # no prefix: the plain causal square, on the kernel torch's SDPA picks (the fastest measured)
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)  # (T, nh, d)
    o2, l2 = _cudnn_part(qh, k[start:], v[start:], True, scale)  # the chunk's own rows: the causal square
    o1, l1 = _cudnn_part(qh, k[:start], v[:start], False, scale)  # the prefix: every key visible
    return _merge(o1, l1, o2, l2, q.dtype)  # the softmax over both key sets


def merge_parts(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """Two attention outputs (1, nh, T, d) over disjoint key sets, with the log-sum-exps of their
    scores (1, nh, T) fp32 -> the softmax over both key sets (T, nh, d) in `dtype`: the torch
    ops (kernels/merge.py is this in one pass)."""
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top)[..., None], torch.exp(l2 - top)[..., None]
    o = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    return o.to(dtype)[0].transpose(0, 1)


# kernels/ops.py sets it where our kernels run (its install built the one-pass merge once);
# --kernels off, no Triton, CPU: the torch ops
FUSED_MERGE = False


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The two parts' merge: one pass (kernels/merge.py) where our kernels run, else the torch ops."""
    if FUSED_MERGE and not torch.compiler.is_compiling():
        from ..kernels.merge import merge_attention  # noqa: PLC0415

        return merge_attention(o1, l1, o2, l2, dtype)
    return merge_parts(o1, l1, o2, l2, dtype)


def _cudnn_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] == v.shape[-1] <= 128 and q.shape[-1] % 8 == 0 and q.shape[1] % k.shape[1] == 0
            and torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000)


# arm name -> (applies, fn); the first that applies runs (the blocked arm always does)
_ARMS = (("cudnn", _cudnn_ok, _cudnn), ("flash", _flash_ok, _flash),
         ("blocked", lambda q, k, v: True, blocked_attention))


def prefix_arm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The arm `prefix_attention` takes for these tensors (benchmarks and tests name it)."""
    return next(name for name, ok, _ in _ARMS if ok(q, k, v))


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q (T, nh, dqk) at positions [start, start + T) over k, v (start + T, nkv, d) -> (T, nh, dv)."""
    if k.shape[0] != start + q.shape[0]:
        raise ValueError(f"prefix attention: {k.shape[0]} key rows for a chunk at {start} of {q.shape[0]} rows")
    for _name, ok, fn in _ARMS:
        if ok(q, k, v):
            return fn(q, k, v, start, scale)
    raise AssertionError("unreachable: the blocked arm applies to everything")
