"""Chunked prefill through the pipeline (pp > 1), on CPU with a real local Ray: the head keeps
several chunks of one prompt in flight, so stage 0 runs chunk c + 1 while the head's last
stage runs chunk c. Greedy output equals pp = 1 with the prompt in one chunk, for chunk
sizes 1, 7, 64 and the whole prompt, at pp 2 and 3, with a drafter that reads the stages'
taps (DFlash) and with sessions in flight; each stage records one span per chunk, and the
two stages' chunk spans overlap in time."""

from __future__ import annotations

import threading

import pytest

from memra_dist.app import generate, open_engine
from memra_dist.config import RunConfig
from memra_dist.demo.tiny_dflash import random_dflash
from memra_dist.phase.levels import TraceSettings
from memra_dist.specdec.chunks import pipeline_chunks

pytestmark = pytest.mark.slow  # a local Ray (pp > 1)

PROMPT = [(i * 7 + 3) % 100 + 2 for i in range(90)]  # 90 rows: chunk 64 splits it, chunk 7 in 13
N_NEW = 10
SHAPE = dict(layers=2, block_size=4, taps=(2, 0), mask_token_id=1, heads=2, kv_heads=1, head_dim=16,
             intermediate_size=64)


def _cfg(model, **kw):
    # fixed K at every pp (at pp 1 --spec-k auto would choose K from the measured step times)
    return RunConfig(**{**dict(model=str(model), max_new_tokens=N_NEW, device="cpu", k=3, drafter="none",
                               spec_k="fixed"), **kw})


@pytest.fixture(scope="module")
def dflash_dir(llama, tmp_path_factory):
    return random_dflash(tmp_path_factory.mktemp("dflash") / "d", llama, seed=5, std=0.5, **SHAPE)


@pytest.fixture(scope="module")
def ref(llama):
    """pp = 1, the prompt in one forward (plain greedy)."""
    return generate(_cfg(llama, prefill_chunk=len(PROMPT)), PROMPT).token_ids


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("chunk", [1, 7, 64, len(PROMPT)])
def test_pipelined_prefill_is_token_identical(ray_local, llama, ref, pp, chunk):
    assert generate(_cfg(llama, pp=pp, prefill_chunk=chunk), PROMPT).token_ids == ref


@pytest.mark.parametrize("pp", [2, 3])
def test_dflash_primes_on_the_pipelined_chunks(ray_local, llama, dflash_dir, ref, pp):
    """Chunk 7 against DFlash's block of 4: boundaries split the blocks; the taps each stage
    ships behind every chunk reach the head's sink by position."""
    cfg = _cfg(llama, pp=pp, prefill_chunk=7, drafter="dflash", draft_model=str(dflash_dir))
    at_pp1 = generate(cfg.with_(pp=1), PROMPT)
    got = generate(cfg, PROMPT)
    assert got.token_ids == at_pp1.token_ids == ref
    assert {k: got.stats[k] for k in ("rounds", "drafted", "accepted")} == \
        {k: at_pp1.stats[k] for k in ("rounds", "drafted", "accepted")}


def test_sessions_in_flight_with_chunked_prompts(ray_local, llama):
    """Two sessions at once, each prompt pipelined in chunks: the chunks of one request and
    the rounds of another share the ring, and each output equals its prompt alone."""
    prompts = [PROMPT, PROMPT[::-1][:70], [5, 9, 17, 5, 9]]
    alone = [generate(_cfg(llama, drafter="ngram"), p).token_ids for p in prompts]
    with open_engine(_cfg(llama, pp=2, drafter="ngram", prefill_chunk=16), capacity=128, sessions=2) as engine:
        got: list = [None] * len(prompts)

        def run(i):
            got[i] = engine.generate(prompts[i]).token_ids

        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=240)
    assert got == alone


def _prime_spans(spans):
    by_stage: dict[int, list[tuple[int, int, int]]] = {}
    for _res, s in spans:
        attrs = {a["key"]: a["value"] for a in s.get("attributes", [])}
        if s["name"] != "stage.forward" or attrs["memra.phase"]["stringValue"] != "prime":
            continue
        stage = int(attrs["memra.stage"]["intValue"])
        by_stage.setdefault(stage, []).append((int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]),
                                               int(attrs["memra.ctx"]["intValue"])))
    return by_stage


def test_each_stage_records_a_span_per_chunk_and_they_overlap(ray_local, llama, tmp_path):
    from memra_dist.tracing.otlp_json import read_spans

    prompt = (PROMPT * 4)[:300]
    cfg = _cfg(llama, pp=2, prefill_chunk=32, trace=TraceSettings(level=1), max_new_tokens=4)
    with open_engine(cfg, capacity=320, run_dir=str(tmp_path)) as engine:
        engine.generate(prompt)
    spans = read_spans(sorted(tmp_path.glob("*spans.otlp.json")))
    by_stage = _prime_spans(spans)
    chunks = pipeline_chunks(len(prompt), 32, 2, 0.0)
    assert len(chunks) > 2
    for stage in (0, 1):  # stage 0's actor and the head's own last stage
        assert sorted(c for _t0, _t1, c in by_stage[stage]) == [lo for lo, _hi in chunks], stage
    # pipelined: some chunk of stage 0 runs while the head runs an earlier one
    overlap = [(a, b) for a in by_stage[0] for b in by_stage[1]
               if a[2] > b[2] and min(a[1], b[1]) > max(a[0], b[0])]
    assert overlap, "no stage-0 chunk ran while the head ran an earlier chunk"
