"""CUDA graphs of the batched decode / verify steps (the GPU's batched fast path).

An eager batched step of an 8B model launches ~1,000 kernels from Python (~25-37 ms of host
time on an H200, BENCHMARKS.md) around ~5-6 ms of device work, so the
device idles most of the step. A step whose every request brings at most PAGED_MAX_ROWS rows
(decode rows, verify rows), with prefill chunks of at most PREFILL_TAIL_ROWS rows in all among
them (what a prompt leaves after a prefix-cache hit: a chat's next turn, a batch job's own lines
after a shared header; a short prompt), instead replays a graph of the whole forward. A chunk's
rows go to the paged kernel as segments of PAGED_MAX_ROWS rows over the same block table (each
row reads the positions up to its own, written by the step before the attention), and only its
last row's logits are handed back, as the eager step hands them. A step with a chunk replays a
graph of its own (the key's `tail`): its buckets step by 64 rows past 64 (`tail_bucket`), its
segments always take the kernel's row class 16, and its grid has a chunk's segments more than
the requests (`segments`); the loop keeps a step's chunks within PREFILL_TAIL_ROWS while few
prompt rows wait (take.py).

One graph per bucket (rows padded up to a bucket size, the class of the longest segment, the
block-table width), captured when the engine opens for the step sizes its requests will take
(`warm`), else on first use, over static buffers: every host input of a
step (ids, positions, the pool slot each row writes, each segment's first row and rows, the
block tables) is packed into ONE pinned host row and copied in one launch; the graph then
runs the embedding, every block over the paged K/V (the paged attention kernel, one launch a
layer) and the lm_head over every row, keeping the tapped layers' rows (a tap drafter's), which
are copied into each request's own sink after the replay. Padded rows write the pool's scratch slot (paged.py)
and padded segments have no rows, so nothing a request owns is touched and each request's rows
see what they see eager. Every graph writes its logits into ONE buffer of the largest bucket's rows
(a buffer per graph would hold gigabytes at large batches), copied out before the replay
returns (the next step rewrites it while a request may still be reading its rows).

A step that holds a trace-level-2 request's rows replays the bucket's timed twin: the same graph
with a device-clock stamp at every mixer / FFN boundary (phase/subsplit.py StampMarks, as a single
request's graphs take them), its stamps copied back behind the replay (before the step's readback)
and read once into each level-2 round's sub-split timer as the loop settles the round (a request
running its own rounds: at its next verify): level 2 times the graphed step, not an eager walk
drained twice a layer (which ran a lone request at a quarter of its rate).

A capture that fails (a kernel that cannot be captured on this stack) leaves that bucket eager,
with one warning. Other threads keep launching while a graph is captured (the requests'
sessions), so capture runs in thread-local error mode on its own stream.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from ..device import to_device
from ..graphs import STAMP_SLOTS, CapturedGraph, step_marks
from ..phase.subsplit import StampMarks, SubsplitTimer, no_drain
from .calibrate import best_ns
from .job import Job
from .paged import PAGED_MAX_ROWS, BatchView, PagedRows
from .step_forward import layers, mark_launch, scatter_taps
from .take import PREFILL_TAIL_ROWS

__all__ = ["StepGraphs", "bucket_rows", "graph_rows", "row_class", "tail_bucket", "PREFILL_TAIL_ROWS"]

SMALL_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)


def pieces(rows: int) -> int:
    """The paged kernel's segments a request's `rows` take (PAGED_MAX_ROWS rows each).

    >>> [pieces(n) for n in (1, 16, 17, 64)]
    [1, 1, 2, 4]
    """
    return -(-rows // PAGED_MAX_ROWS)


def bucket_rows(rows: int) -> int:
    """The padded row count of a step of `rows` rows: a few small sizes, then multiples of 32
    (a bucket wastes at most a third of a step's rows to padding above 16).

    >>> [bucket_rows(n) for n in (1, 3, 5, 17, 33, 49, 65, 100)]
    [1, 4, 8, 32, 48, 64, 96, 128]
    """
    for b in SMALL_BUCKETS:
        if rows <= b:
            return b
    return -(-rows // 32) * 32


def tail_bucket(rows: int) -> int:
    """The padded row count of a step with prefill rows: the small sizes up to 64, then
    multiples of 64 (its chunk's GEMMs make it a compute step: padding costs what it is, and
    each bucket is a capture at open).

    >>> [tail_bucket(n) for n in (9, 40, 64, 65, 200, 264)]
    [16, 48, 64, 128, 256, 320]
    """
    return bucket_rows(rows) if rows <= 64 else -(-rows // 64) * 64


def graph_rows(max_tokens: int, max_requests: int | None) -> int:
    """The most rows a graphed step can hold, and so the rows of the logits buffer every graph
    writes into: a step's row budget, within what `max_requests` requests bring to a graph (up to
    PAGED_MAX_ROWS rows each, and one prefill chunk's PREFILL_TAIL_ROWS): the budget alone
    (8,192 rows by default) would hold ~4 GB of fp32 logits for a 128k vocabulary.

    >>> graph_rows(8192, 64), graph_rows(8192, 4), graph_rows(40, 4), graph_rows(8192, None)
    (1280, 320, 48, 8192)
    """
    rows = bucket_rows(max_tokens)
    if max_requests:
        rows = min(rows, tail_bucket(max_requests * PAGED_MAX_ROWS + PREFILL_TAIL_ROWS))
    return rows


def row_class(max_rows: int) -> int:
    """The longest segment's rows as the paged kernel's row block takes them: 1 (decode steps),
    8 (verify rows up to K = 7), 16. Three classes, not every power of two, because a drafter
    whose k varies per request (ngram) would otherwise meet a new graph every few steps.

    >>> [row_class(n) for n in (1, 2, 3, 5, 8, 9, 16)]
    [1, 8, 8, 8, 8, 16, 16]
    """
    return 1 if max_rows <= 1 else 8 if max_rows <= 8 else PAGED_MAX_ROWS


class _CudaGraph(CapturedGraph):
    """The requests' threads keep launching while a step is captured lazily: thread-local mode."""

    mode = "thread_local"


@dataclass
class _Step:
    rows: int  # T: padded rows (and the segment slots: a segment has >= 1 row)
    width: int  # block-table width
    host: torch.Tensor  # the packed inputs, pinned on CUDA: ids | pos | slots | lo | nrows | table
    dev: torch.Tensor  # the same on the device (the graph reads it)
    graph: object = None
    copied: object = None  # event after the last host -> device copy (before `host` is rewritten)
    np: object = None  # `host`'s memory as a numpy array (the packing writes it without a torch op)
    tail: bool = False  # a prefill chunk rides it (its grid: StepGraphs.segments)
    marks: object = None  # a timed twin's boundaries (StampMarks / EventMarks), recorded at every replay
    _views: tuple | None = None

    def views(self):
        """The device row's fields (made once: `dev` never moves, and a step reads them up to
        three times on the loop's path)."""
        if self._views is None:
            T, W, d = self.rows, self.width, self.dev
            self._views = (d[:T], d[T:2 * T], d[2 * T:3 * T], d[3 * T:4 * T], d[4 * T:5 * T], d[5 * T:].view(T, W))
        return self._views


class StepGraphs:
    """The batched step graphs of one batcher. `eligible(jobs)` says whether a step can replay
    one; `run(jobs)` replays it (capturing its bucket first) and returns each job's logits.
    `graph_cls(fn, pool)` captures fn and exposes `.out` and `.replay()` (CPU tests pass an
    emulation that re-runs fn, which checks the padding and the packed inputs)."""

    def __init__(self, batcher, max_rows: int, graph_cls=_CudaGraph):
        self.b = batcher
        self.max_rows = graph_rows(max_rows, batcher.max_requests)
        self.logits: torch.Tensor | None = None  # shared by every graph (_logits_buf)
        self.graph_cls = graph_cls
        self.cuda = batcher.device.type == "cuda"
        self.steps: dict[tuple, _Step] = {}
        self.twins: dict[tuple, _Step] = {}  # level 2's timed twins, by the same keys
        # the paged kernel's request slots in a graph of T rows: min(T, this). Padded slots are
        # programs with nothing to do, but a grid of T slots (one a row) for 16 requests' verify
        # rows cost 2x the attention (BENCHMARKS.md)
        self.max_segments = batcher.max_requests or self.max_rows
        self.failed: set = set()
        self.pool = None
        self.replays = 0
        self.timed_replays = 0  # ... of timed twins (a level-2 request's rows in the step)
        self.tail_replays = 0  # ... of steps with prefill chunks
        self.captures = 0
        self.padded = 0  # rows of padding replayed (what the buckets waste)
        self.tails = False  # prefill chunks of up to PREFILL_TAIL_ROWS replay too (warm's `tails`)
        self.tail_top = 0  # ... in steps of up to this many rows (the largest tail bucket warm captured)
        self.timings: list[tuple[int, float]] = []  # (rows, ns) of the buckets timed at warm-up
        self.timing_s = 0.0  # ... and the seconds their timing took
        self.last_ids: torch.Tensor | None = None  # the ids of the step last replayed (padded)

    def eligible(self, jobs) -> bool:
        """Decode / verify rows up to the largest bucket's rows, in no more segments than the
        graphs' slots; with prefill chunks (`last`) among them, where `warm` captured the tails'
        buckets (`tails`), up to PREFILL_TAIL_ROWS of their rows and `tail_top` rows in all (the
        buckets captured for them). A longer chunk rides an eager step (its attention is a
        prefill's, and its host time hides behind its device time)."""
        rows = sum(j.n for j in jobs)
        fill = sum(j.n for j in jobs if j.last)
        if fill and not (self.tails and fill <= PREFILL_TAIL_ROWS and rows <= self.tail_top):
            return False
        return (rows <= self.max_rows and sum(pieces(j.n) for j in jobs) <= self.segments(bool(fill))
                and all(j.last or j.n <= PAGED_MAX_ROWS for j in jobs))

    def captured(self, jobs) -> bool:
        """A step of `jobs` replays a graph captured already (no capture would run it first): its
        bucket's timed twin where a job carries a level-2 timer (`run`'s choice)."""
        table = self.twins if any(j.timer is not None for j in jobs) else self.steps
        return self.eligible(jobs) and self._key(jobs) in table

    def segments(self, tail: bool) -> int:
        """The paged kernel's request slots of a graph: the requests', and with a prefill chunk
        its segments too (a 200-row chunk is 13 of them, beside 63 requests' decode rows)."""
        return self.max_segments + (pieces(PREFILL_TAIL_ROWS) if tail else 0)

    def warm(self, max_requests: int, rows_each: tuple[int, ...], width: int, timed: bool = False,
             tails: bool = False, twins: bool = False) -> tuple[int, float]:
        """Capture, before any request, the buckets that steps of up to `max_requests` requests
        of up to `rows_each` rows each take (1: decode; K + 1: verify, which may share a step
        with decode rows), over caches of `width` rows, so no capture stalls a running request
        (an 8B capture costs ~0.1-0.3 s); `tails`: also the buckets of a step with a prefill
        chunk of up to PREFILL_TAIL_ROWS rows beside the others' rows (where the prefix cache
        leaves one). The steps run on a request of the pool's own that holds `width` rows while
        it lasts. `timed`: each decode / verify bucket's replay is also timed (`timings`: (rows,
        ns), --spec-k auto's first fit of a step's cost, calibrate.py). `twins`: each decode /
        verify bucket's level-2 timed twin too (an engine opened at level 2: no twin is then
        captured inside a request's rounds). Returns (graphs captured, seconds)."""
        import time  # noqa: PLC0415

        t0, before = time.perf_counter(), self.captures
        pool, rid = self.b.pool, ("warm-up",)
        if not pool.fits(width) or not pool.reserve(rid, width):
            return 0, 0.0

        def job(n, last=False):
            return Job(rid, torch.zeros(n, dtype=torch.long), 0, width, last)

        try:
            with torch.inference_mode():  # as every step runs (step_forward.forward)
                most = min(max_requests, self.max_segments)
                steps = []  # (its jobs, timed)
                for c in sorted(set(rows_each)):  # decode / verify steps: `most` requests of c rows at most
                    top = bucket_rows(min(most * c, self.max_rows))
                    for T in sorted({bucket_rows(n) for n in range(1 if c == 1 else 2, top + 1)}):
                        n = min(T, most * c)  # the bucket's rows (bucket_rows(n) == T), in <= `most` segments
                        steps.append(([job(min(c, n - i)) for i in range(0, n, c)], True))
                if tails:  # a chunk of up to PREFILL_TAIL_ROWS rows, the others' rows beside it
                    self.tails = True
                    chunk, beside = min(PREFILL_TAIL_ROWS, width), max(rows_each)
                    self.tail_top = max(self.tail_top, min(tail_bucket(chunk + (most - 1) * beside), self.max_rows))
                    for T in sorted({tail_bucket(n) for n in range(1, self.tail_top + 1)}):
                        p = min(T, chunk)  # the chunk, then the others' rows up to T (at most most - 1 of them)
                        rest = [beside] * ((T - p) // beside) + ([(T - p) % beside] if (T - p) % beside else [])
                        steps.append(([job(p, True)] + [job(n) for n in rest[:most - 1]], False))
                for jobs, timed_c in steps:
                    if twins and timed_c and self.eligible(jobs) and self._key(jobs) not in self.twins:
                        self.run(jobs, timers=[SubsplitTimer(no_drain)])  # (its laps go nowhere)
                    if self.eligible(jobs) and self._key(jobs) not in self.steps:
                        self.run(jobs)
                        st = self.steps.get(self._key(jobs))
                        if timed and timed_c and st is not None:  # (a tail's: not the steps' cost)
                            t1 = time.perf_counter()
                            self.timings.append((sum(j.n for j in jobs), best_ns(st.graph.replay, self.b.device)))
                            self.timing_s += time.perf_counter() - t1
        finally:
            pool.release(rid)
        return self.captures - before, time.perf_counter() - t0

    def _key(self, jobs) -> tuple[int, int, int, int, bool]:
        """(padded rows, the longest segment's row class, block-table width, the widest cache,
        whether a prefill chunk rides it)."""
        rows = sum(j.n for j in jobs)
        block = self.b.pool.block
        width = max(-(-j.width // block) for j in jobs)
        if any(j.last for j in jobs):
            return tail_bucket(rows), PAGED_MAX_ROWS, width, max(j.width for j in jobs), True
        return (bucket_rows(rows), row_class(min(max(j.n for j in jobs), PAGED_MAX_ROWS)), width,
                max(j.width for j in jobs), False)

    def run(self, jobs, launched=None, ids_dev: torch.Tensor | None = None, copy: bool = True,
            patch=None, advance=None, timers=()) -> torch.Tensor | None:
        """The logits of every job's rows (a `last` job's last row only), in job order, from a
        replay; None when the bucket cannot be captured (the caller runs the step eager).
        `launched()`: called once the replay is launched (before anything waits on it). `ids_dev`:
        the rows' ids already on the device (copied over the packed ones: a step launched ahead).
        `copy=False`: the rows of the shared logits buffer itself, valid until the next replay.
        `patch`: rows whose drafts are still on the device, written over the packed ids
        (step_forward.py DraftPatch). `advance`: a verify launched ahead, its rows moved by the
        acceptance the device found (verify_ahead.py Advance; its bucket is captured). `timers`:
        the level-2 requests' sub-split timers: the bucket's timed twin replays, and its laps go
        to each timer."""
        key = self._key(jobs)
        timed = bool(timers)
        if (key, timed) in self.failed:
            return None
        st = (self.twins if timed else self.steps).get(key)
        if st is None:
            st = self._capture(key, jobs, timed)
            if st is None:
                return None
        else:
            self._load(st, jobs)
        if ids_dev is not None:
            st.views()[0][:ids_dev.shape[0]].copy_(ids_dev)
        if patch is not None:
            patch.apply(st.views()[0])
        if advance is not None:
            ids, pos, slots, _, _, table = st.views()
            advance.apply(ids, pos, slots, table, self.b.pool.block)
        mark_launch(self.b)
        st.graph.replay()
        if timed:
            self.timed_replays += 1
            st.marks.add_to(*timers)  # (read once for all of them)
        self.last_ids = st.views()[0]  # (the step's ids on the device, until the next load of its bucket)
        if launched is not None:
            launched()
        rows = sum(j.n for j in jobs)
        self.replays += 1
        self.padded += st.rows - rows
        tail = any(j.last for j in jobs)
        self.tail_replays += tail
        logits, tapped = st.graph.out
        scatter_taps(jobs, tapped, st.views()[1])  # the tapped rows into each request's sink
        if tail:  # a prefill chunk's last row only (as the eager step's lm_head)
            keep, lo = [], 0
            for j in jobs:
                keep.extend([lo + j.n - 1] if j.last else range(lo, lo + j.n))
                lo += j.n
            # (a gather: a copy already; the indices through pinned memory, so the host does not
            # wait for the replay just launched, as a pageable copy would)
            return logits[to_device(keep, logits.device)]
        return logits[:rows].clone() if copy else logits[:rows]  # the next replay rewrites it

    def stats(self) -> dict:
        return {"captured": self.captures, "replays": self.replays, "prefill_replays": self.tail_replays,
                "timed_replays": self.timed_replays,
                "padded_rows": self.padded,
                "eager_buckets": len(self.failed)}

    def _pack(self, st: _Step, jobs) -> None:
        """Write the step's inputs into the pinned host row (padded rows: id 0, position 0, the
        scratch slot; padded segments: no rows), through its numpy view: no torch call, and no
        tensor built from a list of T x (5 + W) ints (~0.3 ms a verify step of 16 requests)."""
        T, W, pool, a = st.rows, st.width, self.b.pool, st.np
        a.fill(0)
        a[2 * T:3 * T] = self.b.kv.scratch
        r, s, tab = 0, 0, 5 * T
        for j in jobs:
            n = j.n
            a[r:r + n] = j.ids if isinstance(j.ids, list) else j.ids.tolist()
            a[T + r:T + r + n] = range(j.start, j.start + n)
            a[2 * T + r:2 * T + r + n] = pool.slots(j.rid, j.start, j.start + n)
            tbl = pool.table(j.rid)
            for p in range(0, n, PAGED_MAX_ROWS):  # its segments (a prefill tail's: several, one table)
                a[3 * T + s], a[4 * T + s] = r + p, min(PAGED_MAX_ROWS, n - p)
                a[tab + s * W:tab + s * W + len(tbl)] = tbl
                s += 1
            r += n

    def _load(self, st: _Step, jobs) -> None:
        if st.copied is not None:
            st.copied.synchronize()  # the previous copy out of the host row is done (it is, by now)
        self._pack(st, jobs)
        st.dev.copy_(st.host, non_blocking=True)
        if st.copied is not None:
            st.copied.record()

    def _body(self, st: _Step, rclass: int, max_len: int):
        b, stage = self.b, self.b.stage
        ids, pos, slots, lo, nrows, table = st.views()
        view = BatchView(slots, [], PagedRows(lo.to(torch.int32), nrows.to(torch.int32), table.to(torch.int32),
                                              b.pool.block, rclass, max_len, min(st.rows, self.segments(st.tail))))
        if st.marks is not None:
            st.marks.reset()  # (the warm-ups' boundaries: only the recorded walk's stay)
        h, tapped = layers(b, ids, pos, view, st.marks)
        out = self._logits_buf(stage)[:st.rows]
        out.copy_(stage.logits(h))  # the temporary goes back to the pool: the next capture reuses it
        return out, tapped

    def _logits_buf(self, stage) -> torch.Tensor:
        """ONE fp32 logits buffer of the largest bucket's rows that every graph writes its rows
        into, allocated outside any capture: a buffer per graph would hold a bucket's logits
        each (an 8B's 23 buckets: ~1 GB; at --max-batch 256, several GB)."""
        if self.logits is None:
            self.logits = torch.empty(self.max_rows, stage.cfg.vocab_size, dtype=torch.float32, device=self.b.device)
        return self.logits

    def _capture(self, key, jobs, timed: bool = False) -> _Step | None:
        T, rclass, W, max_len, tail = key
        dev = self.b.device
        n = 5 * T + T * W
        host = torch.zeros(n, dtype=torch.long, pin_memory=self.cuda)
        st = _Step(T, W, host, torch.zeros(n, dtype=torch.long, device=dev), np=host.numpy(), tail=tail)
        if timed:  # (stamps copied back into a ring of host rows: a step's laps are read a round later)
            st.marks = step_marks(dev, turns=TWIN_TURNS) if self.cuda else _host_marks()
        self._load(st, jobs)
        if self.cuda and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                self._logits_buf(self.b.stage)  # before the capture: its memory is not the graph pool's
                st.graph = self.graph_cls(lambda: self._body(st, rclass, max_len), self.pool)
        except Exception as e:  # noqa: BLE001 (a bucket that cannot be captured runs eager)
            self.failed.add((key, timed))
            if len(self.failed) == 1:  # one line, not one per bucket
                print(f"[memra] warning: a batched step of {T} rows was not captured ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); such steps run eager", file=sys.stderr, flush=True)
            return None
        if self.cuda:
            st.copied = torch.cuda.Event()
            st.copied.record()
        (self.twins if timed else self.steps)[key] = st
        self.captures += 1
        return st


TWIN_TURNS = 8  # host rows a timed twin's stamps rotate through: a chained round reads its step's at
# the step's settle, a request running its own rounds at its next verify (a few replays later at most)


def _host_marks() -> StampMarks:
    """A CPU step's boundaries (the tests' emulated graphs): each stamp is the host clock when the
    walk was recorded, so a replay's laps are the recorded walk's."""

    def stamp(buf, i):
        buf[i] = time.perf_counter_ns()

    return StampMarks(torch.zeros(STAMP_SLOTS, dtype=torch.int64), stamp)
