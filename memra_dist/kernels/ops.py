"""The kernels as torch custom ops (opaque to torch.compile, capturable in CUDA graphs), the
one-row linear that uses them, and the switch that installs them on a stage."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .decode_attention import decode_attention
from .gemv import gemv

__all__ = ["FastLinear", "install_stage", "MAX_ATTN_ROWS"]

MAX_ATTN_ROWS = 64  # decode / verify rows; a prefill keeps the reference attention


@torch.library.custom_op("memra::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
            norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    return gemv(x, w, bias, silu_mul, norm, eps, residual)


@gemv_op.register_fake
def _(x, w, bias, silu_mul, norm=None, eps=0.0, residual=None):
    return x.new_empty((1, w.shape[0]))


@torch.library.custom_op("memra::decode_attention", mutates_args=())
def attention_op(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return decode_attention(q, kc, vc, pos)


@attention_op.register_fake
def _(q, kc, vc, pos):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


class FastLinear(nn.Linear):
    """nn.Linear whose one-row calls stream the weight through the Triton GEMV (verify rows
    stay on cuBLAS: kernels/gemv.py says why)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1:
            return gemv_op(x, self.weight, self.bias, False)
        return F.linear(x, self.weight, self.bias)


def _fast(lin: nn.Module) -> int:
    if type(lin) is nn.Linear:
        lin.__class__ = FastLinear  # same parameters, new forward
        return 1
    return 0


def install_stage(stage) -> int:
    """Llama-family blocks (GQA attention, SwiGLU) and the head switch to the kernels; other
    mixers and FFNs (MLA, KDA, MoE) keep theirs. Call after the QKV / gate-up fusion."""
    from ..model.attention import Attention  # noqa: PLC0415
    from ..model.layers import SwiGLU  # noqa: PLC0415

    stage.requires_grad_(False)  # an inference stage: compile traces no backward (the ops define none)
    n = 0
    for blk in stage.layers.values():
        attn, mlp = blk.self_attn, blk.mlp
        fast_attn = type(attn) is Attention and attn.hd >= 16 and attn.hd & (attn.hd - 1) == 0
        fast_mlp = type(mlp) is SwiGLU and hasattr(mlp, "gate_up_proj")
        if fast_attn:
            attn.fast_attn_rows = MAX_ATTN_ROWS
            for name in ("_fast", "fused_step"):  # they write the cache: torch.compile breaks around them
                setattr(attn, name, torch.compiler.disable(getattr(attn, name)))
            n += 1 + sum(_fast(m) for m in attn.children())
        if fast_mlp:
            mlp.fast_rows = 1
            n += 1 + _fast(mlp.gate_up_proj)
        if fast_attn and fast_mlp and attn.rope_kernel_ok():
            blk.fused_rows = 1  # a decode row: norms and residual adds inside the GEMVs (model/transformer.py Block)
    if getattr(stage, "has_head", False):
        n += _fast(stage.lm_head)
        stage.fused_head = True
    return n
