"""Automatic prefix caching (memra_dist/batching/prefix_cache.py, blocks.py, slot.py): a batched
engine keeps the full KV blocks of the prompts (and, once a request ends, of the tokens) it has
computed; a later request whose prompt starts with them shares those blocks and prefills only
the rest. It changes no id (CPU, fp32, strict): every request gets exactly the ids it gets with
the cache off and alone, greedy and sampled, with every drafter (a tap drafter's hidden-state
rows of the cached blocks are kept with them: tap_blocks.py), for prefixes that end mid-block, prompts entirely cached (the last token
still runs), requests sharing blocks while others roll back or are preempted, and a pool full of
cached blocks (evicted, least recently used first, only when no free block is left)."""

from __future__ import annotations

import threading

import pytest

from memra_dist.app import open_engine
from memra_dist.specdec.sampling import SamplingParams

from test_batching import CAP, _cfg, _gate_admissions, _prompts

HEADER = [(5 * j + 1) % 110 + 4 for j in range(37)]  # a few-shot header: two full blocks and 5 rows


def _shared_prompts() -> list[tuple[list[int], int]]:
    """Prompts that start with HEADER (then tails of 1 to 20 tokens), and one prompt exactly
    two blocks long repeated (entirely cached but for its last block), and outputs that repeat
    the prompt (ngram drafts, some rejected: rollbacks)."""
    out = []
    for i, (p, n) in enumerate(_prompts(6)):
        out.append((HEADER + p[: 1 + (i * 7) % 20], 6 + n % 20))
    out += [(HEADER[:32], 12), (HEADER[:32], 12), (HEADER[:33], 9), (HEADER[:33], 9)]
    return out


def _on(eng, model, drafter, reqs, together: bool, **kw) -> list[tuple[list[int], int]]:
    """Each request's (ids, cached tokens) on engine `eng`: one after another, or from concurrent
    threads (`together`); the first request's error re-raised."""
    got, errors = {}, []

    def one(i, p, n):
        try:
            r = eng.generate(p, _cfg(model, drafter, max_new_tokens=n, **kw))
            got[i] = (r.token_ids, r.stats["cached_tokens"])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    if together:
        threads = [threading.Thread(target=one, args=(i, p, n), daemon=True) for i, (p, n) in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    else:
        for i, (p, n) in enumerate(reqs):
            one(i, p, n)
    if errors:
        raise errors[0]
    return [got[i] for i in range(len(reqs))]


def _run(model, drafter, reqs, together: bool, cache: bool = True, max_batch: int = 4, kv_rows=None, **kw):
    """Each request's ids and cached rows on one batched engine: one after another, or from
    concurrent threads (`together`) -> (ids, cached, the engine's batch stats)."""
    cfg = _cfg(model, drafter, prefix_cache=cache, **kw)
    with open_engine(cfg, capacity=CAP, max_batch=max_batch, kv_rows=kv_rows) as eng:
        got = _on(eng, model, drafter, reqs, together, prefix_cache=cache, **kw)
        b = getattr(eng._backend, "batcher", None)  # at pp > 1 the head's, in its actor
        if b is not None:
            b.wait_idle(60)
        stats = eng.batch_stats()
    return [g[0] for g in got], [g[1] for g in got], stats


def _solo(model, drafter, reqs, **kw) -> list[list[int]]:
    with open_engine(_cfg(model, drafter, **kw), capacity=CAP) as eng:
        return [eng.generate(p, _cfg(model, drafter, max_new_tokens=n, **kw)).token_ids for p, n in reqs]


SAMPLED = dict(sampling=SamplingParams(temperature=0.9, top_k=20), seed=7)


@pytest.mark.parametrize("drafter,sampled", [("none", False), ("ngram", False), ("ngram", True), ("model", False),
                                             ("model", True)])
def test_requests_reusing_a_cached_prefix_get_the_ids_they_get_without_it(llama, draft_llama, drafter, sampled):
    kw = dict(draft_model=str(draft_llama)) if drafter == "model" else {}
    kw.update(SAMPLED if sampled else {})
    reqs = _shared_prompts()
    solo = _solo(llama, drafter, reqs, **kw)
    off, off_cached, off_stats = _run(llama, drafter, reqs, together=False, cache=False, **kw)
    ids, cached, stats = _run(llama, drafter, reqs, together=False, **kw)
    assert ids == off == solo
    assert off_cached == [0] * len(reqs) and "prefix_cache" not in off_stats
    # the first request computed the header; every later one shares its two full blocks (32 rows),
    # the repeated 33-token prompt all but its last token (2 blocks), the 32-token one 1 block
    assert cached[0] == 0 and all(c == 32 for c in cached[1:6]), cached
    assert cached[6] == 16 and cached[7] == 16 and cached[8] == 32 and cached[9] == 32, cached
    pc = stats["prefix_cache"]
    assert pc["hits"] == sum(cached) and pc["queries"] >= pc["hits"] > 0, pc
    assert off_stats["rows"] - stats["rows"] == sum(cached)  # the shared rows were not run again
    if drafter == "model":  # the draft model's own pool caches the same prefixes
        assert stats["draft"]["prefix_cache"]["hits"] > 0, stats["draft"]


def test_requests_sharing_blocks_at_once_while_others_roll_back_or_are_preempted(llama):
    """The header's requests run four at a time on a pool too short for all of them to grow:
    one is swapped out (its shared blocks stay with the others) and back; n-gram drafts are
    rejected (rollbacks past shared blocks never touch them); every request gets its solo ids."""
    reqs = [(HEADER + p[:12], 40) for p, _ in _prompts(8)][:4]
    solo = _solo(llama, "ngram", reqs)
    warm = [(HEADER + [9], 1)]  # computes the header first, so the four share it from their admission
    ids, cached, stats = _run(llama, "ngram", warm + reqs, together=False, max_batch=4)
    assert ids[1:] == solo
    blocks = 2 + 4 * 2 + 1  # the header's 2 shared + two each at admission, one to spare: growth must preempt
    with open_engine(_cfg(llama, "ngram"), capacity=CAP, max_batch=4, kv_rows=16 * blocks) as eng:
        eng.generate(*warm[0][:1], _cfg(llama, "ngram", max_new_tokens=1))
        _gate_admissions(eng, 4)  # all four hold their blocks before any runs a forward
        got = _on(eng, llama, "ngram", reqs, together=True)
        eng._backend.batcher.wait_idle(60)
        st = eng.batch_stats()
    assert [g[0] for g in got] == solo
    assert all(g[1] == 32 for g in got), got
    assert st["preemptions"] >= 1 and st["kv_blocks_used"] == 0, st


def test_a_pool_full_of_cached_blocks_evicts_the_oldest_and_still_admits(llama):
    """Eight different prompts through a pool of 8 blocks one after another: their blocks stay
    cached until the pool needs them, then the least recently used go; the ids never change, and
    the last prompt repeated still hits (it was used last)."""
    reqs = [([(13 * i + 7 * j) % 100 + 4 for j in range(38)], 8) for i in range(8)]
    reqs.append(reqs[-1])
    solo = _solo(llama, "none", reqs)
    ids, cached, stats = _run(llama, "none", reqs, together=False, max_batch=2, kv_rows=8 * 16)
    assert ids == solo
    pc = stats["prefix_cache"]
    assert pc["evictions"] > 0 and cached[-1] == 32, (pc, cached)
    assert stats["kv_blocks_used"] == 0 and pc["cached_blocks"] > 0


def test_a_tap_drafters_evicted_blocks_take_new_tap_rows_when_they_are_registered_again(llama, tmp_path_factory,
                                                                                        monkeypatch):
    """DFlash through a pool of 8 blocks, eight different prompts one after another: blocks are
    evicted and registered again under other prompts, their tap rows saved again each time, so
    the last prompt repeated (a hit) drafts what it drafts alone, as does every other."""
    from test_batching import spy_proposals

    from memra_dist.specdec.drafters.dflash import DFlashDrafter

    model, kw = _tap_target("dflash", llama, tmp_path_factory)
    reqs = [([(13 * i + 7 * j) % 100 + 4 for j in range(38)], 8) for i in range(8)]
    reqs.append(reqs[-1])
    seen = spy_proposals(monkeypatch, DFlashDrafter)
    solo = _solo(model, "dflash", reqs, **kw)
    alone, seen[:] = set(seen), []
    ids, cached, stats = _run(model, "dflash", reqs, together=False, max_batch=2, kv_rows=8 * 16, **kw)
    assert ids == solo and set(seen) <= alone and seen
    assert stats["prefix_cache"]["evictions"] > 0 and cached[-1] == 32, (stats["prefix_cache"], cached)


def test_a_chat_turn_reuses_the_turn_before_with_its_answer(llama):
    """Turn 2's prompt is turn 1's prompt, its answer and a new message: it shares the blocks of
    all three that turn 1 held in full (the answer's too, published as turn 1 ended)."""
    p1 = HEADER + [7, 8, 9]
    with open_engine(_cfg(llama, "ngram"), capacity=CAP, max_batch=2) as eng:
        r1 = eng.generate(p1, _cfg(llama, "ngram", max_new_tokens=30))
        p2 = p1 + r1.token_ids + [11, 12, 13]
        r2 = eng.generate(p2, _cfg(llama, "ngram", max_new_tokens=10))
    assert r2.stats["cached_tokens"] == 16 * ((len(p1) + len(r1.token_ids) - 1) // 16) > 32
    assert r2.token_ids == _solo(llama, "ngram", [(p2, 10)])[0]


def _tap_target(drafter: str, llama, tmp_path_factory) -> tuple[str, dict]:
    """(target, extra config) of a tap drafter: a random DFlash / EAGLE-3 over `llama`, or a
    glm4_moe target with its own MTP layer."""
    if drafter == "mtp":
        from moe_ckpt import save_moe

        return str(save_moe(tmp_path_factory.mktemp("pmtp") / "glm", "glm4_moe", layers=2, n_mtp=1, seed=2)[0]), {}
    from test_batching import _tap_drafter

    return str(llama), dict(draft_model=str(_tap_drafter(drafter, llama, tmp_path_factory)))


@pytest.mark.parametrize("drafter,sampled", [("dflash", False), ("dflash", True), ("eagle3", False), ("mtp", False)])
def test_tap_drafters_reuse_cached_prefixes_with_the_tap_rows_of_the_shared_blocks(llama, tmp_path_factory, drafter,
                                                                                   sampled, monkeypatch):
    """A tap drafter primes its draft cache from the target's hidden states at every prompt
    position: the cached blocks keep those tap rows (tap_blocks.py), so its requests share the
    header as the others do, and every proposal (greedy) is the one the request makes alone,
    which it could not be if the shared rows' taps were missing; the ids are the solo ids and
    those with the cache off."""
    from test_batching import spy_proposals

    from memra_dist.specdec.drafters import dflash, eagle3, mtp

    cls = {"dflash": dflash.DFlashDrafter, "eagle3": eagle3.Eagle3Drafter, "mtp": mtp.MTPDrafter}[drafter]
    model, kw = _tap_target(drafter, llama, tmp_path_factory)
    kw.update(SAMPLED if sampled else {})
    reqs = _shared_prompts()[:6] + [(HEADER[:33], 9), (HEADER[:33], 9)]
    seen = spy_proposals(monkeypatch, cls)
    solo = _solo(model, drafter, reqs, **kw)
    alone, seen[:] = set(seen), []
    off, _, _ = _run(model, drafter, reqs, together=False, cache=False, max_batch=2, **kw)
    seen[:] = []
    ids, cached, stats = _run(model, drafter, reqs, together=False, max_batch=2, **kw)
    assert ids == off == solo
    assert cached[0] == 0 and all(c == 32 for c in cached[1:]), cached
    assert stats["prefix_cache"]["hits"] == sum(cached), stats["prefix_cache"]
    if not sampled:
        assert seen and set(seen) <= alone


def test_a_tap_drafters_chat_turn_reuses_the_turn_before_with_its_answer(llama, tmp_path_factory, monkeypatch):
    """DFlash: turn 2 shares turn 1's prompt and answer blocks (their tap rows saved as turn 1
    ended, the answer's from its verify rows), and drafts what it drafts alone."""
    from test_batching import spy_proposals

    from memra_dist.specdec.drafters.dflash import DFlashDrafter

    model, kw = _tap_target("dflash", llama, tmp_path_factory)
    p1 = HEADER + [7, 8, 9]
    seen = spy_proposals(monkeypatch, DFlashDrafter)
    with open_engine(_cfg(model, "dflash", **kw), capacity=CAP, max_batch=2) as eng:
        r1 = eng.generate(p1, _cfg(model, "dflash", max_new_tokens=30, **kw))
        p2 = p1 + r1.token_ids + [11, 12, 13]
        mark = len(seen)
        r2 = eng.generate(p2, _cfg(model, "dflash", max_new_tokens=10, **kw))
    turn2, seen[:] = set(seen[mark:]), []
    assert r2.stats["cached_tokens"] == 16 * ((len(p1) + len(r1.token_ids) - 1) // 16) > 32
    assert r2.token_ids == _solo(model, "dflash", [(p2, 10)], **kw)[0]
    assert turn2 and turn2 <= set(seen), "turn 2's proposals differ from its solo ones"


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_moe_and_latent_attention_targets_reuse_prefixes_with_their_solo_ids(tmp_path_factory, arch):
    """Grouped attention with partial rotary (glm4_moe) and latent attention (deepseek_v3: the
    latent rows are the blocks' content) share cached blocks and keep their solo ids."""
    from moe_ckpt import save_moe

    path, _ = save_moe(tmp_path_factory.mktemp("pmoe") / arch, arch, layers=2, n_mtp=0, seed=2)
    reqs = _shared_prompts()[:4]
    solo = _solo(path, "ngram", reqs)
    ids, cached, _ = _run(path, "ngram", reqs, together=False, max_batch=2)
    assert ids == solo and cached[1:] == [32, 32, 32], cached


@pytest.mark.slow  # a local Ray with two CPU stage actors
@pytest.mark.parametrize("drafter", ["ngram", "dflash"])
def test_a_batched_pipeline_reuses_prefixes_on_every_stage(ray_local, llama, tmp_path_factory, drafter):
    """At pp 2 the head's pool decides and every stage's pool holds the same blocks (the step
    plan carries the block tables): the shared rows are skipped down the whole ring, and the ids
    are the solo ids. DFlash: its requests share the blocks down the ring too, their tap rows
    (the first stage's layers shipped to the head as the rows run) kept with the head's blocks
    (whether the drafts are the solo ones is checked at pp 1, where the proposals can be spied on)."""
    model, kw = _tap_target(drafter, llama, tmp_path_factory) if drafter == "dflash" else (llama, {})
    reqs = _shared_prompts()[:5]
    solo = _solo(model, drafter, reqs, **kw)
    ids, cached, stats = _run(model, drafter, reqs, together=False, max_batch=2, pp=2, **kw)
    assert ids == solo and cached[1:] == [32, 32, 32, 32], cached


def test_serve_reports_the_cached_prompt_tokens_in_its_usage(llama):
    """`serve`'s usage object carries `prompt_tokens_details.cached_tokens` as OpenAI's API
    does: 0 for a prompt first seen, the shared rows for the same prompt again (its text the same)."""
    import httpx

    from test_serve_api import _uvicorn

    from memra_dist.config import RunConfig
    from memra_dist.serve.api import build_app
    from memra_dist.serve.host import EngineHost

    cfg = RunConfig(model=str(llama), device="cpu", dtype="fp32", max_new_tokens=6)
    host = EngineHost(cfg, 2, max_batch=2)
    prompt = "the five phases of a round: draft, verify, accept, rollback and maint; " * 3
    try:
        with _uvicorn(build_app(host, 4)) as base, httpx.Client(timeout=60) as client:
            first, again = (client.post(f"{base}/v1/completions", json={"prompt": prompt}).json() for _ in range(2))
            metrics = client.get(f"{base}/metrics").text
    finally:
        host.close()
    n = first["usage"]["prompt_tokens"]
    assert n > 32 and first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 16 * ((n - 1) // 16)}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    counted = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines() if ln.startswith("memra_prefix")}
    assert counted["memra_prefix_cache_queries_total"] == 2 * n  # the Grafana panel's hit rate: hits / queries
    assert counted["memra_prefix_cache_hits_total"] == again["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_requests_arriving_together_with_one_header_compute_it_once(llama):
    """Four requests of one header arriving together: the first admitted computes the header;
    the other three, admitted meanwhile, wait for its blocks (here: held until all three wait)
    instead of computing them beside it, then share them; every request gets its solo ids."""
    import time as _time

    reqs = [(HEADER + [i + 3] * 5, 12) for i in range(4)]
    solo = _solo(llama, "ngram", reqs)

    def first_waits_for_the_others(eng):
        b = eng._backend.batcher
        admit, first = b.admit, []

        def admit_(rid, *a):
            shared = admit(rid, *a)
            if not first:
                first.append(rid)
                t = _time.monotonic()
                while b.stats.prefix_waits < 3 and _time.monotonic() - t < 60:
                    _time.sleep(0.01)
            return shared
        b.admit = admit_

    with open_engine(_cfg(llama, "ngram"), capacity=CAP, max_batch=4) as eng:
        first_waits_for_the_others(eng)
        got = _on(eng, llama, "ngram", reqs, together=True)
        stats = eng.batch_stats()
    assert [g[0] for g in got] == solo
    assert sorted(g[1] for g in got) == [0, 32, 32, 32]
    assert stats["prefix_waits"] == 3 and stats["prefix_cache"]["hits"] == 96, stats


def test_qwen3_with_its_q_k_norms_reuses_prefixes_with_its_solo_ids(ckpt_factory):
    path = ckpt_factory("qwen3")[0]
    reqs = _shared_prompts()[:4]
    solo = _solo(path, "ngram", reqs)
    ids, cached, _ = _run(path, "ngram", reqs, together=False, max_batch=2)
    assert ids == solo and cached[1:] == [32, 32, 32], cached


def test_a_linear_attention_target_reuses_nothing_says_so_and_keeps_its_ids(capfd):
    """kimi_linear's KDA layers keep a recurrent state per request, not blocks: nothing is
    shared (its state at the prefix's end is not kept), the engine says so in one line, and the
    ids are the solo ids."""
    from kimi_ckpt import hybrid

    _, path, _ = hybrid()
    reqs = [(HEADER + [4], 6), (HEADER + [5], 6)]
    solo = _solo(path, "ngram", reqs)
    ids, cached, stats = _run(path, "ngram", reqs, together=False, max_batch=2)
    assert "the prefix cache reuses nothing for kimi_linear" in capfd.readouterr().err
    assert ids == solo and cached == [0, 0] and "prefix_cache" not in stats


def test_a_waiting_request_with_a_cached_prefix_goes_before_an_earlier_one_without(llama, monkeypatch):
    """Two request slots, held by a request of HEADER and a filler; an unrelated request
    arrives, then another of HEADER. When the HEADER request's slot frees, the second HEADER
    request (its two header blocks cached) is admitted, ahead of the earlier arrival; each
    request gets its solo ids. With the cache off, arrival order holds."""
    import time as _time

    import memra_dist.batching.admission as admission

    reqs = [(HEADER + [3] * 4, 6), (_prompts(2)[1][0], 6), (_prompts(1)[0][0], 6), (HEADER + [9] * 4, 6)]
    solo = _solo(llama, "none", reqs)
    granted: list[int] = []
    real_pick = admission.pick

    def pick(waiting, max_passes=admission.MAX_PASSES):
        i = real_pick(waiting, max_passes)
        granted.append(waiting[i][0])
        return i

    monkeypatch.setattr(admission, "pick", pick)

    def until(cond):
        t = _time.monotonic()
        while not cond():
            assert _time.monotonic() - t < 60
            _time.sleep(0.005)

    for cache in (True, False):
        holds = [threading.Event(), threading.Event()]
        got: dict[int, list[int]] = {}
        granted.clear()
        with open_engine(_cfg(llama, "none", prefix_cache=cache), capacity=CAP, max_batch=2) as eng:
            adm = eng._backend.admission

            def one(i, p, n):
                def stream(_toks):
                    if i < 2:
                        holds[i].wait(60)  # the first two hold their slots until told
                got[i] = eng.generate(p, _cfg(llama, "none", max_new_tokens=n, prefix_cache=cache),
                                      stream=stream).token_ids

            threads = []
            for i, req in enumerate(reqs):  # arriving in this order
                threads.append(threading.Thread(target=one, args=(i, *req), daemon=True))
                threads[-1].start()
                until(lambda: 2 - adm.free + len(adm.waiting) == i + 1)
            holds[0].set()  # one slot for the two waiting: the one choice `pick` makes
            until(lambda: len(granted) == 1)
            holds[1].set()
            for t in threads:
                t.join(120)
            stats = eng.batch_stats()
        assert [got[i] for i in range(4)] == solo
        assert granted == ([3] if cache else [2]), (cache, granted)
        assert stats["admitted_ahead"] == (1 if cache else 0), stats


def test_a_request_nobody_shares_is_passed_over_at_most_max_passes_times():
    """The admission rule alone: a stream of requests with cached prefixes goes ahead of one
    without only until it has been passed over MAX_PASSES times."""
    import time as _time

    from memra_dist.batching.admission import MAX_PASSES, Admission

    adm = Admission(0)
    log: list[int] = []
    hits = {0: 0}
    entered = []

    def one(i):
        with adm.enter(lambda: hits[i]):
            log.append(i)

    def arrive(i, h):
        hits[i] = h
        t = threading.Thread(target=one, args=(i,), daemon=True)
        t.start()
        entered.append(t)
        while not any(w.arrival == len(entered) - 1 for w in adm.waiting) and t.is_alive():
            _time.sleep(0.001)

    arrive(0, 0)  # the unshared one, first
    for i in range(1, MAX_PASSES + 3):
        arrive(i, 5)
    with adm.cv:  # one slot: each request hands it on as it leaves
        adm.free += 1
        adm._grant()
    for t in entered:
        t.join(10)
    assert log == [*range(1, MAX_PASSES + 1), 0, MAX_PASSES + 1, MAX_PASSES + 2], log
