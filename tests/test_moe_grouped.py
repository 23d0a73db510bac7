"""The grouped-GEMM MoE form (CUDA's path: no host sync, static shapes) against the reference
per-expert loop, on CPU in fp32 (torch._grouped_mm has a CPU implementation)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memra_dist.model.moe import MoE

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")


@dataclasses.dataclass
class _Spec:  # the MoE fields of KimiSpec
    num_experts: int = 8
    top_k: int = 3
    moe_inter: int = 16
    n_shared: int = 1
    n_group: int = 2
    topk_group: int = 1
    renormalize: bool = True
    routed_scale: float = 2.5


class _Cfg:
    hidden_size = 24


def _moe(seed: int, **spec) -> MoE:
    torch.manual_seed(seed)
    m = MoE(_Cfg(), _Spec(**spec))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        m.gate.e_score_correction_bias.normal_(0, 0.1)
    return m.eval()


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 33])
@pytest.mark.parametrize("spec", [{}, {"n_shared": 0}, {"n_group": 1, "topk_group": 1, "top_k": 2},
                                  {"num_experts": 4, "top_k": 4, "n_group": 1}])
def test_grouped_equals_loop(rows, spec):
    m = _moe(rows, **spec)
    x = torch.randn(rows, 24)
    with torch.no_grad():
        w, idx = m.gate(x)
        ref = m.experts.forward_loop(x, w, idx)
        got = m.experts.forward_grouped(x, w, idx)
        full_ref = m(x)
        m.use_grouped(True)
        full_got = m(x)
    assert torch.allclose(got, ref, rtol=0, atol=1e-6), (got - ref).abs().max()
    assert torch.allclose(full_got, full_ref, rtol=0, atol=1e-6)


def test_experts_picked_by_many_rows():
    """Every row on the same experts (one big group, the others empty)."""
    m = _moe(3, n_group=1)
    x = torch.randn(1, 24).repeat(7, 1)
    with torch.no_grad():
        w, idx = m.gate(x)
        assert (idx.sort(-1)[0] == idx[:1].sort(-1)[0]).all()
        assert torch.allclose(m.experts.forward_grouped(x, w, idx), m.experts.forward_loop(x, w, idx),
                              rtol=0, atol=1e-6)


def test_grouped_only_for_bf16_cuda():
    """The form is chosen at Stage.to_device: bf16 on CUDA only (the CPU keeps the reference)."""
    from memra_dist.model.transformer import Stage  # noqa: PLC0415

    st = Stage.__new__(Stage)
    torch.nn.Module.__init__(st)
    st._inv_freq = {}
    blk = torch.nn.Module()
    blk.mlp = _moe(0)
    st.layers = torch.nn.ModuleDict({"0": blk})
    st.to_device("cpu")
    assert blk.mlp.experts.grouped is False


@pytest.mark.parametrize("drafter,k", [("none", 1), ("ngram", 4), ("replay", 8)])
def test_hybrid_greedy_with_grouped_experts_equals_transformers(monkeypatch, drafter, k):
    """The tiny kimi target with every MoE layer on the grouped form: greedy ids (plain and
    speculative) equal transformers' greedy ids."""
    pytest.importorskip("transformers")
    from kimi_ckpt import PROMPT, hybrid, reference_greedy  # noqa: PLC0415

    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.app import generate  # noqa: PLC0415

    calls = []

    def force(self, on):
        calls.append(on)
        self.experts.grouped = True

    monkeypatch.setattr(MoE, "use_grouped", force)
    extra = {"replay_corrupt": 0.3} if drafter == "replay" else {}
    cfg = RunConfig(model=hybrid()[1], max_new_tokens=24, device="cpu", drafter=drafter, k=k, **extra)
    assert generate(cfg, PROMPT).token_ids == reference_greedy(24)
    assert calls  # the MoE layers were switched
