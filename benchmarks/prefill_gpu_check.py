"""CUDA check of chunked prefill's attention (what the CPU tests cannot show: the flash arm runs
on CUDA half types only).

attention  `prefix_attention` (GQA must take the cudnn arm, MLA the flash arm: torch's
           FlashAttention-2 kernel with is_causal=True, bottom-right aligned when keys > queries;
           the flash arm is also checked alone on the GQA shapes) against
           `blocked_attention` (the query-blocked reference arm) and a float64 dense reference
           with an explicit bottom-right mask (row t at position start + t sees keys
           0 .. start + t), for start = 0 and start > 0, on GQA 32/8 heads hd 128 and an MLA
           shape (dqk 192, dv 128, one K/V head per query head), with q / k / v as the model
           passes them (q a strided view of a fused QKV row, k / v the first rows of a larger
           cache). The error against a TOP-LEFT reference is printed too: a flash arm that
           matches it is misaligned.
greedy     (--model DIR or --shape S) the public API on one engine: the greedy ids of a
           --prompt-len prompt (default 8192) with prefill_chunk --chunk (default 2048) against
           the whole prompt in one chunk (first 16 tokens); and, on the engine's runner, the
           last row's logits of the chunked prime against the one-chunk prime, with the flash
           arm and with the blocked arm forced (the bench checkpoints' chain structure makes
           greedy ids robust to attention errors, so the logits say more).

usage: python benchmarks/prefill_gpu_check.py [--out DIR] [--skip-attention] [--shape 8b | --model DIR]
exit 1 when the flash arm is wrong (or greedy ids differ); writes prefill_gpu_check.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from memra_dist.model import prefix_attention as pa

TOL_ABS = 3e-2  # bf16 output: |flash - fp64| may exceed |blocked - fp64| by at most this ...
TOL_REL = 2.0  # ... or this factor of the blocked arm's own error


def dense_ref(q, k, v, start: int, scale: float, bottom_right: bool = True) -> torch.Tensor:
    """float64 attention with an explicit mask: q (T, nh, dqk), k (S, nkv, dqk), v (S, nkv, dv)."""
    T, nh, _ = q.shape
    S, nkv = k.shape[0], k.shape[1]
    rep = nh // nkv
    qd = q.double().transpose(0, 1)  # (nh, T, d)
    kd = k.double().transpose(0, 1).repeat_interleave(rep, 0)  # (nh, S, d)
    vd = v.double().transpose(0, 1).repeat_interleave(rep, 0)
    s = torch.matmul(qd, kd.transpose(1, 2)) * scale  # (nh, T, S)
    rows = torch.arange(T, device=q.device)[:, None] + (start if bottom_right else 0)
    hide = torch.arange(S, device=q.device)[None, :] > rows  # key after the row's position
    s.masked_fill_(hide, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), vd).transpose(0, 1)  # (T, nh, dv)


def attention_case(name, T, start, nh, nkv, dqk, dv, dtype=torch.bfloat16, cap_extra=64) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T * 31 + start)
    S = start + T
    # q as the model has it: a view of a fused projection row (strided), k / v the cache's first S rows
    qkv = torch.randn(T, nh * dqk + 8, device=dev, dtype=dtype, generator=g)
    q = qkv[:, : nh * dqk].view(T, nh, dqk)
    kc = torch.randn(S + cap_extra, nkv, dqk, device=dev, dtype=dtype, generator=g)
    vc = torch.randn(S + cap_extra, nkv, dv, device=dev, dtype=dtype, generator=g)
    k, v = kc[:S], vc[:S]
    scale = dqk ** -0.5
    arm = pa.prefix_arm(q, k, v)
    o = pa.prefix_attention(q, k, v, start, scale)
    blk = pa.blocked_attention(q, k, v, start, scale)
    ref = dense_ref(q, k, v, start, scale)
    top = dense_ref(q, k, v, start, scale, bottom_right=False)
    torch.cuda.synchronize()
    e_flash = float((o.double() - ref).abs().max())
    e_blk = float((blk.double() - ref).abs().max())
    e_top = float((o.double() - top).abs().max())
    e_fb = float((o.float() - blk.float()).abs().max())
    want = "cudnn" if dqk == dv and dqk <= 128 else "flash"  # the registry's first fast arm for the shape
    ok = arm == want and tuple(o.shape) == (T, nh, dv) and e_flash <= max(TOL_REL * e_blk, e_blk + TOL_ABS)
    if dqk == dv and dqk <= 128:  # the flash arm alone too (it stays the MLA arm and the fallback)
        e_fa = float((pa._flash(q, k, v, start, scale).double() - ref).abs().max())
        ok = ok and e_fa <= max(TOL_REL * e_blk, e_blk + TOL_ABS)
        print(f"        flash arm alone |flash-fp64|={e_fa:.3e}", flush=True)
    row = {"case": name, "T": T, "start": start, "S": S, "nh": nh, "nkv": nkv, "dqk": dqk, "dv": dv, "arm": arm,
           "err_flash_vs_fp64": e_flash, "err_blocked_vs_fp64": e_blk, "err_flash_vs_blocked": e_fb,
           "err_flash_vs_topleft_fp64": e_top, "ok": ok}
    print(f"  {name:5s} T={T:5d} start={start:5d} arm={arm:7s} |flash-fp64|={e_flash:.3e} |blocked-fp64|={e_blk:.3e} "
          f"|flash-blocked|={e_fb:.3e} |flash-topleft|={e_top:.3e}  {'ok' if ok else 'WRONG'}", flush=True)
    return row


def time_arm(T: int, start: int, nh=32, nkv=8, d=128, n=20) -> dict:
    """Device ms of the flash arm and of the blocked arm on one chunk (events, mean of n)."""
    dev = torch.device("cuda")
    q = torch.randn(T, nh, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(start + T, nkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = {}
    for name, fn in (("cudnn", pa._cudnn), ("flash", pa._flash), ("blocked", pa.blocked_attention)):
        fn(q, k, v, start, d ** -0.5)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        e0.record()
        for _ in range(n):
            fn(q, k, v, start, d ** -0.5)
        e1.record()
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1) / n
        flops = 4 * nh * d * T * (start + T / 2)
        out[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
    print(f"  timing T={T} start={start}: cudnn {out['cudnn']['ms']:.3f} ms ({out['cudnn']['tflops']} TFLOP/s), "
          f"flash {out['flash']['ms']:.3f} ms ({out['flash']['tflops']} TFLOP/s), "
          f"blocked {out['blocked']['ms']:.3f} ms ({out['blocked']['tflops']} TFLOP/s)", flush=True)
    return {"T": T, "start": start, **out}


def attention_checks() -> tuple[list, list, bool]:
    print("prefix_attention on CUDA bf16 (flash arm) vs blocked arm vs float64 bottom-right reference", flush=True)
    rows = []
    for T, start in ((1024, 0), (1024, 3072), (777, 2049), (40, 1000), (2048, 2048)):
        rows.append(attention_case("gqa", T, start, 32, 8, 128, 128))
    for T, start in ((1024, 0), (512, 1536), (300, 701)):
        rows.append(attention_case("mla", T, start, 16, 16, 192, 128))
    timing = [time_arm(8192, 0), time_arm(8192, 24576)]
    return rows, timing, all(r["ok"] for r in rows)


def _resolve_model(args) -> str:
    if args.model:
        return args.model
    from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint, ensure_variant  # noqa: PLC0415
    from memra_dist.bench.prefill import LONG_POSITIONS  # noqa: PLC0415

    say = lambda m: print(f"  {m}", flush=True)  # noqa: E731
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = ensure_checkpoint(args.shape, bench_cache_dir(args.cache_dir), dev, say)
    return str(ensure_variant(base, {"max_position_embeddings": LONG_POSITIONS}, "long", say))


def greedy_check(args) -> tuple[dict, bool]:
    from memra_dist.app import open_engine  # noqa: PLC0415
    from memra_dist.bench.runs import make_prompt  # noqa: PLC0415
    from memra_dist.config import RunConfig  # noqa: PLC0415

    model = _resolve_model(args)
    n, c, new = args.prompt_len, args.chunk, 16
    cap = n + new + 2
    print(f"greedy ids: {n}-token prompt, prefill_chunk {c} vs {n} (one chunk), {new} tokens, model {model}",
          flush=True)
    t = time.perf_counter()
    cfg = RunConfig(model=model, drafter="none", k=1, max_new_tokens=new, graphs=args.graphs)
    with open_engine(cfg, capacity=cap) as engine:
        print(f"  engine open in {time.perf_counter() - t:.1f}s", flush=True)
        vocab = engine.model.vocab_size
        prompt = make_prompt(n, vocab, seed=7)
        whole = engine.generate(prompt, cfg.with_(prefill_chunk=n)).token_ids
        chunked = engine.generate(prompt, cfg.with_(prefill_chunk=c)).token_ids
        same = whole == chunked
        print(f"  greedy ids equal: {same}  (whole {whole[:8]}..., chunked {chunked[:8]}...)", flush=True)
        # the last row's logits of the prime, on the engine's own runner (public API has no logits)
        r = engine._backend.runner
        ids = torch.tensor(prompt)

        def prime(rows: int) -> torch.Tensor:
            r.alloc(cap)
            r.rollback(0)
            lg = None
            for a in range(0, n, rows):
                lg = r.forward(ids[a:a + rows], a, last=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return lg.float()[-1]

        lw = prime(n)
        lc = prime(c)
        arms = pa._ARMS
        pa._ARMS = tuple(a for a in arms if a[0] == "blocked")  # the reference arm, forced
        try:
            lb = prime(c)
        finally:
            pa._ARMS = arms
        scale = float(lw.abs().max())
        res = {"prompt": n, "chunk": c, "greedy_whole": whole, "greedy_chunked": chunked, "greedy_equal": same,
               "logits_absmax": scale, "logits_whole_vs_chunked_flash": float((lw - lc).abs().max()),
               "logits_chunked_flash_vs_blocked": float((lc - lb).abs().max()),
               "logits_whole_vs_chunked_blocked": float((lw - lb).abs().max()),
               "argmax": [int(lw.argmax()), int(lc.argmax()), int(lb.argmax())]}
        print(f"  last-row logits (|max| {scale:.3g}): |whole - chunked(flash)| {res['logits_whole_vs_chunked_flash']:.3e}, "
              f"|chunked flash - chunked blocked| {res['logits_chunked_flash_vs_blocked']:.3e}, "
              f"|whole - chunked blocked| {res['logits_whole_vs_chunked_blocked']:.3e}; argmax {res['argmax']}",
              flush=True)
    return res, same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory for prefill_gpu_check.json")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--model", help="checkpoint for the greedy check (default: none unless --shape)")
    ap.add_argument("--shape", help="a bench shape for the greedy check (its long-position variant)")
    ap.add_argument("--cache-dir", help="bench checkpoint cache (default $MEMRA_BENCH_CACHE)")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--graphs", default="auto", choices=["auto", "on", "off"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_gpu_check: needs CUDA", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res, ok = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}, True
    if not args.skip_attention:
        rows, timing, good = attention_checks()
        res.update(attention=rows, timing=timing, attention_ok=good)
        ok &= good
        print(f"flash arm bottom-right correct: {good}", flush=True)
    if args.model or args.shape:
        g, same = greedy_check(args)
        res["greedy"] = g
        ok &= same
    name = "prefill_gpu_check.json" if not args.skip_attention else "prefill_gpu_check_greedy.json"
    (out / name).write_text(json.dumps(res, indent=2))
    print(f"prefill_gpu_check: {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
