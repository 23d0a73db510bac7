"""GPU smoke + first figures: CUDA generate (eager vs graphs, fp32 ids equal) and the
8B-shape decode step vs the copy roofline. Run on the GPU machine: python benchmarks/gpu_smoke.py OUT_DIR"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from memra_dist.config import RunConfig
from memra_dist.runner import ModelRunner
from memra_dist.demo.tiny import build_checkpoint, llama_config, train_tokenizer
from memra_dist.app import generate

from memra_dist.bench.checkpoints import ensure_checkpoint  # noqa: E402

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/smoke")
out_dir.mkdir(parents=True, exist_ok=True)
res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
log = lambda *a: print("[smoke]", *a, file=sys.stderr, flush=True)  # noqa: E731
tok = train_tokenizer(vocab_size=256)
root = Path("/tmp/memra-ckpt")
root.mkdir(exist_ok=True)
shapes = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "mid": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4),
}
for name, shp in shapes.items():
    if not (root / name / "config.json").exists():
        build_checkpoint(root / name, llama_config(32000 if name == "mid" else 256, **shp), tok, seed=0)
prompt = list(range(3, 40)) * 2

# 1. CUDA generate: eager vs graphs, fp32, identical ids
ids = {}
for g in ("off", "on"):
    cfg = RunConfig(model=str(root / "tiny"), drafter="ngram", max_new_tokens=48, device="cuda", dtype="fp32", graphs=g)
    r = generate(cfg, prompt)
    ids[g] = r.token_ids
    res[f"tiny_fp32_graphs_{g}"] = r.stats
res["graphs_equal_eager_fp32"] = ids["on"] == ids["off"]
log("graphs==eager", res["graphs_equal_eager_fp32"])


# (trace-level cost: `memra-dist bench --sections trace` keeps the model loaded across runs;
# timing whole generate calls here reloaded it inside every timed run)

# 3. copy bandwidth and an 8B-shape decode step (random bf16 weights, made here)
n = 1 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20):
    b.copy_(a)
torch.cuda.synchronize()
bw = 2 * n * 20 / (time.perf_counter() - t)  # read + write bytes/s
res["copy_bw_TBps"] = bw / 1e12
del a, b
log("copy bw TB/s", res["copy_bw_TBps"])
if os.environ.get("SMOKE_8B", "1") == "1":
    t8 = time.perf_counter()
    big = ensure_checkpoint("8b", root, torch.device("cuda"), log)
    res["make_8b_s"] = time.perf_counter() - t8
    for g in (True, False):
        t = time.perf_counter()
        r = ModelRunner(str(big), torch.device("cuda"), torch.bfloat16, max_pos=2048, graphs=g)
        res["load_8b_s"] = time.perf_counter() - t
        wbytes = sum(p.numel() * p.element_size() for p in r.stage.parameters())
        r.alloc(2048)
        x = torch.tensor(prompt)
        r.forward(x, 0)
        steps = {}
        for rows in (1, 3, 5, 9):
            ids1 = torch.randint(0, 1000, (rows,))
            for _ in range(3):
                r.forward(ids1, len(prompt)); r.rollback(len(prompt))
            torch.cuda.synchronize()
            reps = 50
            t = time.perf_counter()
            for _ in range(reps):
                r.forward(ids1, len(prompt)); r.rollback(len(prompt))
            torch.cuda.synchronize()
            steps[rows] = (time.perf_counter() - t) / reps
        key = "graphs" if g else "eager"
        res[f"8b_{key}"] = {"weight_GB": wbytes / 1e9, "step_ms": {k: v * 1e3 for k, v in steps.items()},
                            "decode_tok_s": 1 / steps[1], "roofline_tok_s": bw / wbytes,
                            "pct_roofline": 100 * (1 / steps[1]) / (bw / wbytes),
                            "verify5_over_decode": steps[5] / steps[1], "verify3_over_decode": steps[3] / steps[1]}
        log(key, res[f"8b_{key}"])
        del r
        torch.cuda.empty_cache()
(out_dir / "smoke.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res, indent=1))
