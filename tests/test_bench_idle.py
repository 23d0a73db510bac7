"""The bench's idle-gap report (memra_dist/bench/idle.py) over made-up profiler timelines."""

from memra_dist.bench.idle import format_idle, idle_gaps


def _x(cat, name, ts, dur, tid=None):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_gaps_below_the_floor_are_busy_enough_and_host_work_is_split_by_thread():
    ev = [_x("kernel", "gemm", 0, 1000), _x("kernel", "gemm", 1050, 950),  # a 50 us gap: under the floor
          _x("gpu_memcpy", "DtoH", 2000, 100), _x("kernel", "gemm", 3100, 900),  # a 1 ms gap
          _x("cuda_runtime", "cudaEventSynchronize", 1900, 400, tid=1),  # 200 us inside the gap
          _x("cpu_op", "aten::tolist", 2300, 500, tid=1), _x("python_function", "pack", 2500, 700, tid=2),
          _x("user_annotation", "the whole run", -10, 60_000, tid=1),  # longer than any gap explains
          {"ph": "M", "name": "process_name"}]
    r = idle_gaps(ev, min_us=100)
    assert r["gaps"] == 1 and r["idle_ms"] == 1.0 and r["span_ms"] == 4.0, r
    assert r["busy"] == round(2950 / 4000, 3), r
    by = {(tid, name): (ms, n) for tid, name, ms, n in r["host"]}
    assert by == {(1, "cudaEventSynchronize"): (0.2, 1), (1, "aten::tolist"): (0.5, 1), (2, "pack"): (0.6, 1)}, by
    assert [name for _, name, _, _ in r["host"]] == ["pack", "aten::tolist", "cudaEventSynchronize"]
    assert r["bins"] == [(2, 1)], r  # 1 ms: the third 0.5 ms bin
    text = format_idle(r)
    assert "device busy 0.738" in text and "1 idle gaps" in text and "pack" in text, text


def test_a_timeline_without_device_work_reports_nothing_idle():
    r = idle_gaps([_x("cpu_op", "aten::mm", 0, 10, tid=1)])
    assert r["busy"] is None and r["gaps"] == 0 and r["host"] == []
    assert "nothing idled" in format_idle(r)
