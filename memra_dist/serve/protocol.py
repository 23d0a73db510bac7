"""The OpenAI completions protocol, as plain functions: request-body validation, the error
JSON, the completion object and its stream chunks, Server-Sent-Events framing. No web
framework, no Ray, no model: tests call these directly.

    req = parse_completion(b'{"prompt": "Hello", "max_tokens": 8, "stream": true}', served="llama")
    sse(chunk("cmpl-1", 0, "llama", " world"))   # b'data: {...}\\n\\n'
    SSE_DONE                                     # b'data: [DONE]\\n\\n'

A bad body raises ApiError(400) whose `param` names the field; an unknown model is a 404, as
OpenAI answers it. Fields the engine does not implement are accepted only at their neutral
value (n=1, echo=false, stop=null, penalties 0, ...), so a client never gets silently
different semantics."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

__all__ = ["ApiError", "CompletionRequest", "parse_completion", "error_body", "chunk", "completion", "sse",
           "SSE_DONE", "models_list", "finish_reason", "usage", "KNOWN_FIELDS"]

SSE_DONE = b"data: [DONE]\n\n"
MAX_SEED = 2 ** 64


class ApiError(Exception):
    """An HTTP error answer in OpenAI's shape. `outcome` is the requests-total label it counts under."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("rate_limit_error" if status == 429 else "invalid_request_error" if status < 500
                              else "server_error")

    @property
    def outcome(self) -> str:
        """429 / 503 rejected (busy), 408 / 499 aborted (the client did not finish), other 4xx
        bad_request, 5xx error."""
        return {429: "rejected", 503: "rejected", 408: "aborted", 499: "aborted"}.get(
            self.status, "bad_request" if self.status < 500 else "error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    prompt: str
    fields: dict = field(default_factory=dict)  # engine fields given: max_new_tokens, temperature, top_p, top_k, seed
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk carries the usage
    model: str = ""


def _bad(param: str, want: str, got) -> ApiError:
    shown = json.dumps(got)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return ApiError(400, f"'{param}' must be {want} (got {shown})", param, "invalid_value")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


# engine fields: OpenAI name -> (engine name, check, what it must be)
_ENGINE = {
    "max_tokens": ("max_new_tokens", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "temperature": ("temperature", lambda v: _is_num(v) and 0 <= v <= 2, "a number in [0, 2] (0 = greedy)"),
    "top_p": ("top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ("top_k", lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "seed": ("seed", lambda v: _is_int(v) and 0 <= v < MAX_SEED, "an integer in [0, 2^64)"),
}
# accepted only at their neutral value (null is always fine): name -> (check, what it must be)
_NEUTRAL = {
    "n": (lambda v: v == 1 and _is_int(v), "1 (one choice per request)"),
    "best_of": (lambda v: v == 1 and _is_int(v), "1"),
    "echo": (lambda v: v is False, "false (the prompt is not echoed)"),
    "logprobs": (lambda v: False, "null (log probabilities are not returned)"),
    "stop": (lambda v: v == [], "null (stop sequences are not supported)"),
    "suffix": (lambda v: False, "null (suffixes are not supported)"),
    "presence_penalty": (lambda v: _is_num(v) and v == 0, "0 (penalties are not supported)"),
    "frequency_penalty": (lambda v: _is_num(v) and v == 0, "0 (penalties are not supported)"),
    "logit_bias": (lambda v: v == {}, "null or {} (logit bias is not supported)"),
    "user": (lambda v: isinstance(v, str), "a string"),
}
KNOWN_FIELDS = ("model", "prompt", "stream", "stream_options", *_ENGINE, *_NEUTRAL)


def _lone_surrogate(text: str) -> int | None:
    """The index of a lone surrogate (JSON's "\\ud800" decodes to one; it is no character and
    has no UTF-8 form), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def _check_text(v, where: str, depth: int = 0) -> None:
    """Every string in the body (keys included) valid Unicode; a 400 naming the field otherwise."""
    if isinstance(v, str):
        at = _lone_surrogate(v)
        if at is not None:
            raise ApiError(400, f"'{where}' is not valid Unicode: a lone surrogate (\\u{ord(v[at]):04x}) at "
                                f"character {at}", where, "invalid_encoding")
    elif isinstance(v, dict) and depth < 8:
        for k, x in v.items():
            _check_text(k, where, depth + 1)
            _check_text(x, where, depth + 1)
    elif isinstance(v, list) and depth < 8:
        for x in v:
            _check_text(x, where, depth + 1)


def _parse_json(raw: bytes | str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                       None, "invalid_json") from None
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON", None, "invalid_json") from None


def parse_completion(raw: bytes | str, served: str) -> CompletionRequest:
    """A POST /v1/completions body -> CompletionRequest; ApiError naming the field otherwise.
    `served`: the model this server holds (a body's `model`, when given, must name it)."""
    obj = _parse_json(raw)
    if not isinstance(obj, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    for k in obj:
        if _lone_surrogate(k) is not None:
            raise ApiError(400, "a field name is not valid Unicode (a lone surrogate)", None, "invalid_encoding")
        if k not in KNOWN_FIELDS:
            shown = k if len(k) <= 40 else k[:37] + "..."
            raise ApiError(400, f"unrecognized request argument '{shown}' (known: {', '.join(KNOWN_FIELDS)})", shown,
                           "unknown_parameter")
    for k, v in obj.items():
        _check_text(v, k)
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string", model)
    if model and model != served:
        shown = model if len(model) <= 60 else model[:57] + "..."
        raise ApiError(404, f"the model '{shown}' does not exist: this server serves '{served}'", "model",
                       "model_not_found")
    if "prompt" not in obj or obj["prompt"] is None:
        raise ApiError(400, "'prompt' is required", "prompt", "missing_parameter")
    prompt = obj["prompt"]
    if isinstance(prompt, list):
        raise ApiError(400, "'prompt' must be one string (arrays of prompts or of token ids are not supported)",
                       "prompt", "invalid_type")
    if not isinstance(prompt, str):
        raise _bad("prompt", "a string", prompt)
    if not prompt:
        raise ApiError(400, "'prompt' is empty", "prompt", "invalid_value")
    from ..specdec.sampling import SAMPLING_FIELDS, sampling_rule  # noqa: PLC0415 (torch-free)

    fields = {}
    for name, (engine_name, ok, want) in _ENGINE.items():
        v = obj.get(name)
        if v is None:
            continue  # absent or null: the server's flag
        if not ok(v):
            raise _bad(name, want, v)
        # the sampling values' one rule (the CLI's and the batch lines'), under the API's own range
        shared = sampling_rule(engine_name, v) if engine_name in SAMPLING_FIELDS else None
        if shared:
            raise _bad(name, shared, v)
        fields[engine_name] = v
    for name, (ok, want) in _NEUTRAL.items():
        v = obj.get(name)
        if v is not None and not ok(v):
            raise _bad(name, want, v)
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "true or false", stream)
    usage = _stream_options(obj.get("stream_options"), bool(stream))
    return CompletionRequest(prompt, fields, bool(stream), usage, model or served)


def _stream_options(opts, stream: bool) -> bool:
    if opts is None:
        return False
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed with \"stream\": true", "stream_options",
                       "invalid_value")
    if not isinstance(opts, dict) or any(k != "include_usage" for k in opts):
        raise _bad("stream_options", '{"include_usage": true|false}', opts)
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise _bad("stream_options", '{"include_usage": true|false}', opts)
    return usage


# ---- answers ----------------------------------------------------------------------------


def finish_reason(token_ids: list[int], eos_ids) -> str:
    """'stop' when the model ended its text, 'length' when it hit max_tokens or the context."""
    return "stop" if token_ids and token_ids[-1] in eos_ids else "length"


def _choice(text: str, reason: str | None) -> dict:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: the prompt's tokens served from the prefix cache.

    >>> usage(40, 8, 32)["prompt_tokens_details"]
    {'cached_tokens': 32}
    """
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chunk(cid: str, created: int, model: str, text: str, reason: str | None = None, use: dict | None = None) -> dict:
    """One stream chunk: a text delta, the last one with its finish_reason; a usage chunk
    (stream_options.include_usage) has no choices."""
    out = {"id": cid, "object": "text_completion", "created": created, "model": model,
           "choices": [] if use is not None else [_choice(text, reason)]}
    if use is not None:
        out["usage"] = use
    return out


def completion(cid: str, created: int, model: str, text: str, reason: str, prompt_tokens: int,
               completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [_choice(text, reason)], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "memra-dist"}]}


def sse(obj: dict) -> bytes:
    """One Server-Sent Event carrying `obj` as compact JSON (JSON never holds a raw newline)."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
