"""The once-per-request first-token profile (`MEMRA_SPEC_PROF=1`): the
buckets between the session's start and the first streamed token that this engine's route runs, each a wall interval bounded by
stream drains on both sides (device-inclusive, additive). A bucket the route never runs
stays 0.0 (e.g. `capture`: there is no prompt-boundary prefix capture here).

Depth fields of the tap-drafter path (the seed's names), each a drained SHARE of the bucket
it sits in (so they sum to at most that bucket):
- inside `cache_alloc`: `cache_kv_alloc_ms`, the target's cache states; `graph_captures` step
  graphs captured (one per decode / verify row count, and their level-2 twins), the first in
  `graph_first_capture_ms` (it pays torch.compile and the kernels' JIT, or reads their
  on-disk caches), the rest in `graph_capture_ms` (0 captures: an engine reusing its cache);
  the same captures split into their eager warm-up runs, `graph_warmup_ms` (kernel JIT,
  Triton autotuning and torch.compile land there), and their recordings, `graph_record_ms`;
  per row count in `graph_rows_ms` (`rows:ms/...`);
- `kernel_tune_configs` / `kernel_tune_ms`: Triton autotuner configs benchmarked (and their
  ms) between the session's start and the first token, `kernel_tune_cached` keys read from
  the on-disk cache instead (kernels/tuning.py; inside the captures' warm-ups, the
  drafter's included); the profile line's `kernel_keys` (only when some key was met) splits
  the keys met over the same window per kernel family: `shipped` (the tuned table's config),
  `heuristic` (a default config, nothing benchmarked: a key the table lacks) and `tuned`
  (benchmarked or read from the on-disk cache: MEMRA_TUNE);
- inside `cache_alloc`: `tap_sink_alloc_ms` / `tap_sink_mb`, the target's tap sink (the
  session's sink size; a sink reused from the previous session at the same capacity takes
  ~0 ms);
- inside `prime`: `prime_chunks` prefill forwards over `prime_rows` prompt rows (each chunk's
  drained time is kept: `prime_chunk_ms`, with its rows in `prime_chunk_rows`, one
  `ttft.prime.chunk` span each; the line prints their mean and max); `prime_tap_dtoh_ms`,
  the target prime's tap readbacks: 0 on `arm=device`, where the taps never leave the device
  (the seed's eager arm counted host DtoH copies);
- inside `draft_prime`: `draft_prime_h2d_ms` (tap rows host -> device: 0 on `arm=device`),
  `draft_prime_feat_ms` (the feature GEMM: DFlash's fc + hidden_norm over the rows; MTP has
  none), `draft_prime_kv_ms` (per-layer k/v projections + cache writes), over
  `draft_prime_rows` rows in `draft_prime_chunks` ingest calls; `draft_prime_arm` is
  `device` for a tap drafter, `-` for a drafter that reads no taps.
The runner and the drafter stamp them only when the session lends them a `DepthTimer`
(`lend`), i.e. only with the profile on: no drain, no clock read otherwise.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from ..tracing.conventions import TTFT_BUCKETS

__all__ = ["FirstTokenProf", "DepthTimer", "lend", "DEPTH_FIELDS", "DEVICE_ARM", "DEVICE_ARM_NOTE", "kernel_key_counts",
           "keys_since"]

DEVICE_ARM = "device"  # the taps stay on the target's device: no DtoH in the prime, no HtoD in the ingest
DEVICE_ARM_NOTE = " (device arm: the taps never leave the device, so no tap DtoH in the prime and no HtoD in the ingest)"
# the depth fields in line / attribute order (the seed's names)
DEPTH_FIELDS = ("cache_kv_alloc_ms", "graph_captures", "graph_first_capture_ms", "graph_capture_ms", "graph_warmup_ms",
                "graph_record_ms", "graph_rows_ms", "kernel_tune_configs", "kernel_tune_ms", "kernel_tune_cached", "tap_sink_alloc_ms", "tap_sink_mb", "prime_chunks", "prime_rows", "prime_chunk_mean_ms",
                "prime_chunk_max_ms", "prime_tap_dtoh_ms", "draft_prime_h2d_ms", "draft_prime_feat_ms",
                "draft_prime_kv_ms", "draft_prime_rows", "draft_prime_chunks", "draft_prime_arm")


def kernel_key_counts() -> dict[str, dict[str, int]]:
    """kernels/tuning.py's FAMILIES (kernel family -> shipped / heuristic / tuned keys) so far; {}
    while no kernel module is loaded (nothing imports Triton for this)."""
    mod = sys.modules.get("memra_dist.kernels.tuning")
    return {f: dict(c) for f, c in mod.FAMILIES.items()} if mod is not None else {}


def keys_since(before: dict) -> dict[str, dict[str, int]]:
    """The keys met per kernel family since `before` (a kernel_key_counts()), families with none left out."""
    out = {}
    for fam, c in kernel_key_counts().items():
        d = {k: v - before.get(fam, {}).get(k, 0) for k, v in c.items()}
        if any(d.values()):
            out[fam] = d
    return out


@dataclass
class FirstTokenProf:
    ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TTFT_BUCKETS, 0.0))
    t0_ns: int = 0  # perf_counter ns at the first bucket's start (for spans)
    round1_t0_ns: int = 0  # perf_counter ns at round 1's entry
    first_round_tokens: int = 0
    first_burst_ms: float = 0.0
    first_burst_hook_ms: float = 0.0
    first_burst_rounds: int = 0
    first_burst_tokens: int = 0
    draft_kv_mb: float = 0.0
    cached_tokens: int = 0  # the prompt's leading rows shared from a batched engine's prefix cache (not primed)
    free_mb_before: dict[str, int] = field(default_factory=dict)
    free_mb_after: dict[str, int] = field(default_factory=dict)
    # ---- depth (the module doc) ----
    cache_kv_alloc_ms: float = 0.0
    graph_captures: int = 0
    graph_first_capture_ms: float = 0.0
    graph_capture_ms: float = 0.0
    graph_warmup_ms: float = 0.0  # the captures' eager warm-up runs (kernel JIT, autotuning, compile land here)
    graph_record_ms: float = 0.0  # the captures' recordings
    graph_row_ms: dict[int, float] = field(default_factory=dict)  # rows -> its captures' ms (graph_rows_ms)
    kernel_tune_configs: int = 0  # Triton autotuner configs benchmarked between the session's start and its first token
    kernel_tune_ms: float = 0.0  # their benchmarking (kernels/tuning.py), inside the captures' warm-ups
    kernel_tune_cached: int = 0  # keys read from the on-disk tuning cache instead
    tap_sink_alloc_ms: float = 0.0
    tap_sink_mb: float = 0.0
    prime_tap_dtoh_ms: float = 0.0
    draft_prime_h2d_ms: float = 0.0
    draft_prime_feat_ms: float = 0.0
    draft_prime_kv_ms: float = 0.0
    draft_prime_rows: int = 0
    draft_prime_chunks: int = 0
    draft_prime_arm: str = "-"
    prime_chunk_rows: list[int] = field(default_factory=list)  # the target prime's chunks, in order
    prime_chunk_ms: list[float] = field(default_factory=list)  # each chunk's drained time (pp > 1: its results' arrival)
    # kernel family -> keys met between the session's start and its first token: shipped /
    # heuristic / tuned (the module doc; the session sets it with keys_since)
    kernel_keys: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def prime_chunks(self) -> int:
        return len(self.prime_chunk_rows)

    @property
    def prime_rows(self) -> int:
        return sum(self.prime_chunk_rows)

    @property
    def prime_chunk_mean_ms(self) -> float:
        return sum(self.prime_chunk_ms) / len(self.prime_chunk_ms) if self.prime_chunk_ms else 0.0

    @property
    def prime_chunk_max_ms(self) -> float:
        return max(self.prime_chunk_ms, default=0.0)

    @property
    def graph_rows_ms(self) -> str:
        """Each captured row count's ms, as `rows:ms` joined by `/` (`-` when nothing was captured)."""
        return "/".join(f"{r}:{ms:.1f}" for r, ms in sorted(self.graph_row_ms.items())) or "-"

    def depth(self) -> dict[str, float | int | str]:
        return {f: getattr(self, f) for f in DEPTH_FIELDS}

    def depth_line(self) -> str:
        fmt = lambda f, v: (f"{v}" if isinstance(v, str) else f"{v:.3f}" if f.endswith("_ms")  # noqa: E731
                            else f"{v:.1f}" if f.endswith("_mb") else f"{v}")
        line = " ".join(f"{f}={fmt(f, v)}" for f, v in self.depth().items())
        return line + (DEVICE_ARM_NOTE if self.draft_prime_arm == DEVICE_ARM else "")

    def kernel_keys_field(self) -> str:
        """` kernel_keys=gemv:shipped=3/heuristic=0/tuned=0,...` ('' when no key was met)."""
        fams = ",".join(f"{f}:" + "/".join(f"{k}={v}" for k, v in c.items())
                        for f, c in sorted(self.kernel_keys.items()))
        return f" kernel_keys={fams}" if fams else ""

    def line(self) -> str:
        buckets = " ".join(f"{b}={self.ms[b]:.3f}" for b in TTFT_BUCKETS)
        fmt = lambda d: ",".join(f"{k}:{v}" for k, v in d.items()) or "-"  # noqa: E731
        return (
            f"{buckets} | first_round_tokens={self.first_round_tokens} "
            f"first_burst={self.first_burst_ms:.3f}ms hook={self.first_burst_hook_ms:.3f}ms "
            f"rounds={self.first_burst_rounds} tokens={self.first_burst_tokens} "
            f"draft_kv_mb={self.draft_kv_mb:.1f} free_mb_before={fmt(self.free_mb_before)} "
            f"free_mb_after={fmt(self.free_mb_after)}{self.kernel_keys_field()} | {self.depth_line()}"
        )


class DepthTimer:
    """What the session lends the runner (tap sink) and the drafter (prime split) while the
    profile is on: `stamp` is the phase clock's (drains, then reads the clock), so each
    sub-bucket is a drained wall interval inside its bucket."""

    def __init__(self, prof: FirstTokenProf, stamp: Callable[[], int]):
        self.prof, self.stamp = prof, stamp

    def lap(self, name: str, since_ns: int) -> int:
        """Adds the drained interval since `since_ns` to field `name`; returns the new stamp."""
        now = self.stamp()
        setattr(self.prof, name, getattr(self.prof, name) + (now - since_ns) / 1e6)
        return now

    def chunk(self, rows: int, arm: str = DEVICE_ARM) -> None:
        """One drafter ingest call of `rows` rows inside the prime."""
        self.prof.draft_prime_rows += rows
        self.prof.draft_prime_chunks += 1
        self.prof.draft_prime_arm = arm


@contextmanager
def lend(obj, timer: DepthTimer | None):
    """Hands `obj` the timer (its `ttft_depth`) for the calls in the block, when the profile
    is on and `obj` stamps depth fields; otherwise does nothing."""
    if timer is None or not hasattr(obj, "ttft_depth"):
        yield
        return
    obj.ttft_depth = timer
    try:
        yield
    finally:
        obj.ttft_depth = None
