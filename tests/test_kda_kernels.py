"""The KDA scan backend choice (kda_kernels) and its mapping onto flash-linear-attention.

The choice is checked everywhere (no fla needed). The mapping (`fla_args` / `from_fla`: batch
dim, q pre-scaled -> scale=1, state layout) is checked against fla's pure-PyTorch naive forms
(fla/ops/kda/naive.py, loaded from its file: `import fla.ops` needs triton) where fla is
installed; the kernels themselves need CUDA (benchmarks/fla_check.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from memra_dist.errors import UserError
from memra_dist.model import kda_kernels as kk
from memra_dist.model.kda import KDAState, kda_chunked, kda_recurrent, l2norm


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(kk.ENV, raising=False)
    kk.reset()
    yield
    kk.reset()


def _inputs(T, H=2, D=16, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g_)  # noqa: E731
    q = l2norm(r(T, H, D)) * D ** -0.5
    k = l2norm(r(T, H, D))
    v = r(T, H, D)
    g = -torch.exp(torch.rand(T, H, D, generator=g_) * 2 - 2) * F.softplus(r(T, H, D))  # log decay < 0
    beta = torch.sigmoid(r(T, H))
    S = r(H, D, D) * 0.1
    return q, k, v, g, beta, S


# ---------------------------------------------------------------- the choice


class _FakeFla:
    pass


def test_cpu_is_always_the_reference(monkeypatch):
    q, _, v, *_ = _inputs(3)
    for mode in ("", "auto", "fla", "torch", "junk"):
        monkeypatch.setenv(kk.ENV, mode)
        kk.reset()
        assert kk.fla_for(q, v) is None


class _Dev:
    """Stands in for a CUDA tensor in fla_for (device type and shape only)."""

    def __init__(self, shape, grad=False):
        self.device = torch.device("cuda", 0)
        self.shape = shape
        self.requires_grad = grad


def _with_fla(monkeypatch, fla):
    monkeypatch.setattr(kk, "FlaKDA", (lambda: fla) if fla is not None else _raise)


def _raise():
    raise ImportError("No module named 'fla'")


@pytest.mark.parametrize("mode,want", [("", "fla"), ("auto", "fla"), ("fla", "fla"), ("torch", None),
                                       ("junk", "fla"), (" Torch ", None)])
def test_cuda_uses_fla_unless_forced(monkeypatch, mode, want):
    fake = _FakeFla()
    _with_fla(monkeypatch, fake)
    monkeypatch.setenv(kk.ENV, mode)
    kk.reset()
    got = kk.fla_for(_Dev((5, 4, 128)), _Dev((5, 4, 128)))
    assert (got is fake) if want == "fla" else got is None


def test_cuda_without_fla_falls_back_or_errors(monkeypatch):
    _with_fla(monkeypatch, None)
    assert kk.fla_for(_Dev((1, 4, 64)), _Dev((1, 4, 64))) is None
    st = kk.fla_status()
    assert not st["fla_importable"] and "No module named 'fla'" in st["error"]
    monkeypatch.setenv(kk.ENV, "fla")
    kk.reset()
    with pytest.raises(UserError, match="MEMRA_KDA_KERNELS=fla"):  # one line, exit 2 at the CLI
        kk.fla_for(_Dev((1, 4, 64)), _Dev((1, 4, 64)))


def test_shapes_and_autograd_stay_on_the_reference(monkeypatch):
    fake = _FakeFla()
    _with_fla(monkeypatch, fake)
    assert kk.fla_for(_Dev((2, 4, 8)), _Dev((2, 4, 8))) is None  # kimi-tiny's 8-wide heads
    assert kk.fla_for(_Dev((2, 4, 512)), _Dev((2, 4, 128))) is None
    assert kk.fla_for(_Dev((2, 4, 128)), _Dev((2, 4, 128))) is fake
    with torch.enable_grad():
        assert kk.fla_for(_Dev((2, 4, 128), grad=True), _Dev((2, 4, 128))) is None


def test_env_is_read_once_until_reset(monkeypatch):
    fake = _FakeFla()
    _with_fla(monkeypatch, fake)
    a = _Dev((1, 2, 16))
    assert kk.fla_for(a, a) is fake
    monkeypatch.setenv(kk.ENV, "torch")
    assert kk.fla_for(a, a) is fake
    kk.reset()
    assert kk.fla_for(a, a) is None


# ---------------------------------------------------------------- the ring indexing


@pytest.mark.parametrize("base,rows", [(0, 1), (7, 5), (30, 9), (33, 33), (100, 4)])
def test_ring_indices_are_the_reference_slots(base, rows):
    """The kernel writes row t's state to idx[t] and reads the initial one from idx[rows]
    (num_accepted = rows + 1); the reference writes S after t rows to snaps[(base+t) % n]."""
    n = 34
    idx = kk.ring_indices(base, rows, n)
    assert len(idx) == rows + 1 and len(set(idx)) == rows + 1
    assert idx[rows] == base % n
    assert idx[:rows] == [(base + t + 1) % n for t in range(rows)]


def test_ring_emulation_matches_the_reference_state():
    """The kernel's pool semantics emulated in torch, with our ring as the pool: same slots,
    same states as KDAState's reference advance (so rollback reads the same snapshots)."""
    q, k, v, g, beta, S0 = _inputs(9, seed=3)
    n = 34
    base = 40
    pool = torch.zeros(n, *S0.shape)
    pool[base % n] = S0
    idx = kk.ring_indices(base, 9, n)
    S = pool[idx[9]].clone()
    for t in range(9):
        _, S = kda_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], S)
        pool[idx[t]] = S
    ref = torch.zeros(n, *S0.shape)
    kda_recurrent(q, k, v, g, beta, S0, [ref[(base + t) % n] for t in range(10)])
    for t in range(10):
        torch.testing.assert_close(pool[(base + t) % n], ref[(base + t) % n])


def test_reference_path_unchanged_by_the_hook():
    """On CPU KDAState.advance still runs the reference and fills the ring."""
    H, D = 2, 16
    q, k, v, g, beta, _ = _inputs(40, H, D, seed=5)
    st = KDAState.alloc(H, D, D, 3 * H * D, 4, 8, "cpu", torch.float32)
    xc = torch.randn(3 + 40, 3 * H * D)
    o = st.advance(q, k, v, g, beta, xc)
    o_ref, S_ref = kda_chunked(q, k, v, g, beta, torch.zeros(H, D, D))
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.S, S_ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the mapping vs fla's naive forms


def _naive():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention (fla) is not installed: the mapping is checked where it is")
    pytest.importorskip("einops", reason="fla's naive forms need einops")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not path.exists():
        pytest.skip(f"this fla has no {path.name} for KDA")
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("T", [1, 5, 9, 33])
def test_mapping_recurrent_equals_fla_naive(T):
    naive = _naive()
    q, k, v, g, beta, S0 = _inputs(T, seed=T)
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, S0.clone())
    o, S = kk.from_fla(*naive.naive_recurrent_kda(**kk.fla_args(q, k, v, g, beta, S0)))
    assert o.shape == o_ref.shape and S.shape == S_ref.shape
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [64, 128])
def test_mapping_chunked_equals_fla_naive(T):
    naive = _naive()
    q, k, v, g, beta, S0 = _inputs(T, seed=T)
    o_ref, S_ref = kda_chunked(q, k, v, g, beta, S0.clone())
    o, S = kk.from_fla(*naive.naive_chunk_kda(**kk.fla_args(q, k, v, g, beta, S0), chunk_size=64))
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=1e-4, rtol=1e-4)


def test_mapping_does_not_normalise_twice():
    """scale=1.0 because our q is pre-scaled: fla's default scale would differ by Dk^-1/2."""
    naive = _naive()
    q, k, v, g, beta, S0 = _inputs(5, seed=9)
    a = kk.fla_args(q, k, v, g, beta, S0)
    assert a["scale"] == 1.0 and a["q"].shape == (1, 5, 2, 16) and a["initial_state"].shape == (1, 2, 16, 16)
    a["scale"] = None  # fla's default: 1/sqrt(Dk), applied again
    o_bad, _ = naive.naive_recurrent_kda(**a)
    o_ref, _ = kda_recurrent(q, k, v, g, beta, S0.clone())
    assert not torch.allclose(o_bad[0], o_ref, atol=1e-3)
