"""Self-distillation data for the tiny drafters: the target's own greedy continuations of many
prompts, the text a drafter meets when it drafts for that target.

Acceptance is agreement with the target's greedy tokens, so a drafter should learn the
target's behaviour, not the corpus: trained only on the corpus it accepts ~0 on text it never
saw. Here the (frozen) target continues a few hundred training prompts: windows of the corpus
(from any word, not only a paragraph's start), shuffles of the corpus's words and random
strings of the corpus's characters. A trainer reads these sequences, teacher forced, with the
target's argmax at each row as its label, as on the corpus (demo/tiny_mtp.py mixes the two).
The target memorized the corpus, so its continuations often run into corpus text, including
paragraphs left out of `corpus`: such a paragraph is absent from the prompts, not from the
sequences.

`greedy_continuations` runs a batch of sequences in lockstep through the real blocks: one
KV cache holds every sequence in its own span of slots; a row's rotary rows come from its
position in its sequence, its cache slot is span start + position, and its mask lets it read
its own span up to its position. Attention-class targets only (KV caches: the demo's llama
and glm4_moe).
"""

from __future__ import annotations

import torch

from ..model.transformer import Stage, StepCtx

__all__ = ["greedy_continuations", "distill_prompts", "distill_sequences", "target_pass", "DISTILL"]

# prompts of 2 .. 24 tokens, each continued by the target for 64 tokens: the demo's shape
# (a 12-token prompt, 64 new tokens)
DISTILL = dict(n=256, n_new=64, min_len=2, max_len=24, batch=16)


@torch.no_grad()
def _rows(stage: Stage, cache, ids: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
    """The target's greedy next token (R,) after rows `ids` (R,) of sequences `seq` at positions
    `pos` (in their sequences), written to slots seq * span + pos of the shared cache."""
    slots = seq * span + pos
    c = torch.arange(cache.capacity)
    mask = (c[None, :] // span == seq[:, None]) & (c[None, :] % span <= pos[:, None])
    ctx = StepCtx(pos=slots, mask=mask, rope=stage.step_ctx(pos, None).rope)
    x = stage.embed_tokens(ids)
    for i, blk in stage.layers.items():
        x = blk(x, ctx, cache.layers[int(i)])
    return stage.logits(x).argmax(-1)


@torch.no_grad()
def greedy_continuations(stage: Stage, prompts: list[torch.Tensor], n_new: int, batch: int = 32) -> list[torch.Tensor]:
    """Each prompt (1-D token ids) followed by the target's `n_new` greedy tokens, as plain
    greedy decoding from position 0 gives them. `stage` holds the whole model (embedding,
    every layer, head); `batch` sequences share one cache and one forward per token."""
    out: list[torch.Tensor] = []
    for b0 in range(0, len(prompts), batch):
        group = [p.long() for p in prompts[b0:b0 + batch]]
        span = max(p.numel() for p in group) + n_new
        p0 = next(stage.parameters())
        cache = stage.new_cache(span * len(group), p0.device, p0.dtype)
        lens = torch.tensor([p.numel() for p in group])
        seq = torch.arange(len(group)).repeat_interleave(lens)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()])
        nxt = _rows(stage, cache, torch.cat(group), seq, pos, span)[lens.cumsum(0) - 1]  # each prompt's last row
        new = [nxt]
        rows = torch.arange(len(group))
        for step in range(n_new - 1):
            nxt = _rows(stage, cache, nxt, rows, lens + step, span)
            new.append(nxt)
        gen = torch.stack(new, 1)  # (batch, n_new)
        out += [torch.cat([p, g]) for p, g in zip(group, gen)]
    return out


def distill_prompts(tok, corpus: str, n: int, seed: int, min_len: int = DISTILL["min_len"],
                    max_len: int = DISTILL["max_len"]) -> list[torch.Tensor]:
    """`n` training prompts of `min_len` .. `max_len` tokens, in turn: a window of the corpus
    from a random word, a shuffle of the corpus's words, a random string of its characters
    (letters, spaces and punctuation in their corpus frequencies), each encoded as a prompt
    is. Deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)

    def rint(hi: int) -> int:
        return int(torch.randint(0, hi, (1,), generator=g))

    words = corpus.split()
    chars = [c for c in corpus if c != "\n"]
    out = []
    for i in range(n):
        m = min_len + rint(max_len - min_len + 1)
        if i % 3 == 0:
            w = rint(len(words))
            text = " ".join(words[w:w + m])
        elif i % 3 == 1:
            text = " ".join(words[rint(len(words))] for _ in range(m))
        else:
            text = "".join(chars[rint(len(chars))] for _ in range(3 * m))
        ids = tok.encode(text).ids[:m]
        if len(ids) < min_len:  # a window at the corpus's end: pad from a shuffle
            ids += tok.encode(" ".join(words[rint(len(words))] for _ in range(m))).ids[:m - len(ids)]
        out.append(torch.tensor(ids, dtype=torch.long))
    return out


def distill_sequences(stage: Stage, tok, corpus: str, seed: int, n: int = DISTILL["n"],
                      n_new: int = DISTILL["n_new"], batch: int = DISTILL["batch"]) -> list[torch.Tensor]:
    """`n` prompts (`distill_prompts`) each continued by the target's greedy tokens."""
    return greedy_continuations(stage, distill_prompts(tok, corpus, n, seed), n_new, batch)


@torch.no_grad()
def target_pass(stage: Stage, ids: torch.Tensor, taps) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over ids at positions 0..T-1, no cache: (the tapped layers' outputs
    concatenated in tap order (T, n * H), the greedy next ids (T,)): a tap drafter's training
    features and labels (demo/tiny_dflash.py, demo/tiny_eagle3.py)."""
    x = stage.embed_tokens(ids)
    ctx = stage.step_ctx(torch.arange(ids.numel()), None)
    kept = {}
    for i, blk in stage.layers.items():
        x = blk(x, ctx, None)
        if int(i) in taps:
            kept[int(i)] = x
    return torch.cat([kept[t] for t in taps], -1), stage.logits(x).argmax(-1)
