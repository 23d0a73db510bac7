"""Requests from config to tokens and spans: what `memra-dist generate` and `demo` do
between argument parsing and exit codes, and the Python API (`open_engine`, `generate`).

This is the only place that chooses between the in-process engine (pp=1: the engine loop,
batching/backend.py, at every --max-batch: a request alone is a batch of one, except on a GPU
where the loop's steps would run eager: there a request alone keeps the solo engine, `_Local`)
and the pipeline (pp>1: the head actor's target). `Engine.generate` drives either, request after request on one
loaded engine, and from several threads at once: up to `Engine.sessions` requests in flight
(pp=1: --max-batch; pp>1: interleaved across the stages, or batched down the ring).
`generate` is an engine opened for one request.
"""

from __future__ import annotations

import json
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from .config import RunConfig
from .specdec.chunks import DEFAULT_PREFILL_CHUNK
from .env import trace_settings
from .errors import UserError
from .model.config import load_config
from .model.tokenizer import StreamDecoder, load_tokenizer
from .phase.lines import fast_path_label
from .phase.report import FanOut, LineSink
from .phase.share import ShareTable
from .plan import RequestPlan, plan_request
from .specdec.request import BurstOut, Request, Result
from .specdec.sampling import SamplingParams

__all__ = ["run_command", "config_from_args", "generate", "open_engine", "Engine", "Result"]

DEMO_PROMPT = "A speculative round has five phases. The drafter"
DEFAULT_ENGINE_CTX = 4096  # open_engine's context rows when neither capacity nor --ctx is given


def _bounds(s: str | None) -> tuple[int, ...] | None:
    if not s:
        return None
    try:
        return tuple(int(x) for x in s.split(","))
    except ValueError:
        raise UserError(f"--stage-bounds '{s}': expected comma-separated layer indices") from None


def config_from_args(args, model: str, draft_model: str | None) -> RunConfig:
    trace = trace_settings(args.trace_level, args.prof)
    drafter = args.drafter or ("model" if draft_model else "ngram")
    ngram_first = getattr(args, "ngram_first", False)
    if drafter == "auto":  # the best drafter these checkpoints allow, prompt lookup first (drafters/choose.py)
        from .specdec.drafters.choose import choose  # noqa: PLC0415

        drafter, first, why = choose(model, draft_model)
        ngram_first = ngram_first or first
        print(f"[memra] --drafter auto: {drafter}{' with --ngram-first' if ngram_first else ''} ({why})",
              file=sys.stderr, flush=True)
    return RunConfig(
        model=model, drafter=drafter, draft_model=draft_model, k=args.k,
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p), seed=args.seed,
        device=args.device, dtype=None if args.dtype == "auto" else args.dtype, ctx=args.ctx,
        pp=args.pp, stage_bounds=_bounds(args.stage_bounds), burst_rounds=args.burst_rounds,
        replay_corrupt=args.replay_corrupt, trace=trace, trace_content=args.trace_content,
        graphs=getattr(args, "graphs", "auto"), compile=getattr(args, "compile", "auto"),
        kernels=getattr(args, "kernels", "auto"), prefill_chunk=getattr(args, "prefill_chunk", DEFAULT_PREFILL_CHUNK),
        prefix_cache=not getattr(args, "no_prefix_cache", False), spec_k=getattr(args, "spec_k", "auto"),
        ngram_first=ngram_first)


# ---- the one request path -------------------------------------------------------------


class _Local:
    """pp=1: the target is a ModelRunner in this process, on the device resolved here; a
    draft model, when the drafter is one, stays loaded between requests too."""

    def __init__(self, plan: RequestPlan):
        import torch  # noqa: PLC0415

        from .device import resolve_device, resolve_dtype  # noqa: PLC0415
        from .progress import LoadProgress  # noqa: PLC0415
        from .runner import ModelRunner  # noqa: PLC0415
        from .threads import apply_cpu_threads  # noqa: PLC0415

        cfg = plan.cfg
        self.torch, self.drafter = torch, None
        self.lock = threading.Lock()  # one session at a time: requests run one after another
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.threads_before = apply_cpu_threads(plan.model, self.device)  # a tiny model decodes fastest on one thread
        try:
            self.runner = ModelRunner(cfg.model, self.device, self.dtype, cfg=plan.model, max_pos=plan.capacity,
                                      progress=LoadProgress(Path(cfg.model).name), **cfg.runner_kwargs(self.device))
        except BaseException:
            self.close()
            raise

    def request(self, plan: RequestPlan, prompt: list[int], span_sink, carrier) -> Request:
        if plan.cfg.drafter in ("model", "dflash", "mtp", "eagle3") and self.drafter is None:  # kept loaded
            from .specdec.drafters import build_drafter  # noqa: PLC0415

            self.drafter = build_drafter(plan.cfg, plan, self.device, self.dtype, len(prompt), target=self.runner)
        return Request(self.runner, plan, prompt, span_sink, drafter=self.drafter)

    @contextmanager
    def session(self, plan: RequestPlan, prompt: list[int], span_sink, carrier):
        """The request holds the runner until it ends or is abandoned (the next request's
        allocation starts its cache over)."""
        with self.lock:
            req = self.request(plan, prompt, span_sink, carrier)
            try:
                yield req
            except BaseException:
                req.flush_trace()  # abandoned: its last burst's spans are built too
                raise

    def close(self) -> None:
        self.torch.set_num_threads(self.threads_before)  # the caller's process is left as it was


class _Pipeline:
    """pp>1: the pipeline's actors, placed once; each request goes to a session slot of the
    head actor (waiting for a free one)."""

    def __init__(self, pipe):
        self.pipe = pipe

    def stats(self) -> dict | None:
        """A batched pipeline's counts (the head's batcher), None when not batched."""
        return self.pipe.batch_stats()

    @contextmanager
    def session(self, plan: RequestPlan, prompt: list[int], span_sink, carrier):
        req = self.pipe.request(plan, prompt, carrier)
        try:
            yield req
        except BaseException:
            try:
                req.release()  # abandoned: the slot is finished and freed; the caller's error wins
            except Exception:  # noqa: BLE001
                pass
            raise
        req.release()


class Engine:
    """A loaded target, in this process (pp=1) or as a placed pipeline (pp>1), serving
    requests with nothing reloaded between them. Every request shares the engine's context
    capacity (so caches and captured graphs are reused). `generate` may be called from up to
    `sessions` threads at once; more callers wait for a session to free."""

    def __init__(self, base: RequestPlan, backend, sessions: int = 1):
        self.cfg, self.model, self.capacity, self._base = base.cfg, base.model, base.capacity, base
        self._backend = backend
        self.sessions = sessions

    def batch_stats(self) -> dict | None:
        """A batched engine's (max_batch > 1) counts: steps, requests and rows a step, the time
        in its steps and between them (batching/stats.py BatchStats); None otherwise."""
        stats = getattr(self._backend, "stats", None)
        return stats() if callable(stats) else None

    def plan(self, prompt_len: int, cfg: RunConfig | None = None) -> RequestPlan:
        cfg = cfg or self.cfg
        same = ("model", "pp", "stage_bounds", "drafter", "draft_model", "device", "dtype", "graphs", "compile", "kernels")
        if any(getattr(cfg, f) != getattr(self.cfg, f) for f in same):
            raise UserError("a request must use the engine's model, split, device and drafter")
        return plan_request(cfg.with_(ctx=self.capacity), prompt_len, self.model, draft=self._base.draft,
                            check_cluster=False)

    def generate(self, prompt: list[int], cfg: RunConfig | None = None, stream=None, sink=None, span_sink=None,
                 carrier: dict | None = None) -> Result:
        """One request, the same loop at every pp (see `generate`). If `stream` raises (a
        client that went away), the request is abandoned, its session freed, and the error
        re-raised here."""
        with self._backend.session(self.plan(len(prompt), cfg), prompt, span_sink, carrier) as req:
            shadow = getattr(req, "feed_in_shadow", None)  # a session in this process
            if sink is not None and shadow is not None:
                shadow(sink)  # its burst records reach the sink while a verify runs, not between bursts
            out = [req.start()]
            if stream is not None:
                stream(out[:])
            while not req.done:
                b = req.burst(stream)
                out.extend(b.tokens)
                _feed(sink, b)
            return Result(out, req.finish())


MAX_SESSIONS = 64  # sessions in flight: each is a cache slot (and its graphs) on every stage


def check_sessions(sessions: int | None, pp: int) -> int:
    """The sessions an engine keeps in flight: default one per pipeline stage (what keeps
    every stage busy); pp=1 runs requests one after another (1)."""
    if sessions is None:
        return pp
    if not 1 <= sessions <= MAX_SESSIONS:
        raise UserError(f"--sessions must be in [1, {MAX_SESSIONS}] (got {sessions})")
    return sessions if pp > 1 else 1


@contextmanager
def open_engine(cfg: RunConfig, capacity: int | None = None, mcfg=None, run_dir: str | None = None,
                lost: list | None = None, sessions: int | None = None, max_batch: int = 1,
                max_batch_tokens: int | None = None, kv_rows: int | None = None):
    """Load the model (pp=1) or place the pipeline (pp>1) once, for any number of requests.
    capacity: the context rows every request shares (default: --ctx, else the model's
    positions up to DEFAULT_ENGINE_CTX: a cache for a model's whole window can be tens of GB).
    sessions: requests in flight at once (pp>1; default one per stage, each a cache slot of
    `capacity` rows on every stage); pp=1 serves one at a time.
    run_dir / lost: the pipeline actors' span files, and the lines naming any role whose
    spans did not all arrive.
    max_batch: up to this many requests in flight, their target forwards joined into one
    forward (batching/: continuous batching over a paged KV cache of `kv_rows` rows, at most
    `max_batch_tokens` rows a forward; at pp > 1 one step down the ring, pipeline/batch_head.py).
    At pp = 1 the engine loop runs every B (1: a request alone is a batch of one), except a request
    alone on a GPU where the loop's steps would run eager (`_alone_on_loop`); at pp > 1, 1 runs
    each request's own rounds on the head (`sessions` interleave down the ring)."""
    mcfg = mcfg or load_config(cfg.model)
    cap = capacity or cfg.ctx or min(mcfg.max_position_embeddings, DEFAULT_ENGINE_CTX)
    n = check_sessions(sessions, cfg.pp)
    base = plan_request(cfg.with_(ctx=cap), 1, mcfg)
    if max_batch != 1 and cfg.pp > 1:  # the sessions' forwards joined into one step down the ring
        from .batching.policy import check_batchable  # noqa: PLC0415
        from .pipeline.driver import open_pipeline  # noqa: PLC0415

        check_batchable(cfg, mcfg, max_batch, base.draft if cfg.drafter == "model" else None)
        if cfg.spec_k == "auto" and cfg.drafter != "none":  # (batching/backend.py: the head's slots do not chain)
            print(f"[memra] --spec-k auto applies at --pp 1; at --pp {cfg.pp} every round drafts -k {cfg.k}",
                  file=sys.stderr, flush=True)
        batched = {"max_tokens": max_batch_tokens, "kv_rows": kv_rows}
        with open_pipeline(base, run_dir, lost, max_batch, batched) as pipe:
            yield Engine(base, _Pipeline(pipe), max_batch)
        return
    if cfg.pp == 1 and (max_batch > 1 or _alone_on_loop(cfg, mcfg)):  # the engine loop: alone, a batch of one
        from .batching.backend import BatchedBackend  # noqa: PLC0415

        batched = BatchedBackend(base, max_batch, max_batch_tokens, kv_rows)
        try:
            yield Engine(base, batched, max_batch)
        finally:
            batched.close()
        return
    if cfg.pp > 1:
        from .pipeline.driver import open_pipeline  # noqa: PLC0415 (Ray only when asked for)

        with open_pipeline(base, run_dir, lost, n) as pipe:
            yield Engine(base, _Pipeline(pipe), n)
        return
    local = _Local(base)  # a request alone where the loop's steps would run eager on the GPU
    try:
        yield Engine(base, local, 1)
    finally:
        local.close()


def _alone_on_loop(cfg: RunConfig, mcfg) -> bool:
    """Whether a request alone at pp 1 (--max-batch 1) runs on the engine loop as a batch of one:
    everywhere its steps replay CUDA graphs or nothing does (CPU), i.e. where `--max-batch auto`
    would batch on a GPU (batching/policy.py `auto_max_batch`). Elsewhere on a GPU (families whose
    batched steps run eager: glm4_moe, deepseek_v3, kimi_linear, a head size the paged kernel does
    not take) an eager step costs ~8.5 ms of launches, so the request keeps
    the solo engine, whose step graphs cover every family."""
    from .batching.policy import auto_max_batch  # noqa: PLC0415
    from .device import resolve_device  # noqa: PLC0415

    dev = resolve_device(cfg.device).type
    return dev != "cuda" or auto_max_batch(cfg, mcfg, dev)[0] > 1


def _feed(sink, out: BurstOut) -> None:
    if sink is None:
        return
    if out.prof is not None:
        sink.first_token(out.prof)
    for rec in out.records:
        sink.burst(rec)
    if out.rounds is not None:
        sink.rounds(*out.rounds)


def generate(cfg: RunConfig, prompt: list[int], stream=None, sink=None, span_sink=None,
             carrier: dict | None = None, run_dir: str | None = None, plan: RequestPlan | None = None,
             lost: list | None = None) -> Result:
    """Generate from token ids: an engine opened for this one request (capacity: prompt +
    new tokens + K + 1, or --ctx), the same loop at every pp.

    stream(tokens): called with tokens as they are committed (each round at pp=1, each burst
    at pp>1). sink: gets each burst's records after the burst (lines, share table, metrics).
    span_sink: builds spans where the session runs (pp=1; pipeline actors make their own).
    carrier / run_dir: the request's W3C context and the run directory for the actors' spans.
    lost: gets one line per pipeline role whose spans did not all arrive."""
    plan = plan or plan_request(cfg, len(prompt))
    with open_engine(cfg, plan.capacity, plan.model, run_dir, lost, sessions=1) as engine:
        return engine.generate(prompt, cfg, stream, sink, span_sink, carrier)


# ---- the CLI command -----------------------------------------------------------------


def _demo_args(args):
    from .demo.prewarm import Prewarm, wanted as prewarm_wanted  # noqa: PLC0415
    from .demo.tiny import demo_checkpoints  # noqa: PLC0415

    say = (lambda s: None) if args.json else (lambda s: print(f"[demo] {s}", file=sys.stderr, flush=True))
    warm = Prewarm(args, args.prompt or DEMO_PROMPT, say) if prewarm_wanted(args) else None
    try:
        target, draft = demo_checkpoints(say, warm.start if warm is not None else None)
        return _demo_models(args, say, target, draft, warm)
    finally:
        if warm is not None:
            warm.close()


def _demo_models(args, say, target, draft, warm):
    from .env import environment  # noqa: PLC0415

    if args.trace_level is None and not environment().trace_level_set:
        args.trace_level = 1  # the demo shows the phase shares unless told otherwise
    draft_model = args.draft_model or (str(draft) if args.drafter in (None, "model", "auto") else None)
    if args.drafter == "dflash" and not args.draft_model:  # the tiny DFlash drafter over the demo target
        from .demo.tiny import demo_dflash  # noqa: PLC0415

        draft_model = str(demo_dflash(say))
    if args.drafter == "eagle3" and not args.draft_model:  # the tiny EAGLE-3 drafter (demo/tiny_eagle3.py)
        from .demo.tiny_eagle3 import demo_eagle3_dir  # noqa: PLC0415

        draft_model = str(demo_eagle3_dir(target, say))
    if args.drafter == "mtp":  # a tiny glm4_moe target with a trained MTP layer (demo/tiny_mtp.py), built once
        from .demo.tiny_mtp import demo_mtp_dir  # noqa: PLC0415

        target = demo_mtp_dir(target.parent, say)
    say(f"tiny target + draft llamas trained on the embedded text, cached in {target.parent}")
    if warm is not None:
        warm.join()  # its kernels in Triton's cache before this engine compiles them
    return str(target), draft_model, args.prompt or DEMO_PROMPT


def run_command(args) -> int:
    if args.cmd == "demo":
        model, draft_model, prompt = _demo_args(args)
    else:
        model, draft_model, prompt = args.model, args.draft_model, args.prompt
    cfg = config_from_args(args, model, draft_model)
    mcfg = load_config(cfg.model)
    tok = load_tokenizer(cfg.model)
    if tok.vocab_size > mcfg.vocab_size:
        raise UserError(f"{cfg.model}: tokenizer has {tok.vocab_size} tokens, the model only {mcfg.vocab_size}")
    if not prompt:
        raise UserError("the prompt is empty")
    ids = tok.encode(prompt)
    if not ids:
        raise UserError("the prompt is empty after tokenizing")
    plan = plan_request(cfg, len(ids), mcfg)
    from .tracing.metrics import MetricsSession  # noqa: PLC0415 (OTel only once the input is good)
    from .tracing.otel import TracingSession  # noqa: PLC0415

    tracing = TracingSession.open(cfg, run_dir=args.run_dir, traceparent=args.traceparent)
    share = ShareTable() if cfg.trace.level >= 1 else None
    metrics = MetricsSession.open(cfg, tracing, getattr(args, "metrics_port", None), getattr(args, "metrics_hold", 0.0))
    local = FanOut(LineSink(cfg.trace), share, metrics.sink)  # driver-side sinks, every pp
    stream = None if args.json else _echo(prompt, StreamDecoder(tok, ids))
    lost: list[str] = []
    try:
        with tracing.request(cfg, prompt, len(ids)) as req:
            result = generate(cfg, ids, stream, local, tracing.sink(), req.carrier(),
                              str(tracing.run_dir) if tracing.run_dir else None, plan, lost)
            text = tok.decode(result.token_ids)
            req.finish(result, text)
    finally:  # normal exit, error or Ctrl-C: spans flushed within the bound
        if tracing.close():
            lost.append("driver")
        metrics.close()
    _report(args, cfg, plan, result, text, share, tracing, complete=not lost)
    return 0


def _echo(prompt: str, dec: StreamDecoder):
    """Prints the prompt with the first token, then the continuation as it streams (nothing
    reaches stdout before the model has produced a token: a failed load prints nothing)."""
    started = []

    def stream(new: list[int]) -> None:
        if not started:
            started.append(True)
            print(prompt, end="")
        print(dec.push(new), end="", flush=True)

    return stream


def _report(args, cfg, plan, result, text, share, tracing, complete: bool = True) -> None:
    st = result.stats
    run_dir = str(tracing.run_dir) if tracing.run_dir is not None else None
    busy = None
    if run_dir is not None and cfg.pp > 1 and cfg.trace.level >= 1:  # which stage waits, from its spans
        from .tracing.stage_busy import busy_of_run_dir  # noqa: PLC0415

        busy = busy_of_run_dir(run_dir)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": text, "stats": st, "run_dir": run_dir,
                          "trace_complete": complete, "capped": plan.capped,
                          "stage_busy": busy.share if busy is not None else None}))
        if run_dir is not None:
            print(_where(run_dir, complete), file=sys.stderr)
        return
    ended = "end of text" if result.token_ids and result.token_ids[-1] in plan.model.eos_token_ids else \
        f"stopped at {st['tokens']} new tokens"
    print(f" [{ended}]")
    print(f"[memra] tokens={st['tokens']} tok/s={st['tok_per_s']} ttft_ms={st['ttft_ms']} rounds={st['rounds']} "
          f"drafted={st['drafted']} "
          f"accepted={st['accepted']} acceptance={st['acceptance']:.3f} tokens/round={st['tokens_per_round']:.2f} "
          f"drafter={cfg.drafter} k={cfg.k} pp={cfg.pp} path={fast_path_label(st.get('fast_path'))}")
    if share is not None and share.n_rounds:
        print(share.table(), file=sys.stderr)
    if busy is not None:
        print(f"[memra] {busy.line()}", file=sys.stderr)
    if run_dir is not None:
        print(_where(run_dir, complete), file=sys.stderr)


def _where(run_dir: str, complete: bool) -> str:
    if not complete:
        return f"[memra] INCOMPLETE trace in {run_dir}: spans were lost (see the warnings above)"
    return (f"[memra] spans written to {run_dir}/: trace.perfetto.json (every process, one file: open it in "
            "ui.perfetto.dev) and *spans.otlp.json (OTLP JSON per process)")
