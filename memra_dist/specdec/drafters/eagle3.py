"""`eagle3`: an EAGLE-3 head (model/eagle3.py) drafting a chain from the target's taps.

Rows. Draft row p sits at cache slot and rotary position p and pairs the token at p + 1
with a hidden of position p; its output predicts the token at p + 2. With context
t_0 .. t_{N-1} (t_{N-1} the pending token, whose taps the target has not made yet):

  committed rows p < N - 1: hidden g_p = fc(taps of p) (the target's verified rows), token
      t_{p+1}. Rows [n, N - 1) not yet in the drafter's cache are run in the round's first
      forward (prime runs the prompt's rows [0, P - 1)); its last row (p = N - 2) gives d_1.
  chain step s >= 1: one row at p = N - 2 + s, token d_s, hidden = the previous row's
      pre-norm output (the layer's own output fed back, as EAGLE-3 does at inference);
      it reads the committed rows and the chain rows before it (causal mask).
  rollback: nothing to undo. n never passes the committed rows; chain rows sit at
      p >= N - 1, past them, and the next round's first forward (which starts at n) writes
      over every one of them before any row reads it.

Greedy: argmax over the draft vocabulary, mapped to target ids through d2t, all on the
device; one readback per round. Sampled: q is the drafter's distribution over the TARGET
vocabulary (draft-vocabulary logits placed at their d2t ids, -inf elsewhere, then the
request's temperature / top-k / top-p), the draft drawn from it, so rejection sampling
keeps the target's distribution. Runs beside the target's head (at pp > 1 the stages ship its taps).
Where the target captures its own steps (CUDA, graphs on), a round replays CUDA graphs captured
at allocation (eagle3_graph.py: the first forward per row count, the chained step, the greedy
pick inside them); the eager steps here stay the reference.
"""

from __future__ import annotations

import torch

from ...cache import KVLayer
from ...model.attention import causal_mask
from ...model.eagle3 import Eagle3Net, load_eagle3
from ...model.prefix_attention import PREFIX_MIN_ROWS, prefix_attention
from ..sampling import SamplingParams, draw_drafts, probs
from .base import EMPTY, Drafter, Proposal
from .eagle3_batch import _early, draft_early_many, maintain_many, prime_many, propose_many
from .eagle3_graph import eagle3_graphs

__all__ = ["Eagle3Drafter", "FOLD_ROWS"]

FOLD_ROWS = 16  # rows a folded step takes (the row GEMM's verify block); more: the reference step


class Eagle3Drafter(Drafter):
    name = "eagle3"
    # batched greedy requests: the step leader drafts the step's requests as batched chains (eagle3_batch.py)
    chains = True
    batched = True
    catches_up = True  # propose commits the rows from its n on (base.py)
    loop_prime = True  # a batched engine's loop allocates and primes it (base.py)
    maintain_many = staticmethod(maintain_many)
    propose_many = staticmethod(propose_many)
    prime_many = staticmethod(prime_many)  # a batched engine's loop primes its new requests together
    # a batched engine's greedy rounds are drafted right behind their verify, before its
    # readback, the acceptance found on the device (eagle3_batch.py draft_early_many); those drafts
    # stay on the device for the next verify (`defers`)
    drafts_early = True
    defers = True
    draft_early_many = staticmethod(draft_early_many)
    early = None  # (DeviceDrafts, row, lo, k): draft_early_many's drafts for the next proposal

    verifies_ahead = True  # (batching/verify_ahead.py)

    def drop_pre(self) -> None:
        self.early = None

    def take_early(self, context, k: int):
        return _early(self, len(context), k)

    ttft_depth = None  # the profile's DepthTimer, lent for the prime only (phase/first_token.py)

    def __init__(self, net: Eagle3Net, target):
        """`target`: the pp=1 ModelRunner (its tap sink, and its embedding when the
        checkpoint has none, are read)."""
        self.net, self.target = net, target
        self.ec = net.ec
        self.device = target.device
        self.state: KVLayer | None = None
        self.capacity = 0
        self.n = 0  # committed rows in the cache: positions 0 .. n-1
        self.embed = net.embed_tokens if net.embed_tokens is not None else target.stage.embed_tokens
        self.graph = None  # the round's CUDA graphs (eagle3_graph.py), when the target captures its own steps
        target.keep_taps(self.ec.tap_ids)

    @classmethod
    def load(cls, model_dir, ec, target) -> "Eagle3Drafter":
        net = load_eagle3(model_dir, ec, target.device, target.dtype)
        if getattr(target, "kernel_modules", 0):  # the target runs our kernels: its drafter's steps too
            from ...kernels.ops import install_eagle3  # noqa: PLC0415 (Triton: only where installed)

            install_eagle3(net)
        return cls(net, target)

    pool = None  # a batched engine's DraftPool (draft_pool.py): the draft K/V as a slot of it
    pool_slot = None

    # ---- state ----
    def alloc(self, capacity: int) -> float:
        if capacity != self.capacity:
            c = self.ec.base
            pooled = self.pool.take(self, capacity) if self.pool is not None else None
            self.state = pooled[0] if pooled else KVLayer.alloc(capacity, c.num_kv_heads, c.head_dim, self.device,
                                                                 self.target.dtype)
            self.capacity = capacity
            self.graph = eagle3_graphs(self)
            if self.graph is not None:
                self.graph.warm()  # every graph of the run's K captured here, none inside a round
        elif self.graph is not None and self.graph.sink is not self.target.cache.taps:
            self.graph.warm()  # the target reallocated its tap sink: recaptured here, not in a round
        self.n = 0
        return self.state.nbytes() / 2**20

    def _taps(self):
        taps = self.target.cache.taps
        if taps is None or taps.layers != self.ec.tap_ids:
            raise RuntimeError("the target keeps no taps for this drafter (keep_taps before alloc)")
        return taps

    def _kv_of(self, pos: torch.Tensor):
        """The K/V writer of rows at `pos`: their own k, v into the cache -> the whole cache."""
        st = self.state

        def kv_of(k, v):
            st.k.index_copy_(0, pos, k)
            st.v.index_copy_(0, pos, v)
            return st.k, st.v

        return kv_of

    def _rows(self, tokens: torch.Tensor, g: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rows at positions pos (a device tensor: the graphs pass theirs) under the causal mask
        over the whole cache -> pre-norm outputs (T, H); their K/V land at those positions. On
        the kernels (`Eagle3Net.folded`) a few rows run the folded step instead."""
        if self.net.folded and tokens.shape[0] <= FOLD_ROWS:
            return self.net.step_folded(self.embed(tokens), g, pos, self.state.k, self.state.v)
        return self.net.step(self.embed(tokens), g, pos, self._kv_of(pos), causal_mask(pos, self.capacity))

    def _run(self, tokens: torch.Tensor, g: torch.Tensor, lo: int) -> torch.Tensor:
        """Rows at positions lo .. lo + T - 1 (tokens (T,), hidden (T, H)) -> pre-norm
        outputs (T, H); their K/V land in the cache at those positions."""
        T = tokens.shape[0]
        pos = torch.arange(lo, lo + T, device=self.device)
        if T > PREFIX_MIN_ROWS:  # a prime chunk: the rows before it, bottom-right causal, no (T x capacity) mask
            hd = self.ec.base.head_dim

            def attend(q, K, V):
                return prefix_attention(q, K[:lo + T], V[:lo + T], lo, hd ** -0.5).reshape(T, -1)

            return self.net.step(self.embed(tokens), g, pos, self._kv_of(pos), None, attend)
        return self._rows(tokens, g, pos)

    @torch.inference_mode()
    def _commit_rows(self, context, lo: int, hi: int) -> torch.Tensor:
        """Committed rows [lo, hi): token context[p + 1], hidden fc(taps of p)."""
        tokens = torch.tensor(context[lo + 1:hi + 1], dtype=torch.long, device=self.device)
        out = self._run(tokens, self.net.features(self._taps().rows(lo, hi)), lo)
        self.n = hi
        return out

    @torch.inference_mode()
    def _prime_kv(self, context, lo: int, hi: int) -> None:
        """Committed rows [lo, hi) whose outputs nobody reads: only their K/V into the cache
        (the first propose recomputes the last committed row, whose output gives d_1)."""
        pos = torch.arange(lo, hi, device=self.device)
        tokens = torch.tensor(context[lo + 1:hi + 1], dtype=torch.long, device=self.device)
        k, v = self.net.context_kv(self.embed(tokens), self.net.features(self._taps().rows(lo, hi)), pos)
        self.state.k.index_copy_(0, pos, k)
        self.state.v.index_copy_(0, pos, v)
        self.n = hi

    def prime(self, prompt: list[int], chunks: list[tuple[int, int]] | None = None) -> None:
        """Rows 0 .. P-2 (row p pairs token p + 1 with the taps of p), in the target's chunks:
        their K/V only (`_prime_kv`)."""
        self.n = 0
        n, d = len(prompt) - 1, self.ttft_depth
        for lo, hi in chunks or [(0, n)]:
            if lo < min(hi, n):
                t = d.stamp() if d is not None else 0
                self._prime_kv(prompt, lo, min(hi, n))
                if d is not None:
                    d.lap("draft_prime_kv_ms", t)
                    d.chunk(min(hi, n) - lo)

    def maintain(self, context) -> None:
        self.n = min(self.n, len(context) - 1)  # a no-op: n never passes the committed rows

    # ---- drafting ----
    @torch.inference_mode()
    def step_logits(self, context: list[int], k: int, pick) -> list[torch.Tensor]:
        """The k chained steps after `context`; `pick(s, logits (1, Vd))` returns draft s + 1
        as a (1,) device tensor of TARGET ids. Returns each step's fp32 draft-vocabulary
        logits (1, Vd)."""
        N = len(context)
        lo = min(self.n, N - 2)  # at least the last committed row: its output gives d_1
        g = self.graph
        if g is not None and g.replays(N, lo, k):
            self.n = N - 1
            return g.step_logits(context, lo, k, pick)
        last = self._commit_rows(context, lo, N - 1)[-1:]  # (1, H)
        out = []
        for s in range(k):
            logits = self.net.logits(last)  # (1, Vd)
            out.append(logits)
            tok = pick(s, logits)
            if s + 1 < k:
                last = self._run(tok, last, N - 1 + s)  # chain row at N - 2 + (s + 1)
        return out

    def propose(self, context, k, sp: SamplingParams, gen) -> Proposal:
        if k == 0:
            return EMPTY
        hot = self.net.hot
        g, N = self.graph, len(context)
        lo = min(self.n, N - 2)
        if sp.greedy and g is not None and g.replays(N, lo, k):
            self.n = N - 1
            return Proposal(g.greedy(context, lo, k))  # the picks inside the graphs; left on the device
        if sp.greedy:
            picked: list[torch.Tensor] = []

            def pick(s, logits):
                picked.append(hot[logits.argmax(-1)])  # (1,) target id, on the device
                return picked[-1]

            self.step_logits(context, k, pick)
            return Proposal(torch.cat(picked))  # on the device: the accept reads it back with the verify's
        qs, toks = [], []

        def draw(s, logits):
            q = probs(self.net.target_logits(logits), sp)  # (1, V): over the target vocabulary
            qs.append(q)
            toks.append(int(draw_drafts(q[:1], gen, self.name)[0]))
            return torch.tensor([toks[-1]], device=self.device)

        self.step_logits(context, k, draw)
        return Proposal(torch.tensor(toks, dtype=torch.long), torch.cat(qs))

    def drain(self) -> None:
        self.target.drain()
