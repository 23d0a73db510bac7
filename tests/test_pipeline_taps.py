"""Taps across a pipeline split: each stage keeps its own layers' taps and ships them, with
every earlier stage's, behind its activations; the head writes them into its sink and runs
a drafter that reads the target's hidden states (DFlash) as at pp=1. With taps on different
stages (pp 2 and 3) and sessions in flight, the drafts are the pp=1 drafts exactly: the same
rounds, drafted and accepted counts, and greedy output identical to plain decoding."""

from __future__ import annotations

import threading

import pytest

from memra_dist.app import generate, open_engine
from memra_dist.config import RunConfig
from memra_dist.model.taps import FINAL, shipped_before, stage_taps
from memra_dist.demo.tiny_dflash import random_dflash

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42, 43, 40, 41, 42], [3, 9, 27]]
N_NEW = 24
# taps on layers 0 and 2 of the 4-layer tiny llama: pp=2 -> stage 0 ships layer 0, the head
# holds layer 2; pp=3 -> stages 0 and 1 each ship one (the head holds none of its own)
SHAPE = dict(layers=2, block_size=4, taps=(2, 0), mask_token_id=1, heads=2, kv_heads=1, head_dim=16,
             intermediate_size=64)


@pytest.fixture(scope="module")
def dflash_dir(llama, tmp_path_factory):
    return random_dflash(tmp_path_factory.mktemp("dflash") / "d", llama, seed=5, std=0.5, **SHAPE)


def _cfg(llama, ddir, **kw):
    # fixed K at every pp (at pp 1 --spec-k auto would choose K from the measured step times)
    return RunConfig(**{**dict(model=str(llama), drafter="dflash", draft_model=str(ddir), k=3, spec_k="fixed",
                               max_new_tokens=N_NEW, device="cpu", burst_rounds=3), **kw})


@pytest.fixture(scope="module")
def at_pp1(llama, dflash_dir):
    return [generate(_cfg(llama, dflash_dir), p) for p in PROMPTS]


def _counts(res):
    return {k: res.stats[k] for k in ("rounds", "drafted", "accepted")}


def test_pp1_reference_is_plain_decoding(llama, at_pp1):
    plain = [generate(RunConfig(model=str(llama), drafter="none", max_new_tokens=N_NEW, device="cpu"), p).token_ids
             for p in PROMPTS]
    assert [r.token_ids for r in at_pp1] == plain


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_taps_give_the_pp1_drafts(ray_local, llama, dflash_dir, at_pp1, pp):
    with open_engine(_cfg(llama, dflash_dir, pp=pp), capacity=64, sessions=2) as engine:
        got: list = [None] * len(PROMPTS)

        def run(i):
            got[i] = engine.generate(PROMPTS[i])

        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    for mine, ref in zip(got, at_pp1):
        assert mine.token_ids == ref.token_ids
        assert _counts(mine) == _counts(ref)


@pytest.mark.slow  # the demo's trained target and DFlash drafter (cached; ~25 s to train on a fresh machine)
def test_trained_drafter_accepts_as_much_through_the_pipeline(ray_local):
    """A drafter that really accepts (0.9+): a wrong shipped column, order or position would
    change its drafts and so the accepted count; the pipeline's counts equal pp=1's."""
    from memra_dist.app import DEMO_PROMPT
    from memra_dist.demo.tiny import demo_checkpoints
    from memra_dist.demo.tiny_dflash import demo_dflash_dir
    from memra_dist.model.tokenizer import load_tokenizer

    target, _ = demo_checkpoints()
    ddir = demo_dflash_dir(target)
    ids = load_tokenizer(str(target)).encode(DEMO_PROMPT)
    cfg = RunConfig(model=str(target), drafter="dflash", draft_model=str(ddir), k=4, max_new_tokens=48, device="cpu", spec_k="fixed")
    ref = generate(cfg, ids)
    assert ref.stats["accepted"] >= 0.5 * ref.stats["drafted"] > 0
    for pp, bounds in ((2, None), (3, (1, 2))):  # tap 1 on stage 0 / on stage 1; tap 3 on the head
        got = generate(cfg.with_(pp=pp, stage_bounds=bounds), ids)
        assert got.token_ids == ref.token_ids
        assert _counts(got) == _counts(ref), pp


def test_tap_columns_by_stage():
    stages = [(0, 2), (2, 3), (3, 4)]
    taps = (2, 0, 3, FINAL)
    assert [stage_taps(taps, stages, s) for s in range(3)] == [(0,), (2,), (3, FINAL)]
    assert [shipped_before(taps, stages, s) for s in range(3)] == [(), (0,), (0, 2)]


@pytest.mark.slow  # the session's trained glm4_moe + MTP layer (`tiny_mtp`, ~45 s once)
def test_mtp_through_the_pipeline_drafts_as_at_pp1(ray_local, tiny_mtp):
    """The MTP drafter reads the head's own FINAL tap (the last stage owns the final norm) and
    the target's embedding (loaded on the head): the same drafts as pp=1, sessions in flight."""
    from memra_dist.app import DEMO_PROMPT
    from memra_dist.model.tokenizer import load_tokenizer

    target = tiny_mtp[0]
    ids = load_tokenizer(str(target)).encode(DEMO_PROMPT)
    cfg = RunConfig(model=str(target), drafter="mtp", k=3, max_new_tokens=40, device="cpu", spec_k="fixed")
    ref = generate(cfg, ids)
    assert ref.stats["accepted"] >= 0.5 * ref.stats["drafted"] > 0
    for pp in (2, 3):  # 4 layers: the MoE layers (1..3) spread over the stages; the MTP layer on the head
        with open_engine(cfg.with_(pp=pp), capacity=96, sessions=2) as engine:
            got = engine.generate(ids)
        assert got.token_ids == ref.token_ids, pp
        assert _counts(got) == _counts(ref), pp


@pytest.mark.slow  # the demo's trained target and EAGLE-3 drafter (cached; ~25 s to train on a fresh machine)
def test_eagle3_through_the_pipeline_drafts_as_at_pp1(ray_local):
    """EAGLE-3's three taps (low / mid / high layers) split over the stages: the same drafts
    as pp=1, with sessions in flight."""
    from memra_dist.app import DEMO_PROMPT
    from memra_dist.demo.tiny import demo_checkpoints
    from memra_dist.demo.tiny_eagle3 import demo_eagle3_dir
    from memra_dist.model.tokenizer import load_tokenizer

    target, _ = demo_checkpoints()
    ddir = demo_eagle3_dir(target)
    tok = load_tokenizer(str(target))
    prompts = [tok.encode(DEMO_PROMPT), tok.encode("The phase clock")]
    cfg = RunConfig(model=str(target), drafter="eagle3", draft_model=str(ddir), k=4, max_new_tokens=40, device="cpu", spec_k="fixed")
    refs = [generate(cfg, p) for p in prompts]
    assert refs[0].stats["accepted"] >= 0.5 * refs[0].stats["drafted"] > 0
    for pp, bounds in ((2, None), (3, (1, 3))):
        with open_engine(cfg.with_(pp=pp, stage_bounds=bounds), capacity=96, sessions=2) as engine:
            got: list = [None, None]

            def run(i):
                got[i] = engine.generate(prompts[i])

            ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        for mine, ref in zip(got, refs):
            assert mine.token_ids == ref.token_ids, pp
            assert _counts(mine) == _counts(ref), pp
