"""Level 2 on a batched engine's graphed steps: a step holding a level-2 request's rows replays its
bucket's timed twin (batching/graphs.py), the same graph with a clock stamp at every mixer / FFN
boundary, instead of an eager walk drained twice a layer; the request keeps its solo ids and its
verifies their sub-split. On CPU through the Triton interpreter (the paged kernel) and the
re-run graph contract of test_kernels_paged."""

from __future__ import annotations

import pytest

from triton_interp import triton  # noqa: F401 (the interpreter on CPU; skips without Triton)

from memra_dist.app import open_engine
from memra_dist.phase.levels import TraceSettings
from test_ahead import _Bursts
from test_kernels_paged import _cfg, _on_kernels, _Replayed, wide_llama  # noqa: F401 (a fixture)


@pytest.mark.slow  # the Triton interpreter: every replay re-runs the step's kernels
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_a_level2_request_replays_the_timed_twin_with_its_solo_ids_and_sub_split(wide_llama, drafter, monkeypatch):
    from memra_dist.batching.graphs import StepGraphs
    from memra_dist.batching.step_forward import timed_step
    import memra_dist.batching.step_forward as sf

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    with open_engine(_cfg(wide_llama, drafter), capacity=96) as eng:
        solo = eng.generate(prompt, _cfg(wide_llama, drafter, 10)).token_ids
    eager = []
    monkeypatch.setattr(sf, "timed_step", lambda *a: eager.append(1) or timed_step(*a))  # the drained path, counted
    with open_engine(_cfg(wide_llama, drafter), capacity=96, max_batch=2) as eng:
        b = eng._backend.batcher
        _on_kernels(eng._backend)
        b.graphs = StepGraphs(b, b.max_tokens, graph_cls=_Replayed)
        b.graphs.warm(2, (1, 4), 96, twins=True)  # (as an engine opened at level 2 does)
        assert len(b.graphs.twins) == len(b.graphs.steps) > 0
        captured = b.graphs.captures
        sink = _Bursts()
        cfg = _cfg(wide_llama, drafter, 10).with_(trace=TraceSettings(level=2))
        got = eng.generate(prompt, cfg, sink=sink).token_ids
        g = eng._backend.stats()["graphs"]
    assert got == solo
    assert g["captured"] == captured  # every twin the request replayed was captured at open
    rounds = [r for rec in sink.recs for r in rec.live()]
    assert rounds and g["timed_replays"] >= len(rounds) - 1, (g, len(rounds))  # (the prime's last chunk: eager)
    assert len(eager) <= 1, eager  # the prompt's chunk at most
    graphed = [r for r in rounds if r.sub_ns and r.sub_ns.get("attn", 0) > 0]
    assert len(graphed) >= len(rounds) - 1, [r.sub_ns for r in rounds]
    assert all(r.sub_ns["ffn"] > 0 and r.sub_ns["kda"] == r.sub_ns["mla"] == 0 for r in graphed)


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_level2_tap_drafter_requests_are_chained_with_their_solo_ids_and_each_verify_its_steps_laps(
        llama, tmp_path_factory, drafter):
    """Level-2 requests with a tap drafter on a batched engine (CPU: eager steps, each drained by
    layer, laps.py): the step leader runs their rounds and drafts them together as at level 0,
    each gets its solo ids, and every recorded round's verify has its own step's sub-split
    (attention and FFN shares, the round's job's lap timer)."""
    from test_batching import _prompts, _solo, _tap_drafter, traced_batched

    ddir = str(_tap_drafter(drafter, llama, tmp_path_factory))
    reqs = _prompts(4)
    solo = _solo(llama, drafter, reqs, draft_model=ddir)
    sink = _Bursts()  # every request's records
    got, _, stats = traced_batched(llama, drafter, reqs, 2, max_batch=4, sink=sink, draft_model=ddir)
    assert got == solo
    assert stats["chained_rounds"] > 0 and stats["draft_batches"] > 0, stats
    rounds = [r for rec in sink.recs for r in rec.live()]
    assert len(rounds) >= len(reqs) and all(r.sub_ns.get("attn", 0) > 0 and r.sub_ns.get("ffn", 0) > 0
                                            for r in rounds), [r.sub_ns for r in rounds]


def test_a_step_with_a_level2_job_counts_as_captured_only_once_its_timed_twin_is():
    """A verify launched ahead only goes on a captured bucket (a capture would run its rows
    unmoved: verify_ahead.py): for a step holding a level-2 job (a lap timer) that bucket is
    the timed twin the replay will take, not the plain graph."""
    from types import SimpleNamespace

    from memra_dist.batching.graphs import StepGraphs
    from memra_dist.batching.job import Job

    plain = Job(1, [3, 4], 0, 16, False)
    timed = Job(2, [3, 4], 0, 16, False, timer=object())
    g = SimpleNamespace(eligible=lambda jobs: True, _key=lambda jobs: ("bucket",), steps={("bucket",): 1}, twins={})
    assert StepGraphs.captured(g, [plain]) and not StepGraphs.captured(g, [plain, timed])
    g.twins[("bucket",)] = 1
    assert StepGraphs.captured(g, [plain, timed])
