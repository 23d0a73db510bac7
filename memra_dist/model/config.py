"""HF `config.json` -> a frozen `ModelConfig`. Pure: no torch, no files beyond the json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError

__all__ = ["ModelConfig", "SUPPORTED_ARCHS", "load_config", "parse_config"]

# model_type -> family traits. kimi_linear registers itself in model/kimi_config.py.
SUPPORTED_ARCHS: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: tuple = ()  # sorted (key, value) items of the rope_parameters, () = default
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling)


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise UserError(f"{where}: config.json is missing the key '{key}'")
    return d[key]


def _rope_params(d: dict) -> tuple[float, tuple]:
    rp = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
    params = {**legacy, **rp}
    params.pop("rope_theta", None)
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype not in ("default", "llama3"):
        raise UserError(f"unsupported rope_type '{rtype}' (supported: default, llama3)")
    if rtype == "default":
        return theta, ()
    params["rope_type"] = rtype
    params.pop("type", None)
    return theta, tuple(sorted((k, v) for k, v in params.items() if not isinstance(v, (list, dict))))


def parse_config(d: dict, where: str = "model") -> ModelConfig:
    """Parse a config.json dict. Raises UserError naming the problem."""
    c = _parse_config(d, where)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings"):
        if getattr(c, name) < 1:
            raise UserError(f"{where}: config.json has a non-positive {name} ({getattr(c, name)})")
    if c.num_heads % c.num_kv_heads:
        raise UserError(f"{where}: config.json: num_attention_heads ({c.num_heads}) is not a multiple of "
                        f"num_key_value_heads ({c.num_kv_heads})")
    return c


def _parse_config(d: dict, where: str) -> ModelConfig:
    if not isinstance(d, dict):
        raise UserError(f"{where}: config.json is not a JSON object")
    arch = _need(d, "model_type", where)
    if not isinstance(arch, str):
        raise UserError(f"{where}: config.json 'model_type' must be a string (got {type(arch).__name__})")
    if arch == "kimi_linear":
        from .kimi_config import parse_kimi_config  # noqa: PLC0415 (optional family)

        return parse_kimi_config(d, where)
    if arch not in SUPPORTED_ARCHS:
        names = ", ".join(sorted(list(SUPPORTED_ARCHS) + ["kimi_linear"]))
        raise UserError(f"{where}: unsupported architecture '{arch}' (supported: {names})")
    traits = SUPPORTED_ARCHS[arch]
    try:
        hidden = int(_need(d, "hidden_size", where))
        heads = int(_need(d, "num_attention_heads", where))
        head_dim = d.get("head_dim") or hidden // heads
        theta, rope = _rope_params(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            arch=arch,
            vocab_size=int(_need(d, "vocab_size", where)),
            hidden_size=hidden,
            intermediate_size=int(_need(d, "intermediate_size", where)),
            num_layers=int(_need(d, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope,
            qkv_bias=traits["qkv_bias"] or bool(d.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(d.get("attention_bias", False)),
            qk_norm=traits["qk_norm"],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
            raw=d,
        )
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError) as e:
        raise UserError(f"{where}: config.json has a malformed value ({e})") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and parse `<model_dir>/config.json` with one-line errors for every failure."""
    p = Path(model_dir)
    if not p.exists():
        raise UserError(f"model directory not found: {p}")
    if not p.is_dir():
        raise UserError(f"model path is not a directory: {p}")
    cfg = p / "config.json"
    try:
        if not cfg.exists():
            raise UserError(f"{p}: no config.json (is this a HF checkpoint directory?)")
        d = json.loads(cfg.read_text())
    except PermissionError:
        raise UserError(f"{cfg}: not readable (permission denied)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg}: malformed JSON ({e})") from None
    except OSError as e:  # a directory, a device, an I/O error: still one line
        raise UserError(f"{cfg}: cannot read ({e.strerror or e})") from None
    return parse_config(d, where=str(p))
