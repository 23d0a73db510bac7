"""Moonshot's original kimi_linear tensor names -> the module names (transformers' in-memory /
`save_original_format=False` layout), for the loader's family hook.

The original layout (Moonshot's checkpoints, and transformers' default `save_pretrained`)
differs from the modules in four ways (transformers' `conversion_mapping.py`, "kimi_linear"):
  * the FFN is `block_sparse_moe.*` (MoE and, in transformers' output, the dense layers too);
  * routed experts are per expert: `experts.N.w1` (gate), `w3` (up), `w2` (down), which the
    modules hold stacked: gate_up_proj (E, 2I, H) = [w1; w3] per expert, down_proj (E, H, I);
  * the KDA short convs are `q_conv1d` / `k_conv1d` / `v_conv1d` (Q, 1, K) each, stacked into
    `conv1d` (3Q, 1, K) in that order;
  * the forget gate's weights (`f_a_proj`, `f_b_proj`, `dt_bias`, `A_log`) sit directly under
    `self_attn`, not under `self_attn.forget_gate`.
Only names missing from the checkpoint are asked for, so either layout (or a mix) loads.
"""

from __future__ import annotations

import torch

__all__ = ["checkpoint_tensor"]

_FFN_DIRS = (".mlp.", ".block_sparse_moe.")


def _one(reader, name: str) -> torch.Tensor | None:
    """`name` under any of the FFN directory spellings, as stored."""
    for a in _FFN_DIRS:
        if a in name:
            for b in _FFN_DIRS:
                alt = name.replace(a, b, 1)
                if reader.has(alt):
                    return reader.get(alt)
    return reader.get(name) if reader.has(name) else None


def _experts(reader, prefix: str, parts: tuple[str, ...]) -> torch.Tensor | None:
    """Stack per-expert tensors `<prefix>.experts.N.<part>.weight` over N = 0, 1, ...; the
    parts of one expert are concatenated along dim 0. None if expert 0 is missing."""
    rows = []
    for e in range(1 << 20):
        got = [_one(reader, f"{prefix}.experts.{e}.{p}.weight") for p in parts]
        if any(t is None for t in got):
            break
        rows.append(torch.cat(got, dim=0))
    return torch.stack(rows) if rows else None


def checkpoint_tensor(reader, name: str) -> torch.Tensor | None:
    """The tensor for HF module name `name` (e.g. `model.layers.3.mlp.experts.gate_up_proj`)
    from an original-layout checkpoint, or None if this layout does not have it either."""
    if name.endswith(".experts.gate_up_proj"):
        return _experts(reader, name[: -len(".experts.gate_up_proj")], ("w1", "w3"))
    if name.endswith(".experts.down_proj"):
        return _experts(reader, name[: -len(".experts.down_proj")], ("w2",))
    if name.endswith(".self_attn.conv1d.weight"):
        base = name[: -len("conv1d.weight")]
        parts = [f"{base}{c}_conv1d.weight" for c in "qkv"]
        if all(reader.has(p) for p in parts):
            return torch.cat([reader.get(p) for p in parts], dim=0)  # (3Q, 1, K)
        return None
    if ".self_attn.forget_gate." in name:
        flat = name.replace(".self_attn.forget_gate.", ".self_attn.", 1)
        return reader.get(flat) if reader.has(flat) else None
    return _one(reader, name)
