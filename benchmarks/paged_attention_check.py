"""kernels/paged_attention.py on CUDA: a batched step's attention over the paged pool, timed
per launch setting, on the 8B shape's heads (32 query heads, 8 KV heads, 128 dims), bf16.

A step of n requests, each with `rows` decode / verify rows at a context of `ctx` positions,
blocks of 16 slots scattered over the pool (a shuffled block table, as a pool that has served
a while hands them out). The rows are padded to the batched graphs' bucket (graphs.py
`bucket_rows`), with one segment slot a row as the graphs pack them. Per setting:
  segments   the grid's request slots: T (every padded slot, as the graphs launch it) or n
  chunks     the chunks each request's live length is split over (default: the capacity's)
  warps / stages
each launch (partials + merge) timed in one CUDA graph of 20 launches, its output checked
against the default setting's. The KV bytes a launch must read give an effective TB/s.

    python benchmarks/paged_attention_check.py OUT_DIR [--ctx 600] [--cases 16x1,16x5,64x1,64x5]
Results: OUT_DIR/paged_attention_check.json and a table on stdout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NH, NKV, HD, BLOCK, REPS = 32, 8, 128, 16, 20


def case(n: int, rows: int, ctx: int, settings: list[dict]) -> list[dict]:
    import torch

    from memra_dist.batching.graphs import bucket_rows, row_class
    from memra_dist.bench.timing import capture_graph, graph_replay_ms
    from memra_dist.kernels.paged_attention import paged_attention

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(n * 100 + rows)
    cap = ctx + rows + 8
    per = -(-cap // BLOCK)
    nblocks = n * per + 1
    perm = torch.randperm(nblocks - 1, generator=g)  # block ids scattered over the pool
    kp = torch.randn(nblocks * BLOCK, NKV, HD, generator=g).to(dev, torch.bfloat16)
    vp = torch.randn(nblocks * BLOCK, NKV, HD, generator=g).to(dev, torch.bfloat16)
    T = bucket_rows(n * rows)
    q = torch.randn(T, NH, HD, generator=g).to(dev, torch.bfloat16)
    pos, lo, nr = [0] * T, [0] * T, [0] * T
    table = torch.zeros(T, per, dtype=torch.int32)
    for s in range(n):
        lo[s], nr[s] = s * rows, rows
        pos[s * rows:(s + 1) * rows] = range(ctx - rows, ctx)
        table[s] = perm[s * per:(s + 1) * per].to(torch.int32)
    pos_d = torch.tensor(pos, device=dev)
    lo_d, nr_d = (torch.tensor(x, dtype=torch.int32, device=dev) for x in (lo, nr))
    table_d = table.to(dev)
    rclass = row_class(rows)
    kv_bytes = n * ctx * NKV * HD * 2 * 2  # each request's keys and values, read once
    out, ref = [], None
    for st in settings:
        kw = {k: v for k, v in st.items() if k != "segments"}
        seg = n if st.get("segments") == "n" else T

        def launch(seg=seg, kw=kw):
            return paged_attention(q, kp, vp, pos_d, lo_d, nr_d, table_d, BLOCK, rclass, cap, segments=seg, **kw)
        try:
            o = launch()[: n * rows].float()
            if ref is None:
                ref = o
            err = float((o - ref).abs().max())

            def run(launch=launch):
                for _ in range(REPS):
                    launch()
            us = graph_replay_ms(capture_graph(run, warmup=1), 10) / REPS * 1e3
        except Exception as e:  # noqa: BLE001 (a setting that does not compile: reported, the rest go on)
            out.append({**st, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            continue
        r = {"n": n, "rows": rows, "ctx": ctx, "T": T, **st, "us": round(us, 2),
             "TB_s": round(kv_bytes / (us * 1e-6) / 1e12, 3), "max_err": err}
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--ctx", type=int, default=600)
    ap.add_argument("--cases", default="16x1,16x5,64x1,64x5")
    a = ap.parse_args()
    settings = [{}, {"segments": "n"}]
    settings += [{"segments": "n", "n_chunks": c} for c in (1, 2, 3, 4, 6)]
    settings += [{"segments": "n", "n_chunks": c, "num_warps": w, "num_stages": s}
                 for c in (2, 4) for w in (4, 8) for s in (2, 3, 4)]
    res = []
    for c in a.cases.split(","):
        n, rows = (int(x) for x in c.split("x"))
        res += case(n, rows, a.ctx, settings)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_attention_check.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
