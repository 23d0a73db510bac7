"""The first token under load (issue 44), inside `memra-dist bench --sections batching`: N prompts
arriving together against the same tokens in one prompt alone.

16 prompts of the suite's prompt length (512 tokens on a GPU; CPU: 4 of 128) submitted together
to an engine of as many requests, with the prefix cache off (the bench's warm-up runs the timed
prompts: with the cache on they would be cached), plain and with ngram; and one prompt of all
their tokens (8,192 on a GPU) alone on the one-request engine. Figures, with the repeats'
worst-case ranges: each TTFT p50 of the N over the one prompt's TTFT (issue 44: <= 1.3x, the
same with ngram as without)."""

from __future__ import annotations

from .noise import ratio_row as _ratio, runs_fig as _of

__all__ = ["ttft_under_load"]

NEW = 8  # tokens a request generates: the first token is what is timed


def ttft_under_load(s, run) -> dict:
    """`run(n, max_batch, drafter, **kw)`: one setting's row (bench/batching.py `concurrent` with
    the section's model and repeats; `kw` its new, plen, prefix_cache)."""
    if s.left() <= 0:
        return {"skipped": "budget"}
    n = 16 if s.device.type == "cuda" else 4
    plen = s.p.ctx
    out: dict = {"requests": n, "prompt": plen, "alone_prompt": n * plen, "prefix_cache": False}
    alone = run(1, 1, "none", new=NEW, plen=n * plen)
    alone.pop("ids", None)
    out["alone"] = alone
    base = _of(alone, "ttft_ms_p50")
    for drafter in ("none", "ngram"):
        if s.left() <= 0:
            out.setdefault("skipped", []).append(drafter)
            continue
        r = run(n, n, drafter, new=NEW, plen=plen, prefix_cache=False)
        r.pop("ids", None)
        out[drafter] = r
        f = _ratio(_of(r, "ttft_ms_p50"), base)
        if f is not None:
            out[f"{'plain' if drafter == 'none' else drafter}_over_alone"] = f
    return out
