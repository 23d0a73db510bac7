"""Batched requests (memra_dist/batching/) against one at a time, timed from the outside.

N concurrent callers of one engine (`open_engine(..., max_batch=B)`, the Python API that `batch`
and `serve --max-batch` run) each generate one request; every token is stamped as the caller's
stream callback receives it. Per setting: aggregate decode tok/s (all tokens after each
request's first / the wall from the first caller's start to the last token), per-request
inter-token latency p50 / p99 (gaps between a request's stream callbacks, divided by the
tokens each delivered), time to first token p50 / p99, and the batcher's own counts (steps,
mean requests and rows a step, mean step ms, the share of the time the device ran steps while
requests were mid-generation ("busy": the rest went to their host work between steps), graph
replays). B = 1 is the one-at-a-time engine
(requests queue for it). Before the timed run the same n callers run 8 tokens each (the warm-up
every server gets from its first requests: kernel JIT, the graphs of the step sizes the run
takes); the batcher's counts cover the timed run only. "decode tok/s" counts from the first
request's first token (the aggregate from the callers' start, prefills included); "steady tok/s"
counts the tokens received while every request was in flight (from the last request's first
token to the first request's last): the batch's decode rate with no prefill step in it.

    python benchmarks/batching.py OUT_DIR [--shape tiny] [--device cpu] [--concurrency 1,4,16]
        [--max-batch 16] [--new 64] [--prompt 64] [--drafter none]
Results: OUT_DIR/batching.json, OUT_DIR/speedup.svg and, where matplotlib is installed, speedup.png (each
drafter row's steady tok/s over plain's at its concurrency, by --spec-k: memra_dist/bench/plot.py) and a markdown table on stdout. The measurement is
memra_dist/bench/batching.py's (`memra-dist bench --sections batching` runs its fixed settings
with repeats and targets)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@contextlib.contextmanager
def _profiled(path: Path):
    """torch.profiler over the block; its op tables (host and device time) written to `path`,
    its timeline beside it (`path` .trace.json.gz: chrome://tracing or ui.perfetto.dev)."""
    import gzip
    import tempfile

    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    try:  # the engine loop's thread too, and the host's waits on the device (torch >= 2.7)
        from torch._C._profiler import _ExperimentalConfig

        kw = {"experimental_config": _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)}
    except (ImportError, TypeError):
        kw = {}
    with torch.profiler.profile(activities=acts, **kw) as prof:
        yield
    ka = prof.key_averages()
    text = ka.table(sort_by="self_cpu_time_total", row_limit=45)
    if torch.cuda.is_available():
        text += "\n\n" + ka.table(sort_by="self_device_time_total", row_limit=30)
    path.write_text(text)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        data = raw.read_bytes()
    with gzip.open(path.with_suffix(".trace.json.gz"), "wb") as g:
        g.write(data)
    from memra_dist.bench.idle import format_idle, idle_gaps

    path.with_suffix(".idle.txt").write_text(format_idle(idle_gaps(json.loads(data)["traceEvents"])))


@contextlib.contextmanager
def _loop_idents(idents: list[int]):
    """Every engine loop thread started in the block (batching/batcher.py `_run`) appends its
    thread's ident to `idents`."""
    import threading

    from memra_dist.batching.batcher import Batcher

    orig = Batcher._run

    def run(self):
        idents.append(threading.get_ident())
        orig(self)

    Batcher._run = run
    try:
        yield
    finally:
        Batcher._run = orig


@contextlib.contextmanager
def _loop_sampled(path: Path, idents: list[int]):
    """The latest engine loop thread's stack sampled over the block (memra_dist/bench/loop_sampler.py):
    where its time went, on the CPU or waiting (the device, a lock, the interpreter), to `path`."""
    from memra_dist.bench.loop_sampler import Sampler, format_summary, summarize

    if not idents:  # (a one-at-a-time engine: its requests run on their own threads)
        path.write_text("no engine loop ran in this row\n")
        yield
        return
    s = Sampler(idents[-1]).start()
    try:
        yield
    finally:
        path.write_text(format_summary(summarize(s.stop(), top=40)))


@contextlib.contextmanager
def _each(factories):
    with contextlib.ExitStack() as stack:
        for f in factories:
            stack.enter_context(f())
        yield


def _draft_read(row: dict, drafter: str, target: str, draft: str, device: str, prompt: int, new: int,
                memo: dict) -> dict | None:
    """A tap drafter row's draft phase (its level-1 rounds) against what its draft forwards read
    (memra_dist/bench/batching.py draft_over_read), at this device's copy bandwidth (measured
    once); None where no level-1 round drafted."""
    import torch

    import memra_dist.bench.tap_checkpoints as tc
    from memra_dist.bench.batching import K, draft_over_read
    from memra_dist.bench.timing import copy_bandwidth

    ms = ((row.get("phases_ms_a_round") or {}).get("1") or {}).get("draft")
    if not ms:
        return None
    dcfg = json.loads((Path(draft) / "config.json").read_text())
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if drafter == "dflash-replay":
        w, forwards = tc.dflash_read_bytes(dcfg, json.loads((Path(target) / "config.json").read_text()), dtype), 1
    else:
        w, forwards = tc.eagle3_read_bytes(dcfg, K, dtype), K
    if "bw" not in memo:
        memo["bw"] = copy_bandwidth(torch.device(device), 1 << 30 if device.startswith("cuda") else 1 << 26)
    requests = (row.get("batcher") or {}).get("mean_draft_batch") or row["concurrency"]
    out = draft_over_read(ms, forwards, w["bytes"], tc.draft_kv_bytes(dcfg, dtype), requests, prompt + new / 2,
                          memo["bw"]["bandwidth_bytes_s"])
    return {**out, "requests_a_forward": requests, "context": prompt + new / 2, "weight_bytes": w["bytes"],
            "bandwidth_tb_s": round(memo["bw"]["bandwidth_tb_s"], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory for batching.json")
    ap.add_argument("--shape", default="tiny", help="a bench shape (memra_dist/bench/shapes), random weights")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the default path there)")
    ap.add_argument("--concurrency", default="1,4,16", help="concurrent callers, comma-separated; each N runs "
                    "one at a time (max batch 1) and batched")
    ap.add_argument("--max-batch", type=int, default=16, help="the batched engine's --max-batch (at most N)")
    ap.add_argument("--new", type=int, default=64, help="tokens each request generates")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (copy-with-edits prompts)")
    ap.add_argument("--drafter", default="none", help="none, ngram, replay (greedy; k = 4), or dflash-replay / "
                    "eagle3-replay / mtp-replay (mtp: the target is a glm4_moe slice of GLM-4.5-Air's widths at "
                    "--shape 8b, 1 dense + 3 MoE layers and its MTP layer; tiny at --shape tiny): the bench's "
                    "random drafter over the target drafting in full (at concurrency 1, "
                    "one request on an engine of --max-batch 2, or with --max-batch 1 an engine of one), "
                    "its drafts replaced by each request's plain greedy ids (recorded by a plain run first) "
                    "corrupted at --corrupt")
    ap.add_argument("--corrupt", default="0.2", help="the replay drafters' corruption rates, comma-separated, "
                    "each a row of its own: 0.2 leaves ~0.8 of the drafts right, 0.4 ~0.6, 1.0 none (a drafter "
                    "that never pays: what --spec-k auto must not lose to plain)")
    ap.add_argument("--spec-k", default="fixed", help="the drafter rows' --spec-k, comma-separated: fixed, auto "
                    "or fixed,auto (each a row of its own on the same recordings)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request of the drafter rows sampled at "
                    "this temperature (top-k 50, request i seeded i; default 0: greedy). The replay drafters still "
                    "draft the plain greedy recordings; the ids are not checked against one at a time")
    ap.add_argument("--no-prefix-cache", action="store_true", help="the engines' --no-prefix-cache: every run "
                    "prefills its prompts whole (with the cache on, the warm-up has cached the timed runs' prompts, "
                    "so TTFT is a cached prompt's; off, it is the first token under load)")
    ap.add_argument("--levels", default="0", help="trace levels, comma-separated: each run at each level in turn "
                    "(the batched rows only; the row's by_level has each level's steady tok/s)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per setting (and level)")
    ap.add_argument("--no-spans", action="store_true", help="levels >= 1 with the share tables alone, no span sink "
                    "(what the spans cost)")
    ap.add_argument("--switch-ms", type=float, default=None, help="the interpreter's GIL switch interval for the run "
                    "(sys.setswitchinterval; tracing sets 0.5 ms)")
    ap.add_argument("--only-batched", action="store_true", help="skip the one-at-a-time engine at N > 1; at N = 1, one request on a batched engine of --max-batch 2")
    ap.add_argument("--own-drafts", action="store_true", help="the tap drafters' requests run their own rounds, "
                    "each drafting alone in its thread (Drafter.chains off: how they ran before the step leader "
                    "drafted them together; what the shared draft forwards save)")
    ap.add_argument("--torch-profile", action="store_true", help="the drafter row's last timed run under "
                    "torch.profiler: OUT/profile-N-SPECK.txt, the ops by host time and by device time, its "
                    "timeline beside it (.trace.json.gz) and where the device idled, with the host work in those "
                    "gaps by thread (.idle.txt: memra_dist/bench/idle.py; a diagnostic: it slows the run)")
    ap.add_argument("--loop-profile", action="store_true", help="each drafter row's engine loop thread's stack "
                    "sampled every ms over its last timed run: OUT/loop-N-SPECK.txt, where its time went by "
                    "function and stack, on the CPU or waiting (for the device, a lock, or the interpreter shared "
                    "with the request threads: memra_dist/bench/loop_sampler.py)")
    ap.add_argument("--stub-device-ms", type=float, default=None, help="CPU diagnostic: each batched step also "
                    "sleeps this long (the GIL released), standing in for a GPU's step, so the loop's host work "
                    "between steps contends with the streaming request threads as on a GPU's host (the loop's "
                    "ms a step are the figures to read; tok/s are the tiny model's)")
    a = ap.parse_args()
    import torch

    if a.stub_device_ms is not None:
        import time as _time

        import memra_dist.batching.batcher as batcher

        real_launch = batcher.launch

        def launch(b, jobs, wakes, ids_dev=None):
            out = real_launch(b, jobs, wakes, ids_dev)
            _time.sleep(a.stub_device_ms / 1e3)
            return out
        batcher.launch = launch

    if a.switch_ms is not None:
        import memra_dist.tracing.otel as otel

        otel.GIL_SWITCH_S = a.switch_ms / 1e3
        sys.setswitchinterval(a.switch_ms / 1e3)
    if a.own_drafts:
        from memra_dist.specdec.drafters import dflash, eagle3, mtp

        for cls in (dflash.DFlashDrafter, eagle3.Eagle3Drafter, mtp.MTPDrafter):
            cls.chains = False

    from memra_dist.bench.batching import concurrent, graphed_ms, per_step
    from memra_dist.bench.plot import png, speedups, svg

    try:  # the PNG beside the SVG where matplotlib is installed (else: python -m memra_dist.bench.plot OUT/batching.json)
        import matplotlib  # noqa: F401

        have_png = True
    except ImportError:
        have_png = False
    from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint

    import memra_dist.bench.tap_checkpoints as tc

    say = lambda s: print(f"[batching] {s}", file=sys.stderr)  # noqa: E731
    if a.drafter == "mtp-replay":  # the target is a glm4_moe slice holding its MTP layer
        model = str(tc.ensure_glm_mtp(a.shape, bench_cache_dir(), torch.device(a.device), say))
    else:
        model = str(ensure_checkpoint(a.shape, bench_cache_dir(), torch.device(a.device), say))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tap, draft = a.drafter.endswith("-replay") and a.drafter != "replay", None
    if a.drafter in ("dflash-replay", "eagle3-replay"):
        ensure = {"dflash-replay": tc.ensure_dflash, "eagle3-replay": tc.ensure_eagle3}[a.drafter]
        draft = str(ensure(a.shape, bench_cache_dir(), torch.device(a.device), say)[1])
    rows, idents, bw_memo = [], [], {}
    for n in (int(x) for x in a.concurrency.split(",")):
        sizes = (1,) if n == 1 else (min(a.max_batch, n),) if a.only_batched else (1, min(a.max_batch, n))
        if (tap or a.only_batched) and n == 1 and a.max_batch > 1:  # the replay drafters (and --only-batched)
            sizes = (2,)  # at N = 1: one request on a batched engine (`serve --max-batch N` alone)
        for b in sizes:
            levels = tuple(int(x) for x in a.levels.split(",")) if b > 1 else (0,)
            kw = {}
            if tap:  # each request's plain greedy ids first: the replay's recordings (and the lossless check)
                plain = concurrent(model, a.device, n, b, a.new, a.prompt, "none", repeats=a.repeats,
                                   prefix_cache=not a.no_prefix_cache)
                kw = dict(draft_model=draft, recorded=plain.pop("ids"))
                rows.append(plain)
            ks = a.spec_k.split(",") if a.drafter != "none" and b > 1 else ["fixed"]
            replays = a.drafter.endswith("replay")
            corrupts = [float(c) for c in a.corrupt.split(",")] if replays else [None]
            for corrupt, spec_k in ((c, k) for c in corrupts for k in ks):
                tag = f"{n}-{spec_k}" + (f"-c{corrupt:g}" if len(corrupts) > 1 else "")
                if corrupt is not None:
                    kw["corrupt"] = corrupt
                prof = []  # around the row's last timed run
                if a.torch_profile:
                    prof.append(lambda p=out / f"profile-{tag}.txt": _profiled(p))
                if a.loop_profile:
                    prof.append(lambda p=out / f"loop-{tag}.txt": _loop_sampled(p, idents))
                kw.pop("profile", None)
                if prof:
                    kw["profile"] = lambda fs=tuple(prof): _each(fs)
                idents.clear()  # (this row's engine loop only)
                with _loop_idents(idents) if a.loop_profile else contextlib.nullcontext():
                    r = concurrent(model, a.device, n, b, a.new, a.prompt, a.drafter, repeats=a.repeats, levels=levels,
                                   spans_on=not a.no_spans, spec_k=spec_k, prefix_cache=not a.no_prefix_cache,
                                   temperature=a.temperature, **kw)
                if corrupt is not None:
                    r["corrupt"] = corrupt
                if a.temperature > 0:
                    pass  # (sampled: no greedy ids to check against)
                elif tap:
                    r["ids_equal_alone"] = sum(x == y for x, y in zip(r["ids"], kw["recorded"]))
                    if spec_k == "fixed" and draft is not None:  # its level-1 draft phase against its forwards' reads
                        dr = _draft_read(r, a.drafter, model, draft, a.device, a.prompt, a.new, bw_memo)
                        if dr is not None:
                            r["draft_read"] = dr
                elif b == 1:
                    alone = r["ids"]
                elif not a.only_batched:  # greedy: each request's ids against the one-at-a-time engine's (bf16 may differ)
                    r["ids_equal_alone"] = sum(x == y for x, y in zip(r["ids"], alone))
                del r["ids"]
                rows.append(r)
                print(f"[batching] {json.dumps(r)}", file=sys.stderr, flush=True)
                (out / "batching.json").write_text(json.dumps({"shape": a.shape, "device": a.device,
                                                               "drafter": a.drafter, "new": a.new,
                                                               "prompt": a.prompt, "rows": rows}, indent=1))
                (out / "speedup.svg").write_text(svg(speedups(rows), f"steady decode over plain, {a.shape} on "
                                                                     f"{a.device} (batching.json beside)"))
                if have_png:
                    png(speedups(rows), out / "speedup.png", f"steady decode over plain, {a.shape} on {a.device}")
    print("| drafter (K, corrupt) | concurrent | max batch | decode tok/s | steady tok/s | aggregate tok/s "
          "| ITL p50 / p99 ms | gap p50 / p99 ms | first gap p50 / p99 ms | TTFT p50 / p99 ms | tokens a round | requests / rows a step | requests a draft forward "
          "| step ms | graphed step ms | busy | idle ms a step: all / rounds / held | device idle ms a step (median): after / before verify "
          "| steps launched ahead: all / verifies (of steps) | ids = alone |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bs = r["batcher"] or {}
        name = r["drafter"] + (f" {r['spec_k']}" if r["drafter"] != "none" and r.get("spec_k") else "") + (
            f" c{r['corrupt']:g}" if "corrupt" in r else "") + (f" t{r['temperature']:g}" if "temperature" in r else "")
        print(f"| {name} | {r['concurrency']} | {r['max_batch']} | {r['decode_tok_s']} | {r['steady_tok_s'] or '-'} "
              f"| {r['aggregate_tok_s']} | {r['itl_ms_p50']} / {r['itl_ms_p99']} "
              f"| {r['gap_ms_p50']} / {r['gap_ms_p99']} | {r['first_gap_ms_p50']} / {r['first_gap_ms_p99']} | {r['ttft_ms_p50']} / {r['ttft_ms_p99']} "
              f"| {r.get('tokens_per_round') or '-'} | {bs.get('mean_requests', 1.0)} / {bs.get('mean_rows', '-')} "
              f"| {bs.get('mean_draft_batch') or '-'} | {bs.get('mean_step_ms', '-')} "
              f"| {graphed_ms(bs)} | {bs.get('busy', '-')} | {per_step(bs, 'gap_ms')} / {per_step(bs, 'leader_rounds_ms')} "
              f"/ {per_step(bs, 'held_ms')} | {bs.get('device_idle_after_step_p50_ms') or '-'} / "
              f"{bs.get('device_idle_before_verify_p50_ms') if bs.get('device_idle_steps') else '-'} "
              f"| {bs.get('ahead_steps', '-')} / {bs.get('ahead_verify_steps', '-')} ({bs.get('steps', '-')}) "
              f"| {r.get('ids_equal_alone', '-')} |")
    for r in rows:
        if r.get("draft_read"):
            d = r["draft_read"]
            print(f"\n{r['drafter']} at {r['concurrency']}: the draft phase {d['draft_ms_a_step']} ms a step (level 1, "
                  f"{d['requests_a_forward']} requests a forward) = {d['over_read']}x its {d['forwards']} forward(s)' "
                  f"read ({d['read_ms']} ms at {d['bandwidth_tb_s']} TB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
