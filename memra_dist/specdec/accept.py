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

__all__ = ["accept_greedy", "greedy_commit", "commit_rows", "accept_sampled", "accept_sampled_many", "NonFiniteRow", "RECOVERED", "BONUS"]

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
    Returns (j, next token, RECOVERED | BONUS). Takes K + 1 uniforms from `gen` (K for the
    acceptance tests, one for the token drawn after them): `accept_sampled_many` for one round."""
    from .sampling import uniforms  # noqa: PLC0415

    j, nxt, kind, bad = accept_sampled_many([p], [q], [drafts], [uniforms(gen, int(drafts.shape[0]) + 1)])[0]
    if bad >= 0:
        raise NonFiniteRow(bad)
    return j, nxt, kind


def accept_sampled_many(ps: list, qs: list, drafts: list, us: list) -> list[tuple[int, int, str, int]]:
    """Several rounds' rejection sampling at once, on their device, with ONE readback: round r's
    target probs ps[r] (k_r + 1, V), draft probs qs[r] (k_r, V) or None (one-hot drafts), drafts
    (k_r,) and k_r + 1 uniforms us[r] (fp64, its generator's: `sampling.uniforms`). Draft i is
    accepted where u_i q_i(d_i) < p_i(d_i) (strict: a draft the target gives no mass is never
    accepted, u = 0 included; a NaN p rejects); the token after the j accepted ones is drawn at
    u_k from p_k (all accepted: BONUS) or from max(p_j - q_j, 0) (p_j without d_j for one-hot
    drafts; p_j itself where nothing is left: RECOVERED), by the inverse CDF (`draw_rows`). ->
    each round's (j, next token, kind, the first of its rows 0 .. j whose probabilities are not
    finite or -1: the caller raises NonFiniteRow, no token drawn from them counts)."""
    from ..device import to_device  # noqa: PLC0415
    from .sampling import draw_rows  # noqa: PLC0415

    n, dev = len(ps), ps[0].device
    ks = [int(d.shape[0]) for d in drafts]
    K = max(ks)
    P = torch.cat([x[:k + 1].float() for x, k in zip(ps, ks)])  # (sum k + 1, V)
    if K == 0:  # no drafts (plain sampled decoding): each round's token drawn from its one row
        u = to_device(torch.stack([x[0].to(torch.float64) for x in us]), dev)
        out = torch.stack([draw_rows(P, u), torch.where(torch.isfinite(P.sum(-1)), -1, 0)]).tolist()
        return [(0, t, BONUS, bad) for t, bad in zip(*out)]
    pb = [0]
    for k in ks:
        pb.append(pb[-1] + k + 1)
    # host indices and uniforms in one pinned copy each (no copy that waits for the device's queue):
    # each draft's row of P, its round and column, its row of Q; each round's first row of P and Q,
    # whether it has a Q, its k; each round's rows (for the finite check)
    rix = [r for r, k in enumerate(ks) for _ in range(k)]
    col = [i for k in ks for i in range(k)]
    hq = [x is not None for x in qs]
    qb, acc = [], 0
    for x, k in zip(qs, ks):
        qb.append(acc)
        acc += k if x is not None else 0
    qrows = [qb[r] + i if hq[r] else 0 for r, i in zip(rix, col)]  # (rows without a Q: 0, not read)
    ur = [r for r, k in enumerate(ks) for _ in range(k + 1)]
    uc = [i for k in ks for i in range(k + 1)]
    m, mq, mu = len(rix), len(qrows), len(ur)
    ix = to_device([pb[r] + i for r, i in zip(rix, col)] + rix + col + qrows + pb[:n] + qb + hq + ks + ur + uc, dev)
    prow, dr, dc, qrow = ix[:m], ix[m:2 * m], ix[2 * m:3 * m], ix[3 * m:3 * m + mq]
    o = 3 * m + mq
    base, qbase, has_q, kk = ix[o:o + n], ix[o + n:o + 2 * n], ix[o + 2 * n:o + 3 * n].bool(), ix[o + 3 * n:o + 4 * n]
    urow, ucol = ix[o + 4 * n:o + 4 * n + mu], ix[o + 4 * n + mu:]
    Uh = torch.zeros(n, K + 1, dtype=torch.float64)
    for r, (u, k) in enumerate(zip(us, ks)):
        Uh[r, :k + 1] = u.to(torch.float64)
    U = to_device(Uh, dev)
    j = torch.zeros(n, dtype=torch.long, device=dev)
    D = torch.zeros(n, max(K, 1), dtype=torch.long, device=dev)
    Q = torch.cat([x[:k].float() for x, k in zip(qs, ks) if x is not None]) if any(hq) else None
    Q = Q if Q is not None and Q.shape[0] else None  # (draft distributions of rounds with no drafts)
    if m:
        d = torch.cat([x.long() if x.device == dev else to_device(x.long().cpu(), dev) for x in drafts])
        D[dr, dc] = d
        p_d = P[prow, d]
        q_d = torch.where(has_q[dr], Q[qrow, d], 1.0) if Q is not None else torch.ones(m, device=dev)
        ok = torch.zeros(n, K, dtype=torch.int32, device=dev)
        ok[dr, dc] = (U[dr, dc] * q_d < p_d).int()
        j = ok.cumprod(1).sum(1)
    last = base + j  # each round's row j
    pj = P[last]  # (n, V)
    bonus = j == kk
    dj = D.gather(1, j.clamp(max=D.shape[1] - 1)[:, None])  # d_j where j < k
    resid = pj.scatter(1, dj, 0.0)  # one-hot drafts: p_j without d_j
    if Q is not None:
        qj = Q[(qbase + j.clamp(max=(kk - 1).clamp(min=0))).clamp(max=Q.shape[0] - 1)]
        resid = torch.where(has_q[:, None], (pj - qj).clamp_min(0), resid)
    dist = torch.where(bonus[:, None] | (resid.sum(-1) <= 0)[:, None], pj, resid)
    nxt = draw_rows(dist, U.gather(1, kk[:, None])[:, 0])
    # the rows each round uses (0 .. j) must be finite: the first that is not, per round
    fin = torch.ones(n, K + 1, dtype=torch.bool, device=dev)
    fin[urow, ucol] = torch.isfinite(P.sum(-1))
    badm = ~fin & (torch.arange(K + 1, device=dev)[None, :] <= j[:, None])
    first = torch.where(badm.any(1), badm.int().argmax(1), -1)
    out = torch.stack([j, nxt, first]).tolist()
    return [(a, b, BONUS if a == k else RECOVERED, c) for a, b, c, k in zip(*out, ks)]
