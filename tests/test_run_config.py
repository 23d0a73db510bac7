"""RunConfig: the fast path is the default wherever CUDA graphs run; the switches validate."""

from __future__ import annotations

import pytest
import torch

from memra_dist.config import RunConfig
from memra_dist.errors import UserError


def test_compile_auto_compiles_only_where_it_pays_and_nothing_on_cpu():
    cfg = RunConfig(model="m")
    assert cfg.compile == "auto"
    # auto: the target's blocks stay eager-in-graphs (compile gained < 3 % in decode), the DFlash
    # drafter's pieces compile (+5.8 %): compile_policy.PAYS, measured by benchmarks/compile_pays.py
    assert cfg.runner_kwargs(torch.device("cuda")) == {"graphs": True, "compile": False, "compile_drafter": True,
                                                       "kernels": True, "warm_rows": 5, "warm_timed": False}
    assert cfg.runner_kwargs(torch.device("cpu")) == {"graphs": False, "compile": False, "compile_drafter": False,
                                                      "kernels": False, "warm_rows": 0, "warm_timed": False}
    on = RunConfig(model="m", compile="on").runner_kwargs(torch.device("cuda"))
    assert on["compile"] is True and on["compile_drafter"] is True
    off = RunConfig(model="m", compile="off").runner_kwargs(torch.device("cuda"))
    assert off["compile"] is False and off["compile_drafter"] is False
    no_graphs = RunConfig(model="m", graphs="off", compile="on").runner_kwargs(torch.device("cuda"))
    assert no_graphs["compile"] is False and no_graphs["compile_drafter"] is False


def test_compile_policy_table_drives_auto(monkeypatch):
    from memra_dist import compile_policy

    monkeypatch.setitem(compile_policy.PAYS, "target", True)
    assert RunConfig(model="m").runner_kwargs(torch.device("cuda"))["compile"] is True
    monkeypatch.setitem(compile_policy.PAYS, "dflash", False)
    assert RunConfig(model="m").runner_kwargs(torch.device("cuda"))["compile_drafter"] is False
    with pytest.raises(KeyError, match="unknown compile path"):
        compile_policy.compiles("auto", "eagle")


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
