"""Issue 45's sweep inside `memra-dist bench --sections batching`: speculation with `--spec-k
auto` (the default) against plain decoding at every concurrency, what a user serving with a
drafter gets under each load.

At 1, 2, 4, 8, 16, 32 and 64 concurrent callers on a GPU (1, 2 and 4 on CPU), each on an engine
of as many requests (a tap drafter's lone request on an engine of 2: it drafts batched only):
plain greedy (the baseline, and each request's greedy ids: the replays' recordings), n-gram on
the suite's copy-with-edits prompts, and the DFlash and EAGLE-3 replays (the bench's random
networks drafting in full, their drafts replaced by each request's plain ids corrupted at
CORRUPTS: ~0.8 of the drafts right everywhere; ~0.6 and none right at 16 and 64, CPU 4).
Every figure is a row's steady tok/s over plain's at its concurrency, with the repeats'
worst-case range; the section's rows run before it are reused where they are the same
setting. Its `rows` (plain's and the drafters', no ids) are what `plot.speedups` charts: `memra-dist
bench` writes the chart beside its JSON. Figures (bench/report.py targets, issue 45):
`tap_auto_over_plain_N` (the worse of DFlash and EAGLE-3 at ~0.8), `ngram_auto_over_plain_16`,
and `auto_never_slower` (the lowest ratio of every row, every acceptance)."""

from __future__ import annotations

from .noise import ratio_row as _ratio, runs_fig as _of

__all__ = ["CORRUPTS", "sweep", "sweep_figures", "worst"]

CORRUPTS = (0.2, 0.4, 1.0)  # ~0.8, ~0.6 and none of the drafts right
DRAFTERS = ("ngram", "dflash-replay", "eagle3-replay")


def worst(figs: list[list | None]) -> list | None:
    """The lowest of [value, lo, hi, n] figures (by value); None where there are none.

    >>> worst([[2.1, 2.0, 2.2, 3], None, [1.9, 1.7, 2.3, 3]])
    [1.9, 1.7, 2.3, 3]
    """
    have = [f for f in figs if f is not None]
    return min(have, key=lambda f: f[0]) if have else None


def sweep_figures(rows: list[dict]) -> dict:
    """The sweep's figures from its flat rows (plain's among them).

    >>> run = lambda v: {"runs": [{"steady_tok_s": v, "decode_tok_s": v}]}
    >>> rows = [{"drafter": "none", "concurrency": 16, **run(100.0)},
    ...         {"drafter": "dflash-replay", "concurrency": 16, "corrupt": 0.2, **run(180.0)},
    ...         {"drafter": "eagle3-replay", "concurrency": 16, "corrupt": 0.2, **run(170.0)},
    ...         {"drafter": "eagle3-replay", "concurrency": 16, "corrupt": 1.0, **run(98.0)},
    ...         {"drafter": "ngram", "concurrency": 16, **run(160.0)}]
    >>> f = sweep_figures(rows)
    >>> f["tap_auto_over_plain_16"][0], f["ngram_auto_over_plain_16"][0], f["auto_never_slower"][0]
    (1.7, 1.6, 0.98)
    """
    base = {r["concurrency"]: r for r in rows if r["drafter"] == "none"}
    out: dict[str, list] = {}
    every = []
    for r in rows:
        n = r["concurrency"]
        if r["drafter"] == "none" or n not in base:
            continue
        f = _ratio(_of(r, "steady_tok_s"), _of(base[n], "steady_tok_s"))  # [value, lo, hi, n]
        if f is None:
            continue
        name = r["drafter"].replace("-replay", "").replace("-", "_")
        tag = f"_c{r['corrupt']:g}" if r.get("corrupt") is not None else ""
        out[f"{name}{tag}_auto_over_plain_{n}"] = f
        every.append(f)
    for n in sorted({r["concurrency"] for r in rows}):
        w = worst([out.get(f"{d}_c0.2_auto_over_plain_{n}") for d in ("dflash", "eagle3")])
        if w is not None:
            out[f"tap_auto_over_plain_{n}"] = w
    if every:
        out["auto_never_slower"] = worst(every)
    return out


def sweep(s, run, plain: dict, plain_ids: dict, reuse: dict, draft_dirs) -> dict:
    """The section's sweep (see the module doc). `run(n, max_batch, drafter, **kw)`: one
    setting's row (bench/batching.py `concurrent` with the section's model, prompts and
    repeats); `plain` / `plain_ids`: the section's plain rows and their ids by concurrency
    (filled in here where missing); `reuse`: {(drafter, n): row} rows run already at ~0.8 with
    --spec-k auto; `draft_dirs(drafter)`: the replay's draft checkpoint."""
    cuda = s.device.type == "cuda"
    ns = (1, 2, 4, 8, 16, 32, 64) if cuda else (1, 2, 4)
    wide = (16, 64) if cuda else (4,)
    rows: list[dict] = []
    skipped: list[str] = []

    def keep(r: dict, **extra) -> dict:
        row = {k: v for k, v in r.items() if k != "ids"}
        row.update(extra)
        rows.append(row)
        return row

    for n in ns:
        if s.left() <= 0:
            skipped.append(f"{n} concurrent and more (budget)")
            break
        if str(n) not in plain:
            r = run(n, n, "none")
            plain_ids[n] = r.pop("ids")
            plain[str(n)] = r
        keep(plain[str(n)], drafter="none", concurrency=n, spec_k="fixed")
        for drafter in DRAFTERS:
            tap = drafter != "ngram"
            for c in ((CORRUPTS if n in wide else CORRUPTS[:1]) if tap else (None,)):
                if s.left() <= 0:
                    skipped.append(f"{drafter} at {n}")
                    continue
                got = reuse.get((drafter, n)) if c in (None, CORRUPTS[0]) else None
                if got is None:
                    kw = dict(draft_model=draft_dirs(drafter), recorded=plain_ids[n], corrupt=c) if tap else {}
                    got = run(n, max(n, 2), drafter, spec_k="auto", **kw)
                    ids = got.pop("ids")
                    got["ids_equal_plain"] = ids == plain_ids[n]  # lossless: every request its plain ids
                row = keep(got, drafter=drafter, concurrency=n, spec_k="auto")
                if c is not None:
                    row["corrupt"] = c
                s.say(f"  batching sweep {drafter}{'' if c is None else f' corrupt {c:g}'} x{n}: steady "
                      f"{got['steady_tok_s']} tok/s against plain's {plain[str(n)]['steady_tok_s']}")
    return {"concurrency": list(ns), "corrupts": list(CORRUPTS), "rows": rows, "skipped": skipped,
            "figures": sweep_figures(rows)}
