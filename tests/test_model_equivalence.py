"""memra_dist's model against transformers on tiny random checkpoints saved with
save_pretrained: logits (prefill and step by step), layer-range loading, and the CLI's greedy
ids against transformers' greedy generate()."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from memra_dist.runner import ModelRunner
from memra_dist.model import loader as loader_mod
from memra_dist.demo.tiny import train_tokenizer

ATOL = 1e-4
CPU, F32 = torch.device("cpu"), torch.float32
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
PROMPT_TEXT = "the drafter proposes and the target verifies"


def save_perturbed(path, arch: str, seed: int, shard: str | None = None, **kw):
    """Like conftest.save_hf, but every parameter is random (norm weights and the qwen2 q/k/v
    biases too, which a default init leaves at 1 / 0 and so would not test)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    shape = {**SHAPE, **kw}
    if arch == "qwen3":
        shape.setdefault("head_dim", 16)  # != hidden / heads: the config's head_dim is used
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**shape)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    if shard:
        model.save_pretrained(str(path), max_shard_size=shard)
    else:
        model.save_pretrained(str(path))
    train_tokenizer(vocab_size=shape["vocab_size"]).save(str(path / "tokenizer.json"))
    return path, model


CASES = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "qwen2-sharded": dict(arch="qwen2", shard="20KB"),
}


@pytest.fixture(scope="module", params=list(CASES))
def ckpt(request, tmp_path_factory):
    kw = dict(CASES[request.param])
    arch = kw.pop("arch")
    d, model = save_perturbed(tmp_path_factory.mktemp(request.param), arch, seed=11, **kw)
    return request.param, d, model


def test_checkpoint_layouts_are_what_the_case_says(ckpt):
    name, d, _ = ckpt
    index = d / "model.safetensors.index.json"
    if name.endswith("sharded"):
        assert index.exists() and len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    else:
        assert not index.exists()
    if name.endswith("tied"):
        from safetensors import safe_open

        with safe_open(str(d / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()


def _ids(n=13, seed=0):
    return torch.randint(0, SHAPE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_transformers(ckpt):
    _, d, model = ckpt
    ids = _ids()
    with torch.no_grad():
        ref = model(ids[None]).logits[0]  # (T, V)
    r = ModelRunner(d, CPU, F32, max_pos=64)
    r.alloc(32)
    got = r.forward(ids, 0)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_step_by_step_logits_match_transformers(ckpt):
    """Prefill a prefix, then one row at a time, then a multi-row (verify-shaped) step."""
    _, d, model = ckpt
    ids = _ids(16, seed=1)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    r = ModelRunner(d, CPU, F32, max_pos=64)
    r.alloc(24)
    rows = [r.forward(ids[:5], 0)]
    for t in range(5, 11):
        rows.append(r.forward(ids[t:t + 1], t))
    rows.append(r.forward(ids[11:16], 11))
    torch.testing.assert_close(torch.cat(rows), ref, atol=ATOL, rtol=0)


def test_layer_range_reads_only_its_tensors_and_chains(ckpt, monkeypatch):
    name, d, model = ckpt
    read: list[str] = []
    orig = loader_mod.CheckpointReader.get

    def spy(self, n):
        read.append(n)
        return orig(self, n)

    monkeypatch.setattr(loader_mod.CheckpointReader, "get", spy)
    a = ModelRunner(d, CPU, F32, first=0, last=2, has_embed=True, has_head=False, max_pos=64)
    read_a, read[:] = set(read), []
    b = ModelRunner(d, CPU, F32, first=2, last=4, has_embed=False, has_head=True, max_pos=64)
    read_b = set(read)

    def layer_of(n):
        return int(n.split(".")[2]) if n.startswith("model.layers.") else None

    assert {layer_of(n) for n in read_a} == {0, 1, None}
    assert {n for n in read_a if layer_of(n) is None} == {"model.embed_tokens.weight"}
    assert {layer_of(n) for n in read_b} == {2, 3, None}
    head = {"model.norm.weight", "model.embed_tokens.weight" if name.endswith("tied") else "lm_head.weight"}
    assert {n for n in read_b if layer_of(n) is None} == head
    # each tensor read once, and the stage holds exactly what it read
    assert len(read) == len(read_b)
    keys_a = set(a.stage.state_dict())
    assert keys_a == {loader_mod.hf_name(k)[len("model."):] for k in keys_a}  # no lm_head on a
    assert not any(k.startswith(("layers.2.", "layers.3.", "norm", "lm_head")) for k in keys_a)
    assert not any(k.startswith(("layers.0.", "layers.1.", "embed_tokens")) for k in b.stage.state_dict())

    ids = _ids(9, seed=2)
    whole = ModelRunner(d, CPU, F32, max_pos=64)
    for r in (a, b, whole):
        r.alloc(16)
    h = a.forward(ids, 0)  # (T, H) hidden, no head
    assert h.shape == (9, SHAPE["hidden_size"])
    chained = b.forward(h, 0)
    torch.testing.assert_close(chained, whole.forward(ids, 0), atol=1e-5, rtol=0)
    # and a decode step through the chain
    torch.testing.assert_close(b.forward(a.forward(ids[:1], 9), 9), whole.forward(ids[:1], 9), atol=1e-5, rtol=0)


@pytest.mark.slow  # a CLI subprocess run per architecture
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cli_greedy_equals_transformers_generate(arch, ckpt_factory):
    d, model = ckpt_factory(arch)
    n = 20
    res = subprocess.run(
        [sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(d), "--prompt", PROMPT_TEXT,
         "--temperature", "0", "--json", "--drafter", "none", "--max-new-tokens", str(n), "--device", "cpu"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(PROMPT_TEXT).ids
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)[0, len(ids):]
    assert out["token_ids"] == ref.tolist()
    assert len(out["token_ids"]) >= 2
    assert out["stats"]["tokens"] == len(out["token_ids"])
