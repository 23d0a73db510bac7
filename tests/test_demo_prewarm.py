"""The demo's kernels compiled while its models train (memra_dist/demo/prewarm.py): the child runs
the demo's command on untrained checkpoints of the demo's shapes and exits 0, it is started
before any training and only where kernels compile, and it leaves nothing behind."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from memra_dist.cli import build_parser
from memra_dist.demo import prewarm, tiny


def _args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["demo", *extra])


@pytest.mark.slow  # a child process building the demo's kernels: ~4 s on 2 cores
def test_the_child_runs_the_demos_command_on_the_demos_shapes_and_cleans_up():
    """On the CPU (the child's command is the same there): the untrained checkpoints have the
    demo's shapes, the child's generate exits 0, and its scratch directory is gone after."""
    tok = tiny.train_tokenizer()
    shapes = {n: tiny.llama_config(tok.get_vocab_size(), **tiny.DEMO_SHAPES[n]) for n in tiny.DEMO_RECIPE}
    said: list[str] = []
    w = prewarm.Prewarm(_args("--device", "cpu", "--max-new-tokens", "8"), "Once upon a time", said.append)
    w.start(shapes, tok)
    scratch = Path(w.dir)
    from memra_dist.model.config import load_config

    assert load_config(str(scratch / "target")).hidden_size == shapes["target"]["hidden_size"]
    assert "--draft-model" in w.proc.args and w.proc.args[w.proc.args.index("--drafter") + 1] == "model"
    assert w.join(timeout=120) == 0, said
    assert not scratch.exists() and any("exit 0" in s for s in said)


def test_it_starts_before_the_models_train_with_the_shapes_they_are_trained_at(tmp_path, monkeypatch):
    order: list[tuple] = []
    monkeypatch.setattr(tiny, "demo_cache_dir", lambda: tmp_path / "demo")
    monkeypatch.setattr(tiny, "build_checkpoint", lambda out, cfg, tok, **kw: order.append(("build", cfg)) or out)
    tiny.demo_checkpoints(before_training=lambda shapes, tok: order.append(("warm", shapes)))
    assert [o[0] for o in order] == ["warm", "build", "build"]
    assert [o[1] for o in order[1:]] == list(order[0][1].values())


@pytest.mark.parametrize("flags", [("--device", "cpu"), ("--kernels", "off")])
def test_nothing_is_started_where_nothing_compiles(flags, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (even with a GPU)
    assert not prewarm.wanted(_args(*flags))
    assert prewarm.wanted(_args("--device", "cuda"))


def test_a_child_that_overruns_is_stopped_and_its_files_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(prewarm, "warm_command", lambda *a: ["sleep", "30"])
    tok = tiny.train_tokenizer()
    shapes = {n: tiny.llama_config(tok.get_vocab_size(), **tiny.DEMO_SHAPES[n]) for n in tiny.DEMO_RECIPE}
    w = prewarm.Prewarm(_args("--device", "cpu"), "x")
    w.start(shapes, tok)
    scratch, pid = Path(w.dir), w.proc.pid
    assert w.join(timeout=0.5) is None
    assert not scratch.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
