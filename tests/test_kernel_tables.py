"""Our kernels' shipped tables of tuned configs (kernels/tuned_table.py, kernels/tuning.py), run
by Triton's interpreter on CPU: a key the table has runs that config with nothing benchmarked;
a key it lacks takes the heuristic config with nothing benchmarked; tuning happens only when
asked (MEMRA_TUNE, `tuning.forced`) and then benchmarks every config as before; what
benchmarks/tune_kernels.py dumps is what the lookup reads; the first-token profile counts the
keys per kernel family."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from triton_interp import triton  # noqa: F401 (the interpreter on CPU; skips without Triton)

from memra_dist.kernels import gemm_rows, gemv, moe_gemv, tuned_table, tuning  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests run on CPU machines")
ROOT = Path(__file__).resolve().parents[1]
SLUG = "test-gpu"
N, K = 48, 64
KEY = tuned_table.key_string(["N", "K", "SILU_MUL", "NORM"], [N, K, False, False], torch.float32)


@pytest.fixture
def table(monkeypatch, tmp_path):
    """An empty table directory for the interpreter's 'device', fresh tallies and empty autotuner
    caches; a benchmark fails the test unless the test allows it."""
    import triton.testing

    monkeypatch.setattr(tuning, "TALLY", {"configs": 0, "tune_s": 0.0, "cached": 0, "shipped": 0, "heuristic": 0})
    monkeypatch.setattr(tuning, "FAMILIES", {})
    monkeypatch.setattr(tuning, "device_slug", lambda named_args: SLUG)
    monkeypatch.setattr(tuned_table, "table_dirs", lambda: [tmp_path])

    def no_bench(*a, **k):
        raise AssertionError("a config was benchmarked")

    monkeypatch.setattr(triton.testing, "do_bench", no_bench)
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.autotuning, "listener"):  # it looks for a JITFunction the
        monkeypatch.setattr(knobs.autotuning, "listener", None)  # interpreter's kernels are not
    saved = {n: (dict(t.cache), set(t.memra_choose.benched)) for n, t in tuning.TUNERS.items()}
    for t in tuning.TUNERS.values():
        t.cache.clear()
        t.memra_choose.benched.clear()
    tuned_table.reset()
    yield tmp_path
    tuned_table.reset()
    for n, (cache, benched) in saved.items():
        tuning.TUNERS[n].cache.clear()
        tuning.TUNERS[n].cache.update(cache)
        tuning.TUNERS[n].memra_choose.benched.clear()
        tuning.TUNERS[n].memra_choose.benched.update(benched)


def _write(d: Path, kernels: dict) -> None:
    (d / f"{SLUG}.json").write_text(json.dumps({"device": "Test GPU", "kernels": kernels}))


def _launch_gemv() -> torch.Tensor:
    """The GEMV's autotuned kernel at (N, K), fp32, no folds (kernels/gemv.py's CUDA call)."""
    torch.manual_seed(0)
    x, w = torch.randn(1, K), torch.randn(N, K)
    y = torch.empty(1, N)
    gemv._tuned[lambda m: (triton.cdiv(N, m["BN"]),)](x, w, w, w, w, y, N, K, w.stride(0), 0.0, SILU_MUL=False,
                                                      HAS_BIAS=False, NORM=False, HAS_RES=False)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-4)
    return y


def _chosen():
    (cfg,) = gemv._tuned.cache.values()
    return tuning.entry_of(cfg)


def test_a_table_entry_runs_exactly_its_config_and_benchmarks_nothing(table):
    entry = {"BN": 16, "BK": 32, "num_warps": 2, "num_stages": 1}  # none of gemv.CONFIGS: only the table says it
    _write(table, {"gemv": {KEY: entry}})
    with tuning.forced("off"):
        _launch_gemv()
    assert _chosen() == entry
    assert tuning.TALLY["configs"] == 0 and tuning.TALLY["shipped"] == 1 and tuning.TALLY["heuristic"] == 0
    assert tuning.FAMILIES == {"gemv": {"shipped": 1, "heuristic": 0, "tuned": 0}}
    with tuning.forced("missing"):  # MEMRA_TUNE=1 tunes what the table lacks only
        gemv._tuned.cache.clear()
        _launch_gemv()
    assert _chosen() == entry and tuning.TALLY["configs"] == 0 and tuning.TALLY["shipped"] == 2


def test_a_key_the_table_lacks_takes_the_heuristic_and_benchmarks_nothing(table):
    _write(table, {"gemv": {KEY.replace("N=48", "N=4096"): {"BN": 16, "BK": 32, "num_warps": 2, "num_stages": 1}}})
    with tuning.forced("off"):
        _launch_gemv()
    bn, bk, w, s = gemv.CONFIGS[0]  # the config the kernel lists first
    assert _chosen() == {"BN": bn, "BK": bk, "num_warps": w, "num_stages": s}
    assert tuning.TALLY["configs"] == 0 and tuning.TALLY["heuristic"] == 1 and tuning.TALLY["shipped"] == 0
    assert tuning.FAMILIES["gemv"] == {"shipped": 0, "heuristic": 1, "tuned": 0}


def test_every_kernel_takes_one_config_untuned_and_all_when_tuning(table):
    """The choice itself, on an 8B-sized key of each autotuner (no launch): one config with
    tuning off (the kernel's own pruning first: gemm_rows' first config), every config it
    keeps with MEMRA_TUNE=1."""
    x = torch.empty(0, dtype=torch.bfloat16)
    cases = {"gemv": ({"X": x, "N": 6144, "K": 4096}, dict(SILU_MUL=False, NORM=True)),
             "gemm_rows": ({"X": x, "N": 6144, "K": 4096}, dict(SILU_MUL=False, NORM=True, GLU=False, BM=16)),
             "gemm_rows_wide": ({"X": x, "N": 6144, "K": 4096}, dict(SILU_MUL=False, NORM=True, GLU=False, BM=32)),
             "moe_up": ({"X": x, "N": 4096, "K": 7168}, dict(TOPK=8)),
             "moe_down": ({"G": x, "N": 7168, "K": 2048}, dict(TOPK=8))}
    assert set(cases) == set(tuning.TUNERS)
    for name, (args, kw) in cases.items():
        t = tuning.TUNERS[name]
        with tuning.forced("off"):
            (cfg,) = t.early_config_prune(t.configs, args, **kw)
        assert cfg is t.configs[0], name
        with tuning.forced("missing"):
            assert t.early_config_prune(t.configs, args, **kw) == t.configs, name
    assert tuning.TALLY["heuristic"] == 5 and tuning.TALLY["configs"] == 0
    assert all(tuning.FAMILIES[n] == {"shipped": 0, "heuristic": 1, "tuned": 1} for n in cases)
    assert moe_gemv._up_tuned is tuning.TUNERS["moe_up"] and gemm_rows._wide is tuning.TUNERS["gemm_rows_wide"]


def _fake_bench(monkeypatch, calls: list):
    import triton.testing

    def bench(fn, warmup, rep, quantiles):
        fn()  # the config runs (in the interpreter), as Triton's benchmark would run it
        calls.append((warmup, rep))
        return [float(len(calls))] * 3  # the first config tried is the fastest

    monkeypatch.setattr(triton.testing, "do_bench", bench)


def test_forced_tuning_benchmarks_every_config_as_before(table, monkeypatch):
    _write(table, {"gemv": {KEY: {"BN": 16, "BK": 32, "num_warps": 2, "num_stages": 1}}})
    calls: list = []
    _fake_bench(monkeypatch, calls)
    with tuning.forced("all"):  # the table unread
        _launch_gemv()
    assert len(calls) == len(gemv.CONFIGS) == tuning.TALLY["configs"]
    assert calls[0] == (tuning.WARMUP_MS, tuning.REP_MS)
    assert tuning.TALLY["shipped"] == 0 and tuning.TALLY["heuristic"] == 0
    assert tuning.FAMILIES["gemv"] == {"shipped": 0, "heuristic": 0, "tuned": 1}
    bn, bk, w, s = gemv.CONFIGS[0]
    assert _chosen() == {"BN": bn, "BK": bk, "num_warps": w, "num_stages": s}


def test_memra_tune_says_when_to_benchmark(monkeypatch):
    from memra_dist.env import environment

    try:
        for raw, mode in (("1", "missing"), ("all", "all"), ("0", "off"), ("", "off")):
            monkeypatch.setenv("MEMRA_TUNE", raw)
            environment.cache_clear()
            assert tuning.tune_mode() == mode, raw
        monkeypatch.setenv("MEMRA_TUNE", "yes please")
        environment.cache_clear()
        assert tuning.tune_mode() == "off"  # junk: off, said on stderr
        with tuning.forced("all"):
            assert tuning.tune_mode() == "all"
        with pytest.raises(ValueError):
            with tuning.forced("sometimes"):
                pass
    finally:
        monkeypatch.delenv("MEMRA_TUNE")
        environment.cache_clear()


def _script():
    spec = importlib.util.spec_from_file_location("tune_kernels", ROOT / "benchmarks" / "tune_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_what_tune_kernels_writes_is_what_the_lookup_reads(table, monkeypatch):
    calls: list = []
    _fake_bench(monkeypatch, calls)
    with tuning.forced("all"):
        _launch_gemv()
    won = _script().winners()
    assert won == {"gemv": {KEY: _chosen()}}
    path = table / f"{SLUG}.json"
    path.write_text(json.dumps({"kernels": {"gemv": {"other": {"BN": 8, "BK": 8, "num_warps": 1, "num_stages": 1}},
                                            "moe_up": {}}}))
    assert tuned_table.merge_into(path, "Test GPU", SLUG, won, {"triton": "x"}) == 2  # merged with what was there
    doc = json.loads(path.read_text())
    assert doc["device"] == "Test GPU" and doc["kernels"]["gemv"]["other"]["BN"] == 8
    gemv._tuned.cache.clear()
    tuned_table.reset()
    monkeypatch.setattr(tuning, "TALLY", dict(tuning.TALLY, configs=0))
    with tuning.forced("off"):
        _launch_gemv()
    assert tuning.TALLY["configs"] == 0 and tuning.TALLY["shipped"] == 1 and _chosen() == won["gemv"][KEY]


def test_an_empty_missing_or_broken_table_is_no_table(table, capsys):
    assert tuned_table.load(SLUG) == {}  # missing
    (table / f"{SLUG}.json").write_text("")
    tuned_table.reset()
    assert tuned_table.load(SLUG) == {}  # empty
    (table / f"{SLUG}.json").write_text("{not json")
    tuned_table.reset()
    with tuning.forced("off"):
        _launch_gemv()  # the heuristic, said once on stderr
    assert tuning.TALLY["heuristic"] == 1 and "ignoring the tuned-config table" in capsys.readouterr().err
    _write(table, {"gemv": {KEY: {"BN": 16, "num_warps": 2, "num_stages": 1}}})  # BK missing: not this kernel's
    tuned_table.reset()
    gemv._tuned.cache.clear()
    with tuning.forced("off"):
        _launch_gemv()
    assert tuning.TALLY["heuristic"] == 2 and "ignoring the tuned config" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not JSON"):
        (table / "bad.json").write_text("[")
        tuned_table.read_file(table / "bad.json")


def test_device_names_normalise_to_one_table_per_gpu_model():
    names = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H100 PCIe": "h100",
             "NVIDIA H100 NVL": "h100", "NVIDIA A100-SXM4-80GB": "a100", "NVIDIA A10G": "a10g",
             "NVIDIA GeForce RTX 4090": "rtx-4090", "NVIDIA L40S": "l40s", "AMD Instinct MI300X": "mi300x"}
    assert {n: tuned_table.slug(n) for n in names} == names
    assert tuned_table.device_slug(torch.device("cpu")) == "cpu"


def test_a_gpu_without_a_table_reads_its_siblings_and_the_h200_ships(table):
    """An H100 (no table of its own) reads the H200's: the same chip generation; a GPU with a
    table of its own never reads a sibling's; the shipped H200 table covers the 8B's row GEMMs."""
    _write(table, {"gemv": {KEY: {"BN": 16, "BK": 64, "num_warps": 2, "num_stages": 1}}})
    (table / f"{SLUG}.json").rename(table / "h200.json")
    tuned_table.reset()
    assert tuned_table.load("h100")["gemv"][KEY]["BN"] == 16
    assert tuned_table.load("a100") == {} or KEY not in tuned_table.load("a100").get("gemv", {})
    shipped = tuned_table.read_file(tuned_table.TABLE_DIR / "h200.json")
    assert "N=14336,K=4096,SILU_MUL=0,NORM=1,GLU=1,dtype=bfloat16" in shipped["gemm_rows"]  # 8B gate-up, verify rows


def test_the_package_ships_its_tables():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"kernels/tuned/*.json"' in text
    for f in tuned_table.TABLE_DIR.glob("*.json"):  # each shipped table reads
        assert isinstance(tuned_table.read_file(f), dict), f


def test_the_first_token_profile_counts_keys_per_kernel_family(monkeypatch):
    from memra_dist.phase.first_token import FirstTokenProf, kernel_key_counts, keys_since

    fams = {"gemv": {"shipped": 4, "heuristic": 0, "tuned": 0}}
    monkeypatch.setattr(tuning, "FAMILIES", fams)
    pf = FirstTokenProf()
    assert " kernel_keys=" not in pf.line()  # none met: the line as before (docs/spans.md)
    keys0 = kernel_key_counts()  # the session's start
    fams["gemv"]["shipped"] += 3
    fams["gemm_rows"] = {"shipped": 0, "heuristic": 2, "tuned": 0}
    fams["moe_up"] = {"shipped": 0, "heuristic": 0, "tuned": 0}
    pf.kernel_keys = keys_since(keys0)  # its first token
    fams["gemv"]["shipped"] += 10  # after the first token: not counted
    assert pf.kernel_keys == {"gemv": {"shipped": 3, "heuristic": 0, "tuned": 0},
                              "gemm_rows": {"shipped": 0, "heuristic": 2, "tuned": 0}}
    assert (" kernel_keys=gemm_rows:shipped=0/heuristic=2/tuned=0,gemv:shipped=3/heuristic=0/tuned=0 | "
            in pf.line())


def test_tune_kernels_covers_the_bench_shapes_and_refuses_without_a_gpu(capsys):
    mod = _script()
    labels = [m for m, _ in mod.models()]
    assert labels[:2] == ["8b", "1b"] and {"demo", "tiny", "family-glm4_moe", "kimi"} <= set(labels)
    jobs = mod.jobs_of(dict(mod.models())["8b"])
    bf16 = torch.bfloat16
    for j in [("gemv", 6144, 4096, False, True, bf16), ("gemv", 4096, 4096, False, False, bf16),
              ("gemv", 28672, 4096, False, True, bf16), ("gemv", 4096, 14336, True, False, bf16),
              ("gemv", 128256, 4096, False, True, bf16), ("rows", 14336, 4096, 16, True, True),
              ("rows", 4096, 14336, 64, False, False), ("rows", 128256, 4096, 32, True, False)]:
        assert j in jobs, j
    assert ("moe", 128, 128, 2) in mod.jobs_of(dict(mod.models())["demo-glm4_moe"])
    assert mod.main(["--list", "--only", "8b"]) == 0 and "8b: " in capsys.readouterr().out
    assert mod.main(["--only", "nope"]) == 2
    assert mod.main(["--only", "tiny"]) == 2 and "no CUDA GPU" in capsys.readouterr().err
