"""Automatic prefix caching in the paged block pool (batching/blocks.py, batching/prefix_cache.py):
shared read-only prefix blocks, reference counts, LRU eviction under pressure only, the
all-or-nothing reserve, the counters, and `cache=False` handing out exactly what it always did."""

from __future__ import annotations

import random
import time

import pytest

from memra_dist.batching.blocks import BlockPool, blocks_for
from memra_dist.batching.prefix_cache import block_hashes, reusable_blocks, salt_for

B = 4  # rows per block in most tests


def _cached(pool: BlockPool, rid, tokens: list[int], rows: int | None = None) -> bool:
    """Reserve `rid` for `tokens` (+ nothing) offering the hashes it may reuse."""
    hashes = block_hashes(tokens, pool.block)[:reusable_blocks(len(tokens), pool.block)]
    return pool.reserve(rid, len(tokens) if rows is None else rows, hashes)


def _publish_prompt(pool: BlockPool, rid, tokens: list[int]) -> None:
    pool.publish(rid, block_hashes(tokens, pool.block))


# ---------------------------------------------------------------- prefix_cache.py


def test_block_hashes_one_per_full_block_and_chained():
    t = list(range(100, 111))  # 2 full blocks of 4, 3 tokens left over
    h = block_hashes(t, B)
    assert len(h) == 2 and all(len(x) == 16 for x in h) and h[0] != h[1]
    assert block_hashes(t[:8], B) == h and block_hashes(t[:7], B) == h[:1]
    # the same second block after another first block: another hash for both
    other = [0] + t[1:]
    assert block_hashes(other, B)[1] != h[1]
    # the same tokens at block 1 as at block 0 do not give block 0's hash
    assert block_hashes([7, 7, 7, 7, 7, 7, 7, 7], B)[0] != block_hashes([7, 7, 7, 7, 7, 7, 7, 7], B)[1]
    # deterministic, and the salt separates engines
    assert block_hashes(list(t), B) == h
    assert block_hashes(t, B, salt_for("m", "bf16")) != block_hashes(t, B, salt_for("m", "fp16"))
    assert block_hashes(t, B, salt_for("m", "bf16")) == block_hashes(t, B, salt_for("m", "bf16"))
    assert block_hashes(t, B, salt_for("m", "bf16")) != h
    # ids past 32 bits and negative ones are encoded, not truncated
    assert block_hashes([1 << 40, 0, 0, 0], B) != block_hashes([0, 0, 0, 0], B)
    assert block_hashes([-1, 0, 0, 0], B) != block_hashes([0, 0, 0, 0], B)


def test_block_hashes_of_a_long_prompt_are_fast():
    t = [random.Random(0).randrange(150_000) for _ in range(8192)]
    t0 = time.perf_counter()
    h = block_hashes(t, 16, salt_for("/models/x", "bfloat16"))
    assert len(h) == 512 and len(set(h)) == 512
    assert time.perf_counter() - t0 < 0.1


def test_reusable_blocks_leave_the_last_prompt_token_to_run():
    assert [reusable_blocks(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 0, 0, 0, 1, 1, 2]
    for n in range(1, 80):
        assert reusable_blocks(n, B) * B <= n - 1


def test_salt_parts_are_framed():
    assert salt_for("ab", "c") != salt_for("a", "bc") and salt_for("a") != salt_for("a", "")
    assert len(salt_for("x", 3)) == 16 and salt_for("x", 3) == salt_for("x", "3")


# ---------------------------------------------------------------- sharing


def test_same_prefix_shares_the_first_blocks_and_not_the_rest():
    pool = BlockPool(16, B, cache=True)
    a = list(range(10))  # blocks [0..3] [4..7] + 2 tokens
    assert _cached(pool, "a", a) and pool.shared_rows("a") == 0
    _publish_prompt(pool, "a", a)
    assert pool.cached_blocks == 2
    b = a[:9] + [99, 98]  # same two full blocks, then another tail
    assert _cached(pool, "b", b)
    assert pool.shared_rows("b") == 8
    assert pool.table("b")[:2] == pool.table("a")[:2]
    assert pool.table("b")[2] != pool.table("a")[2]
    assert not set(pool.table("b")[2:]) & set(pool.table("a"))
    # the shared blocks count once in what is used
    assert pool.used_blocks == len(set(pool.table("a")) | set(pool.table("b"))) == 4


def test_a_hit_is_capped_so_the_last_prompt_token_runs():
    pool = BlockPool(16, B, cache=True)
    a = list(range(8))  # exactly two full blocks
    assert _cached(pool, "a", a)
    _publish_prompt(pool, "a", a)
    assert _cached(pool, "b", a)  # the same prompt: only the first block may be reused
    assert pool.shared_rows("b") == 4 and pool.table("b")[0] == pool.table("a")[0]
    assert pool.table("b")[1] != pool.table("a")[1]


def test_a_chained_hash_does_not_hit_after_a_different_earlier_block():
    pool = BlockPool(16, B, cache=True)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert _cached(pool, "a", a)
    _publish_prompt(pool, "a", a)
    b = [0, 2, 3, 4, 5, 6, 7, 8, 9]  # block 1 is the same as a's, block 0 is not
    assert pool.lookup(block_hashes(b, B)) == 0
    assert _cached(pool, "b", b) and pool.shared_rows("b") == 0
    assert not set(pool.table("b")) & set(pool.table("a"))
    assert pool.hits == 0


def test_hashes_past_the_rows_are_ignored_and_a_miss_ends_the_prefix():
    pool = BlockPool(16, B, cache=True)
    assert pool.reserve("a", 12)
    pool.publish("a", [b"x", b"y", b"z"])
    assert pool.lookup([b"x", b"y", b"z"]) == 3 and pool.lookup([b"x", b"q", b"z"]) == 1
    assert pool.reserve("b", 6, [b"x", b"y", b"z"])  # 6 rows: one full block in them
    assert pool.shared_rows("b") == 4 and len(pool.table("b")) == 2
    assert pool.queries == 4 and pool.hits == 4
    assert pool.reserve("c", 12, [b"x", b"q", b"z"]) and pool.shared_rows("c") == 4
    assert pool.reserve("d", 12, [b"x", b"x"]) and pool.shared_rows("d") == 4  # never one block twice
    assert len(set(pool.table("d"))) == 3


def test_publish_keeps_the_first_registration():
    pool = BlockPool(8, B, cache=True)
    assert pool.reserve("a", 8) and pool.reserve("b", 8)
    pool.publish("a", [b"x"])
    pool.publish("a", [b"x"])  # again, the same hash: no error, no change
    pool.publish("b", [b"x", b"y"])  # x is a's block 0's: b's block 0 stays unregistered
    pool.publish("a", [b"w"])  # a's block 0 is x's already
    assert pool.cached_blocks == 2
    assert pool.lookup([b"w"]) == 0
    assert pool.reserve("c", 9, [b"x", b"y"])
    assert pool.table("c")[:2] == [pool.table("a")[0], pool.table("b")[1]]
    with pytest.raises(ValueError):
        pool.publish("a", [b"1", b"2", b"3"])  # a holds 2 blocks


# ---------------------------------------------------------------- reference counts


def test_a_shared_block_outlives_one_sharer_and_is_never_handed_out_while_held():
    pool = BlockPool(6, B, cache=True)
    p = list(range(9))
    assert _cached(pool, "a", p)
    _publish_prompt(pool, "a", p)
    assert _cached(pool, "b", p)
    shared = pool.table("b")[:2]
    pool.release("a")  # a's last block frees; the shared ones stay b's
    assert pool.free_blocks == 6 - 3
    assert pool.table("b")[:2] == shared
    # take everything else that can be taken: never a block b holds
    assert pool.reserve("c", pool.free_blocks * B)
    assert not set(pool.table("c")) & set(pool.table("b"))
    assert pool.free_blocks == 0 and not pool.reserve("d", 1)
    pool.release("c")
    pool.release("b")  # now the prefix blocks are evictable, still cached
    assert pool.free_blocks == 6 and pool.cached_blocks == 2
    assert pool.lookup(block_hashes(p, B)) == 2


def test_shrink_and_release_drop_one_count_each():
    pool = BlockPool(8, B, cache=True)
    assert pool.reserve("a", 12)
    pool.publish("a", [b"x", b"y", b"z"])
    assert pool.reserve("b", 12, [b"x", b"y", b"z"]) and pool.table("b") == pool.table("a")
    assert pool.free_blocks == 5
    assert pool.shrink("b", 4) == 2  # b lets two go; a still holds them
    assert pool.free_blocks == 5 and pool.shared_rows("b") == 4
    assert pool.shrink("a", 4) == 2  # now nobody holds them: evictable, not plain free
    assert pool.free_blocks == 7 and pool.cached_blocks == 3 and pool.lookup([b"x", b"y", b"z"]) == 3
    pool.release("a")
    assert pool.free_blocks == 7  # b still holds block 0
    pool.release("b")
    assert pool.free_blocks == 8 and pool.used_blocks == 0


# ---------------------------------------------------------------- eviction


def test_plain_free_blocks_go_first_then_the_least_recently_released_cached_ones():
    pool = BlockPool(6, B, cache=True)
    for rid, blocks in (("a", [b"a0", b"a1"]), ("b", [b"b0"])):
        assert pool.reserve(rid, len(blocks) * B)
        pool.publish(rid, blocks)
    ta, tb = pool.table("a"), pool.table("b")  # [0, 1], [2]
    pool.release("b")
    pool.release("a")  # LRU: b0 (released first), then a's tail a1, then a0
    assert pool.free_blocks == 6 and pool.cached_blocks == 3
    assert pool.reserve("c", 3 * B)  # the three plain free blocks: nothing evicted
    assert pool.table("c") == [3, 4, 5] and pool.evictions == 0 and pool.cached_blocks == 3
    assert pool.grow("c", 4 * B)  # pressure: the least recently released goes
    assert pool.table("c")[-1] == tb[0] and pool.evictions == 1
    assert pool.lookup([b"b0"]) == 0 and pool.lookup([b"a0", b"a1"]) == 2
    assert pool.grow("c", 5 * B)  # a's tail before its head
    assert pool.table("c")[-1] == ta[1] and pool.lookup([b"a0", b"a1"]) == 1
    assert pool.evictions == 2 and pool.cached_blocks == 1


def test_a_reuse_refreshes_a_block_in_the_lru_order():
    pool = BlockPool(4, B, cache=True)
    for rid, h in (("a", b"x"), ("b", b"y")):
        assert pool.reserve(rid, B)
        pool.publish(rid, [h])
    bx, by = pool.table("a")[0], pool.table("b")[0]
    pool.release("a")
    pool.release("b")  # LRU: x, y
    assert pool.reserve("c", B + 1, [b"x"]) and pool.table("c")[0] == bx  # x held again
    pool.release("c")  # LRU: y, x
    assert pool.reserve("d", 4 * B)  # both plain ones, then y, then x
    assert pool.table("d")[2:] == [by, bx] and pool.evictions == 2 and pool.cached_blocks == 0


def test_a_pool_full_of_evictable_blocks_admits_a_new_request():
    pool = BlockPool(4, B, cache=True)
    assert pool.reserve("a", 4 * B)
    pool.publish("a", [b"0", b"1", b"2", b"3"])
    pool.release("a")
    assert pool.free_blocks == 4 and pool.used_blocks == 0 and pool.cached_blocks == 4
    assert pool.reserve("b", 3 * B)
    assert pool.evictions == 3 and pool.cached_blocks == 1 and pool.lookup([b"0"]) == 1
    assert pool.table("b") == [3, 2, 1]  # the tail first
    # an evicted block is free of its old hash: its new owner may publish another
    pool.publish("b", [b"n"])
    assert pool.lookup([b"n"]) == 1 and pool.lookup([b"3"]) == 0


# ---------------------------------------------------------------- all or nothing


def _state(pool: BlockPool):
    return (pool.free_blocks, pool.cached_blocks, pool.cache_stats(), list(pool._free), list(pool._lru),
            {r: list(t) for r, t in pool._tables.items()}, list(pool._refs))


def test_reserve_takes_nothing_when_the_fresh_blocks_do_not_fit():
    pool = BlockPool(4, B, cache=True)
    assert pool.reserve("a", 2 * B)
    pool.publish("a", [b"x", b"y"])
    pool.release("a")  # x, y evictable; two plain free
    assert pool.reserve("z", 1)  # one plain free left
    before = _state(pool)
    # 2 shared + 2 fresh: 3 blocks can be taken, but 2 of them are the ones it would share
    assert not pool.reserve("b", 4 * B, [b"x", b"y"])
    assert _state(pool) == before and not pool.holds("b")
    assert not pool.reserve("b", 5 * B) and _state(pool) == before
    assert pool.reserve("b", 3 * B, [b"x", b"y"])  # 1 fresh: fits
    assert pool.shared_rows("b") == 2 * B and pool.free_blocks == 0 and pool.evictions == 0
    with pytest.raises(ValueError):
        pool.reserve("b", 1)


def test_grow_takes_nothing_when_short():
    pool = BlockPool(3, B, cache=True)
    assert pool.reserve("a", B)
    pool.publish("a", [b"x"])
    assert pool.reserve("b", B + 1, [b"x"])
    before = _state(pool)
    assert not pool.grow("b", 4 * B) and _state(pool) == before
    assert pool.grow("b", 3 * B) and pool.free_blocks == 0


# ---------------------------------------------------------------- counters


def test_counters_count_tokens_offered_shared_and_blocks_evicted():
    pool = BlockPool(4, B, cache=True)
    assert pool.cache_stats() == {"queries": 0, "hits": 0, "evictions": 0, "cached_blocks": 0}
    p = list(range(13))  # 3 full blocks, all reusable
    assert _cached(pool, "a", p)
    _publish_prompt(pool, "a", p)
    assert pool.cache_stats() == {"queries": 12, "hits": 0, "evictions": 0, "cached_blocks": 3}
    q = p[:8] + [50, 51, 52, 53, 54]  # 2 of 3 blocks hit
    assert not _cached(pool, "b", q)  # 4 blocks, 2 shared, 2 fresh, 0 free: not counted
    assert pool.queries == 12
    pool.release("a")
    assert _cached(pool, "b", q)  # 2 shared, 2 fresh: the plain one and a's evicted block 2
    assert pool.cache_stats() == {"queries": 24, "hits": 8, "evictions": 1, "cached_blocks": 2}
    assert pool.reserve("c", 0, block_hashes(p, B)) and pool.queries == 24  # no rows: nothing looked up


# ---------------------------------------------------------------- cache=False


class _Legacy:
    """The pool's semantics before prefix caching (the reference `cache=False` must match)."""

    def __init__(self, n, block):
        self.block, self.free, self.tables, self.rows = block, list(range(n - 1, -1, -1)), {}, {}

    def reserve(self, rid, rows):
        need = blocks_for(rows, self.block)
        if need > len(self.free):
            return False
        self.tables[rid], self.rows[rid] = [self.free.pop() for _ in range(need)], rows
        return True

    def grow(self, rid, rows):
        need = blocks_for(rows, self.block) - len(self.tables[rid])
        if need > len(self.free):
            return False
        self.tables[rid].extend(self.free.pop() for _ in range(max(need, 0)))
        self.rows[rid] = max(self.rows[rid], rows)
        return True

    def shrink(self, rid, rows):
        have, keep = self.tables[rid], blocks_for(rows, self.block)
        self.rows[rid] = min(self.rows[rid], rows)
        if keep >= len(have):
            return 0
        freed = have[keep:]
        del have[keep:]
        self.free = sorted(self.free + freed, reverse=True)
        return len(freed)

    def release(self, rid):
        self.free = sorted(self.free + self.tables.pop(rid, []), reverse=True)
        self.rows.pop(rid, None)


@pytest.mark.parametrize("cache", [False, True])
def test_without_caching_the_pool_hands_out_what_it_always_did(cache):
    """`cache=False` ignores hashes and `publish`; `cache=True` without any publish is the same."""
    rng = random.Random(7)
    pool, ref = BlockPool(20, B, cache=cache), _Legacy(20, B)
    rids = [f"r{i}" for i in range(6)]
    for _ in range(3000):
        rid, op = rng.choice(rids), rng.random()
        rows = rng.randrange(0, 40)
        if not pool.holds(rid):
            hashes = [] if cache else [b"h%d" % i for i in range(rng.randrange(0, 6))]
            assert pool.reserve(rid, rows, hashes) == ref.reserve(rid, rows)
        elif op < 0.3:
            assert pool.grow(rid, rows) == ref.grow(rid, rows)
        elif op < 0.6:
            assert pool.shrink(rid, rows) == ref.shrink(rid, rows)
        elif op < 0.75 and not cache:
            pool.publish(rid, [b"h%d" % i for i in range(len(pool.table(rid)))])
        else:
            pool.release(rid)
            ref.release(rid)
        assert pool.free_blocks == len(ref.free) and pool.used_blocks == 20 - len(ref.free)
        for r in rids:
            assert pool.holds(r) == (r in ref.tables)
            if pool.holds(r):
                assert pool.table(r) == ref.tables[r] and pool.capacity(r) == ref.rows[r]
                assert pool.shared_rows(r) == 0
    assert pool.cache_stats() == {"queries": 0, "hits": 0, "evictions": 0, "cached_blocks": 0}


# ---------------------------------------------------------------- randomized invariants


def _check(pool: BlockPool, reqs: dict) -> None:
    n = pool.num_blocks
    free, lru = list(pool._free), list(pool._lru)
    tables = {r: pool.table(r) for r in reqs if pool.holds(r)}
    assert set(tables) == {r for r in reqs if pool.holds(r)}
    holders: dict[int, list] = {}
    for r, t in tables.items():
        assert len(set(t)) == len(t), f"{r} holds a block twice: {t}"
        assert len(t) == blocks_for(pool.capacity(r), pool.block)
        for i, b in enumerate(t):
            holders.setdefault(b, []).append((r, i))
    held = set(holders)
    # every block in exactly one of: plain free, evictable, held
    assert len(free) == len(set(free)) and len(lru) == len(set(lru))
    assert not (set(free) & set(lru)) and not (set(free) & held) and not (set(lru) & held)
    assert set(free) | set(lru) | held == set(range(n))
    assert free == sorted(free, reverse=True)
    assert pool.free_blocks + len(held) == n and pool.used_blocks == len(held)
    # counts are the tables holding each block
    for b in range(n):
        assert pool._refs[b] == len(holders.get(b, []))
    # the registry: a one-to-one map over held or evictable blocks; evictable ones are registered
    assert {b: h for h, b in pool._block_of.items()} == pool._hash_of
    assert set(pool._hash_of) <= held | set(lru) and set(lru) <= set(pool._hash_of)
    assert pool.cached_blocks == len(pool._hash_of)
    # a block held twice is registered, sits at one index, and all but one holder took it shared
    for b, hs in holders.items():
        if len(hs) > 1:
            assert b in pool._hash_of
            assert len({i for _, i in hs}) == 1
            took = [r for r, i in hs if i < pool.shared_rows(r) // pool.block]
            assert len(took) >= len(hs) - 1
    for r, t in tables.items():  # what a request took shared is what it asked for
        k = pool.shared_rows(r) // pool.block
        assert k <= len(t)
        for i in range(k):
            assert pool._hash_of.get(t[i], reqs[r][i]) == reqs[r][i]


def test_random_operations_keep_the_invariants():
    rng = random.Random(1234)
    pool = BlockPool(24, B, cache=True)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    rids = [f"r{i}" for i in range(8)]
    reqs: dict = {}  # rid -> the hashes of its prompt's full blocks
    queries = hits = 0
    t0 = time.perf_counter()
    for step in range(4000):
        rid, op = rng.choice(rids), rng.random()
        if not pool.holds(rid):
            prompt = rng.choice(stems)[:rng.randrange(0, 20)] + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            hashes = block_hashes(prompt, B)
            offer = hashes if op < 0.2 else hashes[:reusable_blocks(len(prompt), B)]
            rows = len(prompt) + rng.randrange(0, 8)
            looked = min(pool.lookup(offer), rows // B)
            plain, evictions = len(pool._free), pool.evictions
            if pool.reserve(rid, rows, offer):
                reqs[rid] = hashes
                assert pool.shared_rows(rid) == looked * B
                queries += min(len(offer), rows // B) * B
                hits += looked * B
                fresh = blocks_for(rows, B) - looked
                assert pool.evictions - evictions == max(0, fresh - plain)
            else:
                assert pool.evictions == evictions and not pool.holds(rid)
        elif op < 0.3:
            plain, evictions, have = len(pool._free), pool.evictions, len(pool.table(rid))
            rows = pool.capacity(rid) + rng.randrange(0, 12)
            if pool.grow(rid, rows):
                assert pool.evictions - evictions == max(0, blocks_for(rows, B) - have - plain)
        elif op < 0.5:
            have = pool.table(rid)
            let_go = pool.shrink(rid, rng.randrange(0, pool.capacity(rid) + 1))
            assert let_go == len(have) - len(pool.table(rid)) and pool.table(rid) == have[:len(pool.table(rid))]
        elif op < 0.75:
            k = min(len(pool.table(rid)), len(reqs[rid]))
            pool.publish(rid, reqs[rid][:rng.randrange(0, k + 1)])
        else:
            pool.release(rid)
            reqs.pop(rid)
        _check(pool, reqs)
        assert pool.queries == queries and pool.hits == hits
    assert time.perf_counter() - t0 < 2
    assert pool.hits > 0 and pool.evictions > 0  # the run did exercise sharing and eviction
