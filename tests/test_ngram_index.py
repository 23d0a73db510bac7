"""The incremental n-gram index proposes exactly what the reference scan does."""

from __future__ import annotations

import random
import time

import pytest

from memra_dist.specdec.drafters.ngram import NgramIndex, lookup


@pytest.mark.parametrize("vocab, seed", [(3, 0), (5, 1), (20, 2), (200, 3)])
def test_index_equals_the_reference_as_the_context_grows(vocab, seed):
    rng = random.Random(seed)
    ctx = [rng.randrange(vocab) for _ in range(5)]
    ix = NgramIndex(3, 1)
    for _ in range(400):
        k = rng.randrange(1, 6)
        assert ix.lookup(ctx, k) == lookup(ctx, k), (len(ctx), k)
        ctx.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))  # a round commits 1..3 tokens


def test_a_new_or_shorter_context_starts_over():
    ix = NgramIndex(3, 1)
    a = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert ix.lookup(a, 3) == lookup(a, 3)
    b = [7, 8, 9, 7, 8]
    assert ix.lookup(b, 2) == lookup(b, 2) == [9, 7]
    assert ix.lookup(a[:6], 2) == lookup(a[:6], 2)


def test_lookup_cost_does_not_grow_with_the_context():
    """Correctness of the incremental design, not a benchmark: a 4k context's proposals take
    a handful of dict lookups, so 200 proposals stay far below the reference's scans."""
    rng = random.Random(0)
    ctx = [rng.randrange(1000) for _ in range(4096)]
    ix = NgramIndex(3, 1)
    ix.lookup(ctx, 4)  # indexes the context once
    t0 = time.perf_counter()
    for _ in range(200):
        ctx.append(rng.randrange(1000))
        ix.lookup(ctx, 4)
    assert time.perf_counter() - t0 < 1.0
