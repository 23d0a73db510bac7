"""benchmarks/tap_drafters.py: its tiny path end to end (slow: two families, four fresh
processes), and its parts: the bench-only TapReplay drafter pays the real propose and returns
the replay's tokens; the MTP step's read bytes; the checkpoints load into the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memra_dist.bench import tap_checkpoints as tc
from memra_dist.bench.tap_replay import TapReplay
from memra_dist.specdec.drafters.base import Drafter, Proposal
from memra_dist.specdec.drafters.replay import ReplayDrafter
from memra_dist.specdec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


class _Counting(Drafter):
    name = "counting"

    def __init__(self):
        self.calls = []

    def propose(self, context, k, sp, gen):
        self.calls.append((len(context), k))
        return Proposal(torch.full((k,), 7, dtype=torch.long))


def test_tap_replay_pays_the_real_propose_and_returns_the_recording():
    real = _Counting()
    rec = list(range(100, 140))
    d = TapReplay(real, ReplayDrafter(rec, 5, 1000, corrupt=0.0))
    p = d.propose(list(range(5)) + rec[:3], 4, SamplingParams(), torch.Generator())
    assert real.calls == [(8, 4)]
    assert p.tokens.tolist() == rec[3:7] and p.q is None


def test_mtp_step_read_bytes_counts_top_k_of_the_routed_experts():
    cfg = tc.dsv3_config("tiny")
    r = tc.mtp_step_read_bytes(cfg)
    H, I, E, K = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    assert r["parts"]["routed_top_k"] == K * 3 * H * I * 2
    assert r["parts"]["lm_head"] == cfg["vocab_size"] * H * 2
    assert r["bytes"] == sum(r["parts"].values())
    real = tc.mtp_step_read_bytes(tc.dsv3_config("8b"))  # the 8b slice: ~3.2 GB a step, most of it the lm_head
    assert 3.0e9 < real["bytes"] < 3.5e9


def test_tiny_checkpoints_load_as_engine_drafters(tmp_path):
    from memra_dist.model.config import load_config
    from memra_dist.model.dflash import check_dflash, load_dflash_config
    from memra_dist.model.mtp import check_mtp

    cpu = torch.device("cpu")
    target, draft = tc.ensure_dflash("tiny", tmp_path, cpu, lambda s: None)
    dc = load_dflash_config(draft)
    check_dflash(load_config(target), dc)
    assert dc.block_size == 16 and dc.tap_ids == (0, 1)
    m = tc.ensure_dsv3_mtp("tiny", tmp_path, cpu, lambda s: None)
    assert check_mtp(load_config(m), m) == 1


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path):
    env = dict(os.environ, MEMRA_BENCH_CACHE=str(tmp_path / "ckpt"), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tap_drafters.py"), str(tmp_path / "out"),
                        "--shape", "tiny"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == json.loads((tmp_path / "out" / "tap_drafters.json").read_text())
    assert len(res["figures"]) == 2 + 1 + 3 + 1
    for fam, k in (("dflash", 15), ("mtp", 3)):
        rep = res[fam]["replay"]
        assert rep["k"] == k and rep["replay_follows_recording"]
        assert abs(rep["acceptance_measured"] - rep["acceptance_set"]) < 0.1
        assert rep["fraction_of_ideal"] > 0 and rep["projected_speedup_at_tau"] > 0
    assert res["dflash"]["real"]["15"]["drafted"] > 0
    assert set(res["mtp"]["draft_per_token"]) == {"1", "2", "3"}
    assert "dflash draft / verify(16) per round" in p.stderr
