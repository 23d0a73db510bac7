"""A tiny glm4_moe target with a trained MTP layer, made on the CPU in seconds on the embedded
corpus: the demo's `--drafter mtp` model and the tests' wiring check.

The target (4 layers, the first dense, then MoE with a shared expert and sigmoid routing) is
trained like the demo's llama (demo/tiny.py `build_checkpoint`). Then, target frozen, one
MTP layer is trained exactly as the drafter runs it: over a sequence from position 0, row p
takes the target's final-normed hidden h_p and the token t_{p+1}; its output's logits
(through the target's lm_head) are trained towards the target's greedy token after p + 1, so
greedy acceptance is the goal. One step in `corpus_every` reads a window of the corpus; the
others read the target's own greedy continuation of a training prompt (self-distillation,
demo/distill.py), so the layer learns the target's behaviour beyond the corpus's text. The
layer is stored the released checkpoints' way (`model.layers.{L}.*`,
`num_nextn_predict_layers: 1`), in the same model.safetensors.
Measured (2 cores, ~42 s with the target): greedy acceptance 1.0 / 0.79 at k = 1 / 3 on the
demo prompt; on 24 novel sentences 0.63 / 0.36 (corpus windows only: 0.47 / 0.23); on a
paragraph left out of `corpus` 1.0 / 0.68 (corpus only: 0.07 / 0.02), as the target's
continuations of the other prompts run into it. tests/test_heldout_acceptance.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from ..threads import apply_cpu_threads
from ..model.config import load_config, parse_config
from .corpus import CORPUS
from .distill import DISTILL, distill_sequences
from ..model.loader import hf_name, load_stage
from ..model.mtp import MTPHead
from ..model.transformer import StepCtx

__all__ = ["glm_config", "train_mtp", "build_mtp_target", "demo_mtp_dir", "MTP_VERSION", "TARGET_RECIPE", "MTP_RECIPE"]

MTP_VERSION = "3"  # the demo cache key: bump when a recipe changes
# 1000 steps (~30 s): a target trained longer writes steadier text off its corpus, which its MTP
# layer follows (held-out acceptance at k = 1: 0.31 / 0.56 / 0.79 after 200 / 600 / 1000 steps)
TARGET_RECIPE = dict(steps=1000, lr=3e-3, seed=0)
MTP_RECIPE = dict(steps=600, lr=5e-3, seq=160, seed=7, distill=DISTILL["n"], corpus_every=4)


def glm_config(vocab_size: int) -> dict:
    """The tiny glm4_moe's config.json (the demo target's widths, MoE from layer 1)."""
    return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": vocab_size,
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "partial_rotary_factor": 0.5, "use_qk_norm": True,
            "attention_bias": True, "moe_intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "routed_scaling_factor": 1.0, "norm_topk_prob": True, "num_nextn_predict_layers": 0,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "float32"}


def _stream(tok, corpus: str) -> tuple[torch.Tensor, list[int]]:
    paras = [tok.encode(line).ids for line in corpus.splitlines() if line.strip()]
    starts = [sum(len(p) for p in paras[:i]) for i in range(len(paras))]
    return torch.tensor([t for p in paras for t in p], dtype=torch.long), starts


@torch.no_grad()
def _target_pass(stage, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-normed hidden (T, H), greedy next ids (T,)) of the target over ids from position 0."""
    h = stage.norm(stage(ids, torch.arange(ids.numel()), None))
    return h, stage.lm_head(h).argmax(-1)


def train_mtp(target_dir: str | Path, steps: int = MTP_RECIPE["steps"], lr: float = MTP_RECIPE["lr"],
              seq: int = MTP_RECIPE["seq"], seed: int = MTP_RECIPE["seed"], corpus: str = CORPUS,
              progress: Callable | None = None, distill: int = MTP_RECIPE["distill"],
              corpus_every: int = MTP_RECIPE["corpus_every"]) -> Path:
    """Train one MTP layer against the (frozen) target in `target_dir` and add it to the
    checkpoint there (tensors at `model.layers.{L}.*`, config num_nextn_predict_layers = 1).
    `distill` prompts drawn from `corpus` are continued by the target (0: corpus windows only);
    every `corpus_every`-th step reads a corpus window instead of one of those sequences."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    target_dir = Path(target_dir)
    d = json.loads((target_dir / "config.json").read_text())
    d1 = dict(d, num_nextn_predict_layers=1)
    cfg = parse_config(d1)
    stage = load_stage(target_dir, 0, cfg.num_layers, True, True, torch.device("cpu"), torch.float32,
                       load_config(target_dir))
    for p in stage.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)
    head = MTPHead(cfg, 1)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    layer = head.layer(0)
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    ids, starts = _stream(tok, corpus)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    n = ids.numel()
    seq = min(seq, n - 1)
    prev = apply_cpu_threads(stage, "cpu")
    try:
        seqs = distill_sequences(stage, tok, corpus, seed, n=distill) if distill else []
        for step in range(steps):
            if seqs and step % corpus_every:
                win = seqs[int(torch.randint(0, len(seqs), (1,), generator=g))]
            else:  # every other corpus window starts at a paragraph's start
                nth = step // corpus_every if seqs else step
                s0 = starts[int(torch.randint(0, len(starts), (1,), generator=g))] if nth % 2 == 0 else \
                    int(torch.randint(0, max(1, n - seq), (1,), generator=g))
                win = ids[s0:s0 + seq]
            h, pred = _target_pass(stage, win)  # (T, H), (T,)
            T = win.numel() - 1  # rows p = 0 .. T-1: (h_p, t_{p+1}) -> the target's greedy token after p + 1
            pos = torch.arange(T)
            ctx = StepCtx(pos=pos, mask=None, rope=head.step_ctx(pos, 1).rope)
            out = layer.step(stage.embed_tokens(win[1:]), h[:T], ctx, None)
            loss = F.cross_entropy(stage.lm_head(out), pred[1:T + 1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if progress is not None and (step % 50 == 0 or step == steps - 1):
                progress(step + 1, steps, float(loss.detach()))
    finally:
        torch.set_num_threads(prev)
    W = load_file(str(target_dir / "model.safetensors"))
    W.update({hf_name(k): v.detach().contiguous() for k, v in head.state_dict().items()})
    save_file(W, str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    (target_dir / "config.json").write_text(json.dumps(d1, indent=2))
    return target_dir


def build_mtp_target(out: str | Path, progress: Callable[[str], None] | None = None) -> Path:
    """The tiny glm4_moe target trained on the corpus, then its MTP layer; written atomically."""
    from .tiny import DEMO_INIT_STD, build_checkpoint, train_tokenizer  # noqa: PLC0415

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda s: None)
    tok = train_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        t0 = time.perf_counter()
        r = TARGET_RECIPE
        build_checkpoint(tmp / "m", glm_config(tok.get_vocab_size()), tok, seed=r["seed"], train_steps=r["steps"],
                         init_std=DEMO_INIT_STD, lr=r["lr"],
                         progress=lambda i, n, loss: say(f"training the MTP demo target: step {i}/{n} loss {loss:.3f}"))
        train_mtp(tmp / "m", progress=lambda i, n, loss: say(f"training its MTP layer: step {i}/{n} loss {loss:.3f}"))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "m", out)
        say(f"built the MTP demo target in {time.perf_counter() - t0:.1f}s -> {out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def demo_mtp_dir(root: Path, progress: Callable[[str], None] | None = None) -> Path:
    """The demo's MTP target under `root` (the demo cache), built once, then reused."""
    out = Path(root) / f"mtp-v{MTP_VERSION}"
    if not (out / "config.json").exists():
        build_mtp_target(out, progress)
    return out
