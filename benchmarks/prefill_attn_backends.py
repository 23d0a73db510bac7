"""Which attention kernel a prefill chunk should run on this GPU: device time of one chunk's
attention (GQA 32/8 heads, head dim 128, bf16, the cache layout (S, kv heads, d)) per backend,
at the chunk shapes the prefill section runs (8192 rows at prefix 0 / 24576 / 122880, a 32k
square), each checked against the flash arm (`prefix_attention`, bottom-right causal).

backends:
  flash_arm        model/prefix_attention.py's flash arm (aten FlashAttention-2, GQA read in place)
  sdpa_default     F.scaled_dot_product_attention(is_causal=True, enable_gqa=True), torch's own pick
                   (top-left causal: run on square chunks only, start = 0)
  sdpa_lower_right F.scaled_dot_product_attention(attn_mask=causal_lower_right(T, S), enable_gqa=True)
  cudnn_square     SDPBackend.CUDNN_ATTENTION, is_causal, K/V heads repeated (square only)
  cudnn_split      cuDNN in two calls merged by their log-sum-exp: the chunk against the prefix (no
                   mask) + the chunk's own causal square; bottom-right by construction

Then the decode side of the prefill section's "decode after the prompt" rows: device time of the
split-sequence decode attention (kernels/decode_attention.py, one row, one layer, in a CUDA graph)
at live lengths 512 .. 128k, in a cache of the engine's capacity (131202 rows: its chunking is
set by the capacity) against a cache sized to the length and a fixed 256-slot chunk, with the
KV bytes it must read over that time.
usage: python benchmarks/prefill_attn_backends.py [OUT_DIR]  (writes prefill_attn_backends.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from memra_dist.model import prefix_attention as pa

NH, NKV, D = 32, 8, 128


def _ms(fn, n=5) -> float:
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def _heads(x):  # (S, h, d) -> (1, h, S, d) view
    return x.transpose(0, 1)[None]


def _cudnn(q, k, v, causal: bool):
    """(o (1, h, T, d), lse (1, h, T)) from aten's cuDNN attention; K/V heads repeated to q's."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                scale=D ** -0.5)[:2]
    return o, lse.view(o.shape[:3]).float()


def cudnn_split(q, k, v, start: int):
    """Bottom-right causal attention of q (T rows at [start, start + T)) in two cuDNN calls."""
    T = q.shape[0]
    qh, kh, vh = _heads(q), _heads(k), _heads(v)
    o2, l2 = _cudnn(qh, kh[:, :, start:], vh[:, :, start:], True)  # the chunk's own square
    if start == 0:
        return o2[0].transpose(0, 1)
    o1, l1 = _cudnn(qh, kh[:, :, :start], vh[:, :, :start], False)  # the prefix, every key visible
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    o = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return o.to(q.dtype)[0].transpose(0, 1)  # (T, nh, d)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    rows = []
    for T, start in ((8192, 0), (8192, 24576), (8192, 122880), (32768, 0)):
        S = start + T
        g = torch.Generator(device=dev).manual_seed(T + start)
        q = torch.randn(T, NH, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(S, NKV, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(S, NKV, D, device=dev, dtype=torch.bfloat16, generator=g)
        flops = 4 * NH * D * T * (start + T / 2)
        ref = pa.prefix_attention(q, k, v, start, D ** -0.5)
        cands = {"flash_arm": lambda: pa.prefix_attention(q, k, v, start, D ** -0.5)}
        if start == 0:
            cands["sdpa_default"] = lambda: F.scaled_dot_product_attention(
                _heads(q), _heads(k), _heads(v), is_causal=True, enable_gqa=True)[0].transpose(0, 1)

            def cudnn_sq():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    rep = NH // NKV
                    return F.scaled_dot_product_attention(_heads(q), _heads(k).repeat_interleave(rep, 1),
                                                          _heads(v).repeat_interleave(rep, 1),
                                                          is_causal=True)[0].transpose(0, 1)
            cands["cudnn_square"] = cudnn_sq

        def lower_right():
            from torch.nn.attention.bias import causal_lower_right  # noqa: PLC0415

            return F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v), attn_mask=causal_lower_right(T, S),
                                                  enable_gqa=True)[0].transpose(0, 1)
        cands["sdpa_lower_right"] = lower_right
        cands["cudnn_split"] = lambda: cudnn_split(q, k, v, start)
        for name, fn in cands.items():
            try:
                o = fn()
                err = float((o.float() - ref.float()).abs().max())
                ms = _ms(fn)
                row = {"T": T, "start": start, "backend": name, "ms": round(ms, 3),
                       "tflops": round(flops / ms / 1e9, 1), "max_err_vs_flash_arm": err}
            except Exception as e:  # noqa: BLE001
                row = {"T": T, "start": start, "backend": name, "error": f"{type(e).__name__}: {str(e)[:160]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
    dec = decode_probe()
    (out / "prefill_attn_backends.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows,
                                                                "decode": dec}, indent=2))
    return 0


def decode_probe(capacity: int = 131202) -> list:
    from memra_dist.bench.timing import capture_graph, graph_replay_ms  # noqa: PLC0415
    from memra_dist.kernels.decode_attention import chunking, decode_attention  # noqa: PLC0415

    dev = torch.device("cuda")
    kc = torch.randn(capacity, NKV, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(1, NH, D, device=dev, dtype=torch.bfloat16)
    rows = []
    for ctx in (512, 2048, 8192, 32768, 131072):
        pos = torch.tensor([ctx], device=dev)
        kv = 2 * (ctx + 1) * NKV * D * 2
        for name, c, chunk in (("engine capacity", capacity, None), ("capacity = length", ctx + 130, None),
                               ("engine capacity, chunk 256", capacity, 256)):
            k, v = kc[:c], vc[:c]
            g = capture_graph(lambda: decode_attention(q, k, v, pos, chunk))  # noqa: B023
            us = graph_replay_ms(g, 200) * 1e3
            ch = chunk or chunking(c)[0]
            row = {"ctx": ctx, "cache": name, "capacity": c, "chunk": ch, "programs_live": NKV * -(-(ctx + 1) // ch),
                   "us": round(us, 2), "gb_s": round(kv / us / 1e3, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del g
    return rows


if __name__ == "__main__":
    sys.exit(main())
