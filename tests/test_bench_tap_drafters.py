"""benchmarks/tap_drafters.py: its tiny path end to end (slow: three families, six fresh
processes), and its parts: the bench-only TapReplay drafter pays the real propose and returns
the replay's tokens; the MTP step's and the EAGLE-3 round's read bytes; the checkpoints load
into the engine."""

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


def test_eagle3_read_bytes_per_drafted_token():
    from memra_dist.bench.checkpoints import shape_config

    cfg = tc.eagle3_config(shape_config("8b"), "8b")  # the public Llama-3.1-8B EAGLE-3 layout
    assert cfg["draft_vocab_size"] == 32000 and cfg["hidden_size"] == 4096 and cfg["num_hidden_layers"] == 1
    r7, r1 = tc.eagle3_read_bytes(cfg, 7), tc.eagle3_read_bytes(cfg, 1)
    H, I, Vd = 4096, 14336, 32000
    layer = (32 * 128 + 2 * 8 * 128) * 2 * H + 32 * 128 * H + 3 * H * I + 3 * H  # q/k/v [*, 2H], o, mlp, norms
    assert r7["parts"]["layer"] == layer * 2 and r7["parts"]["lm_head"] == Vd * H * 2
    assert r1["parts"]["fc_over_k"] == 3 * H * H * 2 and r7["parts"]["fc_over_k"] == 3 * H * H * 2 // 7
    assert r7["bytes"] == sum(r7["parts"].values()) and 0.7e9 < r7["bytes"] < 0.8e9


def test_dflash_read_bytes_a_block_forward_and_the_draft_kv_a_position():
    from memra_dist.bench.checkpoints import shape_config

    t = shape_config("8b")
    cfg = tc.dflash_config(t, "8b")  # the public Llama-3.1-8B DFlash layout: 5 layers over 5 taps
    H, I, L = 4096, 14336, 5
    layer = 2 * H * H + 2 * 1024 * H + 3 * H * I + 2 * H + 2 * 128  # q, o, k, v, mlp, 2 norms, q/k norms
    net = L * layer + 5 * H * H + 2 * H  # + fc over the 5 taps' concatenation, hidden_norm, norm
    r = tc.dflash_read_bytes(cfg, t)
    assert r["parts"] == {"drafter": net * 2, "target_lm_head": 128256 * H * 2}
    assert r["bytes"] == sum(r["parts"].values()) and 3.3e9 < r["bytes"] < 3.5e9
    assert tc.draft_kv_bytes(cfg) == L * 2 * 8 * 128 * 2  # 5 layers' K and V a position, bf16
    assert tc.draft_kv_bytes(tc.eagle3_config(t, "8b"), torch.float32) == 1 * 2 * 8 * 128 * 4


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
    from memra_dist.model.eagle3 import check_eagle3, load_eagle3, load_eagle3_config

    t2, e = tc.ensure_eagle3("tiny", tmp_path, cpu, lambda s: None)
    assert t2 == target  # beside the same target
    ec = load_eagle3_config(e, load_config(target))
    check_eagle3(load_config(target), ec)
    net = load_eagle3(e, ec, cpu, torch.float32)
    assert ec.tap_ids == (0, 1) and ec.draft_vocab_size == 256 and net.embed_tokens is None
    assert net.hot.unique().numel() == 256 and int(net.hot.max()) < ec.base.vocab_size


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path):
    env = dict(os.environ, MEMRA_BENCH_CACHE=str(tmp_path / "ckpt"), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tap_drafters.py"), str(tmp_path / "out"),
                        "--shape", "tiny"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == json.loads((tmp_path / "out" / "tap_drafters.json").read_text())
    assert len(res["figures"]) == 2 + 1 + 3 + 1 + 2 + 1
    for fam, k in (("dflash", 15), ("mtp", 3), ("eagle3", 7)):
        rep = res[fam]["replay"]
        assert rep["k"] == k and rep["replay_follows_recording"]
        # the acceptance inverted from ~35 rounds' tokens (tiny: 120 new tokens): its standard
        # error is ~0.05 at K 7, so 0.15 is three of them (a replay off by a whole K is far outside)
        assert abs(rep["acceptance_measured"] - rep["acceptance_set"]) < 0.15
        assert rep["fraction_of_ideal"] > 0 and rep["projected_speedup_at_tau"] > 0
    assert res["dflash"]["real"]["15"]["drafted"] > 0
    assert set(res["mtp"]["draft_per_token"]) == {"1", "2", "3"}
    assert set(res["eagle3"]["draft_per_token"]) == {"3", "7"} and res["eagle3"]["real"]["7"]["drafted"] > 0
    assert "dflash draft / verify(16) per round" in p.stderr


@pytest.mark.slow  # a tiny batched run at levels 0 and 1 in a subprocess (~10 s)
def test_the_batching_bench_prices_a_steps_draft_phase_against_its_forwards_reads(tmp_path):
    """`benchmarks/batching.py --drafter eagle3-replay --levels 0,1 --no-prefix-cache` on the CPU: the fixed-K row
    carries `draft_read`, its level-1 draft phase a round over K chained forwards' reads (the
    head's weights + every request's draft K/V over its mean context) at the measured copy
    bandwidth, and says so in one line under the table."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MEMRA_BENCH_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "batching.py"), str(tmp_path / "out"),
                        "--concurrency", "4", "--max-batch", "4", "--only-batched", "--drafter", "eagle3-replay",
                        "--prompt", "32", "--new", "24", "--levels", "0,1", "--no-prefix-cache"], capture_output=True, text=True,
                       timeout=600, cwd=root, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    row = next(r for r in json.loads((tmp_path / "out" / "batching.json").read_text())["rows"]
               if r["drafter"] == "eagle3-replay")
    assert row["prefix_cache"] is False and "prefix_cache" not in row["batcher"]  # --no-prefix-cache reached the engine
    d = row["draft_read"]
    cfg = json.loads(next((tmp_path / "cache").rglob("*eagle3*/config.json")).read_text())
    w = tc.eagle3_read_bytes(cfg, 4, torch.float32)["bytes"]
    kv = tc.draft_kv_bytes(cfg, torch.float32) * d["requests_a_forward"] * d["context"]
    assert d["forwards"] == 4 and d["context"] == 32 + 24 / 2 and d["weight_bytes"] == w
    assert d["read_bytes"] == int(4 * (w + kv))
    assert d["draft_ms_a_step"] == row["phases_ms_a_round"]["1"]["draft"] > 0
    assert d["over_read"] == pytest.approx(d["draft_ms_a_step"] / d["read_ms"], rel=1e-3)
    assert f"eagle3-replay at 4: the draft phase {d['draft_ms_a_step']} ms a step" in p.stdout


@pytest.mark.slow  # two tiny engines in a subprocess (~5 s)
def test_the_batching_bench_runs_a_tap_replay_alone_on_an_engine_of_one_and_of_two(tmp_path):
    """`benchmarks/batching.py --concurrency 1 --drafter dflash-replay` with `--max-batch 1` runs
    the replay on an engine of one request (what `generate` opens), with `--max-batch 2` as the
    only request of an engine of two: both are the engine loop (issue 44: a request alone is a
    batch of one), each row drafts (more than a token a round) and keeps its plain ids."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MEMRA_BENCH_CACHE": str(tmp_path / "cache")}
    rows = {}
    for mb in (1, 2):
        out = tmp_path / f"out{mb}"
        p = subprocess.run([sys.executable, str(root / "benchmarks" / "batching.py"), str(out), "--concurrency", "1",
                            "--max-batch", str(mb), "--drafter", "dflash-replay", "--new", "24"],
                           capture_output=True, text=True, timeout=600, cwd=root, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        rows[mb] = next(r for r in json.loads((out / "batching.json").read_text())["rows"]
                        if r["drafter"] == "dflash-replay")
    for mb, r in rows.items():
        assert r["max_batch"] == mb and r["batcher"]["steps"] > 0 and r["batcher"]["max_requests"] == 1, r
        assert r["ids_equal_alone"] == 1 and r["tokens_per_round"] > 1.5, r


@pytest.mark.slow  # a tiny batched run in a subprocess (~6 s)
def test_the_batching_bench_replays_mtp_over_a_glm4_moe_slice(tmp_path):
    """`benchmarks/batching.py --drafter mtp-replay --shape tiny`: the target is the glm4_moe slice
    with its MTP layer (tap_checkpoints.GLM_SHAPES, written once), each request's MTP layer
    drafting in full (its K/V a slot of the draft pool) and its drafts replayed: three requests
    together keep their plain ids, share their draft forwards and take more than a token a round."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MEMRA_BENCH_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "batching.py"), str(tmp_path / "out"),
                        "--shape", "tiny", "--concurrency", "3", "--max-batch", "3", "--only-batched", "--drafter",
                        "mtp-replay", "--prompt", "32", "--new", "16", "--spec-k", "fixed"],
                       capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = json.loads(next((tmp_path / "cache").glob("glm-mtp-tiny-*/config.json")).read_text())
    assert cfg == tc.GLM_SHAPES["tiny"]
    row = next(r for r in json.loads((tmp_path / "out" / "batching.json").read_text())["rows"]
               if r["drafter"] == "mtp-replay")
    assert row["ids_equal_alone"] == 3 and row["tokens_per_round"] > 1.5, row
    assert row["batcher"]["draft_batches"] > 0 and row["batcher"]["mean_draft_batch"] > 1, row["batcher"]


@pytest.mark.slow  # three tiny batched runs (~5 s)
def test_the_batching_benchs_sampled_rows_are_seeded_request_by_request(tmp_path, monkeypatch):
    """`benchmarks/batching.py --temperature` (bench/batching.py `concurrent`): every request
    sampled, request i seeded i: two runs give the same ids, not the greedy ones, and the row
    says its temperature."""
    from memra_dist.bench.batching import concurrent
    from memra_dist.bench.checkpoints import ensure_checkpoint

    monkeypatch.setenv("MEMRA_BENCH_CACHE", str(tmp_path / "cache"))
    model = str(ensure_checkpoint("tiny", tmp_path / "cache", torch.device("cpu"), lambda s: None))
    kw = dict(new=12, plen=24, drafter="ngram")
    a, b = (concurrent(model, "cpu", 3, 3, temperature=0.8, **kw) for _ in range(2))
    greedy = concurrent(model, "cpu", 3, 3, **kw)
    assert a["ids"] == b["ids"] and a["ids"] != greedy["ids"] and a["temperature"] == 0.8 and "temperature" not in greedy
    assert len({tuple(x) for x in a["ids"]}) == 3  # (each its own seed and prompt)
