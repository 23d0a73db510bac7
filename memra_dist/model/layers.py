"""Small building blocks shared by every architecture: RMSNorm, rotary tables, the SwiGLU FFN."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["RMSNorm", "SwiGLU", "rope_tables", "apply_rope"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
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


def rope_tables(
    head_dim: int, max_pos: int, theta: float, rope: dict | None = None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables, each (max_pos, head_dim), fp32, in the HF rotate-half layout."""
    cpu = torch.device("cpu")  # explicit: stages are built under a meta-device context
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim))
    if rope and rope.get("rope_type") == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    t = torch.arange(max_pos, dtype=torch.float32, device=cpu)
    freqs = torch.outer(t, inv_freq)  # (max_pos, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (max_pos, head_dim)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, nh, hd); cos/sin (T, hd) already gathered at the rows' positions."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # (T, 1, hd)
    return x * c + rot * s
