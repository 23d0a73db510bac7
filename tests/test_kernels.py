"""The Triton kernels of the fast path (memra_dist/kernels/), run by Triton's interpreter on CPU:
the GEMV (with bias, with the SwiGLU gating folded in) equal F.linear; the split-sequence
cached attention equals the reference `cached_attention` at every row count, position and
chunking; and a stage switched onto them decodes and speculates token-identically in fp32."""

from __future__ import annotations


import pytest
import torch

from triton_interp import triton  # noqa: E402,F401 (the interpreter on CPU; skips without Triton)

from memra_dist.model.attention import cached_attention, causal_mask  # noqa: E402
from memra_dist.runner import ModelRunner  # noqa: E402
from memra_dist.specdec.drafters import ReplayDrafter  # noqa: E402
from memra_dist.specdec.drafters.none import NoDrafter  # noqa: E402
from memra_dist.specdec.sampling import SamplingParams  # noqa: E402
from memra_dist.specdec.session import SpecSession  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests run on CPU machines")


@pytest.mark.parametrize("n,k", [(12, 40), (16, 32), (5, 7)])
def test_gemv_equals_linear(n, k):
    from memra_dist.kernels.gemv import gemv

    g = torch.Generator().manual_seed(n * k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(1, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(gemv(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv(x, w, b), x @ w.t() + b, rtol=1e-5, atol=1e-5)
    gu = torch.randn(1, 2 * k, generator=g)
    ref = (torch.nn.functional.silu(gu[:, :k]) * gu[:, k:]) @ w.t()
    torch.testing.assert_close(gemv(gu, w, None, silu_mul=True), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", [(12, 40), (16, 32)])
def test_gemv_folds_the_pre_norm_and_the_residual_add(n, k):
    """gemv(x, w, norm=, residual=) = residual + RMSNorm(x) @ w^T: a block's half in one kernel."""
    from memra_dist.kernels.gemv import gemv
    from memra_dist.model.layers import RMSNorm

    g = torch.Generator().manual_seed(n + k)
    w, x, r, b = (torch.randn(n, k, generator=g), torch.randn(1, k, generator=g), torch.randn(1, n, generator=g),
                  torch.randn(n, generator=g))
    norm = RMSNorm(k, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=g) + 0.5)
        ref = norm(x) @ w.t()
    torch.testing.assert_close(gemv(x, w, norm=norm.weight, eps=norm.eps), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv(x, w, b, norm=norm.weight, eps=norm.eps, residual=r), ref + b + r,
                               rtol=1e-5, atol=1e-5)
    gu = torch.randn(1, 2 * k, generator=g)
    down = torch.nn.functional.silu(gu[:, :k]) * gu[:, k:] @ w.t()
    torch.testing.assert_close(gemv(gu, w, None, silu_mul=True, residual=r), down + r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,start", [(1, 0), (1, 63), (1, 64), pytest.param(1, 190, marks=pytest.mark.slow), (5, 100),
                                        pytest.param(9, 55, marks=pytest.mark.slow), (3, 197)])
@pytest.mark.parametrize("nh,nkv", [(8, 2), (4, 4)])
def test_split_attention_equals_reference(rows, start, nh, nkv):
    from memra_dist.kernels.decode_attention import decode_attention

    C, hd = 200, 16
    g = torch.Generator().manual_seed(rows * 1000 + start)
    kc, vc = torch.randn(C, nkv, hd, generator=g), torch.randn(C, nkv, hd, generator=g)
    kc[start + rows:] = float("nan")  # slots past the rows are never read (a NaN would spread)
    vc[start + rows:] = float("nan")
    q = torch.randn(rows, nh, hd, generator=g)
    pos = torch.arange(start, start + rows)
    ref = cached_attention(q, kc.nan_to_num(), vc.nan_to_num(), causal_mask(pos, C), nkv)
    for chunk in (16, 32, 64):  # several chunks per row, a row's end inside and on a chunk edge
        torch.testing.assert_close(decode_attention(q, kc, vc, pos, chunk=chunk), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,nh,nkv", [(1, 4, 2), (5, 8, 2), (3, 4, 4)])
def test_rope_kv_write_equals_the_reference_rotary_and_cache_writes(rows, nh, nkv):
    from memra_dist.kernels.rope_kv import rope_kv_write
    from memra_dist.model.layers import apply_rope, rope_inv_freq, rope_rows

    C, hd = 40, 16
    g = torch.Generator().manual_seed(rows * 10 + nh)
    qkv = torch.randn(rows, (nh + 2 * nkv) * hd, generator=g)
    pos = torch.tensor([3, 17, 18, 30, 39][:rows])
    cos, sin = rope_rows(pos, rope_inv_freq(hd, 10000.0))
    kc, vc = torch.randn(C, nkv, hd, generator=g), torch.randn(C, nkv, hd, generator=g)
    rk, rv = kc.clone(), vc.clone()
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
    rq = apply_rope(q.reshape(rows, nh, hd), cos, sin)
    rk.index_copy_(0, pos, apply_rope(k.reshape(rows, nkv, hd), cos, sin))
    rv.index_copy_(0, pos, v.reshape(rows, nkv, hd))
    out = rope_kv_write(qkv, cos, sin, kc, vc, pos, nh)
    assert torch.equal(out, rq) and torch.equal(kc, rk) and torch.equal(vc, rv)  # fp32: the same roundings


@pytest.mark.parametrize("rot,norm", [(16, True), (8, False), (8, True)])
def test_rope_kv_write_takes_qk_norms_and_partial_rotary_as_the_reference(rot, norm):
    """qwen3's q / k norms (each head RMS-normalized before it rotates) and glm4_moe's partial
    rotary (the first `rot` dims rotate, the rest pass through) in the same one pass."""
    from memra_dist.kernels.rope_kv import rope_kv_write
    from memra_dist.model.layers import RMSNorm, apply_rope, rope_inv_freq, rope_rows

    C, hd, nh, nkv, rows = 40, 16, 4, 2, 3
    g = torch.Generator().manual_seed(rot + norm)
    qkv = torch.randn(rows, (nh + 2 * nkv) * hd, generator=g) * 3
    pos = torch.tensor([3, 17, 39])
    cos, sin = rope_rows(pos, rope_inv_freq(rot, 10000.0))
    kc, vc = torch.zeros(C, nkv, hd), torch.zeros(C, nkv, hd)
    rk, rv = kc.clone(), vc.clone()
    q, k, v = (t.reshape(rows, -1, hd) for t in qkv.split([nh * hd, nkv * hd, nkv * hd], -1))
    qn, kn = RMSNorm(hd, 1e-6), RMSNorm(hd, 1e-6)
    with torch.no_grad():
        qn.weight.copy_(torch.rand(hd, generator=g) + 0.5)
        kn.weight.copy_(torch.rand(hd, generator=g) + 0.5)
        if norm:
            q, k = qn(q), kn(k)
    rq = apply_rope(q, cos, sin)
    rk.index_copy_(0, pos, apply_rope(k, cos, sin))
    rv.index_copy_(0, pos, v)
    norms = dict(q_norm=qn.weight.detach(), k_norm=kn.weight.detach(), eps=1e-6) if norm else {}
    out = rope_kv_write(qkv, cos, sin, kc, vc, pos, nh, **norms)
    # (fp32; the head's sum of squares in another order than torch's mean: a last-bit difference at most)
    torch.testing.assert_close(out, rq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc, rk, rtol=1e-6, atol=1e-6)
    assert torch.equal(vc, rv)
    if not norm:
        assert torch.equal(out[..., rot:], q[..., rot:])  # the unrotated dims pass through unchanged


@pytest.mark.parametrize("live", [1, 70, 1000, 2049])
def test_split_attention_spreads_a_short_context_of_a_large_cache(live):
    """A cache far larger than its live rows (a long-context engine on a short request): the
    kernel's programs share the LIVE slots (BC-slot steps), any of them may hold none."""
    from memra_dist.kernels.decode_attention import decode_attention

    C, hd, nh, nkv, rows = 8192, 16, 4, 2, 2
    g = torch.Generator().manual_seed(live)
    kc, vc = torch.randn(C, nkv, hd, generator=g), torch.randn(C, nkv, hd, generator=g)
    kc[live:] = float("nan")
    vc[live:] = float("nan")
    q = torch.randn(rows, nh, hd, generator=g)
    pos = torch.arange(max(0, live - rows), live)[-rows:] if live >= rows else torch.tensor([0])
    q = q[: pos.shape[0]]
    ref = cached_attention(q, kc.nan_to_num(), vc.nan_to_num(), causal_mask(pos, C), nkv)
    torch.testing.assert_close(decode_attention(q, kc, vc, pos), ref, rtol=1e-5, atol=1e-5)


def test_chunking_bounds_the_grid():
    from memra_dist.kernels.decode_attention import chunking

    assert chunking(2048) == (64, 32)
    assert chunking(100) == (64, 2)
    chunk, n = chunking(131072)
    assert n <= 64 and chunk * n >= 131072


@pytest.fixture(scope="module")
def wide_llama(ckpt_factory):
    """head_dim 16: the attention kernel's smallest tile."""
    return ckpt_factory("llama", seed=3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2)[0]


def _on_kernels(r: ModelRunner) -> int:
    """The CUDA fast path's set-up on a CPU runner: the QKV / gate-up fusion, then the kernels."""
    from memra_dist.kernels import install

    for blk in r.stage.layers.values():
        for m in (blk.self_attn, blk.mlp):
            if hasattr(m, "fuse"):
                m.fuse()
    return install(r.stage)


def _runner(path, kernels: bool) -> ModelRunner:
    r = ModelRunner(path, torch.device("cpu"), torch.float32, max_pos=256)
    if kernels:
        from memra_dist.kernels.ops import FastLinear

        n = _on_kernels(r)
        layers = len(r.stage.layers)
        # attention + qkv + o, gating + gate_up, the two norms and the gating in one pass (kernels/rows.py),
        # per layer; the head
        assert n == layers * 8 + 1
        assert isinstance(r.stage.lm_head, FastLinear)
    return r


def _generate(runner, drafter, k, prompt, n):
    s = SpecSession(runner, drafter, SamplingParams(), torch.Generator().manual_seed(0), k)
    s.start(prompt, n, len(prompt) + n + k + 1)
    while not s.done:
        s.burst(8)
    return s.tokens, s.stats


@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 40)])
def test_row_kernels_equal_the_reference_norm_residual_and_gating(shape):
    """kernels/rows.py: RMSNorm, the residual add with the next norm, silu(g) * u: each one pass,
    equal to the reference modules (fp32; any leading dims, a hidden size off a power of two)."""
    from memra_dist.kernels.rows import add_rms_norm_rows, rms_norm_rows, silu_mul_rows
    from memra_dist.model.layers import RMSNorm

    g = torch.Generator().manual_seed(sum(shape))
    H = shape[-1]
    x, r = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    norm = RMSNorm(H, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=g) + 0.5)
        torch.testing.assert_close(rms_norm_rows(x, norm.weight, norm.eps), norm(x), rtol=1e-6, atol=1e-6)
        s, y = add_rms_norm_rows(x, r, norm.weight, norm.eps)
        assert torch.equal(s, x + r)
        torch.testing.assert_close(y, norm(x + r), rtol=1e-6, atol=1e-6)
        gu = torch.randn(*shape[:-1], 2 * H, generator=g)
        ref = torch.nn.functional.silu(gu[..., :H]) * gu[..., H:]
        torch.testing.assert_close(silu_mul_rows(gu), ref, rtol=1e-6, atol=1e-6)
        assert silu_mul_rows(gu[:0].reshape(0, 2 * H)).shape == (0, H)  # an empty step launches nothing


@pytest.mark.slow  # the Triton interpreter: ~8 s on 2 cores
def test_a_prefill_past_the_folds_runs_the_row_kernels_and_equals_the_reference(wide_llama, monkeypatch):
    """Prefill chunks longer than the folded rows (16) run the eager block: their norms, residual
    add and gating go through kernels/rows.py, their rotary and K/V writes through
    kernels/rope_kv.py; the hidden rows and the cache equal the reference stage's (a first chunk
    and one over a prefix)."""
    import memra_dist.kernels.ops as ops
    import memra_dist.kernels.rope_kv as rk

    calls = []
    for mod, name in ((ops, "rms_norm_rows"), (ops, "add_rms_norm_rows"), (ops, "silu_mul_rows"), (rk, "rope_kv_write")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    prompt = torch.tensor([5, 6, 7, 8, 9, 11, 3, 2, 4, 10, 12, 13, 1, 14, 15, 16, 17] * 4)  # two chunks of 34 rows
    out, caches = [], []
    for kernels in (False, True):
        r = _runner(wide_llama, kernels)
        if kernels:  # the install built the row kernels on two rows (ops._warm_rows)
            assert sorted(calls) == ["add_rms_norm_rows", "rms_norm_rows", "silu_mul_rows"], calls
            calls.clear()
        cache = r.stage.new_cache(96, torch.device("cpu"), torch.float32)
        with torch.inference_mode():
            for a in (0, 34):  # (more than PREFIX_MIN_ROWS = 33: prefill chunks, the second over a prefix)
                out.append(r.stage(prompt[a:a + 34], torch.arange(a, a + 34), cache, start=a))  # (hidden: the
                # head's final norm is the unit test's; the head's row GEMM in the interpreter costs seconds)
        caches.append(cache)
    layers = len(r.stage.layers)
    for name in ("rms_norm_rows", "add_rms_norm_rows", "silu_mul_rows", "rope_kv_write"):
        assert calls.count(name) == 2 * layers, (name, calls)
    for ref, fast in ((out[0], out[2]), (out[1], out[3])):  # (fp32; the norms' sums in another order)
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
    for i in caches[0].layers:
        torch.testing.assert_close(caches[1].layers[i].k[:68], caches[0].layers[i].k[:68], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[1].layers[i].v[:68], caches[0].layers[i].v[:68], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the Triton interpreter: seconds to a minute on 2 cores; the full run (slow tier) keeps it
def test_a_stage_on_the_kernels_decodes_and_speculates_identically(wide_llama, monkeypatch):
    import memra_dist.kernels.rope_kv as rk

    calls = []
    real = rk.rope_kv_write
    monkeypatch.setattr(rk, "rope_kv_write", lambda qkv, *a: calls.append(qkv.shape[0]) or real(qkv, *a))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    n = 12  # (each decode step a few seconds of the interpreter)
    plain, _ = _generate(_runner(wide_llama, False), NoDrafter(), 1, prompt, n)
    assert not calls
    fast, _ = _generate(_runner(wide_llama, True), NoDrafter(), 1, prompt, n)
    assert fast == plain and len(plain) == len(prompt) + n
    assert 1 in calls  # the decode steps (and the short prefill) ran rotary + the cache write in one kernel
    def watched():
        r = _runner(wide_llama, True)
        assert r.stage.fused_head == 64 and all(b.fused_rows == 16 for b in r.stage.layers.values())
        rows = []
        for blk in r.stage.layers.values():
            real_step = blk.self_attn.fused_step
            monkeypatch.setattr(blk.self_attn, "fused_step",
                                lambda x, *a, step=real_step: rows.append(x.shape[0]) or step(x, *a))
        return r, rows

    r, fused = watched()
    assert _generate(r, NoDrafter(), 1, prompt, n)[0] == plain
    assert 1 in fused  # decode rows ran the folded norms / residuals (GEMVs)
    r, fused = watched()
    spec, st = _generate(r, ReplayDrafter(plain[len(prompt):], len(prompt), 128, corrupt=0.3), 4, prompt, n)
    assert spec == plain
    assert 0 < st.accepted < st.drafted  # multi-row verifies through the attention kernel, with rejections
    assert 5 in fused  # a verify of K + 1 rows ran folded too (the row GEMMs)


@pytest.mark.slow  # the Triton interpreter: ~10 s on 2 cores; the full run (slow tier) keeps it
@pytest.mark.parametrize("family", ["qwen3", "glm4_moe"])
def test_qk_norms_and_partial_rotary_ride_the_rotary_kernel_and_decode_identically(family, ckpt_factory, tmp_path,
                                                                                    monkeypatch):
    """qwen3's q / k norms and glm4_moe's partial rotary (with its q / k norms) take the rotary
    kernel (kernels/rope_kv.py) as a Llama layer does: decode and verify rows run it (qwen3's blocks
    fold their norms and residual adds), and the ids equal the reference's."""
    import memra_dist.kernels.rope_kv as rk
    from moe_ckpt import save_moe

    if family == "qwen3":
        path = ckpt_factory("qwen3", seed=7, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2)[0]
    else:
        path, _ = save_moe(tmp_path / "glm", "glm4_moe", use_qk_norm=True)
    calls = []
    real = rk.rope_kv_write
    monkeypatch.setattr(rk, "rope_kv_write", lambda qkv, *a, **kw: calls.append((qkv.shape[0], kw)) or real(qkv, *a, **kw))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8]
    plain, _ = _generate(ModelRunner(path, torch.device("cpu"), torch.float32, max_pos=128), NoDrafter(), 1,
                         prompt, 10)
    r = ModelRunner(path, torch.device("cpu"), torch.float32, max_pos=128)
    _on_kernels(r)
    attn = [b.self_attn for b in r.stage.layers.values()]
    assert all(a.fast_attn_rows and a.qk_norm and a.rope_kernel_ok() for a in attn)
    assert all(a.rope_dim < a.hd for a in attn) == (family == "glm4_moe")
    assert all(b.fused_rows for b in r.stage.layers.values()) == (family == "qwen3")  # (glm4_moe's MoE: no fold)
    assert _generate(r, NoDrafter(), 1, prompt, 10)[0] == plain
    assert calls and all(n >= 1 and "q_norm" in kw for n, kw in calls)
    calls.clear()
    spec, st = _generate(r, ReplayDrafter(plain[len(prompt):], len(prompt), 128, corrupt=0.3), 3, prompt, 10)
    assert spec == plain and 0 < st.accepted < st.drafted
    assert 4 in [n for n, _ in calls]  # a verify of K + 1 rows through the kernel


def test_kernels_fall_back_with_one_warning_where_they_cannot_run(capsys, monkeypatch):
    import memra_dist.kernels as K

    monkeypatch.setattr(K, "_PROBED", {})
    assert K.available() and K.available("cpu")  # importable: the interpreter's case
    assert K.available("cuda:0") is False  # no GPU here: the probe kernel cannot run
    assert K.available("cuda:0") is False  # probed once
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("memra-dist: warning: our Triton kernels cannot run on cuda:0 (")
    assert "cuBLAS and the reference attention" in err[0]


@pytest.mark.slow  # the Triton interpreter: seconds to a minute on 2 cores; the full run (slow tier) keeps it
def test_dflash_block_on_the_split_kernel_equals_the_masked_reference(tmp_path):
    """The DFlash block graphs' attention on the split kernel (every row at the block's last
    position: the context and the whole block, no causal mask) gives the reference's logits,
    captured at one start and replayed at later ones (the position follows the device scalar)."""
    from types import SimpleNamespace

    from graph_emulator import EmulatedCapture
    from memra_dist.bench.tap_checkpoints import ensure_dflash
    from memra_dist.model.dflash import load_dflash_config
    from memra_dist.specdec.drafters.dflash import DFlashDrafter
    from memra_dist.specdec.drafters.dflash_graph import BlockGraphs, kernel_attention

    cpu = torch.device("cpu")
    target_dir, draft_dir = ensure_dflash("tiny", tmp_path, cpu, lambda s: None)
    target = ModelRunner(target_dir, cpu, torch.float32, max_pos=160)
    d = DFlashDrafter.load(draft_dir, load_dflash_config(draft_dir), target)
    assert not kernel_attention(d)  # the target runs no kernels of ours here: the reference attention
    assert kernel_attention(SimpleNamespace(dc=d.dc, target=SimpleNamespace(kernel_modules=3)))
    target.alloc(160)
    d.alloc(160)
    graphs = BlockGraphs(d, graph_cls=EmulatedCapture)
    graphs.kernel_attn = True
    block_rounds_equal_the_reference(target, d, graphs, seed=7, adds=(0, 3, 9))
    assert len(graphs.graphs) == 1  # one capture, replayed at each later start


def block_rounds_equal_the_reference(target, d, graphs, seed: int, adds) -> None:
    """Prime 20 rows, then rounds that commit `adds` more rows each (as after verifies): the
    block graph's logits and drafts at each new start equal the drafter's eager block."""
    ids = torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(seed))
    n = 20
    target.forward(ids[:n], 0)
    d.prime(ids[:n].tolist())
    for add in adds:
        if add:  # rows committed since (as after a verify)
            target.forward(ids[n:n + add], n)
        n += add
        d._ingest(n - 1)
        last, start = int(ids[n - 1]), n - 1
        ref = d.block_logits(last, start, 15).clone()
        out = graphs.logits(last, start, 15)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(graphs.greedy(last, start, 15), ref.argmax(-1))
