"""The batched engine's loop (memra_dist/batching/batcher.py `_run`): one thread launches every
step, whoever submitted its rows (a chained round, a prefill chunk, a level-2 round a session
runs itself, a request with the first-token profile); it is joined when the engine closes; a
step that breaks ends the requests it held, and the loop and the requests after them go on."""

from __future__ import annotations

import threading

import pytest

from memra_dist.app import open_engine
from memra_dist.batching import batcher as batcher_mod
from memra_dist.phase.levels import TraceSettings

from test_batching import CAP, _batched, _cfg, _prompts, _solo


def _spy_launches(monkeypatch) -> list[str]:
    """The name of the thread that launched each step."""
    names, real = [], batcher_mod.launch

    def spy(b, jobs, wakes, ids_dev=None):
        names.append(threading.current_thread().name)
        return real(b, jobs, wakes, ids_dev)
    monkeypatch.setattr(batcher_mod, "launch", spy)
    return names


def _at_once(eng, reqs, cfg, n: int = 4, stream_of=None, catch=RuntimeError):
    """Requests 0 .. n - 1 of `reqs` on `eng` from n threads at once (`cfg` with each one's
    max_new_tokens; `stream_of(i)`: request i's stream callback) -> (ids by request, error
    messages by request, `run(i)`: one more request on the caller's thread)."""
    got, errors = {}, {}

    def run(i):
        p, m = reqs[i]
        try:
            got[i] = eng.generate(p, cfg.with_(max_new_tokens=m),
                                  stream=stream_of(i) if stream_of is not None else None).token_ids
        except catch as e:
            errors[i] = str(e) or type(e).__name__
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got, errors, run


@pytest.mark.parametrize("trace", [TraceSettings(), TraceSettings(level=2), TraceSettings(prof=True)],
                         ids=["level0-chained", "level2-chained", "first-token-profile"])
def test_every_step_is_launched_by_the_engine_loop_and_ids_stay_solo(llama, monkeypatch, trace):
    reqs = _prompts(6)
    solo = _solo(llama, "ngram", reqs)
    names = _spy_launches(monkeypatch)
    batched, stats = _batched(llama, "ngram", reqs, max_batch=3, trace=trace)
    assert batched == solo
    assert stats["steps"] >= 20 and len(names) >= stats["steps"]
    assert set(names) == {"memra-engine-loop"}, sorted(set(names))
    if not trace.prof:  # (level 2 too: each round's verify job brings its step's sub-split)
        assert stats["chained_rounds"] > 0, stats  # the loop ran the rounds too
    else:
        assert stats["chained_rounds"] == 0, stats  # the sessions ran their rounds; the loop their steps


def test_the_loop_is_joined_when_the_engine_closes(llama):
    with open_engine(_cfg(llama, "ngram"), capacity=CAP, max_batch=2) as eng:
        eng.generate(_prompts(1)[0][0], _cfg(llama, "ngram", max_new_tokens=6))
        loop = eng._backend.batcher.loop
        assert loop is not None and loop.is_alive() and loop.name == "memra-engine-loop"
    assert not loop.is_alive()
    with pytest.raises(RuntimeError, match="closed"):  # nothing is queued on a closed engine
        eng._backend.batcher.submit(0, __import__("torch").tensor([1]), 0, 8, True)


def test_a_step_that_breaks_ends_its_requests_and_the_loop_goes_on(llama, monkeypatch):
    """A bug escaping a step (here: the step's readback staging raises on the 3rd step): the
    requests whose rows it held end with that error; the loop lives on, and requests submitted
    afterwards get their solo ids."""
    reqs = _prompts(4)
    solo = _solo(llama, "ngram", reqs)
    real, calls = batcher_mod.stage_readback, [0]

    def breaks(pv):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a bug in a step")
        return real(pv)
    monkeypatch.setattr(batcher_mod, "stage_readback", breaks)
    with open_engine(_cfg(llama, "ngram"), capacity=CAP, max_batch=2) as eng:
        errors, got = [], {}

        def one(i):
            p, n = reqs[i]
            try:
                got[i] = eng.generate(p, _cfg(llama, "ngram", max_new_tokens=n)).token_ids
            except RuntimeError as e:
                errors.append(str(e))
        first = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
        for t in first:
            t.start()
        for t in first:
            t.join(120)
        assert errors and all("a bug in a step" in e for e in errors), errors
        loop = eng._backend.batcher.loop
        assert loop.is_alive()
        for i in (2, 3):  # after the failure: their solo ids
            one(i)
            assert got[i] == solo[i]
        assert eng._backend.batcher.loop is loop  # the same loop thread went on


@pytest.mark.parametrize("level", [1, 2])
def test_each_step_is_one_span_of_its_own_and_every_round_that_rode_it_links_to_it(llama, level):
    """Traced, a batched step is a `batch.step` span in a trace of its own, made once (by
    whichever request's sink got there first), with the step's requests, rows, forward and KV
    blocks; every request's spec.round carries one span link to the step its verify rode in,
    with its share (rows, k, accepted), and the step lies inside that round."""
    from test_batching import traced_batched

    from memra_dist.tracing.conventions import ATTR, SPAN_BATCH_STEP, SPAN_ROUND

    reqs = _prompts(4)
    got, exps, stats = traced_batched(llama, "ngram", reqs, level)
    assert got == _solo(llama, "ngram", reqs)
    spans = [s for e in exps for s in e.get_finished_spans()]
    steps = [s for s in spans if s.name == SPAN_BATCH_STEP]
    by_id = {s.attributes[ATTR["batch_step"]]: s for s in steps}
    assert len(by_id) == len(steps) > 0  # each step's span made once
    request_traces = {s.context.trace_id for s in spans if s.name == SPAN_ROUND}
    assert not request_traces & {s.context.trace_id for s in steps} and all(s.parent is None for s in steps)
    rounds = [s for s in spans if s.name == SPAN_ROUND]
    assert rounds and any(s.attributes[ATTR["batch_requests"]] >= 2 for s in steps)
    for r in rounds:
        (link,) = r.links
        step = by_id[r.attributes[ATTR["batch_step"]]]
        assert link.context.span_id == step.context.span_id and link.context.trace_id == step.context.trace_id
        assert link.attributes[ATTR["k"]] == r.attributes[ATTR["k"]]
        assert link.attributes[ATTR["accepted"]] == r.attributes[ATTR["accepted"]]
        assert link.attributes[ATTR["rows"]] == r.attributes[ATTR["k"]] + 1
        slack = 1_000_000  # 1 ms: each sink maps perf_counter to the epoch with its own offset (emit.clock_offset)
        assert r.start_time - slack <= step.start_time <= step.end_time <= r.end_time + slack
    assert max(by_id) < stats["steps"] and all(s.attributes[ATTR["batch_rows"]] >= 1 for s in steps)


def test_a_drafters_error_ends_its_own_request_and_every_other_goes_on(llama, monkeypatch):
    """One request's drafter raises once it has produced a few tokens (in the loop's chained
    round, its proposal); that request ends with the error, the three batched with it get their
    solo ids, and a request submitted afterwards too."""
    from memra_dist.specdec.drafters import ngram

    reqs = _prompts(5)
    solo = _solo(llama, "ngram", reqs)
    bad = reqs[1][0]
    real = ngram.NgramDrafter.propose

    def propose(self, context, k, sp, gen):
        if context[:len(bad)] == bad and len(context) > len(bad) + 3:
            raise RuntimeError("a drafter's bug")
        return real(self, context, k, sp, gen)
    monkeypatch.setattr(ngram.NgramDrafter, "propose", propose)
    with open_engine(_cfg(llama, "ngram"), capacity=CAP, max_batch=4) as eng:
        got, errors, one = _at_once(eng, reqs, _cfg(llama, "ngram"))
        assert errors == {1: "a drafter's bug"}, errors
        assert all(got[i] == solo[i] for i in (0, 2, 3))
        one(4)
        assert got[4] == solo[4]
        assert eng._backend.stats()["chained_rounds"] > 0


def test_each_step_span_says_how_long_the_device_idled_before_it_and_why(llama, monkeypatch):
    """A step's span carries the device's idle time before it (`memra.batch.gap_ms`) and, of it,
    the loop's chained rounds after the step before (`rounds_ms`: here n-gram proposals slowed
    to 3 ms each) and the time it held the step for a request still on the host (`held_ms`):
    the parts never exceed the gap, the rounds show the slowed drafts, and over the spans the
    gaps add up to no more than the engine's own count."""
    import time

    from test_batching import traced_batched

    from memra_dist.specdec.drafters import ngram
    from memra_dist.tracing.conventions import ATTR, SPAN_BATCH_STEP

    real = ngram.NgramDrafter.propose

    def slow(self, context, k, sp, gen):
        time.sleep(0.003)
        return real(self, context, k, sp, gen)

    monkeypatch.setattr(ngram.NgramDrafter, "propose", slow)
    reqs = _prompts(4)
    got, exps, stats = traced_batched(llama, "ngram", reqs, 1)
    assert got == _solo(llama, "ngram", reqs)
    steps = [s for e in exps for s in e.get_finished_spans() if s.name == SPAN_BATCH_STEP]
    a = {k: ATTR[f"batch_{k}_ms"] for k in ("gap", "rounds", "held")}
    for s in steps:
        gap, rounds, held = (s.attributes[a[k]] for k in ("gap", "rounds", "held"))
        assert 0 <= rounds <= gap + 1e-6 and 0 <= held <= gap + 1e-6, s.attributes
    # a step after a round of 2+ chained requests waited for their slowed proposals
    busy = [s for s in steps if s.attributes[a["rounds"]] >= 3 * 2 * 0.9]
    assert busy and all(s.attributes[a["gap"]] >= s.attributes[a["rounds"]] for s in busy)
    assert sum(s.attributes[a["gap"]] for s in steps) <= stats["gap_ms"] + 0.1 * len(steps), stats


def test_no_step_waits_for_a_request_while_its_drafter_primes(llama, monkeypatch):
    """A request between its prompt's last step and its first round (drawing its first token,
    priming its drafter: here 0.4 s) is away from the steps: the request already decoding
    keeps stepping without the loop holding each of its steps up to the batcher's wait for it
    (~5 ms a step: 140-160 ms over the prime on CPU), and both get their solo ids."""
    import time

    from memra_dist.specdec.drafters import ngram

    real = ngram.NgramDrafter.prime
    slow_for = {}

    def prime(self, prompt, chunks=None):
        if tuple(prompt) in slow_for:
            time.sleep(0.4)
        return real(self, prompt, chunks)

    monkeypatch.setattr(ngram.NgramDrafter, "prime", prime)
    (pa, na), (pb, nb) = _prompts(2)
    na = 120  # still decoding while the second request primes
    slow_for[tuple(pb)] = True
    got = {}
    with open_engine(_cfg(llama, "ngram"), capacity=CAP, max_batch=2) as eng:
        def one(key, p, n):
            got[key] = eng.generate(p, _cfg(llama, "ngram", max_new_tokens=n)).token_ids

        ta = threading.Thread(target=one, args=("a", pa, na))
        ta.start()
        time.sleep(0.05)
        one("b", pb, nb)
        ta.join(120)
        eng._backend.batcher.wait_idle(30)
        st = eng.batch_stats()
    assert [got["a"], got["b"]] == _solo(llama, "ngram", [(pa, na), (pb, nb)])
    assert st["held_ms"] < 40, st  # (without the request stepping away: ~140-160 ms on CPU)


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_at_level_0_the_loop_never_drains_the_device_for_a_tap_drafters_maintenance(llama, tmp_path_factory,
                                                                                  monkeypatch, drafter):
    """Nothing is recorded at trace level 0, so no phase boundary is drained: the loop's shared
    maintenance of a tap drafter (DFlash's ingest) runs on without a wait for the device (a drain
    there kept the device idle while the loop launched the drafts after it); the ids are the solo ids."""
    from test_batching import _batched, _tap_drafter

    from memra_dist.device import Drainer

    drains = []
    real = Drainer.__call__
    monkeypatch.setattr(Drainer, "__call__", lambda self: drains.append(1) or real(self))
    ddir = str(_tap_drafter(drafter, llama, tmp_path_factory))
    reqs = _prompts(4)
    solo = _solo(llama, drafter, reqs, draft_model=ddir)
    drains.clear()
    got, stats = _batched(llama, drafter, reqs, max_batch=4, draft_model=ddir, spec_k="fixed")
    assert got == solo
    assert stats["draft_batches"] > 0 and not drains, (len(drains), stats["draft_batches"])


def test_a_dflash_request_the_loop_never_drafts_for_costs_the_loop_no_ingest(llama, tmp_path_factory, monkeypatch):
    """With --spec-k auto choosing K 0 every step (a request's first round too), the engine loop
    never runs a batched DFlash request's drafter past its prime: no maintenance (it would catch
    up when it drafted again), none as the request ends, no proposal. The prime itself is the
    loop's (primes.py): every request's drafter primed there, none on a request's thread. The
    ids are the solo ids."""
    import memra_dist.batching.loop_rounds as lr
    import memra_dist.batching.primes as bm
    from test_batching import _batched, _tap_drafter

    from memra_dist.specdec.drafters import dflash, dflash_batch

    ddir = str(_tap_drafter("dflash", llama, tmp_path_factory))
    reqs = _prompts(4)
    solo = _solo(llama, "dflash", reqs, draft_model=ddir)
    in_loop, priming, primed_on = [], [], set()

    def note(n):
        name = threading.current_thread().name
        if priming:
            primed_on.add(name)
        elif name == "memra-engine-loop" and n > 0:
            in_loop.append(n)

    def primes(ps):
        priming.append(True)
        try:
            real_primes(ps)
        finally:
            priming.clear()

    real_one, real_many, real_primes = dflash.DFlashDrafter._ingest, dflash_batch.ingest_many, bm.run_primes
    monkeypatch.setattr(dflash.DFlashDrafter, "_ingest",
                        lambda self, upto, depth=None: note(upto - self.n) or real_one(self, upto, depth))
    monkeypatch.setattr(dflash_batch, "ingest_many",
                        lambda ds, uptos: [note(u - d.n) for d, u in zip(ds, uptos)] and real_many(ds, uptos))
    monkeypatch.setattr(bm, "run_primes", primes)
    monkeypatch.setattr(lr, "choose", lambda reqs_, cost, others=None: [0] * len(reqs_))
    got, stats = _batched(llama, "dflash", reqs, max_batch=4, draft_model=ddir, spec_k="auto")
    assert got == solo
    assert stats["k_chosen"] and set(stats["k_chosen"]) == {"0"}, stats["k_chosen"]
    assert not in_loop, in_loop
    assert stats["loop_primes"] == 4 and primed_on == {"memra-engine-loop"}, (stats["loop_primes"], primed_on)


@pytest.mark.parametrize("drafter", ["ngram", "replay"])
def test_a_host_drafters_rounds_make_no_torch_call_on_the_loops_path(llama, monkeypatch, drafter):
    """Between two steps the loop settles, maintains and proposes every chained round while the
    device waits; a host drafter's rounds (acceptance, commit, its lookup) run on host lists
    alone there: each torch call would give the GIL up to the streaming request threads (tens of
    microseconds each under 16 of them). Counted with a torch-function mode around the loop's
    rounds (the mode is the loop thread's own)."""
    from torch.overrides import TorchFunctionMode

    calls, rounds = [], [0]

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    real = batcher_mod.chain_rounds

    def counted(b, jobs):
        rounds[0] += 1
        with Count():
            return real(b, jobs)
    monkeypatch.setattr(batcher_mod, "chain_rounds", counted)
    reqs = _prompts(6)
    kw = {"replay_corrupt": 0.3} if drafter == "replay" else {}
    solo = _solo(llama, drafter, reqs, **kw)
    got, stats = _batched(llama, drafter, reqs, max_batch=3, **kw)
    assert got == solo
    assert rounds[0] >= 20 and stats["chained_rounds"] >= 40, stats
    assert calls == [], sorted(set(calls))


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_new_requests_drafters_are_primed_together_by_the_loop(llama, tmp_path_factory, monkeypatch, drafter):
    """Four requests admitted together: the loop allocates and primes their tap drafters
    (batching/primes.py), those that come in together in one shared prime (`prime_many`: their
    chunks packed into one forward), then proposes their first rounds together: no request's
    thread primes or proposes; every proposal equals the request's solo one and the ids are
    the solo ids."""
    from memra_dist.specdec.drafters.base import Drafter

    from test_batching import _drafter_cls, _tap_drafter, spy_proposals

    cls = _drafter_cls(drafter)
    ddir = str(_tap_drafter(drafter, llama, tmp_path_factory))
    seen = spy_proposals(monkeypatch, cls)
    reqs = _prompts(4)
    solo = _solo(llama, drafter, reqs, draft_model=ddir)
    alone, seen[:] = sorted(seen), []
    shared, threads = [], set()
    real_many, real_one = cls.prime_many, cls.prime

    def many(ds, prompts, chunks, rows=0):
        shared.append(len(ds))
        threads.add(threading.current_thread().name)
        real_many(ds, prompts, chunks, rows)

    def one(self, prompt, chunks=None):
        threads.add(threading.current_thread().name)
        real_one(self, prompt, chunks)

    monkeypatch.setattr(cls, "prime_many", staticmethod(many))
    monkeypatch.setattr(cls, "prime", one)
    proposers, spied_one, spied_many = set(), cls.propose, cls.propose_many

    def propose(self, *a):
        proposers.add(threading.current_thread().name)
        return spied_one(self, *a)

    def propose_many(*a, **kw):
        proposers.add(threading.current_thread().name)
        return spied_many(*a, **kw)

    monkeypatch.setattr(cls, "propose", propose)
    monkeypatch.setattr(cls, "propose_many", staticmethod(propose_many))
    from memra_dist.specdec.drafters import dflash_batch, eagle3_batch

    budgets, passes, real_pack = [], [], dflash_batch.pack_chunks

    def pack(lists, rows):  # the shared forwards: several requests' chunks each, within the chunk
        budgets.append(rows)
        out = real_pack(lists, rows)
        passes.extend(out)
        return out

    for mod in (dflash_batch, eagle3_batch):
        monkeypatch.setattr(mod, "pack_chunks", pack)
    assert not hasattr(Drafter, "prime_many")  # (only the classes that share a forward have one)
    got, stats = _batched(llama, drafter, reqs, max_batch=4, draft_model=ddir, gate=True)
    assert got == solo and sorted(seen) == alone
    assert threads == {"memra-engine-loop"} and proposers == {"memra-engine-loop"}, (threads, proposers)
    assert stats["loop_primes"] == 4 and shared and max(shared) >= 2, (stats["loop_prime_runs"], shared)
    assert stats["loop_prime_runs"] < 4
    assert budgets and min(budgets) >= 40, budgets  # the prefill chunk (40), not one request's rows
    assert max(len(p) for p in passes) >= 2 and all(sum(hi - lo for _, lo, hi in p) <= 40 for p in passes
                                                     if len(p) > 1), passes


def test_a_drafter_prime_that_fails_ends_its_own_request_only(llama, tmp_path_factory, monkeypatch):
    """One request's DFlash prime raises, in the loop's shared prime and again alone: that
    request ends with the error, the three primed with it get their solo ids (the shared prime
    is run again one by one), and the engine serves the next request."""
    from memra_dist.specdec.drafters.dflash import DFlashDrafter

    from test_batching import _tap_drafter

    ddir = str(_tap_drafter("dflash", llama, tmp_path_factory))
    reqs = _prompts(5)
    solo = _solo(llama, "dflash", reqs, draft_model=ddir)
    bad = reqs[2][0]
    real_many, real_one = DFlashDrafter.prime_many, DFlashDrafter.prime

    def many(ds, prompts, chunks, rows=0):
        if bad in prompts:
            raise RuntimeError("a prime's bug")
        real_many(ds, prompts, chunks, rows)

    def one(self, prompt, chunks=None):
        if prompt == bad:
            raise RuntimeError("a prime's bug")
        real_one(self, prompt, chunks)

    monkeypatch.setattr(DFlashDrafter, "prime_many", staticmethod(many))
    monkeypatch.setattr(DFlashDrafter, "prime", one)
    with open_engine(_cfg(llama, "dflash", draft_model=ddir), capacity=CAP, max_batch=4) as eng:
        got, errors, run = _at_once(eng, reqs, _cfg(llama, "dflash", draft_model=ddir))
        assert errors == {2: "a prime's bug"}, errors
        assert all(got[i] == solo[i] for i in (0, 1, 3))
        run(4)
        assert got[4] == solo[4]
        assert eng._backend.batcher.wait_idle(60)
        assert eng._backend.draft_pool.owners.held == 0  # the failed request's slot came back too


def test_a_bug_starting_new_chains_ends_those_requests_and_the_engine_goes_on(llama, tmp_path_factory, monkeypatch):
    """The loop's start of new requests' chains (their K under --spec-k auto, their first
    proposals) raises once: the requests it was starting end with that error instead of waiting
    for rounds that never come, and the engine serves the next request its solo ids."""
    import memra_dist.batching.primes as primes

    from test_batching import _tap_drafter

    ddir = str(_tap_drafter("dflash", llama, tmp_path_factory))
    reqs = _prompts(3)
    solo = _solo(llama, "dflash", reqs, draft_model=ddir)
    real, calls = primes.choose_first_k, []

    def broken(b, chains):
        calls.append(len(chains))
        if len(calls) == 1:
            raise RuntimeError("a bug choosing K")
        real(b, chains)

    monkeypatch.setattr(primes, "choose_first_k", broken)
    cfg = _cfg(llama, "dflash", draft_model=ddir, spec_k="auto")
    with open_engine(cfg, capacity=CAP, max_batch=4) as eng:
        got, errors, run = _at_once(eng, reqs, cfg, n=2)
        assert calls and set(errors.values()) == {"a bug choosing K"} and len(errors) == calls[0], (errors, calls)
        assert all(got[i] == solo[i] for i in got)
        run(2)
        assert got[2] == solo[2]
        assert eng._backend.batcher.wait_idle(60)


def test_a_request_that_ends_at_its_first_token_primes_no_drafter(llama, tmp_path_factory):
    """Two of four DFlash requests ask for one token: they end at their first token, with no
    prime and no chain (nothing would draft for them); the other two are primed by the loop, and
    every request gets its solo ids."""
    from test_batching import _tap_drafter

    ddir = str(_tap_drafter("dflash", llama, tmp_path_factory))
    reqs = [(p, 1 if i % 2 else n) for i, (p, n) in enumerate(_prompts(4))]
    solo = _solo(llama, "dflash", reqs, draft_model=ddir)
    got, stats = _batched(llama, "dflash", reqs, max_batch=4, draft_model=ddir)
    assert got == solo and all(len(got[i]) == 1 for i in (1, 3))
    assert stats["loop_primes"] == 2, stats["loop_primes"]


def test_a_client_gone_at_its_first_token_while_its_drafter_primes_leaks_nothing(llama, tmp_path_factory,
                                                                                monkeypatch):
    """The loop primes a new request's drafter while the request streams its first token (the
    prime does not hold the first token back). A client gone at that token leaves while its
    prime is queued or running (slowed here to 50 ms): the request ends, its queued prime is
    dropped or its running one waited for, so its draft-pool slot comes back; the three others
    get their solo ids."""
    import time as _time

    from memra_dist.specdec.drafters.dflash import DFlashDrafter

    from test_batching import _tap_drafter

    ddir = str(_tap_drafter("dflash", llama, tmp_path_factory))
    reqs = _prompts(4)
    solo = _solo(llama, "dflash", reqs, draft_model=ddir)
    real_many, real_one = DFlashDrafter.prime_many, DFlashDrafter.prime

    def slow_many(ds, prompts, chunks, rows=0):
        _time.sleep(0.05)
        real_many(ds, prompts, chunks, rows)

    def slow_one(self, prompt, chunks=None):
        _time.sleep(0.05)
        real_one(self, prompt, chunks)

    monkeypatch.setattr(DFlashDrafter, "prime_many", staticmethod(slow_many))
    monkeypatch.setattr(DFlashDrafter, "prime", slow_one)

    class Gone(Exception):
        pass

    def gone(_tokens):
        raise Gone

    with open_engine(_cfg(llama, "dflash", draft_model=ddir), capacity=CAP, max_batch=4) as eng:
        got, errors, _ = _at_once(eng, reqs, _cfg(llama, "dflash", draft_model=ddir),
                                  stream_of=lambda i: gone if i == 1 else None, catch=Gone)
        assert errors == {1: "Gone"} and all(got[i] == solo[i] for i in (0, 2, 3)), (errors, sorted(got))
        b = eng._backend
        assert b.batcher.wait_idle(60) and not b.batcher.primes and not b.batcher.priming_now
        assert b.draft_pool.owners.held == 0  # every slot back, the departed request's too
