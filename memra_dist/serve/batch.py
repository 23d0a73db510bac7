"""A resumable batch job on one engine: JSONL requests in, JSONL results out.

Input, one JSON object a line: `id` (string or integer, unique), `prompt` (string), and
optionally `max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed` (null or absent: the
job's flag). Blank lines are skipped; line numbers count every line from 1.

Output, one line per input line, appended as each request ends (write, flush, fsync):
  {"id", "token_ids", "text", "stats", "prompt_sha256"}   a finished request
  {"id", "error"[, "prompt_sha256"]}     a request refused or failed: a bad field, an unknown
                                         field, a prompt too long for the context, an engine
                                         refusal, a failure inside the engine ("the engine
                                         failed: ..."): the job goes on with the next request
  {"line", "error"}                      a line with no usable id: not UTF-8, malformed JSON,
                                         not an object, no id, a bad id, a duplicate id (the
                                         id belongs to the line that used it first)
`prompt_sha256` (the first 16 hex digits of the SHA-256 of the prompt's UTF-8) is on every
record of a request the engine ran: a result, an engine's refusal or failure.

Resume: the same command skips every id (and numbered line) already in the output, error
records included: a request that failed is not run again (delete its line to retry it), so
a request that fails every time cannot stop a job's resumes. An id whose record holds
another prompt's hash than its input line (the output of another input) is refused before
anything runs, in one line naming the id. ENGINE_FAILURES_TO_STOP failures inside the engine
in a row (an engine that is down, not one bad request) stop the job, exit 1, with the rest
left to a resume. A last line without its newline (a crash mid-write) is cut off first and
its request runs again.
Each line is written with SIGINT / SIGTERM held and cut back if the write fails, so a job
stopped any way leaves complete lines only; one job at a time holds the output (flock).

Requests run in as many threads as the engine has sessions (pp>1: one per stage unless
--sessions says otherwise), so the pipeline's stages work on several requests at once;
results are appended in the order requests finish.

Progress goes to stderr, at most one line a second, then one summary line.

Traced (--trace-level >= 1 or --prof, as `generate`): each request gets its memra.request
span and its bursts' spans, in the job's run directory (--run-dir, else ./runs/<time>-<pid>)
or over OTLP when an endpoint is set.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

from ..errors import UserError
from ..specdec.sampling import sampling_rule
from .results_file import Output, id_key, is_int, line_key, record_key, valid_id

__all__ = ["Request", "Refused", "Output", "Progress", "parse_input", "read_input", "record_key", "run_job",
           "choose_capacity", "FIELDS", "prompt_hash", "EngineFailing", "ENGINE_FAILURES_TO_STOP"]

OPTIONAL = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
FIELDS = ("id", "prompt", *OPTIONAL)
ENGINE_FAILURES_TO_STOP = 3  # failures inside the engine in a row that stop the job (the engine is down)


def prompt_hash(prompt: str) -> str:
    """The first 16 hex digits of the SHA-256 of the prompt's UTF-8 (a lone surrogate from
    the JSON input kept as is): what a record says its request's prompt was."""
    return hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class EngineFailing(UserError):
    """ENGINE_FAILURES_TO_STOP requests in a row failed inside the engine: the job stops."""

    exit_code = 1


# ---- input ---------------------------------------------------------------------------


@dataclass
class Request:
    line: int
    id: str | int
    prompt: str
    fields: dict = field(default_factory=dict)  # the optional fields given (validated), by name

    @property
    def key(self) -> str:
        return id_key(self.id)


@dataclass
class Refused:
    line: int
    error: str
    id: str | int | None = None  # None: the line has no usable id (the record names the line)
    has_id: bool = False

    @property
    def key(self) -> str:
        return id_key(self.id) if self.has_id else line_key(self.line)

    def record(self) -> dict:
        return {"id": self.id, "error": self.error} if self.has_id else {"line": self.line, "error": self.error}




def _is_num(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))








def _show(v, n: int = 40) -> str:
    s = json.dumps(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _one_line(msg) -> str:
    s = " ".join(str(msg).split())
    return s if len(s) <= 500 else s[:497] + "..."




_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true/false",
          type(None): "null"}


def _check_field(name: str, v) -> str | None:
    """None when `v` is a good value of the optional field `name`, else the error. The
    sampling fields follow specdec/sampling.py's rules (the CLI's and the server's too)."""
    if name == "max_new_tokens":
        ok, want = is_int(v) and v >= 1, "an integer >= 1"
    else:  # temperature, top_p, top_k, seed
        want = sampling_rule(name, v)
        ok = want is None
    return None if ok else f"'{name}' must be {want} (got {_show(v)})"


def _parse_line(n: int, raw: bytes, seen: dict) -> Request | Refused:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Refused(n, "the line is not UTF-8 text")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Refused(n, f"malformed JSON: {e.msg} (column {e.colno})")
    except (ValueError, RecursionError):
        return Refused(n, "malformed JSON")
    if not isinstance(obj, dict):
        return Refused(n, f"expected a JSON object, got {_KINDS.get(type(obj), 'something else')}")
    if "id" not in obj:
        return Refused(n, "missing 'id'")
    rid = obj["id"]
    if not valid_id(rid):
        return Refused(n, f"'id' must be a string or an integer (got {_show(rid)})")
    key = id_key(rid)
    if key in seen:
        return Refused(n, f"duplicate id {_show(rid)} (first on line {seen[key]})")
    seen[key] = n

    def refuse(msg: str) -> Refused:
        return Refused(n, msg, rid, True)

    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        return refuse(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)} "
                      f"(a request has {', '.join(FIELDS)})")
    if "prompt" not in obj:
        return refuse("missing 'prompt'")
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        return refuse(f"'prompt' must be a string (got {_KINDS.get(type(prompt), 'something else')})")
    if not prompt:
        return refuse("the prompt is empty")
    fields = {}
    for name in OPTIONAL:
        v = obj.get(name)
        if v is None:
            continue  # absent or null: the job's value
        bad = _check_field(name, v)
        if bad:
            return refuse(bad)
        fields[name] = v
    return Request(n, rid, prompt, fields)


def parse_input(data: bytes) -> list[Request | Refused]:
    """Every non-blank line, in order, as a request or a refusal."""
    seen: dict[str, int] = {}
    out: list[Request | Refused] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if raw.strip():
            out.append(_parse_line(n, raw.rstrip(b"\r"), seen))
    return out


def read_input(path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"--input {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"--input {path}: is a directory") from None
    except OSError as e:
        raise UserError(f"--input {path}: cannot read ({e.strerror or e})") from None


def _say(line: str, out: TextIO | None = None) -> None:
    """One stderr line; a closed stderr (`... 2>&1 | head`) never stops the job."""
    try:
        print(line, file=out or sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _clock_text(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class Progress:
    """'[batch] 7/12 done, 1 error | 412.3 tok/s | ETA 0:09' on `out`, at most one line every
    `every_s` seconds; rates count this run only (not the requests done before it)."""

    def __init__(self, total: int, done: int, errors: int, out: TextIO | None = None, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.done, self.errors = total, done, errors
        self.before = done
        self.out, self.every_s, self.clock = out, every_s, clock
        self.tokens = 0
        self.ran = 0  # requests the engine ran in this run (what the ETA is made of)
        self.t0 = clock()
        self.t_run: float | None = None  # when the first request started (the engine is up)
        self.last: float | None = None

    def _say(self, line: str) -> None:
        _say(line, self.out)

    def start(self) -> None:
        if self.t_run is None:
            self.t_run = self.clock()

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self.tick()

    def finished(self, error: bool = False, ran: bool = True) -> None:
        self.done += 1
        self.errors += error
        self.ran += ran
        self.tick()

    def rate(self) -> float:
        el = self.clock() - self.t_run if self.t_run is not None else 0.0
        return self.tokens / el if el > 0 else 0.0

    def line(self) -> str:
        errs = f", {self.errors} error{'s' if self.errors != 1 else ''}" if self.errors else ""
        s = f"[batch] {self.done}/{self.total} done{errs}"
        if self.t_run is None:
            return s
        el = self.clock() - self.t_run
        eta = _clock_text(el / self.ran * (self.total - self.done)) if self.ran and el > 0 else "--"
        return f"{s} | {self.rate():.1f} tok/s | ETA {eta}"

    def tick(self) -> None:
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            return
        if self.last is None and now - self.t0 < self.every_s:
            return  # a job that ends within a second prints its summary only
        self.last = now
        self._say(self.line())

    def summary(self, output: str, interrupted: bool = False) -> str:
        errs = f", {self.errors} error{'s' if self.errors != 1 else ''}" if self.errors else ""
        before = f" ({self.before} before this run)" if self.before else ""
        el = self.clock() - self.t_run if self.t_run is not None else 0.0
        rate = f", {self.tokens} tokens in {el:.1f} s ({self.rate():.1f} tok/s)" if self.t_run is not None else ""
        if interrupted:
            return (f"[batch] interrupted at {self.done}/{self.total} done{errs}{rate}: every finished request is "
                    f"in {output}; the same command resumes")
        return f"[batch] done: {self.done}/{self.total}{before}{errs}{rate} -> {output}"


# ---- the job -------------------------------------------------------------------------


def choose_capacity(ctx: int | None, max_pos: int, prompt_lens: list[int], max_news: list[int], k: int) -> int:
    """--ctx when given, else what the longest prompt and the largest max_new_tokens need
    (+ k + 1 verify rows), cut to the model's positions."""
    if ctx is not None:
        return ctx
    return min(max_pos, max(prompt_lens) + max(max_news) + k + 1)


def _request_cfg(cfg, req: Request):
    from ..specdec.sampling import SamplingParams  # noqa: PLC0415

    f = req.fields
    sp = cfg.sampling
    kw = {}
    if "max_new_tokens" in f:
        kw["max_new_tokens"] = f["max_new_tokens"]
    if "seed" in f:
        kw["seed"] = f["seed"]
    if any(x in f for x in ("temperature", "top_k", "top_p")):
        kw["sampling"] = SamplingParams(float(f.get("temperature", sp.temperature)), int(f.get("top_k", sp.top_k)),
                                        float(f.get("top_p", sp.top_p)))
    return cfg.with_(**kw) if kw else cfg


def run_job(cfg, input_path, output_path, *, tokenizer, max_pos: int, open_engine, ctx: int | None = None,
            err: TextIO | None = None, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
            sessions: int | None = None, tracing=None, lost: list | None = None) -> int:
    """The whole job; 0 when it ran (refused and failed requests included), 130 when
    interrupted. Bad arguments (and an output holding other prompts' results) raise UserError
    before the engine opens; EngineFailing (exit 1) when the engine fails on
    ENGINE_FAILURES_TO_STOP requests in a row. `open_engine(cfg, capacity, sessions=)` is a
    context manager giving an object with `sessions` and `generate(ids, cfg, stream) -> Result`
    (callable from that many threads at once). `tracing`: an enabled tracing.otel.TracingSession
    gives each request its memra.request span (and span sink, carrier); open_engine then also
    gets `run_dir=` and `lost=` (the pipeline actors' spans: `lost` gets a line per role whose
    spans did not all arrive)."""
    def say(line: str) -> None:
        _say(line, err)

    if ctx is not None and ctx > max_pos:
        raise UserError(f"--ctx {ctx} exceeds the model's max_position_embeddings ({max_pos})")
    data = read_input(input_path)
    try:
        if os.path.samefile(input_path, output_path):
            raise UserError(f"--output {output_path} is the input file")
    except FileNotFoundError:
        pass
    out = Output(output_path)
    try:
        return _run(cfg, out, parse_input(data), tokenizer, max_pos, open_engine, ctx, say, err, every_s, clock,
                    sessions, tracing if tracing is not None and tracing.enabled else None, lost)
    finally:
        out.close()


def _check_same_prompts(entries, out: Output) -> None:
    """Refuse an output whose records hold another prompt for an id of this input (a result
    of another input's would be kept as this one's): one line naming the first such id."""
    stale = [e for e in entries
             if isinstance(e, Request) and out.hashes.get(e.key) not in (None, prompt_hash(e.prompt))]
    if not stale:
        return
    e = stale[0]
    more = f" (and {len(stale) - 1} more id{'s' if len(stale) > 2 else ''})" if len(stale) > 1 else ""
    raise UserError(f"--output {out.path}: the record of id {_show(e.id)} is for another prompt than line {e.line} "
                    f"of the input{more}: it holds another input's results (use a new --output, or delete those "
                    "records to run them again)")


def _run(cfg, out: Output, entries, tok, max_pos, open_engine, ctx, say, err, every_s, clock, sessions,
         tracing=None, lost: list | None = None) -> int:
    if out.cut:
        say(f"[batch] {out.path}: cut off an unfinished last line ({out.cut} bytes); its request runs again")
    if out.unreadable:
        say(f"[batch] {out.path}: {out.unreadable} line(s) are not records of this job; left as they are")
    _check_same_prompts(entries, out)
    todo = [e for e in entries if e.key not in out.done]
    before = len(entries) - len(todo)
    before_err = sum(1 for e in entries if out.done.get(e.key))
    prog = Progress(len(entries), before, before_err, err, every_s, clock)
    interrupted = False
    try:
        runnable, refused = _prepare(cfg, todo, tok, max_pos, ctx)
        say(f"[batch] {len(entries)} requests in the input: {before} done before, {len(runnable)} to run"
            + (f", {len(refused)} refused" if refused else ""))
        for r in refused:  # refused at once: no model needed
            out.append(r.record())
            prog.finished(error=True, ran=False)
        if runnable:
            lens, news = [len(ids) for _, ids, _ in runnable], [c.max_new_tokens for _, _, c in runnable]
            cap = choose_capacity(ctx, max_pos, lens, news, cfg.k)
            most = max(n + m for n, m in zip(lens, news)) + cfg.k + 1
            if cap < most:
                say(f"[batch] the context holds {cap} rows ({'--ctx' if ctx is not None else 'the model'}): "
                    f"a request needing more (up to {most}) ends when it is full")
            stop = threading.Event()
            workers: list[threading.Thread] = []
            traced = {}
            if tracing is not None:  # the pipeline actors' spans go where the driver's do
                traced = {"run_dir": str(tracing.run_dir) if tracing.run_dir else None,
                          "lost": lost if lost is not None else []}
            with open_engine(cfg, cap, sessions=sessions, **traced) as engine:
                prog.start()
                try:
                    _serve_all(engine, runnable, out, prog, tok, stop, workers, tracing)
                finally:
                    stop.set()  # Ctrl-C or an error: requests in flight end at their next tokens
                    for w in workers:  # before the engine closes: none is left computing on it
                        w.join()
            if any(getattr(w, "error", None) for w in workers):
                raise next(w.error for w in workers if getattr(w, "error", None))
    except KeyboardInterrupt:
        interrupted = True
    say(prog.summary(out.path, interrupted))
    return 130 if interrupted else 0


def _prepare(cfg, todo, tok, max_pos: int, ctx: int | None):
    """(runnable [(request, prompt ids, its RunConfig)], refused) in input order."""
    refused: list[Refused] = []
    runnable: list[tuple[Request, list[int], object]] = []
    limit = ctx if ctx is not None else max_pos
    where = f"the context (--ctx {ctx} rows)" if ctx is not None else f"the model's {max_pos} positions"
    for e in todo:
        if isinstance(e, Refused):
            refused.append(e)
            continue
        try:
            rcfg = _request_cfg(cfg, e)
        except UserError as x:
            refused.append(Refused(e.line, _one_line(x), e.id, True))
            continue
        try:
            ids = tok.encode(e.prompt)
        except Exception as x:  # noqa: BLE001 (tokenizers raises bare exceptions)
            refused.append(Refused(e.line, f"cannot tokenize the prompt ({_one_line(x)[:200]})", e.id, True))
            continue
        if not ids:
            refused.append(Refused(e.line, "the prompt is empty after tokenizing", e.id, True))
        elif len(ids) >= limit:
            refused.append(Refused(e.line, f"the prompt ({len(ids)} tokens) is too long for {where}", e.id, True))
        else:
            runnable.append((e, ids, rcfg))
    return runnable, refused


class _Stopped(Exception):
    """Raised from a request's stream when the job stops: the engine abandons the request
    (it runs again on resume)."""


class _Failures:
    """Requests in a row that failed inside the engine (any thread); a success resets it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.in_a_row = 0

    def ok(self) -> None:
        with self.lock:
            self.in_a_row = 0

    def failed(self) -> int:
        with self.lock:
            self.in_a_row += 1
            return self.in_a_row


def _serve_all(engine, runnable, out: Output, prog: Progress, tok, stop: threading.Event,
               workers: list[threading.Thread], tracing=None) -> None:
    """Run every request on `engine.sessions` worker threads (appended to `workers`) and
    wait for them, in short joins so Ctrl-C reaches the main thread at once. A request that
    fails gets its error record and the job goes on; a worker's unexpected error (or
    EngineFailing) stops the others from starting new requests; it is kept on the thread
    (`error`) and raised by the caller after the engine is closed."""
    todo = iter(runnable)
    take = threading.Lock()
    lock = threading.Lock()  # progress counters and lines
    fails = _Failures()

    def work(me: threading.Thread) -> None:
        while not stop.is_set():
            with take:
                item = next(todo, None)
            if item is None:
                return
            try:
                _one(engine, out, prog, tok, *item, stop=stop, lock=lock, tracing=tracing, fails=fails)
            except _Stopped:
                return
            except BaseException as e:  # noqa: BLE001 (handed to the main thread)
                me.error = e
                stop.set()
                return

    n = max(1, min(getattr(engine, "sessions", 1), len(runnable)))
    if n == 1:  # one session: the requests run on this thread (no torch work in another thread)
        for item in todo:
            _one(engine, out, prog, tok, *item, tracing=tracing, fails=fails)
        return
    for i in range(n):
        t = threading.Thread(target=lambda: work(threading.current_thread()), name=f"batch-{i}", daemon=True)
        t.error = None
        workers.append(t)
        t.start()
    for t in workers:
        while t.is_alive():
            t.join(0.2)


def _generate(engine, ids: list[int], rcfg, stream, req: Request, tok, tracing):
    """engine.generate, inside the request's memra.request span when the job is traced."""
    if tracing is None:
        return engine.generate(ids, rcfg, stream=stream)
    with tracing.request(rcfg, req.prompt, len(ids)) as treq:
        res = engine.generate(ids, rcfg, stream=stream, span_sink=treq.sink, carrier=treq.carrier())
        treq.finish(res, tok.decode(res.token_ids) if rcfg.trace_content else "")
    return res


def _one(engine, out: Output, prog: Progress, tok, req: Request, ids: list[int], rcfg,
         stop: threading.Event | None = None, lock=None, tracing=None, fails: _Failures | None = None) -> None:
    """One request, its record appended: a result, or {"id", "error", "prompt_sha256"} when the
    engine refused it (a UserError) or failed on it (any other error: "the engine failed:
    <type>: <message>", said on stderr too). A failing request fails alone, unless it is the
    ENGINE_FAILURES_TO_STOP-th in a row (EngineFailing). Nothing is written for a request the
    stopping job abandoned (it runs again on resume)."""
    streamed = [0]
    lock = lock or threading.Lock()
    fails = fails if fails is not None else _Failures()
    sha = prompt_hash(req.prompt)

    def stream(new) -> None:
        if stop is not None and stop.is_set():
            raise _Stopped
        streamed[0] += len(new)
        with lock:
            prog.add_tokens(len(new))

    def failed(msg: str) -> None:
        out.append({"id": req.id, "error": msg, "prompt_sha256": sha})
        with lock:
            prog.finished(error=True)
        n = fails.failed()
        if n >= ENGINE_FAILURES_TO_STOP:
            raise EngineFailing(f"the engine failed on {n} requests in a row (the last, id {_show(req.id)}: "
                                f"{msg[:200]}): the job stops; their error records are in {out.path} (delete them "
                                "to run those requests again), the same command resumes the rest")

    try:
        res = _generate(engine, ids, rcfg, stream, req, tok, tracing)
    except (KeyboardInterrupt, _Stopped):
        raise
    except UserError as x:  # the engine refused this request: the job goes on
        if stop is not None and stop.is_set():
            return
        failed(_one_line(x))
        return
    except Exception as x:  # noqa: BLE001 (a failure inside the engine: this request fails alone)
        if stop is not None and stop.is_set():
            return  # the job is being stopped: the engine went away under this request
        msg = f"the engine failed: {type(x).__name__}: {_one_line(x)[:300]}"
        _say(f"[batch] request {_show(req.id)} (line {req.line}): {msg}; its error record is written, the job goes "
             "on", prog.out)
        failed(msg)
        return
    fails.ok()
    token_ids = [int(t) for t in res.token_ids]
    if len(token_ids) > streamed[0]:
        prog.tokens += len(token_ids) - streamed[0]  # an engine that streamed less than it returned
    out.append({"id": req.id, "token_ids": token_ids, "text": tok.decode(token_ids), "stats": res.stats,
                "prompt_sha256": sha})
    with lock:
        prog.finished()
