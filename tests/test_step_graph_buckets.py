"""Which buckets a batched engine's step graphs (memra_dist/batching/graphs.py) capture as it
opens: every step its requests can take replays a graph captured then, none inside a request
(an 8B capture costs 0.1-0.3 s, a first use of a kernel shape up to ~0.9 s: a chat's second turn
paid that once, on an H100). The capture here only records the step's key (no forward runs)."""

from __future__ import annotations

import torch

from memra_dist.app import open_engine
from memra_dist.batching.graphs import PREFILL_TAIL_ROWS, StepGraphs, pieces
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


def test_with_the_prefix_cache_every_step_with_a_prefill_chunk_of_up_to_64_rows_was_captured_at_open(llama):
    """A tail of 1..64 rows (what a prefix-cache hit leaves: 6 rows for a chat's second turn), alone
    or beside other requests' decode rows, is eligible and its bucket was captured at open; without
    `tails` none is eligible (it rides an eager step, as it did)."""
    most, cap = 5, 96
    g = _warmed(llama, (1,), tails=True, most=most, cap=cap)
    rid = ("warm-up",)
    for n in range(1, PREFILL_TAIL_ROWS + 1):
        for beside in range(0, most):
            jobs = [Job(rid, torch.zeros(n, dtype=torch.long), 0, cap, True)]
            jobs += [Job(rid, torch.zeros(1, dtype=torch.long), 0, cap, False) for _ in range(beside)]
            if n + beside > PREFILL_TAIL_ROWS or pieces(n) + beside > most:
                assert not g.eligible(jobs)
                continue
            assert g.eligible(jobs) and g._key(jobs) in g.steps, (n, beside, g._key(jobs), sorted(g.steps))
    plain = _warmed(llama, (1,), tails=False, most=most, cap=cap)
    assert not plain.eligible([Job(rid, torch.zeros(6, dtype=torch.long), 0, cap, True)])
    assert len(plain.steps) < len(g.steps)
