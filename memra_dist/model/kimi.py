"""The kimi_linear family: KDA or MLA mixer per layer, dense SwiGLU or MoE FFN per layer.

transformer.py maps the family to these two factories; the loader reads its original-layout
checkpoint names through kimi_names.py. This module imports neither (no import cycle). The
per-layer choices come from `KimiSpec` (kimi_config.py): `layer_types` (or linear_attn_config
kda_layers / full_attn_layers) and `mlp_layer_types` (or first_k_dense_replace).
"""

from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .kda import KDA
from .kimi_config import DENSE, FULL, KimiSpec
from .layers import SwiGLU
from .mla import MLA
from .moe import MoE

__all__ = ["kimi_mixer", "kimi_ffn"]


def kimi_mixer(cfg: ModelConfig, idx: int) -> nn.Module:
    spec = KimiSpec.from_config(cfg)
    return MLA(cfg, spec) if spec.layer_types[idx] == FULL else KDA(cfg, spec)


def kimi_ffn(cfg: ModelConfig, idx: int) -> nn.Module:
    spec = KimiSpec.from_config(cfg)
    if spec.mlp_types[idx] == DENSE:
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size)
    return MoE(cfg, spec)

