"""Kimi Delta Attention (KDA): gated delta rule with a per-channel decay, pure PyTorch.

Per head, state S (Dk, Dv), for each row t (q, k l2-normalised, q scaled by Dk^-1/2):
    S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
q, k, v come out of a causal depthwise short conv (kernel K, silu) over [q_proj | k_proj | v_proj];
g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) (per channel, <= 0), beta = sigmoid(b_proj(x)).
The output is RMS-normed per head, gated by sigmoid(g_b(g_a(x))), then o_proj.

Two scan forms with the same math: `kda_recurrent` (row by row; decode / verify rows) and
`kda_chunked` (chunks of CHUNK rows, the intra-chunk dependence solved as a unit-lower
triangular system; prefill). Parameter names mirror transformers' KimiLinearDeltaAttention.
These are the reference: on CUDA, kda_kernels may run flash-linear-attention's kernels in
their place (same contract, same snapshot ring; MEMRA_KDA_KERNELS=torch forces these).

Verify rows and the depth log's `seq_rows` (decided here): a verify of K+1 rows is ONE mixer
call: the projections, the short conv, the gates and the output norm run batched over all
rows; only the delta-rule recurrence inside `kda_recurrent` walks the rows in order, and that
is what the level-2 "scan" bucket means (the sequential KDA chain inside the batched call), timed as the scan
share of vkda (`memra.scan_ms`). It is not a per-row ARM: no layer falls back to running the
verify rows through the mixer one call per row, so KDA adds nothing to `ctx.timer.seq_rows`
(nor do MLA, whose absorbed and expanded arms both take all rows at once, or MoE). A future
per-row fallback (e.g. a kernel that cannot take T > 1 and loops decode calls) must count its
rows there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from . import kda_kernels
from .config import ModelConfig
from .kimi_config import KimiSpec

__all__ = ["KDA", "KDAState", "kda_chunked", "kda_recurrent", "RECURRENT_MAX_ROWS", "CHUNK"]

# forwards of at most this many rows scan recurrently (and snapshot each row); also the
# snapshot ring's length. = config.MAX_K + 1: a whole verify of K+1 rows must be restorable
# at any accepted row (a chunked head is not snapshotted); tests check the tie.
RECURRENT_MAX_ROWS = 33
CHUNK = 64  # rows per chunk of the chunked form


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the FLA / reference convention, not max(., eps))."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(q, k, v, g, beta, S, snaps: torch.Tensor | None = None):
    """q, k, g (T, H, Dk); v (T, H, Dv); beta (T, H); S (H, Dk, Dv); all fp32.
    Returns o (T, H, Dv) and the final S. With `snaps` (a (>= T + 1, H, Dk, Dv) tensor or a
    list of >= T + 1 (H, Dk, Dv) views): snaps[0] = S in, snaps[t + 1] = S after row t."""
    T, H, Dv = v.shape
    o = v.new_empty(T, H, Dv)
    decay = g.exp()  # (T, H, Dk)
    if snaps is not None:
        snaps[0].copy_(S)
    for t in range(T):
        S = S * decay[t][:, :, None]  # (H, Dk, Dv)
        kv_mem = torch.einsum("hk,hkv->hv", k[t], S)  # (H, Dv)
        u = (v[t] - kv_mem) * beta[t][:, None]  # (H, Dv)
        S = S + k[t][:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)
        if snaps is not None:
            snaps[t + 1].copy_(S)
    return o, S


def _chunk(q, k, v, g, beta, S):
    """One chunk of n rows, head-major inputs: q, k, g (H, n, Dk); v (H, n, Dv); beta (H, n).
    With G = cumsum(g) and u the delta-rule updates:  (I + L) u = beta (v - (k e^G) S0), where
    L[i, j] = beta_i sum_d k_i k_j e^(G_i - G_j) for j < i; o = (q e^G) S0 + P u with
    P[i, j] = sum_d q_i k_j e^(G_i - G_j) for j <= i; S_n = e^(G_n) S0 + (k e^(G_n - G))^T u."""
    H, n, Dk = k.shape
    Dv = v.shape[-1]
    G = g.cumsum(1)  # (H, n, Dk)
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # j <= i
    diff = G[:, :, None, :] - G[:, None, :, :]  # (H, n, n, Dk): G_i - G_j
    pair = diff.masked_fill(~lower[None, :, :, None], float("-inf")).exp()  # <= 1, 0 above diagonal
    kk = ((k[:, :, None, :] * pair) * k[:, None, :, :]).sum(-1)  # (H, n, n)
    qk = ((q[:, :, None, :] * pair) * k[:, None, :, :]).sum(-1)  # (H, n, n), lower incl. diagonal
    b = beta[:, :, None]  # (H, n, 1)
    A = torch.eye(n, dtype=k.dtype, device=k.device) + (b * kk).tril(-1)  # (H, n, n) unit lower
    eG = G.exp()  # (H, n, Dk)
    rhs = torch.cat([b * v, b * (k * eG)], dim=-1)  # (H, n, Dv + Dk)
    sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    u0, w = sol.split([Dv, Dk], dim=-1)  # (H, n, Dv), (H, n, Dk)
    u = u0 - w @ S  # (H, n, Dv)
    o = (q * eG) @ S + qk @ u  # (H, n, Dv)
    last = G[:, -1:, :]  # (H, 1, Dk)
    S = last.transpose(1, 2).exp() * S + (k * (last - G).exp()).transpose(1, 2) @ u  # (H, Dk, Dv)
    return o, S


def kda_chunked(q, k, v, g, beta, S, chunk: int = CHUNK):
    """Same contract as `kda_recurrent` (no snapshots): (T, H, d) inputs, S (H, Dk, Dv)."""
    outs = []
    for a in range(0, q.shape[0], chunk):
        rows = [t[a:a + chunk].transpose(0, 1) for t in (q, k, v, g, beta)]  # (H, n, d) / (H, n)
        o, S = _chunk(*rows, S)
        outs.append(o.transpose(0, 1))  # (n, H, Dv)
    return torch.cat(outs), S


@dataclass
class KDAState:
    """Recurrent state of one KDA layer, kept so that rollback is a length change.

    Two rings indexed by ABSOLUTE position hold everything (R = snap_rows):
    snaps[L % (R+1)] = the state S (H, Dk, Dv) fp32 after L rows, and hist[p % (K-1+R)] = the
    conv input of position p. The live state is simply the slot of the current length, and a
    forward's conv window is the K-1 history rows before its first position (zeros before
    position 0). So rolling back to any length in [lo, length] moves `length` and nothing
    else, like an attention cache (lo >= length - R is the lowest length still in the rings).
    A forward of T <= R rows keeps every row (the recurrent form writes each row's state to
    its slot); a longer (chunked) forward keeps only its last R rows (lo = its end - R).

    Why a ring across forwards and not the last forward's rows only: a target verify is one
    forward of K+1 rows, but a kimi_linear DRAFT model feeds its K-1 proposal rows one
    forward each, and its maintenance rolls back to the first rejected draft row, several
    forwards back (the feed, <= 2 rows, plus K-1 proposal rows: <= K+1 <= R rows).

    Why snapshots and not a re-scan from a saved pre-forward state: a verify round rolls
    back on almost every partial accept, and a re-scan puts a second sequential pass (plus
    keeping k, v, g, beta of every row) on the critical path between verify and the next
    draft; the snapshot is one (H, Dk, Dv) write per row by the recurrent form the verify
    rows take anyway (T = K+1 <= R), and rollback is free. The price is memory: (R + 1)
    state matrices per layer (34: Kimi-Linear-48B's 32 x 128 x 128 fp32 state is 2 MiB, so
    68 MiB per KDA layer), preallocated (static shapes, no allocation per round).

    Every index a forward uses comes from the positions tensor (`step`), never from a Python
    length: a step captured once in a CUDA graph is right at every position. The host
    bookkeeping (length, lo) lives in `begin`, which runs before every forward and replay."""

    snaps: torch.Tensor
    hist: torch.Tensor
    kernel: int  # the conv kernel K: the window is K-1 rows
    length: int = 0
    lo: int = 0  # the lowest length the rings can restore

    @classmethod
    def alloc(cls, heads: int, dk: int, dv: int, conv_dim: int, kernel: int, snap_rows: int,
              device, dtype) -> "KDAState":
        return cls(
            snaps=torch.zeros(snap_rows + 1, heads, dk, dv, device=device, dtype=torch.float32),
            hist=torch.zeros(kernel - 1 + snap_rows, conv_dim, device=device, dtype=dtype),
            kernel=kernel,
        )

    @property
    def snap_rows(self) -> int:
        return self.snaps.shape[0] - 1

    @property
    def S(self) -> torch.Tensor:
        """The live state (a view of its ring slot)."""
        return self.snaps[self.length % self.snaps.shape[0]]

    @property
    def conv(self) -> torch.Tensor:
        """The live conv window (K-1, 3Q): the inputs of the K-1 positions before `length`."""
        return self.window(torch.tensor([self.length], device=self.hist.device))

    def window(self, start: torch.Tensor) -> torch.Tensor:
        """(K-1, 3Q) conv inputs of positions [start-K+1, start) from the history ring, zeros
        before position 0; `start` a (1,) device tensor (graph-safe)."""
        p = start + torch.arange(1 - self.kernel, 0, device=start.device)  # (K-1,)
        rows = self.hist.index_select(0, p % self.hist.shape[0])
        return rows * (p >= 0).to(rows.dtype)[:, None]

    def begin(self, start: int, rows: int) -> None:
        """Before a forward of `rows` rows from `start`: roll back if it starts earlier, then
        book the lengths it leaves. Host bookkeeping lives here, not in `step`, because a
        captured step (CUDA graph) replays without running Python."""
        if start != self.length:
            self.rollback(start)  # a forward from an earlier row: the snapshot rings decide
        self.lo = max(self.lo, start + rows - self.snap_rows)  # a chunked head (T > R): lo = its end
        self.length = start + rows

    def rollback(self, new_len: int) -> None:
        if new_len == self.length:
            return
        if new_len == 0:
            self.reset()
            return
        if not self.lo <= new_len < self.length:
            raise ValueError(
                f"KDA state cannot roll back to {new_len}: snapshots cover lengths "
                f"[{self.lo}, {self.length}]"
            )
        self.length = new_len  # the state and the window of new_len are in the rings already

    def reset(self) -> None:
        self.snaps[0].zero_()  # the state at length 0; the window before position 0 reads as zeros
        self.length = self.lo = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.snaps, self.hist))

    def advance(self, q, k, v, g, beta, xc: torch.Tensor) -> torch.Tensor:
        """Fold T rows in from `length` (a state driven directly: tests, benchmarks).
        xc (K-1+T, 3Q): the conv inputs of positions [length-K+1, length+T)."""
        start, T = self.length, q.shape[0]
        self.begin(start, T)
        return self.step(q, k, v, g, beta, xc, torch.arange(start, start + T, device=q.device))

    def step(self, q, k, v, g, beta, xc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The forward's fold, after `begin`: rows at positions `pos` (T,) (a device tensor),
        xc as in `advance`. Returns o (T, H, Dv). The state after the row at position p goes
        to ring slot (p + 1) % n, the conv inputs of position p to history row p % w; the
        rows start from the slot of pos[0]. Only a prefill longer than R (a chunked head,
        never captured) splits on the row count."""
        T, R, n = q.shape[0], self.snap_rows, self.snaps.shape[0]
        head = max(T - R, 0)
        S = self.snaps.index_select(0, pos[:1] % n)[0]  # the state the rows start from
        parts = []
        fla = kda_kernels.fla_for(q, v)  # None: the reference forms below (CPU, or forced)
        if head:  # the rows before the last R: no snapshots (rollback never goes back past them)
            chunked = kda_chunked if fla is None else fla.chunked
            o_head, S = chunked(q[:head], k[:head], v[:head], g[:head], beta[:head], S)
            parts.append(o_head)
        rows, tail_pos = (q[head:], k[head:], v[head:], g[head:], beta[head:]), pos[head:]
        if fla is None:
            buf = S.new_empty(T - head + 1, *S.shape)  # S in, then S after each row
            o_tail, _ = kda_recurrent(*rows, S, buf)
            self.snaps.index_copy_(0, tail_pos[:1] % n, buf[:1])
            self.snaps.index_copy_(0, (tail_pos + 1) % n, buf[1:])
        else:  # one kernel writes the same ring slots (kda_kernels explains the indexing)
            o_tail, _ = fla.recurrent_ring(*rows, S, self.snaps, tail_pos)
        parts.append(o_tail)
        w = self.hist.shape[0]
        m = min(T, w)  # the window rows before pos[0] are in the history from earlier forwards
        self.hist.index_copy_(0, pos[T - m:] % w, xc[xc.shape[0] - m:])
        return torch.cat(parts) if head else o_tail


class ForgetGate(nn.Module):
    """g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), fp32, (T, H, D)."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(heads * head_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(1, 1, heads, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()  # (T, H*D)
        g = g.view(x.shape[0], self.heads, self.head_dim)  # (T, H, D)
        rate = self.A_log.float().view(self.heads, 1).exp()  # (H, 1)
        return -rate * F.softplus(g, threshold=20.0)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm in fp32, times sigmoid(gate); back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h * torch.sigmoid(gate.float())).to(x.dtype)


class KDA(nn.Module):
    mixer_class = "kda"
    graph_safe = True  # KDAState.step indexes its rings from the positions tensor
    max_graph_rows = RECURRENT_MAX_ROWS  # a captured step snapshots every row

    def __init__(self, cfg: ModelConfig, spec: KimiSpec):
        super().__init__()
        h, H, D = cfg.hidden_size, spec.kda_heads, spec.kda_head_dim
        self.H, self.D, self.Q, self.K = H, D, H * D, spec.conv_kernel
        self.q_proj = nn.Linear(h, self.Q, bias=False)
        self.k_proj = nn.Linear(h, self.Q, bias=False)
        self.v_proj = nn.Linear(h, self.Q, bias=False)
        self.conv1d = nn.Conv1d(3 * self.Q, 3 * self.Q, self.K, groups=3 * self.Q, bias=False)
        self.forget_gate = ForgetGate(h, H, D)
        self.b_proj = nn.Linear(h, H, bias=False)
        self.g_a_proj = nn.Linear(h, D, bias=False)
        self.g_b_proj = nn.Linear(D, self.Q, bias=False)
        self.o_norm = GatedRMSNorm(D, spec.rms_eps)
        self.o_proj = nn.Linear(self.Q, h, bias=False)

    def new_state(self, capacity: int, device, dtype) -> KDAState:
        return KDAState.alloc(self.H, self.D, self.D, 3 * self.Q, self.K, RECURRENT_MAX_ROWS, device, dtype)

    def state_bytes(self) -> int:
        """What `new_state` allocates, in bytes (its snapshots in fp32, its conv history in the
        weights' dtype)."""
        size = self.q_proj.weight.element_size()
        return ((RECURRENT_MAX_ROWS + 1) * self.H * self.D * self.D * 4
                + (self.K - 1 + RECURRENT_MAX_ROWS) * 3 * self.Q * size)

    def _conv(self, xc: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + silu: xc (K-1+T, 3Q) (the window, then the rows) -> (T, 3Q)."""
        w = self.conv1d.weight  # (3Q, 1, K)
        y = F.conv1d(xc.T[None].to(w.dtype), w, groups=w.shape[0])  # (1, 3Q, T)
        return F.silu(y[0].T).to(xc.dtype)

    def _qkv(self, x: torch.Tensor, state: KDAState | None, pos: torch.Tensor):
        """Returns q, k, v (T, H, D) fp32 (q, k normalised, q scaled) and the conv inputs xc."""
        T = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # (T, 3Q)
        if state is not None:
            window = state.window(pos[:1]).to(mixed.dtype)
        else:
            window = mixed.new_zeros(self.K - 1, 3 * self.Q)
        xc = torch.cat([window, mixed])  # (K-1+T, 3Q)
        q, k, v = (t.reshape(T, self.H, self.D).float() for t in self._conv(xc).split(self.Q, dim=-1))
        return l2norm(q) * self.D ** -0.5, l2norm(k), v, xc

    def forward(self, x: torch.Tensor, ctx, state: KDAState | None) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). With a state the rows continue it (from state.length,
        which StageCache.begin set to the forward's start); without, a fresh sequence."""
        if getattr(ctx, "batch", None) is not None:  # several requests' rows (batching/paged.py)
            return self._batched(x, ctx, state)
        T = x.shape[0]
        q, k, v, xc = self._qkv(x, state, ctx.pos)
        g = self.forget_gate(x)  # (T, H, D)
        beta = torch.sigmoid(self.b_proj(x)).float()  # (T, H)
        tm = ctx.timer
        if tm is None:
            o = self._scan(q, k, v, g, beta, state, xc, ctx.pos)
        else:
            tm.scan_begin()
            o = self._scan(q, k, v, g, beta, state, xc, ctx.pos)
            tm.scan_end()
        gate = self.g_b_proj(self.g_a_proj(x)).view(T, self.H, self.D)  # (T, H, D)
        o = self.o_norm(o.to(x.dtype), gate).reshape(T, self.Q)  # (T, Q)
        return self.o_proj(o)

    def _batched(self, x: torch.Tensor, ctx, states) -> torch.Tensor:
        """Rows of several requests (ctx.batch a BatchView, `states` their RecurrentStates):
        each request's rows continue its own state, exactly as its rows do alone (the state's
        `begin` rolls it back first where the rows start earlier: the request's rollback)."""
        outs = []
        for seg in ctx.batch.segments:
            st = states.of.get(seg.rid)
            if st is None:  # its request left while the step ran (a client gone): its rows are dropped
                outs.append(x.new_zeros(seg.rows, x.shape[1]))
                continue
            st.begin(seg.start, seg.rows)
            # (a level-2 step's sub-split timer times each request's scan: the step's scan share)
            outs.append(self.forward(x[seg.lo:seg.hi], _Rows(ctx.pos[seg.lo:seg.hi], getattr(ctx, "timer", None)), st))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _scan(self, q, k, v, g, beta, state: KDAState | None, xc, pos) -> torch.Tensor:
        if state is not None:
            return state.step(q, k, v, g, beta, xc, pos)
        S = q.new_zeros(self.H, self.D, self.D)
        fla, long = kda_kernels.fla_for(q, v), q.shape[0] > RECURRENT_MAX_ROWS
        if fla is None:
            scan = kda_chunked if long else kda_recurrent
        else:
            scan = fla.chunked if long else fla.recurrent
        return scan(q, k, v, g, beta, S)[0]


@dataclass
class _Rows:
    """The step context one request's rows of a batched step see (`KDA._batched`)."""

    pos: torch.Tensor
    timer: object = None
    batch: object = None
