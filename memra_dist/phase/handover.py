"""What a traced session still holds between its rounds and the sinks (phase/clock.py):

- a burst whose events the event clock reads in the next burst's first verify, in the device's
  shadow: its record reaches the sink then, one burst late (a request's last burst: at its end;
  an abandoned request's: at its release, `flush`);
- level 2's verify sub-splits (`subsplit.Laps`), detached at each accept and added up in the
  next verify's shadow.
Host bookkeeping only: the session calls `settle_laps` / `settle` where the device is busy."""

from __future__ import annotations

__all__ = ["Handover"]


class Handover:
    def __init__(self, clock, sink, level: int):
        self.clock, self.sink, self.level = clock, sink, level
        self.unsettled = None  # (BurstRecord, event bank)
        self.laps_due: list = []  # (RoundRecord, Laps)

    def hold(self, rec, bank: int) -> None:
        """A burst's record whose events are still to be read (`settle`)."""
        self.unsettled = (rec, bank)

    def laps(self, r, laps) -> None:
        self.laps_due.append((r, laps))

    def settle_laps(self) -> None:
        """The verify sub-splits of the rounds before, added up into their records (each
        replay's stamps were copied back before its round's readback returned)."""
        for r, laps in self.laps_due:
            r.sub_ns, r.seq_rows = laps.settle()
        self.laps_due.clear()

    def settle(self) -> None:
        """The held burst's events read (waiting for its last ones: from a verify in flight, in
        the device's shadow) and its record handed to the sink."""
        rec, bank = self.unsettled
        self.unsettled = None
        self.settle_laps()
        self.clock.resolve(rec.live(), bank)
        if rec.n:
            rec.t1 = max(rec.t1, rec.rounds[rec.n - 1].t[5])
        if self.sink is not None and self.level >= 1:
            self.sink.burst(rec)

    def flush(self) -> None:
        """Everything held, into its records and to the sink now (nothing held: nothing done)."""
        if self.unsettled is not None:
            self.settle()
        self.settle_laps()
