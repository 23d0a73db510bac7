"""The request-body limit's default and its parser: light (no web stack), so `memra-dist
serve --help` and every other command build their parsers without importing starlette."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_BODY_BYTES", "parse_size"]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a prompt that fits any context, JSON-escaped, with room to spare


def parse_size(text: str) -> int:
    """'4194304', '4MiB', '4MB', '512k' -> bytes (K/M/G are 1024-based); ValueError otherwise."""
    s = str(text).strip().lower().replace(" ", "")
    for suffix, mult in (("kib", 1 << 10), ("mib", 1 << 20), ("gib", 1 << 30), ("kb", 1 << 10), ("mb", 1 << 20),
                         ("gb", 1 << 30), ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("b", 1)):
        if s.endswith(suffix):
            s, m = s[: -len(suffix)], mult
            break
    else:
        m = 1
    if not s or not s.isdigit():
        raise ValueError(f"expected a byte count such as 4194304 or 4MiB (got {text!r})")
    return int(s) * m
