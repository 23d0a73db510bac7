"""Make a Llama-3-8B-shaped bf16 checkpoint with random weights on the GPU machine."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from memra_dist.model.tiny import llama_config


def make_8b(big: Path, tok) -> float:
    """A Llama-3-8B-shaped bf16 checkpoint with random weights, sharded (~4 GB shards)."""
    if (big / "config.json").exists():
        return 0.0
    t = time.perf_counter()
    cfg8 = llama_config(128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, torch_dtype="bfloat16",
                        max_position_embeddings=8192, rope_theta=500000.0)
    from memra_dist.model.config import parse_config
    from memra_dist.model.loader import hf_name
    from memra_dist.model.transformer import Stage
    from safetensors.torch import save_file
    mc = parse_config(cfg8)
    with torch.device("meta"):
        st = Stage(mc, 0, 32, True, True)
    big.mkdir(parents=True, exist_ok=True)
    shard, idx, size, k = {}, {}, 0, 0
    def flush():
        nonlocal shard, size, k
        if shard:
            fn = f"model-{k:05d}.safetensors"; save_file(shard, str(big / fn), metadata={"format": "pt"})
            for key in shard: idx[key] = fn
            shard, size, k = {}, 0, k + 1
    for key, m in st.state_dict().items():
        tt = (torch.randn(m.shape, device="cuda", dtype=torch.bfloat16) * 0.02).cpu() if m.dim() >= 2 else torch.ones(m.shape, dtype=torch.bfloat16)
        shard[hf_name(key)] = tt; size += tt.numel() * 2
        if size > 4e9:
            flush()
    flush()
    (big / "model.safetensors.index.json").write_text(json.dumps({"weight_map": idx}))
    (big / "config.json").write_text(json.dumps(cfg8))
    tok.save(str(big / "tokenizer.json"))
    return time.perf_counter() - t


if __name__ == "__main__":
    from memra_dist.model.tiny import train_tokenizer

    print(make_8b(Path(sys.argv[1]), train_tokenizer(vocab_size=256)))
