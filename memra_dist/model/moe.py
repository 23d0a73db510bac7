"""Kimi (DeepSeek-V3 style) MoE FFN: sigmoid router with a score-correction bias and grouped
top-k, stacked SwiGLU experts, optional always-on shared experts.

Parameter names mirror transformers' in-memory / `save_original_format=False` layout:
`gate.weight` (E, H) + `gate.e_score_correction_bias` (E,) (both fp32, see loader.FP32_KEYS),
`experts.gate_up_proj` (E, 2I, H) (gate rows first, then up), `experts.down_proj` (E, H, I),
`shared_experts.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .config import ModelConfig
from .kimi_config import KimiSpec
from .layers import SwiGLU

__all__ = ["MoE", "Router", "Experts"]


def _expert_mm(xs: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """xs (N, in) rows grouped by expert, weight (E, out, in) -> (N, out): each row times its
    expert's weight. bf16 on CUDA (and the CPU) uses torch._grouped_mm; CUDA in other dtypes
    has no grouped kernel (its fallback reads the offsets back to the host, which a graph
    capture refuses), so there each row is multiplied by its gathered expert matrix: the same
    math, static shapes, no host sync."""
    if xs.is_cuda and xs.dtype != torch.bfloat16:
        return gathered_mm(xs, weight, experts)
    return torch._grouped_mm(xs, weight.transpose(1, 2), offs=offs)


def gathered_mm(xs: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """xs (N, in), weight (E, out, in), experts (N,) -> (N, out): row n times weight[experts[n]]."""
    return torch.bmm(xs[:, None, :], weight[experts].transpose(1, 2))[:, 0]  # (N, 1, in) @ (N, in, out)


class Router(nn.Module):
    """Scores in fp32: sigmoid(x W^T); choice = scores + bias, restricted to the best
    `topk_group` groups (a group scores the sum of its two best choices); the chosen experts
    weigh with their uncorrected scores, renormalised, times `routed_scale`."""

    def __init__(self, hidden: int, spec: KimiSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
        self.spec = spec

    fast_rows = 0  # kernels/ops.py: a one-row step scores through the Triton GEMV (fp32 in and out)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> (weights (T, k) fp32, expert ids (T, k))."""
        s = self.spec
        if x.shape[0] <= self.fast_rows:
            logits = torch.ops.memra.gemv(x.float(), self.weight, None, False)  # (1, E)
        else:
            logits = F.linear(x.float(), self.weight.float())  # (T, E)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        choice = self._group_filter(choice)
        idx = choice.topk(s.top_k, dim=-1, sorted=False)[1]  # (T, k)
        w = scores.gather(1, idx)  # (T, k)
        if s.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * s.routed_scale, idx

    def _group_filter(self, choice: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if s.n_group == 1:
            return choice  # one group: the filter keeps everything
        T = choice.shape[0]
        grouped = choice.view(T, s.n_group, s.num_experts // s.n_group)  # (T, G, E/G)
        gscore = grouped.topk(2, dim=-1)[0].sum(-1)  # (T, G)
        keep = torch.zeros_like(gscore, dtype=torch.bool)
        keep.scatter_(1, gscore.topk(s.topk_group, dim=-1, sorted=False)[1], True)
        keep = keep[:, :, None].expand_as(grouped).reshape(T, s.num_experts)  # (T, E)
        return choice.masked_fill(~keep, float("-inf"))


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights. Two forms with the same math:
    - `forward_loop` (the reference; CPU): each expert that any row picked, one host sync to
      list them;
    - `forward_grouped` (CUDA): the T*k (row, expert) slots sorted by expert and run as two
      grouped GEMMs (`torch._grouped_mm`, per-expert row offsets computed on the device), so
      no host sync and static shapes (CUDA-graph capturable); an empty expert reads no weights.
      A row's contributions are summed in ascending expert order, as the reference adds them."""

    def __init__(self, hidden: int, spec: KimiSpec):
        super().__init__()
        e, i = spec.num_experts, spec.moe_inter
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i))
        self.grouped = False  # bf16 on CUDA: set by Stage.to_device through MoE.use_grouped

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x (T, H), w / idx (T, k) -> (T, H): sum over a row's experts of w * expert(x)."""
        return self.forward_grouped(x, w, idx) if self.grouped else self.forward_loop(x, w, idx)

    def forward_grouped(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        T, k = idx.shape
        idx, perm = idx.sort(dim=-1)  # each row's experts in ascending order (the reference's sum order)
        w = w.gather(1, perm)
        flat = idx.reshape(-1)  # (T*k,) slot -> expert
        order = flat.argsort(stable=True)  # slots grouped by expert
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # no bincount: it syncs
        offs = counts.cumsum(0, dtype=torch.int32)  # (E,) end row of each expert's group
        xs = x[order // k]  # (T*k, H) the slot rows, grouped
        ex = flat[order]  # (T*k,) each grouped slot's expert
        gate, up = _expert_mm(xs, self.gate_up_proj, offs, ex).chunk(2, dim=-1)
        ys = _expert_mm(F.silu(gate) * up, self.down_proj, offs, ex)  # (T*k, H)
        y = torch.empty_like(ys)
        y[order] = ys  # back to slot order: (T, k) row-major
        y = (y.view(T, k, -1) * w[:, :, None]).to(x.dtype)  # (T, k, H)
        out = torch.zeros_like(x)
        for j in range(k):  # sequential, ascending expert: the reference's accumulation order
            out.add_(y[:, j])
        return out

    def forward_loop(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():  # host sync: the experts hit (small T in decode)
            rows, slot = torch.where(idx == e)  # (n,), (n,)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)  # (n, I) each
            y = F.linear(F.silu(gate) * up, self.down_proj[e])  # (n, H)
            # index_put_ (accumulate), not index_add_: the latter costs ~50 ms a call on CPU torch 2.13
            out.index_put_((rows,), (y * w[rows, slot, None]).to(out.dtype), accumulate=True)
        return out


class MoE(nn.Module):
    """Routed experts + shared experts (a SwiGLU of width moe_inter * n_shared, if any)."""

    def __init__(self, cfg: ModelConfig, spec: KimiSpec):
        super().__init__()
        self.gate = Router(cfg.hidden_size, spec)
        self.experts = Experts(cfg.hidden_size, spec)
        if spec.n_shared > 0:  # zero shared experts: the reference's zero-width MLP adds 0
            self.shared_experts = SwiGLU(cfg.hidden_size, spec.moe_inter * spec.n_shared)
        self.has_shared = spec.n_shared > 0

    @property
    def graph_safe(self) -> bool:  # the per-expert loop syncs on the experts hit
        return self.experts.grouped

    def use_grouped(self, on: bool) -> None:
        self.experts.grouped = on

    fast_rows = 0  # kernels/ops.py: steps of up to this many rows run the experts as per-slot GEMVs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) -> (T, H)."""
        w, idx = self.gate(x)
        if x.shape[0] <= self.fast_rows:  # kernels/moe_gemv.py: the shared output added in its last kernel
            shared = self.shared_experts(x) if self.has_shared else None
            e = self.experts
            return torch.ops.memra.moe_experts(x, e.gate_up_proj, e.down_proj, w, idx, shared)
        y = self.experts(x, w, idx)
        return y + self.shared_experts(x) if self.has_shared else y
