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
