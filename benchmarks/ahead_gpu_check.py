"""Correctness of the one-ahead paths on a real GPU (run it first in a GPU session, ~1-2 min):
plain greedy decoding one step ahead at trace levels 0, 1 and 2 (CUDA graphs, timing events,
the level-2 twin's device-clock stamps) and, with two GPUs, through the pipeline head at pp=2.

For a tiny fp32 llama (greedy, drafter none, 64 new tokens):
  eager ids (--graphs off) == graphed ids at levels 0, 1, 2;  fast_path.ahead at every level;
  levels 1 and 2: the share table counts every round one step ahead, verify > 0; level 2: the sub-split's buckets are > 0 and their sum is at most verify;
  two GPUs: pp=2 ids == pp=1 ids and fast_path.ahead.
usage: python benchmarks/ahead_gpu_check.py OUT_DIR [--device cuda|cpu]   (cpu: a smoke run of
the script itself; nothing runs ahead there). Exit 1 on a failed check; OUT_DIR/ahead_check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from memra_dist.app import generate
from memra_dist.config import RunConfig
from memra_dist.demo.tiny import build_checkpoint, llama_config, train_tokenizer
from memra_dist.phase.levels import TraceSettings
from memra_dist.phase.share import ShareTable

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-llama"
    if not (model / "config.json").exists():
        tok = train_tokenizer(vocab_size=256)
        build_checkpoint(model, llama_config(256, **SHAPE), tok, seed=0)
    prompt = list(range(3, 40)) * 2
    base = dict(model=str(model), drafter="none", max_new_tokens=64, device=a.device, dtype="fp32")
    res: dict = {"device": a.device, "checks": {}}
    fails: list[str] = []

    def check(name: str, ok: bool, detail=None) -> None:
        res["checks"][name] = {"ok": bool(ok), **({"detail": detail} if detail is not None else {})}
        if not ok:
            fails.append(name)
        print(f"[ahead_check] {'ok  ' if ok else 'FAIL'} {name}" + (f" {detail}" if detail is not None else ""),
              file=sys.stderr, flush=True)

    cuda = a.device == "cuda"
    eager = generate(RunConfig(**base, graphs="off"), prompt)
    for level in (0, 1, 2):
        share = ShareTable()  # the traced rounds, summed as the terminal's table sums them
        got = generate(RunConfig(**base, trace=TraceSettings(level=level)), prompt, sink=share if level else None)
        check(f"level{level}: ids equal eager", got.token_ids == eager.token_ids)
        if level == 0:
            level0 = got.token_ids
        else:
            check(f"level{level}: ids equal level 0", got.token_ids == level0)
        check(f"level{level}: ran ahead", got.stats["fast_path"]["ahead"] == cuda, got.stats["fast_path"])
        if level:
            rounds = (share.n_rounds, share.ahead_rounds)
            check(f"level{level}: every round one step ahead", share.n_rounds > 0 and
                  (share.ahead_rounds == share.n_rounds) == cuda, rounds)
            verify = share.ns[1]
            check(f"level{level}: verify > 0", verify > 0, verify)
            if level == 2:
                attn, ffn = share.sub.get("attn", 0), share.sub.get("ffn", 0)
                check("level2: attn and ffn laps > 0, within verify", attn > 0 and ffn > 0 and attn + ffn <= verify,
                      {"attn": attn, "ffn": ffn, "verify": verify})
    if cuda and torch.cuda.device_count() >= 2:
        one = generate(RunConfig(**base), prompt)
        two = generate(RunConfig(**base, pp=2), prompt)
        check("pp2: ids equal pp1", two.token_ids == one.token_ids)
        check("pp2: ran ahead", two.stats["fast_path"]["ahead"], two.stats["fast_path"])
        res["pp_tok_per_s"] = {"pp1": one.stats["tok_per_s"], "pp2": two.stats["tok_per_s"]}
    res["failed"] = fails
    (out / "ahead_check.json").write_text(json.dumps(res, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
