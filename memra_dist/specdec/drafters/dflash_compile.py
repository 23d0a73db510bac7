"""torch.compile'd pieces of the DFlash network, swapped in while its round graphs are captured.

The block forward runs its norms (fp32), q / k norms and rotary as small eager kernels: over
16 rows of an 8B-wide drafter they cost more than its weight reads (BENCHMARKS.md: 1.9 ms a
block forward against ~0.8 ms of reads). As `graphs.compile_blocks` does for the target, each
piece is one compiled function shared by every layer (parameters are inputs), used only while
a block graph is captured (the replays run its kernels; the step leader's shared block forward
over the draft pool too, dflash_pool_graph.py, its pieces compiled once for every bucket's rows): the input norm, `DFlashAttention.qkv`
(projection, head norms, rotary) or, folded, `qkv_folded` (our GEMM with the input norm, then
the head norms and rotary fused), and `DFlashLayer.finish` (o_proj, residual, post-norm,
SwiGLU, residual; its folded twin is three of our kernels, nothing to fuse). `DFlashNet.block`
itself stays Python: its `kv_of` callback (which training shares) writes the drafter's K/V
between the pieces.

On where `--compile` compiles the dflash path (compile_policy.py: auto does; CUDA only). A piece that fails to
compile (at the capture's eager warm-up, before any capture starts) turns the swap off for the
drafter with one warning line; the eager pieces are the reference either way.
"""

from __future__ import annotations

import functools
import sys
import types
from contextlib import contextmanager

from ...graphs import compile_inference, stage_compiles
from ...model.dflash import DFlashAttention, DFlashLayer, DFlashNet
from ...model.layers import RMSNorm

__all__ = ["compiled_pieces", "target_compiles", "warn_fallback"]


@functools.cache
def _fns(dynamic: bool = False) -> dict[str, object]:
    """Each piece compiled with grad off (graphs.compile_inference: no backward is traced);
    `dynamic`: one compile for every row count (the shared block forward's buckets of requests,
    dflash_pool_graph.py: 6 buckets x 2 row counts would pass dynamo's recompile limit)."""
    return {"norm": compile_inference(RMSNorm.forward, dynamic=dynamic),
            "qkv": compile_inference(DFlashAttention.qkv, dynamic=dynamic),
            "qkv_folded": compile_inference(DFlashAttention.qkv_folded, dynamic=dynamic),
            "finish": compile_inference(DFlashLayer.finish, dynamic=dynamic)}


def target_compiles(target) -> bool:
    """Whether the drafter's pieces compile: what the run's `--compile` means for the dflash path
    (compile_policy.py, handed over as the target runner's `compile_drafter`); a runner built
    without it (tests, older callers) follows its own blocks (graphs.compile_blocks ran)."""
    flag = getattr(target, "compile_drafter", None)
    if flag is not None:
        return bool(flag)
    stage = getattr(target, "stage", None)
    return stage is not None and stage_compiles(stage)


@contextmanager
def compiled_pieces(net: DFlashNet, on: bool = True, dynamic: bool = False):
    """While inside: every layer's input norm, qkv and finish (and the final norm and the
    context norm) call the shared compiled functions; restored on exit (the block graphs swap
    them in; `on=False` leaves the eager methods; `dynamic`: the functions compiled for any
    row count)."""
    if not on:
        yield
        return
    f = _fns(dynamic)
    swapped = []
    for layer in net.layers:
        for obj, name, fn in ((layer.input_layernorm, "forward", f["norm"]), (layer.self_attn, "qkv", f["qkv"]),
                              (layer.self_attn, "qkv_folded", f["qkv_folded"]), (layer, "finish", f["finish"])):
            setattr(obj, name, types.MethodType(fn, obj))
            swapped.append((obj, name))
    for norm in (net.norm, net.hidden_norm):
        norm.forward = types.MethodType(f["norm"], norm)
        swapped.append((norm, "forward"))
    try:
        yield
    finally:
        for obj, name in swapped:
            delattr(obj, name)  # back to the class's eager method


def warn_fallback(e: BaseException) -> None:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    print(f"memra-dist: warning: the DFlash drafter's compiled pieces failed to build ({line}); its graphs "
          f"capture the eager forward", file=sys.stderr)
