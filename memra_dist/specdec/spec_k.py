"""K by goodput (pure: no tensors): how many drafts each request of a batched step verifies.

A step's time grows with its rows; a request's tokens from a round grow with its drafts only
as far as they are accepted. So each step, for the requests it will hold, pick the K_i (0 ..
the request's upper bound) that maximize the step's expected tokens per second:

    goodput(K) = sum_i (1 + E_i(K_i)) / T(sum_i (1 + K_i))

E_i(k) is request i's expected accepted drafts among k: sum over m = 1..k of the chance the
first m are all accepted, from its running acceptance per draft position (`Acceptance`: an
exponential average per position). A new request starts from what the engine's earlier
requests' drafts were accepted at (`EngineAcceptance`, itself started optimistic so that the
first requests draft and are measured): where the drafter never pays (random drafts), new
requests start at K 0 instead of each paying a few rounds of drafts to learn it, and every
PROBE_EVERY-th new request starts optimistic again, so an engine whose drafts became worth it
finds out. T(rows) is the step's time for that many rows: a line fitted online to the steps
the engine ran (`StepCost`: rows against measured time, exponentially weighted least
squares), or where steps replay CUDA graphs the time of the rows' bucket; both start from the
steps timed as the engine opens (batching/calibrate.py). Plus, when anything is drafted, the
drafting's time: a fixed part and a part per drafted token, fitted the same way. `choose`
weighs the plans of the m largest gains, every m, and keeps the best; a request whose drafts are
rarely accepted, or a step whose rows cost more than their tokens bring, stays at K = 0
(plain decoding for that request: one row).

>>> a = Acceptance(4)
>>> round(a.expected(4), 3)   # the optimistic start: 0.8 per position
2.362
>>> for _ in range(60): a.update(4, 0)   # never accepted
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

from dataclasses import dataclass

__all__ = ["Acceptance", "EngineAcceptance", "StepCost", "Others", "choose", "PROBE_EVERY", "ALPHA", "SHADOW_ALPHA"]

PROBE_EVERY = 32  # every 32nd new request starts from the optimistic prior, whatever the engine learned

# A request's own average moves this much a round. Its K-0 rounds measure nothing, so a request
# that a few unlucky rounds put below what a draft costs stays at K 0 for good: at 0.3, 64 requests
# whose every draft position is accepted 0.8 of the time ran ~40 % of their rounds at K 0 on an
# H100 (DFlash replay: 6,164 steady tok/s against 8,175 at a fixed K of 4; EAGLE-3: 9,433 against
# 10,873), and the step-cost model, fed the same figures on the CPU, left 24 % of such rounds at
# K 0 (none at 0.1: tests/test_spec_k.py). A drafter that never pays is learned by the engine's
# average (EngineAcceptance), which every later request starts from, so learning it more slowly
# per request costs little there.
ALPHA = 0.1
# ... except the scores of a host drafter's K-0 rounds (batching/chain.py `shadow`): they come only
# while the request sits at K 0, one a round at no device cost, so they move it at the old rate
# and a request whose drafts start paying (a continuation that begins to repeat) drafts again
# within a few rounds.
SHADOW_ALPHA = 0.3


class Acceptance:
    """A request's running chance that its draft at position i is accepted, given the ones
    before it were: an exponential average per position (`alpha`, ALPHA), from `prior` (one chance
    for every position, or one per position). `parent`: the engine's average
    (EngineAcceptance), which every update feeds too."""

    def __init__(self, kmax: int, alpha: float = ALPHA, prior: float | list[float] = 0.8, parent=None):
        n = max(kmax, 0)
        self.p = list(prior[:n]) if isinstance(prior, list) else [prior] * n
        assert len(self.p) == n, "a prior per position covers every position"
        self.alpha = alpha
        self.parent = parent

    def update(self, k: int, j: int, alpha: float | None = None) -> None:
        """A round verified k drafts and accepted the first j: positions 0 .. j - 1 were
        accepted, position j (when j < k) rejected; later ones were not reached. `alpha`: this
        update's own rate (a K-0 round's unverified score, SHADOW_ALPHA)."""
        _ema(self.p, self.alpha if alpha is None else alpha, k, j)
        if self.parent is not None and k > 0:
            self.parent.update(k, j)

    def expected(self, k: int) -> float:
        """Expected accepted drafts among the first k."""
        out, run = 0.0, 1.0
        for i in range(min(k, len(self.p))):
            run *= self.p[i]
            out += run
        return out


def _ema(p: list[float], alpha: float, k: int, j: int) -> None:
    for i in range(min(k, j + 1, len(p))):
        p[i] += alpha * ((1.0 if i < j else 0.0) - p[i])


class EngineAcceptance:
    """The engine's acceptance per draft position over every request's rounds: at position i,
    the accepted share of the drafts that reached it, recent rounds weighted most (`decay` a
    round) over `prior` counted as `prior_rounds` rounds (so the first rounds move it at once
    and a long run remembers ~1 / (1 - decay) rounds). A new request's `Acceptance` starts there
    (`start`), except every `probe_every`-th, which starts from `prior`. A request keeps its own
    average while it runs, across its chains (`forget` as it leaves).

    >>> e = EngineAcceptance(probe_every=4)
    >>> for _ in range(40): e.update(4, 0)        # the first requests' drafts never accepted
    >>> [round(e.start(r, 4).expected(4), 2) for r in "abcd"]   # d: the 4th new one, a probe
    [0.07, 0.07, 0.07, 2.36]
    >>> e.start("a", 4) is e.start("a", 4)          # the same request keeps its own
    True
    """

    def __init__(self, decay: float = 0.98, prior: float = 0.8, prior_rounds: float = 2.0,
                 probe_every: int = PROBE_EVERY):
        self.decay, self.prior, self.prior_rounds = decay, prior, prior_rounds
        self.probe_every = max(int(probe_every), 1)
        self.acc: list[float] = []  # per position: accepted drafts (decayed), the prior's included
        self.seen: list[float] = []  # ... and drafts that reached it
        self.started = 0
        self._by_rid: dict = {}

    def update(self, k: int, j: int) -> None:
        """A round verified k drafts and accepted the first j (as Acceptance.update)."""
        while len(self.seen) < k:
            self.acc.append(self.prior * self.prior_rounds)
            self.seen.append(self.prior_rounds)
        for i in range(min(k, j + 1)):
            self.acc[i] = self.decay * self.acc[i] + (1.0 if i < j else 0.0)
            self.seen[i] = self.decay * self.seen[i] + 1.0

    def p(self, kmax: int) -> list[float]:
        """The chance per position 0 .. kmax - 1 (the prior where no draft reached it yet)."""
        return [self.acc[i] / self.seen[i] if i < len(self.seen) else self.prior for i in range(kmax)]

    def start(self, rid, kmax: int) -> Acceptance:
        a = self._by_rid.get(rid)
        if a is None:
            self.started += 1
            probe = self.started % self.probe_every == 0
            a = self._by_rid[rid] = Acceptance(kmax, prior=self.prior if probe else self.p(kmax), parent=self)
        elif len(a.p) < kmax:  # chained again with a larger bound: the positions it never had, the engine's
            a.p += self.p(kmax)[len(a.p):]
        return a

    def forget(self, rid) -> None:
        self._by_rid.pop(rid, None)


class _Line:
    """y ~ a + b * x, fitted to the points seen, the recent ones weighted most (`decay` a point),
    from prior points (x, y, weight)."""

    def __init__(self, prior: list[tuple[float, float, float]], decay: float):
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        for x, y, w in prior:
            self._add(x, y, w)

    def _add(self, x: float, y: float, w: float) -> None:
        self.n += w
        self.sx += w * x
        self.sy += w * y
        self.sxx += w * x * x
        self.sxy += w * x * y

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy, self.sxx, self.sxy = (d * self.n, d * self.sx, d * self.sy, d * self.sxx,
                                                        d * self.sxy)
        self._add(float(x), float(y), 1.0)

    def fit(self) -> tuple[float, float]:
        """(a, b), both >= 0 (one x seen so far: b 0, a their mean)."""
        if self.n <= 0:
            return 0.0, 0.0
        var = self.sxx - self.sx * self.sx / self.n
        b = (self.sxy - self.sx * self.sy / self.n) / var if var > 1e-9 * max(self.sxx, 1.0) else 0.0
        b = max(b, 0.0)
        return max((self.sy - b * self.sx) / self.n, 0.0), b


class StepCost:
    """A step's time (ns): T(rows) ~ a + b * rows, fitted to the steps seen (the recent ones
    weighted most, `decay` per step, from `prior_ns` = (a, b) weighted as `prior_steps` steps),
    plus, when anything is drafted, the drafting's own time ~ d0 + d1 * drafted tokens (the
    drafters' maintenance and proposals between steps: a tap drafter's one forward costs about
    the same for 1 draft as for 4, a host drafter's grows with them), fitted the same way.

    Where steps replay CUDA graphs by bucket (`bucket`: rows -> the bucket a step of that many
    rows replays, batching/graphs.py bucket_rows), a step costs its bucket's time, not the
    line's: every row of a bucket is paid whether used or not, and the next bucket may cost a
    jump (batched steps fold their GEMMs up to 64 rows, cuBLAS above). A bucket timed at open
    (calibrate.py) costs that time plus one offset every graphed step moves (an exponential
    average of its time over its bucket's, `BUCKET_ALPHA`): the open timed each bucket at short
    contexts, and the requests' reads grow the time of every bucket alike, so a bucket the steps
    never take still costs what the ones they take cost now (an average per bucket left the
    untaken ones at their times at open: 16 requests' decode steps took 7.0 ms against 5.8 at
    open, the 32-row bucket stayed at its 6.5, and requests whose drafts were never accepted were
    given drafts to fill it: 0.61x plain on an H100). A bucket not timed at open costs the
    average of its own graphed steps, or before any the line's time at its padded rows."""

    BUCKET_ALPHA = 0.2
    # drafting's variable part counts drafting requests, not drafted tokens: a block drafter's
    # (DFlash) one forward computes its whole block for each request whatever its K, so a
    # request's first draft costs a block and its others nothing more (batching/backend.py sets it
    # for --drafter dflash); `observe_draft` / `calibrate` then take requests as their x
    per_request = False

    def __init__(self, prior_ns: tuple[float, float] = (1e6, 1e4), prior_steps: float = 4.0, decay: float = 0.98,
                 draft_prior_ns: tuple[float, float] | None = None, bucket=None):
        """`draft_prior_ns`: drafting's (d0, d1) before any step drafted, weighted as the rows'
        prior is (None: no prior, drafting's cost is what the first drafting steps measure)."""
        a, b = prior_ns
        self.prior_steps = prior_steps
        self.rows = _Line([(x, a + b * x, prior_steps / 2) for x in (1.0, 16.0)], decay)
        d = draft_prior_ns
        self.drafts = _Line([] if d is None else [(x, d[0] + d[1] * x, prior_steps / 2) for x in (1.0, 16.0)], decay)
        self.bucket = bucket
        self.at_open: dict[int, float] = {}  # bucket -> its time at open (ns, calibrate)
        self.offset = 0.0  # ns every bucket timed at open costs over that time now
        self.by_bucket: dict[int, float] = {}  # bucket -> a step's time (ns) now: the above, else its steps'

    def calibrate(self, steps: list[tuple[int, float]], drafts: list[tuple[int, float]] = (),
                  weight: float | None = None) -> None:
        """Start over from points measured at open: (rows, ns) of steps, (drafted tokens, ns) of
        drafting, each list weighted as `weight` steps in all (default: the prior's weight), so
        the steps run afterwards take over as they did from the prior. An empty list keeps that line."""
        w = self.prior_steps if weight is None else weight
        if steps:
            self.rows = _Line([(float(x), float(y), w / len(steps)) for x, y in steps], self.rows.decay)
            if self.bucket is not None:
                self.at_open, self.offset = {}, 0.0
                for x, y in steps:
                    k = self.bucket(x)
                    self.at_open[k] = min(self.at_open.get(k, float(y)), float(y))
                self.by_bucket = dict(self.at_open)
        if drafts:
            self.drafts = _Line([(float(x), float(y), w / len(drafts)) for x, y in drafts], self.drafts.decay)

    def observe(self, rows: int, ns: float, graphed: bool = False) -> None:
        """A step of `rows` rows took `ns`; `graphed`: it replayed its bucket's graph (an eager
        step, a prefill's, says nothing of what its bucket's replay costs)."""
        self.rows.observe(rows, ns)
        if graphed and self.bucket is not None:
            k, ns = self.bucket(rows), float(ns)
            base = self.at_open.get(k)
            if base is not None:
                self.offset += self.BUCKET_ALPHA * (ns - base - self.offset)
                for b, t in self.at_open.items():
                    self.by_bucket[b] = t + self.offset
            else:
                old = self.by_bucket.get(k)
                self.by_bucket[k] = ns if old is None else old + self.BUCKET_ALPHA * (ns - old)

    def step_fn(self):
        """rows -> a step's ns, the fits read once (for a choice's many lookups)."""
        a, b = self.line()
        if self.bucket is None or not self.by_bucket:
            return lambda rows: a + b * rows
        by, bucket = self.by_bucket, self.bucket

        def step(rows):  # a bucket not timed yet: the line at its padded rows (it pays them all)
            k = bucket(rows)
            return by.get(k, a + b * k)
        return step

    def observe_draft(self, tokens: int, ns: float, requests: int = 0) -> None:
        """A step's drafting: `tokens` drafted (> 0) by `requests` in `ns` (maintenance and
        proposals); the line's x is the requests where `per_request`."""
        if tokens > 0:
            self.drafts.observe(requests if self.per_request else tokens, ns)

    def line(self) -> tuple[float, float]:
        """(a, b): the fitted base and per-row cost."""
        return self.rows.fit()

    def draft_line(self) -> tuple[float, float]:
        """(d0, d1): drafting's fixed cost a step and its cost a drafted token (a drafting
        request, where `per_request`)."""
        return self.drafts.fit()

    def predict(self, rows: int, drafted: int = 0, requests: int = 0) -> float:
        d0, d1 = self.draft_line()
        x = requests if self.per_request else drafted
        return self.step_fn()(rows) + (d0 + d1 * x if drafted > 0 else 0.0)


@dataclass(frozen=True)
class Others:
    """The requests of a step whose K is set already (`choose`'s `others`): their rows, their
    expected tokens, and drafting's x for them (drafting requests where `StepCost.per_request`,
    else drafted tokens; 0: none of them drafts)."""

    rows: int = 0
    tokens: float = 0.0
    drafting: int = 0


def choose(reqs: list[tuple[Acceptance, int]], cost: StepCost, others: Others | None = None) -> list[int]:
    """Each request's K for the next step (0 .. its bound), for the step's best expected tokens
    per ns (the module doc). A request's gains shrink with its K (each is a product of one more
    chance), so the best plan of m drafts takes the m largest gains; every m is weighed (each
    costs its step's rows, by bucket where the steps replay graphs, plus drafting's time), and
    plain decoding (every K 0, no drafting cost) unless a plan beats it: O(drafts log drafts).
    Walking every m, not stopping at the first that lowers the rate, finds the plan that fills
    a bucket past a draft whose own row does not pay (its bucket's rows are paid anyway).
    Where drafting costs by request (`cost.per_request`: a block drafter), a request's first
    draft pays its block and its later ones only their rows, so the plans of the r requests
    worth most at their bound, each drafting its bound, are weighed too: the m largest gains
    spread one draft over many requests, each paying a whole block for it.

    >>> accs = [(Acceptance(4, prior=0.9), 4)] * 4 + [(Acceptance(4, prior=0.5), 4)] * 4
    >>> by_token = StepCost(prior_ns=(4e6, 1e4), draft_prior_ns=(5e5, 1.25e5))   # 125 us a draft
    >>> choose(accs, by_token)
    [4, 4, 4, 4, 1, 1, 1, 1]
    >>> by_block = StepCost(prior_ns=(4e6, 1e4), draft_prior_ns=(5e5, 5e5))   # 500 us a request's block
    >>> by_block.per_request = True
    >>> choose(accs, by_block)   # one draft is not worth a block: each request drafts its bound, or nothing
    [4, 4, 4, 4, 0, 0, 0, 0]

    `others`: the step's requests whose K is set already (a request starting while the others
    run: its first round joins their step). Their rows and tokens count, and where they draft,
    drafting's fixed part is paid whatever the new ones choose:

    >>> h100 = StepCost(prior_ns=(6e6, 1.3e4), draft_prior_ns=(2.25e6, 5e4))   # DFlash at 64 on an H100
    >>> h100.per_request = True
    >>> one = [(Acceptance(4, prior=0.8), 4)]
    >>> choose(one, h100)   # alone: 2.4 more tokens for 2.3 ms of drafting on a 6 ms step
    [4]
    >>> choose(one, h100, Others(rows=63, tokens=63.0))   # beside 63 plain rows, that 2.3 ms does not pay
    [0]
    >>> choose(one, h100, Others(rows=315, tokens=212.0, drafting=63))   # they draft: it adds its block, 0.05 ms
    [4]
    """
    n = len(reqs)
    if n == 0:
        return []
    o = others or Others()
    step = cost.step_fn()
    d0, d1 = cost.draft_line()
    per_req = cost.per_request
    gains = []
    for i, (acc, bound) in enumerate(reqs):
        run = 1.0
        for m in range(min(bound, len(acc.p))):
            run *= acc.p[m]
            gains.append((-run, m, i))  # (largest first; then the request's lower K first)
    gains.sort()
    rows0 = n + o.rows
    sunk = d0 + d1 * o.drafting if o.drafting else 0.0  # (the others' drafting: paid whatever these choose)
    best, best_m = (n + o.tokens) / max(step(rows0) + sunk, 1.0), 0  # plain: (ns; a free step still ranks the drafts)
    tokens, last, drafting = float(n) + o.tokens, 0.0, 0
    bucket = cost.bucket if cost.by_bucket else None  # (a step's time is its bucket's: read once a bucket)
    top, base = -1, 0.0
    for m, (g, mm, _i) in enumerate(gains, 1):
        tokens -= g
        drafting += mm == 0  # (a request's first draft comes before its others: its gains shrink)
        if bucket is None:
            base = max(step(rows0 + m), 1.0)
        elif rows0 + m > top:
            top, base = bucket(rows0 + m), max(step(rows0 + m), 1.0)
        rate = tokens / (base + d0 + d1 * (o.drafting + (drafting if per_req else m)))
        if rate > best * (1 + 1e-9):
            best, best_m = rate, m
        elif bucket is None and not per_req and rate < last:
            break  # (a line: the rate rises to one peak and falls after it)
        last = rate
    ks = [0] * n
    for _g, _m, i in gains[:best_m]:
        ks[i] += 1
    if per_req:
        whole = _whole_requests(reqs, step, d0, d1, best, o)
        if whole is not None:
            return whole
    return ks


def _whole_requests(reqs: list[tuple[Acceptance, int]], step, d0: float, d1: float, best: float,
                    o: Others) -> list[int] | None:
    """The plan of the r requests worth most at their bound (each drafting its bound, the others
    none), the best r, where it beats `best` (the rate of choose's best plan); else None."""
    n = len(reqs)
    worth = sorted(((acc.expected(min(bound, len(acc.p))), min(bound, len(acc.p)), i)
                    for i, (acc, bound) in enumerate(reqs) if bound > 0), reverse=True)
    tokens, rows, plan = float(n) + o.tokens, n + o.rows, None
    for r, (e, k, _i) in enumerate(worth, 1):
        tokens, rows = tokens + e, rows + k
        rate = tokens / (max(step(rows), 1.0) + d0 + d1 * (o.drafting + r))
        if rate > best * (1 + 1e-9):
            best, plan = rate, r
    if plan is None:
        return None
    ks = [0] * n
    for _e, k, i in worth[:plan]:
        ks[i] = k
    return ks
