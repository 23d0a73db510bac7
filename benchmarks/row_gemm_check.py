"""kernels/gemm_rows.py on CUDA: correct against the reference, and timed against cuBLAS on the
verify step's 8B weight shapes at 5 and 16 rows (and a batched step's wider row counts, given
as a second argument: `32,64,96,128`).

For each shape: cuBLAS `F.linear` vs `gemm_rows` plain, and the per-layer chain as the verify
step runs it (cuBLAS with the compiled norm / gating / residual kernels beside it, as the
default path's kernel table shows) vs gemm_rows with the folds (qkv with the pre-norm, o_proj
with the residual, gate_up with the pre-norm, down with the gating and the residual). Each
case is captured 20 times in one CUDA graph over 4 weight copies (more than L2 holds), replayed
and timed by events. Errors: max |ours - reference| over max |reference|, bf16.
usage: python benchmarks/row_gemm_check.py OUT_DIR [ROWS, default 5,16]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from memra_dist.bench.checkpoints import shape_config
from memra_dist.bench.timing import capture_graph, graph_replay_ms
from memra_dist.kernels.gemm_rows import MAX_ROWS, _tuned, _wide, gemm_rows
from memra_dist.model.layers import RMSNorm

dev = torch.device("cuda")
out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
cfg = shape_config("8b")
h, inter = cfg["hidden_size"], cfg["intermediate_size"]
kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
# name -> (N, K, folds)
shapes = {"qkv": (h + 2 * kv, h, "norm"), "o": (h, h, "res"), "gate_up": (2 * inter, h, "norm"),
          "down": (h, inter, "silu_res"), "lm_head": (cfg["vocab_size"], h, "norm")}
REPS = 20
res: dict = {}
norm = RMSNorm(h, 1e-5).to(dev, torch.bfloat16)
with torch.no_grad():
    norm.weight.uniform_(0.5, 1.5)


def timed(fn) -> float:
    """us of one call: REPS calls (over the weight copies) in one graph, 10 replays."""
    def run():
        for i in range(REPS):
            fn(i)
    return graph_replay_ms(capture_graph(run, warmup=1), 10) / REPS * 1e3


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


ok = True
for rows in (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "5,16").split(",")):
    r: dict = {}
    for name, (n, k, fold) in shapes.items():
        copies = 2 if name == "lm_head" else 4
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        kin = 2 * k if fold == "silu_res" else k
        x = torch.randn(rows, kin, device=dev, dtype=torch.bfloat16)
        resid = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)

        def ref_chain(i=0, w=None):
            w = ws[i % copies] if w is None else w
            if fold == "norm":
                return F.linear(norm(x), w)
            if fold == "res":
                return resid + F.linear(x, w)
            return resid + F.linear(F.silu(x[:, :k]) * x[:, k:], w)

        def our_chain(i=0, w=None):
            w = ws[i % copies] if w is None else w
            if fold == "norm":
                return gemm_rows(x, w, norm=norm.weight, eps=norm.eps)
            if fold == "res":
                return gemm_rows(x, w, residual=resid)
            return gemm_rows(x, w, None, silu_mul=True, residual=resid)

        xp = x[:, :k].contiguous()
        e_plain = rel(gemm_rows(xp, ws[0]), F.linear(xp, ws[0]))
        e_fold = rel(our_chain(0), ref_chain(0))
        c = {"cublas_us": timed(lambda i=0: F.linear(xp, ws[i % copies])),
             "ours_us": timed(lambda i=0: gemm_rows(xp, ws[i % copies])),
             "cublas_chain_us": timed(ref_chain), "ours_folded_us": timed(our_chain),
             "err_plain": e_plain, "err_folded": e_fold, "best": str((_tuned if rows <= MAX_ROWS else _wide).best_config)}
        c = {key: (round(v, 2) if isinstance(v, float) and key.endswith("us") else v) for key, v in c.items()}
        c["weight_TB_s_ours"] = round(n * k * 2 / (c["ours_us"] * 1e-6) / 1e12, 3)
        ok &= e_plain < 2e-2 and e_fold < 3e-2
        r[name] = c
        print(rows, name, json.dumps(c), flush=True)
        del ws
        torch.cuda.empty_cache()
    layer = [s for s in shapes if s != "lm_head"]
    r["layer"] = {key: round(sum(r[s][key] for s in layer), 2)
                  for key in ("cublas_us", "ours_us", "cublas_chain_us", "ours_folded_us")}
    print(rows, "layer", json.dumps(r["layer"]), flush=True)
    res[f"rows{rows}"] = r
res["ok"] = ok
(out / "row_gemm_check.json").write_text(json.dumps(res, indent=1))
print("ok" if ok else "FAILED", flush=True)
sys.exit(0 if ok else 1)
