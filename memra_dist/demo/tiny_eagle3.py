"""A tiny EAGLE-3 drafter for the demo and the tests, trained on the CPU in seconds against the
demo's tiny target (demo/tiny.py) on the embedded corpus, saved in the public checkpoint
format (model/eagle3.py): no embed_tokens (the target's is reused), a draft vocabulary of the
corpus's most frequent tokens with its d2t / t2d maps.

Training follows the drafter's inference ("training-time test", as EAGLE-3 trains): the
target (frozen) runs a window of the corpus from position 0, as a prompt does, keeping the
tapped layers' outputs. Step 0 runs every row p (token t_{p+1}, hidden fc(taps of p)) under a
causal mask, as the committed rows are. Step s >= 1 runs, for every anchor a, the chain row at
position a + s (token t_{a+s+1}, hidden = the same anchor's step s - 1 output), reading the
step-0 rows up to a and its own anchor's chain rows, exactly what a chain row reads at
inference. Each row is trained towards the target's greedy token after it (acceptance under
greedy verification is the goal), later steps weighted less.
Measured (2 cores, fp32): ~16 s; greedy acceptance 1.0 at k = 4 on the demo prompt and on a
paragraph's opening (with 3 training steps instead of 4: 0.8).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F

from ..threads import apply_cpu_threads
from ..model.config import load_config
from .corpus import CORPUS
from .demo_cache import build_once, write_checkpoint
from .distill import target_pass
from ..model.eagle3 import Eagle3Net, parse_eagle3_config
from ..model.loader import load_stage

__all__ = ["eagle3_config_dict", "save_eagle3", "random_eagle3", "train_eagle3", "demo_eagle3_dir",
           "TINY_EAGLE3", "EAGLE3_VERSION", "RECIPE"]

EAGLE3_VERSION = "1"  # bump when the recipe changes: the demo cache key
# the drafter's shape over the demo target (hidden 128, 4 layers, 256 tokens): low / mid / high taps
TINY_EAGLE3 = dict(taps=(0, 1, 3), heads=4, kv_heads=2, head_dim=32, intermediate_size=256, draft_vocab=200)
RECIPE = dict(steps=500, lr=4e-3, seq=128, ttt=4, seed=3)  # ~16 s on 2 cores


def eagle3_config_dict(target: dict, taps, heads: int, kv_heads: int, head_dim: int, intermediate_size: int,
                       draft_vocab: int) -> dict:
    """An EAGLE-3 config.json (the Llama head format) for a drafter over the target whose
    config.json is `target`; taps are layer OUTPUT ids (eagle_config's convention)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": target["hidden_size"],
            "intermediate_size": intermediate_size, "num_hidden_layers": 1, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
            "rope_theta": target.get("rope_theta", 10000.0), "vocab_size": target["vocab_size"],
            "draft_vocab_size": draft_vocab, "target_hidden_size": target["hidden_size"],
            "max_position_embeddings": target.get("max_position_embeddings", 2048), "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(taps), "use_aux_hidden_state": True},
            "torch_dtype": "float32"}


def save_eagle3(out: str | Path, net: Eagle3Net, cfg: dict, hot: torch.Tensor, embed: torch.Tensor | None = None
                ) -> Path:
    """config.json + model.safetensors (the net, d2t, t2d, optionally embed_tokens),
    atomically (demo/demo_cache.py)."""
    tensors = dict(net.state_dict())
    tensors["d2t"] = hot - torch.arange(hot.numel())
    tensors["t2d"] = torch.zeros(cfg["vocab_size"], dtype=torch.bool).index_fill_(0, hot, True)
    if embed is not None:
        tensors["embed_tokens.weight"] = embed
    return write_checkpoint(out, tensors, cfg)


def _new_net(cfg: dict, num_target_layers: int, seed: int, std: float) -> Eagle3Net:
    torch.manual_seed(seed)
    net = Eagle3Net(parse_eagle3_config(cfg, num_target_layers))
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return net


def random_eagle3(out: str | Path, target_dir: str | Path, seed: int = 0, std: float = 0.2, embed: bool = False,
                  **shape) -> Path:
    """An untrained EAGLE-3 checkpoint over `target_dir` (tests: exactness, reference
    equality): a random draft vocabulary (sorted target ids) and, with `embed`, its own
    embedding."""
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = eagle3_config_dict(tcfg, **{**TINY_EAGLE3, **shape})
    net = _new_net(cfg, tcfg["num_hidden_layers"], seed, std)
    g = torch.Generator().manual_seed(seed)
    hot = torch.randperm(cfg["vocab_size"], generator=g)[:cfg["draft_vocab_size"]].sort().values
    emb = torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g) if embed else None
    return save_eagle3(out, net, cfg, hot, emb)


def ttt_logits(net: Eagle3Net, feats: torch.Tensor, ids: torch.Tensor, embed, steps: int) -> list[torch.Tensor]:
    """Training-time test over a window: step s's draft-vocabulary logits (R, Vd) for every
    anchor a = 0 .. R-1 (R = T - 1), the row at position a + s. Row (s, a) predicts the
    token at a + s + 2; rows whose inputs fall past the window are garbage (mask them)."""
    T = ids.numel()
    R = T - 1
    a = torch.arange(R)
    causal = a[None, :] <= a[:, None]  # (R, R): step-0 rows up to the anchor
    eye = torch.eye(R, dtype=torch.bool)  # a chain row reads its own anchor's chain rows only
    Ks, Vs, out = [], [], []
    h = net.features(feats[:R])  # (R, H): g of rows 0 .. R-1
    for s in range(steps):
        tok = ids[(a + s + 1).clamp(max=T - 1)]

        def kv_of(k, v):
            Ks.append(k)
            Vs.append(v)
            return torch.cat(Ks), torch.cat(Vs)

        mask = torch.cat([causal] + [eye] * s, 1)  # (R, R * (s + 1))
        h = net.step(embed(tok), h, a + s, kv_of, mask)
        out.append(net.logits(h))
    return out


def _draft_vocab(ids: torch.Tensor, vocab: int, n: int) -> torch.Tensor:
    """The n most frequent target ids in the corpus stream, sorted (EAGLE-3's hot tokens)."""
    counts = torch.bincount(ids, minlength=vocab).float() + torch.arange(vocab, 0, -1) * 1e-6  # stable ties
    return counts.topk(n).indices.sort().values


def _corpus_stream(tok, corpus: str) -> tuple[torch.Tensor, list[int]]:
    """The corpus as one token stream, each paragraph encoded on its own (as a prompt is), and
    where each paragraph starts in it."""
    paras = [tok.encode(line).ids for line in corpus.splitlines() if line.strip()]
    starts = [sum(len(p) for p in paras[:i]) for i in range(len(paras))]
    return torch.tensor([t for p in paras for t in p], dtype=torch.long), starts


def train_eagle3(target_dir: str | Path, out: str | Path, steps: int = RECIPE["steps"], lr: float = RECIPE["lr"],
                 seq: int = RECIPE["seq"], ttt: int = RECIPE["ttt"], seed: int = RECIPE["seed"],
                 corpus: str = CORPUS, progress: Callable | None = None, **shape) -> Path:
    """Train an EAGLE-3 drafter against the (frozen) target in `target_dir` on `corpus` and
    save it to `out`."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = eagle3_config_dict(tcfg, **{**TINY_EAGLE3, **shape})
    L, V = tcfg["num_hidden_layers"], tcfg["vocab_size"]
    net = _new_net(cfg, L, seed, 0.05)
    stage = load_stage(target_dir, 0, L, True, True, torch.device("cpu"), torch.float32, load_config(target_dir))
    for p in stage.parameters():
        p.requires_grad_(False)
    ids, starts = _corpus_stream(Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json")), corpus)
    hot = _draft_vocab(ids, V, cfg["draft_vocab_size"])
    t2d = torch.full((V,), -100, dtype=torch.long).index_copy_(0, hot, torch.arange(hot.numel()))
    with torch.no_grad():  # the head starts as the target's own read-out, restricted to the draft vocabulary
        net.lm_head.weight.copy_(stage.lm_head.weight[hot])
        net.norm.weight.copy_(stage.norm.weight)
    prev = apply_cpu_threads(stage, "cpu")
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    n, seq = ids.numel(), min(seq, ids.numel())
    taps = net.ec.tap_ids
    try:
        for step in range(steps):
            s0 = starts[int(torch.randint(0, len(starts), (1,), generator=g))] if step % 2 == 0 else \
                int(torch.randint(0, max(1, n - seq // 2), (1,), generator=g))
            win = ids[s0:s0 + seq]
            T = win.numel()
            feats, pred = target_pass(stage, win, taps)
            loss = 0.0
            wsum = 0.0
            for s, logits in enumerate(ttt_logits(net, feats, win, stage.embed_tokens, ttt)):
                tgt = torch.arange(T - 1) + s + 1  # row (s, a) learns the target's token after a + s + 1
                labels = torch.where(tgt <= T - 1, t2d[pred[tgt.clamp(max=T - 1)]], -100)
                w = 0.8 ** s
                loss = loss + w * F.cross_entropy(logits, labels, ignore_index=-100)
                wsum += w
            loss = loss / wsum
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if progress is not None and (step % 50 == 0 or step == steps - 1):
                progress(step + 1, steps, float(loss.detach()))
    finally:
        torch.set_num_threads(prev)
    return save_eagle3(out, net, cfg, hot)


def demo_eagle3_dir(target_dir: Path, progress: Callable[[str], None] | None = None) -> Path:
    """The demo's EAGLE-3 drafter beside the demo target, trained once, then reused."""
    return build_once(Path(target_dir).parent / f"eagle3-v{EAGLE3_VERSION}", "the demo eagle3 drafter",
                      lambda out, cb: train_eagle3(target_dir, out, progress=cb), progress)
