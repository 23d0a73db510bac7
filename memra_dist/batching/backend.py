"""The batched engine backend (pp = 1, `--max-batch B` > 1): up to B requests in flight, their
target forwards joined into one forward of the stage (batcher.py), each request's session
unchanged over its own `BatchSlot` (slot.py).

What runs batched today: the attention families (llama, qwen2, qwen3) with the drafters that
need nothing but the target (none, ngram, replay), greedy or sampled. A drafter with its own
network (model, dflash, mtp, eagle3), the other families and pp > 1 are refused with one line
(`check_batchable`). On a GPU with the fast path on (`--graphs`, `--kernels`: the defaults) the
stage is fused and on our kernels (row GEMMs, rotary with the paged K/V write, one paged
split-sequence attention launch for every request's decode / verify rows); the batched steps
are not CUDA graphs yet and nothing is compiled. On CPU the batched forward is the reference.

The KV pool: `kv_rows` slots in blocks of BLOCK rows (default: every request of the batch at
the engine's capacity, shrunk to what the device's free memory holds, at least one capacity).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError
from .batcher import Batcher
from .blocks import BlockPool, blocks_for
from .paged import PagedKV
from .slot import BatchSlot

__all__ = ["BatchedBackend", "check_batchable", "BLOCK", "BATCHABLE_DRAFTERS", "BATCHABLE_FAMILIES"]

BLOCK = 16
BATCHABLE_DRAFTERS = ("none", "ngram", "replay")
BATCHABLE_FAMILIES = ("llama", "qwen2", "qwen3")
MAX_BATCH = 256


def check_batchable(cfg, mcfg, max_batch: int) -> None:
    """One line for what --max-batch > 1 does not run yet."""
    if not 1 <= max_batch <= MAX_BATCH:
        raise UserError(f"--max-batch must be in [1, {MAX_BATCH}] (got {max_batch})")
    if max_batch == 1:
        return
    if cfg.pp > 1:
        raise UserError("--max-batch > 1 runs at --pp 1 for now (at pp > 1, --sessions interleaves requests)")
    if cfg.drafter not in BATCHABLE_DRAFTERS:
        raise UserError(f"--max-batch > 1 takes --drafter {', '.join(BATCHABLE_DRAFTERS)} for now "
                        f"(got {cfg.drafter})")
    if mcfg.arch not in BATCHABLE_FAMILIES:
        raise UserError(f"--max-batch > 1 runs the {', '.join(BATCHABLE_FAMILIES)} families for now "
                        f"(this model is {mcfg.arch})")


class BatchedBackend:
    def __init__(self, plan, max_batch: int, max_tokens: int | None = None, kv_rows: int | None = None):
        import torch  # noqa: PLC0415

        from ..device import free_mb, resolve_device, resolve_dtype  # noqa: PLC0415
        from ..progress import LoadProgress  # noqa: PLC0415
        from ..runner import ModelRunner  # noqa: PLC0415
        from ..threads import apply_cpu_threads  # noqa: PLC0415

        cfg = plan.cfg
        check_batchable(cfg, plan.model, max_batch)
        self.torch = torch
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.threads_before = apply_cpu_threads(plan.model, self.device)
        # the weights (the runner's own cache is never allocated: the batch's pool replaces it)
        fast = cfg.runner_kwargs(self.device)  # fused projections and our kernels where the run has them
        self.runner = ModelRunner(cfg.model, self.device, self.dtype, cfg=plan.model, max_pos=plan.capacity,
                                  progress=LoadProgress(Path(cfg.model).name), graphs=fast["graphs"],
                                  kernels=fast["kernels"])
        stage = self.runner.stage
        row = PagedKV.row_bytes(stage, self.dtype)
        if kv_rows is None:
            kv_rows = max_batch * plan.capacity
            fits = int(free_mb(self.device) * (1 << 20) * 0.9) // max(row, 1)
            kv_rows = max(min(kv_rows, fits), plan.capacity)
        pool = BlockPool(blocks_for(kv_rows, BLOCK), BLOCK)
        if pool.rows * row > free_mb(self.device) * (1 << 20):
            raise UserError(f"out of memory: a KV pool of {pool.rows} rows needs {pool.rows * row / 2**20:.0f} MB on "
                            f"{self.runner.label}, free {free_mb(self.device)} MB (lower --kv-rows or --ctx)")
        budget = max_tokens if max_tokens is not None else max(cfg.prefill_chunk, max_batch * (cfg.k + 1))
        self.batcher = Batcher(stage, self.device, self.dtype, pool, budget)
        self.slots = threading.BoundedSemaphore(max_batch)
        self.max_batch = max_batch

    def request(self, plan, prompt: list[int], span_sink, slot: BatchSlot):
        from ..specdec.request import Request  # noqa: PLC0415

        return Request(slot, plan, prompt, span_sink)

    @contextmanager
    def session(self, plan, prompt: list[int], span_sink, carrier):
        """A batch slot for the request (waiting for one of the B), its blocks given back when
        it ends or is abandoned."""
        cfg = plan.cfg
        with self.slots:
            slot = BatchSlot(self.batcher, min(plan.capacity, len(prompt) + cfg.max_new_tokens + cfg.k + 1))
            try:
                yield self.request(plan, prompt, span_sink, slot)
            finally:
                slot.release()

    def stats(self) -> dict:
        return {**self.batcher.stats.as_dict(), "kv_rows": self.batcher.pool.rows, "block": BLOCK,
                "kv_blocks_used": self.batcher.pool.used_blocks, "kv_blocks_free": self.batcher.pool.free_blocks}

    def close(self) -> None:
        self.torch.set_num_threads(self.threads_before)
