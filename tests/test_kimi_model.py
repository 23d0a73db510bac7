"""kimi_linear against transformers' KimiLinearForCausalLM (tiny random checkpoints, fp32, CPU).

The reference runs on CPU through its torch fallbacks (causal_conv1d_fn / chunk_kda without
fla), always over the full sequence with use_cache=False.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from memra_dist.runner import ModelRunner  # noqa: E402
from memra_dist.errors import UserError  # noqa: E402
from memra_dist.model import kda as kda_mod  # noqa: E402
from memra_dist.model import mla as mla_mod  # noqa: E402
from memra_dist.model.config import parse_config  # noqa: E402
from memra_dist.model.kimi_config import KimiSpec  # noqa: E402
from memra_dist.model.kda import KDA, KDAState, kda_chunked, kda_recurrent, l2norm  # noqa: E402
from memra_dist.model.mla import MLA  # noqa: E402
from memra_dist.model.moe import MoE  # noqa: E402
from memra_dist.phase.subsplit import SubsplitTimer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

CPU, ATOL, V = torch.device("cpu"), 1e-4, 97

# name -> (kda_layers, full_attn_layers (1-indexed), shared experts, first_k_dense_replace, q_lora_rank)
CASES = {
    "kda_only": ([1, 2], [], 1, 1, None),
    "mla_only": ([], [1, 2], 1, 1, None),
    "kda3_mla1": ([1, 2, 3], [4], 1, 1, None),
    "kda3_mla1_no_shared": ([1, 2, 3], [4], 0, 1, None),
    "mixed_qlora_2dense": ([1, 3], [2], 2, 2, 8),
}


def _hf_config(kda, full, shared, dense, q_lora) -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=len(kda) + len(full), num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=q_lora, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
        num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=shared,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.15,
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": kda, "full_attn_layers": full},
        first_k_dense_replace=dense,
    )


@functools.lru_cache(maxsize=None)
def checkpoint(name: str):
    """(reference model, checkpoint dir, ids (20,), reference logits (20, V)) for a case."""
    torch.manual_seed(0)
    m = KimiLinearForCausalLM(_hf_config(*CASES[name])).float().eval()
    for n, b in m.named_buffers():  # a non-zero correction bias, so routing depends on it
        if n.endswith("e_score_correction_bias"):
            b.normal_(0, 0.1)
    d = tempfile.mkdtemp(prefix=f"kimi_{name}_")
    m.save_pretrained(d, save_original_format=False)  # the in-memory names (see kimi_config.py)
    ids = torch.randint(3, V, (20,))
    with torch.no_grad():
        ref = m(ids[None], use_cache=False).logits[0].float()
    return m, d, ids, ref


def runner(name: str, capacity: int = 64) -> ModelRunner:
    r = ModelRunner(checkpoint(name)[1], CPU, torch.float32)
    r.alloc(capacity)
    return r


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    err = (a - b).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} > {atol}"


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("name", CASES)
def test_prefill_matches_reference(name):
    _, _, ids, ref = checkpoint(name)
    close(runner(name).forward(ids[:12], 0), ref[:12])


@pytest.mark.parametrize("name", CASES)
def test_step_by_step_matches_reference(name):
    _, _, ids, ref = checkpoint(name)
    r = runner(name)
    close(r.forward(ids[:8], 0), ref[:8])
    for i in range(8, 12):
        close(r.forward(ids[i:i + 1], i), ref[i:i + 1])


@pytest.mark.parametrize("name", CASES)
def test_verify_rows_match_reference(name):
    _, _, ids, ref = checkpoint(name)
    r = runner(name)
    r.forward(ids[:8], 0)
    close(r.forward(ids[8:13], 8), ref[8:13])


def test_layer_dispatch():
    r = runner("mixed_qlora_2dense")
    blocks = [r.stage.layers[str(i)] for i in range(3)]
    assert [type(b.self_attn) for b in blocks] == [KDA, MLA, KDA]
    assert [type(b.mlp).__name__ for b in blocks] == ["SwiGLU", "SwiGLU", "MoE"]
    assert isinstance(blocks[2].mlp, MoE) and blocks[2].mlp.gate.weight.dtype == torch.float32


def test_chunked_prefill_and_expanded_mla_arm(monkeypatch):
    """Force the chunked KDA head (+ recurrent snapshot tail) and the expanded MLA arm."""
    monkeypatch.setattr(kda_mod, "RECURRENT_MAX_ROWS", 4)
    monkeypatch.setattr(mla_mod, "ABSORB_MAX_ROWS", 0)
    _, _, ids, ref = checkpoint("kda3_mla1")
    r = runner("kda3_mla1")
    close(r.forward(ids[:12], 0), ref[:12])
    close(r.forward(ids[12:15], 12), ref[12:15])
    r.rollback(13)  # inside the 4-row snapshot tail of the last forward
    close(r.forward(ids[13:20], 13), ref[13:20])


def test_no_cache_path_matches_reference(monkeypatch):
    """Stage without a cache (reference / training path); 20 rows > RECURRENT_MAX_ROWS: chunked."""
    monkeypatch.setattr(kda_mod, "RECURRENT_MAX_ROWS", 16)
    _, _, ids, ref = checkpoint("kda3_mla1")
    st = runner("kda3_mla1").stage
    with torch.no_grad():
        h = st(ids, torch.arange(20), None)
    close(st.logits(h), ref)


# ---------------------------------------------------------------- KDA scan forms and rollback


def _scan_inputs(T: int, H: int = 3, D: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k = l2norm(r(T, H, D)) * D ** -0.5, l2norm(r(T, H, D))
    v, beta = r(T, H, D), torch.rand(T, H, generator=g)
    gate = -torch.rand(T, H, D, generator=g) * 2.0  # per-channel log decay in [-2, 0]
    return q, k, v, gate, beta, r(H, D, D)


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_chunked_equals_recurrent(chunk):
    q, k, v, g, beta, S0 = _scan_inputs(37)
    snaps = torch.empty(38, *S0.shape)
    o_r, S_r = kda_recurrent(q, k, v, g, beta, S0, snaps)
    o_c, S_c = kda_chunked(q, k, v, g, beta, S0, chunk=chunk)
    close(o_c, o_r, 1e-5)
    close(S_c, S_r, 1e-5)
    close(snaps[0], S0, 0.0)
    close(snaps[-1], S_r, 0.0)
    # snapshot t is the state a scan of the first t rows ends in
    close(kda_chunked(q[:11], k[:11], v[:11], g[:11], beta[:11], S0, chunk=chunk)[1], snaps[11], 1e-5)


def _kda_states(r: ModelRunner) -> dict[int, KDAState]:
    return {i: s for i, s in r.cache.layers.items() if isinstance(s, KDAState)}


@pytest.mark.parametrize("P", [7, 40])
def test_kda_rollback_restores_state(P):
    """Prefill P, verify 5, roll back to P+2: state == a fresh prefill of P+2 tokens, and the
    next forward matches the reference. P=40 > RECURRENT_MAX_ROWS: a chunked prefill."""
    m, _, _, _ = checkpoint("kda3_mla1")
    ids = torch.randint(3, V, (P + 8,), generator=torch.Generator().manual_seed(P))
    with torch.no_grad():
        ref = m(ids[None], use_cache=False).logits[0]
    r = runner("kda3_mla1")
    r.forward(ids[:P], 0)
    r.forward(ids[P:P + 5], P)
    r.rollback(P + 5)  # to the end of the last forward: a no-op
    r.rollback(P + 3)
    r.rollback(P + 2)  # a second rollback inside the same snapshot window
    fresh = runner("kda3_mla1")
    fresh.forward(ids[:P + 2], 0)
    got, want = _kda_states(r), _kda_states(fresh)
    assert got and got.keys() == want.keys()
    for i in got:
        assert got[i].length == want[i].length == P + 2
        close(got[i].S, want[i].S, 1e-5)
        close(got[i].conv, want[i].conv, 1e-5)  # raw projections of the same rows
    close(r.forward(ids[P + 2:P + 8], P + 2), ref[P + 2:P + 8])


def test_kda_rollback_limits(monkeypatch):
    monkeypatch.setattr(kda_mod, "RECURRENT_MAX_ROWS", 16)  # a 16-row ring: its limit within 20 ids
    _, _, ids, ref = checkpoint("kda_only")
    r = runner("kda_only")
    r.forward(ids[:8], 0)
    r.forward(ids[8:20], 8)
    with pytest.raises(ValueError, match="cannot roll back"):
        r.rollback(3)  # past the 16-row snapshot ring (lengths [4, 20] restorable)
    # a forward from an earlier row (begin(start < length)) rolls back through the snapshots
    close(r.forward(ids[10:14], 10), ref[10:14])
    r.rollback(0)  # to empty: a reset
    close(r.forward(ids[:4], 0), ref[:4])


@pytest.mark.parametrize("splits", [(8, 20), (20,)])  # two forwards; one prefill with a chunked head
def test_kda_rollback_to_the_lowest_restorable_length(monkeypatch, splits):
    """With an R-row ring, the rows of the latest forwards leave lengths [end - R, end]
    restorable: a rollback to exactly end - R is allowed and restores the state a fresh
    prefill of that many rows ends in; one row lower is refused."""
    R = 16
    monkeypatch.setattr(kda_mod, "RECURRENT_MAX_ROWS", R)
    _, _, ids, ref = checkpoint("kda_only")
    r = runner("kda_only")
    start = 0
    for end in splits:
        r.forward(ids[start:end], start)
        start = end
    lo = start - R
    states = _kda_states(r)
    assert states and all(s.lo == lo for s in states.values())
    with pytest.raises(ValueError, match="cannot roll back"):
        r.rollback(lo - 1)
    r.rollback(lo)
    assert r.length == lo
    fresh = runner("kda_only")
    fresh.forward(ids[:lo], 0)
    want = _kda_states(fresh)
    for i, s in states.items():
        assert s.length == want[i].length == lo
        close(s.S, want[i].S, 1e-5)
        close(s.conv, want[i].conv, 1e-5)
    close(r.forward(ids[lo:20], lo), ref[lo:20])


def test_timer_brackets_the_scan():
    _, _, ids, ref = checkpoint("kda3_mla1")
    r = runner("kda3_mla1")
    tm = SubsplitTimer(lambda: None)
    calls = []
    tm.scan_begin, tm.scan_end = (lambda: calls.append("b")), (lambda: calls.append("e"))
    close(r.forward(ids[:6], 0, timer=tm), ref[:6])
    assert calls == ["b", "e"] * 3  # one bracket per KDA layer
    ns, seq_rows = tm.take()
    assert seq_rows == 0 and ns["kda"] > 0 and ns["mla"] > 0 and ns["ffn"] > 0


# ---------------------------------------------------------------- MLA cache, config


def test_mla_caches_latents():
    r = runner("mla_only", capacity=64)
    spec = r.stage.layers["0"].self_attn
    for st in r.cache.layers.values():
        expanded = 64 * spec.nh * (spec.dn + spec.dr + spec.dv) * 4  # K and V rows, fp32
        assert st.nbytes() == 64 * (16 + 8) * 4 < expanded


def _raw(**over):
    d = _hf_config([1, 2, 3], [4], 1, 1, None).to_dict()
    d.update(over)
    return d


def test_config_parsing_and_errors():
    cfg = parse_config(_raw())
    assert (cfg.arch, cfg.num_layers, cfg.head_dim, cfg.vocab_size) == ("kimi_linear", 4, 16, V)
    d = _raw()
    del d["hidden_size"]
    with pytest.raises(UserError, match="hidden_size"):
        parse_config(d)
    with pytest.raises(UserError, match="layer types"):
        parse_config(_raw(layer_types=["linear_attention", "bogus", "linear_attention", "full_attention"]))
    with pytest.raises(UserError, match="num_key_value_heads"):
        parse_config(_raw(num_key_value_heads=2))
    with pytest.raises(UserError, match="malformed"):
        parse_config(_raw(num_experts="many"))
    d = _raw()
    for k in ("layer_types", "mlp_layer_types"):
        d.pop(k)
    d["linear_attn_config"] = {"head_dim": 8, "num_heads": 4}  # no layer lists: HF's default
    d["first_k_dense_replace"] = 2
    spec = KimiSpec.from_config(parse_config(d))
    assert spec.layer_types == ("linear_attention",) * 4
    assert spec.mlp_types == ("dense", "dense", "sparse", "sparse")
