"""deepseek_v3 / glm4_moe `config.json` -> `MoESpec` (family fields) + the common `ModelConfig` fields.

Pure: no torch, and no import of config.py (config.py imports this module). Field names and
defaults follow transformers' `DeepseekV3Config` / `Glm4MoeConfig`:

  deepseek_v3  MLA attention (q_lora_rank may be null), RoPE on the decoupled key part
               (`rope_interleave`, default true: the rotary dims are stored as interleaved
               pairs), every layer from `first_k_dense_replace` (default 3) on an MoE.
  glm4_moe     GQA with partial rotary (`partial_rotary_factor`, default 0.5, top level or in
               `rope_parameters`), optional q/k RMSNorm (`use_qk_norm`), q/k/v bias
               (`attention_bias`; o_proj never has one), MoE from `first_k_dense_replace`
               (default 1).
Both MoEs: sigmoid router with `e_score_correction_bias`, group-limited top-k (`n_group`,
`topk_group`), `norm_topk_prob`, `routed_scaling_factor`, `n_shared_experts` always-on.
`num_nextn_predict_layers` (default 0 here: a config that names none declares no MTP layer)
counts the MTP layers stored after the decoder, at `model.layers.{num_hidden_layers + i}`.

Every size is an int checked against SIZE_LIMITS / `_LIMITS` before anything is sized by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from .kimi_config import SIZE_LIMITS, as_int, layers_field, size_field

__all__ = ["MoESpec", "moe_common", "MOE_ARCHS"]

MOE_ARCHS = ("deepseek_v3", "glm4_moe")

# size keys of these families that kimi_config's SIZE_LIMITS does not name (same spirit: far
# above released models: DeepSeek-V3 256 routed experts, 1 MTP layer)
_LIMITS = {"n_routed_experts": 1 << 14, "num_experts_per_tok": 1 << 14, "n_shared_experts": 1 << 10,
           "n_group": 1 << 14, "num_nextn_predict_layers": 1 << 4}

_DEFAULTS = {  # transformers' config defaults that differ between the two
    "deepseek_v3": dict(first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5, rms_norm_eps=1e-6),
    "glm4_moe": dict(first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, rms_norm_eps=1e-5),
}


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


@dataclass(frozen=True)
class MoESpec:
    """The family fields the layers need. Attribute names are those model/mla.py and
    model/moe.py read from a KimiSpec, so both modules serve these families unchanged."""

    arch: str
    first_k_dense: int  # layers [0, first_k_dense) have a dense SwiGLU FFN; later ones (and MTP layers) an MoE
    num_mtp: int  # num_nextn_predict_layers
    rms_eps: float
    # attention: deepseek_v3 MLA
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False
    rope_interleave: bool = True
    # attention: glm4_moe GQA
    rotary_dim: int = 0  # the leading head dims that rotate (head_dim * partial_rotary_factor)
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_inter: int = 0
    n_shared: int = 0
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scale: float = 1.0

    @property
    def mla(self) -> bool:
        return self.arch == "deepseek_v3"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    def is_moe(self, idx: int, num_layers: int) -> bool:
        """Layer idx's FFN is an MoE: past the leading dense layers, or an MTP layer (idx >= L)."""
        return idx >= self.first_k_dense or idx >= num_layers


def _partial_factor(d: dict, where: str) -> float:
    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    v = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5))
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < float(v) <= 1.0:
        raise UserError(f"{where}: config.json has a malformed value for partial_rotary_factor ({_show(v)})")
    return float(v)


def _size(d: dict, where: str, *names: str, lo: int = 1, default: int | None = None) -> int:
    hi = _LIMITS.get(names[0]) or SIZE_LIMITS[names[0]]
    return size_field(d, where, *names, lo=lo, hi=hi, default=default)


def _spec(d: dict, arch: str, where: str, n_layers: int, heads: int, head_dim: int) -> MoESpec:
    dflt = _DEFAULTS[arch]
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}: {arch} hidden_act {_show(act)} unsupported (supported: silu)")
    k_dense = _size(d, where, "first_k_dense_replace", lo=0, default=dflt["first_k_dense_replace"])
    kw: dict[str, Any] = {}
    if arch == "deepseek_v3":
        q_rank = d.get("q_lora_rank")
        kw = dict(kv_lora_rank=_size(d, where, "kv_lora_rank"),
                  q_lora_rank=None if q_rank is None else _size(d, where, "q_lora_rank"),
                  qk_nope_dim=_size(d, where, "qk_nope_head_dim", lo=0),
                  qk_rope_dim=_size(d, where, "qk_rope_head_dim"),
                  v_head_dim=_size(d, where, "v_head_dim"),
                  rope_interleave=bool(d.get("rope_interleave", True)))
        if kw["qk_rope_dim"] % 2:
            raise UserError(f"{where}: config.json qk_rope_head_dim = {kw['qk_rope_dim']} must be even")
    else:
        rot = int(head_dim * _partial_factor(d, where))
        if rot < 2 or rot % 2:
            raise UserError(f"{where}: head_dim {head_dim} x partial_rotary_factor gives {rot} rotary dims "
                            f"(an even number >= 2 is needed)")
        kw = dict(rotary_dim=rot)
    spec = MoESpec(
        arch=arch, first_k_dense=k_dense,
        num_mtp=_size(d, where, "num_nextn_predict_layers", lo=0, default=0),
        rms_eps=float(d.get("rms_norm_eps", dflt["rms_norm_eps"])),
        attention_bias=bool(d.get("attention_bias", False)),
        num_experts=_size(d, where, "n_routed_experts", "num_local_experts"),
        top_k=_size(d, where, "num_experts_per_tok"),
        moe_inter=_size(d, where, "moe_intermediate_size"),
        n_shared=_size(d, where, "n_shared_experts", lo=0, default=1),
        n_group=_size(d, where, "n_group", default=dflt["n_group"]),
        topk_group=_size(d, where, "topk_group", default=dflt["topk_group"]),
        renormalize=bool(d.get("norm_topk_prob", True)),
        routed_scale=float(d.get("routed_scaling_factor", dflt["routed_scaling_factor"])),
        **kw)
    if spec.num_experts % spec.n_group or spec.num_experts // spec.n_group < 2:
        raise UserError(f"{where}: n_routed_experts {spec.num_experts} not in groups of >= 2 across n_group {spec.n_group}")
    if not spec.top_k <= spec.num_experts or not spec.topk_group <= spec.n_group:
        raise UserError(f"{where}: num_experts_per_tok / topk_group out of range "
                        f"({spec.top_k} of {spec.num_experts} experts, {spec.topk_group} of {spec.n_group} groups)")
    return spec


def moe_common(d: dict, where: str, max_layers: int | None = None) -> tuple[MoESpec, dict[str, Any]]:
    """(the family spec, the ModelConfig fields but arch / raw / rope) of a deepseek_v3 or
    glm4_moe config.json. `max_layers` (the layers a checkpoint's tensors hold, MTP layers
    included) bounds num_hidden_layers."""
    arch = d["model_type"]
    try:
        n = layers_field(d, where, max_layers)
        hidden = size_field(d, where, "hidden_size")
        heads = size_field(d, where, "num_attention_heads")
        kv_heads = size_field(d, where, "num_key_value_heads", default=heads)
        head_dim = size_field(d, where, "head_dim", default=max(1, hidden // heads))
        spec = _spec(d, arch, where, n, heads, head_dim)
        if spec.mla:  # MLA expands its latent to every head: no grouped heads
            kv_heads, head_dim = heads, spec.qk_head_dim
        eos = d.get("eos_token_id")
        eos_ids = tuple(as_int(e, "eos_token_id", where) for e in eos) if isinstance(eos, list) else (
            () if eos is None else (as_int(eos, "eos_token_id", where),))
        return spec, dict(
            vocab_size=size_field(d, where, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=size_field(d, where, "intermediate_size"),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_eps=spec.rms_eps,
            qkv_bias=not spec.mla and spec.attention_bias,
            o_bias=False,
            qk_norm=not spec.mla and bool(d.get("use_qk_norm", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=size_field(d, where, "max_position_embeddings", default=4096),
            eos_token_ids=eos_ids,
        )
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise UserError(f"{where}: config.json has a malformed value ({str(e).splitlines()[0][:200]})") from None
