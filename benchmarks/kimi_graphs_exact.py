"""Is the captured kimi step exact? fp32 on CUDA, the tiny kimi_linear (KDA reference scan,
MLA, MoE forced onto the grouped form so the stage is capturable): one runner, greedy ids
with its graphs on and off, plain and replay K=4 (partial accepts: rollbacks between captured
steps). Then the bench's bf16 hybrid: max |logit difference| of graphed vs eager forwards over
the same rows (a random bf16 model's greedy ids are decided by rounding noise).
usage: python benchmarks/kimi_graphs_exact.py OUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint
from memra_dist.engine import ModelRunner
from memra_dist.model.moe import MoE
from memra_dist.spec.drafters.none import NoDrafter
from memra_dist.spec.drafters.replay import ReplayDrafter
from memra_dist.spec.sampling import SamplingParams
from memra_dist.spec.session import SpecSession

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
out.mkdir(parents=True, exist_ok=True)
dev, res = torch.device("cuda"), {}


def gen(r, drafter, prompt, k=1, n=40):
    s = SpecSession(r, drafter, SamplingParams(), torch.Generator().manual_seed(0), k)
    ids = [s.start(prompt, n, 256)]
    while not s.done:
        ids.extend(s.burst(8))
    return ids, s.stats.as_dict()


def toggled(r, fn):
    g = r.graphs
    a = fn()
    r.graphs = None
    try:
        b = fn()
    finally:
        r.graphs = g
    return a, b


ORIG = MoE.use_grouped
try:
    MoE.use_grouped = lambda self, on: setattr(self.experts, "grouped", True)  # fp32 too, for this check
    tiny = ensure_checkpoint("kimi-tiny", bench_cache_dir(), dev, print)
    r = ModelRunner(str(tiny), dev, torch.float32, max_pos=256, graphs=True, warm_rows=9)
    r.alloc(256)
    res["tiny_graphs_active"] = r.graphs is not None and sorted(r.graphs.graphs)
    prompt = [(7 * i) % 90 + 3 for i in range(20)]
    (gp, _), (ep, _) = toggled(r, lambda: gen(r, NoDrafter(), prompt))
    res["tiny_fp32_plain_graphs_eq_eager"] = gp == ep
    (gr, st), (er, _) = toggled(r, lambda: gen(r, ReplayDrafter(gp, len(prompt), r.cfg.vocab_size, 0.3, seed=3), prompt, 4))
    res["tiny_fp32_replay_graphs_eq_plain"], res["tiny_fp32_replay_eager_eq_plain"] = gr == gp, er == ep
    res["tiny_replay_stats"] = st
except Exception as e:
    res["tiny_error"] = repr(e)[:500]
print(res, flush=True)
MoE.use_grouped = ORIG  # back to the class's own (bf16 CUDA: grouped)
try:
    big = ensure_checkpoint("kimi", bench_cache_dir(), dev, print)
    r = ModelRunner(str(big), dev, torch.bfloat16, max_pos=256, graphs=True, warm_rows=9)
    r.alloc(256)
    prompt = torch.tensor([(7 * i) % 1000 + 3 for i in range(30)])
    steps = [torch.tensor([11]), torch.tensor([12]), torch.tensor([13, 14, 15, 16, 17]), torch.tensor([18])]

    def run():
        r.alloc(256)
        outs = [r.forward(prompt, 0)[-1:].float()]
        pos = 30
        for i, ids in enumerate(steps):
            outs.append(r.forward(ids, pos).float())
            pos += ids.shape[0]
            if i == 2:
                r.rollback(pos - 3)  # keep 2 of the 5 verify rows
                pos -= 3
        torch.cuda.synchronize()
        return outs

    a, b = toggled(r, run)
    res["big_bf16_logit_maxdiff"] = [float((x - y).abs().max()) for x, y in zip(a, b)]
    res["big_bf16_logit_absmax"] = [float(y.abs().max()) for y in b]
    res["big_bf16_argmax_equal"] = [bool((x.argmax(-1) == y.argmax(-1)).all()) for x, y in zip(a, b)]
except Exception as e:
    res["big_error"] = repr(e)[:500]
print(res, flush=True)
(out / "kimi_graphs_exact.json").write_text(json.dumps(res, indent=1))
