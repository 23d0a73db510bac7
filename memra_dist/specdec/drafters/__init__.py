"""Drafters, one per file, behind `base.Drafter`: none, ngram, model, replay (benchmarking)."""

from .base import Drafter, Proposal
from .draft_model import ModelDrafter
from .ngram import NgramDrafter
from .none import NoDrafter
from .replay import ReplayDrafter

DRAFTERS = ("none", "ngram", "model", "replay")

__all__ = ["DRAFTERS", "Drafter", "Proposal", "ModelDrafter", "NgramDrafter", "NoDrafter", "ReplayDrafter"]
