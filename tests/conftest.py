"""Shared fixtures: tiny HF checkpoints saved with transformers' save_pretrained, each with a
tokenizer.json, so every test loads real files through the real loader."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # Triton's interpreter for the kernel tests: set before anything imports Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)

VOCAB = 128
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def save_hf(path, arch: str, seed: int = 0, **kw):
    """A tiny random `arch` checkpoint (llama | qwen2 | qwen3) + tokenizer.json at `path`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    from memra_dist.demo.tiny import train_tokenizer

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    shape = {**SHAPE, **kw}
    if arch == "qwen3":
        shape.setdefault("head_dim", 16)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**shape)).float().eval()
    with torch.no_grad():  # bigger weights than the default init: sharper, less tie-prone logits
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    train_tokenizer(vocab_size=shape["vocab_size"]).save(str(path / "tokenizer.json"))
    return path, model


def pytest_addoption(parser):
    parser.addoption("--recipes", action="store_true",
                     help="also run the `recipe` tests: a training recipe no shipped path uses, measured (minutes each)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: Ray, job-submit, hypothesis and other tests over ~2-5 s; the quick tier is "
        "`pytest -m \"not slow\"` (about 3 minutes on 2 cores), CI runs everything but `recipe`")
    config.addinivalue_line(
        "markers",
        "recipe: measures a training recipe that no shipped path uses (the demo trains its own); skipped "
        "unless `--recipes` is given")


def pytest_collection_modifyitems(config, items):
    """Tests that start the module's local Ray (the `ray_local` fixture) and hypothesis
    property tests (hundreds of examples each) are slow wherever they are."""
    skip = pytest.mark.skip(reason="a recipe no shipped path uses, minutes to train: `pytest --recipes` runs it")
    for item in items:
        if "recipe" in item.keywords and not config.getoption("--recipes"):
            item.add_marker(skip)
        ray = "ray_local" in getattr(item, "fixturenames", ())
        prop = getattr(getattr(item, "obj", None), "is_hypothesis_test", False)
        if ray or prop:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    cache = {}

    def make(arch: str = "llama", seed: int = 0, **kw):
        key = (arch, seed, tuple(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{arch}-{seed}")
            cache[key] = save_hf(d, arch, seed, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama(ckpt_factory):
    return ckpt_factory("llama")[0]


@pytest.fixture(scope="session")
def draft_llama(ckpt_factory):
    """A smaller draft of the same vocabulary."""
    return ckpt_factory("llama", seed=1, num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                        num_attention_heads=2, num_key_value_heads=1)[0]


@pytest.fixture(scope="session")
def tiny_mtp(tmp_path_factory):
    """The tiny glm4_moe target by the demo's recipe (~30 s), built once: (with its MTP layer
    trained by the demo's recipe with the corpus's last paragraph withheld, the same target
    without an MTP layer). Tests that train or edit it take a copy."""
    import shutil

    from memra_dist.demo.corpus import CORPUS
    from memra_dist.demo.tiny import DEMO_INIT_STD, build_checkpoint, train_tokenizer
    from memra_dist.demo.tiny_mtp import TARGET_RECIPE, glm_config, train_mtp

    root = tmp_path_factory.mktemp("tiny-mtp")
    tok = train_tokenizer()
    r = TARGET_RECIPE
    bare = build_checkpoint(root / "bare", glm_config(tok.get_vocab_size()), tok, seed=r["seed"],
                            train_steps=r["steps"], init_std=DEMO_INIT_STD, lr=r["lr"])
    d = shutil.copytree(bare, root / "mtp")
    paras = [line for line in CORPUS.splitlines() if line.strip()]
    train_mtp(d, corpus="\n".join(paras[:-1]))
    return d, bare


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for one test module (CPU actors), with the engine's runtime env."""
    ray = pytest.importorskip("ray")
    from memra_dist.pipeline.driver import _runtime_env

    ray.init(num_cpus=4, include_dashboard=False, runtime_env=_runtime_env(), configure_logging=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()
