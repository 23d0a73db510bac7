"""The stderr line shapes, kept stable so scripts that grep them keep working."""

from __future__ import annotations

from ..tracing.conventions import TAGS
from .records import BurstRecord

__all__ = ["phase_line", "phase_v_line", "fast_path_label"]


def fast_path_label(fp: dict | None) -> str:
    """A run's `fast_path` stats as one word: 'graphs+compile+kernels' (a default CUDA run),
    '+ahead' where plain greedy decoding ran one step ahead of the host (specdec/ahead.py),
    'eager' with none of them (the [memra] line's path=, the request span's memra.fast_path)."""
    on = [k for k in ("graphs", "compile", "kernels", "ahead") if fp and fp.get(k)]
    return "+".join(on) if on else "eager"


def phase_line(b: BurstRecord, tag: str = TAGS["phase"]) -> str | None:
    if b.n == 0:
        return None
    d, v, a, r, m = b.totals_ns()
    total = d + v + a + r + m
    ms = lambda ns: ns / 1e6  # noqa: E731
    per = lambda ns: ns / 1e6 / b.n  # noqa: E731
    return (
        f"[{tag}] rounds={b.n} k={b.k} total={ms(total):.2f}ms | draft={ms(d):.2f} verify={ms(v):.2f} "
        f"accept={ms(a):.2f} roll={ms(r):.2f} maint={ms(m):.2f} | per-round ms: draft={per(d):.3f} "
        f"verify={per(v):.3f} accept={per(a):.3f} roll={per(r):.3f} maint={per(m):.3f} total={per(total):.3f}"
    )


def sub_totals(b: BurstRecord) -> dict[str, int]:
    """Level-2 ns per bucket over the burst, with vrest = verify - (kda + mla + attn)."""
    out = dict.fromkeys(("kda", "scan", "mla", "attn", "ffn"), 0)
    verify = 0
    for r in b.live():
        verify += r.phase_ns(1)
        for key in out:
            out[key] += r.sub_ns.get(key, 0)
    out["rest"] = max(0, verify - out["kda"] - out["mla"] - out["attn"])
    return out


def phase_v_line(b: BurstRecord, tag: str = TAGS["phase_v"]) -> str | None:
    """vkda (scan), vmla, vrest (vffn); a model with GQA attention layers gets
    its class under its own name (vattn), and the classes it lacks print 0."""
    if b.n == 0:
        return None
    s = sub_totals(b)
    per = lambda ns: ns / 1e6 / b.n  # noqa: E731
    return (
        f"[{tag}] rounds={b.n} k={b.k} | per-round ms: vkda={per(s['kda']):.3f} (scan={per(s['scan']):.3f}) "
        f"vmla={per(s['mla']):.3f} vattn={per(s['attn']):.3f} vrest={per(s['rest']):.3f} (vffn={per(s['ffn']):.3f})"
    )
