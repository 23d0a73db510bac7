"""batching/verify_ahead.py's device move on a graphed step's own packed inputs: a step packed as
if nothing of the rounds before were accepted, moved by `Advance.apply` with each request's
acceptance and bonus token (and a plain row's argmax), equals the step packed on the host at
the starts the acceptance gives; `resolve`, the eager path's, moves the jobs the same way."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from memra_dist.batching.blocks import BlockPool
from memra_dist.batching.graphs import StepGraphs, _Step
from memra_dist.batching.job import Job
from memra_dist.batching.verify_ahead import Advance
from memra_dist.specdec.drafters.dflash_pool_graph import DeviceDrafts


def _packer(pool: BlockPool):
    """StepGraphs' packing over `pool` alone (no stage, no graph)."""
    g = StepGraphs.__new__(StepGraphs)
    g.b = SimpleNamespace(pool=pool, kv=SimpleNamespace(scratch=pool.rows))

    def pack(jobs, T: int, W: int) -> _Step:
        host = torch.zeros(5 * T + T * W, dtype=torch.long)
        st = _Step(T, W, host, host, np=host.numpy())
        g._pack(st, jobs)
        return st

    return pack


def test_a_step_packed_ahead_and_moved_on_the_device_is_the_step_packed_at_its_starts():
    block, W, T = 4, 6, 16
    pool = BlockPool(num_blocks=40, block=block)
    for r in range(3):
        assert pool.reserve(r, 1)
    for rows in range(block + 1, W * block + 1, block):  # grown in turn: each table's blocks interleaved
        assert all(pool.grow(r, rows) for r in range(3))
    assert pool.table(1) == [1, 4, 7, 10, 13, 16]
    # rounds just verified: request 0 at lo 5 with 3 drafts, 2 accepted; request 2 at lo 9, 0
    # accepted; request 1 a plain row at position 7 (its next input: row 4 of the step's argmax)
    acc, bonus = torch.tensor([2, 0]), torch.tensor([41, 42])
    dd = DeviceDrafts(torch.tensor([[11, 12, 13], [21, 22, 23]]), acc, bonus)
    pred = torch.arange(100, 112)
    ahead = [Job(0, [0] * 4, 6, 24, False), Job(1, [0], 8, 24, False), Job(2, [0] * 3, 10, 24, False)]
    ahead[0].ahead, ahead[2].ahead = (dd, 0, 6), (dd, 1, 10)
    ahead[1].argmax = 4
    pack = _packer(pool)
    st = pack(ahead, T, W)
    Advance(ahead, pred).apply(*[st.views()[i] for i in (0, 1, 2, 5)], block)
    want = pack([Job(0, [41, 0, 0, 0], 8, 24, False), Job(1, [104], 8, 24, False),
                 Job(2, [42, 0, 0], 10, 24, False)], T, W)
    assert torch.equal(st.host, want.host)  # ids (the drafts' rows: DraftPatch's), positions, slots, segments, tables
    Advance(ahead, pred).resolve()  # (the eager path: the same move, read on the host)
    assert [(j.start, j.ids[0]) for j in ahead] == [(8, 41), (8, 104), (10, 42)]
