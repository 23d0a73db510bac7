"""`memra-dist batch`: the subparser (added by memra_dist/cli.py) and its handler.

memra_dist/cli.py hands in its generate flag set (`add_batch_parser(sub, _add_run_args)`):
nothing here imports memra_dist.cli, which imports this package (no import cycle)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from ..batching.policy import AUTO_MAX_BATCH, check_batchable, max_batch_arg, resolve_max_batch
from ..errors import UserError
from .batch_input import DEFAULT_MAX_LINE_BYTES, MAX_LINE_BYTES, MIN_LINE_BYTES
from .body_size import parse_size

__all__ = ["add_batch_parser", "run_batch"]

DESCRIPTION = """\
A resumable batch job: the model loads once (or the pipeline is placed once, --pp > 1), then
every request of --input runs on it. --input holds one JSON object a line: "id" (string or
integer, unique) and "prompt" (string), optionally "max_new_tokens", "temperature", "top_p",
"top_k", "seed" (else the flags below). --output gets one line per request as it finishes:
{"id", "token_ids", "text", "stats"}, or {"id", "error"} for a request refused (the job goes
on; a request that fails inside the engine gets one too: "the engine failed: ..."), or
{"line", "error"} for a line without a usable id. A line over --max-line-bytes gets a
{"line", "error"} record unread: it is read past in bounded pieces, never parsed nor held
whole, and the lines around it run; a prompt far longer than the context is refused after
about the context's worth of tokenizing. Run the same command again to resume: ids already
in --output are skipped, error records included (delete a record to run its request again);
an --output whose records hold other prompts for this input's ids is refused.
--temperature (and a line's "temperature") below 1e-5 is greedy, and so is a top_p below
the top token's probability (that token always stays). With --trace-level >= 1 (or
--prof) every request's spans go to the run directory (--run-dir) or OTLP, as generate's.
Progress on stderr. Exit 0 when the job ran (refused and failed requests included), 2 for
bad arguments, 1 when the engine failed on 3 requests in a row, 130 when interrupted
(Ctrl-C, SIGTERM)."""


# generate's flags that a batch accepts and does not use (its output is always JSON lines);
# --metrics-port / --metrics-hold are not a batch's flags at all
IGNORED = (("--json", "json", False),)


def _add_args(b: argparse.ArgumentParser, add_run_args: Callable[..., None]) -> None:
    b.add_argument("--model", required=True, metavar="DIR",
                   help="HF checkpoint directory (config.json + *.safetensors + tokenizer.json)")
    b.add_argument("--input", required=True, metavar="JSONL", help="requests, one JSON object a line")
    b.add_argument("--output", required=True, metavar="JSONL",
                   help="results, one JSON object a line, appended as requests finish (created if absent)")
    b.add_argument("--max-line-bytes", default=str(DEFAULT_MAX_LINE_BYTES), metavar="N",
                   help="longest input line, in bytes (4194304, 4MiB, 512k; default 4MiB, as serve's "
                        "--max-body-bytes); a longer line gets a {\"line\", \"error\"} record without being read "
                        "whole, and the job goes on")
    add_run_args(b, demo=True, metrics=False)  # generate's flag set but --model / --prompt and the metrics endpoint
    b.add_argument("--sessions", type=int, default=None, metavar="S",
                   help="requests in flight at once (--pp > 1; default: one per stage, so every stage "
                        "works; each is a cache slot of --ctx rows on every stage); --pp 1 runs one at a time")
    b.add_argument("--max-batch", type=max_batch_arg, default=None, metavar="B",
                   help="up to B requests in flight with their forwards joined into one (at --pp > 1 one step "
                        "down the ring; continuous batching over a paged KV cache; every drafter and family); each "
                        "request gets the ids "
                        f"it gets alone; 1: one after another (default auto: {AUTO_MAX_BATCH} on a GPU for "
                        "llama / qwen2 / qwen3 shapes whose batched steps replay CUDA graphs, as measured, else 1)")
    b.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                   help="with --max-batch: at most N rows a forward (default: max(--prefill-chunk, B x (k + 1)))")
    b.add_argument("--kv-rows", type=int, default=None, metavar="N",
                   help="with --max-batch: the paged KV cache's rows (default: B x --ctx, at most what free "
                        "memory holds); a request waits while the cache cannot hold its rows")
    b.set_defaults(max_new_tokens=64, burst_rounds=8)  # generate's defaults, not the demo's
    for a in b._actions:  # noqa: SLF001 (two helps that read differently for a batch)
        if a.dest == "ctx":
            a.help = ("context rows every request shares (default: the longest prompt + the largest "
                      "max_new_tokens + k + 1, at most the model's positions)")
        elif a.dest == "json":
            a.help = argparse.SUPPRESS  # the output is always JSON lines


def add_batch_parser(sub, add_run_args: Callable[..., None]) -> argparse.ArgumentParser:
    """`sub`: the CLI's subparsers; add_run_args: memra_dist.cli._add_run_args (generate's flags)."""
    b = sub.add_parser("batch", help="run a JSONL file of prompts on one loaded model, resumable",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(b, add_run_args)
    return b


def run_batch(args) -> int:
    """The handler: an exit code (bad arguments: one stderr line, 2)."""
    try:
        return _run(args)
    except UserError as e:
        print(f"memra-dist: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # before the job started (its own Ctrl-C path returns 130 itself)
        print("memra-dist: interrupted", file=sys.stderr)
        return 130


def _max_line_bytes(v) -> int:
    if isinstance(v, int):
        n = v
    else:
        try:
            n = parse_size(v)
        except ValueError as e:
            raise UserError(f"--max-line-bytes: {e}") from None
    if not MIN_LINE_BYTES <= n <= MAX_LINE_BYTES:
        raise UserError(f"--max-line-bytes {v}: expected {MIN_LINE_BYTES} bytes (1KiB) to {MAX_LINE_BYTES} (1GiB)")
    return n


def _run(args) -> int:
    from pathlib import Path  # noqa: PLC0415

    from ..app import config_from_args, open_engine  # noqa: PLC0415 (torch only once the arguments parse)
    from ..model.config import load_config  # noqa: PLC0415
    from ..model.tokenizer import load_tokenizer  # noqa: PLC0415
    from .batch import run_job  # noqa: PLC0415

    src = Path(args.input)
    if not src.exists():
        raise UserError(f"--input {src}: no such file")
    if src.is_dir():
        raise UserError(f"--input {src}: is a directory")
    max_line = _max_line_bytes(getattr(args, "max_line_bytes", DEFAULT_MAX_LINE_BYTES))
    ignored = [flag for flag, dest, off in IGNORED if getattr(args, dest, off) != off]
    if ignored:
        print(f"memra-dist: note: batch does not use {', '.join(ignored)}", file=sys.stderr)
    cfg = config_from_args(args, args.model, args.draft_model)
    mcfg = load_config(cfg.model)
    batching = None
    args.max_batch = resolve_max_batch(args.max_batch, cfg, mcfg)  # auto: where this job runs its engine
    if args.max_batch != 1 or args.max_batch_tokens is not None or args.kv_rows is not None:
        check_batchable(cfg, mcfg, args.max_batch)
        for flag, v in (("--max-batch-tokens", args.max_batch_tokens), ("--kv-rows", args.kv_rows)):
            if v is not None and v < 1:
                raise UserError(f"{flag} must be >= 1 (got {v})")
        if args.max_batch > 1:
            batching = {"max_batch": args.max_batch, "max_batch_tokens": args.max_batch_tokens,
                        "kv_rows": args.kv_rows}
    tok = load_tokenizer(cfg.model)
    if tok.vocab_size > mcfg.vocab_size:
        raise UserError(f"{cfg.model}: tokenizer has {tok.vocab_size} tokens, the model only {mcfg.vocab_size}")
    from ..tracing.otel import TracingSession  # noqa: PLC0415 (OTel only once the input is good)

    # traced (--trace-level >= 1 or --prof): one memra.request span per request, as generate's
    tracing = TracingSession.open(cfg, run_dir=args.run_dir, traceparent=args.traceparent)
    lost: list[str] = []
    try:
        code = run_job(cfg, args.input, args.output, tokenizer=tok, max_pos=mcfg.max_position_embeddings,
                       open_engine=open_engine, ctx=args.ctx, sessions=args.sessions, tracing=tracing, lost=lost,
                       batching=batching, max_line_bytes=max_line)
    finally:  # a normal end, an error or Ctrl-C: spans flushed within the bound
        if tracing.close(metrics_follow=False):
            lost.append("driver")
    if tracing.run_dir is not None:
        where = (f"INCOMPLETE trace in {tracing.run_dir}: spans were lost (see the warnings above)" if lost else
                 f"spans written to {tracing.run_dir}/: trace.perfetto.json and *spans.otlp.json")
        print(f"[batch] {where}", file=sys.stderr)
    return code
