"""Our custom ops (kernels/ops.py) under `--compile on`: a MoE block on the kernels, compiled
the way the CUDA path compiles it (graphs.compile_blocks: inductor, here its CPU backend, the
kernels run by Triton's interpreter), equals the eager block even with parameters that require
grad, as a freshly built module's do (the compiled region runs with grad off, so no backward
is traced: GLM-4.5's MoE crashed the GPU demo there); and a backward through any of the ops
raises a clear error instead of running."""

from __future__ import annotations

import pytest
import torch

from triton_interp import triton  # noqa: F401 (the interpreter on CPU; skips without Triton)

from memra_dist.graphs import compile_blocks
from memra_dist.kernels import ops
from memra_dist.model.config import load_config
from memra_dist.model.loader import load_stage
from memra_dist.model.moe import MoE

from moe_ckpt import save_moe

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests run on CPU machines")


@pytest.mark.slow  # inductor compiles one small block for the CPU (~20-40 s)
def test_a_compiled_moe_block_equals_eager_with_grad_on(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile, nothing kept
    torch._dynamo.reset()
    d, _ = save_moe(tmp_path / "glm", "glm4_moe", tokenizer=False)
    cfg = load_config(d)
    stage = load_stage(d, 0, cfg.num_layers, True, True, CPU, torch.float32, cfg)
    for blk in stage.layers.values():  # the runner's fast-path set-up: fusion, then the kernels
        for m in (blk.self_attn, blk.mlp):
            if hasattr(m, "fuse"):
                m.fuse()
    ops.install_stage(stage)
    stage.requires_grad_(True)  # as a freshly built module: compile must not trace a backward anyway
    compile_blocks(stage)
    blk = next(b for b in stage.layers.values() if isinstance(b.mlp, MoE))
    assert blk.mlp.fast_rows >= 1  # one row reaches torch.ops.memra.moe_experts (and the GEMVs)
    calls = []
    kernel = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda *a: calls.append(1) or kernel(*a))
    pos = torch.tensor([5])
    ctx = stage.step_ctx(pos, None)
    h = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    try:
        eager = blk(h, ctx, None)
        assert eager.requires_grad and calls  # grad on, and the expert op ran
        compiled = blk._compiled(h, ctx, None)
    finally:
        torch._dynamo.reset()
    assert len(calls) == 2  # eager, then the compiled graph's run (its trace ran the fake): the op stays in it
    torch.testing.assert_close(compiled, eager.detach(), rtol=1e-5, atol=1e-5)


def _op_calls():
    """Each op on small CPU inputs that require grad (the kernels swapped for zeros of the
    output's shape: only the autograd wrapping is under test)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).requires_grad_(True)

    idx = torch.tensor([[0, 1]])
    return {"gemv": lambda: torch.ops.memra.gemv(t(1, 8), t(4, 8), None, False),
            "glu_rows": lambda: torch.ops.memra.glu_rows(t(2, 8), t(8, 8), t(8), 1e-6),
            "moe_experts": lambda: torch.ops.memra.moe_experts(t(1, 8), t(2, 6, 8), t(2, 8, 3), t(1, 2), idx, None),
            "decode_attention": lambda: torch.ops.memra.decode_attention(t(1, 2, 4), t(6, 1, 4), t(6, 1, 4),
                                                                         torch.tensor([3]))}


@pytest.mark.parametrize("name", ["gemv", "glu_rows", "moe_experts", "decode_attention"])
def test_a_backward_through_an_op_raises(name, monkeypatch):
    monkeypatch.setattr(ops, "gemv", lambda x, w, *a: torch.zeros(x.shape[0], w.shape[0]))
    monkeypatch.setattr(ops, "gemm_rows", lambda x, w, *a, **k: torch.zeros(x.shape[0], w.shape[0] // 2))
    monkeypatch.setattr(ops, "moe_experts", lambda x, *a: torch.zeros_like(x))
    monkeypatch.setattr(ops, "decode_attention", lambda q, *a: torch.zeros(q.shape[0], q.shape[1] * q.shape[2]))
    y = _op_calls()[name]()
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=f"memra::{name} is inference-only"):
        y.sum().backward()
    with torch.no_grad():  # the ops' ordinary use: nothing to refuse
        assert not _op_calls()[name]().requires_grad
