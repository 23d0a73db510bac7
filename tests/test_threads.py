"""memra_dist.threads: the thread count chosen from the model's size (pure), and its
application to torch on CPU only, with the previous count returned for the restore."""

from __future__ import annotations

import pytest
import torch

from memra_dist import threads
from memra_dist.model.config import parse_config
from memra_dist.demo.tiny import DEMO_SHAPES, llama_config
from memra_dist.threads import PARAMS_PER_THREAD, apply_cpu_threads, choose_threads, model_params

NO_ENV: dict[str, str] = {}
LLAMA_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---- sizes ---------------------------------------------------------------------------------

def test_model_params_from_an_int_a_config_a_dict_and_a_module():
    assert model_params(12345) == 12345
    h, inter, layers, vocab = 64, 128, 2, 100
    d = llama_config(vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2)
    # q, o: h x h; k, v: h x (2 heads * 16); gate, up, down: h x inter; lm_head: vocab x h
    want = layers * (2 * h * h + 2 * h * 32 + 3 * h * inter) + vocab * h
    assert model_params(d) == want
    assert model_params(parse_config(d)) == want
    assert model_params(torch.nn.Linear(10, 20, bias=False)) == 200


def test_model_params_of_llama_8b_is_about_8e9():
    assert 7.0e9 < model_params(LLAMA_8B) < 8.1e9  # embedding left out: a lookup, not a matmul


@pytest.mark.parametrize("bad", [True, "big", {"hidden_size": 8}, object()])
def test_model_params_refuses_what_has_no_size(bad):
    with pytest.raises(TypeError):
        model_params(bad)


# ---- the choice ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DEMO_SHAPES))
def test_the_demo_models_get_one_thread(name):
    cfg = llama_config(256, **DEMO_SHAPES[name])
    for cores in (1, 2, 16, 128):
        assert choose_threads(cfg, cores, NO_ENV) == 1


def test_a_big_model_gets_every_core():
    for cores in (1, 2, 16, 128):
        assert choose_threads(LLAMA_8B, cores, NO_ENV) == cores


def test_one_thread_per_quantum_between_the_bounds():
    assert choose_threads(0, 8, NO_ENV) == 1
    assert choose_threads(PARAMS_PER_THREAD - 1, 8, NO_ENV) == 1
    assert choose_threads(2 * PARAMS_PER_THREAD, 8, NO_ENV) == 2
    assert choose_threads(5 * PARAMS_PER_THREAD + 7, 8, NO_ENV) == 5
    assert choose_threads(100 * PARAMS_PER_THREAD, 8, NO_ENV) == 8
    counts = [choose_threads(n * PARAMS_PER_THREAD // 2, 16, NO_ENV) for n in range(40)]
    assert counts == sorted(counts) and min(counts) == 1 and max(counts) == 16


def test_omp_num_threads_leaves_the_choice_to_torch():
    assert choose_threads(LLAMA_8B, 16, {"OMP_NUM_THREADS": "3"}) is None
    assert choose_threads(1000, 16, {"OMP_NUM_THREADS": "1"}) is None
    assert choose_threads(1000, 16, {"OMP_NUM_THREADS": ""}) == 1  # set but empty: not a choice


def test_the_environment_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(1000, 4) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert choose_threads(1000, 4) == 1


# ---- applying it -----------------------------------------------------------------------------

def test_apply_on_cpu_sets_the_count_and_returns_the_previous(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_torch_default", 4)
    monkeypatch.setattr(threads, "available_cores", lambda: 3)
    torch.set_num_threads(2)
    assert apply_cpu_threads(1000, "cpu") == 2
    assert torch.get_num_threads() == 1
    assert apply_cpu_threads(LLAMA_8B, torch.device("cpu")) == 1
    assert torch.get_num_threads() == 3  # the cores available, under torch's default of 4
    prev = apply_cpu_threads(1000, "cpu")
    torch.set_num_threads(prev)  # the caller's restore
    assert torch.get_num_threads() == 3


def test_apply_stays_under_torchs_own_default(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_torch_default", 2)  # e.g. physical cores, fewer than the CPUs
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    apply_cpu_threads(LLAMA_8B, "cpu")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "meta", torch.device("cuda", 0)])
def test_apply_off_cpu_changes_nothing(device, monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    assert apply_cpu_threads(1000, device) == 2
    assert torch.get_num_threads() == 2


def test_apply_with_omp_num_threads_changes_nothing(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert apply_cpu_threads(1000, "cpu") == 2
    assert torch.get_num_threads() == 2


def test_available_cores_is_positive():
    assert threads.available_cores() >= 1
