"""Content hashes of a prompt's full KV blocks, for automatic prefix caching (pure: no tensors).

A block's KV rows depend on every token up to its last one, not only on its own tokens, so a
block is named by a chained hash: block i's hash covers the salt, block i-1's hash and block i's
token ids. Two prompts then share block i's hash only when they agree on everything up to and
including block i, and `BlockPool` (blocks.py) can hand the cached block of one request to
another that starts the same way. The salt keeps engines that would compute different KV for the
same tokens (another model, another dtype) apart: `salt_for(model_path, dtype)`.

Only full blocks get a hash (a trailing partial block is still being written), and a request
never takes its prompt's last token from the cache: that token must still be run, its logits
give the first token (`reusable_blocks`).

>>> a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], block=4)
>>> b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], block=4)
>>> len(a), len(b), a[0] == b[0], a[1] == b[1], len(a[0])
(2, 2, True, False, 16)
>>> c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], block=4)  # same second block after another first
>>> c[1] == a[1]
False
>>> block_hashes([1, 2, 3, 4], 4, salt_for("m", "bf16")) == block_hashes([1, 2, 3, 4], 4, salt_for("m", "fp16"))
False
"""

from __future__ import annotations

import sys
from array import array
from hashlib import blake2b

__all__ = ["block_hashes", "reusable_blocks", "salt_for", "InFlight"]

DIGEST = 16
_NO_PARENT = bytes(DIGEST)  # block 0's "previous hash"


def _framed(data: bytes) -> bytes:
    """`data` behind its length, so that concatenated parts cannot be read two ways."""
    return len(data).to_bytes(8, "little") + data


def block_hashes(tokens: list[int], block: int, salt: bytes = b"") -> list[bytes]:
    """One 16-byte hash per full block of `tokens` (none for a trailing partial block), chained:
    block i's hash covers `salt`, block i-1's hash and block i's ids (as little-endian int64).

    >>> block_hashes([1, 2, 3], 4), len(block_hashes(list(range(8)), 4))
    ([], 2)
    >>> block_hashes(list(range(8)), 4)[:1] == block_hashes(list(range(5)), 4)
    True
    >>> block_hashes([1, 2], 2, b"x") == block_hashes([1, 2], 2, b"y")
    False
    """
    if block < 1:
        raise ValueError(f"a block holds >= 1 token (got {block})")
    ids = array("q", tokens)
    if sys.byteorder != "little":
        ids.byteswap()
    raw, step = memoryview(ids.tobytes()), block * ids.itemsize
    base = blake2b(digest_size=DIGEST)
    base.update(_framed(bytes(salt)))
    out, prev = [], _NO_PARENT
    for i in range(len(ids) // block):
        h = base.copy()
        h.update(prev)
        h.update(raw[i * step:(i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def salt_for(*parts) -> bytes:
    """A 16-byte salt from `parts` (e.g. the model's path and the dtype), each taken as its str.

    >>> salt_for("model", "bf16") == salt_for("model", "bf16"), salt_for("model", "bf16") == salt_for("model", "fp16")
    (True, False)
    >>> salt_for("ab", "c") == salt_for("a", "bc"), len(salt_for())
    (False, 16)
    """
    h = blake2b(digest_size=DIGEST)
    for part in parts:
        h.update(_framed(str(part).encode("utf-8", "surrogatepass")))
    return h.digest()


def reusable_blocks(prompt_len: int, block: int) -> int:
    """The most full blocks a prompt of `prompt_len` tokens may take from the cache: its last
    token must still be run (its logits give the first token), so `(prompt_len - 1) // block`.

    >>> [reusable_blocks(n, 16) for n in (0, 1, 16, 17, 33)]
    [0, 0, 0, 1, 2]
    """
    return max(prompt_len - 1, 0) // block


class InFlight:
    """The prompt blocks admitted requests are computing and have not published yet, so that a
    request arriving meanwhile with the same prefix waits for them rather than computing them
    a second time beside them (16 requests of one few-shot header arriving together prefill the
    header once). A request waits only while the next block it would share is another live
    request's to compute; it stops at the first block nobody computes (there its own prompt
    differs, or the computing request left).

    >>> f = InFlight()
    >>> f.claim("a", [b"h0", b"h1", b"h2"])
    >>> f.wait_for("b", [b"h0", b"h1", b"x"], 0), f.wait_for("b", [b"h0", b"h1"], 2), f.wait_for("a", [b"h0"], 0)
    (True, False, False)
    >>> f.published([b"h0"]); f.wait_for("b", [b"h0", b"h1"], 1), f.wait_for("b", [b"h0"], 0)
    (True, False)
    >>> f.drop("a"); f.wait_for("b", [b"h0", b"h1"], 1)
    False
    """

    def __init__(self):
        self._by: dict[bytes, object] = {}  # block hash -> the request computing it
        self._of: dict[object, list[bytes]] = {}  # request -> the hashes it claimed

    def claim(self, rid, hashes) -> None:
        """Request `rid` (admitted) will publish these blocks as its prefill writes them: those
        nobody computes yet are its own."""
        mine = [h for h in hashes if h not in self._by]
        for h in mine:
            self._by[h] = rid
        self._of.setdefault(rid, []).extend(mine)

    def wait_for(self, rid, hashes, hit: int) -> bool:
        """Whether request `rid`, which the cache gives `hit` of its `hashes` now, should wait:
        the next one is another live request's to compute."""
        owner = self._by.get(hashes[hit]) if hit < len(hashes) else None
        return owner is not None and owner != rid

    def published(self, hashes) -> None:
        for h in hashes:
            self._by.pop(h, None)

    def drop(self, rid) -> None:
        """Request `rid` left (or was preempted): what it had not published, nobody computes."""
        for h in self._of.pop(rid, ()):
            if self._by.get(h) == rid:
                del self._by[h]
