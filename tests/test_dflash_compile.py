"""The DFlash network's compiled pieces (specdec/drafters/dflash_compile.py), swapped in while
its block graphs are captured: the block forward through them equals the eager one (outputs
and the K/V it writes, fp32 on CPU, compiled here by inductor's CPU backend); they are on only
where the target compiles its blocks; a piece that fails to compile leaves the graphs on the
eager forward with one warning line, and the drafts unchanged."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from graph_emulator import EmulatedCapture
from memra_dist.bench.tap_checkpoints import ensure_dflash
from memra_dist.model.dflash import load_dflash_config
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters import dflash_graph
from memra_dist.specdec.drafters.dflash import DFlashDrafter
from memra_dist.specdec.drafters.dflash_compile import compiled_pieces, target_compiles

CPU, CAP = torch.device("cpu"), 160


def _setup(tmp_path):
    target_dir, draft_dir = ensure_dflash("tiny", tmp_path, CPU, lambda s: None)
    target = ModelRunner(target_dir, CPU, torch.float32, max_pos=CAP)
    d = DFlashDrafter.load(draft_dir, load_dflash_config(draft_dir), target)
    target.alloc(CAP)
    d.alloc(CAP)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(3))
    target.forward(ids[:24], 0)
    d.prime(ids[:24].tolist())
    return target, d, ids


@pytest.mark.slow  # inductor compiles four small functions for the CPU (~30 s)
def test_compiled_pieces_give_the_eager_block(tmp_path):
    _, d, ids = _setup(tmp_path)
    last, start = int(ids[23]), 23
    eager = d.block_logits(last, start, 7).clone()
    k_eager = [s.k.clone() for s in d.states]
    with compiled_pieces(d.net):
        compiled = d.block_logits(last, start, 7).clone()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for s, k in zip(d.states, k_eager):
        torch.testing.assert_close(s.k, k, rtol=1e-5, atol=1e-5)
    assert "qkv" not in vars(d.net.layers[0].self_attn)  # the eager methods are back


def test_pieces_follow_the_targets_compile_switch():
    blocks = {"0": SimpleNamespace(), "1": SimpleNamespace()}
    target = SimpleNamespace(stage=SimpleNamespace(layers=blocks))
    assert not target_compiles(target)
    blocks["1"]._compiled = object()  # graphs.compile_blocks ran
    assert target_compiles(target)
    assert not target_compiles(SimpleNamespace())  # a pipeline head without a local stage object
    # a runner built by the engine carries the run's --compile for the dflash path, which wins
    # over its own blocks (auto: the pieces compile while the target's blocks do not)
    assert target_compiles(SimpleNamespace(stage=SimpleNamespace(layers={}), compile_drafter=True))
    assert not target_compiles(SimpleNamespace(stage=target.stage, compile_drafter=False))


def test_a_piece_that_fails_to_compile_leaves_the_graphs_eager(tmp_path, monkeypatch, capsys):
    _, d, ids = _setup(tmp_path)
    last, start = int(ids[23]), 23
    eager = d.block_logits(last, start, 7).clone()

    @contextmanager
    def broken(net, on=True):
        raise RuntimeError("inductor: no C++ compiler\nmore lines")
        yield

    monkeypatch.setattr(dflash_graph, "compiled_pieces", broken)
    graphs = dflash_graph.BlockGraphs(d, graph_cls=EmulatedCapture)
    graphs.compiled = True  # as on CUDA behind a compiling target
    replayed = graphs.logits(last, start, 7).clone()
    assert torch.equal(replayed, eager)
    assert graphs.compiled is False
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["memra-dist: warning: the DFlash drafter's compiled pieces failed to build (inductor: no C++ "
                   "compiler); its graphs capture the eager forward"]
