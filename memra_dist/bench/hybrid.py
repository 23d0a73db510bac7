"""A kimi_linear hybrid (KDA + MLA + MoE) of realistic width: verify(K+1) / single-step cost
and the KDA state rollback as a share of a verify round.

Rollback cost = wall of `ModelRunner.rollback(ctx + keep)` right after a K+1-row verify at
ctx (a length change: KDA's live state and conv window are read from rings indexed by
position, so nothing is copied; MLA layers only move the length too), device-synced, median over repeats and over keep in
{0, K // 2}. The per-row snapshot writes themselves happen inside the verify forward, so
they are part of the verify cost this is divided by."""

from __future__ import annotations

import torch

from ..runner import ModelRunner
from ..model import kda_kernels
from .checkpoints import HYBRID_OF, ensure_checkpoint
from .fastpath import runner_kwargs
from .roofline import median
from .runs import Steps

__all__ = ["hybrid"]


def hybrid(s) -> dict:
    name = HYBRID_OF[s.opts.shape]
    path = ensure_checkpoint(name, s.cache, s.device, s.say, s.ckpt_dtype)
    s.say(f"  loading hybrid {name}")
    r = ModelRunner(str(path), s.device, s.dtype, max_pos=s.p.hybrid_ctx + 64, **runner_kwargs(s.graphs))
    b, ctx, n = Steps(s.device), s.p.hybrid_ctx, s.p.step_repeats
    b.prime(r, ctx, ctx + max(s.p.ks) + 8)
    dec = b.step_time(r, 1, ctx, n)["median_s"]
    spec = r.cfg.raw.get("linear_attn_config", {})
    out = {"shape": name, "ctx": ctx, "layers": r.cfg.num_layers, "hidden": r.cfg.hidden_size,
           "kda_layers": len(spec.get("kda_layers", [])), "mla_layers": len(spec.get("full_attn_layers", [])),
           "graphs": r.graphs is not None, "kda_kernels": kda_kernels.fla_status() if s.device.type == "cuda" else {"mode": "torch (not CUDA)"},
           "decode_ms": round(dec * 1e3, 4), "k": {}}
    for k in s.p.ks:
        ver = b.step_time(r, k + 1, ctx, n)["median_s"]
        rbs = [b.rollback_time(r, ctx, k, keep, max(3, n // 2))["median_s"] for keep in (0, k // 2)]
        rb = median(rbs)
        out["k"][str(k)] = {"verify_ms": round(ver * 1e3, 4), "ratio_vs_decode": round(ver / dec, 4),
                            "rollback_ms": round(rb * 1e3, 4), "rollback_share_of_verify": round(rb / ver, 4)}
        s.say(f"  hybrid K={k}: verify/decode {ver / dec:.2f}, rollback {rb / ver * 100:.2f}% of verify")
    del r
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    return out
