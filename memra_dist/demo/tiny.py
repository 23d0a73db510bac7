"""Tiny HF-format checkpoints (config.json + model.safetensors + tokenizer.json), made on the
machine: for the demo (trained for a few seconds on the embedded corpus, so the text is
readable and the drafter agrees with the target) and for tests (random weights)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..threads import apply_cpu_threads
from ..model.config import parse_config
from .corpus import CORPUS
from .demo_cache import write_checkpoint
from ..model.loader import hf_name
from ..model.transformer import Stage

__all__ = ["train_tokenizer", "llama_config", "build_checkpoint", "demo_checkpoints", "demo_dflash", "DEMO_SHAPES"]

DEMO_SHAPES = {
    "target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2),
    "draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1),
}
# name -> (train steps, learning rate, seed). A wide init (std 0.1) lets the 4-layer target
# leave the uniform-loss plateau within a few dozen steps (at 0.02 it needs hundreds).
DEMO_RECIPE = {"target": (200, 3e-3, 0), "draft": (200, 5e-3, 1)}
DEMO_INIT_STD = 0.1
DEMO_VERSION = "3"  # bump when the demo recipe changes: the cache key


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


def _paragraphs(tok: Tokenizer, corpus: str) -> tuple[torch.Tensor, list[int]]:
    """The corpus as one token stream, each non-empty line (a paragraph) encoded on its own, as a
    prompt is; and where each paragraph starts in that stream."""
    paras = [tok.encode(line).ids for line in corpus.splitlines() if line.strip()]
    starts, n = [], 0
    for ids in paras:
        starts.append(n)
        n += len(ids)
    return torch.tensor([t for ids in paras for t in ids], dtype=torch.long), starts


def _train(stage: Stage, ids: torch.Tensor, starts: list[int], steps: int, seq: int, seed: int,
           progress: Callable | None, lr: float):
    """AdamW with a cosine schedule, one window of `seq` tokens per step, positions from 0 (as a
    generation starts). Every other window starts at a paragraph start, so a prompt that opens
    a paragraph continues it exactly; the others start anywhere in the stream."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(stage.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    n = ids.numel()
    seq = min(seq, n - 1)
    for step in range(steps):
        if step % 2 == 0:
            s = starts[int(torch.randint(0, len(starts), (1,), generator=g))]
        else:
            s = int(torch.randint(0, max(1, n - seq // 4), (1,), generator=g))
        y = ids[s + 1:s + seq + 1]
        x = ids[s:s + y.numel()]
        loss = torch.nn.functional.cross_entropy(stage.logits(stage(x, torch.arange(x.numel()), None)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if progress is not None and (step % max(25, steps // 8) == 0 or step == steps - 1):  # <= ~10 lines
            progress(step + 1, steps, float(loss.detach()))


def build_checkpoint(out: str | Path, cfg_dict: dict, tok: Tokenizer, seed: int = 0, train_steps: int = 0,
                     corpus: str = CORPUS, progress: Callable | None = None, init_std: float = 0.02,
                     lr: float = 3e-3, seq: int = 160) -> Path:
    """Write config.json, model.safetensors and tokenizer.json to `out` (atomically: a temp
    directory renamed into place, so a crash leaves all of it or none). Matrices start as
    N(0, init_std); with `train_steps`, the model then trains on `corpus` (on the CPU, at the
    thread count `apply_cpu_threads` picks for its size)."""
    out = Path(out)
    cfg = parse_config(cfg_dict)
    torch.manual_seed(seed)
    stage = Stage(cfg, 0, cfg.num_layers, True, True)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_std)
    if train_steps:
        ids, starts = _paragraphs(tok, corpus)
        prev = apply_cpu_threads(stage, "cpu")
        try:
            _train(stage, ids, starts, train_steps, seq, seed, progress, lr)
        finally:
            torch.set_num_threads(prev)
    return write_checkpoint(out, {hf_name(k): v for k, v in stage.state_dict().items()}, cfg_dict,
                            extra=lambda d: tok.save(str(d / "tokenizer.json")))


def demo_cache_dir() -> Path:
    from ..env import cache_root  # noqa: PLC0415

    return Path(cache_root()) / f"demo-v{DEMO_VERSION}"


def demo_checkpoints(progress: Callable[[str], None] | None = None,
                     before_training: Callable[[dict, Tokenizer], None] | None = None) -> tuple[Path, Path]:
    """(target_dir, draft_dir), built once into the user cache directory, then reused.
    `before_training(shapes, tok)`: called once the shapes are known, before the models are
    trained (the demo compiles its kernels meanwhile: prewarm.py)."""
    root = demo_cache_dir()
    target, draft = root / "target", root / "draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return target, draft
    root.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda s: None)
    tok = train_tokenizer()
    shapes = {name: llama_config(tok.get_vocab_size(), **DEMO_SHAPES[name]) for name in DEMO_RECIPE}
    if before_training is not None:
        before_training(shapes, tok)
    for name, (steps, lr, seed) in DEMO_RECIPE.items():
        t0 = time.perf_counter()
        cfg = shapes[name]
        cb = lambda i, n, loss, name=name: say(f"training the demo {name}: step {i}/{n} loss {loss:.3f}")  # noqa: E731
        build_checkpoint(root / name, cfg, tok, seed=seed, train_steps=steps, progress=cb,
                         init_std=DEMO_INIT_STD, lr=lr)
        say(f"built the demo {name} in {time.perf_counter() - t0:.1f}s -> {root / name}")
    return target, draft


def demo_dflash(progress: Callable[[str], None] | None = None) -> Path:
    """The demo's DFlash drafter over the demo target (demo/tiny_dflash.py), built once."""
    from .tiny_dflash import demo_dflash_dir  # noqa: PLC0415

    target, _ = demo_checkpoints(progress)
    return demo_dflash_dir(target, progress)
