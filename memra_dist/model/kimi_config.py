"""kimi_linear `config.json` -> `ModelConfig` (common fields) + `KimiSpec` (family fields).

Pure: no torch. Field names and defaults follow transformers' `KimiLinearConfig`: the
checkpoint spellings (`num_experts`, `num_experts_per_token`, `num_shared_experts`,
`num_expert_group`, `moe_renormalize`, `model_max_length`) and the HF attribute names
(`num_local_experts`, `num_experts_per_tok`, `n_shared_experts`, `n_group`, ...) are both read.
Layer types: `layer_types` if present, else `linear_attn_config` kda_layers / full_attn_layers
(1-indexed), else HF's default (full attention at every 4th layer but the first). MLP types:
`mlp_layer_types` if present, else dense for the first `first_k_dense_replace` (default 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from .config import ModelConfig

__all__ = ["KimiSpec", "parse_kimi_config"]

KDA, FULL = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"


def _get(d: dict, *names: str, default: Any = None) -> Any:
    """The first of `names` present (and not None) in d, else `default`."""
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def _need(d: dict, where: str, *names: str) -> Any:
    v = _get(d, *names)
    if v is None:
        raise UserError(f"{where}: config.json is missing the key '{names[0]}'")
    return v


def _layer_types(d: dict, n: int, where: str) -> tuple[str, ...]:
    lin = d.get("linear_attn_config") or {}
    if d.get("layer_types") is not None:
        types = list(d["layer_types"])
    elif "kda_layers" in lin and "full_attn_layers" in lin:
        types = [None] * n
        for key, kind in (("full_attn_layers", FULL), ("kda_layers", KDA)):
            for one_based in lin[key]:
                if not 1 <= int(one_based) <= n:
                    raise UserError(f"{where}: linear_attn_config.{key} names layer {one_based} of {n}")
                types[int(one_based) - 1] = kind
    else:
        types = [FULL if i and i % 4 == 0 else KDA for i in range(n)]
    if len(types) != n or any(t not in (KDA, FULL) for t in types):
        raise UserError(f"{where}: layer types must be {n} of '{KDA}' / '{FULL}', got {types}")
    return tuple(types)


def _mlp_types(d: dict, n: int, where: str) -> tuple[str, ...]:
    if d.get("mlp_layer_types") is not None:
        types = list(d["mlp_layer_types"])
    else:
        k = int(d.get("first_k_dense_replace", 1))
        types = [DENSE if i < k else SPARSE for i in range(n)]
    if len(types) != n or any(t not in (DENSE, SPARSE) for t in types):
        raise UserError(f"{where}: mlp_layer_types must be {n} of '{DENSE}' / '{SPARSE}', got {types}")
    return tuple(types)


@dataclass(frozen=True)
class KimiSpec:
    """The kimi_linear fields the layers need, derived once from the raw config.json."""

    layer_types: tuple[str, ...]  # per layer: "linear_attention" (KDA) | "full_attention" (MLA)
    mlp_types: tuple[str, ...]  # per layer: "dense" | "sparse" (MoE)
    rms_eps: float
    # KDA
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    # MLA (NoPE: the "rope" part of the key is shared across heads but never rotated)
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    attention_bias: bool
    # MoE
    num_experts: int
    top_k: int
    moe_inter: int
    n_shared: int
    n_group: int
    topk_group: int
    renormalize: bool
    routed_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "KimiSpec":
        return cls.from_raw(cfg.raw, "model")

    @classmethod
    def from_raw(cls, d: dict, where: str) -> "KimiSpec":
        try:
            return cls._parse(d, where)
        except (TypeError, ValueError, AttributeError) as e:  # AttributeError: a non-dict sub-config
            raise UserError(f"{where}: config.json has a malformed value ({e})") from None

    @classmethod
    def _parse(cls, d: dict, where: str) -> "KimiSpec":
        n = int(_need(d, where, "num_hidden_layers"))
        layers, mlps = _layer_types(d, n, where), _mlp_types(d, n, where)
        lin = d.get("linear_attn_config") or {}
        has_mla, has_moe = FULL in layers, SPARSE in mlps
        mla = (lambda *k: int(_need(d, where, *k))) if has_mla else (lambda *k: int(_get(d, *k, default=0)))
        moe = (lambda *k: int(_need(d, where, *k))) if has_moe else (lambda *k: int(_get(d, *k, default=0)))
        q_rank = d.get("q_lora_rank")
        spec = cls(
            layer_types=layers,
            mlp_types=mlps,
            rms_eps=float(d.get("rms_norm_eps", 1e-5)),
            kda_heads=int(_get(lin, "num_heads", default=_get(d, "linear_num_heads", default=32))),
            kda_head_dim=int(_get(lin, "head_dim", default=_get(d, "linear_head_dim", default=128))),
            conv_kernel=int(_get(lin, "short_conv_kernel_size", default=_get(d, "linear_conv_kernel_dim", default=4))),
            kv_lora_rank=mla("kv_lora_rank"),
            q_lora_rank=None if q_rank is None else int(q_rank),
            qk_nope_dim=mla("qk_nope_head_dim"),
            qk_rope_dim=mla("qk_rope_head_dim"),
            v_head_dim=mla("v_head_dim"),
            attention_bias=bool(d.get("attention_bias", False)),
            num_experts=moe("num_experts", "num_local_experts"),
            top_k=moe("num_experts_per_token", "num_experts_per_tok"),
            moe_inter=moe("moe_intermediate_size"),
            n_shared=int(_get(d, "num_shared_experts", "n_shared_experts", default=1)),
            n_group=int(_get(d, "num_expert_group", "n_group", default=1)),
            topk_group=int(_get(d, "topk_group", default=1)),
            renormalize=bool(_get(d, "moe_renormalize", "norm_topk_prob", default=True)),
            routed_scale=float(d.get("routed_scaling_factor", 2.446)),
        )
        spec._check(d, where)
        return spec

    def _check(self, d: dict, where: str) -> None:
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UserError(f"{where}: kimi_linear hidden_act '{act}' unsupported (supported: silu)")
        if SPARSE in self.mlp_types:
            if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
                raise UserError(f"{where}: num_experts {self.num_experts} not in groups of >= 2 "
                                f"across num_expert_group {self.n_group}")
            if not 1 <= self.top_k <= self.num_experts or not 1 <= self.topk_group <= self.n_group:
                raise UserError(f"{where}: num_experts_per_token / topk_group out of range")
        if min(self.kda_heads, self.kda_head_dim, self.conv_kernel) < 1:
            raise UserError(f"{where}: linear_attn_config has a non-positive size")


def parse_kimi_config(d: dict, where: str) -> ModelConfig:
    """Common ModelConfig fields of a kimi_linear config (validating the family fields too)."""
    spec = KimiSpec.from_raw(d, where)
    try:
        heads = int(_need(d, where, "num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if kv_heads != heads and FULL in spec.layer_types:
            # the reference expands the latent to all heads; grouped MLA heads do not exist there
            raise UserError(f"{where}: kimi_linear MLA needs num_key_value_heads == num_attention_heads")
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            arch="kimi_linear",
            vocab_size=int(_need(d, where, "vocab_size")),
            hidden_size=int(_need(d, where, "hidden_size")),
            intermediate_size=int(_need(d, where, "intermediate_size")),
            num_layers=len(spec.layer_types),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=spec.qk_head_dim,
            rms_eps=spec.rms_eps,
            rope_theta=float(d.get("rope_theta", 10000.0)),  # unused: Kimi's MLA is NoPE
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(_get(d, "model_max_length", "max_position_embeddings", default=4096)),
            eos_token_ids=eos_ids,
            raw=d,
        )
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: config.json has a malformed value ({e})") from None
