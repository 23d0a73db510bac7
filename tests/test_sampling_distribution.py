"""Sampled speculative decoding follows the target distribution.

Statistical tests with fixed seeds (so they are deterministic) and a stated tolerance: a
Pearson chi-square goodness-of-fit test at significance 1e-3 (bins with an expected count
below 5 pooled), plus a total-variation bound. A negative control runs the same test on a
deliberately broken acceptance rule and requires it to FAIL, so the test has power.
"""

from __future__ import annotations

import math

import pytest
import torch

from memra_dist.runner import ModelRunner
from memra_dist.specdec import session as session_mod
from memra_dist.specdec.accept import BONUS, accept_sampled
from memra_dist.specdec.drafters import ModelDrafter, ReplayDrafter
from memra_dist.specdec.sampling import SamplingParams, probs
from memra_dist.specdec.session import SpecSession

ALPHA_Z = 3.090  # standard normal quantile for alpha = 1e-3 (one-sided)
CPU, F32 = torch.device("cpu"), torch.float32
TINY = dict(vocab_size=16, num_hidden_layers=2, hidden_size=16, intermediate_size=32,
            num_attention_heads=2, num_key_value_heads=1)
PROMPT = [3, 7, 1, 12, 5]


def chi2_critical(df: int, z: float = ALPHA_Z) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (accurate to ~1% for df >= 3)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, pooling bins with expected count < 5."""
    n = float(counts.sum())
    exp = expected_p.double() * n
    obs = counts.double()
    small = exp < 5
    bins_e = list(exp[~small])
    bins_o = list(obs[~small])
    if small.any():
        bins_e.append(exp[small].sum())
        bins_o.append(obs[small].sum())
    e, o = torch.stack(bins_e), torch.stack(bins_o)
    keep = e > 0
    assert float(o[~keep].sum()) == 0, "a token of target probability 0 was sampled"
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    return stat, int(keep.sum()) - 1


def assert_matches(counts: torch.Tensor, p: torch.Tensor, what: str, tv_tol: float) -> None:
    stat, df = chi2_stat(counts, p)
    crit = chi2_critical(df)
    tv = 0.5 * float((counts.double() / counts.sum() - p.double()).abs().sum())
    assert stat < crit and tv < tv_tol, f"{what}: chi2={stat:.1f} (df={df}, crit={crit:.1f}) tv={tv:.4f}"


def mismatch(counts: torch.Tensor, p: torch.Tensor) -> bool:
    stat, df = chi2_stat(counts, p)
    return stat > chi2_critical(df)


# ---- the pure rejection sampler against an adversarial draft distribution ----

P_ROWS = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.20],
                       [0.50, 0.00, 0.10, 0.10, 0.30],
                       [0.20, 0.20, 0.20, 0.20, 0.20]])
Q_ADV = torch.tensor([[0.70, 0.00, 0.30, 0.00, 0.00],  # mass where p is small, none where p is big
                      [0.00, 0.90, 0.00, 0.10, 0.00]])  # mostly a token p never emits


def _simulate(q: torch.Tensor | None, n: int, accept=accept_sampled):
    """Committed token at position 0, and at position 1 given the round reached it."""
    g = torch.Generator().manual_seed(1234)
    first = torch.zeros(5, dtype=torch.long)
    second = torch.zeros(5, dtype=torch.long)
    for _ in range(n):
        if q is not None:
            d = torch.multinomial(q, 1, generator=g)[:, 0]
        else:
            d = torch.tensor([1, 0])  # a deterministic drafter's proposal
        j, nxt, _ = accept(P_ROWS, q, d, g)
        toks = d[:j].tolist() + [nxt]
        first[toks[0]] += 1
        if len(toks) >= 2:
            second[toks[1]] += 1
    return first, second


@pytest.mark.parametrize("q", [Q_ADV, None], ids=["adversarial-q", "one-hot-q"])
def test_rejection_sampler_output_is_p(q):
    first, second = _simulate(q, 12000)
    assert_matches(first, P_ROWS[0], "position 0", tv_tol=0.03)
    assert int(second.sum()) > 1000
    assert_matches(second, P_ROWS[1], "position 1 | reached", tv_tol=0.04)


def test_rejection_sampler_test_has_power():
    """Accepting every draft (no correction) samples from q, and the test notices."""

    def accept_all(p, q, drafts, gen):
        k = drafts.shape[0]
        return k, int(torch.multinomial(p[k], 1, generator=gen)), BONUS

    first, _ = _simulate(Q_ADV, 3000, accept=accept_all)
    assert mismatch(first, P_ROWS[0])


# ---- whole speculative sessions on a vocabulary-16 checkpoint ----


@pytest.fixture(scope="module")
def tiny_pair(ckpt_factory):
    target_dir, target_hf = ckpt_factory("llama", seed=3, **TINY)
    draft_dir, _ = ckpt_factory("llama", seed=4, **{**TINY, "num_hidden_layers": 1})
    return target_dir, target_hf, draft_dir


def exact_marginals(hf_model, sp: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's exact marginals of generated tokens 1, 2 and 3 under `sp` (transformers'
    logits, memra's filtering): enumerate every prefix (16 and 256 sequences)."""
    V = TINY["vocab_size"]
    base = torch.tensor(PROMPT)
    with torch.no_grad():
        p1 = probs(hf_model(base[None]).logits[0, -1:], sp)[0]  # (V,)
        seq2 = torch.cat([base.expand(V, -1), torch.arange(V)[:, None]], 1)  # (V, L+1)
        p2_given = probs(hf_model(seq2).logits[:, -1], sp)  # (V, V): row t1
        a, b = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
        seq3 = torch.cat([base.expand(V * V, -1), a.reshape(-1, 1), b.reshape(-1, 1)], 1)
        p3_given = probs(hf_model(seq3).logits[:, -1], sp).view(V, V, V)  # (t1, t2, t3)
    joint12 = p1[:, None] * p2_given  # (V, V)
    m2 = joint12.sum(0)
    m3 = (joint12[:, :, None] * p3_given).sum((0, 1))
    return p1, m2, m3


def sample_first_tokens(target: ModelRunner, drafter, sp: SamplingParams, k: int, n: int):
    """Counts of generated tokens 1..3 over n seeded sessions (the anchor, then speculative
    rounds; rounds are run one at a time until three tokens exist). `drafter`: one for every
    session, or a function of the session's seed that makes its own."""
    V = TINY["vocab_size"]
    counts = torch.zeros(3, V, dtype=torch.long)
    cap = len(PROMPT) + 8 + k
    stats = {"drafted": 0, "accepted": 0}
    for seed in range(n):
        d = drafter(seed) if callable(drafter) else drafter
        s = SpecSession(target, d, sp, torch.Generator().manual_seed(seed), k)
        out = [s.start(PROMPT, 3 + k, cap)]
        while len(out) < 3:
            out += s.burst(1)
        for i in range(3):
            counts[i, out[i]] += 1
        stats["drafted"] += s.stats.drafted
        stats["accepted"] += s.stats.accepted
    return counts, stats


def _runner(d, cap=64):
    return ModelRunner(d, CPU, F32, max_pos=cap)


@pytest.mark.slow  # 1000 sampled sessions per case
@pytest.mark.parametrize("drafter_name, sp", [
    ("model", SamplingParams(temperature=1.0)),
    ("replay", SamplingParams(temperature=0.8, top_k=10)),
])
def test_speculative_samples_follow_target(tiny_pair, drafter_name, sp):
    target_dir, hf, draft_dir = tiny_pair
    target = _runner(target_dir)
    k = 3
    if drafter_name == "model":
        drafter = ModelDrafter(_runner(draft_dir))
    else:  # a recorded greedy continuation, half of it corrupted (each session its own positions: a
        # replay draws each position's draft once, so one replay for all would draft alike in each)
        rec = [int(x) for x in hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12,
                                           attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))[0, len(PROMPT):]]

        def drafter(seed):
            return ReplayDrafter(rec, len(PROMPT), TINY["vocab_size"], corrupt=0.5, seed=7 + seed)
    m1, m2, m3 = exact_marginals(hf, sp)
    assert float(m2.max()) < 0.6, "the target is too peaked for a meaningful test"
    counts, st = sample_first_tokens(target, drafter, sp, k, 1000)
    # the speculative path was really exercised, with many accepts and many rejects
    assert st["accepted"] >= 100 and st["drafted"] - st["accepted"] >= 100, st
    assert_matches(counts[0], m1, "token 1 (anchor)", tv_tol=0.08)
    assert_matches(counts[1], m2, "token 2", tv_tol=0.08)
    assert_matches(counts[2], m3, "token 3", tv_tol=0.08)


@pytest.mark.slow  # 400 sampled sessions
def test_session_distribution_test_has_power(tiny_pair, monkeypatch):
    """The same session test with acceptance replaced by 'accept every draft' must fail:
    the outputs then follow the draft model, not the target."""
    target_dir, hf, draft_dir = tiny_pair

    def accept_all(p, q, drafts, gen):
        k = drafts.shape[0]
        return k, int(torch.multinomial(p[k], 1, generator=gen)), BONUS

    monkeypatch.setattr(session_mod, "accept_sampled", accept_all)
    sp = SamplingParams(temperature=1.0)
    counts, _ = sample_first_tokens(_runner(target_dir), ModelDrafter(_runner(draft_dir)), sp, 3, 400)
    _, m2, _ = exact_marginals(hf, sp)
    assert mismatch(counts[1], m2)


def _auto_batched_counts(target_dir, sp: SamplingParams, n: int, max_batch: int = 8):
    """Counts of generated tokens 1..3 over n seeded requests of PROMPT (8 tokens each) on ONE
    batched engine with --spec-k auto (the replay drafter, half corrupted) -> (counts, stats)."""
    import threading

    from memra_dist.app import open_engine
    from memra_dist.config import RunConfig
    from memra_dist.specdec.spec_k import StepCost

    V = TINY["vocab_size"]

    def cfg(seed):
        return RunConfig(model=str(target_dir), drafter="replay", k=3, device="cpu", dtype="fp32", sampling=sp,
                         seed=seed, max_new_tokens=8, spec_k="auto", replay_corrupt=0.5)

    counts = torch.zeros(3, V, dtype=torch.long)
    outs: dict[int, list[int]] = {}
    with open_engine(cfg(0), capacity=len(PROMPT) + 8, max_batch=max_batch) as eng:
        b = eng._backend.batcher
        assert b.auto_k
        # a row costs about a quarter of a step's base: a draft pays only where the request's running
        # acceptance is high, so requests get K 0 or K > 0 by their own acceptance
        b.cost = StepCost(prior_ns=(20e6, 4.6e6), prior_steps=1e9)
        todo = list(range(n))
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                outs[i] = eng.generate(PROMPT, cfg(i)).token_ids

        threads = [threading.Thread(target=worker) for _ in range(max_batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        stats = eng.batch_stats()
    for out in outs.values():
        for i in range(3):  # (the first three: their marginals are the target's whatever follows)
            counts[i, out[i]] += 1
    return counts, stats


@pytest.mark.slow  # 800 sampled requests through a batched engine
def test_auto_k_batched_samples_follow_target(tiny_pair, tmp_path, monkeypatch):
    """--spec-k auto choosing for sampled requests too (`CHOOSE_SAMPLED`: off by default, so a
    seeded request's output never depends on the load), batched 8 at a time: each round's K is
    chosen per request and step (several values, 0 among them), the drafts accepted by rejection
    sampling with each request's own generator, and the generated tokens still follow the
    target's exact marginals."""
    import json
    import shutil

    import memra_dist.batching.loop_rounds as lr

    monkeypatch.setattr(lr, "CHOOSE_SAMPLED", True)

    target_dir, hf, _ = tiny_pair
    free = shutil.copytree(target_dir, tmp_path / "no-eos")  # no token ends a request: every one gives 8
    conf = json.loads((free / "config.json").read_text())
    conf["eos_token_id"] = None
    (free / "config.json").write_text(json.dumps(conf))
    sp = SamplingParams(temperature=0.8, top_k=10)
    m1, m2, m3 = exact_marginals(hf, sp)
    counts, st = _auto_batched_counts(free, sp, 800)
    assert int(counts[0].sum()) == 800
    ks = {int(k): n for k, n in st["k_chosen"].items()}
    assert len(ks) >= 2 and sum(n for k, n in ks.items() if k > 0) >= 100, ks
    assert_matches(counts[0], m1, "token 1 (anchor)", tv_tol=0.08)
    assert_matches(counts[1], m2, "token 2", tv_tol=0.08)
    assert_matches(counts[2], m3, "token 3", tv_tol=0.08)
