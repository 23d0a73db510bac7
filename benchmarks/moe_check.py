"""MoE on CUDA: the grouped-GEMM form against the per-expert loop (bf16, kimi bench widths):
max abs difference, wall per call for T = 1 / 5 / 9 rows, and whether the grouped form
captures into a CUDA graph and replays to the same output. usage: python benchmarks/moe_check.py OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from memra_dist.bench.checkpoints import shape_config
from memra_dist.bench.timing import time_call
from memra_dist.model.config import parse_kimi_config
from memra_dist.model.kimi_config import KimiSpec
from memra_dist.model.moe import MoE

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")


# the bench's hybrid widths (memra_dist/bench/checkpoints.py): 32 experts, top-8, 1024 wide
raw = shape_config("kimi")
cfg, spec = parse_kimi_config(raw, "kimi"), KimiSpec.from_raw(raw, "kimi")
torch.manual_seed(0)
m = MoE(cfg, spec)
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.02)
m = m.to(dev, torch.bfloat16)
m.gate.float()
res: dict = {}


def wall_ms(fn, n=50) -> float:
    return time_call(fn, dev, n, warmup=5)["median_s"] * 1e3


with torch.inference_mode():
    for rows in (1, 5, 9):
        x = torch.randn(rows, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
        w, idx = m.gate(x)
        try:
            ref = m.experts.forward_loop(x, w, idx)
            got = m.experts.forward_grouped(x, w, idx)
            r = {"max_abs_diff": float((got.float() - ref.float()).abs().max()),
                 "ref_abs_max": float(ref.float().abs().max()),
                 "loop_ms": round(wall_ms(lambda: m.experts.forward_loop(x, w, idx)), 4),
                 "grouped_ms": round(wall_ms(lambda: m.experts.forward_grouped(x, w, idx)), 4)}
            m.use_grouped(True)
            sx = x.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    m(sx)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = m(sx)
            x2 = torch.randn_like(x)
            sx.copy_(x2)
            g.replay()
            torch.cuda.synchronize()
            r["graph_replay_equals_eager"] = bool(torch.equal(y, m(x2)))
            r["graph_ms"] = round(wall_ms(g.replay), 4)
            m.use_grouped(False)
        except Exception as e:  # report and go on
            r = {"error": repr(e)[:400]}
        res[f"rows_{rows}"] = r
        print(rows, r, flush=True)
(out / "moe_check.json").write_text(json.dumps(res, indent=1))
