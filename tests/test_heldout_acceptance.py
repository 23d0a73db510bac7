"""Acceptance off the training text: the tiny MTP layer, trained on the target's own greedy
continuations (self-distillation, demo/distill.py) as the demo's recipe does, against the
same layer trained on corpus windows only (the former recipe), measured through the engine
as tests/test_mtp.py measures it (greedy, 64 new tokens, accepted / drafted).

Held out from the drafter's training prompts: the 24 novel sentences below (their words,
mostly, are not the corpus's; 24, not a handful, because one flipped greedy token changes a
whole continuation) and the corpus's last paragraph (left out of the `corpus` the drafter
trains on; the target, trained on the whole corpus, still memorized it). The paragraph is
absent from the prompts, not from the training sequences: the target's continuations of the
other prompts run into it, so it measures following the target's memorized text from a
prompt the drafter never saw; the novel sentences are the strict test. Measured (2 cores,
fp32, the demo's target recipe of 1000 steps):

                            self-distilled      corpus only
    novel,    k = 1 / 3      0.63 / 0.36        0.47 / 0.23
    withheld, k = 1 / 3      1.00 / 0.68        0.07 / 0.02

The issue's 0.5 at k = 1 on novel text holds at the recipe, with little to spare: the same
recipe trained with 2 threads instead of 1 (other float rounding, another target) gives
0.54, other target seeds 0.46 / 0.52; a target of 200 steps (the former recipe) 0.31-0.42.
The floor below is 0.45 so that a machine whose rounding differs does not fail it. The
DFlash drafter, by its distilled recipe over the same target (demo/tiny_dflash.py
DISTILLED), accepts 0.52 at k = 1 on the novel sentences (its corpus-only recipe 0.08), with
the same floor.
"""

from __future__ import annotations

import shutil

import pytest

from memra_dist.app import generate
from memra_dist.config import RunConfig

NOVEL = [
    "The scheduler sends each request to the replica with the shortest queue.",
    "A larger batch raises the throughput of the verify pass but adds latency.",
    "Our cat sleeps on the warm windowsill while rain falls outside.",
    "The river floods the lower fields every spring, so farmers plant late.",
    "Quantized weights shrink the memory a model needs on each device.",
    "She wrote the letter by hand and posted it before noon.",
    "Each worker pulls a task from the queue and reports back when it is done.",
    "The compiler folds constant expressions before it emits any machine code.",
    "A cold start loads the weights from disk and warms every cache it owns.",
    "The library keeps one pool of buffers and hands them out in order.",
    "When the link drops, the client retries with a longer backoff each time.",
    "Small models answer quickly but miss the rare facts a large one recalls.",
    "The bakery opens at six and sells out of bread before nine.",
    "Two trains left the station together and took different routes north.",
    "The garden needs water every evening during the dry summer months.",
    "He tuned the old piano until every key rang clear and true.",
    "Memory bandwidth, not arithmetic, limits how fast one token is produced.",
    "The dashboard shows latency per request and the queue depth per replica.",
    "A checksum guards each file so a partial download is caught at once.",
    "The router splits traffic between the old service and the new one.",
    "Children ran across the field chasing a bright red kite.",
    "The museum moved its paintings to a cooler room for the winter.",
    "Logs rotate daily and the oldest ones are compressed and archived.",
    "The test harness starts a fresh process for every case it runs.",
]


def _held_out(run, models: dict, prompts: dict) -> dict:
    """Acceptance (accepted / drafted, greedy, 64 new tokens) of each named model at k = 1 and 3
    on each named prompt set, through the engine; `run(model, k)` is the request's RunConfig."""
    def acceptance(model, k, ps) -> float:
        st = [generate(run(model, k), p).stats for p in ps]
        return sum(s["accepted"] for s in st) / sum(s["drafted"] for s in st)

    got = {(m, k, w): acceptance(model, k, ps) for m, model in models.items() for k in (1, 3)
           for w, ps in prompts.items()}
    print("held-out acceptance:", {",".join(map(str, key)): round(v, 3) for key, v in got.items()})
    return got


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.mark.slow  # the session's `tiny_mtp` (~45 s once), and its MTP layer by the former recipe (~8 s)
def test_self_distilled_mtp_follows_the_target_off_its_corpus(tiny_mtp, tmp_path):
    from tokenizers import Tokenizer

    from memra_dist.demo.corpus import CORPUS
    from memra_dist.demo.distill import distill_prompts
    from memra_dist.demo.tiny_mtp import MTP_RECIPE, train_mtp
    from memra_dist.model.tokenizer import load_tokenizer

    d = tiny_mtp[0]  # the demo's recipe, the last paragraph withheld
    d0 = shutil.copytree(tiny_mtp[1], tmp_path / "t0")
    paras = [line for line in CORPUS.splitlines() if line.strip()]
    corpus = "\n".join(paras[:-1])
    train_mtp(d0, corpus=corpus, steps=300, distill=0)  # the former recipe: corpus windows only
    enc = load_tokenizer(str(d)).encode
    novel = [enc(s)[:12] for s in NOVEL]
    withheld = [enc(paras[-1])[:12]]

    # held out: no evaluation prompt is inside a training prompt or the training corpus
    prompts = [p.tolist() for p in distill_prompts(Tokenizer.from_file(str(d / "tokenizer.json")), corpus,
                                                   MTP_RECIPE["distill"], MTP_RECIPE["seed"])]
    stream = [t for line in paras[:-1] for t in enc(line)]
    for p in novel + withheld:
        assert not any(_contains(q, p) for q in prompts) and not _contains(stream, p)

    got = _held_out(lambda model, k: RunConfig(model=str(model), drafter="mtp", k=k, max_new_tokens=64, device="cpu"),
                    {"distilled": d, "corpus": d0}, {"novel": novel, "withheld": withheld})
    # novel sentences: self-distillation lifts it (measured 0.63 / 0.36 against 0.47 / 0.23)
    assert got["distilled", 1, "novel"] >= 0.45, got
    assert got["distilled", 1, "novel"] >= got["corpus", 1, "novel"] + 0.05, got
    assert got["distilled", 3, "novel"] >= got["corpus", 3, "novel"] + 0.03, got
    # the withheld paragraph: followed (measured 1.0 / 0.68) where corpus training is ~0 (0.07 / 0.02)
    assert got["distilled", 1, "withheld"] >= 0.5 and got["distilled", 3, "withheld"] >= 0.5, got
    assert got["corpus", 1, "withheld"] < 0.3, got


@pytest.mark.slow
@pytest.mark.recipe  # ~5.5 min on 2 cores (3,000 steps over 2,048 distilled sequences); `pytest --recipes` runs it
def test_self_distilled_dflash_drafts_off_its_corpus(tiny_mtp, tmp_path):
    """The DFlash drafter by its distilled recipe (demo/tiny_dflash.py DISTILLED: the target's
    own continuations, the loss leaning on the block's first rows) over the better-trained
    glm4_moe target, measured through the engine on the same held-out prompts as the MTP
    layer: the first draft of each block is the target's token on novel sentences at least
    half the time, where the corpus-only recipe (the demo's, against its memorizing target's
    text) stays near the unigram level."""
    from memra_dist.demo.corpus import CORPUS
    from memra_dist.demo.tiny_dflash import DISTILLED, RECIPE, train_dflash
    from memra_dist.model.tokenizer import load_tokenizer

    target = tiny_mtp[1]  # the MTP demo's target without its MTP layer
    paras = [line for line in CORPUS.splitlines() if line.strip()]
    corpus = "\n".join(paras[:-1])
    distilled = train_dflash(target, tmp_path / "distilled", corpus=corpus, **DISTILLED)
    plain = train_dflash(target, tmp_path / "corpus", corpus=corpus, **RECIPE)
    enc = load_tokenizer(str(target)).encode
    novel = [enc(s)[:12] for s in NOVEL]
    withheld = [enc(paras[-1])[:12]]

    got = _held_out(lambda ddir, k: RunConfig(model=str(target), drafter="dflash", draft_model=str(ddir), k=k,
                                              max_new_tokens=64, device="cpu"),
                    {"distilled": distilled, "corpus": plain}, {"novel": novel, "withheld": withheld})
    # novel sentences (measured 0.52 / 0.25 at k = 1 / 3, against 0.08 / 0.04)
    assert got["distilled", 1, "novel"] >= 0.45, got
    assert got["distilled", 1, "novel"] >= got["corpus", 1, "novel"] + 0.2, got
    assert got["distilled", 3, "novel"] >= got["corpus", 3, "novel"] + 0.05, got
    # the withheld paragraph, which the target's continuations run into (measured 0.97 / 0.82, against 0.0)
    assert got["distilled", 1, "withheld"] >= 0.5, got
