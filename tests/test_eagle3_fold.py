"""The EAGLE-3 head on our kernels (kernels/ops.py install_eagle3, model/eagle3.py step_folded),
run by the Triton interpreter on CPU in fp32: both input norms in one kernel equal the two
reference norms; a folded step (the round's first forward of a few rows, a chained row) equals
the reference step and writes the same K/V; a session drafting through the folded head proposes
exactly the reference head's drafts every round and ends with the same ids."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_dist.demo.tiny_eagle3 import random_eagle3  # noqa: E402
from memra_dist.model.config import load_config  # noqa: E402
from memra_dist.model.eagle3 import load_eagle3_config  # noqa: E402
from memra_dist.model.layers import RMSNorm  # noqa: E402
from memra_dist.runner import ModelRunner  # noqa: E402
from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from memra_dist.specdec.sampling import SamplingParams  # noqa: E402
from memra_dist.specdec.session import SpecSession  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests run on CPU machines")

CPU, F32, CAP = torch.device("cpu"), torch.float32, 96
SHAPE = dict(taps=(0, 1, 3), heads=2, kv_heads=1, head_dim=16, intermediate_size=64, draft_vocab=96)
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


@pytest.fixture(scope="module")
def eagle_dir(llama, tmp_path_factory):
    return random_eagle3(tmp_path_factory.mktemp("eagle3f") / "e", llama, seed=3, **SHAPE)


@pytest.mark.parametrize("keep_b", [False, True])
def test_pair_norm_equals_the_two_reference_norms(keep_b):
    from memra_dist.kernels.pair_norm import pair_rmsnorm

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g) * 4
    na, nb = RMSNorm(40, 1e-5), RMSNorm(40, 1e-6)
    with torch.no_grad():
        na.weight.copy_(torch.rand(40, generator=g) + 0.5)
        nb.weight.copy_(torch.rand(40, generator=g) + 0.5)
        ref_b = nb(b)
        ref = torch.cat((na(a), ref_b), -1)
    y, bn = pair_rmsnorm(a, b, na.weight, nb.weight, na.eps, nb.eps, keep_b)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    if keep_b:
        torch.testing.assert_close(bn, ref_b, rtol=1e-5, atol=1e-5)
    else:
        assert bn is None


def _pair(llama, eagle_dir):
    """(target, reference drafter, folded drafter): the same checkpoint twice."""
    from memra_dist.kernels.ops import install_eagle3

    target = ModelRunner(llama, CPU, F32, max_pos=CAP)
    ec = load_eagle3_config(eagle_dir, load_config(llama))
    ref, fold = Eagle3Drafter.load(eagle_dir, ec, target), Eagle3Drafter.load(eagle_dir, ec, target)
    assert install_eagle3(fold.net) and fold.net.folded and not ref.net.folded
    return target, ref, fold


def test_a_folded_step_equals_the_reference_step_and_writes_the_same_kv(llama, eagle_dir):
    target, ref, fold = _pair(llama, eagle_dir)
    for d in (ref, fold):
        d.alloc(CAP)
    H = ref.ec.base.hidden_size
    outs = {}
    for name, d in (("ref", ref), ("fold", fold)):
        gen = torch.Generator().manual_seed(5)
        toks = torch.randint(0, 100, (9,), generator=gen)
        hid = torch.randn(9, H, generator=gen)
        with torch.inference_mode():
            first = d._rows(toks[:5], hid[:5], torch.arange(0, 5))  # a first forward of 5 rows
            chain = d._rows(toks[5:6], first[-1:], torch.tensor([5]))  # one chained row fed its output
            logits = d.net.logits(chain)
        outs[name] = (first, chain, logits, d.state.k[:6].clone(), d.state.v[:6].clone())
    for a, b in zip(outs["ref"], outs["fold"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # the Triton interpreter: ~6 s on 2 cores (k 2)
@pytest.mark.parametrize("k", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_a_session_drafting_through_the_folded_head_proposes_the_reference_drafts(llama, eagle_dir, k):
    runs = {}
    for name in ("ref", "fold"):
        target, ref, fold = _pair(llama, eagle_dir)
        d = ref if name == "ref" else fold
        rounds = []
        propose = d.propose

        def spy(context, kk, sp, gen, propose=propose, rounds=rounds):
            p = propose(context, kk, sp, gen)
            rounds.append(p.tokens.tolist())
            return p
        d.propose = spy
        s = SpecSession(target, d, SamplingParams(), torch.Generator().manual_seed(0), k)
        ids = [s.start(PROMPT, 24, CAP)]
        while not s.done:
            ids.extend(s.burst(3))
        runs[name] = (ids, rounds, s.stats.accepted)
    assert runs["fold"] == runs["ref"]
    assert len(runs["ref"][1]) >= 5 and len({t for r in runs["ref"][1] for t in r}) > 3  # many rounds, varied drafts


def test_a_head_whose_folded_step_fails_its_probe_drafts_on_the_reference_step(llama, eagle_dir, monkeypatch, capfd):
    """install_eagle3 probes the folded step before any capture: a kernel that cannot build on
    this machine leaves the head on the reference step, with one warning line."""
    from memra_dist.kernels import pair_norm
    from memra_dist.kernels.ops import install_eagle3

    target = ModelRunner(llama, CPU, F32, max_pos=CAP)
    d = Eagle3Drafter.load(eagle_dir, load_eagle3_config(eagle_dir, load_config(llama)), target)

    def broken(*a, **k):
        raise RuntimeError("no assembler here")
    monkeypatch.setattr(pair_norm, "pair_rmsnorm", broken)
    assert install_eagle3(d.net) is False and not d.net.folded
    assert "drafts on the reference step" in capfd.readouterr().err
    d.alloc(CAP)
    with torch.inference_mode():  # the reference step runs over the fused weights
        out = d._rows(torch.tensor([3, 4]), torch.zeros(2, d.ec.base.hidden_size), torch.arange(2))
    assert out.shape == (2, d.ec.base.hidden_size) and torch.isfinite(out).all()
