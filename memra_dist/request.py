"""One request on the in-process engine (pp=1): load, build the drafter, run the session.
The Ray pipeline (pipeline/) runs the same session inside its head actor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .config import RunConfig
from .device import resolve_device, resolve_dtype
from .runner import ModelRunner
from .errors import UserError
from .model.config import ModelConfig, load_config
from .phase.levels import TraceSettings
from .specdec.drafters import ModelDrafter, NgramDrafter, NoDrafter, ReplayDrafter
from .specdec.drafters.base import Drafter
from .specdec.sampling import SamplingParams
from .specdec.session import SessionSink, SpecSession

__all__ = ["Result", "plan_capacity", "check_vocab", "make_drafter", "run_session", "run_local"]


@dataclass
class Result:
    token_ids: list[int]
    stats: dict


def plan_capacity(cfg: RunConfig, mcfg: ModelConfig, prompt_len: int) -> int:
    if prompt_len == 0:
        raise UserError("the prompt is empty")
    cap = cfg.capacity(prompt_len)
    if cfg.ctx is None:
        cap = min(cap, mcfg.max_position_embeddings)
    if cap > mcfg.max_position_embeddings:
        raise UserError(f"--ctx {cap} exceeds the model's max_position_embeddings ({mcfg.max_position_embeddings})")
    if prompt_len >= cap:
        raise UserError(f"the prompt ({prompt_len} tokens) is longer than the context ({cap} rows)")
    return cap


def check_vocab(target: ModelConfig, draft: ModelConfig) -> None:
    if target.vocab_size != draft.vocab_size:
        raise UserError(f"draft and target vocabularies differ: draft has {draft.vocab_size} tokens, "
                        f"target has {target.vocab_size}")


def make_drafter(cfg: RunConfig, mcfg: ModelConfig, device, dtype, capacity: int, prompt_len: int,
                 record: Callable[[], list[int]] | None = None) -> Drafter:
    """`record` produces the target's greedy continuation (replay only)."""
    if cfg.drafter == "none":
        return NoDrafter()
    if cfg.drafter == "ngram":
        return NgramDrafter()
    if cfg.drafter == "model":
        dcfg = load_config(cfg.draft_model)
        check_vocab(mcfg, dcfg)
        return ModelDrafter(ModelRunner(cfg.draft_model, device, dtype, cfg=dcfg, max_pos=capacity,
                                        **cfg.runner_kwargs(device)))
    return ReplayDrafter(record(), prompt_len, mcfg.vocab_size, cfg.replay_corrupt, seed=cfg.seed + 1)


def run_session(target, drafter: Drafter, cfg: RunConfig, mcfg: ModelConfig, prompt: list[int],
                capacity: int, hook=None, sink: SessionSink | None = None,
                trace: TraceSettings | None = None) -> Result:
    gen = torch.Generator().manual_seed(cfg.seed)
    s = SpecSession(target, drafter, cfg.sampling, gen, cfg.k, trace or cfg.trace, sink, mcfg.eos_token_ids)
    first = s.start(prompt, cfg.max_new_tokens, capacity)
    if hook is not None:
        hook([first])
    out = [first]
    while not s.done:
        out.extend(s.burst(cfg.burst_rounds, hook))
    return Result(out, s.stats.as_dict())


def run_local(cfg: RunConfig, prompt: list[int], hook=None, sink: SessionSink | None = None) -> Result:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    mcfg = load_config(cfg.model)
    capacity = plan_capacity(cfg, mcfg, len(prompt))
    target = ModelRunner(cfg.model, device, dtype, cfg=mcfg, max_pos=capacity, **cfg.runner_kwargs(device))

    def record() -> list[int]:  # the replay drafter's recording: a plain greedy pass, untraced
        plain = cfg.with_(drafter="none", sampling=SamplingParams(), trace=TraceSettings())
        return run_session(target, NoDrafter(), plain, mcfg, prompt, capacity).token_ids

    drafter = make_drafter(cfg, mcfg, device, dtype, capacity, len(prompt), record)
    return run_session(target, drafter, cfg, mcfg, prompt, capacity, hook, sink)
