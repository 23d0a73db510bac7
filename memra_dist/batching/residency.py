"""Requests joining, growing and leaving the batcher's pool (the Batcher's half that holds
memory; batcher.py runs the steps): admission (with the prefix cache's shared blocks, and the
wait for a block another request is computing: prefix_cache.py InFlight), publishing full
blocks and their tap rows, a request's growth block by block, preemption by swap-out to host
memory and swap-in before its next forward, and its leaving, which frees its blocks only once
no step in flight reads them.

Every method is the Batcher's (a mixin over its state: `pool`, `kv`, `cv`, `admitted`,
`swapped`, `inflight`, the running and pending steps); the ones named with `_` are called
holding its lock."""

from __future__ import annotations

from ..errors import UserError

__all__ = ["Residency"]


class Residency:
    def admit(self, rid, rows: int, need: int | None = None, hashes=(), reusable: int = 0) -> int:
        """Reserve `rows` rows of blocks for request `rid`, waiting while the pool is short.
        `need`: the most rows it can ever hold (refused now, in one line, if the pool cannot).
        `hashes`: its prompt's full blocks (prefix_cache.py), of which the first `reusable`
        may be shared: the longest prefix of them the pool holds is, not recomputed, and while
        the next one is another admitted request's to compute, it waits for that (InFlight).
        Returns the rows shared (0: none)."""
        most = max(rows, need or 0)
        if not self.pool.fits(most):
            raise UserError(f"a request of {most} rows does not fit the KV pool ({self.pool.rows} rows): "
                            f"raise --kv-rows or lower --max-new-tokens")
        share = list(hashes[:reusable]) if self.pool.cache else []
        with self.cv:
            waited = False
            while share and self.inflight.wait_for(rid, share, self.pool.lookup(share)):
                self._open()
                self.stats.prefix_waits += not waited
                waited = True
                self.cv.wait()  # until the computing request publishes (or leaves)
            waited = False
            while not self.pool.reserve(rid, rows, share):
                self._open()
                waited = True
                self.cv.wait()
            self.stats.waits += waited
            self._order += 1
            self.admitted[rid] = self._order
            self.kv.admit(rid)  # recurrent layers: the request's own states
            shared = self.pool.shared_rows(rid)
            if self.pool.cache:
                self.inflight.claim(rid, hashes[shared // self.pool.block:])  # the rest is its to compute
            return shared

    def publish(self, rid, hashes, taps=None) -> None:
        """Request `rid`'s first len(hashes) blocks hold those full blocks' final rows (its
        prompt's, or its committed tokens' as it ends): later requests may share them. `taps`:
        its tap sink, whose rows of the blocks registered now go to the tap store (tap_blocks.py)."""
        with self.cv:
            if self.pool.holds(rid):
                placed = self.pool.publish(rid, hashes)
                if self.tap_blocks is not None:  # (tap_blocks.py: their rows saved once, as registered)
                    self.tap_blocks.save(taps, placed)
                self.inflight.published(hashes)
                self.cv.notify_all()  # admissions waiting for these blocks

    def load_taps(self, rid, taps, rows: int) -> None:
        """Into sink `taps`, the tap rows of request `rid`'s first `rows` rows (its shared blocks)."""
        if self.tap_blocks is not None and rows > 0:
            with self.cv:
                self.tap_blocks.load(taps, self.pool.table(rid)[:rows // self.pool.block])

    def step_away(self, rid) -> None:
        """Request `rid` has host work to do before it submits again (its first token drawn, its
        drafter priming on the prompt): no step waits for it meanwhile (a step otherwise holds
        for an admitted request up to the batcher's wait, every step, as it does for requests
        coming back from their host work a few at a time); its next submission ends this."""
        with self.cv:
            if rid in self.admitted:
                self.away.add(rid)
                self._loop_cv.notify()  # a step waiting for it goes now

    def leave(self, rid) -> None:
        """Request `rid` is gone (finished, failed, its client gone), from any thread. Its queued
        rows go and its chain ends at once; its blocks and recurrent states go back only when no
        step in flight holds its rows (the step running unlocked, or the one launched behind it,
        reads them): until then it is `leaving`, and the step's end frees it (_free_left). Its
        drafter's prime, still queued, is dropped; one the loop is running is waited for (its
        drafter's pool slot is given back after this returns: primes.py)."""
        with self.cv:
            self.primes = [p for p in self.primes if p.rid != rid]
            while rid in self.priming_now:
                self.cv.wait()
            for j in self.pending + self.running_jobs:  # a chained request left: its queued rows go, its chain ends
                if j.rid == rid and j.chain is not None:
                    j.chain.cancel()
            self.pending = [j for j in self.pending if j.rid != rid]
            self.inflight.drop(rid)  # what it did not publish, nobody computes: admissions waiting for it go on
            self.finished.discard(rid)
            self.away.discard(rid)
            self.priming.discard(rid)
            self.acceptance.forget(rid)
            self.admitted.pop(rid, None)
            self.swapped.pop(rid, None)
            if rid in self.running_rids or rid in self.ahead_rids:
                self.leaving.add(rid)
            else:
                self._free(rid)
            self.cv.notify_all()  # blocks for a waiting admission
            self._loop_cv.notify()  # a step that waited for this one

    def _free(self, rid) -> None:
        self.pool.release(rid)
        self.kv.leave(rid)

    def _free_left(self, held: set) -> None:
        """Called holding the lock between steps: the requests that left while a step held
        them, freed now unless `held` (the step launched behind) still reads them."""
        gone = [r for r in self.leaving if r not in held]
        for rid in gone:
            self.leaving.discard(rid)
            self._free(rid)
        if gone:
            self.cv.notify_all()  # blocks for a waiting admission; wait_idle

    def trim(self, rid, rows: int) -> None:
        """Request `rid` rolled back to `rows` rows: the whole blocks past them go back to the pool."""
        with self.cv:
            if self.pool.holds(rid) and self.pool.shrink(rid, rows):
                self.cv.notify_all()

    def _hold(self, rid, rows: int) -> None:
        """Called holding the lock: request `rid` (swapped back in if it was preempted) holds
        blocks for `rows` rows, growing into free blocks or preempting another for them."""
        while True:
            self._open()  # a closed engine wakes whoever waits for blocks: they end
            if rid in self.swapped and not self._swap_in(rid):
                self.cv.wait()  # blocks come back when a request ends or is preempted
                continue
            if self.pool.capacity(rid) >= rows or self.pool.grow(rid, rows):
                return
            victim = self._victim(rid)
            if victim is None:
                self.cv.wait()  # every other request is in a step: the step's end frees or lets one go
                continue
            self._swap_out(victim)

    def _try_hold(self, rid, rows: int) -> bool:
        """`_hold` that never waits (the engine loop's own path: batcher.py `submit_many`): False
        where the rows cannot be held now (swapped out with no room to come back, or no free block
        and no other request to preempt); preempting another request for them where one can go."""
        while True:
            self._open()
            if rid in self.swapped and not self._swap_in(rid):
                pass  # (room for it first: another request goes, if one can)
            elif rid not in self.swapped and (self.pool.capacity(rid) >= rows or self.pool.grow(rid, rows)):
                return True
            victim = self._victim(rid)
            if victim is None:
                return False
            self._swap_out(victim)

    def _victim(self, rid):
        """The most recently admitted request other than `rid` with nothing pending or running."""
        busy = self.running_rids | {j.rid for j in self.pending} | {rid}
        free = [(order, r) for r, order in self.admitted.items() if r not in busy]
        return max(free)[1] if free else None

    def _swap_out(self, rid) -> None:
        rows = self.pool.capacity(rid)
        saved = self.kv.save(self.pool.slots(rid, 0, rows), rid)
        self.pool.release(rid)
        del self.admitted[rid]
        self.swapped[rid] = (rows, saved)
        self.stats.preemptions += 1
        self.cv.notify_all()

    def _swap_in(self, rid) -> bool:
        rows, saved = self.swapped[rid]
        if not self.pool.reserve(rid, rows):
            return False
        self.kv.restore(self.pool.slots(rid, 0, rows), saved, rid)
        del self.swapped[rid]
        self._order += 1
        self.admitted[rid] = self._order
        return True
