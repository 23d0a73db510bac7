"""Sampling parameters and logits -> probabilities (temperature, top-k, top-p). Pure.

The rules for every sampling value live here, once; the CLI (SamplingParams, RunConfig's
seed), the batch job's lines and the server's request bodies all ask `sampling_rule`:

  temperature  a finite number >= 0. 0 is greedy, and so is any temperature below
               GREEDY_BELOW (1e-5): it is stored as 0. Dividing fp32 logits by a smaller one
               overflows to inf (1e-38 does for any logit above 3.4), and at 1e-5 a logit gap
               of 1e-3 already weighs e^-100, so greedy is the limit the sampler was heading to.
  top_p        a number in (0, 1] (1 = off). The most likely token always stays, so a top_p
               below its probability is greedy, down to 5e-324 (in fp32 a top_p under 1e-45
               is 0, which no token's preceding mass is below: the filter would keep none).
  top_k        an integer >= 0 (0 = off)
  seed         an integer in [0, 2^64) (what the sampling generator takes)

NaN and +-inf are refused wherever a number is asked for. `NonFiniteLogits` is what a
session raises when the target's logits hold NaN / inf (a broken checkpoint or an overflow):
one line, never a token drawn from them."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    import torch

__all__ = ["SamplingParams", "probs", "probs_rows", "row_filters", "draw_rows", "uniforms", "draw_drafts", "non_finite_drafts", "sampling_rule", "SAMPLING_FIELDS", "RULES", "GREEDY_BELOW", "MAX_SEED",
           "NonFiniteLogits"]

GREEDY_BELOW = 1e-5  # temperatures in (0, GREEDY_BELOW) act as (and are stored as) 0 = greedy
MAX_SEED = 2 ** 64


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return _int(v) or (isinstance(v, float) and math.isfinite(v))


# name -> (check, what a value must be)
RULES = {
    "temperature": (lambda v: _num(v) and v >= 0,
                    f"a finite number >= 0 (0 = greedy; below {GREEDY_BELOW:g} acts as 0)"),
    "top_p": (lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "top_k": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "seed": (lambda v: _int(v) and 0 <= v < MAX_SEED, "an integer in [0, 2^64)"),
}
SAMPLING_FIELDS = tuple(RULES)


def sampling_rule(name: str, v) -> str | None:
    """None when `v` is a good value of the sampling field `name` (temperature, top_p, top_k,
    seed), else what it must be ("a number in (0, 1] (1 = off)"): each front end words the
    error its own way (--top-p, 'top_p') around the same rule."""
    ok, want = RULES[name]
    return None if ok(v) else want


class NonFiniteLogits(UserError):
    """The target's logits hold NaN or inf: the checkpoint (or an overflow in its dtype) is
    broken. The message names the first layer whose output is not finite when it can be found."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (and any value below GREEDY_BELOW)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        for flag, name, cast in (("--temperature", "temperature", float), ("--top-p", "top_p", float),
                                 ("--top-k", "top_k", int)):
            v = getattr(self, name)
            # numpy scalars from the Python API become Python numbers (a float top_k stays, to be refused)
            wanted = numbers.Integral if cast is int else numbers.Real
            if isinstance(v, wanted) and not isinstance(v, bool):
                v = cast(v)
                object.__setattr__(self, name, v)
            want = sampling_rule(name, v)
            if want:
                raise UserError(f"{flag} must be {want} (got {v})")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)  # below the fp32 logits' resolution: greedy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """(T, V) fp32 logits -> (T, V) probabilities of the filtered, tempered distribution: one
    request's rows through `probs_rows`, so a batch's rows (each its own parameters) and a
    request alone give the same distribution. No filter on: no sort (the masks would be empty)."""
    import torch  # noqa: PLC0415 (the rules above are read by torch-free front ends: the server's parsing)

    T, dev = logits.shape[0], logits.device
    full = lambda v, dt: torch.full((T,), v, dtype=dt, device=dev)  # noqa: E731
    return probs_rows(logits, full(sp.temperature, torch.float32), full(sp.top_k, torch.long),
                      full(sp.top_p, torch.float32), filters=row_filters([sp]))


def row_filters(sps) -> bool | int:
    """`probs_rows`' `filters` for rows of these sampling parameters: True where a row has a
    top-p, else the largest top-k (top-k alone: no sort), else False (no filter)."""
    if any(sp.top_p < 1.0 for sp in sps):
        return True
    return max((sp.top_k for sp in sps), default=0) or False


def probs_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               filters: bool | int = True) -> torch.Tensor:
    """(T, V) logits and each row's sampling parameters ((T,) tensors on the logits' device:
    temperature > 0, top_k (0 = off), top_p (1 = off)) -> (T, V) probabilities, on the device
    with no host sync (a CUDA graph captures it). Row by row what `probs` gives: top-k keeps
    the values >= the k-th largest, then top-p keeps the most likely tokens up to the one whose
    preceding mass crosses p (the most likely always; among equal logits the first id leads, as
    argmax picks). `filters` False: no row filters (no sort); an int: top-k alone, no row's
    above it (each row's k-th largest from one `topk`, no sort); True: any filter."""
    import torch  # noqa: PLC0415

    x = logits.float() / temperature.to(torch.float32)[:, None]
    top_p = top_p.to(torch.float32)
    if not filters:
        return torch.softmax(x, dim=-1)
    V = x.shape[-1]
    if filters is not True:  # top-k alone: each row's k-th largest value (the smallest at k = V: no mask)
        top = torch.topk(x, min(int(filters), V), dim=-1).values
        k = torch.where((top_k > 0) & (top_k < V), top_k, 0)
        kth = torch.where(k[:, None] > 0, top.gather(-1, (k - 1).clamp(min=0)[:, None]), float("-inf"))
        return torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)
    sorted_x, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    kth = sorted_x.gather(-1, (k - 1)[:, None])  # (T, 1): the k-th largest (the smallest at k = V)
    x = x.masked_fill(x < kth, float("-inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))  # = x sorted (the masked tail stays -inf)
    sm = torch.softmax(sorted_x, dim=-1)
    drop = (sm.cumsum(-1) - sm) >= top_p[:, None]  # keep the token that crosses p
    drop[..., 0] = False  # and the most likely one always (a top_p that is 0 in fp32 would drop every token)
    drop &= (top_p < 1.0)[:, None]  # top_p 1 is off (fp32 sums can reach 1 before the tail)
    x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return torch.softmax(x, dim=-1)


def draw_rows(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token a row of the probabilities q (T, V) for the uniforms u (T,) in [0, 1): the
    inverse of each row's CDF (in fp64) at u times its total, on q's device with no host sync.
    A zero-probability token is never drawn (its CDF step is empty)."""
    import torch  # noqa: PLC0415

    cdf = q.double().cumsum(-1)
    at = (u.to(cdf.device, torch.float64) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, at, right=True)[:, 0].clamp_(max=q.shape[-1] - 1)


def uniforms(gen, n: int):
    """A request's next n draft uniforms (fp64) from its generator: `draw_drafts` takes one a
    row, so n drawn at once equal n drawn one at a time (the CPU generator's stream)."""
    import torch  # noqa: PLC0415

    return torch.rand(n, generator=gen, dtype=torch.float64)


def draw_drafts(q, gen, drafter: str):
    """One draft per row of the drafter's probabilities q (T, V), drawn with the request's
    generator (one uniform a row, `draw_rows`) -> (T,) int64 on the host. Non-finite rows (NaN /
    inf in the drafter's logits: a broken draft checkpoint) are refused in one line instead of
    sampled into a traceback."""
    import torch  # noqa: PLC0415

    q = q.cpu()
    if not bool(torch.isfinite(q.sum(-1)).all()):
        raise non_finite_drafts(drafter)
    return draw_rows(q, uniforms(gen, q.shape[0]))


def non_finite_drafts(drafter: str) -> UserError:
    return UserError(f"non-finite logits (NaN/inf) from the {drafter} drafter: its sampling distribution "
                     "is undefined (a broken draft checkpoint?)")
