"""Native MTP layers (DeepSeek-V3 / GLM-4.5 style): the module, the checkpoint check, loading.

Tensors, for MTP layer j at index N = num_hidden_layers + j (j < num_nextn_predict_layers):
`model.layers.N.{enorm, hnorm, shared_head.norm}.weight` [H], `eh_proj.weight` [H, 2H], and a
decoder layer of the target's MoE kind (`input_layernorm`, `self_attn.*`,
`post_attention_layernorm`, `mlp.*`). `shared_head.head` and `embed_tokens` are copies of the
main model's; the target's own are used (as transformers' MtpModel does), so they are not read.

One step of layer j over rows (token e, hidden h):
    y = block(eh_proj([enorm(E(e)) ; hnorm(h)]))        block: attention over its own KV cache
    out = shared_head.norm(y);  logits = lm_head_target(out)
`out` (the normed output) is the hidden the next step is fed, as in transformers' `MtpLayer`
(its `post_norm` is the checkpoint's `shared_head.norm`). The drafter
(specdec/drafters/mtp.py) decides which rows run and with which inputs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from .attention import causal_mask
from .config import ModelConfig, safetensors_header
from .layers import RMSNorm, rope_inv_freq, rope_rows, rope_scale
from .loader import FP32_KEYS, CheckpointReader, hf_name
from .moe_config import MOE_ARCHS
from .moe_names import checkpoint_tensor
from .prefix_attention import PREFIX_MIN_ROWS
from .transformer import Block, StepCtx

__all__ = ["MTPLayer", "MTPHead", "mtp_layer_count", "check_mtp", "load_mtp"]

class MTPLayer(Block):
    """A decoder block (the target's MoE layer kind) plus the MTP input / output parts."""

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__(cfg, idx)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_eps)
        self.hnorm = RMSNorm(h, cfg.rms_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.ModuleDict({"norm": RMSNorm(h, cfg.rms_eps)})

    def step(self, emb: torch.Tensor, hidden: torch.Tensor, ctx: StepCtx, state) -> torch.Tensor:
        """emb, hidden (T, H) -> the normed output (T, H); K/V rows land in `state` at ctx.pos."""
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(hidden)), dim=-1))  # (T, H)
        return self.shared_head["norm"](self(x, ctx, state))


class MTPHead(nn.Module):
    """The MTP layers of a target; module keys are the checkpoint's names without `model.`."""

    def __init__(self, cfg: ModelConfig, n: int):
        super().__init__()
        self.cfg, self.n = cfg, n
        self.layers = nn.ModuleDict({str(cfg.num_layers + j): MTPLayer(cfg, cfg.num_layers + j) for j in range(n)})
        dims = {b.self_attn.rope_dim for b in self.layers.values() if getattr(b.self_attn, "rope_dim", None)}
        self._inv_freq = {d: rope_inv_freq(d, cfg.rope_theta, cfg.rope) for d in dims}

    def layer(self, j: int) -> MTPLayer:
        return self.layers[str(self.cfg.num_layers + j)]

    def step_ctx(self, pos: torch.Tensor, capacity: int, start: int | None = None) -> StepCtx:
        """`start`: the first of contiguous rows (the prime's chunks): more than
        PREFIX_MIN_ROWS of them attend as a prefill chunk, with no (rows x capacity) mask."""
        rope = self.rope(pos)
        if start is not None and pos.shape[0] > PREFIX_MIN_ROWS:
            return StepCtx(pos=pos, mask=None, rope=rope, prefix=start)
        return StepCtx(pos=pos, mask=causal_mask(pos, capacity), rope=rope)

    def rope(self, pos: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The rotary rows (cos, sin) of every rotary width at `pos`."""
        return {d: rope_rows(pos, f, rope_scale(self.cfg.rope)) for d, f in self._inv_freq.items()}

    def to_device(self, device, dtype) -> "MTPHead":
        self._inv_freq = {d: f.to(device) for d, f in self._inv_freq.items()}
        for blk in self.layers.values():  # the MoE's grouped GEMMs where the target uses them (bf16 CUDA)
            blk.mlp.use_grouped(torch.device(device).type == "cuda" and dtype == torch.bfloat16)
        return self


def _tensor_names(model_dir: Path) -> set[str]:
    """Every tensor name the checkpoint holds (the index, else the safetensors headers)."""
    import json  # noqa: PLC0415

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index}: malformed index ({str(e).splitlines()[0][:200]})") from None
    return {n for f in sorted(model_dir.glob("*.safetensors")) for n in safetensors_header(f)}


def mtp_layer_count(cfg: ModelConfig, model_dir: str | Path) -> int:
    """How many MTP layers both the config declares and the checkpoint holds (their
    `eh_proj` present), counted from the first: 0 when either has none."""
    if cfg.arch not in MOE_ARCHS:
        return 0
    names = _tensor_names(Path(model_dir))
    n = 0
    while n < cfg.family.num_mtp and f"model.layers.{cfg.num_layers + n}.eh_proj.weight" in names:
        n += 1
    return n


def check_mtp(cfg: ModelConfig, model_dir: str | Path) -> int:
    """The MTP layer count of a target asked for `--drafter mtp`; one UserError line if none."""
    where = str(model_dir)
    if cfg.arch not in MOE_ARCHS:
        raise UserError(f"{where}: --drafter mtp needs a target with MTP layers ({', '.join(MOE_ARCHS)}); "
                        f"this is a {cfg.arch} checkpoint")
    if cfg.family.num_mtp < 1:
        raise UserError(f"{where}: --drafter mtp: config.json declares no MTP layer (num_nextn_predict_layers = 0)")
    n = mtp_layer_count(cfg, model_dir)
    if n < 1:
        raise UserError(f"{where}: --drafter mtp: the checkpoint holds no MTP tensors "
                        f"(model.layers.{cfg.num_layers}.eh_proj.weight is missing)")
    return n


def load_mtp(model_dir: str | Path, cfg: ModelConfig, n: int, device, dtype) -> MTPHead:
    """Build the n MTP layers and load exactly their tensors (shapes checked, one line on a
    mismatch); the router stays fp32 as in the target (loader.FP32_KEYS)."""
    with torch.device("meta"):
        head = MTPHead(cfg, n)
    reader = CheckpointReader(model_dir)
    state = {}
    for key, meta in head.state_dict().items():
        name = hf_name(key)  # model.layers.N.<part>
        t = None if reader.has(name) else checkpoint_tensor(reader, name)
        t = reader.get(name) if t is None else t
        if tuple(t.shape) != tuple(meta.shape):
            raise UserError(f"{model_dir}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(meta.shape)}")
        state[key] = t.to(device=device, dtype=torch.float32 if key.endswith(FP32_KEYS) else dtype)
    head.load_state_dict(state, assign=True, strict=True)
    return head.to_device(device, dtype).eval()
