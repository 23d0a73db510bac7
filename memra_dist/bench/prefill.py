"""Prefill on the default path: what a user's first token costs at 512 to 128k prompt tokens,
against transformers' own forward of the same files, and what decoding after that prompt
reaches against a roofline that counts the KV cache it reads.

Everything of ours goes through the public API, as users run it: one engine
(`app.open_engine(RunConfig(drafter="none", default flags), capacity=...)`) opened once with
room for the longest prompt, one warm-up request, then `engine.generate(ids, stream=...)` per
timed request. Per prompt length:

    TTFT        wall from the call of `engine.generate` to the FIRST call of its `stream`
                callback (the caller's view; the session's own stats["ttft_ms"], which starts at
                the session's construction, is kept beside it as `ttft_stats_ms`)
    tok/s       prompt tokens / TTFT
    TFLOP/s     PREFILL_FLOPS / TTFT, with PREFILL_FLOPS stated below
    peak memory torch.cuda.max_memory_allocated() over the request (reset before), against the
                weights + the KV cache the engine holds (its capacity, not the prompt's share)
    decode      tokens after the first / wall from the first stream call to the return,
                against bandwidth / (weight bytes + KV bytes per token x mean context)

transformers' peer: `AutoModelForCausalLM` with attn_implementation="sdpa" on the same files,
one forward of the prompt (`logits_to_keep=1`, as its generate() prefill and our last-row
lm_head; `use_cache=True`, as we write the cache), warm, device-synced; an OOM is recorded
as such. A chunk sweep times the sweep length's TTFT per `prefill_chunk` (a request-level
setting: one engine serves them all) and checks that the greedy ids do not depend on it.

The bench checkpoints hold 8192 positions; this section reads a variant of the same weight
files with a longer `max_position_embeddings` (checkpoints.ensure_variant: links, no copy),
so the other sections' checkpoints and results are untouched.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time

import torch

from ..errors import UserError
from .checkpoints import ensure_checkpoint, ensure_variant, shape_config, weight_bytes
from .noise import Fig

__all__ = ["prefill", "prefill_flops", "kv_bytes_per_token", "decode_roofline_tok_s", "FLOPS_FORMULA",
           "param_count", "LONG_POSITIONS", "best_chunk"]

LONG_POSITIONS = 1 << 18  # the prefill variant's max_position_embeddings: 128k prompts and room to decode

FLOPS_FORMULA = ("prefill FLOPs = 2 * P * T + 2 * 2 * L * H * d * T^2 / 2 (P = every weight parameter, embedding "
                 "and lm_head included; L layers, H query heads, d head dim; the causal half of the q.k and p.v "
                 "products); TFLOP/s = FLOPs / TTFT")
DECODE_FORMULA = ("decode roofline tok/s = copy bandwidth / (weight bytes + KV bytes per token * (prompt + new / 2)); "
                  "KV bytes per token = 2 * L * KV heads * d * element size")


def param_count(cfg: dict) -> int:
    """Weight parameters of a llama-family config (embedding and lm_head counted, untied).

    >>> param_count(shape_config("8b"))
    8030261248
    """
    h, i, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh
    attn = h * nh * d + 2 * h * nkv * d + nh * d * h
    per_layer = attn + 3 * h * i + 2 * h  # q/k/v/o, gate/up/down, two norms
    head = V * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return L * per_layer + head + h  # + the final norm


def prefill_flops(params: int, layers: int, heads: int, head_dim: int, tokens: int) -> float:
    """FLOPS_FORMULA: 2 * params * T + 2 * 2 * layers * heads * head_dim * T^2 / 2.

    >>> prefill_flops(10, 1, 1, 1, 4)  # 2*10*4 + 4 * 16 / 2
    112.0
    """
    return 2.0 * params * tokens + 2.0 * 2.0 * layers * heads * head_dim * tokens * tokens / 2.0


def kv_bytes_per_token(cfg: dict, element_size: int) -> int:
    """K and V of one position in every layer.

    >>> kv_bytes_per_token(shape_config("8b"), 2)  # 2 * 32 * 8 * 128 * 2: 128 KiB
    131072
    """
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * element_size


def decode_roofline_tok_s(bandwidth_bytes_s: float, weight_bytes_: int, kv_per_token: int, context: float) -> float:
    """Batch-1 decode bound when each token reads every weight and the KV cache of `context`
    positions once (DECODE_FORMULA).

    >>> round(decode_roofline_tok_s(4.25e12, 16.06e9, 131072, 0), 1)  # no context: the weight roofline
    264.6
    >>> round(decode_roofline_tok_s(4.25e12, 16.06e9, 131072, 32768 + 64), 1)  # + 4.3 GB of KV
    208.7
    """
    return bandwidth_bytes_s / (weight_bytes_ + kv_per_token * context)


def best_chunk(sweep: dict) -> int | None:
    """The chunk size of the lowest median TTFT among the sweep's measured rows.

    >>> best_chunk({"2048": {"ttft_ms": 9.0}, "8192": {"ttft_ms": 7.5}, "16384": {"oom": True}})
    8192
    """
    rows = [(r["ttft_ms"], int(c)) for c, r in sweep.items() if isinstance(r, dict) and r.get("ttft_ms")]
    return min(rows)[1] if rows else None


# ---- measurement ----------------------------------------------------------------------------

def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _reset_peak(dev) -> int:
    """Resets the peak counter; the bytes allocated now."""
    if dev.type != "cuda":
        return 0
    _sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


def _peak(dev) -> int | None:
    return torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None


def _free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _sig(x: float, n: int = 4) -> float:
    """x to n significant digits (TFLOP/s of a tiny CPU model are 1e-3)."""
    return float(f"{x:.{n}g}")


def _gb(x) -> float | None:
    return None if x is None else round(x / 1e9, 3)


def _timed_request(engine, prompt: list[int], cfg, dev) -> dict:
    """One engine.generate, timed from outside: TTFT at the first stream call, decode after it."""
    first: list[float] = []

    def stream(_new):
        if not first:
            first.append(time.perf_counter())

    base = _reset_peak(dev)
    t0 = time.perf_counter()
    res = engine.generate(prompt, cfg, stream=stream)
    _sync(dev)
    t1 = time.perf_counter()
    n = len(res.token_ids)
    return {"ttft_s": first[0] - t0, "decode_s": t1 - first[0], "tokens": n, "ids": res.token_ids,
            "ttft_stats_ms": res.stats.get("ttft_ms"), "stats_tok_s": res.stats.get("tok_per_s"),
            "peak": _peak(dev), "allocated_before": base}


def _len_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _ours(s, engine, cfg, prompts: dict, flops: dict, weights: int, kvpt: int, capacity: int, bw: dict) -> dict:
    """Timed requests per prompt length (after the caller's warm-up)."""
    dev, out = s.device, {}
    kv_cache = kvpt * capacity
    for L, prompt in prompts.items():
        key = str(L)
        if s.left() <= 0:
            out[key] = {"skipped": "budget"}
            s.say(f"  ours {_len_label(L)}: skipped (budget)")
            continue
        reps = s.p.prefill_repeats(L)
        runs = []
        try:
            for _ in range(reps):
                runs.append(_timed_request(engine, prompt, cfg, dev))
                if s.left() <= 0:
                    break
        except (torch.OutOfMemoryError, UserError) as e:  # recorded as such; the next length still runs
            oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)
            out[key] = {"oom": oom, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                        "timed_before": len(runs), "peak_gb": _gb(_peak(dev))}
            s.say(f"  ours {_len_label(L)}: {out[key]['error']}")
            _free(dev)
            continue
        ttft = Fig.of([r["ttft_s"] for r in runs])
        new = runs[0]["tokens"]
        dec = Fig.of([(r["tokens"] - 1) / r["decode_s"] for r in runs if r["tokens"] > 1 and r["decode_s"] > 0] or [0.0])
        ctx = L + new / 2
        bwf = Fig(bw["bandwidth_bytes_s"], *bw["bandwidth_bytes_s_range"], bw["repeats"])
        roof = bwf.map(lambda b: decode_roofline_tok_s(b, weights, kvpt, ctx))
        frac = dec / roof
        # TFLOP/s falls as TTFT grows: its range is [F / hi, F / lo]
        tfl_rng = [_sig(flops[L] / ttft.hi / 1e12), _sig(flops[L] / ttft.lo / 1e12)] if ttft.known else None
        peaks = [r["peak"] for r in runs if r["peak"] is not None]
        row = {"prompt": L, "repeats": len(runs), "ttft_ms": round(ttft.value * 1e3, 3),
               "ttft_ms_range": ttft.map(lambda x: x * 1e3).rng(3),
               "ttft_ms_all": [round(r["ttft_s"] * 1e3, 3) for r in runs],
               "ttft_stats_ms_all": [r["ttft_stats_ms"] for r in runs],
               "prefill_tok_s": round(L / ttft.value, 1), "flops": flops[L], "tflops": _sig(flops[L] / ttft.value / 1e12),
               "tflops_range": tfl_rng, "new_tokens": new, "decode_tok_s": round(dec.value, 2),
               "decode_tok_s_range": dec.rng(2), "decode_stats_tok_s_all": [r["stats_tok_s"] for r in runs],
               "decode_context_mean": ctx, "decode_kv_roofline_tok_s": round(roof.value, 2),
               "decode_kv_roofline_fraction": round(frac.value, 4), "decode_kv_roofline_fraction_range": frac.rng(4),
               "first_token": runs[0]["ids"][0]}
        if peaks:
            pk = max(peaks)
            over = pk - weights - kv_cache
            row.update(peak_gb=_gb(pk), weights_gb=_gb(weights), kv_cache_gb=_gb(kv_cache),
                       kv_prompt_gb=_gb(kvpt * L), overhead_gb=round(over / 1e9, 3),
                       overhead_gb_range=[round(over / 1e9, 3)] * 2,
                       allocated_before_gb=_gb(runs[0]["allocated_before"]))
        out[key] = row
        s.say(f"  ours {_len_label(L)}: TTFT {row['ttft_ms']:.1f} ms (x{len(runs)}: {row['ttft_ms_all']}), "
              f"{row['prefill_tok_s']:.0f} tok/s, {row['tflops']:.1f} TFLOP/s, peak {row.get('peak_gb')} GB "
              f"(over weights+KV {row.get('overhead_gb')} GB); decode {row['decode_tok_s']:.1f} tok/s = "
              f"{row['decode_kv_roofline_fraction']:.3f} of the KV roofline {row['decode_kv_roofline_tok_s']:.1f}")
    return out


def _sweep(s, engine, cfg, prompt: list[int], flops: float, chunks: tuple[int, ...]) -> dict:
    """TTFT of the sweep prompt per prefill_chunk (requests on the same engine); greedy ids
    of every chunk size against the whole prompt in one chunk (or the largest measured)."""
    dev, out, ids = s.device, {}, {}
    new = s.p.prefill_sweep_new
    for c in chunks:
        if s.left() <= 0:
            out[str(c)] = {"skipped": "budget"}
            continue
        cc = cfg.with_(prefill_chunk=c, max_new_tokens=new)
        runs = []
        try:
            for _ in range(s.p.prefill_sweep_repeats):
                runs.append(_timed_request(engine, prompt, cc, dev))
        except (torch.OutOfMemoryError, UserError) as e:
            out[str(c)] = {"oom": True, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            _free(dev)
            s.say(f"  sweep chunk {c}: OOM")
            continue
        t = Fig.of([r["ttft_s"] for r in runs])
        ids[c] = runs[0]["ids"]
        row = {"chunk": c, "chunks": math.ceil(len(prompt) / c), "repeats": len(runs),
               "ttft_ms": round(t.value * 1e3, 3), "ttft_ms_range": t.map(lambda x: x * 1e3).rng(3),
               "ttft_ms_all": [round(r["ttft_s"] * 1e3, 3) for r in runs], "tflops": _sig(flops / t.value / 1e12),
               "peak_gb": _gb(max((r["peak"] for r in runs if r["peak"] is not None), default=None))}
        out[str(c)] = row
        s.say(f"  sweep chunk {c}: TTFT {row['ttft_ms']:.1f} ms {row['ttft_ms_all']}, {row['tflops']:.1f} TFLOP/s, "
              f"peak {row['peak_gb']} GB")
    res = {"prompt": len(prompt), "new_tokens": new, "rows": out, "best_chunk": best_chunk(out)}
    if ids:
        ref_c = max(ids)  # the fewest chunks: the whole prompt in one when the sweep reaches it
        res["greedy_reference_chunk"] = ref_c
        res["greedy_ids_equal"] = {str(c): v == ids[ref_c] for c, v in ids.items()}
    return res


def _hf_load(path: str, dev, dtype):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    kw = {"attn_implementation": "sdpa"}
    if dev.type == "cuda":
        kw["device_map"] = str(dev) if dev.index is not None else "cuda"
    try:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, **kw)
    except (ImportError, ValueError):  # device_map needs accelerate
        kw.pop("device_map", None)
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    return m.to(dev).eval()


def _hf_forward(model, ids: torch.Tensor, dev) -> tuple[float, int]:
    """(seconds, last-row greedy id) of one forward of the prompt, synced on both sides."""
    _sync(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        try:
            out = model(ids, use_cache=True, logits_to_keep=1)
        except TypeError:  # older transformers: num_logits_to_keep / all rows
            out = model(ids, use_cache=True)
    tok = out.logits[0, -1]
    _sync(dev)
    dt = time.perf_counter() - t0
    first = int(tok.argmax())
    del out
    return dt, first


def _peer(s, path: str, prompts: dict, flops: dict, ours: dict) -> dict:
    try:
        import transformers  # noqa: PLC0415
    except ImportError:
        return {"skipped": "transformers is not installed"}
    dev = s.device
    s.say(f"  loading the transformers {transformers.__version__} model (sdpa) from the same files")
    t = time.perf_counter()
    model = _hf_load(path, dev, s.dtype)
    out = {"transformers": transformers.__version__, "attn_implementation": model.config._attn_implementation,
           "load_s": round(time.perf_counter() - t, 2), "call": "model(ids, use_cache=True, logits_to_keep=1)",
           "weights_allocated_gb": _gb(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else None,
           "lengths": {}}
    warm = min(prompts)
    _hf_forward(model, torch.tensor([prompts[warm]], device=dev), dev)  # warm-up
    for L, prompt in prompts.items():
        if s.left() <= 0:
            out["lengths"][str(L)] = {"skipped": "budget"}
            continue
        ids = torch.tensor([prompt], device=dev)
        xs, first, peak, base = [], None, None, 0
        try:
            for _ in range(s.p.prefill_repeats(L)):
                base = _reset_peak(dev)
                dt, first = _hf_forward(model, ids, dev)
                xs.append(dt)
                peak = max(peak or 0, _peak(dev) or 0) or None
                if s.left() <= 0:
                    break
        except torch.OutOfMemoryError as e:
            out["lengths"][str(L)] = {"oom": True, "error": str(e).splitlines()[0][:200],
                                      "timed_before_oom": len(xs)}
            s.say(f"  transformers {_len_label(L)}: OOM")
            del ids
            _free(dev)
            continue
        f = Fig.of(xs)
        row = {"prompt": L, "repeats": len(xs), "forward_ms": round(f.value * 1e3, 3),
               "forward_ms_range": f.map(lambda x: x * 1e3).rng(3), "forward_ms_all": [round(x * 1e3, 3) for x in xs],
               "tflops": _sig(flops[L] / f.value / 1e12), "peak_gb": _gb(peak), "allocated_before_gb": _gb(base),
               "first_token": first}
        o = ours.get(str(L), {})
        if o.get("ttft_ms"):
            of = Fig.from_json(o["ttft_ms"], o.get("ttft_ms_range"), o.get("repeats"))
            r = of / f.map(lambda x: x * 1e3)
            row.update(ours_ttft_over_sdpa=round(r.value, 4), ours_ttft_over_sdpa_range=r.rng(4),
                       first_token_equal=o.get("first_token") == first)
        out["lengths"][str(L)] = row
        s.say(f"  transformers {_len_label(L)}: forward {row['forward_ms']:.1f} ms {row['forward_ms_all']}, "
              f"{row['tflops']:.1f} TFLOP/s, peak {row['peak_gb']} GB; ours / sdpa "
              f"{row.get('ours_ttft_over_sdpa')}")
        del ids
        _free(dev)
    del model
    _free(dev)
    return out


def _partial(out: dict) -> None:
    """The section's figures so far, to $MEMRA_PREFILL_PARTIAL when set (a run killed at a wall
    limit keeps what it measured)."""
    path = os.environ.get("MEMRA_PREFILL_PARTIAL")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2, default=str)


def _guarded(s, what: str, fn) -> dict:
    """fn() or {"error": ...}: one part failing keeps the others' figures."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        s.say(f"  {what}: ERROR {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def prefill(s) -> dict:
    from ..app import open_engine  # noqa: PLC0415
    from ..config import RunConfig  # noqa: PLC0415
    from ..specdec.chunks import DEFAULT_PREFILL_CHUNK  # noqa: PLC0415
    from .drafting import bandwidth_run  # noqa: PLC0415
    from .fastpath import config_kwargs  # noqa: PLC0415
    from .runs import make_prompt  # noqa: PLC0415

    shape, dev, p = s.opts.shape, s.device, s.p
    cfg_dict = shape_config(shape)
    if cfg_dict.get("model_type") != "llama":
        return {"skipped": f"prefill only for llama shapes (shape {shape})"}
    lens = tuple(sorted(p.prefill_lens))
    new, k = p.prefill_new, 1
    longest = max(lens + (p.prefill_sweep_len,))
    capacity = longest + new + k + 1
    base = ensure_checkpoint(shape, s.cache, dev, s.say, s.ckpt_dtype)
    path = ensure_variant(base, {"max_position_embeddings": max(LONG_POSITIONS, capacity)}, "long", s.say)
    elem = torch.empty(0, dtype=s.dtype).element_size()
    weights = weight_bytes(cfg_dict, s.dtype)
    kvpt = kv_bytes_per_token(cfg_dict, elem)
    params = param_count(cfg_dict)
    d = cfg_dict["hidden_size"] // cfg_dict["num_attention_heads"]
    fl = lambda T: prefill_flops(params, cfg_dict["num_hidden_layers"], cfg_dict["num_attention_heads"], d, T)  # noqa: E731
    bw = dict(bandwidth_run(s))
    vocab = cfg_dict["vocab_size"]
    prompts = {L: make_prompt(L, vocab, seed=L) for L in lens}
    flops = {L: fl(L) for L in lens}
    cfg = RunConfig(model=str(path), drafter="none", k=k, max_new_tokens=new, device=str(dev),
                    dtype=_dtype_name(s.dtype), **config_kwargs(s.graphs))
    out = {"checkpoint": str(path), "capacity": capacity, "default_prefill_chunk": cfg.prefill_chunk,
           "flops_formula": FLOPS_FORMULA, "decode_formula": DECODE_FORMULA, "params": params,
           "weight_bytes": weights, "kv_bytes_per_token": kvpt, "kv_cache_bytes": kvpt * capacity,
           "bandwidth_bytes_s": bw["bandwidth_bytes_s"], "bandwidth_bytes_s_range": bw["bandwidth_bytes_s_range"],
           "ttft": "wall from engine.generate to the first call of its stream callback (the caller's view); "
                   "ttft_stats_ms_all = the session's stats['ttft_ms'] (from the session's construction)",
           "lengths": list(lens), "new_tokens": new}
    s.say(f"  opening the engine on {path.name} (capacity {capacity}, KV cache {kvpt * capacity / 1e9:.2f} GB)")
    t = time.perf_counter()
    with open_engine(cfg, capacity=capacity) as engine:
        out["open_s"] = round(time.perf_counter() - t, 2)
        out["allocated_after_open_gb"] = _gb(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else None
        warm_len = min(longest, cfg.prefill_chunk + 512)
        t = time.perf_counter()
        engine.generate(make_prompt(warm_len, vocab, seed=1), cfg)  # warm-up: cache, graphs, kernels
        _sync(dev)
        out["warmup"] = {"prompt": warm_len, "s": round(time.perf_counter() - t, 2)}
        out["allocated_idle_gb"] = _gb(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else None
        s.say(f"  engine open in {out['open_s']:.1f}s, warm-up ({warm_len} tokens) {out['warmup']['s']:.1f}s")
        _partial(out)
        out["ours"] = _guarded(s, "ours", lambda: _ours(s, engine, cfg, prompts, flops, weights, kvpt, capacity, bw))
        _partial(out)
        if s.left() > 0:
            sp = make_prompt(p.prefill_sweep_len, vocab, seed=p.prefill_sweep_len)
            out["sweep"] = _guarded(s, "sweep", lambda: _sweep(s, engine, cfg, sp, fl(p.prefill_sweep_len),
                                                               p.prefill_chunks))
            bc, rows = out["sweep"].get("best_chunk"), out["sweep"].get("rows") or {}
            dc = str(DEFAULT_PREFILL_CHUNK)
            if bc is not None and rows.get(dc, {}).get("ttft_ms"):
                out["sweep"]["default_over_best"] = round(rows[dc]["ttft_ms"] / rows[str(bc)]["ttft_ms"], 4)
        else:
            out["sweep"] = {"skipped": "budget"}
        _partial(out)
        del engine
    _free(dev)
    out["allocated_after_close_gb"] = _gb(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else None
    if s.left() > 0:
        out["peer"] = _guarded(s, "transformers peer", lambda: _peer(s, str(path), prompts, flops, out["ours"]))
    else:
        out["peer"] = {"skipped": "budget"}
    _partial(out)
    return out
