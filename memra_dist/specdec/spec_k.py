"""K by goodput (pure: no tensors): how many drafts each request of a batched step verifies.

A step's time grows with its rows; a request's tokens from a round grow with its drafts only
as far as they are accepted. So each step, for the requests it will hold, pick the K_i (0 ..
the request's upper bound) that maximize the step's expected tokens per second:

    goodput(K) = sum_i (1 + E_i(K_i)) / T(sum_i (1 + K_i))

E_i(k) is request i's expected accepted drafts among k: sum over m = 1..k of the chance the
first m are all accepted, from its running acceptance per draft position (`Acceptance`: an
exponential average per position, started optimistic so that a new request drafts and is
measured). T(rows) is the step's time for that many rows: a line fitted online to the steps
the engine ran (`StepCost`: rows against measured time, exponentially weighted least
squares), plus the drafter's time per drafted token. `choose` raises one K_i at a time, the
one whose next draft adds the most goodput, while any adds some; a request whose drafts are
rarely accepted, or a step whose rows cost more than their tokens bring, stays at K = 0
(plain decoding for that request: one row).

>>> a = Acceptance(4)
>>> round(a.expected(4), 3)   # the optimistic start: 0.8 per position
2.362
>>> for _ in range(30): a.update(4, 0)   # never accepted
>>> round(a.expected(4), 3) < 0.01
True
>>> c = StepCost(prior_ns=(1e6, 1e4))   # 1 ms a step + 10 us a row: rows are cheap
>>> good, bad = Acceptance(4, prior=0.9), Acceptance(4, prior=0.01)
>>> choose([(good, 4), (bad, 4)], c)
[4, 0]
>>> choose([(good, 4)], StepCost(prior_ns=(1e5, 1e6)))   # each row costs ten steps' base: plain
[0]
"""

from __future__ import annotations

__all__ = ["Acceptance", "StepCost", "choose"]


class Acceptance:
    """A request's running chance that its draft at position i is accepted, given the ones
    before it were: an exponential average per position (`alpha`), from `prior`."""

    def __init__(self, kmax: int, alpha: float = 0.3, prior: float = 0.8):
        self.p = [prior] * max(kmax, 0)
        self.alpha = alpha

    def update(self, k: int, j: int) -> None:
        """A round verified k drafts and accepted the first j: positions 0 .. j - 1 were
        accepted, position j (when j < k) rejected; later ones were not reached."""
        for i in range(min(k, j + 1, len(self.p))):
            self.p[i] += self.alpha * ((1.0 if i < j else 0.0) - self.p[i])

    def expected(self, k: int) -> float:
        """Expected accepted drafts among the first k."""
        out, run = 0.0, 1.0
        for i in range(min(k, len(self.p))):
            run *= self.p[i]
            out += run
        return out


class StepCost:
    """T(rows) ~ a + b * rows (ns), fitted to the steps seen, the recent ones weighted most
    (`decay` per step), starting from `prior_ns` = (a, b) weighted as `prior_steps` steps; plus
    `draft_ns` a drafted token (the drafter's share, an exponential average)."""

    def __init__(self, prior_ns: tuple[float, float] = (1e6, 1e4), prior_steps: float = 4.0, decay: float = 0.98):
        a, b = prior_ns
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        for rows in (1.0, 16.0):  # the prior as points of its line at 1 and 16 rows
            self._add(rows, a + b * rows, prior_steps / 2)
        self.draft_ns = 0.0

    def _add(self, x: float, y: float, w: float) -> None:
        self.n += w
        self.sx += w * x
        self.sy += w * y
        self.sxx += w * x * x
        self.sxy += w * x * y

    def observe(self, rows: int, ns: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy, self.sxx, self.sxy = (d * self.n, d * self.sx, d * self.sy, d * self.sxx,
                                                        d * self.sxy)
        self._add(float(rows), float(ns), 1.0)

    def observe_draft(self, tokens: int, ns: float, alpha: float = 0.2) -> None:
        if tokens > 0:
            self.draft_ns += alpha * (ns / tokens - self.draft_ns)

    def line(self) -> tuple[float, float]:
        """(a, b): the fitted base and per-row cost (b >= 0, a >= 0)."""
        var = self.sxx - self.sx * self.sx / self.n
        b = (self.sxy - self.sx * self.sy / self.n) / var if var > 1e-9 else 0.0
        b = max(b, 0.0)
        a = max((self.sy - b * self.sx) / self.n, 0.0)
        return a, b

    def predict(self, rows: int, drafted: int = 0) -> float:
        a, b = self.line()
        return a + b * rows + self.draft_ns * drafted


def choose(reqs: list[tuple[Acceptance, int]], cost: StepCost) -> list[int]:
    """Each request's K for the next step (0 .. its bound), by greedy ascent of the step's
    expected tokens per ns (the module doc). Every added draft costs the same (one row and one
    drafted token), and a request's gains shrink with its K (each is a product of one more
    chance), so the ascent takes the gains largest first while one still raises the rate:
    O(drafts log drafts), the cost line read once."""
    a, b = cost.line()
    step = b + cost.draft_ns  # what one more draft adds to the step
    tokens = float(len(reqs))  # each request's one sure token
    t = max(a + b * len(reqs), 1.0)  # (ns; a free step still ranks its drafts)
    gains = []
    for i, (acc, bound) in enumerate(reqs):
        run = 1.0
        for m in range(min(bound, len(acc.p))):
            run *= acc.p[m]
            gains.append((-run, m, i))  # (largest first; then the request's lower K first)
    gains.sort()
    ks = [0] * len(reqs)
    for g, _m, i in gains:
        if (tokens - g) * t <= tokens * (t + step) * (1 + 1e-9):
            break  # (tokens + gain) / (t + step) no longer beats tokens / t
        tokens, t = tokens - g, t + step
        ks[i] += 1
    return ks
