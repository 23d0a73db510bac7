"""The drafter interface every proposer implements (one proposer per file)."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams

__all__ = ["Drafter", "Proposal", "EMPTY", "prime_all"]


class Proposal:
    """A round's drafts. `tokens`: (k',) int64 drafted ids, k' <= k (0 = plain decode this
    round); on the drafter's device for a graphed greedy drafter (the session reads them back
    with the verify's argmax), else on the host. `q`: (k', V) draft probabilities (None =
    deterministic, one-hot). A drafter that made its drafts on the host, or read them back
    already, hands them as `ids` (a list) instead: the batched engine's loop reads them as they
    are (`host`), with no torch call on its path between two steps (each one gives the GIL up,
    and under 16 streaming request threads took tens of microseconds to get it back); the
    tensor is built only where a caller asks for `tokens`.

    >>> p = Proposal(ids=[5, 6, 7])
    >>> p.host(2), p.count(), p.tokens.tolist()
    ([5, 6], 3, [5, 6, 7])
    """

    __slots__ = ("_tokens", "q", "ids", "dev")

    def __init__(self, tokens: torch.Tensor | None = None, q: torch.Tensor | None = None,
                 ids: list[int] | None = None, dev=None):
        """`dev`: (DeviceDrafts, row, count): greedy drafts a shared draft forward left on the device
        (dflash_pool_graph.py), read back when `host` asks; the loop's next verify takes them on
        the device meanwhile (batching/step_forward.py `DraftPatch`)."""
        assert tokens is not None or ids is not None or dev is not None, "a proposal has its drafts"
        self._tokens, self.q, self.ids, self.dev = tokens, q, ids, dev

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = torch.tensor(self.host(self.count()), dtype=torch.long)
        return self._tokens

    def host(self, k: int) -> list[int]:
        """The first k drafts as a host list (a readback where they are on the device)."""
        if self.on_device:
            dd, row, n = self.dev
            self.ids = dd.rows()[row][:n]
        return self.ids[:k] if self.ids is not None else self._tokens[:k].tolist()

    @property
    def on_device(self) -> bool:
        """Its drafts are still on the device only (`dev`, not read back yet)."""
        return self.ids is None and self.dev is not None

    def count(self) -> int:
        if self.on_device:
            return self.dev[2]
        return len(self.ids) if self.ids is not None else int(self._tokens.numel())


EMPTY = Proposal(ids=[])
# a batched `propose_many`'s answer for a drafter whose rows found no room in its own pool without
# waiting (the engine loop never waits): its request's chain parks, and its session drafts that
# round itself, where waiting for room is its own (batching/chain_drafts.py)
PARK = Proposal(ids=[])


class Drafter:
    """Lifecycle per session: alloc(capacity) -> prime(prompt, chunks) -> rounds of
    propose(context, k) ... maintain(context) (after each round's accept)."""

    name = "base"
    device: torch.device | None = None  # device the drafter's state lives on (None: host only)
    host_only = False  # propose / maintain touch nothing but host lists (batching/chain.py may run them)
    defers = False  # propose_many(..., defer=True) may leave greedy drafts on the device (Proposal.dev)
    pre_maintains = False  # pre_maintain_many(drafters, rows): a round's maintenance ingested behind its verify
    # draft_early_many(drafters, verify, pred, ids): ... and its next drafts made there too (the
    # acceptance found on the device), for its next proposal (DFlash after its pre_maintain)
    drafts_early = False
    # ... and those drafts may feed the round's verify launched before the readback too
    # (batching/verify_ahead.py): `take_early(context, k)` then takes them as its proposal would
    verifies_ahead = False

    @staticmethod
    def ahead_drafts_many(drafters, earlies, ks: list[int]) -> list:
        """The drafts each drafter's verify launched ahead runs, from its early drafts
        `earlies[i]` = (DeviceDrafts, row, lo, k) (its next round's K `ks[i]`): (DeviceDrafts,
        row) each, those drafts themselves (a bench wrapper replays others: bench/tap_replay.py)."""
        return [(e[0], e[1]) for e in earlies]

    def take_early(self, context, k: int):
        """Its early drafts for the round after `context` (k of them), as its next proposal would
        take them, its state moved as that proposal moves it: (DeviceDrafts, row), or None where
        they do not fit that context."""
        return None

    # the step leader may run a batched greedy request's rounds (batching/chain.py): host drafters,
    # and device drafters that draft many requests in one forward (`batched`)
    chains = False
    # maintain_many(drafters, contexts) / propose_many(drafters, contexts, ks, sps, gens) -> each one's
    # Proposal (its drafts on the host; greedy, or drawn with its generator): the chained requests of
    # a step that share this drafter's network, in one forward each
    batched = False
    # its propose catches up on every committed row its maintain skipped (DFlash's ingest from its
    # n, EAGLE-3's and MTP's from theirs): a round of K 0 (--spec-k auto) may leave maintain out
    catches_up = False
    # a batched engine's loop allocates and primes it (its network reads the target's taps on the
    # device): the request's thread only waits (batching/batcher.py `prime`); the class's
    # `prime_many(drafters, prompts, chunks)`, where it has one, primes many in shared forwards
    loop_prime = False

    def drop_pre(self) -> None:
        """Forget what `pre_maintain_many` ingested ahead and `draft_early_many` drafted: they
        serve the maintenance and the proposal right after their step only (batching/chain_drafts.py)."""

    @property
    def batch_key(self):
        """What the drafters of one batched forward share (their network): requests whose
        drafters' keys are the same object draft together."""
        return getattr(self, "net", self)

    def alloc(self, capacity: int) -> float:
        """Allocate per-session state; returns the MB allocated (the profile's draft_kv_mb)."""
        return 0.0

    def prime(self, prompt: list[int], chunks: list[tuple[int, int]] | None = None) -> None:
        """Ingest the prompt (draft_prime), in the target's prefill chunks ([lo, hi) row
        ranges over the prompt, specdec/chunks.py; None: one chunk), so the drafter's working
        memory is bounded as the target's is."""

    def propose(self, context: list[int], k: int, sp: SamplingParams, gen: torch.Generator) -> Proposal:
        raise NotImplementedError

    def maintain(self, context: list[int]) -> None:
        """Draft-source maintenance after a round: drop state past the committed context."""

    def drain(self) -> None:
        """Drain the drafter's device stream (a no-op for host-only drafters)."""


def prime_all(drafters, prompts: list[list[int]], chunks: list, rows: int = 0) -> None:
    """Drafters of one class and network primed on their prompts (each with its chunks): in
    shared forwards of at most `rows` prompt rows (or the largest chunk's, if more) where the
    class has `prime_many(drafters, prompts, chunks, rows)`, else one after another."""
    many = getattr(type(drafters[0]), "prime_many", None)
    if many is not None and len(drafters) > 1:
        many(drafters, prompts, chunks, rows)
        return
    for d, p, c in zip(drafters, prompts, chunks):
        d.prime(p, c)
