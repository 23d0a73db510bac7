"""An engine serves requests one after another with nothing reloaded: each request's greedy
output equals the same prompt run alone, at pp=1 and pp=2, and the models load once."""

from __future__ import annotations

import pytest

import memra_dist.runner as runner_mod
from memra_dist.app import generate, open_engine
from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.specdec.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 5, 9, 23, 40, 5, 9], [3, 4, 5], [60, 61, 62, 60, 61, 62, 60, 61, 62, 60, 61, 62, 70]]


def _cfg(model, **kw):
    return RunConfig(**{**dict(model=str(model), max_new_tokens=16, device="cpu", k=3), **kw})


def _count_loads(monkeypatch) -> list[int]:
    n = [0]
    real = runner_mod.ModelRunner.__init__

    def counted(self, *a, **k):
        n[0] += 1
        real(self, *a, **k)

    monkeypatch.setattr(runner_mod.ModelRunner, "__init__", counted)
    return n


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_requests_through_one_engine_equal_each_alone(llama, draft_llama, monkeypatch, drafter):
    extra = {"draft_model": str(draft_llama)} if drafter == "model" else {}
    cfg = _cfg(llama, drafter=drafter, **extra)
    alone = [generate(cfg, p).token_ids for p in PROMPTS]
    loads = _count_loads(monkeypatch)
    with open_engine(cfg, capacity=64) as engine:
        got = [engine.generate(p).token_ids for p in PROMPTS]
        got.append(engine.generate(PROMPTS[0], cfg.with_(max_new_tokens=5)).token_ids)
    assert got[:3] == alone
    assert got[3] == alone[0][:5]  # a per-request override, through the same engine
    assert loads[0] == (2 if drafter == "model" else 1)  # the target (and the draft) loaded once


def test_sampled_requests_reproduce_whatever_ran_before(llama, draft_llama):
    cfg = _cfg(llama, draft_model=str(draft_llama), sampling=SamplingParams(temperature=0.9, top_p=0.95), seed=7)
    with open_engine(cfg, capacity=64) as engine:
        a = engine.generate(PROMPTS[0]).token_ids
        engine.generate(PROMPTS[1])
        b = engine.generate(PROMPTS[0]).token_ids
    assert a == b == generate(cfg, PROMPTS[0]).token_ids


def test_a_request_that_does_not_fit_or_changes_the_model_is_refused(llama):
    cfg = _cfg(llama, drafter="ngram")
    with open_engine(cfg, capacity=8) as engine:
        with pytest.raises(UserError, match="longer than the context"):
            engine.generate(list(range(3, 20)))
        with pytest.raises(UserError, match="engine's model"):
            engine.generate([3, 4], cfg.with_(pp=2))
        assert len(engine.generate([3, 4, 5]).token_ids) >= 1  # the engine still serves


def test_pp2_engine_serves_requests_in_turn(ray_local, llama):
    cfg = _cfg(llama, drafter="ngram", pp=2)
    alone = [generate(cfg.with_(pp=1), p).token_ids for p in PROMPTS]
    with open_engine(cfg, capacity=64) as engine:
        got = [engine.generate(p).token_ids for p in PROMPTS]
    assert got == alone
