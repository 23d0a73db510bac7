"""RunConfig: the fast path is the default wherever CUDA graphs run; the switches validate."""

from __future__ import annotations

import pytest
import torch

from memra_dist.config import RunConfig
from memra_dist.errors import UserError


def test_compile_is_on_by_default_with_the_graphs_and_off_on_cpu():
    cfg = RunConfig(model="m")
    assert cfg.compile == "auto"
    assert cfg.runner_kwargs(torch.device("cuda")) == {"graphs": True, "compile": True, "kernels": True,
                                                       "warm_rows": 5, "warm_timed": False}
    assert cfg.runner_kwargs(torch.device("cpu")) == {"graphs": False, "compile": False, "kernels": False,
                                                      "warm_rows": 0, "warm_timed": False}
    assert RunConfig(model="m", compile="off").runner_kwargs(torch.device("cuda"))["compile"] is False
    assert RunConfig(model="m", graphs="off").runner_kwargs(torch.device("cuda"))["compile"] is False


def test_kernels_follow_the_graphs_and_switch_off():
    assert RunConfig(model="m", kernels="off").runner_kwargs(torch.device("cuda"))["kernels"] is False
    assert RunConfig(model="m", graphs="off").runner_kwargs(torch.device("cuda"))["kernels"] is False
    assert RunConfig(model="m", kernels=False).kernels == "off"
    with pytest.raises(UserError, match="--kernels"):
        RunConfig(model="m", kernels="on")


def test_compile_accepts_the_python_apis_booleans_and_refuses_junk():
    assert RunConfig(model="m", compile=True).compile == "on"
    assert RunConfig(model="m", compile=False).compile == "off"
    with pytest.raises(UserError, match="--compile"):
        RunConfig(model="m", compile="fast")


def test_inductor_cache_follows_the_package_cache(monkeypatch, tmp_path):
    from memra_dist.env import environment
    from memra_dist.graphs import inductor_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path))
    environment.cache_clear()
    try:
        assert inductor_cache_dir() == str(tmp_path / "inductor")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/x")
        assert inductor_cache_dir() == "/x"
    finally:
        environment.cache_clear()


def test_level_2_captures_its_timed_graphs_at_allocation():
    from memra_dist.phase.levels import TraceSettings

    cfg = RunConfig(model="m", trace=TraceSettings(level=2))
    assert cfg.runner_kwargs(torch.device("cuda"))["warm_timed"] is True
    assert cfg.runner_kwargs(torch.device("cpu"))["warm_timed"] is False
