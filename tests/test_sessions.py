"""Sessions in flight: up to S requests run at once through one loaded engine (pp>1
interleaves them across the stages, each in its own cache slot on every stage; pp=1 runs
them one after another). Every request's output equals the same prompt run alone, greedy
and seeded-sampled, whatever else is in flight; an abandoned request frees its session."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from memra_dist.app import check_sessions, generate, open_engine
from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.specdec.sampling import SamplingParams

# mixed lengths: a 1-token prompt, repetitive ones the n-gram drafter hits, a longer one
PROMPTS = [[5, 9, 17, 5, 9, 23, 40, 5, 9], [3], [60, 61, 62, 60, 61, 62, 60, 61, 62, 60, 61, 62, 70],
           [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 7, 8, 9], [44, 45, 44, 45]]


def _cfg(model, **kw):
    return RunConfig(**{**dict(model=str(model), max_new_tokens=14, device="cpu", k=3, drafter="ngram"), **kw})


def _all_at_once(engine, prompts, cfgs=None):
    """Every prompt from its own thread, all started together (a barrier): the engine's
    sessions are all taken and the rest wait."""
    go = threading.Barrier(len(prompts))

    def one(i):
        go.wait()
        return engine.generate(prompts[i], None if cfgs is None else cfgs[i]).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


@pytest.fixture(scope="module")
def alone(llama):
    cfg = _cfg(llama)
    return [generate(cfg, p).token_ids for p in PROMPTS]


@pytest.mark.parametrize("sessions", [1, 2, 4])
def test_pp2_sessions_in_flight_equal_each_alone(ray_local, llama, alone, sessions):
    with open_engine(_cfg(llama, pp=2), capacity=64, sessions=sessions) as engine:
        assert engine.sessions == sessions
        got = _all_at_once(engine, PROMPTS)
    assert got == alone


def test_pp1_requests_from_threads_run_in_turn(llama, alone):
    with open_engine(_cfg(llama), capacity=64, sessions=4) as engine:
        assert engine.sessions == 1  # one at a time in process
        assert _all_at_once(engine, PROMPTS) == alone


def test_pp3_model_drafter_sessions_in_flight(ray_local, llama, draft_llama):
    cfg = _cfg(llama, drafter="model", draft_model=str(draft_llama))
    want = [generate(cfg, p).token_ids for p in PROMPTS[:3]]
    with open_engine(cfg.with_(pp=3), capacity=64, sessions=3) as engine:
        assert _all_at_once(engine, PROMPTS[:3]) == want


def test_seeded_sampling_reproduces_whatever_else_is_in_flight(ray_local, llama):
    sampled = _cfg(llama, sampling=SamplingParams(temperature=0.9, top_p=0.95), seed=11)
    want = generate(sampled, PROMPTS[0]).token_ids
    greedy = _cfg(llama)
    with open_engine(sampled.with_(pp=2), capacity=64, sessions=2) as engine:
        cfgs = [sampled.with_(pp=2), greedy.with_(pp=2, max_new_tokens=20), sampled.with_(pp=2)]
        got = _all_at_once(engine, [PROMPTS[0], PROMPTS[2], PROMPTS[0]], cfgs)
    assert got[0] == got[2] == want


class _Gone(Exception):
    pass


def test_an_abandoned_request_frees_its_session(ray_local, llama, alone):
    """A stream callback that raises (a client that went away) ends that request; the
    other session goes on undisturbed and the freed slot serves the next request."""
    with open_engine(_cfg(llama, pp=2, max_new_tokens=40), capacity=96, sessions=2) as engine:
        def leave(tokens):
            raise _Gone

        def first():
            with pytest.raises(_Gone):
                engine.generate(PROMPTS[3], stream=leave)

        t = threading.Thread(target=first)
        t.start()
        other = engine.generate(PROMPTS[0], _cfg(llama, pp=2)).token_ids
        t.join()
        again = [engine.generate(p, _cfg(llama, pp=2)).token_ids for p in PROMPTS[:2]]  # both slots serve
    assert other == alone[0]
    assert again == alone[:2]


def test_sessions_bounds():
    assert check_sessions(None, 3) == 3  # default: one per stage
    assert check_sessions(None, 1) == 1
    assert check_sessions(4, 1) == 1  # pp=1 runs one at a time
    assert check_sessions(2, 4) == 2
    for bad in (0, -1, 65):
        with pytest.raises(UserError, match="--sessions"):
            check_sessions(bad, 2)


def test_stage_spans_show_the_interleaving(ray_local, llama, tmp_path):
    """At S=2 the stage spans carry each forward's session, and two stages work at once
    (stage 0 on one session while the head's last stage runs the other); at S=1 they never
    do: a forward walks the stages one after another."""
    from memra_dist.phase.levels import TraceSettings
    from memra_dist.tracing.stage_busy import busy_of_items
    from memra_dist.tracing.otlp_json import read_spans

    def run(sessions, run_dir):
        cfg = _cfg(llama, pp=2, max_new_tokens=40, trace=TraceSettings(level=1))
        with open_engine(cfg, capacity=96, run_dir=str(run_dir), sessions=sessions) as engine:
            _all_at_once(engine, [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[4]])
        return read_spans(sorted(run_dir.glob("*spans.otlp.json")))

    two = run(2, tmp_path / "s2")
    fwd = [s for _r, s in two if s["name"] == "stage.forward"]
    sessions = {a["value"].get("intValue") for s in fwd for a in s["attributes"] if a["key"] == "memra.session"}
    assert sessions == {"0", "1"} or sessions == {0, 1}
    assert busy_of_items(two).overlap_ns > 0
    one = run(1, tmp_path / "s1")
    assert busy_of_items(one).overlap_ns == 0
