"""The peer: transformers `generate()` on the SAME checkpoint files, plain and assisted
(`assistant_model` = the draft checkpoint), greedy, batch 1. Decode tok/s = (n - 1) tokens
over t(generate n) - t(generate 1), so the prefill cancels as in our own decode timing; the
plain figure is the median of gen_repeats such pairs, with their range (noise.py)."""

from __future__ import annotations

import time

import torch

from .noise import Fig
from .timing import sync

__all__ = ["peer"]


def _load(path: str, device, dtype):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    try:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    return m.to(device).eval()


def _gen_s(model, ids, n: int, device, keep: list | None = None, **kw) -> float:
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    sync(device)
    if keep is not None:
        keep.extend(out[0, ids.shape[1]:].tolist())
    return time.perf_counter() - t0


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _decode_tok_s(model, ids, n: int, device, ours: list[int] | None = None, repeats: int = 1, **kw) -> dict:
    """Decode tok/s of `repeats` (t(generate 1), t(generate n)) pairs: the median pair's figures,
    every pair's tok/s and their range."""
    _gen_s(model, ids, min(4, n), device, **kw)  # warm-up
    pairs, toks = [], []
    for i in range(repeats):
        t1 = _gen_s(model, ids, 1, device, **kw)
        tn = _gen_s(model, ids, n, device, toks if i == 0 else None, **kw)
        pairs.append(((n - 1) / max(tn - t1, 1e-9), tn, t1))
    tok_s, tn, t1 = sorted(pairs)[len(pairs) // 2]
    f = Fig.of([p[0] for p in pairs])
    out = {"tok_s": round(tok_s, 3), "generate_s": round(tn, 4), "prefill_plus_one_s": round(t1, 4),
           "tok_s_all": [round(p[0], 3) for p in pairs], "tok_s_range": f.rng(3),
           "repeats": len(pairs)}
    if ours:  # same weights, same greedy rule: the leading tokens should agree (bf16 near-ties may split later)
        out["greedy_agree_prefix"] = _agree(toks, ours)
    return out


def peer(s) -> dict:
    try:
        import transformers  # noqa: PLC0415
    except ImportError:
        return {"skipped": "transformers is not installed"}
    b = s.bench
    if b.target.cfg.arch != "llama":
        return {"skipped": f"peer only for llama shapes (target is {b.target.cfg.arch})"}
    ids = torch.tensor([s.prompt], device=s.device)
    n = s.p.max_new
    s.say(f"  loading the transformers {transformers.__version__} model from the same files")
    model = _load(b.target_dir, s.device, s.dtype)
    plain = s.memo.get("plain")
    ours = plain["result"].tokens if plain is not None else None
    out = {"transformers": transformers.__version__, "tokens": n,
           "plain": _decode_tok_s(model, ids, n, s.device, ours, repeats=s.p.gen_repeats)}
    s.say(f"  transformers plain: {out['plain']['tok_s']:.1f} tok/s")
    if b.draft_dir and s.left() > 0:
        draft = _load(b.draft_dir, s.device, s.dtype)
        out["assisted"] = _decode_tok_s(model, ids, n, s.device, ours, assistant_model=draft)
        out["assisted"]["note"] = "transformers' default assistant schedule (num_assistant_tokens heuristic)"
        s.say(f"  transformers assisted: {out['assisted']['tok_s']:.1f} tok/s")
        del draft
    elif b.draft_dir:
        out["assisted"] = {"skipped": "budget"}
    del model
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    if plain is not None:
        hf = Fig.from_json(out["plain"]["tok_s"], out["plain"]["tok_s_range"], out["plain"]["repeats"])
        ratio = plain["tok_s_fig"] / hf  # worst-case range over both tok/s ranges
        out["memra_plain_tok_s"] = round(plain["result"].decode_tok_s, 3)
        out["memra_over_transformers"] = round(ratio.value, 3)
        out["memra_over_transformers_range"] = ratio.rng(3)
    return out
