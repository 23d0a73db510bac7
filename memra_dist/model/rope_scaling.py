"""YaRN rope scaling: the config's parameters resolved once, the inverse frequencies, and the
two attention scales it implies. Parsing is pure (config.py imports it); torch is imported
only by `yarn_inv_freq`.

Semantics follow transformers' `_compute_yarn_parameters` and DeepSeek-V3's attention:
  * inverse frequencies: per rotary pair i, a blend of the extrapolated frequency
    theta^(-2i/dim) and the interpolated one (that over `factor`), weighted by a linear ramp
    over pair indices between the correction dims of `beta_fast` and `beta_slow` rotations
    within `original_max_position_embeddings` (floored / ceiled unless `truncate` is false);
    `dim` is the rotary width (MLA: qk_rope_head_dim; partial rotary: the rotating dims);
  * cos / sin are multiplied by `attention_factor` (given, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set and non-zero, else mscale(factor));
  * DeepSeek-V3's MLA multiplies its softmax scale by mscale(factor, mscale_all_dim)^2 when
    the rope is scaled and `mscale_all_dim` is set and non-zero (`softmax_scale_factor`).
`original_max_position_embeddings`: a top-level key of config.json wins over the rope
parameters' one (as transformers re-standardises at model build), else the rope parameters',
else `max_position_embeddings` when config.json names it; a `factor` of null is
max_position_embeddings / original_max_position_embeddings.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["resolve_yarn", "mscale", "attention_factor", "softmax_scale_factor", "yarn_inv_freq"]

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "mscale", "mscale_all_dim", "truncate")


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * m * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _number(p: dict, key: str, positive: bool = False) -> float | None:
    """p[key] as a finite float, or None when absent / null. ValueError names the key."""
    v = p.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        kind = "a positive number" if positive else "a finite number"
        raise ValueError(f"yarn {key} must be {kind} (got {_show(v)})")
    return float(v)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _positive_int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 40:
        raise ValueError(f"yarn {key} must be a positive integer (got {_show(v)})")
    return v


def resolve_yarn(params: dict, d: dict) -> dict[str, Any]:
    """The yarn rope parameters `params` of config.json `d`, resolved to plain values:
    factor, original_max_position_embeddings, beta_fast, beta_slow, truncate,
    attention_factor (the cos / sin scale) and mscale_all_dim (0.0 when unset).
    Raises ValueError (one line, naming the key) on a malformed or missing value."""
    if "factor" not in params:
        raise ValueError("yarn needs a 'factor'")
    top_orig = d.get("original_max_position_embeddings")
    if top_orig is not None:
        orig = _positive_int(top_orig, "original_max_position_embeddings")
    elif params.get("original_max_position_embeddings") is not None:
        orig = _positive_int(params["original_max_position_embeddings"], "original_max_position_embeddings")
    elif d.get("max_position_embeddings") is not None:
        orig = _positive_int(d["max_position_embeddings"], "max_position_embeddings")
    else:
        raise ValueError("yarn needs original_max_position_embeddings (or max_position_embeddings)")
    factor = _number(params, "factor", positive=True)
    if factor is None:  # DeepSeek-style: the ratio of the extended to the pretrained context
        if d.get("max_position_embeddings") is None:
            raise ValueError("yarn factor is null and config.json has no max_position_embeddings")
        factor = _positive_int(d["max_position_embeddings"], "max_position_embeddings") / orig
    m, m_all = _number(params, "mscale"), _number(params, "mscale_all_dim")
    att = _number(params, "attention_factor")
    if att is not None and att <= 0:
        raise ValueError(f"yarn attention_factor must be a positive number (got {_show(params['attention_factor'])})")
    truncate = params.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
        raise ValueError(f"yarn truncate must be true or false (got {_show(truncate)})")
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": orig,
        "beta_fast": _number(params, "beta_fast") or 32.0,  # 0 / null: the paper's defaults, as transformers
        "beta_slow": _number(params, "beta_slow") or 1.0,
        "truncate": bool(truncate),
        "attention_factor": att if att is not None else attention_factor(factor, m, m_all),
        "mscale_all_dim": m_all or 0.0,
    }


def attention_factor(factor: float, m: float | None, m_all: float | None) -> float:
    """The cos / sin scale YaRN infers when the config gives none."""
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def softmax_scale_factor(rope: dict) -> float:
    """DeepSeek-V3's MLA: its softmax scale is multiplied by this (1.0 for default rope or
    no `mscale_all_dim`)."""
    if not rope or rope.get("rope_type", "default") == "default":
        return 1.0
    m_all = rope.get("mscale_all_dim") or 0.0
    if not m_all:
        return 1.0
    s = mscale(float(rope["factor"]), float(m_all))
    return s * s


def _correction_dim(rotations: float, dim: int, base: float, ctx: int) -> float:
    """The (fractional) dim index whose wavelength turns `rotations` times within `ctx`."""
    return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, p: dict):
    """(dim/2,) fp32 YaRN inverse frequencies for a `dim`-wide rotary part (p: resolve_yarn's)."""
    import torch  # noqa: PLC0415 (this module is imported by the torch-free config parser)

    lo = _correction_dim(p["beta_fast"], dim, base, p["original_max_position_embeddings"])
    hi = _correction_dim(p["beta_slow"], dim, base, p["original_max_position_embeddings"])
    if p["truncate"]:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # no zero-width ramp
    cpu = torch.device("cpu")
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=cpu) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # weight of the extrapolated (unscaled) frequency: 1 for the fast-turning dims
    freqs = base ** (torch.arange(0, dim, 2, device=cpu).float() / dim)
    extrapolated, interpolated = 1.0 / freqs, 1.0 / (p["factor"] * freqs)
    return interpolated * (1 - keep) + extrapolated * keep
