"""Measured generations and step timings over runners built ONCE per run (loading an 8B
checkpoint per configuration would dominate the wall): a plain/spec generation loop with
decode-only timing, drafter factories, and ModelRunner step timing at a fixed context."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import RunConfig
from ..runner import ModelRunner
from ..phase.levels import TraceSettings
from ..specdec.drafters import ModelDrafter, NgramDrafter, NoDrafter, ReplayDrafter
from ..specdec.session import SpecSession
from .fastpath import config_kwargs, runner_kwargs
from .noise import trimmed_range
from .roofline import median
from .timing import sync, time_call

__all__ = ["Bench", "Steps", "make_prompt", "chain", "GenResult"]


def chain(P: torch.Tensor, start: int, n: int) -> list[int]:
    out = [start]
    for _ in range(n - 1):
        out.append(int(P[out[-1]]))
    return out


def make_prompt(n: int, vocab: int, seed: int = 0, hole_every: int = 5) -> list[int]:
    """n token ids for the chain-structured bench checkpoints (checkpoints.py): the prompt is
    A = the greedy chain from s with every `hole_every`-th token replaced, then B = the chain
    from s again (its first quarter). The target continues B along the chain, which A holds
    with holes: a copy-with-edits workload where the n-gram drafter is right most of the time."""
    from .checkpoints import chain_perm  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    P = chain_perm(vocab)
    s = int(torch.randint(3, vocab, (1,), generator=g))
    m = max(2, n // 4)
    a = chain(P, s, n - m)
    for i in range(hole_every - 1, len(a), hole_every):
        a[i] = int(torch.randint(3, vocab, (1,), generator=g))
    return a + chain(P, s, m)


@dataclass
class GenResult:
    tokens: list[int]
    decode_s: float  # wall from the first token to the last (prefill excluded), device-synced
    rounds: int
    drafted: int
    accepted: int

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"tokens": len(self.tokens), "decode_s": round(self.decode_s, 5),
                "tok_s": round(self.decode_tok_s, 3), "rounds": self.rounds, "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_drafted": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "accepted_per_round": round(self.accepted / self.rounds, 4) if self.rounds else 0.0,
                "tokens_per_round": round((len(self.tokens) - 1) / self.rounds, 4) if self.rounds else 0.0}


class Bench:
    """Target (and draft) runners of one shape on one device; every measurement reuses them."""

    def __init__(self, target_dir, draft_dir, device: torch.device, dtype: torch.dtype, max_pos: int,
                 graphs: bool):
        self.device, self.dtype, self.max_pos, self.graphs = device, dtype, max_pos, graphs
        self.target_dir, self.draft_dir = str(target_dir), str(draft_dir) if draft_dir else None
        kw = runner_kwargs(graphs)
        self.target = ModelRunner(self.target_dir, device, dtype, max_pos=max_pos, **kw)
        self.draft = ModelRunner(self.draft_dir, device, dtype, max_pos=max_pos, **kw) if draft_dir else None
        self.vocab = self.target.cfg.vocab_size
        self.steps = Steps(device)

    # ---- generations ----
    def drafter(self, name: str, recorded: list[int] | None = None, prompt_len: int = 0,
                corrupt: float = 0.0, seed: int = 1, k: int = 0):
        if name == "none":
            return NoDrafter()
        if name == "ngram":
            return NgramDrafter()
        if name == "model":
            return ModelDrafter(self.draft, k=k)  # K: its greedy chain graph, as the engine builds it
        if name == "replay":
            return ReplayDrafter(recorded, prompt_len, self.vocab, corrupt, seed=seed)
        raise ValueError(name)

    def generate(self, drafter, prompt: list[int], max_new: int, k: int = 1,
                 trace: TraceSettings = TraceSettings(), sink=None) -> GenResult:
        cfg = RunConfig(model=self.target_dir, drafter="none", k=k, max_new_tokens=max_new, trace=trace,
                        **config_kwargs(self.graphs))
        s = SpecSession(self.target, drafter, cfg.sampling, torch.Generator().manual_seed(0), k, trace, sink,
                        self.target.cfg.eos_token_ids)
        # one capacity for every run: a new one would re-capture (and, compiled, re-specialise)
        # every step graph
        capacity = max(self.max_pos, len(prompt) + max_new + k + 1)
        out = [s.start(prompt, max_new, capacity)]
        sync(self.device)
        t0 = time.perf_counter()
        while not s.done:
            out.extend(s.burst(cfg.burst_rounds))
        sync(self.device)
        dt = time.perf_counter() - t0
        st = s.stats
        return GenResult(out, dt, st.rounds, st.drafted, st.accepted)

    def propose_time(self, drafter, context: list[int], k: int, repeats: int) -> float:
        """Median wall of one propose(k) of a host-side drafter (replay / ngram), per drafted token."""
        return self.propose_times(drafter, context, k, repeats)["median_s"]

    def propose_times(self, drafter, context: list[int], k: int, repeats: int) -> dict:
        """propose_time's median and the range of its repeats (lo_s, hi_s), per drafted token."""
        from ..specdec.sampling import SamplingParams  # noqa: PLC0415

        sp, gen, xs = SamplingParams(), torch.Generator(), []
        for _ in range(repeats):
            t0 = time.perf_counter()
            drafter.propose(context, k, sp, gen)
            xs.append((time.perf_counter() - t0) / max(k, 1))
        lo, hi = trimmed_range(xs)
        return {"median_s": median(xs), "lo_s": lo, "hi_s": hi, "n": len(xs)}


class Steps:
    """Step timing on one device: forward of `rows` rows at a fixed, primed context."""

    def __init__(self, device: torch.device):
        self.device = device

    def prime(self, runner: ModelRunner, ctx: int, capacity: int) -> None:
        """Allocate and fill `ctx` rows, so steps attend over a realistic context."""
        runner.alloc(capacity)
        ids = torch.tensor([(7 * i) % (runner.cfg.vocab_size - 3) + 3 for i in range(ctx)])
        runner.forward(ids, 0)
        sync(self.device)

    def step_time(self, runner: ModelRunner, rows: int, ctx: int, repeats: int) -> dict:
        """Median wall of ModelRunner.forward of `rows` rows at position `ctx` (rolled back
        after each call, so every repeat sees the same context)."""
        ids = torch.full((rows,), 5, dtype=torch.long)
        return time_call(lambda: runner.forward(ids, ctx), self.device, repeats, warmup=3,
                         between=lambda: runner.rollback(ctx))

    def rollback_time(self, runner: ModelRunner, ctx: int, k: int, keep: int, repeats: int) -> dict:
        """Median wall of rolling back a K+1-row verify at `ctx` to ctx + keep rows (verify untimed)."""
        ids = torch.full((k + 1,), 5, dtype=torch.long)
        xs = []
        for _ in range(repeats):
            runner.forward(ids, ctx)
            sync(self.device)
            t0 = time.perf_counter()
            runner.rollback(ctx + keep)
            sync(self.device)
            xs.append(time.perf_counter() - t0)
            if keep:
                runner.rollback(ctx)
        return {"median_s": median(xs), "min_s": min(xs), "n": len(xs)}
