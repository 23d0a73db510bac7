"""Acceptance rules on hand-made tables: greedy (exact j and next token) and rejection
sampling (exact cases where the outcome is forced, and the vocabulary accepted / recovered /
bonus)."""

from __future__ import annotations

import pytest
import torch

from memra_dist.specdec.accept import BONUS, RECOVERED, accept_greedy, accept_sampled, greedy_commit


def onehot_logits(rows: list[int], vocab: int = 8) -> torch.Tensor:
    """(len(rows), vocab) logits whose argmax per row is the given id."""
    x = torch.zeros(len(rows), vocab)
    for i, t in enumerate(rows):
        x[i, t] = 5.0
    return x


@pytest.mark.parametrize(
    "preds, drafts, j, nxt",
    [
        ([3, 4, 5, 6], [3, 4, 5], 3, 6),  # all accepted: bonus from the last row
        ([3, 4, 5, 6], [1, 4, 5], 0, 3),  # first rejected: later matches do not count
        ([3, 4, 5, 6], [3, 1, 5], 1, 4),  # rejected at 1: the correction is row 1's argmax
        ([3, 4, 5, 6], [3, 4, 1], 2, 5),
        ([7], [], 0, 7),  # K = 0: plain decode, next = row 0's argmax
        ([2, 2], [2], 1, 2),
    ],
)
def test_accept_greedy_table(preds, drafts, j, nxt):
    got = accept_greedy(onehot_logits(preds), torch.tensor(drafts, dtype=torch.long))
    assert got == (j, nxt)


def _p(rows):
    t = torch.tensor(rows, dtype=torch.float32)
    return t / t.sum(-1, keepdim=True)


def test_sampled_forced_accept_all_gives_bonus_from_last_row():
    # p(d_i) = q(d_i) = 1: every u <= 1 accepts; the bonus row is one-hot on token 2
    p = _p([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]])
    q = _p([[0, 1, 0, 0], [1, 0, 0, 0]])
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        assert accept_sampled(p, q, torch.tensor([1, 0]), g) == (2, 2, BONUS)


def test_sampled_forced_reject_recovers_from_residual():
    # p(d_0) = 0 -> always rejected; residual max(p - q, 0) is one-hot on token 3
    p = _p([[0, 0, 1, 1], [1, 1, 1, 1]])
    q = _p([[1, 0, 1, 0]])
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        assert accept_sampled(p, q, torch.tensor([0]), g) == (0, 3, RECOVERED)


def test_sampled_one_hot_draft_never_recovers_the_rejected_token():
    # deterministic drafter (q = None): p(d) = 0.5 -> accepted about half the time; when
    # rejected, the recovered token is drawn from p with d removed -> never d itself
    p = _p([[1, 1, 0, 0], [0, 0, 0, 1]])
    kinds = {RECOVERED: 0, BONUS: 0}
    for seed in range(400):
        g = torch.Generator().manual_seed(seed)
        j, nxt, kind = accept_sampled(p, None, torch.tensor([0]), g)
        kinds[kind] += 1
        if kind == RECOVERED:
            assert (j, nxt) == (0, 1)
        else:
            assert (j, nxt) == (1, 3)
    assert 150 < kinds[BONUS] < 250  # binomial(400, 0.5): +-5 sigma


def test_sampled_rejection_stops_at_first_reject():
    # d_0 certain (p = q = 1 on it), d_1 impossible under p: j == 1, recovered from row 1
    p = _p([[1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    q = _p([[1, 0, 0, 0], [0, 1, 0, 0]])
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        assert accept_sampled(p, q, torch.tensor([0, 1]), g) == (1, 2, RECOVERED)


def test_sampled_p_equals_q_never_rejects():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 6), -1)
    q = p[:3].clone()
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        d = torch.multinomial(q, 1, generator=g)[:, 0]
        j, _, kind = accept_sampled(p, q, d, g)
        assert (j, kind) == (3, BONUS)


def test_sampled_is_reproducible_with_the_same_generator():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(5, 10), -1)
    q = torch.softmax(torch.randn(4, 10), -1)
    d = torch.tensor([1, 2, 3, 4])
    a = [accept_sampled(p, q, d, torch.Generator().manual_seed(s)) for s in range(30)]
    b = [accept_sampled(p, q, d, torch.Generator().manual_seed(s)) for s in range(30)]
    assert a == b
    assert len(set(a)) > 1  # the generator does drive the outcome


@pytest.mark.parametrize(
    "preds, drafts, committed",
    [
        ([3, 4, 5, 6], [3, 4, 5], [3, 4, 5, 6]),  # every draft accepted, then the bonus
        ([3, 4, 5, 6], [3, 9, 5], [3, 4]),  # one accepted, then row 1's argmax (a later match does not count)
        ([3, 4, 5, 6], [0, 4, 5], [3]),
        ([7], [], [7]),
    ],
)
def test_greedy_commit_is_the_accepted_drafts_then_the_next_token(preds, drafts, committed):
    d = torch.tensor(drafts, dtype=torch.long)
    assert greedy_commit(onehot_logits(preds, vocab=10), d) == committed
    j, nxt = accept_greedy(onehot_logits(preds, vocab=10), d)
    assert committed == drafts[:j] + [nxt]


def test_greedy_commit_on_rows_read_back_by_a_batched_step_equals_its_own_readback():
    """A batched step reads every request's argmax and the logit at it at once; the commit on
    those host rows is the commit on the logits, non-finite rows included."""
    import torch

    from memra_dist.specdec.accept import NonFiniteRow, greedy_commit

    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        k = trial % 5
        logits = torch.randn(k + 1, 11, generator=g)
        drafts = logits.argmax(-1)[:k].clone()
        if k and trial % 2:
            drafts[trial % k] = (drafts[trial % k] + 1) % 11  # a rejection somewhere
        pred = logits.argmax(-1)
        rows = (pred.tolist(), logits.gather(-1, pred[:, None]).view(-1).tolist())
        assert greedy_commit(logits, drafts, rows) == greedy_commit(logits, drafts)
    bad = torch.randn(2, 11, generator=g)
    bad[0, 4] = float("nan")
    pred = bad.argmax(-1)
    with pytest.raises(NonFiniteRow):
        greedy_commit(bad, torch.zeros(1, dtype=torch.long), (pred.tolist(), bad.gather(-1, pred[:, None]).view(-1).tolist()))


def test_rounds_accepted_together_are_each_as_accepted_alone():
    """`accept_sampled_many` (the engine loop: a step's sampled rounds with one readback) gives
    every round what `accept_sampled` gives it alone with the same generator: rounds of 0 to 4
    drafts, draft distributions and one-hot drafts mixed, a round whose later rows are NaN
    (rejected there: its first non-finite row is reported only where the round reaches it)."""
    from memra_dist.specdec.accept import NonFiniteRow, accept_sampled_many
    from memra_dist.specdec.sampling import uniforms

    g = torch.Generator().manual_seed(4)
    for trial in range(40):
        rounds = []
        for r in range(1 + trial % 5):
            k = (trial + r) % 5
            p = torch.softmax(torch.randn(k + 1, 12, generator=g) * 2, -1)
            q = torch.softmax(torch.randn(k, 12, generator=g) * 2, -1) if (trial + r) % 3 else None
            d = torch.randint(0, 12, (k,), generator=g)
            if q is not None and k:
                d[0] = int(p[0].argmax())  # accepted often: later rows get reached
            if trial % 7 == 3 and r == 0 and k >= 2:
                p[2] = float("nan")
            rounds.append((p, q, d, 100 * trial + r))
        alone = []
        for p, q, d, seed in rounds:
            try:
                alone.append(accept_sampled(p, q, d, torch.Generator().manual_seed(seed)))
            except NonFiniteRow as e:
                alone.append(("nan", e.row))
        together = accept_sampled_many([p for p, *_ in rounds], [q for _, q, *_ in rounds], [d for _, _, d, _ in rounds],
                                       [uniforms(torch.Generator().manual_seed(s), d.shape[0] + 1)
                                        for _, _, d, s in rounds])
        got = [("nan", bad) if bad >= 0 else (j, nxt, kind) for j, nxt, kind, bad in together]
        assert got == alone, (trial, got, alone)


def test_rounds_without_drafts_draw_as_beside_a_round_with_drafts():
    """Plain sampled rounds (no drafts) take a shorter path when no round of the step drafts:
    each round's token and finiteness as when a drafting round rides with them."""
    from memra_dist.specdec.accept import accept_sampled_many
    from memra_dist.specdec.sampling import uniforms

    g = torch.Generator().manual_seed(8)
    ps = [torch.softmax(torch.randn(1, 30, generator=g), -1) for _ in range(5)]
    ps[3] = torch.full((1, 30), float("nan"))
    us = [uniforms(torch.Generator().manual_seed(s), 1) for s in range(5)]
    none = torch.zeros(0, dtype=torch.long)
    alone = accept_sampled_many(ps, [None] * 5, [none] * 5, us)
    extra = torch.softmax(torch.randn(2, 30, generator=g), -1)
    beside = accept_sampled_many(ps + [extra], [None] * 6, [none] * 5 + [torch.tensor([4])],
                                 us + [uniforms(torch.Generator().manual_seed(9), 2)])
    assert alone == beside[:5] and alone[3][3] == 0 and all(r[3] == -1 for i, r in enumerate(alone) if i != 3)
