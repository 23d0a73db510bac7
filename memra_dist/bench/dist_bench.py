"""pp=2 against pp=1, and the per-hop activation transfer time.

Hop: two bench-only Ray actors (one GPU each, or CPU) join a 2-rank torch.distributed group
through the engine's own `Link` (NCCL on GPU, gloo on CPU) and ping-pong a (rows, hidden)
activation; one hop = median round trip / 2, host sync included (the DESIGN §3 convention).
pp: the real `app.generate` at pp=N with drafter none at pp=2 (and pp=4 with >= 4 GPUs); decode tok/s
from the driver's token stream (first token -> last), against the in-process plain decode of
this same run, and whether its greedy ids equal that decode's. Ranges (noise.py): the hop's over
its ping-pongs; pp=N's tok/s over three consecutive thirds of its one decode."""

from __future__ import annotations

import time

import torch

__all__ = ["pipeline", "HopActor"]


class HopActor:
    def __init__(self, rank: int):
        from ..device import actor_device  # noqa: PLC0415
        from ..pipeline.transport import Link  # noqa: PLC0415

        self.device, _ = actor_device("auto")
        self.link = Link(rank, 2, self.device)

    def address(self):
        return self.link.listen()

    def connect(self, addr: str, port: int) -> None:
        self.link.connect(addr, port, 60.0)

    def pingpong(self, rows: int, hidden: int, dtype: str, iters: int) -> list[float]:
        link, dev = self.link, self.device
        dt = getattr(torch, dtype)
        x = torch.randn(rows, hidden, device=dev).to(dt)
        xs = []
        for i in range(iters + 5):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            if link.rank == 0:
                link.send(x)
                y = link.recv((rows, hidden), dt)
            else:
                y = link.recv((rows, hidden), dt)
                link.send(y)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i >= 5:
                xs.append(time.perf_counter() - t0)
        return xs

    def close(self) -> None:
        self.link.close()


def _hop(s, ray, hidden: int, gpu: bool) -> dict:
    from .noise import Fig  # noqa: PLC0415

    opts = dict(num_gpus=1, num_cpus=1) if gpu else dict(num_cpus=1)
    actors = [ray.remote(HopActor).options(**opts).remote(r) for r in range(2)]
    try:
        addr, port = ray.get(actors[0].address.remote())
        ray.get([a.connect.remote(addr, port) for a in actors], timeout=120)
        dtype = "bfloat16" if gpu else "float32"
        out = {"hidden": hidden, "dtype": dtype, "backend": "nccl" if gpu else "gloo"}
        for rows in (1, max(s.p.ks) + 1):
            xs = ray.get([a.pingpong.remote(rows, hidden, dtype, s.p.hop_iters) for a in actors], timeout=300)[0]
            f = Fig.of(xs).map(lambda x: x / 2 * 1e6)
            out[f"rows_{rows}_one_way_us"] = round(f.value, 2)
            out[f"rows_{rows}_one_way_us_range"] = f.rng(2)
        out["one_way_us"] = out["rows_1_one_way_us"]
        out["one_way_us_range"], out["iters"] = out["rows_1_one_way_us_range"], s.p.hop_iters
        ray.get([a.close.remote() for a in actors], timeout=60)
        return out
    finally:
        for a in actors:
            ray.kill(a)


def _pp_decode(s, ray, pp: int) -> dict:
    from ..config import RunConfig  # noqa: PLC0415
    from ..app import generate  # noqa: PLC0415
    from .fastpath import config_kwargs  # noqa: PLC0415

    dev = "cuda" if s.device.type == "cuda" else "cpu"
    cfg = RunConfig(model=s.bench.target_dir, drafter="none", k=1, max_new_tokens=s.p.max_new, device=dev,
                    dtype={torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[s.dtype],
                    pp=pp, **config_kwargs(s.bench.graphs))
    stamps = []

    def stream(toks):
        stamps.append((time.perf_counter(), len(toks)))

    res = generate(cfg, s.prompt, stream)  # warm (actor start, load, first compile) and measured: one run
    t_first, t_last = stamps[0][0], stamps[-1][0]
    ntok = sum(n for _, n in stamps[1:])
    return {"tokens": ntok + 1, "decode_s": round(t_last - t_first, 4),
            "tok_s": round(ntok / (t_last - t_first), 3) if t_last > t_first else None,
            "tok_s_segments": _segment_rates(stamps), "token_ids": list(res.token_ids)}


def _segment_rates(stamps: list, parts: int = 3) -> list[float]:
    """tok/s over `parts` consecutive stretches of the stream (split at burst stamps; the whole
    run's tok/s lies between them); [] when there are fewer bursts than parts."""
    m = len(stamps) - 1
    if m < parts:
        return []
    cuts = [round(m * j / parts) for j in range(parts + 1)]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        dt = stamps[b][0] - stamps[a][0]
        if dt > 0:
            out.append(round(sum(n for _, n in stamps[a + 1:b + 1]) / dt, 3))
    return out if len(out) == parts else []


def pipeline(s) -> dict:
    gpus = torch.cuda.device_count() if s.device.type == "cuda" else 0
    if s.device.type == "cuda" and gpus < 2:
        return {"skipped": f"needs >= 2 GPUs (this machine has {gpus})"}
    from ..pipeline.driver import _ray_up  # noqa: PLC0415

    ray, started = _ray_up()
    try:
        s.say("  hop: 2 actors ping-pong the activation over torch.distributed")
        out = {"hop": _hop(s, ray, s.bench.target.cfg.hidden_size, gpus >= 2)}
        s.say(f"  hop one-way: {out['hop']['one_way_us']} us")
        from .noise import Fig  # noqa: PLC0415
        from .sections import plain_decode  # noqa: PLC0415

        plain = plain_decode(s)  # this run's pp=1 figure and greedy ids (memoized: the decode section's own)
        p1, ids1 = plain["result"].decode_tok_s, plain["result"].tokens
        out["pp1_tok_s"] = round(p1, 3)
        for pp in (2, 4) if gpus >= 4 else (2,):  # pp=4 on a 4-GPU machine
            if s.left() <= 0:
                out[f"pp{pp}"] = {"skipped": "budget"}
                continue
            s.say(f"  pp={pp}: {pp} actors load their parts")
            r = _pp_decode(s, ray, pp)
            ids = r.pop("token_ids")
            n = min(len(ids), len(ids1))
            r["greedy_ids_equal_pp1"] = n > 0 and ids[:n] == ids1[:n]
            out[f"pp{pp}"] = r
            if r["tok_s"]:
                out[f"pp{pp}_over_pp1_step"] = round(p1 / r["tok_s"], 4)
                seg = r["tok_s_segments"]  # pp=N's range: its thirds; pp=1's: the decode repeats
                fig = Fig(r["tok_s"], min(seg), max(seg), len(seg)) if seg else Fig(r["tok_s"], None, None, 1)
                out[f"pp{pp}_over_pp1_step_range"] = (plain["tok_s_fig"] / fig).rng()
            s.say(f"  pp={pp}: {r['tok_s']} tok/s, ids equal pp=1: {r['greedy_ids_equal_pp1']}")
        out["note"] = ("pp=1 is the in-process decode of this run; pp>1 includes the per-burst Ray call "
                       "that streams tokens to the driver")
        return out
    finally:
        if started:
            ray.shutdown()
