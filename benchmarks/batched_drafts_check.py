"""Batched DFlash and EAGLE-3 on the GPU against solo: the shared draft forward's drafts left on
the device for the next verify (batching/step_forward.py `DraftPatch`, in the graphed step) give
every request its solo ids, and so do the next drafts made before the verify's readback (the
acceptance found on the device: chain_drafts.py `draft_early`) and the next verify launched
then, its rows moved on the device by that acceptance (batching/verify_ahead.py).

The demo's trained tiny target and its trained drafters (real acceptance: DFlash ~0.93 of the
drafts on average, so a wrong draft reaching the verify, or a host that accepts drafts other
than those the device verified, would change the ids), twelve corpus prompts of different
lengths and budgets, K 15 for DFlash and 4 for EAGLE-3, fixed. For each drafter and dtype: each
request alone on a solo engine, then all twelve at once on engines of --max-batch 4 and 16,
with the drafts made before the readback, left on the device, and the next verify launched
before the readback too (the drafter's `drafts_early`, `defers` and `verifies_ahead`: the
default; batching/verify_ahead.py), the same without the verify ahead, the drafts made after
the readback and left on the device (drafts_early off), and read back before the verify (all
off). Every batched run must give each request its solo ids (exit 1 otherwise); on CUDA the
deferred runs must have patched drafts into a step (EAGLE-3's: where drafted early), the early
ones drafted rounds early and
the ahead ones launched verifies ahead (else the check checked nothing: exit 1).

    python benchmarks/batched_drafts_check.py OUT_DIR [--device cuda|cpu] [--drafters dflash,eagle3]
        [--dtypes fp32,bf16] [--max-batch 4,16] [--sampled]

`--sampled` adds a sampled arm a drafter and dtype (every request at temperature 0.8 with its own
seed, against its solo sampled ids; DFlash's must draft on the shared forward's graph on CUDA).
Writes OUT_DIR/batched_drafts_check.json and prints a line a run (~3 min a drafter on one H200,
most of it the first compiles; the demo's checkpoints are trained first where the cache lacks
them)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--drafters", default="dflash,eagle3", help="comma-separated drafters to check (default dflash,eagle3)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated dtypes to check (default fp32,bf16)")
    ap.add_argument("--max-batch", default="4,16", help="comma-separated engine sizes to check (default 4,16)")
    ap.add_argument("--sampled", action="store_true", help="also each drafter's sampled arm: every request at "
                    "temperature 0.8, top-k 20, its own seed, against its solo sampled ids; a DFlash arm on CUDA "
                    "must draft on the shared forward's graph (no eager shared forward)")
    a = ap.parse_args()
    import torch
    from tokenizers import Tokenizer

    import memra_dist.batching.step_forward as sf
    from memra_dist.app import open_engine
    from memra_dist.config import RunConfig
    from memra_dist.demo.corpus import CORPUS
    from memra_dist.demo.tiny import demo_checkpoints
    from memra_dist.demo.tiny_dflash import demo_dflash_dir
    from memra_dist.demo.tiny_eagle3 import demo_eagle3_dir
    from memra_dist.specdec.drafters.dflash import DFlashDrafter
    from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter

    if a.device == "cuda" and not torch.cuda.is_available():
        print("batched_drafts_check: no CUDA device", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    say = lambda s: print(f"[check] {s}", file=sys.stderr)  # noqa: E731
    target, _ = demo_checkpoints(say)
    kinds = {"dflash": (DFlashDrafter, demo_dflash_dir, 15), "eagle3": (Eagle3Drafter, demo_eagle3_dir, 4)}
    wanted = a.drafters.split(",")
    if any(d not in kinds for d in wanted):
        print(f"batched_drafts_check: --drafters takes {', '.join(kinds)} (got {a.drafters})", file=sys.stderr)
        return 2
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    paras = [p for p in CORPUS.split("\n\n") if len(p) > 80]
    reqs = []
    for i in range(12):
        ids = tok.encode(paras[i % len(paras)]).ids
        reqs.append((ids[:8 + (i * 7) % max(1, len(ids) // 2)], 24 + (i * 5) % 40))
    patched = [0]
    real = sf.DraftPatch.apply

    def counted(self, ids):
        patched[0] += 1
        return real(self, ids)

    sf.DraftPatch.apply = counted

    def cfg(dtype, **kw):
        cls, ddir, k = kinds[drafter]
        return RunConfig(model=str(target), drafter=drafter, draft_model=str(ddir(target, say)), device=a.device,
                         dtype=dtype, spec_k="fixed", k=k, **kw)

    from memra_dist.specdec.sampling import SamplingParams

    def own(i, sampled):  # a request's sampling: greedy, or its own seed
        return dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=i) if sampled else {}

    import memra_dist.specdec.drafters.dflash_batch as db

    eager, real_pooled = [0], db._pooled

    def pooled(*args, **kw):  # the eager shared DFlash forward (the graph path never builds it)
        eager[0] += 1
        return real_pooled(*args, **kw)

    db._pooled = pooled

    def batched(dtype, mb, sampled=False):
        got, errs, st = {}, [], {}
        with open_engine(cfg(dtype), max_batch=mb) as eng:
            def one(i, p, n):
                try:
                    got[i] = eng.generate(p, cfg(dtype, max_new_tokens=n, **own(i, sampled))).token_ids
                except BaseException as e:  # noqa: BLE001
                    errs.append(repr(e))
            ts = [threading.Thread(target=one, args=(i, p, n)) for i, (p, n) in enumerate(reqs)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(600)
            st = eng.batch_stats() or {}
        return [got.get(i) for i in range(len(reqs))], errs, st

    rows, ok = [], True
    for drafter, dtype in ((d, t) for d in wanted for t in a.dtypes.split(",")):
        cls = kinds[drafter][0]
        with open_engine(cfg(dtype)) as eng:
            solo, acc = [], []
            for p, n in reqs:
                r = eng.generate(p, cfg(dtype, max_new_tokens=n))
                solo.append(r.token_ids)
                acc.append(r.stats.get("acceptance", 0.0))
        for defers, early, ahead in ((True, True, True), (True, True, False), (True, False, False),
                                     (False, False, False)):
            cls.defers, cls.drafts_early, cls.verifies_ahead = defers, early, ahead
            for mb in (int(x) for x in a.max_batch.split(",")):
                patched[0] = 0
                t0 = time.perf_counter()
                got, errs, st = batched(dtype, mb)
                same = sum(g == s for g, s in zip(got, solo))
                drafted_early, went = st.get("early_drafted_rounds", 0), st.get("ahead_verify_steps", 0)
                row = dict(drafter=drafter, dtype=dtype, defers=defers, early=early, ahead=ahead, max_batch=mb,
                           same=same, requests=len(reqs), steps_patched=patched[0],
                           early_drafted_rounds=drafted_early, ahead_verify_steps=went, steps=st.get("steps", 0),
                           errors=errs[:2], solo_acceptance=round(sum(acc) / len(acc), 3),
                           seconds=round(time.perf_counter() - t0, 1))
                cuda = a.device == "cuda"
                # (EAGLE-3's drafts stay on the device only where made early; DFlash's shared forward's always)
                patches = defers and (early or drafter == "dflash")
                bad = (same != len(reqs) or errs or (patches and cuda and not patched[0])
                       or (early and cuda and not drafted_early) or (not early and drafted_early)
                       or (ahead and cuda and not went) or (not ahead and went))
                ok = ok and not bad
                rows.append(row)
                print(("ok  " if not bad else "BAD ") + json.dumps(row), flush=True)
        cls.defers = cls.drafts_early = cls.verifies_ahead = True
        if a.sampled:  # each request sampled with its own seed, the default path, against its solo sampled ids
            with open_engine(cfg(dtype)) as eng:
                solo = [eng.generate(p, cfg(dtype, max_new_tokens=n, **own(i, True))).token_ids
                        for i, (p, n) in enumerate(reqs)]
            for mb in (int(x) for x in a.max_batch.split(",")):
                eager[0] = 0
                got, errs, st = batched(dtype, mb, sampled=True)
                same = sum(g == s for g, s in zip(got, solo))
                row = dict(drafter=drafter, dtype=dtype, sampled=True, max_batch=mb, same=same, requests=len(reqs),
                           eager_shared_forwards=eager[0], draft_batches=st.get("draft_batches", 0), errors=errs[:2])
                bad = same != len(reqs) or errs or (drafter == "dflash" and a.device == "cuda" and eager[0] > 0)
                ok = ok and not bad
                rows.append(row)
                print(("ok  " if not bad else "BAD ") + json.dumps(row), flush=True)
    (a.out / "batched_drafts_check.json").write_text(json.dumps({"ok": ok, "runs": rows}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
