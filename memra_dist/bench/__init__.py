"""`memra-dist bench`: one command, one run, every speed figure against its target.

One role per file: checkpoints (made on the machine), timing (sync, medians, copy bandwidth),
roofline (pure formulas), noise (ranges of repeats; the pass / miss / within-noise verdict),
fastpath (the one place the CUDA-graph switch is wired), runs (runners built once,
generations, step timing), drafting (draft cost per round off the phase clock, the model
drafter vs its weight read, n-gram propose), sections / peer / dist_bench / hybrid / prefill / prefix / batching (what
is measured), suite (order, budget, progress), report (targets, flags, markdown), cli (argparse glue).
"""

__all__ = ["add_bench_parser", "run_bench", "SECTIONS"]

SECTIONS = ("bandwidth", "steps", "decode", "trace", "peer", "pp", "hybrid", "prefill", "prefix", "batching")  # in run order


def add_bench_parser(sub) -> None:
    from .cli import add_bench_parser as add  # noqa: PLC0415

    add(sub)


def run_bench(args) -> int:
    from .cli import run_bench as run  # noqa: PLC0415

    return run(args)
