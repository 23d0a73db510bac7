"""The EAGLE-3 drafter: its k chained drafts equal a plain-torch reference of the published
equations (taps from transformers' hidden states, the whole chain recomputed from scratch,
written here independently of the engine), at the prime and mid-session; greedy output is
token-identical to plain decoding for every k, with and without the checkpoint's own
embedding; the layer ids resolve from each published config key; sampled output follows the
target distribution through a partial draft vocabulary (d2t); bad checkpoints and flags get
one line and exit 2; and a trained tiny drafter really accepts (permuted taps or a
normed feedback cost it)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from memra_dist.app import generate, open_engine
from memra_dist.cli import main
from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.model.config import load_config
from memra_dist.model.eagle3 import default_eagle3_taps, load_eagle3_config, parse_eagle3_config
from memra_dist.demo.tiny_eagle3 import random_eagle3
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

CPU, F32 = torch.device("cpu"), torch.float32
SHAPE = dict(taps=(0, 1, 3), heads=2, kv_heads=1, head_dim=16, intermediate_size=64, draft_vocab=96)
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
N_NEW = 30


@pytest.fixture(scope="module")
def eagle_dir(llama, tmp_path_factory):
    return random_eagle3(tmp_path_factory.mktemp("eagle3") / "e", llama, seed=2, **SHAPE)


@pytest.fixture(scope="module")
def eagle_embed_dir(llama, tmp_path_factory):
    """The checkpoint carries its own embedding (used instead of the target's)."""
    return random_eagle3(tmp_path_factory.mktemp("eagle3e") / "e", llama, seed=4, embed=True, **SHAPE)


# ---- the reference: the equations, in plain torch, from the checkpoint's tensors ----


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, hd):  # x (T, heads, hd), HF rotate-half
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    f = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + rot * sin


def _layer_outputs(hf, ids: list[int], layers) -> list[torch.Tensor]:
    """transformers' decoder layers' outputs (T, H) over ids, read by forward hooks: HF
    `hidden_states[t + 1]`, except that for the last layer that one is after the final norm."""
    got = {}

    def keep(t):
        return lambda mod, args, out: got.__setitem__(t, (out[0] if isinstance(out, tuple) else out)[0])

    hooks = [hf.model.layers[t].register_forward_hook(keep(t)) for t in layers]
    try:
        hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return [got[t] for t in layers]


def reference_chain(edir, hf, context: list[int], k: int) -> list[torch.Tensor]:
    """The k draft-vocabulary logits (Vd,) after `context`, from scratch: row p (p < N - 1)
    pairs token t_{p+1} with g_p = fc(the outputs of the tapped target layers at p); chain
    row N - 2 + s pairs the greedy draft s (through d2t) with the previous row's pre-norm
    output. Every row attends causally over all rows before it and itself."""
    cfg = json.loads((edir / "config.json").read_text())
    W = load_file(str(edir / "model.safetensors"))
    w = lambda n: W[f"midlayer.{n}.weight"]  # noqa: E731
    nh, nkv, hd, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    taps = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    E = W.get("embed_tokens.weight", hf.model.embed_tokens.weight.detach())
    hot = torch.arange(W["d2t"].numel()) + W["d2t"]
    N = len(context)
    Ks, Vs = [], []

    def layer(tokens, g, pos):  # rows (T,) tokens, (T, H) hidden, (T,) positions -> pre-norm h
        x2 = torch.cat([_rms(E[tokens], w("input_layernorm")), _rms(g, w("hidden_norm"))], -1)  # (T, 2H)
        T = x2.shape[0]
        q = _rope((x2 @ w("self_attn.q_proj").T).view(T, nh, hd), pos, theta, hd)
        Ks.append(_rope((x2 @ w("self_attn.k_proj").T).view(T, nkv, hd), pos, theta, hd))
        Vs.append((x2 @ w("self_attn.v_proj").T).view(T, nkv, hd))
        K, V = torch.cat(Ks).repeat_interleave(nh // nkv, 1), torch.cat(Vs).repeat_interleave(nh // nkv, 1)
        n0 = K.shape[0] - T
        allowed = torch.arange(K.shape[0])[None, :] <= n0 + torch.arange(T)[:, None]  # (T, all rows)
        s = torch.einsum("qhd,khd->hqk", q, K) / hd ** 0.5
        att = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        h = g + torch.einsum("hqk,khd->qhd", att, V).reshape(T, nh * hd) @ w("self_attn.o_proj").T
        h2 = _rms(h, w("post_attention_layernorm"))
        return h + (F.silu(h2 @ w("mlp.gate_proj").T) * (h2 @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T

    def logits(h):
        return (_rms(h, W["norm.weight"]) @ W["lm_head.weight"].T)[-1]

    with torch.no_grad():
        g = torch.cat(_layer_outputs(hf, context[:-1], taps), -1) @ W["fc.weight"].T  # (N - 1, H)
        h = layer(torch.tensor(context[1:]), g, torch.arange(N - 1))[-1:]
        out = [logits(h)]
        for s in range(1, k):
            tok = hot[out[-1].argmax()].view(1)
            h = layer(tok, h, torch.tensor([N - 2 + s]))
            out.append(logits(h))
    return out


def _session_chains(llama, edir, oracle: list[int] | None = None, k=3):
    """(context, the drafter's k logits) of every round of a greedy session. With `oracle`
    (the plain greedy tokens after the prompt), each proposal's first two drafts are replaced
    by the right ones, so rounds accept and the next round's first forward runs several
    verified rows (its chain rows of the round before overwritten)."""
    target = ModelRunner(llama, CPU, F32, max_pos=128)
    d = Eagle3Drafter.load(edir, load_eagle3_config(edir, load_config(llama)), target)
    seen, real_logits, real_propose = [], d.step_logits, d.propose

    def spy(context, kk, pick):
        out = real_logits(context, kk, pick)
        seen.append((list(context), [o[0] for o in out]))
        return out

    def helped(context, kk, sp, gen):
        prop = real_propose(context, kk, sp, gen)
        n = len(context) - len(PROMPT)
        prop.tokens[:2] = torch.tensor(oracle[n:n + 2])[:prop.tokens[:2].numel()]
        return prop

    d.step_logits = spy
    if oracle is not None:
        d.propose = helped
    s = SpecSession(target, d, SamplingParams(), torch.Generator(), k)
    s.start(PROMPT, N_NEW, 64)
    while not s.done:
        s.burst(1)
    return seen, s.stats


@pytest.mark.parametrize("which", ["target_embedding", "own_embedding"])
def test_drafts_equal_reference_at_prime_and_mid_session(ckpt_factory, eagle_dir, eagle_embed_dir, plain, which):
    llama, hf = ckpt_factory("llama")
    edir = eagle_dir if which == "target_embedding" else eagle_embed_dir
    with torch.no_grad():  # the hooks read what HF's hidden_states say (below the last layer)
        torch.testing.assert_close(_layer_outputs(hf, PROMPT, [1])[0],
                                   hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states[2][0])
    for oracle in (None, plain):  # rounds that accept nothing, and rounds that accept two drafts
        seen, stats = _session_chains(llama, edir, oracle)
        assert len(seen) >= 6 and (oracle is None or stats.accepted >= 2 * stats.rounds - 2), stats
        for ctx, got in seen[:1] + seen[3:6]:  # the first round (the prime's rows) and later ones
            want = reference_chain(edir, hf, ctx, len(got))
            for g, w_ in zip(got, want):
                torch.testing.assert_close(g, w_, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def plain(llama):
    return generate(RunConfig(model=str(llama), drafter="none", max_new_tokens=N_NEW, device="cpu"), PROMPT).token_ids


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain(llama, eagle_dir, plain, k):
    cfg = RunConfig(model=str(llama), drafter="eagle3", draft_model=str(eagle_dir), k=k, max_new_tokens=N_NEW,
                    device="cpu", burst_rounds=3)
    res = generate(cfg, PROMPT)
    assert res.token_ids == plain
    assert 0 < res.stats["drafted"] <= k * res.stats["rounds"]


def test_engine_serves_requests_in_turn(llama, eagle_embed_dir, plain):
    cfg = RunConfig(model=str(llama), drafter="eagle3", draft_model=str(eagle_embed_dir), k=4,
                    max_new_tokens=N_NEW, device="cpu")
    with open_engine(cfg, capacity=96) as eng:
        other = eng.generate([3, 4, 5]).token_ids
        assert eng.generate(PROMPT).token_ids == plain
    assert other == generate(cfg.with_(drafter="none", draft_model=None), [3, 4, 5]).token_ids


# ---- which target layers: the config keys and the default ----


def _cfg(**kw):
    base = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 128}
    return {**base, **kw}


def test_tap_ids_from_each_key_and_default():
    assert default_eagle3_taps(32) == (1, 15, 28)  # inputs of layers 2, 16, 29
    assert parse_eagle3_config(_cfg(), 32).tap_ids == (1, 15, 28)
    # SGLang / SpecForge: eagle_config's ids are layer outputs (SGLang captures them at id + 1's input)
    assert parse_eagle3_config(_cfg(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 9, 17]}), 32).tap_ids \
        == (1, 9, 17)
    # vLLM: the top-level ids are layer inputs (captured before the layer)
    assert parse_eagle3_config(_cfg(eagle_aux_hidden_state_layer_ids=[2, 16, 29]), 32).tap_ids == (1, 15, 28)
    ec = parse_eagle3_config(_cfg(draft_vocab_size=64), 32)
    assert ec.draft_vocab_size == 64 and ec.target_hidden_size == 32 and not ec.norm_before_residual
    with pytest.raises(UserError, match="at least 7 layers"):
        parse_eagle3_config(_cfg(), 4)
    with pytest.raises(UserError, match="past the embedding"):
        parse_eagle3_config(_cfg(eagle_aux_hidden_state_layer_ids=[0, 2, 3]), 4)  # the embedding is no tap


def test_eagle3_with_draft_model_keeps_its_name():
    assert RunConfig(model="m", drafter="eagle3", draft_model="d").drafter == "eagle3"


# ---- bad input: one line, exit 2 ----


def _variant(src, dst, d2t: str = "", **edits):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in edits.items():
        if k == "taps":
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = v
        elif k == "no_taps":
            del cfg["eagle_config"]
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    if d2t:  # the last draft id mapped past the vocabulary ("out") or onto draft id 0's target id ("dup")
        W = load_file(str(dst / "model.safetensors"))
        n = W["d2t"].numel()
        W["d2t"][-1] = 1000 if d2t == "out" else W["d2t"][0] - (n - 1)
        save_file(W, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit, says", [
    (dict(taps=[0, 1, 4]), "exceed the target's 4 layers"),
    (dict(no_taps=True), "need a target of at least 7 layers"),
    (dict(target_hidden_size=48), "hidden size 48 differs"),
    (dict(vocab_size=256), "vocabulary (256 tokens) differs"),
    (dict(d2t="out"), "outside the target's vocabulary"),
    (dict(d2t="dup"), "two draft ids to the same target id"),
    (dict(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 checkpoint"),
])
def test_bad_checkpoint_one_line(llama, eagle_dir, tmp_path, capsys, edit, says):
    bad = _variant(eagle_dir, tmp_path / "bad", **edit)
    code = main(["generate", "--model", str(llama), "--prompt", "hello", "--drafter", "eagle3",
                 "--draft-model", str(bad), "--device", "cpu", "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("args, says", [
    (["--drafter", "eagle3"], "--drafter eagle3 needs --draft-model"),
])
def test_bad_flags_one_line(llama, capsys, args, says):
    code = main(["generate", "--model", str(llama), "--prompt", "hello", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err


# ---- sampled decoding keeps the target distribution (the style of test_sampling_distribution) ----


@pytest.mark.slow  # 800 sampled sessions
def test_sampled_follows_target(ckpt_factory, tmp_path):
    from test_sampling_distribution import TINY, assert_matches, exact_marginals, sample_first_tokens

    target_dir, hf = ckpt_factory("llama", seed=3, **TINY)
    # 12 of the 16 ids draftable: q is 0 on the other 4, which only the target's residual can emit
    edir = random_eagle3(tmp_path / "e", target_dir, seed=9, std=0.3, taps=(0, 1), heads=2, kv_heads=1,
                         head_dim=8, intermediate_size=32, draft_vocab=12)
    target = ModelRunner(target_dir, CPU, F32, max_pos=64)
    drafter = Eagle3Drafter.load(edir, load_eagle3_config(edir, load_config(target_dir)), target)
    sp = SamplingParams(temperature=1.0)
    m1, m2, m3 = exact_marginals(hf, sp)
    counts, st = sample_first_tokens(target, drafter, sp, 3, 800)
    assert st["accepted"] >= 100 and st["drafted"] - st["accepted"] >= 100, st
    assert_matches(counts[0], m1, "token 1 (anchor)", tv_tol=0.08)
    assert_matches(counts[1], m2, "token 2", tv_tol=0.08)
    assert_matches(counts[2], m3, "token 3", tv_tol=0.08)


# ---- the wiring test: a trained tiny drafter accepts; permuted taps or a normed feedback cost it ----


@pytest.mark.slow  # trains the demo target (~8 s) and its EAGLE-3 drafter (~16 s)
def test_trained_tiny_drafter_accepts_and_miswiring_costs_it(tmp_path):
    from memra_dist.app import DEMO_PROMPT
    from memra_dist.demo.corpus import CORPUS
    from memra_dist.demo.tiny import (DEMO_INIT_STD, DEMO_RECIPE, DEMO_SHAPES, build_checkpoint, llama_config,
                                       train_tokenizer)
    from memra_dist.demo.tiny_eagle3 import TINY_EAGLE3, train_eagle3
    from memra_dist.model.tokenizer import load_tokenizer

    tok = train_tokenizer()
    steps, lr, seed = DEMO_RECIPE["target"]
    target = build_checkpoint(tmp_path / "target", llama_config(tok.get_vocab_size(), **DEMO_SHAPES["target"]), tok,
                              seed=seed, train_steps=steps, init_std=DEMO_INIT_STD, lr=lr)
    good = train_eagle3(target, tmp_path / "eagle3")
    permuted = _variant(good, tmp_path / "permuted", taps=list(reversed(TINY_EAGLE3["taps"])))
    enc = load_tokenizer(str(target)).encode
    prompts = [enc(DEMO_PROMPT), enc(CORPUS.splitlines()[2])[:12]]

    def acceptance(edir) -> float:
        st = [generate(RunConfig(model=str(target), drafter="eagle3", draft_model=str(edir), k=4, max_new_tokens=64,
                                 device="cpu"), p).stats for p in prompts]
        return sum(s["accepted"] for s in st) / sum(s["drafted"] for s in st)

    good_acc = acceptance(good)
    assert good_acc >= 0.5, good_acc  # measured 1.0
    # the tiny drafter leans on its own attention as much as on the taps: fc reading its
    # taps in the wrong order costs it about 0.3 (measured 0.71) ...
    assert acceptance(permuted) < good_acc - 0.15
    # ... and a chain fed the layer's normed output instead of its pre-norm one, 0.6 (measured 0.39)
    real_commit, real_run = Eagle3Drafter._commit_rows, Eagle3Drafter._run

    def commit(self, *a):
        self.committing = True
        try:
            return real_commit(self, *a)
        finally:
            self.committing = False

    # (the engine loop's shared chain, eagle3_batch.py: each round's first step reads the taps'
    # features, every later step the step before's output, which the sabotage norms)
    import memra_dist.specdec.drafters.eagle3_batch as eb
    from memra_dist.model.eagle3 import Eagle3Net

    real_step, real_features, features = eb._step, Eagle3Net.features, []

    def feats(self, x):
        out = real_features(self, x)
        features.append(out)
        return out

    def step(net, ds, los, lens, tokens, g):
        fed = any(g is f for f in features)
        features.clear()
        return real_step(net, ds, los, lens, tokens, g if fed else net.norm(g))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Eagle3Drafter, "_commit_rows", commit)
        mp.setattr(Eagle3Drafter, "_run", lambda self, tok, g, lo: real_run(
            self, tok, g if getattr(self, "committing", False) else self.net.norm(g), lo))
        mp.setattr(Eagle3Net, "features", feats)
        mp.setattr(eb, "_step", step)
        assert acceptance(good) < good_acc - 0.3
