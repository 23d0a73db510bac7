"""Kimi's multi-head latent attention (MLA, DeepSeek-V2 shape) with NoPE.

Per row the cache holds the normalised KV latent (kv_lora_rank) and the shared key part
(qk_rope_dim; named "rope" after DeepSeek but never rotated in Kimi Linear: no rotary tables,
so no `rope_dim`). Keys/values per head are `kv_b_proj(latent)` split into (k_nope, v);
k = [k_nope, k_shared]. Two equal-math arms over the cache:
  * expanded: materialise K/V for every cache slot, then SDPA (cheap when many rows query);
  * absorbed: fold kv_b_proj into the query / output side, attend over latents directly
    (cost independent of the per-head K/V width; the decode / verify arm).
Parameter names mirror transformers' KimiLinearAttention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .config import ModelConfig
from .kimi_config import KimiSpec
from .layers import RMSNorm
from .prefix_attention import prefix_attention

__all__ = ["MLA", "MLALayer", "ABSORB_MAX_ROWS"]

ABSORB_MAX_ROWS = 32  # cached forwards of at most this many rows take the absorbed arm
_LATENT_EPS = 1e-6  # the reference builds kv_a_layernorm / q_a_layernorm with the default eps


@dataclass
class MLALayer:
    """Compressed rows of one MLA layer: latent (C, kv_lora_rank), k_shared (C, qk_rope_dim).
    Zero-filled; rolls back by length alone (the position mask hides rows past it)."""

    latent: torch.Tensor
    k_shared: torch.Tensor

    @classmethod
    def alloc(cls, capacity: int, rank: int, shared: int, device, dtype) -> "MLALayer":
        z = lambda d: torch.zeros(capacity, d, device=device, dtype=dtype)  # noqa: E731
        return cls(z(rank), z(shared))

    def begin(self, start: int, rows: int) -> None:
        pass

    def rollback(self, new_len: int) -> None:
        pass

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.latent, self.k_shared))


class MLA(nn.Module):
    mixer_class = "mla"
    graph_safe = True  # latents written at the positions tensor, the mask spans the capacity

    def __init__(self, cfg: ModelConfig, spec: KimiSpec):
        super().__init__()
        h, nh, bias = cfg.hidden_size, cfg.num_heads, spec.attention_bias
        self.nh, self.dn, self.dr, self.dv = nh, spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim
        self.rank = spec.kv_lora_rank
        qk = self.dn + self.dr
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, _LATENT_EPS)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, nh * qk, bias=False)
        self.q_lora = spec.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_EPS)
        self.kv_b_proj = nn.Linear(self.rank, nh * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(nh * self.dv, h, bias=bias)
        self.scale = qk ** -0.5

    def new_state(self, capacity: int, device, dtype) -> MLALayer:
        return MLALayer.alloc(capacity, self.rank, self.dr, device, dtype)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        return q.view(x.shape[0], self.nh, self.dn + self.dr)  # (T, nh, dn + dr)

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.kv_a_proj_with_mqa(x)  # (T, rank + dr)
        latent, k_shared = c.split([self.rank, self.dr], dim=-1)
        return self.kv_a_layernorm(latent), k_shared  # (T, rank), (T, dr)

    def forward(self, x: torch.Tensor, ctx, state: MLALayer | None) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). Without a state: plain causal attention over x."""
        T = x.shape[0]
        q = self._query(x)
        latent, k_shared = self._latents(x)
        q, k_shared = self._rotate(q, k_shared, ctx)
        if getattr(ctx, "batch", None) is not None:  # several requests' rows over a paged cache
            return self.o_proj(self._batched(q, latent, k_shared, ctx.batch, state).reshape(T, self.nh * self.dv))
        if state is not None:
            state.latent.index_copy_(0, ctx.pos, latent)
            state.k_shared.index_copy_(0, ctx.pos, k_shared)
            latent, k_shared = state.latent, state.k_shared  # (C, rank), (C, dr)
        if state is not None and ctx.prefix is not None:  # a prefill chunk over the rows before it
            S = ctx.prefix + T
            o = self._prefix(q, latent[:S], k_shared[:S], ctx.prefix)
        elif state is not None and T <= ABSORB_MAX_ROWS:
            o = self._absorbed(q, latent, k_shared, ctx.mask)
        else:
            o = self._expanded(q, latent, k_shared, ctx.mask)
        return self.o_proj(o.reshape(T, self.nh * self.dv))  # (T, hidden)

    def _batched(self, q, latent, k_shared, view, state) -> torch.Tensor:
        """Rows of several requests (batching/paged.py `BatchView`; `state` a PagedLatent): the
        latents written at the rows' pool slots, then each request's rows over its own latents,
        gathered in position order, on the arm its rows take alone: the prefix attention for a
        prefill chunk, else the absorbed / expanded attention over a buffer of its capacity, zero
        and masked past its rows (as its own cache). Returns (T, nh, dv)."""
        state.latent.index_copy_(0, view.slots, latent)
        state.k_shared.index_copy_(0, view.slots, k_shared)
        outs = []
        for seg in view.segments:
            qs = q[seg.lo:seg.hi]
            if seg.prefix is not None:
                lat, ks = state.latent.index_select(0, seg.keys), state.k_shared.index_select(0, seg.keys)
                outs.append(self._prefix(qs, lat, ks, seg.prefix))
                continue
            arm = self._absorbed if seg.rows <= ABSORB_MAX_ROWS else self._expanded
            outs.append(arm(qs, seg.own_cache(state.latent), seg.own_cache(state.k_shared), seg.mask))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _rotate(self, q: torch.Tensor, k_shared: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Positional rotation of the decoupled query / key part: none here (NoPE);
        deepseek_v3's RopeMLA (model/moe_families.py) rotates it."""
        return q, k_shared

    def _expanded(self, q, latent, k_shared, mask) -> torch.Tensor:
        """Per-head K/V for every slot, then SDPA. Returns (T, nh, dv)."""
        S = latent.shape[0]
        kv = self.kv_b_proj(latent).view(S, self.nh, self.dn + self.dv)  # (S, nh, dn + dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_shared[:, None, :].expand(S, self.nh, self.dr)], dim=-1)  # (S, nh, dn + dr)
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (nh, rows, d)
        if mask is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1)  # (T, nh, dv)

    def _prefix(self, q, latent, k_shared, start: int) -> torch.Tensor:
        """A prefill chunk: per-head K/V of the S = start + T live rows only (not the whole
        cache), then bottom-right causal attention that never holds the (T, S) scores of all
        heads at once (model/prefix_attention.py). Returns (T, nh, dv)."""
        S = latent.shape[0]
        kv = self.kv_b_proj(latent).view(S, self.nh, self.dn + self.dv)  # (S, nh, dn + dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_shared[:, None, :].expand(S, self.nh, self.dr)], dim=-1)  # (S, nh, dn + dr)
        return prefix_attention(q, k, v, start, self.scale)

    def _absorbed(self, q, latent, k_shared, mask) -> torch.Tensor:
        """scores = (q_nope W_uk) . latent + q_shared . k_shared; out = (P latent) W_uv.
        Returns (T, nh, dv)."""
        w = self.kv_b_proj.weight.view(self.nh, self.dn + self.dv, self.rank)  # (nh, dn + dv, rank)
        w_uk, w_uv = w.split([self.dn, self.dv], dim=1)  # (nh, dn, rank), (nh, dv, rank)
        q_nope, q_shared = q.split([self.dn, self.dr], dim=-1)  # (T, nh, dn), (T, nh, dr)
        q_lat = torch.einsum("thd,hdr->htr", q_nope, w_uk)  # (nh, T, rank)
        scores = q_lat @ latent.T + torch.einsum("thd,sd->hts", q_shared, k_shared)  # (nh, T, S)
        scores = (scores * self.scale).masked_fill(~mask, float("-inf"))
        p = scores.float().softmax(-1).to(latent.dtype)  # (nh, T, S)
        o_lat = p @ latent  # (nh, T, rank)
        return torch.einsum("htr,hvr->thv", o_lat, w_uv)  # (T, nh, dv)
