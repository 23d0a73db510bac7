"""Which KDA scan runs: the pure-PyTorch reference (kda.py) or flash-linear-attention's kernels.

Choice (`fla_for`, the one hook kda.py calls):
  - not CUDA (CPU, tests, CI)                      -> the reference, always;
  - CUDA, MEMRA_KDA_KERNELS=torch                  -> the reference;
  - CUDA, fla (`fla.ops.kda`, needs triton) imports -> fla (MEMRA_KDA_KERNELS unset / auto / fla);
  - CUDA, fla missing                              -> the reference, or an error with
    MEMRA_KDA_KERNELS=fla (so a run that asked for the kernels never measures the fallback).
  Per call the reference also stays where fla's kernels do not apply: head dims that are not
  multiples of 16 or Dk > 256 (tl.dot tiles), and autograd (the ring kernel has no backward).
  The env var and the import are read once; `reset()` forgets both (tests, the GPU check).

Mapping our conventions to fla's (`fla_args`, pure, tested on CPU against fla's naive forms):
  - layout: ours is one sequence (T, H, D); fla takes (B, T, H, D): a leading batch dim of 1,
    made contiguous (the kernels index raw pointers; our v is a strided split of the conv);
  - q: ours is l2-normalised AND scaled by Dk^-1/2 before the scan -> scale=1.0 and
    use_qk_l2norm_in_kernel=False (fla would otherwise normalise and scale a second time);
  - g: ours is already the log-space per-channel decay -exp(A_log) softplus(.) ->
    use_gate_in_kernel=False; beta is post-sigmoid -> use_beta_sigmoid_in_kernel=False;
  - state: ours (H, Dk, Dv) fp32 is fla's default K-first layout (state_v_first=False) of one
    sequence: initial_state = S[None] (fla requires fp32 states), final state [0];
  - dtypes: q, k, v, g, beta are fp32 as in the reference, outputs come back fp32. The
    recurrent kernel is fp32 elementwise math (rounding-level agreement); chunk_kda's tl.dot
    runs TF32 on fp32 inputs, so a chunked prefill head agrees to ~1e-3 relative, not 1e-6.

Forms:
  - a prefill's head (the rows before its last R = RECURRENT_MAX_ROWS, never snapshotted):
    `chunk_kda`, initial state in, final state out;
  - every row that needs a snapshot (decode 1 row, verify K+1 rows, a prefill's last R rows):
    ONE launch of `fused_recurrent_kda_fwd` in its continuous-batching + spec-decoding mode,
    with the snapshot ring (R+1, H, Dk, Dv) itself as the kernel's state pool. The kernel
    reads the initial state from pool[idx[num_accepted - 1]] and writes the state after row
    t to pool[idx[t]]; with idx = [(b+1) % n, ..., (b+T) % n, b % n] and num_accepted = T+1
    (b = the rows' first position, n = R+1) it reads the ring slot of length b and writes
    slot (b+t+1) % n after row t: exactly the slots the reference path fills, so
    KDAState.rollback (a length change: the live state is the ring slot of the length) is
    exact either way. idx is computed on the device from the positions tensor, so the call
    is CUDA-graph capturable.
  Why this and not the alternatives: the reference recurrence for verify rows costs ~6
  launches per row per layer (host-bound at K+1 = 5..9 rows); fla's public fused_recurrent
  per row adds a launch and a state copy per row; re-scanning the accepted rows from a
  pre-verify state after acceptance puts a second sequential pass on the critical path
  between verify and the next draft. The ring kernel is one launch, snapshots included.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from ..errors import UserError

__all__ = ["ENV", "FlaKDA", "fla_args", "fla_for", "fla_status", "from_fla", "reset", "ring_indices", "shapes_ok"]

ENV = "MEMRA_KDA_KERNELS"  # auto (default) | torch | fla
_MODES = ("auto", "torch", "fla")

_mode: str | None = None
_fla: "FlaKDA | None" = None
_fla_error: str | None = None
_loaded = False


def reset() -> None:
    """Forget the env var and the import outcome (read again on the next call)."""
    from ..env import environment  # noqa: PLC0415

    global _mode, _fla, _fla_error, _loaded
    _mode, _fla, _fla_error, _loaded = None, None, None, False
    environment.cache_clear()


def _env_mode() -> str:
    global _mode
    if _mode is None:
        from ..env import environment  # noqa: PLC0415 (read once per process there)

        _mode = environment().kda_kernels
    return _mode


def _load() -> "FlaKDA | None":
    global _fla, _fla_error, _loaded
    if not _loaded:
        _loaded = True
        try:
            _fla = FlaKDA()
        except Exception as e:  # ImportError (no fla / no triton) or an API that moved
            _fla, _fla_error = None, f"{type(e).__name__}: {e}"
    return _fla


def fla_status() -> dict:
    """What the choice would be on CUDA (for logs and the GPU check)."""
    fla = _load()
    return {"mode": _env_mode(), "fla_importable": fla is not None, "error": _fla_error}


def shapes_ok(dk: int, dv: int) -> bool:
    return dk % 16 == 0 and dv % 16 == 0 and 16 <= dk <= 256


def fla_for(q: torch.Tensor, v: torch.Tensor) -> "FlaKDA | None":
    """The fla backend for these scan inputs (q (T, H, Dk), v (T, H, Dv)), or None: the reference."""
    if q.device.type != "cuda":
        return None
    mode = _env_mode()
    if mode == "torch":
        return None
    fla = _load()
    if fla is None:
        if mode == "fla":
            raise UserError(f"{ENV}=fla but flash-linear-attention is not usable here ({_fla_error})")
        return None
    if not shapes_ok(q.shape[-1], v.shape[-1]):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or v.requires_grad):
        return None
    return fla


def fla_args(q, k, v, g, beta, S) -> dict:
    """Our scan arguments -> the arguments fla's KDA functions (kernels and naive) share.
    q, k, g (T, H, Dk); v (T, H, Dv); beta (T, H); S (H, Dk, Dv); q already normalised and scaled."""
    one = lambda t: t[None].contiguous()  # noqa: E731  (T, ...) -> (1, T, ...)
    return dict(q=one(q), k=one(k), v=one(v), g=one(g), beta=one(beta), scale=1.0,
                initial_state=S[None].float().contiguous(), output_final_state=True)


def from_fla(o: torch.Tensor, S: torch.Tensor):
    """fla's (o (1, T, H, Dv), S (1, H, Dk, Dv)) -> ours (o (T, H, Dv), S (H, Dk, Dv))."""
    return o[0], S[0]


def ring_indices(base: int, rows: int, n: int) -> list[int]:
    """Pool slots for the ring kernel: row t's state -> (base + t + 1) % n, and (last entry,
    read through num_accepted = rows + 1) the initial state <- base % n."""
    return [(base + t + 1) % n for t in range(rows)] + [base % n]


# what the kernels are told beyond fla_args: our q, k, g, beta are final (see the docstring)
_FLAGS = dict(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class FlaKDA:
    """fla's chunk and recurrent KDA kernels behind our (T, H, D) contract."""

    def __init__(self):
        from fla.ops.kda.chunk import chunk_kda  # noqa: PLC0415 (optional, CUDA only)
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd  # noqa: PLC0415

        need = {"ssm_state_indices", "num_accepted_tokens", "inplace_final_state"}
        missing = need - set(inspect.signature(fused_recurrent_kda_fwd).parameters)
        if missing:
            raise ImportError(f"fused_recurrent_kda_fwd lacks {sorted(missing)} (fla too old)")
        self._chunk, self._rec, self._rec_fwd = chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd
        self._acc: dict = {}  # (device, rows) -> num_accepted (1,) int32

    def chunked(self, q, k, v, g, beta, S):
        """Same contract as kda.kda_chunked: returns o (T, H, Dv) fp32 and the final S."""
        with _on(q.device):
            o, S = self._chunk(**fla_args(q, k, v, g, beta, S), **_FLAGS)
        return from_fla(o, S)

    def recurrent(self, q, k, v, g, beta, S):
        """Same contract as kda.kda_recurrent without snapshots."""
        with _on(q.device):
            o, S = self._rec(**fla_args(q, k, v, g, beta, S), **_FLAGS)
        return from_fla(o, S)

    def _accepted(self, device, rows: int):
        key = (device, rows)
        hit = self._acc.get(key)
        if hit is None:  # a constant per row count (no host->device copy per call)
            hit = self._acc[key] = torch.tensor([rows + 1], dtype=torch.int32, device=device)
        return hit

    def recurrent_ring(self, q, k, v, g, beta, S, snaps: torch.Tensor, pos: torch.Tensor):
        """kda.kda_recurrent with snapshots in the ring: snaps (n, H, Dk, Dv) fp32 contiguous;
        for rows at positions `pos` (T,), snaps[pos[0] % n] = S in and snaps[(pos[t] + 1) % n]
        = S after row t (T + 1 <= n). The pool indices are computed on the device from `pos`
        (ring_indices is their host form), so a captured graph replays right at any position.
        Returns o (T, H, Dv) and the final S (a view of its ring slot)."""
        T, n = q.shape[0], snaps.shape[0]
        if T + 1 > n or not snaps.is_contiguous() or snaps.dtype != torch.float32:
            raise ValueError(f"ring kernel: {T} rows need {T + 1} <= {n} contiguous fp32 slots")
        slot_in = pos[:1] % n
        snaps.index_copy_(0, slot_in, S[None])  # the slot of length pos[0] holds S in (not so after a reset)
        # padded to n columns: the kernel's index stride is a compile-time constant, so one
        # width means one compiled kernel for every row count (entries past T are unused)
        idx = torch.empty(1, n, dtype=torch.int32, device=q.device)
        idx[0, :T] = (pos + 1) % n
        idx[0, T:] = slot_in
        a = fla_args(q, k, v, g, beta, S)
        with _on(q.device):
            o, _ = self._rec_fwd(
                q=a["q"], k=a["k"], v=a["v"], g=a["g"], beta=a["beta"], scale=1.0,
                initial_state=snaps, inplace_final_state=True, output_final_state=False,
                ssm_state_indices=idx, num_accepted_tokens=self._accepted(q.device, T), **_FLAGS)
        return o[0], snaps.index_select(0, (pos[-1:] + 1) % n)[0]
