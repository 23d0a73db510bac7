"""Where does the time between two decode steps go? (plain decode vs graph step rate)

8B shape, bf16, compiled blocks inside CUDA graphs, 512 rows of context. Measures, per step:
  A  the graph replayed back to back (GPU time by events: the step's device cost);
  B  the graph replayed with a sync after each step (A + launch latency);
  C  ModelRunner.forward(host ids) + argmax readback (B + the input copy and the readback);
  D  a whole plain-decode session round (C + the session's host work);
then the kernel table of the replayed graph, split into weight GEMMs and the rest against this
machine's copy-bandwidth roofline, the cost of one phase-clock boundary (drain + free memory,
what trace level 1 adds five times a round), and the CPU-op table of session rounds.
usage: python benchmarks/host_gap.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from memra_dist.bench.checkpoints import ensure_checkpoint, shape_config, weight_bytes
from memra_dist.bench.timing import copy_bandwidth
from memra_dist.device import free_mb
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters.none import NoDrafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
ckpt = ensure_checkpoint("8b", Path(os.environ.get("MEMRA_BENCH_CACHE", "/tmp/memra-bench-ckpt")), dev, print)
P, N = 512, 100
res: dict = {}
r = ModelRunner(str(ckpt), dev, torch.bfloat16, max_pos=2048, graphs=True, compile=True, kernels=True, warm_rows=2)
t = time.perf_counter()
r.alloc(2048)
res["alloc_capture_s"] = round(time.perf_counter() - t, 2)
r.forward(torch.arange(P) % 1000, 0)
torch.cuda.synchronize()
ids = torch.tensor([17])
g = r.graphs.graphs[1]
g.x.copy_(ids.to(dev))
torch.add(g.base, P, out=g.pos)


def per_step_ms(fn, n=N) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record()
for _ in range(N):
    g.graph.replay()
e1.record()
torch.cuda.synchronize()
res["A_replay_gpu_ms"] = e0.elapsed_time(e1) / N
res["B_replay_sync_ms"] = per_step_ms(lambda: (g.graph.replay(), torch.cuda.synchronize()))


def fwd():
    int(r.forward(ids, P)[-1].argmax())
    r.rollback(P)


res["C_forward_readback_ms"] = per_step_ms(fwd)
r.rollback(P)

s = SpecSession(r, NoDrafter(), SamplingParams(), torch.Generator().manual_seed(0), 1)
prompt = [int(x) for x in torch.arange(P) % 1000]
s.start(prompt, 10_000, 2048)
torch.cuda.synchronize()
t0 = time.perf_counter()
s.burst(N)
torch.cuda.synchronize()
res["D_session_round_ms"] = (time.perf_counter() - t0) * 1e3 / N
print(json.dumps(res), flush=True)

with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        g.graph.replay()
    torch.cuda.synchronize()
gemm_us = other_us = 0.0
for ev in prof.key_averages():
    us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    if not us or ev.key.startswith(("cuda", "aten::")):
        continue
    if any(w in ev.key.lower() for w in ("nvjet", "gemm", "gemv", "cublas", "splitk", "sm90_xmma", "cutlass")):
        gemm_us += us
    else:
        other_us += us
bw = copy_bandwidth(dev, 1 << 30)["bandwidth_bytes_s"]
wb = weight_bytes(shape_config("8b"), torch.bfloat16)
ideal_ms = wb / bw * 1e3
res.update(bandwidth_tb_s=round(bw / 1e12, 3), roofline_step_ms=round(ideal_ms, 3),
           gemm_ms_per_step=round(gemm_us / 5e3, 3), other_kernels_ms_per_step=round(other_us / 5e3, 3))
res["gemm_only_fraction_of_roofline"] = round(ideal_ms / res["gemm_ms_per_step"], 4)
res["replay_fraction_of_roofline"] = round(ideal_ms / res["A_replay_gpu_ms"], 4)
res["session_fraction_of_roofline"] = round(ideal_ms / res["D_session_round_ms"], 4)
t0 = time.perf_counter()
for _ in range(1000):
    torch.cuda.synchronize()
res["idle_drain_us"] = round((time.perf_counter() - t0) * 1e3, 2)
t0 = time.perf_counter()
for _ in range(1000):
    free_mb(dev)
res["free_mb_us"] = round((time.perf_counter() - t0) * 1e3, 2)
print(json.dumps(res), flush=True)
ktab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof2:
    s.burst(10)
    torch.cuda.synchronize()
ctab = prof2.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
prof2.export_chrome_trace(str(out / "session_rounds.json"))
print(ktab)
print(ctab)
(out / "host_gap.txt").write_text(json.dumps(res) + "\n\n" + ktab + "\n\n" + ctab)
