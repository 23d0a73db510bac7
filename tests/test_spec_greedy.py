"""Greedy speculative output is token-identical to plain greedy decoding, for every drafter
and K, including rounds where nothing is accepted and rounds where everything is."""

from __future__ import annotations

import pytest
import torch

from memra_dist.config import RunConfig
from memra_dist.runner import ModelRunner
from memra_dist.phase.levels import TraceSettings
from memra_dist.phase.report import LineSink
from memra_dist.app import generate
from memra_dist.specdec.drafters import ReplayDrafter
from memra_dist.specdec.session import SpecSession
from memra_dist.specdec.sampling import SamplingParams

N_NEW = 40
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # repetitive: the n-gram drafter finds matches


@pytest.fixture(scope="module")
def plain(llama):
    res = generate(RunConfig(model=str(llama), drafter="none", max_new_tokens=N_NEW, device="cpu"), PROMPT)
    assert len(res.token_ids) == N_NEW and res.stats["drafted"] == 0
    assert res.stats["rounds"] == N_NEW - 1  # one verify row per round
    return res.token_ids


def _reference_greedy(d, n):
    """Plain greedy by hand, outside the session (full re-prefill each step)."""
    r = ModelRunner(d, torch.device("cpu"), torch.float32, max_pos=128)
    r.alloc(len(PROMPT) + n + 1)
    ids, out = list(PROMPT), []
    for _ in range(n):
        t = int(r.forward(torch.tensor(ids), 0)[-1].argmax())
        out.append(t)
        ids.append(t)
    return out


def test_plain_session_is_plain_greedy(llama, plain):
    assert plain == _reference_greedy(llama, N_NEW)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("drafter", ["model", "ngram", "replay"])
def test_greedy_speculative_equals_plain(llama, draft_llama, plain, drafter, k):
    cfg = RunConfig(model=str(llama), drafter=drafter, k=k, max_new_tokens=N_NEW, device="cpu",
                    draft_model=str(draft_llama) if drafter == "model" else None, replay_corrupt=0.3,
                    burst_rounds=3)
    res = generate(cfg, PROMPT)
    assert res.token_ids == plain
    st = res.stats
    assert st["tokens"] == N_NEW
    assert 0 <= st["accepted"] <= st["drafted"] <= k * st["rounds"]
    assert st["drafted"] > 0, "the drafter never proposed: the test would not test speculation"
    if drafter == "replay":  # 30 % corruption: some drafts accepted, some rejected
        assert 0 < st["accepted"] < st["drafted"]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_nothing_accepted_still_exact(llama, plain, k):
    """corrupt=1.0: every drafted token is wrong, every round rejects at position 0."""
    cfg = RunConfig(model=str(llama), drafter="replay", k=k, max_new_tokens=N_NEW, device="cpu", replay_corrupt=1.0)
    res = generate(cfg, PROMPT)
    assert res.token_ids == plain
    assert res.stats["drafted"] > 0 and res.stats["accepted"] == 0
    assert res.stats["rounds"] == N_NEW - 1


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_everything_accepted_still_exact(llama, plain, k):
    """corrupt=0.0: the recording is the target's own greedy continuation: acceptance 1.0,
    every round commits k + 1 tokens (bar the last, capped by max-new-tokens)."""
    cfg = RunConfig(model=str(llama), drafter="replay", k=k, max_new_tokens=N_NEW, device="cpu", replay_corrupt=0.0)
    res = generate(cfg, PROMPT)
    assert res.token_ids == plain
    assert res.stats["acceptance"] == 1.0 and res.stats["drafted"] == res.stats["accepted"] > 0
    assert res.stats["rounds"] == -(-(N_NEW - 1) // (k + 1))  # ceil


@pytest.mark.parametrize("k", [2, 8])
def test_model_drafter_identical_to_target_accepts_everything(llama, plain, k):
    """The target as its own drafter: the draft cache and its rollback agree with the target."""
    cfg = RunConfig(model=str(llama), draft_model=str(llama), k=k, max_new_tokens=N_NEW, device="cpu")
    res = generate(cfg, PROMPT)
    assert res.token_ids == plain
    assert res.stats["acceptance"] == 1.0


def test_mixed_rounds_within_one_run(llama, plain):
    """One run that has full-accept rounds, zero-accept rounds and partial ones (checked per
    round through the profile's round log), still exact."""
    target = ModelRunner(llama, torch.device("cpu"), torch.float32, max_pos=128)
    drafter = ReplayDrafter(plain, len(PROMPT), 128, corrupt=0.25, seed=3)
    lines = []

    class Out:
        def write(self, s):
            lines.append(s)

        def flush(self):
            pass

    s = SpecSession(target, drafter, SamplingParams(), torch.Generator().manual_seed(0), 4,
                    TraceSettings(level=0, prof=True), LineSink(TraceSettings(prof=True), out=Out()))
    out = [s.start(PROMPT, N_NEW, len(PROMPT) + N_NEW + 5)]
    while not s.done:
        out += s.burst(4)
    assert out == plain
    js = [(r.k, r.j) for r in s.log.rounds]
    assert any(k > 0 and j == k for k, j in js)
    assert any(k > 0 and j == 0 for k, j in js)
    assert any(0 < j < k for k, j in js)
