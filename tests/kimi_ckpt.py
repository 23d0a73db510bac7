"""Tiny kimi_linear checkpoints for the speculative / tracing tests (built once per process).

The target: 4 layers, 3:1 KDA:MLA ([KDA, MLA, KDA, KDA], so a pp=2 split puts KDA on both
stages and the only MLA on stage 0), a dense first layer and MoE (8 experts, top-2, grouped,
one shared expert) after it; vocabulary 128 (conftest's llama draft shares it). The draft:
the target's first two layers + its norm and head (a smaller kimi_linear of the same
vocabulary). The target's last two layers' output projections are scaled down so that draft
agrees with it often but not always: the runs mix full, partial and zero accepts.
"""

from __future__ import annotations

import functools
import tempfile

import torch

from memra_dist.bench.tiny_families import kimi_config  # one config for the tests and the smoke run

VOCAB = 128
PROMPT = [5, 9, 17, 5, 9, 23, 40, 5, 9, 17, 5, 9]
_LATE_SCALE = 0.3


@functools.lru_cache(maxsize=None)
def hybrid():
    """(reference target model, target dir, draft dir); both saved with the module names."""
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(0)
    m = KimiLinearForCausalLM(kimi_config([1, 3, 4], [2])).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.startswith(("model.layers.2.", "model.layers.3.")) and ("o_proj" in n or "down_proj" in n):
                p.mul_(_LATE_SCALE)
        for n, b in m.named_buffers():  # a non-zero correction bias, so routing depends on it
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    target = tempfile.mkdtemp(prefix="kimi_spec_target_")
    m.save_pretrained(target, save_original_format=False)
    d = KimiLinearForCausalLM(kimi_config([1], [2])).float().eval()
    d.load_state_dict({k: v for k, v in m.state_dict().items()
                       if not k.startswith(("model.layers.2.", "model.layers.3."))}, strict=True)
    draft = tempfile.mkdtemp(prefix="kimi_spec_draft_")
    d.save_pretrained(draft, save_original_format=False)
    return m, target, draft


@functools.lru_cache(maxsize=None)
def reference_greedy(n: int) -> list[int]:
    """transformers' greedy continuation of PROMPT (full-sequence forwards, use_cache=False)."""
    m = hybrid()[0]
    with torch.no_grad():
        out = m.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, use_cache=False)
    return out[0, len(PROMPT):].tolist()
