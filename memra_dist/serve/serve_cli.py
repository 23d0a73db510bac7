"""`memra-dist serve`: the subparser (added by memra_dist/cli.py), the handler, and the same
flags parsed from a list (a RayService's `args` are these flags: serve/entry.py).

memra_dist/cli.py hands in its generate flag set (`add_serve_parser(sub, _add_run_args)`):
nothing here imports memra_dist.cli, which imports this package (no import cycle)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

from ..batching.policy import AUTO_MAX_BATCH, check_batchable, max_batch_arg
from ..errors import UserError
from .body_size import DEFAULT_MAX_BODY_BYTES, parse_size

__all__ = ["add_serve_parser", "run_serve", "parse_serve_argv", "spec_argv", "check_serve_deps", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'memra_dist[serve]'"

DESCRIPTION = """\
An OpenAI-compatible HTTP API on Ray Serve: the model loads once (or the pipeline is placed
once, --pp > 1) in one Serve replica, which answers

  POST /v1/completions   {"prompt": "...", "max_tokens": 64, "temperature": 0, "top_p": 1,
                          "seed": 0, "stream": true}  (stream: Server-Sent Events, data: [DONE] last)
  GET  /v1/models, GET /health, GET /metrics (Prometheus text)

Up to --sessions requests generate at once (--max-batch batches that many into shared
forwards: by default 16 on a GPU at --pp 1 for llama / qwen2 / qwen3 shapes whose batched
steps replay CUDA graphs, else 1); up to --max-queue more wait for a session, and a
request beyond that is answered 429 at once. A bad body is a 400 naming the field; a prompt
that does not fit the context (--ctx) is a 400; a body that is not JSON, a 415; one over
--max-body-bytes, a 413; one not whole within 10 s, a 408. A client that disconnects frees
its session at the engine's next round. A `traceparent` header makes the request's
memra.request span a child of the caller's trace (spans need --trace-level >= 1 and
OTEL_EXPORTER_OTLP_ENDPOINT).
The generation flags below are the defaults of requests that leave a field out.
Listens on 127.0.0.1 unless --host says otherwise. With RAY_ADDRESS set, the application is
deployed on that cluster's Serve.

Stopping: SIGTERM (systemd, Kubernetes) drains: a new completion is answered 503 (code
"draining") and GET /health 503 {"status": "draining", ...}, while the requests in flight and
queued finish, for up to --drain-timeout seconds; then it exits 0. A second SIGTERM (or
Ctrl-C), or the timeout, cuts what is left: a begun stream ends with an error event (code
"shutting_down"), then data: [DONE]; a request not yet streaming gets a 503. Ctrl-C stops at
once, cutting the same way, exit 0."""

# generate's flags that a server does not use: a request brings its own prompt and traceparent
IGNORED = (("--json", "json", False), ("--metrics-port", "metrics_port", None), ("--metrics-hold", "metrics_hold", 0.0),
           ("--run-dir", "run_dir", None), ("--traceparent", "traceparent", None))


def _add_args(p: argparse.ArgumentParser, add_run_args: Callable[..., None]) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="HF checkpoint directory (config.json + *.safetensors + tokenizer.json); "
                        "its directory name is the model id the API answers to")
    add_run_args(p, demo=True)  # generate's flag set; demo=True leaves out --model / --prompt
    p.set_defaults(max_new_tokens=64, burst_rounds=8)  # generate's defaults, not the demo's
    g = p.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 = every interface)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    g.add_argument("--sessions", type=int, default=None, metavar="S",
                   help="requests the engine generates at once, each in its own context rows (default: one per "
                        "pipeline stage, --pp; at --pp 1 requests run one at a time)")
    g.add_argument("--max-batch", type=max_batch_arg, default=None, metavar="B",
                   help="up to B requests generate at once with their forwards joined into one (at --pp > 1 "
                        "one step down the ring) "
                        "(continuous batching over a paged KV cache; every drafter and family); each gets the ids "
                        f"it gets alone; 1: one at a time (default auto, decided where the engine is placed: "
                        f"{AUTO_MAX_BATCH} on a GPU for llama / qwen2 / qwen3 shapes whose batched steps "
                        "replay CUDA graphs, as measured, else 1)")
    g.add_argument("--max-queue", type=int, default=16, metavar="Q",
                   help="requests that may wait for a session; one more is answered 429 (default 16)")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="SEC",
                   help="after SIGTERM, how long requests in flight and queued may take to finish before they are "
                        "cut (new ones get 503 meanwhile; default 30; 0: cut at once)")
    g.add_argument("--max-body-bytes", default=str(DEFAULT_MAX_BODY_BYTES), metavar="N",
                   help="largest request body, in bytes (4194304, 4MiB, 512k); a larger one is answered 413 before "
                        "it is read (default 4MiB)")
    for a in p._actions:  # noqa: SLF001 (helps that read differently for a server)
        if a.dest == "ctx":
            a.help = ("context rows of each session: prompt + completion (default: the model's positions, at "
                      "most 4096); a longer prompt is a 400")
        elif a.dest == "max_new_tokens":
            a.help = "completion tokens of a request without max_tokens (default %(default)s)"
        elif a.dest in ("json", "metrics_port", "metrics_hold", "run_dir", "traceparent"):
            a.help = argparse.SUPPRESS  # per-request (traceparent header) or not a server's


def add_serve_parser(sub, add_run_args: Callable[..., None]) -> argparse.ArgumentParser:
    """`sub`: the CLI's subparsers; add_run_args: memra_dist.cli._add_run_args (generate's flags)."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (Ray Serve) on one loaded model",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p, add_run_args)
    return p


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(f"serve: {message}")


def parse_serve_argv(argv: list[str], add_run_args: Callable[..., None]) -> argparse.Namespace:
    """The serve flags from a list, checked as the CLI checks them; UserError when bad.
    add_run_args: memra_dist.cli._add_run_args (handed in: this package never imports the CLI)."""
    p = _RaisingParser(prog="memra-dist serve", add_help=False)
    _add_args(p, add_run_args)
    args = p.parse_args(argv)
    check_args(args)
    return args


def spec_argv(spec: dict) -> list[str]:
    """{"model": "/m", "pp": 2, "max-queue": 8, "trace_content": true} -> the serve flags.
    Keys are flag names (dashes or underscores); true = a bare flag, false / null = left out."""
    argv: list[str] = []
    for key, v in spec.items():
        flag = ("-" if len(key) == 1 else "--") + key.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            argv.append(flag)
        elif isinstance(v, (str, int, float)):
            argv += [flag, str(v)]
        else:
            raise UserError(f"serve: '{key}': expected a string, number or true/false (got {type(v).__name__})")
    return argv


MIN_BODY_BYTES, MAX_BODY_BYTES = 1 << 10, 1 << 30


def check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: expected 0..65535")
    if args.sessions is not None and args.sessions < 1:
        raise UserError(f"--sessions {args.sessions}: expected >= 1")
    if args.max_queue < 0:
        raise UserError(f"--max-queue {args.max_queue}: expected >= 0")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: expected >= 1")
    drain_timeout = getattr(args, "drain_timeout", 0.0)
    if not 0 <= drain_timeout <= 86400:  # NaN too
        raise UserError(f"--drain-timeout {drain_timeout:g}: expected 0..86400 seconds")
    if not isinstance(args.max_body_bytes, int):
        try:
            n = parse_size(args.max_body_bytes)
        except ValueError as e:
            raise UserError(f"--max-body-bytes: {e}") from None
        if not MIN_BODY_BYTES <= n <= MAX_BODY_BYTES:
            raise UserError(f"--max-body-bytes {args.max_body_bytes}: expected {MIN_BODY_BYTES} bytes (1KiB) to "
                            f"{MAX_BODY_BYTES} (1GiB)")
        args.max_body_bytes = n
    # the defaults of requests that leave a field out: only what a request itself may ask for
    for flag, value, ok, want in (("--temperature", args.temperature, 0 <= args.temperature <= 2, "0..2 (0 = greedy)"),
                                  ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
                                  ("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0 = off)"),
                                  ("--seed", args.seed, 0 <= args.seed < 2 ** 64, "0..2^64-1")):
        if not ok:
            raise UserError(f"{flag} {value}: expected {want} (a request may not ask for more, so neither may "
                            "the server's default)")


def check_serve_deps() -> None:
    """One line naming the extra when Ray Serve (or its web stack) is missing."""
    for mod in ("ray.serve", "fastapi", "starlette", "uvicorn"):
        try:
            __import__(mod)
        except ImportError as e:
            raise UserError(f"memra-dist serve needs Ray Serve and its web stack ({e.name or mod} is missing): "
                            f"{INSTALL_HINT}") from None


def _check_port(host: str, port: int) -> None:
    """A local server's port, refused now rather than by Serve's proxy after the model loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve ({e.strerror})") from None
    fam, _, _, _, addr = infos[0]
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
    except OSError as e:
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None
    finally:
        s.close()


def run_serve(args) -> int:
    """The handler: an exit code (bad arguments or missing deps: one stderr line, 2)."""
    try:
        return _run(args)
    except UserError as e:
        print(f"memra-dist: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("memra-dist: interrupted", file=sys.stderr)
        return 130


def validate(args):
    """Everything that can be refused before Ray starts: flags, model files, tracing setup."""
    from ..app import config_from_args  # noqa: PLC0415
    from ..model.config import load_config  # noqa: PLC0415
    from ..model.tokenizer import load_tokenizer  # noqa: PLC0415
    from ..tracing.otel import otlp_endpoint  # noqa: PLC0415

    check_args(args)
    if args.sessions is not None:
        from ..app import check_sessions  # noqa: PLC0415

        check_sessions(args.sessions, args.pp)
        if args.pp == 1 and args.sessions > 1:
            print(f"memra-dist: note: at --pp 1 the engine runs one request at a time (--sessions {args.sessions} "
                  "is 1; more wait in the queue)", file=sys.stderr)
    cfg = config_from_args(args, args.model, args.draft_model)
    mcfg = load_config(cfg.model)
    if getattr(args, "max_batch", 1) not in (1, None):  # None: auto, decided by the replica (serve/host.py)
        check_batchable(cfg, mcfg, args.max_batch)
    tok = load_tokenizer(cfg.model)
    if tok.vocab_size > mcfg.vocab_size:
        raise UserError(f"{cfg.model}: tokenizer has {tok.vocab_size} tokens, the model only {mcfg.vocab_size}")
    if args.ctx is not None and not 1 < args.ctx <= mcfg.max_position_embeddings:
        raise UserError(f"--ctx {args.ctx}: expected 2..{mcfg.max_position_embeddings} (the model's positions)")
    if cfg.trace.clock_on and not otlp_endpoint():
        raise UserError("serve with --trace-level >= 1 (or --prof) sends spans over OTLP: set "
                        "OTEL_EXPORTER_OTLP_ENDPOINT (a server writes no run directory)")
    return cfg


def _run(args) -> int:
    ignored = [flag for flag, dest, off in IGNORED if getattr(args, dest, off) not in (off, None)]
    if ignored:
        print(f"memra-dist: note: serve does not use {', '.join(ignored)}"
              + (" (send a traceparent header per request)" if "--traceparent" in ignored else ""), file=sys.stderr)
    check_serve_deps()
    validate(args)
    if not os.environ.get("RAY_ADDRESS"):
        _check_port(args.host, args.port)
    from .deployment import deploy, drain, engine_sessions, undeploy  # noqa: PLC0415 (Ray only once the input is good)

    sig = _Signals(threading.current_thread() is threading.main_thread())
    prev = signal.signal(signal.SIGTERM, sig.on_term) if sig.installs else None
    try:
        return _serve(args, deploy, undeploy, drain, engine_sessions(args), sig)
    finally:
        if sig.installs:
            signal.signal(signal.SIGTERM, prev)


class _DrainAsked(BaseException):
    """The first SIGTERM while serving: drain, then stop."""


class _Signals:
    """What SIGTERM and SIGINT mean as serve goes. Starting, or stopping: SIGTERM unwinds as
    Ctrl-C does (KeyboardInterrupt). Serving: SIGTERM raises _DrainAsked, Ctrl-C is
    KeyboardInterrupt. Draining: the first of either asks for the cut (`cut`, read by the
    drain's loop), one more is KeyboardInterrupt."""

    def __init__(self, installs: bool = False):
        self.installs = installs  # the main thread's: handlers may be set (else the signals stay as they are)
        self.phase = "starting"
        self.cut = False

    def on_term(self, signum, frame):
        if self.phase == "serving":
            self.phase = "draining"
            raise _DrainAsked
        self.on_int(signum, frame)

    def on_int(self, signum, frame):
        if self.phase == "draining" and not self.cut:
            self.cut = True  # (no print here: the main thread may be printing)
            return
        raise KeyboardInterrupt


def _serve(args, deploy, undeploy, drain, sessions: int, sig: _Signals | None = None) -> int:
    sig = sig or _Signals()
    url = deploy(args)
    prev_int = signal.getsignal(signal.SIGINT) if sig.installs else None
    held = (f"up to {sessions} session(s) (--max-batch auto)" if args.pp == 1 and getattr(args, "max_batch", 1) is None
            else f"{sessions} session(s)")
    timeout = getattr(args, "drain_timeout", 30.0)
    try:
        try:
            print(f"[serve] {os.path.basename(os.path.normpath(args.model))} at {url}/v1 (POST /v1/completions; "
                  f"{held}, queue {args.max_queue}); SIGTERM drains (up to {timeout:g} s), Ctrl-C stops",
                  file=sys.stderr, flush=True)
            sig.phase = "serving"
            while True:
                time.sleep(3600)
        except _DrainAsked:
            if sig.installs:
                signal.signal(signal.SIGINT, sig.on_int)
            print(f"[serve] draining: new requests are answered 503; those in flight and queued have up to "
                  f"{timeout:g} s (a second SIGTERM or Ctrl-C cuts them)", file=sys.stderr, flush=True)
            print(f"[serve] drained: {drain(timeout, lambda: sig.cut)}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            sig.phase = "stopping"
            print("[serve] stopping: requests in flight are cut, the engine is unloaded", file=sys.stderr, flush=True)
            print(f"[serve] {drain(0)}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # one more signal while draining or cutting: stop without waiting
        pass
    finally:
        sig.phase = "stopping"
        if sig.installs:
            signal.signal(signal.SIGINT, prev_int)
        undeploy()
    print("[serve] stopped", file=sys.stderr, flush=True)
    return 0
