"""The DFlash block forward's graph (specdec/drafters/dflash_graph.py), checked on the CPU with an
emulated capture (graph_emulator.py): captured once per row count at one block start, then
replayed at later starts with no Python in between, it gives the eager block_logits exactly
(fp32), as the context grows through ingests; and a greedy session drafting through the
replayed graph equals one drafting eagerly (ids, drafted and accepted counts)."""

from __future__ import annotations

import torch

from graph_emulator import EmulatedGraph
from memra_dist.bench.tap_checkpoints import ensure_dflash
from memra_dist.model.dflash import load_dflash_config
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters.dflash import DFlashDrafter
from memra_dist.specdec.drafters.dflash_graph import BlockGraphs
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

CPU, CAP = torch.device("cpu"), 160


class _Emulated:
    """graph_cls for BlockGraphs: two eager warm-ups, then an emulated capture."""

    captures = 0

    def __init__(self, fn, pool):
        for _ in range(2):
            fn()
        self.g = EmulatedGraph()
        self.out = self.g.capture(fn)
        _Emulated.captures += 1

    def replay(self) -> None:
        self.g.replay()


def _setup(tmp_path):
    target_dir, draft_dir = ensure_dflash("tiny", tmp_path, CPU, lambda s: None)
    target = ModelRunner(target_dir, CPU, torch.float32, max_pos=CAP)
    d = DFlashDrafter.load(draft_dir, load_dflash_config(draft_dir), target)
    return target, d


def test_replayed_block_equals_eager_at_every_start(tmp_path):
    target, d = _setup(tmp_path)
    target.alloc(CAP)
    d.alloc(CAP)
    assert d.graph is None  # CPU: the eager forward, the reference
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (80,), generator=g)
    P = 20
    target.forward(ids[:P], 0)
    d.prime(ids[:P].tolist())
    graphs = BlockGraphs(d, graph_cls=_Emulated)
    before = _Emulated.captures
    n = P
    for step, rows in enumerate((15, 15, 7, 15, 7, 15)):
        add = 1 + step % 3  # rows committed this round (as after a verify)
        target.forward(ids[n:n + add], n)
        n += add
        d._ingest(n - 1)
        last, start = int(ids[n - 1]), n - 1
        eager = d.block_logits(last, start, rows).clone()
        replayed = graphs.logits(last, start, rows).clone()
        assert torch.equal(eager, replayed), (step, (eager - replayed).abs().max())
    assert _Emulated.captures - before == 2  # one per row count, replayed at every later start


def test_session_drafting_through_the_graph_equals_eager(tmp_path):
    target, d = _setup(tmp_path)
    prompt = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(5)).tolist()

    def run(graphed: bool):
        s = SpecSession(target, d, SamplingParams(), torch.Generator().manual_seed(0), 15)
        out = [s.start(prompt, 40, CAP)]
        if graphed:
            d.graph = BlockGraphs(d, graph_cls=_Emulated)  # after alloc, as dflash.alloc builds it on CUDA
        while not s.done:
            out.extend(s.burst(4))
        d.graph = None
        return out, s.stats.drafted, s.stats.accepted

    eager = run(False)
    before = _Emulated.captures
    assert run(True) == eager
    assert _Emulated.captures > before and eager[1] > 0  # the graph drafted every round
