"""Where does a graphed 8B decode step go? GPU time by CUDA events around the replay, host
time around the call, and the top kernels of the eager step under torch.profiler."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from memra_dist.bench.checkpoints import ensure_checkpoint
from memra_dist.runner import ModelRunner

big = ensure_checkpoint("8b", Path("/tmp/memra-ckpt"), torch.device("cuda"), print)
out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
res = {}
P = 512


def measure(r, tag):
  r.alloc(2048)
  r.forward(torch.arange(P) % 1000, 0)
  for rows in (1, 5):
    ids = torch.randint(0, 1000, (rows,))
    t = time.perf_counter()
    for _ in range(3):
        r.forward(ids, P); r.rollback(P)
    torch.cuda.synchronize()
    res[f"{tag}_warm_s_rows{rows}"] = time.perf_counter() - t
    g = r.graphs.graphs[rows]
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(50):
        g.graph.replay()
    e1.record(); torch.cuda.synchronize()
    res[f"{tag}_replay_gpu_ms_rows{rows}"] = e0.elapsed_time(e1) / 50
    t = time.perf_counter()
    for _ in range(50):
        r.forward(ids, P); r.rollback(P)
    torch.cuda.synchronize()
    res[f"{tag}_forward_wall_ms_rows{rows}"] = (time.perf_counter() - t) * 1e3 / 50


r = ModelRunner(str(big), torch.device("cuda"), torch.bfloat16, max_pos=2048, graphs=True)
measure(r, "graphs")
print(res, flush=True)
rc = ModelRunner(str(big), torch.device("cuda"), torch.bfloat16, max_pos=2048, graphs=True, compile=True)
try:
    measure(rc, "compiled")
except Exception as e:  # report, keep the eager profile
    res["compiled_error"] = repr(e)[:500]
print(res, flush=True)
del rc
# eager kernels
r.graphs = None
from torch.profiler import ProfilerActivity, profile
ids = torch.randint(0, 1000, (1,))
for _ in range(2):
    r.forward(ids, P); r.rollback(P)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        r.forward(ids, P); r.rollback(P)
    torch.cuda.synchronize()
tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
print(tab)
(out / "profile.txt").write_text(tab + "\n" + json.dumps(res))
