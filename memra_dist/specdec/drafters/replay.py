"""`replay` - a BENCHMARKING TOOL, not a drafter for real use: it proposes a recorded target
continuation, corrupting each proposed token with probability `corrupt`, so the engine can
be measured at a controlled acceptance (about 1 - corrupt per token under greedy). Host lists
and Python's own generator only: in a batched engine its proposals run on the loop's path
between two steps, where each torch call (seven a proposal, before) gave the GIL up to the
streaming request threads (0.17 ms a request a step measured on an H200 host at 16 concurrent),
a cost no real drafter has."""

from __future__ import annotations

import random

from .base import EMPTY, Drafter, Proposal

__all__ = ["ReplayDrafter"]


class ReplayDrafter(Drafter):
    name = "replay"
    host_only = True  # nothing but the host
    chains = True  # a batched greedy request's rounds run in the step leader (batching/chain.py)

    def __init__(self, recorded: list[int], prompt_len: int, vocab_size: int, corrupt: float = 0.0, seed: int = 0):
        if not 0.0 <= corrupt <= 1.0:
            raise ValueError("corrupt must be in [0, 1]")
        self.recorded, self.prompt_len, self.vocab = list(recorded), prompt_len, vocab_size
        self.corrupt = corrupt
        # its own stream (sampling draws stay the target's), and each request's its own: the seed
        # mixed with the request's recorded continuation, so concurrent requests' corruptions are
        # independent (one seed for all made every request of a batch reject at the same rounds,
        # a bench's acceptance then one request's draw) and a request's are the same solo or batched.
        # Each position's draft is drawn once (`drafted`): a round drafting positions p .. p + k - 1
        # accepts up to the first corrupted one, whichever round drafted it before, so each
        # round's acceptance is what a fresh draw per draft gives, and a round's drafts depend
        # only on where it starts (a verify launched ahead draws them on the device: bench/tap_replay.py)
        gen = random.Random(f"{seed}:{prompt_len}:{self.recorded[:64]}")
        self.drafted = [(t + gen.randrange(1, vocab_size)) % vocab_size if corrupt > 0 and gen.random() < corrupt
                        else t for t in self.recorded]  # (a corrupted id is always a different one)

    def propose(self, context, k, sp, gen) -> Proposal:
        at = len(context) - self.prompt_len
        toks = self.drafted[at:at + k] if k > 0 and at >= 0 else []
        return Proposal(ids=toks) if toks else EMPTY
