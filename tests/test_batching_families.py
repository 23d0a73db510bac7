"""Every family batched (memra_dist/batching/): grouped attention with partial rotary and MoE
FFNs (glm4_moe), latent attention (deepseek_v3, kimi_linear's MLA: each request's latent rows
in the paged pool) and linear attention (kimi_linear's KDA: a recurrent state per request):
every request gets exactly the ids it gets alone (CPU, fp32), through prefill chunks,
rollbacks, preemption and sampling, with their MTP layers and draft models."""

from __future__ import annotations

from pathlib import Path

import pytest

from memra_dist.specdec.sampling import SamplingParams

from test_batching import _batched, _crowded, _prompts, _solo, spy_proposals


@pytest.mark.parametrize("arch,drafter,n_mtp", [("glm4_moe", "ngram", 1), ("glm4_moe", "mtp", 1),
                                                ("glm4_moe", "mtp", 2), ("deepseek_v3", "ngram", 1),
                                                ("deepseek_v3", "mtp", 1)])
def test_an_moe_target_batched_with_its_mtp_layers_drafts_and_decodes_as_alone(tmp_path_factory, arch, drafter,
                                                                               n_mtp, monkeypatch):
    """glm4_moe (grouped attention with partial rotary, MoE FFNs) and deepseek_v3 (latent
    attention, MLA: each request's latents in the paged pool, its rows attending over them on
    the arm they take alone) batched: each request's ids are its solo ids, and with its MTP
    layers (the FINAL tap each batched step writes into the request's sink) every proposal
    equals its solo proposal (two MTP layers: each later layer reads the one before's outputs,
    in the step leader's batched chains too)."""
    from moe_ckpt import save_moe

    from memra_dist.specdec.drafters.mtp import MTPDrafter

    path, _ = save_moe(tmp_path_factory.mktemp("bmoe") / arch, arch, layers=2, n_mtp=n_mtp, seed=2)
    seen = spy_proposals(monkeypatch, MTPDrafter)
    reqs = [(p[:14], n) for p, n in _prompts(6)]
    solo = _solo(path, drafter, reqs)
    alone, seen[:] = sorted(seen), []
    batched, stats = _batched(path, drafter, reqs, max_batch=3)
    assert batched == solo and sorted(seen) == alone
    assert drafter != "mtp" or (len(alone) > 20 and stats["draft_batches"] > 0)  # MTP: batched chains
    assert stats["max_requests"] >= 2 and stats["kv_blocks_used"] == 0, stats


@pytest.mark.parametrize("n_mtp", [1, 2])
def test_sampled_requests_with_their_mtp_layers_draft_together_as_alone(tmp_path_factory, monkeypatch, n_mtp):
    """Sampled MTP requests (glm4_moe) drafted by the step leader as batched chains: each step's
    draft drawn with its own request's generator and fed to its next step, accepted with it on
    the step's logits: every proposal and every id as alone. One MTP layer: its K/V in the draft
    pool, each chain step one batched step over it (mtp_pool_graph.py `pooled_step`); two: each
    request's own caches."""
    from moe_ckpt import save_moe

    import memra_dist.specdec.drafters.mtp_batch as mb
    from memra_dist.specdec.drafters.mtp import MTPDrafter

    path, _ = save_moe(tmp_path_factory.mktemp("bmtps") / "glm", "glm4_moe", layers=2, n_mtp=n_mtp, seed=2)
    kw = dict(sampling=SamplingParams(temperature=0.9, top_k=30), seed=7)
    seen = spy_proposals(monkeypatch, MTPDrafter)
    pooled, real = [], mb.pooled_step
    monkeypatch.setattr(mb, "pooled_step", lambda *a, **k: pooled.append(a[8]) or real(*a, **k))
    reqs = [(p[:14], n) for p, n in _prompts(6)]
    solo = _solo(path, "mtp", reqs, **kw)
    alone, seen[:] = sorted(seen), []
    batched, stats = _batched(path, "mtp", reqs, max_batch=3, **kw)
    assert batched == solo and sorted(seen) == alone and len(alone) > 20
    assert stats["draft_batches"] > 0 and stats["kv_blocks_used"] == 0, stats
    assert (len(pooled) > 0) == (n_mtp == 1) and (n_mtp == 2 or any(len(x) > 1 for x in pooled)), pooled[:5]


def test_a_latent_attention_target_preempted_and_sampled_loses_nothing(tmp_path_factory):
    """deepseek_v3 (MLA) with prompts of two prefill chunks (the prefix arm over gathered
    latents), four requests admitted together into a pool that holds their prompts but not
    their growth (latent rows swapped to host and back, bitwise) and sampled requests (their
    own generators): every request's ids are its solo ids."""
    from moe_ckpt import save_moe

    import torch

    from memra_dist.batching.paged import PagedKV, PagedLatent

    path, _ = save_moe(tmp_path_factory.mktemp("bds") / "ds", "deepseek_v3", layers=2, n_mtp=1, seed=3)
    path = _no_eos(Path(path), tmp_path_factory.mktemp("bds") / "ds-no-eos")
    reqs, kv_rows = _crowded(longest=58)
    assert max(len(p) for p, _ in reqs) > 40  # two prefill chunks of 40
    kw = dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=11)
    solo = _solo(path, "ngram", reqs, **kw)
    seen = {}

    def on_open(e):
        b = e._backend.batcher
        seen["kinds"] = {type(v) for v in b.kv.layers.values()}
        seen["row"] = PagedKV.row_bytes(b.stage, torch.float32)
        seen["want"] = sum(4 * (blk.self_attn.rank + blk.self_attn.dr) for blk in b.stage.layers.values())
    batched, stats = _batched(path, "ngram", reqs, max_batch=6, kv_rows=kv_rows, on_open=on_open, gate=True, **kw)
    assert batched == solo
    assert seen["kinds"] == {PagedLatent}
    assert seen["row"] == seen["want"]  # a slot holds a latent and a shared rotary key row per layer
    assert stats["preemptions"] >= 1 and stats["kv_blocks_used"] == 0, stats


def _no_eos(path, to):
    """A copy of checkpoint `path` whose config names no EOS token: a sampled request runs to its
    max_new (where an EOS drawn early would end it, `_crowded`'s requests might all fit without a
    preemption, depending on the threads' timing)."""
    import json
    import shutil

    out = shutil.copytree(path, to)
    conf = json.loads((out / "config.json").read_text())
    conf["eos_token_id"] = None
    (out / "config.json").write_text(json.dumps(conf))
    return out


@pytest.mark.parametrize("drafter,sampled", [("ngram", False), ("ngram", True), ("none", False), ("model", False)])
def test_a_linear_attention_target_batched_gets_its_solo_ids(drafter, sampled, tmp_path):
    """kimi_linear (KDA layers, a recurrent state per request, beside MLA layers in the paged
    pool): prompts over the recurrent form's rows (the chunked scan) and two prefill chunks,
    rollbacks on rejected drafts (each request's state rolled back at its next forward), four
    requests admitted together into a pool that must preempt one (the latent rows swapped, the
    states kept): every request's ids are its solo ids, and every state goes when its request
    does."""
    from kimi_ckpt import hybrid

    from memra_dist.batching.paged import RecurrentStates

    _, path, draft = hybrid()  # the draft model: kimi_linear too (its own batcher's states)
    reqs, kv_rows = _crowded(longest=58)
    kw = dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=11) if sampled else {}
    path = _no_eos(Path(path), tmp_path / "k") if sampled else path
    if drafter == "model":
        kw["draft_model"] = draft
    solo = _solo(path, drafter, reqs, **kw)
    layers = []
    batched, stats = _batched(path, drafter, reqs, max_batch=6, kv_rows=kv_rows, gate=True,
                              on_open=lambda e: layers.extend(e._backend.batcher.kv.layers.values()), **kw)
    assert batched == solo
    states = [v for v in layers if isinstance(v, RecurrentStates)]
    assert len(states) == 3 and all(not s.of for s in states)  # the three KDA layers; every request's state gone
    assert stats["max_requests"] >= 2 and stats["kv_blocks_used"] == 0, stats
    assert stats["preemptions"] >= 1, stats
