"""What `memra-dist generate` and `demo` do, between argument parsing and exit codes."""

from __future__ import annotations

import json
import os
import sys

from .config import RunConfig
from .errors import UserError
from .model.config import load_config
from .model.tokenizer import StreamDecoder, load_tokenizer
from .phase.levels import resolve
from .phase.report import FanOut, LineSink
from .phase.share import ShareTable
from .specdec.sampling import SamplingParams
from .tracing.metrics import MetricsSession
from .tracing.otel import TracingSession

__all__ = ["run_command", "config_from_args"]

DEMO_PROMPT = "A speculative round has five phases. The drafter"


def _bounds(s: str | None) -> tuple[int, ...] | None:
    if not s:
        return None
    try:
        return tuple(int(x) for x in s.split(","))
    except ValueError:
        raise UserError(f"--stage-bounds '{s}': expected comma-separated layer indices") from None


def config_from_args(args, model: str, draft_model: str | None) -> RunConfig:
    trace = resolve(args.trace_level, args.prof)
    drafter = args.drafter or ("model" if draft_model else "ngram")
    return RunConfig(
        model=model, drafter=drafter, draft_model=draft_model, k=args.k,
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p), seed=args.seed,
        device=args.device, dtype=None if args.dtype == "auto" else args.dtype, ctx=args.ctx,
        pp=args.pp, stage_bounds=_bounds(args.stage_bounds), burst_rounds=args.burst_rounds,
        replay_corrupt=args.replay_corrupt, trace=trace, trace_content=args.trace_content,
        graphs=getattr(args, "graphs", "auto"), compile=bool(getattr(args, "compile", False)))


def _demo_args(args):
    from .model.tiny import demo_checkpoints  # noqa: PLC0415

    say = (lambda s: None) if args.json else (lambda s: print(f"[demo] {s}", file=sys.stderr, flush=True))
    target, draft = demo_checkpoints(say)
    if args.trace_level is None and not os.environ.get("MEMRA_SPEC_TRACE") and not os.environ.get("MEMRA_GLM5_SPEC_TRACE"):
        args.trace_level = 1  # the demo shows the phase shares unless told otherwise
    draft_model = args.draft_model or (str(draft) if args.drafter in (None, "model") else None)
    prompt = args.prompt or DEMO_PROMPT
    say(f"tiny target + draft llamas trained on the embedded text ({target.parent}); prompt: {prompt!r}")
    return str(target), draft_model, prompt


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
    tracing = TracingSession.open(cfg, run_dir=args.run_dir, traceparent=args.traceparent)
    share = ShareTable() if cfg.trace.level >= 1 else None
    metrics = MetricsSession.open(cfg, tracing, getattr(args, "metrics_port", None), getattr(args, "metrics_hold", 0.0))
    # driver-side sinks; at pp > 1 the head actor emits the round spans itself
    local = FanOut(LineSink(cfg.trace), share, metrics.sink)
    dec = StreamDecoder(tok)
    stream = None if args.json else (lambda new: print(dec.push(new), end="", flush=True))
    try:
        with tracing.request(cfg, prompt, len(ids)) as req:
            result = _run(cfg, ids, stream, local, tracing, req)
            text = tok.decode(result.token_ids)
            req.finish(result, text)
    finally:  # normal exit, error or Ctrl-C: spans flushed within the bound
        tracing.close()
        metrics.close()
    _report(args, cfg, result, text, share, tracing)
    return 0


def _run(cfg: RunConfig, ids, stream, local: FanOut, tracing, req):
    if cfg.pp > 1:
        from .pipeline.driver import run_pipeline  # noqa: PLC0415 (Ray only when asked for)

        return run_pipeline(cfg, ids, stream, req.carrier(), tracing.run_dir, local)
    from .request import run_local  # noqa: PLC0415

    return run_local(cfg, ids, stream, FanOut(local, tracing.sink()))


def _report(args, cfg, result, text, share, tracing) -> None:
    st = result.stats
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": text, "stats": st}))
        return
    print()
    print(f"[memra] tokens={st['tokens']} tok/s={st['tok_per_s']} rounds={st['rounds']} drafted={st['drafted']} "
          f"accepted={st['accepted']} acceptance={st['acceptance']:.3f} tokens/round={st['tokens_per_round']:.2f} "
          f"drafter={cfg.drafter} k={cfg.k} pp={cfg.pp}")
    if share is not None and share.n_rounds:
        print(share.table(), file=sys.stderr)
    if tracing.run_dir is not None:
        print(f"[memra] trace written to {tracing.run_dir} (spans.otlp.json; open trace.perfetto.json in ui.perfetto.dev)",
              file=sys.stderr)
