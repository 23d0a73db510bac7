"""The EAGLE-3 drafter's network and its checkpoint (the public format: EAGLE, SpecForge, SGLang, vLLM).

Checkpoint: a Llama-style config.json whose `architectures` names an EAGLE-3 class
(`LlamaForCausalLMEagle3`, `Eagle3LlamaForCausalLM`, ...), `vocab_size` (the target's),
`draft_vocab_size`, optionally `target_hidden_size`, `norm_before_residual` and the taps.
Tensors (names with or without a `model.` prefix; `layers.0.` accepted for `midlayer.`):
  fc [H, n_taps * H_target]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm};
  midlayer.self_attn.{q,k,v}_proj [*, 2H] (input [emb ; hidden]), o_proj; midlayer.mlp.*; norm;
  lm_head [draft_vocab, H]; d2t [draft_vocab] (target id = draft id + d2t[draft id]); t2d [V]
  (unused at inference); embed_tokens [V, H] optional (absent: the target's is reused).

Taps. A tap id t here is the OUTPUT of target layer t (model/taps.py), i.e. the residual
stream entering layer t + 1, which is what the references capture ("aux hidden states",
taken before the layer). Where the ids come from:
  eagle_config.eagle_aux_hidden_state_layer_ids   layer OUTPUT ids (SGLang / SpecForge; SGLang
                                                  captures them at the input of id + 1)
  eagle_aux_hidden_state_layer_ids (top level)    layer INPUT ids (vLLM): tap = id - 1
  neither                                         inputs of layers (2, L // 2, L - 3): taps
                                                  (1, L // 2 - 1, L - 4) (both references)

One step over rows (token e at position p, hidden g):
  x = [input_layernorm(E(e)) ; hidden_norm(g)]                 (T, 2H)
  r = g   (hidden_norm(g) with norm_before_residual)
  h = r + o_proj(attention(rope(Wq x), rope(Wk x), Wv x))       causal over the drafter's own KV
  h = h + mlp(post_attention_layernorm(h))                      h: the pre-norm output, fed back
  logits = lm_head(norm(h)) over the draft vocabulary; draft id i is target id i + d2t[i]
On the first step g = fc(concat of the taps) (no norm on fc's output); later steps feed back h.
The drafter (specdec/drafters/eagle3.py) decides which rows run and with which inputs.
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

__all__ = ["Eagle3Config", "Eagle3Net", "parse_eagle3_config", "load_eagle3_config", "check_eagle3",
           "load_eagle3", "default_eagle3_taps", "check_d2t"]

OUTPUT_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"
INPUT_IDS = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class Eagle3Config:
    base: ModelConfig  # the Llama-style layer shapes; base.vocab_size is the TARGET vocabulary
    tap_ids: tuple[int, ...]  # target layers whose OUTPUT feeds fc, in fc's input order
    draft_vocab_size: int
    target_hidden_size: int  # fc's input is n_taps * this
    norm_before_residual: bool = False
    taps_from: str = "default"  # which key named the taps (for messages)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def hidden_size(self) -> int:
        return self.base.hidden_size


def default_eagle3_taps(num_target_layers: int) -> tuple[int, ...]:
    """The references' layers when a config names none: the inputs of layers 2, L // 2 and
    L - 3, as tap (output) ids.

    >>> default_eagle3_taps(32)
    (1, 15, 28)
    """
    return tuple(i - 1 for i in (2, num_target_layers // 2, num_target_layers - 3))


def is_eagle3(d: dict) -> bool:
    """A config.json dict whose architectures name an EAGLE-3 class."""
    archs = d.get("architectures") or []
    return isinstance(archs, list) and any(isinstance(a, str) and "eagle3" in a.lower() for a in archs)


def _tap_ids(d: dict, where: str, num_target_layers: int) -> tuple[tuple[int, ...], str]:
    ec = d.get("eagle_config")
    if ec is not None and not isinstance(ec, dict):
        raise UserError(f"{where}: config.json eagle_config must be an object")
    nested, top = (ec or {}).get("eagle_aux_hidden_state_layer_ids"), d.get(INPUT_IDS)
    for ids, key, shift in ((nested, OUTPUT_IDS, 0), (top, INPUT_IDS, 1)):
        if ids is None:
            continue
        if not isinstance(ids, list) or not ids:
            raise UserError(f"{where}: config.json {key} must be a non-empty list of layer indices")
        return tuple(as_int(t, key, where) - shift for t in ids), key
    taps = default_eagle3_taps(num_target_layers)
    if len(set(taps)) != len(taps) or min(taps) < 0:
        raise UserError(f"{where}: the default EAGLE-3 taps (inputs of layers 2, L/2, L-3) need a target of at "
                        f"least 7 layers; this one has {num_target_layers}: name them in {OUTPUT_IDS}")
    return taps, "default"


def parse_eagle3_config(d: dict, num_target_layers: int, where: str = "draft model") -> Eagle3Config:
    """An EAGLE-3 config.json dict -> Eagle3Config (taps resolved for a target of
    `num_target_layers` layers); every problem is one UserError line."""
    if not isinstance(d, dict):
        raise UserError(f"{where}: config.json is not a JSON object")
    if not is_eagle3(d):
        raise UserError(f"{where}: not an EAGLE-3 checkpoint (config.json architectures must name an Eagle3 "
                        f"class, e.g. 'LlamaForCausalLMEagle3')")
    base = parse_config({**d, "model_type": "llama"}, where)  # the Llama decoder layer's shapes
    tap_ids, taps_from = _tap_ids(d, where, num_target_layers)
    if len(set(tap_ids)) != len(tap_ids) or min(tap_ids) < 0:
        shown = [t + (taps_from == INPUT_IDS) for t in tap_ids]
        raise UserError(f"{where}: {taps_from} {shown}: distinct layers past the embedding expected")
    vd = size_field(d, where, "draft_vocab_size", hi=1 << 22, default=base.vocab_size)
    if vd > base.vocab_size:
        raise UserError(f"{where}: draft_vocab_size {vd} exceeds vocab_size {base.vocab_size}")
    ht = size_field(d, where, "target_hidden_size", hi=1 << 17, default=base.hidden_size)
    return Eagle3Config(base, tap_ids, vd, ht, bool(d.get("norm_before_residual", False)), taps_from, d)


def load_eagle3_config(model_dir: str | Path, target: ModelConfig) -> Eagle3Config:
    p = Path(model_dir)
    d = read_config_json(p, "draft model", "an EAGLE-3 checkpoint")
    return parse_eagle3_config(d, target.num_layers, str(p))


def check_eagle3(target: ModelConfig, ec: Eagle3Config, where: str = "draft model") -> None:
    """Refuse a drafter that cannot read this target: taps past its layers, another hidden
    size (fc's input) or vocabulary."""
    bad = [t for t in ec.tap_ids if t >= target.num_layers]
    if bad:
        raise UserError(f"{where}: EAGLE-3 taps {list(ec.tap_ids)} (layer outputs, from {ec.taps_from}) exceed the "
                        f"target's {target.num_layers} layers (layers 0..{target.num_layers - 1})")
    if ec.target_hidden_size != target.hidden_size:
        raise UserError(f"{where}: EAGLE-3 hidden size {ec.target_hidden_size} differs from the target's "
                        f"{target.hidden_size}")
    if ec.base.vocab_size != target.vocab_size:
        raise UserError(f"{where}: EAGLE-3 vocabulary ({ec.base.vocab_size} tokens) differs from the target's "
                        f"({target.vocab_size})")


def check_d2t(d2t: torch.Tensor, draft_vocab: int, vocab: int, where: str = "draft model") -> torch.Tensor:
    """The target ids of the draft vocabulary (draft id + d2t[draft id]), checked: one per
    draft id, each inside the target's vocabulary, no two equal. Pure (host tensors)."""
    if d2t.dim() != 1 or d2t.shape[0] != draft_vocab or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise UserError(f"{where}: d2t must be an integer vector of draft_vocab_size = {draft_vocab} entries "
                        f"(got {d2t.dtype} {tuple(d2t.shape)})")
    hot = torch.arange(draft_vocab, dtype=torch.long) + d2t.long()
    bad = ((hot < 0) | (hot >= vocab)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise UserError(f"{where}: d2t maps draft id {i} to target id {int(hot[i])}, outside the target's "
                        f"vocabulary (0..{vocab - 1})")
    if torch.unique(hot).numel() != draft_vocab:
        raise UserError(f"{where}: d2t maps two draft ids to the same target id")
    return hot


class Eagle3Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        nh, nkv, hd, h = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=c.qkv_bias)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=c.qkv_bias)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=c.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=c.o_bias)

    def fuse(self) -> None:
        """q, k and v as one (nh + 2 nkv) hd x 2H weight, `qkv_proj` (the folded step's one GEMV);
        k and v are row slices of it (a context row's `kv`)."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        w = torch.cat([q.weight, k.weight, v.weight])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=q.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            fused.weight.copy_(w)
            if q.bias is not None:
                fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def _proj(self, x2: torch.Tensor, lo: int) -> torch.Tensor:
        """Rows [lo:] of the fused projection (0: q, k, v; nh hd: k, v)."""
        w = self.qkv_proj.weight[lo:]
        b = self.qkv_proj.bias[lo:] if self.qkv_proj.bias is not None else None
        return F.linear(x2, w, b)

    def kv(self, x2: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 2H) -> k, v (T, nkv, hd): what a context row leaves in the cache."""
        if hasattr(self, "qkv_proj"):
            k, v = self._proj(x2, self.nh * self.hd).split(self.nkv * self.hd, dim=-1)
        else:
            k, v = self.k_proj(x2), self.v_proj(x2)
        return apply_rope(k.reshape(-1, self.nkv, self.hd), *rope), v.reshape(-1, self.nkv, self.hd)

    def qkv(self, x2: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, 2H) -> q (T, nh, hd), k, v (T, nkv, hd); rotary at the rows' positions."""
        if hasattr(self, "qkv_proj"):
            q, k, v = self._proj(x2, 0).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        else:
            q, k, v = self.q_proj(x2), self.k_proj(x2), self.v_proj(x2)
        q = apply_rope(q.reshape(-1, self.nh, self.hd), *rope)
        k = apply_rope(k.reshape(-1, self.nkv, self.hd), *rope)
        return q, k, v.reshape(-1, self.nkv, self.hd)


class Eagle3Layer(nn.Module):
    """The `midlayer`: a Llama decoder layer whose attention reads [emb ; hidden]."""

    def __init__(self, c: ModelConfig, norm_before_residual: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.norm_before_residual = norm_before_residual

    def inputs(self, emb: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input (T, 2H), residual (T, H))."""
        gn = self.hidden_norm(g)
        return torch.cat((self.input_layernorm(emb), gn), dim=-1), gn if self.norm_before_residual else g

    def finish(self, resid: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        h = resid + self.self_attn.o_proj(o)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Net(nn.Module):
    """The draft network. Module names are the checkpoint's tensor names (without `model.`);
    `embed_tokens` is set only when the checkpoint has one; `hot` holds d2t's target ids."""

    def __init__(self, ec: Eagle3Config):
        super().__init__()
        c = ec.base
        self.ec = ec
        self.fc = nn.Linear(len(ec.tap_ids) * ec.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c, ec.norm_before_residual)
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.lm_head = nn.Linear(c.hidden_size, ec.draft_vocab_size, bias=False)
        self.embed_tokens: nn.Embedding | None = None
        self.register_buffer("hot", torch.arange(ec.draft_vocab_size), persistent=False)
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope)
        self.rope_scale = rope_scale(c.rope)  # YaRN's cos / sin factor (1.0 otherwise)

    def rope(self, pos: torch.Tensor):
        return rope_rows(pos, self.inv_freq.to(pos.device), self.rope_scale)

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        """Taps (T, n_taps * H_target) -> the first step's hidden g (T, H)."""
        return self.fc(taps)

    def step(self, emb: torch.Tensor, g: torch.Tensor, pos: torch.Tensor, kv_of, mask: torch.Tensor | None,
             attend=None) -> torch.Tensor:
        """Rows (emb, g) at positions pos -> pre-norm outputs h (T, H). `kv_of(k, v)` returns
        the full keys / values (N, nkv, hd) given the rows' own; `mask` (T, N) says which
        of those N each row reads; `attend(q, K, V)` -> (T, nh * hd), when given, replaces
        the masked reference (a prime chunk's prefix attention)."""
        layer = self.midlayer
        x2, resid = layer.inputs(emb, g)
        q, k, v = layer.self_attn.qkv(x2, self.rope(pos))
        K, V = kv_of(k, v)
        o = attend(q, K, V) if attend is not None else cached_attention(q, K, V, mask, layer.self_attn.nkv)
        return layer.finish(resid, o)

    folded = False  # kernels/ops.py install_eagle3: a few rows' step and the logits on our kernels

    def step_folded(self, emb: torch.Tensor, g: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor,
                    vc: torch.Tensor, at: torch.Tensor | None = None, attend=None) -> torch.Tensor:
        """`step` for a few rows (<= 16: the round's first forward, a chained step; a batched
        round's, up to the row GEMM's rows) on our kernels (kernels/ops.py install_eagle3), the
        cache kc / vc (C, nkv, hd) written at rows `at` (default pos): both input norms in one
        kernel, the QKV GEMV (row GEMM), rotary with the K/V write, the split attention over the
        live rows (or `attend(q)` -> (T, nh * hd): a pool's paged attention), o_proj with the
        residual add folded in, the FFN's two folded GEMVs. -> pre-norm outputs (T, H)."""
        from ..kernels.decode_attention import decode_attention  # noqa: PLC0415 (Triton: only where installed)
        from ..kernels.pair_norm import pair_rmsnorm  # noqa: PLC0415
        from ..kernels.rope_kv import rope_kv_write  # noqa: PLC0415

        layer = self.midlayer
        a, n_in, n_h = layer.self_attn, layer.input_layernorm, layer.hidden_norm
        x2, gn = pair_rmsnorm(emb, g, n_in.weight, n_h.weight, n_in.eps, n_h.eps, layer.norm_before_residual)
        qkv = torch.ops.memra.gemv(x2, a.qkv_proj.weight, a.qkv_proj.bias, False, None, 0.0, None)
        q = rope_kv_write(qkv, *self.rope(pos), kc, vc, pos if at is None else at, a.nh)
        o = decode_attention(q, kc, vc, pos) if attend is None else attend(q)
        h = torch.ops.memra.gemv(o, a.o_proj.weight, a.o_proj.bias, False, None, 0.0, gn if gn is not None else g)
        return layer.mlp.fused_step(h, layer.post_attention_layernorm)

    def context_kv(self, emb: torch.Tensor, g: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows whose outputs nobody reads (the prompt's, before the last): only their k, v
        (T, nkv, hd), no attention, o_proj or MLP."""
        layer = self.midlayer
        x2, _resid = layer.inputs(emb, g)
        return layer.self_attn.kv(x2, self.rope(pos))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits (T, draft_vocab); folded: the final norm inside the lm_head's GEMV."""
        if self.folded and h.shape[0] <= 16:
            return torch.ops.memra.gemv(h, self.lm_head.weight, None, False, self.norm.weight, self.norm.eps,
                                        None).float()
        return self.lm_head(self.norm(h)).float()

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (T, Vd) -> target-vocabulary logits (T, V): -inf at every
        target id outside the draft vocabulary (probability 0 there)."""
        out = logits.new_full((logits.shape[0], self.ec.base.vocab_size), float("-inf"))
        return out.index_copy_(1, self.hot, logits)


_ALIASES = (("", ""), ("model.", ""), ("", "layers.0."), ("model.", "layers.0."))


def _tensor(reader, key: str) -> torch.Tensor | None:
    """The checkpoint tensor for module key `key`, under any of the published spellings."""
    for prefix, mid in _ALIASES:
        name = prefix + (key.replace("midlayer.", mid, 1) if mid else key)
        if reader.has(name):
            return reader.get(name)
    return None


def load_eagle3(model_dir: str | Path, ec: Eagle3Config, device, dtype) -> Eagle3Net:
    """Build the network and load exactly its tensors (shapes checked, one line on a
    mismatch), the optional embedding, and d2t (checked against the vocabularies)."""
    from .loader import CheckpointReader  # noqa: PLC0415

    with torch.device("meta"):
        net = Eagle3Net(ec)
    reader = CheckpointReader(model_dir)
    state = {}
    for key, meta in net.state_dict().items():
        t = _tensor(reader, key)
        if t is None:
            raise UserError(f"{model_dir}: tensor missing from the EAGLE-3 checkpoint: {key}")
        if tuple(t.shape) != tuple(meta.shape):
            raise UserError(f"{model_dir}: tensor {key} has shape {tuple(t.shape)}, expected {tuple(meta.shape)}")
        state[key] = t.to(device=device, dtype=dtype)
    net.load_state_dict(state, assign=True, strict=True)
    c, vd = ec.base, ec.draft_vocab_size
    d2t = _tensor(reader, "d2t")
    if d2t is None and vd != c.vocab_size:
        raise UserError(f"{model_dir}: no d2t map, and the draft vocabulary ({vd}) is not the target's "
                        f"({c.vocab_size})")
    net.hot = (torch.arange(vd) if d2t is None else check_d2t(d2t, vd, c.vocab_size, str(model_dir))).to(device)
    emb = _tensor(reader, "embed_tokens.weight")
    if emb is not None:
        if tuple(emb.shape) != (c.vocab_size, c.hidden_size):
            raise UserError(f"{model_dir}: tensor embed_tokens.weight has shape {tuple(emb.shape)}, expected "
                            f"{(c.vocab_size, c.hidden_size)}")
        net.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, device=device, dtype=dtype)
        with torch.no_grad():
            net.embed_tokens.weight.copy_(emb)
    elif c.hidden_size != ec.target_hidden_size:
        raise UserError(f"{model_dir}: no embed_tokens, and the draft's hidden size {c.hidden_size} differs from "
                        f"the target's {ec.target_hidden_size} (its embedding cannot be reused)")
    net.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope).to(device)
    return net.eval()
