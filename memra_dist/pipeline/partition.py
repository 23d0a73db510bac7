"""Layers -> pipeline stages. Pure (no torch, no ray), tested on its own."""

from __future__ import annotations

from ..errors import UserError

__all__ = ["partition"]


def partition(num_layers: int, num_stages: int, bounds: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Split layers [0, num_layers) into `num_stages` contiguous, non-empty [first, last) ranges.

    Even by default, the earlier stages taking one extra layer when it does not divide:

    >>> partition(10, 3)
    [(0, 4), (4, 7), (7, 10)]

    `bounds` gives the first layer of stages 2..N explicitly:

    >>> partition(10, 3, (2, 5))
    [(0, 2), (2, 5), (5, 10)]
    """
    if num_stages < 1:
        raise UserError(f"--pp must be >= 1 (got {num_stages})")
    if num_stages > num_layers:
        raise UserError(f"--pp {num_stages} is larger than the model's {num_layers} layers")
    if bounds is not None:
        if len(bounds) != num_stages - 1:
            raise UserError(f"--stage-bounds needs {num_stages - 1} values for --pp {num_stages} (got {len(bounds)})")
        edges = [0, *bounds, num_layers]
        if any(b <= a for a, b in zip(edges, edges[1:])):
            raise UserError(f"--stage-bounds {','.join(map(str, bounds))}: must increase strictly inside (0, {num_layers})")
        return list(zip(edges, edges[1:]))
    base, extra = divmod(num_layers, num_stages)
    out, first = [], 0
    for s in range(num_stages):
        last = first + base + (1 if s < extra else 0)
        out.append((first, last))
        first = last
    return out
