"""`memra-dist serve --pp 2` on a real Ray Serve: the replica places the pipeline (stage
actors of its own) and keeps two sessions in flight; two clients streaming at once each get
exactly what the same prompt gives alone (greedy, pp=1)."""

from __future__ import annotations

import json
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")

from ports import free_port as _free_port  # noqa: E402
from memra_dist.cli import _add_run_args  # noqa: E402

PROMPTS = ["A speculative round has five phases.", "The phase clock drains the streams"]




def _streamed_text(base: str, prompt: str) -> str:
    out = []
    with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": prompt, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                out.extend(c["text"] for c in ev.get("choices", []))
    return "".join(out)


@pytest.mark.slow
def test_pp2_two_clients_at_once_each_get_the_prompt_alone(ckpt_factory, monkeypatch):
    from memra_dist.app import generate
    from memra_dist.config import RunConfig
    from memra_dist.model.tokenizer import load_tokenizer
    from memra_dist.serve.deployment import deploy, undeploy
    from memra_dist.serve.host import completion_text
    from memra_dist.serve.serve_cli import parse_serve_argv

    model = ckpt_factory("llama", seed=3, max_position_embeddings=4096, eos_token_id=None)[0]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    tok = load_tokenizer(model)
    alone = []
    for p in PROMPTS:
        ids = tok.encode(p)
        res = generate(RunConfig(model=str(model), device="cpu", dtype="fp32", max_new_tokens=20), ids)
        alone.append(completion_text(tok, ids, res.token_ids))
    argv = ["--model", str(model), "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "20", "--pp", "2",
            "--sessions", "2", "--port", str(_free_port())]
    base = deploy(parse_serve_argv(argv, _add_run_args))
    try:
        got = [None, None]
        go = threading.Barrier(2)

        def client(i):
            go.wait()
            got[i] = _streamed_text(base, PROMPTS[i])

        ts = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert got == alone
        health = httpx.get(f"{base}/health", timeout=30)
        assert health.status_code == 200
    finally:
        undeploy()
