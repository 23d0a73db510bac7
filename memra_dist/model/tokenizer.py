"""Tokenizer from `tokenizer.json` (the `tokenizers` library), with incremental detokenizing."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import UserError

__all__ = ["Tokenizer", "load_tokenizer"]


class Tokenizer:
    def __init__(self, tok: _HFTokenizer):
        self.tok = tok

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    # the same, with the GIL released while `tokenizers` works (its batch calls), so a server's
    # event loop runs on while a worker thread tokenizes
    def encode_released(self, text: str) -> list[int]:
        return self.tok.encode_batch([text], add_special_tokens=True)[0].ids

    def decode_released(self, ids: list[int]) -> str:
        return self.tok.decode_batch([list(ids)], skip_special_tokens=True)[0]


class StreamDecoder:
    """Turns a growing id list into text deltas (decode-all-and-diff: exact for any merges).
    Seeded with the prompt's ids, the first delta carries the space between the prompt and
    the continuation that decoding the continuation alone would drop."""

    def __init__(self, tok: Tokenizer, prefix: list[int] | None = None):
        self.tok, self.ids = tok, list(prefix or [])
        self.text = tok.decode(self.ids) if self.ids else ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte char: wait for the rest
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    p = Path(model_dir) / "tokenizer.json"
    if not p.exists():
        raise UserError(f"{model_dir}: no tokenizer.json (the tokenizer is read from it)")
    try:
        return Tokenizer(_HFTokenizer.from_file(str(p)))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise UserError(f"{p}: cannot load tokenizer ({str(e).splitlines()[0][:200]})") from None
