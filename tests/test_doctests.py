"""The examples in the docstrings run as part of the suite (and each module has some)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["memra_dist.pipeline.partition", "memra_dist.specdec.drafters.ngram", "memra_dist.bench.roofline",
           "memra_dist.model.prefetch", "memra_dist.specdec.chunks", "memra_dist.model.prefix_attention",
           "memra_dist.compile_policy", "memra_dist.batching.blocks", "memra_dist.batching.graphs",
           "memra_dist.batching.backend", "memra_dist.specdec.accept", "memra_dist.specdec.stop",
           "memra_dist.serve.batch", "memra_dist.batching.policy", "memra_dist.batching.step_plan",
           "memra_dist.batching.admission", "memra_dist.specdec.spec_k", "memra_dist.batching.prefix_cache",
           "memra_dist.bench.idle", "memra_dist.bench.plot", "memra_dist.batching.take", "memra_dist.bench.prefix",
           "memra_dist.batching.primes", "memra_dist.bench.loop_sampler", "memra_dist.bench.batching", "memra_dist.bench.batching_sweep",
           "memra_dist.batching.device_idle"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=True)
    assert res.attempted > 0, f"{name} has no doctest examples"
    assert res.failed == 0, f"{res.failed} of {res.attempted} doctest examples of {name} failed (see the output above)"
