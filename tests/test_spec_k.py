"""K by goodput (memra_dist/specdec/spec_k.py; `--spec-k auto` on a batched engine): the pure
rule (acceptance per position, the step's cost line fitted online, the greedy ascent), and the
engine choosing each chained request's K every step: lossless (greedy ids equal alone), K 0 for
a request whose drafts are never accepted, the bound for one whose drafts always are."""

from __future__ import annotations

import pytest

from memra_dist.specdec.spec_k import Acceptance, StepCost, choose
from memra_dist.batching.chain import Chain

from test_batching import _batched, _prompts, _solo, _tap_drafter, spy_proposals


def test_acceptance_counts_only_the_positions_a_round_reached():
    a = Acceptance(4, alpha=0.5, prior=0.5)
    a.update(4, 2)  # positions 0, 1 accepted, 2 rejected, 3 not reached
    assert a.p == [0.75, 0.75, 0.25, 0.5]
    a.update(2, 2)  # both drafts accepted: nothing rejected, positions 2, 3 not reached
    assert a.p == [0.875, 0.875, 0.25, 0.5]
    assert a.expected(0) == 0 and a.expected(2) == pytest.approx(0.875 + 0.875 ** 2)
    assert a.expected(9) == a.expected(4)  # no position past the bound


def test_step_cost_fits_the_line_the_steps_follow_and_forgets_the_prior():
    c = StepCost(prior_ns=(5e6, 0.0), prior_steps=2, decay=0.9)
    for i in range(200):
        rows = 1 + (i * 7) % 40
        c.observe(rows, 2e6 + 3e4 * rows)
    a, b = c.line()
    assert a == pytest.approx(2e6, rel=1e-3) and b == pytest.approx(3e4, rel=1e-3)
    assert c.predict(10, 4) == pytest.approx(2e6 + 3e5, rel=1e-3)  # nothing drafted seen: drafting free
    c.observe_draft(4, 9e5)  # one drafting size seen: all of it the fixed part
    assert c.draft_line() == pytest.approx((9e5, 0.0))
    for i in range(100):  # drafting's fixed part (one forward) and its part a token
        n = 1 + i % 16
        c.observe_draft(n, 5e5 + 2e4 * n)
    d0, d1 = c.draft_line()
    assert d0 == pytest.approx(5e5, rel=1e-3) and d1 == pytest.approx(2e4, rel=1e-3)
    assert c.predict(10, 4) == pytest.approx(2e6 + 3e5 + 5e5 + 8e4, rel=1e-3)
    assert c.predict(10, 0) == pytest.approx(2e6 + 3e5, rel=1e-3)  # K 0 everywhere: no drafting cost


def test_step_cost_starts_from_the_points_timed_at_open_and_the_steps_take_over():
    """calibrate.py: the buckets' replays timed as the engine opens replace the prior (1 ms +
    10 us a row, drafting free) with this device's line; the steps run after it move it as the
    prior's were moved."""
    c = StepCost()
    c.calibrate([(1, 5.04e6), (16, 5.64e6), (64, 7.56e6)], [(6, 1.2e6), (12, 1.3e6)])  # 5 ms + 40 us a row
    a, b = c.line()
    assert a == pytest.approx(5e6, rel=1e-6) and b == pytest.approx(4e4, rel=1e-6)
    assert c.draft_line() == pytest.approx((1.1e6, 1.667e4), rel=1e-2)
    c.calibrate([], [])  # nothing timed: the lines kept
    assert c.line() == pytest.approx((a, b))
    for _ in range(300):  # the steps this engine then runs
        c.observe(8, 3e6)
        c.observe(40, 4e6)
    a2, b2 = c.line()
    assert a2 == pytest.approx(3e6 - 8 * 3.125e4, rel=2e-2) and b2 == pytest.approx(3.125e4, rel=2e-2)


def test_where_steps_replay_by_bucket_the_choice_fills_a_bucket_instead_of_paying_for_the_next():
    """16 requests whose drafts are accepted at 0.8 a position, K up to 4, steps costing their
    bucket's time (graphs.py buckets: 64 rows fold their GEMMs, 80 rows replay the 96-row
    bucket; illustrative times, 16 x 1 and 16 x 5 as an H200 measured them): all K 4 would be 80 rows
    in the 96-row bucket; K 3 fills the 64-row bucket for 0.41 tokens a request less and 2 ms a
    step less, and the choice takes it; a line through the same times charges each row its
    slope and keeps K 4."""
    from memra_dist.batching.graphs import bucket_rows

    accs = [(Acceptance(4, prior=0.8), 4) for _ in range(16)]
    times = {16: 4.9e6, 32: 5.1e6, 48: 5.6e6, 64: 6.0e6, 96: 8.0e6}
    c = StepCost(prior_steps=1e9, draft_prior_ns=(1.5e6, 0.0), bucket=bucket_rows)
    c.calibrate([(r, t) for r, t in times.items()], [], weight=1e9)
    assert c.step_fn()(80) == 8.0e6 and c.step_fn()(64) == 6.0e6 and c.step_fn()(50) == 6.0e6
    assert choose(accs, c) == [3] * 16
    line = StepCost(prior_steps=1e9, draft_prior_ns=(1.5e6, 0.0))  # the same points as a line
    line.calibrate([(r, t) for r, t in times.items()], [], weight=1e9)
    assert choose(accs, line) == [4] * 16  # (a row costs the line's 40 us: it misses the jump)
    # a graphed step's time moves every bucket timed at open by its excess; an eager step's (a
    # prefill's) moves none
    c.observe(64, 7.0e6, graphed=True)
    assert c.step_fn()(64) == pytest.approx(6.2e6) and c.step_fn()(16) == pytest.approx(5.1e6)
    c.observe(64, 30e6)
    assert c.step_fn()(64) == pytest.approx(6.2e6)


def test_buckets_the_steps_never_take_cost_what_the_taken_ones_cost_now_not_their_time_at_open():
    """The open times each bucket at short contexts (an H100's, 8B); 16 requests' decode steps
    then take 7.0 ms at their contexts against 5.85 at open. The 32-row bucket, which no step
    took, costs 6.49 + the same 1.15 ms now, not its 6.49 at open: requests whose drafts are
    accepted at 0.1 a position stay at K 0 (at its time at open, the 32-row bucket looked
    cheaper than the 16-row one the steps were paying, and they were given drafts to fill it)."""
    from memra_dist.batching.graphs import bucket_rows

    at_open = {1: 5.49, 2: 5.78, 4: 5.83, 8: 5.86, 16: 5.85, 32: 6.49, 48: 7.09, 64: 7.20, 96: 8.90}
    c = StepCost(draft_prior_ns=(0.3e6, 10e3), bucket=bucket_rows)
    c.calibrate([(r, t * 1e6) for r, t in at_open.items()], [])
    for _ in range(40):
        c.observe(16, 7.0e6, graphed=True)
    assert c.step_fn()(16) == pytest.approx(7.0e6, rel=1e-3)
    assert c.step_fn()(32) == pytest.approx((6.49 + 1.15) * 1e6, rel=1e-3)
    accs = [(Acceptance(4, prior=0.1), 4) for _ in range(16)]
    assert choose(accs, c) == [0] * 16
    stale = StepCost(draft_prior_ns=(0.3e6, 10e3), bucket=bucket_rows)  # each bucket its own average
    stale.calibrate([(r, t * 1e6) for r, t in at_open.items()], [])
    stale.at_open = {}
    stale.by_bucket[16] = 7.0e6
    assert sum(choose(accs, stale)) > 0  # (what it chose before: drafts into the cheaper-looking bucket)


def _best_plan_by_brute_force(reqs, cost):
    """Every plan of the m largest gains weighed, m = 0 .. all (what `choose` must find)."""
    import math

    step, (d0, d1) = cost.step_fn(), cost.draft_line()
    gains = sorted((-math.prod(acc.p[:m + 1]), m, i) for i, (acc, bound) in enumerate(reqs)
                   for m in range(min(bound, len(acc.p))))
    n, rates = len(reqs), []
    for m in range(len(gains) + 1):
        t = max(step(n + m), 1.0) + (d0 + d1 * m if m else 0.0)
        rates.append((n - sum(g for g, _, _ in gains[:m])) / t)
    m = max(range(len(rates)), key=lambda x: (rates[x] > rates[0] * (1 + 1e-9), rates[x]))
    m = m if rates[m] > rates[0] * (1 + 1e-9) else 0
    ks = [0] * n
    for _, _, i in gains[:m]:
        ks[i] += 1
    return ks, rates[m]


def test_choose_finds_the_best_plan_a_full_walk_finds_and_stops_early():
    """Random steps (2-64 requests, bounds 0-8, acceptances 0-1 a position, costs by bucket or
    by line, drafting fixed or per token): `choose`'s early stop never loses the plan the walk
    over every m finds (its rate within rounding)."""
    import random

    from memra_dist.batching.graphs import bucket_rows

    rng = random.Random(5)
    for trial in range(300):
        n = rng.randint(2, 64)
        reqs = [(Acceptance(8, prior=[rng.random() ** rng.choice((0.2, 1, 3)) for _ in range(8)]), rng.randint(0, 8))
                for _ in range(n)]
        bucketed = trial % 2 == 0
        c = StepCost(prior_steps=1e9, draft_prior_ns=(rng.choice((0.0, 5e5, 3e6)), rng.choice((0.0, 1e4, 5e4))),
                     bucket=bucket_rows if bucketed else None)
        base, row = rng.uniform(2e6, 6e6), rng.uniform(5e3, 6e4)
        c.calibrate([(r, base + row * r) for r in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256,
                                                     288, 320, 352, 384, 416, 448, 480, 512, 544, 576)], [], weight=1e9)
        ks = choose(reqs, c)
        want_ks, want_rate = _best_plan_by_brute_force(reqs, c)
        step, (d0, d1) = c.step_fn(), c.draft_line()
        m = sum(ks)
        got = (n + sum(acc.expected(k) for (acc, _), k in zip(reqs, ks))) / (max(step(n + m), 1.0) + (d0 + d1 * m if m else 0))
        assert got == pytest.approx(want_rate, rel=1e-9), (trial, ks, want_ks)
        assert all(0 <= k <= b for k, (_, b) in zip(ks, reqs))


def test_choose_gives_drafts_where_they_pay_and_respects_each_bound():
    cheap = StepCost(prior_ns=(1e6, 1e4), prior_steps=1e9)
    costly = StepCost(prior_ns=(1e5, 1e6), prior_steps=1e9)
    hi, mid, lo = Acceptance(8, prior=0.95), Acceptance(8, prior=0.6), Acceptance(8, prior=0.0)
    ks = choose([(hi, 8), (mid, 8), (lo, 8), (hi, 3)], cheap)
    assert ks[0] == 8 and 0 < ks[1] < 8 and ks[2] == 0 and ks[3] == 3
    assert choose([(hi, 8), (mid, 8)], costly) == [0, 0]  # a row costs ten steps' base: plain decoding
    assert choose([], cheap) == []


def test_choose_drafts_only_where_the_plan_pays_drafting_s_fixed_cost():
    """A tap drafter's forward costs about the same for one draft as for all: with a fixed
    drafting cost above what the drafts bring, every K is 0; below it, the drafts go to their
    bounds (each one more is nearly free once the forward runs)."""
    accs = [(Acceptance(4, prior=0.8), 4) for _ in range(16)]  # 16 requests, ~2.4 accepted of 4

    def cost(d0):
        c = StepCost(prior_ns=(4e6, 2e4), prior_steps=1e9)  # 4.3 ms for 16 rows
        for n in (16, 32, 64):
            c.observe_draft(n, d0 + 1e3 * n)
        return c

    assert choose(accs, cost(40e6)) == [0] * 16  # 40 ms of drafting for ~2.4x the tokens: plain
    assert choose(accs, cost(2e6)) == [4] * 16


def test_a_block_drafters_cost_is_fitted_and_priced_by_drafting_request():
    """Where drafting costs by request (DFlash: a block each, whatever its K), the draft line's x
    is the requests that drafted, not the drafts: 1 ms + 0.5 ms a request is what it learns from
    steps of 4 and 12 requests drafting 3 each (12 and 36 drafts); its plans give each drafting
    request its bound (a first draft pays the block, the others only their rows)."""
    c = StepCost(prior_ns=(4e6, 1e4), prior_steps=1e9)
    c.per_request = True
    for _ in range(20):
        for r in (4, 12):
            c.observe_draft(3 * r, 1e6 + 5e5 * r, r)
    d0, d1 = c.draft_line()
    assert d0 == pytest.approx(1e6, rel=1e-6) and d1 == pytest.approx(5e5, rel=1e-6)
    assert c.predict(16, drafted=24, requests=8) == pytest.approx(c.predict(16) + 1e6 + 4e6)
    ks = choose([(Acceptance(4, prior=0.85), 4) for _ in range(12)], c)
    assert set(ks) <= {0, 4} and any(ks), ks


# An H100's step times by bucket at 64 requests (8B shape; --spec-k auto's fit after a run,
# BENCHMARKS.md 2026-12-06), ms
H100_BUCKETS = {1: 6.37, 2: 6.60, 4: 6.64, 8: 6.68, 16: 6.70, 32: 7.32, 48: 7.89, 64: 8.04, 96: 7.96, 128: 8.18,
                160: 8.51, 192: 8.92, 224: 9.32, 256: 9.54, 288: 11.45, 320: 10.72}


@pytest.mark.parametrize("per_request", [True, False])
def test_requests_whose_drafts_pay_alike_are_not_parked_at_k_0_by_a_few_unlucky_rounds(per_request):
    """64 requests whose every draft position is accepted 0.8 of the time, on the step costs an
    H100 measured at 64 (by bucket) and drafting priced as DFlash's (by request) or EAGLE-3's
    (by token): after the first rounds, no request sits at K 0. A request's average moves ALPHA a
    round; at 0.3 a few unlucky rounds put some requests below what a draft costs, and at K 0
    nothing measured them again: ~24 % of such rounds stayed at K 0 here (~40 % on the H100,
    where auto then ran at 0.75-0.87x of a fixed K). A drafter that is never accepted still ends
    at K 0 for every request."""
    import random

    from memra_dist.batching.graphs import bucket_rows
    from memra_dist.specdec.spec_k import EngineAcceptance

    def run(p: float) -> list[list[int]]:
        c = StepCost(bucket=bucket_rows)
        c.per_request = per_request
        d0, d1 = (2.19e6, 5.8e4) if per_request else (1.9e6, 1.5e3)
        c.calibrate([(k, v * 1e6) for k, v in H100_BUCKETS.items()], [(1, d0 + d1), (16, d0 + 16 * d1)])
        eng, rng = EngineAcceptance(), random.Random(0)
        accs = [eng.start(i, 4) for i in range(64)]
        out = []
        for _ in range(60):
            ks = choose([(a, 4) for a in accs], c)
            out.append(ks)
            for a, k in zip(accs, ks):
                if k:
                    j = 0
                    while j < k and rng.random() < p:
                        j += 1
                    a.update(k, j)
        return out

    late = [k for ks in run(0.8)[20:] for k in ks]
    assert late.count(0) <= 0.02 * len(late), sorted(set(late))
    assert all(k == 0 for k in run(0.0)[-1])


def test_a_dflash_engine_prices_its_drafting_by_request(llama, tmp_path_factory, monkeypatch):
    """A batched DFlash engine under --spec-k auto sets its cost to price drafting by request
    (backend.py), and the loop feeds the draft line the requests that drafted (never more than a
    step holds); the ids stay the solo ids."""
    from memra_dist.specdec import spec_k

    ddir = str(_tap_drafter("dflash", llama, tmp_path_factory))
    reqs = _prompts(6)
    solo = _solo(llama, "dflash", reqs, draft_model=ddir)
    xs, per, real = [], [], spec_k._Line.observe

    def seen(eng):
        b = eng._backend.batcher
        per.append(b.cost.per_request)
        monkeypatch.setattr(b.cost.drafts, "observe", lambda x, y: xs.append(x) or real(b.cost.drafts, x, y))

    got, stats = _batched(llama, "dflash", reqs, max_batch=3, on_open=seen, spec_k="auto", draft_model=ddir)
    assert got == solo and per == [True]
    assert xs and max(xs) <= 3, xs


def _auto(eng, cost=None):
    b = eng._backend.batcher
    assert b.auto_k  # --spec-k auto reached the engine
    if cost is not None:
        b.cost = cost


@pytest.mark.parametrize("corrupt,expect", [(1.0, "zero"), (0.0, "bound")])
def test_the_engine_chooses_k_per_request_and_step_and_stays_lossless(llama, monkeypatch, corrupt, expect):
    """The replay drafter (each request's own greedy continuation) corrupted at 1.0 (no draft
    is ever accepted) or 0.0 (every draft is): with a step cost where rows are cheap, the
    engine soon gives the first K 0 and the second its bound (in the later half of the steps'
    choices, started from the optimistic prior with no engine average learned yet); every
    request's ids are its solo ids either way. Drafting's cost is pinned too (0.1 ms a step
    and 10 us a draft), so the choices do not depend on how fast this machine runs the
    replay's host proposals."""
    import memra_dist.batching.loop_rounds as lr

    reqs = [(p, 40) for p, _ in _prompts(4)]
    solo = _solo(llama, "replay", reqs, replay_corrupt=corrupt)
    cost = StepCost(prior_ns=(1e6, 1e4), prior_steps=1e9, draft_prior_ns=(1e5, 1e4))
    steps, real = [], lr.choose
    monkeypatch.setattr(lr, "choose", lambda r, c, o=None: steps.append(real(r, c, o)) or steps[-1])
    got, stats = _batched(llama, "replay", reqs, max_batch=4, on_open=lambda e: _auto(e, cost),
                          replay_corrupt=corrupt, spec_k="auto")
    assert got == solo
    ks = {int(k): n for k, n in stats["k_chosen"].items()}
    assert sum(ks.values()) >= 20, stats
    steps = [ch for ch in steps if ch]  # (a step's choice among no drafting chain: none to make)
    late = [k for ch in steps[len(steps) // 2:] for k in ch]
    assert len(late) >= 20, steps
    # the rounds the engine cut below their bound, apart from a request's last ones (fewer tokens left)
    cut, cut_drafts = stats["k_cut_rounds"], stats["k_cut_drafts"]
    assert cut <= sum(ks.values()) and cut <= cut_drafts <= 4 * cut, stats
    if expect == "zero":
        assert late.count(0) >= 0.9 * len(late), steps
        assert cut >= ks.get(0, 0) - len(reqs), stats  # every K 0 but a request's last round's
    else:  # (each request's last rounds are bounded by the tokens it has left)
        assert sum(n for k, n in ks.items() if k >= 3) >= 0.7 * sum(ks.values()), ks
        assert cut <= 0.3 * sum(ks.values()), stats  # K 0 or short at the ends, not cut


@pytest.mark.parametrize("drafter,ahead", [("dflash", False), ("eagle3", False), ("dflash", True)])
def test_a_tap_drafter_at_k_0_skips_its_maintenance_and_catches_up_when_it_drafts_again(
        llama, tmp_path_factory, monkeypatch, drafter, ahead):
    """K chosen as 0 for two steps in four: a tap drafter's maintenance is left out of those
    rounds (plain decoding's cost), and when it drafts again it first takes in every row it
    skipped: each of its proposals equals the one the request makes alone at the same context,
    and the ids are the solo ids. With the GPU's steps ahead (`ahead`), the K-0 rounds run one
    step ahead as plain decoding does, their taps still written."""
    import memra_dist.batching.loop_rounds as lr

    if drafter == "dflash":
        from memra_dist.specdec.drafters.dflash import DFlashDrafter as cls
    else:
        from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter as cls
    ddir = str(_tap_drafter(drafter, llama, tmp_path_factory))
    reqs = _prompts(4)
    seen = spy_proposals(monkeypatch, cls)
    solo = _solo(llama, drafter, reqs, draft_model=ddir)
    alone, seen[:] = set(seen), []
    calls = {"choose": 0, "maintain": 0, "in_loop": False, "drafting": 0}
    real_maintain, real_many, real_rounds = cls.maintain, cls.maintain_many, lr.maintain_rounds

    def maintain(self, context):  # counted when the loop maintains a chained round
        calls["maintain"] += calls["in_loop"]
        real_maintain(self, context)

    def maintain_many(drafters, contexts):  # the step's shared maintenance: each drafter's counted once
        calls["maintain"] += len(drafters)
        calls["in_loop"] = False  # (where it calls each one's maintain)
        try:
            real_many(drafters, contexts)
        finally:
            calls["in_loop"] = True

    def maintain_rounds(chains):
        calls["in_loop"] = True
        try:
            return real_rounds(chains)
        finally:
            calls["in_loop"] = False

    def every_third(reqs_, cost, others=None):  # K 0 twice, then each request's bound twice
        calls["choose"] += 1
        out = [bound if calls["choose"] % 4 < 2 else 0 for _, bound in reqs_]
        calls["drafting"] += sum(k > 0 for k in out)
        return out

    def on_open(eng):
        _auto(eng)
        eng._backend.batcher.ahead = ahead  # (as on a GPU's graphed steps)

    rounds = []  # (drafts, expected) of every round the loop ran with a K chosen (expected >= 0)
    real_maintained = Chain.maintained

    def maintained(self, t4=None, ev=None):
        real_maintained(self, t4, ev)
        r = self.rounds[-1]
        rounds.append((r.k, r.expected))

    monkeypatch.setattr(Chain, "maintained", maintained)
    monkeypatch.setattr(cls, "maintain", maintain)
    monkeypatch.setattr(cls, "maintain_many", staticmethod(maintain_many))
    monkeypatch.setattr(lr, "choose", every_third)
    monkeypatch.setattr(lr, "maintain_rounds", maintain_rounds)
    got, stats = _batched(llama, drafter, reqs, max_batch=4, on_open=on_open, draft_model=ddir, spec_k="auto")
    assert got == solo
    assert (stats["ahead_steps"] > 0) == ahead, stats
    ks = {int(k): n for k, n in stats["k_chosen"].items()}
    assert ks.get(0, 0) >= 20 and sum(n for k, n in ks.items() if k > 0) >= 8, ks
    # each round counted once, under the K it ran with: a K chosen while the chain's next round
    # already ran ahead (K 0) is chosen again once that round is in, and counted then
    ran = {0: sum(1 for kk, e in rounds if kk == 0 and e >= 0), "k": sum(1 for kk, e in rounds if kk > 0 and e >= 0)}
    assert ks.get(0, 0) == ran[0] and sum(n for k, n in ks.items() if k > 0) == ran["k"], (ks, ran, stats)
    # every proposal after a catch-up is the one the request makes alone at that context (where
    # it proposed at that context alone: a round whose draft was accepted skips a context, and
    # the K-0 rounds here shift where the batched rounds begin)
    solo_at = dict(alone)
    both = [(c, d) for c, d in seen if c in solo_at]
    assert len(both) >= 0.5 * len(seen) > 0, (len(both), len(seen))
    assert all(solo_at[c] == d for c, d in both), [(len(c), d, solo_at[c]) for c, d in both if solo_at[c] != d]
    # the loop maintained a round only ahead of drafting (or as a request ended, or before its
    # first K): where K > 0 was chosen (with steps ahead, a choice made while a K-0 round ran
    # ahead may be chosen again, as K 0, once that round is in)
    assert calls["maintain"] <= calls["drafting"] + 2 * len(reqs), (calls, ks)


def test_auto_k_with_ngram_on_the_measured_step_cost_keeps_the_ids(llama):
    """--spec-k auto with the cost line fitted to this machine's own steps (no injection): the
    requests get their solo ids and every chained round had a K chosen."""
    reqs = _prompts(6)
    solo = _solo(llama, "ngram", reqs)
    got, stats = _batched(llama, "ngram", reqs, max_batch=3, on_open=_auto, spec_k="auto")
    assert got == solo
    assert sum(stats["k_chosen"].values()) > 0, stats


def test_the_trace_shows_each_rounds_chosen_k_against_what_it_expected_and_each_steps_forecast(llama):
    """Traced at level 1 with --spec-k auto: each chained round's span carries the accepted
    drafts its K was chosen for (memra.spec_k.expected, between 0 and its K) beside what came
    (memra.accepted), and each step's span its cost line's forecast beside its measured forward."""
    from test_batching import traced_batched

    from memra_dist.tracing.conventions import ATTR, SPAN_BATCH_STEP, SPAN_ROUND

    from memra_dist.phase.share import JobShare

    reqs = _prompts(4)
    table = JobShare()
    got, exps, stats = traced_batched(llama, "ngram", reqs, 1, sink=table, spec_k="auto")
    assert got == _solo(llama, "ngram", reqs)
    assert table.by_k and sum(n for n, *_ in table.by_k.values()) >= 10, table.by_k
    lines = table.table().splitlines()
    assert any(line.startswith("  by K chosen") for line in lines)
    for k, (n, _ns, acc, exp) in table.by_k.items():  # a line per K: its rounds, accepted <= K, expected <= K
        assert any(line.split()[:2] == [f"K={k}", str(n)] for line in lines), lines
        assert acc <= k * n and exp <= k * n + 1e-6
    spans = [s for e in exps for s in e.get_finished_spans()]
    rounds = [s for s in spans if s.name == SPAN_ROUND]
    chosen = [s for s in rounds if ATTR["expected_accepted"] in s.attributes]
    assert len(chosen) >= len(rounds) - 2 * len(reqs)  # all but each request's first round(s), K fixed there
    for s in chosen:
        assert 0 <= s.attributes[ATTR["expected_accepted"]] <= s.attributes[ATTR["k"]] + 1e-9
    steps = [s for s in spans if s.name == SPAN_BATCH_STEP]
    assert steps and all(s.attributes[ATTR["batch_predicted_ms"]] > 0 for s in steps)


def test_k_0_rounds_run_one_step_ahead_are_counted_in_the_share_table(llama, monkeypatch):
    """K 0 chosen for every round, the GPU's steps ahead on: the rounds that ran ahead (adopted,
    not proposed) still count on the share table's K=0 line, with nothing expected or accepted."""
    import memra_dist.batching.loop_rounds as lr
    from test_batching import traced_batched

    from memra_dist.phase.share import JobShare

    monkeypatch.setattr(lr, "choose", lambda reqs_, cost, others=None: [0] * len(reqs_))

    def ahead(eng):
        _auto(eng)
        eng._backend.batcher.ahead = True

    reqs = _prompts(3)
    table = JobShare()
    got, _exps, stats = traced_batched(llama, "ngram", reqs, 1, max_batch=3, sink=table, on_open=ahead,
                                       spec_k="auto")
    assert got == _solo(llama, "ngram", reqs)
    assert stats["ahead_steps"] > 10, stats
    assert set(table.by_k) == {0}, table.by_k
    n, _ns, acc, exp = table.by_k[0]
    assert n >= stats["ahead_steps"] and acc == 0 and exp == 0, (table.by_k, stats)


@pytest.mark.parametrize("drafter", ["ngram", "model", "dflash", "eagle3", "mtp"])
def test_every_drafter_under_auto_k_gives_its_solo_ids_twelve_requests_six_at_a_time(
        llama, draft_llama, tmp_path_factory, drafter, capfd):
    """--spec-k auto with every drafter, twelve requests six at a time, on a step cost where a
    row costs about a quarter of a step's base (so a request drafts only while its running
    acceptance is high, and K moves with it): every request gets its solo ids."""
    model, kw = str(llama), {}
    if drafter == "model":
        kw = dict(draft_model=str(draft_llama))
    elif drafter in ("dflash", "eagle3"):
        kw = dict(draft_model=str(_tap_drafter(drafter, llama, tmp_path_factory)))
    elif drafter == "mtp":
        from moe_ckpt import save_moe

        model = str(save_moe(tmp_path_factory.mktemp("kmtp") / "glm", "glm4_moe", layers=2, n_mtp=1, seed=2)[0])
    reqs = [(p[:14], n) for p, n in _prompts(12)] if drafter == "mtp" else _prompts(12)
    solo = _solo(model, drafter, reqs, **kw)
    cost = StepCost(prior_ns=(20e6, 4.6e6), prior_steps=1e9)
    got, stats = _batched(model, drafter, reqs, max_batch=6, on_open=lambda e: _auto(e, cost), spec_k="auto", **kw)
    assert got == solo and stats["max_requests"] >= 2, stats
    assert sum(stats["k_chosen"].values()) > 0, stats  # (the model drafter's rounds too: the loop's, chained)
    assert "every round drafts -k" not in capfd.readouterr().err


@pytest.mark.slow  # a local Ray with two CPU stage actors
def test_auto_k_on_a_batched_pipeline_says_it_drafts_k_and_gives_the_solo_ids(ray_local, llama, capfd):
    """At pp 2 a batched request runs its own rounds (the pipeline head's slots do not chain),
    so --spec-k auto cannot choose there: the engine says in one line that every round drafts
    -k, and the ids are the solo ids."""
    from test_batching_pp import _runs

    reqs = _prompts(6)
    solo = _solo(llama, "ngram", reqs)
    got, stats = _runs(llama, "ngram", reqs, pp=2, max_batch=3, spec_k="auto")
    assert [g[0] for g in got] == solo
    assert "--spec-k auto applies at --pp 1; at --pp 2 every round drafts -k 3" in capfd.readouterr().err
    assert not stats.get("k_chosen"), stats


def test_sampled_requests_keep_their_seeded_solo_ids_under_auto_k(llama):
    """A sampled request's draws depend on its K, so under auto it drafts -k every round: its
    seeded output is the one it gets alone, whatever runs beside it; the greedy requests beside
    it choose their K."""
    from memra_dist.specdec.sampling import SamplingParams

    reqs = _prompts(6)
    sp = dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=11)
    each = [sp if i % 2 else {} for i in range(len(reqs))]
    solo = [_solo(llama, "ngram", [r], **e)[0] for r, e in zip(reqs, each)]
    got, stats = _batched(llama, "ngram", reqs, max_batch=3, each=each, spec_k="auto",
                          on_open=lambda e: _auto(e, StepCost(prior_ns=(20e6, 4.6e6), prior_steps=1e9)))
    assert got == solo
    assert sum(stats["k_chosen"].values()) > 0, stats  # (the greedy ones)


def test_new_requests_start_from_the_engines_acceptance_so_a_drafter_that_never_pays_costs_little():
    """Pure: where every draft so far was rejected, a new request's first choice is K 0
    (it would otherwise draft until its own average fell), while every PROBE_EVERY-th new one
    starts optimistic; and one whose drafts are always accepted leaves the engine's
    average high for the next."""
    from memra_dist.specdec.spec_k import PROBE_EVERY, EngineAcceptance

    cost = StepCost(prior_ns=(1e6, 1e5), prior_steps=1e9)  # a draft pays where it is accepted > ~9 % of the time
    fresh = Acceptance(4)
    assert choose([(fresh, 4)], cost) == [4]  # a request alone, optimistic: drafts
    e = EngineAcceptance()
    first = e.start("r0", 4)
    for _ in range(30):
        first.update(4, 0)  # its rounds feed the engine's average too
    e.forget("r0")
    starts = [choose([(e.start(f"r{i}", 4), 4)], cost)[0] for i in range(1, 2 * PROBE_EVERY + 1)]
    probes = [i for i, k in enumerate(starts, 1) if k > 0]
    assert probes == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1], starts  # (r0 was the first started)
    good = EngineAcceptance()
    for i in range(6):
        a = good.start(i, 4)
        for _ in range(5):
            a.update(4, 4)
    assert good.start("next", 4).expected(4) > 3.0


def test_a_drafter_that_never_pays_drafts_little_in_requests_after_the_first(llama):
    """Replay corrupted at 1.0 (no draft ever accepted), 12 requests through 4 slots, rows cheap:
    a request started optimistic drafts its first rounds until its own average falls below what
    pays; started from the engine's average, the later ones (but the probes) start at K 0: far fewer drafting
    rounds than when every request starts optimistic, and the ids are the solo ids either way."""
    import memra_dist.specdec.spec_k as sk

    reqs = [(p, 24) for p, _ in _prompts(12)]
    solo = _solo(llama, "replay", reqs, replay_corrupt=1.0)

    def drafting_rounds(probe_every):
        cost = StepCost(prior_ns=(1e6, 1e4), prior_steps=1e9)

        def on_open(eng):
            _auto(eng, cost)
            eng._backend.batcher.acceptance = sk.EngineAcceptance(probe_every=probe_every)

        got, stats = _batched(llama, "replay", reqs, max_batch=4, on_open=on_open, replay_corrupt=1.0,
                              spec_k="auto")
        assert got == solo
        return sum(n for k, n in stats["k_chosen"].items() if int(k) > 0)

    every_optimistic = drafting_rounds(1)
    learned = drafting_rounds(sk.PROBE_EVERY)
    assert learned <= 0.4 * every_optimistic, (learned, every_optimistic)  # (on CPU: ~5 against ~48)


@pytest.mark.parametrize("shadows", [True, False])
def test_a_host_drafters_k_0_rounds_score_unverified_drafts_so_the_engine_relearns(llama, monkeypatch, shadows):
    """Requests that start from an engine acceptance learned near 0 (as after a warm-up whose
    drafts were rejected) choose K 0, and at K 0 no draft reaches the verify. A host drafter's
    K-0 rounds still propose (no device time), unverified, and score those drafts against the
    tokens that come: here every one would be accepted (replay at corruption 0), so the
    requests' averages rise and they draft again, with no re-measuring step. Without the
    shadows they decode plainly to the end. The ids are the solo ids either way."""
    import memra_dist.batching.loop_rounds as lr
    from memra_dist.specdec.spec_k import EngineAcceptance

    monkeypatch.setattr(lr, "REMEASURE_STEPS", 6)  # (a host drafter's requests never re-measure)
    if not shadows:
        monkeypatch.setattr(Chain, "shadow", lambda self: False)
    reqs = [(p, 40) for p, _ in _prompts(4)]
    solo = _solo(llama, "replay", reqs, replay_corrupt=0.0)

    def on_open(eng):
        b = eng._backend.batcher
        _auto(eng, StepCost(prior_ns=(1e6, 1e4), prior_steps=1e9, draft_prior_ns=(1e5, 1e4)))
        b.acceptance = EngineAcceptance(prior=0.01, probe_every=10 ** 9)  # learned near 0, no probes

    got, stats = _batched(llama, "replay", reqs, max_batch=4, on_open=on_open, replay_corrupt=0.0, spec_k="auto")
    assert got == solo
    ks = {int(k): n for k, n in stats["k_chosen"].items()}
    drafted = sum(n for k, n in ks.items() if k >= 2)
    assert stats["k_remeasures"] == 0, stats
    if shadows:
        assert stats["k_shadows"] >= len(reqs) and drafted >= 0.5 * sum(ks.values()), (ks, stats)
    else:
        assert stats["k_shadows"] == 0 and drafted == 0, (ks, stats)


@pytest.mark.parametrize("ahead,most", [(False, 8), (True, 8), (True, 2)])
def test_after_a_long_run_at_k_0_a_network_drafters_requests_draft_together_at_their_bound(
        llama, tmp_path_factory, monkeypatch, ahead, most):
    """A network drafter (EAGLE-3) whose engine learned its acceptance near 0: every request
    chooses K 0 and nothing measures the drafts. After REMEASURE_STEPS (here 6) all-K-0 steps up
    to REMEASURE_MAX requests (`most`) draft their next round at their bound, in the step's one
    shared forward, also where a K-0 round already runs one step ahead (`ahead`, as on a GPU: the
    choice made then is for the round after it, and must survive that round's own choice); with
    a cap below the requests, the re-measures take turns. The ids stay the solo ids."""
    import memra_dist.batching.loop_rounds as lr
    from memra_dist.specdec.spec_k import EngineAcceptance

    monkeypatch.setattr(lr, "REMEASURE_STEPS", 6)
    monkeypatch.setattr(lr, "REMEASURE_MAX", most)
    ddir = str(_tap_drafter("eagle3", llama, tmp_path_factory))
    reqs = [(p, 40) for p, _ in _prompts(4)]
    solo = _solo(llama, "eagle3", reqs, draft_model=ddir)
    shared, drafted_by = [], set()
    real = lr.propose_rounds

    def propose_rounds(chains, stats=None):
        before = stats.draft_batched if stats is not None else 0
        drafted_by.update(ch.rid for ch in chains if ch.draft_k() > 0)
        out = real(chains, stats)
        shared.append(stats.draft_batched - before if stats is not None else 0)
        return out

    def on_open(eng):
        b = eng._backend.batcher
        _auto(eng, StepCost(prior_ns=(1e6, 1e4), prior_steps=1e9, draft_prior_ns=(1e5, 1e4)))
        b.acceptance = EngineAcceptance(prior=0.01, probe_every=10 ** 9)  # learned near 0, no probes
        b.ahead = ahead

    monkeypatch.setattr(lr, "propose_rounds", propose_rounds)
    got, stats = _batched(llama, "eagle3", reqs, max_batch=4, on_open=on_open, draft_model=ddir, spec_k="auto")
    assert got == solo
    assert (stats["ahead_steps"] > 0) == ahead, stats
    ks = {int(k): n for k, n in stats["k_chosen"].items()}
    assert stats["k_remeasures"] >= 2 and stats["k_shadows"] == 0, stats
    # each re-measure's requests (4 or the cap, or the ones still running) drafted, together in
    # one forward; with the cap, in turns: every request drafted in one of them
    each = min(most, 4) - 1
    assert sum(n for k, n in ks.items() if k > 0) >= each * stats["k_remeasures"], ks
    # (a re-measure's group is the requests running then: under load, one that joined late or
    # already ended leaves fewer; at least two, or the cap's one, still draft in one forward)
    assert sum(1 for n in shared if n >= min(2, each)) >= stats["k_remeasures"] and max(shared) <= most, shared
    assert len(drafted_by) == len(reqs), drafted_by


def test_a_request_starting_beside_drafting_requests_drafts_its_first_round():
    """A new request's first K is chosen as it joins the step of the requests running now
    (loop_rounds.py `choose_first_k`): beside 63 DFlash requests that draft, its drafts cost its
    own block only, so it takes its bound; beside 63 plain rows the whole drafting step would
    be its own, and it starts at K 0. New requests starting together are weighed together. (It
    was weighed against the others at K 0 whatever they ran: every first round of 64 DFlash
    requests went plain, ~2 % of their tokens a round.)"""
    from types import SimpleNamespace as NS

    from memra_dist.batching.loop_rounds import choose_first_k
    from memra_dist.batching.stats import BatchStats

    def chain(rid, k_next=None):
        return NS(rid=rid, never_drafts=False, greedy=True, acc=Acceptance(4, prior=0.8), k_step=k_next,
                  draft_k=lambda: 4, bound=lambda: 4)

    def engine(others_k: int, new: int):
        cost = StepCost(prior_ns=(6e6, 1.3e4), draft_prior_ns=(2.25e6, 5e4))  # an H100's DFlash at 64
        cost.per_request = True
        others = [chain(i, others_k) for i in range(64 - new)]
        pending = [NS(rid=ch.rid, n=1 + others_k, chain=ch) for ch in others]
        return NS(pending=pending, running_jobs=[], admitted={i: i for i in range(64)}, cost=cost,
                  stats=BatchStats())

    for others_k, want in ((4, 4), (0, 0)):
        b, ch = engine(others_k, 1), chain(63)
        choose_first_k(b, [ch])
        assert ch.k_step == want, (others_k, ch.k_step)
        assert b.stats.k_chosen == {want: 1} and b.stats.k_cut == (want == 0)
    b = engine(0, 32)  # half the engine starting at once: their drafting step pays for itself
    new = [chain(i) for i in range(32, 64)]
    choose_first_k(b, new)
    assert [ch.k_step for ch in new] == [4] * 32
