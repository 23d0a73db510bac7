"""The batch job's input: JSONL lines -> requests (validated) or refusals, and each request's
own config. The format is serve/batch.py's module doc.

Bounded: the file is read a line at a time, at most `max_line_bytes` + 2 bytes at once; a
longer line is refused unparsed (an error record naming its line) and the rest of it skipped
in pieces of SKIP_BYTES, so a 24 MB line costs what the limit does, not its length."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field

from ..errors import UserError
from ..specdec.sampling import sampling_rule
from .body_size import DEFAULT_MAX_BODY_BYTES
from .results_file import id_key, is_int, line_key, valid_id

__all__ = ["Request", "Refused", "FIELDS", "OPTIONAL", "parse_input", "read_input", "prompt_hash", "request_cfg",
           "show", "DEFAULT_MAX_LINE_BYTES", "MIN_LINE_BYTES", "MAX_LINE_BYTES"]

DEFAULT_MAX_LINE_BYTES = DEFAULT_MAX_BODY_BYTES  # a line holds what a server's request body may (4 MiB)
MIN_LINE_BYTES, MAX_LINE_BYTES = 1 << 10, 1 << 30  # --max-line-bytes' range (serve's --max-body-bytes')
SKIP_BYTES = 1 << 20  # the rest of an over-long line is read past in pieces of this many bytes

OPTIONAL = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
FIELDS = ("id", "prompt", *OPTIONAL)


def prompt_hash(prompt: str) -> str:
    """The first 16 hex digits of the SHA-256 of the prompt's UTF-8 (a lone surrogate from
    the JSON input kept as is): what a record says its request's prompt was."""
    return hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass
class Request:
    line: int
    id: str | int
    prompt: str
    fields: dict = field(default_factory=dict)  # the optional fields given (validated), by name

    @property
    def key(self) -> str:
        return id_key(self.id)


@dataclass
class Refused:
    line: int
    error: str
    id: str | int | None = None  # None: the line has no usable id (the record names the line)
    has_id: bool = False

    @property
    def key(self) -> str:
        return id_key(self.id) if self.has_id else line_key(self.line)

    def record(self) -> dict:
        return {"id": self.id, "error": self.error} if self.has_id else {"line": self.line, "error": self.error}


def show(v, n: int = 40) -> str:
    """A JSON value for a one-line message, cut to `n` characters."""
    s = json.dumps(v)
    return s if len(s) <= n else s[: n - 3] + "..."


_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true/false",
          type(None): "null"}


def _check_field(name: str, v) -> str | None:
    """None when `v` is a good value of the optional field `name`, else the error. The
    sampling fields follow specdec/sampling.py's rules (the CLI's and the server's too)."""
    if name == "max_new_tokens":
        ok, want = is_int(v) and v >= 1, "an integer >= 1"
    else:  # temperature, top_p, top_k, seed
        want = sampling_rule(name, v)
        ok = want is None
    return None if ok else f"'{name}' must be {want} (got {show(v)})"


def _parse_line(n: int, raw: bytes, seen: dict) -> Request | Refused:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Refused(n, "the line is not UTF-8 text")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Refused(n, f"malformed JSON: {e.msg} (column {e.colno})")
    except (ValueError, RecursionError):
        return Refused(n, "malformed JSON")
    if not isinstance(obj, dict):
        return Refused(n, f"expected a JSON object, got {_KINDS.get(type(obj), 'something else')}")
    if "id" not in obj:
        return Refused(n, "missing 'id'")
    rid = obj["id"]
    if not valid_id(rid):
        return Refused(n, f"'id' must be a string or an integer (got {show(rid)})")
    key = id_key(rid)
    if key in seen:
        return Refused(n, f"duplicate id {show(rid)} (first on line {seen[key]})")
    seen[key] = n

    def refuse(msg: str) -> Refused:
        return Refused(n, msg, rid, True)

    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        return refuse(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)} "
                      f"(a request has {', '.join(FIELDS)})")
    if "prompt" not in obj:
        return refuse("missing 'prompt'")
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        return refuse(f"'prompt' must be a string (got {_KINDS.get(type(prompt), 'something else')})")
    if not prompt:
        return refuse("the prompt is empty")
    fields = {}
    for name in OPTIONAL:
        v = obj.get(name)
        if v is None:
            continue  # absent or null: the job's value
        bad = _check_field(name, v)
        if bad:
            return refuse(bad)
        fields[name] = v
    return Request(n, rid, prompt, fields)


def _lines(f, limit: int):
    """(line number, its bytes without the line end, or None when it is over `limit` bytes,
    its length) for each non-blank line of the binary file `f`; never more than limit + 2
    bytes of a line in memory (its "\\r\\n" is not counted)."""
    n = 0
    while True:
        piece = f.readline(limit + 2)
        if not piece:
            return
        n += 1
        whole = piece.endswith(b"\n")
        raw = piece[:-1] if whole else piece
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if len(raw) <= limit:
            if raw.strip():
                yield n, raw, len(raw)
            continue
        size, blank = len(piece) - whole, not piece.strip()
        while not whole:  # the rest of the line, in bounded pieces: never held whole
            piece = f.readline(SKIP_BYTES)
            whole = not piece or piece.endswith(b"\n")
            size += len(piece) - piece.endswith(b"\n")
            blank = blank and not piece.strip()
        if not blank:
            yield n, None, size


def _entries(f, max_line_bytes: int) -> list[Request | Refused]:
    seen: dict[str, int] = {}
    out: list[Request | Refused] = []
    for n, raw, size in _lines(f, max_line_bytes):
        if raw is None:
            out.append(Refused(n, f"the line is {size} bytes, over the limit of {max_line_bytes} "
                                  "(--max-line-bytes): refused unread"))
        else:
            out.append(_parse_line(n, raw, seen))
    return out


def parse_input(data: bytes, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> list[Request | Refused]:
    """Every non-blank line, in order, as a request or a refusal."""
    return _entries(io.BytesIO(data), max_line_bytes)


def read_input(path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> list[Request | Refused]:
    """The file's lines as `parse_input` gives them, read a bounded piece at a time."""
    try:
        with open(path, "rb") as f:
            return _entries(f, max_line_bytes)
    except FileNotFoundError:
        raise UserError(f"--input {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"--input {path}: is a directory") from None
    except OSError as e:
        raise UserError(f"--input {path}: cannot read ({e.strerror or e})") from None


def request_cfg(cfg, req: Request):
    """The job's RunConfig with the request's own fields (max_new_tokens, seed, sampling)."""
    from ..specdec.sampling import SamplingParams  # noqa: PLC0415

    f = req.fields
    sp = cfg.sampling
    kw = {}
    if "max_new_tokens" in f:
        kw["max_new_tokens"] = f["max_new_tokens"]
    if "seed" in f:
        kw["seed"] = f["seed"]
    if any(x in f for x in ("temperature", "top_k", "top_p")):
        kw["sampling"] = SamplingParams(float(f.get("temperature", sp.temperature)), int(f.get("top_k", sp.top_k)),
                                        float(f.get("top_p", sp.top_p)))
    return cfg.with_(**kw) if kw else cfg
