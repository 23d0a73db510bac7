"""Safetensors loading by layer range: a stage reads only the tensors it owns.

Module keys mirror the HF names, so the mapping is one prefix: `lm_head.*` stays, anything
else is `model.<key>`. Tied embeddings: a head without `lm_head.weight` in the checkpoint
reads `model.embed_tokens.weight`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ..errors import UserError
from .config import ModelConfig, load_config
from .kimi_names import checkpoint_tensor
from .moe_names import checkpoint_tensor as moe_checkpoint_tensor
from .transformer import Stage

__all__ = ["CheckpointReader", "load_stage", "hf_name", "FP32_KEYS", "register_checkpoint_names"]

# parameters the references keep in fp32 whatever the model dtype (gates, decay, router)
FP32_KEYS = ("dt_bias", "A_log", "e_score_correction_bias", "mlp.gate.weight")


# family -> (reader, hf name) -> tensor | None: the family's other checkpoint layouts, asked
# only for names missing from the checkpoint
_NAME_HOOKS: dict[str, Callable[["CheckpointReader", str], torch.Tensor | None]] = {
    "kimi_linear": checkpoint_tensor,  # Moonshot's original layout (model/kimi_names.py)
    "deepseek_v3": moe_checkpoint_tensor,  # per-expert tensors (model/moe_names.py)
    "glm4_moe": moe_checkpoint_tensor,
}


def register_checkpoint_names(arch: str, hook: Callable[["CheckpointReader", str], torch.Tensor | None]) -> None:
    _NAME_HOOKS[arch] = hook


def hf_name(key: str) -> str:
    return key if key.startswith("lm_head.") else f"model.{key}"


def _weight_map(model_dir: Path) -> dict[str, Path] | None:
    """A sharded checkpoint's index: tensor name -> its file; None without an index."""
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        return None
    try:
        wm = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise UserError(f"{index}: malformed index ({e})") from None
    return {k: model_dir / v for k, v in wm.items()}


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files a CheckpointReader reads: those its index names, else every
    `*.safetensors` of the directory (in name order)."""
    d = Path(model_dir)
    wm = _weight_map(d)
    return sorted(set(wm.values())) if wm is not None else sorted(d.glob("*.safetensors"))


class CheckpointReader:
    """Maps tensor names to safetensors files (single file, sharded index or a glob)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        wm = _weight_map(self.dir)
        if wm is not None:
            self.where = wm
        else:
            files = checkpoint_files(self.dir)
            if not files:
                raise UserError(f"{self.dir}: no *.safetensors weights found")
            self.where = {}
            for f in files:
                try:
                    with safe_open(str(f), framework="pt") as fh:
                        for k in fh.keys():
                            self.where[k] = f
                except Exception as e:  # noqa: BLE001 (safetensors raises its own types; unreadable = one line)
                    raise UserError(f"{f}: cannot read safetensors file ({str(e).splitlines()[0][:200]})") from None
        self._open: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise UserError(f"{self.dir}: tensor missing from the checkpoint: {name}")
        f = self.where[name]
        if f not in self._open:
            try:
                self._open[f] = safe_open(str(f), framework="pt")
            except (OSError, Exception) as e:  # safetensors raises its own error types
                raise UserError(f"{f}: cannot read safetensors file ({e})") from None
        return self._open[f].get_tensor(name)


def load_stage(
    model_dir: str | Path,
    first: int,
    last: int,
    has_embed: bool,
    has_head: bool,
    device: torch.device,
    dtype: torch.dtype,
    cfg: ModelConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Stage:
    """Build the Stage for layers [first, last) and load exactly its tensors. `progress(done,
    total)` gets the bytes read so far after each tensor."""
    cfg = cfg or load_config(model_dir)
    if not 0 <= first <= last <= cfg.num_layers:
        raise UserError(f"layer range [{first}, {last}) outside the model's {cfg.num_layers} layers")
    with torch.device("meta"):
        stage = Stage(cfg, first, last, has_embed, has_head)
    reader = CheckpointReader(model_dir)
    state = {}
    metas = stage.state_dict()
    size = {k: 4 if k.endswith(FP32_KEYS) else torch.empty((), dtype=dtype).element_size() for k in metas}
    total = sum(m.numel() * size[k] for k, m in metas.items())  # the bytes as loaded (the meta stage is fp32)
    done = 0
    for key, meta in metas.items():
        name = hf_name(key)
        if key == "lm_head.weight" and not reader.has(name):
            name = "model.embed_tokens.weight"  # tied embeddings
        hook = None if reader.has(name) else _NAME_HOOKS.get(cfg.arch)
        t = hook(reader, name) if hook is not None else None
        t = reader.get(name) if t is None else t  # still missing: reader.get names it
        if tuple(t.shape) != tuple(meta.shape):
            raise UserError(
                f"{model_dir}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(meta.shape)}"
            )
        state[key] = t.to(device=device, dtype=torch.float32 if key.endswith(FP32_KEYS) else dtype)
        done += meta.numel() * size[key]
        if progress is not None:
            progress(done, total)
    stage.load_state_dict(state, assign=True, strict=True)
    return stage.to_device(device).eval().requires_grad_(False)  # inference only: compile traces no backward


def load_embedding(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Embedding:
    """The target's token embedding alone: a pipeline head holds the last layers, and a
    drafter that embeds tokens with the target's table (DFlash, MTP) needs it there too."""
    t = CheckpointReader(model_dir).get(hf_name("embed_tokens.weight"))
    if tuple(t.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise UserError(f"{model_dir}: embedding has shape {tuple(t.shape)}, expected {(cfg.vocab_size, cfg.hidden_size)}")
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
    emb.load_state_dict({"weight": t.to(device=device, dtype=dtype)}, assign=True)
    return emb.eval()
