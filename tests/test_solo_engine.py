"""The solo engine (app.py `_Local`): a request alone at pp 1 where the engine loop's steps would
run eager on a GPU (glm4_moe, deepseek_v3, kimi_linear, a head size the paged kernel
does not take: app.py `_alone_on_loop`) keeps it. On the CPU a request alone always runs on the
loop, so these tests make `_alone_on_loop` say no and check the solo engine against the loop:
the same ids for every drafter, greedy and sampled (seeded), and the same span tree shape."""

from __future__ import annotations

import pytest

import memra_dist.app as app
from memra_dist.app import open_engine
from memra_dist.specdec.sampling import SamplingParams

from test_batching import CAP, _cfg, _prompts, _tap_drafter


def _run(model, drafter, reqs, solo: bool, monkeypatch, **kw):
    with monkeypatch.context() as mp:
        mp.setattr(app, "_alone_on_loop", lambda cfg, mcfg: not solo)
        with open_engine(_cfg(model, drafter, **kw), capacity=CAP) as eng:
            assert (eng._backend.__class__.__name__ == "_Local") == solo
            return [eng.generate(p, _cfg(model, drafter, max_new_tokens=n, **kw)).token_ids for p, n in reqs]


@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "dflash", "eagle3", "mtp"])
def test_the_solo_engine_and_the_loop_give_a_request_alone_the_same_ids(llama, draft_llama, tmp_path_factory,
                                                                         monkeypatch, drafter):
    kw = {}
    model = llama
    if drafter == "model":  # (on the loop, its rounds the loop's: draft_model.py propose_many)
        kw["draft_model"] = str(draft_llama)
    if drafter in ("dflash", "eagle3"):
        kw["draft_model"] = str(_tap_drafter(drafter, llama, tmp_path_factory))
    reqs = _prompts(3)
    if drafter == "mtp":  # a glm4_moe target with its MTP layer (a family whose loop steps a GPU runs eager)
        from moe_ckpt import save_moe

        model, _ = save_moe(tmp_path_factory.mktemp("solo-moe") / "glm4_moe", "glm4_moe", layers=2, n_mtp=1, seed=2)
        reqs = [(p[:14], n) for p, n in reqs]
    assert _run(model, drafter, reqs, True, monkeypatch, **kw) == _run(model, drafter, reqs, False, monkeypatch, **kw)


@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "dflash", "eagle3", "mtp"])
def test_sampled_requests_alone_draw_the_same_on_both(llama, draft_llama, tmp_path_factory, monkeypatch, drafter):
    """The solo engine's session draws each draft (`draw_drafts`) and accepts each round
    (`accept_sampled`) request by request; the loop draws a step's drafts on the device and
    accepts its rounds together: the same uniforms from each request's generator, the same ids."""
    reqs, model, kw = _prompts(2), llama, dict(sampling=SamplingParams(temperature=0.8, top_k=20, top_p=0.95), seed=7)
    if drafter == "model":
        kw["draft_model"] = str(draft_llama)
    if drafter in ("dflash", "eagle3"):
        kw["draft_model"] = str(_tap_drafter(drafter, llama, tmp_path_factory))
    if drafter == "mtp":
        from moe_ckpt import save_moe

        model, _ = save_moe(tmp_path_factory.mktemp("solo-smoe") / "glm4_moe", "glm4_moe", layers=2, n_mtp=1, seed=2)
        reqs = [(p[:14], n) for p, n in reqs]
    assert _run(model, drafter, reqs, True, monkeypatch, **kw) == _run(model, drafter, reqs, False, monkeypatch, **kw)


def test_a_request_alone_keeps_the_solo_engine_only_where_the_loops_steps_would_run_eager(monkeypatch):
    """On a GPU: the loop where its steps replay graphs (a llama-like family, a head size the paged
    kernel takes; qwen3's q / k norms ride the rotary kernel), the solo engine elsewhere; on the CPU
    always the loop."""
    from types import SimpleNamespace as NS

    import torch

    import memra_dist.device as device
    from memra_dist.config import RunConfig

    cfg = RunConfig(model="m", drafter="ngram", device="cuda")
    llama = NS(arch="llama", head_dim=128, qk_norm=False)
    monkeypatch.setattr(device, "resolve_device", lambda name: torch.device("cuda"))
    assert app._alone_on_loop(cfg, llama)
    assert not app._alone_on_loop(cfg, NS(arch="kimi_linear", head_dim=128, qk_norm=False))
    assert not app._alone_on_loop(cfg, NS(arch="llama", head_dim=96, qk_norm=False))
    assert app._alone_on_loop(cfg, NS(arch="qwen3", head_dim=128, qk_norm=True))
    assert not app._alone_on_loop(cfg.with_(graphs="off"), llama)
    monkeypatch.setattr(device, "resolve_device", lambda name: torch.device("cpu"))
    assert app._alone_on_loop(cfg, NS(arch="kimi_linear", head_dim=128, qk_norm=False))
