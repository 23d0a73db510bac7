"""CUDA check of the fast path's attention kernels (what the interpreter tests cannot show):
the split attention with its merge in the same kernel (a ticket per row block, the last
program to finish merges) equals the reference `cached_attention` in fp32 and bf16 at decode
and verify row counts, replayed 200 times in one CUDA graph with identical outputs every time
(the merge is deterministic, the tickets are back at zero); `rope_kv_write` equals the eager
rotary and cache writes in bf16 (V bit for bit, q and K within one bf16 step: one rounding
instead of three); the decode GEMV with the pre-norm and residual folded in equals the eager
norm and linear; and the time a call of the split attention takes with its merge in the same
kernel or in a second one.
usage: python benchmarks/kernels_gpu_check.py OUT_DIR   (writes kernels_gpu_check.json; exit 1 on a failure)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from memra_dist.kernels.decode_attention import decode_attention, tickets
from memra_dist.kernels.rope_kv import rope_kv_write
from memra_dist.model.attention import cached_attention, causal_mask
from memra_dist.model.layers import apply_rope, rope_inv_freq, rope_rows

dev = torch.device("cuda")
out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
results, ok = [], True


def attention_case(dtype, rows, start, nh, nkv, hd, C):
    global ok
    g = torch.Generator(device=dev).manual_seed(rows * 7 + start)
    kc = torch.randn(C, nkv, hd, device=dev, dtype=dtype, generator=g)
    vc = torch.randn(C, nkv, hd, device=dev, dtype=dtype, generator=g)
    q = torch.randn(rows, nh, hd, device=dev, dtype=dtype, generator=g)
    pos = torch.arange(start, start + rows, device=dev)
    ref = cached_attention(q.float(), kc.float(), vc.float(), causal_mask(pos, C), nkv)
    t = tickets(nkv, rows * (nh // nkv), dev)
    first = decode_attention(q, kc, vc, pos, t)  # warm-up (compiles) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = decode_attention(q, kc, vc, pos, t)
    same = True
    for _ in range(200):
        graph.replay()
        same &= bool(torch.equal(o, first))
    torch.cuda.synchronize()
    err = float((o.float() - ref).abs().max())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    good = same and err <= tol and not bool(t.any())
    ok &= good
    results.append({"kernel": "decode_attention", "dtype": str(dtype), "rows": rows, "start": start, "nh": nh,
                    "nkv": nkv, "hd": hd, "capacity": C, "max_abs_err": err, "replays_identical": same,
                    "tickets_zero": not bool(t.any()), "ok": good})


def rope_case(rows, nh, nkv, hd):
    global ok
    C = 4096
    g = torch.Generator(device=dev).manual_seed(rows + nh)
    qkv = torch.randn(rows, (nh + 2 * nkv) * hd, device=dev, dtype=torch.bfloat16, generator=g)
    pos = torch.arange(1000, 1000 + rows, device=dev)
    cos, sin = rope_rows(pos, rope_inv_freq(hd, 500000.0).to(dev))
    kc = torch.zeros(C, nkv, hd, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    rk, rv = kc.clone(), vc.clone()
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
    rq = apply_rope(q.reshape(rows, nh, hd), cos, sin)
    rk.index_copy_(0, pos, apply_rope(k.reshape(rows, nkv, hd), cos, sin))
    rv.index_copy_(0, pos, v.reshape(rows, nkv, hd))
    got = rope_kv_write(qkv, cos, sin, kc, vc, pos, nh)
    ulp = (rq.float().abs() * 2.0 ** -7).clamp_min(1e-6)  # one bf16 step at each value
    q_ok = bool(((got.float() - rq.float()).abs() <= ulp).all())
    k_ok = bool(((kc.float() - rk.float()).abs() <= (rk.float().abs() * 2.0 ** -7).clamp_min(1e-6)).all())
    good = q_ok and k_ok and bool(torch.equal(vc, rv))
    ok &= good
    results.append({"kernel": "rope_kv_write", "rows": rows, "nh": nh, "nkv": nkv, "hd": hd, "q_within_1ulp": q_ok,
                    "k_within_1ulp": k_ok, "v_equal": bool(torch.equal(vc, rv)), "ok": good})


def gemv_case(n, k):
    """The decode GEMV with the pre-norm and the residual folded in vs the eager RMSNorm and linear."""
    global ok
    from memra_dist.kernels.gemv import gemv
    from memra_dist.model.layers import RMSNorm

    g = torch.Generator(device=dev).manual_seed(n + k)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    r = torch.randn(1, n, device=dev, dtype=torch.bfloat16, generator=g)
    norm = RMSNorm(k, 1e-5).to(dev, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, device=dev, generator=g) + 0.5)
        ref = (norm(x).float() @ w.float().t()) + r.float()
    got = gemv(x, w, norm=norm.weight, eps=norm.eps, residual=r).float()
    err = float(((got - ref).abs() / (ref.abs() + 1)).max())
    good = err <= 2e-2
    ok &= good
    results.append({"kernel": "gemv+norm+residual", "n": n, "k": k, "max_rel_err": err, "ok": good})


def merge_timing(rows, nh, nkv, hd, C, start, layers=32, reps=50):
    """Device time of `layers` calls of the split attention in one graph, per call, per merge."""
    kc = torch.randn(C, nkv, hd, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(rows, nh, hd, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(start, start + rows, device=dev)
    t = tickets(nkv, rows * (nh // nkv), dev)
    r = {"rows": rows, "nh": nh, "nkv": nkv, "hd": hd, "capacity": C, "start": start}
    for merge in ("fused", "kernel"):
        decode_attention(q, kc, vc, pos, t, merge=merge)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(layers):
                decode_attention(q, kc, vc, pos, t, merge=merge)
        graph.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        r[f"{merge}_us"] = round(e0.elapsed_time(e1) * 1e3 / reps / layers, 2)
    timings.append(r)


timings: list = []
for dtype in (torch.float32, torch.bfloat16):
    for rows, start in ((1, 0), (1, 511), (1, 1500), (5, 700), (16, 512), (64, 3000)):
        for nh, nkv, hd, C in ((32, 8, 128, 4096), (32, 8, 64, 2048), (8, 8, 64, 4096)):
            if start + rows <= C:
                attention_case(dtype, rows, start, nh, nkv, hd, C)
for rows in (1, 5, 16):
    for nh, nkv, hd in ((32, 8, 128), (32, 8, 64)):
        rope_case(rows, nh, nkv, hd)
for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (3072, 2048)):
    gemv_case(n, k)
for rows, nh, nkv, hd, C, start in ((1, 32, 8, 128, 2048, 600), (1, 32, 8, 64, 2048, 600), (1, 32, 8, 128, 4096, 3000),
                                    (16, 32, 8, 128, 2048, 600), (16, 32, 8, 64, 2048, 600)):
    merge_timing(rows, nh, nkv, hd, C, start)
(out / "kernels_gpu_check.json").write_text(json.dumps({"ok": ok, "cases": results, "merge_timing": timings}, indent=1))
for r in results:
    if not r["ok"]:
        print(json.dumps(r))
for r in timings:
    print("split attention per call:", json.dumps(r))
print("kernels_gpu_check:", "all ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
