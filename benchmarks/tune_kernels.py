"""Tune our Triton kernels on this GPU and write the winners into the shipped table
(memra_dist/kernels/tuned/<gpu>.json, kernels/tuned_table.py), so a fresh machine of this GPU
model benchmarks nothing before its first token.

For every model shape the project measures (the `memra-dist bench` shapes: the 8B target, its
1B draft, their DFlash / EAGLE-3 drafters, the hybrid and the DeepSeek-V3 MTP shapes; the demo's
tiny models; the tiny families of memra_dist/bench/tiny_families.py) it drives the kernels'
public wrappers over the model's weight shapes with tuning forced on (kernels/tuning.py
`forced("all")`: the table unread, every config of a key benchmarked): one row through the GEMV
(each fold an engine step uses), 16 / 32 / 64 rows through the row GEMM (a verify's block and a
batched step's wider ones), one row through the MoE expert kernels. Each autotuner's winners
are then read from its `.cache` and merged into OUT/<gpu>.json after every model (the keys
already there and not re-tuned are kept), so an interrupted run keeps what it tuned. Keys a
kernel's own rule answers with one config (a tiny weight's row GEMM) are not written: the
heuristic gives them that config anyway.

    python benchmarks/tune_kernels.py                 # writes memra_dist/kernels/tuned/<gpu>.json
    python benchmarks/tune_kernels.py --out DIR       # DIR/<gpu>.json (use it: MEMRA_TUNED_DIR=DIR)
    python benchmarks/tune_kernels.py --only 8b,1b    # some models only; --list shows them (no GPU)

Progress on stderr. Exit status: 0 all tuned; 1 some keys failed (said, and the rest written);
2 no usable GPU / Triton; 3 the time budget (--budget-s, default 450 s) ran out first (the
models left are named).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# this checkout's memra_dist (its kernels, and the tables --out writes by default), installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROW_COUNTS = (16, 32, 64)  # the row GEMM's column blocks the engine runs: verify (<= 16), batched (32, 64)
DTYPE = torch.bfloat16  # the engine's CUDA default (--dtype auto)


def say(line: str) -> None:
    print(f"[tune] {line}", file=sys.stderr, flush=True)


# ---- the models and their kernel launches ------------------------------------------------

def _moe_of(c: dict) -> tuple[int, int, int, int] | None:
    """(experts, top-k, expert width, shared experts) of a MoE config, None for a dense one."""
    e = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
    k = c.get("num_experts_per_tok") or c.get("num_experts_per_token")
    if not e or not k:
        return None
    return e, k, c["moe_intermediate_size"], c.get("n_shared_experts", c.get("num_shared_experts", 0)) or 0


def jobs_of(c: dict) -> list[tuple]:
    """The kernel launches a model of config `c` (HF config.json keys) makes on the fast path,
    as jobs: ("gemv", N, K, silu_mul, norm, dtype), ("rows", N, K, M, norm, glu),
    ("moe", H, I, top_k). A superset is harmless: a key the engine never meets is never read."""
    H, V = c["hidden_size"], c["vocab_size"]
    nh = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    hd = c.get("head_dim") or H // nh
    mla = bool(c.get("kv_lora_rank"))
    moe = _moe_of(c)
    jobs: list[tuple] = []

    def gemv(n, k, silu=False, norm=False, dtype=DTYPE):
        jobs.append(("gemv", n, k, silu, norm, dtype))

    def rows(n, k, norm=False, glu=False):
        jobs.extend(("rows", n, k, m, norm, glu) for m in ROW_COUNTS)

    k_in = 2 * H if c.get("draft_vocab_size") else H  # an EAGLE-3 layer reads [embedding, hidden]
    if mla:  # its one-row projections are plain GEMVs (kernels/ops.py install_block)
        nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q = c.get("q_lora_rank")
        if q:
            gemv(q, H), gemv(nh * (nope + rope), q)
        else:
            gemv(nh * (nope + rope), H)
        gemv(c["kv_lora_rank"] + rope, H), gemv(nh * (nope + v), c["kv_lora_rank"]), gemv(H, nh * v)
    else:  # GQA: QKV with the pre-norm folded in (or plain), o_proj with the residual
        qkv = (nh + 2 * nkv) * hd
        gemv(qkv, k_in, norm=k_in == H), gemv(qkv, k_in), gemv(H, nh * hd)
        rows(qkv, k_in, norm=k_in == H), rows(H, nh * hd)
    if moe is None or c.get("first_k_dense_replace", 0) > 0:  # a dense SwiGLU
        inter = c["intermediate_size"]
        gemv(2 * inter, H, norm=True), gemv(2 * inter, H), gemv(H, inter, silu=True)
        if not mla:
            rows(inter, H, norm=True, glu=True), rows(H, inter)
    if moe is not None:
        e, k, mi, shared = moe
        gemv(e, H, dtype=torch.float32)  # the router's scores, in fp32
        jobs.append(("moe", H, mi, k))
        if shared:
            gemv(2 * mi * shared, H), gemv(H, mi * shared, silu=True)
    if c.get("num_nextn_predict_layers"):
        gemv(H, 2 * H)  # an MTP layer's eh_proj
    head = c.get("draft_vocab_size") or V
    gemv(head, H, norm=True), gemv(head, H)
    rows(head, H, norm=True)
    return jobs


def models() -> list[tuple[str, dict]]:
    """(label, config) of every model shape to tune, the bench's 8B first (a run out of time
    has done those)."""
    from memra_dist.bench.checkpoints import HYBRID_SHAPES, SHAPES
    from memra_dist.bench.tap_checkpoints import DFLASH_SHAPES, DSV3_SHAPES, EAGLE3_SHAPES
    from memra_dist.bench.tiny_families import DENSE_SHAPE, DFLASH_SHAPE, EAGLE3_SHAPE, MOE_SHAPES
    from memra_dist.demo.tiny import DEMO_SHAPES, llama_config, train_tokenizer
    from memra_dist.demo.tiny_dflash import TINY_DFLASH, dflash_config_dict
    from memra_dist.demo.tiny_eagle3 import TINY_EAGLE3, eagle3_config_dict
    from memra_dist.demo.tiny_mtp import glm_config

    def dflash(target, shape):
        return dflash_config_dict(target, **{"mask_token_id": 0, **shape})

    def eagle3(target, shape):
        return eagle3_config_dict(target, **shape)

    demo_vocab = train_tokenizer().get_vocab_size()  # the demo's tokenizer decides its vocabulary
    demo = llama_config(demo_vocab, **DEMO_SHAPES["target"])
    family = {**DENSE_SHAPE, "num_hidden_layers": 4}
    out = [("8b", SHAPES["8b"]), ("1b", SHAPES["1b"]),
           ("8b-dflash", dflash({**SHAPES["8b"]}, DFLASH_SHAPES["8b"])),
           ("8b-eagle3", eagle3(SHAPES["8b"], EAGLE3_SHAPES["8b"])),
           ("qwen3-8b", SHAPES["qwen3-8b"]), ("qwen3-8b-dflash", dflash(SHAPES["qwen3-8b"], DFLASH_SHAPES["qwen3-8b"])),
           ("demo", demo), ("demo-draft", llama_config(demo_vocab, **DEMO_SHAPES["draft"])),
           ("demo-dflash", dflash(demo, TINY_DFLASH)), ("demo-eagle3", eagle3(demo, TINY_EAGLE3)),
           ("demo-glm4_moe", glm_config(demo_vocab)),
           ("tiny", SHAPES["tiny"]), ("tiny-draft", SHAPES["tiny-draft"]),
           ("tiny-dflash", dflash(SHAPES["tiny"], DFLASH_SHAPES["tiny"])),
           ("tiny-eagle3", eagle3(SHAPES["tiny"], EAGLE3_SHAPES["tiny"])),
           ("mid", SHAPES["mid"]), ("mid-draft", SHAPES["mid-draft"]),
           ("family-dense", family), ("family-qwen3", {**family, "head_dim": 16}),
           ("family-draft", {**family, "num_hidden_layers": 1}),
           ("family-dflash", dflash(family, DFLASH_SHAPE)), ("family-eagle3", eagle3(family, EAGLE3_SHAPE)),
           *((f"family-{arch}", {**shape, "num_nextn_predict_layers": 1}) for arch, shape in MOE_SHAPES.items()),
           ("kimi-tiny", HYBRID_SHAPES["kimi-tiny"]), ("dsv3-tiny", DSV3_SHAPES["tiny"]),
           ("kimi", HYBRID_SHAPES["kimi"]), ("dsv3", DSV3_SHAPES["8b"])]
    return out


# ---- running a job -------------------------------------------------------------------------

def run_job(job: tuple, dev: torch.device) -> None:
    """One launch of the job's kernel (its autotuner benchmarks the key under forced tuning)."""
    from memra_dist.kernels.gemm_rows import gemm_rows
    from memra_dist.kernels.gemv import gemv
    from memra_dist.kernels.moe_gemv import moe_experts

    kind = job[0]
    if kind == "gemv":
        _, n, k, silu, norm, dtype = job
        w = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
        x = torch.randn(1, 2 * k if silu else k, device=dev, dtype=dtype)
        nw = torch.ones(k, device=dev, dtype=dtype) if norm else None
        res = torch.randn(1, n, device=dev, dtype=dtype) if not norm else None  # o_proj / down add the residual
        gemv(x, w, None, silu, nw, 1e-5, res)
    elif kind == "rows":
        _, n, k, m, norm, glu = job
        w = torch.randn(2 * n if glu else n, k, device=dev, dtype=DTYPE) * 0.02
        x = torch.randn(m, k, device=dev, dtype=DTYPE)
        nw = torch.ones(k, device=dev, dtype=DTYPE) if norm else None
        res = torch.randn(m, n, device=dev, dtype=DTYPE) if not (norm or glu) else None
        gemm_rows(x, w, None, False, nw, 1e-5, res, glu=glu)
    elif kind == "moe":
        _, h, i, k = job  # the key has no expert count: k experts, one row picking all of them
        x = torch.randn(1, h, device=dev, dtype=DTYPE)
        gate_up = torch.randn(k, 2 * i, h, device=dev, dtype=DTYPE) * 0.02
        down = torch.randn(k, h, i, device=dev, dtype=DTYPE) * 0.02
        idx = torch.randperm(k, device=dev).view(1, k)
        wts = torch.full((1, k), 1.0 / k, device=dev, dtype=torch.float32)
        moe_experts(x, gate_up, down, wts, idx, torch.randn(1, h, device=dev, dtype=DTYPE))
    else:
        raise ValueError(f"unknown job {job!r}")
    torch.cuda.synchronize(dev)  # an asynchronous failure is this job's


def winners() -> dict[str, dict[str, dict]]:
    """{kernel: {table key: entry}} of every key the autotuners benchmarked (or read from
    Triton's disk cache of this machine) in this process, from their `.cache`."""
    from memra_dist.kernels import tuned_table, tuning

    out: dict[str, dict[str, dict]] = {}
    for name, t in tuning.TUNERS.items():
        benched = t.memra_choose.benched
        for key, cfg in t.cache.items():
            names = list(t.keys)
            if len(key) <= len(names):
                raise RuntimeError(f"{name}: autotuner key {key!r} has no dtype after its {names} values: this "
                                   f"Triton builds its keys differently; kernels/tuning.py needs updating")
            k = tuned_table.key_string(names, list(key[:len(names)]), key[len(names)])
            if k in benched:
                out.setdefault(name, {})[k] = tuning.entry_of(cfg)
    return out


def _new_keys(before: dict) -> list[str]:
    """What the last job's launches added to the autotuners' caches, a line each."""
    from memra_dist.kernels import tuned_table, tuning

    lines = []
    for name, t in tuning.TUNERS.items():
        for key in set(t.cache) - before.get(name, set()):
            c, n = t.cache[key], len(t.keys)
            k = tuned_table.key_string(list(t.keys), list(key[:n]), key[n] if len(key) > n else "?")
            cfg = " ".join(f"{a}={b}" for a, b in c.kwargs.items())
            lines.append(f"{name} [{k}] -> {cfg} warps={c.num_warps} stages={c.num_stages}"
                         f"{'' if k in t.memra_choose.benched else ' (one config: not benchmarked, not written)'}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", metavar="DIR", default=None,
                    help="where <gpu>.json is merged into (default: the package's memra_dist/kernels/tuned)")
    ap.add_argument("--only", metavar="LABELS", default=None, help="comma-separated model labels (see --list)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting models after this (default 450)")
    ap.add_argument("--list", action="store_true", help="print the models and their launches, then exit (no GPU)")
    a = ap.parse_args(argv)

    todo = models()
    if a.only:
        want = [s.strip() for s in a.only.split(",") if s.strip()]
        unknown = sorted(set(want) - {m for m, _ in todo})
        if unknown:
            say(f"error: unknown model labels {unknown}; known: {[m for m, _ in todo]}")
            return 2
        todo = [(m, c) for m, c in todo if m in want]
    if a.list:
        for label, cfg in todo:
            print(f"{label}: {len(jobs_of(cfg))} launches")
        return 0

    if not torch.cuda.is_available():
        say("error: no CUDA GPU here: the tables are per GPU model and tuned on one (nothing written)")
        return 2
    from memra_dist import kernels
    from memra_dist.kernels import tuned_table, tuning

    dev = torch.device("cuda", torch.cuda.current_device())
    if not kernels.available(dev):
        say(f"error: our Triton kernels cannot run on {dev} (the warning above says why; nothing written)")
        return 2
    gpu = torch.cuda.get_device_name(dev)
    slug = tuned_table.slug(gpu)
    out = Path(a.out) if a.out else tuned_table.TABLE_DIR
    path = out / f"{slug}.json"
    meta = {"triton": __import__("triton").__version__, "torch": torch.__version__,
            "capability": ".".join(map(str, torch.cuda.get_device_capability(dev))),
            "tuned_by": "benchmarks/tune_kernels.py"}
    tuned_table.read_file(path)  # an unreadable table fails here, before any tuning
    say(f"{gpu} -> {path} ({len(todo)} models, budget {a.budget_s:.0f} s)")

    t_start, failures, seen, left = time.perf_counter(), [], set(), []
    with tuning.forced("all"), torch.inference_mode():
        for i, (label, cfg) in enumerate(todo):
            if time.perf_counter() - t_start > a.budget_s:
                left = [m for m, _ in todo[i:]]
                break
            jobs = [j for j in jobs_of(cfg) if j not in seen]
            seen.update(jobs)
            t0 = time.perf_counter()
            say(f"{label} ({i + 1}/{len(todo)}): {len(jobs)} new launches")
            for job in jobs:
                before = {n: set(t.cache) for n, t in tuning.TUNERS.items()}
                tj = time.perf_counter()
                try:
                    run_job(job, dev)
                except Exception as e:  # noqa: BLE001 (said, counted, and the run goes on)
                    failures.append((label, job, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"))
                    say(f"  FAILED {job[:5]}: {failures[-1][2]}")
                    continue
                for line in _new_keys(before):
                    say(f"  {line} ({time.perf_counter() - tj:.1f} s)")
            n = tuned_table.merge_into(path, gpu, slug, winners(), meta)
            say(f"{label} done in {time.perf_counter() - t0:.1f} s; {path} holds {n} keys")
    total = time.perf_counter() - t_start
    say(f"tuned {tuning.TALLY['configs']} configs in {tuning.TALLY['tune_s']:.1f} s of benchmarks, "
        f"{total:.1f} s in all; table {path}")
    if failures:
        say(f"error: {len(failures)} launches failed (their keys are not in the table):")
        for label, job, why in failures:
            say(f"  {label} {job[:5]}: {why}")
    if left:
        say(f"error: the budget ({a.budget_s:.0f} s) ran out before {left}: run again with --only "
            f"{','.join(left)} (the table keeps what is there)")
        return 3
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
