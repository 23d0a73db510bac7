"""The step graphs' contract, checked on the CPU with an emulated capture (graph_emulator.py):
a stage captured once per row count at position 0 (as ModelRunner.alloc does on CUDA), then
replayed at every later position with no Python in between, gives the eager ids exactly -
plain greedy and speculative with rollbacks (fp32). For the kimi hybrid (KDA's snapshot ring
and conv history indexed from the positions tensor, MLA, grouped MoE) and for llama."""

from __future__ import annotations

import pytest
import torch

from graph_emulator import EmulatedGraph
from memra_dist.runner import ModelRunner
from memra_dist.graphs import graph_rows_limit, graphs_supported
from memra_dist.model.moe import MoE
from memra_dist.specdec.drafters.none import NoDrafter
from memra_dist.specdec.drafters.replay import ReplayDrafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

CPU, CAP = torch.device("cpu"), 128


class EmulatedSteps:
    """StepGraphs' capture and replay, with EmulatedGraph in place of torch.cuda.CUDAGraph:
    the row counts in `warm` captured at position 0 at allocation (nothing reset afterwards, as
    in ModelRunner.alloc), any other row count captured on first use mid-session, after two
    eager warm-up runs at that step's own positions (which must leave the cache as they found
    it), then replayed."""

    @torch.inference_mode()
    def __init__(self, runner: ModelRunner, warm, limit: int):
        self.r, self.g, self.limit = runner, {}, limit
        for rows in warm:
            self._capture(torch.zeros(rows, dtype=torch.long), 0)

    def _capture(self, x, start):
        rows = x.shape[0]
        sx, base = x.clone(), torch.arange(rows)
        pos = base + start
        step = lambda: self._eager(sx, pos)  # noqa: E731
        for _ in range(2):
            step()
        graph = EmulatedGraph()
        out = graph.capture(step)
        self.g[rows] = (graph, sx, base, pos, out)

    @torch.inference_mode()
    def _eager(self, x, pos):
        st = self.r.stage
        h = st(x, pos, self.r.cache, None)
        return st.logits(h) if st.has_head else h

    @torch.inference_mode()
    def forward(self, x, start, timer=None, last=False):
        rows = x.shape[0]
        self.r.cache.begin(start, rows)
        if rows > self.limit:  # a prefill: eager
            return self._eager(x, torch.arange(start, start + rows))
        if rows not in self.g:
            self._capture(x, start)
            self.captured_mid_session = getattr(self, "captured_mid_session", 0) + 1
        graph, sx, base, pos, out = self.g[rows]
        sx.copy_(x)
        torch.add(base, start, out=pos)
        graph.replay()
        return out.clone()


def _session_ids(target, drafter, prompt, k, n=28):
    s = SpecSession(target, drafter, SamplingParams(), torch.Generator().manual_seed(0), k)
    ids = [s.start(prompt, n, CAP)]
    while not s.done:
        ids.extend(s.burst(8))
    return ids, s.stats


class _Target:
    """A ModelRunner whose decode / verify forwards replay emulated graphs."""

    def __init__(self, r: ModelRunner, steps: EmulatedSteps):
        self.r, self.steps = r, steps
        self.label, self.device = r.label, r.device
        self.drain = r.drain

    def alloc(self, capacity):
        assert capacity == CAP and self.r.cache is not None
        self.r.cache.rollback(0)

    def forward(self, x, start, timer=None, last=False):
        return self.steps.forward(x, start)

    def rollback(self, n):
        self.r.rollback(n)

    def free_mb(self):
        return 0


def _check(model_dir, monkeypatch, grouped: bool):
    if grouped:
        monkeypatch.setattr(MoE, "use_grouped", lambda self, on: setattr(self.experts, "grouped", True))
    eager = ModelRunner(model_dir, CPU, torch.float32)
    eager.alloc(CAP)
    r = ModelRunner(model_dir, CPU, torch.float32)
    assert graphs_supported(r.stage)
    r.alloc(CAP)
    steps = EmulatedSteps(r, (1, 2), graph_rows_limit(r.stage))  # verify row counts: captured mid-session
    t = _Target(r, steps)
    prompt = [5, 9, 17, 5, 9, 23, 40, 5, 9, 17, 5, 9]
    want, _ = _session_ids(eager, NoDrafter(), prompt, 1)
    got, _ = _session_ids(t, NoDrafter(), prompt, 1)
    assert got == want
    spec, st = _session_ids(t, ReplayDrafter(want, len(prompt), r.cfg.vocab_size, 0.3, seed=3), prompt, 4)
    assert spec == want
    assert 0 < st.accepted < st.drafted  # partial accepts: captured steps after rollbacks
    assert steps.captured_mid_session >= 1


def test_kimi_hybrid_replays_exactly(monkeypatch):
    pytest.importorskip("transformers")
    from kimi_ckpt import hybrid  # noqa: PLC0415

    _check(hybrid()[1], monkeypatch, grouped=True)


def test_llama_replays_exactly(monkeypatch, llama):
    _check(str(llama), monkeypatch, grouped=False)


def test_a_host_sync_is_refused_at_capture():
    g = EmulatedGraph()
    x = torch.arange(4)
    with pytest.raises(RuntimeError, match="not capturable"):
        g.capture(lambda: x[: int(x.sum())])  # a shape read back from the device


def test_the_moe_loop_form_is_not_capturable(monkeypatch):
    """The per-expert loop reads the experts hit back to the host: refused, so graphs_supported
    must (and does) exclude it."""
    from test_moe_grouped import _moe  # noqa: PLC0415

    m = _moe(0)
    x = torch.randn(3, 24)
    with pytest.raises(RuntimeError, match="not capturable"):
        EmulatedGraph().capture(lambda: m(x))
    assert not m.graph_safe
    m.use_grouped(True)
    g = EmulatedGraph()
    out = g.capture(lambda: m(x))
    x.copy_(torch.randn(3, 24))
    g.replay()
    assert torch.allclose(out, m(x), atol=1e-6, rtol=0)


def _ring_kernel_standin(q, k, v, g, beta, scale, initial_state, inplace_final_state, output_final_state,
                         ssm_state_indices, num_accepted_tokens, **flags):
    """fla's fused_recurrent_kda_fwd in its spec-decoding mode, in torch, with device-side
    indexing only: S <- pool[idx[acc - 1]]; after row t, pool[idx[t]] <- S."""
    from memra_dist.model.kda import kda_recurrent  # noqa: PLC0415

    _ring_kernel_standin.seen.append((q.shape[1], ssm_state_indices.clone(), num_accepted_tokens.clone()))
    pool, idx = initial_state, ssm_state_indices[0].long()
    S = pool.index_select(0, idx.gather(0, num_accepted_tokens.long() - 1))[0]
    T = q.shape[1]
    buf = S.new_empty(T + 1, *S.shape)
    o, _ = kda_recurrent(q[0], k[0], v[0], g[0], beta[0], S, buf)
    pool.index_copy_(0, idx[:T], buf[1:])
    return o[None], None


_ring_kernel_standin.seen = []


def test_kimi_hybrid_with_the_ring_kernel_glue_replays_exactly(monkeypatch):
    """The same, with KDA routed through kda_kernels.FlaKDA.recurrent_ring (the CUDA path's
    glue: ring indices computed on the device, the slot of the starting state, the final
    state read back) around a torch stand-in for fla's ring kernel."""
    pytest.importorskip("transformers")
    from kimi_ckpt import hybrid  # noqa: PLC0415

    from memra_dist.model import kda_kernels as kk  # noqa: PLC0415
    from memra_dist.model.kda import kda_chunked  # noqa: PLC0415

    fla = kk.FlaKDA.__new__(kk.FlaKDA)
    fla._acc, fla._rec_fwd = {}, _ring_kernel_standin
    fla.chunked = lambda q, k, v, g, beta, S: kda_chunked(q, k, v, g, beta, S)
    calls = []
    monkeypatch.setattr(kk, "fla_for", lambda q, v: calls.append(q.shape[0]) or fla)
    _ring_kernel_standin.seen.clear()
    _check(hybrid()[1], monkeypatch, grouped=True)
    assert calls  # the glue ran
    # the device-made pool indices are the documented host form (kda_kernels.ring_indices),
    # padded to the pool width with the start slot: checked on the eager calls (a replay
    # re-runs recorded ops, so the stand-in sees only eager and capture-time calls)
    n = 34
    assert _ring_kernel_standin.seen
    for T, idx, acc in _ring_kernel_standin.seen:
        row = idx[0].tolist()
        base = row[T]  # the start slot: pos[0] % n
        assert row[:T + 1] == kk.ring_indices(base, T, n) and row[T:] == [base] * (n - T)
        assert acc.tolist() == [T + 1]
