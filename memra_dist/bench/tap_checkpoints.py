"""Checkpoints for the tap drafters' benchmark (benchmarks/tap_drafters.py), made on the machine
with random bf16 weights at real shapes, never downloaded:

  a DFlash drafter over the bench's Llama target (the public Llama-3.1-8B DFlash layout:
    5 layers, hidden 4096, 32 / 8 heads, head_dim 128, intermediate 14336, block 16,
    taps [1, 8, 15, 22, 29]), cached BESIDE the target checkpoint;
  an EAGLE-3 head over the same target (the public Llama-3.1-8B EAGLE-3 layout: one decoder
    layer, hidden 4096, 32 / 8 heads, head_dim 128, intermediate 14336, a 32000-token draft
    vocabulary with its d2t / t2d maps, the target's embedding reused, the default taps
    (1, 15, 28)), cached beside it too;
  a DeepSeek-V3-shaped slice with one MTP layer: real widths (hidden 7168, MLA q_lora 1536 /
    kv_lora 512 / nope 128 / rope 64 / v 128 over 128 heads, 256 routed experts top-8 in
    8 groups of which 4 are kept, 1 shared expert, moe_intermediate 2048, dense intermediate
    18432, vocab 129280), few layers: 1 dense + 1 MoE + 1 MTP (a MoE layer). In bf16 one
    MoE layer is 22.5 GB (256 x 3 x 7168 x 2048 x 2 bytes of experts): the slice is ~49.6 GB,
    which fits a 64 GB disk and an H200's 139 GB; a second MoE layer (~72 GB) would not fit
    the disk. Default RoPE (the released config's YaRN is refused by the engine).
    Its embedding / lm_head carry the bench's chain structure (checkpoints._chain_head), so
    the greedy path is stable under bf16 and a recorded continuation replays.

Tensors are drawn on the device (checkpoints._draw), written shard by shard (<= 4 GB each,
a tensor larger than that alone), so the host holds one shard at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from .checkpoints import SHARD_BYTES, _chain_head, _draw, _key, _param_shapes, ensure_checkpoint

__all__ = ["DFLASH_SHAPES", "DSV3_SHAPES", "EAGLE3_SHAPES", "GLM_SHAPES", "dflash_config", "ensure_dflash", "eagle3_config",
           "ensure_eagle3", "ensure_glm_mtp", "eagle3_read_bytes", "dflash_read_bytes", "draft_kv_bytes", "dsv3_config", "ensure_dsv3_mtp", "mtp_step_read_bytes",
           "planned_bytes"]

DFLASH_SHAPES = {  # target shape -> the drafter's shape (model/tiny_dflash.dflash_config_dict's arguments)
    "8b": dict(layers=5, block_size=16, taps=(1, 8, 15, 22, 29), mask_token_id=128002, heads=32, kv_heads=8,
               head_dim=128, intermediate_size=14336),
    "qwen3-8b": dict(layers=5, block_size=16, taps=(1, 9, 17, 25, 33), mask_token_id=151669, heads=32, kv_heads=8,
                     head_dim=128, intermediate_size=12288),  # Qwen3-8B-DFlash-b16's widths (DRAFTERS.md)
    "tiny": dict(layers=2, block_size=16, taps=(0, 1), mask_token_id=2, heads=4, kv_heads=2, head_dim=16,
                 intermediate_size=128),
}

EAGLE3_SHAPES = {  # target shape -> the head's shape (demo/tiny_eagle3.eagle3_config_dict's arguments)
    "8b": dict(taps=(1, 15, 28), heads=32, kv_heads=8, head_dim=128, intermediate_size=14336, draft_vocab=32000),
    "tiny": dict(taps=(0, 1), heads=4, kv_heads=2, head_dim=16, intermediate_size=128, draft_vocab=256),
}


def _dsv3(hidden, inter, moe_inter, heads, q_lora, kv_lora, nope, rope, v, experts, top_k, n_group, topk_group,
          vocab, layers=2, dense=1, mtp=1) -> dict:
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "v_head_dim": v, "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": top_k,
            "n_group": n_group, "topk_group": topk_group, "first_k_dense_replace": dense,
            "num_nextn_predict_layers": mtp, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 8192, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": None, "torch_dtype": "bfloat16"}


DSV3_SHAPES = {  # DeepSeek-V3's released widths; 1 dense + 1 MoE layer + 1 MTP layer
    "8b": _dsv3(7168, 18432, 2048, 128, 1536, 512, 128, 64, 128, 256, 8, 8, 4, 129280),
    "tiny": _dsv3(64, 128, 32, 4, 32, 16, 16, 8, 16, 16, 4, 8, 4, 512),
}


def _glm(hidden, inter, moe_inter, heads, kv_heads, head_dim, experts, top_k, vocab, layers=4, dense=1, mtp=1) -> dict:
    return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "partial_rotary_factor": 0.5, "use_qk_norm": False, "attention_bias": True,
            "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": top_k, "n_group": 1,
            "topk_group": 1, "first_k_dense_replace": dense, "num_nextn_predict_layers": mtp, "norm_topk_prob": True,
            "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
            "max_position_embeddings": 8192, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": None, "torch_dtype": "bfloat16"}


GLM_SHAPES = {  # GLM-4.5-Air's widths (grouped attention, partial rotary, 128 experts top 8); 1 dense + 3 MoE + 1 MTP layer
    "8b": _glm(4096, 10944, 1408, 96, 8, 128, 128, 8, 151552),
    "tiny": _glm(64, 128, 32, 4, 2, 16, 8, 2, 512),
}


# ---- shapes and bytes -------------------------------------------------------------------

def _nbytes(shapes: dict, dtype: torch.dtype) -> int:
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(math.prod(s) * (4 if f32 else size) for s, f32 in shapes.values())


def _mtp_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The MTP layers' tensors (HF names) -> (shape, kept in fp32), from model/mtp.MTPHead on meta."""
    from ..model.config import parse_config  # noqa: PLC0415
    from ..model.loader import FP32_KEYS, hf_name  # noqa: PLC0415
    from ..model.mtp import MTPHead  # noqa: PLC0415

    mcfg = parse_config(cfg, "bench")
    with torch.device("meta"):
        head = MTPHead(mcfg, cfg["num_nextn_predict_layers"])
    return {hf_name(k): (tuple(v.shape), k.endswith(FP32_KEYS)) for k, v in head.state_dict().items()}


def _dflash_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    from ..model.dflash import DFlashNet, parse_dflash_config  # noqa: PLC0415

    with torch.device("meta"):
        net = DFlashNet(parse_dflash_config(cfg))
    return {k: (tuple(v.shape), False) for k, v in net.state_dict().items()}


def _eagle3_shapes(cfg: dict, num_target_layers: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The EAGLE-3 head's tensors (checkpoint names, d2t and t2d included) -> (shape, fp32)."""
    from ..model.eagle3 import Eagle3Net, parse_eagle3_config  # noqa: PLC0415

    with torch.device("meta"):
        net = Eagle3Net(parse_eagle3_config(cfg, num_target_layers))
    shapes = {k: (tuple(v.shape), False) for k, v in net.state_dict().items()}
    return {**shapes, "d2t": ((cfg["draft_vocab_size"],), False), "t2d": ((cfg["vocab_size"],), False)}


def eagle3_read_bytes(cfg: dict, k: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Bytes an EAGLE-3 round of k drafts reads per drafted token: each step reads the decoder
    layer, the final norm, the draft lm_head and one embedding row; the round's first forward
    also reads fc once (counted as fc / k a token). The K/V and tap rows are not counted."""
    size = torch.empty(0, dtype=dtype).element_size()
    parts = {"layer": 0, "lm_head": 0, "norm": 0}
    fc = 0
    for name, (shape, _f32) in _eagle3_shapes(cfg, max(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) + 1
                                              ).items():
        b = math.prod(shape) * size
        if name.startswith("midlayer."):
            parts["layer"] += b
        elif name == "lm_head.weight":
            parts["lm_head"] += b
        elif name == "norm.weight":
            parts["norm"] += b
        elif name == "fc.weight":
            fc = b
    parts["embed_row"] = cfg["hidden_size"] * size
    parts["fc_over_k"] = fc // k
    return {"bytes": sum(parts.values()), "parts": parts, "k": k,
            "formula": "decoder layer + final norm + draft lm_head + one embedding row, + fc / k (one fc a round)"}


def dflash_read_bytes(cfg: dict, target_cfg: dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Bytes ONE DFlash block forward reads whatever the number of requests it drafts for: every
    tensor of the drafter (its layers, fc, norms) and the target's lm_head its drafted rows go
    through. Its K/V (draft_kv_bytes a context position and request) is counted apart."""
    size = torch.empty(0, dtype=dtype).element_size()
    net = sum(math.prod(shape) * size for shape, _f32 in _dflash_shapes(cfg).values())
    lm = target_cfg["vocab_size"] * target_cfg["hidden_size"] * size
    return {"bytes": net + lm, "parts": {"drafter": net, "target_lm_head": lm},
            "formula": "the drafter's tensors + the target's lm_head, once a block forward"}


def draft_kv_bytes(cfg: dict, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a draft network's K/V one context position holds (every layer's K and V): what a
    forward reads per position of each request's context."""
    size = torch.empty(0, dtype=dtype).element_size()
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * size


def mtp_step_read_bytes(cfg: dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Bytes ONE MTP step (one row) reads: every tensor of MTP layer 0 (eh_proj, norms, MLA,
    router, shared expert) but the routed experts, of which top_k / n_routed_experts, plus the
    target's lm_head and one embedding row. The KV-cache read (a few latent rows per context
    position) is not counted."""
    size = torch.empty(0, dtype=dtype).element_size()
    frac = cfg["num_experts_per_tok"] / cfg["n_routed_experts"]
    first = f"model.layers.{cfg['num_hidden_layers']}."
    parts = {"routed_top_k": 0, "layer_rest": 0}
    for name, (shape, f32) in _mtp_shapes(cfg).items():
        if not name.startswith(first):
            continue
        b = math.prod(shape) * (4 if f32 else size)
        if ".mlp.experts." in name:
            parts["routed_top_k"] += int(b * frac)
        else:
            parts["layer_rest"] += b
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    parts["lm_head"] = V * H * size
    parts["embed_row"] = H * size
    return {"bytes": sum(parts.values()), "parts": parts,
            "formula": "MTP layer tensors (routed experts x top_k / n_experts) + lm_head + one embedding row"}


def planned_bytes(kind: str, shape: str) -> int:
    """Disk bytes the checkpoint(s) of one case write (bf16): 'dflash' / 'eagle3' = the drafter
    alone (the target is the bench's shape checkpoint), 'dsv3' / 'glm' = the target with its MTP layer."""
    if kind == "eagle3":
        from .checkpoints import shape_config  # noqa: PLC0415

        t = shape_config(shape)
        return _nbytes(_eagle3_shapes(eagle3_config(t, shape), t["num_hidden_layers"]), torch.bfloat16)
    if kind == "dflash":
        from .checkpoints import shape_config  # noqa: PLC0415

        return _nbytes(_dflash_shapes(dflash_config(shape_config(shape), shape)), torch.bfloat16)
    cfg = GLM_SHAPES[shape] if kind == "glm" else DSV3_SHAPES[shape]
    return _nbytes({**_param_shapes(cfg), **_mtp_shapes(cfg)}, torch.bfloat16)


# ---- the writer ---------------------------------------------------------------------------

def _check_disk(where: Path, need: int) -> None:
    free = shutil.disk_usage(where).free
    if free < need + (1 << 30):
        raise RuntimeError(f"not enough disk under {where}: {need / 1e9:.1f} GB to write, {free / 1e9:.1f} GB free")


def _write_sharded(out: Path, shapes: dict, special: dict, device, dtype, say, prefix_free: bool = False) -> None:
    """Draw every tensor (or take it from `special`), one shard at a time, and save it."""
    from safetensors.torch import save_file  # noqa: PLC0415

    size = torch.empty(0, dtype=dtype).element_size()
    shards, cur, cur_b = [], [], 0
    for name, (shape, f32) in shapes.items():
        cur.append(name)
        cur_b += math.prod(shape) * (4 if f32 else size)
        if cur_b >= SHARD_BYTES:
            shards.append(cur)
            cur, cur_b = [], 0
    if cur:
        shards.append(cur)
    gen = torch.Generator(device=device).manual_seed(0)
    n, weight_map = len(shards), {}
    for i, names in enumerate(shards):
        tensors = {}
        for name in names:
            shape, f32 = shapes[name]
            t = special.pop(name, None)
            if t is None:
                t = _draw(name, shape, torch.float32 if f32 else dtype, device, gen)
            tensors[name] = t.cpu()
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        del tensors
        say(f"  wrote shard {i + 1}/{n}")
    if n > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _ensure(out: Path, cfg: dict, shapes: dict, special_fn, device, dtype, say, what: str) -> Path:
    if (out / "config.json").exists():
        say(f"{what}: reusing {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    need = _nbytes(shapes, dtype)
    _check_disk(out.parent, need)
    say(f"{what}: writing random {str(dtype).removeprefix('torch.')} weights ({need / 1e9:.2f} GB) to {out}")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        _write_sharded(tmp, shapes, special_fn(), device, dtype, say)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"{what}: written in {time.perf_counter() - t0:.1f}s")
    return out


def dflash_config(target_cfg: dict, shape: str) -> dict:
    from ..demo.tiny_dflash import dflash_config_dict  # noqa: PLC0415

    return {**dflash_config_dict(target_cfg, **DFLASH_SHAPES[shape]), "torch_dtype": "bfloat16"}


def ensure_dflash(shape: str, cache: Path, device: torch.device, say: Callable[[str], None],
                  dtype: torch.dtype = torch.bfloat16) -> tuple[Path, Path]:
    """(target dir, DFlash drafter dir): the bench's `shape` Llama target and a random DFlash
    drafter over it, cached beside it (keyed by its config)."""
    target = ensure_checkpoint(shape, cache, device, say, dtype)
    cfg = dflash_config(json.loads((target / "config.json").read_text()), shape)
    out = target.parent / f"{target.name}-dflash-b{cfg['block_size']}-{_key(cfg)}"
    return target, _ensure(out, cfg, _dflash_shapes(cfg), dict, device, dtype, say, f"dflash over {shape}")


def eagle3_config(target_cfg: dict, shape: str) -> dict:
    from ..demo.tiny_eagle3 import eagle3_config_dict  # noqa: PLC0415

    return {**eagle3_config_dict(target_cfg, **EAGLE3_SHAPES[shape]), "torch_dtype": "bfloat16"}


def ensure_eagle3(shape: str, cache: Path, device: torch.device, say: Callable[[str], None],
                  dtype: torch.dtype = torch.bfloat16) -> tuple[Path, Path]:
    """(target dir, EAGLE-3 head dir): the bench's `shape` Llama target and a random EAGLE-3 head
    over it, cached beside it (keyed by its config). The draft vocabulary is a fixed random set
    of target ids (d2t = its ids - the draft ids, t2d its membership); no embed_tokens."""
    target = ensure_checkpoint(shape, cache, device, say, dtype)
    tcfg = json.loads((target / "config.json").read_text())
    cfg = eagle3_config(tcfg, shape)
    out = target.parent / f"{target.name}-eagle3-{_key(cfg)}"

    def special() -> dict:
        V, Vd = cfg["vocab_size"], cfg["draft_vocab_size"]
        hot = torch.randperm(V, generator=torch.Generator().manual_seed(7))[:Vd].sort().values
        return {"d2t": hot - torch.arange(Vd), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, hot, True)}

    shapes = _eagle3_shapes(cfg, tcfg["num_hidden_layers"])
    return target, _ensure(out, cfg, shapes, special, device, dtype, say, f"eagle3 over {shape}")


def dsv3_config(shape: str) -> dict:
    return dict(DSV3_SHAPES[shape])


def _ensure_mtp_slice(name: str, cfg: dict, shape: str, cache: Path, device, say, dtype, what: str) -> Path:
    """A target slice with its MTP layers (`cfg`), written once under `name`-mtp-`shape`-<key>,
    its embedding / lm_head carrying the bench's chain structure."""
    shapes = {**_param_shapes(cfg), **_mtp_shapes(cfg)}

    def special() -> dict:
        t: dict = {}
        _chain_head(name, cfg, t, device, dtype)
        return t

    return _ensure(cache / f"{name}-mtp-{shape}-{_key(cfg)}", cfg, shapes, special, device, dtype, say, what)


def ensure_dsv3_mtp(shape: str, cache: Path, device: torch.device, say: Callable[[str], None],
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """The DeepSeek-V3-shaped slice with its MTP layer (module docstring), written once."""
    return _ensure_mtp_slice("dsv3", dsv3_config(shape), shape, cache, device, say, dtype,
                             f"deepseek_v3 slice ({shape}) + MTP")


def ensure_glm_mtp(shape: str, cache: Path, device: torch.device, say: Callable[[str], None],
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """The GLM-4.5-Air-shaped slice with its MTP layer (GLM_SHAPES), written once: a glm4_moe
    target whose MTP layer drafts on the engine loop's pool graphs (mtp_pool_graph.py)."""
    return _ensure_mtp_slice("glm", dict(GLM_SHAPES[shape]), shape, cache, device, say, dtype,
                             f"glm4_moe slice ({shape}) + MTP")
