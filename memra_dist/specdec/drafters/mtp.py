"""`mtp`: the target's own MTP layers (model/mtp.py) draft, chained, from its final-normed hidden.

Rows. Layer j's row p pairs the token at position p + j + 1 with a hidden of position p:
the target's final-normed hidden h_p for layer 0 (the FINAL tap, kept by the target's own
forwards in `runner.cache.taps`: no host readback), layer j - 1's output at row p for j >= 1
(transformers' MtpModel, the DeepSeek-V3 paper's sequential modules). Rows sit at cache
slot and rotary position p (vLLM's convention; transformers rotates at p + j + 1: the same
attention, rotary being relative). With context t_0 .. t_{N-1} (t_{N-1} the pending token):

  propose, step s < n (n layers): layer j = s runs rows [done_j, N - 1) in one forward: the
      rows whose inputs are all committed tokens (p < N - 1 - j) and the j rows whose tokens
      are this round's drafts d_1 .. d_j; its last row (p = N - 2) gives d_{s+1}. Rows
      p >= N - 1 - j hold drafts, so done_j = N - 1 - j: the next round recomputes them from
      the verified tokens (rejected drafts never stay in a cache).
  propose, step s >= n: layer s % n again, one row further on (p = N - 2 + s // n), fed the
      previous step's output and draft (vLLM's / SGLang's chaining of one MTP layer).
  maintain: nothing (the next propose ingests the verified rows in its first forward).

Layer outputs of committed rows are kept per position (layers 0 .. n-2) for the next layer.
Greedy: argmax on the device, one readback per round. Sampled: each draft is drawn from the
MTP's distribution at its step (q), which rejection sampling corrects to the target's.
Runs beside the target's head (at pp > 1 the head's sink holds the FINAL tap of the rows it
ran: the final norm is the head's own; tests/test_pipeline_taps.py).
"""

from __future__ import annotations

import torch

from ...model.mtp import MTPHead, check_mtp, load_mtp
from ...model.taps import FINAL
from ..sampling import SamplingParams, draw_drafts, probs
from .base import EMPTY, Drafter, Proposal
from .mtp_batch import maintain_many, propose_many
from .mtp_graph import mtp_graphs

__all__ = ["MTPDrafter"]


class MTPDrafter(Drafter):
    name = "mtp"
    # batched greedy requests: the step leader drafts the step's requests as batched chains (mtp_batch.py)
    chains = True
    batched = True
    catches_up = True  # propose commits the rows from its n on (base.py)
    loop_prime = True  # a batched engine's loop allocates and primes it (base.py)
    maintain_many = staticmethod(maintain_many)
    propose_many = staticmethod(propose_many)

    @property
    def batch_key(self):
        return self.head
    ttft_depth = None  # the profile's DepthTimer, lent for the prime only (phase/first_token.py)

    def __init__(self, head: MTPHead, target):
        """`target`: the pp=1 ModelRunner (its embedding, lm_head and FINAL tap are read)."""
        self.head, self.target = head, target
        self.n = head.n
        self.device = target.device
        self.states: list = []
        self.outs: list[torch.Tensor] = []  # layer j's normed outputs by row (j < n - 1: layer j + 1's input)
        self.done = [0] * self.n  # layer j: rows [0, done[j]) are final (all-committed inputs)
        self.capacity = 0
        self.graph = None  # the steps' CUDA graphs, captured at alloc, when the target captures its own (mtp_graph.py)
        target.keep_taps((FINAL,))

    @classmethod
    def load(cls, model_dir, cfg, target) -> "MTPDrafter":
        n = check_mtp(cfg, model_dir)
        head = load_mtp(model_dir, cfg, n, target.device, target.dtype)
        if getattr(target, "kernel_modules", 0):  # the target runs our kernels: its MTP layers too
            from ...kernels.ops import install_mtp  # noqa: PLC0415 (Triton: only where installed)

            install_mtp(head)
        return cls(head, target)

    pool = None  # a batched engine's DraftPool (draft_pool.py): one layer's K/V as a slot of it (mtp_pool_graph.py)
    pool_slot = None

    # ---- state ----
    def alloc(self, capacity: int) -> float:
        if capacity != self.capacity:
            blocks = [self.head.layer(j) for j in range(self.n)]
            pooled = self.pool.take(self, capacity) if self.pool is not None else None
            self.states = pooled or [b.self_attn.new_state(capacity, self.device, self.target.dtype) for b in blocks]
            h = self.head.cfg.hidden_size
            self.outs = [torch.zeros(capacity, h, device=self.device, dtype=self.target.dtype)
                         for _ in range(self.n - 1)]
            self.capacity = capacity
            self.graph = mtp_graphs(self)
            if self.graph is not None:
                self.graph.warm()  # every step of the run's K captured here, none inside a round
        elif self.graph is not None and self.graph.k is not None and self.graph.sink is not self._final():
            self.graph.warm()  # the target reallocated its FINAL tap: recaptured here, not in a round
        self.done = [0] * self.n
        return (sum(s.nbytes() for s in self.states) + sum(o.numel() * o.element_size() for o in self.outs)) / 2**20

    def _final(self) -> torch.Tensor:
        taps = self.target.cache.taps
        if taps is None or not taps.wants(FINAL):
            raise RuntimeError("the target keeps no final-normed hidden for this drafter (keep_taps before alloc)")
        return taps.bufs[FINAL]

    @torch.inference_mode()
    def _rows(self, j: int, lo: int, hi: int, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Layer j over rows [lo, hi): token ids (hi - lo,), hidden (hi - lo, H) -> outputs."""
        pos = torch.arange(lo, hi, device=self.device)
        emb = self.target.stage.embed_tokens(tokens)
        out = self.head.layer(j).step(emb, hidden, self.head.step_ctx(pos, self.capacity, lo), self.states[j])
        if j < self.n - 1:
            self.outs[j].index_copy_(0, pos, out)
        return out

    def prime(self, prompt: list[int], chunks: list[tuple[int, int]] | None = None) -> None:
        """Ingest the rows the prompt alone settles (layer j: p < P - 1 - j), in the target's
        chunks: after chunk [lo, hi), layer 0 takes its rows up to hi (their FINAL taps
        exist) and layer j its rows up to layer j - 1's. Profiled (`ttft_depth`): each
        layer's forward over a chunk's rows is one k/v ingest chunk (an MTP layer has no
        feature GEMM: draft_prime_feat_ms stays 0)."""
        self.done = [0] * self.n
        ids = torch.tensor(prompt, device=self.device)
        d, P = self.ttft_depth, len(prompt)
        for _lo, hi in chunks or [(0, P)]:
            for j in range(self.n):
                lo, top = self.done[j], min(P - 1 - j, hi if j == 0 else self.done[j - 1])
                if top <= lo:
                    break
                t = d.stamp() if d is not None else 0
                hidden = self._final()[lo:top] if j == 0 else self.outs[j - 1][lo:top]
                self._rows(j, lo, top, ids[lo + j + 1:top + j + 1], hidden)
                self.done[j] = top
                if d is not None:
                    d.lap("draft_prime_kv_ms", t)
                    d.chunk(top - lo)

    # ---- drafting ----
    @torch.inference_mode()
    def step_logits(self, context: list[int], k: int, pick, keep: bool = True) -> list[torch.Tensor]:
        """The k chained steps after `context`; `pick(s, logits (1, V))` returns draft s + 1 as a
        (1,) device tensor. Returns each step's fp32 logits (1, V); `keep=False` (propose, whose
        picks launch their reads of a step's logits before the next replay) returns a graph's
        static outputs as they are instead of copies (a later replay of that graph rewrites them)."""
        N = len(context)
        lm_head = self.target.stage.lm_head
        drafts: list[torch.Tensor] = []
        out_logits = []
        prev = None
        for s in range(k):
            j, r = s % self.n, s // self.n
            g, logits = self.graph, None  # g: the steps' CUDA graphs (mtp_graph.py), when the target's are on
            if r == 0:  # layer j's first forward this round: committed rows, then the j draft rows
                lo = self.done[j]
                ids = context[lo + j + 1:N]
                if g is not None and len(ids) + j == N - 1 - lo and g.replays(("first", j, N - 1 - lo)):
                    last, logits = g.first(j, lo, ids, drafts[:j])
                else:
                    real = torch.tensor(ids, dtype=torch.long, device=self.device)
                    tokens = torch.cat([real, *drafts[:j]]) if j else real
                    hidden = self._final()[lo:N - 1] if j == 0 else self.outs[j - 1][lo:N - 1]
                    last = self._rows(j, lo, N - 1, tokens, hidden)[-1:]
                self.done[j] = N - 1 - j
            else:  # chained past the layers: one row further on, fed the previous step
                p = N - 2 + r
                if g is not None and g.replays(("chain", j)):
                    last, logits = g.chain(j, p, drafts[-1], prev)
                else:
                    last = self._rows_chain(j, p, drafts[-1], prev)
            # (1, V); a graph's static output is copied: the same graph may replay again this round
            logits = lm_head(last).float() if logits is None else (logits.clone() if keep else logits)
            out_logits.append(logits)
            drafts.append(pick(s, logits))
            prev = last
        return out_logits

    def _rows_chain(self, j: int, p: int, token: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        pos = torch.full((1,), p, dtype=torch.long, device=self.device)
        emb = self.target.stage.embed_tokens(token)
        return self.head.layer(j).step(emb, hidden, self.head.step_ctx(pos, self.capacity), self.states[j])

    def propose(self, context, k, sp: SamplingParams, gen) -> Proposal:
        if k == 0:
            return EMPTY
        if sp.greedy:
            picked: list[torch.Tensor] = []

            def pick(s, logits):
                picked.append(logits.argmax(-1))
                return picked[-1]

            self.step_logits(context, k, pick, keep=False)
            return Proposal(torch.cat(picked))  # on the device: the accept reads it back with the verify's
        qs, toks = [], []

        def draw(s, logits):
            q = probs(logits, sp)  # (1, V): the distribution this draft is drawn from
            qs.append(q)
            toks.append(int(draw_drafts(q[:1], gen, self.name)[0]))
            return torch.tensor([toks[-1]], device=self.device)

        self.step_logits(context, k, draw, keep=False)
        return Proposal(torch.tensor(toks, dtype=torch.long), torch.cat(qs))

    def drain(self) -> None:
        self.target.drain()
