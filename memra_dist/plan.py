"""A request's plan, made once before anything heavy starts: the model configs (target and
draft) read once, the context capacity, the pipeline split, the device of an in-process
run. Everything downstream (local runner, pipeline actors, drafters) takes these values;
nothing reloads a config or re-partitions. Bad input is refused here, before Ray starts
or a tensor is loaded."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from .config import RunConfig
from .errors import UserError
from .model.config import ModelConfig, load_config
from .pipeline.partition import partition

__all__ = ["RequestPlan", "plan_request", "plan_capacity", "check_vocab"]


@dataclass(frozen=True)
class RequestPlan:
    cfg: RunConfig
    model: ModelConfig  # the target's config, read once
    draft: ModelConfig | None  # the draft model's config ("model"; a DFlash- / Eagle3Config for "dflash" / "eagle3")
    capacity: int  # context rows the caches hold
    stages: tuple[tuple[int, int], ...]  # layer ranges [first, last) per pipeline stage (one at pp=1)
    capped: bool = False  # max_new_tokens was cut to fit the model's positions


def plan_capacity(cfg: RunConfig, mcfg: ModelConfig, prompt_len: int) -> tuple[int, bool]:
    """(rows, capped). Without --ctx the context is prompt + max_new + k + 1, cut to the
    model's max_position_embeddings (capped = True: the request ends at the cap)."""
    if prompt_len == 0:
        raise UserError("the prompt is empty")
    want = cfg.capacity(prompt_len)
    cap = want if cfg.ctx is not None else min(want, mcfg.max_position_embeddings)
    if cap > mcfg.max_position_embeddings:
        raise UserError(f"--ctx {cap} exceeds the model's max_position_embeddings ({mcfg.max_position_embeddings})")
    if prompt_len >= cap:
        raise UserError(f"the prompt ({prompt_len} tokens) is longer than the context ({cap} rows)")
    return cap, cfg.ctx is None and cap < want


def check_vocab(target: ModelConfig, draft: ModelConfig) -> None:
    if target.vocab_size != draft.vocab_size:
        raise UserError(f"draft and target vocabularies differ: draft has {draft.vocab_size} tokens, "
                        f"target has {target.vocab_size}")


def plan_request(cfg: RunConfig, prompt_len: int, mcfg: ModelConfig | None = None, warn=None,
                 draft: ModelConfig | None = None, check_cluster: bool = True) -> RequestPlan:
    """Read the configs once (or take them), check the request against them, split the layers."""
    mcfg = mcfg or load_config(cfg.model)
    if cfg.drafter == "model":
        draft = draft or load_config(cfg.draft_model)
        check_vocab(mcfg, draft)
    elif cfg.drafter == "dflash":
        from .model.dflash import check_dflash, load_dflash_config  # noqa: PLC0415

        draft = draft or load_dflash_config(cfg.draft_model)
        check_dflash(mcfg, draft, cfg.draft_model)
    elif cfg.drafter == "eagle3":
        from .model.eagle3 import check_eagle3, load_eagle3_config  # noqa: PLC0415

        draft = draft or load_eagle3_config(cfg.draft_model, mcfg)  # taps resolved for this target
        check_eagle3(mcfg, draft, cfg.draft_model)
    elif cfg.drafter == "mtp":
        from .model.mtp import check_mtp  # noqa: PLC0415

        check_mtp(mcfg, cfg.model)  # a target without MTP layers: refused here, one line
        draft = None
    else:
        draft = None
    capacity, capped = plan_capacity(cfg, mcfg, prompt_len)
    stages = tuple(partition(mcfg.num_layers, cfg.pp, cfg.stage_bounds))
    if check_cluster and cfg.pp > 1 and os.environ.get("RAY_ADDRESS"):
        from .pipeline.driver import check_ray_address  # noqa: PLC0415 (imports no Ray itself)

        check_ray_address(os.environ["RAY_ADDRESS"])  # a cluster that does not answer: refused now
    if capped:
        room = capacity - prompt_len
        (warn or _stderr)(f"memra-dist: warning: the model holds {mcfg.max_position_embeddings} positions: "
                          f"this request ends after about {room} new tokens, not {cfg.max_new_tokens}")
    return RequestPlan(cfg, mcfg, draft, capacity, stages, capped)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
