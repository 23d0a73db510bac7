"""Where does an eager kimi hybrid step go on CUDA? The bench's hybrid shape (bf16), 512 rows
of context: wall per forward of 1 / 5 / 9 rows after a long warm-up (so no kernel autotune is
timed), then torch.profiler tables of the 1-row step by CPU time and by device time.
usage: python benchmarks/hybrid_profile.py OUT_DIR"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint
from memra_dist.runner import ModelRunner

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
path = ensure_checkpoint("kimi", bench_cache_dir(), dev, print)
r = ModelRunner(str(path), dev, torch.bfloat16, max_pos=1024)
r.alloc(1024)
P = 512
r.forward(torch.arange(P) % 1000 + 3, 0)
torch.cuda.synchronize()
res = {}
for rows in (1, 5, 9):
    ids = torch.full((rows,), 7)
    xs = []
    for i in range(40):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r.forward(ids, P)
        torch.cuda.synchronize()
        xs.append(time.perf_counter() - t0)
        r.rollback(P)
    res[f"rows_{rows}_ms"] = {"first": round(xs[0] * 1e3, 3), "median_last30": round(sorted(xs[10:])[15] * 1e3, 3),
                              "min": round(min(xs) * 1e3, 3)}
print(json.dumps(res), flush=True)
ids = torch.full((1,), 7)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        r.forward(ids, P)
        r.rollback(P)
    torch.cuda.synchronize()
t1 = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
t2 = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=70)
print(t1)
print(t2)
(out / "hybrid_profile.txt").write_text(json.dumps(res) + "\n\n" + t1 + "\n\n" + t2)
