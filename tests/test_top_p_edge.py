"""A top_p so small that no token's preceding mass is below it (1e-46 .. 5e-324: 0 in fp32)
keeps the most likely token: greedy, in the sampler, the Python API, `generate`, `batch` and
the server's path, never "non-finite logits from the target" (which stays for logits that
are not finite: test_edge_values.py)."""

from __future__ import annotations

import json

import pytest
import torch

from memra_dist.cli import main
from memra_dist.config import RunConfig
from memra_dist.specdec.accept import accept_sampled
from memra_dist.specdec.sampling import SamplingParams, probs

PROMPT = "the drafter proposes"
TINY = (1e-45, 1e-46, 5e-324)  # 1e-45 is fp32's smallest subnormal; below it, 0 in fp32


# ---- the filter ---------------------------------------------------------------------------


@pytest.mark.parametrize("top_p", TINY)
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    logits = torch.tensor([[3.0, 1.0, 2.0, -1.0],
                           [0.5, 4.0, 4.0, 1.0],   # a tie: the first id, as argmax picks
                           [-50.0, -50.0, -49.0, -60.0]])
    for sp in (SamplingParams(temperature=0.8, top_p=top_p), SamplingParams(temperature=1.5, top_k=2, top_p=top_p)):
        p = probs(logits, sp)
        assert torch.isfinite(p).all(), (sp, p)
        assert p.argmax(-1).tolist() == logits.argmax(-1).tolist() == [0, 1, 2]
        assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
    # the failure this replaces: fp32 reads top_p 1e-46 as 0 and the mask dropped every token
    assert torch.tensor(1e-46, dtype=torch.float32).item() == 0.0


def test_top_p_still_keeps_the_token_that_crosses_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for top_p, kept in ((0.4, 1), (0.5, 1), (0.6, 2), (0.81, 3), (0.99, 4), (1.0, 4)):
        p = probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert int((p > 0).sum()) == kept, (top_p, p)
        assert torch.allclose(p.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("top_p", TINY)
def test_rejection_sampling_on_a_tiny_top_p_commits_the_argmax(top_p, monkeypatch):
    """p and q are one-hot: a draft the target does not rank first is never accepted (not even
    at u = 0), one it does is always; the recovered / bonus token is the target's argmax."""
    target = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    draft = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    sp = SamplingParams(temperature=0.9, top_p=top_p)
    p, q = probs(target, sp), probs(draft, sp)
    best = target.argmax(-1)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        for drafts, qq in ((best[:3].clone(), None), (draft.argmax(-1), q)):
            drafts[1] = (best[1] + 1) % 16  # the second draft is not the target's choice
            j, nxt, _ = accept_sampled(p, qq, drafts, gen)
            assert j <= 1 and nxt == int(best[j])
    monkeypatch.setattr(torch, "rand", lambda k, generator=None, **kw: torch.zeros(k, **kw))  # u = 0 exactly
    j, nxt, _ = accept_sampled(p, None, torch.tensor([(int(best[0]) + 1) % 16]), torch.Generator())
    assert (j, nxt) == (0, int(best[0]))  # the strict test rejects a zero-mass draft even then


# ---- the engine's front ends ---------------------------------------------------------------


def _greedy_ids(model, n=8, **kw):
    from memra_dist.app import generate
    from memra_dist.model.tokenizer import load_tokenizer

    ids = load_tokenizer(model).encode(PROMPT)
    cfg = RunConfig(model=str(model), max_new_tokens=n, device="cpu", dtype="fp32", **kw)
    return ids, generate(cfg, ids).token_ids


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_the_python_api_runs_a_tiny_top_p_as_greedy(llama, draft_llama, drafter):
    from memra_dist.app import generate

    kw = {"draft_model": str(draft_llama)} if drafter == "draft" else {}
    ids, greedy = _greedy_ids(llama, **kw)
    for top_p in TINY:
        for seed in (0, 7):
            cfg = RunConfig(model=str(llama), max_new_tokens=8, device="cpu", dtype="fp32", seed=seed,
                            sampling=SamplingParams(temperature=0.8, top_p=top_p), **kw)
            assert generate(cfg, ids).token_ids == greedy, (top_p, seed)


def _run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return (rc, *capsys.readouterr())


@pytest.mark.parametrize("top_p", ["1e-46", "5e-324"])
def test_cli_generate_runs_a_tiny_top_p_as_greedy(llama, top_p, capsys):
    base = ["generate", "--model", str(llama), "--prompt", PROMPT, "--max-new-tokens", "8", "--device", "cpu",
            "--json"]
    rc, out, err = _run([*base, "--temperature", "0.8", "--top-p", top_p], capsys)
    assert rc == 0, err
    rc0, out0, err0 = _run(base, capsys)
    assert rc0 == 0, err0
    assert json.loads(out)["token_ids"] == json.loads(out0)["token_ids"]


@pytest.mark.parametrize("extra", [(), ("--max-batch", "2")], ids=["one-at-a-time", "batched"])
def test_batch_lines_with_a_tiny_top_p_run_as_greedy_and_the_job_goes_on(llama, tmp_path, capsys, extra):
    """Three such lines in a row once stopped the job (three engine failures in a row)."""
    from memra_dist.cli import _add_run_args, _Parser
    from memra_dist.serve import add_batch_parser, run_batch

    rows = [{"id": "greedy", "prompt": PROMPT},
            {"id": "a", "prompt": PROMPT, "temperature": 0.8, "top_p": 1e-46},
            {"id": "b", "prompt": PROMPT, "temperature": 0.8, "top_p": 5e-324, "seed": 3},
            {"id": "c", "prompt": PROMPT, "temperature": 1.2, "top_p": 1e-300, "top_k": 5},
            {"id": "after", "prompt": PROMPT}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = _Parser(prog="memra-dist")
    add_batch_parser(p.add_subparsers(dest="cmd", required=True, parser_class=_Parser), _add_run_args)
    args = p.parse_args(["batch", "--model", str(llama), "--input", str(inp), "--output", str(out),
                         "--max-new-tokens", "8", "--device", "cpu", "--dtype", "fp32", *extra])
    assert run_batch(args) == 0
    err = capsys.readouterr().err
    assert "[batch] done: 5/5," in err and "error" not in err, err
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {r["id"] for r in rows}
    for k in ("a", "b", "c", "after"):
        assert recs[k].get("token_ids") == recs["greedy"]["token_ids"], recs[k]


def test_the_server_path_runs_a_tiny_top_p_as_greedy(llama):
    """The server's own steps short of HTTP: the body parsed, the request prepared (its
    RunConfig) and run on the host's engine."""
    from memra_dist.serve.host import EngineHost
    from memra_dist.serve.protocol import parse_completion

    host = EngineHost(RunConfig(model=str(llama), device="cpu", dtype="fp32", ctx=64, max_new_tokens=8), None)
    try:
        def run(body: dict) -> list[int]:
            req = parse_completion(json.dumps({"prompt": PROMPT, "max_tokens": 8, **body}).encode(), host.model_name)
            return list(host.run(host.prepare(req), lambda ids: None).token_ids)

        greedy = run({"temperature": 0})
        for top_p in TINY:
            assert run({"temperature": 0.8, "top_p": top_p, "seed": 5}) == greedy, top_p
    finally:
        host.close()
