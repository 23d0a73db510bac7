"""benchmarks/loop_gpu_check.py (the GPU's fast path against its reference, per family and
drafter) run on the CPU: its rows, its JSON, its exit codes."""

from __future__ import annotations

import doctest
import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "loop_gpu_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("loop_gpu_check", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_doctests(check):
    assert doctest.testmod(check).failed == 0


def test_rows_equal_their_reference_and_land_in_the_json(check, tmp_path):
    rc = check.main([str(tmp_path), "--device", "cpu", "--families", "qwen3", "--drafters", "none,ngram",
                     "--new", "8"])
    rows = json.loads((tmp_path / "loop_gpu_check.json").read_text())
    assert rc == 0
    assert [(r["family"], r["drafter"]) for r in rows] == [("qwen3", "none"), ("qwen3", "ngram")]
    assert all(r["alone_equal"] and r["batched_equal"] and r["alone_engine"] == "loop" for r in rows)
    assert rows[1]["counts"]["chained_rounds"] > 0  # the batched engine's loop ran the n-gram rounds


def test_a_path_that_differs_fails_the_shell_and_says_where(check, tmp_path, monkeypatch):
    import memra_dist.app as app

    real = app.Engine.generate

    def off_by_one(self, prompt, cfg, *a, **kw):  # every fast-path run's last token changed
        res = real(self, prompt, cfg, *a, **kw)
        if cfg.kernels != "off":
            res.token_ids[-1] += 1
        return res

    monkeypatch.setattr(app.Engine, "generate", off_by_one)
    rc = check.main([str(tmp_path), "--device", "cpu", "--families", "llama", "--drafters", "none", "--new", "6"])
    row = json.loads((tmp_path / "loop_gpu_check.json").read_text())[0]
    assert rc == 1
    assert not row["alone_equal"] and not row["batched_equal"]
    assert [r for r, _ in row["alone_first_diff"]] == [0, 1, 2, 3]  # every request, at its last token
    assert {i for _, i in row["alone_first_diff"]} == {5}  # token 6 of 6 (the ids after the prompt)


def test_an_unknown_family_is_exit_2(check, tmp_path, capsys):
    assert check.main([str(tmp_path), "--device", "cpu", "--families", "gpt2"]) == 2
    assert "unknown family 'gpt2'" in capsys.readouterr().err


def test_sampled_rows_are_seeded_alike_on_every_path(check, tmp_path, monkeypatch):
    """`--temperature`: every request samples (top-k too) with one seed on each path, so the fast
    path's ids still equal the reference's (the drafts' and the acceptance's draws alike)."""
    import memra_dist.app as app

    real, asked = app.Engine.generate, set()

    def generate(self, prompt, cfg, *a, **kw):
        asked.add((cfg.sampling.temperature, cfg.sampling.top_k, cfg.seed))
        return real(self, prompt, cfg, *a, **kw)

    monkeypatch.setattr(app.Engine, "generate", generate)
    rc = check.main([str(tmp_path), "--device", "cpu", "--families", "qwen3", "--drafters", "eagle3",
                     "--new", "8", "--temperature", "0.9", "--top-k", "20"])
    row = json.loads((tmp_path / "loop_gpu_check.json").read_text())[0]
    assert rc == 0 and row["alone_equal"] and row["batched_equal"], row
    assert row["counts"]["chained_rounds"] > 0 and asked == {(0.9, 20, 7)}
