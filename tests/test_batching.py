"""Batched speculative decoding (memra_dist/batching/): many requests' rows in one forward over
a paged KV cache give every request exactly the ids it gets alone (CPU, fp32), whatever shares
its forwards: requests of different prompt and output lengths, ending in the middle of others,
admitted while others decode, waiting for KV blocks; greedy and sampled; drafters none, ngram,
the draft model and the tap drafters (DFlash, EAGLE-3: each request's drafts equal its solo
drafts, so its taps are its own)."""

from __future__ import annotations

import threading

import pytest

from memra_dist.app import open_engine
from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.specdec.sampling import SamplingParams

CAP = 160


def _prompts(n: int = 12) -> list[tuple[list[int], int]]:
    """(prompt, max_new): lengths from 3 to 58 (chunks of 40 make the long ones two prefill
    forwards), outputs from 5 to 40 tokens; repeats inside some prompts so ngram drafts."""
    out = []
    for i in range(n):
        plen = 3 + (i * 11) % 56
        base = [(7 * i + 5 * j + 3) % 120 + 4 for j in range(max(2, plen // 3))]
        prompt = (base * 4)[:plen]
        out.append((prompt, 5 + (i * 7) % 36))
    return out


def _cfg(model, drafter: str, **kw) -> RunConfig:
    """(Fixed K unless a test asks for --spec-k auto: the tests of today's rounds compare each
    round's drafts with the solo run's.)"""
    kw.setdefault("spec_k", "fixed")
    return RunConfig(model=str(model), drafter=drafter, k=3, device="cpu", dtype="fp32", prefill_chunk=40, **kw)


def _solo(model, drafter, reqs, **kw) -> list[list[int]]:
    with open_engine(_cfg(model, drafter, **kw), capacity=CAP) as eng:
        return [eng.generate(p, _cfg(model, drafter, max_new_tokens=n, **kw)).token_ids for p, n in reqs]


def _crowded(n: int = 4, new: int = 40, longest: int = 34) -> tuple[list[tuple[list[int], int]], int]:
    """(requests, kv_rows): n requests whose prompts' blocks all fit the pool at once with one
    block to spare, while each needs at least two more blocks to finish: admitted together
    (`_batched(gate=True)`), their growth must preempt one of them, whatever the threads'
    timing. (A request growing into a full pool waits while every other request is in a
    step; the next one to grow then finds it idle and swaps it out.)"""
    reqs = [(p[:longest], new) for p, _ in _prompts(2 * n) if len(p) >= 20][:n]
    assert len(reqs) == n
    blocks = sum(-(-(len(p) + 1) // 16) for p, _ in reqs)  # admitted with len(prompt) + 1 rows (backend.session)
    return reqs, 16 * (blocks + 1)


def _gate_admissions(eng, n: int) -> None:
    """The target batcher's first n admissions wait for each other, so those requests hold their
    prompts' blocks before any of them runs a forward."""
    b = eng._backend.batcher
    admit, seen, bar = b.admit, [0], threading.Barrier(n, timeout=120)

    def gated(rid, rows, need=None, *a):
        shared = admit(rid, rows, need, *a)
        seen[0] += 1
        if seen[0] <= n:
            bar.wait()
        return shared
    b.admit = gated


def _batched(model, drafter, reqs, max_batch=6, kv_rows=None, on_open=None, each=None, gate=False, **kw):
    """The requests from concurrent threads on one batched engine -> (their ids, its stats).
    `on_open(engine)` runs before them; `each[i]`: request i's own config fields; `gate`: every
    request is admitted before any runs a forward (`_gate_admissions`)."""
    got: dict[int, list[int]] = {}
    errors = []
    assert not gate or len(reqs) <= max_batch  # more would wait for a batch slot, not at the gate
    with open_engine(_cfg(model, drafter, **kw), capacity=CAP, max_batch=max_batch, kv_rows=kv_rows) as eng:
        if on_open is not None:
            on_open(eng)
        if gate:
            _gate_admissions(eng, len(reqs))
        sem = threading.Semaphore(0)

        def one(i, p, n):
            try:
                own = {**kw, **(each[i] if each else {})}
                got[i] = eng.generate(p, _cfg(model, drafter, max_new_tokens=n, **own)).token_ids
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            sem.release()

        threads = [threading.Thread(target=one, args=(i, p, n), daemon=True) for i, (p, n) in enumerate(reqs)]
        for t in threads:
            t.start()
        for _ in threads:
            assert sem.acquire(timeout=300), "a batched request never finished"
        assert eng._backend.batcher.wait_idle(60)  # a row launched ahead may still run: its blocks come back after it
        stats = eng._backend.stats()
    assert not errors, errors
    return [got[i] for i in range(len(reqs))], stats


def _drafter_kw(drafter, draft_llama, llama, tmp_path_factory) -> dict:
    if drafter == "model":
        return dict(draft_model=str(draft_llama))
    if drafter in ("dflash", "eagle3"):
        return dict(draft_model=str(_tap_drafter(drafter, llama, tmp_path_factory)))
    return {}


def _drafter_cls(drafter):
    from memra_dist.specdec.drafters.dflash import DFlashDrafter
    from memra_dist.specdec.drafters.draft_model import ModelDrafter
    from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter

    return {"model": ModelDrafter, "dflash": DFlashDrafter, "eagle3": Eagle3Drafter}.get(drafter)


@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "dflash", "eagle3"])
def test_twelve_requests_batched_six_at_a_time_get_their_solo_ids(llama, draft_llama, drafter, monkeypatch,
                                                                   tmp_path_factory):
    reqs = _prompts()
    kw = _drafter_kw(drafter, draft_llama, llama, tmp_path_factory)
    cls = _drafter_cls(drafter)  # a drafter on the device: its proposals the same batched as alone
    seen = spy_proposals(monkeypatch, cls) if cls is not None else []
    solo = _solo(llama, drafter, reqs, **kw)
    alone, seen[:] = sorted(seen), []
    batched, stats = _batched(llama, drafter, reqs, **kw)
    assert sorted(seen) == alone and (cls is None or len(alone) > 50)
    for i, (a, b) in enumerate(zip(solo, batched)):
        assert a == b, f"request {i} (prompt {len(reqs[i][0])}, {reqs[i][1]} new): batched {b} alone {a}"
    assert len({len(t) for t in solo}) >= 8  # outputs of many lengths: requests end in the middle of others
    # it did batch: steps held several requests, and decode rows rode beside others' rows
    assert stats["max_requests"] >= 3, stats
    assert stats["mean_requests"] > 1.5, stats
    assert stats["kv_blocks_used"] == 0  # every request gave its blocks back
    if drafter == "model":  # the draft model's steps were batched too
        assert stats["draft"]["max_requests"] >= 3 and stats["draft"]["kv_blocks_used"] == 0, stats
    if drafter in ("dflash", "eagle3"):  # and the tap drafters' forwards (the step leader's shared drafts)
        assert stats["draft_batches"] > 0 and stats["mean_draft_batch"] >= 2, stats


@pytest.mark.parametrize("drafter", ["ngram", "model", "dflash", "eagle3"])
def test_sampled_requests_keep_their_own_generators(llama, draft_llama, drafter, monkeypatch, tmp_path_factory):
    """Sampled requests, each seeded: its ids are its solo ids. The tap drafters' requests are
    drafted together by the step leader (one shared forward), each draft drawn with its own
    request's generator from its own rows, and accepted with it: every proposal is its solo one."""
    reqs = _prompts(6)
    kw = dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=11,
              **_drafter_kw(drafter, draft_llama, llama, tmp_path_factory))
    cls = _drafter_cls(drafter)
    seen = spy_proposals(monkeypatch, cls) if cls is not None else []
    solo = _solo(llama, drafter, reqs, **kw)
    alone, seen[:] = sorted(seen), []
    batched, stats = _batched(llama, drafter, reqs, max_batch=3, **kw)
    assert batched == solo and sorted(seen) == alone
    if drafter in ("dflash", "eagle3"):
        assert len(alone) > 20 and stats["draft_batches"] > 0 and stats["chained_rounds"] > 0, stats


def _first_waits_for_a_short_pool(eng) -> None:
    """The first request admitted holds its blocks but runs no forward until another admission
    has found the pool short (a reserve that failed), so an admission waits whatever the
    threads' timing (60 s at most)."""
    b = eng._backend.batcher
    reserve, admit, short, lock, first = b.pool.reserve, b.admit, threading.Event(), threading.Lock(), []

    def reserve_(rid, rows, hashes=()):
        ok = reserve(rid, rows, hashes)
        if not ok:
            short.set()
        return ok

    def admit_(rid, rows, need=None, *a):
        shared = admit(rid, rows, need, *a)
        with lock:
            lead = not first
            first.append(rid)
        if lead:
            short.wait(60)
        return shared
    b.pool.reserve, b.admit = reserve_, admit_


def test_a_short_kv_pool_makes_requests_wait_and_loses_nothing(llama):
    """A pool of five blocks, three requests of three blocks' prompts (each fits the pool
    alone, no two at once) with six slots: admissions wait for blocks (never an out-of-memory),
    and every request still gets its solo ids."""
    reqs = [(p[:34], 40) for p, _ in _prompts(12) if len(p) >= 34][:3]
    assert len(reqs) == 3
    solo = _solo(llama, "ngram", reqs)
    batched, stats = _batched(llama, "ngram", reqs, max_batch=6, kv_rows=5 * 16, on_open=_first_waits_for_a_short_pool)
    assert batched == solo
    assert stats["admission_waits"] >= 1, stats
    assert stats["kv_rows"] == 80 and stats["max_requests"] == 1, stats


@pytest.mark.parametrize("drafter", ["ngram", "model", "dflash"])
def test_running_out_of_blocks_preempts_by_swap_and_loses_nothing(llama, draft_llama, drafter, tmp_path_factory):
    """Four requests admitted together into a pool that holds their prompts but not their
    growth (`_crowded`): when a growth finds the pool empty another request is swapped out to
    host memory and back later; every request still gets its solo ids (its swapped rows come
    back bitwise), no out-of-memory, every block given back. With DFlash, a chain whose next
    rows find no block parks (the draft the leader made for it with the others' is dropped) and
    its session drafts that round alone (runs here parked 4-5 chains)."""
    reqs, kv_rows = _crowded()
    kw = _drafter_kw(drafter, draft_llama, llama, tmp_path_factory)
    solo = _solo(llama, drafter, reqs, **kw)
    batched, stats = _batched(llama, drafter, reqs, max_batch=6, kv_rows=kv_rows, gate=True, **kw)
    assert batched == solo
    assert stats["preemptions"] >= 1, stats
    assert stats["kv_blocks_used"] == 0
    if drafter == "model":  # its draft pool crowded too: the loop's draft steps never wait for its blocks (a
        # request whose draft rows find no room parks: its session drafts that round, waiting there)
        assert stats["draft"]["kv_blocks_used"] == 0 and stats["draft"]["preemptions"] >= 1, stats["draft"]


@pytest.mark.parametrize("sampled", [False, True])
def test_the_loop_drafts_a_steps_draft_model_requests_together(llama, draft_llama, sampled):
    """--drafter model on the engine loop: every request's rounds are the loop's (chained), and
    the loop drafts a step's requests together (each draft step one forward of the draft model's
    batcher for all of them: draft_model.py propose_many); each request gets its solo ids
    (sampled: seeded, its draws from its own generator as alone)."""
    kw = dict(draft_model=str(draft_llama))
    if sampled:
        kw.update(sampling=SamplingParams(temperature=0.8, top_k=20), seed=11)
    reqs = _prompts(6)
    solo = _solo(llama, "model", reqs, **kw)
    got, stats = _batched(llama, "model", reqs, max_batch=6, gate=True, **kw)
    assert got == solo
    assert stats["chained_rounds"] > 0 and stats["draft_batches"] > 0 and stats["mean_draft_batch"] >= 2, stats


def test_what_does_not_batch_yet_is_refused_in_one_line(llama, draft_llama):
    from memra_dist.batching.backend import check_batchable
    from memra_dist.model.config import load_config

    mcfg = load_config(llama)
    import dataclasses

    for arch in ("llama", "qwen2", "qwen3", "glm4_moe", "deepseek_v3", "kimi_linear"):  # every family batches
        check_batchable(_cfg(llama, "none"), dataclasses.replace(mcfg, arch=arch), 4)
    arch = "mamba"  # a family the batcher was never given (were the loader to take one)
    with pytest.raises(UserError, match=f"runs the llama, qwen2, qwen3, glm4_moe, deepseek_v3, kimi_linear families "
                                        f"for now .the model is {arch}."):
        check_batchable(_cfg(llama, "none"), dataclasses.replace(mcfg, arch=arch), 4)
    check_batchable(_cfg(llama, "none").with_(pp=2), mcfg, 4)  # pp > 1 batches too (test_batching_pp.py)
    check_batchable(_cfg(llama, "model", draft_model=str(draft_llama)), mcfg, 4, load_config(draft_llama))  # a llama draft model batches
    with pytest.raises(UserError, match="--max-batch must be in"):
        with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=0):
            pass
    with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=2, kv_rows=64) as eng:
        with pytest.raises(UserError, match="a request of 160 rows does not fit the KV pool .64 rows."):
            eng.generate([5, 6, 7], _cfg(llama, "none", max_new_tokens=200))
        assert eng.generate([5, 6, 7], _cfg(llama, "none", max_new_tokens=20)).token_ids  # the engine still serves


def test_serve_max_batch_auto_is_decided_where_the_engine_runs(llama):
    """serve's --max-batch default is auto: the driver caps Ray's ongoing requests at
    AUTO_MAX_BATCH, and the replica's engine host decides (here, on CPU: one at a time)."""
    import argparse

    from memra_dist.batching.policy import AUTO_MAX_BATCH
    from memra_dist.serve.host import EngineHost

    pytest.importorskip("ray.serve")
    from memra_dist.serve.deployment import engine_sessions

    assert engine_sessions(argparse.Namespace(pp=1, max_batch=None, sessions=None)) == AUTO_MAX_BATCH
    assert engine_sessions(argparse.Namespace(pp=1, max_batch=4, sessions=None)) == 4
    assert engine_sessions(argparse.Namespace(pp=2, max_batch=6, sessions=None)) == 6  # batched down the ring
    assert engine_sessions(argparse.Namespace(pp=2, max_batch=None, sessions=None)) == 2  # auto: not at pp > 1
    host = EngineHost(RunConfig(model=str(llama), drafter="ngram", k=3, device="cpu", dtype="fp32", ctx=CAP), None,
                      max_batch=None)
    try:
        assert host.max_batch == 1 and host.sessions == 1
    finally:
        host.close()


def test_max_batch_auto_batches_on_a_gpu_where_the_model_and_drafter_batch(llama):
    """--max-batch auto (batch's default): AUTO_MAX_BATCH on CUDA at pp 1 with a batchable
    drafter and family (the measured choice), one request at a time elsewhere."""
    import argparse
    import dataclasses

    from memra_dist.batching.policy import AUTO_MAX_BATCH, auto_max_batch, max_batch_arg
    from memra_dist.model.config import load_config

    mcfg = dataclasses.replace(load_config(llama), head_dim=128)  # a shape the paged kernel takes
    assert AUTO_MAX_BATCH == 16
    assert auto_max_batch(_cfg(llama, "ngram"), mcfg, "cuda") == (16, "a GPU")
    assert auto_max_batch(_cfg(llama, "ngram"), mcfg, "cpu")[0] == 1
    assert auto_max_batch(_cfg(llama, "ngram").with_(pp=2), mcfg, "cuda")[0] == 1
    for arch in ("kimi_linear", "deepseek_v3", "glm4_moe"):  # eager steps, not measured on a GPU
        assert auto_max_batch(_cfg(llama, "none"), dataclasses.replace(mcfg, arch=arch), "cuda")[0] == 1
    # a shape the paged kernel does not take (head_dim 8, the smoke's tiny llama: its lone request
    # decoded ~140 tok/s batched on an H200, ~3,000 alone): eager steps
    b, why = auto_max_batch(_cfg(llama, "none"), dataclasses.replace(mcfg, head_dim=8), "cuda")
    assert b == 1 and "head_dim 8" in why
    # qwen3's q / k norms ride the rotary kernel (kernels/rope_kv.py): its steps replay graphs
    assert auto_max_batch(_cfg(llama, "none"), dataclasses.replace(mcfg, arch="qwen3", qk_norm=True), "cuda")[0] == 16
    assert auto_max_batch(_cfg(llama, "none", graphs="off"), mcfg, "cuda")[0] == 1
    assert max_batch_arg("auto") is None and max_batch_arg(" AUTO ") is None and max_batch_arg("8") == 8
    with pytest.raises(argparse.ArgumentTypeError, match="a count or auto"):
        max_batch_arg("many")


def _jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(path):
    import json

    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow  # two CLI processes
def test_batch_job_with_max_batch_writes_the_records_of_one_at_a_time(llama, tmp_path):
    import os
    import subprocess
    import sys

    rows = [{"id": f"r{i}", "prompt": "the phase clock drains " * (1 + i % 4) + str(i), "max_new_tokens": 8 + 5 * i}
            for i in range(7)]
    rows[3]["temperature"], rows[3]["seed"] = 0.7, 5  # a sampled one among the greedy
    inp = _jsonl(tmp_path / "in.jsonl", rows)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RAY_ADDRESS", "MEMRA_", "TRACEPARENT"))}

    def run(out, *extra):
        cmd = [sys.executable, "-m", "memra_dist.cli", "batch", "--model", str(llama), "--input", str(inp),
               "--output", str(out), "--device", "cpu", "--drafter", "ngram", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)

    one, many = tmp_path / "one.jsonl", tmp_path / "many.jsonl"
    p1, p4 = run(one), run(many, "--max-batch", "4")
    assert p1.returncode == 0, p1.stderr[-2000:]
    assert p4.returncode == 0, p4.stderr[-2000:]
    a, b = _records(one), _records(many)
    assert sorted(a) == sorted(b) == sorted(r["id"] for r in rows)
    for rid in a:
        assert b[rid]["token_ids"] == a[rid]["token_ids"], rid
    said = [line for line in p4.stderr.splitlines() if line.startswith("[batch] batched: ")]
    assert len(said) == 1 and " steps, " in said[0] and "busy" in said[0], p4.stderr[-2000:]
    assert "[batch] batched" not in p1.stderr  # one at a time: no batch steps to account for
    assert "--max-batch auto" not in p1.stderr  # the default, auto, is one at a time on CPU (no note)
    pp2 = run(tmp_path / "pp2.jsonl", "--max-batch", "4", "--pp", "2")  # one step down the ring (test_batching_pp.py)
    assert pp2.returncode == 0, pp2.stderr[-2000:]
    c = _records(tmp_path / "pp2.jsonl")
    assert sorted(c) == sorted(a) and all(c[rid]["token_ids"] == a[rid]["token_ids"] for rid in a)
    assert any(line.startswith("[batch] batched: ") for line in pp2.stderr.splitlines()), pp2.stderr[-2000:]
    bad = run(tmp_path / "bad.jsonl", "--max-batch", "999")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("memra-dist: error: --max-batch must be in [1, 256]")
    assert not (tmp_path / "bad.jsonl").exists()


def _five_clients(host, during=None) -> list[str]:
    """Five concurrent HTTP clients of `host` behind the API (prompts and lengths of their own,
    greedy) -> their completions' texts; `during(host)` runs once they are done, before the
    app's shutdown closes the engine."""
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from memra_dist.serve.api import build_app

    from test_serve_api import _uvicorn

    bodies = [{"prompt": "the drafter proposes " * (1 + i), "max_tokens": 6 + 4 * i, "temperature": 0} for i in range(5)]
    got = {}
    with _uvicorn(build_app(host, 8)) as base:
        def one(i):
            with httpx.Client(timeout=120) as c:
                got[i] = c.post(f"{base}/v1/completions", json=bodies[i]).json()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if during is not None:
            during(host)
    return [got[i]["choices"][0]["text"] for i in range(len(bodies))]


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_served_requests_batched_get_their_solo_completions(llama, draft_llama, drafter):
    """`serve --max-batch 3`'s engine host behind the HTTP API: five concurrent clients, each
    completion equal to the one the one-at-a-time server gives (the draft model's steps
    batched too, over its own pool)."""
    from memra_dist.serve.host import EngineHost

    def serve(max_batch):
        cfg = RunConfig(model=str(llama), drafter=drafter, k=3, device="cpu", dtype="fp32", ctx=CAP,
                        spec_k="fixed",  # (every round drafts: --spec-k auto may leave the draft model K 0)
                        **({"draft_model": str(draft_llama)} if drafter == "model" else {}))
        host = EngineHost(cfg, None, max_batch=max_batch)
        assert host.sessions == max_batch
        return _five_clients(host), host

    solo, _ = serve(1)
    batched, host = serve(3)
    assert all(solo) and batched == solo
    backend = host.engine._backend
    assert backend.batcher.stats.max_requests >= 2
    if drafter == "model":
        assert backend.draft_batcher.stats.max_requests >= 2


def traced_batched(model, drafter, reqs, level: int, max_batch: int = 4, sink=None, on_open=None, **kw):
    """The requests from concurrent threads on one batched engine traced at `level`, each
    request's spans into its own in-memory exporter -> (their ids, the exporters, the stats).
    `sink`: every request's round records (a JobShare: the job's share table)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from memra_dist.phase.levels import TraceSettings
    from memra_dist.tracing.emit import SpanSink

    exps = [InMemorySpanExporter() for _ in reqs]  # each request's spans apart
    kw = dict(trace=TraceSettings(level=level), **kw)
    got: dict[int, list[int]] = {}
    with open_engine(_cfg(model, drafter, **kw), capacity=CAP, max_batch=max_batch) as eng:
        if on_open is not None:
            on_open(eng)

        def one(i, p, n):
            prov = TracerProvider()
            prov.add_span_processor(SimpleSpanProcessor(exps[i]))
            got[i] = eng.generate(p, _cfg(model, drafter, max_new_tokens=n, **kw), sink=sink,
                                  span_sink=SpanSink(prov.get_tracer("t"), None)).token_ids

        threads = [threading.Thread(target=one, args=(i, p, n)) for i, (p, n) in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        stats = eng._backend.stats()
    return [got.get(i) for i in range(len(reqs))], exps, stats


@pytest.mark.parametrize("level", [1, 2])
def test_each_requests_verify_spans_name_the_batch_step_they_rode_in(llama, level):
    """Levels 1 and 2 on a batched engine: every request keeps its own trace (its own k,
    accepted, ids equal to alone), and each verify names the batch step its rows rode in, with
    the step's requests and rows and the verify's split into waiting for the step and its
    forward. A round the engine loop ran (chained.py) is ONE span, spec.round, its phases' ms
    its attributes, at both levels; at level 2 every step a round rode has its verify sub-split
    by mixer class (batching/laps.py) ONCE, under the step's batch.step span: attention, FFN
    and the rest, laid end to end inside the step's forward, in the step's trace."""
    from memra_dist.tracing.conventions import ATTR, PHASE_SPANS, PHASES, SPAN_BATCH_STEP, SPAN_ROUND, VERIFY_SUB_SPANS

    reqs = _prompts(4)
    solo = _solo(llama, "ngram", reqs)
    got, exps, _ = traced_batched(llama, "ngram", reqs, level)
    assert got == solo
    a = ATTR
    by_step: dict[int, list] = {}
    every = [s for exp in exps for s in exp.get_finished_spans()]
    steps = {s.context.span_id: s for s in every if s.name == SPAN_BATCH_STEP}
    subs: dict[int, list] = {}  # each step span's sub-spans
    for s in every:
        if s.name in VERIFY_SUB_SPANS.values():
            assert s.parent.span_id in steps and s.context.trace_id == s.parent.trace_id, s.name  # under a step
            subs.setdefault(s.parent.span_id, []).append(s)
    for sid, kids in subs.items():  # once a step, end to end inside its forward
        st = steps[sid]
        names = [k.name for k in kids]
        assert len(names) == len(set(names)) and {VERIFY_SUB_SPANS["attn"], VERIFY_SUB_SPANS["ffn"]} <= set(names)
        # (from the step's start; its sub-spans may come from another request's sink than the
        # step's span, whose clock offset differs by a few ns)
        assert names[-1] == VERIFY_SUB_SPANS["rest"] and abs(kids[0].start_time - st.start_time) < 1000
        assert all(x.end_time == y.start_time for x, y in zip(kids, kids[1:]))
        assert kids[-1].end_time <= st.end_time + 2000 or kids[-1].start_time == kids[-1].end_time
        assert all(k.attributes[a["batch_step"]] == st.attributes[a["batch_step"]] for k in kids)
    linked = set()
    for i, exp in enumerate(exps):
        spans = exp.get_finished_spans()
        names = {s.name for s in spans}
        verifies = [s for s in spans if s.name == SPAN_ROUND]  # one span a round: no phase span at all
        assert not names & set(PHASE_SPANS.values()), names
        for s in verifies:
            ms = [s.attributes[a[f"{p}_ms"]] for p in PHASES]
            assert min(ms) >= 0 and abs(sum(ms) * 1e6 - (s.end_time - s.start_time)) < 1e3  # the round's laps
            linked |= {ln.context.span_id for ln in s.links}
        assert verifies and all(s.attributes[a["k"]] >= 0 for s in verifies)
        for s in verifies:
            by_step.setdefault(s.attributes[a["batch_step"]], []).append((i, s))
            wait, fwd = s.attributes[a["batch_wait_ms"]], s.attributes[a["batch_forward_ms"]]
            verify_ns = s.attributes[a["verify_ms"]] * 1e6
            assert wait >= 0 and fwd > 0
            assert (wait + fwd) * 1e6 <= verify_ns + 1e5  # shares of the verify (0.1 ms of slack)
    assert any(len({i for i, _ in v}) >= 2 for v in by_step.values()), "no batch step held two requests' verifies"
    for v in by_step.values():  # every request of a step names the same step, its requests and rows
        assert len({(s.attributes[a["batch_requests"]], s.attributes[a["batch_rows"]]) for _, s in v}) == 1
        first = v[0][1].attributes
        assert len({i for i, _ in v}) == len(v) <= first[a["batch_requests"]]  # a request's verify once a step
        assert first[a["batch_rows"]] >= sum(s.attributes[a["k"]] + 1 for _, s in v)
    assert linked and linked <= set(steps)
    if level == 2:  # every step a round rode has its sub-split, once
        assert set(subs) == linked, (len(subs), len(linked))
    else:
        assert not subs


def test_sampled_batched_requests_with_a_host_drafter_are_timed_without_a_drain(llama, monkeypatch):
    """Sampled requests with the ngram drafter on a batched engine: their rounds are the step
    leader's (batching/chain.py accepts each on the step's logits with the request's own
    generator), so they get their solo ids; their phases are the leader's stamps (`leader`) and
    nothing drains the shared stream (which would wait for the other requests' steps); the
    caller's sink gets every round, each verify holding its step's forward."""
    from memra_dist.device import Drainer
    from memra_dist.phase.levels import TraceSettings

    drains = []
    real = Drainer.__call__
    monkeypatch.setattr(Drainer, "__call__", lambda self: drains.append(1) or real(self))

    from test_ahead import _Bursts

    reqs = _prompts(4)
    kw = dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=11)
    solo = _solo(llama, "ngram", reqs, **kw)
    sinks = [_Bursts() for _ in reqs]
    got: dict[int, tuple] = {}
    traced = _cfg(llama, "ngram", trace=TraceSettings(level=1), **kw)
    with open_engine(traced, capacity=CAP, max_batch=4) as eng:
        def one(i, p, n):
            res = eng.generate(p, traced.with_(max_new_tokens=n), sink=sinks[i])
            got[i] = (res.token_ids, res.stats["rounds"])

        drains.clear()
        threads = [threading.Thread(target=one, args=(i, p, n)) for i, (p, n) in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        stats = eng._backend.stats()
    assert [got[i][0] for i in range(len(reqs))] == solo
    assert drains == []
    assert stats["chained_rounds"] >= sum(r for _, r in got.values()) - len(reqs), stats  # (a first round may be its own)
    for i, sink in enumerate(sinks):
        rounds = [r for rec in sink.recs for r in rec.live()]
        assert len(rounds) == got[i][1] and "leader" in {rec.clock for rec in sink.recs}
        for r in rounds:
            assert r.t == sorted(r.t) and r.batch is not None
            assert r.phase_ns(1) >= r.batch.forward_ns  # the verify holds its step's forward


def _stubbed_rounds(llama, monkeypatch, n: int, rounds: int, forward_s: float, before, after) -> dict:
    """n requests of `rounds` forwards each on a batcher whose forward only sleeps
    `forward_s`; request r calls before(r) once, then after(r) around each submission's
    return (its host work). Returns the batcher's stats."""
    import time

    import torch

    with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=n) as eng:
        from memra_dist.batching import step_forward

        b = eng._backend.batcher
        monkeypatch.setattr(step_forward, "forward",
                            lambda b, jobs, wakes=(), ids_dev=None, advance=None: time.sleep(forward_s) or torch.zeros(len(jobs), 8))
        for r in range(n):
            b.admit(("stub", r), 8)

        def one(r):
            before(r)
            for s in range(rounds):
                b.submit(("stub", r), torch.zeros(1, dtype=torch.long), s, CAP, False)
                after(r)
            b.leave(("stub", r))

        threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return b.stats.as_dict()


def test_requests_slower_than_the_wait_still_ride_one_step_together(llama, monkeypatch):
    """Steps longer than the batcher's wait (an eager GPU step, a long verify) do not split the
    requests into groups that alternate steps: the wait counts from the previous step's end, so
    requests back from their host work (here 2 ms of it) join the next step."""
    import time

    n = 4
    st = _stubbed_rounds(llama, monkeypatch, n, 12, 0.02, before=lambda r: time.sleep(0.007 * r),  # arriving apart
                         after=lambda r: time.sleep(0.002))
    assert st["mean_requests"] >= 0.75 * n, st  # alternating groups would hold about n / 2


def test_requests_coming_back_one_after_another_ride_one_step(llama, monkeypatch):
    """Requests whose host work is serialised (the GIL: here a lock held 2 ms each) come back
    from a step one after another, 8 of them over 16 ms, longer than the batcher's 5 ms wait:
    the step waits while submissions keep coming (it counts silence, not time), so they ride
    together rather than in the groups a fixed wait would cut."""
    import time

    n, rounds = 8, 10
    gil = threading.Lock()

    def host(r):  # this request's share of the host, nobody else's meanwhile
        with gil:
            time.sleep(0.002)

    st = _stubbed_rounds(llama, monkeypatch, n, rounds, 0.001, before=host, after=host)
    assert st["mean_requests"] >= 0.75 * n, st
    # the batcher's own account of where the time went: between its steps, the requests' host
    # work (8 x 2 ms a round, serialised); in them, the 1 ms forwards
    assert st["gap_ms"] >= 12 * (rounds - 2) and st["busy"] < 0.2, st
    # ... and of the gaps, the loop held its steps back for the requests still on the host
    assert st["holds"] >= rounds - 2 and st["held_ms"] >= 8 * (rounds - 2), st
    assert st["held_ms"] <= st["gap_ms"] + 1, st


def spy_proposals(monkeypatch, cls) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every proposal drafter class `cls` makes, as (context, drafts): a request's own
    (`propose`), those the step leader makes for several chained requests in one forward
    (`propose_many`, chain_drafts.py), and the early drafts a round's verify launched ahead ran
    (`Chain.adopt_ahead`: as many as its own proposal would have asked for)."""
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real, many = cls.propose, getattr(cls, "propose_many", None)

    def spy(self, context, k, sp, gen):
        prop = real(self, context, k, sp, gen)
        seen.append((tuple(context), tuple(prop.tokens[:k].tolist())))
        return prop

    def drafts(p, k):  # (drafts left on the device, Proposal.dev: read without taking them to the host)
        return p.dev[0].rows()[p.dev[1]][:min(k, p.dev[2])] if p.on_device else p.tokens[:k].tolist()

    def spy_many(drafters, contexts, ks, sps, gens, **kw):
        out = many(drafters, contexts, ks, sps, gens, **kw)
        seen.extend((tuple(c), tuple(drafts(p, k))) for c, k, p in zip(contexts, ks, out) if k > 0)
        return out

    from memra_dist.batching.chain import Chain

    real_adopt = Chain.adopt_ahead

    def adopt_ahead(self, job):  # a round that adopted its verify launched ahead (batching/verify_ahead.py)
        context, want = tuple(self.tokens), self.draft_k()  # (near its end its own round asks for fewer)
        ok = real_adopt(self, job)
        if ok and want > 0 and job.n > 1 and isinstance(self.drafter, cls):
            seen.append((context, tuple(job.drafts.host(min(job.n - 1, want)))))
        return ok

    monkeypatch.setattr(cls, "propose", spy)
    if many is not None:
        monkeypatch.setattr(cls, "propose_many", staticmethod(spy_many))
    monkeypatch.setattr(Chain, "adopt_ahead", adopt_ahead)
    return seen


def _tap_drafter(drafter: str, llama, tmp_path_factory):
    """A random tiny DFlash drafter (taps 0, 2) or EAGLE-3 head (taps 0, 1, 3) over `llama`."""
    if drafter == "dflash":
        from memra_dist.demo.tiny_dflash import random_dflash

        return random_dflash(tmp_path_factory.mktemp("bdflash") / "d", llama, seed=2, layers=2, block_size=4,
                             taps=(0, 2), mask_token_id=1, heads=2, kv_heads=1, head_dim=16, intermediate_size=64)
    from memra_dist.demo.tiny_eagle3 import random_eagle3

    return random_eagle3(tmp_path_factory.mktemp("beagle") / "e", llama, seed=2, taps=(0, 1, 3), heads=2,
                         kv_heads=1, head_dim=16, intermediate_size=64, draft_vocab=96)


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_tap_drafters_batched_draft_exactly_what_they_draft_alone(llama, tmp_path_factory, drafter, monkeypatch):
    """A tap drafter reads its request's own tap sink, which every batched step fills with the
    request's rows of the tapped layers (prefill chunks and verify rows beside other requests'):
    every proposal of every round equals the request's solo proposal (greedy ids alone could
    not show it: they are the target's whatever the drafts), and the ids are the solo ids."""
    if drafter == "dflash":
        from memra_dist.specdec.drafters.dflash import DFlashDrafter as cls
    else:
        from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter as cls
    ddir = _tap_drafter(drafter, llama, tmp_path_factory)
    seen = spy_proposals(monkeypatch, cls)
    reqs = _prompts(8)
    solo = _solo(llama, drafter, reqs, draft_model=str(ddir))
    alone, seen[:] = sorted(seen), []
    batched, stats = _batched(llama, drafter, reqs, max_batch=4, draft_model=str(ddir))
    assert batched == solo
    assert sorted(seen) == alone and len(alone) > 50 and any(t for _, t in alone)
    assert stats["max_requests"] >= 3 and stats["kv_blocks_used"] == 0, stats
    if cls.batched:  # most proposals came from forwards shared with other requests
        assert stats["chained_rounds"] > 0 and stats["draft_batches"] > 0 and stats["mean_draft_batch"] >= 2, stats


def test_a_rollback_gives_back_the_whole_blocks_past_the_kept_rows(llama):
    """Mid-request, a rejected verify's rollback returns the blocks wholly past the rows kept
    (block 16): the pool gets them back at once, the next forward grows into blocks again, and
    the rows kept are untouched (its logits equal a fresh request's on the same rows)."""
    import torch

    from memra_dist.batching.slot import BatchSlot

    with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=2) as eng:
        b = eng._backend.batcher
        free0 = b.pool.free_blocks
        slot = BatchSlot(b, need=CAP, first=4)
        slot.alloc(CAP)
        ids = torch.arange(4, 44)
        slot.forward(ids[:36], 0)  # rows 0..35: three blocks
        assert free0 - b.pool.free_blocks == 3
        slot.rollback(17)  # keep rows 0..16: two blocks
        assert free0 - b.pool.free_blocks == 2
        slot.rollback(16)  # exactly one block's rows
        assert free0 - b.pool.free_blocks == 1
        again = slot.forward(ids[16:20], 16)  # grows back into a second block
        assert free0 - b.pool.free_blocks == 2
        other = BatchSlot(b, need=CAP, first=4)
        other.alloc(CAP)
        fresh = other.forward(ids[:20], 0)[16:]
        torch.testing.assert_close(again, fresh, rtol=1e-5, atol=1e-5)  # another arm of attention: not bitwise
        slot.release()
        other.release()
        assert b.pool.free_blocks == free0


def test_an_open_batched_engine_lowers_the_gil_switch_interval_and_puts_it_back(llama):
    """While a batched engine is open the process's switch interval is at most
    BATCH_GIL_SWITCH_S (the step's leader waits at most that long for the GIL behind the
    requests' threads); the last engine to close puts back what the first found."""
    import sys

    from memra_dist.batching.backend import BATCH_GIL_SWITCH_S

    before = sys.getswitchinterval()
    sys.setswitchinterval(5e-3)
    try:
        with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=2):
            assert sys.getswitchinterval() == pytest.approx(BATCH_GIL_SWITCH_S)
            with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=2):
                assert sys.getswitchinterval() == pytest.approx(BATCH_GIL_SWITCH_S)
            assert sys.getswitchinterval() == pytest.approx(BATCH_GIL_SWITCH_S)  # one still open
        assert sys.getswitchinterval() == pytest.approx(5e-3)
    finally:
        sys.setswitchinterval(before)
