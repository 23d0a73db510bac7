"""The DFlash block drafter: its drafts equal a plain-torch reference of the published
equations (taps from transformers' hidden states, written here independently of the
engine), at the prime and mid-session (after ingests of verified rows only); greedy output
is token-identical to plain decoding for every k (below and above B - 1); sampled output
follows the target distribution; bad checkpoints and flags get one line and exit 2; and a
trained tiny drafter really accepts (a tap or block position one off costs it: the wiring test)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from memra_dist.app import generate, open_engine
from memra_dist.cli import main
from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.model.dflash import default_tap_ids, load_dflash_config
from memra_dist.demo.tiny_dflash import random_dflash
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters.dflash import DFlashDrafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

CPU, F32 = torch.device("cpu"), torch.float32
SHAPE = dict(layers=2, block_size=4, taps=(0, 2), mask_token_id=1, heads=2, kv_heads=1, head_dim=16,
             intermediate_size=64)
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
N_NEW = 30


@pytest.fixture(scope="module")
def dflash_dir(llama, tmp_path_factory):
    return random_dflash(tmp_path_factory.mktemp("dflash") / "d", llama, seed=2, **SHAPE)


# ---- the reference: the equations, in plain torch, from the checkpoint's tensors ----


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, hd):  # x (T, heads, hd), HF rotate-half
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    f = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + rot * sin


def reference_logits(ddir, hf, context: list[int]) -> torch.Tensor:
    """Logits (B-1, V) of the block after `context`: taps = HF hidden_states[t + 1] of every
    context row but the last; the block is [last, mask x (B-1)] at start = len(context) - 1."""
    cfg = json.loads((ddir / "config.json").read_text())
    W = load_file(str(ddir / "model.safetensors"))
    B, taps, mask = cfg["block_size"], cfg["dflash_config"]["target_layer_ids"], cfg["dflash_config"]["mask_token_id"]
    nh, nkv, hd, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    start = len(context) - 1
    with torch.no_grad():
        hs = hf(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states
        C = _rms(torch.cat([hs[t + 1][0] for t in taps], -1) @ W["fc.weight"].T, W["hidden_norm.weight"])
        x = hf.model.embed_tokens(torch.tensor([context[-1]] + [mask] * (B - 1)))
        qpos = torch.arange(start, start + B)
        kpos = torch.cat([torch.arange(start), qpos])
        for i in range(cfg["num_hidden_layers"]):
            w = lambda n: W[f"layers.{i}.{n}.weight"]  # noqa: E731
            hn = _rms(x, w("input_layernorm"))
            q = _rope(_rms((hn @ w("self_attn.q_proj").T).view(B, nh, hd), w("self_attn.q_norm")), qpos, theta, hd)
            kv_in = torch.cat([C, hn])
            k = _rope(_rms((kv_in @ w("self_attn.k_proj").T).view(-1, nkv, hd), w("self_attn.k_norm")), kpos, theta, hd)
            v = (kv_in @ w("self_attn.v_proj").T).view(-1, nkv, hd)
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5, -1)  # no mask at all
            x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(B, nh * hd) @ w("self_attn.o_proj").T
            h2 = _rms(x, w("post_attention_layernorm"))
            x = x + (F.silu(h2 @ w("mlp.gate_proj").T) * (h2 @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
        return hf.lm_head(_rms(x, W["norm.weight"]))[1:]


def _drafter(llama, ddir):
    target = ModelRunner(llama, CPU, F32, max_pos=128)
    return target, DFlashDrafter.load(ddir, load_dflash_config(ddir), target)


def test_drafts_equal_reference_at_prime_and_mid_session(ckpt_factory, dflash_dir):
    llama, hf = ckpt_factory("llama")
    target, d = _drafter(llama, dflash_dir)
    seen = []
    real = d.block_logits

    def spy(last, start, rows):
        out = real(last, start, rows)
        seen.append((list(ctx_now[0]), out))
        return out

    d.block_logits = spy
    s = SpecSession(target, d, SamplingParams(), torch.Generator(), 3)
    ctx_now = [None]
    s.start(PROMPT, N_NEW, 64)
    while not s.done:
        ctx_now[0] = list(s.tokens)
        s.burst(1)
    assert len(seen) >= 8
    for ctx, got in seen[:1] + seen[4:8]:  # the first round (prime ingest) and later ones (maintain ingests)
        want = reference_logits(dflash_dir, hf, ctx)[:got.shape[0]]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def plain(llama):
    return generate(RunConfig(model=str(llama), drafter="none", max_new_tokens=N_NEW, device="cpu"), PROMPT).token_ids


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain(llama, dflash_dir, plain, k):
    cfg = RunConfig(model=str(llama), drafter="dflash", draft_model=str(dflash_dir), k=k, max_new_tokens=N_NEW,
                    device="cpu", burst_rounds=3)
    res = generate(cfg, PROMPT)
    assert res.token_ids == plain
    st = res.stats
    assert st["drafted"] > 0 and st["drafted"] <= min(k, SHAPE["block_size"] - 1) * st["rounds"]


def test_engine_serves_requests_in_turn(llama, dflash_dir, plain):
    cfg = RunConfig(model=str(llama), drafter="dflash", draft_model=str(dflash_dir), k=3, max_new_tokens=N_NEW,
                    device="cpu")
    with open_engine(cfg, capacity=96) as eng:
        other = eng.generate([3, 4, 5]).token_ids
        assert eng.generate(PROMPT).token_ids == plain
    assert other == generate(cfg.with_(drafter="none", draft_model=None), [3, 4, 5]).token_ids


def test_default_taps():
    assert default_tap_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_tap_ids(32, 1) == (16,)


# ---- bad input: one line, exit 2 ----


def _variant(src, dst, **edits):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in edits.items():
        if k in ("target_layer_ids", "mask_token_id"):
            cfg["dflash_config"][k] = v
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit, says", [
    (dict(target_layer_ids=[0, 4]), "exceed the target's 4 layers"),
    (dict(hidden_size=48), "hidden size 48 differs"),
    (dict(vocab_size=256), "vocabulary (256 tokens) differs"),
    (dict(mask_token_id=128), "mask_token_id 128 is outside"),
    (dict(architectures=["Qwen3ForCausalLM"]), "not a DFlash checkpoint"),
])
def test_bad_checkpoint_one_line(llama, dflash_dir, tmp_path, capsys, edit, says):
    bad = _variant(dflash_dir, tmp_path / "bad", **edit)
    code = main(["generate", "--model", str(llama), "--prompt", "hello", "--drafter", "dflash",
                 "--draft-model", str(bad), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("args, says", [
    (["--drafter", "dflash"], "--drafter dflash needs --draft-model"),
])
def test_bad_flags_one_line(llama, capsys, args, says):
    code = main(["generate", "--model", str(llama), "--prompt", "hello", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err


def test_dflash_with_draft_model_keeps_its_name():
    assert RunConfig(model="m", drafter="dflash", draft_model="d").drafter == "dflash"
    with pytest.raises(UserError):
        RunConfig(model="m", drafter="dflash")


# ---- sampled decoding keeps the target distribution (the style of test_sampling_distribution) ----


@pytest.mark.slow  # 800 sampled sessions
def test_sampled_follows_target(ckpt_factory, tmp_path):
    from test_sampling_distribution import TINY, assert_matches, exact_marginals, sample_first_tokens

    target_dir, hf = ckpt_factory("llama", seed=3, **TINY)
    ddir = random_dflash(tmp_path / "d", target_dir, seed=9, std=0.3, layers=1, block_size=4, taps=(0, 1),
                         mask_token_id=15, heads=2, kv_heads=1, head_dim=8, intermediate_size=32)
    target = ModelRunner(target_dir, CPU, F32, max_pos=64)
    drafter = DFlashDrafter.load(ddir, load_dflash_config(ddir), target)
    sp = SamplingParams(temperature=1.0)
    m1, m2, m3 = exact_marginals(hf, sp)
    counts, st = sample_first_tokens(target, drafter, sp, 3, 800)
    assert st["accepted"] >= 100 and st["drafted"] - st["accepted"] >= 100, st
    assert_matches(counts[0], m1, "token 1 (anchor)", tv_tol=0.08)
    assert_matches(counts[1], m2, "token 2", tv_tol=0.08)
    assert_matches(counts[2], m3, "token 3", tv_tol=0.08)


# ---- the wiring test: a trained tiny drafter accepts; a tap or position offset by one costs it ----


@pytest.mark.slow  # trains the demo target (~8 s) and its DFlash drafter (~17 s)
def test_trained_tiny_drafter_accepts_and_miswiring_costs_it(tmp_path):
    from memra_dist.app import DEMO_PROMPT
    from memra_dist.demo.corpus import CORPUS
    from memra_dist.demo.tiny import (DEMO_INIT_STD, DEMO_RECIPE, DEMO_SHAPES, build_checkpoint, llama_config,
                                       train_tokenizer)
    from memra_dist.demo.tiny_dflash import TINY_DFLASH, train_dflash
    from memra_dist.model.tokenizer import load_tokenizer

    tok = train_tokenizer()
    steps, lr, seed = DEMO_RECIPE["target"]
    target = build_checkpoint(tmp_path / "target", llama_config(tok.get_vocab_size(), **DEMO_SHAPES["target"]), tok,
                              seed=seed, train_steps=steps, init_std=DEMO_INIT_STD, lr=lr)
    good = train_dflash(target, tmp_path / "dflash")
    shifted = _variant(good, tmp_path / "shifted", target_layer_ids=[t - 1 for t in TINY_DFLASH["taps"]])
    enc = load_tokenizer(str(target)).encode
    prompts = [enc(DEMO_PROMPT), enc(CORPUS.splitlines()[2])[:12]]

    def acceptance(ddir) -> float:
        st = [generate(RunConfig(model=str(target), drafter="dflash", draft_model=str(ddir), k=4, max_new_tokens=64,
                                 device="cpu"), p).stats for p in prompts]
        return sum(s["accepted"] for s in st) / sum(s["drafted"] for s in st)

    good_acc = acceptance(good)
    assert good_acc >= 0.5, good_acc  # measured 0.96
    # the tiny drafter leans on its last tap (the target's last layer) and on positions: an
    # input-vs-output tap offset costs a quarter of its acceptance (measured 0.73) ...
    assert acceptance(shifted) < good_acc - 0.15
    # ... and a block one position off collapses it (measured 0.006 on the solo drafter): its
    # rows' rotary positions one past where the block sits, in every path that drafts (the
    # engine loop's shared block forward and a drafter drafting alone)
    from memra_dist.model.dflash import DFlashNet

    real = DFlashNet.block
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DFlashNet, "block", lambda self, x, pos, *a, **kw: real(self, x, pos + 1, *a, **kw))
        assert acceptance(good) < 0.1


def test_draft_span_says_one_forward(llama, dflash_dir):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from memra_dist.phase.levels import TraceSettings
    from memra_dist.tracing.emit import SpanSink

    exp = InMemorySpanExporter()
    prov = TracerProvider()
    prov.add_span_processor(SimpleSpanProcessor(exp))
    cfg = RunConfig(model=str(llama), drafter="dflash", draft_model=str(dflash_dir), k=3, max_new_tokens=12,
                    device="cpu", trace=TraceSettings(level=1))
    generate(cfg, PROMPT, span_sink=SpanSink(prov.get_tracer("t"), None))
    drafts = [s for s in exp.get_finished_spans() if s.name == "spec.draft"]
    assert drafts and all(s.attributes["memra.draft_forwards"] == (1 if s.attributes["memra.k"] else 0)
                          for s in drafts)


def test_a_block_forward_keeping_the_drafted_rows_computes_them_as_the_whole_block(dflash_dir):
    """`DFlashNet.block(keep=(B, lo, hi))`, as the batched draft forward runs it: every row's
    K/V still written in the last layer (the kept rows read the whole block), that layer's
    attention, o_proj and FFN on rows lo .. hi - 1 of each block only, each equal to the same
    row of the whole forward."""
    from memra_dist.model.attention import cached_attention
    from memra_dist.model.dflash import load_dflash

    net = load_dflash(dflash_dir, load_dflash_config(dflash_dir), CPU, F32)
    B, n, ctx = 4, 3, 6
    H, last = net.layers[0].self_attn, net.layers[-1]
    torch.manual_seed(0)
    x = torch.randn(n * B, net.dc.base.hidden_size)
    pos = (torch.arange(B)[None, :] + torch.tensor([ctx, ctx + 2, ctx + 5])[:, None]).reshape(-1)
    ctx_kv = [(torch.randn(n, 16, H.nkv, H.hd), torch.randn(n, 16, H.nkv, H.hd)) for _ in net.layers]

    def run(keep):
        written = []

        def kv_of(li, kb, vb):  # each request's context rows, then its block's rows at their positions
            written.append((li, kb.shape[0]))
            K, V = (t.clone() for t in ctx_kv[li])
            K[torch.arange(n).repeat_interleave(B), pos] = kb
            V[torch.arange(n).repeat_interleave(B), pos] = vb
            return K, V

        def attend(q, K, V):
            R = q.shape[0] // n
            lim = pos.view(n, B)[:, -1] + 1  # context and the whole block
            return torch.cat([cached_attention(q[r * R:(r + 1) * R], K[r], V[r],
                                               (torch.arange(16) < lim[r])[None, :], H.nkv) for r in range(n)])

        ffn_rows = []
        hook = last.mlp.register_forward_hook(lambda m, a, o: ffn_rows.append(a[0].shape[0]))
        try:
            with torch.no_grad():
                return net.block(x, pos, kv_of, None, attend=attend, keep=keep), written, ffn_rows
        finally:
            hook.remove()

    whole, w_all, f_all = run(None)
    kept, w_kept, f_kept = run((B, 1, 3))
    assert w_kept == w_all == [(li, n * B) for li in range(len(net.layers))]  # every row's K/V, every layer
    assert f_all == [n * B] and f_kept == [n * 2]  # the last layer's FFN on the kept rows only
    torch.testing.assert_close(kept, whole.view(n, B, -1)[:, 1:3].reshape(n * 2, -1), rtol=1e-5, atol=1e-5)

    # the reference attention (no `attend`) under a mask of a row each: the kept rows' rows of it
    K0, V0 = (torch.randn(16, H.nkv, H.hd) for _ in range(2))
    lim = int(pos[B - 1]) + 1

    def one(keep):
        def kv_of(li, kb, vb):
            K, V = K0.clone(), V0.clone()
            K[pos[:B]], V[pos[:B]] = kb, vb
            return K, V

        mask = (torch.arange(16)[None, :] < lim) & (torch.arange(B)[:, None] >= 0)  # (B, 16)
        with torch.no_grad():
            return net.block(x[:B], pos[:B], kv_of, mask, keep=keep)

    torch.testing.assert_close(one((B, 1, 3)), one(None)[1:3], rtol=1e-5, atol=1e-5)
