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

Prefix caching (`cache=True`): a full block whose content is known (its chained hash, see
prefix_cache.py) is `publish`ed by the request that wrote it; a later `reserve` offering the
same leading hashes shares those blocks read-only instead of taking fresh ones, and the request
runs only the rows past `shared_rows(rid)`. Every block counts the tables holding it; when the
count of a published block falls to 0 the block is not freed but kept, evictable, in an LRU
order (a request's tail blocks enter it first, so they leave first). Fresh blocks come from the
plain free list (lowest ids first) and only when it is empty from evicting the least recently
released cached block, whose hash is dropped first: a block is never handed out fresh while it
is registered, nor while any table holds it. With `cache=False` (the default) hashes are
ignored and the pool hands out exactly the blocks it always did.

>>> pool = BlockPool(num_blocks=4, block=4, cache=True)
>>> pool.reserve("a", 9), pool.publish("a", [b"h0", b"h1"]), pool.table("a")
(True, [(0, 0), (1, 1)], [0, 1, 2])
>>> pool.reserve("b", 10, [b"h0", b"h1"]), pool.table("b"), pool.shared_rows("b"), pool.free_blocks
(True, [0, 1, 3], 8, 0)
>>> pool.release("a"); pool.release("b"); pool.free_blocks, pool.cached_blocks
(4, 2)
>>> pool.reserve("c", 16), pool.table("c"), pool.cached_blocks  # free ones first, then evicts (LRU: the tail first)
(True, [2, 3, 1, 0], 0)
"""

from __future__ import annotations

from collections import OrderedDict

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
    def __init__(self, num_blocks: int, block: int, cache: bool = False):
        if num_blocks < 1 or block < 1:
            raise ValueError(f"a pool needs >= 1 block of >= 1 row (got {num_blocks} x {block})")
        self.num_blocks, self.block, self.cache = num_blocks, block, cache
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: lowest ids first
        self._tables: dict[object, list[int]] = {}
        self._rows: dict[object, int] = {}
        self._refs = [0] * num_blocks  # tables holding each block
        self._hash_of: dict[int, bytes] = {}  # published blocks (held or evictable) ...
        self._block_of: dict[bytes, int] = {}  # ... and the other way round
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks no table holds, LRU first
        self._shared: dict[object, int] = {}  # leading blocks each request took from the cache
        self.queries = self.hits = self.evictions = 0  # tokens offered, tokens shared; blocks

    @property
    def free_blocks(self) -> int:
        """Blocks a request can take: plain free ones and evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks registered under a hash (held or evictable)."""
        return len(self._hash_of)

    @property
    def rows(self) -> int:
        """Slots in the pool."""
        return self.num_blocks * self.block

    def fits(self, rows: int) -> bool:
        """Whether a request of `rows` rows could ever be admitted (the whole pool free)."""
        return blocks_for(rows, self.block) <= self.num_blocks

    def _take(self, n: int) -> list[int]:
        """`n` fresh blocks (the caller checked there are): plain free ones first, then evicted."""
        out = []
        for _ in range(n):
            b = self._free.pop() if self._free else self._evict()
            self._refs[b] = 1
            out.append(b)
        return out

    def _evict(self) -> int:
        b, _ = self._lru.popitem(last=False)
        del self._block_of[self._hash_of.pop(b)]
        self.evictions += 1
        return b

    def _drop(self, blocks) -> None:
        """One table fewer holds each of `blocks`: at 0 a cached one turns evictable (most recent
        last), any other goes back to the free list."""
        freed = False
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._hash_of:
                self._lru[b] = None
            else:
                self._free.append(b)
                freed = True
        if freed:
            self._free.sort(reverse=True)  # lowest ids are taken first, whatever the release order

    def _hit(self, hashes) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (each block once)."""
        out: list[int] = []
        if self.cache:
            for h in hashes:
                b = self._block_of.get(h)
                if b is None or b in out:
                    break
                out.append(b)
        return out

    def lookup(self, hashes: list[bytes]) -> int:
        """How many leading `hashes` are cached (held or evictable); changes nothing.

        >>> pool = BlockPool(num_blocks=4, block=2, cache=True)
        >>> pool.reserve("a", 4), pool.publish("a", [b"x", b"y"]), pool.lookup([b"x", b"z", b"y"])
        (True, [(0, 0), (1, 1)], 1)
        """
        return len(self._hit(hashes))

    def reserve(self, rid, rows: int, hashes: list[bytes] = ()) -> bool:
        """Take the blocks for `rows` rows for request `rid` (new): first the cached blocks of the
        longest prefix of `hashes` (full blocks within `rows`; the rest are ignored), shared, then
        fresh ones. False (nothing taken, nothing counted) when the pool has too few free for the
        fresh ones: the evictable blocks count, but not those this reservation would share.

        >>> pool = BlockPool(num_blocks=3, block=2, cache=True)
        >>> pool.reserve("a", 4), pool.publish("a", [b"x", b"y"]), pool.release("a")
        (True, [(0, 0), (1, 1)], None)
        >>> pool.reserve("b", 8, [b"x", b"y"]), pool.reserve("b", 6, [b"x", b"y"]), pool.table("b")
        (False, True, [0, 1, 2])
        """
        if rid in self._tables:
            raise ValueError(f"request {rid!r} already holds blocks")
        offered = list(hashes)[:rows // self.block] if self.cache else []
        shared = self._hit(offered)
        fresh = blocks_for(rows, self.block) - len(shared)
        if fresh > self.free_blocks - sum(b in self._lru for b in shared):
            return False
        for b in shared:
            self._refs[b] += 1
            self._lru.pop(b, None)
        self._tables[rid] = shared + self._take(fresh)
        self._rows[rid] = rows
        self._shared[rid] = len(shared)
        self.queries += len(offered) * self.block
        self.hits += len(shared) * self.block
        return True

    def shared_rows(self, rid) -> int:
        """The leading rows request `rid` took from the cache at `reserve` (it runs only those past
        them); 0 without a hit."""
        return self._shared[rid] * self.block

    def publish(self, rid, hashes: list[bytes]) -> list[tuple[int, int]]:
        """Request `rid`'s first `len(hashes)` blocks hold exactly those full blocks' content:
        register each under its hash, unless the hash is registered already (to any block) or
        the block is under another one. Nothing without `cache`. Returns the blocks registered
        now, as (index in the request's table, block id) (tap_blocks.py saves their tap rows).

        >>> pool = BlockPool(num_blocks=5, block=2, cache=True)
        >>> pool.reserve("a", 4), pool.reserve("b", 4), pool.publish("a", [b"x"]), pool.publish("b", [b"x", b"y"])
        (True, True, [(0, 0)], [(1, 3)])
        >>> pool.reserve("c", 5, [b"x", b"y"]), pool.table("c"), pool.cached_blocks
        (True, [0, 3, 4], 2)
        """
        have = self._tables[rid]
        if len(hashes) > len(have):
            raise ValueError(f"request {rid!r} holds {len(have)} blocks, not the {len(hashes)} published")
        if not self.cache:
            return []
        placed = []
        for i, (b, h) in enumerate(zip(have, hashes)):
            if h not in self._block_of and b not in self._hash_of:
                self._hash_of[b], self._block_of[h] = h, b
                placed.append((i, b))
        return placed

    def cache_stats(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "evictions": self.evictions,
                "cached_blocks": self.cached_blocks}

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
        if need > self.free_blocks:
            return False
        have.extend(self._take(max(need, 0)))
        self._rows[rid] = max(self._rows[rid], rows)
        return True

    def shrink(self, rid, rows: int) -> int:
        """Request `rid` keeps the blocks of its first `rows` rows; the whole blocks past them go
        back to the pool (a rollback past rejected drafts). Returns the blocks let go.

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
        let_go = have[keep:]
        del have[keep:]
        self._shared[rid] = min(self._shared[rid], keep)
        self._drop(reversed(let_go))
        return len(let_go)

    def release(self, rid) -> None:
        """Give request `rid`'s blocks back (nothing when it holds none); its tail blocks turn
        evictable first."""
        self._drop(reversed(self._tables.pop(rid, [])))
        self._rows.pop(rid, None)
        self._shared.pop(rid, None)

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
