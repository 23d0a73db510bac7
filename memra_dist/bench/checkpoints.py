"""Benchmark checkpoints MADE on the machine (random weights at real shapes, never downloaded).

Tensors are drawn directly in the target dtype on the fastest device available (the GPU when
there is one), moved to the host shard by shard and written with safetensors (sharded past
SHARD_BYTES, with a HF `model.safetensors.index.json`). A cache directory keyed by the shape's
config keeps them: a second run reuses them. The tokenizer is the tiny trained BPE (the bench
feeds token ids directly; it is there so `memra-dist generate --model` works on them too).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ..env import environment

__all__ = ["SHAPES", "DRAFT_OF", "chain_perm", "HYBRID_OF", "shape_config", "bench_cache_dir", "ensure_checkpoint",
           "weight_bytes", "CKPT_VERSION", "ensure_variant"]

CKPT_VERSION = "2"  # bump when the writer changes: part of the cache key
SHARD_BYTES = 4 << 30
INIT_STD = 0.02
EMB_STD = 64.0
CHAIN_SEED = 1234
DRAFT_AGREE = 0.75

_LLAMA = dict(rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
SHAPES: dict[str, dict] = {
    # Llama-3-8B: 8.03 B parameters, 16.06 GB in bf16
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, **_LLAMA),
    # Qwen3-8B: 8.19 B parameters; q / k norms (each head RMS-normalized before rotary), head_dim 128
    "qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960),
    # Llama-3.2-1B-shaped draft (untied head, so the draft reads its full 1.5 B)
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, **_LLAMA),
    "mid": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                num_attention_heads=16, num_key_value_heads=8, **_LLAMA),
    "mid-draft": dict(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, **_LLAMA),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, **_LLAMA),
    "tiny-draft": dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, **_LLAMA),
}


def _kimi(hidden, inter, layers, kda_heads, kda_dim, heads, kv_rank, nope, rope, v, experts, top_k,
          moe_inter, vocab) -> dict:
    full = [i for i in range(1, layers + 1) if i % 4 == 0]  # 3:1 KDA:MLA, as Kimi-Linear
    return {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "kv_lora_rank": kv_rank, "q_lora_rank": None, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "v_head_dim": v, "num_experts": experts, "num_experts_per_token": top_k, "num_expert_group": 1,
            "topk_group": 1, "num_shared_experts": 1, "first_k_dense_replace": 1, "rms_norm_eps": 1e-5,
            "model_max_length": 8192, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": None, "torch_dtype": "bfloat16",
            "linear_attn_config": {"num_heads": kda_heads, "head_dim": kda_dim, "short_conv_kernel_size": 4,
                                   "kda_layers": [i for i in range(1, layers + 1) if i not in full],
                                   "full_attn_layers": full}}


# Kimi-Linear-48B-A3B widths (hidden 2304, KDA 32x128, MLA 32 heads, latent 512, 1024-wide experts,
# 163840 vocab) with fewer layers and experts, so it is written and loaded in seconds
HYBRID_SHAPES = {
    "kimi": _kimi(2304, 9216, 8, 32, 128, 32, 512, 128, 64, 128, 32, 8, 1024, 163840),
    "kimi-tiny": _kimi(32, 48, 4, 4, 8, 4, 16, 8, 8, 12, 8, 2, 16, 97),
}
DRAFT_OF = {"8b": "1b", "mid": "mid-draft", "tiny": "tiny-draft"}
_DRAFTS = set(DRAFT_OF.values())
HYBRID_OF = {"8b": "kimi", "mid": "kimi", "tiny": "kimi-tiny"}


def shape_config(name: str) -> dict:
    """The HF config.json dict of a named shape."""
    if name in HYBRID_SHAPES:
        return dict(HYBRID_SHAPES[name])
    if name not in SHAPES:
        raise KeyError(f"unknown shape '{name}' (known: {', '.join(sorted([*SHAPES, *HYBRID_SHAPES]))})")
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": None, "torch_dtype": "bfloat16",
            **SHAPES[name]}


def bench_cache_dir(override: str | None = None) -> Path:
    base = override or environment().bench_cache or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memra_dist", "bench")
    return Path(base)


def _key(cfg: dict) -> str:
    blob = json.dumps(cfg, sort_keys=True) + CKPT_VERSION
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _param_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """HF tensor name -> (shape, kept in fp32), from the engine's own module tree on `meta`."""
    from ..model.config import parse_config  # noqa: PLC0415
    from ..model.loader import FP32_KEYS, hf_name  # noqa: PLC0415
    from ..model.transformer import Stage  # noqa: PLC0415

    mcfg = parse_config(cfg, "bench")
    with torch.device("meta"):
        stage = Stage(mcfg, 0, mcfg.num_layers, True, True)
    return {hf_name(k): (tuple(v.shape), k.endswith(FP32_KEYS)) for k, v in stage.state_dict().items()}


def _draw(name: str, shape, dtype, device, gen) -> torch.Tensor:
    if name.endswith(("norm.weight", "layernorm.weight")):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(("dt_bias", "e_score_correction_bias")):
        return torch.zeros(shape, dtype=dtype, device=device)
    if name.endswith("A_log"):  # decay rates in [1, 16], as the reference initialises them
        return torch.empty(shape, dtype=dtype, device=device).uniform_(1, 16, generator=gen).log_()
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=gen)


def chain_perm(vocab: int) -> torch.Tensor:
    """P: the target's greedy next token of t is P[t] (a random permutation, fixed seed)."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(CHAIN_SEED))


def _chain_head(name: str, cfg: dict, tensors: dict, device, dtype) -> None:
    """Overwrite embed_tokens / lm_head of a llama shape with the chain structure (see above)."""
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(CHAIN_SEED + 1)
    emb = torch.randn(V, H, generator=g) * EMB_STD
    P = chain_perm(V)
    if name in _DRAFTS:  # the draft follows the chain on a DRAFT_AGREE share of tokens
        off = torch.rand(V, generator=g) >= DRAFT_AGREE
        P = torch.where(off, torch.randint(0, V, (V,), generator=g), P)
    head = torch.zeros(V, H)
    head[P] = emb * (INIT_STD / EMB_STD)  # logits of row t peak at P[t]: W[P[t]] ~ e_t
    tensors["model.embed_tokens.weight"] = emb.to(device=device, dtype=dtype)
    tensors["lm_head.weight"] = head.to(device=device, dtype=dtype)


def weight_bytes(cfg: dict, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of every weight at `dtype` (fp32-kept tensors at 4 bytes): what a dense decode step reads."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(math.prod(s) * (4 if f32 else size) for s, f32 in _param_shapes(cfg).values())


def _write(out: Path, name: str, cfg: dict, device: torch.device, dtype: torch.dtype,
           say: Callable[[str], None]) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415

    shapes = _param_shapes(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    special = {}
    if cfg.get("model_type") == "llama":
        _chain_head(name, cfg, special, device, dtype)
    shards, cur, cur_bytes = [], {}, 0
    for tname, (shape, f32) in shapes.items():
        t = special.pop(tname, None)
        if t is None:
            t = _draw(tname, shape, torch.float32 if f32 else dtype, device, gen)
        cur[tname] = t.cpu()
        cur_bytes += t.numel() * t.element_size()
        if cur_bytes >= SHARD_BYTES:
            shards.append(cur)
            cur, cur_bytes = {}, 0
    if cur:
        shards.append(cur)
    n, weight_map = len(shards), {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        say(f"  wrote shard {i + 1}/{n}")
    if n > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    try:
        from ..demo.tiny import train_tokenizer  # noqa: PLC0415 (needs `tokenizers`; the bench itself does not)
    except ImportError:
        say("  no `tokenizers` here: checkpoint written without tokenizer.json (the bench feeds ids)")
        return
    train_tokenizer(vocab_size=min(256, cfg["vocab_size"])).save(str(out / "tokenizer.json"))


def ensure_checkpoint(name: str, cache: Path, device: torch.device, say: Callable[[str], None],
                      dtype: torch.dtype = torch.bfloat16) -> Path:
    """The checkpoint directory of shape `name`, written (atomically) on first use."""
    cfg = shape_config(name)
    out = cache / f"{name}-{_key(cfg)}"
    if (out / "config.json").exists():
        say(f"checkpoint {name}: reusing {out}")
        return out
    cache.mkdir(parents=True, exist_ok=True)
    say(f"checkpoint {name}: writing random {str(dtype).removeprefix('torch.')} weights "
        f"({weight_bytes(cfg, dtype) / 1e9:.2f} GB) to {out}")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache))
    try:
        _write(tmp, name, cfg, device, dtype, say)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"checkpoint {name}: written in {time.perf_counter() - t0:.1f}s")
    return out


def ensure_variant(base: Path, overrides: dict, tag: str, say: Callable[[str], None]) -> Path:
    """A checkpoint with the weight files of `base` and its config.json fields overridden (e.g.
    a longer `max_position_embeddings`): a sibling directory `<base>-<tag>-<key>` holding the
    new config.json and links to the base's other files (hard links, else symbolic ones, else
    copies). No weight is rewritten; `base` and its cache key stay as they are, so sections
    that read it are untouched."""
    cfg = {**json.loads((base / "config.json").read_text()), **overrides}
    out = base.parent / f"{base.name}-{tag}-{_key(cfg)}"
    if (out / "config.json").exists():
        say(f"checkpoint variant {tag}: reusing {out}")
        return out
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=base.parent))
    try:
        for f in base.iterdir():
            if f.name == "config.json" or not f.is_file():
                continue
            try:
                os.link(f, tmp / f.name)
            except OSError:
                try:
                    os.symlink(f.resolve(), tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"checkpoint variant {tag}: {out} ({', '.join(f'{k}={v}' for k, v in overrides.items())}; weights linked)")
    return out
