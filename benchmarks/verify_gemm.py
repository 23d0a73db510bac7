"""The verify step's weight GEMMs at 16 rows (the 8B shape), on each BLAS library torch can
pick: cuBLAS (the default) and cuBLASLt (`torch.backends.cuda.preferred_blas_library`). Each
shape is captured 20 times in one CUDA graph, replayed, timed by events, and its kernels
listed (split-K reduces show as separate kernels).
usage: python benchmarks/verify_gemm.py OUT_DIR [rows]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

from memra_dist.bench.checkpoints import shape_config

dev = torch.device("cuda")
out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 16
cfg = shape_config("8b")  # the bench's 8B shape (Llama-3-8B)
h, inter = cfg["hidden_size"], cfg["intermediate_size"]
kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
shapes = {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}
REPS = 20
res: dict = {"rows": rows}
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    r: dict = {}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]  # > L2: each read from HBM
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        for w in ws:
            F.linear(x, w)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(REPS):
                y = F.linear(x, ws[i % 4])
        for _ in range(3):
            g.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        us = e0.elapsed_time(e1) / 10 / REPS * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        kern = sorted({ev.key[:90] for ev in prof.key_averages() if getattr(ev, "device_time_total", 0)
                       and not ev.key.startswith(("cuda", "aten::"))})
        gbs = n * k * 2 / (us * 1e-6) / 1e9
        r[name] = {"us": round(us, 2), "weight_GB_s": round(gbs, 1), "kernels": kern}
        print(lib, name, json.dumps(r[name]), flush=True)
        del ws, g
    r["total_us_per_layer"] = round(sum(v["us"] for v in r.values() if isinstance(v, dict)), 2)
    res[lib] = r
    print(lib, "per layer", r["total_us_per_layer"], "us", flush=True)
(out / f"verify_gemm_{rows}.json").write_text(json.dumps(res, indent=1))
