"""The speculative session: prime on the prompt, then bursts of rounds
draft K -> verify K+1 rows in one target forward -> accept -> rollback -> maint.

The phase clock (phase/clock.py) runs only when tracing or the profile is on: at level 0
each boundary costs one boolean test - no drains, no clock reads, no records. Records are
numbers only; lines and spans are built from them by the sinks, in a later verify's shadow.
"""

from __future__ import annotations

import math

import time
from typing import Callable, Protocol

import torch

from ..errors import UserError
from ..phase.clock import PhaseClock, session_clock
from ..phase.handover import Handover
from ..kernels import tuning_tally
from ..phase.first_token import DepthTimer, FirstTokenProf, kernel_key_counts, keys_since, lend
from ..phase.levels import TraceSettings
from ..phase.records import BurstRecord
from ..phase.rounds_log import RoundProf, RoundsLog
from ..phase.subsplit import SubsplitTimer
from .accept import NonFiniteRow, accept_sampled, greedy_commit
from .ahead import ahead_steps
from .chained import burst_chained
from .chunks import DEFAULT_PREFILL_CHUNK, fixed_chunks, pipeline_chunks
from .drafters.base import Drafter
from .non_finite import locate_non_finite
from .session_stats import SessionStats
from .stop import commit_tokens
from .sampling import NonFiniteLogits, SamplingParams, draw_rows, probs, uniforms

__all__ = ["SpecSession", "SessionStats", "Target", "SessionSink"]


class Target(Protocol):
    """The verifying engine(s): a local ModelRunner or the head side of a pipeline."""

    def alloc(self, capacity: int) -> None: ...
    def forward(self, ids: torch.Tensor, start: int, timer=None, last: bool = False) -> torch.Tensor: ...  # (T, V) fp32; last: (1, V)
    def rollback(self, new_len: int) -> None: ...
    def drain(self) -> None: ...
    def free_mb(self) -> int: ...
    label: str


class SessionSink(Protocol):
    """Receives records once they are settled (lines, spans, metrics): at a burst's end, or,
    with the event clock, in the next burst's first verify; never between a readback and the
    next launch."""

    def burst(self, rec: BurstRecord) -> None: ...
    def first_token(self, prof: FirstTokenProf) -> None: ...
    def rounds(self, log: RoundsLog, final: bool) -> None: ...


class SpecSession:
    def __init__(self, target: Target, drafter: Drafter, sp: SamplingParams, gen: torch.Generator,
                 k: int, trace: TraceSettings = TraceSettings(), sink: SessionSink | None = None,
                 eos_ids: tuple[int, ...] = (), prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if k < 1:
            raise UserError(f"-k must be >= 1 (got {k})")
        if prefill_chunk < 1:
            raise UserError(f"--prefill-chunk must be >= 1 (got {prefill_chunk})")
        self.prefill_chunk = prefill_chunk
        self.target, self.drafter, self.sp, self.gen, self.k = target, drafter, sp, gen, k
        self.trace, self.sink, self.eos = trace, sink, set(eos_ids)
        self.clock: PhaseClock | None = session_clock(target, drafter, trace, self._free_mb) if trace.clock_on else None
        self.timer = SubsplitTimer(target.drain) if trace.level >= 2 else None
        self.prof = FirstTokenProf() if trace.prof else None
        self.log = RoundsLog() if trace.prof else None
        self._ids = torch.zeros(k + 1, dtype=torch.long)  # the verify row ids, reused every round
        # the same row on the target's device, for drafts that stay there (_verify_ids)
        dev = getattr(target, "device", None) if getattr(target, "takes_device_ids", False) else None
        self._ids_dev = torch.zeros(k + 1, dtype=torch.long, device=dev) if dev is not None else None
        self._draft_fw = getattr(drafter, "forwards_per_draft", -1)  # dflash: one forward drafts the block
        self._no_drafts = torch.zeros(0, dtype=torch.long)
        # deferred sink work (span building, tracing/deferred.py) runs while a verify is on the
        # device: right after the forward is launched, before the accept reads it back (level 2
        # on the eager path drains per layer: its forward has returned by then, which costs what
        # building between rounds would). Level 0 without the profile makes no records, hence no
        # such work: nothing is wired.
        self._pump = getattr(sink, "pump", None) if sink is not None and trace.clock_on else None
        self.tokens: list[int] = []
        self.stats = SessionStats()
        self.done = False
        self._ahead = None  # specdec/ahead.py: greedy plain decoding one step ahead (pp=1 graphs, or the pipeline head)
        # a batched target runs a request's rounds in its step leader (batching/chain.py) with a
        # drafter that allows it (host drafters; the tap drafters, drafting the step's requests at
        # once), greedy or sampled (the leader accepts with the request's own generator); never
        # with the first-token profile (its hook share stays the session's). At level 2 each
        # round's verify job brings its own sub-split (batching/graphs.py's timed twin, laps.py)
        self._chains = (self.prof is None
                        and getattr(drafter, "chains", False) and callable(getattr(target, "chain", None)))
        self._chain = None
        # records still held: a burst the event clock reads in the next burst's first verify,
        # level 2's sub-splits added up in the next verify's shadow (phase/handover.py)
        self._held = Handover(self.clock, sink, trace.level)
        self._spare: BurstRecord | None = None  # the next burst's record (made in a verify's shadow)

    @property
    def ran_ahead(self) -> bool:
        """Whether its steps ran one step ahead of the host (specdec/ahead.py; the loop's: chain.py)."""
        return (self._ahead is not None and self._ahead.launched > 0) or getattr(self.target, "ahead_steps", 0) > 0

    def _free_mb(self) -> dict[str, int]:
        out = {self.target.label: self.target.free_mb()}
        dev = getattr(self.drafter, "runner", None)
        if dev is not None and dev.label not in out:
            out[dev.label] = dev.free_mb()
        return out

    # ---- prime ----
    def start(self, prompt: list[int], max_new: int, capacity: int) -> int:
        """Allocate, prime target and drafter on the prompt, draw the first token (the anchor)."""
        if not prompt:
            raise UserError("the prompt is empty")
        if max_new < 1:
            raise UserError(f"--max-new-tokens must be >= 1 (got {max_new})")
        if len(prompt) >= capacity:
            raise UserError(f"the prompt ({len(prompt)} tokens) does not fit the context ({capacity})")
        self.capacity, self.max_new, self.prompt_len = capacity, max_new, len(prompt)
        self._ahead = None
        self._chain = None
        c, pf = self.clock, self.prof
        depth = None  # the profile's depth timer, lent to the tap sink's runner and the drafter
        if pf is not None:
            pf.free_mb_before = self._free_mb()
            depth = DepthTimer(pf, c.stamp)
            tally0, keys0 = tuning_tally(), kernel_key_counts()
            t = pf.t0_ns = c.stamp()
        with lend(getattr(self.target, "runner", self.target), depth):  # pp>1: the head's runner
            self.target.alloc(capacity)
            warm = getattr(self.target, "warm_timed_rows", None)
            if self.timer is not None and warm is not None:  # level 2: no twin captured inside a round
                warm(self.k + 1)
        if pf is not None:
            t, pf.ms["cache_alloc"] = c.lap_ms(t)
        chunks = self.chunks(len(prompt))
        # a batched target may hold the prompt's leading rows already (prefix_cache.py): only the rest runs
        cached = getattr(self.target, "cached_rows", 0)
        own = [(lo + cached, hi + cached) for lo, hi in self.chunks(len(prompt) - cached)] if cached else chunks
        on_loop = getattr(self.target, "prime_drafter", None)
        on_loop = on_loop if on_loop is not None and self._chains and self.drafter.loop_prime else None
        if on_loop is not None:  # (chained: never profiled)
            self.target.will_prime(len(prompt))
        logits = self._prefill(torch.tensor(prompt), own)  # (1, V): the last prompt row's
        if pf is not None:
            t, pf.ms["prime"] = c.lap_ms(t)
            pf.cached_tokens = cached
        away = getattr(self.target, "away", None)
        if away is not None:  # a batched target: no step waits for this request while it draws and primes
            away()
        first = self._draw(logits, torch.tensor(prompt[-1:]), len(prompt) - 1)
        if pf is not None:
            t, pf.ms["anchor"] = c.lap_ms(t)
        self.tokens = list(prompt) + [first]
        ends = commit_tokens([first], 0, max_new, len(prompt), capacity, self.eos)[2]
        if on_loop is not None:  # the engine loop primes it with the other new requests' drafters and proposes
            if not ends:  # its chain's first round (batcher.py `prime`; no wait here); one that ends drafts nothing
                self._chain = self._new_chain(1, start=False)
                on_loop(self.drafter, prompt, chunks, capacity, self._chain, self.prefill_chunk)
        else:
            kv_mb = self.drafter.alloc(capacity)
            if pf is not None:
                t, pf.ms["draft_alloc"] = c.lap_ms(t)
                pf.draft_kv_mb, pf.free_mb_after = kv_mb, self._free_mb()
            with lend(self.drafter, depth):
                self.drafter.prime(prompt, chunks)
            if self._chains and not ends:  # its first round queued for the loop's next step before the caller
                self._chain = self._new_chain(1)  # streams the first token (not one step later)
        if pf is not None:
            t, pf.ms["draft_prime"] = c.lap_ms(t)
            tally = tuning_tally()
            pf.kernel_tune_configs = tally["configs"] - tally0["configs"]
            pf.kernel_tune_ms = (tally["tune_s"] - tally0["tune_s"]) * 1e3
            pf.kernel_tune_cached, pf.kernel_keys = tally["cached"] - tally0["cached"], keys_since(keys0)
        self.stats = SessionStats(tokens=1, t_start=self.stats.t_start, t_first=time.perf_counter(), cached=cached)
        self.done = self.done or ends
        return first

    def _new_chain(self, produced: int, start: bool = True):
        """Its rounds handed to the batched target's engine loop from its state now (its last
        token pending; batching/chain.py), recorded where the clock runs; `start`: its first
        verify rows queued at once (else the loop starts it after its drafter's prime)."""
        return self.target.chain(self.tokens, produced, self.max_new, self.capacity, self.eos, self.k, self.drafter,
                                 self.sp, self.gen, timed=self.clock is not None, start=start, laps=self.timer is not None)

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """The prompt's prefill chunks (specdec/chunks.py): fixed `prefill_chunk` rows on one
        engine; on a pipeline (the target's `stages` > 1) several per stage, shrinking as the
        prefix grows so each costs the same."""
        stages = getattr(self.target, "stages", 1)
        if stages <= 1:
            return fixed_chunks(n, self.prefill_chunk)
        return pipeline_chunks(n, self.prefill_chunk, stages, getattr(self.target, "attention_weight", 0.0))

    def _prefill(self, ids: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
        """The prompt's rows into the target's cache chunk by chunk; the last row's logits
        (1, V) (only its lm_head row runs). A pipeline target keeps several chunks in flight
        across its stages (`prefill`); profiled, each chunk's drained time and rows are kept."""
        pf, c = self.prof, self.clock
        run = getattr(self.target, "prefill", None)
        if run is not None:
            logits, laps = run(ids, chunks, c.stamp if pf is not None else None)
        else:
            logits, laps = None, []
            t = c.stamp() if pf is not None else 0
            for lo, hi in chunks:
                logits = self.target.forward(ids[lo:hi], lo, last=True)
                if pf is not None:
                    t1 = c.stamp()
                    laps.append(t1 - t)
                    t = t1
        if pf is not None:
            pf.prime_chunk_rows = [hi - lo for lo, hi in chunks]
            pf.prime_chunk_ms = [ns / 1e6 for ns in laps]
        return logits[-1:]

    def _draw(self, logits: torch.Tensor, last_id: torch.Tensor, pos: int) -> int:
        """The anchor from the prompt's last row, whose logits are checked first (the request's
        only full check: each round's rides in its readback, accept.py). Greedy: the logit at
        the argmax comes back with it (NaN / +inf are where argmax lands; on a batched target both
        came back in the step's readback: no device op, no wait for the step running now);
        sampled: the probabilities sum to NaN exactly when a logit is not finite (read back with
        the draw, two numbers)."""
        rows = getattr(self.target, "greedy_rows", None) if self.sp.greedy else None
        if rows is not None:  # a batched target: the step's one readback holds the row's argmax and its logit
            tok, ok = int(rows[0][-1]), math.isfinite(rows[1][-1])
        elif self.sp.greedy:
            a = logits[0].argmax()
            tok, ok = torch.stack((a, torch.isfinite(logits[0, a]).long())).tolist()
        else:
            p = probs(logits[:1], self.sp)  # drawn on its device at the generator's next uniform (`draw_rows`)
            tok, ok = torch.stack((draw_rows(p, uniforms(self.gen, 1))[0], torch.isfinite(p.sum()).long())).tolist()
        if not ok:
            raise self._non_finite(last_id, pos, 0, "the prompt's last row")
        return int(tok)

    def _non_finite(self, ids: torch.Tensor, start: int, row: int, what: str) -> NonFiniteLogits:
        """One line for logits that hold NaN / inf at position start + row: the first layer
        whose output is not finite, found by re-running rows start .. start + row layer by
        layer (only now, after the failure), and a weight holding NaN / inf where one does."""
        where = locate_non_finite(self.target, ids[: row + 1], start)
        return NonFiniteLogits(f"non-finite logits (NaN/inf) from the target at position {start + row} ({what}): "
                               f"{where}")

    # ---- rounds ----
    def burst(self, max_rounds: int, hook: Callable[[list[int]], None] | None = None) -> list[int]:
        """Run up to `max_rounds` rounds (fewer if the request ends); the hook receives each
        round's committed tokens as they are accepted. Returns the burst's tokens."""
        if self.done:
            return []  # nothing to run, nothing to record
        out: list[int] = []
        rec = None  # level 0 without the profile: no record, no clock read in the loop
        if self.clock is not None:  # a fresh record per burst (sinks may keep it), built in a verify's shadow
            rec, self._spare = self._spare or BurstRecord(), None
            rec.reset(self.stats.bursts, self.k, max_rounds)
            rec.t0 = time.perf_counter_ns()
        first = self.prof is not None and self.stats.bursts == 0  # the profile implies a record
        if self._ahead is None:  # None until the one-row graph (level 2: its stamped twin) is captured
            self._ahead = ahead_steps(self.target, self.drafter, self.sp, self.trace)
        deferred, held = False, self._held
        if held.unsettled is not None and (self._ahead is not None or self._chains):
            held.settle()  # no round loop this burst to read them in
        if self._ahead is not None:  # never with the profile: its hook share stays 0
            self._burst_ahead(max_rounds, hook, out, rec)
            hook_ns = 0
        elif self._chains:
            burst_chained(self, max_rounds, hook, out, rec)
            hook_ns = 0
        else:
            if rec is not None:
                rec.clock = self.clock.mode
                bank = self.clock.begin(max_rounds)
            hook_ns = self._burst_rounds(max_rounds, hook, rec, first, out)
            if held.unsettled is not None:  # the loop ran no round to read them in
                held.settle()
            if rec is not None and self.clock.events and not self.done and rec.n:
                held.hold(rec, bank)  # read in the next burst's first verify
                deferred = True
            elif rec is not None:
                held.settle_laps()
                self.clock.resolve(rec.live(), bank)  # the draining clock: nothing to read
                if self.log is not None:
                    for r in rec.live():
                        self._profile_round(r)
        if rec is not None:
            rec.t1 = time.perf_counter_ns()
        self.stats.bursts += 1
        if first:
            self._finish_first_burst(rec, (rec.t1 - rec.t0) / 1e6, hook_ns / 1e6, len(out))
        if self.done:
            self.stats.t_end = time.perf_counter()
        if rec is not None:
            rec.tokens = len(out)
            rec.t1 = max(rec.t1, rec.rounds[rec.n - 1].t[5]) if rec.n and not deferred else rec.t1
        if self.sink is not None and rec is not None:
            if self.trace.level >= 1 and not deferred:
                self.sink.burst(rec)
            if self.log is not None:
                self.sink.rounds(self.log, final=self.done or not self.log.wants_more())
        return out

    def flush_trace(self) -> None:
        """A request left before its end (its caller went away): the last burst's record, whose
        events the next burst would have read, goes to the sink now (waiting for them)."""
        self._held.flush()

    def _round(self, rec: BurstRecord | None) -> list[int]:
        n = len(self.tokens)
        k = min(self.k, self.capacity - n, self.max_new - self.stats.tokens - 1)
        c = self.clock
        if rec is not None:
            slot = rec.n
            r = rec.next_round()
            r.index, r.ctx = self.stats.rounds, n - 1
            c.mark(r, slot, 0)  # round entry: the previous boundary's; the hook is host-only
        prop = self.drafter.propose(self.tokens, max(k, 0), self.sp, self.gen) if k > 0 else None
        drafts = prop.tokens[:k] if prop is not None else self._no_drafts
        kk = int(drafts.shape[0])
        if rec is not None:
            r.h[0] = c.mark(r, slot, 1)
        ids = self._verify_ids(drafts)  # (kk+1,): the pending token, then the drafts
        logits = self.target.forward(ids, n - 1, self.timer)  # (kk+1, V)
        if rec is not None:
            r.h[1] = time.perf_counter_ns()  # the verify launched (before the tracer's own deferred work)
            # the burst before's events, the rounds before's sub-splits: while this verify runs
            self._held.flush()  # (before the pump, which hands the settled record on)
        if self._pump is not None:
            self._pump()
        if rec is not None:
            # free memory once a round, in the verify's shadow, after the span work (should the
            # driver's query wait for the device, it waits where the readback would anyway);
            # every phase of the round carries this reading
            fm = c.free_mb()
            for i in range(len(r.free_mb)):
                r.free_mb[i] = fm
            if self._spare is None:  # the next burst's record, built here rather than between bursts
                self._spare = BurstRecord()
                self._spare.reset(0, self.k, len(rec.rounds))
            c.mark(r, slot, 2)
            r.batch = getattr(self.target, "last_step", None)  # a batched request: the step its rows rode in
            r.draft_requests, r.expected = 0, -1.0  # its own draft (a leader's shared draft forward: chained.py)
        try:
            if self.sp.greedy:
                # the accepted drafts + the next token: one readback (none when a batched step read them)
                new = greedy_commit(logits, drafts, getattr(self.target, "greedy_rows", None))
                j = len(new) - 1
            else:
                q = prop.q[:kk] if prop is not None and prop.q is not None else None
                j, nxt, _kind = accept_sampled(probs(logits, self.sp), q, drafts, self.gen)
                new = drafts[:j].tolist() + [nxt]
        except NonFiniteRow as e:  # rows 0 .. j of this verify hold NaN / inf
            raise self._non_finite(ids, n - 1, e.row, f"round {self.stats.rounds}, verify row {e.row}") from None
        if rec is not None:
            if not slot:
                c.anchor()  # the streams just ran dry (the readback): the burst's tie to the host clock
            r.h[2] = c.mark(r, slot, 3)
            if self.timer is not None:  # level 2: the verify's laps, added up in the next verify's shadow
                self._held.laps(r, self.timer.detach())
        self.target.rollback(n + j)  # keep the pending token + j accepted drafts
        if rec is not None:
            r.h[3] = c.mark(r, slot, 4)
        new = self._commit(new)
        self.drafter.maintain(self.tokens)
        if rec is not None:
            r.h[4] = c.mark(r, slot, 5)
            r.k, r.j = kk, j
            r.draft_forwards = self._draft_fw if kk or self._draft_fw < 0 else 0
        self.stats.rounds += 1
        self.stats.drafted += kk
        self.stats.accepted += j
        return new

    def _burst_rounds(self, max_rounds: int, hook, rec, first: bool, out: list[int]) -> int:
        """The round loop; returns the ns spent in the hook (read by the first-token profile)."""
        hook_ns = 0
        for _ in range(max_rounds):
            if self.done:
                break
            new = self._round(rec)
            out.extend(new)
            if hook is not None and first:  # the hook share is read only by the first-token profile
                th = time.perf_counter_ns()
                hook(new)
                hook_ns += time.perf_counter_ns() - th
            elif hook is not None:
                hook(new)
        return hook_ns

    def _burst_ahead(self, max_rounds: int, hook, out: list[int], rec: BurstRecord | None) -> None:
        """Plain greedy rounds one step ahead of the host (specdec/ahead.py): the step for the
        next position is launched, its input the argmax on the device, before this one's
        token is read back. A step in flight carries over to the next burst. Traced, each
        round is recorded from the step's own device times (`_record_ahead`)."""
        a = self._ahead
        if rec is not None:
            rec.clock = "ahead"
        pump = self._pump
        for _ in range(max_rounds):
            if self.done:
                break
            n = len(self.tokens)
            t0 = time.perf_counter_ns() if rec is not None else 0
            if a.pending == 0:
                a.launch(n - 1, self.tokens[-1])
            if self.stats.tokens + 1 < self.max_new and n + 1 < self.capacity:
                a.launch(n)  # the row of the token about to be read: kept if the request goes on
            if pump is not None:
                pump()  # deferred span work while the device runs
            try:
                tok = a.take()
            except NonFiniteRow:  # the step at n - 1 (its input: the pending token) read NaN / inf
                a.drop()
                raise self._non_finite(torch.tensor(self.tokens[-1:]), n - 1, 0,
                                       f"round {self.stats.rounds}, one step ahead") from None
            new = self._commit([tok])
            t3 = time.perf_counter_ns() if rec is not None else 0
            if self.done and a.pending:  # launched past the end: its row is rolled back
                a.drop()
                self.target.rollback(n)
            if rec is not None:
                self._record_ahead(rec.next_round(), n, t0, t3)
            self.stats.rounds += 1
            out.extend(new)
            if hook is not None:
                hook(new)

    def _record_ahead(self, r, n: int, t0: int, t3: int) -> None:
        """One traced round of the one-ahead loop. No boundary drained, so the phases come from
        the step's device times: verify = its replay, accept = the rest of the round up to the
        token committed (the argmax and the copy back on the device, the host's read), rollback
        = the drop of a step launched past the end; no draft, no maint. Free memory is read once
        a round (every phase of it carries that reading)."""
        verify_ns = self._ahead.verify_ns()
        r.index, r.ctx, r.k, r.j, r.batch = self.stats.rounds, n - 1, 0, 0, None
        r.draft_requests, r.expected = 0, -1.0
        r.draft_forwards = self._draft_fw if self._draft_fw < 0 else 0
        t2 = t0 + min(verify_ns, t3 - t0)
        t4 = time.perf_counter_ns()
        r.t[:] = [t0, t0, t2, t3, t4, t4]
        r.h[:] = [0] * len(r.h)  # no boundary drained: no host / drain split
        fm = self.clock.free_mb()
        for i in range(len(r.free_mb)):
            r.free_mb[i] = fm
        if self.timer is not None:
            self._ahead.laps_to(self.timer)
            r.sub_ns, r.seq_rows = self.timer.take()

    def _verify_ids(self, drafts: torch.Tensor) -> torch.Tensor:
        """The verify row [pending token, drafts...], in a preallocated row. Drafts left on the
        target's device (a graphed greedy drafter's output) stay there: the row is built with
        two device ops and the verify is launched while the draft may still run, so neither
        waits on the host; the round's one readback is the accept's. A target that takes host
        ids (the pipeline head ships them) gets them read back here."""
        kk = int(drafts.shape[0])
        if self._ids_dev is not None and drafts.device == self._ids_dev.device:
            ids = self._ids_dev[: kk + 1]
            ids[:1].fill_(self.tokens[-1])
            ids[1:].copy_(drafts, non_blocking=True)
            return ids
        if drafts.device.type != "cpu":
            drafts = drafts.cpu()
        ids = self._ids[: kk + 1]
        ids[0] = self.tokens[-1]
        ids[1:] = drafts
        return ids

    def _commit(self, new: list[int]) -> list[int]:
        kept, out, done = commit_tokens(new, self.stats.tokens, self.max_new, len(self.tokens), self.capacity,
                                        self.eos)
        self.tokens.extend(kept)
        self.stats.tokens += len(kept)
        self.done = self.done or done
        return out

    # ---- profile ----
    def _profile_round(self, r) -> None:
        if self.log is None:
            return
        ms = [r.phase_ns(i) / 1e6 for i in range(5)]
        if r.index == 0:
            for name, v in zip(("first_draft", "first_verify", "first_accept", "first_roll", "first_maint"), ms):
                self.prof.ms[name] = v
            self.prof.first_round_tokens = r.j + 1
            self.prof.round1_t0_ns = r.t[0]
        self.log.push(RoundProf(wall_ms=r.wall_ns / 1e6, draft_ms=ms[0], verify_ms=ms[1], accept_ms=ms[2],
                                rest_ms=ms[3] + ms[4], k=r.k, j=r.j, ctx=r.ctx, seq_rows=r.seq_rows))

    def _finish_first_burst(self, rec, wall_ms, hook_ms, ntok) -> None:
        pf = self.prof
        pf.first_burst_ms, pf.first_burst_hook_ms = wall_ms, hook_ms
        pf.first_burst_rounds, pf.first_burst_tokens = rec.n, ntok + 1  # + the anchor
        if self.sink is not None:
            self.sink.first_token(pf)
