"""`--ngram-first` (memra_dist/specdec/drafters/ngram_first.py): a network drafter whose rounds
are drafted by prompt lookup where the context's suffix recurs. The ids stay the target's (CPU,
fp32, strict), alone and batched, greedy and sampled; each round drafts from one source, the
batched engine's rounds exactly as alone (the n-gram ones on the host, the network's in its
shared forward, catching up on the maintenance it skipped); the stats count each source apart."""

from __future__ import annotations

import pytest

from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.specdec.drafters.ngram_first import NgramFirst
from memra_dist.specdec.sampling import SamplingParams

from test_batching import CAP, _batched, _cfg, _prompts, _solo, _tap_drafter, spy_proposals


def _looping(n: int) -> list[tuple[list[int], int]]:
    """Prompts that repeat a phrase (their continuations too, on the tiny target): the lookup
    finds 4+ token suffixes again and again, and some rounds still fall to the network."""
    return [(p + p[:9], 30) for p, _ in _prompts(n + 3)[3:]]


def _solo_stats(model, drafter, reqs, **kw):
    from memra_dist.app import open_engine

    with open_engine(_cfg(model, drafter, **kw), capacity=CAP) as eng:
        rs = [eng.generate(p, _cfg(model, drafter, max_new_tokens=n, **kw)) for p, n in reqs]
    return [r.token_ids for r in rs], [r.stats for r in rs]


@pytest.fixture
def short_match(monkeypatch):
    """The lookup drafts where 2 suffix tokens recur (the tiny random target copies little)."""
    import memra_dist.specdec.drafters.ngram_first as nf

    monkeypatch.setattr(nf, "MIN_MATCH", 2)


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_alone_each_round_drafts_from_one_source_and_the_ids_are_the_targets(llama, tmp_path_factory, drafter,
                                                                           short_match, monkeypatch):
    """Each round drafts from the lookup (where the suffix recurs) or the network; the ids are
    plain decoding's; the counts by source add up to the request's, and the lookup's accepted
    drafts are those its proposals share with the output that followed them."""
    d = str(_tap_drafter(drafter, llama, tmp_path_factory))
    reqs = _looping(4)
    plain = _solo(llama, "none", reqs)
    looked: list[list[tuple[int, list[int]]]] = []  # each request's n-gram rounds: (context length, drafts)
    real, real_prime = NgramFirst.propose, NgramFirst.prime

    def prime(self, prompt, chunks=None):
        looked.append([])  # a new request
        real_prime(self, prompt, chunks)

    def spy(self, context, k, sp, gen):
        prop = real(self, context, k, sp, gen)
        if self._open is not None and self._open[0] == len(context):  # an n-gram round
            looked[-1].append((len(context), prop.tokens.tolist()))
        return prop

    monkeypatch.setattr(NgramFirst, "propose", spy)
    monkeypatch.setattr(NgramFirst, "prime", prime)
    ids, stats = _solo_stats(llama, drafter, reqs, draft_model=d, ngram_first=True)
    assert ids == plain and len(looked) == len(reqs)
    src = [s["drafts_by_source"] for s in stats]
    assert sum(s["ngram"]["rounds"] for s in src) > 0 and sum(s["network"]["rounds"] for s in src) > 0, src
    for (p, _), out, s, st, rounds in zip(reqs, ids, src, stats, looked):
        assert 0 <= st["rounds"] - s["ngram"]["rounds"] - s["network"]["rounds"] <= 1, (s, st)  # (the last drafts none)
        assert s["ngram"]["drafted"] + s["network"]["drafted"] == st["drafted"], (s, st)
        assert s["ngram"]["rounds"] == len(rounds), (s, rounds)
        full = p + out
        accepted = 0
        for n, drafts in rounds:
            j = 0
            while j < len(drafts) and n + j < len(full) and full[n + j] == drafts[j]:
                j += 1
            accepted += j
        assert s["ngram"]["accepted"] == accepted and s["ngram"]["accepted"] <= st["accepted"], (s, st, rounds)


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_rounds_draft_what_they_draft_alone(llama, tmp_path_factory, monkeypatch, sampled, short_match):
    """Six requests three at a time: every proposal (the lookup's on the host, the network's in
    its shared forward after catching up on the maintenance its n-gram rounds skipped) equals
    the request's solo proposal at the same context; the ids are the solo ids."""
    d = str(_tap_drafter("dflash", llama, tmp_path_factory))
    kw = dict(draft_model=d, ngram_first=True)
    if sampled:
        kw.update(sampling=SamplingParams(temperature=0.9, top_k=20), seed=7)
    reqs = _looping(6)
    seen = spy_proposals(monkeypatch, NgramFirst)
    solo = _solo(llama, "dflash", reqs, **kw)
    alone, seen[:] = set(seen), []
    got, stats = _batched(llama, "dflash", reqs, max_batch=3, **kw)
    assert got == solo
    if not sampled:
        assert seen and set(seen) <= alone
        assert stats["draft_batches"] > 0, stats  # the network's rounds still drafted together


def test_ngram_first_needs_a_network_drafter_that_catches_up():
    with pytest.raises(UserError, match="--ngram-first needs a network drafter"):
        RunConfig(model="m", drafter="ngram", ngram_first=True)
    with pytest.raises(UserError, match="ngram_first must be True or False"):
        RunConfig(model="m", drafter="dflash", draft_model="d", ngram_first="yes")


def test_generate_with_ngram_first_reports_each_source_in_its_json(llama, tmp_path_factory, capsys, short_match):
    """`memra-dist generate --drafter dflash --ngram-first --json`: the result's stats carry
    drafts_by_source; `--ngram-first` with the n-gram drafter is one line and exit 2."""
    import json

    from test_cli_errors import run_main

    d = str(_tap_drafter("dflash", llama, tmp_path_factory))
    base = ["generate", "--model", str(llama), "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "24",
            "--prompt", "the cat sat on the mat and the cat sat on the mat and the cat", "--json",
            "--run-dir", str(tmp_path_factory.mktemp("r"))]
    rc, out, err = run_main(base + ["--drafter", "dflash", "--draft-model", d, "--ngram-first"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    src = res["stats"]["drafts_by_source"]
    assert src["ngram"]["rounds"] + src["network"]["rounds"] > 0, src
    rc, out, err = run_main(base + ["--drafter", "ngram", "--ngram-first"], capsys)
    assert rc == 2 and out == "" and "--ngram-first needs a network drafter" in err and len(err.splitlines()) == 1


@pytest.mark.slow  # a local Ray with two CPU stage actors
def test_ngram_first_on_a_pipeline_gives_the_solo_ids(ray_local, llama, tmp_path_factory, short_match):
    """At pp 2 the head's drafter is wrapped too (pipeline/actors.py builds it): the ids are the
    solo ids."""
    from test_batching_pp import _runs

    d = str(_tap_drafter("dflash", llama, tmp_path_factory))
    reqs = _looping(3)
    solo = _solo(llama, "none", reqs)
    got, _ = _runs(llama, "dflash", reqs, pp=2, max_batch=1, draft_model=d, ngram_first=True)
    assert [g[0] for g in got] == solo


def test_the_first_token_profile_reaches_the_network_through_the_wrapper():
    """The profile's timer lent to the drafter (`lend`) reaches the network's prime, whose
    sub-buckets (draft_prime_feat_ms, ...) it stamps, and is taken back after."""
    from memra_dist.phase.first_token import lend
    from memra_dist.specdec.drafters.base import Drafter

    class Net(Drafter):
        ttft_depth = None
        seen = None

        def prime(self, prompt, chunks=None):
            Net.seen = self.ttft_depth

    net = Net()
    w = NgramFirst(net)
    timer = object()
    with lend(w, timer):
        w.prime([1, 2, 3])
    assert Net.seen is timer and net.ttft_depth is None
