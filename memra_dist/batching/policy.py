"""What `--max-batch` may be, and what `auto` picks: no torch here (the CLI's parsers use it)."""

from __future__ import annotations

import argparse

from ..errors import UserError

__all__ = ["check_batchable", "auto_max_batch", "eager_steps", "resolve_max_batch", "max_batch_arg", "BATCHABLE_DRAFTERS", "BATCHABLE_FAMILIES",
           "MAX_BATCH", "AUTO_MAX_BATCH"]

BATCHABLE_DRAFTERS = ("none", "ngram", "replay", "model", "dflash", "eagle3", "mtp")
BATCHABLE_FAMILIES = ("llama", "qwen2", "qwen3", "glm4_moe", "deepseek_v3", "kimi_linear")
MAX_BATCH = 256
# `--max-batch auto` on a GPU, by measurement (BENCHMARKS.md, "Batched steps fold their norms and
# residual adds"; one H200, the 8B shape): 16 requests decode at 14.1x one request's rate with
# each one's inter-token latency 1.10x its own alone (the bound: 1.3x); 64 reach 35x but
# at 1.8x the latency. On CPU (2 cores, the tiny shape) batching measured no gain: 1 there.
AUTO_MAX_BATCH = 16
# the families whose batched steps run on the paged kernel as CUDA graphs, as measured (where
# `eager_steps` finds nothing against it); glm4_moe's, deepseek_v3's and kimi_linear's are not
# measured on a GPU (MLA and KDA run eager there): auto leaves them one at a time
AUTO_FAMILIES = ("llama", "qwen2", "qwen3")


def max_batch_arg(s: str) -> int | None:
    """argparse type of --max-batch: a count, or `auto` (None)."""
    if s.strip().lower() == "auto":
        return None
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or auto (got {s!r})") from None


def auto_max_batch(cfg, mcfg, device_type: str) -> tuple[int, str]:
    """`--max-batch auto`: (B, why): AUTO_MAX_BATCH where the batched engine runs the request
    as measured (a CUDA device, pp 1, a batchable drafter, a family and shape whose steps are
    graphed: `eager_steps`), else 1 (one request at a time)."""
    if device_type != "cuda":
        return 1, "not a GPU (batching measured no gain on CPU)"
    if cfg.pp > 1:
        return 1, "--pp > 1 (its batched steps run eager across the ring, not measured to pay yet: --max-batch B batches it)"
    if cfg.drafter not in BATCHABLE_DRAFTERS:
        return 1, f"--drafter {cfg.drafter} does not batch yet"
    if mcfg.arch not in AUTO_FAMILIES:
        return 1, f"the {mcfg.arch} family's batched steps are not measured to pay yet (--max-batch B batches it)"
    eager = eager_steps(cfg, mcfg)
    if eager:
        return 1, f"its batched steps would run eager ({eager}; --max-batch B batches it)"
    return AUTO_MAX_BATCH, "a GPU"


def eager_steps(cfg, mcfg) -> str | None:
    """Why a GPU's batched decode / verify steps would run eager (kernel by kernel, no CUDA graph:
    batching/graphs.py needs the paged kernel in every layer), or None when they replay graphs.
    Eager, a step costs ~8.5 ms of host launches even for a tiny model (measured on an H200: a
    lone request of a 2-layer model decoded 120-170 tok/s batched, 1,800-3,200 alone), so auto
    does not batch there.

    >>> from types import SimpleNamespace as NS
    >>> c = NS(graphs="auto", kernels="auto")
    >>> eager_steps(c, NS(head_dim=128, qk_norm=False)) is None
    True
    >>> eager_steps(c, NS(head_dim=8, qk_norm=False))
    'head_dim 8: the paged kernel takes powers of two from 16'
    >>> eager_steps(c, NS(head_dim=128, qk_norm=True)) is None  # (qwen3: the rotary kernel takes its norms)
    True
    >>> eager_steps(NS(graphs="off", kernels="auto"), NS(head_dim=128, qk_norm=False))
    '--graphs off'
    """
    if cfg.graphs == "off" or cfg.kernels == "off":
        return "--graphs off" if cfg.graphs == "off" else "--kernels off"
    hd = mcfg.head_dim
    if hd < 16 or hd & (hd - 1):
        return f"head_dim {hd}: the paged kernel takes powers of two from 16"
    return None


def resolve_max_batch(max_batch: int | None, cfg, mcfg) -> int:
    """--max-batch as given, or `auto` (None) decided on the device this process runs the engine
    on (`auto_max_batch`), with one stderr note when it batches."""
    if max_batch is not None:
        return max_batch
    import sys  # noqa: PLC0415

    from ..device import resolve_device  # noqa: PLC0415 (torch: only once an engine is opened here)

    b, why = auto_max_batch(cfg, mcfg, resolve_device(cfg.device).type)
    if b > 1:
        print(f"memra-dist: note: --max-batch auto: {b} requests at once on {why} (--max-batch 1: one at a time)",
              file=sys.stderr)
    return b


def check_batchable(cfg, mcfg, max_batch: int, draft=None) -> None:
    """One line for what --max-batch > 1 does not run yet."""
    if not 1 <= max_batch <= MAX_BATCH:
        raise UserError(f"--max-batch must be in [1, {MAX_BATCH}] (got {max_batch})")
    if max_batch == 1:
        return
    if cfg.drafter not in BATCHABLE_DRAFTERS:
        raise UserError(f"--max-batch > 1 takes --drafter {', '.join(BATCHABLE_DRAFTERS)} for now "
                        f"(got {cfg.drafter})")
    for what, c in (("model", mcfg), ("draft model", draft)):
        if c is not None and c.arch not in BATCHABLE_FAMILIES:
            raise UserError(f"--max-batch > 1 runs the {', '.join(BATCHABLE_FAMILIES)} families for now "
                            f"(the {what} is {c.arch})")
