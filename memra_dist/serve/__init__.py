"""Serving many requests on one loaded engine: `memra-dist batch` (a resumable JSONL job)
and `memra-dist serve` (an OpenAI-compatible HTTP API on Ray Serve).

Light on import (no torch): memra_dist/cli.py builds its parser from here on every start."""

__all__ = ["add_batch_parser", "run_batch", "add_serve_parser", "run_serve"]


def add_batch_parser(sub, add_run_args):
    """memra_dist/cli.py: `add_batch_parser(sub, _add_run_args)` (its flag set, handed in)."""
    from .batch_cli import add_batch_parser as add  # noqa: PLC0415

    return add(sub, add_run_args)


def run_batch(args) -> int:
    from .batch_cli import run_batch as run  # noqa: PLC0415

    return run(args)


def add_serve_parser(sub, add_run_args):
    """memra_dist/cli.py: `add_serve_parser(sub, _add_run_args)` (its flag set, handed in)."""
    from .serve_cli import add_serve_parser as add  # noqa: PLC0415

    return add(sub, add_run_args)


def run_serve(args) -> int:
    from .serve_cli import run_serve as run  # noqa: PLC0415

    return run(args)
