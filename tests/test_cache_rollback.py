"""Rollback leaves the cache exactly as if the rejected rows had never been written: the KV
rows of the accepted prefix equal a fresh prefill's, the next forward's logits equal the
fresh cache's, and nothing was reallocated."""

from __future__ import annotations

import pytest
import torch

from memra_dist.runner import ModelRunner

CPU, F32 = torch.device("cpu"), torch.float32
CAP = 40


def _runner(d):
    r = ModelRunner(d, CPU, F32, max_pos=64)
    r.alloc(CAP)
    return r


def _ptrs(r):
    return [(st.k.data_ptr(), st.v.data_ptr()) for st in r.cache.layers.values()]


def _assert_same_prefix(a, b, n):
    for i in a.cache.layers:
        ka, kb = a.cache.layers[i].k[:n], b.cache.layers[i].k[:n]
        va, vb = a.cache.layers[i].v[:n], b.cache.layers[i].v[:n]
        torch.testing.assert_close(ka, kb, atol=1e-5, rtol=0)
        torch.testing.assert_close(va, vb, atol=1e-5, rtol=0)


@pytest.mark.parametrize("j", [0, 2, 5])  # accept none, some, all of 5 drafts
def test_rollback_equals_fresh_prefill(llama, j):
    g = torch.Generator().manual_seed(j)
    prompt = torch.randint(0, 128, (9,), generator=g)
    drafts = torch.randint(0, 128, (5,), generator=g)
    a = _runner(llama)
    ptrs = _ptrs(a)
    a.forward(prompt[:-1], 0)
    # verify: the pending token + 5 drafts written at [8, 14)
    a.forward(torch.cat([prompt[-1:], drafts]), 8)
    assert a.length == 14
    a.rollback(9 + j)  # keep the pending token and j accepted drafts
    assert a.length == 9 + j
    accepted = torch.cat([prompt, drafts[:j]])  # (9 + j,)

    fresh = _runner(llama)
    fresh.forward(accepted, 0)
    _assert_same_prefix(a, fresh, 9 + j)

    nxt = torch.randint(0, 128, (3,), generator=g)  # the next round's rows, written over the rejected ones
    la = a.forward(nxt, 9 + j)
    lf = fresh.forward(nxt, 9 + j)
    torch.testing.assert_close(la, lf, atol=1e-5, rtol=0)
    # the reference without any cache: the whole sequence in one prefill of a third runner
    ref = _runner(llama).forward(torch.cat([accepted, nxt]), 0)[-3:]
    torch.testing.assert_close(la, ref, atol=1e-4, rtol=0)
    _assert_same_prefix(a, fresh, 12 + j)
    assert _ptrs(a) == ptrs  # no reallocation, no copy of the whole cache


def test_rejected_rows_past_length_are_never_read(llama):
    """Garbage left past the committed length (here: poisoned with huge values) does not
    change a single logit of the next forward."""
    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(7))
    a, b = _runner(llama), _runner(llama)
    a.forward(ids[:8], 0)
    b.forward(ids[:8], 0)
    for st in a.cache.layers.values():
        st.k[8:].fill_(1e4)
        st.v[8:].fill_(-1e4)
    torch.testing.assert_close(a.forward(ids[8:], 8), b.forward(ids[8:], 8), atol=1e-5, rtol=0)


def test_repeated_rollbacks(llama):
    """Several rounds of write K+1, roll back, as a session does, end equal to one prefill."""
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 128, (30,), generator=g).tolist()
    a = _runner(llama)
    a.forward(torch.tensor(seq[:5]), 0)
    n = 5  # committed rows
    for acc in (0, 3, 1, 4, 2):
        junk = torch.randint(0, 128, (4 - acc,), generator=g).tolist()
        rows = seq[n:n + acc + 1] + junk  # acc+1 right rows then wrong drafts
        a.forward(torch.tensor(rows), n)
        n += acc + 1
        a.rollback(n)
    fresh = _runner(llama)
    fresh.forward(torch.tensor(seq[:n]), 0)
    _assert_same_prefix(a, fresh, n)
    tail = torch.tensor(seq[n:n + 2])
    torch.testing.assert_close(a.forward(tail, n), fresh.forward(tail, n), atol=1e-5, rtol=0)


def test_rollback_bounds(llama):
    a = _runner(llama)
    a.forward(torch.tensor([1, 2, 3]), 0)
    with pytest.raises(ValueError):
        a.rollback(4)
    with pytest.raises(ValueError):
        a.rollback(-1)
    a.rollback(0)
    assert a.length == 0


def test_session_leaves_the_committed_length_after_every_round(llama):
    """In a speculative session with full, partial and zero accepts, the target cache holds
    exactly the committed rows after every round: every token but the pending last one
    (len(tokens) - 1), never the verify's rejected rows (which positions alone would mask on
    an attention cache)."""
    from memra_dist.phase.levels import TraceSettings
    from memra_dist.specdec.drafters.replay import ReplayDrafter
    from memra_dist.specdec.sampling import SamplingParams
    from memra_dist.specdec.session import SpecSession

    prompt, n_new = [5, 6, 7, 8, 9, 5, 6, 7], 30
    ref = _runner(llama)
    seq = list(prompt)
    for _ in range(n_new):  # plain greedy by full prefills: the recording the drafter replays
        seq.append(int(ref.forward(torch.tensor(seq), 0)[-1].argmax()))
    target = ModelRunner(llama, CPU, F32, max_pos=64)
    drafter = ReplayDrafter(seq[len(prompt):], len(prompt), 128, corrupt=0.3, seed=1)
    s = SpecSession(target, drafter, SamplingParams(), torch.Generator().manual_seed(0), 4,
                    TraceSettings(level=0))
    out = [s.start(prompt, n_new, CAP)]
    assert target.length == len(prompt)
    kinds = set()
    while not s.done:
        drafted, accepted = s.stats.drafted, s.stats.accepted
        out += s.burst(1)
        k, j = s.stats.drafted - drafted, s.stats.accepted - accepted
        kinds.add("none" if j == 0 else "all" if j == k else "some")
        assert target.length == target.cache.length == len(s.tokens) - 1, (k, j)
    assert out == seq[len(prompt):]
    assert kinds == {"none", "some", "all"}, kinds
