"""YaRN rope scaling against transformers: the inverse frequencies and attention factor of
`ROPE_INIT_FUNCTIONS["yarn"]`, then tiny random checkpoints (deepseek_v3 MLA, glm4_moe
partial rotary, llama, qwen2) whose prompts run past `original_max_position_embeddings`:
logits at the prefill and step by step, and greedy ids equal to transformers' generate().
Each checkpoint also shows the check has teeth: dropping either YaRN effect (the blended
frequencies, the cos / sin factor, DeepSeek's softmax mscale) moves the logits. Malformed
yarn parameters are refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from memra_dist.model.config import load_config, parse_config
from memra_dist.model.layers import rope_inv_freq
from memra_dist.model.moe_families import RopeMLA
from memra_dist.model.rope_scaling import resolve_yarn, softmax_scale_factor, yarn_inv_freq
from memra_dist.runner import ModelRunner

from moe_ckpt import load_hf, save_moe
from test_config_bounds import FAMILIES as DENSE, _refused_fast
from test_model_equivalence import save_perturbed
from test_moe_families import FAMILIES as MOE

ATOL = 1e-4
CPU, F32 = torch.device("cpu"), torch.float32
ORIG = 32  # original_max_position_embeddings: every prompt here runs past it
PROMPT, NEW = 40, 16  # greedy: a 40-token prompt, 16 new tokens (positions up to 55)


def _yarn(**kw) -> dict:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, **kw}


# name -> (arch, config overrides); "legacy": config.json gets DeepSeek-V3's released form
# (`rope_scaling` with "type", rope_theta at the top level) in place of rope_parameters
CASES = {
    "deepseek_v3-released": ("deepseek_v3", dict(rope=_yarn(mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
                                                 legacy=True)),
    "deepseek_v3-mscale": ("deepseek_v3", dict(rope=_yarn(mscale=0.707, mscale_all_dim=1.0, factor=8.0),
                                               q_lora_rank=None, rope_interleave=False)),
    "glm4_moe": ("glm4_moe", dict(rope=_yarn(beta_fast=16, beta_slow=2))),
    "llama": ("llama", dict(rope=_yarn())),
    "qwen2-untruncated": ("qwen2", dict(rope=_yarn(truncate=False, attention_factor=0.9, factor=2.5))),
}


def _to_legacy(path) -> None:
    f = path / "config.json"
    c = json.loads(f.read_text())
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    c["rope_scaling"] = rp
    f.write_text(json.dumps(c, indent=2))


@pytest.fixture(scope="module", params=list(CASES))
def ckpt(request, tmp_path_factory):
    arch, kw = CASES[request.param]
    kw = dict(kw)
    rope, legacy = dict(kw.pop("rope"), rope_theta=500.0), kw.pop("legacy", False)
    where = tmp_path_factory.mktemp(request.param) / "m"
    if arch in ("deepseek_v3", "glm4_moe"):
        d, hf = save_moe(where, arch, layers=2, n_mtp=0, seed=7, tokenizer=False, max_position_embeddings=128,
                         rope_parameters=rope, **kw)
    else:
        d, hf = save_perturbed(where, arch, seed=7, num_hidden_layers=2, max_position_embeddings=128,
                               rope_parameters=rope, **kw)
    if legacy:
        _to_legacy(d)
        hf = load_hf(d)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    return request.param, d, hf


def _ids(n, seed=0):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def test_config_resolves_like_transformers(ckpt):
    _, d, hf = ckpt
    rope = load_config(d).rope
    rp = hf.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == rp["factor"]
    assert rope["original_max_position_embeddings"] == rp["original_max_position_embeddings"] == ORIG
    rot = hf.model.rotary_emb
    assert rope["attention_factor"] == pytest.approx(rot.attention_scaling, rel=1e-12)
    dim = 2 * rot.inv_freq.numel()
    torch.testing.assert_close(rope_inv_freq(dim, load_config(d).rope_theta, rope), rot.inv_freq, atol=0, rtol=0)
    if hf.config.model_type == "deepseek_v3":
        attn = hf.model.layers[0].self_attn
        assert dim == hf.config.qk_rope_head_dim
        assert attn.scaling == pytest.approx(hf.config.qk_head_dim ** -0.5 * softmax_scale_factor(rope), rel=1e-12)


def _runner(d, max_pos=64):
    r = ModelRunner(d, CPU, F32, max_pos=max_pos)
    r.alloc(max_pos)
    return r


def _steps(r, ids):
    """A 40-row prefill (MLA's expanded arm), single rows and a verify-shaped step (absorbed)."""
    return torch.cat([r.forward(ids[:40], 0)] + [r.forward(ids[t:t + 1], t) for t in range(40, 43)]
                     + [r.forward(ids[43:], 43)])


def test_logits_match_transformers_past_the_original_context(ckpt):
    _, d, hf = ckpt
    ids = _ids(56, seed=1)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(_steps(_runner(d), ids), ref, atol=ATOL, rtol=0)


def test_each_yarn_effect_moves_the_logits(ckpt):
    """Undo one effect at a time: the logits leave the reference by far more than ATOL."""
    name, d, hf = ckpt
    ids = _ids(56, seed=1)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cfg = load_config(d)
    undo = {"frequencies": lambda st: st._inv_freq.update(
        {k: rope_inv_freq(k, cfg.rope_theta) for k in st._inv_freq})}
    if cfg.rope["attention_factor"] != 1.0:
        undo["cos/sin factor"] = lambda st: setattr(st, "_rope_scale", 1.0)
    if softmax_scale_factor(cfg.rope) != 1.0:
        def plain_softmax(st):
            for blk in st.layers.values():
                if isinstance(blk.self_attn, RopeMLA):
                    blk.self_attn.scale /= softmax_scale_factor(cfg.rope)
        undo["softmax mscale"] = plain_softmax
    if name.startswith("deepseek_v3"):
        assert "softmax mscale" in undo
    assert len(undo) >= 2 or name == "deepseek_v3-released"  # released: attention_factor is exactly 1
    for what, f in undo.items():
        r = _runner(d)
        f(r.stage)
        gap = (_steps(r, ids) - ref).abs().max().item()
        assert gap > 100 * ATOL, f"{name}: undoing the {what} moved the logits only {gap:.2e}"


def test_greedy_ids_equal_transformers_generate(ckpt):
    _, d, hf = ckpt
    prompt = _ids(PROMPT, seed=2)
    r = _runner(d)
    out = []
    logits = r.forward(prompt, 0)[-1]
    for t in range(NEW):
        out.append(int(logits.argmax()))
        if t + 1 < NEW:
            logits = r.forward(torch.tensor([out[-1]]), PROMPT + t)[-1]
    with torch.no_grad():
        ref = hf.generate(prompt[None], attention_mask=torch.ones(1, PROMPT, dtype=torch.long), do_sample=False,
                          max_new_tokens=NEW, min_new_tokens=NEW)[0, PROMPT:]
    assert out == ref.tolist()


# ---- the pure functions against transformers' ROPE_INIT_FUNCTIONS["yarn"] ------------------

PURE = [  # (rope parameters, head_dim, partial_rotary_factor)
    (_yarn(), 16, 1.0),
    (dict(_yarn(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0, beta_fast=32,
                beta_slow=1)), 64, 1.0),  # DeepSeek-V3's released rope_scaling, its qk_rope_head_dim
    (_yarn(mscale=0.707, mscale_all_dim=1.0, truncate=False), 32, 1.0),
    (_yarn(attention_factor=0.9, beta_fast=8, beta_slow=4, factor=6.0), 128, 0.5),
    (_yarn(beta_fast=0, beta_slow=None, mscale=2.0), 16, 1.0),  # 0 / null betas: the paper's 32 / 1
    (_yarn(factor=None), 24, 1.0),  # null: max_position_embeddings / original_max_position_embeddings
    (_yarn(factor=1.0, beta_fast=2, beta_slow=2), 8, 1.0),  # a zero-width ramp
]


@pytest.mark.parametrize("rope, head_dim, partial", PURE, ids=[str(i) for i in range(len(PURE))])
def test_inv_freq_and_attention_factor_equal_transformers(rope, head_dim, partial):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from transformers.utils import logging as hf_logging

    theta = 10000.0
    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "factor does not match max_position_embeddings": expected here
    try:
        c = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=128,
                        rope_parameters=dict(rope, rope_theta=theta, partial_rotary_factor=partial))
        ref, att = ROPE_INIT_FUNCTIONS["yarn"](c)
    finally:
        hf_logging.set_verbosity(prev)
    p = resolve_yarn(rope, {"max_position_embeddings": 128})
    torch.testing.assert_close(yarn_inv_freq(int(head_dim * partial), theta, p), ref, atol=0, rtol=0)
    assert p["attention_factor"] == pytest.approx(att, rel=1e-12)


def test_deepseek_softmax_scale_factor():
    p = resolve_yarn(_yarn(factor=40.0, mscale=1.0, mscale_all_dim=1.0), {})
    assert p["attention_factor"] == 1.0
    assert softmax_scale_factor(p) == pytest.approx((0.1 * math.log(40.0) + 1) ** 2)
    assert softmax_scale_factor(resolve_yarn(_yarn(mscale=1.0), {})) == 1.0  # no mscale_all_dim
    assert softmax_scale_factor({}) == 1.0


def test_original_context_comes_from_where_transformers_reads_it():
    rp = _yarn()
    assert resolve_yarn(rp, {"original_max_position_embeddings": 16})["original_max_position_embeddings"] == 16
    no_orig = {"rope_type": "yarn", "factor": 4.0}
    assert resolve_yarn(no_orig, {"max_position_embeddings": 96})["original_max_position_embeddings"] == 96
    cfg = parse_config(dict(DENSE["llama"], rope_scaling={"type": "yarn", "factor": 2.0, "mscale_all_dim": 1}))
    assert cfg.rope["original_max_position_embeddings"] == 512 and cfg.rope["mscale_all_dim"] == 1.0


# ---- malformed yarn parameters: one line, naming the key ---------------------------------

_BAD = [
    (dict(factor=0), "factor"),
    (dict(factor=-4.0), "factor"),
    (dict(factor="4"), "factor"),
    (dict(factor=float("inf")), "factor"),
    (dict(beta_fast="fast"), "beta_fast"),
    (dict(mscale_all_dim=[1.0]), "mscale_all_dim"),
    (dict(attention_factor=-1.0), "attention_factor"),
    (dict(truncate="yes"), "truncate"),
    (dict(original_max_position_embeddings=0), "original_max_position_embeddings"),
    (dict(original_max_position_embeddings=32.5), "original_max_position_embeddings"),
]


@pytest.mark.parametrize("edit, needle", _BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(_BAD)])
def test_malformed_yarn_is_refused_in_one_line(edit, needle):
    for base in (DENSE["llama"], MOE["deepseek_v3"], MOE["glm4_moe"]):
        _refused_fast(dict(base, rope_scaling=dict(_yarn(), **edit)), "cfg:", "yarn", needle)


def test_yarn_without_a_context_or_a_factor_is_refused():
    no_ctx = {k: v for k, v in DENSE["llama"].items() if k != "max_position_embeddings"}
    _refused_fast(dict(no_ctx, rope_scaling={"type": "yarn", "factor": 4.0}), "original_max_position_embeddings")
    _refused_fast(dict(no_ctx, rope_scaling=_yarn(factor=None)), "factor", "max_position_embeddings")
    _refused_fast(dict(DENSE["llama"], rope_parameters={"rope_type": "yarn"}), "factor")
    _refused_fast(dict(DENSE["llama"], rope_parameters={"rope_type": "longrope", "factor": 4.0}),
                  "unsupported rope_type", "yarn")
