"""kimi_linear `config.json` -> `KimiSpec` (family fields) + the common `ModelConfig` fields.

Pure: no torch, and no import of config.py (config.py imports this module, never the other
way round). Field names and defaults follow transformers' `KimiLinearConfig`: the checkpoint
spellings (`num_experts`, `num_experts_per_token`, `num_shared_experts`, `num_expert_group`,
`moe_renormalize`, `model_max_length`) and the HF attribute names (`num_local_experts`,
`num_experts_per_tok`, `n_shared_experts`, `n_group`, ...) are both read.
Layer types: `layer_types` if present, else `linear_attn_config` kda_layers / full_attn_layers
(1-indexed), else HF's default (full attention at every 4th layer but the first). MLP types:
`mlp_layer_types` if present, else dense for the first `first_k_dense_replace` (default 1).

Every size is an int checked against `SIZE_LIMITS` (and `num_hidden_layers` against the
layers a checkpoint holds, when the caller knows them) before any per-layer list is built.
`size_field` and `SIZE_LIMITS` serve every family: config.py uses them for llama / qwen too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError

__all__ = ["KimiSpec", "kimi_common", "size_field", "layers_field", "as_int", "SIZE_LIMITS",
           "KDA", "FULL", "DENSE", "SPARSE"]

KDA, FULL = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"

# config.json size key -> largest accepted value: far above any released model (Llama-3.1-405B:
# 126 layers, hidden 16384; Kimi-K2: 384 experts; vocabularies ~256k), small enough that
# nothing sized from a config can exhaust memory or time before the tensors are checked.
SIZE_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1 << 12,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 26,
    "model_max_length": 1 << 26,
    "kv_lora_rank": 1 << 16,
    "q_lora_rank": 1 << 16,
    "qk_nope_head_dim": 1 << 12,
    "qk_rope_head_dim": 1 << 12,
    "v_head_dim": 1 << 12,
    "num_experts": 1 << 14,
    "num_experts_per_token": 1 << 14,
    "num_shared_experts": 1 << 10,
    "num_expert_group": 1 << 14,
    "topk_group": 1 << 14,
    "first_k_dense_replace": 1 << 12,
    "linear_attn_config.num_heads": 1 << 12,
    "linear_attn_config.head_dim": 1 << 12,
    "linear_attn_config.short_conv_kernel_size": 1 << 10,
}


def _show(v: Any) -> str:
    """A short one-line rendering of a config value for an error message."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"{'-' if v < 0 else ''}~2^{v.bit_length() - 1}"
    try:
        s = repr(v)
    except ValueError:  # an int past the interpreter's digit limit, nested in a list
        return f"<{type(v).__name__}>"
    return s if len(s) <= 60 else s[:57] + "..."


def _get(d: dict, *names: str, default: Any = None) -> Any:
    """The first of `names` present (and not None) in d, else `default`."""
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def _present(d: dict, names: tuple[str, ...]) -> str | None:
    """The first of `names` present (and not None) in d, else None."""
    return next((n for n in names if d.get(n) is not None), None)


def as_int(v: Any, key: str, where: str) -> int:
    """v as an int: a JSON integer (or an integral float); anything else is malformed."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise UserError(f"{where}: config.json has a malformed value for {key} ({_show(v)})")
    return int(v)


def size_field(d: dict, where: str, *names: str, lo: int = 1, hi: int | None = None, default: int | None = None,
               prefix: str = "") -> int:
    """The size under the first present of `names` (aliases), checked to be an int in
    [lo, hi]; hi defaults to SIZE_LIMITS[prefix + names[0]]. Missing and no default: refused."""
    key = _present(d, names)
    if key is None:
        if default is None:
            raise UserError(f"{where}: config.json is missing the key '{prefix}{names[0]}'")
        return default
    n = as_int(d[key], prefix + key, where)
    hi = SIZE_LIMITS[prefix + names[0]] if hi is None else hi
    if not lo <= n <= hi:
        raise UserError(f"{where}: config.json {prefix}{key} = {_show(n)} is out of range ({lo}..{hi})")
    return n


def layers_field(d: dict, where: str, max_layers: int | None = None) -> int:
    """num_hidden_layers within SIZE_LIMITS and, when given, within `max_layers` (the layers
    a checkpoint's tensors hold)."""
    n = size_field(d, where, "num_hidden_layers")
    if max_layers is not None and n > max_layers:
        raise UserError(f"{where}: config.json num_hidden_layers = {n} exceeds the {max_layers} layers "
                        f"the checkpoint's tensors hold")
    return n


def _str_list(v: Any, key: str, n: int, allowed: tuple[str, str], where: str) -> tuple[str, ...]:
    """A list of exactly n entries from `allowed` (the length is checked before the entries)."""
    want = f"{n} of '{allowed[0]}' / '{allowed[1]}'"
    if not isinstance(v, list):
        raise UserError(f"{where}: {key} must be a list of {want}, got {_show(v)}")
    if len(v) != n or any(not isinstance(t, str) or t not in allowed for t in v):
        raise UserError(f"{where}: {key} must be {want}, got {_show(v)}")
    return tuple(v)


def _layer_types(d: dict, n: int, where: str) -> tuple[str, ...]:
    lin = d.get("linear_attn_config") or {}
    if d.get("layer_types") is not None:
        return _str_list(d["layer_types"], "layer types", n, (KDA, FULL), where)
    if "kda_layers" in lin and "full_attn_layers" in lin:
        types: list[str | None] = [None] * n
        for key, kind in (("full_attn_layers", FULL), ("kda_layers", KDA)):
            if not isinstance(lin[key], list):
                raise UserError(f"{where}: linear_attn_config.{key} must be a list, got {_show(lin[key])}")
            for one_based in lin[key]:
                i = as_int(one_based, f"linear_attn_config.{key}", where)
                if not 1 <= i <= n:
                    raise UserError(f"{where}: linear_attn_config.{key} names layer {_show(i)} of {n}")
                types[i - 1] = kind
        return _str_list(types, "layer types", n, (KDA, FULL), where)
    return tuple(FULL if i and i % 4 == 0 else KDA for i in range(n))


def _mlp_types(d: dict, n: int, where: str) -> tuple[str, ...]:
    if d.get("mlp_layer_types") is not None:
        return _str_list(d["mlp_layer_types"], "mlp_layer_types", n, (DENSE, SPARSE), where)
    k = size_field(d, where, "first_k_dense_replace", lo=0, default=1)
    return tuple(DENSE if i < k else SPARSE for i in range(n))


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
    def from_config(cls, cfg) -> "KimiSpec":
        """The spec of a parsed kimi_linear ModelConfig: the one parse_config kept
        (`cfg.family`), else parsed again from `cfg.raw`."""
        spec = getattr(cfg, "family", None)
        return spec if isinstance(spec, cls) else cls.from_raw(cfg.raw, "model")

    @classmethod
    def from_raw(cls, d: dict, where: str, max_layers: int | None = None) -> "KimiSpec":
        """Parse and validate the family fields; `max_layers` bounds num_hidden_layers further
        (the layers a checkpoint's tensors hold)."""
        if not isinstance(d, dict):
            raise UserError(f"{where}: config.json is not a JSON object")
        try:
            return cls._parse(d, where, max_layers)
        except (TypeError, ValueError, AttributeError, OverflowError) as e:  # AttributeError: a non-dict sub-config
            raise UserError(f"{where}: config.json has a malformed value ({str(e).splitlines()[0][:200]})") from None

    @classmethod
    def _parse(cls, d: dict, where: str, max_layers: int | None) -> "KimiSpec":
        n = layers_field(d, where, max_layers)  # bounded before any per-layer list
        lin = d.get("linear_attn_config") or {}
        if not isinstance(lin, dict):
            raise UserError(f"{where}: linear_attn_config must be a JSON object, got {_show(lin)}")
        layers, mlps = _layer_types(d, n, where), _mlp_types(d, n, where)
        has_mla, has_moe = FULL in layers, SPARSE in mlps

        def mla(*k: str, lo: int = 1) -> int:  # required by MLA layers; otherwise unused (0 if absent)
            return size_field(d, where, *k, lo=lo if has_mla else 0, default=None if has_mla else 0)

        def moe(*k: str, lo: int = 1, default: int | None = None) -> int:  # likewise for MoE layers
            return size_field(d, where, *k, lo=lo if has_moe else 0,
                              default=default if has_moe else (0 if default is None else default))

        def kda(key: str, alias: str, default: int) -> int:
            if lin.get(key) is not None:
                return size_field(lin, where, key, prefix="linear_attn_config.")
            return size_field(d, where, alias, default=default, hi=SIZE_LIMITS[f"linear_attn_config.{key}"])

        q_rank = d.get("q_lora_rank")
        spec = cls(
            layer_types=layers,
            mlp_types=mlps,
            rms_eps=float(d.get("rms_norm_eps", 1e-5)),
            kda_heads=kda("num_heads", "linear_num_heads", 32),
            kda_head_dim=kda("head_dim", "linear_head_dim", 128),
            conv_kernel=kda("short_conv_kernel_size", "linear_conv_kernel_dim", 4),
            kv_lora_rank=mla("kv_lora_rank"),
            q_lora_rank=None if q_rank is None else mla("q_lora_rank"),
            qk_nope_dim=mla("qk_nope_head_dim", lo=0),
            qk_rope_dim=mla("qk_rope_head_dim", lo=0),
            v_head_dim=mla("v_head_dim"),
            attention_bias=bool(d.get("attention_bias", False)),
            num_experts=moe("num_experts", "num_local_experts"),
            top_k=moe("num_experts_per_token", "num_experts_per_tok"),
            moe_inter=moe("moe_intermediate_size"),
            n_shared=size_field(d, where, "num_shared_experts", "n_shared_experts", lo=0, default=1),
            n_group=moe("num_expert_group", "n_group", default=1),
            topk_group=moe("topk_group", default=1),
            renormalize=bool(_get(d, "moe_renormalize", "norm_topk_prob", default=True)),
            routed_scale=float(d.get("routed_scaling_factor", 2.446)),
        )
        spec._check(d, where)
        return spec

    def _check(self, d: dict, where: str) -> None:
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UserError(f"{where}: kimi_linear hidden_act {_show(act)} unsupported (supported: silu)")
        if SPARSE in self.mlp_types:
            if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
                raise UserError(f"{where}: num_experts {self.num_experts} not in groups of >= 2 "
                                f"across num_expert_group {self.n_group}")
            if not 1 <= self.top_k <= self.num_experts or not 1 <= self.topk_group <= self.n_group:
                raise UserError(f"{where}: num_experts_per_token / topk_group out of range")


def kimi_common(d: dict, where: str, max_layers: int | None = None) -> tuple[KimiSpec, dict[str, Any]]:
    """(the family spec, the common ModelConfig fields but `arch` and `raw`) of a kimi_linear
    config.json; config.py builds the ModelConfig from them."""
    spec = KimiSpec.from_raw(d, where, max_layers)
    try:
        heads = size_field(d, where, "num_attention_heads")
        kv_heads = size_field(d, where, "num_key_value_heads", default=heads)
        if kv_heads != heads and FULL in spec.layer_types:
            # the reference expands the latent to all heads; grouped MLA heads do not exist there
            raise UserError(f"{where}: kimi_linear MLA needs num_key_value_heads == num_attention_heads")
        eos = d.get("eos_token_id")
        eos_ids = tuple(as_int(e, "eos_token_id", where) for e in eos) if isinstance(eos, list) else (
            () if eos is None else (as_int(eos, "eos_token_id", where),))
        return spec, dict(
            vocab_size=size_field(d, where, "vocab_size"),
            hidden_size=size_field(d, where, "hidden_size"),
            intermediate_size=size_field(d, where, "intermediate_size"),
            num_layers=len(spec.layer_types),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=spec.qk_head_dim,
            rms_eps=spec.rms_eps,
            rope_theta=float(d.get("rope_theta", 10000.0)),  # unused: Kimi's MLA is NoPE
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=size_field(d, where, "model_max_length", "max_position_embeddings",
                                               default=4096),
            eos_token_ids=eos_ids,
        )
    except (TypeError, ValueError, OverflowError) as e:
        raise UserError(f"{where}: config.json has a malformed value ({str(e).splitlines()[0][:200]})") from None
