"""Our Triton kernels' autotuners keep their timings on disk and bench briefly
(kernels/tuning.py): a fresh process reads the winners instead of re-benchmarking every
config at its first capture (most of a tiny model's first-token wait before)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from memra_dist.kernels import gemm_rows, gemv, moe_gemv, tuning  # noqa: E402


def _tuners():
    return {"gemv": gemv._tuned, "gemm_rows": gemm_rows._tuned, "gemm_rows_wide": gemm_rows._wide,
            "moe_up": moe_gemv._up_tuned,
            "moe_down": moe_gemv._down_tuned}


def test_every_tuner_uses_the_disk_cache_and_the_short_bench():
    kw = tuning.tune_kwargs()
    if "cache_results" not in kw:
        pytest.skip("this Triton's autotune has no on-disk cache")
    for name, t in _tuners().items():
        assert isinstance(t, triton.runtime.Autotuner), name
        assert t._do_bench is tuning._bench, f"{name} benchmarks with Triton's default 25 + 100 ms"
        if not triton.knobs.runtime.interpret:
            assert t.cache_results, f"{name} re-tunes in every process"


def test_the_tally_counts_benchmarked_configs_and_cache_hits(monkeypatch):
    import triton.testing

    monkeypatch.setattr(tuning, "TALLY", {"configs": 0, "tune_s": 0.0, "cached": 0, "shipped": 0, "heuristic": 0})
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, quantiles: (warmup, rep))
    assert tuning._bench(lambda: None, None) == (tuning.WARMUP_MS, tuning.REP_MS)
    assert tuning._bench(lambda: None, None) == (5, 20)
    tuning._listen(duration=0.25, cache_hit=False)  # a key benchmarked: its configs are counted by _bench
    tuning._listen(duration=None, cache_hit=True)
    assert tuning.TALLY["configs"] == 2 and tuning.TALLY["cached"] == 1 and tuning.TALLY["tune_s"] >= 0.0
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.autotuning, "listener"):
        assert knobs.autotuning.listener is tuning._listen


def test_a_tiny_weight_takes_the_row_gemms_first_config_untried():
    """kernels/gemm_rows.py small_first: a tiny model's weight is launch-bound whatever its
    config, so its keys try one config (no compile and benchmark of the others on a fresh
    machine); an 8B weight tries them all."""
    from memra_dist.kernels.gemm_rows import SMALL_WEIGHT, small_first

    configs = ["a", "b", "c"]
    assert small_first(configs, {"N": 256, "K": 128}) == ["a"]
    assert small_first(configs, {"N": SMALL_WEIGHT // 4096, "K": 4096}) == ["a"]
    assert small_first(configs, {"N": 6144, "K": 4096}) == configs
    for t in (gemm_rows._tuned, gemm_rows._wide):  # composed into the table's choice (kernels/tuning.py)
        assert t.memra_choose.prune is small_first
