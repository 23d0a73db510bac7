"""The deepseek_v3 / glm4_moe checkpoint layout -> the module names, for the loader's family hook.

Released checkpoints (and transformers' default `save_pretrained`) store routed experts one
by one: `mlp.experts.N.{gate_proj, up_proj, down_proj}.weight`; the modules hold them stacked
(model/moe.py): gate_up_proj (E, 2I, H) = [gate; up] per expert, down_proj (E, H, I). Only
names missing from the checkpoint are asked for, so the stacked layout loads too.
"""

from __future__ import annotations

import torch

__all__ = ["checkpoint_tensor"]


def _experts(reader, prefix: str, parts: tuple[str, ...]) -> torch.Tensor | None:
    """Stack `<prefix>.experts.N.<part>.weight` over N = 0, 1, ... (the parts of one expert
    concatenated along dim 0); None if expert 0 is missing."""
    rows = []
    for e in range(1 << 20):
        names = [f"{prefix}.experts.{e}.{p}.weight" for p in parts]
        if not all(reader.has(n) for n in names):
            break
        rows.append(torch.cat([reader.get(n) for n in names], dim=0))
    return torch.stack(rows) if rows else None


def checkpoint_tensor(reader, name: str) -> torch.Tensor | None:
    """The tensor for module name `name` from the per-expert layout, or None."""
    if name.endswith(".experts.gate_up_proj"):
        return _experts(reader, name[: -len(".experts.gate_up_proj")], ("gate_proj", "up_proj"))
    if name.endswith(".experts.down_proj"):
        return _experts(reader, name[: -len(".experts.down_proj")], ("down_proj",))
    return None
