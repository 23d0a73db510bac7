"""CPU intra-op thread count chosen from the model's size.

A small model's matmuls are too short to split across threads: each op then pays the thread
pool's wake-up and barrier, and on a loaded machine the pool's threads wait for cores that
other processes hold, so decoding a tiny model is far faster on one thread than on torch's
default (one per core). A large model's matmuls are long enough to share out. The count is
one thread per `PARAMS_PER_THREAD` weights touched per token, at least 1, at most the cores
available. When OMP_NUM_THREADS is set, the user chose: torch's own setting stands.

`choose_threads` is pure (sizes, cores and the environment are arguments); `apply_cpu_threads`
sets torch's count on CPU and returns the previous count, for the caller to restore.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["PARAMS_PER_THREAD", "model_params", "available_cores", "choose_threads", "apply_cpu_threads"]

# weights per token one thread is given before a second one pays off (fp32: 128 MB of weights)
PARAMS_PER_THREAD = 32_000_000


def _get(cfg: Any, *names: str) -> int | None:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
        if v is not None:
            return int(v)
    return None


def model_params(size: Any) -> int:
    """Weights touched per token, from: an int (a parameter count), a ModelConfig, an HF
    config.json dict, or an nn.Module (its parameter count). For configs, the blocks' q/k/v/o
    and gated-MLP projections plus the output projection (the embedding is a lookup)."""
    if isinstance(size, bool):
        raise TypeError("model size: expected a parameter count, a config or a module, got a bool")
    if isinstance(size, int):
        return max(0, size)
    if callable(getattr(size, "parameters", None)):
        return sum(p.numel() for p in size.parameters())
    h = _get(size, "hidden_size")
    layers = _get(size, "num_layers", "num_hidden_layers")
    if h is None or layers is None:
        raise TypeError(f"model size: {type(size).__name__} has no hidden_size / num_layers")
    inter = _get(size, "intermediate_size") or 4 * h
    heads = _get(size, "num_heads", "num_attention_heads") or 1
    kv = _get(size, "num_kv_heads", "num_key_value_heads") or heads
    hd = _get(size, "head_dim") or max(1, h // heads)
    vocab = _get(size, "vocab_size") or 0
    attn = h * heads * hd * 2 + h * kv * hd * 2
    mlp = 3 * h * inter
    return layers * (attn + mlp) + vocab * h


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def choose_threads(size: Any, cores: int, env: Mapping[str, str] | None = None) -> int | None:
    """The intra-op thread count for a model of `size` (see `model_params`) on `cores` CPUs:
    one per PARAMS_PER_THREAD weights, clamped to [1, cores]. None when OMP_NUM_THREADS is
    set in `env` (default os.environ): the caller leaves torch's setting as it is."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    return max(1, min(int(cores), model_params(size) // PARAMS_PER_THREAD))


_torch_default: int | None = None  # torch's count before this module first changed it


def apply_cpu_threads(size: Any, device: Any) -> int:
    """On a CPU device, set torch's intra-op thread count to `choose_threads(size, ...)`, at
    most the cores available and at most torch's own default (which excludes SMT siblings).
    Returns the count before the call: `torch.set_num_threads(prev)` restores it. On other
    devices, or with OMP_NUM_THREADS set, nothing changes (the current count is returned)."""
    import torch  # noqa: PLC0415 (the choice above stays importable without torch)

    global _torch_default
    prev = torch.get_num_threads()
    if torch.device(device).type != "cpu":
        return prev
    if _torch_default is None:
        _torch_default = prev
    n = choose_threads(size, min(available_cores(), _torch_default))
    if n is not None and n != prev:
        torch.set_num_threads(n)
    return prev
