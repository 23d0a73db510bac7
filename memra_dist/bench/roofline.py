"""Pure arithmetic of the benchmark: the roofline, the expected tokens per speculative round,
the ideal speculative speedup and the per-token acceptance recovered from a measured run.

Formulas (stated once; the report prints SPEC_FORMULA):
    roofline tok/s      = copy bandwidth (bytes/s) / weight bytes   (batch-1 decode reads every weight once)
    E(a, K)             = (1 - a^(K+1)) / (1 - a)     expected tokens per round (K drafts, per-token acceptance a;
                                                      = K + 1 at a = 1)
    ideal speedup       = E * t_decode / (K * t_draft_step + t_verify(K+1))
    achieved fraction   = (spec tok/s / plain tok/s) / ideal speedup
"""

from __future__ import annotations

__all__ = ["SPEC_FORMULA", "roofline_tok_s", "expected_tokens", "ideal_speedup", "per_token_acceptance",
           "achieved_fraction", "median"]

SPEC_FORMULA = ("ideal = E * t_decode / (K * t_draft_step + t_verify(K+1)), E = (1 - a^(K+1)) / (1 - a); "
                "a = per-token acceptance recovered from the measured accepted drafts per round; "
                "achieved fraction = (spec tok/s / plain tok/s) / ideal")


def roofline_tok_s(bandwidth_bytes_s: float, weight_bytes: int) -> float:
    """Batch-1 decode upper bound: every weight byte crosses the memory bus once per token.

    >>> round(roofline_tok_s(4.25e12, 16.06e9), 1)
    264.6
    """
    if weight_bytes <= 0:
        raise ValueError("weight_bytes must be > 0")
    return bandwidth_bytes_s / weight_bytes


def expected_tokens(a: float, k: int) -> float:
    """E = sum_{i=0..K} a^i = (1 - a^(K+1)) / (1 - a): tokens a round commits (the bonus included).

    >>> expected_tokens(0.5, 2)
    1.75
    """
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance {a} outside [0, 1]")
    if k < 0:
        raise ValueError("k must be >= 0")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def ideal_speedup(a: float, k: int, t_decode: float, t_draft_step: float, t_verify: float) -> float:
    """E * t_decode / (K * t_draft_step + t_verify): spec tok/s over plain tok/s with no overhead
    beyond drafting and verifying (times in any one unit)."""
    cost = k * t_draft_step + t_verify
    if cost <= 0 or t_decode <= 0:
        raise ValueError("costs must be > 0")
    return expected_tokens(a, k) * t_decode / cost


def per_token_acceptance(accepted_per_round: float, k: int, tol: float = 1e-9) -> float:
    """The a with sum_{i=1..K} a^i = accepted_per_round (greedy acceptance stops at the first
    rejection, so accepted/drafted under-reads a). Bisection; clamps to [0, 1].

    >>> round(per_token_acceptance(0.75, 2), 6)   # 0.5 + 0.25
    0.5
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    if accepted_per_round <= 0:
        return 0.0
    if accepted_per_round >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) - 1.0 < accepted_per_round:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def achieved_fraction(spec_tok_s: float, plain_tok_s: float, ideal: float) -> float:
    if plain_tok_s <= 0 or ideal <= 0:
        raise ValueError("plain tok/s and ideal must be > 0")
    return (spec_tok_s / plain_tok_s) / ideal


def median(xs) -> float:
    s = sorted(xs)
    if not s:
        raise ValueError("median of nothing")
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
