"""A resumable batch job on one engine: JSONL requests in, JSONL results out.

Input, one JSON object a line: `id` (string or integer, unique), `prompt` (string), and
optionally `max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed` (null or absent: the
job's flag). Blank lines are skipped; line numbers count every line from 1. A line over
--max-line-bytes (default 4 MiB, a server's body limit) is refused unread, `{"line", "error"}`,
and a prompt far over the context is refused after about the context's worth of tokenizing
(serve/prompt_pieces.py): neither costs memory in proportion to its length.

Output, one line per input line, appended as each request ends (write, flush, fsync):
  {"id", "token_ids", "text", "stats", "prompt_sha256"}   a finished request
  {"id", "error"[, "prompt_sha256"]}     a request refused or failed: a bad field, an unknown
                                         field, a prompt too long for the context, an engine
                                         refusal, a failure inside the engine ("the engine
                                         failed: ..."): the job goes on with the next request
  {"line", "error"}                      a line with no usable id: not UTF-8, malformed JSON,
                                         not an object, no id, a bad id, a duplicate id (the
                                         id belongs to the line that used it first), a line
                                         over --max-line-bytes (not read, so not its id)
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
or over OTLP when an endpoint is set; at level >= 1 the job ends with the phase-share table of
every request's rounds together (as `generate` prints one request's).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, TextIO

from ..errors import UserError
from ..phase.share import JobShare
from .batch_input import DEFAULT_MAX_LINE_BYTES, Refused, Request, prompt_hash, read_input, request_cfg, show
from .batch_progress import Progress, say as say_to
from .prompt_pieces import at_least_tokens
from .results_file import Output
from .workers import Workers

__all__ = ["run_job", "choose_capacity", "EngineFailing", "ENGINE_FAILURES_TO_STOP"]

ENGINE_FAILURES_TO_STOP = 3  # failures inside the engine in a row that stop the job (the engine is down)


class EngineFailing(UserError):
    """ENGINE_FAILURES_TO_STOP requests in a row failed inside the engine: the job stops."""

    exit_code = 1


def _one_line(msg) -> str:
    s = " ".join(str(msg).split())
    return s if len(s) <= 500 else s[:497] + "..."


def choose_capacity(ctx: int | None, max_pos: int, prompt_lens: list[int], max_news: list[int], k: int) -> int:
    """--ctx when given, else what the longest prompt and the largest max_new_tokens need
    (+ k + 1 verify rows), cut to the model's positions."""
    if ctx is not None:
        return ctx
    return min(max_pos, max(prompt_lens) + max(max_news) + k + 1)


def run_job(cfg, input_path, output_path, *, tokenizer, max_pos: int, open_engine, ctx: int | None = None,
            err: TextIO | None = None, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
            sessions: int | None = None, tracing=None, lost: list | None = None, batching: dict | None = None,
            max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> int:
    """The whole job; 0 when it ran (refused and failed requests included), 130 when
    interrupted. Bad arguments (and an output holding other prompts' results) raise UserError
    before the engine opens; EngineFailing (exit 1) when the engine fails on
    ENGINE_FAILURES_TO_STOP requests in a row. `open_engine(cfg, capacity, sessions=)` is a
    context manager giving an object with `sessions` and `generate(ids, cfg, stream) -> Result`
    (callable from that many threads at once). `tracing`: an enabled tracing.otel.TracingSession
    gives each request its memra.request span (and span sink, carrier); open_engine then also
    gets `run_dir=` and `lost=` (the pipeline actors' spans: `lost` gets a line per role whose
    spans did not all arrive). `batching` (pp=1, --max-batch > 1): open_engine's max_batch /
    max_batch_tokens / kv_rows: the requests' forwards joined (memra_dist/batching/). A line
    over `max_line_bytes` is an error record, read past in bounded pieces (batch_input.py)."""
    def say(line: str) -> None:
        say_to(line, err)

    if ctx is not None and ctx > max_pos:
        raise UserError(f"--ctx {ctx} exceeds the model's max_position_embeddings ({max_pos})")
    entries = read_input(input_path, max_line_bytes)
    try:
        if os.path.samefile(input_path, output_path):
            raise UserError(f"--output {output_path} is the input file")
    except FileNotFoundError:
        pass
    out = Output(output_path)
    try:
        return _run(cfg, out, entries, tokenizer, max_pos, open_engine, ctx, say, err, every_s, clock,
                    sessions, tracing if tracing is not None and tracing.enabled else None, lost, batching)
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
    raise UserError(f"--output {out.path}: the record of id {show(e.id)} is for another prompt than line {e.line} "
                    f"of the input{more}: it holds another input's results (use a new --output, or delete those "
                    "records to run them again)")


def _run(cfg, out: Output, entries, tok, max_pos, open_engine, ctx, say, err, every_s, clock, sessions,
         tracing=None, lost: list | None = None, batching: dict | None = None) -> int:
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
            workers = Workers()
            traced = {}
            if tracing is not None:  # the pipeline actors' spans go where the driver's do
                traced = {"run_dir": str(tracing.run_dir) if tracing.run_dir else None,
                          "lost": lost if lost is not None else []}
            if batching:
                traced.update(batching)
            share = JobShare() if tracing is not None and cfg.trace.level >= 1 else None
            with open_engine(cfg, cap, sessions=sessions, **traced) as engine:
                prog.start()
                try:
                    _serve_all(engine, runnable, out, prog, tok, stop, workers, tracing, share)
                finally:
                    stop.set()  # Ctrl-C or an error: requests in flight end at their next tokens
                    workers.finish()  # before the engine closes: none is left computing on it
                    # (an engine of one request at a time runs steps too, but batches nothing)
                    line = (batch_line(getattr(engine, "batch_stats", lambda: None)())
                            if (batching or {}).get("max_batch", 1) > 1 else None)
                    if line:
                        say(line)
                    if share is not None and share.n_rounds:  # where the job's rounds' time went
                        say(share.table())
            if workers.first_error() is not None:
                raise workers.first_error()
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
            rcfg = request_cfg(cfg, e)
        except UserError as x:
            refused.append(Refused(e.line, _one_line(x), e.id, True))
            continue
        try:  # a prompt far over the context: counted piece by piece, refused before it is tokenized whole
            over = at_least_tokens(tok.encode, e.prompt, limit)
            ids = tok.encode(e.prompt) if over is None else None
        except Exception as x:  # noqa: BLE001 (tokenizers raises bare exceptions)
            refused.append(Refused(e.line, f"cannot tokenize the prompt ({_one_line(x)[:200]})", e.id, True))
            continue
        if over is not None:
            refused.append(Refused(e.line, f"the prompt (at least {over} tokens) is too long for {where}", e.id, True))
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
               workers: Workers, tracing=None, share=None) -> None:
    """Run every request on `engine.sessions` worker threads (started on `workers`) and wait
    for them, in short waits so Ctrl-C reaches the main thread at once (the caller's
    `workers.finish()` waits for them again). A request that fails gets its error record and
    the job goes on; a worker's unexpected error (or EngineFailing) stops the others from
    starting new requests; it is kept on the thread (`error`) and raised by the caller after
    the engine is closed."""
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
                _one(engine, out, prog, tok, *item, stop=stop, lock=lock, tracing=tracing, fails=fails, share=share)
            except _Stopped:
                return
            except BaseException:
                stop.set()
                raise  # kept on the thread (Workers)

    n = max(1, min(getattr(engine, "sessions", 1), len(runnable)))
    if n == 1:  # one session: the requests run on this thread (no torch work in another thread)
        for item in todo:
            _one(engine, out, prog, tok, *item, tracing=tracing, fails=fails, share=share)
        return
    for i in range(n):
        workers.start(work, f"batch-{i}")
    workers.wait()


def _generate(engine, ids: list[int], rcfg, stream, req: Request, tok, tracing, share=None):
    """engine.generate, inside the request's memra.request span when the job is traced (its
    bursts' records into the job's share table, `share`)."""
    if tracing is None:
        return engine.generate(ids, rcfg, stream=stream)
    with tracing.request(rcfg, req.prompt, len(ids)) as treq:
        res = engine.generate(ids, rcfg, stream=stream, sink=share, span_sink=treq.sink, carrier=treq.carrier())
        treq.finish(res, tok.decode(res.token_ids) if rcfg.trace_content else "")
    return res


def _one(engine, out: Output, prog: Progress, tok, req: Request, ids: list[int], rcfg,
         stop: threading.Event | None = None, lock=None, tracing=None, fails: _Failures | None = None,
         share=None) -> None:
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
            raise EngineFailing(f"the engine failed on {n} requests in a row (the last, id {show(req.id)}: "
                                f"{msg[:200]}): the job stops; their error records are in {out.path} (delete them "
                                "to run those requests again), the same command resumes the rest")

    try:
        res = _generate(engine, ids, rcfg, stream, req, tok, tracing, share)
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
        say_to(f"[batch] request {show(req.id)} (line {req.line}): {msg}; its error record is written, the job goes "
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


def batch_line(st: dict | None) -> str | None:
    """One line on where a batched job's time went: its steps (requests and rows a step, the
    time in them) and the time between them while requests were mid-generation (their host
    work and the batcher's wait; of it, the rounds the step leader ran for greedy requests:
    batching/chain.py), as the share the steps took (`busy`).

    >>> batch_line({"steps": 40, "mean_requests": 5.5, "mean_rows": 12.0, "step_ms": 80.0, "gap_ms": 20.0,
    ...             "busy": 0.8, "preemptions": 0})
    '[batch] batched: 40 steps, 5.5 requests / 12.0 rows a step; 80.0 ms in steps, 20.0 ms between them (busy 80 %)'
    >>> print(batch_line({"steps": 40, "mean_requests": 5.5, "mean_rows": 12.0, "step_ms": 80.0, "gap_ms": 20.0,
    ...                   "busy": 0.8, "preemptions": 0, "chained_rounds": 200, "leader_rounds_ms": 4.0}).split("; ")[1])
    80.0 ms in steps, 20.0 ms between them, 4.0 ms of it the leader's rounds for 200 request rounds (busy 80 %)
    >>> print(batch_line({"steps": 40, "mean_requests": 5.5, "mean_rows": 12.0, "step_ms": 80.0, "gap_ms": 20.0,
    ...                   "busy": 0.8, "preemptions": 0, "chained_rounds": 200, "leader_rounds_ms": 9.0,
    ...                   "draft_batches": 38, "mean_draft_batch": 5.2, "leader_maint_ms": 2.5,
    ...                   "leader_draft_ms": 5.0}).split("; ")[1])
    80.0 ms in steps, 20.0 ms between them, 9.0 ms of it the leader's rounds for 200 request rounds, drafted in 38 shared forwards of 5.2 requests (maintenance 2.5 ms, drafts 5.0 ms) (busy 80 %)
    >>> print(batch_line({"steps": 40, "mean_requests": 5.5, "mean_rows": 12.0, "step_ms": 80.0, "gap_ms": 20.0,
    ...                   "busy": 0.8, "preemptions": 0, "held_ms": 6.5}).split("; ")[1])
    80.0 ms in steps, 20.0 ms between them, 6.5 ms of it held for a request still on the host (busy 80 %)
    """
    if not st or not st.get("steps"):
        return None
    pre = f", {st['preemptions']} preempted" if st.get("preemptions") else ""
    lead = (f", {st['leader_rounds_ms']} ms of it the leader's rounds for {st['chained_rounds']} request rounds"
            if st.get("chained_rounds") else "")
    if st.get("draft_batches"):  # tap drafters: the step's requests drafted together (batching/chain_drafts.py)
        lead += f", drafted in {st['draft_batches']} shared forwards of {st['mean_draft_batch']} requests"
        if "leader_draft_ms" in st:
            lead += f" (maintenance {st['leader_maint_ms']} ms, drafts {st['leader_draft_ms']} ms)"
    if st.get("held_ms"):  # the loop holding a step for a request's next rows (batcher.py _ready_in)
        lead += f", {st['held_ms']} ms of it held for a request still on the host"
    return (f"[batch] batched: {st['steps']} steps, {st['mean_requests']} requests / {st['mean_rows']} rows a step; "
            f"{st['step_ms']} ms in steps, {st['gap_ms']} ms between them{lead} (busy {st['busy'] * 100:.0f} %){pre}")
