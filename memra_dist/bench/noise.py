"""Pure noise arithmetic of the benchmark: a measured figure is its median over repeats plus
the range of those repeats, ranges carry through ratios and sums (worst case), and a verdict
against a target is pass / miss only when the whole range is on one side of the target.

Spread of n repeats: the range [lo, hi] after dropping n // 10 samples at each end (so for
n < 10, min..max; for the hop's hundreds of ping-pongs, roughly the 10th..90th percentile).
A figure derived from several measured ones gets the worst-case range: a / b spans
[a.lo / b.hi, a.hi / b.lo], a * b spans [a.lo * b.lo, a.hi * b.hi] (all positive).

Statuses (evaluate() in report.py):
    pass          the whole range is on the target's side
    miss          the whole range is on the wrong side
    within noise  the range straddles the target (or the median lies past a physical bound,
                  but only within the range)
    impossible / unreliable   the whole range lies past a physical bound (a fraction of the
                  ideal speedup above 1; a trace overhead below 0): a timing artefact, flagged
    off label     a replay row whose measured acceptance is off its label by > ACC_TOL
    n/a (why)     not measured, or not applicable
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fig", "trimmed_range", "verdict", "ACC_TOL", "fig_row", "ratio_row", "runs_fig"]

ACC_TOL = 0.05  # a replay row is "off label" when |measured acceptance - label| exceeds this


def _median(xs) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def trimmed_range(xs) -> tuple[float, float]:
    """(lo, hi) of xs after dropping n // 10 samples at each end.

    >>> trimmed_range([3, 1, 2])
    (1, 3)
    >>> trimmed_range(list(range(20)))   # drops 0, 1 and 18, 19
    (2, 17)
    """
    s = sorted(xs)
    if not s:
        raise ValueError("range of nothing")
    cut = len(s) // 10
    return s[cut], s[len(s) - 1 - cut]


@dataclass(frozen=True)
class Fig:
    """A figure: `value` (median of its repeats), [lo, hi] (their range) and n (repeats; for a
    derived figure, the fewest repeats among its inputs). lo / hi None = spread not recorded."""

    value: float
    lo: float | None
    hi: float | None
    n: int

    @classmethod
    def of(cls, xs) -> "Fig":
        xs = list(xs)
        lo, hi = trimmed_range(xs)
        return cls(_median(xs), lo, hi, len(xs))

    @classmethod
    def exact(cls, v: float) -> "Fig":
        """A value without noise (a constant, an acceptance that every repeat shares)."""
        return cls(v, v, v, 1 << 30)

    @classmethod
    def from_json(cls, value, rng, n=None) -> "Fig | None":
        """Back from a result's figure + its "_range" key ([lo, hi]) + repeat count (None: 2 when
        a range is recorded, else 1)."""
        if value is None:
            return None
        ok = isinstance(rng, (list, tuple)) and len(rng) == 2 and None not in rng
        lo, hi = rng if ok else (None, None)
        n = int(n) if isinstance(n, (int, float)) else (2 if ok else 1)
        return cls(value, lo, hi, n)

    @property
    def known(self) -> bool:
        return self.lo is not None and self.hi is not None and self.n >= 2

    def __truediv__(self, o: "Fig | float") -> "Fig":
        o = o if isinstance(o, Fig) else Fig.exact(o)
        if not (self.known and o.known):
            return Fig(self.value / o.value, None, None, min(self.n, o.n))
        return Fig(self.value / o.value, self.lo / o.hi, self.hi / o.lo, min(self.n, o.n))

    def __mul__(self, o: "Fig | float") -> "Fig":
        o = o if isinstance(o, Fig) else Fig.exact(o)
        if not (self.known and o.known):
            return Fig(self.value * o.value, None, None, min(self.n, o.n))
        return Fig(self.value * o.value, self.lo * o.lo, self.hi * o.hi, min(self.n, o.n))

    def __add__(self, o: "Fig | float") -> "Fig":
        o = o if isinstance(o, Fig) else Fig.exact(o)
        if not (self.known and o.known):
            return Fig(self.value + o.value, None, None, min(self.n, o.n))
        return Fig(self.value + o.value, self.lo + o.lo, self.hi + o.hi, min(self.n, o.n))

    def map(self, f) -> "Fig":
        """f applied to value, lo and hi (f must be increasing)."""
        if not self.known:
            return Fig(f(self.value), None, None, self.n)
        return Fig(f(self.value), f(self.lo), f(self.hi), self.n)

    def rng(self, nd: int = 4) -> list[float] | None:
        """[lo, hi] rounded, for the JSON ("<figure>_range" keys); None when not recorded."""
        return [round(self.lo, nd), round(self.hi, nd)] if self.known else None

    def spread_pct(self) -> float | None:
        """Relative half-range, %: (hi - lo) / 2 / |value| * 100."""
        if not self.known or self.value == 0:
            return None
        return (self.hi - self.lo) / 2 / abs(self.value) * 100


def verdict(f: Fig | None, op: str, thr: float, bound: tuple | None = None) -> str:
    """Status of figure f against `op thr` (op ">=" or "<="). bound = (op, limit, flag, why):
    the physically possible side of `limit` (e.g. (">=", 0, "unreliable", ...) for an overhead);
    a median past it is never a pass.

    >>> verdict(Fig(2.0, 1.0, 3.0, 3), "<=", 5.0)
    'pass'
    >>> verdict(Fig(4.0, 3.0, 6.0, 3), "<=", 5.0)
    'within noise'
    """
    if f is None:
        return "n/a (not measured)"
    if not f.known:
        return f"unreliable (no spread: {'fewer than 2 repeats' if f.n < 2 else 'range not recorded'})"
    if bound is not None:
        bop, lim, flag, why = bound
        past = (f.value < lim) if bop == ">=" else (f.value > lim)
        if past:
            wholly = (f.hi < lim) if bop == ">=" else (f.lo > lim)
            return f"{flag} ({why}, beyond the noise)" if wholly else f"within noise ({why} only within the noise)"
    if op == ">=":
        return "pass" if f.lo > thr else ("miss" if f.hi < thr else "within noise")
    return "pass" if f.hi < thr else ("miss" if f.lo > thr else "within noise")


def runs_fig(row: dict | None, key: str) -> Fig | None:
    """A bench row's `key` over its timed runs (`row["runs"]`), as a Fig; None where none has it."""
    xs = [r[key] for r in (row or {}).get("runs", []) if r.get(key)]
    return Fig.of(xs) if xs else None


def fig_row(f: Fig) -> list:
    """[value, lo, hi, n], rounded: how the bench's sections store a figure with its range."""
    return [round(f.value, 3), None if f.lo is None else round(f.lo, 3), None if f.hi is None else round(f.hi, 3), f.n]


def ratio_row(a: Fig | None, b: Fig | None) -> list | None:
    """[value, lo, hi, n]: a / b with its worst-case range."""
    return None if a is None or b is None else fig_row(a / b)
