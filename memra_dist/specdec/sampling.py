"""Sampling parameters and logits -> probabilities (temperature, top-k, top-p). Pure."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError

__all__ = ["SamplingParams", "probs"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (got {self.top_k})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """(T, V) fp32 logits -> (T, V) probabilities of the filtered, tempered distribution."""
    x = logits.float() / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]  # (T, 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = (cum - torch.softmax(sorted_x, dim=-1)) >= sp.top_p  # keep the token that crosses p
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return torch.softmax(x, dim=-1)
