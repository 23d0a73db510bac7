"""A prompt far longer than the context, refused after about the context's worth of
tokenizing: counted piece by piece, never tokenized whole. The one rule of `serve` (serve/host.py
`EngineHost._tokens`, before a body's prompt is tokenized) and of the batch job's lines.

Light (no torch, no tokenizer import): `encode` is any text -> ids callable."""

from __future__ import annotations

from typing import Callable

__all__ = ["PIECE_CHARS", "PIECE_SLACK", "at_least_tokens"]

PIECE_CHARS = 32768  # a prompt longer than the context is first counted in pieces of this many characters
PIECE_SLACK = 16  # tokens a cut between two pieces may add (special tokens, merges lost at the cut)


def at_least_tokens(encode: Callable[[str], list], text: str, limit: int) -> int | None:
    """None when `text` may fit `limit` tokens (short enough to tokenize whole: at most
    max(2 x PIECE_CHARS, limit) characters, or counted piece by piece without reaching it);
    else a token count it surely reaches (>= limit), found as soon as the pieces so far,
    less PIECE_SLACK for each cut, reach `limit`: a text far over it costs about `limit`
    tokens' worth of tokenizing and one piece of memory at a time, whatever its length.

    >>> at_least_tokens(list, "ab" * 40000, 1000)  # one id a character
    32752
    >>> at_least_tokens(list, "short", 1000) is None
    True
    """
    if len(text) <= max(2 * PIECE_CHARS, limit):
        return None
    n = 0
    for i, start in enumerate(range(0, len(text), PIECE_CHARS), 1):
        n += len(encode(text[start:start + PIECE_CHARS]))
        if n - i * PIECE_SLACK >= limit:
            return n - i * PIECE_SLACK
    return None
