"""Run configuration: one frozen dataclass built from the CLI (or the Python API), validated
once. Environment flags (MEMRA_*) are read once in phase/levels.py; OTEL_* stay the SDK's."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace

from .compile_policy import compiles
from .errors import UserError
from .phase.levels import TraceSettings
from .specdec.chunks import DEFAULT_PREFILL_CHUNK
from .specdec.drafters import DRAFTERS
from .specdec.sampling import SamplingParams, sampling_rule

__all__ = ["RunConfig", "MAX_K"]

MAX_K = 32  # verify rows per round beyond this stop paying on any drafter we ship


@dataclass(frozen=True)
class RunConfig:
    model: str
    drafter: str = "ngram"
    draft_model: str | None = None
    k: int = 4
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    device: str = "auto"
    dtype: str | None = None
    ctx: int | None = None  # session context rows; default prompt + max_new + k + 1
    pp: int = 1
    stage_bounds: tuple[int, ...] | None = None
    burst_rounds: int = 8
    replay_corrupt: float = 0.2
    trace: TraceSettings = field(default_factory=TraceSettings)
    trace_content: bool = False
    graphs: str = "auto"  # CUDA graphs for decode/verify steps: auto (= on with CUDA) | on | off
    compile: str = "auto"  # torch.compile inside those graphs: auto (= where it pays, compile_policy.py) | on | off
    kernels: str = "auto"  # our Triton GEMV / cached-attention kernels in those graphs: auto (= with the graphs) | off
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt rows per prefill forward (specdec/chunks.py)
    spec_k: str = "auto"  # auto: a batched engine picks each request's K <= k by goodput; fixed: every round drafts k
    prefix_cache: bool = True  # a batched engine reuses the KV blocks of prompts it has seen (batching/prefix_cache.py)
    ngram_first: bool = False  # a network drafter's rounds drafted by prompt lookup where the suffix recurs (ngram_first.py)

    def __post_init__(self):
        if self.drafter == "mtp" and self.draft_model:
            raise UserError("--drafter mtp takes no --draft-model: the target's checkpoint holds its MTP layers")
        if self.draft_model and self.drafter not in ("model", "dflash", "eagle3"):
            object.__setattr__(self, "drafter", "model")  # --draft-model implies --drafter model
        if self.drafter not in DRAFTERS:
            raise UserError(f"unknown drafter '{self.drafter}' (choose from {', '.join(DRAFTERS)})")
        if self.drafter == "model" and not self.draft_model:
            raise UserError("--drafter model needs --draft-model DIR")
        if self.drafter == "dflash" and not self.draft_model:
            raise UserError("--drafter dflash needs --draft-model DIR (a DFlash checkpoint)")
        if self.drafter == "eagle3" and not self.draft_model:
            raise UserError("--drafter eagle3 needs --draft-model DIR (an EAGLE-3 checkpoint)")
        if self.k < 1:
            raise UserError(f"-k must be >= 1 (got {self.k})")
        if self.k > MAX_K:
            raise UserError(f"-k {self.k} is too large (at most {MAX_K} drafted tokens per round)")
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")
        if self.pp < 1:
            raise UserError(f"--pp must be >= 1 (got {self.pp})")
        if self.burst_rounds < 1:
            raise UserError(f"--burst-rounds must be >= 1 (got {self.burst_rounds})")
        if not 0.0 <= self.replay_corrupt <= 1.0:
            raise UserError(f"--replay-corrupt must be in [0, 1] (got {self.replay_corrupt})")
        if isinstance(self.compile, bool):  # the Python API's True / False
            object.__setattr__(self, "compile", "on" if self.compile else "off")
        if self.compile not in ("auto", "on", "off"):
            raise UserError(f"--compile must be auto, on or off (got {self.compile!r})")
        if isinstance(self.kernels, bool):
            object.__setattr__(self, "kernels", "auto" if self.kernels else "off")
        if self.kernels not in ("auto", "off"):
            raise UserError(f"--kernels must be auto or off (got {self.kernels!r})")
        if isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1:
            raise UserError(f"--prefill-chunk must be an integer >= 1 (got {self.prefill_chunk!r})")
        if self.spec_k not in ("fixed", "auto"):
            raise UserError(f"--spec-k must be fixed or auto (got {self.spec_k!r})")
        if not isinstance(self.prefix_cache, bool):
            raise UserError(f"prefix_cache must be True or False (got {self.prefix_cache!r})")
        if not isinstance(self.ngram_first, bool):
            raise UserError(f"ngram_first must be True or False (got {self.ngram_first!r})")
        if self.ngram_first and self.drafter not in ("dflash", "eagle3", "mtp"):
            raise UserError(f"--ngram-first needs a network drafter that catches up on the rounds it leaves to "
                            f"the lookup: --drafter dflash, eagle3 or mtp (got {self.drafter})")
        if isinstance(self.seed, numbers.Integral) and not isinstance(self.seed, bool):
            object.__setattr__(self, "seed", int(self.seed))  # a numpy integer from the Python API
        bad_seed = sampling_rule("seed", self.seed)  # the batch lines' and the server's rule too
        if bad_seed:
            raise UserError(f"--seed must be {bad_seed} (got {self.seed!r})")
        if self.ctx is not None and self.ctx < 2:
            raise UserError(f"--ctx must be >= 2 (got {self.ctx})")

    def use_graphs(self, device) -> bool:
        return self.graphs == "on" or (self.graphs == "auto" and device.type == "cuda")

    def runner_kwargs(self, device) -> dict:
        """The fast-path switches every ModelRunner of this run gets."""
        on = self.use_graphs(device)
        return {"graphs": on, "compile": on and compiles(self.compile, "target"),
                "compile_drafter": on and compiles(self.compile, "dflash"), "kernels": on and self.kernels != "off",
                "warm_rows": self.k + 1 if on else 0, "warm_timed": on and self.trace.level >= 2}

    def capacity(self, prompt_len: int) -> int:
        return self.ctx if self.ctx is not None else prompt_len + self.max_new_tokens + self.k + 1

    def with_(self, **kw) -> "RunConfig":
        return replace(self, **kw)
