"""The paged KV cache's bookkeeping (pure: no tensors): a pool of fixed-size blocks, a block
table per request, and the flat slot of each of a request's positions.

A request holds `ceil(rows / block)` blocks for the rows it has written so far: it reserves
its first rows when it is admitted, `grow`s block by block as it writes further, and gives them
all back when it ends, so memory follows each request's own length rather than a fixed
`--ctx` slot. When the pool cannot hold a new request or a growth, `reserve` / `grow` return
False and take nothing; the caller waits for blocks or preempts another request (batcher.py).

Slot s of the pool is row s % block of block s // block; position p of a request lives in
slot table[p // block] * block + p % block.

>>> pool = BlockPool(num_blocks=4, block=4)
>>> pool.reserve("a", 6), pool.reserve("b", 9), pool.free_blocks
(True, False, 2)
>>> pool.table("a"), pool.slots("a", 2, 6)
([0, 1], [2, 3, 4, 5])
>>> pool.reserve("c", 8), pool.table("c"), pool.slots("c", 3, 5)
(True, [2, 3], [11, 12])
>>> pool.release("a"); pool.reserve("b", 5), pool.table("b")
(True, [0, 1])
"""

from __future__ import annotations

__all__ = ["BlockPool", "blocks_for", "table_slots"]


def table_slots(table: list[int], block: int, lo: int, hi: int) -> list[int]:
    """The pool slots of positions [lo, hi) through a block table (slot = its block's first slot
    plus the position within the block)."""
    return [table[p // block] * block + p % block for p in range(lo, hi)]


def blocks_for(rows: int, block: int) -> int:
    """Blocks that hold `rows` rows.

    >>> blocks_for(0, 16), blocks_for(1, 16), blocks_for(16, 16), blocks_for(17, 16)
    (0, 1, 1, 2)
    """
    return -(-rows // block)


class BlockPool:
    def __init__(self, num_blocks: int, block: int):
        if num_blocks < 1 or block < 1:
            raise ValueError(f"a pool needs >= 1 block of >= 1 row (got {num_blocks} x {block})")
        self.num_blocks, self.block = num_blocks, block
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: lowest ids first
        self._tables: dict[object, list[int]] = {}
        self._rows: dict[object, int] = {}

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def rows(self) -> int:
        """Slots in the pool."""
        return self.num_blocks * self.block

    def fits(self, rows: int) -> bool:
        """Whether a request of `rows` rows could ever be admitted (the whole pool free)."""
        return blocks_for(rows, self.block) <= self.num_blocks

    def reserve(self, rid, rows: int) -> bool:
        """Take the blocks for `rows` rows for request `rid` (new); False (nothing taken) when
        the pool has too few free."""
        if rid in self._tables:
            raise ValueError(f"request {rid!r} already holds blocks")
        need = blocks_for(rows, self.block)
        if need > len(self._free):
            return False
        self._tables[rid] = [self._free.pop() for _ in range(need)]
        self._rows[rid] = rows
        return True

    def grow(self, rid, rows: int) -> bool:
        """Request `rid`'s reservation up to `rows` rows (more blocks at the end of its table);
        False (nothing taken) when the pool has too few free. Never shrinks.

        >>> pool = BlockPool(num_blocks=3, block=4)
        >>> pool.reserve("a", 3), pool.grow("a", 9), pool.table("a"), pool.capacity("a")
        (True, True, [0, 1, 2], 9)
        >>> pool.grow("a", 13), pool.grow("a", 5), pool.capacity("a")
        (False, True, 9)
        """
        have = self._tables[rid]
        need = blocks_for(rows, self.block) - len(have)
        if need > len(self._free):
            return False
        have.extend(self._free.pop() for _ in range(max(need, 0)))
        self._rows[rid] = max(self._rows[rid], rows)
        return True

    def shrink(self, rid, rows: int) -> int:
        """Request `rid` keeps the blocks of its first `rows` rows; the whole blocks past them go
        back to the pool (a rollback past rejected drafts). Returns the blocks freed.

        >>> pool = BlockPool(num_blocks=4, block=4)
        >>> pool.reserve("a", 14), pool.shrink("a", 5), pool.table("a"), pool.free_blocks
        (True, 2, [0, 1], 2)
        >>> pool.shrink("a", 8), pool.capacity("a")
        (0, 5)
        """
        have = self._tables[rid]
        keep = blocks_for(rows, self.block)
        self._rows[rid] = min(self._rows[rid], rows)
        if keep >= len(have):  # nothing wholly past the rows kept (most rounds)
            return 0
        freed = have[keep:]
        del have[keep:]
        self._free.extend(freed)
        self._free.sort(reverse=True)
        return len(freed)

    def release(self, rid) -> None:
        """Give request `rid`'s blocks back (nothing when it holds none)."""
        for b in reversed(self._tables.pop(rid, [])):
            self._free.append(b)
        self._rows.pop(rid, None)
        self._free.sort(reverse=True)  # lowest ids are taken first, whatever the release order

    def holds(self, rid) -> bool:
        return rid in self._tables

    def capacity(self, rid) -> int:
        """The rows request `rid` reserved."""
        return self._rows[rid]

    def table(self, rid) -> list[int]:
        return list(self._tables[rid])

    def slots(self, rid, lo: int, hi: int) -> list[int]:
        """The pool slots of positions [lo, hi) of request `rid`."""
        if not 0 <= lo <= hi <= self._rows[rid]:
            raise ValueError(f"positions [{lo}, {hi}) outside request {rid!r}'s {self._rows[rid]} rows")
        return table_slots(self._tables[rid], self.block, lo, hi)
