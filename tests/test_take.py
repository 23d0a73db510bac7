"""Which waiting submissions a step takes (memra_dist/batching/take.py): the engine loop keeps a
step's prefill chunks within what a graphed step holds while few prompt rows wait."""

from __future__ import annotations

import random
from collections import namedtuple

from memra_dist.batching.take import EAGER_PREFILL_ROWS, PREFILL_TAIL_ROWS, take

J = namedtuple("J", "n last")


def test_a_step_keeps_its_chunks_within_the_tail_rows_and_defers_only_chunks():
    """Over random queues of decode / verify rows and chunks: the step takes jobs in arrival order
    within the row budget; with graphed chunks it holds at most PREFILL_TAIL_ROWS chunk rows while
    fewer than EAGER_PREFILL_ROWS wait (only a chunk is ever passed over, for the next step, and
    only while one is taken; the rows after it may then fill the budget); from EAGER_PREFILL_ROWS waiting, or with a chunk larger than the tail
    rows, it takes what the budget allows, as without graphs."""
    rng = random.Random(0)
    for _ in range(2000):
        jobs = [J(rng.choice((1, 1, 5, 16, 40, 200, 250, 300)), rng.random() < 0.4) for _ in range(rng.randint(1, 12))]
        jobs = [J(j.n if j.last else min(j.n, 16), j.last) for j in jobs]
        budget = rng.choice((64, 512, 8192))
        plain = take(jobs, budget)
        assert plain[0] == 0 and plain == list(range(len(plain)))
        assert sum(jobs[i].n for i in plain) <= budget or len(plain) == 1
        got = take(jobs, budget, PREFILL_TAIL_ROWS, EAGER_PREFILL_ROWS)
        assert got == sorted(got) and got[0] == 0
        assert sum(jobs[i].n for i in got) <= budget or len(got) == 1
        skipped = [i for i in range(got[-1]) if i not in got]  # passed over: later jobs went first
        chunks = [jobs[i].n for i in got if jobs[i].last]
        waiting = sum(jobs[i].n for i in plain if jobs[i].last)
        if waiting >= EAGER_PREFILL_ROWS or any(jobs[i].last and jobs[i].n > PREFILL_TAIL_ROWS for i in plain):
            assert got == plain
        else:
            assert sum(chunks) <= PREFILL_TAIL_ROWS
            assert all(jobs[i].last for i in skipped) and (not skipped or chunks)
        # no chunk waits for ever: the first one the budget reaches is always taken
        first = next((i for i in plain if jobs[i].last), None)
        assert first is None or first in got
