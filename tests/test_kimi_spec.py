"""Speculative decoding on the hybrid kimi_linear model (3:1 KDA:MLA, MoE, dense first layer):
greedy speculative output equals plain greedy (and transformers' greedy) for every drafter,
K in {1, 4, 8}, pp in {1, 2}; after rejections the KDA state (target and kimi draft) equals a
fresh prefill of the accepted prefix; both checkpoint layouts load to the same logits."""

from __future__ import annotations

import tempfile

import pytest
import torch

pytest.importorskip("transformers")

from kimi_ckpt import PROMPT, hybrid, kimi_config, reference_greedy  # noqa: E402

from memra_dist.config import RunConfig  # noqa: E402
from memra_dist.runner import ModelRunner  # noqa: E402
from memra_dist.model.kda import KDAState  # noqa: E402
from memra_dist.app import generate  # noqa: E402
from memra_dist.specdec.drafters import ModelDrafter, ReplayDrafter  # noqa: E402
from memra_dist.specdec.sampling import SamplingParams  # noqa: E402
from memra_dist.specdec.session import SpecSession  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

CPU, N = torch.device("cpu"), 24

# drafter id -> (RunConfig drafter fields); "model" = the kimi_linear draft, "llama" = conftest's
DRAFTERS = {
    "ngram": dict(drafter="ngram"),
    "replay0.3": dict(drafter="replay", replay_corrupt=0.3),
    "replay1.0": dict(drafter="replay", replay_corrupt=1.0),
    "model": dict(drafter="model"),
}


def _cfg(target: str, name: str = "none", draft: str | None = None, **kw) -> RunConfig:
    extra = dict(DRAFTERS.get(name, {"drafter": name}))
    if extra["drafter"] == "model":
        extra["draft_model"] = draft or hybrid()[2]
    kw.setdefault("spec_k", "fixed")  # (the rounds' counts compared across pp: the loop's auto K moves at pp 1)
    return RunConfig(model=target, max_new_tokens=N, device="cpu", **extra, **kw)


@pytest.fixture(scope="module")
def plain() -> list[int]:
    return generate(_cfg(hybrid()[1]), PROMPT).token_ids


def test_plain_greedy_equals_transformers(plain):
    assert plain == reference_greedy(N)


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_spec_greedy_equals_plain(plain, name, k):
    res = generate(_cfg(hybrid()[1], name, k=k), PROMPT)
    assert res.token_ids == plain
    s = res.stats
    if name == "replay1.0":
        assert s["accepted"] == 0 and s["drafted"] > 0  # every round rejects (and rolls back)
    if name in ("replay0.3", "model"):
        assert 0 < s["accepted"] < s["drafted"]  # mixed rounds: partial accepts roll back mid-verify


def test_llama_draft_for_kimi_target(plain, draft_llama):
    """Any family drafts for any family of the same vocabulary."""
    for k in (1, 4):
        assert generate(_cfg(hybrid()[1], "model", draft=str(draft_llama), k=k), PROMPT).token_ids == plain


# ---------------------------------------------------------------- pp=2 (a module-scoped local Ray)


@pytest.mark.parametrize("name,k", [("ngram", 4), ("replay0.3", 8), ("model", 1), ("replay1.0", 4)])
def test_spec_greedy_pp2_equals_plain(ray_local, plain, name, k):
    """[KDA, MLA | KDA, KDA]: KDA state rolls back on the stage actor and on the head."""
    from memra_dist.app import generate

    res = generate(_cfg(hybrid()[1], name, k=k, pp=2), PROMPT)
    assert res.token_ids == plain
    ref = generate(_cfg(hybrid()[1], name, k=k), PROMPT)
    assert (res.stats["accepted"], res.stats["drafted"]) == (ref.stats["accepted"], ref.stats["drafted"])


# ---------------------------------------------------------------- KDA state after rejections


def _kda(r: ModelRunner) -> dict[int, KDAState]:
    return {i: s for i, s in r.cache.layers.items() if isinstance(s, KDAState)}


def _fresh(model_dir: str, tokens: list[int], capacity: int) -> ModelRunner:
    r = ModelRunner(model_dir, CPU, torch.float32)
    r.alloc(capacity)
    r.forward(torch.tensor(tokens), 0)
    return r


def _same_kda_state(got: ModelRunner, want: ModelRunner) -> None:
    a, b = _kda(got), _kda(want)
    assert a and a.keys() == b.keys()
    for i in a:
        assert a[i].length == b[i].length == got.length == want.length
        torch.testing.assert_close(a[i].S, b[i].S, atol=1e-5, rtol=1e-5, msg=f"S of layer {i}")
        torch.testing.assert_close(a[i].conv, b[i].conv, atol=1e-5, rtol=1e-5, msg=f"conv of layer {i}")


@pytest.mark.parametrize("corrupt", [1.0, 0.5])
def test_kda_state_after_rejection_equals_fresh_prefill(plain, corrupt):
    """Drive a session with the replay drafter; after every round the target's KDA states
    (recurrent S and conv window) equal a fresh prefill of the accepted prefix (the pending
    token, tokens[-1], is not yet in the cache)."""
    _, target, _ = hybrid()
    cap = len(PROMPT) + N + 9
    run = ModelRunner(target, CPU, torch.float32)
    drafter = ReplayDrafter(plain, len(PROMPT), 128, corrupt, seed=3)
    s = SpecSession(run, drafter, SamplingParams(), torch.Generator().manual_seed(0), k=4)
    s.start(PROMPT, N, cap)
    rejected = 0
    for _ in range(5):
        before = s.stats.accepted
        s.burst(1)
        rejected += s.stats.accepted - before < 4
        assert run.length == len(s.tokens) - 1
        _same_kda_state(run, _fresh(target, s.tokens[:-1], cap))
    assert rejected >= 3
    assert s.tokens[len(PROMPT):] == plain[:len(s.tokens) - len(PROMPT)]


def test_kimi_draft_state_after_maintenance(plain):
    """The kimi_linear DRAFT rolls back several single-row forwards at once (its proposals);
    after maintenance its KDA state equals a fresh prefill of the rows it keeps."""
    _, target, draft = hybrid()
    cap = len(PROMPT) + N + 9
    drafter = ModelDrafter(ModelRunner(draft, CPU, torch.float32))
    s = SpecSession(ModelRunner(target, CPU, torch.float32), drafter, SamplingParams(),
                    torch.Generator().manual_seed(0), k=8)
    s.start(PROMPT, N, cap)
    partial = 0
    while not s.done:
        before = s.stats.accepted
        s.burst(1)
        partial += 0 < s.stats.accepted - before < 8
        _same_kda_state(drafter.runner, _fresh(draft, drafter.cached, cap))
    assert partial >= 1  # a rollback into the middle of the proposal rows happened
    assert s.tokens[len(PROMPT):] == plain


# ---------------------------------------------------------------- original-format checkpoints


def test_original_and_module_layouts_load_identically():
    """The same model saved with transformers' default (Moonshot's original names:
    block_sparse_moe, per-expert w1/w2/w3, q/k/v_conv1d, flat forget-gate weights) and with
    save_original_format=False loads to identical logits, as a whole and as a pp split."""
    from safetensors import safe_open
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(1)
    m = KimiLinearForCausalLM(kimi_config([1, 3, 4], [2])).float().eval()
    orig, mod = tempfile.mkdtemp(prefix="kimi_orig_"), tempfile.mkdtemp(prefix="kimi_mod_")
    m.save_pretrained(orig)
    m.save_pretrained(mod, save_original_format=False)
    with safe_open(f"{orig}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names  # really the original layout
    assert "model.layers.0.self_attn.q_conv1d.weight" in names and "model.layers.0.self_attn.A_log" in names
    assert not any(".mlp." in n or "gate_up_proj" in n or "forget_gate" in n for n in names)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        ref = m(ids[None], use_cache=False).logits[0]
    weights, logits = [], []
    for d in (orig, mod):
        r = ModelRunner(d, CPU, torch.float32)
        r.alloc(32)
        logits.append(r.forward(ids, 0))
        whole = r.stage.state_dict()
        # a stage of the split: layers [1, 3) without embed / head reads only its tensors
        mid = ModelRunner(d, CPU, torch.float32, first=1, last=3, has_embed=False, has_head=False)
        weights.append((whole, mid.stage.state_dict()))
    # identical loading means identical tensors under the same names (the strict claim); the two
    # forwards' logits are then compared to the reference, not to each other, because a CPU GEMM
    # may round differently with the alignment of its operands (MKL does), which is not the loader
    for a, b in zip(weights[0], weights[1]):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    for out in logits:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_snapshot_ring_covers_the_largest_verify():
    from memra_dist.config import MAX_K
    from memra_dist.model import kda

    assert kda.RECURRENT_MAX_ROWS >= MAX_K + 1  # any accepted row of a K+1-row verify restorable


def test_spec_greedy_equals_plain_at_max_k():
    """K = MAX_K: the first rounds verify MAX_K + 1 rows and roll back inside them."""
    from memra_dist.config import MAX_K

    ref = generate(_cfg(hybrid()[1]).with_(max_new_tokens=40), PROMPT).token_ids
    for name in ("replay0.3", "model"):
        res = generate(_cfg(hybrid()[1], name, k=MAX_K).with_(max_new_tokens=40), PROMPT)
        assert res.token_ids == ref and res.stats["accepted"] < res.stats["drafted"]


def test_kda_ring_rolls_back_across_forwards(monkeypatch):
    from memra_dist.model import kda

    monkeypatch.setattr(kda, "RECURRENT_MAX_ROWS", 16)  # a 16-row ring, wrapped within 40 ids
    """Single-row forwards (a draft's proposals) then a rollback several forwards back,
    including before K-1 rows exist (the zero conv window) and after the ring wrapped."""
    _, target, _ = hybrid()
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    r = ModelRunner(target, CPU, torch.float32)
    r.alloc(48)
    for p in range(5):
        r.forward(torch.tensor(ids[p:p + 1]), p)
    r.rollback(2)  # conv window of length 2 holds one zero row (position -1)
    _same_kda_state(r, _fresh(target, ids[:2], 48))
    r.forward(torch.tensor(ids[2:20]), 2)  # 18 rows > 16: a chunked head + a 16-row tail
    for p in range(20, 34):  # 14 single-row forwards: the rings wrap
        r.forward(torch.tensor(ids[p:p + 1]), p)
    r.rollback(23)
    _same_kda_state(r, _fresh(target, ids[:23], 48))
    with pytest.raises(ValueError, match="cannot roll back"):
        r.rollback(17)  # past the ring: lengths [34 - 16, 34] were restorable
