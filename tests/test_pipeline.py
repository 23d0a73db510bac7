"""The ppN split on CPU with a real local Ray: token-identical to pp=1, no leaks, one trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.app import generate
from memra_dist.specdec.sampling import SamplingParams

PROMPT = [5, 9, 17, 5, 9, 23, 40, 5, 9]

pytestmark = pytest.mark.slow  # every test here runs a local Ray (pp > 1)


def _cfg(model, **kw):
    base = dict(model=str(model), max_new_tokens=16, device="cpu", k=3)
    return RunConfig(**{**base, **kw})


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_greedy_pp_token_identical(ray_local, llama, draft_llama, drafter):
    from memra_dist.app import generate

    extra = {"draft_model": str(draft_llama)} if drafter == "model" else {}
    ref = generate(_cfg(llama, drafter=drafter, **extra), PROMPT).token_ids
    for pp in (2, 3):
        got = generate(_cfg(llama, drafter=drafter, pp=pp, **extra), PROMPT).token_ids
        assert got == ref, f"pp={pp} drafter={drafter}"


def test_long_prompt_ids_travel_as_a_payload(ray_local, llama):
    """A prefill longer than a command holds (transport.INLINE_IDS) sends its ids after the
    command; decode and verify steps carry theirs inside it. Both at pp=2, token-identical."""
    from memra_dist.app import generate
    from memra_dist.pipeline.transport import INLINE_IDS

    prompt = (PROMPT * 8)[: INLINE_IDS + 7]
    assert len(prompt) > INLINE_IDS
    ref = generate(_cfg(llama, drafter="ngram"), prompt).token_ids
    assert generate(_cfg(llama, drafter="ngram", pp=2), prompt).token_ids == ref


def test_pp4_on_cpu_token_identical(ray_local, llama, draft_llama):
    """Four stage actors (one layer each) + the head: the CPU share of the pp=4 issue."""
    from memra_dist.app import generate

    for drafter, extra in (("ngram", {}), ("model", {"draft_model": str(draft_llama)})):
        ref = generate(_cfg(llama, drafter=drafter, **extra), PROMPT).token_ids
        assert generate(_cfg(llama, drafter=drafter, pp=4, **extra), PROMPT).token_ids == ref


def test_greedy_pp_matches_transformers(ray_local, ckpt_factory):
    import torch

    from memra_dist.app import generate

    path, model = ckpt_factory("qwen3")
    got = generate(_cfg(path, drafter="ngram", pp=2, max_new_tokens=12), PROMPT).token_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
    assert got == ref


def test_sampled_identical_across_pp(ray_local, llama, draft_llama):
    from memra_dist.app import generate

    sp = SamplingParams(temperature=0.9, top_p=0.95)
    cfg = _cfg(llama, draft_model=str(draft_llama), sampling=sp, seed=7, max_new_tokens=20)
    ref = generate(cfg, PROMPT)
    got = generate(cfg.with_(pp=2), PROMPT)
    assert got.token_ids == ref.token_ids
    assert got.stats["accepted"] == ref.stats["accepted"]
    assert got.stats["fast_path"] == ref.stats["fast_path"] == {"graphs": False, "compile": False, "kernels": False,
                                                                      "ahead": False}


def test_stage_bounds_explicit(ray_local, llama):
    from memra_dist.app import generate

    ref = generate(_cfg(llama, drafter="ngram"), PROMPT).token_ids
    assert generate(_cfg(llama, drafter="ngram", pp=2, stage_bounds=(1,)), PROMPT).token_ids == ref


def test_nothing_left_after_a_run(ray_local, llama):
    import time

    import ray._private.state as gcs  # the GCS actor table (the state API needs the dashboard)
    import torch.distributed as dist

    from memra_dist.app import generate

    before = set(gcs.actors())
    generate(_cfg(llama, drafter="ngram", pp=3), PROMPT)
    ours = {k: v for k, v in gcs.actors().items() if k not in before}
    assert len(ours) == 3  # the head + two stage actors of this run
    deadline = time.time() + 10
    while any(v["State"] != "DEAD" for v in gcs.actors().values()) and time.time() < deadline:
        time.sleep(0.2)
    assert {k: v["State"] for k, v in gcs.actors().items() if k in ours} == dict.fromkeys(ours, "DEAD")
    assert not dist.is_initialized()  # the driver never joins the group


def test_pp_larger_than_layers_refused_before_ray(llama):
    from memra_dist.app import generate

    with pytest.raises(UserError, match="larger than the model's 4 layers"):
        generate(_cfg(llama, pp=5), PROMPT)


def test_cli_pp2_one_trace_across_actors(llama, tmp_path):
    """The CLI starts a local Ray itself, runs pp=2 at level 1 and shuts Ray down; the
    driver, the stage actor and the head write spans of ONE trace, parents right."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RAY_ADDRESS", "MEMRA_"))}
    p = subprocess.run([sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(llama), "--prompt",
                        "The phase clock drains", "--pp", "2", "--trace-level", "1", "--max-new-tokens", "12",
                        "--device", "cpu", "--run-dir", str(run_dir), "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert len(out["token_ids"]) == 12
    spans = {}
    for f in sorted(Path(run_dir).glob("*spans.otlp.json")):
        for rs in json.loads(f.read_text())["resourceSpans"]:
            role = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}["memra.role"]["stringValue"]
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    spans.setdefault(role, []).append(s)
    assert set(spans) == {"driver", "stage", "head"}
    assert len({s["traceId"] for ss in spans.values() for s in ss}) == 1
    (req,) = [s for s in spans["driver"] if s["name"] == "memra.request"]
    by_id = {s["spanId"]: s for ss in spans.values() for s in ss}
    head_names = [s["name"] for s in spans["head"]]
    assert head_names.count("spec.burst") >= 1 and head_names.count("spec.round") >= 1, sorted(set(head_names))
    assert head_names.count("spec.draft") == head_names.count("spec.verify") == head_names.count("spec.round")
    for s in spans["head"]:
        if s["name"] == "spec.burst":
            assert s["parentSpanId"] == req["spanId"]
        if s["name"] in ("spec.draft", "spec.verify"):
            assert by_id[s["parentSpanId"]]["name"] == "spec.round"
            assert any(a["key"] == "memra.free_mb.cpu" for a in s["attributes"])
    stage_spans = [s for s in spans["stage"] if s["name"] == "stage.forward"]
    assert stage_spans and all(s["parentSpanId"] == req["spanId"] for s in stage_spans)
    for s in stage_spans:
        attrs = {a["key"]: a["value"] for a in s["attributes"]}
        assert attrs["memra.stage"]["intValue"] in ("0", 0)
        assert int(attrs["memra.free_mb.cpu"]["intValue"]) > 0


def test_plain_greedy_runs_one_step_ahead_through_the_pipeline(ray_local, llama, tmp_path):
    """pp > 1, greedy, no drafts, level 0: the head sends the next step's command, its id the
    argmax left on the device, before it reads the token back (specdec/ahead.py TargetAhead).
    The ids are pp=1's across bursts, at the token budget and at a stop token (the step sent
    past the end is rolled back), and the stats say it ran ahead; at level 1 too (its rounds
    recorded from the forward's events), not at level 2."""
    import shutil

    ref = generate(_cfg(llama, drafter="none", max_new_tokens=24), PROMPT)
    for pp, burst in ((2, 5), (3, 1)):
        got = generate(_cfg(llama, drafter="none", pp=pp, max_new_tokens=24, burst_rounds=burst), PROMPT)
        assert got.token_ids == ref.token_ids, pp
        assert got.stats["fast_path"]["ahead"] and got.stats["rounds"] == ref.stats["rounds"]
    stop = next(i for i, t in enumerate(ref.token_ids) if i >= 6 and t not in ref.token_ids[:i])
    eos_model = shutil.copytree(llama, tmp_path / "eos")
    cfg_path = eos_model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "eos_token_id": ref.token_ids[stop]}))
    want = generate(_cfg(eos_model, drafter="none", max_new_tokens=24), PROMPT).token_ids
    assert want == ref.token_ids[:stop + 1]
    assert generate(_cfg(eos_model, drafter="none", pp=2, max_new_tokens=24, burst_rounds=4), PROMPT).token_ids == want
    from memra_dist.phase.levels import TraceSettings
    from memra_dist.phase.share import ShareTable

    # level 1 runs ahead too: each round's verify is its forward's own events on the head's stream
    share = ShareTable()
    traced = generate(_cfg(llama, drafter="none", pp=2, max_new_tokens=24, trace=TraceSettings(level=1)), PROMPT,
                      sink=share)
    assert traced.token_ids == ref.token_ids and traced.stats["fast_path"]["ahead"]
    assert share.n_rounds == share.ahead_rounds == ref.stats["rounds"] and share.ns[1] > 0
    assert share.ns[0] == share.ns[4] == 0  # no draft, no maint
    # level 2 keeps the round loop (the stages' sub-split vectors ride back with every forward)
    timed = generate(_cfg(llama, drafter="none", pp=2, max_new_tokens=24, trace=TraceSettings(level=2)), PROMPT)
    assert timed.token_ids == ref.token_ids and not timed.stats["fast_path"]["ahead"]
