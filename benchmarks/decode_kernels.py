"""Where the non-GEMM time of a graphed 8B decode step goes, and what fewer kernels would give.

Builds the Llama-3-8B shape with random bf16 weights directly on the GPU (no checkpoint), a
cache of 2048 rows with 512 filled, and times one decode row (and a 16-row verify) replayed in
CUDA graphs, for each way of compiling the step:
  blocks   torch.compile per block (the default path today);
  stage    one torch.compile over the whole layer walk (add + norm fused across blocks);
  kernels  blocks + our Triton kernels (one-row GEMV with the gating folded in, split attention);
  stage_kernels  stage + our kernels;
then the kernel table of each, at 1 and 16 rows (grouped: weight GEMMs, attention, elementwise), and a GEMV
microbenchmark (cuBLAS vs a plain Triton GEMV) on the step's weight shapes at M = 1.
usage: python benchmarks/decode_kernels.py OUT_DIR [blocks|stage|kernels|stage_kernels|gemv ...]
DECODE_KERNELS_SHAPE=1b times the model drafter's shape instead (a step of the 1B draft).
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import torch

from memra_dist.bench.checkpoints import shape_config, weight_bytes
from memra_dist.bench.timing import capture_graph, copy_bandwidth, graph_kernels, graph_replay_ms
from memra_dist.model.config import parse_config
from memra_dist.model.transformer import Block, Stage

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
out.mkdir(parents=True, exist_ok=True)
variants = sys.argv[2:] or ["blocks", "stage", "kernels", "gemv"]
micro = "gemv" in variants
variants = [v for v in variants if v != "gemv"]
dev = torch.device("cuda")
torch.manual_seed(0)
cfg = parse_config(shape_config(os.environ.get("DECODE_KERNELS_SHAPE", "8b")))
P, CAP, N = 512, 2048, 100
res: dict = {}
log = lambda *a: print(*a, flush=True)  # noqa: E731

t0 = time.perf_counter()
with torch.device(dev):
    stage = Stage(cfg, 0, cfg.num_layers, True, True)
stage = stage.to(torch.bfloat16)
with torch.no_grad():
    for n, p in stage.named_parameters():
        if p.dim() == 2:
            p.normal_(0, 0.02 if "embed" not in n else 1.0)
stage.to_device(dev).eval()
for blk in stage.layers.values():
    blk.self_attn.fuse()
    blk.mlp.fuse()
cache = stage.new_cache(CAP, dev, torch.bfloat16)
res["build_s"] = round(time.perf_counter() - t0, 1)
bw = copy_bandwidth(dev, 1 << 30)["bandwidth_bytes_s"]
ideal_ms = weight_bytes(cfg.raw, torch.bfloat16) / bw * 1e3
res.update(bandwidth_tb_s=round(bw / 1e12, 3), roofline_step_ms=round(ideal_ms, 3))
log(json.dumps(res))
with torch.inference_mode():
    stage(torch.arange(P, device=dev) % 1000, torch.arange(P, device=dev), cache)
torch.cuda.synchronize()


def classify(name: str) -> str:
    k = name.lower()
    if any(w in k for w in ("nvjet", "gemv", "cublas", "sm90_xmma", "cutlass", "gemm", "splitk")):
        return "gemm"
    if "softmax" in k or "bmm" in k or "attn" in k or "flash" in k:
        return "attention"
    return "other"


def walk_blocks(fn_for):
    def run(x, pos):
        ctx = stage.step_ctx(pos, cache)
        h = stage.embed_tokens(x)
        for i, blk in stage.layers.items():
            h = fn_for(blk)(h, ctx, cache.layers[int(i)])
        return stage.logits(h)
    return run


def build(variant: str):
    torch._dynamo.reset()
    if variant == "eager":
        return walk_blocks(lambda b: b.forward)
    if variant == "blocks":
        fn = torch.compile(Block.forward, dynamic=False)
        return walk_blocks(lambda b: types.MethodType(fn, b))
    if variant == "stage":
        return torch.compile(walk_blocks(lambda b: b.forward), dynamic=False)
    if variant in ("kernels", "stage_kernels"):  # our Triton GEMV / attention (memra_dist/kernels), installed for good
        from memra_dist.kernels import install
        install(stage)
        return build(variant.split("_")[0] if variant != "kernels" else "blocks")
    raise SystemExit(f"unknown variant {variant}")


def capture(run, rows: int):
    x = torch.full((rows,), 17, device=dev, dtype=torch.long)
    pos = torch.arange(P, P + rows, device=dev)
    g = capture_graph(lambda: run(x, pos))
    return g, g.out


def replay_ms(g, n=N) -> float:
    return graph_replay_ms(g, n, warmup=5)


def kernel_table(g, reps=5):
    groups: dict[str, float] = {}
    rows = []
    for us, count, name in graph_kernels(g, reps):
        c = classify(name)
        groups[c] = groups.get(c, 0.0) + us / 1e3
        rows.append((us, count, c, name[:110]))
    return {k: round(v, 3) for k, v in groups.items()}, rows


ref = None
for v in variants:
    t0 = time.perf_counter()
    run = build(v)
    g1, o1 = capture(run, 1)
    t_c1 = time.perf_counter() - t0
    g5, _ = capture(run, 5)
    g16, _ = capture(run, 16)
    r = {"compile_capture_1_s": round(t_c1, 1)}
    r["decode_ms"] = round(replay_ms(g1), 4)
    r["verify5_ms"] = round(replay_ms(g5), 4)
    r["verify16_ms"] = round(replay_ms(g16), 4)
    r["verify5_over_decode"] = round(r["verify5_ms"] / r["decode_ms"], 4)
    r["verify16_over_decode"] = round(r["verify16_ms"] / r["decode_ms"], 4)
    r["decode_fraction_of_roofline"] = round(ideal_ms / r["decode_ms"], 4)
    groups, rows = kernel_table(g1)
    r["groups_ms"] = groups
    r["kernels_per_step"] = sum(c for _, c, _, _ in rows)
    top = out / f"kernels_{v}.txt"
    top.write_text("\n".join(f"{us:9.1f} us  x{c:4d}  {cl:9s} {k}" for us, c, cl, k in rows))
    groups16, rows16 = kernel_table(g16)
    r["verify16_groups_ms"] = groups16
    r["verify16_kernels_per_step"] = sum(c for _, c, _, _ in rows16)
    top16 = out / f"kernels_{v}_16.txt"
    top16.write_text("\n".join(f"{us:9.1f} us  x{c:4d}  {cl:9s} {k}" for us, c, cl, k in rows16))
    if ref is None:
        ref = o1.float().clone()
    r["max_abs_diff_vs_first"] = float((o1.float() - ref).abs().max())
    res[v] = r
    log(v, json.dumps(r))
    log("\n".join(top.read_text().splitlines()[:25]))
    log("verify(16):\n" + "\n".join(top16.read_text().splitlines()[:40]))
    del g1, g5, g16
    torch.cuda.empty_cache()

# GEMV at M = 1: cuBLAS vs a plain Triton kernel over the step's weight shapes
try:
    if not micro:
        raise RuntimeError("not asked for (add the pseudo-variant gemv)")
    import triton
    import triton.language as tl

    @triton.autotune(configs=[triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
                              for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8) for s in (1, 3)],
                     key=["N", "K"])
    @triton.jit
    def _gemv(W, X, Y, N, K, BN: tl.constexpr, BK: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BN + tl.arange(0, BN)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            w = tl.load(W + rn[:, None] * K + rk[None, :], eviction_policy="evict_first")
            x = tl.load(X + rk)
            acc += w.to(tl.float32) * x[None, :].to(tl.float32)
        tl.store(Y + rn, tl.sum(acc, 1).to(Y.dtype.element_ty))

    def tgemv(w, x, y):
        N, K = w.shape
        _gemv[lambda m: (triton.cdiv(N, m["BN"]),)](w, x, y, N, K)

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    gemv = {}
    for name, (n_, k_) in shapes.items():
        w = torch.randn(n_, k_, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k_, device=dev, dtype=torch.bfloat16)
        y = torch.empty(n_, device=dev, dtype=torch.bfloat16)
        tgemv(w, x[0], y)
        err = float((y.float() - (x @ w.t())[0].float()).abs().max())
        gb = w.numel() * 2 / 1e9
        out_c = torch.empty(1, n_, device=dev, dtype=torch.bfloat16)
        gc = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gc):
            for _ in range(20):
                torch.mm(x, w.t(), out=out_c)
        gt = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gt):
            for _ in range(20):
                tgemv(w, x[0], y)
        tc, tt = replay_ms(gc, 10) / 20, replay_ms(gt, 10) / 20
        gemv[name] = {"cublas_us": round(tc * 1e3, 1), "triton_us": round(tt * 1e3, 1),
                      "cublas_of_copy_bw": round(gb / (tc / 1e3) / (bw / 1e9), 3),
                      "triton_of_copy_bw": round(gb / (tt / 1e3) / (bw / 1e9), 3),
                      "best": str(_gemv.best_config), "max_err": err}
        log(name, json.dumps(gemv[name]))
        del w, gc, gt
    res["gemv"] = gemv
except Exception as e:  # noqa: BLE001
    res["gemv_error"] = repr(e)[:300]
(out / "decode_kernels.json").write_text(json.dumps(res, indent=1))
log(json.dumps(res))
