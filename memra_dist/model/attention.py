"""Grouped-query attention (llama / qwen2 / qwen3) over a preallocated KV cache."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..cache import KVLayer
from .config import ModelConfig
from .layers import RMSNorm, apply_rope

__all__ = ["Attention", "causal_mask"]


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

    def forward(self, x: torch.Tensor, ctx, state: KVLayer | None) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). ctx: StepCtx (positions, mask over cache slots, rotary
        rows); without a state (no cache) plain causal attention over x."""
        T, pos, mask = x.shape[0], ctx.pos, ctx.mask
        rope = ctx.rope_for(self.hd)
        q = self.q_proj(x).view(T, self.nh, self.hd)  # (T, nh, hd)
        k = self.k_proj(x).view(T, self.nkv, self.hd)  # (T, nkv, hd)
        v = self.v_proj(x).view(T, self.nkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if state is not None:
            state.k.index_copy_(0, pos, k)
            state.v.index_copy_(0, pos, v)
            k, v = state.k, state.v  # (C, nkv, hd)
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, rows, hd)
        if self.nkv != self.nh:
            rep = self.nh // self.nkv
            kh, vh = kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0)  # (nh, C, hd)
        if mask is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return self.o_proj(o.transpose(0, 1).reshape(T, self.nh * self.hd))  # (T, hidden)
