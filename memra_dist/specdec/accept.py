"""Acceptance: greedy and rejection sampling. Pure functions; randomness is passed in.

Vocabulary (defined once, as in vLLM's spec_decode): of K drafted tokens the first j are
ACCEPTED; if j < K the round ends with a RECOVERED token drawn at the first rejection; if
j == K it ends with a BONUS token drawn from the last verify row. A round thus commits
j + 1 tokens.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023). With target probabilities
p_i and draft probabilities q_i at draft position i, accept d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from norm(max(p_i - q_i, 0)); if
all K are accepted draw the bonus from p_K. The committed tokens are then distributed
exactly as samples from p. A deterministic drafter (n-gram, replay) has q_i = one-hot(d_i):
accept with probability p_i(d_i), recover from p_i with d_i removed.
"""

from __future__ import annotations

import torch

__all__ = ["accept_greedy", "accept_sampled", "RECOVERED", "BONUS"]

RECOVERED, BONUS = "recovered", "bonus"


def accept_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """target_logits (K+1, V), drafts (K,) -> (j, next token). next = argmax of row j."""
    pred = target_logits.argmax(-1).tolist()  # (K+1,): the round's one device readback
    j = 0
    for d in drafts.tolist():  # the longest prefix the target agrees with
        if pred[j] != d:
            break
        j += 1
    return j, pred[j]


def accept_sampled(
    p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, gen: torch.Generator
) -> tuple[int, int, str]:
    """p (K+1, V) target probs; q (K, V) draft probs or None (one-hot drafts); drafts (K,).
    Returns (j, next token, RECOVERED | BONUS). Draws K uniforms then one categorical."""
    k = drafts.shape[0]
    p = p.cpu()
    drafts = drafts.cpu()
    if k:
        u = torch.rand(k, generator=gen)
        rows = torch.arange(k)
        p_d = p[rows, drafts]  # (K,)
        q_d = q.cpu()[rows, drafts] if q is not None else torch.ones(k)
        ok = (u * q_d <= p_d).int()  # u <= p/q without dividing by a zero q
        j = int(ok.cumprod(0).sum())
    else:
        j = 0
    if j == k:
        return j, int(torch.multinomial(p[k], 1, generator=gen)), BONUS
    if q is not None:
        resid = (p[j] - q.cpu()[j]).clamp_min(0)
    else:
        resid = p[j].clone()
        resid[drafts[j]] = 0
    total = resid.sum()
    # p == q on the support leaves nothing to recover from; then p itself is exact
    dist = resid / total if total > 0 else p[j]
    return j, int(torch.multinomial(dist, 1, generator=gen)), RECOVERED
