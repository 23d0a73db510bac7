"""Kimi hybrid on CUDA graphs: is the capture exact, and what does it buy?

Every comparison uses ONE runner with its step graphs on and then off (two runners would
differ by the fused gate-up GEMM's rounding alone):
 1. exact: the tiny kimi_linear in fp32 (reference KDA scan, MLA, MoE forced onto the grouped
    form so the stage is capturable): greedy ids with graphs == without, plain and with the
    replay drafter at K=4 (partial accepts: captured steps after rollbacks);
 2. the bench's hybrid shape in bf16 (fla KDA kernels, grouped MoE): max |logit difference| of
    graphed vs eager forwards over the same rows, greedy ids both ways (a random bf16 model's
    argmax is decided by rounding noise, so ids are informative only), then step and
    rollback costs both ways. Prompts stay under the snapshot ring (33 rows): no chunked
    prefill, whose first-call Triton autotune would dominate.
usage: python benchmarks/kimi_graphs_check.py OUT_DIR   (KIMI_CHECK_DRY=1: the tiny shape on CPU,
graphs inactive, to check the script itself)"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint
from memra_dist.bench.timing import time_call
from memra_dist.runner import ModelRunner
from memra_dist.model.moe import MoE
from memra_dist.specdec.drafters.none import NoDrafter
from memra_dist.specdec.drafters.replay import ReplayDrafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
out.mkdir(parents=True, exist_ok=True)
DRY = os.environ.get("KIMI_CHECK_DRY") == "1"
dev, T0, CAP = torch.device("cpu" if DRY else "cuda"), time.perf_counter(), 256
res: dict = {}


def log(*a):
    print(f"[kimi_graphs {time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def generate(r, drafter, prompt, k=1, n=40):
    s = SpecSession(r, drafter, SamplingParams(), torch.Generator().manual_seed(0), k)
    ids = [s.start(prompt, n, CAP)]
    while not s.done:
        ids.extend(s.burst(8))
    return ids, s.stats.as_dict()


def toggled(r, fn):
    """fn() with the runner's graphs, then with them off (same weights)."""
    g = r.graphs
    a = fn()
    r.graphs = None
    try:
        b = fn()
    finally:
        r.graphs = g
    return a, b


def ids_both_ways(r, tag):
    prompt = [(7 * i) % 90 + 3 for i in range(20)]
    (gp, _), (ep, _) = toggled(r, lambda: generate(r, NoDrafter(), prompt))
    res[f"{tag}_plain_graphs_eq_eager"] = gp == ep
    res[f"{tag}_plain_first_diff"] = next((i for i, (a, b) in enumerate(zip(gp, ep)) if a != b), None)
    drafter = lambda: ReplayDrafter(gp, len(prompt), r.cfg.vocab_size, 0.3, seed=3)  # noqa: E731
    (gr, st), (er, _) = toggled(r, lambda: generate(r, drafter(), prompt, k=4))
    res[f"{tag}_replay_graphs_eq_plain"], res[f"{tag}_replay_eager_eq_plain"] = gr == gp, er == ep
    res[f"{tag}_replay_stats"] = st
    log(tag, {k: v for k, v in res.items() if k.startswith(tag)})


def runner(shape, dtype):
    r = ModelRunner(str(ensure_checkpoint(shape, bench_cache_dir(), dev, print)), dev, dtype, max_pos=CAP,
                    graphs=True, warm_rows=9)
    r.alloc(CAP)
    log(shape, "graphs active:", r.graphs is not None, "rows:", sorted(r.graphs.graphs) if r.graphs else None)
    return r


# 1. exact, fp32
orig = MoE.use_grouped
try:
    MoE.use_grouped = lambda self, on: setattr(self.experts, "grouped", True)  # fp32 too, for this check
    ids_both_ways(runner("kimi-tiny", torch.float32), "tiny_fp32")
except Exception as e:  # report and go on
    res["tiny_error"] = repr(e)[:600]
    log("tiny failed:", res["tiny_error"])
finally:
    MoE.use_grouped = orig

# 2. the bench's hybrid, bf16
try:
    r = runner("kimi-tiny" if DRY else "kimi", torch.float32 if DRY else torch.bfloat16)
    prompt = torch.tensor([(7 * i) % 90 + 3 for i in range(30)])
    steps = [torch.tensor([11]), torch.tensor([12]), torch.tensor([13, 14, 15, 16, 17]), torch.tensor([18])]

    def logits():
        r.alloc(CAP)
        outs, pos = [r.forward(prompt, 0)[-1:].float()], 30
        for i, ids in enumerate(steps):
            outs.append(r.forward(ids, pos).float())
            pos += ids.shape[0]
            if i == 2:  # keep 2 of the 5 verify rows
                pos -= 3
                r.rollback(pos)
        return outs

    a, b = toggled(r, logits)
    res["bf16_logit_maxdiff"] = [round(float((x - y).abs().max()), 6) for x, y in zip(a, b)]
    res["bf16_logit_absmax"] = [round(float(y.abs().max()), 4) for y in b]
    log("bf16 logits", res["bf16_logit_maxdiff"], "of", res["bf16_logit_absmax"])
    ids_both_ways(r, "bf16")
    graphs, ctx = r.graphs, len(prompt)
    for mode in ("graphs", "eager"):
        r.graphs = graphs if mode == "graphs" else None
        r.alloc(CAP)
        r.forward(prompt, 0)
        d = {f"rows_{n}_ms": round(time_call(lambda n=n: r.forward(torch.full((n,), 7), ctx), dev, 30, warmup=10,
                                             between=lambda: r.rollback(ctx))["median_s"] * 1e3, 3)
             for n in (1, 3, 5, 9)}
        for n in (3, 5, 9):
            d[f"verify_{n}_over_decode"] = round(d[f"rows_{n}_ms"] / d["rows_1_ms"], 3)
        ids5, xs = torch.full((5,), 7), []
        for _ in range(15):
            r.forward(ids5, ctx)
            xs.append(time_call(lambda: r.rollback(ctx + 2), dev, 1, warmup=0)["median_s"])
            r.rollback(ctx)
        d["rollback_ms_k4_keep2"] = round(sorted(xs)[7] * 1e3, 4)
        d["rollback_share_of_verify_k4"] = round(d["rollback_ms_k4_keep2"] / d["rows_5_ms"], 4)
        res[mode] = d
        log(mode, d)
    r.graphs = graphs
except Exception as e:
    res["bf16_error"] = repr(e)[:600]
    log("bf16 failed:", res["bf16_error"])
(out / "kimi_graphs.json").write_text(json.dumps(res, indent=1))
log("done")
