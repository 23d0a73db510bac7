"""One loaded engine and what each HTTP request needs around it: the tokenizer, the
request's RunConfig (the batch job's `_request_cfg`), its `memra.request` span, and the
engine call itself. Blocking, thread-safe, framework-free: the API runs `run` on worker
threads, tests call it directly.

The engine contract (memra_dist.app): `open_engine(cfg, capacity, sessions=S)` gives an
engine whose `generate` up to S threads may call at once; a stream callback that raises
aborts its request, frees the session and comes back out of `generate`. An `open_engine`
without `sessions` serves one request at a time: S is 1 and calls take a lock."""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .prompt_pieces import at_least_tokens
from .protocol import ApiError, CompletionRequest

__all__ = ["EngineHost", "Prepared", "ClientGone", "RequestTracing", "completion_text"]


class ClientGone(Exception):
    """Raised from the stream callback when the client went away: the engine aborts the request."""


@dataclass
class Prepared:
    prompt: str
    ids: list[int]
    cfg: object  # the request's RunConfig
    base: str | None = None  # the prompt's text, decoded (completion_text's prefix)


def completion_text(tok, prompt_ids: list[int], out_ids: list[int], base: str | None = None) -> str:
    """The continuation's text as the stream delivers it: decoded after the prompt, so the
    space between prompt and continuation is kept (memra_dist.model.tokenizer.StreamDecoder).
    `base`: tok.decode(prompt_ids), when the caller has it already."""
    decode = getattr(tok, "decode_released", tok.decode)  # a worker thread's decode lets the event loop run
    base = decode(prompt_ids) if base is None else base
    full = decode(list(prompt_ids) + list(out_ids))
    return full[len(base):] if full.startswith(base) else decode(out_ids)


class RequestTracing:
    """One tracer provider for the server process; every request gets its own `memra.request`
    span (a child of the caller's `traceparent` when one came), built by the CLI's own
    TracingSession.request, on a session object per request so concurrent requests never
    share state. Off at trace level 0 (as the CLI: no spans)."""

    def __init__(self, cfg):
        from ..tracing.otel import make_provider, otlp_endpoint, quick_gil_handoff  # noqa: PLC0415

        self.enabled = cfg.trace.clock_on
        self.provider = self.counting = self.tracer = None
        self.made = 0
        if not self.enabled:
            return
        if not otlp_endpoint():
            raise UserError("serve with --trace-level >= 1 (or --prof) sends spans over OTLP: set "
                            "OTEL_EXPORTER_OTLP_ENDPOINT (a server writes no run directory)")
        self._switch_before = quick_gil_handoff()
        self.provider, self.counting, _ = make_provider("driver", None)
        self.tracer = self.provider.get_tracer("memra_dist")

    def session(self, traceparent: str | None):
        from ..tracing.otel import TracingSession, parse_traceparent  # noqa: PLC0415

        if not self.enabled:
            return TracingSession(False, None, None)
        ts = TracingSession(True, None, parse_traceparent(traceparent))
        ts.tracer = self.tracer
        return ts

    def close(self) -> int:
        """Flush within the bound; spans not delivered."""
        if not self.enabled:
            return 0
        from ..tracing.otel import flush_timeout_s, shutdown_bounded  # noqa: PLC0415

        sys.setswitchinterval(self._switch_before)
        return shutdown_bounded(self.provider, self.counting, self.made, flush_timeout_s())


def _opener_takes_sessions(opener) -> bool:
    try:
        return "sessions" in inspect.signature(opener).parameters
    except (TypeError, ValueError):
        return False


class EngineHost:
    """Enters `open_engine` once (here) and exits it in `close`; in between, `run` serves
    requests from up to `sessions` threads at once (None: the engine's default; with
    `max_batch` > 1, that many requests batched into shared forwards; None: `--max-batch
    auto`, decided here, where the engine runs: batching/policy.py `auto_max_batch`)."""

    def __init__(self, cfg, sessions: int | None = None, *, open_engine=None, tokenizer=None, mcfg=None,
                 max_batch: int | None = 1):
        from ..model.config import load_config  # noqa: PLC0415
        from ..model.tokenizer import load_tokenizer  # noqa: PLC0415

        if open_engine is None:
            from ..app import open_engine  # noqa: PLC0415
        self.cfg = cfg
        self.mcfg = mcfg or load_config(cfg.model)
        self.tok = tokenizer or load_tokenizer(cfg.model)
        if self.tok.vocab_size > self.mcfg.vocab_size:
            raise UserError(f"{cfg.model}: tokenizer has {self.tok.vocab_size} tokens, the model only "
                            f"{self.mcfg.vocab_size}")
        self.model_name = Path(cfg.model).name
        self.eos_ids = tuple(self.mcfg.eos_token_ids)
        from ..batching.policy import resolve_max_batch  # noqa: PLC0415

        self.max_batch = max_batch = resolve_max_batch(max_batch, cfg, self.mcfg)  # auto: decided here
        self.prefix_cache = max_batch != 1 and cfg.prefix_cache  # a batched engine's pool caches prompts' blocks
        self.tracing = RequestTracing(cfg)
        self._stack = ExitStack()
        try:
            self.concurrent = _opener_takes_sessions(open_engine)
            if max_batch != 1:  # the requests' forwards joined (memra_dist/batching/; pp > 1: down the ring)
                cm = open_engine(cfg, None, sessions=sessions, max_batch=max_batch)
            elif self.concurrent:
                cm = open_engine(cfg, None, sessions=sessions)
            else:
                cm = open_engine(cfg, None)
            self.engine = self._stack.enter_context(cm)
        except BaseException:
            self.tracing.close()
            raise
        self.sessions = int(getattr(self.engine, "sessions", sessions or 1)) if self.concurrent else 1
        self._lock = contextlib.nullcontext() if self.concurrent else threading.Lock()
        self.capacity = self.engine.capacity

    # ---- before a request queues: everything that can be refused with a 400 ----

    def prepare(self, req: CompletionRequest) -> Prepared:
        """Tokenize and check; blocking and CPU-bound (the API runs it on a worker thread)."""
        from .batch_input import Request, request_cfg  # noqa: PLC0415 (the batch job's per-request config)

        ids = self._tokens(req.prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenizing", "prompt", "invalid_value")
        if len(ids) >= self.capacity:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) is too long for this server's context "
                                f"({self.capacity} tokens, prompt and completion together)", "prompt",
                           "context_length_exceeded")
        room = self.capacity - len(ids)
        asked = req.fields.get("max_new_tokens")
        if asked is not None and asked > room:
            raise ApiError(400, f"'max_tokens' ({asked}) and the prompt ({len(ids)} tokens) do not fit this "
                                f"server's context ({self.capacity} tokens): at most {room} for this prompt",
                           "max_tokens", "context_length_exceeded")
        try:
            cfg = request_cfg(self.cfg, Request(0, "api", req.prompt, req.fields))
            self.engine.plan(len(ids), cfg)  # what the engine itself would refuse, refused now
        except UserError as e:
            raise ApiError(400, " ".join(str(e).split()), None, "invalid_value") from None
        return Prepared(req.prompt, ids, cfg, self._decode(ids))

    def _encode(self, text: str) -> list[int]:
        try:
            return getattr(self.tok, "encode_released", self.tok.encode)(text)
        except Exception as e:  # noqa: BLE001 (tokenizers raises bare exceptions)
            print(f"[serve] a prompt could not be tokenized: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr,
                  flush=True)
            raise ApiError(400, "the prompt cannot be tokenized", "prompt", "invalid_value") from None

    def _tokens(self, prompt: str) -> list[int]:
        """The prompt's ids. A prompt longer (in characters) than the context is first counted
        piece by piece, and refused as soon as it is sure not to fit: one far over the context
        costs about the context's worth of tokenizing, never its whole length."""
        if at_least_tokens(self._encode, prompt, self.capacity) is not None:
            raise ApiError(400, f"the prompt (at least {self.capacity} tokens) is too long for this server's "
                                f"context ({self.capacity} tokens, prompt and completion together)",
                           "prompt", "context_length_exceeded")
        return self._encode(prompt)

    def _decode(self, ids: list[int]) -> str:
        return getattr(self.tok, "decode_released", self.tok.decode)(ids)

    # ---- one request, on a worker thread ----

    def run(self, prep: Prepared, on_tokens, traceparent: str | None = None):
        """Generate; `on_tokens(ids)` gets tokens as they commit (raising aborts the request).
        Returns the engine's Result; raises what generate raised."""
        with self._lock:
            ts = self.tracing.session(traceparent)
            with ts.request(prep.cfg, prep.prompt, len(prep.ids)) as req:
                self.tracing.made += 1 if self.tracing.enabled else 0
                res = self.engine.generate(prep.ids, prep.cfg, stream=on_tokens, span_sink=ts.sink(),
                                           carrier=req.carrier())
                req.finish(res, self.text(prep.ids, res.token_ids, prep.base) if prep.cfg.trace_content else "")
            if ts._sink is not None:  # noqa: SLF001 (the burst spans built for this request)
                self.tracing.made += ts._sink.count  # noqa: SLF001
            return res

    def text(self, prompt_ids: list[int], out_ids: list[int], base: str | None = None) -> str:
        return completion_text(self.tok, prompt_ids, out_ids, base)

    def close(self) -> None:
        """Exit the engine (the pipeline's actors stop, pp > 1), then flush the spans."""
        try:
            self._stack.close()
        finally:
            lost = self.tracing.close()
            if lost:
                print(f"memra-dist: warning: {lost} spans of the server were not delivered", file=sys.stderr)
        print(f"[serve] engine closed ({self.model_name})", file=sys.stderr, flush=True)
