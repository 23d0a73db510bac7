"""The DFlash block drafter's network and its checkpoint (the public format).

Checkpoint: a Qwen3-style config.json with `architectures: ["DFlashDraftModel"]`,
`block_size`, `num_target_layers`, `dflash_config: {target_layer_ids, mask_token_id}`;
tensors without a `model.` prefix: `fc` [H, n_taps * H], `hidden_norm`, `norm`,
`layers.{i}.self_attn.{q,k,v,o}_proj`, `.q_norm`, `.k_norm`, `layers.{i}.{input_layernorm,
post_attention_layernorm}`, `layers.{i}.mlp.{gate,up,down}_proj`. No embedding, no lm_head:
the target's are reused.

Forward (one block of B rows starting at position `start`):
  C = hidden_norm(fc(concat_t tap_t))            one row per committed context row
  x = E_target([b, m, ..., m])                   b = last committed token, m = mask id
  per layer:  hn = input_layernorm(x)
              Q = rope(q_norm(Wq hn), start .. start + B - 1)
              K = rope(k_norm(Wk [C ; hn]), ctx positions ++ block positions),  V = Wv [C ; hn]
              x += o_proj(attention(Q, K, V))    NO mask: every row sees C and the whole block
              x += mlp(post_attention_layernorm(x))
  logits = lm_head_target(norm(x)); row i predicts the token AT start + i (no shift).
input_layernorm is not applied to C; C is the same for every layer (each layer projects it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import UserError
from .attention import cached_attention
from .config import ModelConfig, parse_config, read_config_json
from .kimi_config import as_int, size_field
from .layers import RMSNorm, SwiGLU, apply_rope, rope_inv_freq, rope_rows, rope_scale

__all__ = ["DFlashConfig", "DFlashNet", "parse_dflash_config", "load_dflash_config", "check_dflash",
           "load_dflash", "default_tap_ids", "ARCH"]

ARCH = "DFlashDraftModel"


@dataclass(frozen=True)
class DFlashConfig:
    base: ModelConfig  # the Qwen3-style layer shapes (hidden, heads, head_dim, rope, eps, vocab)
    block_size: int  # B: the block is [b, mask x (B - 1)]; one forward drafts B - 1 tokens
    tap_ids: tuple[int, ...]  # target layers whose OUTPUT feeds fc, in fc's input order
    mask_token_id: int
    num_target_layers: int
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def hidden_size(self) -> int:
        return self.base.hidden_size

    @property
    def num_layers(self) -> int:
        return self.base.num_layers


def default_tap_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The references' default when a config names no taps: spread from layer 1 to L - 3
    (one per draft layer; a single draft layer taps the middle).

    >>> default_tap_ids(36, 5)
    (1, 9, 17, 25, 33)
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, num_target_layers - 3
    return tuple(int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def parse_dflash_config(d: dict, where: str = "draft model") -> DFlashConfig:
    """A DFlash config.json dict -> DFlashConfig; every problem is one UserError line."""
    if not isinstance(d, dict):
        raise UserError(f"{where}: config.json is not a JSON object")
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or ARCH not in archs:
        raise UserError(f"{where}: not a DFlash checkpoint (config.json architectures must include '{ARCH}')")
    base = parse_config({**d, "model_type": "qwen3"}, where)  # Qwen3-style layers: q/k norms
    dc = d.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise UserError(f"{where}: config.json dflash_config must be an object")
    block = size_field(d, where, "block_size", hi=1024)
    if block < 2:
        raise UserError(f"{where}: config.json block_size = {block}: a block needs at least 2 rows")
    n_target = size_field(d, where, "num_target_layers", hi=1 << 12, default=0) if "num_target_layers" in d else 0
    taps = dc.get("target_layer_ids")
    if taps is None:
        if not n_target:
            raise UserError(f"{where}: config.json names neither dflash_config.target_layer_ids nor num_target_layers")
        tap_ids = default_tap_ids(n_target, base.num_layers)
    else:
        if not isinstance(taps, list) or not taps:
            raise UserError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of layer indices")
        tap_ids = tuple(as_int(t, "dflash_config.target_layer_ids", where) for t in taps)
        if len(set(tap_ids)) != len(tap_ids) or min(tap_ids) < 0:
            raise UserError(f"{where}: dflash_config.target_layer_ids {list(tap_ids)}: distinct indices >= 0 expected")
    mask = dc.get("mask_token_id", d.get("mask_token_id"))
    if mask is None:
        raise UserError(f"{where}: config.json has no dflash_config.mask_token_id")
    return DFlashConfig(base, block, tap_ids, as_int(mask, "mask_token_id", where), n_target, d)


def load_dflash_config(model_dir: str | Path) -> DFlashConfig:
    p = Path(model_dir)
    d = read_config_json(p, "draft model", "a DFlash checkpoint")
    return parse_dflash_config(d, str(p))


def check_dflash(target: ModelConfig, dc: DFlashConfig, where: str = "draft model") -> None:
    """Refuse a drafter that cannot read this target: taps past its layers, another hidden
    size or vocabulary, a mask id outside the vocabulary."""
    bad = [t for t in dc.tap_ids if t >= target.num_layers]
    if bad:
        raise UserError(f"{where}: DFlash taps {list(dc.tap_ids)} exceed the target's {target.num_layers} layers "
                        f"(layers 0..{target.num_layers - 1})")
    if dc.hidden_size != target.hidden_size:
        raise UserError(f"{where}: DFlash hidden size {dc.hidden_size} differs from the target's {target.hidden_size}")
    if dc.base.vocab_size != target.vocab_size:
        raise UserError(f"{where}: DFlash vocabulary ({dc.base.vocab_size} tokens) differs from the target's "
                        f"({target.vocab_size})")
    if not 0 <= dc.mask_token_id < target.vocab_size:
        raise UserError(f"{where}: DFlash mask_token_id {dc.mask_token_id} is outside the target's vocabulary "
                        f"(0..{target.vocab_size - 1})")


class DFlashAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        nh, nkv, hd, h = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=c.qkv_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=c.qkv_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=c.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=c.o_bias)
        self.q_norm = RMSNorm(hd, c.rms_eps)
        self.k_norm = RMSNorm(hd, c.rms_eps)

    def fuse(self) -> None:
        """One [q; k; v] weight (the fast path): a block's rows take one GEMM for all three,
        the context rows' k / v one GEMM over its contiguous [k; v] rows. The reference (and
        training, and the checkpoint's names) keep q/k/v_proj."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        with torch.no_grad():
            self.qkv_w = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
            self.qkv_b = (nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
                          if parts[0].bias is not None else None)
        del self.q_proj, self.k_proj, self.v_proj

    def _split(self, y: torch.Tensor, rope, with_q: bool):
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        parts = y.split([nq, nk, nk] if with_q else [nk, nk], -1)
        k = apply_rope(self.k_norm(parts[-2].reshape(-1, self.nkv, self.hd)), *rope)
        v = parts[-1].reshape(-1, self.nkv, self.hd)
        if not with_q:
            return k, v
        return apply_rope(self.q_norm(parts[0].reshape(-1, self.nh, self.hd)), *rope), k, v

    def q(self, hn: torch.Tensor, rope) -> torch.Tensor:
        """(T, H) -> (T, nh, hd): q_norm then rotary at the rows' positions."""
        return apply_rope(self.q_norm(self.q_proj(hn).view(-1, self.nh, self.hd)), *rope)

    def kv(self, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> k, v (T, nkv, hd): k_norm then rotary at the rows' positions."""
        if hasattr(self, "qkv_w"):
            nq = self.nh * self.hd
            b = self.qkv_b[nq:] if self.qkv_b is not None else None
            return self._split(F.linear(h, self.qkv_w[nq:], b), rope, False)
        k = apply_rope(self.k_norm(self.k_proj(h).view(-1, self.nkv, self.hd)), *rope)
        return k, self.v_proj(h).view(-1, self.nkv, self.hd)

    def qkv(self, hn: torch.Tensor, rope):
        """(T, H) -> q (T, nh, hd), k, v (T, nkv, hd): a block's rows (one GEMM when fused)."""
        if hasattr(self, "qkv_w"):
            return self._split(F.linear(hn, self.qkv_w, self.qkv_b), rope, True)
        return (self.q(hn, rope), *self.kv(hn, rope))

    def qkv_folded(self, x: torch.Tensor, norm: RMSNorm, rope):
        """qkv(norm(x), rope) with the norm inside the fused GEMM (our kernels: kernels/ops.py)."""
        return self._split(torch.ops.memra.gemv(x, self.qkv_w, self.qkv_b, False, norm.weight, norm.eps, None),
                           rope, True)


class DFlashLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))

    def finish_folded(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """finish(x, o) in three of our kernels: o_proj with the residual add, then the SwiGLU
        half as the target's (`SwiGLU.fused_step`: the post-norm in gate-up, the residual in down)."""
        op = self.self_attn.o_proj
        x = torch.ops.memra.gemv(o, op.weight, op.bias, False, None, 0.0, x)
        return self.mlp.fused_step(x, self.post_attention_layernorm)


class DFlashNet(nn.Module):
    """The draft network. Module names are the checkpoint's tensor names."""

    def __init__(self, dc: DFlashConfig):
        super().__init__()
        c = dc.base
        self.dc = dc
        self.fc = nn.Linear(len(dc.tap_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope)
        self.rope_scale = rope_scale(c.rope)  # YaRN's cos / sin factor (1.0 otherwise)

    def rope(self, pos: torch.Tensor):
        return rope_rows(pos, self.inv_freq.to(pos.device), self.rope_scale)

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        """Taps (T, n_taps * H) -> context rows C (T, H)."""
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, C: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k, v) of the context rows C at positions pos (no input_layernorm)."""
        rope = self.rope(pos)
        return [layer.self_attn.kv(C, rope) for layer in self.layers]

    def fuse(self) -> None:
        """The fast path's fused GEMMs: [q; k; v] and [gate; up] per layer (CUDA graphs)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def block(self, x: torch.Tensor, pos: torch.Tensor, kv_of, mask: torch.Tensor, attend=None,
              folded: bool = False, keep: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Block rows x (T, H) at positions pos -> normed hidden (T, H). `kv_of(i, kb, vb)`
        returns layer i's full keys / values (N, nkv, hd) given the block's own; `mask`
        (T, N) says which of those N each row reads. `attend(q, K, V)`, when given, replaces
        the reference attention under `mask` (the graphs' split kernel, which reads only the
        live rows: it must mean the same mask). `folded` (the graphs, where the target runs our
        kernels; the net fused, T <= 16): every norm and residual add inside the GEMMs, and the
        hidden returned BEFORE the final norm (the caller's lm_head kernel applies `self.norm`).
        `keep` (B, lo, hi): x holds blocks of B rows and only rows lo .. hi - 1 of each are wanted
        (the drafted ones): the last layer still writes every row's K/V (the kept rows read the
        whole block), but its attention, o_proj and FFN run on the kept rows only, and the
        result is (T / B * (hi - lo), H). Each kept row's math is the whole block's. A 16-row
        block drafting 4 skips 3/4 of its last layer's o_proj and FFN (~12 % of a five-layer
        block forward's FLOPs; on an H100 at 64 requests the draft's time moved inside the runs'
        spread: BENCHMARKS.md)."""
        rope = self.rope(pos)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            at = layer.self_attn
            if folded:
                q, kb, vb = at.qkv_folded(x, layer.input_layernorm, rope)
            else:
                q, kb, vb = at.qkv(layer.input_layernorm(x), rope)  # (T, nh, hd), (T, nkv, hd) x 2
            K, V = kv_of(i, kb, vb)
            if keep is not None and i == last:
                q, x = _kept(q, keep), _kept(x, keep)
                mask = _kept(mask, keep) if mask is not None and mask.shape[0] > 1 else mask
            o = attend(q, K, V) if attend is not None else cached_attention(q, K, V, mask, at.nkv)
            x = layer.finish_folded(x, o) if folded else layer.finish(x, o)
        return x if folded else self.norm(x)


def _kept(t: torch.Tensor, keep: tuple[int, int, int]) -> torch.Tensor:
    """Rows lo .. hi - 1 of each block of B rows of t (T, ...) -> (T / B * (hi - lo), ...)."""
    B, lo, hi = keep
    return t.view(-1, B, *t.shape[1:])[:, lo:hi].reshape(-1, *t.shape[1:])


def load_dflash(model_dir: str | Path, dc: DFlashConfig, device, dtype) -> DFlashNet:
    """Build the network and load exactly its tensors (shapes checked, one line on a mismatch)."""
    from .loader import CheckpointReader  # noqa: PLC0415

    with torch.device("meta"):
        net = DFlashNet(dc)
    reader = CheckpointReader(model_dir)
    state = {}
    for key, meta in net.state_dict().items():
        t = reader.get(key)
        if tuple(t.shape) != tuple(meta.shape):
            raise UserError(f"{model_dir}: tensor {key} has shape {tuple(t.shape)}, expected {tuple(meta.shape)}")
        state[key] = t.to(device=device, dtype=dtype)
    net.load_state_dict(state, assign=True, strict=True)
    net.inv_freq = rope_inv_freq(dc.base.head_dim, dc.base.rope_theta, dc.base.rope).to(device)
    return net.eval()
