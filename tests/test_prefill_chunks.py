"""Chunked prefill (SpecSession.start runs the prompt in `--prefill-chunk` rows): on CPU, fp32,
strict. Greedy output is token-identical whatever the chunk (1 row, 7, 37, 64, the whole
prompt) and equal to transformers' greedy for every family, and the chunked prefill's
logits equal transformers' at every row; with every tap / model drafter the chunked prime
proposes exactly what the unchunked one does (chunk boundaries that split a DFlash block,
an MTP chain, KDA's internal chunks, the draft model's P - 1 rows) and the output is plain
greedy; `blocked_attention` equals a dense bottom-right-causal reference; the chunk plans
cover the prompt; a 16k-token prompt runs in bounded memory; bad chunk sizes are one line,
exit 2; the first-token profile and its spans report the real chunks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from memra_dist.app import generate
from memra_dist.cli import main
from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.model.prefix_attention import (PREFIX_MIN_ROWS, block_rows, blocked_attention, prefix_arm,
                                               prefix_attention)
from memra_dist.demo.tiny_dflash import random_dflash
from memra_dist.demo.tiny_eagle3 import random_eagle3
from memra_dist.phase.levels import TraceSettings
from memra_dist.phase.report import FanOut
from memra_dist.runner import ModelRunner
from memra_dist.specdec.chunks import DEFAULT_PREFILL_CHUNK, fixed_chunks, pipeline_chunks
from memra_dist.specdec.drafters import ModelDrafter, NgramDrafter, NoDrafter
from memra_dist.specdec.drafters.dflash import DFlashDrafter
from memra_dist.specdec.drafters.eagle3 import Eagle3Drafter
from memra_dist.specdec.drafters.mtp import MTPDrafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession
from memra_dist.tracing.conventions import SPAN_PRIME_CHUNK, ttft_span
from memra_dist.tracing.emit import SpanSink

from conftest import save_hf
from kimi_ckpt import hybrid
from moe_ckpt import save_moe

pytestmark = pytest.mark.filterwarnings("ignore")

CPU, F32 = torch.device("cpu"), torch.float32
N_NEW = 10
_R = torch.randint(3, 128, (90,), generator=torch.Generator().manual_seed(7)).tolist()
PROMPT = _R + _R[20:60]  # 130 tokens; the repeated stretch gives the n-gram drafter matches
P = len(PROMPT)
ATOL = 1e-4
FAMILIES = ["llama", "qwen2", "qwen3", "kimi_linear", "deepseek_v3", "glm4_moe"]
# 1: decode rows; 7: masked chunks only; 37: three prefix chunks (> PREFIX_MIN_ROWS rows) at
# unaligned starts and a masked tail; 64: prefix chunks at 0 and 64, a 2-row masked tail; P: one
CHUNKS = [1, 7, 37, 64, P]
assert 37 > PREFIX_MIN_ROWS >= P % 37 and 64 > PREFIX_MIN_ROWS >= P % 64 and P > 64


# ---- checkpoints (built once per module): family -> (dir, transformers model) ----


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Every family, without an EOS id where the builder takes one (the continuations run their
    full length); deepseek_v3 with two MTP layers, glm4_moe with one. kimi_linear: the
    spec tests' hybrid (3:1 KDA:MLA), whose kimi draft is its first two layers."""
    root = tmp_path_factory.mktemp("prefill_chunks")
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        (root / arch).mkdir()
        out[arch] = save_hf(root / arch, arch, seed=3, eos_token_id=None)
    out["deepseek_v3"] = save_moe(root / "ds", "deepseek_v3", layers=2, n_mtp=2, seed=4, eos_token_id=None)
    out["glm4_moe"] = save_moe(root / "glm", "glm4_moe", layers=2, n_mtp=1, seed=5, eos_token_id=None)
    hf, target, _draft = hybrid()
    out["kimi_linear"] = (target, hf)
    return out


@pytest.fixture(scope="module")
def reference(ckpts):
    """family -> transformers' greedy continuation of PROMPT (N_NEW tokens; kimi_linear by
    full-sequence forwards, as kimi_ckpt.reference_greedy)."""
    refs = {}
    ids = torch.tensor([PROMPT])
    for name, (_d, hf) in ckpts.items():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW,
                              use_cache=name != "kimi_linear")
        refs[name] = out[0, P:].tolist()
        assert len(refs[name]) == N_NEW, (name, refs[name])  # no EOS cut: the comparison is the full length
    return refs


def _cfg(d, chunk: int, **kw) -> RunConfig:
    kw.setdefault("drafter", "none")
    return RunConfig(model=str(d), max_new_tokens=N_NEW, device="cpu", dtype="fp32", prefill_chunk=chunk, **kw)


# ---- 1. plain greedy: every chunk size, every family, equal to transformers ----


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_chunk_independent_and_equals_transformers(ckpts, reference, family):
    d, _hf = ckpts[family]
    outs = {c: generate(_cfg(d, c), PROMPT).token_ids for c in CHUNKS}
    assert outs[P] == reference[family]  # one chunk, the whole prompt
    for c in CHUNKS:
        assert outs[c] == reference[family], (family, c)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_logits_equal_transformers(ckpts, family):
    """Every row's logits of the prompt run chunk by chunk through the runner (KDA's state and
    the caches carried across chunks) equal transformers' full-sequence logits; `last=True`
    is the last row's alone."""
    d, hf = ckpts[family]
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want = hf(ids[None], use_cache=False).logits[0]
    r = ModelRunner(d, CPU, F32, max_pos=P + 8)
    for c in (7, 37, 64, P):
        r.alloc(P + 8)  # the same capacity: the cache starts over
        got = torch.cat([r.forward(ids[lo:hi], lo) for lo, hi in fixed_chunks(P, c)])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{family} chunk {c}: {m}")
        r.alloc(P + 8)
        last = [r.forward(ids[lo:hi], lo, last=True) for lo, hi in fixed_chunks(P, c)]
        assert all(x.shape == (1, want.shape[-1]) for x in last)
        torch.testing.assert_close(last[-1][0], want[-1], atol=ATOL, rtol=0)


def test_one_engine_takes_each_requests_chunk(ckpts, reference):
    """The chunk is a request's setting: one loaded engine primes each request in its own
    chunks (the profile says which), with the same tokens (the prefix cache off: with it, the
    later requests would find the first one's blocks and prefill only the prompt's tail)."""
    from memra_dist.app import open_engine

    d = ckpts["qwen2"][0]
    cfg = _cfg(d, DEFAULT_PREFILL_CHUNK, trace=TraceSettings(level=0, prof=True), prefix_cache=False)
    with open_engine(cfg, capacity=P + 32) as eng:
        for c in (DEFAULT_PREFILL_CHUNK, 37, 7):
            cap = _Capture()
            assert eng.generate(PROMPT, cfg.with_(prefill_chunk=c), sink=cap).token_ids == reference["qwen2"]
            assert cap.prof.prime_chunk_rows == [hi - lo for lo, hi in fixed_chunks(P, c)], c


# ---- 2. speculative drafters: the chunked prime drafts what the unchunked one does ----


@pytest.fixture(scope="module")
def draft_dirs(ckpts, draft_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill_drafts")
    llama = ckpts["llama"][0]
    return {
        # block size 4: chunks 7 / 37 split blocks; 64 rows (> PREFIX_MIN_ROWS) of taps per ingest
        "dflash": random_dflash(root / "dflash", llama, seed=2, layers=2, block_size=4, taps=(0, 2),
                                mask_token_id=1, heads=2, kv_heads=1, head_dim=16, intermediate_size=64),
        "eagle3": random_eagle3(root / "eagle3", llama, seed=2, taps=(0, 1, 3), heads=2, kv_heads=1, head_dim=16,
                                intermediate_size=64, draft_vocab=96),
        "model": draft_llama,
        "kimi": hybrid()[2],
    }


# id -> (target family, drafter, draft dir key, k, chunk sizes besides the whole prompt)
SPEC = {
    "mtp-deepseek": ("deepseek_v3", "mtp", None, 3, [7, 37, 64]),  # two MTP layers, chained past them
    "mtp-glm": ("glm4_moe", "mtp", None, 2, [7, 37]),
    "dflash": ("llama", "dflash", "dflash", 3, [7, 37, 64]),
    "eagle3": ("llama", "eagle3", "eagle3", 3, [7, 37, 64]),
    "model": ("llama", "model", "model", 3, [7, 37, 64, P - 1]),  # P - 1: the draft's rows end on a boundary
    # KDA's chunked form runs the rows before the last 33 of a forward in CHUNK = 64 rows: a
    # 100-row prefill chunk splits that grid (64 + 3 chunked rows, then 33 recurrent)
    "kimi-model": ("kimi_linear", "model", "kimi", 4, [7, 37, 100]),
    "kimi-ngram": ("kimi_linear", "ngram", None, 4, [37, 100]),
}
_CLASSES = {"mtp": MTPDrafter, "dflash": DFlashDrafter, "eagle3": Eagle3Drafter, "model": ModelDrafter,
            "ngram": NgramDrafter}


def _spec_run(monkeypatch, cfg: RunConfig) -> tuple[list[int], list, dict]:
    """(tokens, every round's (context length, drafted ids), stats) of one public-path run.
    A tap drafter's rounds are the engine loop's (batching/chain.py): their drafts come from the
    shared draft forward, read as each round is settled; a host or draft-model drafter's from
    its own `propose`."""
    from memra_dist.batching.chain import Chain

    seen = []
    with monkeypatch.context() as mp:
        if cfg.drafter in ("dflash", "eagle3", "mtp"):
            real_settle = Chain.settle

            def settle(self, job):
                n = len(self.tokens)
                out = real_settle(self, job)
                if self._drafts:
                    seen.append((n, list(self._drafts)))
                return out

            mp.setattr(Chain, "settle", settle)
        else:
            cls = _CLASSES[cfg.drafter]
            real = cls.propose

            def spy(self, context, k, sp, gen):
                p = real(self, context, k, sp, gen)
                seen.append((len(context), p.tokens.tolist()))
                return p

            mp.setattr(cls, "propose", spy)
        res = generate(cfg, PROMPT)
    return res.token_ids, seen, res.stats


@pytest.mark.parametrize("case", list(SPEC))
def test_spec_chunked_prime_drafts_the_same_and_output_is_plain_greedy(ckpts, reference, draft_dirs, monkeypatch,
                                                                       case):
    family, drafter, ddir, k, chunks = SPEC[case]
    d = ckpts[family][0]
    # fixed K: --spec-k auto's choice follows the measured step times, which differ run to run
    kw = dict(drafter=drafter, k=k, draft_model=str(draft_dirs[ddir]) if ddir else None, spec_k="fixed")
    toks, drafts, stats = _spec_run(monkeypatch, _cfg(d, DEFAULT_PREFILL_CHUNK, **kw))  # one chunk
    assert toks == reference[family]
    assert stats["drafted"] > 0 and drafts
    for c in chunks:
        assert len(fixed_chunks(P, c)) >= 2
        got, got_drafts, got_stats = _spec_run(monkeypatch, _cfg(d, c, **kw))
        assert got == reference[family], (case, c)
        assert got_drafts == drafts, (case, c)  # the drafter's state after the chunked prime is the same
        assert (got_stats["drafted"], got_stats["accepted"]) == (stats["drafted"], stats["accepted"]), (case, c)


def test_eagle3_prime_chunk_rows_equal_one_chunk(ckpts, draft_dirs):
    """EAGLE-3's prime keeps only its K/V (the drafts above cannot see its rows' outputs), so
    its prefix-attention arm is checked here: each prime row's output is the same whether
    the rows ran as one chunk, as chunks over a prefix (> PREFIX_MIN_ROWS rows, lo > 0) or
    as small masked chunks."""
    from memra_dist.model.config import load_config
    from memra_dist.model.eagle3 import load_eagle3_config

    llama, edir = ckpts["llama"][0], draft_dirs["eagle3"]
    target = ModelRunner(llama, CPU, F32, max_pos=P + 8)
    d = Eagle3Drafter.load(edir, load_eagle3_config(edir, load_config(llama)), target)
    target.alloc(P + 8)
    target.forward(torch.tensor(PROMPT), 0)  # the taps of every prompt row

    def rows(chunks):
        d.alloc(P + 8)
        return torch.cat([d._commit_rows(PROMPT, lo, hi) for lo, hi in chunks])

    n = P - 1
    want = rows([(0, n)])
    for c in (64, 37, 7):
        torch.testing.assert_close(rows(fixed_chunks(n, c)), want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"chunk {c}: {m}")
    # the prime writes only these rows' K/V: the same K/V the full rows leave
    full_k, full_v = d.state.k[:n].clone(), d.state.v[:n].clone()
    for c in (64, 7):
        d.alloc(P + 8)
        d.prime(PROMPT, fixed_chunks(P, c))
        assert d.n == n
        torch.testing.assert_close(d.state.k[:n], full_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d.state.v[:n], full_v, atol=1e-5, rtol=1e-5)


# ---- 3. prefix attention against a dense reference ----


def _dense(q, k, v, start, scale):
    """Full softmax in fp64 with an explicit bottom-right causal mask; K/V head h // rep."""
    T, nh, _ = q.shape
    S, nkv, _ = k.shape
    kk, vv = k.double().repeat_interleave(nh // nkv, 1), v.double().repeat_interleave(nh // nkv, 1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    hide = torch.arange(S)[None, :] > (start + torch.arange(T))[:, None]  # key after the row's position
    assert not hide.all(-1).any()
    p = s.masked_fill(hide, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", p, vv).float()


def _qkv(T, start, nh, nkv, dqk, dv, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    S = start + T
    q = torch.randn(T, nh, dqk, generator=g)
    if strided:  # cache-like views: rows [0, S) of a longer cache, k and v split from one buffer
        buf = torch.randn(S + 11, nkv, dqk + dv, generator=g)
        k, v = buf[:S, :, :dqk], buf[:S, :, dqk:]
        assert not k.is_contiguous() and not v.is_contiguous()
    else:
        k, v = torch.randn(S, nkv, dqk, generator=g), torch.randn(S, nkv, dv, generator=g)
    return q, k, v


HEADS = {"gqa": (4, 2, 16, 16), "mqa": (4, 1, 16, 16), "mha": (4, 4, 8, 8), "mla": (4, 4, 24, 12),
         "mla-gqa": (6, 2, 24, 8)}


@pytest.mark.parametrize("T, start", [(1, 0), (9, 0), (50, 0), (1, 13), (9, 40), (50, 23)])
@pytest.mark.parametrize("heads", list(HEADS))
def test_blocked_attention_equals_dense(heads, T, start):
    nh, nkv, dqk, dv = HEADS[heads]
    q, k, v = _qkv(T, start, nh, nkv, dqk, dv, seed=T + start, strided=start % 2 == 1)
    scale = dqk ** -0.5
    want = _dense(q, k, v, start, scale)
    for budget in (None, nh * (start + T) * 3, 1):  # default: one block; 3 rows a block; one row a block
        got = blocked_attention(q, k, v, start, scale) if budget is None else blocked_attention(q, k, v, start,
                                                                                               scale, budget)
        assert got.shape == (T, nh, dv) and got.dtype == F32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"budget {budget}: {m}")
    assert prefix_arm(q, k, v) == "blocked"
    torch.testing.assert_close(prefix_attention(q, k, v, start, scale), want, atol=1e-5, rtol=1e-5)


def test_tiny_budget_forces_many_blocks_each_within_it():
    nh, nkv, T, start = 4, 2, 70, 30
    q, k, v = _qkv(T, start, nh, nkv, 16, 16, seed=1)
    budget = nh * (start + T) * 4 + 5  # 4 rows a block (the keys of the last block bound it)
    step = block_rows(nh, start + T, budget)
    assert step == 4 and math.ceil(T / step) >= 16 and step * nh * (start + T) <= budget
    assert block_rows(nh, start + T, 1) == 1  # never zero rows
    torch.testing.assert_close(blocked_attention(q, k, v, start, 0.25, budget), _dense(q, k, v, start, 0.25),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keys_delta", [-1, 1, -5])
def test_prefix_attention_refuses_a_mismatched_key_count(keys_delta):
    T, start = 6, 10
    q, k, v = _qkv(T, start + max(keys_delta, 0), 4, 2, 16, 16)
    S = start + T + keys_delta
    with pytest.raises(ValueError, match="key rows"):
        prefix_attention(q[:T], k[:S], v[:S], start, 0.25)


# ---- 3b. chunk plans ----


def _check_cover(chunks, start, n, max_rows):
    if n <= start:
        assert chunks == []
        return
    assert chunks[0][0] == start and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous
    assert all(1 <= hi - lo <= max_rows for lo, hi in chunks)


def test_fixed_chunks_cover_the_prompt():
    for n in range(0, 60):
        for m in range(1, 14):
            for start in (0, 1, 5):
                ch = fixed_chunks(n, m, start)
                _check_cover(ch, start, n, m)
                assert all(hi - lo == m for lo, hi in ch[:-1])  # full chunks but the last
    with pytest.raises(ValueError):
        fixed_chunks(10, 0)


@pytest.mark.parametrize("stages", [2, 3, 8])
def test_pipeline_chunks_cover_the_prompt_and_shrink(stages):
    for n in (1, 7, 255, 256, 1000, 4097, 33000):
        for max_rows in (1, 64, 512, 8192):
            for ratio in (0.0, 3.8e-5, 1e-3, 0.1):
                for start in (0, 3, 500):
                    ch = pipeline_chunks(n, max_rows, stages, ratio, start)
                    _check_cover(ch, start, n, max_rows)
                    sizes = [hi - lo for lo, hi in ch]
                    assert sizes == sorted(sizes, reverse=True), (n, max_rows, ratio, start, sizes)
    sizes = [hi - lo for lo, hi in pipeline_chunks(32768, 8192, stages, 3.8e-5)]
    assert sizes[-2] < sizes[0]  # a positive ratio: later chunks (longer prefix) are smaller
    with pytest.raises(ValueError):
        pipeline_chunks(10, 0, stages, 0.0)


def test_one_stage_is_fixed_chunks():
    for n, m, start in ((1, 1, 0), (100, 7, 0), (100, 64, 30), (8192 * 3 + 5, 8192, 0)):
        assert pipeline_chunks(n, m, 1, 3.8e-5, start) == fixed_chunks(n, m, start)


# ---- 4. a 16k-token prompt in bounded memory ----

_LONG = textwrap.dedent("""
    import json, resource, sys
    import torch
    from memra_dist.app import generate
    from memra_dist.config import RunConfig
    d, P = sys.argv[1], int(sys.argv[2])
    prompt = torch.randint(3, 128, (P,), generator=torch.Generator().manual_seed(0)).tolist()
    run = lambda c, ids: generate(RunConfig(model=d, drafter="none", max_new_tokens=2, device="cpu", dtype="fp32",
                                            prefill_chunk=c), ids).token_ids
    run(64, prompt[:100])  # imports, allocator, the model's files: all before the baseline
    kib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    base, out = kib(), {}
    for c in map(int, sys.argv[3:]):
        out[c] = {"tokens": run(c, prompt), "extra_mib": (kib() - base) / 1024}
    print(json.dumps(out))
""")


@pytest.mark.slow  # a 16k-token prompt in a subprocess
def test_16k_prompt_runs_in_bounded_memory(tmp_path):
    """16384 prompt rows in 1024-row chunks and in one chunk (the prefix arm alone bounds it):
    the peak RSS above a warmed baseline stays under half of ONE head's (16k x 16k) fp32
    score matrix (the model has two heads: the whole (T x context) scores would be 2 GiB, the
    mask another 256 MiB), and the tokens agree."""
    P16 = 16384
    d = tmp_path / "long"
    d.mkdir()
    save_hf(d, "llama", seed=3, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=P16 + 64, eos_token_id=None)
    res = subprocess.run([sys.executable, "-c", _LONG, str(d), str(P16), "1024", str(P16)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    one_head_scores_mib = P16 * P16 * 4 / 2**20  # 1024 MiB
    for c in ("1024", str(P16)):
        assert len(out[c]["tokens"]) == 2
        assert out[c]["extra_mib"] < one_head_scores_mib / 2, out
    assert out["1024"]["tokens"] == out[str(P16)]["tokens"]


# ---- 5. bad chunk sizes: one line, exit 2 ----


@pytest.mark.parametrize("value", ["0", "-3"])
def test_cli_bad_prefill_chunk_one_line_exit_2(ckpts, capsys, value):
    argv = ["generate", "--model", str(ckpts["llama"][0]), "--prompt", "hi", "--device", "cpu",
            "--prefill-chunk", value]
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("memra-dist: error:") and "--prefill-chunk" in lines[0] and value in lines[0], err


@pytest.mark.slow  # ~3 s (a fresh interpreter); the in-process case above keeps the quick tier's check
def test_cli_bad_prefill_chunk_subprocess(ckpts):
    res = subprocess.run([sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(ckpts["llama"][0]),
                          "--prompt", "hi", "--device", "cpu", "--prefill-chunk", "0"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "", res
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memra-dist: error:") and "--prefill-chunk" in lines[0], res.stderr


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_run_config_refuses_bad_prefill_chunk(bad):
    with pytest.raises(UserError, match="--prefill-chunk"):
        RunConfig(model="m", prefill_chunk=bad)
    assert RunConfig(model="m", prefill_chunk=1).prefill_chunk == 1
    assert RunConfig(model="m").prefill_chunk == DEFAULT_PREFILL_CHUNK


def test_session_refuses_bad_prefill_chunk():
    with pytest.raises(UserError, match="--prefill-chunk"):
        SpecSession(object(), NoDrafter(), SamplingParams(), torch.Generator(), 1, prefill_chunk=0)


# ---- 6. the first-token profile and its spans report the real chunks ----


class _Capture:
    def __init__(self):
        self.prof = None

    def first_token(self, prof):
        self.prof = prof

    def burst(self, rec):
        pass

    def rounds(self, log, final):
        pass


def _expected_draft_prime(drafter: str, chunks) -> tuple[int, int]:
    """(chunks, rows) the drafter's prime ingests, from its rule: DFlash every prompt row, one
    ingest per target chunk; EAGLE-3 rows p < P - 1, one per chunk that starts below that;
    MTP layer j (deepseek_v3 here: two) rows p < P - 1 - j, after target chunk [lo, hi) its
    rows up to min(hi, P - 1 - j): one ingest per chunk that starts below that bound."""
    if drafter == "dflash":
        return len(chunks), P
    bounds = {"eagle3": [P - 1], "mtp": [P - 1, P - 2]}.get(drafter, [])
    return sum(1 for b in bounds for lo, _hi in chunks if lo < b), sum(bounds)


# the method each tap drafter's prime ingests through: counted while its prime runs
_INGESTS = {"dflash": (DFlashDrafter, "_ingest"), "mtp": (MTPDrafter, "_rows"), "eagle3": (Eagle3Drafter, "_prime_kv")}


def _count_prime_ingests(mp, drafter: str) -> list[int]:
    """Patches the drafter class: returns a list that collects the rows of each ingest call
    made inside its prime (DFlash's _ingest counts only calls that ingest a row)."""
    if drafter not in _INGESTS:
        return []
    cls, name = _INGESTS[drafter]
    real_prime, real = cls.prime, getattr(cls, name)
    rows, inside = [], [False]

    def prime(self, prompt, chunks=None):
        inside[0] = True
        try:
            return real_prime(self, prompt, chunks)
        finally:
            inside[0] = False

    def ingest(self, *a):
        if inside[0] and drafter == "dflash":  # _ingest(upto, depth): rows [n, upto)
            rows.extend([a[0] - self.n] if a[0] > self.n else [])
        elif inside[0]:  # _rows(j, lo, hi, ...) / _prime_kv(context, lo, hi)
            rows.append(a[2] - a[1])
        return real(self, *a)

    mp.setattr(cls, "prime", prime)
    mp.setattr(cls, name, ingest)
    return rows


# id -> (family, drafter, draft dir key, chunk); P = 130
PROF = {
    "plain-37": ("llama", "none", None, 37),  # 37, 37, 37, 19
    "plain-whole": ("llama", "none", None, DEFAULT_PREFILL_CHUNK),
    "dflash-64": ("llama", "dflash", "dflash", 64),  # 64, 64, 2
    "dflash-7": ("llama", "dflash", "dflash", 7),
    "eagle3-37": ("llama", "eagle3", "eagle3", 37),
    "eagle3-129": ("llama", "eagle3", "eagle3", P - 1),  # its rows end on the first chunk's end: one ingest
    "mtp-37": ("deepseek_v3", "mtp", None, 37),
    "mtp-129": ("deepseek_v3", "mtp", None, P - 1),  # layer 0's last row is the first chunk's last
}


@pytest.mark.parametrize("case", list(PROF))
def test_first_token_profile_and_spans_report_the_chunks(ckpts, draft_dirs, monkeypatch, case):
    family, drafter, ddir, C = PROF[case]
    cap = _Capture()
    exp = InMemorySpanExporter()
    prov = TracerProvider()
    prov.add_span_processor(SimpleSpanProcessor(exp))
    cfg = _cfg(ckpts[family][0], C, drafter=drafter, k=3, draft_model=str(draft_dirs[ddir]) if ddir else None,
               trace=TraceSettings(level=0, prof=True))
    ingests = _count_prime_ingests(monkeypatch, drafter)
    generate(cfg, PROMPT, sink=FanOut(cap, SpanSink(prov.get_tracer("t"), None)))
    pf = cap.prof
    chunks = fixed_chunks(P, C)
    sizes = [hi - lo for lo, hi in chunks]
    assert pf.prime_chunk_rows == sizes and pf.prime_chunks == math.ceil(P / C) == len(sizes)
    assert pf.prime_rows == P and len(pf.prime_chunk_ms) == len(sizes) and all(ms > 0 for ms in pf.prime_chunk_ms)
    assert sum(pf.prime_chunk_ms) <= pf.ms["prime"]
    assert f"prime_chunks={len(sizes)} prime_rows={P} " in pf.line()
    want = _expected_draft_prime(drafter, chunks)
    assert (pf.draft_prime_chunks, pf.draft_prime_rows) == want
    assert (len(ingests), sum(ingests)) == want  # the profile counts the calls that ran

    spans = exp.get_finished_spans()
    (prime,) = [s for s in spans if s.name == ttft_span("prime")]
    mine = sorted((s for s in spans if s.name == SPAN_PRIME_CHUNK), key=lambda s: s.start_time)
    assert [s.attributes["memra.rows"] for s in mine] == sizes
    assert [s.attributes["memra.chunk"] for s in mine] == list(range(len(sizes)))
    for s in mine:
        assert s.parent is not None and s.parent.span_id == prime.context.span_id
        assert prime.start_time <= s.start_time <= s.end_time <= prime.end_time
    assert all(a.end_time <= b.start_time for a, b in zip(mine, mine[1:]))  # end to end, in order
