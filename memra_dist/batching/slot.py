"""One batched request's target: what its speculative session (specdec/session.py) calls where a
single request calls its ModelRunner — `alloc`, `forward`, `rollback`, `length` — over the
batcher's paged cache (batcher.py).

`alloc(capacity)` admits the request: it reserves blocks for its prompt's rows (`first`),
waiting while the pool is short; each forward grows them to the rows it writes (the batcher
preempts another request when the pool is empty; `need`, prompt + new tokens + K + 1, is the
most it can grow to and must fit the pool). Its attention still runs as over a cache of
`capacity` rows (paged.py), so a request's ids are the same batched or alone. `rollback(n)`
keeps n rows and gives back the whole blocks past them: positions past n are rewritten by the
next forward before anything reads them (the mask reads positions up to each row's own), as a
ModelRunner's cache does. `release()` gives the blocks back.
"""

from __future__ import annotations

import itertools

import torch

from ..device import Drainer, device_label, free_mb
from ..errors import UserError
from ..model.taps import TapSink
from .chain import Chain
from .prefix_cache import block_hashes, reusable_blocks

__all__ = ["BatchSlot"]

_ids = itertools.count()


class _Cache:
    """What a tap drafter reads of its target's cache: the request's own tap sink."""

    def __init__(self):
        self.taps: TapSink | None = None


class BatchSlot:
    takes_device_ids = False  # ids come from the host (the session's row buffer)
    # forward returns once its step ran and was read back; rollback trims blocks on the host: with a
    # host-only drafter, a round's boundaries need no drain (specdec/session.py: the host clock)
    synchronous = True
    graphs = None  # no per-request step graphs (the batched steps are the batcher's; the ahead path stays off)
    ahead_steps = 0  # its rounds the loop launched one step ahead of the host (chain.py adopt / adopt_ahead)

    def __init__(self, batcher, need: int, first: int | None = None, prompt: list[int] | None = None):
        """`prompt`: where the batcher's pool caches prefixes (prefix_cache.py), the request's
        prompt: its reusable blocks are looked up at `alloc` and its full blocks published as
        its prefill writes them."""
        self.batcher, self.need = batcher, need
        cache = prompt is not None and batcher.pool.cache
        self.prompt = list(prompt) if cache else None
        self.hashes = block_hashes(self.prompt, batcher.pool.block, batcher.salt) if cache else []
        self.published = 0  # the prompt's leading full blocks published so far
        self.cached_rows = 0  # the prompt's leading rows shared from the cache at admission (not recomputed)
        self.first = min(need, first) if first is not None else need  # rows reserved at admission
        self.rid = next(_ids)
        self.device, self.dtype = batcher.device, batcher.dtype
        self.label = device_label(self.device)
        self.drain = Drainer(self.device)
        self.capacity = 0
        self.length = 0
        self.admitted = False
        self.stage = batcher.stage  # a tap drafter reads its embedding and lm_head
        self.cache = _Cache()
        self.tap_layers: tuple[int, ...] = ()
        self.last_step = None  # the BatchStep of the latest forward (the session's round records read it)
        # the latest forward's rows' argmax and the logit at it, read back by the step (accept.py greedy_commit)
        self.greedy_rows: tuple[list, list] | None = None
        self.primes_at: int | None = None  # its drafter primes on the loop once its rows reach this (the prompt's end)

    def cached_blocks(self) -> int:
        """The leading blocks of its prompt the pool caches now (0 with the cache off): what the
        engine's admission orders waiting requests by (admission.py)."""
        if not self.hashes:
            return 0
        b = self.batcher
        with b.cv:
            return b.pool.lookup(self.hashes[:reusable_blocks(len(self.prompt), b.pool.block)])

    def keep_taps(self, layers) -> None:
        """From the next `alloc` on, every forward of this request keeps the outputs of these
        target layers (FINAL: the final norm's) in `cache.taps`, by position (model/taps.py):
        the batched step writes each request's rows into its own sink."""
        self.tap_layers = tuple(int(t) for t in layers)

    def alloc(self, capacity: int) -> None:
        if self.tap_layers and (self.cache.taps is None or self.cache.taps.capacity != capacity):
            pool = self.batcher.tap_pool  # a slot of the engine's tap pool where it has one (model/tap_pool.py)
            sink = pool.sink(self, capacity) if pool is not None and pool.layers == self.tap_layers else None
            self.cache.taps = sink or TapSink.alloc(self.tap_layers, capacity, self.stage.cfg.hidden_size,
                                                    self.device, self.dtype)
        if not self.admitted:
            reuse = reusable_blocks(len(self.prompt), self.batcher.pool.block) if self.hashes else 0
            self.cached_rows = self.batcher.admit(self.rid, min(self.first, capacity), min(self.need, capacity),
                                                  self.hashes, reuse)
            self.published = self.cached_rows // self.batcher.pool.block
            if self.cached_rows and self.cache.taps is not None:  # a tap drafter's rows of the shared blocks
                self.batcher.load_taps(self.rid, self.cache.taps, self.cached_rows)
            self.admitted = True
        self.capacity, self.length = capacity, 0

    def forward(self, x: torch.Tensor, start: int, timer=None, last: bool = False) -> torch.Tensor:
        self._rows(x, start)
        primes = self.primes_at is not None and start + x.shape[0] >= self.primes_at
        if primes:
            self.primes_at = None
        out, self.last_step, self.greedy_rows = self.batcher.submit(self.rid, x.reshape(-1), start, self.capacity,
                                                                    last, self.cache.taps, timer, primes)
        self._publish(start, x.shape[0])
        return out

    @staticmethod
    def forward_many(slots, xs, starts) -> list:
        """`forward(x, start, last=True)` of several slots of one batcher (none with taps or a
        prime due: a draft model's slots) in ONE step, from another batcher's engine loop
        (batcher.py `submit_many`) -> each one's last row's logits, None for a slot whose rows
        found no room without waiting (its length as before)."""
        was = [s.length for s in slots]
        for s, x, start in zip(slots, xs, starts):
            s._rows(x, start)
        got = slots[0].batcher.submit_many([(s.rid, x.reshape(-1), start, s.capacity, True)
                                            for s, x, start in zip(slots, xs, starts)])
        for s, x, start, g, n in zip(slots, xs, starts, got, was):
            if g is None:
                s.length = n
                continue
            s.last_step, s.greedy_rows = g[1], g[2]
            s._publish(start, x.shape[0])
        return [g[0] if g is not None else None for g in got]

    def _rows(self, x: torch.Tensor, start: int) -> None:
        rows = x.shape[0]
        if start + rows > self.capacity:
            raise UserError(f"context full: {start + rows} rows needed, the request holds {self.capacity}")
        self.length = start + rows

    def _publish(self, start: int, rows: int) -> None:
        """A prefill chunk's full blocks into the prefix cache (prefix_cache.py)."""
        if self.published < len(self.hashes) and start < len(self.prompt):
            done = min(len(self.hashes), min(start + rows, len(self.prompt)) // self.batcher.pool.block)
            if done > self.published:
                self.batcher.publish(self.rid, self.hashes[:done], self.cache.taps)
                self.published = done

    def away(self) -> None:
        """The request works on the host before its next forward (batcher.py `step_away`)."""
        if self.admitted:
            self.batcher.step_away(self.rid)

    def will_prime(self, prompt_len: int) -> None:
        """Its drafter will prime on the loop after the prompt's last chunk (`prime_drafter`): the
        loop waits for it to prime with the others of that step (primes.py `due_in`)."""
        self.primes_at = prompt_len

    def prime_drafter(self, drafter, prompt: list[int], chunks, capacity: int, chain: Chain, rows: int = 0) -> None:
        """The request's drafter allocated and primed by the engine loop, which then proposes
        `chain`'s first round (batcher.py `prime`: it returns at once); `rows`: its prefill chunk."""
        self.batcher.prime(self.rid, drafter, prompt, chunks, capacity, chain, rows)

    def chain(self, tokens: list[int], produced: int, max_new: int, capacity: int, eos, k: int, drafter, sp,
              gen, timed: bool = True, start: bool = True, laps: bool = False) -> Chain:
        """Hand this greedy request's rounds to the step leader (chain.py)
        from the session's state: its tokens (the last one pending), the tokens produced so
        far and its stop rules; `take` returns them round by round. `timed`: its rounds are
        recorded (trace level >= 1); `laps`: each round's verify step its sub-split too (level 2)."""
        ch = Chain(self, tokens, produced, max_new, capacity, eos, k, drafter, sp, gen, timed, laps)
        if start:  # (else the loop starts it after its drafter's prime: prime_drafter)
            self.batcher.start_chain(ch)
        return ch

    def take(self, ch: Chain):
        return self.batcher.take(ch)

    def rollback(self, new_len: int) -> None:
        if not 0 <= new_len <= self.length:
            raise ValueError(f"rollback to {new_len} outside [0, {self.length}]")
        self.length = new_len
        if self.admitted:
            self.batcher.trim(self.rid, new_len)  # whole blocks past the kept rows go back

    def kv_mb(self) -> float:
        """The K/V the request's reserved blocks hold (MB)."""
        pool = self.batcher.pool
        if not self.admitted or not pool.holds(self.rid):
            return 0.0
        return self.batcher.kv.slot_bytes() * len(pool.table(self.rid)) * pool.block / 2**20

    def free_mb(self) -> int:
        return free_mb(self.device)

    def fast_path(self) -> dict[str, bool]:
        """What the loop's steps ran for this request: its bucketed CUDA graphs (graphs.py), the
        compiled blocks inside them, our kernels (`ahead`: the session adds `ahead_steps`)."""
        from ..graphs import stage_compiles  # noqa: PLC0415

        return {"graphs": self.batcher.graphs is not None, "compile": stage_compiles(self.batcher.stage),
                "kernels": self.batcher.kernels}

    def release(self, tokens: list[int] | None = None) -> None:
        """Give the blocks back; `tokens`: the request's tokens once it ended (not abandoned):
        the full blocks of those its K/V rows hold are published first (a chat's next turn,
        which repeats this one, reuses them)."""
        if self.admitted and tokens is not None and self.prompt is not None:
            rows = min(self.length, len(tokens))  # rows written and kept are the committed tokens'
            self.batcher.publish(self.rid, block_hashes(tokens[:rows], self.batcher.pool.block, self.batcher.salt),
                                 self.cache.taps)
        if self.admitted:
            self.batcher.leave(self.rid)
            self.admitted = False
        if self.batcher.tap_pool is not None:
            self.batcher.tap_pool.give(self)
