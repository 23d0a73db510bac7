"""HF `config.json` -> a frozen `ModelConfig`. Pure: no torch.

From a checkpoint directory (`load_config`) it reads config.json and the safetensors headers
(tensor names and shapes, never tensor data): a config claiming more layers, a larger
vocabulary or a wider hidden size than the tensors hold is refused. Every size is checked
(a positive int within `SIZE_LIMITS`) before anything sized by it is built.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from .kimi_config import SIZE_LIMITS, as_int, kimi_common, layers_field, size_field
from .moe_config import MOE_ARCHS, moe_common
from .rope_scaling import resolve_yarn

__all__ = ["ModelConfig", "SUPPORTED_ARCHS", "SIZE_LIMITS", "CheckpointSizes", "checkpoint_sizes", "load_config", "read_config_json",
           "parse_config", "parse_kimi_config", "safetensors_header"]

# model_type -> family traits (the dense families); kimi_linear is parsed by kimi_config.py
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
    family: Any = field(default=None, compare=False, repr=False)  # kimi_linear: KimiSpec; deepseek_v3 / glm4_moe: MoESpec

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling)


@dataclass(frozen=True)
class CheckpointSizes:
    """What a checkpoint's safetensors headers hold, as bounds on its config's sizes."""

    layers: int  # 1 + the largest N of the `model.layers.N.*` tensors (0: none)
    vocab: int | None  # rows of model.embed_tokens.weight (else lm_head.weight); None: not found
    hidden: int | None  # its columns


def _rope_params(d: dict) -> tuple[float, tuple]:
    rp = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
    params = {**legacy, **rp}
    params.pop("rope_theta", None)
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype not in ("default", "llama3", "yarn"):
        raise UserError(f"unsupported rope_type '{rtype}' (supported: default, llama3, yarn)")
    if rtype == "default":
        return theta, ()
    if rtype == "yarn":  # resolved once here (model/rope_scaling.py); ValueError -> the caller's one line
        return theta, tuple(sorted(resolve_yarn(params, d).items()))
    params["rope_type"] = rtype
    params.pop("type", None)
    return theta, tuple(sorted((k, v) for k, v in params.items() if not isinstance(v, (list, dict))))


def parse_config(d: dict, where: str = "model", sizes: CheckpointSizes | None = None) -> ModelConfig:
    """Parse a config.json dict. Raises UserError naming the problem. `sizes` (from
    `checkpoint_sizes`) bounds the layers, vocabulary and hidden size further."""
    c = _parse_config(d, where, sizes)
    if c.head_dim < 1:
        raise UserError(f"{where}: config.json has a non-positive head_dim ({c.head_dim})")
    if c.num_heads % c.num_kv_heads:
        raise UserError(f"{where}: config.json: num_attention_heads ({c.num_heads}) is not a multiple of "
                        f"num_key_value_heads ({c.num_kv_heads})")
    if sizes is not None:
        for key, have, disk in (("vocab_size", c.vocab_size, sizes.vocab),
                                ("hidden_size", c.hidden_size, sizes.hidden)):
            if disk is not None and have > disk:
                raise UserError(f"{where}: config.json {key} = {have} exceeds the checkpoint's embedding "
                                f"({sizes.vocab} x {sizes.hidden})")
    return c


def _parse_config(d: dict, where: str, sizes: CheckpointSizes | None) -> ModelConfig:
    if not isinstance(d, dict):
        raise UserError(f"{where}: config.json is not a JSON object")
    if "model_type" not in d:
        raise UserError(f"{where}: config.json is missing the key 'model_type'")
    arch = d["model_type"]
    if not isinstance(arch, str):
        raise UserError(f"{where}: config.json 'model_type' must be a string (got {type(arch).__name__})")
    max_layers = None if sizes is None else sizes.layers
    if arch == "kimi_linear":
        return parse_kimi_config(d, where, max_layers)
    if arch in MOE_ARCHS:  # deepseek_v3, glm4_moe: model/moe_config.py
        spec, common = moe_common(d, where, max_layers)
        try:
            theta, rope = _rope_params(d)
        except (TypeError, ValueError, AttributeError, OverflowError) as e:
            raise UserError(f"{where}: config.json has a malformed value ({_line(e)})") from None
        return ModelConfig(arch=arch, raw=d, family=spec, rope_theta=theta, rope_scaling=rope, **common)
    if arch not in SUPPORTED_ARCHS:
        names = ", ".join(sorted(list(SUPPORTED_ARCHS) + ["kimi_linear", *MOE_ARCHS]))
        raise UserError(f"{where}: unsupported architecture '{arch}' (supported: {names})")
    traits = SUPPORTED_ARCHS[arch]
    try:
        hidden = size_field(d, where, "hidden_size")
        heads = size_field(d, where, "num_attention_heads")
        theta, rope = _rope_params(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(as_int(e, "eos_token_id", where) for e in eos) if isinstance(eos, list) else (
            () if eos is None else (as_int(eos, "eos_token_id", where),))
        return ModelConfig(
            arch=arch,
            vocab_size=size_field(d, where, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=size_field(d, where, "intermediate_size"),
            num_layers=layers_field(d, where, max_layers),
            num_heads=heads,
            num_kv_heads=size_field(d, where, "num_key_value_heads", default=heads),
            head_dim=size_field(d, where, "head_dim", default=hidden // heads),
            rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope,
            qkv_bias=traits["qkv_bias"] or bool(d.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(d.get("attention_bias", False)),
            qk_norm=traits["qk_norm"],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=size_field(d, where, "max_position_embeddings", default=4096),
            eos_token_ids=eos_ids,
            raw=d,
        )
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError) as e:
        raise UserError(f"{where}: config.json has a malformed value ({_line(e)})") from None


def parse_kimi_config(d: dict, where: str, max_layers: int | None = None) -> ModelConfig:
    """A kimi_linear config.json (validating the family fields too); the KimiSpec rides along
    as `family`. `max_layers` bounds num_hidden_layers (the layers on disk)."""
    spec, common = kimi_common(d, where, max_layers)
    return ModelConfig(arch="kimi_linear", raw=d, family=spec, **common)


# ---- the checkpoint's safetensors headers ----------------------------------------------

_LAYER_NAME = re.compile(r"model\.layers\.(\d{1,9})\.")
_MAX_HEADER = 100_000_000  # safetensors' own limit on a header's length
_EMBED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def _line(why: Any) -> str:
    """The first line of an error's text (its type name when it has none), at most 200 chars."""
    text = str(why).strip()
    return text.splitlines()[0][:200] if text else type(why).__name__


def _unreadable(f: Path, why: Any) -> UserError:
    return UserError(f"{f}: cannot read safetensors file ({_line(why)})")


def safetensors_header(f: Path) -> dict[str, Any]:
    """name -> {"dtype", "shape", "data_offsets"} of one safetensors file: its 8-byte length
    and JSON header only (at most _MAX_HEADER bytes), never the tensor data."""
    try:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _unreadable(f, "shorter than its 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER:
                raise _unreadable(f, f"header length {n} is over {_MAX_HEADER} bytes")
            body = fh.read(n)
        if len(body) < n:
            raise _unreadable(f, "truncated header")
        hdr = json.loads(body)
    except PermissionError:
        raise _unreadable(f, "permission denied") from None
    except OSError as e:  # a directory, a device, an I/O error
        raise _unreadable(f, e.strerror or e) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # not JSON
        raise _unreadable(f, f"malformed header: {e}") from None
    if not isinstance(hdr, dict):
        raise _unreadable(f, "malformed header: not a JSON object")
    hdr.pop("__metadata__", None)
    return hdr


def _matrix(entry: Any) -> tuple[int, int] | None:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if isinstance(shape, list) and len(shape) == 2 and all(isinstance(x, int) for x in shape):
        return shape[0], shape[1]
    return None


def checkpoint_sizes(model_dir: str | Path) -> CheckpointSizes | None:
    """The sizes `model_dir`'s safetensors headers hold (a sharded index names the tensors;
    only the header of the embedding's shard is read then), or None when there are no
    weights at all (loading them reports that)."""
    p = Path(model_dir)
    index = p / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            file_of = {str(k): p / v for k, v in wm.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise UserError(f"{index}: malformed index ({_line(e)})") from None
        headers: dict[Path, dict] = {}
    else:
        files = sorted(p.glob("*.safetensors"))
        if not files:
            return None
        headers = {f: safetensors_header(f) for f in files}
        file_of = {name: f for f, hdr in headers.items() for name in hdr}
    layers = max((int(m.group(1)) + 1 for name in file_of if (m := _LAYER_NAME.match(name))), default=0)
    vocab = hidden = None
    for name in _EMBED_NAMES:
        f = file_of.get(name)
        if f is None:
            continue
        if f not in headers:
            if not f.is_file():  # a shard that is not here: loading reports it
                break
            headers[f] = safetensors_header(f)
        shape = _matrix(headers[f].get(name))
        if shape is not None:
            vocab, hidden = shape
        break
    return CheckpointSizes(layers=layers, vocab=vocab, hidden=hidden)


def read_config_json(model_dir: str | Path, role: str = "model", kind: str = "a HF checkpoint") -> dict:
    """`<model_dir>/config.json` as a dict, with one-line errors for every failure (`role`
    names the directory in them, `kind` what it should have been)."""
    p = Path(model_dir)
    if not p.exists():
        raise UserError(f"{role} directory not found: {p}")
    if not p.is_dir():
        raise UserError(f"{role} path is not a directory: {p}")
    cfg = p / "config.json"
    try:
        if not cfg.exists():
            raise UserError(f"{p}: no config.json (is this {kind} directory?)")
        return json.loads(cfg.read_text())
    except PermissionError:
        raise UserError(f"{cfg}: not readable (permission denied)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg}: malformed JSON ({e})") from None
    except OSError as e:  # a directory, a device, an I/O error: still one line
        raise UserError(f"{cfg}: cannot read ({e.strerror or e})") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and parse `<model_dir>/config.json`, bounded by the checkpoint's safetensors
    headers, with one-line errors for every failure."""
    d = read_config_json(model_dir)
    return parse_config(d, where=str(Path(model_dir)), sizes=checkpoint_sizes(Path(model_dir)))
