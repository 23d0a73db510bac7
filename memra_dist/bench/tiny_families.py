"""Tiny random checkpoints of every family the engine loads, saved by transformers'
`save_pretrained` (the files a user downloads, through the real loader), each with a
tokenizer.json, and the drafters each family takes: a smaller checkpoint of the same family
(`--drafter model`), a random DFlash and EAGLE-3 drafter over it, and for deepseek_v3 /
glm4_moe the target's own MTP layers. Used by benchmarks/smoke_commands.py; the builders
follow tests/conftest.py `save_hf` and tests/kimi_ckpt.py; tests/moe_ckpt.py builds its MoE
checkpoints with `save_moe` here. Needs `transformers` (the `test` extra; kimi_linear: >= 4.57).

    build_family("glm4_moe", Path("/tmp/w/glm4_moe"))
    # -> {"target": .../target, "draft": .../draft, "dflash": .../dflash, "eagle3": .../eagle3}
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["FAMILIES", "DRAFTERS", "DENSE_SHAPE", "MOE_SHAPES", "save_dense", "save_moe", "save_kimi",
           "build_family", "save_tokenizer", "kimi_config"]

VOCAB = 128
DENSE_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
MOE_SHAPES = {
    "deepseek_v3": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                        kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8,
                        n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        max_position_embeddings=512, routed_scaling_factor=2.5),
    "glm4_moe": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1,
                     n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                     max_position_embeddings=512, partial_rotary_factor=0.5, use_qk_norm=True,
                     attention_bias=True, routed_scaling_factor=1.5),
}
FAMILIES = ("llama", "qwen2", "qwen3", "kimi_linear", "deepseek_v3", "glm4_moe")
_TAPPED = ("none", "ngram", "model", "dflash", "eagle3")  # every family: 4 layers, taps fit
DRAFTERS = {f: _TAPPED + (("mtp",) if f in MOE_SHAPES else ()) for f in FAMILIES}
# the drafters' shapes over a 4-layer, hidden-32, 128-token target (demo/tiny_dflash.py, tiny_eagle3.py)
DFLASH_SHAPE = dict(layers=1, block_size=4, taps=(1, 3), heads=2, kv_heads=1, head_dim=16, intermediate_size=64)
EAGLE3_SHAPE = dict(taps=(0, 1, 3), heads=2, kv_heads=1, head_dim=16, intermediate_size=64, draft_vocab=96)

_TOK = {}


def save_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """The demo corpus's BPE tokenizer (trained once per process) as path/tokenizer.json."""
    from ..demo.tiny import train_tokenizer  # noqa: PLC0415

    if vocab_size not in _TOK:
        _TOK[vocab_size] = train_tokenizer(vocab_size=vocab_size)
    _TOK[vocab_size].save(str(Path(path) / "tokenizer.json"))


def _randomize(model, std: float) -> None:
    """Wider weights than the default init (sharper, less tie-prone logits); norms, biases and
    the router's correction bias random too, so nothing runs at a default init."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * std if p.dim() >= 2 else p + torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.2)


def save_dense(path: Path, arch: str, seed: int = 0, **kw) -> Path:
    """A tiny random `arch` checkpoint (llama | qwen2 | qwen3) + tokenizer.json at `path`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: PLC0415

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    shape = {**DENSE_SHAPE, **kw}
    if arch == "qwen3":
        shape.setdefault("head_dim", 16)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**shape)).float().eval()
    _randomize(model, 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    save_tokenizer(path, shape["vocab_size"])
    return path


def save_moe(path: Path, arch: str, layers: int = 4, n_mtp: int = 1, seed: int = 0, std: float = 0.2,
             tokenizer: bool = True, **kw) -> Path:
    """A tiny deepseek_v3 / glm4_moe checkpoint with `n_mtp` MTP layers + tokenizer.json.
    transformers saves only the decoder, so `layers + n_mtp` decoder layers are saved and the
    config cut to `layers`: the trailing layers become the MTP layers' blocks, each given its
    own tensors (enorm, hnorm, eh_proj, shared_head.norm; head and embedding copied), as in
    the released checkpoints."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig  # noqa: PLC0415

    cls = {"deepseek_v3": DeepseekV3Config, "glm4_moe": Glm4MoeConfig}[arch]
    shape = {**MOE_SHAPES[arch], **kw}
    torch.manual_seed(seed)
    full = AutoModelForCausalLM.from_config(
        cls(num_hidden_layers=layers + n_mtp, num_nextn_predict_layers=n_mtp, **shape)).float().eval()
    _randomize(full, std)
    path.mkdir(parents=True, exist_ok=True)
    full.save_pretrained(str(path))
    f = path / "model.safetensors"
    W = load_file(str(f))
    H = shape["hidden_size"]
    g = torch.Generator().manual_seed(seed + 100)
    for j in range(n_mtp):
        pre = f"model.layers.{layers + j}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            W[f"{pre}{norm}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        W[pre + "eh_proj.weight"] = std * torch.randn(H, 2 * H, generator=g)
        W[pre + "shared_head.head.weight"] = W["lm_head.weight"].clone()
        W[pre + "embed_tokens.weight"] = W["model.embed_tokens.weight"].clone()
    save_file(W, str(f), metadata={"format": "pt"})
    c = json.loads((path / "config.json").read_text())
    c["num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(c, indent=2))
    if tokenizer:
        save_tokenizer(path, shape["vocab_size"])
    return path


def kimi_config(kda: list[int], full: list[int]):
    """The tiny kimi_linear config: KDA layers `kda`, MLA layers `full` (1-based, as transformers)."""
    from transformers import KimiLinearConfig  # noqa: PLC0415

    return KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=len(kda) + len(full), num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
        num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2, first_k_dense_replace=1,
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": kda, "full_attn_layers": full})


def _save_pretrained(model, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    try:
        model.save_pretrained(str(path), save_original_format=False)  # transformers 5: the module's names
    except TypeError:
        model.save_pretrained(str(path))
    save_tokenizer(path)


def save_kimi(target: Path, draft: Path, seed: int = 0) -> tuple[Path, Path]:
    """A 4-layer kimi_linear ([KDA, MLA, KDA, KDA], a dense first layer, then MoE) and its
    draft: the target's first two layers + norm and head (a smaller kimi_linear of the same
    vocabulary). Both with tokenizer.json."""
    from transformers import KimiLinearForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    m = KimiLinearForCausalLM(kimi_config([1, 3, 4], [2])).float().eval()
    with torch.no_grad():
        for n, b in m.named_buffers():  # a non-zero correction bias, so routing depends on it
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    _save_pretrained(m, target)
    d = KimiLinearForCausalLM(kimi_config([1], [2])).float().eval()
    d.load_state_dict({k: v for k, v in m.state_dict().items()
                       if not k.startswith(("model.layers.2.", "model.layers.3."))}, strict=True)
    _save_pretrained(d, draft)
    return target, draft


def build_family(arch: str, root: Path, seed: int = 0) -> dict[str, Path]:
    """Target, draft, DFlash and EAGLE-3 drafters of `arch` under root (reused when there)."""
    from ..demo.tiny_dflash import random_dflash  # noqa: PLC0415
    from ..demo.tiny_eagle3 import random_eagle3  # noqa: PLC0415

    root = Path(root)
    out = {name: root / name for name in ("target", "draft", "dflash", "eagle3")}
    if all((p / "config.json").exists() for p in out.values()):
        return out
    if arch in ("llama", "qwen2", "qwen3"):
        save_dense(out["target"], arch, seed)
        save_dense(out["draft"], arch, seed + 1, num_hidden_layers=1)
    elif arch in MOE_SHAPES:
        save_moe(out["target"], arch, layers=4, n_mtp=1, seed=seed)
        save_moe(out["draft"], arch, layers=1, n_mtp=0, seed=seed + 1)
    elif arch == "kimi_linear":
        save_kimi(out["target"], out["draft"], seed)
    else:
        raise ValueError(f"unknown family {arch!r} (one of {', '.join(FAMILIES)})")
    random_dflash(out["dflash"], out["target"], seed=seed, **DFLASH_SHAPE)
    random_eagle3(out["eagle3"], out["target"], seed=seed, **EAGLE3_SHAPE)
    return out
