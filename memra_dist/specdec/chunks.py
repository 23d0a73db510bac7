"""Where a prompt's prefill chunks fall (pure: no torch, tested on CPU).

A chunk of n rows at prefix p costs about a*n (weights: GEMMs, FFN, norms) + b*n*(p + n/2)
(attention to the p rows before it and, causally, to its own). One engine (pp = 1) gains
nothing from unequal chunks: it runs them back to back, so every chunk is `max_rows` but
the last. A pipeline (pp > 1) runs chunk c on stage s while stage s+1 runs chunk c-1; its
time is about (chunks + stages - 1) x the slowest chunk's stage time, so the chunks should
(1) be several per stage and (2) cost the same: later chunks, with a longer prefix, shrink
(SGLang's dynamic chunking solves the same equal-cost condition for each next size).
"""

from __future__ import annotations

import math

__all__ = ["DEFAULT_PREFILL_CHUNK", "fixed_chunks", "pipeline_chunks", "attention_weight", "MIN_PIPE_ROWS", "CHUNKS_PER_STAGE",
           "pack_chunks"]

# prompt rows per prefill forward (--prefill-chunk): working memory O(chunk x context);
# chosen by the prefill section's chunk sweep on an H200 (BENCHMARKS.md)
DEFAULT_PREFILL_CHUNK = 8192
MIN_PIPE_ROWS = 256  # a pipelined chunk below this runs its GEMMs well under the matrix peak
CHUNKS_PER_STAGE = 4  # the pipeline's fill and drain are (stages - 1) chunks out of chunks + stages - 1


def fixed_chunks(n: int, max_rows: int, start: int = 0) -> list[tuple[int, int]]:
    """[start, n) in chunks of `max_rows` rows, the last one shorter.

    >>> fixed_chunks(10, 4)
    [(0, 4), (4, 8), (8, 10)]
    >>> fixed_chunks(3, 8)
    [(0, 3)]
    """
    if max_rows < 1:
        raise ValueError(f"prefill chunk must be >= 1 row (got {max_rows})")
    return [(a, min(n, a + max_rows)) for a in range(start, n, max_rows)]


def attention_weight(hidden: int, heads: int, head_dim: int, kv_heads: int, intermediate: int) -> float:
    """b / a of the cost model for one layer: attention FLOPs per (row x prefix row) over the
    weight FLOPs per row (QKV, O, a gated FFN), both counted as 2 x multiply-adds.

    >>> round(attention_weight(4096, 32, 128, 8, 14336), 6)  # Llama-3-8B: 4 * 4096 / 436207616
    3.8e-05
    """
    per_row = 2 * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * intermediate)
    per_key = 4 * heads * head_dim  # q.k and p.v
    return per_key / per_row


def _equal_cost_rows(cost: float, prefix: int, ratio: float) -> float:
    """n with n * (1 + ratio * (prefix + n / 2)) = cost (cost in units of a)."""
    if ratio <= 0:
        return cost
    # (ratio / 2) n^2 + (1 + ratio * prefix) n - cost = 0
    a, b = ratio / 2, 1 + ratio * prefix
    return (-b + math.sqrt(b * b + 4 * a * cost)) / (2 * a)


def pipeline_chunks(n: int, max_rows: int, stages: int, ratio: float, start: int = 0,
                    min_rows: int = MIN_PIPE_ROWS) -> list[tuple[int, int]]:
    """[start, n) for a pipeline of `stages`: the first chunk is about (n - start) /
    (CHUNKS_PER_STAGE x stages) rows (never above `max_rows`, never below `min_rows` unless
    `max_rows` is), and each next chunk is sized to cost what the first did at its longer
    prefix (`ratio` = attention_weight), never below min(first, min_rows). One stage:
    fixed_chunks.

    >>> pipeline_chunks(4096, 8192, 2, 0.0)  # no attention cost: equal sizes
    [(0, 512), (512, 1024), (1024, 1536), (1536, 2048), (2048, 2560), (2560, 3072), (3072, 3584), (3584, 4096)]
    >>> [b - a for a, b in pipeline_chunks(32768, 8192, 2, 3.8e-05)][:3]  # later chunks shrink
    [4096, 3606, 3259]
    """
    if stages <= 1:
        return fixed_chunks(n, max_rows, start)
    if max_rows < 1:
        raise ValueError(f"prefill chunk must be >= 1 row (got {max_rows})")
    total = n - start
    first = min(max_rows, max(min(min_rows, total), math.ceil(total / (CHUNKS_PER_STAGE * stages))))
    floor = min(first, min_rows)
    cost = first * (1 + ratio * (start + first / 2))
    out, a = [], start
    while a < n:
        rows = first if a == start else int(_equal_cost_rows(cost, a, ratio))
        rows = min(max(floor, min(rows, max_rows)), n - a)
        out.append((a, a + rows))
        a += rows
    return out


def pack_chunks(chunks: list[list[tuple[int, int]]], budget: int) -> list[list[tuple[int, int, int]]]:
    """Many requests' chunk lists (request i: its [lo, hi) ranges in order) packed into passes
    of at most `budget` rows: each pass a list of (i, lo, hi), at most one chunk a request, each
    request's chunks in their order over the passes (its chunk c + 1 in a later pass than c).
    A pass takes a request's next chunk while it fits; a first chunk larger than the budget is
    a pass of its own. What the engine loop's drafter primes run as one forward each, their
    working memory bounded as one request's chunk bounds it (batching/batcher.py).

    >>> pack_chunks([[(0, 4), (4, 6)], [(0, 3)], [(0, 5)]], 8)
    [[(0, 0, 4), (1, 0, 3)], [(0, 4, 6), (2, 0, 5)]]
    >>> pack_chunks([[(0, 9)], [(0, 2)]], 8)
    [[(0, 0, 9)], [(1, 0, 2)]]
    >>> pack_chunks([[], [(0, 1)]], 8)
    [[(1, 0, 1)]]
    """
    at = [0] * len(chunks)
    out: list[list[tuple[int, int, int]]] = []
    while True:
        pack, rows = [], 0
        for i, cs in enumerate(chunks):
            if at[i] < len(cs):
                lo, hi = cs[at[i]]
                if not pack or rows + hi - lo <= budget:
                    pack.append((i, lo, hi))
                    rows += hi - lo
                    at[i] += 1
        if not pack:
            return out
        out.append(pack)
