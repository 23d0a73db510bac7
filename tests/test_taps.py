"""Taps: a target forward keeps the outputs of chosen layers (tap t = HF hidden_states[t + 1])
for the rows it ran, written by position into preallocated buffers: in the prime, in decode
and verify steps, under an (emulated) graph capture replayed at later positions; and nothing
at all when no taps are asked for."""

from __future__ import annotations

import torch

from graph_emulator import EmulatedGraph
from memra_dist.model.taps import TapSink
from memra_dist.runner import ModelRunner

CPU, F32 = torch.device("cpu"), torch.float32
TAPS = (0, 2, 3)
IDS = [5, 9, 17, 3, 44, 2, 80, 11, 7, 63, 21, 5]


def _hf_hidden(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states


def test_taps_are_layer_outputs_prime_and_steps(ckpt_factory):
    d, hf = ckpt_factory("llama")
    r = ModelRunner(d, CPU, F32, max_pos=64)
    r.keep_taps(TAPS)
    r.alloc(32)
    r.forward(torch.tensor(IDS[:7]), 0)  # prime
    r.forward(torch.tensor(IDS[7:10]), 7)  # a verify of 3 rows
    r.rollback(8)
    r.forward(torch.tensor(IDS[8:9]), 8)  # a decode step after a rollback
    r.forward(torch.tensor(IDS[9:12]), 9)
    hs = _hf_hidden(hf, IDS)
    for t in TAPS[:-1]:
        torch.testing.assert_close(r.cache.taps.bufs[t][:12], hs[t + 1][0], rtol=1e-5, atol=1e-5)
    # the last layer: HF's last hidden state is after the final norm; a tap is before it
    with torch.no_grad():
        torch.testing.assert_close(hf.model.norm(r.cache.taps.bufs[3][:12]), hs[4][0], rtol=1e-5, atol=1e-5)
    assert r.cache.taps.rows(0, 12).shape == (12, len(TAPS) * 32)
    torch.testing.assert_close(r.cache.taps.rows(3, 5)[:, 32:64], hs[3][0, 3:5], rtol=1e-5, atol=1e-5)


def test_no_taps_by_default_and_taps_after_a_later_keep(llama):
    r = ModelRunner(llama, CPU, F32, max_pos=64)
    r.alloc(16)
    assert r.cache.taps is None
    plain = r.forward(torch.tensor(IDS), 0)
    r.keep_taps((1,))
    r.alloc(16)  # same capacity: reallocated, now with the tap buffers
    assert r.cache.taps is not None and r.cache.taps.layers == (1,)
    torch.testing.assert_close(r.forward(torch.tensor(IDS), 0), plain)  # taps change no output
    cache = r.cache
    r.alloc(16)
    assert r.cache is cache  # reused when the taps match


def test_stage_local_subset_and_gather():
    sink = TapSink.alloc((1, 5, 9), 8, 4, CPU, F32)
    for t in sink.layers:
        sink.write(t, torch.arange(8), torch.full((8, 4), float(t)) + torch.arange(8)[:, None])
    local = sink.subset(4, 10)  # a stage holding layers 4..9
    assert local.layers == (5, 9) and local.bufs[5] is sink.bufs[5]
    g = local.gather(torch.tensor([2, 6]))
    assert g.shape == (2, 8) and g[0, 0] == 7 and g[1, 4] == 15
    assert local.nbytes() == 2 * 8 * 4 * 4


def test_taps_written_under_graph_replay(llama):
    """A step captured once at position 0 (emulated CUDA graph: no host sync allowed) and
    replayed at later positions writes the same taps as eager steps."""
    eager = ModelRunner(llama, CPU, F32, max_pos=64)
    graphed = ModelRunner(llama, CPU, F32, max_pos=64)
    for r in (eager, graphed):
        r.keep_taps(TAPS)
        r.alloc(32)
        r.forward(torch.tensor(IDS[:6]), 0)
    rows = 3
    sx, base = torch.zeros(rows, dtype=torch.long), torch.arange(rows)
    pos = base.clone()
    st = graphed.stage
    with torch.inference_mode():
        g = EmulatedGraph()
        # capture at position 0 after the prime's rows: rewrite them by replaying the prime after
        out = g.capture(lambda: st.logits(st(sx, pos, graphed.cache)))
        graphed.cache.rollback(0)
        graphed.forward(torch.tensor(IDS[:6]), 0)
        for start in (6, 9):
            graphed.cache.begin(start, rows)
            sx.copy_(torch.tensor(IDS[start:start + rows]))
            torch.add(base, start, out=pos)
            g.replay()
            want = eager.forward(torch.tensor(IDS[start:start + rows]), start)
            torch.testing.assert_close(out, want)
    for t in TAPS:
        torch.testing.assert_close(graphed.cache.taps.bufs[t][:12], eager.cache.taps.bufs[t][:12])
