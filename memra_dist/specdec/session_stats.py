"""A request's counts (tokens, rounds, drafted, accepted, the prompt rows shared from a prefix
cache) and its times (start, first token, end), as `SpecSession.stats` keeps them and
`as_dict` reports them in each result's `stats`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["SessionStats"]


@dataclass
class SessionStats:
    tokens: int = 0  # generated tokens (the anchor included)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    bursts: int = 0
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0  # the first token drawn (prefill, cache and graph set-up before it)
    t_end: float = 0.0
    cached: int = 0  # prompt rows its prefill did not run: shared from the engine's prefix cache

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.tokens - 1) / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        """tok_per_s is the decode rate the caller sees after the first token (tokens after
        it over the time since it); ttft_ms is the time to that first token; seconds is all."""
        end = self.t_end or time.perf_counter()
        wall = end - self.t_start
        first = self.t_first or self.t_start
        decode = end - first
        return {"tokens": self.tokens, "seconds": round(wall, 4), "ttft_ms": round((first - self.t_start) * 1e3, 2),
                "tok_per_s": round((self.tokens - 1) / decode, 2) if decode > 0 and self.tokens > 1 else 0.0,
                "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(self.acceptance, 4), "tokens_per_round": round(self.tokens_per_round, 3),
                "cached_tokens": self.cached}
