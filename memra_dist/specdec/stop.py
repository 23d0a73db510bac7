"""Where a request stops: the commit rule every round applies, the session's own (session.py)
and the batched step leader's for its chained requests (batching/chain.py), so both end a
request at the same token."""

from __future__ import annotations

__all__ = ["commit_tokens"]


def commit_tokens(new: list[int], produced: int, max_new: int, length: int, capacity: int,
                  eos) -> tuple[list[int], list[int], bool]:
    """A round's accepted tokens `new`, after `produced` of `max_new` tokens and a context of
    `length` of `capacity` rows -> (kept: appended to the context, cut to the room left;
    streamed: kept up to its first EOS; whether the request ends).

    >>> commit_tokens([5, 2, 7], 0, 8, 10, 64, {2})
    ([5, 2, 7], [5, 2], True)
    >>> commit_tokens([5, 6, 7], 6, 8, 10, 64, ())
    ([5, 6], [5, 6], True)
    >>> commit_tokens([5], 0, 8, 62, 64, ())
    ([5], [5], False)
    """
    kept = new[:max_new - produced]
    for i, t in enumerate(kept):
        if t in eos:
            return kept, kept[:i + 1], True
    return kept, kept, produced + len(kept) >= max_new or length + len(kept) >= capacity
