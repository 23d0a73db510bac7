"""The batched engine backend (pp = 1, `--max-batch B` > 1): up to B requests in flight, their
target forwards joined into one forward of the stage (batcher.py), each request's session
unchanged over its own `BatchSlot` (slot.py).

What runs batched today: every family: the attention families (llama, qwen2, qwen3, glm4_moe),
latent attention (deepseek_v3's and kimi_linear's MLA: each request's latent rows in the pool,
model/mla.py `_batched`) and linear attention (kimi_linear's KDA: a recurrent state per request,
paged.py `RecurrentStates`, model/kda.py `_batched`), with every
drafter: those that need nothing but the target (none, ngram, replay), the draft model
(`model`: a second batcher over the draft model's stage and its own paged pool, each request's
ModelDrafter over its own draft slot; the loop drafts the step's requests together, each draft
step one forward of the draft batcher for all of them) and
the tap drafters DFlash, EAGLE-3 and MTP (their network loaded once; each request's drafter
reads its own tap sink, which every batched step fills with its rows' outputs of the tapped
layers; a greedy request's rounds are the step leader's, which drafts the step's requests
together, in one draft forward: batching/chain_drafts.py), greedy or sampled. At pp > 1
the head actor opens this backend over its own runner (the last stage's layers and the head)
and every step walks the ring (pipeline/batch_head.py), eager. On a GPU with the fast path on (`--graphs`, `--kernels`: the defaults)
the stage is fused and on our kernels (row GEMMs, rotary with the paged K/V write, one paged
split-sequence attention launch for every request's decode / verify rows), and a step whose
requests bring at most 16 rows each replays a CUDA graph of the whole forward (graphs.py);
nothing is compiled. Partial rotary (glm4_moe) and q / k norms (qwen3, glm4_moe) ride the
rotary kernel; deepseek_v3's latent attention gathers each request's latents and kimi_linear's
KDA scans each request's rows on its own state, so their steps run eager. On CPU the batched forward is the reference.

The KV pool: `kv_rows` slots in blocks of BLOCK rows (default: every request of the batch at
the engine's capacity, shrunk to what the device's free memory holds, at least one capacity).

The GIL: the engine loop (batcher.py) launches every step and runs the chained requests' rounds; the
requests' threads stream their tokens and, traced, build their spans. A thread that wants the
GIL asks its holder to drop it only after the switch interval, so while the backend is open
the process's interval is at most BATCH_GIL_SWITCH_S (put back at close). Measured on an H200,
8B, 16 concurrent greedy requests, trace level 1 against level 0 in the same run: 8.9 % of the
batch's steady rate lost at 0.5 ms (tracing's own setting, otel.py), 4.3 % at 0.15 ms, 0.5 %
(within the runs' noise) at 0.05 ms; level 0's rate the same at each.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError
from .admission import Admission
from .batcher import Batcher
from .blocks import BlockPool, blocks_for
from .prefix_cache import salt_for
from .paged import PagedKV
from .policy import check_batchable
from .slot import BatchSlot
from .tap_blocks import TapBlocks

__all__ = ["BatchedBackend", "check_batchable", "BLOCK", "BATCH_GIL_SWITCH_S"]

BLOCK = 16
BATCH_GIL_SWITCH_S = 5e-5  # the GIL switch interval while a batched engine is open (see the module doc)
_OPEN = {"n": 0, "before": None}
_OPEN_LOCK = threading.Lock()


def _switch(delta: int) -> None:
    """Count the open backends: the first lowers the switch interval, the last puts back what
    it found (unless something else changed it meanwhile)."""
    with _OPEN_LOCK:
        _OPEN["n"] += delta
        if delta > 0 and _OPEN["n"] == 1:
            _OPEN["before"] = sys.getswitchinterval()
            if _OPEN["before"] > BATCH_GIL_SWITCH_S:
                sys.setswitchinterval(BATCH_GIL_SWITCH_S)
        elif _OPEN["n"] == 0 and abs(sys.getswitchinterval() - BATCH_GIL_SWITCH_S) < 1e-7:  # ours (us-rounded)
            sys.setswitchinterval(_OPEN["before"])


def graph_bytes(stage, budget: int, max_requests: int | None) -> int:
    """About what the batched step graphs hold once captured (graphs.py): the fp32 logits
    buffer of the most rows a graphed step holds, and as much again for their temporaries.

    >>> stage = type("Stage", (), {"cfg": type("Cfg", (), {"vocab_size": 1000})})()
    >>> graph_bytes(stage, 20, 4) == 2 * 32 * 1000 * 4  # 20 rows: the 32-row bucket
    True
    >>> graph_bytes(stage, 8192, 4) == 2 * 320 * 1000 * 4  # 4 requests' 16 rows, a 256-row chunk
    True
    """
    from .graphs import graph_rows  # noqa: PLC0415

    return 2 * graph_rows(budget, max_requests) * stage.cfg.vocab_size * 4


def prefix_cache_off(cfg, arch: str) -> str | None:
    """Why a batched engine asked to cache prefixes (`cfg.prefix_cache`) cannot, in one line;
    None when it can (or was asked not to).

    >>> from types import SimpleNamespace as NS
    >>> prefix_cache_off(NS(prefix_cache=True, drafter="ngram"), "llama") is None
    True
    >>> prefix_cache_off(NS(prefix_cache=True, drafter="dflash"), "llama") is None  # its taps cached too
    True
    >>> print(prefix_cache_off(NS(prefix_cache=True, drafter="none"), "kimi_linear"))
    the prefix cache reuses nothing for kimi_linear (its linear-attention layers keep a recurrent state, not blocks)
    """
    if not cfg.prefix_cache:
        return None
    if arch == "kimi_linear":
        return ("the prefix cache reuses nothing for kimi_linear (its linear-attention layers keep a recurrent "
                "state, not blocks)")
    return None


def _batcher(runner, max_batch: int, capacity: int, kv_rows: int | None, budget: int, graphs: bool,
             tap_layers: tuple[int, ...] = (), reserve: int = 0, cache: bool = False, salt: bytes = b"") -> Batcher:
    """A batcher over `runner`'s stage with a pool of `kv_rows` slots (default: every request of
    the batch at `capacity`, shrunk to what the device's free memory holds, at least one, with
    `reserve` bytes left for the tap and draft-cache pools its requests take later); `cache`:
    the pool keeps prompts' full blocks for later requests, keyed under `salt` (prefix_cache.py)."""
    from ..device import room_mb  # noqa: PLC0415

    hidden = runner.stage.cfg.hidden_size
    tapped = cache and bool(tap_layers)  # the cached blocks keep their tap rows too (tap_blocks.py)
    row = PagedKV.row_bytes(runner.stage, runner.dtype) + (TapBlocks.row_bytes(tap_layers, hidden, runner.dtype)
                                                             if tapped else 0)
    free = room_mb(runner.device) * (1 << 20)
    if kv_rows is None:  # what the step graphs capture next (their logits, fp32) stays free too
        room = free * 0.9 - (graph_bytes(runner.stage, budget, max_batch) if graphs else 0)
        room -= max_batch * PagedKV.request_bytes(runner.stage) + reserve  # recurrent states; taps, draft caches
        kv_rows = max(min(max_batch * capacity, int(room) // max(row, 1)), capacity)
    pool = BlockPool(blocks_for(kv_rows, BLOCK), BLOCK, cache=cache)
    if pool.rows * row > free:
        raise UserError(f"out of memory: a KV pool of {pool.rows} rows needs {pool.rows * row / 2**20:.0f} MB on "
                        f"{runner.label}, free {free // 2**20} MB (lower --kv-rows or --ctx)")
    b = Batcher(runner.stage, runner.device, runner.dtype, pool, budget,
                graphs=graphs and runner.device.type == "cuda", tap_layers=tap_layers, max_requests=max_batch)
    b.salt = salt
    if tapped:
        b.tap_blocks = TapBlocks(tap_layers, pool.num_blocks, BLOCK, hidden, runner.device, runner.dtype)
    return b


class BatchedBackend:
    def __init__(self, plan, max_batch: int, max_tokens: int | None = None, kv_rows: int | None = None,
                 runner=None):
        """runner: the target's runner already loaded (a batched pipeline's head: the last
        stage's layers and the head, pipeline/batch_head.py); its steps then run eager."""
        import torch  # noqa: PLC0415

        from ..device import resolve_device, resolve_dtype  # noqa: PLC0415
        from ..progress import LoadProgress  # noqa: PLC0415
        from ..runner import ModelRunner  # noqa: PLC0415
        from ..threads import apply_cpu_threads  # noqa: PLC0415

        cfg = plan.cfg
        check_batchable(cfg, plan.model, max_batch, plan.draft if cfg.drafter == "model" else None)
        self.torch = torch
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.threads_before = apply_cpu_threads(plan.model, self.device)
        fast = cfg.runner_kwargs(self.device)  # fused projections and our kernels where the run has them

        def load(path, mcfg):  # the weights (a runner's own cache is never allocated: the pools replace it)
            return ModelRunner(path, self.device, self.dtype, cfg=mcfg, max_pos=plan.capacity,
                               progress=LoadProgress(Path(path).name), graphs=fast["graphs"], kernels=fast["kernels"],
                               compile_drafter=fast["compile_drafter"])  # (the tap drafters' shared graphs read it)

        self.runner = runner if runner is not None else load(cfg.model, plan.model)
        budget = max_tokens if max_tokens is not None else max(cfg.prefill_chunk, max_batch * (cfg.k + 1))
        taps = self._load_tap_net(cfg, plan, max_batch)
        graphs = fast["graphs"] and runner is None
        off = prefix_cache_off(cfg, plan.model.arch)
        if off is not None:
            print(f"[memra] {off}", file=sys.stderr, flush=True)
        self.prefix_cache = cfg.prefix_cache and off is None
        self.batcher = _batcher(self.runner, max_batch, plan.capacity, kv_rows, budget, graphs, taps,
                                self._pool_bytes(plan, max_batch, taps), self.prefix_cache,
                                salt_for(cfg.model, self.dtype))
        # --spec-k auto chooses K in the loop's chained rounds; a pipeline's requests run their own
        # rounds (the head's slots do not chain), so there every round drafts -k (app.py says so)
        self.batcher.auto_k = cfg.spec_k == "auto" and runner is None
        # DFlash's shared forward computes a whole block a drafting request, whatever its K:
        # --spec-k auto prices its drafting by request, not by drafted token (spec_k.py StepCost)
        self.batcher.cost.per_request = cfg.drafter == "dflash"
        self.draft_batcher = None
        if cfg.drafter == "model":  # the draft model's steps batched too, over its own pool
            self.draft_runner = load(cfg.draft_model, plan.draft)
            self.draft_batcher = _batcher(self.draft_runner, max_batch, plan.capacity,
                                          self.batcher.pool.rows if kv_rows is not None else None, budget,
                                          fast["graphs"], cache=self.prefix_cache, salt=salt_for(cfg.draft_model,
                                                                                                 self.dtype))
            if runner is None:  # the loop drafts the chained requests together (submit_many: due at once); what
                self.draft_batcher.max_wait_s = 0.0  # else reaches it (a prime, a parked round) waits for no one
        self.admission = Admission(max_batch)  # the B request slots, longest cached prefix first (admission.py)
        self.max_batch = max_batch
        verify = cfg.k + 1 if cfg.drafter != "none" else 1
        self._warm(self.batcher, max_batch, (1, verify), plan.capacity, "target", timed=self.batcher.auto_k,
                   tails=self.prefix_cache, twins=cfg.trace.level >= 2)
        if self.draft_batcher is not None:  # draft rows: one a step, a catch-up of up to K + 1
            self._warm(self.draft_batcher, max_batch, (1, cfg.k + 1), plan.capacity, "draft model",
                       tails=self.prefix_cache)
        if self.draft_pool is not None and self.batcher.graphs is not None:
            try:
                self._draft_graphs(plan, max_batch)
            except Exception as e:  # noqa: BLE001 (the graphs are a fast path: the shared forwards run eager)
                self.draft_pool.graphs = self.draft_pool.ingest_graphs = None
                print(f"[memra] warning: the shared draft forwards stay eager (their CUDA graphs failed: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr, flush=True)
        self.calibration = self._calibrate(plan) if self.batcher.auto_k else None
        _switch(+1)  # last: a backend that failed to open is never closed

    def _calibrate(self, plan) -> dict | None:
        """--spec-k auto's step cost started from the steps and draft forwards timed at open
        (calibrate.py); None where nothing was timed (no graphs)."""
        from .calibrate import calibrate, draft_points, say  # noqa: PLC0415

        steps = self.batcher.graphs.timings if self.batcher.graphs is not None else []
        if not steps:
            return None
        t = time.perf_counter()
        drafts = []
        if self.draft_pool is not None:
            block = plan.draft.block_size if plan.cfg.drafter == "dflash" else None
            drafts = draft_points(self.draft_pool, plan.cfg.k, block, self.device, self.batcher.cost.per_request)
        timed_s = time.perf_counter() - t + self.batcher.graphs.timing_s
        rec = calibrate(self.batcher.cost, steps, drafts, timed_s)
        print(f"[memra] {say(rec)}", file=sys.stderr, flush=True)
        return rec

    def _load_tap_net(self, cfg, plan, max_batch: int) -> tuple[int, ...]:
        """A tap drafter's network, loaded once for every request (each request's drafter holds
        its own draft cache over it); returns the target layers it reads."""
        self.tap_net = self.draft_pool = None
        if cfg.drafter in ("dflash", "eagle3"):  # every request's draft cache a slot of one pool (draft_pool.py)
            from ..specdec.drafters.draft_pool import DraftPool  # noqa: PLC0415

            base = plan.draft.base
            layers = base.num_layers if cfg.drafter == "dflash" else 1
            self.draft_pool = DraftPool(max_batch, layers, base.num_kv_heads, base.head_dim, self.device, self.dtype)
        if cfg.drafter == "dflash":
            from ..model.dflash import load_dflash  # noqa: PLC0415

            self.tap_net = load_dflash(cfg.draft_model, plan.draft, self.device, self.dtype)
        elif cfg.drafter == "eagle3":
            from ..model.eagle3 import load_eagle3  # noqa: PLC0415

            self.tap_net = load_eagle3(cfg.draft_model, plan.draft, self.device, self.dtype)
        elif cfg.drafter == "mtp":  # the target checkpoint's own MTP layers
            from ..model.mtp import check_mtp, load_mtp  # noqa: PLC0415
            from ..model.taps import FINAL  # noqa: PLC0415
            from ..specdec.drafters.draft_pool import DraftPool  # noqa: PLC0415
            from ..specdec.drafters.mtp_pool_graph import poolable  # noqa: PLC0415

            self.tap_net = load_mtp(cfg.model, plan.model, check_mtp(plan.model, cfg.model), self.device, self.dtype)
            if poolable(self.tap_net):  # one layer of grouped attention: its K/V a slot of one pool
                a = self.tap_net.layer(0).self_attn
                self.draft_pool = DraftPool(max_batch, 1, a.nkv, a.hd, self.device, self.dtype)
            return (FINAL,)
        return tuple(plan.draft.tap_ids) if self.tap_net is not None else ()

    def _pool_bytes(self, plan, max_batch: int, taps: tuple[int, ...]) -> int:
        """The tap pool's and the draft-cache pool's bytes once allocated (their spare slots too)."""
        elem = self.torch.tensor([], dtype=self.dtype).element_size()
        out = (max_batch + 1) * plan.capacity * self.runner.stage.cfg.hidden_size * len(taps) * elem
        p = self.draft_pool
        if p is not None:
            rows = plan.capacity + (plan.draft.block_size if plan.cfg.drafter == "dflash" else 0)
            out += 2 * p.layers * (p.slots + 1) * rows * p.n_kv * p.head_dim * elem
        return out

    def _draft_graphs(self, plan, max_batch: int) -> None:
        """The step leader's shared draft forwards as CUDA graphs over the draft pool, captured
        before the first request, where each slot is short enough to read whole: DFlash's block
        forward and maintenance (specdec/drafters/dflash_pool_graph.py; the network fused as the
        solo drafter's graphs run it), EAGLE-3's round of chains (eagle3_pool_graph.py)."""
        from ..specdec.drafters.dflash_compile import target_compiles  # noqa: PLC0415
        from ..specdec.drafters.dflash_pool_graph import PoolBlockGraphs, PoolIngestGraphs, pays  # noqa: PLC0415

        if plan.cfg.drafter == "eagle3":
            self._chain_graphs(plan, max_batch)
            return
        if plan.cfg.drafter == "mtp":
            self._mtp_graphs(plan, max_batch)
            return
        dc = plan.draft
        rows = plan.capacity + dc.block_size  # the drafter's rows (dflash.py alloc)
        paged = self._paged_drafts(dc.base.head_dim)
        if not paged and not pays(rows, max_batch):
            return
        self.tap_net.fuse()
        self.draft_pool.alloc(rows)
        g = PoolBlockGraphs(self.tap_net, self.runner.stage, self.draft_pool, dc.block_size, plan.cfg.k,
                            dc.mask_token_id, max_batch, paged=paged, compiled=target_compiles(self.runner))
        t0 = time.perf_counter()
        n = g.warm()
        ing = None
        taps = self.batcher.tap_pool
        if taps is not None and taps.layers == tuple(dc.tap_ids):  # the maintenance too, over the tap pool
            taps.alloc(plan.capacity)
            ing = PoolIngestGraphs(self.tap_net, self.draft_pool, taps, min(plan.cfg.k, dc.block_size - 1) + 1,
                                   max_batch)
            n += ing.warm()
        self.draft_pool.graphs, self.draft_pool.ingest_graphs = g, ing  # both captured, or neither used
        self._say_graphs("dflash", n, t0)

    def _paged_drafts(self, head_dim: int) -> bool:
        """Whether the shared draft forwards' graphs attend on the paged kernel: the target runs
        our kernels and the drafter's head size suits them (a power of two, >= 16)."""
        return bool(self.batcher.kernels) and head_dim >= 16 and head_dim & (head_dim - 1) == 0

    def _chain_graphs(self, plan, max_batch: int) -> None:
        from ..specdec.drafters.dflash_pool_graph import pays  # noqa: PLC0415
        from ..specdec.drafters.eagle3_pool_graph import PoolChainGraphs  # noqa: PLC0415

        taps = self.batcher.tap_pool
        paged = self._paged_drafts(plan.draft.base.head_dim)
        if ((not paged and not pays(plan.capacity, max_batch)) or taps is None
                or taps.layers != tuple(plan.draft.tap_ids)):
            return
        self.draft_pool.alloc(plan.capacity)  # the drafter's rows (eagle3.py alloc)
        taps.alloc(plan.capacity)
        net = self.tap_net
        if paged and not net.folded:  # the rounds' steps on our kernels, as the solo drafter's (its probe may refuse)
            from ..kernels.ops import install_eagle3  # noqa: PLC0415 (Triton: only where installed)

            install_eagle3(net)
        embed = net.embed_tokens if net.embed_tokens is not None else self.runner.stage.embed_tokens
        g = PoolChainGraphs(net, embed, self.draft_pool, taps, plan.cfg.k, max_batch, paged=paged)
        t0 = time.perf_counter()
        n = g.warm()
        self.draft_pool.graphs = g
        self._say_graphs("eagle3", n, t0)

    def _mtp_graphs(self, plan, max_batch: int) -> None:
        """The loop's MTP rounds as one replay a step (mtp_pool_graph.py), the layer on the
        kernels where the target runs them (its QKV and gate-up fused first, as the runner fuses
        the target's blocks)."""
        from ..specdec.drafters.dflash_pool_graph import pays  # noqa: PLC0415
        from ..specdec.drafters.mtp_pool_graph import MTPPoolGraphs  # noqa: PLC0415

        taps, head = self.batcher.tap_pool, self.tap_net
        paged = self._paged_drafts(head.layer(0).self_attn.hd)
        if ((not paged and not pays(plan.capacity, max_batch)) or taps is None
                or not getattr(head.layer(0).mlp, "graph_safe", True)):  # (an MoE off its grouped form)
            return
        if self.runner.kernel_modules:  # as MTPDrafter.load installs them beside a solo target
            from ..kernels.ops import install_mtp  # noqa: PLC0415 (Triton: only where installed)

            for m in (head.layer(0).self_attn, head.layer(0).mlp):
                if hasattr(m, "fuse") and not (hasattr(m, "qkv_proj") or hasattr(m, "gate_up_proj")):
                    m.fuse()
            install_mtp(head)
        self.draft_pool.alloc(plan.capacity)  # the drafter's rows (mtp.py alloc)
        taps.alloc(plan.capacity)
        g = MTPPoolGraphs(head, self.runner.stage, self.draft_pool, taps, plan.cfg.k, max_batch,
                          paged=paged and hasattr(head.layer(0).self_attn, "qkv_proj"))
        t0 = time.perf_counter()
        n = g.warm()
        self.draft_pool.graphs = g
        self._say_graphs("mtp", n, t0)

    @staticmethod
    def _say_graphs(what: str, n: int, t0: float) -> None:
        print(f"[memra] shared draft forwards ({what}): {n} CUDA graphs captured in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)

    @staticmethod
    def _warm(batcher: Batcher, max_batch: int, rows_each: tuple[int, ...], capacity: int, what: str,
              timed: bool = False, tails: bool = False, twins: bool = False) -> None:
        """The batched steps' graphs (graphs.py) captured before the first request (`timed`: each
        bucket's replay timed too, calibrate.py; `tails`: a prefill tail's buckets too, where the
        prefix cache leaves prompts short tails; `twins`: each decode / verify bucket's level-2
        timed twin too, an engine opened at trace level 2)."""
        if batcher.graphs is None:
            return
        n, sec = batcher.graphs.warm(max_batch, rows_each, capacity, timed, tails, twins)
        if n:
            print(f"[memra] batched steps ({what}): {n} CUDA graphs captured in {sec:.1f} s", file=sys.stderr,
                  flush=True)

    def request(self, plan, prompt: list[int], span_sink, slot: BatchSlot, draft_slot: BatchSlot | None = None):
        from ..specdec.drafters.draft_model import ModelDrafter  # noqa: PLC0415
        from ..specdec.request import Request  # noqa: PLC0415

        drafter = ModelDrafter(draft_slot) if draft_slot is not None else None
        if plan.cfg.drafter == "dflash":  # over the request's slot: its taps, the stage's embedding / lm_head
            from ..specdec.drafters.dflash import DFlashDrafter  # noqa: PLC0415

            drafter = DFlashDrafter(self.tap_net, slot)
        elif plan.cfg.drafter == "eagle3":
            from ..specdec.drafters.eagle3 import Eagle3Drafter  # noqa: PLC0415

            drafter = Eagle3Drafter(self.tap_net, slot)
        elif plan.cfg.drafter == "mtp":
            from ..specdec.drafters.mtp import MTPDrafter  # noqa: PLC0415

            drafter = MTPDrafter(self.tap_net, slot)
        if self.draft_pool is not None:
            drafter.pool = self.draft_pool  # its draft cache taken at alloc, given back as the request ends
        if plan.cfg.ngram_first:  # the lookup's rounds on the host, the network's in its shared forward
            from ..specdec.drafters.ngram_first import NgramFirst  # noqa: PLC0415

            drafter = NgramFirst(drafter)
        return Request(slot, plan, prompt, span_sink, drafter=drafter)

    @contextmanager
    def session(self, plan, prompt: list[int], span_sink, carrier):
        """A batch slot for the request (waiting for one of the B), and one on the draft
        model's batcher with a model drafter; their blocks given back when it ends or is
        abandoned."""
        cfg = plan.cfg
        need = min(plan.capacity, len(prompt) + cfg.max_new_tokens + cfg.k + 1)
        first = len(prompt) + 1  # admitted with its prompt's blocks; its forwards grow them
        slot = BatchSlot(self.batcher, need, first, prompt)
        with self.admission.enter(slot.cached_blocks):
            draft = BatchSlot(self.draft_batcher, need, first, prompt) if self.draft_batcher is not None else None
            req = None
            try:
                req = self.request(plan, prompt, span_sink, slot, draft)
                yield req
            finally:
                done = req is not None and req.done  # ended (not abandoned): its committed blocks are kept too
                slot.release(req.session.tokens if done else None)
                if draft is not None:
                    draft.release()  # (the draft model's prompt blocks were published as its prime wrote them)
                if self.draft_pool is not None:
                    self.draft_pool.give(slot)

    def stats(self) -> dict:
        b = self.batcher
        out = {**b.stats.as_dict(), **b.idle.as_dict(), "kv_rows": b.pool.rows, "block": BLOCK, "admitted_ahead": self.admission.ahead,
               "kv_blocks_used": b.pool.used_blocks, "kv_blocks_free": b.pool.free_blocks}
        if b.pool.cache:
            out["prefix_cache"] = b.pool.cache_stats()
        if b.graphs is not None:
            out["graphs"] = b.graphs.stats()
        if self.calibration is not None:
            out["calibration"] = self.calibration
            cost = self.batcher.cost  # ... and what the steps since taught it
            out["step_cost"] = {"offset_ms": round(cost.offset / 1e6, 4),
                                "bucket_ms": {str(k): round(v / 1e6, 4) for k, v in sorted(cost.by_bucket.items())}}
        g = self.draft_pool.graphs if self.draft_pool is not None else None
        if g is not None:
            ing = self.draft_pool.ingest_graphs
            out["draft_graphs"] = {"captured": len(g.graphs), "replays": g.replays,
                                   "sampled_replays": getattr(g, "sampled_replays", 0),
                                   "ingest_replays": ing.replays if ing is not None else 0}
        if self.draft_batcher is not None:
            d = self.draft_batcher
            out["draft"] = {**d.stats.as_dict(), "kv_rows": d.pool.rows, "kv_blocks_used": d.pool.used_blocks}
            if d.pool.cache:
                out["draft"]["prefix_cache"] = d.pool.cache_stats()
        return out

    def close(self) -> None:
        self.batcher.close()  # no step left running (the engine loop joined) once the engine is closed
        if self.draft_batcher is not None:
            self.draft_batcher.close()
        self.torch.set_num_threads(self.threads_before)
        _switch(-1)
