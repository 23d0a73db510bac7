"""How our Triton kernels pick their launch configs: `autotune(configs, key, name=...)` is
`triton.autotune` with what a fresh machine's first token needs.

- A shipped table first (kernels/tuned_table.py: `kernels/tuned/<gpu>.json`, tuned by
  benchmarks/tune_kernels.py): a key it has takes its config, with nothing benchmarked. A
  fresh H200 used to spend most of the 8B shape's 50 s first token compiling and
  benchmarking every config of every (shape, flags) key.
- A key the table lacks (another GPU, another shape) takes a heuristic config at once: the
  first config the kernel's own pruning keeps (each kernel lists its configs with the one it
  favours first; gemm_rows' `small_first` gives a tiny weight that one only). Nothing is
  benchmarked on a user's request unless tuning is asked for.
- Tuning on request: `MEMRA_TUNE=1` (memra_dist/env.py) benchmarks the keys the table lacks,
  `MEMRA_TUNE=all` every key (the table unread); `forced(mode)` does the same in-process
  (benchmarks/tune_kernels.py, tests). Triton's autotuner then works as it did: the timings
  persist on disk (`cache_results`, in Triton's cache directory next to the compiled kernels,
  so a second tuning process reads the winners) and each config's benchmark is short
  (`WARMUP_MS`, `REP_MS`: a decode GEMV runs in microseconds, so 20 ms is thousands of
  launches).

The choice runs as Triton's `early_config_prune`, called once per key not yet in the
autotuner's cache with (configs, positional args by name, keyword args): a key left ONE
config is not benchmarked. `TALLY` counts what this process's keys cost: `configs`
benchmarked and their seconds in `tune_s` (timed in our bench function), `cached` keys read
from Triton's disk cache (through its autotuning listener, where this Triton has one),
`shipped` keys answered from the table and `heuristic` keys given the heuristic config;
`FAMILIES` the same per kernel name (shipped / heuristic / tuned keys). The first-token
profile reports them (phase/first_token.py). `TUNERS` holds each named autotuner
(benchmarks/tune_kernels.py reads their `.cache` winners). Older Triton without
`cache_results` / `do_bench` keeps its own behaviour (the arguments it lacks are not passed)."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import triton

from . import tuned_table

__all__ = ["autotune", "TALLY", "FAMILIES", "TUNERS", "WARMUP_MS", "REP_MS", "tune_kwargs", "tune_mode", "forced",
           "device_slug", "table_key", "entry_of"]

WARMUP_MS, REP_MS = 5, 20
TALLY = {"configs": 0, "tune_s": 0.0, "cached": 0, "shipped": 0, "heuristic": 0}
FAMILIES: dict[str, dict[str, int]] = {}  # kernel name -> {"shipped", "heuristic", "tuned"} keys
TUNERS: dict[str, object] = {}  # kernel name -> its triton Autotuner
MODES = ("off", "missing", "all")
_FORCED: list[str] = []  # forced(): a stack of modes, the last wins over MEMRA_TUNE


def device_slug(named_args) -> str:
    """The table slug of the device the launch's first tensor lives on (tests monkeypatch this)."""
    dev = next((v.device for v in named_args.values() if hasattr(v, "device")), None)
    return tuned_table.device_slug(dev)


def tune_mode() -> str:
    """off (the table, else the heuristic), missing (the table, else benchmark), all (benchmark)."""
    if _FORCED:
        return _FORCED[-1]
    from ..env import environment  # noqa: PLC0415

    return environment().tune


@contextmanager
def forced(mode: str = "all"):
    """Tuning mode `mode` for the calls in the block, whatever MEMRA_TUNE says."""
    if mode not in MODES:
        raise ValueError(f"tuning mode {mode!r}: expected one of {MODES}")
    _FORCED.append(mode)
    try:
        yield
    finally:
        _FORCED.pop()


def table_key(names, named_args, kwargs) -> str:
    """The table's key of a launch: its values of the key names (positional or keyword), then
    the first tensor argument's dtype (Triton's own key appends every tensor's dtype)."""
    values = []
    for n in names:
        if n in named_args:
            values.append(named_args[n])
        elif n in kwargs:
            values.append(kwargs[n])
        else:
            raise KeyError(f"autotune key {n!r} is neither a positional nor a keyword argument of this launch")
    dtype = next((v.dtype for v in named_args.values() if hasattr(v, "dtype")), "none")
    return tuned_table.key_string(names, values, dtype)


def entry_of(config) -> dict:
    """A triton.Config as a table entry: its kwargs, num_warps, num_stages."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


class _Choose:
    """The early prune of one named kernel: the table's config, else (tuning off) the heuristic
    one, else the configs the kernel's own `prune` keeps, for Triton to benchmark."""

    def __init__(self, name: str, key, configs, prune=None):
        self.name, self.key, self.prune = name, list(key), prune
        self.params = set(configs[0].kwargs) if configs else set()
        self._made: dict[tuple, triton.Config] = {}
        self.benched: set[str] = set()  # table keys handed to Triton's benchmark (benchmarks/tune_kernels.py)

    def _count(self, what: str) -> None:
        fam = FAMILIES.setdefault(self.name, {"shipped": 0, "heuristic": 0, "tuned": 0})
        fam[what] += 1
        if what in TALLY:
            TALLY[what] += 1

    def _config(self, entry: dict) -> triton.Config:
        kw = {k: v for k, v in entry.items() if k in self.params}
        sig = (tuple(sorted(kw.items())), entry["num_warps"], entry["num_stages"])
        if sig not in self._made:
            self._made[sig] = triton.Config(kw, num_warps=entry["num_warps"], num_stages=entry["num_stages"])
        return self._made[sig]

    def __call__(self, configs, named_args, **kwargs):
        mode = tune_mode()
        if mode != "all":
            entry = tuned_table.lookup(device_slug(named_args), self.name, table_key(self.key, named_args, kwargs),
                                       self.params)
            if entry is not None:
                self._count("shipped")
                return [self._config(entry)]
        kept = self.prune(configs, named_args, **kwargs) if self.prune is not None else configs
        if mode == "off" or len(kept) == 1:
            self._count("heuristic")
            return list(kept[:1])
        self._count("tuned")
        self.benched.add(table_key(self.key, named_args, kwargs))
        return kept


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


def autotune(configs, key, prune=None, name: str | None = None):
    """`triton.autotune(configs=configs, key=key)` that reads the shipped table (as kernel
    `name`, default the kernel function's name), else takes the heuristic config, and tunes
    only when asked (the module doc); `prune(configs, named_args, **kwargs)`: the kernel's own
    early config pruning, applied to what a tuned key benchmarks and to the heuristic's pick."""
    _install_listener()

    def wrap(fn):
        base = fn
        while not inspect.isfunction(base) and hasattr(base, "fn"):
            base = base.fn
        kname = name or getattr(base, "__name__", "kernel")
        choose = _Choose(kname, key, configs, prune)
        tuner = triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": choose},
                                **tune_kwargs())(fn)
        tuner.memra_name, tuner.memra_choose = kname, choose
        TUNERS[kname] = tuner
        return tuner

    return wrap
