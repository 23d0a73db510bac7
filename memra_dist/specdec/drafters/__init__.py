"""Drafters, one per file, behind `base.Drafter`: none, ngram, model, dflash, mtp, eagle3, replay (benchmarking).
`build_drafter` is the registry: the one place a drafter is chosen by name."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ...progress import LoadProgress
from ...runner import ModelRunner
from .base import Drafter, Proposal
from .draft_model import ModelDrafter
from .ngram import NgramDrafter
from .none import NoDrafter
from .replay import ReplayDrafter

DRAFTERS = ("none", "ngram", "model", "dflash", "mtp", "eagle3", "replay")

__all__ = ["DRAFTERS", "Drafter", "Proposal", "ModelDrafter", "NgramDrafter", "NoDrafter", "ReplayDrafter",
           "build_drafter", "tap_layers", "TAP_DRAFTERS"]


# drafters that read the target's hidden states: the taps they keep, and whether they embed
# tokens with the target's table (a pipeline head then holds the embedding too)
TAP_DRAFTERS = ("dflash", "mtp", "eagle3")


def tap_layers(cfg, plan) -> tuple[int, ...]:
    """The target layers whose outputs the drafter reads (model/taps.py), () for the others."""
    if cfg.drafter in ("dflash", "eagle3"):
        return tuple(plan.draft.tap_ids)
    if cfg.drafter == "mtp":
        from ...model.taps import FINAL  # noqa: PLC0415

        return (FINAL,)
    return ()


def build_drafter(cfg, plan, device, dtype, prompt_len: int,
                  record: Callable[[], list[int]] | None = None, target=None) -> Drafter:
    """The drafter `cfg.drafter` names. `plan` (memra_dist.plan.RequestPlan) holds the configs
    read once; `record` produces the target's greedy continuation (replay only); `target` is
    the runner whose taps a tap drafter reads (dflash, mtp, eagle3): pp=1 the model's, pp>1 the head's."""
    if getattr(cfg, "ngram_first", False):  # the network's rounds, and the lookup's where the suffix recurs
        from .ngram_first import NgramFirst  # noqa: PLC0415

        return NgramFirst(build_drafter(cfg.with_(ngram_first=False), plan, device, dtype, prompt_len, record, target))
    if cfg.drafter == "none":
        return NoDrafter()
    if cfg.drafter == "ngram":
        return NgramDrafter()
    if cfg.drafter == "model":
        return ModelDrafter(ModelRunner(cfg.draft_model, device, dtype, cfg=plan.draft, max_pos=plan.capacity,
                                        progress=LoadProgress(Path(cfg.draft_model).name),
                                        **{**cfg.runner_kwargs(device), "warm_timed": False}), k=cfg.k)
    if cfg.drafter == "dflash":
        if target is None or not hasattr(target, "keep_taps"):
            raise ValueError("the dflash drafter needs a target runner (pp=1: the model; pp>1: the head's)")
        from .dflash import DFlashDrafter  # noqa: PLC0415

        return DFlashDrafter.load(cfg.draft_model, plan.draft, target)
    if cfg.drafter == "mtp":  # the target's own MTP layers (its checkpoint holds them)
        if target is None or not hasattr(target, "keep_taps"):
            raise ValueError("the mtp drafter needs a target runner (pp=1: the model; pp>1: the head's)")
        from .mtp import MTPDrafter  # noqa: PLC0415

        return MTPDrafter.load(cfg.model, plan.model, target)
    if cfg.drafter == "eagle3":
        if target is None or not hasattr(target, "keep_taps"):
            raise ValueError("the eagle3 drafter needs a target runner (pp=1: the model; pp>1: the head's)")
        from .eagle3 import Eagle3Drafter  # noqa: PLC0415

        return Eagle3Drafter.load(cfg.draft_model, plan.draft, target)
    if cfg.drafter == "replay":
        if record is None:
            raise ValueError("the replay drafter needs the target's recorded continuation")
        return ReplayDrafter(record(), prompt_len, plan.model.vocab_size, cfg.replay_corrupt, seed=(cfg.seed + 1) % 2**64)
    raise ValueError(f"unknown drafter {cfg.drafter!r}")
