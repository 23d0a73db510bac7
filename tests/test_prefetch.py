"""Reading the weights ahead while Ray starts (model/prefetch.py): which files, within what
bound, and that a local pipeline asks for its target's and its draft's files before Ray is up."""

from __future__ import annotations

import os
from pathlib import Path

from memra_dist.model import prefetch


def test_the_plan_keeps_order_and_the_memory_bound():
    files = [(Path("a"), 60), (Path("b"), 50), (Path("c"), 40), (Path("d"), 1)]
    assert prefetch.prefetch_plan(files, 200) == [Path("a"), Path("c")]  # b would pass 100 bytes
    assert prefetch.prefetch_plan(files, 0) == []
    assert prefetch.prefetch_plan(files, 10_000) == [f for f, _ in files]


def test_it_advises_every_weight_file_of_the_dirs_in_order(tmp_path, monkeypatch):
    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    for name, size in (("t/model-00002-of-00002.safetensors", 30), ("t/model-00001-of-00002.safetensors", 20),
                       ("t/config.json", 5), ("d/model.safetensors", 10)):
        (tmp_path / name).write_bytes(b"\0" * size)
    seen = []

    def advise(fd, offset, length, advice):
        assert (offset, length, advice) == (0, 0, os.POSIX_FADV_WILLNEED)
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "posix_fadvise", advise)
    t = prefetch.prefetch_weights([tmp_path / "t", None, tmp_path / "d"], 1 << 30)
    t.join(10)
    assert [Path(p).relative_to(tmp_path).as_posix() for p in seen] == [
        "t/model-00001-of-00002.safetensors", "t/model-00002-of-00002.safetensors", "d/model.safetensors"]
    assert prefetch.prefetch_weights([tmp_path / "t"], 0) is None  # nothing fits: no thread


def test_a_local_pipeline_prefetches_before_ray_starts(monkeypatch):
    from memra_dist.pipeline import driver

    calls = []

    class Stop(Exception):
        pass

    def ray_up():
        calls.append("ray")
        raise Stop

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(prefetch, "prefetch_weights", lambda dirs, avail: calls.append(("prefetch", tuple(dirs))))
    monkeypatch.setattr(driver, "_ray_up", ray_up)

    class Cfg:
        model, draft_model = "M", "D"

    class Plan:
        cfg = Cfg()

    try:
        with driver.open_pipeline(Plan()):
            pass
    except Stop:
        pass
    assert calls == [("prefetch", ("M", "D")), "ray"]
    calls.clear()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a remote cluster: its actors may be elsewhere
    try:
        with driver.open_pipeline(Plan()):
            pass
    except Stop:
        pass
    assert calls == ["ray"]


def test_a_sharded_checkpoint_reads_ahead_only_what_its_index_names(tmp_path):
    """The loader's own file set (model/loader.py checkpoint_files): a stray safetensors file
    beside an index is not read ahead; a malformed index means nothing to read ahead."""
    import json

    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors"):
        (tmp_path / name).write_bytes(b"\0" * 8)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))
    assert [f.name for f, _ in prefetch.weight_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                                  "model-00002-of-00002.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text("{")
    assert prefetch.weight_files(tmp_path) == []
