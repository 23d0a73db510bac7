"""Config sizes are bounded before anything is sized by them, for every family; a checkpoint
directory bounds its config further by what its safetensors headers hold; memra_dist has no
import cycles.

The timing and memory bounds are loose correctness bounds (a refused config costs next to
nothing), not benchmarks."""

from __future__ import annotations

import ast
import json
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from memra_dist.errors import UserError
from memra_dist.model.config import (SIZE_LIMITS, CheckpointSizes, checkpoint_sizes, load_config, parse_config,
                                     safetensors_header)
from memra_dist.model.kimi_config import KimiSpec

from test_cli_errors import _assert_one_line_error, _gen, run_main

# ---- valid tiny configs, one per family ------------------------------------------------

_DENSE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
_KIMI = {"model_type": "kimi_linear", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
         "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "kv_lora_rank": 16, "q_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
         "num_experts": 8, "num_experts_per_token": 2, "num_expert_group": 2, "topk_group": 1,
         "num_shared_experts": 1, "first_k_dense_replace": 1, "model_max_length": 8192,
         "linear_attn_config": {"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4,
                                "kda_layers": [1, 3, 4], "full_attn_layers": [2]}}
FAMILIES = {
    "llama": dict(_DENSE, model_type="llama"),
    "qwen2": dict(_DENSE, model_type="qwen2"),
    "qwen3": dict(_DENSE, model_type="qwen3", head_dim=16),
    "kimi_linear": _KIMI,
}
_COMMON = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "vocab_size"]
FIELDS = {  # family -> the size keys of its config.json ("a.b": key b of sub-config a)
    **{f: _COMMON + ["head_dim", "max_position_embeddings"] for f in ("llama", "qwen2", "qwen3")},
    "kimi_linear": _COMMON + ["model_max_length", "moe_intermediate_size", "kv_lora_rank", "q_lora_rank",
                              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
                              "num_experts_per_token", "num_expert_group", "topk_group", "num_shared_experts",
                              "first_k_dense_replace", "linear_attn_config.num_heads",
                              "linear_attn_config.head_dim", "linear_attn_config.short_conv_kernel_size"],
}
CASES = [(fam, key) for fam, keys in FIELDS.items() for key in keys]
GIANT = [10**8, 2**40, 2**70]


def _with(family: str, key: str, value) -> dict:
    d = json.loads(json.dumps(FAMILIES[family]))  # a deep copy
    sub, _, leaf = key.rpartition(".")
    (d[sub] if sub else d)[leaf] = value
    return d


def _refused_fast(d: dict, *needles: str) -> str:
    """parse_config refuses d with one UserError line containing the needles, in well under
    a second and a few MB of Python allocations."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(UserError) as e:
            parse_config(d, where="cfg")
    finally:
        wall = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    assert wall < 2.0, f"{wall:.2f}s to refuse"
    assert peak < 16 << 20, f"{peak} bytes allocated to refuse"
    return msg


def test_the_tiny_configs_parse():
    for family, d in FAMILIES.items():
        c = parse_config(d)
        assert (c.arch, c.num_layers, c.hidden_size) == (family, 4, 32)
    cfg = parse_config(_KIMI)
    assert isinstance(cfg.family, KimiSpec) and KimiSpec.from_config(cfg) is cfg.family  # parsed once, kept


@pytest.mark.parametrize("family, key", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_a_giant_size_is_refused_naming_the_field(family, key):
    for v in GIANT:
        _refused_fast(_with(family, key, v), key.rpartition(".")[2], "out of range")


@pytest.mark.parametrize("family, key", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_a_malformed_size_is_refused_naming_the_field(family, key):
    for v in (2.5, "64", True, [4], float("inf"), float("nan")):
        _refused_fast(_with(family, key, v), key.rpartition(".")[2], "malformed")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_non_positive_sizes_are_refused(family):
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
        for v in (0, -1, -(2**40)):
            _refused_fast(_with(family, key, v), key)


def test_kimi_sizes_that_may_be_zero_or_unused():
    assert parse_config(_with("kimi_linear", "num_shared_experts", 0)).family.n_shared == 0
    d = _with("kimi_linear", "q_lora_rank", None)
    assert parse_config(d).family.q_lora_rank is None
    dense = dict(_KIMI, first_k_dense_replace=4)  # no MoE layer: the MoE sizes are unused, may be absent
    for k in ("num_experts", "num_experts_per_token", "moe_intermediate_size"):
        dense.pop(k)
    assert parse_config(dense).family.num_experts == 0
    _refused_fast(dict(dense, num_experts=2**40), "num_experts")  # but never out of range


def test_kimi_layer_lists_are_checked_before_they_are_built():
    _refused_fast(_with("kimi_linear", "num_hidden_layers", 2**40), "num_hidden_layers")
    _refused_fast(dict(_KIMI, layer_types="linear_attention" * 1000), "layer types")
    _refused_fast(dict(_KIMI, layer_types=["linear_attention"] * 5), "layer types")
    _refused_fast(_with("kimi_linear", "linear_attn_config.kda_layers", [1, 2**40]), "kda_layers", "of 4")
    _refused_fast(_with("kimi_linear", "linear_attn_config.full_attn_layers", "2"), "full_attn_layers")


def test_sizes_at_the_limits_parse_quickly():
    t0 = time.perf_counter()
    n = SIZE_LIMITS["num_hidden_layers"]
    assert parse_config(dict(FAMILIES["llama"], num_hidden_layers=n)).num_layers == n
    d = dict(_KIMI, num_hidden_layers=n, linear_attn_config={"num_heads": 4, "head_dim": 8})
    assert len(parse_config(d).family.layer_types) == n
    assert parse_config(dict(FAMILIES["llama"], vocab_size=SIZE_LIMITS["vocab_size"])).vocab_size > 0
    assert time.perf_counter() - t0 < 2.0


# ---- bounded by the checkpoint on disk -------------------------------------------------


def _clone(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    d = json.loads((dst / "config.json").read_text())
    d.update(config)
    (dst / "config.json").write_text(json.dumps(d))
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_dense_checkpoints_bound_their_configs(ckpt_factory, tmp_path, arch):
    src = ckpt_factory(arch)[0]
    assert checkpoint_sizes(src) == CheckpointSizes(layers=4, vocab=128, hidden=32)
    assert load_config(src).num_layers == 4
    for key, value, needles in (("num_hidden_layers", 5, ["num_hidden_layers = 5", "4 layers"]),
                                ("num_hidden_layers", 2**40, ["num_hidden_layers", "out of range"]),
                                ("vocab_size", 129, ["vocab_size = 129", "128 x 32"]),
                                ("hidden_size", 64, ["hidden_size = 64", "128 x 32"])):
        d = _clone(src, tmp_path / f"{key}-{value}", **{key: value})
        with pytest.raises(UserError) as e:
            load_config(d)
        assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


def test_load_stage_and_the_cli_refuse_extra_layers(llama, tmp_path, capsys):
    from memra_dist.model.loader import load_stage

    d = _clone(llama, tmp_path / "five", num_hidden_layers=5)
    with pytest.raises(UserError, match="num_hidden_layers"):
        load_stage(d, 0, 5, True, True, torch.device("cpu"), torch.float32)
    _assert_one_line_error(*run_main(_gen(d), capsys), ["num_hidden_layers", "4 layers"])


def test_sharded_checkpoints_are_bounded_through_the_index(llama, tmp_path):
    d = tmp_path / "sharded"
    shutil.copytree(llama, d)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(d / f), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    assert load_config(d).num_layers == 4
    assert checkpoint_sizes(d).layers == 4 and checkpoint_sizes(d).vocab == 128
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=6)))
    with pytest.raises(UserError, match="num_hidden_layers = 6 exceeds the 4 layers"):
        load_config(d)
    (d / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    with pytest.raises(UserError, match="malformed index"):
        load_config(d)


def test_only_the_headers_are_read(tmp_path):
    """A header that describes far more data than the file holds: the sizes come from the
    header alone (the data is never touched); a broken header is one line naming the file."""
    d = tmp_path / "header-only"
    d.mkdir()
    hdr = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [1 << 20, 4096], "data_offsets": [0, 1 << 34]},
           "model.layers.0.mlp.up_proj.weight": {"dtype": "F32", "shape": [8, 8], "data_offsets": [0, 256]}}
    blob = json.dumps(hdr).encode()
    (d / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob)
    assert safetensors_header(d / "model.safetensors") == hdr
    sizes = checkpoint_sizes(d)
    assert (sizes.layers, sizes.vocab, sizes.hidden) == (1, 1 << 20, 4096)
    for name, raw in (("short", b"\x01\x02"), ("huge-length", (1 << 60).to_bytes(8, "little")),
                      ("not-json", (5).to_bytes(8, "little") + b"{nope"), ("truncated", (99).to_bytes(8, "little"))):
        (d / "model.safetensors").write_bytes(raw)
        with pytest.raises(UserError) as e:
            checkpoint_sizes(d)
        assert "model.safetensors" in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    assert checkpoint_sizes(tmp_path) is None  # no weights: the loader says so when it loads


def test_a_kimi_checkpoint_bounds_its_config(tmp_path):
    pytest.importorskip("transformers")
    from kimi_ckpt import hybrid

    _, target, draft = hybrid()
    assert load_config(target).num_layers == 4 and load_config(draft).num_layers == 2
    d = _clone(Path(draft), tmp_path / "kimi-3", num_hidden_layers=3, layer_types=None, mlp_layer_types=None,
               linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4,
                                   "kda_layers": [1, 3], "full_attn_layers": [2]})
    with pytest.raises(UserError, match="num_hidden_layers = 3 exceeds the 2 layers"):
        load_config(d)
    d = _clone(Path(draft), tmp_path / "kimi-giant", num_hidden_layers=2**40)
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="num_hidden_layers"):
        load_config(d)
    assert time.perf_counter() - t0 < 2.0


# ---- valid tiny checkpoints still load -------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_dense_checkpoints_load(ckpt_factory, arch):
    from memra_dist.runner import ModelRunner

    d = ckpt_factory(arch)[0]
    r = ModelRunner(d, torch.device("cpu"), torch.float32)
    r.alloc(16)
    assert r.forward(torch.tensor([3, 5, 7]), 0).shape == (3, 128)


def test_tiny_kimi_checkpoint_loads():
    pytest.importorskip("transformers")
    from kimi_ckpt import hybrid

    from memra_dist.runner import ModelRunner

    r = ModelRunner(hybrid()[1], torch.device("cpu"), torch.float32)
    r.alloc(16)
    assert r.forward(torch.tensor([3, 5, 7]), 0).shape == (3, 128)


def test_the_demo_builder_still_builds_from_a_dict(tmp_path):
    from memra_dist.demo.tiny import build_checkpoint, llama_config, train_tokenizer

    tok = train_tokenizer(vocab_size=64)
    out = build_checkpoint(tmp_path / "demo", llama_config(tok.get_vocab_size(), hidden_size=16,
                                                           intermediate_size=32, num_hidden_layers=2,
                                                           num_attention_heads=2, num_key_value_heads=1), tok)
    assert load_config(out).num_layers == 2
    with pytest.raises(UserError, match="num_hidden_layers"):
        build_checkpoint(tmp_path / "giant", llama_config(64, hidden_size=16, intermediate_size=32,
                                                          num_hidden_layers=2**40, num_attention_heads=2), tok)


# ---- import cycles ---------------------------------------------------------------------

PKG_ROOT = Path(__file__).resolve().parent.parent / "memra_dist"

# Cycles outside the config / loader modules, through function-local imports, still to be
# broken by their owners; each entry is the cycle's set of modules.
KNOWN_ELSEWHERE: list[frozenset[str]] = []


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package)."""
    out = {}
    for f in sorted(PKG_ROOT.rglob("*.py")):
        parts = list(f.relative_to(PKG_ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _imports(body: list, top_only: bool):
    """The import statements that run when the module body runs (top_only) or at any time:
    function bodies count only when not top_only; `if TYPE_CHECKING:` blocks never run."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not top_only:
                yield from _imports(node.body, top_only)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from _imports(node.orelse, top_only)
        else:
            for name in ("body", "orelse", "finalbody", "handlers", "cases"):
                sub = getattr(node, name, None)
                if isinstance(sub, list):
                    yield from _imports(sub, top_only)


def import_graph(top_only: bool) -> dict[str, set[str]]:
    """module -> the memra_dist modules it imports (its own enclosing packages left out:
    they are imported before it whatever it says)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, (f, is_pkg) in mods.items():
        pkg = m if is_pkg else m.rpartition(".")[0]
        for node in _imports(ast.parse(f.read_text()).body, top_only):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[m] |= {t for t in targets if t in mods and t != m and not m.startswith(t + ".")}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(g) == [frozenset("abc")]


def test_no_import_cycles_among_memra_dist_modules():
    """Counting the imports a module body runs (function-local imports left out)."""
    assert import_cycles(import_graph(top_only=True)) == []


def test_no_import_cycles_even_through_function_local_imports():
    """Every import, function-local ones too; the cycles in KNOWN_ELSEWHERE are pending."""
    found = [sorted(c) for c in import_cycles(import_graph(top_only=False)) if c not in KNOWN_ELSEWHERE]
    assert found == []


def test_the_model_modules_import_each_other_one_way():
    g = import_graph(top_only=False)
    assert "memra_dist.model.config" not in g["memra_dist.model.kimi_config"]
    assert not {"memra_dist.model.loader", "memra_dist.model.transformer"} & g["memra_dist.model.kimi"]
