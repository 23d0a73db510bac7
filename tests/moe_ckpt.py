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

from pathlib import Path

import torch

from memra_dist.bench.tiny_families import MOE_SHAPES
from memra_dist.bench.tiny_families import save_moe as _save_moe

SHAPES = MOE_SHAPES
DEEPSEEK, GLM = SHAPES["deepseek_v3"], SHAPES["glm4_moe"]


def save_moe(path: Path, arch: str, layers: int = 2, n_mtp: int = 1, seed: int = 0, std: float = 0.2,
             tokenizer: bool = True, **kw):
    """A tiny `arch` checkpoint at `path` with `n_mtp` MTP layers (memra_dist/bench/tiny_families.py);
    returns (path, the HF model of the decoder, loaded back from the files)."""
    _save_moe(Path(path), arch, layers=layers, n_mtp=n_mtp, seed=seed, std=std, tokenizer=tokenizer, **kw)
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
