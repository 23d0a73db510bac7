"""The kernels as torch custom ops (opaque to torch.compile, capturable in CUDA graphs), the
one-row linear that uses them, and the switches that install them on a stage's blocks and on
a target's MTP layers."""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F

from .decode_attention import decode_attention
from .gemm_rows import BATCH_ROWS, MAX_ROWS, gemm_rows
from .gemv import gemv
from .moe_gemv import moe_experts
from .rows import add_rms_norm_rows, rms_norm_rows, silu_mul_rows

__all__ = ["FastLinear", "install_stage", "install_mtp", "install_eagle3", "eagle3_foldable", "MAX_ATTN_ROWS",
           "MAX_MOE_ROWS", "BATCH_FOLD_ROWS"]

MAX_ATTN_ROWS = 64  # decode / verify rows; a prefill keeps the reference attention
MAX_MOE_ROWS = 16  # decode / verify / drafter rows through the per-slot expert GEMVs; more: the grouped GEMM
# a batched step folds its blocks (norms and residual adds inside the row GEMMs) up to this many
# rows: measured on an H200 at the 8B's shapes (benchmarks/row_gemm_check.py), a layer's folded
# row GEMMs beat cuBLAS with its separate norm / gating / residual kernels by 25 % at 32 rows and
# 16 % at 64, and lost by 15-25 % at 96 and 128 (the norm fold on a 128-wide column block)
BATCH_FOLD_ROWS = 64
assert BATCH_FOLD_ROWS <= BATCH_ROWS


@torch.library.custom_op("memra::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
            norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """One row: the GEMV (kernels/gemv.py); 2 .. BATCH_ROWS rows: the row GEMM (kernels/gemm_rows.py)."""
    if x.shape[0] == 1:
        return gemv(x, w, bias, silu_mul, norm, eps, residual)
    return gemm_rows(x, w, bias, silu_mul, norm, eps, residual)


@gemv_op.register_fake
def _(x, w, bias, silu_mul, norm=None, eps=0.0, residual=None):
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.custom_op("memra::glu_rows", mutates_args=())
def glu_rows_op(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """silu(g) * u of RMSNorm(x) through a fused gate-up weight, for 2 .. BATCH_ROWS rows."""
    return gemm_rows(x, w, None, False, norm, eps, None, glu=True)


@glu_rows_op.register_fake
def _(x, w, norm, eps):
    return x.new_empty((x.shape[0], w.shape[0] // 2))


@torch.library.custom_op("memra::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                   idx: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    return moe_experts(x, gate_up, down, weights, idx, shared)


@moe_experts_op.register_fake
def _(x, gate_up, down, weights, idx, shared=None):
    return torch.empty_like(x)


@torch.library.custom_op("memra::decode_attention", mutates_args=())
def attention_op(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return decode_attention(q, kc, vc, pos)


@attention_op.register_fake
def _(q, kc, vc, pos):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@torch.library.custom_op("memra::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over many rows in one pass (kernels/rows.py)."""
    return rms_norm_rows(x, w, eps)


@rms_norm_op.register_fake
def _(x, w, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(w.dtype, x.dtype))


@torch.library.custom_op("memra::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, RMSNorm(x + r)) in one pass: a residual add and the next half's pre-norm."""
    return add_rms_norm_rows(x, r, w, eps)


@add_rms_norm_op.register_fake
def _(x, r, w, eps):
    return torch.empty_like(x), x.new_empty(x.shape, dtype=torch.promote_types(w.dtype, x.dtype))


@torch.library.custom_op("memra::silu_mul", mutates_args=())
def silu_mul_op(gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of a fused gate-up output, in one pass."""
    return silu_mul_rows(gu)


@silu_mul_op.register_fake
def _(gu):
    return gu.new_empty((gu.shape[0], gu.shape[1] // 2))


def _no_backward(qualname: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"{qualname} is inference-only and has no backward: call it (and any torch.compile'd "
                           f"region around it) under torch.no_grad() or torch.inference_mode()")
    return backward


def _no_context(ctx, inputs, output) -> None:
    pass


# An autograd formula that refuses: a backward through one of the kernels raises this clear error
# (at the call, or where AOTAutograd traces a compiled region with grad on), never a silent one.
for _name, _op in (("gemv", gemv_op), ("glu_rows", glu_rows_op), ("moe_experts", moe_experts_op),
                   ("decode_attention", attention_op), ("rms_norm", rms_norm_op), ("add_rms_norm", add_rms_norm_op),
                   ("silu_mul", silu_mul_op)):
    _op.register_autograd(_no_backward(f"memra::{_name}"), setup_context=_no_context)


class FastLinear(nn.Linear):
    """nn.Linear whose one-row calls stream the weight through the Triton GEMV. Several rows
    stay on cuBLAS here; verify rows reach the row GEMM through the blocks' folded halves
    (`fused_step`) and the head, where the folds pay. (Bare, it beat cuBLAS by ~7 % on the 8B
    shapes; the other families' shapes are not measured.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1:
            return gemv_op(x, self.weight, self.bias, False)
        return F.linear(x, self.weight, self.bias)


def _fast(lin: nn.Module) -> int:
    if type(lin) is nn.Linear:
        lin.__class__ = FastLinear  # same parameters, new forward
        return 1
    return 0


def _install_moe(moe) -> int:
    """A MoE FFN: the router's one-row scores and a few rows' experts on the kernels
    (kernels/moe_gemv.py), the shared experts as a gate-up GEMV and a gated down GEMV."""
    moe.fast_rows = MAX_MOE_ROWS
    moe.gate.fast_rows = 1
    n = 2
    if moe.has_shared:
        sh = moe.shared_experts
        if not hasattr(sh, "gate_up_proj"):
            sh.fuse()
        sh.fast_rows = 1
        n += 1 + _fast(sh.gate_up_proj)
    return n


def _rows_kernels(module, norm_cls, glu_cls) -> int:
    """Every RMSNorm and fused-gate SwiGLU in `module` computes its many rows' elementwise work
    in one pass (kernels/rows.py): a prefill chunk's, or a batched step's past the folds."""
    n = 0
    for m in module.modules():
        if type(m) is norm_cls or (type(m) is glu_cls and hasattr(m, "gate_up_proj")):
            m.rows_kernel = True
            n += 1
    return n


def install_block(blk) -> int:
    """One decoder block onto the kernels: Llama-family attention (GQA) and SwiGLU with their
    norms and residual adds folded in on a decode row; MLA's one-row projections as GEMVs;
    MoE FFNs (`_install_moe`). Other mixers (KDA) keep theirs."""
    from ..model.attention import Attention  # noqa: PLC0415
    from ..model.layers import RMSNorm, SwiGLU  # noqa: PLC0415
    from ..model.mla import MLA  # noqa: PLC0415
    from ..model.moe import MoE  # noqa: PLC0415

    attn, mlp = blk.self_attn, blk.mlp
    n = 0
    fast_attn = type(attn) is Attention and attn.hd >= 16 and attn.hd & (attn.hd - 1) == 0
    fast_mlp = type(mlp) is SwiGLU and hasattr(mlp, "gate_up_proj")
    if fast_attn:
        attn.fast_attn_rows = MAX_ATTN_ROWS
        for name in ("_fast", "fused_step"):  # they write the cache: torch.compile breaks around them
            setattr(attn, name, torch.compiler.disable(getattr(attn, name)))
        n += 1 + sum(_fast(m) for m in attn.children())
    elif isinstance(attn, MLA):  # its absorbed attention reads kv_b_proj's weight itself, unchanged
        n += sum(_fast(m) for m in attn.children())
    if fast_mlp:
        mlp.fast_rows = 1
        n += 1 + _fast(mlp.gate_up_proj)
    elif isinstance(mlp, MoE):
        n += _install_moe(mlp)
    n += _rows_kernels(blk, RMSNorm, SwiGLU)  # (after _install_moe: its shared experts' gate-up is fused now)
    if fast_attn and attn.rope_kernel_ok():
        attn.rows_rope = True  # a prefill chunk's rotary and cache writes in one kernel
    if fast_attn and fast_mlp and attn.rope_kernel_ok():
        blk.fused_rows = MAX_ROWS  # decode and verify rows: norms and residual adds inside the GEMVs / row GEMMs
        blk.batch_rows = BATCH_FOLD_ROWS  # a batched step's rows over the paged K/V, where the fold pays
    return n


def _warm_rows(stage) -> None:
    """Build the row kernels (kernels/rows.py) at install, on two rows of the stage's widths: no
    graph captures them (the decode and verify steps fold their norms), so the first prompt past
    the folds would build them inside its prefill (Triton's compile; later processes read its
    cache)."""
    blk = next(iter(stage.layers.values()), None)
    post = getattr(blk, "post_attention_layernorm", None)
    if not getattr(post, "rows_kernel", False):
        return
    w = post.weight
    x = torch.zeros(2, w.shape[0], device=w.device, dtype=w.dtype)
    with torch.no_grad():
        rms_norm_rows(x, w, post.eps)
        add_rms_norm_rows(x, x, w, post.eps)
        mlp = blk.mlp
        if getattr(mlp, "rows_kernel", False) and hasattr(mlp, "gate_up_proj"):
            silu_mul_rows(torch.zeros(2, mlp.gate_up_proj.weight.shape[0], device=w.device, dtype=w.dtype))


def _warm_merge(stage, on=("cuda",)) -> None:
    """Build the one-pass merge of a prefix chunk's attention parts (kernels/merge.py) at
    install, on a row of the stage's heads, and switch the prefix arm to it
    (`prefix_attention.FUSED_MERGE`); where it cannot build, the arm keeps the torch ops (one
    warning). Only a CUDA stage's chunks take the cuDNN arm that merges (`on`: the device types
    it is built for; a test's CPU, on Triton's interpreter)."""
    from ..model import prefix_attention  # noqa: PLC0415
    from ..model.attention import Attention  # noqa: PLC0415

    attn = next((b.self_attn for b in stage.layers.values() if type(b.self_attn) is Attention), None)
    if attn is None or prefix_attention.FUSED_MERGE:
        return
    w = next(attn.parameters())
    if w.device.type not in on:
        return
    try:
        from .merge import merge_attention  # noqa: PLC0415

        o = torch.zeros(1, attn.nh, 1, attn.hd, device=w.device, dtype=w.dtype)
        lse = torch.zeros(1, attn.nh, 1, device=w.device, dtype=torch.float32)
        merge_attention(o, lse, o, lse, w.dtype)
        prefix_attention.FUSED_MERGE = True
    except Exception as e:  # noqa: BLE001 (a fast path: the torch ops stay)
        print(f"[memra] warning: the prefix attention's one-pass merge did not build ({type(e).__name__}: "
              f"{(str(e).strip().splitlines() or [''])[0][:200]}); it keeps the torch ops", file=sys.stderr, flush=True)


def install_stage(stage) -> int:
    """Every block of the stage (`install_block`) and the head (the final norm inside the
    lm_head GEMV) switch to the kernels. Call after the QKV / gate-up fusion."""
    stage.requires_grad_(False)  # an inference stage (compiled regions run with grad off too: graphs.compile_inference)
    n = sum(install_block(blk) for blk in stage.layers.values())
    if getattr(stage, "norm", None) is not None:
        stage.norm.rows_kernel = True
    _warm_rows(stage)
    _warm_merge(stage)
    if getattr(stage, "has_head", False):
        n += _fast(stage.lm_head)
        # a verify's rows, and a batched step's up to 64: the lm_head's folded row GEMM beat cuBLAS with
        # the norm apart at 16, 32 and 64 rows on an H200 (row_gemm_check.py: 241 / 249 / 278 us
        # against 269 / 279 / 298 at the 8B's 128k vocabulary)
        stage.fused_head = BATCH_FOLD_ROWS
    return n


def install_mtp(head) -> int:
    """A target's MTP layers (model/mtp.py) onto the kernels, as their target's blocks: each
    layer's block and its eh_proj (a chained draft step is one row)."""
    head.requires_grad_(False)
    return sum(install_block(layer) + _fast(layer.eh_proj) for layer in head.layers.values())


def eagle3_foldable(net) -> bool:
    """Whether an EAGLE-3 head's layer fits the kernels: a power-of-two head dim of at least 16
    (the attention and rotary kernels' tiles), rotary over the whole head."""
    hd = net.ec.base.head_dim
    return hd >= 16 and hd & (hd - 1) == 0


def install_eagle3(net) -> bool:
    """An EAGLE-3 head (model/eagle3.py) onto the kernels, as its target's blocks: q, k, v fused
    into one weight and the FFN's gate and up into another, so a few rows' step (the round's
    first forward, each chained step) runs `Eagle3Net.step_folded` and the logits take the final
    norm inside the lm_head's GEMV. Returns whether it was installed."""
    if not eagle3_foldable(net):
        return False
    net.requires_grad_(False)
    layer = net.midlayer
    if not hasattr(layer.self_attn, "qkv_proj"):
        layer.self_attn.fuse()
    if not hasattr(layer.mlp, "gate_up_proj"):
        layer.mlp.fuse()
    layer.mlp.fast_rows = 1
    net.folded = True
    try:  # a probe before any capture: a kernel that cannot build here leaves the reference step
        _probe_eagle3(net)
    except Exception as e:  # noqa: BLE001 (any failure: compiler, launch, shapes)
        net.folded = False
        print(f"memra-dist: warning: the EAGLE-3 head's folded step failed its probe ({type(e).__name__}: "
              f"{(str(e).strip().splitlines() or [''])[0][:160]}); it drafts on the reference step", file=sys.stderr)
    return net.folded


def _probe_eagle3(net) -> None:
    """One folded step of one row and one of two (the GEMV and the row GEMM arms), and their
    logits, over a scratch cache of a few rows: builds every kernel the rounds will launch."""
    c, w = net.ec.base, net.lm_head.weight
    kc = torch.zeros(4, c.num_kv_heads, c.head_dim, device=w.device, dtype=w.dtype)
    vc = torch.zeros_like(kc)
    with torch.inference_mode():
        for rows in (1, 2):
            x = torch.zeros(rows, c.hidden_size, device=w.device, dtype=w.dtype)
            h = net.step_folded(x, x, torch.arange(rows, device=w.device), kc, vc)
            net.logits(h[-1:])
