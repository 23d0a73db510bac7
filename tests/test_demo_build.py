"""The demo's first run: the tiny target + draft train from scratch into the cache directory,
report progress, leave torch's thread count as it was, and then give the corpus's text with
the drafter agreeing with the target on the demo prompt."""

from __future__ import annotations

import json
import re

import pytest
import torch

from memra_dist.app import DEMO_PROMPT
from memra_dist.cli import main
from memra_dist.demo.corpus import CORPUS
from memra_dist.demo.tiny import DEMO_RECIPE, DEMO_VERSION, demo_checkpoints


@pytest.fixture
def _fresh_env():
    from memra_dist.env import environment

    environment.cache_clear()  # MEMRA_CACHE_DIR is read once per process
    yield
    environment.cache_clear()


@pytest.mark.slow  # trains the tiny models: ~5 s on 2 cores (CI's demo step runs the demo too)
def test_demo_trains_caches_and_agrees(tmp_path, monkeypatch, capsys, _fresh_env):
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # the traced demo run writes ./runs/<time>
    threads_before = torch.get_num_threads()
    said: list[str] = []
    target, draft = demo_checkpoints(said.append)
    assert torch.get_num_threads() == threads_before
    assert target == tmp_path / "cache" / f"demo-v{DEMO_VERSION}" / "target"
    for d in (target, draft):
        assert {p.name for p in d.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    for name, (steps, _, _) in DEMO_RECIPE.items():
        assert f"training the demo {name}: step 1/{steps} loss" in "\n".join(said)
        assert any(re.match(rf"training the demo {name}: step {steps}/{steps} loss \d", s) for s in said)
        assert any(s.startswith(f"built the demo {name} in ") for s in said)

    # a second call reuses the cache: no training, same paths
    again: list[str] = []
    assert demo_checkpoints(again.append) == (target, draft) and again == []

    rc = main(["demo", "--json", "--max-new-tokens", "48", "--device", "cpu"])
    out, _ = capsys.readouterr()
    assert rc == 0
    res = json.loads(out)
    st = res["stats"]
    assert st["tokens"] == 48
    assert st["acceptance"] >= 0.9, st
    # greedy: the target continues the corpus's first paragraph word for word
    rest = CORPUS[len(DEMO_PROMPT):].replace("\n", " ").lstrip()
    assert len(res["text"]) > 100 and rest.startswith(res["text"].lstrip()[:100]), res["text"]
