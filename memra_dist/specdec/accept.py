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

import math

import torch

__all__ = ["accept_greedy", "greedy_commit", "commit_rows", "accept_sampled", "NonFiniteRow", "RECOVERED", "BONUS"]

RECOVERED, BONUS = "recovered", "bonus"


def greedy_commit(target_logits: torch.Tensor, drafts: torch.Tensor,
                  rows: tuple[list, list] | None = None) -> list[int]:
    """target_logits (K+1, V), drafts (K,) -> the round's committed tokens: the j accepted
    drafts, then the argmax of row j (j + 1 ids; accepted drafts equal the target's argmax, so
    they are row 0 .. j's argmax). Drafts on the logits' device (a graphed drafter's device
    output) come back with the argmax in ONE readback, the round's only one.

    Non-finite logits: argmax picks a NaN (or +inf) wherever a row holds one, so the logit AT
    each argmax is finite exactly when the row has neither (nor is all -inf). Those K+1 logits
    are gathered on the device (one tiny kernel, no pass over the vocabulary) and ride in the
    same readback (the row is then float: token ids are exact below 2^24, float64 past that);
    a row the round uses (0 .. j) whose logit is not finite raises NonFiniteRow.

    `rows`: each row's argmax and the logit at it, already read back by whoever ran the verify
    (a batched step reads every request's rows in one readback): no device op here at all."""
    k = int(drafts.shape[0])
    if rows is not None:
        return commit_rows(rows[0], drafts.tolist() if k else [], rows[1])
    pred = target_logits.argmax(-1)  # (K+1,)
    val = target_logits.gather(-1, pred.unsqueeze(-1)).view(-1)  # (K+1,): the logit at each argmax
    if target_logits.shape[-1] >= 1 << 24 or val.dtype not in (torch.float32, torch.float64):
        val = val.double()  # ids past float32's integers (or half-precision logits): read exactly
    if k and drafts.device == pred.device:
        row = torch.cat((pred, drafts, val)).tolist()
        p, d, f = row[:k + 1], row[k + 1:2 * k + 1], row[2 * k + 1:]
    else:
        row = torch.cat((pred, val)).tolist()
        p, f = row[:k + 1], row[k + 1:]
        d = drafts.tolist()
    return _commit(p, d, f, k)


def commit_rows(pred: list, drafts: list, vals: list) -> list[int]:
    """`greedy_commit` on host lists: each verify row's argmax and the logit at it (read back
    by a batched step), and the round's drafts -> its committed tokens.

    >>> commit_rows([5.0, 7.0, 2.0], [5, 8], [1.0, 2.0, 3.0])
    [5, 7]
    """
    return _commit(pred, drafts, vals, len(drafts))


def _commit(p: list, d: list, f: list, k: int) -> list[int]:
    j = 0
    while j < k and p[j] == d[j]:  # the longest prefix the target agrees with
        j += 1
    _check_rows(f, j)
    return [int(t) for t in p[:j + 1]]


class NonFiniteRow(Exception):
    """Row `row` of a verify's logits is not finite (NaN / inf): the session names the layer."""

    def __init__(self, row: int):
        super().__init__(f"non-finite logits in verify row {row}")
        self.row = row


def _check_rows(values: list, j: int) -> None:
    """Rows 0 .. j: each one's value (the logit at its argmax, its probabilities' sum) must be finite."""
    for i in range(j + 1):
        if not math.isfinite(values[i]):
            raise NonFiniteRow(i)


def accept_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """target_logits (K+1, V), drafts (K,) -> (j, next token). next = argmax of row j."""
    toks = greedy_commit(target_logits, drafts)
    return len(toks) - 1, toks[-1]


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
        # u < p/q without dividing by a zero q (a NaN p rejects); strict, so a draft the target
        # gives no mass (top-p / top-k filtered it out) is never accepted, u = 0 included
        ok = (u * q_d < p_d).int()
        j = int(ok.cumprod(0).sum())
    else:
        j = 0
    # the rows the round draws from, on the host already: a NaN / inf logit makes its row's
    # softmax NaN, and a row's sum (<= 1, never overflowing) is NaN exactly then
    _check_rows(p[:j + 1].sum(-1).tolist(), j)
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
