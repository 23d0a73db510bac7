"""`--drafter auto` (memra_dist/specdec/drafters/choose.py): the drafter the checkpoints on hand
allow, a network one with prompt lookup first; the ids stay the target's (CPU, fp32, strict)."""

from __future__ import annotations

import json

import pytest

from memra_dist.errors import UserError
from memra_dist.specdec.drafters.choose import choose

from test_batching import _tap_drafter


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_a_tap_checkpoint_drafts_with_its_network_and_the_lookup_first(llama, tmp_path_factory, kind):
    d = _tap_drafter(kind, llama, tmp_path_factory)
    drafter, first, why = choose(str(llama), str(d))
    assert (drafter, first) == (kind, True) and why


def test_a_plain_draft_checkpoint_is_a_draft_model_and_none_is_ngram(llama, ckpt_factory):
    draft = ckpt_factory("llama")[0]  # any causal LM checkpoint: a draft model
    assert choose(str(llama), str(draft))[:2] == ("model", False)
    assert choose(str(llama), None)[:2] == ("ngram", False)


def test_mtp_only_where_the_target_holds_its_tensors(tmp_path):
    from moe_ckpt import save_moe

    with_mtp = save_moe(tmp_path / "glm", "glm4_moe", layers=2, n_mtp=1, seed=2)[0]
    assert choose(str(with_mtp), None)[:2] == ("mtp", True)
    bare = save_moe(tmp_path / "bare", "glm4_moe", layers=2, n_mtp=0, seed=2)[0]
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))  # declared, not held
    assert choose(str(bare), None)[:2] == ("ngram", False)


def test_an_unreadable_draft_config_is_one_line(tmp_path, llama):
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="no config.json"):  # one line, as every checkpoint read says it
        choose(str(llama), str(tmp_path / "d"))


def test_generate_with_auto_runs_the_network_with_the_lookup_and_says_so(llama, tmp_path_factory, capsys,
                                                                          monkeypatch):
    """Through the CLI's own path (config_from_args): the choice is one line on stderr, the
    result's stats count both sources, the ids are plain decoding's."""
    import argparse

    import memra_dist.specdec.drafters.ngram_first as nf
    from memra_dist.app import config_from_args, generate
    from memra_dist.cli import _add_run_args

    monkeypatch.setattr(nf, "MIN_MATCH", 2)  # the lookup drafts where 2 suffix tokens recur (a tiny target copies little)

    d = _tap_drafter("eagle3", llama, tmp_path_factory)
    p = argparse.ArgumentParser()
    _add_run_args(p, demo=False)
    from test_ngram_first import _looping

    prompt, n = _looping(1)[0]  # a phrase that repeats: the lookup drafts some rounds
    base = ["--model", str(llama), "--prompt", "x", "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", str(n)]
    args = p.parse_args(base + ["--drafter", "auto", "--draft-model", str(d)])
    cfg = config_from_args(args, args.model, args.draft_model)
    assert (cfg.drafter, cfg.ngram_first) == ("eagle3", True)
    assert capsys.readouterr().err.strip() == ("[memra] --drafter auto: eagle3 with --ngram-first (the draft "
                                               "checkpoint is an EAGLE-3 head)")
    res = generate(cfg, prompt)
    plain = generate(config_from_args(p.parse_args(base + ["--drafter", "none"]), str(llama), None), prompt)
    assert res.token_ids == plain.token_ids
    src = res.stats["drafts_by_source"]
    assert src["ngram"]["rounds"] > 0 and src["network"]["rounds"] > 0, src  # each source drafted

