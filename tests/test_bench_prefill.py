"""memra-dist bench's prefill section: the pure parts (FLOP count, KV bytes, the KV-counting
decode roofline, the sweep's pick, the targets), the long-position checkpoint variant, and one
tiny CPU run of the section end to end."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memra_dist.bench import prefill as pf
from memra_dist.bench.checkpoints import ensure_checkpoint, ensure_variant, shape_config, weight_bytes
from memra_dist.bench.report import evaluate, markdown

REPO = Path(__file__).resolve().parents[1]


def test_doctests():
    res = doctest.testmod(pf, report=True)
    assert res.attempted > 0 and res.failed == 0


def test_flops_formula_on_the_8b_shape():
    cfg = shape_config("8b")
    P = pf.param_count(cfg)
    assert P * 2 == weight_bytes(cfg)  # every weight counted once, bf16
    # 8k tokens: 2 * 8.03e9 * 8192 + 4 * 32 * 32 * 128 * 8192^2 / 2
    f = pf.prefill_flops(P, 32, 32, 128, 8192)
    assert f == pytest.approx(2 * 8_030_261_248 * 8192 + 2 * 32 * 32 * 128 * 8192 ** 2)
    assert f == pytest.approx(1.4916e14, rel=1e-4)
    # the attention term grows with T^2: 4x the tokens, 16x the attention FLOPs
    att = lambda T: pf.prefill_flops(0, 32, 32, 128, T)  # noqa: E731
    assert att(32768) == pytest.approx(16 * att(8192))
    assert "2 * P * T" in pf.FLOPS_FORMULA and "T^2 / 2" in pf.FLOPS_FORMULA


def test_kv_bytes_and_the_kv_roofline():
    cfg = shape_config("8b")
    kv = pf.kv_bytes_per_token(cfg, 2)
    assert kv == 2 * 32 * 8 * 128 * 2
    assert kv * 131072 == 17_179_869_184  # a 128k cache: 17.2 GB
    w = weight_bytes(cfg)
    assert pf.decode_roofline_tok_s(4.25e12, w, kv, 0) == pytest.approx(4.25e12 / w)
    # at 32k the KV read adds 4.3 GB to the 16.06 GB of weights per token
    assert pf.decode_roofline_tok_s(4.25e12, w, kv, 32768) == pytest.approx(4.25e12 / (w + kv * 32768))


def test_best_chunk_skips_oom_and_budget_rows():
    assert pf.best_chunk({"2048": {"ttft_ms": 5.0}, "4096": {"ttft_ms": 4.0}, "8192": {"oom": True},
                          "16384": {"skipped": "budget"}}) == 4096
    assert pf.best_chunk({"8192": {"oom": True}}) is None


def _res(shape="8b", over=0.9, mem=2.5) -> dict:
    ours = {"512": {"ttft_ms": 25.0, "ttft_ms_range": [24.0, 26.0], "repeats": 5},
            "32768": {"ttft_ms": 1300.0, "tflops": 700.0, "tflops_range": [690.0, 710.0], "repeats": 3,
                      "decode_kv_roofline_fraction": 0.8, "decode_kv_roofline_fraction_range": [0.79, 0.81],
                      "prefill_tok_s": 25000.0, "decode_tok_s": 170.0, "decode_kv_roofline_tok_s": 212.0},
            "131072": {"ttft_ms": 20000.0, "repeats": 1, "overhead_gb": mem}}
    peer = {"lengths": {"8192": {"ours_ttft_over_sdpa": over, "ours_ttft_over_sdpa_range": [over - 0.05, over + 0.05],
                                 "repeats": 3, "forward_ms": 250.0, "tflops": 590.0, "peak_gb": 30.0},
                        "32768": {"oom": True}}}
    return {"meta": {"date": "2026-12-02 12:00", "device": "cuda", "device_name": "NVIDIA H200", "commit": "abc",
                     "shape": shape, "dtype": "bfloat16", "graphs": {"active": True}, "quick": False, "ctx": 512,
                     "max_new": 256, "torch": "2.11"},
            "prefill": {"ours": ours, "peer": peer, "flops_formula": pf.FLOPS_FORMULA,
                        "decode_formula": pf.DECODE_FORMULA, "ttft": "x",
                        "sweep": {"prompt": 32768, "rows": {"4096": {"ttft_ms": 1.0, "peak_gb": 30.0},
                                                            "8192": {"ttft_ms": 1.1, "peak_gb": 31.0}},
                                  "best_chunk": 4096, "greedy_ids_equal": {"4096": True, "8192": True}}}}


def test_prefill_targets():
    rows = {r["name"]: r for r in evaluate(_res())}
    assert rows["prefill_ttft_512_ms"]["status"] == "pass"
    assert rows["prefill_ttft_8k_over_sdpa"]["status"] == "pass"
    assert rows["prefill_ttft_32k_over_sdpa"]["status"].startswith("n/a")  # the peer ran out of memory
    assert rows["prefill_tflops_32k"]["status"] == "pass"
    assert rows["decode_after_32k_kv_roofline"]["status"] == "miss"
    assert rows["prefill_128k_over_weights_kv_gb"]["status"] == "pass"  # memory: one request gives it exactly
    assert {r["name"]: r for r in evaluate(_res(mem=5.0))}["prefill_128k_over_weights_kv_gb"]["status"] == "miss"
    assert {r["name"]: r for r in evaluate(_res(over=1.02))}["prefill_ttft_8k_over_sdpa"]["status"] == "within noise"
    tiny = {r["name"]: r for r in evaluate(_res("tiny"))}
    assert all(tiny[n]["status"].startswith("n/a") for n in ("prefill_ttft_512_ms", "prefill_tflops_32k"))
    res = _res()
    res["targets"] = evaluate(res)
    md = markdown(res)
    assert "| prefill 8192 tokens (transformers sdpa) |" not in md  # no ours row at 8k: the peer row rides on it
    assert "| prefill 32768 tokens (ours) | TTFT 1300 ms" in md
    assert "| prefill chunk sweep at 32768 tokens | 4096: 1 ms, 30.00 GB; 8192: 1.1 ms, 31.00 GB; best 4096" in md
    assert "out of memory" in md and "2 * P * T" in md and "None" not in md


def test_variant_links_the_weights_and_leaves_the_base(tmp_path):
    import torch

    said = []
    base = ensure_checkpoint("tiny", tmp_path, torch.device("cpu"), said.append, torch.float32)
    cfg0 = (base / "config.json").read_text()
    v = ensure_variant(base, {"max_position_embeddings": 1 << 18}, "long", said.append)
    assert v != base and v.parent == base.parent
    assert json.loads((v / "config.json").read_text())["max_position_embeddings"] == 1 << 18
    assert (base / "config.json").read_text() == cfg0  # the base (and its cache key) untouched
    assert os.path.samefile(v / "model.safetensors", base / "model.safetensors")  # linked, not rewritten
    assert ensure_variant(base, {"max_position_embeddings": 1 << 18}, "long", said.append) == v
    assert any("reusing" in s for s in said)


@pytest.mark.slow  # the section end to end on the tiny shape (the transformers peer included)
def test_prefill_section_tiny_cpu(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, "-m", "memra_dist.cli", "bench", "--shape", "tiny", "--quick", "--device", "cpu",
                        "--sections", "prefill", "--out", str(out), "--cache-dir", str(tmp_path / "cache")],
                       capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    pre = res["prefill"]
    assert "error" not in pre, pre
    assert set(pre["ours"]) == {"48", "256", "1024"}
    for row in pre["ours"].values():
        assert row["ttft_ms"] > 0 and row["tflops"] > 0 and row["decode_tok_s"] > 0, row
        assert row["repeats"] >= 3 and len(row["ttft_ms_all"]) == row["repeats"]
        assert 0 < row["decode_kv_roofline_fraction"], row
    sw = pre["sweep"]
    assert set(sw["rows"]) == {"64", "256", "1024"} and sw["best_chunk"] in (64, 256, 1024)
    assert all(sw["greedy_ids_equal"].values())  # greedy ids do not depend on the chunk size
    if "skipped" not in pre["peer"]:
        for row in pre["peer"]["lengths"].values():
            assert row["forward_ms"] > 0 and row["first_token_equal"], row
    assert res["decode"] == {"skipped": "not selected"}
    assert "| prefill chunk sweep at 1024 tokens |" in p.stdout
