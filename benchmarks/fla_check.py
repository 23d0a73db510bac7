"""flash-linear-attention (fla) KDA kernels vs the PyTorch reference, on CUDA.

    source .whl/use-wheels.sh; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    python benchmarks/fla_check.py OUT_DIR

1. accuracy: KDAState.advance (the engine's path: chunked head + snapshot ring) torch vs fla
   at H=32, Dk=Dv=128, T in {1, 5, 9, 512}, two gate regimes: max |diff| of outputs, final
   state, every ring slot, and the state after a rollback; then the raw forms with fp32 and
   bf16 q/k/v/beta (g and the state fp32) against the reference on the same values;
2. timing (CUDA events, median ms): prefill T=512/2048, verify T=5/9, decode T=1, through
   KDAState.advance (+ the raw chunk form in fp32 and bf16);
3. a tiny kimi_linear (KDA heads 32 wide, so fla's tiles apply) greedy in fp32: fla vs torch,
   plain and n-gram K=4, a short prompt (ring only) and a long one (chunked head too);
4. OUT_DIR/fla_check.json and a summary. Each step is guarded; no network; ~1-2 min.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch.nn import functional as F

from memra_dist.model import kda_kernels as kk
from memra_dist.model.kda import RECURRENT_MAX_ROWS as R, KDAState, kda_chunked, kda_recurrent, l2norm

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fla_check")
OUT.mkdir(parents=True, exist_ok=True)
BUDGET_S = float(os.environ.get("FLA_CHECK_BUDGET_S", "200"))
T0 = time.perf_counter()
H, D, KC = 32, 128, 4  # Kimi-Linear: 32 KDA heads of 128, conv kernel 4
dev = torch.device("cuda")
res: dict = {"errors": {}, "skipped": []}


def log(*a):
    print(f"[fla_check {time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def step(name):
    def run(fn):
        if time.perf_counter() - T0 > BUDGET_S:
            res["skipped"].append(name)
            log(f"{name}: skipped (past the {BUDGET_S:.0f}s budget)")
            return fn
        t = time.perf_counter()
        try:
            fn()
            log(f"{name}: done in {time.perf_counter() - t:.1f}s")
        except Exception as e:  # one failure must not stop the rest
            res["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"{name}: FAILED {type(e).__name__}: {e}")
            traceback.print_exc()
        return fn
    return run


def use(backend: str) -> None:
    os.environ[kk.ENV] = backend
    kk.reset()


def mad(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def inputs(T, regime="kimi", seed=0, S_scale=0.5):
    g_ = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g_, device=dev)  # noqa: E731
    q, k, v = l2norm(r(T, H, D)) * D ** -0.5, l2norm(r(T, H, D)), r(T, H, D)
    if regime == "kimi":  # -exp(A_log) softplus(x + dt_bias), A_log ~ log U[1, 16] per head
        rate = torch.empty(H, 1, device=dev).uniform_(1, 16, generator=g_)
        g = -rate * F.softplus(r(T, H, D))
    else:  # "slow": decay ~0.98 per row, long memory
        g = F.logsigmoid(r(T, H, D) + 4)
    beta = torch.sigmoid(r(T, H))
    return q, k, v, g, beta, r(H, D, D) * S_scale


def new_state(length=0, S0=None) -> KDAState:
    st = KDAState.alloc(H, D, D, 3 * H * D, KC, R, dev, torch.float32)
    if length:
        st.length = st.lo = length  # as if `length` rows were in: the ring slot of `length` holds S
        st.S.copy_(S0)
    return st


def xc_for(T):
    return torch.randn(KC - 1 + T, 3 * H * D, device=dev)


res["env"] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, **kk.fla_status()}
try:
    import fla  # noqa: PLC0415
    import triton  # noqa: PLC0415
    res["env"].update(fla=getattr(fla, "__version__", "?"), triton=triton.__version__)
except Exception as e:
    res["env"]["import"] = f"{type(e).__name__}: {e}"
log("env", res["env"])
HAVE_FLA = res["env"]["fla_importable"]


# ---------------------------------------------------------------- 1. accuracy
@step("accuracy_engine_fp32")
def _():
    out = res["accuracy_engine_fp32"] = {}
    L0 = 40
    for regime in ("kimi", "slow"):
        for T in (1, 5, 9, 512):
            q, k, v, g, beta, S0 = inputs(T, regime, seed=T)
            xc = xc_for(T)
            got = {}
            for be in ("torch", "fla"):
                use(be)
                st = new_state(L0, S0)
                o = st.advance(q, k, v, g, beta, xc)
                S, ring = st.S.clone(), st.snaps.clone()
                back = L0 + T - max(1, min(T, R) // 2)  # a length inside the ring
                st.rollback(back)
                got[be] = (o, S, ring, st.S.clone())
            a, b = got["torch"], got["fla"]
            row = {"o": mad(a[0], b[0]), "S": mad(a[1], b[1]), "ring": mad(a[2], b[2]),
                   "rollback_S": mad(a[3], b[3]), "o_scale": a[0].abs().max().item()}
            out[f"{regime}_T{T}"] = row
            log(f"engine fp32 {regime:4s} T={T:4d}: max|do| {row['o']:.2e}  |dS| {row['S']:.2e}  "
                f"ring {row['ring']:.2e}  rollback {row['rollback_S']:.2e}  (|o| {row['o_scale']:.2f})")


def raw_accuracy(dt, name):
    out = res[name] = {}
    fl = kk.FlaKDA()
    for T in (1, 5, 9, 512):
        q, k, v, g, beta, S0 = inputs(T, "slow", seed=100 + T)
        q, k, v, beta = (t.to(dt) for t in (q, k, v, beta))
        ref_f = kda_chunked if T > R else kda_recurrent
        fla_f = fl.chunked if T > R else fl.recurrent
        o_r, S_r = ref_f(*(t.float() for t in (q, k, v, g, beta)), S0.clone())
        o_f, S_f = fla_f(q, k, v, g, beta, S0.clone())
        row = out[f"T{T}"] = {"form": "chunk" if T > R else "recurrent", "o": mad(o_r, o_f), "S": mad(S_r, S_f),
                              "o_dtype": str(o_f.dtype).removeprefix("torch.")}
        log(f"raw {name[-4:]} T={T:4d} {row['form']:9s}: max|do| {row['o']:.2e}  |dS| {row['S']:.2e}")


@step("accuracy_raw_fp32")
def _():
    raw_accuracy(torch.float32, "accuracy_raw_fp32")


# ---------------------------------------------------------------- 3. a tiny kimi_linear, greedy
def tiny_kimi() -> str:
    from safetensors.torch import save_file  # noqa: PLC0415

    from memra_dist.bench import checkpoints as ck  # noqa: PLC0415

    # 4 layers [KDA, KDA, KDA, MLA], KDA 2 heads x 32, MoE 8 experts top-2, vocab 97
    cfg = ck._kimi(64, 96, 4, 2, 32, 4, 16, 8, 8, 12, 8, 2, 16, 97)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (shape, f32) in ck._param_shapes(cfg).items():
        t = ck._draw(name, shape, torch.float32, "cpu", gen)
        if not name.endswith(("norm.weight", "layernorm.weight", "dt_bias", "e_score_correction_bias", "A_log")):
            t = t * 10  # std 0.2 (the tests' initializer range): clear greedy margins
        tensors[name] = t.contiguous()
    d = Path(tempfile.mkdtemp(prefix="fla_check_kimi_"))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@step("model_greedy_fp32")
def _():
    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.runner import ModelRunner  # noqa: PLC0415
    from memra_dist.app import generate  # noqa: PLC0415

    model = tiny_kimi()
    out = res["model_greedy_fp32"] = {}
    g_ = torch.Generator().manual_seed(1)
    base = torch.randint(3, 97, (12,), generator=g_).tolist()
    prompts = {"short20": (base * 2)[:20], "long90": (base * 8)[:90]}  # 90 > R: a chunked head
    for pname, prompt in prompts.items():
        ids, logit = {}, {}
        for be in ("torch", "fla"):
            use(be)
            r = ModelRunner(model, dev, torch.float32)
            r.alloc(len(prompt) + 8)
            lg = [r.forward(torch.tensor(prompt), 0)[-1:]]
            for t in range(5):  # decode rows on top of the prefill
                lg.append(r.forward(torch.tensor([int(lg[-1].argmax())]), len(prompt) + t))
            logit[be] = torch.cat(lg)
            for drafter in ("none", "ngram"):
                cfg = RunConfig(model=model, drafter=drafter, k=4, max_new_tokens=48, device="cuda",
                                dtype="fp32", graphs="off")
                t = time.perf_counter()
                rr = generate(cfg, prompt)
                ids[(be, drafter)] = rr.token_ids
                out[f"{pname}_{be}_{drafter}"] = {"s": round(time.perf_counter() - t, 3),
                                                  "accepted": rr.stats.get("accepted"),
                                                  "drafted": rr.stats.get("drafted")}
        row = out[pname] = {
            "logits_maxdiff": mad(logit["torch"], logit["fla"]),
            "fla_eq_torch_plain": ids[("fla", "none")] == ids[("torch", "none")],
            "fla_eq_torch_ngram": ids[("fla", "ngram")] == ids[("torch", "ngram")],
            "fla_ngram_eq_plain": ids[("fla", "ngram")] == ids[("fla", "none")],
            "torch_ngram_eq_plain": ids[("torch", "ngram")] == ids[("torch", "none")],
        }
        if not row["fla_eq_torch_plain"]:
            a, b = ids[("torch", "none")], ids[("fla", "none")]
            row["first_diff"] = next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i])
        log(f"model {pname}: {row}")


# ---------------------------------------------------------------- 2. timing
def cuda_ms(fn, iters, setup=None, warm=2) -> dict:
    ts = []
    for i in range(warm + iters):
        if setup is not None:
            setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warm:
            ts.append(a.elapsed_time(b))
    return {"median_ms": round(statistics.median(ts), 4), "min_ms": round(min(ts), 4)}


@step("timing_engine_fp32")
def _():
    out = res["timing_engine_fp32"] = {}
    for be in ("torch", "fla") if HAVE_FLA else ("torch",):
        use(be)
        for T in (512, 2048):
            q, k, v, g, beta, _ = inputs(T, "kimi", seed=7)
            xc, st = xc_for(T), new_state()
            out[f"{be}_prefill_T{T}"] = cuda_ms(lambda: st.advance(q, k, v, g, beta, xc), 5, setup=st.reset)
        st = new_state()
        q, k, v, g, beta, _ = inputs(600, "kimi", seed=8)
        st.advance(q, k, v, g, beta, xc_for(600))
        for T in (1, 5, 9):
            q, k, v, g, beta, _ = inputs(T, "kimi", seed=9 + T)
            xc = xc_for(T)
            out[f"{be}_rows_T{T}"] = cuda_ms(lambda: st.advance(q, k, v, g, beta, xc), 30,
                                             setup=lambda: st.rollback(600))
        for key in [k_ for k_ in out if k_.startswith(be)]:
            log(f"{key:22s} {out[key]['median_ms']:9.3f} ms")
    if HAVE_FLA:
        out["speedup"] = {k_[6:]: round(out[k_]["median_ms"] / out["fla" + k_[5:]]["median_ms"], 2)
                          for k_ in out if k_.startswith("torch_")}
        log("speedup torch/fla", out["speedup"])


@step("timing_raw_chunk")
def _():
    out = res["timing_raw_chunk"] = {}
    fl = kk.FlaKDA()
    for dt in (torch.float32, torch.bfloat16):
        q, k, v, g, beta, S0 = inputs(2048, "kimi", seed=11)
        q, k, v, beta = (t.to(dt) for t in (q, k, v, beta))
        name = f"fla_chunk_T2048_{str(dt).removeprefix('torch.')}"
        out[name] = cuda_ms(lambda: fl.chunked(q, k, v, g, beta, S0), 10)
        log(f"{name:24s} {out[name]['median_ms']:9.3f} ms")
    q, k, v, g, beta, S0 = inputs(2048, "kimi", seed=11)
    out["torch_chunk_T2048_float32"] = cuda_ms(lambda: kda_chunked(q, k, v, g, beta, S0), 5)
    log(f"torch_chunk_T2048_float32 {out['torch_chunk_T2048_float32']['median_ms']:9.3f} ms")


@step("accuracy_raw_bf16")
def _():
    raw_accuracy(torch.bfloat16, "accuracy_raw_bf16")


# ---------------------------------------------------------------- 4. results
res["wall_s"] = round(time.perf_counter() - T0, 1)
(OUT / "fla_check.json").write_text(json.dumps(res, indent=2, default=str))
eng = res.get("accuracy_engine_fp32", {})
print("\n== fla_check summary ==")
print(f"fla importable: {HAVE_FLA}  {res['env'].get('error') or ''}")
if not HAVE_FLA:
    print("  (after `source .whl/use-wheels.sh`, extend PYTHONPATH rather than replace it:"
          " export PYTHONPATH=$PWD:$PYTHONPATH)")
if eng:
    print(f"engine fp32 worst: o {max(r['o'] for r in eng.values()):.2e}  S {max(r['S'] for r in eng.values()):.2e}"
          f"  ring {max(r['ring'] for r in eng.values()):.2e}  rollback {max(r['rollback_S'] for r in eng.values()):.2e}")
for p, row in res.get("model_greedy_fp32", {}).items():
    if "logits_maxdiff" in row:
        print(f"model {p}: fla==torch plain {row['fla_eq_torch_plain']}  ngram {row['fla_eq_torch_ngram']}  "
              f"fla ngram==plain {row['fla_ngram_eq_plain']}  logits |d| {row['logits_maxdiff']:.2e}")
if "speedup" in res.get("timing_engine_fp32", {}):
    print("speedup torch/fla:", res["timing_engine_fp32"]["speedup"])
print(f"errors: {list(res['errors']) or 'none'}  skipped: {res['skipped'] or 'none'}  wall {res['wall_s']}s")
print(f"wrote {OUT / 'fla_check.json'}")
