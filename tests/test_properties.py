"""Property-based tests (hypothesis) for the pure pieces: the acceptance rule, the partition
function, config.json parsing and the round-log summary. Derandomized and bounded, so a run
is deterministic and fast on two cores."""

from __future__ import annotations

import math
import re
import time
import tracemalloc
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from memra_dist.pipeline.partition import partition
from memra_dist.errors import UserError
from memra_dist.model.config import parse_config
from memra_dist.phase.rounds_log import SPEC_PROF_ROUNDS, RoundProf, RoundsLog
from memra_dist.specdec.accept import BONUS, RECOVERED, accept_greedy, accept_sampled

FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])

# ---- acceptance rule --------------------------------------------------------------------


@st.composite
def greedy_round(draw):
    v = draw(st.integers(2, 12))
    k = draw(st.integers(0, 8))
    preds = draw(st.lists(st.integers(0, v - 1), min_size=k + 1, max_size=k + 1))
    # drafts agree with the target's argmax for a drawn prefix, then anything
    agree = draw(st.integers(0, k))
    tail = draw(st.lists(st.integers(0, v - 1), min_size=k - agree, max_size=k - agree))
    drafts = preds[:agree] + tail
    logits = torch.randn(k + 1, v, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    logits[torch.arange(k + 1), torch.tensor(preds)] = 100.0  # a strict argmax per row
    return logits, torch.tensor(drafts, dtype=torch.long), preds


@FAST
@given(greedy_round())
def test_greedy_j_is_the_longest_matching_prefix(case):
    logits, drafts, preds = case
    k = drafts.shape[0]
    j, nxt = accept_greedy(logits, drafts)
    assert 0 <= j <= k
    want = 0
    while want < k and int(drafts[want]) == preds[want]:
        want += 1
    assert j == want
    assert nxt == preds[j]  # the recovered (j < k) or bonus (j == k) token is row j's argmax


def _dist(draw, v, sparse=True):
    one = st.floats(0.01, 1.0)
    w = draw(st.lists(st.just(0.0) | one if sparse else one, min_size=v, max_size=v))
    if sum(w) <= 0:
        w[0] = 1.0
    t = torch.tensor(w, dtype=torch.float32)
    return t / t.sum()


@st.composite
def sampled_round(draw):
    v = draw(st.integers(2, 8))
    k = draw(st.integers(0, 5))
    p = torch.stack([_dist(draw, v) for _ in range(k + 1)])
    with_q = draw(st.booleans())
    q = torch.stack([_dist(draw, v) for _ in range(k)]) if with_q and k else None
    if q is not None:  # drafts are samples of q: only tokens q gives mass
        drafts = [draw(st.sampled_from([i for i in range(v) if q[r, i] > 0])) for r in range(k)]
    else:
        drafts = draw(st.lists(st.integers(0, v - 1), min_size=k, max_size=k))
    return p, q, torch.tensor(drafts, dtype=torch.long), draw(st.integers(0, 2**16))


@FAST
@given(sampled_round())
def test_sampled_invariants(case):
    p, q, drafts, seed = case
    k = drafts.shape[0]
    j, nxt, kind = accept_sampled(p, q, drafts, torch.Generator().manual_seed(seed))
    assert 0 <= j <= k
    assert kind == (BONUS if j == k else RECOVERED)
    assert 0 <= nxt < p.shape[1]
    assert p[j, nxt] > 0  # never a token the target rules out
    for i in range(j):  # every accepted draft had target mass
        assert p[i, drafts[i]] > 0
    if kind == RECOVERED and q is None and p[j].sum() - p[j, drafts[j]] > 0:
        assert nxt != int(drafts[j])  # a one-hot draft is never recovered as itself
    # the same generator state gives the same answer (randomness is passed in)
    assert accept_sampled(p, q, drafts, torch.Generator().manual_seed(seed)) == (j, nxt, kind)


@st.composite
def small_pq(draw):
    v = draw(st.integers(2, 4))
    return _dist(draw, v, sparse=False), _dist(draw, v, sparse=False), draw(st.booleans())


@SLOW
@given(small_pq())
def test_sampled_first_token_follows_p(case):
    """K = 1: the first committed token (the accepted draft, or the recovered one) is a
    sample of p whatever q is. N draws, total variation within 5 standard errors."""
    p0, q0, one_hot = case
    v, n = p0.shape[0], 3000
    gen = torch.Generator().manual_seed(1234)
    p = torch.stack([p0, p0])  # (K+1, V); row 1 is the bonus row, unused here
    counts = torch.zeros(v)
    for _ in range(n):
        d = int(torch.multinomial(q0, 1, generator=gen))
        j, nxt, _ = accept_sampled(p, None if one_hot else q0[None], torch.tensor([d]), gen)
        counts[d if j == 1 else nxt] += 1
    emp = counts / n
    # one-hot (a deterministic drafter): accept d w.p. p(d), else draw from p without d; then
    # P(x) = q(x) p(x) + sum_{d != x} q(d) p(x) = p(x) for any rule choosing d
    tv = 0.5 * (emp - p0).abs().sum().item()
    assert tv < 5 * math.sqrt(v / n) / 2 + 0.01, (emp.tolist(), p0.tolist(), tv)


# ---- partition ------------------------------------------------------------------------


@st.composite
def layers_stages(draw):
    n = draw(st.integers(1, 200))
    return n, draw(st.integers(1, n))


def _assert_partition(ranges, n, s):
    assert len(ranges) == s
    assert ranges[0][0] == 0 and ranges[-1][1] == n  # cover
    for (a, b), (c, _d) in zip(ranges, ranges[1:]):
        assert b == c  # contiguous
    assert all(b > a for a, b in ranges)  # non-empty


@FAST
@given(layers_stages())
def test_partition_even(ns):
    n, s = ns
    r = partition(n, s)
    _assert_partition(r, n, s)
    sizes = [b - a for a, b in r]
    assert max(sizes) - min(sizes) <= 1  # balanced within one layer
    assert sizes == sorted(sizes, reverse=True)  # the earlier stages take the extra layers


@FAST
@given(st.data())
def test_partition_explicit_bounds(data):
    n = data.draw(st.integers(2, 120))
    s = data.draw(st.integers(2, min(n, 12)))
    bounds = tuple(sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=s - 1, max_size=s - 1))))
    r = partition(n, s, bounds)
    _assert_partition(r, n, s)
    assert tuple(a for a, _ in r[1:]) == bounds


@FAST
@given(st.integers(-3, 60), st.integers(-3, 60), st.one_of(st.none(), st.lists(st.integers(-5, 70), max_size=6)))
def test_partition_refuses_with_user_error_only(n, s, bounds):
    b = tuple(bounds) if bounds is not None else None
    try:
        r = partition(n, s, b)
    except UserError:
        return
    _assert_partition(r, n, s)


# ---- config.json parsing --------------------------------------------------------------

_BASE = {"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 128, "intermediate_size": 64,
         "num_hidden_layers": 4}


@st.composite
def valid_config(draw):
    heads = draw(st.integers(1, 16))
    kv = draw(st.sampled_from([h for h in range(1, heads + 1) if heads % h == 0]))
    hd = draw(st.sampled_from([8, 16, 32, 64]))
    d = {"model_type": draw(st.sampled_from(["llama", "qwen2", "qwen3"])), "hidden_size": heads * hd,
         "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": draw(st.integers(2, 200_000)),
         "intermediate_size": draw(st.integers(1, 50_000)), "num_hidden_layers": draw(st.integers(1, 128)),
         "max_position_embeddings": draw(st.integers(2, 1 << 20))}
    if draw(st.booleans()):
        d["rms_norm_eps"] = draw(st.floats(1e-8, 1e-3))
    if draw(st.booleans()):
        d["rope_theta"] = draw(st.floats(1.0, 1e7))
    if draw(st.booleans()):
        d["eos_token_id"] = draw(st.one_of(st.integers(0, 100), st.lists(st.integers(0, 100), max_size=3)))
    if draw(st.booleans()):
        d["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}
    if draw(st.booleans()):
        d["tie_word_embeddings"] = draw(st.booleans())
    d.update(draw(st.dictionaries(st.text("xyz_", min_size=1, max_size=6), st.integers(), max_size=3)))  # unknown keys
    return d


@FAST
@given(valid_config())
def test_valid_configs_parse(d):
    c = parse_config(d)
    assert c.arch == d["model_type"] and c.hidden_size == d["hidden_size"]
    assert c.num_layers == d["num_hidden_layers"] and c.num_kv_heads == d["num_key_value_heads"]
    assert c.head_dim * c.num_heads == c.hidden_size
    assert c.vocab_size == d["vocab_size"]


_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
# sizes near and far past the limits: the values that once built per-layer lists of 10^8+ entries
_HUGE = st.sampled_from([10**8, 2**31, 2**40, 2**63, 2**70, -(2**40), 0, -1]) | st.integers(1 << 12, 1 << 64)
_KEYS = ["model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
         "intermediate_size", "num_hidden_layers", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
         "eos_token_id", "max_position_embeddings", "attention_bias", "tie_word_embeddings"]
_KIMI_BASE = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128,
              "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 4, "kv_lora_rank": 16,
              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "num_experts": 8,
              "num_experts_per_token": 2, "num_expert_group": 2, "topk_group": 1, "num_shared_experts": 1,
              "linear_attn_config": {"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4,
                                     "kda_layers": [1, 3, 4], "full_attn_layers": [2]}}
_KIMI_KEYS = _KEYS + ["moe_intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                      "v_head_dim", "num_experts", "num_experts_per_token", "num_expert_group", "topk_group",
                      "num_shared_experts", "first_k_dense_replace", "linear_attn_config", "layer_types",
                      "mlp_layer_types", "model_max_length"]
# parsing one config: time per example (hypothesis deadline) and Python allocations (tracemalloc)
PARSE_DEADLINE = timedelta(seconds=1)
PARSE_PEAK_BYTES = 16 << 20


@st.composite
def junk_config(draw):
    kind = draw(st.integers(0, 2))
    if kind == 0:  # not even an object
        return draw(_JUNK)
    arch = draw(st.sampled_from(["llama", "qwen2", "qwen3", "kimi_linear"]))
    kimi = arch == "kimi_linear" and draw(st.booleans())  # half the kimi cases start complete
    d = dict(_KIMI_BASE if kimi else _BASE, model_type=arch)
    for key in draw(st.lists(st.sampled_from(_KIMI_KEYS if kimi else _KEYS), min_size=1, max_size=4, unique=True)):
        how = draw(st.integers(0, 2))
        if how == 0:
            d[key] = draw(_JUNK)
        elif how == 1:
            d[key] = draw(_HUGE)
        else:
            d.pop(key, None)
    return d


def _parse_bounded(d):
    """parse_config(d) under tracemalloc: (the config or the UserError, peak bytes)."""
    tracemalloc.start()
    try:
        try:
            got = parse_config(d, where="junk")
        except UserError as e:
            got = e
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


_K = dict(_KIMI_BASE, model_type="kimi_linear")
HUGE_EXAMPLES = [dict(_K, num_hidden_layers=10**8), dict(_K, num_hidden_layers=2**40),
                 dict(_BASE, model_type="kimi_linear", num_hidden_layers=2**40),
                 dict(_BASE, model_type="llama", num_hidden_layers=2**40), dict(_K, vocab_size=2**40),
                 dict(_BASE, model_type="qwen2", vocab_size=10**12), dict(_K, num_experts=2**40),
                 dict(_K, layer_types=["linear_attention"] * 2**10), dict(_K, first_k_dense_replace=2**40),
                 dict(_K, linear_attn_config={"num_heads": 2**40, "head_dim": 8})]


@settings(max_examples=400, deadline=PARSE_DEADLINE, derandomize=True, database=None)
@given(junk_config())
@example(HUGE_EXAMPLES[0])
@example(HUGE_EXAMPLES[1])
@example(HUGE_EXAMPLES[4])
def test_junk_configs_raise_user_error_only(d):
    got, peak = _parse_bounded(d)
    assert peak < PARSE_PEAK_BYTES, f"parsing allocated {peak} bytes"
    if isinstance(got, UserError):
        assert "\n" not in str(got) and str(got)
        return
    # whatever parses is usable: positive sizes
    c = got
    assert c.hidden_size > 0 and c.num_heads > 0 and c.num_layers > 0 and c.vocab_size > 0 and c.head_dim > 0


@pytest.mark.parametrize("d", HUGE_EXAMPLES, ids=range(len(HUGE_EXAMPLES)))
def test_huge_sizes_raise_user_error_fast(d):
    t0 = time.perf_counter()
    got, peak = _parse_bounded(d)
    wall = time.perf_counter() - t0
    assert isinstance(got, UserError), got
    assert "\n" not in str(got)
    assert wall < 0.5 and peak < PARSE_PEAK_BYTES, (wall, peak)


# ---- round-log summary ----------------------------------------------------------------

_ROUND = st.builds(
    lambda wall, split, k, jfrac, ctx, seq: RoundProf(wall, wall * split[0], wall * split[1], wall * split[2],
                                                      wall * split[3], k, min(k, int(k * jfrac)), ctx, seq),
    st.floats(0.001, 500.0),
    st.tuples(*[st.floats(0.0, 0.25)] * 4),
    st.integers(0, 16), st.floats(0.0, 1.0), st.integers(1, 4096), st.integers(0, 64))


def _field(s, name):
    return float(re.search(rf"(?:^| ){re.escape(name)}=([-0-9.]+)", s).group(1))


@FAST
@given(st.lists(_ROUND, max_size=SPEC_PROF_ROUNDS + 20))
def test_rounds_summary_invariants(rows):
    log = RoundsLog()
    for r in rows:
        log.push(r)
    kept = rows[:SPEC_PROF_ROUNDS]
    s = log.summary()
    if not kept:
        assert s == "rounds=0"
        return
    n = len(kept)
    assert _field(s, "rounds") == n
    slow = int(re.search(r"slow_rounds\(>1\.5x med\)=(\d+)", s).group(1))
    assert 0 <= slow <= n - 1  # the median itself (and everything below it) is never slow
    mn, med, mx = _field(s, "min"), _field(s, "med"), _field(s, "max")
    assert mn <= med <= mx
    mean = _field(s, "mean")
    assert mn - 0.05 <= mean <= mx + 0.05
    acc = _field(s, "accept")
    assert 0.0 <= acc <= 1.0
    k = sum(r.k for r in kept)
    j = sum(r.j for r in kept)
    assert acc == pytest.approx(j / k if k else 0.0, abs=1e-3)
    assert _field(s, "tok_per_round") == pytest.approx((j + n) / n, abs=5e-3)
    assert _field(s, "seq_rows_total") == sum(r.seq_rows for r in kept)
    assert _field(s, "ctx_first") == kept[0].ctx and _field(s, "ctx_last") == kept[-1].ctx
