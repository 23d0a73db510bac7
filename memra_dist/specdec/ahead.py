"""Plain greedy decoding one step ahead of the host, on the graphed path.

A decode round's host work (load the id, write the positions, launch the replay, read the
argmax back, commit, stop checks, the caller's hook) is ~0.2 ms a token on the 8B shape,
and in the round-at-a-time loop the device idles through all of it: the next replay waits
for the host to learn the token it takes as input. Here the token never has to come back
first. After each replay the argmax is written on the device straight into the step graph's
input buffer, so the next replay is launched before the host reads the token of the one
before; the host then reads tokens one step behind the device, and its work overlaps the
next replay (the idle gap shrinks to the argmax and two copies).

Exactly the same graph, the same argmax over the same logits: the ids are those of the
round-at-a-time loop (the tests compare them). A step launched past the request's end (a
stop token, the token budget) wrote one cache row past the committed length; the caller
rolls it back, as a rejected verify row is.

It runs where nothing needs the host between the steps: greedy, no drafts, trace level 0
without the profile (the phase clock drains at every boundary), a local runner whose
one-row step is a captured graph (pp = 1 on CUDA). Everything else takes the round loop.
"""

from __future__ import annotations

import torch

from .drafters.none import NoDrafter

__all__ = ["AheadSteps", "ahead_steps"]

RING = 4  # host slots for the tokens read back (at most two steps are in flight)


class AheadSteps:
    """Launch one-row steps whose input is the previous step's argmax, on the device; take
    their tokens in launch order. `step` is the one-row token-id graph (graphs._Graph); its
    completion events are of the kind its own staging event is (torch.cuda.Event; a
    stand-in on the CPU emulator)."""

    def __init__(self, runner, step):
        self.runner, self.step = runner, step
        cuda = step.x.device.type == "cuda"
        self.host = torch.zeros(RING, dtype=torch.long, pin_memory=cuda)
        self.events = [type(step.copied)() for _ in range(RING)]
        self.launched = self.taken = 0

    @property
    def pending(self) -> int:
        return self.launched - self.taken

    @torch.inference_mode()  # the graph's buffers are inference tensors (captured under the runner's forward)
    def launch(self, start: int, token: int | None = None) -> None:
        """The step at position `start`. Its input: `token` (from the host) or, when None,
        the argmax the previous step left in the input buffer."""
        g = self.step
        self.runner.cache.begin(start, 1)
        if token is not None:
            g.load(torch.tensor([token], dtype=torch.long))
        g.replay_at(start)
        torch.argmax(g.out, dim=-1, out=g.x)  # the next step's input, never via the host
        s = self.launched % RING
        self.host[s:s + 1].copy_(g.x, non_blocking=True)
        self.events[s].record()
        self.launched += 1

    def take(self) -> int:
        """The oldest pending step's token (waits for that step only)."""
        s = self.taken % RING
        self.events[s].synchronize()
        self.taken += 1
        return int(self.host[s])

    def drop(self) -> None:
        """Forget the steps not taken (their rows are rolled back by the caller)."""
        self.taken = self.launched


def ahead_steps(target, drafter, sp, clock_on: bool) -> AheadSteps | None:
    """One-ahead steps for this session's target when nothing needs the host between steps
    (see the module docstring; `clock_on`: trace level >= 1 or the profile); None otherwise."""
    if clock_on or not sp.greedy or not isinstance(drafter, NoDrafter):
        return None
    graphs = getattr(target, "graphs", None)
    step = graphs.graphs.get(1) if graphs is not None else None
    if step is None or step.copied is None or getattr(target, "cache", None) is None:
        return None  # not captured yet, or a graph of hidden rows (a pipeline stage)
    return AheadSteps(target, step)
