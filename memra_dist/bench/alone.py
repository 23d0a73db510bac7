"""A request alone on the solo engine and on the engine loop (issue 44: "a request alone is a batch
of one"), inside `memra-dist bench --sections batching`.

One request with each drafter (plain, n-gram on the suite's copy-with-edits prompt, the DFlash
and EAGLE-3 replays at ~0.8 of their drafts right, their networks drafting in full), on the
one-request engine (what `generate` opens) and as the only request of an engine of two (what
`serve --max-batch N` gives a request alone), `--spec-k auto` (the default) on both. Figures:
`{drafter}_loop_over_solo`, steady tok/s on the loop over the solo engine's, with the repeats'
worst-case ranges (report target: >= 0.98 each, the loop may replace the solo engine only where
a request alone loses nothing). Measured on an H100 with `benchmarks/batching.py` (fixed K):
plain 0.992, n-gram 0.996, DFlash 0.952, EAGLE-3 0.899 (BENCHMARKS.md). The rows the section
ran already at these settings (plain alone; the sweep's n-gram and replays at 1, on an engine of
2) are reused: four more engines, not eight."""

from __future__ import annotations

from .noise import ratio_row as _ratio, runs_fig as _of

__all__ = ["alone", "DRAFTERS"]

DRAFTERS = ("none", "ngram", "dflash-replay", "eagle3-replay")
CORRUPT = 0.2  # the replays' ~0.8 of the drafts right


def alone(s, run, plain_ids: list[int], draft_dir, reuse: dict | None = None) -> dict:
    """`run(n, max_batch, drafter, **kw)`: one setting's row (bench/batching.py `concurrent` with
    the section's model, prompt and repeats); `plain_ids`: the lone request's plain greedy ids
    (the replays' recording, and their lossless check); `draft_dir(drafter)`: the replay's draft
    checkpoint; `reuse`: {(drafter, max_batch): row} of one request run already at these settings
    (the section's plain row, the sweep's rows at 1), taken instead of running them again."""
    reuse = reuse or {}
    out: dict = {}
    for d in DRAFTERS:
        if s.left() <= 0:
            out.setdefault("skipped", []).append(d)
            continue
        kw = dict(draft_model=draft_dir(d), recorded=[plain_ids], corrupt=CORRUPT) if d.endswith("-replay") else {}
        rows = {}
        for engine, max_batch in (("solo", 1), ("loop", 2)):
            r = dict(reuse[(d, max_batch)]) if (d, max_batch) in reuse else run(1, max_batch, d, spec_k="auto", **kw)
            ids = r.pop("ids", [None])[0]
            if kw and ids is not None:  # (a reused row has its own)
                r["ids_equal_plain"] = ids == plain_ids
            rows[engine] = r
        name = "plain" if d == "none" else d.replace("-replay", "")
        out[name] = rows
        f = _ratio(_of(rows["loop"], "steady_tok_s"), _of(rows["solo"], "steady_tok_s"))
        if f is not None:
            out[f"{name}_loop_over_solo"] = f
    return out
