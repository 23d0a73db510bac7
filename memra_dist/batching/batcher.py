"""Many requests' rows in one forward: the batcher every batched request's target submits to.

Each request runs its own speculative session (specdec/session.py, unchanged: its drafter,
acceptance, sampling generator, phase clock and spans) in its own thread, over a `BatchSlot`
(slot.py) instead of a ModelRunner. A slot's forward (a prefill chunk, a decode row, or a
verify of 1 + k rows) is submitted here and waits; the engine loop (`_run`: one thread, from
the first submission until `close`, the only one that launches a step) runs every pending
submission as ONE forward of the stage (embedding, each block's projections and FFN over all
rows at once, attention per request over its own paged K/V: paged.py), then hands each
request its rows' output. A caller's thread never leads a step. So decode rows, verify rows of different
lengths (k per request, 0 included) and new requests' prefill chunks share a forward, and
requests join (`admit`) and leave (`leave`) between steps: continuous batching.

When a step runs: as soon as every admitted request has a submission waiting (or is away on
the host for a while: its first token drawn, its drafter priming, `step_away`); else once no
new submission has come for `max_wait_s` (a request busy on the host, or its client slow to
read, never holds the others longer than that), and at the latest `MAX_HOLD` waits after the
previous step's end (or the oldest submission, if later). Counting silence rather than time
since the oldest submission matters: the requests back from a step come back one after
another (their host work — acceptance, the next drafts — is serialised by the GIL: ~0.1-0.2 ms
each), so 64 of them take longer than any fixed wait, and a fixed wait would launch the next
step with part of them, splitting the requests into groups that alternate steps for good.
A step takes waiting submissions in arrival order up to `max_tokens` rows (at least one); the
rest go in the next step (where steps with prefill chunks replay graphs, a chunk that would take
the step past the graphs' chunk rows waits a step while few prompt rows wait: take.py). Each
request's rows see exactly the inputs they see alone (paged.py), so what shares a step never
changes a result.

Memory follows length: a request is admitted with the blocks of its first rows (blocks.py) and
grows block by block as its forwards reach further. When a growth finds the pool empty, the
request preempts another: the most recently admitted one that has no rows in the pending or
running step is swapped out (its K/V rows copied to host memory, its blocks freed, its
submissions no longer awaited) and swapped back in, into whatever blocks it then gets, before
its next forward: its rows come back bitwise, so nothing is lost and nothing recomputed. A
swap-in only waits for blocks (it never preempts, so two requests cannot evict each other in
turn); an admission waits too. A request larger than the whole pool is refused with one line.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from ..errors import UserError
from .blocks import BlockPool
from .device_idle import DeviceIdle
from ..device import device_mark
from .ahead import plan_ahead, stage_readback, take_readback
from .chain import Chain
from .chain_drafts import draft_early, pre_maintain
from .loop_rounds import chain_rounds, choose_first_k
from .job import BatchStep, Job
from ..specdec.spec_k import EngineAcceptance, StepCost
from .stats import BatchStats
from .step_ids import StepIds
from .paged import PagedKV
from .prefix_cache import InFlight
from .primes import Prime, due_in, run_due
from .residency import Residency
from .step_forward import launch, wake
from .verify_ahead import Advance, plan_verify_ahead
from .take import EAGER_PREFILL_ROWS, PREFILL_TAIL_ROWS, take as take_jobs

__all__ = ["Batcher", "BatchStats", "BatchStep"]

MAX_WAIT_S = 0.005  # the longest silence (no new submission) a step waits through
MAX_HOLD = 4  # a step waits at most this many MAX_WAIT_S after the previous one ended


class Batcher(Residency):
    def __init__(self, stage, device, dtype, pool: BlockPool, max_tokens: int, max_wait_s: float = MAX_WAIT_S,
                 graphs: bool = False, graph_cls=None, tap_layers: tuple[int, ...] = (), max_requests: int | None = None):
        if max_tokens < 1:
            raise UserError(f"--max-batch-tokens must be >= 1 (got {max_tokens})")
        self.stage, self.device, self.dtype, self.pool = stage, device, dtype, pool
        self.kv = PagedKV(stage, pool, device, dtype)
        # on our kernels (kernels/ops.py install): decode / verify rows through the paged kernel
        self.kernels = all(getattr(b.self_attn, "fast_attn_rows", 0) > 0 and b.self_attn.rope_kernel_ok()
                           for b in stage.layers.values())
        self.max_tokens, self.max_wait_s = max_tokens, max_wait_s
        self.max_requests = max_requests  # requests a step holds at most (the backend's --max-batch): the graphs' grid
        self.salt = b""  # the prefix cache's: the model and dtype whose K/V the pool holds (prefix_cache.py salt_for)
        self.tap_layers: tuple[int, ...] = tuple(tap_layers)  # the layers the requests' tap drafters read
        self.tap_pool = None  # the requests' tap sinks as slots of one pool (model/tap_pool.py)
        self.tap_blocks = None  # the prefix cache's blocks' tap rows (tap_blocks.py), where both are on
        if self.tap_layers and max_requests:
            from ..model.tap_pool import TapPool  # noqa: PLC0415

            self.tap_pool = TapPool(self.tap_layers, max_requests, stage.cfg.hidden_size, device, dtype)
        # decode / verify steps replayed as CUDA graphs (graphs.py): on the kernels only (the
        # paged kernel takes every segment, no gather); graph_cls: a test's emulation
        self.graphs = None
        if self.kernels and (graphs or graph_cls is not None):
            from .graphs import StepGraphs  # noqa: PLC0415

            self.graphs = StepGraphs(self, max_tokens, **({"graph_cls": graph_cls} if graph_cls else {}))
        # one lock, two conditions: callers wait on `cv` (their blocks, their rows' step done),
        # the engine loop alone on `_loop_cv` (a submission wakes it, and only it)
        lock = threading.RLock()
        self.cv = threading.Condition(lock)
        self._loop_cv = threading.Condition(lock)
        self.pending: list[Job] = []
        self.primes: list[Prime] = []  # new requests' drafters the loop allocates and primes before its next step
        self.priming: set = set()  # requests whose prompt's last chunk has run: each queues a prime soon
        self.priming_now: set = set()  # requests whose primes the loop is running (unlocked)
        self.last_prime = 0  # perf_counter_ns of the latest prime queued
        self.admitted: dict = {}  # request id -> admission order (the latest is preempted first)
        self.swapped: dict = {}  # request id -> (rows, host K/V per layer): preempted, back before its next forward
        self.running_rids: set = set()
        self.running_jobs: list[Job] = []
        self._order = 0
        self.running = False
        self.last_end = 0  # perf_counter_ns when the latest step ended
        self.prev_rids: set = set()  # the requests of the latest step
        self.last_submit = 0  # perf_counter_ns of the latest submission
        self.finished: set = set()  # requests whose chain ended with them: no step waits for their rows
        self.away: set = set()  # requests on the host between submissions for a while (step_away): no step waits
        self.ahead = self.graphs is not None  # plain greedy chains one step ahead (ahead.py): the GPU's graphed steps
        self.verify_ahead = self.graphs is not None  # ... and early-drafted verifies (verify_ahead.py)
        self.remote = None  # pp > 1: the earlier stages down the ring (pipeline/batch_head.py RingWalk)
        self.loop: threading.Thread | None = None  # the engine loop: leads every step (started at the first submission)
        self.closed = False
        self.leaving: set = set()  # requests gone while a step in flight held their rows (leave)
        self.ahead_rids: set = set()  # the requests of the step launched behind the running one (ahead.py)
        self._wakes: list[Chain] = []  # chains with a new round (or ended), their threads not yet woken
        self.stats = BatchStats()
        self.idle = DeviceIdle()  # the device's waits for the loop between steps, by CUDA events
        # batch.step spans where a step may hold several requests; an engine of one request at a
        # time (--max-batch 1) traces each round as the seed does, its five phase spans, no step
        self.step_ids = StepIds() if max_requests != 1 else None
        self.launch_ids = None  # the ids of the step last launched, on the device (step_forward.py)
        self.inflight = InFlight()  # prompt blocks admitted requests compute and have not published (prefix_cache.py)
        self.auto_k = False  # --spec-k auto: each chained request's K chosen every step by goodput (specdec/spec_k.py)
        # ... from this fit of the steps' time by their rows (by bucket where steps replay graphs)
        self.cost = StepCost(bucket=_bucket_rows() if self.graphs is not None else None)
        self.acceptance = EngineAcceptance()  # ... and each request's acceptance, started from the engine's
        self.k0_steps = 0  # steps in a row whose every K chosen was 0 (loop_rounds.py choose_k)
        self.draft_seen = None  # a drafting left on the device, its cost observed after the next step (loop_rounds.py)
        self._held_since = 0  # ns the loop held steps back since the latest step ended
        self._rounds_last = 0  # ns of the chained rounds after the latest step

    def close(self, timeout: float = 30.0) -> None:
        """No step runs after this returns (within `timeout`): every submission still queued
        fails, every chain is cancelled, and the engine loop is joined. Called when the engine
        closes, so no thread runs torch code while the interpreter exits."""
        with self.cv:
            self.closed = True
            for j in self.pending + self.running_jobs:
                if j.chain is not None:
                    j.chain.cancel()
            self._fail_pending(RuntimeError("the engine closed"))
            for p in self.primes:  # (their requests raise it from their next take)
                p.chain.err, p.chain.ended = RuntimeError("the engine closed"), True
                p.chain.wake()
            self.primes = []
            loop = self.loop
            self.cv.notify_all()
            self._loop_cv.notify()
        if loop is not None and loop is not threading.current_thread():
            loop.join(timeout)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Until no step runs or is queued and every request that left has its blocks back
        (a step launched one step ahead may still run after its requests have returned);
        False if that takes longer than `timeout`."""
        with self.cv:
            return self.cv.wait_for(lambda: not (self.running or self.pending or self.leaving), timeout)

    # ---- one forward's rows ----
    def submit(self, rid, ids: torch.Tensor, start: int, width: int, last: bool, taps=None, timer=None,
               primes: bool = False):
        """Request `rid`'s rows `ids` at positions [start, start + len) (its attention as over a
        cache of `width` rows); returns what its runner's forward would (fp32 logits of every
        row, or of the last with `last`), the step it rode in, and its rows' argmax and the
        logit at each (host lists: the step reads every request's back at once). `taps`: the
        request's TapSink, which gets its rows' outputs of the tapped layers. `timer`: a level-2
        request's sub-split timer, which gets the step's laps (laps.py). `primes`: the prompt's
        last chunk, after which the request's drafter primes on the loop (`prime`)."""
        job = Job(rid, ids, start, width, last, taps=taps, timer=timer, primes=primes)
        with self.cv:
            self._open()
            self._hold(rid, start + ids.shape[0])
            self._queue(job)
            while not job.done:
                self.cv.wait()
        if job.err is not None:
            raise job.err
        return job.out, job.step, job.greedy

    def submit_many(self, items) -> list:
        """`submit` for several requests at once from the engine loop of another batcher (a chained
        drafter's draft step for all its requests: draft_model.py `propose_many`): `items` (rid,
        ids, start, width, last) queued together and due at once (no wait for other requests'
        rows: the loop that calls this is the only one that would bring them). A request whose
        rows cannot be held without waiting (`_try_hold`: the caller's loop must not wait for
        blocks that only its own progress frees) is not queued. -> each one's (out, step,
        greedy), None for one not queued; the first error raised after all are done."""
        jobs = [Job(rid, ids, start, width, last, now=True) for rid, ids, start, width, last in items]
        with self.cv:
            held = []
            for job in jobs:  # (each queued once held: a queued one is no later one's preemption victim)
                held.append(self._try_hold(job.rid, job.start + job.n))
                if held[-1]:
                    self._queue(job)
            while not all(j.done for j, ok in zip(jobs, held) if ok):
                self.cv.wait()
        err = next((j.err for j, ok in zip(jobs, held) if ok and j.err is not None), None)
        if err is not None:
            raise err
        return [(j.out, j.step, j.greedy) if ok else None for j, ok in zip(jobs, held)]

    def _queue(self, job: Job) -> None:
        """Called holding the lock: `job` waits for a step; the loop (started now if it is not
        running) is the one thread woken: waking every caller on every submission cost a
        wake-up storm a step (16 requests: 240 wake-ups; the host's step time 5.8 -> 3.4 ms)."""
        self._open()
        self.away.discard(job.rid)  # back: the steps wait for its rows again
        self.pending.append(job)
        self.last_submit = job.t
        self._wake_loop()

    def _wake_loop(self) -> None:
        """Called holding the lock: the loop (started now if it is not running) woken, and only it."""
        if self.loop is None:
            self.loop = threading.Thread(target=self._run, name="memra-engine-loop", daemon=True)
            self.loop.start()
        self._loop_cv.notify()

    # ---- rounds the leader runs (chain.py) ----
    def start_chain(self, ch: Chain) -> None:
        """Hand request `ch.rid`'s rounds to the engine loop: its first verify rows are queued
        here (waiting for blocks, or preempting, as a submission does); the loop queues each
        next one right after the step before. The request's own thread only takes its rounds
        (`take`), waiting on its own chain's signal, so a step's end wakes each of them once
        and none queues for the batcher's lock."""
        if self.auto_k:
            with self.cv:  # (the engine's average is the loop's to update)
                ch.acc = self.acceptance.start(ch.rid, ch.k)  # (a request chained again keeps its own)
                choose_first_k(self, [ch])
        job = ch.next_job()
        with self.cv:
            self._open()
            self._hold(ch.rid, job.start + job.n)
            self._queue(job)

    def take(self, ch: Chain):
        """The chain's next round (chain.ChainRound), waiting for it; None once the chain has
        ended and every round was taken."""
        while not ch.rounds and not ch.ended:
            ch.wait()
        return ch.rounds.popleft() if ch.rounds else None

    def prime(self, rid, drafter, prompt: list[int], chunks, capacity: int, chain: Chain, rows: int = 0) -> None:
        """Request `rid`'s drafter allocated (`capacity` rows) and primed on its prompt by the
        engine loop, with the other new requests' (primes.py), before its next step; then
        `chain`'s first round (its rounds, not started) proposed with theirs in one shared draft
        forward and queued (primes.py `start_chains`). Returns at once: the request streams its
        first token meanwhile, away (no step waits for it), and a prime that fails ends the
        chain with its error (raised from the request's next `take`). `rows`: its prefill
        chunk, the most prompt rows a shared prime's forward takes."""
        p = Prime(rid, drafter, prompt, chunks, capacity, chain, rows)
        with self.cv:
            self._open()
            self.primes.append(p)
            self.last_prime = p.t
            self._wake_loop()

    def _open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine is closed")

    def _run(self) -> None:
        """The engine loop: the one thread that leads steps, from the first submission until
        `close`. A step falls due as `_ready_in` says; meanwhile the loop sleeps on its own
        condition. A bug that escapes a step fails the submissions queued then (their requests
        end with it); the loop and the requests that come later go on."""
        with self.cv:
            while not self.closed:
                try:
                    if self.running:
                        self._flush_wakes()
                        self._loop_cv.wait()
                        continue
                    # new requests' drafters first (primes.py), once those of a step are all in
                    prime_in = due_in(self) if self.primes else None
                    if prime_in is not None and prime_in <= 0:
                        run_due(self)
                        continue
                    step_in = self._ready_in() if self.pending else None
                    if step_in is not None and step_in <= 0:
                        self._lead()
                        continue
                    self._flush_wakes()
                    t = time.perf_counter_ns()
                    waits = [w for w in (prime_in, step_in) if w is not None]
                    self._loop_cv.wait(min(waits) if waits else None)
                    if step_in is not None:
                        held = time.perf_counter_ns() - t
                        self.stats.holds += 1
                        self.stats.held_ns += held
                        self._held_since += held  # (the next step's span says it)
                except BaseException as e:  # noqa: BLE001 (no request waits forever on a step that broke)
                    self.pending = self.running_jobs + self.pending
                    self.running, self.running_rids, self.running_jobs = False, set(), []
                    self._fail_pending(e)
                    print(f"[memra] engine loop: a step failed ({type(e).__name__}: {e}); its requests end with it",
                          file=sys.stderr, flush=True)
            self._flush_wakes()

    def _fail_pending(self, e: BaseException) -> None:
        """Called holding the lock: every queued submission ends with `e` (a chain's request
        raises it from its next `take`)."""
        for j in self.pending:
            if j.chain is not None:
                if not j.chain.ended:
                    j.chain.err, j.chain.ended = e, True
                self._wakes.append(j.chain)
            else:
                j.err, j.done = e, True
        self.pending = []
        self.cv.notify_all()

    def _flush_wakes(self) -> None:
        """Wake the threads of the chains the last step gave a round: called once the next
        step is launched (or none is due), so their host work (commit, stream) runs while the
        device works, and none of them holds the GIL while the leader packs the next step."""
        wakes, self._wakes = self._wakes, []
        wake(wakes)

    def _ready_in(self) -> float:
        """Seconds until a step should run (<= 0: now)."""
        waiting = {j.rid for j in self.pending} | self.finished | self.away
        if self.admitted.keys() <= waiting or any(j.now for j in self.pending):
            return 0.0
        start = max(self.pending[0].t, self.last_end)
        quiet = max(self.last_submit, self.last_end)  # silence counts from the step's end at the earliest
        due = min(quiet + self.max_wait_s * 1e9, start + MAX_HOLD * self.max_wait_s * 1e9)
        return (due - time.perf_counter_ns()) / 1e9

    def _lead(self) -> None:
        """Called holding the lock: take a step's jobs, run it unlocked, hand the results out;
        then, while plain greedy chains go one step ahead (ahead.py), the steps launched behind it."""
        g = self.graphs
        tail = (PREFILL_TAIL_ROWS, EAGER_PREFILL_ROWS) if g is not None and g.tails else (0, 0)
        idx = take_jobs(self.pending, self.max_tokens, *tail)
        taken = set(idx)
        take = [self.pending[i] for i in idx]
        self.pending[:] = [j for i, j in enumerate(self.pending) if i not in taken]
        rows = sum(j.n for j in take)
        wakes, self._wakes = self._wakes, []
        behind = None  # (the step launched behind the previous one, when it began)
        while True:
            self.running, self.running_jobs = True, take
            self.running_rids = {j.rid for j in take}
            self.cv.release()
            try:
                out, nxt, ahead, t0, t1 = self._step(take, wakes, behind)
            finally:
                self.cv.acquire()
            self._end_step(take, rows, t0, t1, not isinstance(out, BaseException) and out.graphed)
            self._free_left(self.ahead_rids)
            if nxt is None:
                return
            self._flush_wakes()  # their rounds are in: the device runs the next step meanwhile
            take, rows, behind, wakes = nxt, sum(j.n for j in nxt), (ahead[0], max(ahead[1], t1)), ()
            self.ahead_rids = set()  # the step behind is now the running one (running_rids)

    def _step(self, take: list[Job], wakes, behind):
        """Called without the lock: step `take` launched (or, `behind`: launched one step ahead
        already, and when), the step behind it launched where its requests go one step ahead
        (ahead.py), and the step's rows handed out -> (its output, its readback, the step behind
        it and that one's (output, start) or None, its start, its end)."""
        if behind is None:
            t0 = time.perf_counter_ns()
            out = launch(self, take, wakes)
        else:
            out, t0 = behind
        nxt = staged = ahead = busy = None
        if not isinstance(out, BaseException):
            staged = stage_readback(out.pv)  # before anything is launched behind it
            pre = pre_maintain(take)  # (behind the readback's copy: that waits for the step alone)
            early = draft_early(take, out.pred, out.ids)  # (the next rounds' drafts)
            if pre or early:
                self.stats.pre_maintained += pre
                self.stats.early_drafted += early
                busy = device_mark()  # the device's work for this step ends with that ingest and drafting (device_idle.py)
            adv = None
            try:  # (queued primes run before the next step: none is launched behind this one)
                nxt = plan_ahead(self, take) if not self.primes else None
                if nxt is None and early and not self.primes:  # the next verifies (verify_ahead.py)
                    nxt = plan_verify_ahead(self, take)
                    adv = Advance(nxt, out.pred) if nxt is not None else None
            except Exception:  # noqa: BLE001 (going ahead is an optimisation: the step goes on)
                nxt = adv = None
            if nxt is not None:
                self.ahead_rids = {j.rid for j in nxt}
                self.stats.ahead += 1
                self.stats.ahead_verifies += adv is not None
                t_next = time.perf_counter_ns()
                # its ids: this step's argmax; a verify's: its bonus token and early drafts
                ahead = (launch(self, nxt, (), ids_dev=out.pred if adv is None else None, advance=adv), t_next)
        self._hand_out(take, out, staged)
        self.idle.fold()  # (the readback passed every event recorded before it)
        self.idle.ready((busy or staged[1]) if staged is not None and nxt is None else None)
        return out, nxt, ahead, t0, time.perf_counter_ns()

    @staticmethod
    def _hand_out(take: list[Job], out, staged) -> None:
        """Each job's rows of the step read back (or the step's error)."""
        try:
            if isinstance(out, BaseException):
                raise out
            host = take_readback(staged)
            anchor = (time.perf_counter_ns(), staged[1]) if staged[1] is not None else None
            logits = out.logits
            lo, r = 0, logits.shape[0]
            for j in take:
                j.anchor = anchor
                n = 1 if j.last else j.n
                if j.chain is None or not j.chain.greedy:  # a greedy chained round reads only its greedy rows
                    j.out = logits[lo:lo + n]
                j.greedy = (host[lo:lo + n], host[r + lo:r + lo + n])
                lo += n
        except BaseException as e:  # noqa: BLE001
            for j in take:
                j.err = e

    def _end_step(self, take: list[Job], rows: int, t0: int, t1: int, graphed: bool) -> None:
        """Called holding the lock after a step: its records and stats, the chained rounds, the
        submissions done."""
        used, free = self.pool.used_blocks, self.pool.free_blocks
        cached, evicted = self.pool.cached_blocks, self.pool.evictions
        predicted = int(self.cost.predict(rows)) if self.auto_k else 0  # before this step is fitted in
        sid = self.stats.steps
        rode = bool(self.running_rids & self.prev_rids)  # a request mid-generation waited for this step
        gap = max(0, t0 - self.last_end) if rode else 0
        before = (gap, min(self._rounds_last, gap), min(self._held_since, gap))
        for j in take:
            if j.primes:
                self.priming.add(j.rid)
            j.step = BatchStep(sid, len(take), rows, max(0, t0 - j.t), t1 - t0, used, free, self.stats.preemptions,
                               cached, evicted, t0, predicted, *before, spans=self.step_ids)
        self._held_since = 0
        self.running = False
        s = self.stats
        s.gap_ns += gap
        self.last_end = time.perf_counter_ns()
        self.prev_rids, self.running_rids = self.running_rids, set()
        self.running_jobs = []
        s.steps, s.rows, s.requests = s.steps + 1, s.rows + rows, s.requests + len(take)
        s.forward_ns += t1 - t0
        if self.auto_k:  # (a step with a prefill chunk replays a graph of its own: not its bucket's cost)
            self.cost.observe(rows, t1 - t0, graphed and not any(j.last for j in take))
        if not graphed:
            s.eager, s.eager_ns = s.eager + 1, s.eager_ns + t1 - t0
        s.max_requests = max(s.max_requests, len(take))
        tc = time.perf_counter_ns()
        chain_rounds(self, take)
        self._rounds_last = time.perf_counter_ns() - tc
        s.rounds_ns += self._rounds_last
        for j in take:
            j.done = True
        self.cv.notify_all()


def _bucket_rows():
    from .graphs import bucket_rows  # noqa: PLC0415 (graphs.py imports the step's CUDA path)

    return bucket_rows
