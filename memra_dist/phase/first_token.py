"""The once-per-request first-token profile (`MEMRA_SPEC_PROF=1`): the
buckets between the session's start and the first streamed token that this engine's route runs, each a wall interval bounded by
stream drains on both sides (device-inclusive, additive). A bucket the route never runs
stays 0.0 (e.g. `capture`: there is no prompt-boundary prefix capture here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tracing.conventions import TTFT_BUCKETS

__all__ = ["FirstTokenProf"]


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
    free_mb_before: dict[str, int] = field(default_factory=dict)
    free_mb_after: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        buckets = " ".join(f"{b}={self.ms[b]:.3f}" for b in TTFT_BUCKETS)
        fmt = lambda d: ",".join(f"{k}:{v}" for k, v in d.items()) or "-"  # noqa: E731
        return (
            f"{buckets} | first_round_tokens={self.first_round_tokens} "
            f"first_burst={self.first_burst_ms:.3f}ms hook={self.first_burst_hook_ms:.3f}ms "
            f"rounds={self.first_burst_rounds} tokens={self.first_burst_tokens} "
            f"draft_kv_mb={self.draft_kv_mb:.1f} free_mb_before={fmt(self.free_mb_before)} "
            f"free_mb_after={fmt(self.free_mb_after)}"
        )
