"""Rounds the step leader runs (memra_dist/batching/chain.py): a batched greedy request whose
drafter needs only the host (none, ngram) hands its rounds to the batcher, which accepts,
commits, trims and drafts for it right after each step and queues its next verify; its own
thread only takes the rounds. What must hold (CPU, fp32): the ids are the solo ids, every
round is the leader's, the steps never wait for a request's thread (a stream that blocks does
not stop the rounds), a request that leaves mid-chain loses nobody else anything, a chain
whose blocks run out hands one round back to its session, and a non-finite row is named as
alone."""

from __future__ import annotations

import threading
import time

import pytest

from memra_dist.app import open_engine
from memra_dist.specdec.sampling import NonFiniteLogits

from test_batching import CAP, _batched, _cfg, _prompts, _solo


def _solo_stats(model, drafter, reqs) -> list[dict]:
    with open_engine(_cfg(model, drafter), capacity=CAP) as eng:
        return [eng.generate(p, _cfg(model, drafter, max_new_tokens=n)).stats for p, n in reqs]


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_every_round_of_a_greedy_host_drafted_request_is_the_leaders(llama, drafter):
    reqs = _prompts(8)
    solo = _solo(llama, drafter, reqs)
    rounds = sum(s["rounds"] for s in _solo_stats(llama, drafter, reqs))
    batched, stats = _batched(llama, drafter, reqs, max_batch=4)
    assert batched == solo
    assert stats["chained_rounds"] == rounds, stats  # the sessions ran none of them
    assert stats["chain_parks"] == 0 and stats["kv_blocks_used"] == 0, stats


@pytest.mark.parametrize("blocks_at", [1, 2])
def test_a_stream_that_blocks_does_not_stop_the_rounds(llama, blocks_at):
    """Every request's stream blocks on its first token (1: its first round was queued before
    the caller received that token, not after) or its first decoded token (2); the leader still
    runs every round of every request to its end (the steps wait for no request's thread), and
    once the streams go on each request receives its solo ids."""
    reqs = _prompts(4)
    solo = _solo(llama, "none", reqs)
    rounds = sum(s["rounds"] for s in _solo_stats(llama, "none", reqs))
    gate = threading.Event()
    got: dict[int, list[int]] = {}
    with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=4) as eng:
        b = eng._backend.batcher

        def one(i, p, n):
            calls = []

            def stream(toks):
                calls.append(toks)
                if len(calls) == blocks_at:
                    assert gate.wait(60)

            got[i] = eng.generate(p, _cfg(llama, "none", max_new_tokens=n), stream=stream).token_ids

        threads = [threading.Thread(target=one, args=(i, p, n), daemon=True) for i, (p, n) in enumerate(reqs)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while b.stats.chained < rounds and time.monotonic() < deadline:
            time.sleep(0.01)
        ran = b.stats.chained
        gate.set()
        for t in threads:
            t.join(60)
    assert ran == rounds, (ran, rounds)
    assert [got.get(i) for i in range(len(reqs))] == solo


def _with_a_victim(llama, victim_stream, again_of: int):
    """Four ngram requests at once on a 4-wide batched engine, request 0 (thread "victim")
    streaming through `victim_stream(toks, seen)`: (ids by request, errors by request, the
    solo ids, request `again_of` run once more after, the backend's stats, the batcher). The
    victim asks for 40 tokens: its chain still has rounds to run when its thread parks."""
    reqs = _prompts(4)
    reqs[0] = (reqs[0][0], 40)
    solo = _solo(llama, "ngram", reqs)
    got: dict[int, list[int]] = {}
    errs: dict[int, BaseException] = {}
    with open_engine(_cfg(llama, "ngram"), capacity=CAP, max_batch=4) as eng:
        def one(i, p, n):
            seen: list[int] = []

            def stream(toks):
                seen.extend(toks)
                if i == 0:
                    victim_stream(seen)

            try:
                got[i] = eng.generate(p, _cfg(llama, "ngram", max_new_tokens=n), stream=stream).token_ids
            except BaseException as e:  # noqa: BLE001 (the tests name every error)
                errs[i] = e

        threads = [threading.Thread(target=one, args=(i, p, n), name="victim" if i == 0 else f"r{i}")
                   for i, (p, n) in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        again = eng.generate(reqs[again_of][0], _cfg(llama, "ngram", max_new_tokens=reqs[again_of][1])).token_ids
        return got, errs, solo, again, eng._backend.stats(), eng._backend.batcher


def test_a_request_leaving_mid_chain_costs_the_others_nothing(llama):
    """A client that goes away (its stream raises) mid-request: its queued rows leave the step
    queue and its blocks go back; the others keep their solo ids, and the engine serves on."""
    def victim(seen):
        if len(seen) >= 3:
            raise ConnectionError("client went away")

    got, errs, solo, again, stats, batcher = _with_a_victim(llama, victim, again_of=0)
    assert {i: type(e).__name__ for i, e in errs.items()} == {0: "ConnectionError"} and _prompts(4)[0][1] > 3
    assert [got.get(i) for i in range(1, 4)] == solo[1:]
    assert again == solo[0]
    assert stats["kv_blocks_used"] == 0 and not batcher.pending, stats


def test_a_request_leaving_while_a_step_holds_its_rows_fails_nobody(llama, monkeypatch):
    """The race a streaming client that goes away hits: its thread leaves (its blocks freed)
    while the leader, the lock dropped, launches a step that holds its rows. Here the victim's
    thread waits in its stream while its chain runs on, and the next step holding its rows
    lets it leave and waits for the leave before building: the leave is deferred to the
    step's end, so the step runs, the others keep their solo ids and the engine serves on."""
    import memra_dist.batching.batcher as batcher_mod
    from memra_dist.batching.step_forward import wake

    cv = threading.Condition()
    state = {"rid": None, "left": False, "raced": 0}
    parked, go = threading.Event(), threading.Event()
    real_admit, real_leave, real_launch = batcher_mod.Batcher.admit, batcher_mod.Batcher.leave, batcher_mod.launch

    def admit(self, rid, *a, **kw):
        if threading.current_thread().name == "victim":
            state["rid"] = rid
        return real_admit(self, rid, *a, **kw)

    def leave(self, rid):
        real_leave(self, rid)
        with cv:
            state["left"] = state["left"] or rid == state["rid"]
            cv.notify_all()

    def launch(b, jobs, wakes, ids_dev=None):
        """The first step holding the victim's rows once its thread is parked in its stream:
        its client goes away now, and the step waits for its leave before building. From the
        victim's third step on (its prefill, its first round, then this), a step waits for its
        thread to park first, so its chain cannot run ahead to its end meanwhile."""
        if state["rid"] in {j.rid for j in jobs}:
            state["steps"] = state.get("steps", 0) + 1
            if state["steps"] >= 3:  # the rounds the step before gave reach their threads now, not
                wake(wakes)  # after this launch: the victim's thread must be free to take its round and park
                wakes = ()
                parked.wait(10)
        if parked.is_set() and not go.is_set() and state["rid"] in {j.rid for j in jobs}:
            go.set()
            with cv:
                cv.wait_for(lambda: state["left"], timeout=10)
                state["raced"] += state["left"]
        return real_launch(b, jobs, wakes, ids_dev)

    monkeypatch.setattr(batcher_mod.Batcher, "admit", admit)
    monkeypatch.setattr(batcher_mod.Batcher, "leave", leave)
    monkeypatch.setattr(batcher_mod, "launch", launch)

    def victim(seen):
        if len(seen) >= 2:  # the victim's thread waits here; its chain runs on
            parked.set()
            go.wait(30)
            raise ConnectionError("client went away")

    got, errs, solo, again, stats, batcher = _with_a_victim(llama, victim, again_of=1)
    assert state["raced"] == 1, state  # the leave did land inside a launch holding the victim's rows
    assert {i: type(e).__name__ for i, e in errs.items()} == {0: "ConnectionError"}
    assert [got.get(i) for i in range(1, 4)] == solo[1:]
    assert again == solo[1]
    assert stats["kv_blocks_used"] == 0 and not batcher.leaving and not batcher.pending, stats


def test_a_chain_out_of_blocks_hands_a_round_back_and_loses_nothing(llama):
    """A pool a little larger than the longest request: a chain whose next rows find no free
    block parks, its session runs that round itself (waiting, or swapping another request
    out), and chains again; every request keeps its solo ids."""
    reqs = _prompts(8)
    solo = _solo(llama, "none", reqs)
    most = max(len(p) + n + 4 for p, n in reqs)
    batched, stats = _batched(llama, "none", reqs, max_batch=6, kv_rows=most + 32)
    assert batched == solo
    assert stats["chain_parks"] >= 1 and stats["chained_rounds"] > 0, stats
    assert stats["kv_blocks_used"] == 0


def test_a_non_finite_row_in_a_chained_round_is_named_as_alone(llama):
    """A weight that turns NaN mid-request (after the first decoded token): the leader's
    acceptance finds the row and the request fails with the session's one line, naming the
    layer; another request on the engine is unaffected once the weight is mended."""
    import torch

    prompt, n = _prompts(1)[0]
    with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=2) as eng:
        w = eng._backend.runner.stage.layers["1"].mlp.down_proj.weight
        keep = w.detach().clone()

        def stream(toks):
            if len(toks) and stream.calls == 1:
                with torch.no_grad():
                    w.fill_(float("nan"))
            stream.calls += 1

        stream.calls = 0
        with pytest.raises(NonFiniteLogits, match=r"non-finite logits .* verify row 0\): .*layer 1"):
            # long enough that the leader's rounds cannot all be done before the weight turns
            eng.generate(prompt, _cfg(llama, "none", max_new_tokens=100), stream=stream)
        assert eng._backend.stats()["chained_rounds"] >= 1  # the leader's round found it
        with torch.no_grad():
            w.copy_(keep)
        assert eng.generate(prompt, _cfg(llama, "none", max_new_tokens=n)).token_ids == _solo(llama, "none", [(prompt, n)])[0]


def test_greedy_sampled_and_level2_requests_all_chained_share_steps_and_keep_their_ids(llama):
    """Greedy requests, sampled ones (a sampled round accepted on the step's logits with the
    request's own generator) and level-2 traced ones (each round's verify job bringing its step's
    sub-split) in one engine at once: the leader runs every one's rounds, they ride the same
    steps, and each gets its solo ids (their laps: test_batching's level-2 spans)."""
    from memra_dist.phase.levels import TraceSettings
    from memra_dist.specdec.sampling import SamplingParams

    reqs = _prompts(6)
    sampled = dict(sampling=SamplingParams(temperature=0.8, top_k=20), seed=5)
    own = dict(trace=TraceSettings(level=2))
    kws = [(sampled, own, {})[i % 3] for i in range(len(reqs))]
    with open_engine(_cfg(llama, "ngram"), capacity=CAP) as eng:
        alone = [eng.generate(p, _cfg(llama, "ngram", max_new_tokens=n, **kw)) for (p, n), kw in zip(reqs, kws)]
    solo = [r.token_ids for r in alone]
    led_rounds = sum(r.stats["rounds"] for r in alone)
    got, stats = _batched(llama, "ngram", reqs, max_batch=6, each=kws)
    assert got == solo
    assert stats["chained_rounds"] == led_rounds, stats  # every request's rounds
    assert stats["max_requests"] >= 4 and stats["kv_blocks_used"] == 0, stats


def test_a_step_that_fails_fails_each_chained_request_it_held(llama, monkeypatch):
    """A decode step whose forward raises: every chained request that rode it gets the error
    (none waits forever), its blocks go back, and the engine serves the next request."""
    reqs = _prompts(3)
    errs: dict[int, BaseException] = {}
    with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=3) as eng:
        from memra_dist.batching import step_forward

        b = eng._backend.batcher
        real = step_forward.eager

        def eager(batcher, jobs, ids_dev=None, timer=None, patch=None):
            if not any(j.last for j in jobs) and b.stats.chained >= 6:
                raise RuntimeError("device lost")
            return real(batcher, jobs, ids_dev, timer, patch)

        monkeypatch.setattr(step_forward, "eager", eager)

        def one(i, p, n):
            try:
                eng.generate(p, _cfg(llama, "none", max_new_tokens=40))
            except RuntimeError as e:
                errs[i] = e

        threads = [threading.Thread(target=one, args=(i, p, n), daemon=True) for i, (p, n) in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a chained request waited forever"
        monkeypatch.setattr(step_forward, "eager", real)
        again = eng.generate(reqs[0][0], _cfg(llama, "none", max_new_tokens=reqs[0][1])).token_ids
        assert eng._backend.stats()["kv_blocks_used"] == 0
    assert sorted(errs) == [0, 1, 2] and all("device lost" in str(e) for e in errs.values()), errs
    assert again == _solo(llama, "none", reqs[:1])[0]


def _run_ahead(model, reqs, max_batch=6, kv_rows=None):
    """The requests (drafter none, greedy) through a batched engine whose plain chains go one
    step ahead (on a GPU's graphed steps by default; forced here on the CPU's eager steps)."""
    return _batched(model, "none", reqs, max_batch=max_batch, kv_rows=kv_rows,
                    on_open=lambda eng: setattr(eng._backend.batcher, "ahead", True))


def test_plain_chains_one_step_ahead_get_their_solo_ids(llama):
    """Steps launched behind the step before, their ids its argmax on the device: the
    requests (of different lengths, ending in the middle of others, joining while others
    decode) get their solo ids, and most steps went ahead."""
    reqs = _prompts(12)
    solo = _solo(llama, "none", reqs)
    rounds = sum(s["rounds"] for s in _solo_stats(llama, "none", reqs))
    got, stats = _run_ahead(llama, reqs)
    assert got == solo
    assert stats["chained_rounds"] == rounds and stats["ahead_steps"] >= stats["steps"] // 3, stats
    assert stats["kv_blocks_used"] == 0, stats


def test_a_request_ending_at_an_eos_drops_its_row_launched_ahead(llama, tmp_path):
    """A checkpoint whose EOS is a token the requests produce mid-way: requests end at it while
    their next row already runs one step ahead; that row is dropped (counted), and every
    request gets its solo ids, ending at the EOS as alone."""
    import json
    import shutil

    reqs = _prompts(6)
    plain = _solo(llama, "none", reqs)
    eos = next(t for out in plain for t in out[3:-2])  # a token some request makes mid-way
    ck = tmp_path / "eos"
    shutil.copytree(llama, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["eos_token_id"] = int(eos)
    (ck / "config.json").write_text(json.dumps(cfg))
    solo = _solo(ck, "none", reqs)
    assert any(len(s) < n + 1 and s[-1] == eos for s, (_, n) in zip(solo, reqs))  # some end at the EOS
    got, stats = _run_ahead(ck, reqs)
    assert got == solo
    assert stats["void_rows"] >= 1 and stats["kv_blocks_used"] == 0, stats


def test_plain_chains_ahead_with_blocks_running_out_lose_nothing(llama):
    """Going ahead grows each request's blocks first; a pool too small for that stops going
    ahead (or parks a chain) and every request keeps its solo ids. Whether a parked chain's
    session then waits or swaps another request out depends on which thread gets there first
    (one CI run swapped none), so preemption is held by the tests that crowd the pool on
    purpose (test_batching.py, _crowded), not here."""
    reqs = _prompts(8)
    solo = _solo(llama, "none", reqs)
    most = max(len(p) + n + 4 for p, n in reqs)
    got, stats = _run_ahead(llama, reqs, kv_rows=most + 32)
    assert got == solo
    assert stats["ahead_steps"] > 0 and stats["chain_parks"] >= 1, stats
    assert stats["kv_blocks_used"] == 0, stats


def test_a_request_going_ahead_streams_each_token_as_its_step_ends(llama):
    """While its steps run one step ahead, a request's tokens reach its stream step by step
    (each round's thread is woken as soon as the leader has run the round), not in a burst
    when the run of steps ahead ends."""
    prompt, n = _prompts(1)[0][0], 40
    seen: list[int] = []
    with open_engine(_cfg(llama, "none"), capacity=CAP, max_batch=2) as eng:
        b = eng._backend.batcher
        b.ahead = True
        out = eng.generate(prompt, _cfg(llama, "none", max_new_tokens=n), stream=lambda t: seen.append(b.stats.steps))
        stats = eng._backend.stats()
    assert len(out.token_ids) == n and stats["ahead_steps"] >= n // 2, stats
    lag = [s - i for i, s in enumerate(seen)]  # steps ended when the stream got its i-th call (the anchor: 1 step)
    # a burst at the end would lag by the whole run (~n); a woken thread may wait a few steps for
    # the GIL on a loaded machine (one run on 2 busy cores lagged 5), so the bound is n / 4
    assert max(lag) - min(lag) <= n // 4, seen


def test_a_shared_draft_forward_that_fails_fails_the_requests_in_it_and_the_engine_serves_on(
        llama, tmp_path_factory, monkeypatch):
    """DFlash requests drafted together by the step leader (chain_drafts.py): a block forward that
    raises ends each chained request that took part in it with the error (none waits forever),
    their blocks go back, and the next requests get their solo ids."""
    from memra_dist.specdec.drafters.dflash import DFlashDrafter

    from test_batching import _tap_drafter

    ddir = str(_tap_drafter("dflash", llama, tmp_path_factory))
    reqs = _prompts(3)
    solo = _solo(llama, "dflash", reqs, draft_model=ddir)
    real, calls = DFlashDrafter.propose_many, [0]

    def failing(drafters, contexts, ks, sps, gens, **kw):
        calls[0] += 1
        if calls[0] >= 3 and len(drafters) > 1:
            raise RuntimeError("draft device lost")
        return real(drafters, contexts, ks, sps, gens, **kw)

    errs: dict[int, BaseException] = {}
    with open_engine(_cfg(llama, "dflash", draft_model=ddir), capacity=CAP, max_batch=3) as eng:
        monkeypatch.setattr(DFlashDrafter, "propose_many", staticmethod(failing))

        def one(i, p):
            try:
                eng.generate(p, _cfg(llama, "dflash", draft_model=ddir, max_new_tokens=40))
            except RuntimeError as e:
                errs[i] = e

        threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, (p, _) in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a chained request waited forever"
        monkeypatch.setattr(DFlashDrafter, "propose_many", staticmethod(real))
        again = [eng.generate(p, _cfg(llama, "dflash", draft_model=ddir, max_new_tokens=n)).token_ids for p, n in reqs]
        stats = eng._backend.stats()
    assert len(errs) >= 2 and all("draft device lost" in str(e) for e in errs.values()), errs
    assert again == solo and stats["kv_blocks_used"] == 0, stats


def test_a_shared_draft_forward_is_named_on_each_round_it_drafted(llama, tmp_path_factory):
    """Traced at level 1, a DFlash round the step leader ran names on its spec.round the requests
    its draft forward drafted together (memra.batch.draft_requests); every request of that
    forward shows the same draft start (the forward's), so the shared draft is seen side by side."""
    from memra_dist.tracing.conventions import ATTR, SPAN_ROUND

    from test_batching import _tap_drafter, traced_batched

    ddir = str(_tap_drafter("dflash", llama, tmp_path_factory))
    reqs = _prompts(4)
    solo = _solo(llama, "dflash", reqs, draft_model=ddir)
    got, exps, stats = traced_batched(llama, "dflash", reqs, 1, draft_model=ddir)
    assert got == solo
    shared = sorted((s.start_time, s.attributes[ATTR["batch_draft_requests"]]) for exp in exps
                    for s in exp.get_finished_spans()
                    if s.name == SPAN_ROUND and ATTR["batch_draft_requests"] in s.attributes)
    assert stats["draft_batches"] > 0 and shared, stats
    groups: list[list[int]] = []  # rounds whose draft began at one moment (each request's sink maps the
    last = None                   # clock on its own offset: equal to within a few us), a forward a group
    for t, n in shared:
        if last is None or t - last > 20_000:
            groups.append([])
        groups[-1].append(n)
        last = t
    for g in groups:  # one forward: one count, and no more rounds than it drafted
        assert len(set(g)) == 1 and 1 <= len(g) <= g[0], groups
    assert any(len(g) >= 2 for g in groups), groups
