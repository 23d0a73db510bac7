"""Acceptance off the training text: the tiny MTP layer, trained on the target's own greedy
continuations (self-distillation, model/distill.py) as the demo's recipe does, against the
same layer trained on corpus windows only (the former recipe), measured through the engine
as tests/test_mtp.py measures it (greedy, 64 new tokens, accepted / drafted).

Held out from the drafter's training prompts: the novel sentences below (their words, mostly,
are not the corpus's) and the corpus's last paragraph (left out of the `corpus` the drafter
trains on; the target, trained on the whole corpus, still memorized it). The paragraph is
absent from the prompts, not from the training sequences: the target's continuations of the
other prompts run into it (13 of the 256 sequences hold its 12-token opening, 39 share an
8-gram with it; without those 39: 0.44 / 0.25 at k = 1 / 3), so it measures following the
target's memorized text from a prompt the drafter never saw; the novel sentences are the
strict test. Measured (2 cores, fp32):

                            self-distilled      corpus only
    novel,    k = 1 / 3      0.42 / 0.22        0.22 / 0.09
    withheld, k = 1 / 3      0.94 / 0.79        0.05 / 0.02

Below the issue's 0.5 on the novel sentences: the tiny target's greedy text there is
near-random (median top-1 probability ~0.4) and one MTP layer follows it only so far (0.44 at
k = 1 with 4x the steps and data). The DFlash drafter learned nothing from the same data in
its budget (model/tiny_dflash.py), so it is not tested here.
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
]


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.mark.slow  # ~40 s: the tiny glm4_moe target (~9 s), its MTP layer by both recipes (~18 s, ~8 s)
def test_self_distilled_mtp_follows_the_target_off_its_corpus(tmp_path):
    from tokenizers import Tokenizer

    from memra_dist.model.corpus import CORPUS
    from memra_dist.model.distill import distill_prompts
    from memra_dist.model.tiny import DEMO_INIT_STD, build_checkpoint, train_tokenizer
    from memra_dist.model.tiny_mtp import MTP_RECIPE, TARGET_RECIPE, glm_config, train_mtp
    from memra_dist.model.tokenizer import load_tokenizer

    tok = train_tokenizer()
    r = TARGET_RECIPE
    d = build_checkpoint(tmp_path / "t", glm_config(tok.get_vocab_size()), tok, seed=r["seed"],
                         train_steps=r["steps"], init_std=DEMO_INIT_STD, lr=r["lr"])
    d0 = shutil.copytree(d, tmp_path / "t0")
    paras = [line for line in CORPUS.splitlines() if line.strip()]
    corpus = "\n".join(paras[:-1])
    train_mtp(d, corpus=corpus)  # the demo's recipe, the last paragraph withheld
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

    def acceptance(model, k, ps) -> float:
        st = [generate(RunConfig(model=str(model), drafter="mtp", k=k, max_new_tokens=64, device="cpu"), p).stats
              for p in ps]
        return sum(s["accepted"] for s in st) / sum(s["drafted"] for s in st)

    got = {(m, k, w): acceptance(model, k, ps) for m, model in (("distilled", d), ("corpus", d0))
           for k in (1, 3) for w, ps in (("novel", novel), ("withheld", withheld))}
    # novel sentences: self-distillation nearly doubles it (measured 0.42 / 0.22 against 0.22 / 0.09)
    assert got["distilled", 1, "novel"] >= 0.33, got
    assert got["distilled", 1, "novel"] >= got["corpus", 1, "novel"] + 0.1, got
    assert got["distilled", 3, "novel"] >= got["corpus", 3, "novel"] + 0.05, got
    # the withheld paragraph: followed (measured 0.94 / 0.79) where corpus training is ~0 (0.05 / 0.02)
    assert got["distilled", 1, "withheld"] >= 0.5 and got["distilled", 3, "withheld"] >= 0.5, got
    assert got["corpus", 1, "withheld"] < 0.3, got
