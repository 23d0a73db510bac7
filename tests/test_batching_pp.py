"""Batched speculative decoding at pp > 1 (pipeline/batch_head.py, pipeline/batch_stage.py): the
head's batcher joins the requests' rows into one step that walks the ring (a local Ray, CPU
actors), every stage over a paged pool of the head's geometry. Every request gets exactly the
ids it gets alone at pp = 1 (CPU, fp32), with every drafter: its drafts too, shown by each
request's drafted and accepted counts equal to its solo run's (a tap drafter fed a wrong tap
row drafts otherwise); through prefill chunks, rollbacks, sampling and preemption."""

from __future__ import annotations

import threading

import pytest

from memra_dist.app import open_engine
from memra_dist.specdec.sampling import SamplingParams

from test_batching import CAP, _cfg, _crowded, _five_clients, _prompts, _tap_drafter


def _runs(model, drafter, reqs, pp=1, max_batch=1, kv_rows=None, **kw):
    """Each request's (ids, drafted, accepted): one after another on an unbatched engine at pp = 1,
    or from concurrent threads on a batched one; and the engine's batch stats."""
    got: dict[int, tuple] = {}
    errors: list = []
    with open_engine(_cfg(model, drafter, pp=pp, **kw), capacity=CAP, max_batch=max_batch, kv_rows=kv_rows) as eng:
        def one(i, p, n):
            try:
                r = eng.generate(p, _cfg(model, drafter, pp=pp, max_new_tokens=n, **kw))
                got[i] = (r.token_ids, r.stats["drafted"], r.stats["accepted"])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        if max_batch == 1:
            for i, (p, n) in enumerate(reqs):
                one(i, p, n)
        else:
            threads = [threading.Thread(target=one, args=(i, p, n), daemon=True) for i, (p, n) in enumerate(reqs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
        stats = eng.batch_stats()
    assert not errors, errors
    return [got[i] for i in range(len(reqs))], stats


@pytest.mark.parametrize("pp,drafter", [(2, "none"), (2, "ngram"), (2, "model"), (3, "none"), (3, "ngram"),
                                        (3, "model")])
def test_requests_batched_down_the_ring_get_their_solo_ids_and_drafts(ray_local, llama, draft_llama, pp, drafter):
    """Twelve requests of 3 to 58 prompt tokens (two prefill chunks of 40 for the long ones) and
    5 to 40 new tokens, six at a time, ending in the middle of others and admitted while others
    decode."""
    kw = dict(draft_model=str(draft_llama)) if drafter == "model" else {}
    reqs = _prompts(12)
    solo, _ = _runs(llama, drafter, reqs, **kw)
    batched, stats = _runs(llama, drafter, reqs, pp=pp, max_batch=6, **kw)
    assert batched == solo
    assert stats["max_requests"] >= 2 and stats["eager_steps"] == stats["steps"], stats
    assert stats["kv_blocks_used"] == 0, stats


def test_sampled_requests_batched_down_the_ring_keep_their_generators(ray_local, llama):
    kw = dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=11)
    reqs = _prompts(6)
    solo, _ = _runs(llama, "ngram", reqs, **kw)
    batched, _ = _runs(llama, "ngram", reqs, pp=2, max_batch=3, **kw)
    assert batched == solo


@pytest.mark.parametrize("pp,drafter", [(2, "dflash"), (2, "eagle3"), (3, "dflash"), (3, "eagle3")])
def test_tap_drafters_batched_down_the_ring_read_their_own_taps(ray_local, llama, tmp_path_factory, pp, drafter):
    """The tapped layers' rows of every request ride behind the step's hidden rows from the
    stage that holds them to the head, into each request's own sink: every request drafts and
    accepts what it does alone (pp 2: taps 0 (and 1) on stage 0, the rest on the head; pp 3: the
    4 layers as 2 / 1 / 1, so a middle stage passes stage 0's taps on with its own). The
    random DFlash drafter accepts some drafts, so a wrong tap row would change its counts; the
    random EAGLE-3 head accepts none, so its case shows the ring's taps do not break it."""
    ddir = _tap_drafter(drafter, llama, tmp_path_factory)
    reqs = _prompts(6)
    solo, _ = _runs(llama, drafter, reqs, draft_model=str(ddir))
    batched, stats = _runs(llama, drafter, reqs, pp=pp, max_batch=3, draft_model=str(ddir))
    assert batched == solo
    assert sum(d for _, d, _ in solo) > 30 and (drafter != "dflash" or any(a for _, _, a in solo))
    assert stats["max_requests"] >= 2 and stats["draft_batches"] > 0, stats  # the head's leader drafts them together


@pytest.mark.parametrize("pp", [2, 3])
def test_mtp_batched_down_the_ring_drafts_from_the_final_tap(ray_local, tmp_path_factory, pp):
    """glm4_moe's MTP layer reads the final norm's rows (the head's own tap) and decodes as alone."""
    from moe_ckpt import save_moe

    path, _ = save_moe(tmp_path_factory.mktemp("ppmtp") / "glm", "glm4_moe", layers=3, n_mtp=1, seed=2)
    reqs = [(p[:14], n) for p, n in _prompts(5)]
    solo, _ = _runs(path, "mtp", reqs)
    batched, stats = _runs(path, "mtp", reqs, pp=pp, max_batch=3)
    assert batched == solo and sum(d for _, d, _ in solo) > 10
    assert stats["draft_batches"] > 0, stats


@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_linear"])
def test_latent_and_linear_attention_batched_down_the_ring(ray_local, tmp_path_factory, arch):
    """Latent rows (MLA) in every stage's pool, a recurrent state per request on each stage
    that holds a KDA layer (made at its first step there, gone at its end)."""
    if arch == "kimi_linear":
        from kimi_ckpt import hybrid

        _, path, _ = hybrid()
    else:
        from moe_ckpt import save_moe

        path, _ = save_moe(tmp_path_factory.mktemp("ppds") / "ds", "deepseek_v3", layers=2, n_mtp=1, seed=3)
    reqs = _prompts(5)
    solo, _ = _runs(path, "ngram", reqs)
    batched, stats = _runs(path, "ngram", reqs, pp=2, max_batch=3)
    assert batched == solo
    assert stats["max_requests"] >= 2 and stats["kv_blocks_used"] == 0, stats


def test_a_request_preempted_down_the_ring_comes_back_on_every_stage(ray_local, llama):
    """A pool that holds four requests' prompts but not their growth (`_crowded`): a growth
    swaps a request out on every rank (its rows to each stage's host memory) and back into new
    blocks; every request's ids are its solo ids. The head cannot be gated from here, so a run
    that happened to admit the requests one after another (no preemption) is run once more."""
    reqs, kv_rows = _crowded()
    solo, _ = _runs(llama, "ngram", reqs)
    for _ in range(3):
        batched, stats = _runs(llama, "ngram", reqs, pp=2, max_batch=4, kv_rows=kv_rows)
        assert batched == solo
        assert stats["kv_blocks_used"] == 0, stats
        if stats["preemptions"]:
            break
    assert stats["preemptions"] >= 1, stats


def test_served_requests_batched_down_the_ring_get_their_solo_completions(ray_local, llama):
    """`serve --pp 2 --max-batch 3`'s engine host behind the HTTP API: five concurrent clients,
    each completion the one the one-at-a-time server at pp = 1 gives."""
    from memra_dist.config import RunConfig
    from memra_dist.serve.host import EngineHost

    def serve(pp, max_batch):
        host = EngineHost(RunConfig(model=str(llama), drafter="ngram", k=3, device="cpu", dtype="fp32", ctx=CAP,
                                    pp=pp), None, max_batch=max_batch)
        stats = {}
        try:
            assert host.sessions == max_batch
            texts = _five_clients(host, lambda h: stats.update(h.engine.batch_stats() or {}))
        finally:
            host.close()
        return texts, stats

    solo, _ = serve(1, 1)
    batched, stats = serve(2, 3)
    assert all(solo) and batched == solo
    assert stats["max_requests"] >= 2, stats


@pytest.mark.slow  # a CLI process with its own Ray
@pytest.mark.parametrize("level", [1, 2])
def test_each_batch_step_down_the_ring_is_a_stage_span_on_every_rank(llama, tmp_path, level):
    """`batch --pp 2 --max-batch 3 --trace-level 1|2`: every rank records its part of each batch
    step as one stage.forward span (phase "batch", the step's id, requests and rows), inside the
    trace of a request that rode the step, so "which stage is the bottleneck" reads across the
    ranks for batched steps too; each request keeps its own spec.round spans, and at level 2 each
    step has its verify sub-split once, under its batch.step span (the stages' laps ride back with
    the step's rows); the job ends with the
    share table of all its rounds."""
    import json
    import re
    import subprocess
    import sys

    from test_trace_pipeline import _attr, _env, _spans_by_role

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": "the phase clock drains " * (1 + i % 3),
                                       "max_new_tokens": 8 + 3 * i}) + "\n" for i in range(5)))
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "memra_dist.cli", "batch", "--model", str(llama), "--input", str(inp),
                        "--output", str(tmp_path / "out.jsonl"), "--device", "cpu", "--pp", "2", "--max-batch", "3",
                        "--trace-level", str(level), "--run-dir", str(run_dir)],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = int(re.search(r"\[batch\] batched: (\d+) steps", p.stderr).group(1))
    spans = _spans_by_role(run_dir)
    traces = {s["traceId"] for s in spans["driver"] if s["name"] == "memra.request"}
    assert len(traces) == 5
    for role, stage in (("stage", 0), ("head", 1)):
        fw = [s for s in spans[role] if s["name"] == "stage.forward"]
        assert sorted(_attr(s, "memra.batch.step") for s in fw) == list(range(steps)), role
        assert all(_attr(s, "memra.phase") == "batch" and _attr(s, "memra.stage") == stage for s in fw)
        assert all(_attr(s, "memra.rows") == _attr(s, "memra.batch.rows") >= _attr(s, "memra.batch.requests") >= 1
                   for s in fw)
        assert {s["traceId"] for s in fw} <= traces and len({s["traceId"] for s in fw}) >= 2
    rounds = [s for s in spans["head"] if s["name"] == "spec.round"]
    assert {s["traceId"] for s in rounds} == traces
    subs = [s for s in spans["head"] if s["name"] in ("spec.verify.attn", "spec.verify.ffn")]
    if level == 2:  # the step's sub-split (its stages' laps), once a step, under its batch.step span
        step_spans = {s["spanId"] for s in spans["head"] if s["name"] == "batch.step"}
        parents = [s["parentSpanId"] for s in subs]
        assert subs and set(parents) <= step_spans and len(subs) == 2 * len(set(parents)), (len(subs), len(step_spans))
        assert len(set(parents)) >= len(step_spans) // 2  # (a step whose rounds had no laps: a prompt's chunk)
    else:
        assert not subs
    # the job's share table: every request's rounds together, as generate prints one request's
    assert f"phase shares over {len(rounds)} speculative rounds" in p.stderr, p.stderr[-2000:]
