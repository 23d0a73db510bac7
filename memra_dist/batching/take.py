"""Which waiting submissions a step takes (pure: no torch; the engine loop's `Batcher._lead`).

In arrival order up to `max_tokens` rows (at least one), as before; where steps with prefill
chunks replay CUDA graphs (graphs.py: `tail_rows`, the chunk rows such a step may hold), a
step's chunks are also kept within `tail_rows` while few prompt rows wait: a chunk that would
take the step past it waits for the next step (one step: a few ms), so the decode rows beside it
replay a graph instead of a step launched kernel by kernel (25-37 ms of host time on an 8B,
measured on an H200, for a 200-row chunk's few ms of device work). Once `eager_rows` prompt rows or more wait (requests
arriving together), the step takes them all: a large step's host time hides behind its device
time, and one step of them beats several graphed ones. A chunk larger than `tail_rows` never
rides a graph: a step that holds one takes the rest as before.

>>> from collections import namedtuple
>>> J = namedtuple("J", "n last")
>>> jobs = [J(1, False), J(200, True), J(1, False), J(200, True), J(5, False)]
>>> take(jobs, 8192)                                   # no graphs for chunks: as before
[0, 1, 2, 3, 4]
>>> take(jobs, 8192, tail_rows=256, eager_rows=1024)   # the second chunk waits a step
[0, 1, 2, 4]
>>> take(jobs, 8192, tail_rows=256, eager_rows=400)    # 400 prompt rows wait: all at once
[0, 1, 2, 3, 4]
>>> take([J(300, True), J(40, True), J(1, False)], 8192, tail_rows=256, eager_rows=1024)  # eager anyway
[0, 1, 2]
>>> take([J(5, False), J(9, False)], 10)               # the row budget, in arrival order
[0]
"""

from __future__ import annotations

__all__ = ["take", "PREFILL_TAIL_ROWS", "EAGER_PREFILL_ROWS"]

# a step's prefill rows (its chunks, in all) that may ride a graphed step (graphs.py): a batch
# job's lines after a 2k shared header (200 tokens each) ride one beside 63 decode rows; a longer
# chunk is a prefill's work, where an eager step's host time (25-37 ms on an 8B) hides behind the
# device's
PREFILL_TAIL_ROWS = 256
# prompt rows waiting (within the row budget) from which a step takes them all at once: four
# graphed steps of PREFILL_TAIL_ROWS should cost about what one eager step of 1,024 rows does (an
# estimate from the GEMMs' work and the eager step's host time; the threshold is not yet tuned)
EAGER_PREFILL_ROWS = 4 * PREFILL_TAIL_ROWS


def take(pending, max_tokens: int, tail_rows: int = 0, eager_rows: int = 0) -> list[int]:
    """The indices (in order) of the `pending` jobs (each with `n` rows, `last` for a prefill
    chunk) the next step takes."""
    room = tail_rows
    if tail_rows:
        waiting, rows, large = 0, 0, False
        for j in pending:  # the prompt rows the budget would take
            if rows + j.n > max_tokens and rows:
                break
            rows += j.n
            waiting += j.n if j.last else 0
            large = large or (j.last and j.n > tail_rows)
        if large or waiting >= eager_rows:
            room = 0
    out, rows, fill = [], 0, 0
    for i, j in enumerate(pending):
        if out and rows + j.n > max_tokens:
            break
        if room and j.last:
            if fill and fill + j.n > room:
                continue  # the next step's
            fill += j.n
        out.append(i)
        rows += j.n
    return out
