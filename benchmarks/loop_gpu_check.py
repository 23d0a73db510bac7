"""The engine on a GPU's fast path against its reference, per family and drafter, in fp32.

For each family of memra_dist/bench/tiny_families.py (tiny random checkpoints saved by
transformers: llama, qwen2, qwen3, kimi_linear, deepseek_v3, glm4_moe) and each drafter it
takes (none, ngram, model, dflash, eagle3; mtp where it has MTP layers), greedy (or sampled,
`--temperature`: every path seeded alike draws the same drafts and acceptances), fixed K:

  reference  `--kernels off --graphs off`: every request alone, torch's eager ops
  alone      the default flags, every request alone (a GPU runs our kernels and CUDA graphs:
             the engine loop, or the solo engine where the loop's steps would run eager)
  batched    the default flags, the four requests at once on an engine of --max-batch 4

Every run's ids must equal the reference's (exit 1 otherwise: a fast path that is not lossless).
Each row also says which engine ran the request alone (`loop` / `solo`) and the batched
engine's counts (graph replays, eager steps, chained rounds, shared draft forwards), so a row
that checked a path other than the one meant reads as such. fp32 keeps near-ties of a random
model from flipping an argmax between two correct paths; a mismatch prints the first token
that differs.

    python benchmarks/loop_gpu_check.py OUT_DIR [--device cuda] [--families llama,qwen3]
        [--drafters none,model] [--dtype fp32] [--new 40] [--k 3] [--temperature 0.8 --top-k 50]

Writes OUT_DIR/loop_gpu_check.json and prints a line a row (~2-4 min for every family on one
H100, most of it kernel JIT and graph capture; `--device cpu` runs the same comparison on the
CPU, where every path is the loop's eager one)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [[5 + (i * 7 + j * 3) % 100 for j in range(9 + 5 * i)] for i in range(4)]


def _first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where the two id lists differ (a length difference counts), else None.

    >>> _first_diff([1, 2, 3], [1, 2, 3]), _first_diff([1, 2, 3], [1, 4, 3]), _first_diff([1], [1, 2])
    (None, 1, 1)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _row(fam: dict, arch: str, drafter: str, a) -> dict:
    from memra_dist.app import open_engine  # noqa: PLC0415
    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.specdec.sampling import SamplingParams  # noqa: PLC0415

    draft = {"model": fam["draft"], "dflash": fam["dflash"], "eagle3": fam["eagle3"]}.get(drafter)

    def cfg(**kw):
        if a.temperature > 0:  # every request's generator seeded alike on every path
            kw.update(sampling=SamplingParams(temperature=a.temperature, top_k=a.top_k), seed=7)
        return RunConfig(model=str(fam["target"]), drafter=drafter, draft_model=str(draft) if draft else None,
                         k=a.k, device=a.device, dtype=a.dtype, max_new_tokens=a.new, spec_k="fixed", **kw)

    ref_cfg = cfg(kernels="off", graphs="off")
    with open_engine(ref_cfg, capacity=256) as eng:
        ref = [eng.generate(p, ref_cfg).token_ids for p in PROMPTS]
    with open_engine(cfg(), capacity=256) as eng:
        engine = "loop" if type(eng._backend).__name__ == "BatchedBackend" else "solo"
        alone = [eng.generate(p, cfg()).token_ids for p in PROMPTS]
    with open_engine(cfg(), capacity=256, max_batch=len(PROMPTS)) as eng:
        got: dict[int, list[int]] = {}
        errs: list[BaseException] = []

        def one(i):
            try:
                got[i] = eng.generate(PROMPTS[i], cfg()).token_ids
            except BaseException as e:  # noqa: BLE001 (reported in the row)
                errs.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        st = eng._backend.stats() if hasattr(eng._backend, "stats") else {}
    if errs:
        raise errs[0]
    batched = [got[i] for i in range(len(PROMPTS))]
    row = {"family": arch, "drafter": drafter, "alone_engine": engine,
           "alone_equal": alone == ref, "batched_equal": batched == ref,
           "counts": {k: st.get(k) for k in ("graphs", "eager_steps", "chained_rounds", "draft_batches", "draft_graphs")}}
    for name, runs in (("alone", alone), ("batched", batched)):
        diffs = [(i, _first_diff(r, x)) for i, (r, x) in enumerate(zip(ref, runs)) if r != x]
        if diffs:
            row[f"{name}_first_diff"] = diffs  # (request, first index that differs)
    return row


def main(argv: list[str] | None = None) -> int:
    from memra_dist.bench.tiny_families import DRAFTERS, FAMILIES  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory for loop_gpu_check.json")
    ap.add_argument("--device", default="cuda", help="cuda (the fast path checked) or cpu")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families (default: all)")
    ap.add_argument("--drafters", default=None, help="comma-separated drafters (default: each family's own)")
    ap.add_argument("--dtype", default="fp32", help="fp32 (default: no near-tie flips between two correct paths) or "
                    "bf16 (what a GPU serves: the MoE FFNs in their grouped form, so glm4_moe's and deepseek_v3's "
                    "steps and MTP rounds replay graphs; a random model's near-ties may then differ)")
    ap.add_argument("--new", type=int, default=40, help="tokens each request generates (default 40)")
    ap.add_argument("--k", type=int, default=3, help="drafts a round, fixed (default 3)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled requests at this temperature (seeded "
                    "alike on every path: the drafts' and the acceptance's draws are the same, so the ids must be "
                    "too; default 0, greedy)")
    ap.add_argument("--top-k", type=int, default=0, help="with --temperature: the requests' top-k (default 0, off)")
    a = ap.parse_args(argv)
    fams = [f.strip() for f in a.families.split(",") if f.strip()]
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        print(f"loop_gpu_check: unknown family {bad[0]!r} (one of {', '.join(FAMILIES)})", file=sys.stderr)
        return 2
    want = None if a.drafters is None else {d.strip() for d in a.drafters.split(",") if d.strip()}
    from memra_dist.bench.tiny_families import build_family  # noqa: PLC0415

    a.out.mkdir(parents=True, exist_ok=True)
    root = a.out / "checkpoints"
    rows, failed = [], 0
    for arch in fams:
        fam = build_family(arch, root / arch)
        for drafter in DRAFTERS[arch]:
            if want is not None and drafter not in want:
                continue
            t = time.perf_counter()
            try:
                row = _row(fam, arch, drafter, a)
            except Exception as e:  # noqa: BLE001 (a row that raised is a failed row; the others still run)
                row = {"family": arch, "drafter": drafter, "error": f"{type(e).__name__}: {e}"}
            row["s"] = round(time.perf_counter() - t, 1)
            ok = row.get("alone_equal") and row.get("batched_equal")
            failed += not ok
            rows.append(row)
            print(("ok  " if ok else "FAIL"), json.dumps(row, default=str), flush=True)
            (a.out / "loop_gpu_check.json").write_text(json.dumps(rows, indent=1, default=str))
    print(f"loop_gpu_check: {len(rows) - failed} of {len(rows)} rows equal their reference", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
