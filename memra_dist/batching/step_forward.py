"""A batched step's forward (the batcher's device side): the jobs' rows through the stage's
embedding, blocks and lm_head in ONE forward over the paged K/V, as a CUDA graph's replay
(graphs.py) where the step is eligible (level 2: the bucket's timed twin), else eager; level 2's
eager step (laps.py) runs under a drained sub-split timer. The scheduler around it (admission, growth, preemption,
who leads a step) is batcher.py's.

`launch` is what the step's leader calls: the forward, then every row's argmax and the logit
at it in ONE device row (the step's readback; ahead.py stages it), or the exception that
stopped the step (every job of the step gets it)."""

from __future__ import annotations

import torch

from ..model.layers import rope_rows
from ..model.tap_pool import pooled
from ..model.taps import FINAL
from ..device import device_mark, to_device
from ..model.transformer import StepCtx
from .job import Job, Launched
from .laps import timed_step
from .paged import BatchView

__all__ = ["launch", "draw_at_launch", "forward", "eager", "layers", "stage_layers", "scatter_taps", "wake"]


def launch(b, jobs: list[Job], wakes, ids_dev=None, advance=None):
    """The step's forward launched -> its `Launched`, or the exception that stopped it.
    `advance`: a verify launched ahead (verify_ahead.py Advance)."""
    try:
        replays = b.graphs.replays if b.graphs is not None else 0
        b.launch_ids = None
        logits = forward(b, jobs, wakes, ids_dev, advance)
        # every row's argmax and the logit at it in ONE readback, which is also where the
        # step ends on a GPU (its device work done; the wait releases the GIL): the
        # requests' greedy accepts then need no device op and no readback of their own
        pred = logits.argmax(-1)
        val = logits.gather(-1, pred.unsqueeze(-1)).view(-1)
        pred, val = draw_at_launch(jobs, logits, pred, val)
        graphed = b.graphs is not None and b.graphs.replays > replays
        return Launched(logits, torch.cat((pred.double(), val.double())), pred, graphed, b.launch_ids)
    except BaseException as e:  # noqa: BLE001 (every request of the step gets the error)
        return e


def draw_at_launch(jobs: list[Job], logits: torch.Tensor, pred: torch.Tensor, val: torch.Tensor):
    """Sampled plain decoding's rows (`Chain.drawn`): each row's token drawn on the device from its
    request's distribution (`probs_rows`) at its generator's next uniform, as its session draws a
    plain round (`accept_sampled` with no drafts), in place of the row's argmax, and its logit
    replaced by 0 (finite) or NaN (the row's probabilities are not): the step's readback carries
    them as greedy rows, and a step launched behind this one reads its ids from them (ahead.py)."""
    at, chains, lo = [], [], 0
    for j in jobs:
        n = 1 if j.last else j.n
        ch = j.chain
        if ch is not None and ch.drawn and not ch.ended and not j.void and n == 1:
            at.append(lo)
            chains.append(ch)
        lo += n
    if not at:
        return pred, val
    from ..specdec.sampling import draw_rows, probs_rows, row_filters, uniforms  # noqa: PLC0415

    dev, m = logits.device, len(at)
    host = torch.tensor([[ch.sp.temperature, ch.sp.top_k, ch.sp.top_p, float(r)] for ch, r in zip(chains, at)],
                        dtype=torch.float64)
    u = torch.cat([uniforms(ch.gen, 1) for ch in chains])
    x = to_device(torch.cat([host.view(-1), u]), dev)  # (one copy)
    prm, u = x[:4 * m].view(m, 4), x[4 * m:]
    rows = prm[:, 3].long()
    p = probs_rows(logits[rows], prm[:, 0], prm[:, 1].long(), prm[:, 2], row_filters([ch.sp for ch in chains]))
    ok = torch.isfinite(p.sum(-1))
    pred = pred.index_put((rows,), draw_rows(p, u))
    val = val.index_put((rows,), torch.where(ok, 0.0, float("nan")).to(val.dtype))
    return pred, val


@torch.inference_mode()
def forward(b, jobs: list[Job], wakes=(), ids_dev: torch.Tensor | None = None, advance=None) -> torch.Tensor:
    """The step's forward -> fp32 logits of the rows used, in job order: every row of a job,
    or its last with `last` (one lm_head over them). `wakes`: chains whose threads are woken
    once the step is launched (before the readback; batcher._flush_wakes). `ids_dev`: the
    rows' ids on the device (a step launched ahead: the previous step's argmax). A graphed
    step's logits are copied out of the graphs' shared buffer only when a job reads them: a
    greedy chained round reads only its greedy rows, computed before any replay. `advance`: a
    verify launched ahead, its rows moved by the device's acceptance (verify_ahead.py): on the
    device in a graphed step, else read on the host first."""
    try:
        graphed = b.graphs is not None and b.graphs.eligible(jobs)
        if advance is not None and not graphed:
            advance.resolve()  # (eager: the rows' starts and first ids on the host)
            advance = None
        timers = [j.timer for j in jobs if j.timer is not None]  # level 2's (a request has one job a step)
        if b.remote is not None:  # (the ring's plan takes host ids: drafts on the device read back first)
            for j in jobs:
                j.host_ids()
        patch = DraftPatch.of(jobs)
        if graphed:  # (with a level-2 request's rows: the bucket's timed twin, graphs.py)
            out = b.graphs.run(jobs, lambda: wake(wakes), ids_dev,
                               any(j.chain is None or not j.chain.greedy for j in jobs), patch, advance, timers)
            if out is not None:
                b.launch_ids = b.graphs.last_ids
                return out
        if advance is not None:
            advance.resolve()
        if timers:  # level 2 eager: the step's own drained sub-split (laps.py), on host ids
            for j in jobs:
                j.host_ids()
            mark_launch(b)
            return timed_step(b, jobs, ids_dev, eager)
        mark_launch(b)
        return eager(b, jobs, ids_dev, patch=patch)
    finally:
        wake(wakes)  # again (a no-op once woken): also when the step failed before its launch


class DraftPatch:
    """The step's rows whose ids are drafts still on the device (`Job.drafts`: a shared draft
    forward's, dflash_pool_graph.py DeviceDrafts): written into the step's ids on the device,
    behind the ids copied from the host, so the step is packed and launched while the draft
    runs and nothing waits for its readback; the rounds read the drafts back at their accept.
    `of(jobs)`: None where no row is on the device."""

    def __init__(self, parts: list):
        self.parts = parts  # (DeviceDrafts, the step's rows, their flat indices into its ids)

    @staticmethod
    def of(jobs) -> "DraftPatch | None":
        by, r = {}, 0
        for j in jobs:
            if j.drafts is not None:
                dd, row, _ = j.drafts.dev
                rows, src = by.setdefault(id(dd), (dd, [], []))[1:]
                rows.extend(range(r + 1, r + j.n))
                w = dd.ids.shape[1]  # (its K drafts, and the acceptance where made after a verify)
                src.extend(range(row * w, row * w + j.n - 1))
            r += j.n
        return DraftPatch(list(by.values())) if by else None

    def apply(self, ids: torch.Tensor) -> None:
        """Into the step's ids on the device (one gather and one scatter a draft forward)."""
        for dd, rows, src in self.parts:
            at = to_device(rows + src, ids.device)  # (one copy of both index rows)
            ids.index_copy_(0, at[:len(rows)], dd.ids.view(-1)[at[len(rows):]])


def mark_launch(b) -> None:
    """The step's first launch comes now: the device's wait for the loop since the step before
    ends here (device_idle.py; graphs.py marks it right before its replay)."""
    idle = getattr(b, "idle", None)
    if idle is not None:
        idle.verify(device_mark())


def eager(b, jobs: list[Job], ids_dev: torch.Tensor | None = None, timer=None, patch=None) -> torch.Tensor:
    """The step launched kernel by kernel (prefill chunks, CPU, a bucket without a graph);
    `patch`: rows whose drafts are on the device (DraftPatch)."""
    dev = b.device
    view = BatchView.build(b.pool, [(j.rid, j.start, j.n, j.width) for j in jobs], dev, kernels=b.kernels)
    pos = torch.cat([torch.arange(j.start, j.start + j.n) for j in jobs]).to(dev)
    if b.remote is not None:  # pp > 1: the earlier stages' layers first, down the ring (ids in the plan)
        x, remote = b.remote.walk(b, jobs, timer)
        h, tapped = b.remote.head(b, jobs, lambda: layers(b, x, pos, view, timer))
        tapped.update(remote)
    else:
        x = ids_dev if ids_dev is not None else torch.cat([torch.as_tensor(j.ids, dtype=torch.long)
                                                           for j in jobs]).to(dev)
        if patch is not None:
            x = x.clone() if ids_dev is not None else x  # (never into the step before's argmax)
            patch.apply(x)
        b.launch_ids = x  # (what rounds drafting before the readback read: chain_drafts.py draft_early)
        h, tapped = layers(b, x, pos, view, timer)
    scatter_taps(jobs, tapped, pos)
    keep, lo = [], 0
    for j in jobs:
        n = j.n
        keep.extend([lo + n - 1] if j.last else range(lo, lo + n))
        lo += n
    return b.stage.logits(h[torch.tensor(keep, device=dev)])


def layers(b, x: torch.Tensor, pos: torch.Tensor, view: BatchView, timer=None):
    """The stage's embedding and blocks over the step's rows (ids x at positions pos; at
    pp > 1 the hidden rows the ring brought) -> (hidden rows, {tap layer: its output rows})
    (the eager step and the graphed one, graphs.py, run this; the tapped rows go to each
    request's sink: `scatter_taps`)."""
    return stage_layers(b.stage, b.kv, b.tap_layers, x, pos, view, timer, embed=b.remote is None)


def stage_layers(st, kv, tap_layers, x: torch.Tensor, pos: torch.Tensor, view: BatchView, timer=None,
                 embed: bool = True):
    """`layers` over any stage and its paged pool (a pipeline stage's too: pipeline/batch_stage.py)."""
    rope = {d: rope_rows(pos, f, st._rope_scale) for d, f in st._inv_freq.items()}
    ctx = StepCtx(pos=pos, mask=None, rope=rope, batch=view, timer=timer)
    h = st.embed_tokens(x) if embed else x
    tapped = {}
    for i, blk in st.layers.items():
        h = blk(h, ctx, kv.layers[int(i)])
        if int(i) in tap_layers:
            tapped[int(i)] = h
    if FINAL in tap_layers:
        tapped[FINAL] = st.norm(h)
    return h, tapped


def scatter_taps(jobs, tapped: dict, pos: torch.Tensor) -> None:
    """Each tapping request's rows of the tapped layers into its own sink, at its positions:
    where every request's sink is a slot of one pool (model/tap_pool.py), one launch a layer for
    all of them, at the step's own positions."""
    pool = pooled([j.taps for j in jobs])
    if pool is not None and all(t in tapped for t in pool.layers):
        pool.scatter(to_device([j.taps.pool_slot for j in jobs for _ in range(j.n)], pos.device), pos, tapped)
        return
    lo = 0
    for j in jobs:
        n = j.n
        if j.taps is not None:
            for layer in j.taps.layers:
                j.taps.write(layer, pos[lo:lo + n], tapped[layer][lo:lo + n])
        lo += n


def wake(chains) -> None:
    for ch in chains:
        ch.wake()
