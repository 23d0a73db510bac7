"""Loaded stages are inference-only: no parameter requires grad, so torch.compile traces no
backward graph (an MoE block calling our expert op, which defines no autograd formula,
crashed the GPU demo under compile when the parameters required grad)."""

from __future__ import annotations

import torch

from memra_dist.model.config import load_config
from memra_dist.model.loader import load_stage
from memra_dist.runner import ModelRunner

from moe_ckpt import save_moe


def test_a_loaded_dense_stage_requires_no_grad(llama):
    r = ModelRunner(llama, torch.device("cpu"), torch.float32, max_pos=64)
    params = list(r.stage.parameters())
    assert params and not any(p.requires_grad for p in params)


def test_a_loaded_moe_stage_requires_no_grad(tmp_path):
    d = tmp_path / "glm"
    save_moe(d, "glm4_moe")
    cfg = load_config(d)
    stage = load_stage(d, 0, cfg.num_layers, True, True, torch.device("cpu"), torch.float32, cfg)
    params = list(stage.parameters())
    assert params and not any(p.requires_grad for p in params)
