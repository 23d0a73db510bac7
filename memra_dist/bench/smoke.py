"""Helpers of benchmarks/smoke_commands.py (every documented command, each in a fresh process):
running one command with a timeout, reading its figures from its own output (the `[memra]`
summary line, `--json`, batch's summary), streaming one completion from `serve` over
http.client, and the markdown table. Pure apart from `run_cmd`, `stream_completion` and
`wait_health`; no torch import."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import time

__all__ = ["parse_summary", "parse_batch_summary", "last_json", "run_cmd", "stream_completion", "wait_health",
           "stop_group", "markdown_table", "fmt"]

_KV = re.compile(r"(\S+?)=(\S+)")
_BATCH = re.compile(r"\[batch\] done: (\d+)/(\d+)[^\n]*?(?:, (\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\))?"
                    r"(?: -> |$)", re.M)


def _num(v: str):
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def parse_summary(text: str) -> dict | None:
    """The last `[memra] tokens=N tok/s=X ttft_ms=Y ...` line of `text` as a dict (numbers
    parsed; `tok/s` is `tok_per_s`), or None."""
    lines = [ln for ln in text.splitlines() if ln.startswith("[memra] tokens=")]
    if not lines:
        return None
    d = {k.replace("tok/s", "tok_per_s").replace("tokens/round", "tokens_per_round"): _num(v)
         for k, v in _KV.findall(lines[-1][len("[memra] "):])}
    return d if {"tokens", "tok_per_s", "ttft_ms"} <= d.keys() else None


def parse_batch_summary(text: str) -> dict | None:
    """batch's `[batch] done: 3/3, 48 tokens in 1.2 s (40.0 tok/s) -> out.jsonl` (the last
    one in `text`) as {done, total, tokens, seconds, tok_per_s} (the rate part may be absent)."""
    found = list(_BATCH.finditer(text))
    if not found:
        return None
    m = found[-1]
    d = {"done": int(m[1]), "total": int(m[2])}
    if m[3] is not None:
        d.update(tokens=int(m[3]), seconds=float(m[4]), tok_per_s=float(m[5]))
    return d


def last_json(text: str) -> dict | None:
    """The last line of `text` that is a JSON object (generate --json prints exactly one)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def stop_group(proc: subprocess.Popen, grace_s: float = 60.0) -> int:
    """SIGTERM to the process group this script started (start_new_session), SIGKILL after
    `grace_s`; the exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.wait()


def run_cmd(cmd: list[str], env: dict, cwd: str, timeout_s: float, log_stem: str | None = None) -> dict:
    """One command in a fresh process (its own session, so a timeout ends all of it):
    {rc (124 on timeout), out, err, wall_s}; with log_stem, out / err also go to .out / .err files."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         errors="replace", start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        stop_group(p, 20)
        out, err = p.communicate()
        rc = 124
        err += f"\n[smoke] timed out after {timeout_s:.0f} s\n"
    if log_stem:
        for ext, s in ((".out", out), (".err", err)):
            with open(log_stem + ext, "w") as f:
                f.write(s)
    return {"rc": rc, "out": out, "err": err, "wall_s": round(time.perf_counter() - t0, 2)}


def wait_health(port: int, proc: subprocess.Popen, timeout_s: float, host: str = "127.0.0.1") -> float | None:
    """Seconds until GET /health answers 200; None when the server exits or time runs out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            return None
        try:
            c = http.client.HTTPConnection(host, port, timeout=5)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
            if ok:
                return time.perf_counter() - t0
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(1.0)
    return None


def stream_completion(port: int, body: dict, timeout_s: float, host: str = "127.0.0.1") -> dict:
    """POST /v1/completions with stream: true, every SSE chunk stamped as it arrives:
    {status, ttft_s (request to the first chunk with text), tok_per_s ((tokens - 1) over
    first to last text chunk), tokens (usage, else chunks), chunks, text, error}."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res: dict = {"status": None, "ttft_s": None, "tok_per_s": None, "tokens": 0, "chunks": 0, "text": "",
                 "error": None}
    stamps: list[float] = []
    usage = None
    t0 = time.perf_counter()
    try:
        c = http.client.HTTPConnection(host, port, timeout=timeout_s)
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        res["status"] = r.status
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read(300).decode(errors='replace')}"
            return res
        done = False
        while not done:
            line = r.readline()
            if not line:
                break
            line = line.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                res["error"] = f"stream error: {json.dumps(chunk['error'])[:300]}"
            usage = chunk.get("usage") or usage
            text = "".join(ch.get("text") or "" for ch in chunk.get("choices") or [])
            if text:
                stamps.append(time.perf_counter())
                res["text"] += text
        c.close()
        if not done and res["error"] is None:
            res["error"] = "the stream ended without data: [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["chunks"] = len(stamps)
    res["tokens"] = (usage or {}).get("completion_tokens", len(stamps))
    if stamps:
        res["ttft_s"] = round(stamps[0] - t0, 4)
        if len(stamps) > 1 and res["tokens"] > 1:
            res["tok_per_s"] = round((res["tokens"] - 1) / (stamps[-1] - stamps[0]), 2)
    elif res["error"] is None:
        res["error"] = "no chunk with text"
    return res


def fmt(v, digits: int = 3) -> str:
    """A figure for the table: '-' when absent, else `digits` significant digits."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict]) -> str:
    """command | exit | first token s | decode tok/s | note; exit 'skip' for a row not run."""
    out = ["| command | exit | first token s | decode tok/s | note |", "|---|---|---|---|---|"]
    for r in rows:
        rc = "skip" if r.get("rc") is None else str(r["rc"])
        note = (r.get("note") or "").replace("|", "/").replace("\n", " ")
        out.append(f"| `{r['name']}` | {rc} | {fmt(r.get('ttft_s'))} | {fmt(r.get('tok_per_s'))} | {note} |")
    return "\n".join(out)
