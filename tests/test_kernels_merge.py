"""The one-pass merge of a prefill chunk's two attention parts (memra_dist/kernels/merge.py)
against the torch ops it replaces (model/prefix_attention.py `merge_parts`), on Triton's
interpreter here (its GPU check: benchmarks/kernels_gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from memra_dist.kernels.merge import merge_attention
from memra_dist.model.prefix_attention import merge_parts


def _parts(nh: int, T: int, d: int, dtype, layout: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def out():
        if layout == "bshd":  # (1, T, nh, d) memory seen as (1, nh, T, d): what cuDNN hands back
            return torch.randn(1, T, nh, d, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(1, nh, T, d, generator=g).to(dtype)

    # log-sum-exps far apart too (one part's keys dominate: a weight of exp(-40))
    lse = lambda: (torch.randn(1, nh, T, generator=g) * 20).float()  # noqa: E731
    return out(), lse(), out(), lse()


@pytest.mark.parametrize("nh,T,d,dtype,layout", [
    (4, 7, 16, torch.float32, "bshd"), (6, 5, 24, torch.float32, "bhsd"),  # heads / dims not powers of two
    (4, 9, 32, torch.bfloat16, "bshd"), (2, 0, 16, torch.bfloat16, "bhsd")])
def test_the_merge_equals_the_torch_ops(nh, T, d, dtype, layout):
    o1, l1, o2, l2 = _parts(nh, T, d, dtype, layout)
    got = merge_attention(o1, l1, o2, l2, dtype)
    want = merge_parts(o1, l1, o2, l2, dtype)
    assert got.shape == want.shape == (T, nh, d) and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # both round the same fp32 value once: at most one bf16 step apart where fp32 sums differ
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def test_the_merge_is_the_softmax_over_both_key_sets():
    """What the merge stands for: attention over keys [A; B] from attention over A and over B."""
    g = torch.Generator().manual_seed(3)
    nh, T, S1, S2, d = 2, 5, 6, 4, 16
    q, k, v = (torch.randn(nh, T, d, generator=g), torch.randn(nh, S1 + S2, d, generator=g),
               torch.randn(nh, S1 + S2, d, generator=g))

    def part(ks, vs):
        s = q @ ks.transpose(-1, -2)
        return (s.softmax(-1) @ vs)[None], s.logsumexp(-1)[None]

    o1, l1 = part(k[:, :S1], v[:, :S1])
    o2, l2 = part(k[:, S1:], v[:, S1:])
    whole = ((q @ k.transpose(-1, -2)).softmax(-1) @ v).transpose(0, 1)
    torch.testing.assert_close(merge_attention(o1, l1, o2, l2, torch.float32), whole, rtol=1e-5, atol=1e-5)


def test_the_install_builds_the_merge_and_switches_the_arm_or_keeps_the_torch_ops(llama, monkeypatch, capsys):
    """kernels/ops.py builds the merge once at install and only then points the prefix arm at it;
    a build that fails leaves the torch ops, with one warning (the engine runs, slower)."""
    import memra_dist.kernels.merge as km
    from memra_dist.kernels import ops
    from memra_dist.model import prefix_attention as pa
    from memra_dist.runner import ModelRunner

    stage = ModelRunner(str(llama), torch.device("cpu"), torch.float32, max_pos=64).stage
    monkeypatch.setattr(pa, "FUSED_MERGE", False)
    ops._warm_merge(stage)  # a CPU stage: nothing merges there
    assert pa.FUSED_MERGE is False
    built = []
    real = km.merge_attention
    monkeypatch.setattr(km, "merge_attention", lambda *a: built.append(a[0].shape) or real(*a))
    ops._warm_merge(stage, on=("cpu",))
    attn = stage.layers["0"].self_attn
    assert pa.FUSED_MERGE is True and built == [(1, attn.nh, 1, attn.hd)]
    o1, l1, o2, l2 = _parts(attn.nh, 5, attn.hd, torch.float32, "bshd")
    assert torch.equal(pa._merge(o1, l1, o2, l2, torch.float32), real(o1, l1, o2, l2, torch.float32))

    def broken(*a):
        raise RuntimeError("PTX assembly failed\nmore")

    monkeypatch.setattr(pa, "FUSED_MERGE", False)
    monkeypatch.setattr(km, "merge_attention", broken)
    ops._warm_merge(stage, on=("cpu",))
    assert pa.FUSED_MERGE is False
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "RuntimeError: PTX assembly failed" in err and "torch ops" in err
    torch.testing.assert_close(pa._merge(o1, l1, o2, l2, torch.float32), pa.merge_parts(o1, l1, o2, l2, torch.float32))
