"""A decoder over a contiguous layer range: the unit a pipeline stage (or the whole model) holds.

The model knows nothing of parallelism (the torchtitan habit): a `Stage` owns layers
[first, last) and, optionally, the embedding (`has_embed`) and the head (final norm +
lm_head, `has_head`). One process holding the whole model is the Stage (0, L, True, True).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..cache import StageCache
from .attention import Attention, causal_mask
from .config import ModelConfig
from .prefix_attention import PREFIX_MIN_ROWS
from .kimi import kimi_ffn, kimi_mixer
from .layers import RMSNorm, SwiGLU, rope_inv_freq, rope_rows, rope_scale, rows_on
from .moe_families import moe_ffn, moe_mixer
from .taps import FINAL

__all__ = ["Block", "Stage", "StepCtx", "register_family"]


@dataclass
class StepCtx:
    """What every layer of one forward shares: positions, the mask, rotary rows, a timer."""

    pos: torch.Tensor  # (T,) absolute positions
    mask: torch.Tensor | None  # (T, C) bool over cache slots; None = plain causal, no cache
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # dim -> (T, dim)
    timer: object | None = None  # level-2 sub-split timer (phase/subsplit.py), None = off
    # a prefill chunk's first position: the rows are [prefix, prefix + T), attention reads cache
    # rows [0, prefix + T) causal to the bottom right (model/prefix_attention.py) and no mask is
    # built (it would be T x capacity); None: decode / verify rows under `mask`
    prefix: int | None = None
    # several requests' rows in one forward over a paged cache (batching/paged.py BatchView):
    # each layer writes the rows at their pool slots and attends per request
    batch: object | None = None

    def rope_for(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope[dim]


# family name -> (mixer factory, ffn factory); each factory is (cfg, layer_idx) -> nn.Module
_FAMILIES: dict[str, tuple[Callable, Callable]] = {}


def register_family(name: str, mixer: Callable, ffn: Callable) -> None:
    _FAMILIES[name] = (mixer, ffn)


def _dense_ffn(cfg: ModelConfig, i: int) -> nn.Module:
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size)


for _n in ("llama", "qwen2", "qwen3"):
    register_family(_n, lambda cfg, i: Attention(cfg), _dense_ffn)
register_family("kimi_linear", kimi_mixer, kimi_ffn)
for _n in ("deepseek_v3", "glm4_moe"):
    register_family(_n, moe_mixer, moe_ffn)


def _family(arch: str) -> tuple[Callable, Callable]:
    return _FAMILIES[arch]


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        mixer, ffn = _family(cfg.arch)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = mixer(cfg, idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = ffn(cfg, idx)

    fused_rows = 0  # kernels/ops.py: steps of up to this many rows run each half with its norm and residual folded in
    batch_rows = 0  # the same for a batched step whose attention is the paged kernel's (batching/paged.py)

    def forward(self, x: torch.Tensor, ctx: StepCtx, state) -> torch.Tensor:
        tm = ctx.timer
        if ctx.batch is None:
            fused = x.shape[0] <= self.fused_rows and state is not None
        else:
            fused = x.shape[0] <= self.batch_rows and ctx.batch.paged is not None
        if tm is not None:
            tm.begin()  # level 2: drained laps, so each class gets its device share
        post, h = self.post_attention_layernorm, None
        if fused:
            x = self.self_attn.fused_step(x, ctx, state, self.input_layernorm)
        elif rows_on(post):  # the residual add and the FFN's pre-norm in one pass (kernels/rows.py)
            x, h = torch.ops.memra.add_rms_norm(x, self.self_attn(self.input_layernorm(x), ctx, state), post.weight,
                                                post.eps)
        else:
            x = x + self.self_attn(self.input_layernorm(x), ctx, state)
        if tm is not None:
            tm.lap(self.self_attn.mixer_class)
        if fused:
            x = self.mlp.fused_step(x, post)
        else:
            x = x + self.mlp(post(x) if h is None else h)
        if tm is not None:
            tm.lap("ffn")
        return x


class Stage(nn.Module):
    """Layers [first, last) plus, where owned, the embedding and the head."""

    def __init__(self, cfg: ModelConfig, first: int, last: int, has_embed: bool, has_head: bool):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        self.has_embed, self.has_head = has_embed, has_head
        if has_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(first, last)})
        if has_head:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        dims = {m.self_attn.rope_dim for m in self.layers.values() if getattr(m.self_attn, "rope_dim", None)}
        self._inv_freq = {d: rope_inv_freq(d, cfg.rope_theta, cfg.rope) for d in dims}
        self._rope_scale = rope_scale(cfg.rope)  # YaRN's attention_factor on cos / sin

    def to_device(self, device) -> "Stage":
        self._inv_freq = {d: f.to(device) for d, f in self._inv_freq.items()}
        for blk in self.layers.values():  # MoE FFNs: grouped GEMMs where torch has the kernel (bf16 CUDA)
            if hasattr(blk.mlp, "use_grouped"):
                blk.mlp.use_grouped(torch.device(device).type == "cuda"
                                    and blk.mlp.experts.gate_up_proj.dtype == torch.bfloat16)
        return self

    def new_cache(self, capacity: int, device, dtype) -> StageCache:
        cache = StageCache(capacity)
        for i, blk in self.layers.items():
            cache.layers[int(i)] = blk.self_attn.new_state(capacity, device, dtype)
        return cache

    def step_ctx(self, pos: torch.Tensor, cache: StageCache | None, timer=None, start: int | None = None) -> StepCtx:
        """`start`: the first position of contiguous rows (a host int); a forward of more
        than PREFIX_MIN_ROWS such rows over a cache is a prefill chunk (`StepCtx.prefix`)."""
        rope = {d: rope_rows(pos, f, self._rope_scale) for d, f in self._inv_freq.items()}
        if cache is not None and start is not None and pos.shape[0] > PREFIX_MIN_ROWS:
            return StepCtx(pos=pos, mask=None, rope=rope, timer=timer, prefix=start)
        mask = causal_mask(pos, cache.capacity) if cache is not None else None
        return StepCtx(pos=pos, mask=mask, rope=rope, timer=timer)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: StageCache | None, timer=None,
                start: int | None = None) -> torch.Tensor:
        """x: token ids (T,) when this stage embeds, else hidden (T, H). Returns hidden (T, H)
        (the head is separate: `logits`). With a cache the rows land at `pos`; `start` says
        they are the contiguous rows [start, start + T) (the runner's forwards)."""
        if self.has_embed:
            x = self.embed_tokens(x)  # (T, H)
        ctx = self.step_ctx(pos, cache, timer, start)
        taps = cache.taps if cache is not None else None
        if taps is not None:  # the tapped walk (model/taps.py): layer outputs written by position
            for i, blk in self.layers.items():
                x = blk(x, ctx, cache.layers[int(i)])
                if taps.wants(int(i)):
                    taps.write(int(i), pos, x)
            if self.has_head and taps.wants(FINAL):  # the hidden lm_head reads (an MTP drafter's input)
                taps.write(FINAL, pos, self.norm(x))
            return x
        for i, blk in self.layers.items():
            x = blk(x, ctx, cache.layers[int(i)] if cache is not None else None)
        return x

    fused_head = 0  # kernels/ops.py: steps of up to this many rows run the final norm inside the lm_head kernel

    def logits(self, h: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """Final norm + lm_head; fp32 logits (T, V). `norm` replaces the stage's own final norm
        (a drafter whose network ends in its own norm and reads the target's lm_head)."""
        n = self.norm if norm is None else norm
        if h.shape[0] <= self.fused_head:
            return torch.ops.memra.gemv(h, self.lm_head.weight, self.lm_head.bias, False, n.weight, n.eps, None).float()
        return self.lm_head(n(h)).float()
