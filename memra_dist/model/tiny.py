"""Tiny HF-format checkpoints (config.json + model.safetensors + tokenizer.json), made on the
machine: for the demo (trained for a few seconds on the embedded corpus, so the text is
readable and the drafter agrees with the target) and for tests (random weights)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .config import parse_config
from .corpus import CORPUS
from .loader import hf_name
from .transformer import Stage

__all__ = ["train_tokenizer", "llama_config", "build_checkpoint", "demo_checkpoints", "DEMO_SHAPES"]

DEMO_SHAPES = {
    "target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2),
    "draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1),
}
DEMO_VERSION = "2"  # bump when the demo recipe changes: the cache key


def train_tokenizer(corpus: str = CORPUS, vocab_size: int = 256) -> Tokenizer:
    """A BPE tokenizer over the corpus characters (sentencepiece-style word boundaries)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator([corpus], trainer=trainer)
    return tok


def llama_config(vocab_size: int, **shape) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "float32", **shape}


def _train(stage: Stage, ids: torch.Tensor, steps: int, seq: int, seed: int, progress: Callable | None,
           lr: float = 2e-3):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(stage.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    seq = min(seq, ids.numel() - 1)
    pos = torch.arange(seq)
    for step in range(steps):
        s = int(torch.randint(0, ids.numel() - seq, (1,), generator=g))
        x, y = ids[s:s + seq], ids[s + 1:s + seq + 1]
        loss = torch.nn.functional.cross_entropy(stage.logits(stage(x, pos, None)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if progress is not None and (step % 25 == 0 or step == steps - 1):
            progress(step + 1, steps, float(loss.detach()))


def build_checkpoint(out: str | Path, cfg_dict: dict, tok: Tokenizer, seed: int = 0, train_steps: int = 0,
                     corpus: str = CORPUS, progress: Callable | None = None) -> Path:
    """Write config.json, model.safetensors and tokenizer.json to `out` (atomically: a temp
    directory renamed into place, so a crash leaves all of it or none)."""
    out = Path(out)
    cfg = parse_config(cfg_dict)
    torch.manual_seed(seed)
    stage = Stage(cfg, 0, cfg.num_layers, True, True)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    if train_steps:
        ids = torch.tensor(tok.encode(corpus).ids)
        _train(stage, ids, train_steps, 512, seed, progress)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        tensors = {hf_name(k): v.detach().contiguous() for k, v in stage.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
        tok.save(str(tmp / "tokenizer.json"))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def demo_cache_dir() -> Path:
    base = os.environ.get("MEMRA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memra_dist")
    return Path(base) / f"demo-v{DEMO_VERSION}"


def demo_checkpoints(progress: Callable[[str], None] | None = None) -> tuple[Path, Path]:
    """(target_dir, draft_dir), built once into the user cache directory, then reused."""
    root = demo_cache_dir()
    target, draft = root / "target", root / "draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return target, draft
    root.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda s: None)
    tok = train_tokenizer()
    for name, steps, seed in (("target", 400, 0), ("draft", 300, 1)):
        t0 = time.perf_counter()
        cfg = llama_config(tok.get_vocab_size(), **DEMO_SHAPES[name])
        cb = lambda i, n, loss, name=name: say(f"training the demo {name}: step {i}/{n} loss {loss:.3f}")  # noqa: E731
        build_checkpoint(root / name, cfg, tok, seed=seed, train_steps=steps, progress=cb)
        say(f"built the demo {name} in {time.perf_counter() - t0:.1f}s -> {root / name}")
    return target, draft
