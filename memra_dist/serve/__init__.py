"""Serving many requests on one loaded engine: `memra-dist batch` (a resumable JSONL job).

Light on import (no torch): memra_dist/cli.py builds its parser from here on every start."""

__all__ = ["add_batch_parser", "run_batch"]


def add_batch_parser(sub, add_run_args):
    """memra_dist/cli.py: `add_batch_parser(sub, _add_run_args)` (its flag set, handed in)."""
    from .batch_cli import add_batch_parser as add  # noqa: PLC0415

    return add(sub, add_run_args)


def run_batch(args) -> int:
    from .batch_cli import run_batch as run  # noqa: PLC0415

    return run(args)
