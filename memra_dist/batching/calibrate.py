"""--spec-k auto's first fit of a step's cost, from steps timed as the engine opens.

The goodput rule (specdec/spec_k.py `choose`) weighs each draft's expected gain against what it
adds to the step: the step's time by its rows and the drafting's own time, lines the loop fits
online from the steps it runs (`StepCost`). Before the first steps that line is a guess (1 ms a
step, 10 us a row), and drafting's is unknown (free), so the first requests' K were chosen
against costs this GPU does not have. Where the engine captures its steps' CUDA graphs at open
(graphs.py `warm`), each bucket's replay is timed there as well, and where it captures its tap
drafter's shared forwards (DFlash's block and maintenance, EAGLE-3's chains), each request
bucket's too; the lines start from those points, and each step bucket's own time (a step costs
its bucket's, spec_k.py) from its replay (weighted as the prior was, so the steps the
loop then runs take over within a few dozen steps). Recorded in the backend's stats
(`calibration`) and in one line at open. Without graphs (CPU, --graphs off) nothing is timed and
the lines start from the prior, as before.
"""

from __future__ import annotations

import time

import torch

__all__ = ["best_ns", "calibrate", "draft_points", "say", "REPS"]

REPS = 3  # replays a timing takes the best of (the first after a capture pays its lazy setup)


def best_ns(fn, device, reps: int | None = None) -> float:
    """The fastest of `reps` (default REPS) runs of `fn` (ns), each from an idle device to an idle device."""
    cuda = device.type == "cuda"
    best = float("inf")
    for _ in range(REPS if reps is None else reps):
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter_ns()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter_ns() - t)
    return float(best)


def draft_points(pool, k: int, block: int | None, device, per_request: bool = False) -> list[tuple[int, float]]:
    """(drafted tokens, ns) a shared draft forward of b requests costs, b each bucket of the draft
    pool's graphs: DFlash's block forward plus its maintenance (`block`: its block size; each
    request drafts min(k, block - 1)), EAGLE-3's round of chains (k drafts a request);
    `per_request`: (b, ns), the cost priced by drafting request (spec_k.py StepCost)."""
    g = getattr(pool, "graphs", None)
    if g is None or not hasattr(g, "timed"):
        return []
    per = 1 if per_request else min(k, block - 1) if block is not None else k
    times = g.timed(device)
    ing = pool.ingest_graphs.timed(device) if getattr(pool, "ingest_graphs", None) is not None else {}
    return [(b * per, ns + ing.get(b, 0.0)) for b, ns in sorted(times.items())]


def calibrate(cost, steps: list[tuple[int, float]], drafts: list[tuple[int, float]], seconds: float) -> dict:
    """Start `cost`'s lines from the timed points; returns what the backend records."""
    cost.calibrate(steps, drafts)
    a, b = cost.line()
    d0, d1 = cost.draft_line()
    return {"steps_timed": len(steps), "drafts_timed": len(drafts), "seconds": round(seconds, 3),
            "step_ms": round(a / 1e6, 4), "row_ms": round(b / 1e6, 5),
            "draft_ms": round(d0 / 1e6, 4) if drafts else None,
            ("draft_request_ms" if cost.per_request else "draft_token_ms"): round(d1 / 1e6, 5) if drafts else None,
            "bucket_ms": {str(k): round(v / 1e6, 4) for k, v in sorted(cost.by_bucket.items())}}


def say(rec: dict) -> str:
    """The line printed at open."""
    out = (f"--spec-k auto: the step's cost from {rec['steps_timed']} steps timed at open: "
           f"{rec['step_ms']:.2f} ms + {rec['row_ms'] * 1e3:.1f} us a row")
    if rec["drafts_timed"]:
        per = "a drafting request" if "draft_request_ms" in rec else "a draft"
        d1 = rec.get("draft_request_ms", rec.get("draft_token_ms"))
        out += f"; drafting {rec['draft_ms']:.2f} ms + {d1 * 1e3:.1f} us {per}"
    return out + f" ({rec['seconds']:.2f} s)"
