"""The terminal's phase-share table: where the traced rounds' time went, summed over bursts."""

from __future__ import annotations

from ..tracing.conventions import PHASES
from .lines import sub_totals
from .records import BurstRecord

__all__ = ["ShareTable"]


class ShareTable:
    def __init__(self):
        self.ns = [0] * len(PHASES)
        self.sub: dict[str, int] = {}
        self.n_rounds = 0

    def burst(self, rec: BurstRecord) -> None:
        for i, v in enumerate(rec.totals_ns()):
            self.ns[i] += v
        self.n_rounds += rec.n
        if any(r.sub_ns for r in rec.live()):
            for key, v in sub_totals(rec).items():
                self.sub[key] = self.sub.get(key, 0) + v

    def first_token(self, prof) -> None:
        pass

    def rounds(self, log, final) -> None:  # the profile's rows are printed by LineSink
        pass

    def table(self) -> str:
        total = sum(self.ns) or 1
        lines = [f"phase shares over {self.n_rounds} traced rounds (drained: shares, not untraced walls)",
                 f"  {'phase':<10}{'total ms':>12}{'per round':>12}{'share':>9}"]
        rows = list(zip(PHASES, self.ns))
        if self.sub:
            rows += [(f"  verify.{k}", self.sub[k]) for k in ("kda", "scan", "mla", "attn", "ffn", "rest")]
        for name, ns in rows:
            bar = "#" * int(round(30 * ns / total))
            lines.append(f"  {name:<10}{ns / 1e6:>12.2f}{ns / 1e6 / max(self.n_rounds, 1):>12.3f}{100 * ns / total:>8.1f}% {bar}")
        return "\n".join(lines)
