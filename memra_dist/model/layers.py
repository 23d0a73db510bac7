"""Small building blocks shared by every architecture: RMSNorm, rotary tables, the SwiGLU FFN."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .rope_scaling import yarn_inv_freq

__all__ = ["RMSNorm", "SwiGLU", "rows_on", "rope_inv_freq", "rope_scale", "rope_rows", "apply_rope"]


def rows_on(m: nn.Module) -> bool:
    """Whether module `m` (RMSNorm, SwiGLU) runs its many rows' elementwise work as the one-pass
    kernel: installed (kernels/ops.py sets `rows_kernel`), and not inside a region torch.compile
    traces (it fuses the reference ops itself)."""
    return m.rows_kernel and not torch.compiler.is_compiling()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    rows_kernel = False  # kernels/ops.py: one pass (kernels/rows.py) instead of the six ops below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rows_on(self):
            return torch.ops.memra.rms_norm(x, self.weight, self.eps)
        # normalise in fp32 like the HF reference, scale in the input dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with the HF names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def fuse(self) -> None:
        """One gate+up GEMM (the fast path; the reference keeps both projections)."""
        g, u = self.gate_proj, self.up_proj
        fused = nn.Linear(g.in_features, g.out_features * 2, bias=False, device=g.weight.device, dtype=g.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([g.weight, u.weight]))
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    fast_rows = 0  # kernels/ops.py: steps of up to this many rows fold silu(g) * u into the down kernel
    rows_kernel = False  # kernels/ops.py: more rows compute silu(g) * u in one pass (kernels/rows.py)

    def fused_step(self, x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        """x + self(norm(x)) in two kernels. One decode row, two GEMVs (kernels/gemv.py): gate_up
        with the norm folded in, down with the gating and the residual add folded in. Verify
        rows, two row GEMMs (kernels/gemm_rows.py): gate_up with the norm folded in writing the
        gated rows, down with the residual add folded in."""
        if x.shape[0] == 1:
            gu = torch.ops.memra.gemv(x, self.gate_up_proj.weight, None, False, norm.weight, norm.eps, None)
            return torch.ops.memra.gemv(gu, self.down_proj.weight, self.down_proj.bias, True, None, 0.0, x)
        h = torch.ops.memra.glu_rows(x, self.gate_up_proj.weight, norm.weight, norm.eps)
        return torch.ops.memra.gemv(h, self.down_proj.weight, self.down_proj.bias, False, None, 0.0, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.fast_rows:
            return torch.ops.memra.gemv(self.gate_up_proj(x), self.down_proj.weight, self.down_proj.bias, True)
        if hasattr(self, "gate_up_proj"):
            if rows_on(self):  # the gating in one pass (kernels/rows.py)
                return self.down_proj(torch.ops.memra.silu_mul(self.gate_up_proj(x)))
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama-3 frequency scaling: long wavelengths divided by `factor`, smooth in between."""
    factor = float(p["factor"])
    lo, hi = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
    return torch.where(is_mid, mid, scaled)


def rope_inv_freq(head_dim: int, theta: float, rope: dict | None = None) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies (llama3 or YaRN scaling applied when configured;
    YaRN's cos / sin scale is `rope_scale(rope)`, passed to `rope_rows`)."""
    if rope and rope.get("rope_type") == "yarn":
        return yarn_inv_freq(head_dim, theta, rope)
    cpu = torch.device("cpu")  # explicit: stages are built under a meta-device context
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim))
    if rope and rope.get("rope_type") == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def rope_scale(rope: dict | None) -> float:
    """The factor cos / sin are multiplied by (YaRN's attention_factor; 1.0 otherwise)."""
    return float(rope.get("attention_factor", 1.0)) if rope and rope.get("rope_type") == "yarn" else 1.0


def rope_rows(pos: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, head_dim) fp32 for the rows at `pos`, in the HF rotate-half layout, times
    `scale` (`rope_scale`). Computed per step, not read from a table: one multiply per
    element, exactly the reference's values, and no table whose size grows with the context."""
    freqs = pos.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, nh, hd); cos/sin (T, d) already gathered at the rows' positions. d < hd: partial
    rotary (glm4_moe), the first d dims rotate and the rest pass through."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :d], cos, sin), x[..., d:]), dim=-1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # (T, 1, hd)
    return x * c + rot * s
