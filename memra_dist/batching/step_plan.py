"""A batched step as the pipeline's stages take it (pp > 1; pure: no device, tested on CPU).

At pp > 1 the head keeps the block pool's bookkeeping and the batcher (batcher.py), and every
stage holds a paged K/V pool of the same geometry for its own layers. A step goes down the
ring as ONE command and one int64 row, the plan: each request's segment (its id, first
position, rows, the cache width its attention runs over alone, and its block table as the
head's pool holds it now), then the step's token ids (stage 0 embeds them). From that row a
stage rebuilds exactly the `BatchView` the head builds (`TablePool` answers what `BlockPool`
answers for the requests of this step), so every stage writes and reads the same slots.

Layout: [segments, rows, then per segment: rid, start, rows, width, blocks, table...,
then the ids (rows)].

>>> row = pack([(7, 0, 3, 32, [4, 5]), (9, 12, 1, 32, [0])], [11, 12, 13, 14])
>>> row
[2, 4, 7, 0, 3, 32, 2, 4, 5, 9, 12, 1, 32, 1, 0, 11, 12, 13, 14]
>>> parts, ids = unpack(row)
>>> parts, ids
([(7, 0, 3, 32, [4, 5]), (9, 12, 1, 32, [0])], [11, 12, 13, 14])
>>> pool = TablePool(rows=96, block=16, parts=parts)
>>> pool.slots(7, 0, 3), pool.slots(9, 12, 13), pool.table(7)
([64, 65, 66], [12], [4, 5])
"""

from __future__ import annotations

from .blocks import table_slots

__all__ = ["pack", "unpack", "TablePool", "swap_row", "unswap_row"]


def pack(parts: list[tuple[int, int, int, int, list[int]]], ids: list[int]) -> list[int]:
    """parts: (rid, start, rows, width, block table) in row order; ids: every row's token id."""
    rows = sum(p[2] for p in parts)
    if len(ids) != rows:
        raise ValueError(f"{len(ids)} ids for {rows} rows")
    out = [len(parts), rows]
    for rid, start, n, width, table in parts:
        out += [int(rid), start, n, width, len(table), *table]
    return out + [int(i) for i in ids]


def unpack(row: list[int]) -> tuple[list[tuple[int, int, int, int, list[int]]], list[int]]:
    n, rows = row[0], row[1]
    parts, i = [], 2
    for _ in range(n):
        rid, start, r, width, nb = row[i:i + 5]
        parts.append((rid, start, r, width, list(row[i + 5:i + 5 + nb])))
        i += 5 + nb
    ids = list(row[i:i + rows])
    if len(ids) != rows or i + rows != len(row):
        raise ValueError(f"a step plan of {len(row)} values does not hold {rows} ids after its segments")
    return parts, ids


class TablePool:
    """A stage's view of the head's block pool for one step: the block tables the plan carried
    (BatchView.build reads `slots`, `table` and `block`; PagedKV reads `rows`)."""

    def __init__(self, rows: int, block: int, parts=()):
        self.rows, self.block = rows, block
        self.tables = {p[0]: list(p[4]) for p in parts}

    def table(self, rid) -> list[int]:
        return list(self.tables[rid])

    def slots(self, rid, lo: int, hi: int) -> list[int]:
        t = self.tables[rid]
        if hi > len(t) * self.block:
            raise ValueError(f"positions [{lo}, {hi}) past request {rid}'s {len(t)} blocks")
        return table_slots(t, self.block, lo, hi)


def swap_row(rid: int, slots: list[int]) -> list[int]:
    """A preemption's command payload: the request and the slots its rows leave (or come back
    to), in position order.

    >>> unswap_row(swap_row(3, [16, 17, 40]))
    (3, [16, 17, 40])
    """
    return [int(rid), *slots]


def unswap_row(row: list[int]) -> tuple[int, list[int]]:
    return row[0], list(row[1:])
