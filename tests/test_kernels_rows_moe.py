"""The verify rows' and the MoE's kernels (memra_dist/kernels/gemm_rows.py, moe_gemv.py), run by
Triton's interpreter on CPU in fp32: the row GEMM with each fold equals norm / linear / gating /
residual; the per-slot expert GEMVs equal the reference per-expert loop; and a MoE target with
its MTP layers on the kernels drafts and decodes exactly as without them."""

from __future__ import annotations


import pytest
import torch
from torch.nn import functional as F

from triton_interp import triton  # noqa: E402,F401 (the interpreter on CPU; skips without Triton)

from memra_dist.model.config import load_config  # noqa: E402
from memra_dist.model.layers import RMSNorm  # noqa: E402
from memra_dist.runner import ModelRunner  # noqa: E402
from memra_dist.specdec.drafters.mtp import MTPDrafter  # noqa: E402
from memra_dist.specdec.drafters.none import NoDrafter  # noqa: E402

from test_kernels import _generate, _on_kernels, block_rounds_equal_the_reference  # noqa: E402
from test_moe_grouped import _moe  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests run on CPU machines")
TOL = dict(rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("m", [2, 5, 16, 17, 80])  # 17, 80: a batched step's wider column blocks (32, 128)
@pytest.mark.parametrize("n,k", [(48, 64), (40, 72)])  # 40 x 72: ragged tiles on both axes
def test_row_gemm_equals_linear_with_each_fold(m, n, k):
    from memra_dist.kernels.gemm_rows import gemm_rows

    g = torch.Generator().manual_seed(m * n + k)
    w, x, b, r = (torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g),
                  torch.randn(m, n, generator=g))
    norm = RMSNorm(k, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=g) + 0.5)
        normed = norm(x)
    torch.testing.assert_close(gemm_rows(x, w), x @ w.t(), **TOL)
    torch.testing.assert_close(gemm_rows(x, w, b, norm=norm.weight, eps=norm.eps, residual=r),
                               normed @ w.t() + b + r, **TOL)
    gu = torch.randn(m, 2 * k, generator=g)
    torch.testing.assert_close(gemm_rows(gu, w, None, silu_mul=True, residual=r),
                               (F.silu(gu[:, :k]) * gu[:, k:]) @ w.t() + r, **TOL)
    w2 = torch.randn(2 * n, k, generator=g)  # a fused gate-up weight: gate rows, then up rows
    h = normed @ w2.t()
    torch.testing.assert_close(gemm_rows(x, w2, norm=norm.weight, eps=norm.eps, glu=True),
                               F.silu(h[:, :n]) * h[:, n:], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, pytest.param(16, marks=pytest.mark.slow)])  # (16 rows: ~12 s in all)
@pytest.mark.parametrize("spec", [{}, {"n_shared": 0}, {"top_k": 6, "n_group": 1}, {"num_experts": 4, "top_k": 4,
                                                                                     "n_group": 1}])
def test_expert_gemvs_equal_the_per_expert_loop(rows, spec):
    """top_k 6 is not a power of two (the kernel pads the row's expert lanes); top_k 4 of 4
    experts: every row on every expert."""
    from memra_dist.kernels.moe_gemv import moe_experts
    from memra_dist.kernels.ops import _install_moe

    m = _moe(rows + 7, **spec)
    x = torch.randn(rows, 24, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        w, idx = m.gate(x)
        torch.testing.assert_close(moe_experts(x, m.experts.gate_up_proj, m.experts.down_proj, w, idx),
                                   m.experts.forward_loop(x, w, idx), **TOL)
        ref = m(x)
        _install_moe(m)
        torch.testing.assert_close(m(x), ref, **TOL)  # router GEMV (one row), experts, shared expert added in


@pytest.mark.slow  # the Triton interpreter: seconds to a minute on 2 cores; the full run (slow tier) keeps it
def test_moe_target_and_its_mtp_layers_on_the_kernels_decode_identically(tmp_path, monkeypatch):
    """deepseek_v3 (MLA, MoE, two MTP layers): the target and the drafter installed on the
    kernels (the drafter follows its target) speculate exactly the plain tokens, and both the
    one-row (chained) and the several-row (a round's first) MTP steps ran the expert GEMVs."""
    from moe_ckpt import save_moe

    import memra_dist.kernels.ops as ops

    path, _ = save_moe(tmp_path / "ds", "deepseek_v3", layers=2, n_mtp=2, seed=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    plain, _ = _generate(ModelRunner(path, torch.device("cpu"), torch.float32, max_pos=128), NoDrafter(), 1,
                         prompt, 16)
    rows = []
    real = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    target = ModelRunner(path, torch.device("cpu"), torch.float32, max_pos=128)
    assert _on_kernels(target) > 0
    target.kernel_modules = 1  # what the runner records when it installs them (CUDA)
    dr = MTPDrafter.load(path, load_config(path), target)
    assert all(layer.mlp.fast_rows and type(layer.eh_proj).__name__ == "FastLinear" for layer in dr.head.layers.values())
    tokens, st = _generate(target, dr, 3, prompt, 16)
    assert tokens == plain
    assert st.drafted > 0 and st.accepted > 0
    assert 1 in rows and any(r > 1 for r in rows)


@pytest.mark.slow  # the Triton interpreter: seconds to a minute on 2 cores; the full run (slow tier) keeps it
def test_dflash_block_folded_into_our_gemms_equals_the_reference(tmp_path):
    """Where the target runs our kernels, the DFlash block graph runs folded (DFlashNet.block
    `folded`: input norms in the QKV row GEMM, residuals in o_proj / down, the gated gate-up,
    the final norm in the lm_head kernel): its logits equal the eager reference block's and
    its drafts are the same tokens, at every start over rounds of ingested rows."""
    from types import SimpleNamespace

    from graph_emulator import EmulatedCapture

    from memra_dist.bench.tap_checkpoints import ensure_dflash
    from memra_dist.model.dflash import load_dflash_config
    from memra_dist.specdec.drafters.dflash import DFlashDrafter
    from memra_dist.specdec.drafters.dflash_graph import BlockGraphs, folds

    cpu = torch.device("cpu")
    target_dir, draft_dir = ensure_dflash("tiny", tmp_path, cpu, lambda s: None)
    target = ModelRunner(target_dir, cpu, torch.float32, max_pos=160)
    d = DFlashDrafter.load(draft_dir, load_dflash_config(draft_dir), target)
    assert not folds(d)  # the net is fused only on the CUDA fast path
    d.net.fuse()
    assert folds(d) and not folds(SimpleNamespace(B=17, net=d.net))  # a block past the row GEMM's 16 rows
    target.kernel_modules = _on_kernels(target)  # the target on the kernels, as the runner installs them (CUDA)
    assert target.stage.fused_head == 64  # a batched step's rows too (ops.BATCH_FOLD_ROWS)
    with torch.no_grad():  # norm weights away from 1 (the tiny checkpoint's are ones: a norm applied twice would pass)
        for m in d.net.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(m.weight.numel()))
    target.alloc(160)
    d.alloc(160)
    graphs = BlockGraphs(d, graph_cls=EmulatedCapture)
    assert graphs.kernel_attn and graphs.folded  # decided from the target and the net, not forced
    block_rounds_equal_the_reference(target, d, graphs, seed=11, adds=(0, 4, 7))


@pytest.mark.slow  # the Triton interpreter: seconds to a minute on 2 cores; the full run (slow tier) keeps it
def test_kimi_hybrid_on_the_kernels_speculates_transformers_greedy():
    """Kimi-Linear (KDA + MLA + MoE): install switches its MoE (router, expert GEMVs, shared
    expert) and MLA projections; decoding and replay speculation (multi-row verifies through the
    expert GEMVs) give transformers' greedy tokens."""
    from kimi_ckpt import PROMPT, hybrid, reference_greedy

    from memra_dist.specdec.drafters import ReplayDrafter

    _, target_dir, _ = hybrid()
    want = reference_greedy(12)
    r = ModelRunner(target_dir, torch.device("cpu"), torch.float32, max_pos=128)
    assert _on_kernels(r) > 0
    assert any(getattr(b.mlp, "fast_rows", 0) == 16 for b in r.stage.layers.values())
    assert _generate(r, NoDrafter(), 1, PROMPT, 12)[0][len(PROMPT):] == want
    r = ModelRunner(target_dir, torch.device("cpu"), torch.float32, max_pos=128)
    _on_kernels(r)
    spec, st = _generate(r, ReplayDrafter(want, len(PROMPT), 128, corrupt=0.3), 4, PROMPT, 12)
    assert spec[len(PROMPT):] == want and 0 < st.accepted < st.drafted
