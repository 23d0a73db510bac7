"""`memra-dist`: generate, demo, batch, serve (and bench). Bad input: one stderr line, exit code 2."""

from __future__ import annotations

import argparse
import signal
import sys

from . import __version__
from .errors import UserError
from .specdec.chunks import DEFAULT_PREFILL_CHUNK

__all__ = ["main", "run", "build_parser"]

EPILOG = """\
environment (read once per process; junk values are ignored, with one line saying so):
  MEMRA_SPEC_TRACE=1|2     trace level; --trace-level beats it. MEMRA_GLM5_SPEC_TRACE is the same
                           flag under the originating engine's name (the general name wins)
  MEMRA_SPEC_PROF=1        first-token profile + per-round depth log; --prof beats it
  MEMRA_CACHE_DIR          where `demo` builds its tiny checkpoints once (default ~/.cache/memra_dist)
  OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL (grpc | http/protobuf),
  OTEL_EXPORTER_OTLP_HEADERS, OTEL_SERVICE_NAME   export spans over OTLP (standard SDK names);
                           with no endpoint, traced runs write a run directory (OTLP JSON + Perfetto)
  RAY_ADDRESS              with --pp > 1: join this Ray cluster (unset: start a local one)
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + error)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _add_run_args(p: argparse.ArgumentParser, demo: bool, metrics: bool = True) -> None:
    """generate's flags (demo: no --model / --prompt); metrics=False leaves out --metrics-port
    and --metrics-hold (a batch job serves no metrics)."""
    if not demo:
        p.add_argument("--model", required=True, metavar="DIR", help="HF checkpoint directory (config.json + *.safetensors + tokenizer.json)")
        p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64 if not demo else 96, metavar="N",
                   help="tokens to generate (default %(default)s); a model with fewer positions caps the "
                        "request at its max_position_embeddings and says so on stderr")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling, in (0, 1] (default 1 = off; the most likely token always stays, so "
                        "a tiny P is greedy)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="top-k sampling (default 0 = off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--drafter", choices=["none", "ngram", "model", "dflash", "mtp", "eagle3", "auto", "replay"],
                   default=None,
                   help="none = plain decoding; ngram = prompt lookup; model = a draft checkpoint; "
                        "dflash = a DFlash block drafter (--draft-model DIR) reading the target's hidden states; "
                        "mtp = the target's own MTP layers (deepseek_v3 / glm4_moe with num_nextn_predict_layers); "
                        "eagle3 = an EAGLE-3 head (--draft-model DIR) chained over the target's low / mid / high "
                        "layer taps (at --pp > 1 the stages ship these taps to the head); "
                        "auto = the best the checkpoints allow: dflash or eagle3 by --draft-model's kind, else the "
                        "target's MTP layers where it holds them, each with --ngram-first; a draft model; else "
                        "ngram (the choice is one line on stderr); "
                        "replay = BENCHMARKING TOOL: a recorded greedy continuation, corrupted at --replay-corrupt "
                        "(default: model with --draft-model, else ngram)")
    p.add_argument("--draft-model", metavar="DIR", help="draft checkpoint (same vocabulary); implies --drafter model "
                                                          "unless --drafter dflash / eagle3 names its kind")
    p.add_argument("-k", type=int, default=4, help="drafted tokens per round (default 4)")
    p.add_argument("--replay-corrupt", type=float, default=0.2, metavar="R", help="replay drafter: per-token corruption rate")
    p.add_argument("--ctx", type=int, metavar="N", help="session context rows (default: prompt + max-new + k + 1)")
    p.add_argument("--burst-rounds", type=int, default=8 if not demo else 32, metavar="N", help="rounds per burst: phase lines and spans per burst; tokens stream per round "
                        "(pp=1) or per burst (pp>1) (default %(default)s)")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "auto"], default="auto", help="auto = fp32 on CPU, bf16 on CUDA")
    p.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                   help="CUDA graphs + fused projections for decode/verify steps (auto = on with CUDA)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile inside those graphs, so norms, rotary and gating fuse (auto = only where "
                        "a benchmark showed it gains >= 3 %% in decode: the DFlash drafter's block, not the target's "
                        "blocks; on = everywhere it is supported: a machine's first compile takes ~10-60 s, later "
                        "runs read the cache in ~/.cache/memra_dist/inductor)")
    p.add_argument("--kernels", choices=["auto", "off"], default="auto",
                   help="our Triton kernels inside those graphs: one-row GEMVs and 2-16-row GEMMs with the "
                        "block's norms, gating and residual adds folded in, per-slot MoE expert GEMVs, and "
                        "split-sequence cached attention that reads only the live rows "
                        "(auto = on wherever the graphs are and Triton imports; off = cuBLAS and the reference "
                        "attention)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help="prompt rows per prefill forward (default %(default)s): the prompt runs in chunks, so its "
                        "working memory is O(N x context) whatever its length; at --pp > 1 the chunks are "
                        "pipelined across the stages and shrink as the prefix grows (N is their upper bound)")
    p.add_argument("--spec-k", choices=["fixed", "auto"], default="auto",
                   help="with --max-batch > 1: auto (default) = each step gives each request the K (0 .. -k) that "
                        "maximizes the step's expected tokens per second, from its running acceptance per draft "
                        "position (a new request starts from the engine's) and the step time the engine measures "
                        "(K 0: that request decodes plainly; greedy requests; at "
                        "--pp 1; at --pp > 1 every round drafts -k); fixed = every round drafts -k tokens")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="with --max-batch > 1: do not reuse the KV blocks of prompt prefixes seen before (by "
                        "default a request whose prompt starts with whole 16-token blocks an earlier request "
                        "computed shares those blocks and prefills only the rest; the ids are the same)")
    p.add_argument("--ngram-first", action="store_true",
                   help="with --drafter dflash, eagle3 or mtp: each round where the context's last 4+ tokens "
                        "occurred earlier (output copying the prompt) is drafted by prompt lookup, on the host, "
                        "and the network drafts the others; the result's stats count each source apart "
                        "(drafts_by_source; the ids are the same)")
    p.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline stages (Ray actors, one device each); 1 = in-process")
    p.add_argument("--stage-bounds", metavar="A,B,..", help="explicit first layer of stages 2..N (default: even split)")
    p.add_argument("--trace-level", type=int, choices=[0, 1, 2], default=None, help="0 off, 1 phases, 2 + verify sub-split (beats MEMRA_SPEC_TRACE)")
    p.add_argument("--prof", action="store_true", default=None, help="first-token profile + per-round depth log (beats MEMRA_SPEC_PROF)")
    p.add_argument("--traceparent", metavar="TP", help="W3C traceparent to parent memra.request (or TRACEPARENT)")
    p.add_argument("--trace-content", action="store_true", help="put prompt and output text on the request span (off: never exported)")
    p.add_argument("--run-dir", metavar="DIR", help="where traced runs without an OTLP endpoint write spans "
                                                    "(default ./runs/<time>-<pid>; the path is printed)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object: token_ids, text, stats, "
                                                       "run_dir (null when nothing was written), capped")
    if not metrics:
        return
    p.add_argument("--metrics-port", type=int, metavar="N", help="serve Prometheus metrics on 127.0.0.1:N (0 = any free port)")
    p.add_argument("--metrics-hold", type=float, default=0.0, metavar="S",
                   help="keep the metrics endpoint up S seconds after the run, for a last scrape (default 0)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="memra-dist", description="Speculative-decoding LLM inference, every phase of a round traced.",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"memra-dist {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate from a checkpoint directory", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_args(g, demo=False)
    d = sub.add_parser("demo", help="the embedded default: tiny target + draft built once, a traced speculative run",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_args(d, demo=True)
    d.add_argument("--prompt", default=None, help="prompt text (default: the start of a sentence the demo model knows)")
    from .bench import add_bench_parser  # noqa: PLC0415 (its handler lives in memra_dist/bench)

    add_bench_parser(sub)
    from .serve import add_batch_parser  # noqa: PLC0415

    add_batch_parser(sub, _add_run_args)
    from .serve import add_serve_parser  # noqa: PLC0415

    add_serve_parser(sub, _add_run_args)
    return p


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt  # unwinds through the same flush-and-teardown path as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    """The CLI as a function: an exit code, no process-wide changes (signal handlers are the
    program's business: see `run`)."""
    args = build_parser().parse_args(argv)
    if args.cmd == "bench":
        from .bench import run_bench as run_command  # noqa: PLC0415
    elif args.cmd == "batch":
        from .serve import run_batch as run_command  # noqa: PLC0415
    elif args.cmd == "serve":
        from .serve import run_serve as run_command  # noqa: PLC0415
    else:
        from .app import run_command  # noqa: PLC0415 (keeps --help fast: no torch import)

    try:
        return run_command(args)
    except UserError as e:
        print(f"memra-dist: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("memra-dist: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The `memra-dist` program: SIGTERM (`kill`, `ray job stop`) unwinds through the same
    flush-and-teardown path as Ctrl-C. Once the command has returned, its output is complete and
    the process only exits: a SIGTERM or SIGINT then is ignored, so it cannot kill the
    interpreter's teardown and turn the command's exit code into -15 / -2 (a batch job done just
    as it was stopped)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = main()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    run()
