"""Which buckets a batched engine's step graphs (memra_dist/batching/graphs.py) capture as it
opens: every step its requests can take replays a graph captured then, none inside a request
(an 8B capture costs 0.1-0.3 s, a first use of a kernel shape up to ~0.9 s: a chat's second turn
paid that once, on an H100). The capture here only records the step's key (no forward runs)."""

from __future__ import annotations

import torch

from memra_dist.app import open_engine
from memra_dist.batching.graphs import PREFILL_TAIL_ROWS, StepGraphs, graph_rows, pieces, tail_bucket
from memra_dist.batching.job import Job
from memra_dist.config import RunConfig


class _Keys:
    """A capture that records nothing but that it happened: its output is zeros."""

    def __init__(self, fn, pool):
        self.out = (torch.zeros(PREFILL_TAIL_ROWS * 4, 8), {})

    def replay(self) -> None:
        pass


def _warmed(llama, rows_each, tails: bool, most: int = 5, cap: int = 96):
    cfg = RunConfig(model=str(llama), drafter="none", device="cpu", dtype="fp32", max_new_tokens=4)
    with open_engine(cfg, capacity=cap, max_batch=most) as eng:
        b = eng._backend.batcher
        g = StepGraphs(b, b.max_tokens, graph_cls=_Keys)
        n, _ = g.warm(most, rows_each, cap, tails=tails)
        assert n == g.captures == len(g.steps)
        return g


def test_with_the_prefix_cache_every_step_with_a_prefill_chunk_was_captured_at_open(llama):
    """A chunk of 1..capacity rows (what a prefix-cache hit leaves: 6 rows for a chat's second
    turn, a batch job's own 200-token lines after a shared header), alone or beside other
    requests' decode rows, is eligible and its bucket (by 64 rows past 64, row class 16) was
    captured at open; chunks of more than PREFILL_TAIL_ROWS rows in all are not (a prefill's
    step, eager); without `tails` none is eligible (it rides an eager step)."""
    most, cap = 5, 96
    g = _warmed(llama, (1,), tails=True, most=most, cap=cap)
    rid = ("warm-up",)

    def job(n, last):
        return Job(rid, torch.zeros(n, dtype=torch.long), 0, cap, last)

    for n in range(1, cap + 1):
        for beside in range(0, most):
            jobs = [job(n, True)] + [job(1, False) for _ in range(beside)]
            assert g.eligible(jobs) and g._key(jobs) in g.steps, (n, beside, g._key(jobs), sorted(g.steps))
            assert g._key(jobs)[1] == 16 and g._key(jobs)[0] == tail_bucket(n + beside)
    assert g.tail_top == tail_bucket(cap + most - 1)  # the largest step warm captured: no step larger
    assert not g.eligible([job(g.tail_top // 2, True), job(g.tail_top // 2, True), job(1, False)])
    assert not g.eligible([job(PREFILL_TAIL_ROWS + 1, True)])
    assert not g.eligible([job(PREFILL_TAIL_ROWS // 2, True), job(PREFILL_TAIL_ROWS // 2 + 1, True)])
    assert g.segments(True) == most + pieces(PREFILL_TAIL_ROWS) and g.segments(False) == most
    # the logits buffer every graph writes holds the largest step captured, not the row budget's
    assert max(k[0] for k in g.steps) <= g.max_rows == graph_rows(8192, most) < 8192 == g.b.max_tokens
    plain = _warmed(llama, (1,), tails=False, most=most, cap=cap)
    assert not plain.eligible([job(6, True)])
    assert len(plain.steps) < len(g.steps)
