"""How our Triton kernels pick their launch configs: `autotune(configs, key)` is
`triton.autotune` with two changes that matter for a fresh process's first token.

- The timings persist on disk (`cache_results`, in Triton's cache directory next to the
  compiled kernels): a second process reads the winner instead of benchmarking every config
  again. Before this, each process re-tuned every (shape, flags) key at its first capture:
  ~22 configs x ~0.13 s (Triton's default 25 ms warm-up + 100 ms of repetitions each) per
  key, most of the 11-61 s a tiny model waited for its first token.
- A shorter benchmark (`WARMUP_MS`, `REP_MS`): a decode GEMV runs in microseconds, so 20 ms of
  repetitions is still thousands of launches per config, which is what the cold (first ever)
  tuning costs.

`TALLY` counts what tuning cost this process: `configs` benchmarked and their seconds in
`tune_s` (timed in our bench function, so on every Triton that takes one), and `cached`
keys read from disk (through Triton's autotuning listener, where this Triton has one; 0
otherwise); the first-token profile reports them (phase/first_token.py). Older Triton
without `cache_results` / `do_bench` keeps its own behaviour (the arguments it lacks are
not passed)."""

from __future__ import annotations

import inspect

import triton

__all__ = ["autotune", "TALLY", "WARMUP_MS", "REP_MS", "tune_kwargs"]

WARMUP_MS, REP_MS = 5, 20
TALLY = {"configs": 0, "tune_s": 0.0, "cached": 0}


def _bench(kernel_call, quantiles):
    """One config's benchmark (Triton calls it per config of a key it tunes), counted."""
    import time  # noqa: PLC0415

    import triton.testing  # noqa: PLC0415

    t0 = time.perf_counter()
    try:
        return triton.testing.do_bench(kernel_call, warmup=WARMUP_MS, rep=REP_MS, quantiles=quantiles)
    finally:
        TALLY["configs"] += 1
        TALLY["tune_s"] += time.perf_counter() - t0


def _listen(fn=None, key=None, best_config=None, configs_timings=None, duration=None, cache_hit=False, **_):
    if cache_hit:
        TALLY["cached"] += 1


def _install_listener() -> None:
    knobs = getattr(triton, "knobs", None)
    tuning = getattr(knobs, "autotuning", None) if knobs is not None else None
    if tuning is not None and hasattr(tuning, "listener") and tuning.listener is None:
        tuning.listener = _listen


def tune_kwargs() -> dict:
    """The arguments this Triton's autotune takes of ours: the on-disk cache and the short bench."""
    params = inspect.signature(triton.autotune).parameters
    kw = {}
    if "cache_results" in params:
        kw["cache_results"] = True
    if "do_bench" in params:
        kw["do_bench"] = _bench
    return kw


def autotune(configs, key, prune=None):
    """`triton.autotune(configs=configs, key=key)` with the on-disk timings and the short bench;
    `prune(configs, named_args, **kwargs)`: Triton's early config pruning (a key it leaves one
    config is not benchmarked)."""
    _install_listener()
    extra = {"prune_configs_by": {"early_config_prune": prune}} if prune is not None else {}
    return triton.autotune(configs=configs, key=key, **tune_kwargs(), **extra)
