"""The shipped tables of tuned kernel configs: one JSON file per GPU model in
`memra_dist/kernels/tuned/<device-slug>.json` (written by benchmarks/tune_kernels.py), read
before any autotuning so a fresh machine benchmarks nothing on its first request
(kernels/tuning.py decides what a key takes).

A table:

    {"device": "NVIDIA H200", "slug": "h200", "triton": "3.5.0",
     "kernels": {"gemv": {"N=4096,K=4096,SILU_MUL=0,NORM=1,dtype=bfloat16":
                          {"BN": 8, "BK": 512, "num_warps": 4, "num_stages": 3}, ...}, ...}}

keyed by the kernel's name (the `name` its `autotune` call gives) and its autotune key values
(`key_string`: the kernel's key names in order, booleans as 0 / 1, then the first tensor
argument's dtype). The device is `torch.cuda.get_device_name()` normalised (`slug`:
"NVIDIA H200" -> "h200", every H100 variant -> "h100"). `MEMRA_TUNED_DIR` names a directory of
tables read before the package's own (a table tuned on this machine, without reinstalling).
A missing or empty table is no table; a file that does not parse, or an entry that does not
fit its kernel, is said once on stderr and skipped (the key then takes the heuristic config).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

__all__ = ["TABLE_DIR", "SIBLINGS", "slug", "device_slug", "key_string", "table_dirs", "lookup", "load", "reset", "merge_into",
           "read_file"]

TABLE_DIR = Path(__file__).resolve().parent / "tuned"  # the package's tables (package data)
# datacenter families whose variants (memory size, form factor) share one table
_FAMILY = re.compile(r"^(gh200|gb200|gb300|b200|b300|b100|h200|h100|h800|h20|a100|a800|a10g|a10|a30|a40|l40s|l40|l4|"
                     r"v100|t4|mi300x|mi300a|mi325x|mi250x|mi250|mi210)(?![a-z0-9])")
_WORDS = re.compile(r"\b(nvidia|amd|instinct|tesla|geforce|quadro)\b")

_SLUGS: dict[object, str] = {}  # torch device -> its slug (one get_device_name call per device)
_TABLES: dict[str, dict] = {}  # slug -> {kernel: {key: entry}} merged over table_dirs()
_SAID: set[str] = set()


def _say(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(f"memra-dist: warning: {line}", file=sys.stderr, flush=True)


def slug(name: str) -> str:
    """A GPU's name as a table's file stem.

    >>> [slug(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
    ...                    "NVIDIA GeForce RTX 4090", "AMD Instinct MI300X", "NVIDIA L40S", "NVIDIA GH200 480GB")]
    ['h200', 'h100', 'h100', 'a100', 'rtx-4090', 'mi300x', 'l40s', 'gh200']
    """
    s = _WORDS.sub(" ", name.lower())
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    m = _FAMILY.match(s)
    return m.group(1) if m else (s or "unknown")


def device_slug(device=None) -> str:
    """The table slug of `device` (a torch device or None: the current CUDA device); "cpu" off
    CUDA (Triton's interpreter). Tests monkeypatch kernels/tuning.py's `device_slug`."""
    import torch  # noqa: PLC0415

    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return "cpu"
    if dev is None:
        if not torch.cuda.is_available():
            return "cpu"
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev not in _SLUGS:
        try:
            _SLUGS[dev] = slug(torch.cuda.get_device_name(dev))
        except Exception as e:  # noqa: BLE001 (no name, no table: the heuristic, said once)
            _say(f"cannot name {dev} ({type(e).__name__}: {e}); its kernels take the heuristic configs")
            _SLUGS[dev] = "unknown"
    return _SLUGS[dev]


def key_string(names, values, dtype) -> str:
    """One key of a table: the kernel's autotune key names and values, then the dtype.

    >>> key_string(["N", "K", "SILU_MUL"], [4096, 14336, True], "torch.bfloat16")
    'N=4096,K=14336,SILU_MUL=1,dtype=bfloat16'
    """
    if len(names) != len(values):
        raise ValueError(f"{len(names)} key names {list(names)} but {len(values)} values {list(values)}")
    parts = [f"{n}={int(v) if isinstance(v, bool) else v}" for n, v in zip(names, values)]
    return ",".join(parts + [f"dtype={str(dtype).removeprefix('torch.')}"])


def table_dirs() -> list[Path]:
    """MEMRA_TUNED_DIR (when set), then the package's tables: the first that has a key wins."""
    from ..env import environment  # noqa: PLC0415

    extra = environment().tuned_dir
    return ([Path(extra).expanduser()] if extra else []) + [TABLE_DIR]


def read_file(path: Path) -> dict:
    """A table file's `kernels` ({} when missing or empty); raises ValueError when it does not
    parse or is not a table (benchmarks/tune_kernels.py merges into it: loud there)."""
    if not path.is_file():
        return {}
    text = path.read_text()
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    kernels = data.get("kernels", {}) if isinstance(data, dict) else None
    if not isinstance(kernels, dict) or not all(isinstance(v, dict) for v in kernels.values()):
        raise ValueError(f"{path}: not a tuned-config table (expected {{\"kernels\": {{name: {{key: config}}}}}})")
    return kernels


# A GPU with no table of its own reads a sibling's: the same chip generation (Hopper, SM 9.0), so
# the same tile shapes win, near enough. Measured on an H200, the 8B's verify rows with the
# heuristic row-GEMM config decoded at 165 tok/s, with the tuned table at 315 (BENCHMARKS.md).
SIBLINGS = {"h100": "h200", "h800": "h200", "h20": "h200", "gh200": "h200"}


def load(slug_: str) -> dict:
    """{kernel: {key: entry}} for a device slug, merged over table_dirs() (read once, see reset);
    a slug with no table reads its sibling's (SIBLINGS)."""
    if slug_ not in _TABLES:
        own = _load(slug_)
        _TABLES[slug_] = own if own or slug_ not in SIBLINGS else _load(SIBLINGS[slug_])
    return _TABLES[slug_]


def _load(slug_: str) -> dict:
    merged: dict[str, dict] = {}
    for d in reversed(table_dirs()):  # the package's first, MEMRA_TUNED_DIR's over it
        try:
            kernels = read_file(d / f"{slug_}.json")
        except (OSError, ValueError) as e:
            _say(f"ignoring the tuned-config table ({e}); its keys take the heuristic config")
            continue
        for name, entries in kernels.items():
            merged.setdefault(name, {}).update(entries)
    return merged


def _valid(entry, params: set[str]) -> bool:
    if not isinstance(entry, dict):
        return False
    if not all(isinstance(entry.get(k), int) and entry[k] > 0 for k in ("num_warps", "num_stages")):
        return False
    kw = set(entry) - {"num_warps", "num_stages", "num_ctas", "maxnreg"}
    return kw == params and all(isinstance(entry[k], (int, bool)) for k in kw)


def lookup(slug_: str, kernel: str, key: str, params: set[str]) -> dict | None:
    """The table's entry for (kernel, key) on the device, when it has one that fits the
    kernel's tunables `params` (its configs' kwargs names); None otherwise."""
    entry = load(slug_).get(kernel, {}).get(key)
    if entry is None:
        return None
    if not _valid(entry, params):
        _say(f"ignoring the tuned config {entry!r} of {kernel} [{key}] on {slug_} (expected integers "
             f"{sorted(params)} + num_warps + num_stages); the key takes the heuristic config")
        return None
    return entry


def reset() -> None:
    """Forget the tables read and the slugs found (tests; a table written in this process)."""
    _TABLES.clear()
    _SLUGS.clear()
    _SAID.clear()


def merge_into(path: Path, device: str, slug_: str, kernels: dict, meta: dict | None = None) -> int:
    """Writes `kernels` ({kernel: {key: entry}}) over the table at `path` (its other keys kept);
    returns the number of keys it now holds. Written to a temporary file, then renamed."""
    old = read_file(path)
    for name, entries in kernels.items():
        old.setdefault(name, {}).update(entries)
    doc = {"device": device, "slug": slug_, **(meta or {}),
           "kernels": {n: dict(sorted(e.items())) for n, e in sorted(old.items())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return sum(len(e) for e in old.values())
