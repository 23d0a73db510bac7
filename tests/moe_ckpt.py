"""Tiny deepseek_v3 / glm4_moe checkpoints with MTP layers, saved by transformers' save_pretrained.

transformers saves only the decoder (its models hold no MTP layer), so a model of
`layers + n_mtp` decoder layers is saved and its config cut to `layers`: the trailing decoder
layers become the MTP layers' blocks, and each MTP layer gets its own tensors beside them
(`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`; `shared_head.head` and `embed_tokens` as
copies of the main model's, as in the released checkpoints). Every parameter is random
(norm weights, biases and the router's correction bias too), so nothing is tested at a
default init.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEEPSEEK = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8,
                n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                max_position_embeddings=512, routed_scaling_factor=2.5)
GLM = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
           num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=512,
           partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.5)
SHAPES = {"deepseek_v3": DEEPSEEK, "glm4_moe": GLM}


def _config_cls(arch: str):
    from transformers import DeepseekV3Config, Glm4MoeConfig

    return {"deepseek_v3": DeepseekV3Config, "glm4_moe": Glm4MoeConfig}[arch]


def save_moe(path: Path, arch: str, layers: int = 2, n_mtp: int = 1, seed: int = 0, std: float = 0.2,
             tokenizer: bool = True, **kw):
    """A tiny `arch` checkpoint at `path` with `n_mtp` MTP layers; returns (path, the HF model
    of the decoder, loaded back from the files)."""
    from transformers import AutoModelForCausalLM

    shape = {**SHAPES[arch], **kw}
    torch.manual_seed(seed)
    full = AutoModelForCausalLM.from_config(
        _config_cls(arch)(num_hidden_layers=layers + n_mtp, num_nextn_predict_layers=n_mtp, **shape)).float().eval()
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn_like(p) * std if p.dim() >= 2 else p + torch.randn_like(p) * 0.1)
        for name, b in full.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.2)
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
        from memra_dist.demo.tiny import train_tokenizer

        train_tokenizer(vocab_size=shape["vocab_size"]).save(str(path / "tokenizer.json"))
    return path, load_hf(path)


def load_hf(path: Path):
    """The decoder as transformers loads it (the MTP tensors are left out of it)."""
    import logging

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)  # the MTP tensors are "unexpected" to the decoder: expected
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(prev)
