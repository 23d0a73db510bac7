"""Grouped-query attention (llama / qwen2 / qwen3) over a preallocated KV cache."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..cache import KVLayer
from .config import ModelConfig
from .layers import RMSNorm, apply_rope
from .prefix_attention import prefix_attention

__all__ = ["Attention", "causal_mask", "cached_attention"]


def causal_mask(pos: torch.Tensor, capacity: int) -> torch.Tensor:
    """(T, capacity) bool: row t may read key slot c iff c <= pos[t]. Static-shaped."""
    slots = torch.arange(capacity, device=pos.device)
    return slots[None, :] <= pos[:, None]


class Attention(nn.Module):
    mixer_class = "attn"
    rope_dim: int

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        nh, nkv, hd, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_eps)
        self.qk_norm = cfg.qk_norm
        self.rope_dim = hd

    def new_state(self, capacity: int, device, dtype) -> KVLayer:
        return KVLayer.alloc(capacity, self.nkv, self.hd, device, dtype)

    fast_attn_rows = 0  # kernels/ops.py: steps of up to this many rows read the cache with the split-sequence kernel
    rows_rope = False  # kernels/ops.py: a prefill chunk's rotary and cache writes in one kernel (`_prefill_rows`)
    graph_safe = True  # static shapes, no host syncs: CUDA-graph capturable (graphs.py)
    compile_safe = True  # torch.compile'd blocks inside the graphs (--compile)

    def fuse(self) -> None:
        """One QKV GEMM instead of three (the fast path; the reference keeps q/k/v_proj)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                          device=parts[0].weight.device, dtype=parts[0].weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([p.bias for p in parts]))
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x: torch.Tensor):
        T = x.shape[0]
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(T, self.nh, self.hd), k.view(T, self.nkv, self.hd), v.view(T, self.nkv, self.hd)

    def forward(self, x: torch.Tensor, ctx, state: KVLayer | None) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). ctx: StepCtx (positions, mask over cache slots, rotary
        rows); without a state (no cache) plain causal attention over x."""
        T, pos, mask = x.shape[0], ctx.pos, ctx.mask
        if getattr(ctx, "batch", None) is not None:  # several requests' rows over a paged cache
            return self._batched(x, ctx, state)
        if state is not None and T <= self.fast_attn_rows and self.rope_kernel_ok():
            return self._fast(x, ctx, state)
        if state is not None and ctx.prefix is not None and self.rows_rope and not torch.compiler.is_compiling():
            return self._prefill_rows(x, ctx, state)
        rope = ctx.rope_for(self.rope_dim)
        q, k, v = self._qkv(x)  # (T, nh, hd), (T, nkv, hd), (T, nkv, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if state is None:  # reference / training path: plain causal over x
            qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, T, hd)
            if self.nkv != self.nh:
                rep = self.nh // self.nkv
                kh, vh = kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0)  # (nh, T, hd)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)  # (nh, T, hd)
            return self.o_proj(o.transpose(0, 1).reshape(T, self.nh * self.hd))
        state.k.index_copy_(0, pos, k)
        state.v.index_copy_(0, pos, v)
        if ctx.prefix is not None:  # a prefill chunk: the cache rows up to its end, bottom-right causal
            S = ctx.prefix + T
            o = prefix_attention(q, state.k[:S], state.v[:S], ctx.prefix, self.hd ** -0.5)  # (T, nh, hd)
            return self.o_proj(o.reshape(T, self.nh * self.hd))
        if T <= self.fast_attn_rows:
            return self.o_proj(torch.ops.memra.decode_attention(q, state.k, state.v, pos))
        return self.o_proj(cached_attention(q, state.k, state.v, mask, self.nkv))  # (T, hidden)

    def _prefill_rows(self, x: torch.Tensor, ctx, state: KVLayer) -> torch.Tensor:
        """A prefill chunk on our kernels (kernels/ops.py install): the rotary of q and k and the
        K/V cache writes in one pass (kernels/rope_kv.py: the reference's rotary is about ten
        elementwise passes over q and k, then two index copies), then the chunk's attention
        over its prefix as the reference path runs it."""
        from ..kernels.rope_kv import rope_kv_write  # noqa: PLC0415 (Triton: only where installed)

        T = x.shape[0]
        cos, sin = ctx.rope_for(self.rope_dim)
        qkv = self.qkv_proj(x)
        q = rope_kv_write(qkv, cos, sin, state.k, state.v, ctx.pos, self.nh, **self._norms())  # (T, nh, hd)
        o = prefix_attention(q, state.k[:ctx.prefix + T], state.v[:ctx.prefix + T], ctx.prefix, self.hd ** -0.5)
        return self.o_proj(o.reshape(T, self.nh * self.hd))

    def _batched(self, x: torch.Tensor, ctx, state) -> torch.Tensor:
        """Rows of several requests (batching/paged.py `BatchView` in ctx.batch): the
        projections over every row at once, the K/V written at the rows' pool slots, then each
        request's attention over its own keys, gathered in position order, on the arm its
        rows take alone (prefix attention for a prefill chunk; the masked cached attention over
        a buffer of its capacity, zero and masked past its rows, for decode / verify rows)."""
        view = ctx.batch
        if view.paged is not None:
            return self._batched_paged(x, ctx, state)
        q, k, v = self._qkv(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = ctx.rope_for(self.rope_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        state.k.index_copy_(0, view.slots, k)
        state.v.index_copy_(0, view.slots, v)
        outs = [self._segment(q[seg.lo:seg.hi], state, seg) for seg in view.segments]
        return self.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])

    def _segment(self, qs: torch.Tensor, state, seg) -> torch.Tensor:
        """One request's rows qs (rows, nh, hd) over its paged keys, gathered in position order,
        on the arm its rows take alone -> (rows, nh * hd)."""
        if seg.prefix is not None:
            ks, vs = state.k.index_select(0, seg.keys), state.v.index_select(0, seg.keys)
            return prefix_attention(qs, ks, vs, seg.prefix, self.hd ** -0.5).reshape(seg.rows, -1)
        return cached_attention(qs, seg.own_cache(state.k), seg.own_cache(state.v), seg.mask, self.nkv)

    def _batched_paged(self, x: torch.Tensor, ctx, state) -> torch.Tensor:
        """`_batched` on the kernels (kernels/ops.py install; batching/paged.py `PagedRows`):
        rotary and the K/V write at the rows' pool slots in one kernel, then one paged
        split-sequence launch for every decode / verify segment; prefill chunks (segments
        left in view.segments) gather their keys and run the prefix attention."""
        return self.o_proj(self._attend_paged(self.qkv_proj(x), ctx, state))

    def _attend_paged(self, qkv: torch.Tensor, ctx, state) -> torch.Tensor:
        """`_attend` over a batched step's paged K/V: (T, (nh + 2 nkv) hd) -> (T, nh hd)."""
        from ..kernels.paged_attention import paged_attention  # noqa: PLC0415 (Triton: only where installed)
        from ..kernels.rope_kv import rope_kv_write  # noqa: PLC0415

        view, pg = ctx.batch, ctx.batch.paged
        cos, sin = ctx.rope_for(self.rope_dim)
        q = rope_kv_write(qkv, cos, sin, state.k, state.v, view.slots, self.nh, **self._norms())  # (T, nh, hd)
        o = paged_attention(q, state.k, state.v, ctx.pos, pg.lo, pg.nrows, pg.table, pg.block, pg.max_rows,
                            pg.max_len, segments=pg.segments)  # (T, nh * hd)
        for seg in view.segments:
            o[seg.lo:seg.hi] = self._segment(q[seg.lo:seg.hi], state, seg)
        return o

    def rope_kernel_ok(self) -> bool:
        """Whether kernels/rope_kv.py can take this layer's rotary and cache write: a fused QKV
        (its q / k norms, qwen3's, and a partial rotary, glm4_moe's, ride the same pass)."""
        return hasattr(self, "qkv_proj") and self.rope_dim % 2 == 0 and 0 < self.rope_dim <= self.hd

    def _norms(self) -> dict:
        """rope_kv_write's q / k norm arguments: none without them."""
        if not self.qk_norm:
            return {}
        return {"q_norm": self.q_norm.weight, "k_norm": self.k_norm.weight, "eps": self.q_norm.eps}

    # `_fast` and `fused_step` run opaque kernels that write the cache: kernels/ops.py install wraps
    # them in torch.compiler.disable (torch.compile breaks the block around them), at install
    # time rather than here, so importing the model does not import torch._dynamo (nor Triton).
    def _fast(self, x: torch.Tensor, ctx, state: KVLayer) -> torch.Tensor:
        """A verify step's rows on our kernels (kernels/ops.py install): the QKV projection,
        then `_attend` and o_proj."""
        return self.o_proj(self._attend(self.qkv_proj(x), ctx, state))

    def fused_step(self, x: torch.Tensor, ctx, state: KVLayer, norm: RMSNorm) -> torch.Tensor:
        """x + self(norm(x)) for a decode row or verify rows, in five kernels: the QKV GEMV (row
        GEMM) with the norm folded in, `_attend`'s three, the o_proj GEMV (row GEMM) with the
        residual add folded in. A batched step's rows over the paged K/V (several requests'
        decode / verify rows, up to the row GEMM's rows) attend through `_attend_paged`."""
        qkv, o = self.qkv_proj, self.o_proj
        y = torch.ops.memra.gemv(x, qkv.weight, qkv.bias, False, norm.weight, norm.eps, None)
        a = self._attend(y, ctx, state) if ctx.batch is None else self._attend_paged(y, ctx, state)
        return torch.ops.memra.gemv(a, o.weight, o.bias, False, None, 0.0, x)

    def _attend(self, qkv: torch.Tensor, ctx, state: KVLayer) -> torch.Tensor:
        """(T, (nh + 2 nkv) hd) -> (T, nh hd): rotary and the K/V cache write in one kernel,
        then the split attention (its partials and their merge)."""
        from ..kernels.decode_attention import decode_attention  # noqa: PLC0415 (Triton: only where installed)
        from ..kernels.rope_kv import rope_kv_write  # noqa: PLC0415

        cos, sin = ctx.rope_for(self.rope_dim)
        q = rope_kv_write(qkv, cos, sin, state.k, state.v, ctx.pos, self.nh, **self._norms())
        return decode_attention(q, state.k, state.v, ctx.pos)


def cached_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor, nkv: int) -> torch.Tensor:
    """q (T, nh, hd) against the whole cache kc/vc (C, nkv, hd) under mask (T, C) -> (T, nh*hd).

    GQA without materialising repeated K/V: the `rep` query heads sharing a KV head become
    extra query rows of that head (head h = kv * rep + r, HF's layout). Two batched GEMMs in
    the cache dtype and an fp32 softmax: a decode/verify step reads each K/V row once, where
    SDPA's math fallback (taken for a boolean mask over a strided cache) upcast the whole
    cache to fp32 every step (measured: ~3 of 9.4 ms of an 8B bf16 decode step on an H200)."""
    T, nh, hd = q.shape
    rep = nh // nkv
    qg = q.view(T, nkv, rep, hd).permute(1, 2, 0, 3).reshape(nkv, rep * T, hd)  # (nkv, rep*T, hd)
    kh, vh = kc.transpose(0, 1), vc.transpose(0, 1)  # (nkv, C, hd) strided views, no copy
    scores = torch.matmul(qg, kh.transpose(1, 2)).float() * (hd ** -0.5)  # (nkv, rep*T, C)
    C = kc.shape[0]  # the mask broadcasts over the rep query heads of a KV head (no repeated copy)
    scores = scores.view(nkv, rep, T, C).masked_fill(~mask, float("-inf")).view(nkv, rep * T, C)
    p = torch.softmax(scores, dim=-1).to(vc.dtype)
    o = torch.matmul(p, vh)  # (nkv, rep*T, hd)
    return o.view(nkv, rep, T, hd).permute(2, 0, 1, 3).reshape(T, nh * hd)
