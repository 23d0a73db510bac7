"""`dflash`: a block drafter conditioned on the target's hidden states (model/dflash.py).

One forward of the draft network over the block [last committed token, mask x (B - 1)]
gives B - 1 drafts at once; a round proposes min(k, B - 1) of them. The drafter reads the
target's taps (the outputs of chosen target layers, kept by the target's own forwards in
`runner.cache.taps`, model/taps.py) and keeps, per draft layer, the K/V of the committed
context rows only:

  prime(prompt)      ingest rows 0 .. P-1 (the prompt's taps from the target's prime)
  propose(context)   block at start = len(context) - 1; its K/V is written at the block's
                     positions, read under the mask `slot < start + B` (context rows and the
                     whole block, no causal mask) and dropped: the next ingest overwrites it
  maintain(context)  ingest the verified rows up to len(context) - 1: after a verify that
                     accepted a drafts, rows start .. start + a; never the new bonus token
                     (it is the next block's first row)

Greedy: argmax on the device, one readback per round. Sampled: each draft is drawn from the
drafter's own distribution at its row (q), which rejection sampling corrects to the target's.
The drafts of a block are drawn independently (mask rows do not see earlier draws), so q_i
given the earlier drafts is q_i itself.

Runs beside the target's head: at pp = 1 the taps are local; at pp > 1 each stage ships its
layers' taps behind its activations and the head's sink holds them all by position
(pipeline/head_target.py), so the drafter reads the same sink either way.
"""

from __future__ import annotations

import torch

from ...cache import KVLayer
from ...model.dflash import DFlashNet, load_dflash
from ..sampling import SamplingParams, draw_drafts, probs
from .base import EMPTY, Drafter, Proposal
from .dflash_batch import _early, draft_early_many, ingest_many, pre_ingest_many, prime_many, propose_many
from .dflash_graph import block_graphs


def ingest_many_of_contexts(drafters, contexts) -> None:
    """Each drafter maintained for its context (maintain's rows: up to len(context) - 1), at once."""
    ingest_many(drafters, [len(c) - 1 for c in contexts])

__all__ = ["DFlashDrafter"]


class DFlashDrafter(Drafter):
    name = "dflash"
    forwards_per_draft = 1  # the whole proposal is one forward of the draft network
    # batched greedy requests: the step leader drafts the step's requests in one forward (dflash_batch.py)
    chains = True
    batched = True
    defers = True  # the shared forward's graphed greedy drafts may stay on the device until the verify
    pre_maintains = True  # (False: each round's maintenance after its accept, as before)
    catches_up = True  # propose commits the rows from its n on (base.py)
    loop_prime = True  # a batched engine's loop allocates and primes it (base.py)
    maintain_many = staticmethod(ingest_many_of_contexts)
    # a batched engine's rounds ingest their verify rows right behind the verify, before
    # its readback (dflash_batch.py pre_ingest_many; batching/chain_drafts.py pre_maintain)
    pre_maintain_many = staticmethod(pre_ingest_many)
    pre = None  # (lo, hi): rows pre_ingest_many ingested for the next maintenance
    # ... and their next drafts made behind that ingest, the acceptance found on the device
    # (dflash_batch.py draft_early_many), taken by the next proposal where it fits
    drafts_early = True  # (False: drafted after the accept, as before)
    draft_early_many = staticmethod(draft_early_many)
    early = None  # (DeviceDrafts, row, lo, k): draft_early_many's drafts for the next proposal

    verifies_ahead = True  # (batching/verify_ahead.py)

    def drop_pre(self) -> None:
        self.pre = self.early = None

    def take_early(self, context, k: int):
        return _early(self, len(context) - 1, k)

    propose_many = staticmethod(propose_many)
    prime_many = staticmethod(prime_many)  # a batched engine's loop primes its new requests together
    ttft_depth = None  # the profile's DepthTimer, lent for the prime only (phase/first_token.py)

    def __init__(self, net: DFlashNet, target):
        """`target`: the pp=1 ModelRunner (its embedding, lm_head and tap sink are read)."""
        self.net, self.target = net, target
        self.dc = net.dc
        self.B = self.dc.block_size
        self.device = target.device
        self.states: list[KVLayer] = []
        self.n = 0  # context rows ingested: positions 0 .. n-1
        self.graph = None  # the block forward's and the round ingest's CUDA graphs when the target captures its steps (dflash_graph.py)
        if getattr(target, "graphs", None) is not None and self.device.type == "cuda":
            net.fuse()  # the fast path: one GEMM for a block row's q / k / v, one for gate / up (as the target's)
        target.keep_taps(self.dc.tap_ids)

    @classmethod
    def load(cls, model_dir, dc, target) -> "DFlashDrafter":
        return cls(load_dflash(model_dir, dc, target.device, target.dtype), target)

    pool = None  # a batched engine's DraftPool (draft_pool.py): the draft K/V as a slot of it
    pool_slot = None

    # ---- state ----
    def alloc(self, capacity: int) -> float:
        rows = capacity + self.B  # a block may start at the last context row
        c = self.dc.base
        if not self.states or self.states[0].k.shape[0] != rows:
            pooled = self.pool.take(self, rows) if self.pool is not None else None
            self.states = pooled or [KVLayer.alloc(rows, c.num_kv_heads, c.head_dim, self.device, self.target.dtype)
                                     for _ in range(c.num_layers)]
            self.slots = torch.arange(rows, device=self.device)
            self.block_ids = torch.full((self.B,), self.dc.mask_token_id, dtype=torch.long, device=self.device)
            self.block_base = torch.arange(self.B, device=self.device)
            self.graph = block_graphs(self)
            if self.graph is not None:
                self.graph.warm()  # every row count captured here, none inside a round
        self.n, self.pre = 0, None
        return sum(s.nbytes() for s in self.states) / 2**20

    def _taps(self):
        taps = self.target.cache.taps
        if taps is None or taps.layers != self.dc.tap_ids:
            raise RuntimeError("the target keeps no taps for this drafter (keep_taps before alloc)")
        return taps

    @torch.inference_mode()
    def _ingest(self, upto: int, depth=None) -> None:
        """Context rows [n, upto) from the target's taps into every layer's K/V: one feature
        GEMM over the rows, then each layer's k/v projections, all on the device. `depth`
        (the prime, profiled): drained laps of the feature GEMM and of the k/v ingest."""
        if upto <= self.n:
            return
        t = depth.stamp() if depth is not None else 0
        pos = torch.arange(self.n, upto, device=self.device)
        C = self.net.features(self._taps().rows(self.n, upto))  # (rows, H)
        if depth is not None:
            t = depth.lap("draft_prime_feat_ms", t)
        for st, (k, v) in zip(self.states, self.net.context_kv(C, pos)):
            st.k.index_copy_(0, pos, k)
            st.v.index_copy_(0, pos, v)
        if depth is not None:
            depth.lap("draft_prime_kv_ms", t)
            depth.chunk(upto - self.n)  # the taps stay on the device: no HtoD (draft_prime_h2d_ms = 0)
        self.n = upto

    def prime(self, prompt: list[int], chunks: list[tuple[int, int]] | None = None) -> None:
        self.n, self.pre = 0, None
        for _lo, hi in chunks or [(0, len(prompt))]:  # one ingest per target chunk: bounded feature rows
            self._ingest(hi, self.ttft_depth)

    def maintain(self, context) -> None:
        upto = len(context) - 1
        self.pre = None
        if self.graph is not None and self.graph.ingests_rows(upto - self.n):
            self.graph.ingest(self.n, upto)  # the round's a + 1 rows, replayed (dflash_graph.py)
            self.n = upto
            return
        self._ingest(upto)

    # ---- drafting ----
    @torch.inference_mode()
    def block_logits(self, last: int, start: int, rows: int) -> torch.Tensor:
        """fp32 logits (rows, V) of the block's rows 1 .. rows (row i: the token AT start + i)."""
        if self.graph is not None:
            return self.graph.logits(last, start, rows)
        ids = self.block_ids.clone()
        ids[0] = last
        pos = self.block_base + start  # (B,) start .. start + B - 1
        mask = (self.slots < start + self.B)[None, :]  # (1, slots): every context row and the whole block
        st = self.states

        def kv_of(i, kb, vb):
            st[i].k.index_copy_(0, pos, kb)  # the block's K/V, dropped: the next ingest overwrites it
            st[i].v.index_copy_(0, pos, vb)
            return st[i].k, st[i].v

        stage = self.target.stage
        h = self.net.block(stage.embed_tokens(ids), pos, kv_of, mask)  # (B, H)
        return stage.lm_head(h[1:1 + rows]).float()

    def propose(self, context, k, sp: SamplingParams, gen) -> Proposal:
        if k == 0:
            return EMPTY
        start = len(context) - 1
        self._ingest(start)  # normally a no-op: maintain has ingested every committed row
        kk = min(k, self.B - 1)
        if sp.greedy and self.graph is not None:
            return Proposal(self.graph.greedy(context[-1], start, kk))  # argmax in the graph; left on the device
        logits = self.block_logits(context[-1], start, kk)  # (kk, V)
        if sp.greedy:
            return Proposal(logits.argmax(-1))  # on the device: the accept reads it back with the verify's
        q = probs(logits, sp)  # (kk, V): the distribution each draft is drawn from
        toks = draw_drafts(q, gen, self.name)
        return Proposal(toks, q)

    def drain(self) -> None:
        self.target.drain()
