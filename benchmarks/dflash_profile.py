"""Where a DFlash round's draft and verify(16) go on the GPU (issue 16's two DFlash ratios).

One engine through `open_engine` with the default RunConfig (what `memra-dist generate
--drafter dflash` runs), the bench's 8B Llama target and a random bf16 DFlash b16 drafter
(benchmarks/tap_drafters.py's checkpoints), after one request of a 512-token prompt:
  block   the drafter's block forward as a round replays it (its CUDA graph, 15 draft rows),
          then the round's propose (the same plus the argmax and its one readback), and the
          block once more on the reference attention (the split kernel's share);
  verify  the target's 16-row and 1-row steps (forward + rollback, as a verify / decode);
  round   one more request at level 0 (nothing traced), each piece of the round loop wrapped
          with a host clock: what returns at once is the host's launch cost, what waits on
          the device (accept's readback) includes that wait; the sum against the device time
          of the draft and verify says where a round's host time goes. The verify launch is
          split further (cache.begin, the graph's load, replay_at, the rest of graphs.run),
          and every CUDA graph replay is counted;
each timed with CUDA events over many back-to-back calls (device time per call), and the
kernels of each under torch.profiler, grouped (GEMMs, attention, the rest) with the top ones.
(Eager F.linear calls timed alone measure the host's launches at these sizes, not the GEMM:
the kernel table of the graphed step is the per-GEMM figure.)

    python benchmarks/dflash_profile.py OUT_DIR
Results: OUT_DIR/dflash_profile.json, tables on stderr."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def _say(*a) -> None:
    print("[dflash_profile]", *a, file=sys.stderr, flush=True)


def _events_ms(fn, n: int = 50) -> float:
    """Device ms per call of fn over n back-to-back calls (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def _group(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "gemv", "cutlass", "sm90_", "nvjet", "splitk", "cublas")):
        return "gemm"
    if any(s in n for s in ("attention", "partial_kernel", "merge_kernel", "softmax", "bmm")):
        return "attention"
    return "other"


def _kernels(fn, n: int = 10) -> dict:
    """torch.profiler's kernels of n calls: us per call by group, and the top 12."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / n, e.count / n) for e in prof.key_averages()
            if e.device_time_total > 0 and e.key[:1] != "["]
    groups: dict[str, list[float]] = {}
    for k, us, c in rows:
        g = groups.setdefault(_group(k), [0.0, 0.0])
        g[0] += us
        g[1] += c
    top = sorted(rows, key=lambda r: -r[1])[:12]
    return {"us_per_call": {g: round(v[0], 1) for g, v in groups.items()},
            "kernels_per_call": {g: round(v[1], 1) for g, v in groups.items()},
            "top": [{"kernel": k[:90], "us": round(us, 2), "count": round(c, 2)} for k, us, c in top]}


class _HostClock:
    """Wraps obj.name so each call's host wall is added up (ms), no sync of its own."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []

    def wrap(self, obj, name: str, label: str) -> None:
        import time  # noqa: PLC0415

        fn = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.ms[label] = self.ms.get(label, 0.0) + (time.perf_counter() - t) * 1e3
                self.calls[label] = self.calls.get(label, 0) + 1

        self._undo.append((obj, name, fn, name in vars(obj)))  # own: the attribute was obj's, not its class's
        setattr(obj, name, timed)

    def undo(self) -> None:
        for obj, name, fn, own in reversed(self._undo):
            if own:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)


def _round_host(engine, prompt, cfg) -> dict:
    """Host ms per round of each piece of the round loop (module doc: round)."""
    import time  # noqa: PLC0415

    from memra_dist.specdec import session as sess  # noqa: PLC0415

    d = engine._backend.drafter
    clock = _HostClock()
    clock.wrap(d, "propose", "propose (launch + wait for the drafts)")
    clock.wrap(d.target, "forward", "verify launch")
    clock.wrap(sess, "greedy_commit", "accept (wait for verify + argmax + readback)")
    clock.wrap(d.target, "rollback", "rollback")
    clock.wrap(d, "maintain", "maintain (ingest launch)")
    # inside the verify launch (labels that start with a space: parts of the one above, not summed)
    t = d.target
    clock.wrap(t.cache, "begin", "  of it: cache.begin")
    if t.graphs is not None:
        clock.wrap(t.graphs, "run", "  of it: graphs.run (load + replay + out.clone)")
        for rows, g in t.graphs.graphs.items():
            if rows > 1:
                clock.wrap(g, "load", "  of it: graph load (the ids into the static row)")
                clock.wrap(g, "replay_at", "  of it: replay_at (positions + cudaGraphLaunch)")
        clock.wrap(torch.cuda.CUDAGraph, "replay", "every CUDA graph replay (block, verify, ingest)")
    if d.graph is not None:
        clock.wrap(d.graph, "ingest", "  of it: maintain's ingest replay")
    try:
        stamps: list[float] = []
        res = engine.generate(prompt, cfg, stream=lambda t: stamps.append(time.perf_counter()))
    finally:
        clock.undo()
    rounds = res.stats["rounds"]
    wall = (stamps[-1] - stamps[0]) * 1e3 / max(rounds - 1, 1)
    per = {k: round(v / rounds, 4) for k, v in clock.ms.items()}
    per["round wall (stream to stream)"] = round(wall, 4)
    top = [v for k, v in per.items() if not k.startswith(" ") and not k.startswith("every") and k != "round wall (stream to stream)"]
    per["rest of the loop"] = round(wall - sum(top), 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the host's own ops, per round
        r2 = engine.generate(prompt, cfg.with_(max_new_tokens=48))
    n2 = r2.stats["rounds"]
    top = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)[:20]
    ops = [{"op": e.key[:80], "self_us_per_round": round(e.self_cpu_time_total / n2, 1), "calls_per_round": round(e.count / n2, 2)}
           for e in top]
    calls = {k: round(v / rounds, 2) for k, v in clock.calls.items()}
    return {"rounds": rounds, "ms_per_round": per, "calls_per_round": calls, "cpu_ops": ops}


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dflash_profile")
    out.mkdir(parents=True, exist_ok=True)
    from memra_dist.app import open_engine  # noqa: PLC0415
    from memra_dist.bench import tap_checkpoints as tc  # noqa: PLC0415
    from memra_dist.bench.runs import make_prompt  # noqa: PLC0415
    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.specdec.sampling import SamplingParams  # noqa: PLC0415

    dev = torch.device("cuda")
    cache = Path(os.environ.get("MEMRA_BENCH_CACHE", "/tmp/memra-bench-ckpt"))
    target_dir, draft_dir = tc.ensure_dflash("8b", cache, dev, _say)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    prompt = make_prompt(512, tcfg["vocab_size"])
    cfg = RunConfig(model=str(target_dir), drafter="dflash", draft_model=str(draft_dir), k=15, max_new_tokens=32)
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with open_engine(cfg, len(prompt) + 160 + 16) as engine:
        engine.generate(prompt, cfg)
        d = engine._backend.drafter
        target = d.target
        res["fused"] = hasattr(d.net.layers[0].self_attn, "qkv_w")
        res["kernel_attention"] = bool(d.graph is not None and d.graph.kernel_attn)
        res["compiled_pieces"] = bool(d.graph is not None and d.graph.compiled)
        start, last = d.n, 17
        ctx = list(range(start)) + [last]
        block = lambda: d.block_logits(last, start, 15)  # noqa: E731
        res["block_ms"] = round(_events_ms(block), 4)
        res["propose_ms"] = round(_events_ms(lambda: d.propose(ctx, 15, SamplingParams(), None)), 4)
        res["block_kernels"] = _kernels(block)
        if d.graph is not None and d.graph.kernel_attn:  # the same block on the reference attention, for the split
            d.graph.kernel_attn = False
            d.graph.reset()
            d.graph.warm()
            res["block_ms_reference_attention"] = round(_events_ms(block), 4)
            d.graph.kernel_attn = True
            d.graph.reset()
            d.graph.warm()
        n0 = target.length
        ids16 = torch.randint(10, 1000, (16,), device=dev)
        ids1 = ids16[:1]

        def step(ids):
            def f():
                target.forward(ids, n0)
                target.rollback(n0)
            return f

        res["verify16_ms"] = round(_events_ms(step(ids16)), 4)
        res["decode_ms"] = round(_events_ms(step(ids1)), 4)
        res["verify16_kernels"] = _kernels(step(ids16))
        res["decode_kernels"] = _kernels(step(ids1))
        res["round_host"] = _round_host(engine, prompt, cfg.with_(max_new_tokens=128))
    (out / "dflash_profile.json").write_text(json.dumps(res, indent=1))
    for k in ("fused", "kernel_attention", "compiled_pieces", "block_ms", "block_ms_reference_attention", "propose_ms",
              "verify16_ms", "decode_ms"):
        _say(f"{k}: {res.get(k)}")
    for k in ("block_kernels", "verify16_kernels", "decode_kernels"):
        _say(f"{k}: {json.dumps(res[k]['us_per_call'])} kernels {json.dumps(res[k]['kernels_per_call'])}")
        for t in res[k]["top"]:
            _say(f"   {t['us']:9.2f} us  x{t['count']:<5} {t['kernel']}")
    _say(f"round host ms per round over {res['round_host']['rounds']} rounds (device: block {res['block_ms']}, "
         f"verify(16) {res['verify16_ms']}):")
    calls = res["round_host"]["calls_per_round"]
    for k, v in res["round_host"]["ms_per_round"].items():
        _say(f"   {v:8.4f}  {k}" + (f"  (x{calls[k]} a round)" if k in calls else ""))
    _say("host ops by self time (us per round, one request of 48 tokens, its prime included):")
    for o in res["round_host"]["cpu_ops"]:
        _say(f"   {o['self_us_per_round']:9.1f} us  x{o['calls_per_round']:<6} {o['op']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
