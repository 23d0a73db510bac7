"""The deepseek_v3 and glm4_moe families: per-layer mixer and FFN factories.

  deepseek_v3  mixer: MLA (model/mla.py) with RoPE on the decoupled query / key part
               (`RopeMLA`); DeepSeek stores those dims as interleaved pairs (x0, x1), (x2, x3)
               ... when `rope_interleave` is set, so they are de-interleaved (evens, then
               odds) before the rotate-half rotation: the same dot products, since query and
               key get the same permutation.
  glm4_moe     mixer: grouped-query Attention (model/attention.py) whose first `rotary_dim`
               head dims rotate (partial rotary); optional q/k norms and q/k/v bias come
               through the ModelConfig.
  both         FFN: a dense SwiGLU for the first `first_k_dense_replace` layers, else the
               sigmoid-routed MoE of model/moe.py (shared experts, correction bias,
               group-limited top-k, routed scaling); MTP layers (idx >= num_layers) are MoE.
transformer.py registers these factories; the loader reads the per-expert checkpoint layout
through model/moe_names.py.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .config import ModelConfig
from .layers import SwiGLU, apply_rope
from .mla import MLA
from .moe import MoE
from .moe_config import MoESpec
from .rope_scaling import softmax_scale_factor

__all__ = ["RopeMLA", "moe_mixer", "moe_ffn", "deinterleave"]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., d) interleaved pairs -> (..., d) evens then odds (rotate-half layout)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class RopeMLA(MLA):
    """DeepSeek-V3's MLA: Kimi's MLA with the decoupled part rotated at the rows' positions
    before the latents are cached (so cached keys carry their own positions)."""

    def __init__(self, cfg: ModelConfig, spec: MoESpec):
        super().__init__(cfg, spec)
        self.rope_dim = spec.qk_rope_dim
        self.interleave = spec.rope_interleave
        self.scale = self.scale * softmax_scale_factor(cfg.rope)  # YaRN: mscale(factor, mscale_all_dim)^2

    def _rotate(self, q: torch.Tensor, k_shared: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, nh, dn + dr), k_shared (T, dr) -> the same with the dr part rotated."""
        cos, sin = ctx.rope_for(self.dr)
        q_nope, q_rot = q.split([self.dn, self.dr], dim=-1)
        if self.interleave:
            q_rot, k_shared = deinterleave(q_rot), deinterleave(k_shared)
        q_rot = apply_rope(q_rot, cos, sin)  # (T, nh, dr)
        k_shared = apply_rope(k_shared[:, None, :], cos, sin)[:, 0]  # (T, dr)
        return torch.cat((q_nope, q_rot), dim=-1), k_shared


def moe_mixer(cfg: ModelConfig, idx: int) -> nn.Module:
    spec: MoESpec = cfg.family
    if spec.mla:
        return RopeMLA(cfg, spec)
    attn = Attention(cfg)
    attn.rope_dim = spec.rotary_dim  # partial rotary: the leading rotary_dim dims of each head
    return attn


def moe_ffn(cfg: ModelConfig, idx: int) -> nn.Module:
    spec: MoESpec = cfg.family
    if spec.is_moe(idx, cfg.num_layers):
        return MoE(cfg, spec)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size)
