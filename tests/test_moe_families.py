"""deepseek_v3 and glm4_moe against transformers on tiny random checkpoints saved with
save_pretrained (every parameter random, the router's correction bias too): logits at the
prefill and step by step (decode rows and verify-shaped steps), layer-range loading that
chains, the final-normed tap equal to transformers' last hidden state, greedy ids through
the CLI equal to transformers' generate(); config sizes bounded like every family's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from memra_dist.errors import UserError
from memra_dist.model.config import load_config, parse_config
from memra_dist.model.moe_config import MoESpec
from memra_dist.model.taps import FINAL
from memra_dist.runner import ModelRunner

from moe_ckpt import save_moe
from test_config_bounds import GIANT, _refused_fast

ATOL = 1e-4
CPU, F32 = torch.device("cpu"), torch.float32

CASES = {  # name -> (arch, overrides): the families' switches, each case one checkpoint
    "deepseek_v3": ("deepseek_v3", {}),  # q LoRA, interleaved rope, 2 expert groups
    "deepseek_v3-plain": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                                              norm_topk_prob=False, n_shared_experts=2)),
    "glm4_moe": ("glm4_moe", {}),  # qk-norm, q/k/v bias, half the head dims rotate
    "glm4_moe-plain": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=1.0,
                                        n_group=1, topk_group=1, first_k_dense_replace=0)),
}


@pytest.fixture(scope="module", params=list(CASES))
def ckpt(request, tmp_path_factory):
    arch, kw = CASES[request.param]
    d, hf = save_moe(tmp_path_factory.mktemp(request.param) / "m", arch, layers=3, seed=5, **kw)
    return request.param, d, hf


def _ids(n, seed=0):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def test_config_is_the_family(ckpt):
    name, d, hf = ckpt
    cfg = load_config(d)
    spec = cfg.family
    assert isinstance(spec, MoESpec) and cfg.arch == CASES[name][0] and cfg.num_layers == 3
    assert spec.num_mtp == 1 and spec.first_k_dense == hf.config.first_k_dense_replace
    if spec.mla:
        assert spec.rope_interleave == hf.config.rope_interleave and cfg.head_dim == 16
    else:
        assert spec.rotary_dim == int(16 * hf.config.rope_parameters.get("partial_rotary_factor", 0.5))


def test_logits_match_transformers_prefill_and_steps(ckpt):
    """A 40-row prefill (MLA's expanded arm), single rows and a verify-shaped step (absorbed),
    and the final-normed tap equal to transformers' last hidden state."""
    _, d, hf = ckpt
    ids = _ids(48, seed=1)
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
    r = ModelRunner(d, CPU, F32, max_pos=64)
    r.keep_taps((FINAL,))
    r.alloc(64)
    rows = [r.forward(ids[:40], 0)] + [r.forward(ids[t:t + 1], t) for t in range(40, 43)] + [r.forward(ids[43:], 43)]
    torch.testing.assert_close(torch.cat(rows), out.logits[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(r.cache.taps.bufs[FINAL][:48], out.hidden_states[-1][0], atol=ATOL, rtol=0)


def test_layer_ranges_chain(ckpt):
    _, d, _ = ckpt
    a = ModelRunner(d, CPU, F32, first=0, last=2, has_embed=True, has_head=False, max_pos=32)
    b = ModelRunner(d, CPU, F32, first=2, last=3, has_embed=False, has_head=True, max_pos=32)
    whole = ModelRunner(d, CPU, F32, max_pos=32)
    for r in (a, b, whole):
        r.alloc(16)
    ids = _ids(9, seed=2)
    torch.testing.assert_close(b.forward(a.forward(ids, 0), 0), whole.forward(ids, 0), atol=1e-5, rtol=0)
    assert not any(k.startswith("layers.3.") for k in whole.stage.state_dict())  # the MTP layer is not the decoder's


@pytest.mark.slow  # a CLI subprocess per family
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_cli_greedy_equals_transformers_generate(name, tmp_path):
    arch, kw = CASES[name]
    d, hf = save_moe(tmp_path / "m", arch, layers=2, seed=3, **kw)
    text = "the drafter proposes and the target verifies"
    res = subprocess.run([sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(d), "--prompt", text,
                          "--json", "--drafter", "none", "--max-new-tokens", "16", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    from tokenizers import Tokenizer

    ids = torch.tensor([Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)[0, ids.shape[1]:]
    assert json.loads(res.stdout)["token_ids"] == ref.tolist()


# ---- config bounds (test_config_bounds.py's checks, for these families) -------------------

_BASE = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "num_nextn_predict_layers": 1, "max_position_embeddings": 512}
FAMILIES = {
    "deepseek_v3": dict(_BASE, model_type="deepseek_v3", kv_lora_rank=16, q_lora_rank=8, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=12),
    "glm4_moe": dict(_BASE, model_type="glm4_moe", num_key_value_heads=2, head_dim=16),
}
_COMMON = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
           "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
           "n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers", "max_position_embeddings"]
FIELDS = {"deepseek_v3": _COMMON + ["kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                    "v_head_dim"],
          "glm4_moe": _COMMON + ["num_key_value_heads", "head_dim"]}
BOUND_CASES = [(f, k) for f, keys in FIELDS.items() for k in keys]


def test_the_tiny_configs_parse():
    for fam, d in FAMILIES.items():
        c = parse_config(d)
        assert (c.arch, c.num_layers, c.hidden_size, c.family.num_mtp) == (fam, 4, 32, 1)
    assert parse_config(FAMILIES["deepseek_v3"]).num_kv_heads == 4  # MLA: every head
    g = parse_config(FAMILIES["glm4_moe"])
    assert (g.num_kv_heads, g.head_dim, g.family.rotary_dim, g.o_bias) == (2, 16, 8, False)


@pytest.mark.parametrize("family, key", BOUND_CASES, ids=[f"{f}-{k}" for f, k in BOUND_CASES])
def test_giant_and_malformed_sizes_are_refused_naming_the_field(family, key):
    for v in GIANT:
        _refused_fast(dict(FAMILIES[family], **{key: v}), key, "out of range")
    for v in (2.5, "64", True, [4]):
        _refused_fast(dict(FAMILIES[family], **{key: v}), key, "malformed")


@pytest.mark.parametrize("edit, needle", [
    (dict(n_routed_experts=9), "groups of >= 2"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(topk_group=3), "topk_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0}), "rope_type"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 0}), "yarn factor"),
])
def test_family_fields_are_checked(edit, needle):
    for d in FAMILIES.values():
        _refused_fast(dict(d, **edit), needle)


def test_glm_rotary_dims_are_checked():
    _refused_fast(dict(FAMILIES["glm4_moe"], partial_rotary_factor=0.1), "rotary dims")
    _refused_fast(dict(FAMILIES["glm4_moe"], partial_rotary_factor="half"), "partial_rotary_factor")
    _refused_fast(dict(FAMILIES["deepseek_v3"], qk_rope_head_dim=7), "even")
    with pytest.raises(UserError, match="unsupported architecture"):
        parse_config(dict(FAMILIES["glm4_moe"], model_type="glm5"))
