"""Where one MTP draft step's time goes on the DeepSeek-V3 widths, kernel by kernel (issue 16).

Builds MTP layer 0 of `tap_checkpoints.dsv3_config("8b")` (eh_proj, MLA as V3, 256 routed experts
top-8, one shared expert) and a target embedding and lm_head with random bf16 weights directly on
the GPU (no checkpoint: the tap_drafters bench writes 51 GB for the same layer), then captures the
drafter's step as mtp_graph.py does (embedding, `MTPLayer.step`, lm_head, fp32 logits) at 1 row
(a chained step) and 3 rows (a round's first forward), over a 2048-slot cache with 512 rows
filled. For each variant it times the replay (device events) against the step's weight read
(`tap_checkpoints.mtp_step_read_bytes` at the measured copy bandwidth) and writes its kernel
table:
  graph     the step without our kernels in the MTP layer (MLA and shared-expert GEMMs on
            cuBLAS, the routed experts through torch._grouped_mm), the lm_head our GEMV;
  kernels   the same after `kernels.ops.install_mtp`, as the engine runs it when the target
            runs our kernels (the default on CUDA): one-row projections as Triton GEMVs, the
            router's scores and the routed experts on kernels/moe_gemv.py.
usage: python benchmarks/mtp_profile.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from memra_dist.bench.tap_checkpoints import dsv3_config, mtp_step_read_bytes
from memra_dist.bench.timing import capture_graph, copy_bandwidth, graph_kernels, graph_replay_ms
from memra_dist.model.config import parse_config
from memra_dist.model.mtp import MTPHead

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
torch.manual_seed(0)
raw = dsv3_config("8b")
cfg = parse_config(raw)
P, CAP, N = 512, 2048, 50
log = lambda *a: print(*a, flush=True)  # noqa: E731
res: dict = {}

t0 = time.perf_counter()
with torch.device(dev):
    head = MTPHead(cfg, 1)
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    lm = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
head = head.to(torch.bfloat16)
emb, lm = emb.to(torch.bfloat16), lm.to(torch.bfloat16)
layer = head.layer(0)
layer.mlp.gate.float()  # the router stays fp32 (loader.FP32_KEYS)
with torch.no_grad():
    for n, p in list(head.named_parameters()) + list(lm.named_parameters()) + list(emb.named_parameters()):
        if p.dim() >= 2:
            p.normal_(0, 0.02)
        elif "norm" in n:
            p.fill_(1.0)
    layer.mlp.gate.e_score_correction_bias.normal_(0, 0.01)
head.to_device(dev, torch.bfloat16).eval()
try:  # the target's lm_head as the engine runs it (the one-row Triton GEMV)
    from memra_dist.kernels.ops import _fast
    _fast(lm)
except Exception as e:  # noqa: BLE001
    res["lm_head_gemv_error"] = repr(e)[:200]
state = layer.self_attn.new_state(CAP, dev, torch.bfloat16)
hidden = torch.randn(CAP, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
res["build_s"] = round(time.perf_counter() - t0, 1)
bw = copy_bandwidth(dev, 1 << 30)["bandwidth_bytes_s"]
read = mtp_step_read_bytes(raw)
read_ms = read["bytes"] / bw * 1e3
res.update(bandwidth_tb_s=round(bw / 1e12, 3), step_read_gb=round(read["bytes"] / 1e9, 3), step_read_ms=round(read_ms, 4))
log(json.dumps(res))
with torch.inference_mode():  # the context rows the steps attend over
    ids = torch.arange(P, device=dev) % 1000
    layer.step(emb(ids), hidden[:P], head.step_ctx(torch.arange(P, device=dev), CAP), state)
torch.cuda.synchronize()


def step(rows: int):
    tok = torch.full((rows,), 17, device=dev, dtype=torch.long)
    pos = torch.arange(P, P + rows, device=dev)

    def run():
        o = layer.step(emb(tok), hidden.index_select(0, pos), head.step_ctx(pos, CAP), state)
        return lm(o[-1:]).float()
    return run


first: dict = {}
for v in ("graph", "kernels"):  # in this order: install switches the layer for good
    r: dict = {}
    try:
        if v == "kernels":
            from memra_dist.kernels.ops import install_mtp
            r["modules"] = install_mtp(head)
        for rows in (1, 3):  # eager first, synchronised: a fault shows here with its op
            with torch.inference_mode():
                step(rows)()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs = {rows: capture_graph(step(rows)) for rows in (1, 3)}
        r["capture_s"] = round(time.perf_counter() - t0, 1)
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        res[v] = {"error": repr(e)[:400]}
        log(v, res[v])
        continue
    for rows, g in graphs.items():
        o = g.out
        ms = graph_replay_ms(g, N)
        table = graph_kernels(g)
        (out / f"mtp_{v}_{rows}.txt").write_text("\n".join(f"{us:9.1f} us  x{c:4d}  {k}" for us, c, k in table))
        r[f"rows{rows}_ms"] = round(ms, 4)
        r[f"rows{rows}_over_read"] = round(ms / read_ms, 4)
        r[f"rows{rows}_kernels"] = sum(c for _, c, _ in table)
        r[f"rows{rows}_argmax"] = int(o.argmax())
        if v == "graph":
            first[rows] = o.clone()
        else:  # bf16 roundings differ (another summation order): the logits' largest gap
            r[f"rows{rows}_max_abs_diff_vs_graph"] = round(float((o - first[rows]).abs().max()), 4)
        log(v, rows, json.dumps(r))
        log("\n".join(f"{us:9.1f} us  x{c:4d}  {k}" for us, c, k in table[:30]))
    res[v] = r
    del graphs
    torch.cuda.empty_cache()
(out / "mtp_profile.json").write_text(json.dumps(res, indent=1))
log(json.dumps(res))
