"""What the HTTP API adds per streamed token over the batch path, and time to first token
under concurrent clients, timed from the outside.

1. `memra-dist serve` is started as users start it (a subprocess; Ray Serve, one replica);
   one client streams a completion (SSE, greedy) and stamps every chunk as it arrives:
   API decode time per token = (last chunk - first chunk) / (tokens - 1), tokens from the
   stream's usage chunk. Then C clients at once stream a shorter completion each: their
   times to the first chunk (queued behind the sessions: at pp=1 one runs at a time).
2. The server is stopped; the same engine is opened in this process (`open_engine`, what
   `memra-dist batch` calls) and the same request is timed as its stream callback receives
   the tokens: the batch path's time per token. The overhead is the difference; the token
   ids of both must be equal (the API's text is the engine's).

    python benchmarks/api_overhead.py OUT_DIR [--shape 8b] [--new 256] [--prompt-words 300]
        [--clients 8] [--client-tokens 32] [--port 8011]
Results: OUT_DIR/api_overhead.json (+ lines on stderr)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def _say(*a) -> None:
    print("[api_overhead]", *a, file=sys.stderr, flush=True)


def _stream(url: str, body: dict) -> dict:
    import httpx  # noqa: PLC0415

    t0 = time.perf_counter()
    stamps, text, usage = [], [], None
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
                text.append(chunk["choices"][0]["text"])
    return {"t0": t0, "stamps": stamps, "text": "".join(text), "usage": usage}


def _with_word_tokenizer(model: Path, vocab: int) -> Path:
    """The checkpoint with a tokenizer in which every id is one word ("t123"): the bench
    checkpoints carry a 256-token BPE, so most ids of a random model decode to nothing and
    the stream would have no text to send until the end. Weights and config are linked."""
    from tokenizers import Tokenizer  # noqa: PLC0415
    from tokenizers.models import WordLevel  # noqa: PLC0415
    from tokenizers.pre_tokenizers import WhitespaceSplit  # noqa: PLC0415

    out = model.parent / f"{model.name}-words"
    if (out / "tokenizer.json").exists():
        return out
    out.mkdir(exist_ok=True)
    for f in model.iterdir():
        if f.name != "tokenizer.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    return out


def _wait_health(base: str, proc, limit_s: float = 900) -> float:
    import httpx  # noqa: PLC0415

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become healthy")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--client-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--cache", default="/tmp/memra-bench-ckpt")
    a = ap.parse_args()

    import torch  # noqa: PLC0415

    from memra_dist.bench.checkpoints import ensure_checkpoint  # noqa: PLC0415

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = ensure_checkpoint(a.shape, Path(a.cache), dev, _say)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    model = _with_word_tokenizer(model, vocab)
    g = torch.Generator().manual_seed(0)
    prompt = " ".join(f"t{int(i)}" for i in torch.randint(10, vocab, (a.prompt_words,), generator=g))
    body = {"prompt": prompt, "max_tokens": a.new, "temperature": 0}
    base = f"http://127.0.0.1:{a.port}"
    res: dict = {"shape": a.shape, "new": a.new, "clients": a.clients,
                 "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"}

    cmd = [sys.executable, "-m", "memra_dist.cli", "serve", "--model", str(model), "--port", str(a.port),
           "--max-queue", str(max(8, a.clients)), "--ctx", "2048"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    errs: list[str] = []
    threading.Thread(target=lambda: errs.extend(proc.stderr), daemon=True).start()
    try:
        res["server_ready_s"] = round(_wait_health(base, proc), 1)
        _say(f"server healthy after {res['server_ready_s']} s")
        _stream(f"{base}/v1/completions", {**body, "max_tokens": 8})  # warm
        one = _stream(f"{base}/v1/completions", body)
        n = one["usage"]["completion_tokens"]
        api_ms = (one["stamps"][-1] - one["stamps"][0]) / (n - 1) * 1e3
        res["api"] = {"tokens": n, "chunks": len(one["stamps"]), "ms_per_token": round(api_ms, 4),
                      "ttft_ms": round((one["stamps"][0] - one["t0"]) * 1e3, 1)}
        _say(f"API, one client: {api_ms:.3f} ms a token over {n} tokens ({len(one['stamps'])} chunks)")
        got: list[dict] = [None] * a.clients
        go = threading.Barrier(a.clients)

        def client(i):
            go.wait()
            got[i] = _stream(f"{base}/v1/completions", {**body, "max_tokens": a.client_tokens})

        ts = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        ttft = sorted(round((g["stamps"][0] - g["t0"]) * 1e3, 1) for g in got)
        res["concurrent"] = {"clients": a.clients, "max_tokens": a.client_tokens, "ttft_ms_sorted": ttft,
                             "ttft_ms_median": ttft[len(ttft) // 2], "ttft_ms_max": ttft[-1]}
        _say(f"{a.clients} clients at once: time to first token (ms, sorted) {ttft}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        (out / "server.err").write_text("".join(errs))

    from memra_dist.app import open_engine  # noqa: PLC0415
    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.model.tokenizer import load_tokenizer  # noqa: PLC0415

    tok = load_tokenizer(str(model))
    ids = tok.encode(prompt)
    cfg = RunConfig(model=str(model), max_new_tokens=a.new)
    with open_engine(cfg, 2048) as engine:
        engine.generate(ids, cfg.with_(max_new_tokens=8))  # warm
        stamps = []
        r = engine.generate(ids, stream=lambda t: stamps.append((time.perf_counter(), len(t))))
    m = len(r.token_ids)
    batch_ms = (stamps[-1][0] - stamps[0][0]) / (m - 1) * 1e3
    res["batch"] = {"tokens": m, "ms_per_token": round(batch_ms, 4), "stats": r.stats}
    from memra_dist.serve.host import completion_text  # noqa: PLC0415 (the text the API promises)

    res["same_text"] = completion_text(tok, ids, r.token_ids) == one["text"]
    res["overhead_ms_per_token"] = round(api_ms - batch_ms, 4)
    _say(f"batch path: {batch_ms:.3f} ms a token; the API adds {api_ms - batch_ms:.3f} ms a token; "
         f"same text: {res['same_text']}")
    (out / "api_overhead.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
