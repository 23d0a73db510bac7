"""The gathered expert product (the capturable MoE form where CUDA has no grouped kernel)
equals the grouped GEMM on the same grouped rows."""

from __future__ import annotations

import torch

from memra_dist.model.moe import gathered_mm


def test_gathered_equals_grouped():
    g = torch.Generator().manual_seed(0)
    E, n_in, n_out = 5, 12, 7
    experts = torch.tensor([0, 0, 2, 2, 2, 3, 4, 4])  # grouped: ascending, expert 1 empty
    xs = torch.randn(len(experts), n_in, generator=g)
    w = torch.randn(E, n_out, n_in, generator=g)
    offs = torch.bincount(experts, minlength=E).cumsum(0).to(torch.int32)
    want = torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)
    got = gathered_mm(xs, w, experts)
    assert got.shape == (len(experts), n_out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for n, e in enumerate(experts.tolist()):  # and each row is its expert's product
        torch.testing.assert_close(got[n], w[e] @ xs[n], rtol=1e-5, atol=1e-5)
