"""Renders docs/spans.md from the name registry (conventions.py) and from the very functions
that print the stderr lines, so the doc cannot drift from the code.

    python -m memra_dist.tracing.spans_doc          # rewrite docs/spans.md
    python -m memra_dist.tracing.spans_doc --check  # exit 1 if it is stale (tests do this)
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..phase.first_token import FirstTokenProf
from ..phase.levels import trace_level_from
from ..phase.lines import phase_line, phase_v_line
from ..phase.records import BurstRecord
from ..phase.rounds_log import RoundProf, RoundsLog
from . import conventions as C

__all__ = ["render", "ATTR_DOC", "DOC_PATH"]

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "spans.md"

# key of conventions.ATTR -> (unit, where it appears, meaning)
ATTR_DOC = {
    "round": ("", "round, phase, sub-bucket and stage spans", "round index within the request"),
    "burst": ("", "spec.burst", "burst index within the request"),
    "k": ("{token}", "burst, round, phase spans; memra.request", "drafted tokens that entered the verify (the request's K on memra.request)"),
    "accepted": ("{token}", "round and phase spans", "accepted drafts j, 0 <= j <= k"),
    "ctx": ("{row}", "round, phase, stage spans", "committed target rows at round entry (a stage span: the forward's first row)"),
    "stage": ("", "stage.forward", "pipeline stage index (0 = the first layers)"),
    "session": ("", "stage.forward", "the session slot the forward served (sessions in flight interleave across the stages)"),
    "phase": ("", "stage.forward", "`prime` or `verify`: what the forward served; `batch`: one step of a batched "
                                   "pipeline (--pp > 1 --max-batch B), with the step's memra.batch.* attributes"),
    "rows": ("{row}", "stage.forward, ttft.prime.chunk", "rows in the forward (a prime chunk: the chunk's rows)"),
    "chunk": ("", "ttft.prime.chunk", "the chunk's index in the target's prime (0 = the prompt's first rows)"),
    "prime_chunks": ("", "memra.first_token", "prefill forwards of the target's prime (--prefill-chunk rows at most; "
                     "pp > 1: pipelined, shrinking as the prefix grows)"),
    "prime_rows": ("{row}", "memra.first_token", "prompt rows the prime's chunks ran"),
    "prime_chunk_mean_ms": ("ms", "memra.first_token", "mean drained time of a prime chunk (pp > 1: between "
                            "successive chunks' arrival at the head)"),
    "prime_chunk_max_ms": ("ms", "memra.first_token", "the slowest prime chunk"),
    "scan_ms": ("ms", "spec.verify.kda", "the recurrent scan's share inside the KDA mixer bucket"),
    "seq_rows": ("{row}", "spec.round", "verify rows that took a per-row mixer arm instead of the batched one"),
    "draft_forwards": ("{forward}", "spec.draft", "draft-network forwards in the phase, where the drafter says: dflash "
                       "drafts its whole block in ONE forward (1; 0 in a round that drafted nothing)"),
    "clock": ("", "spec.burst", "how the burst's phases were timed (phase/clock.py): `events` (a timing event "
              "recorded on every stream at each boundary, read in the next burst's first verify; a boundary whose phase launched no device work takes the boundary before's time or the host's arrival: the device never idles for the "
              "clock; the CUDA default), `drain` (each boundary synchronizes the streams: CPU, the first-token "
              "profile, a batched request whose drafter runs on the device, a pipeline head shared by sessions "
              "in flight, MEMRA_PHASE_CLOCK=drain), `ahead` (plain greedy one step "
              "ahead: each step's device events), `leader` (a batched request whose rounds the engine loop runs: its stamps, its drafter's device work ending at events behind it), "
              "`host` (a batched request with a host drafter running its own rounds: its steps return read back, so the host's stamps "
              "are the boundaries, no drain)"),
    "host_ms": ("ms", "phase spans (not one step ahead)", "the phase from its start until the host reached its end "
                "boundary (before its drain, or as it recorded its events): its launches, its host work and any "
                "wait inside it (the accept's readback); "
                "the rest of the span is the device finishing work already launched. A phase whose host_ms is "
                "most of it, with the device idle meanwhile, is bound by the host. Waits inside count as host: at level 2 "
                "the verify drains per layer, and at pp > 1 the head's verify waits for the last stage's rows, so "
                "there the verify's host part is nearly all of it"),
    "tokens": ("{token}", "spec.burst, memra.request, memra.first_token", "tokens committed (the first-token span: tokens of the first burst, anchor included)"),
    "rounds": ("{round}", "spec.burst, memra.request, memra.first_token", "rounds run"),
    "drafter": ("", "memra.request", "none | ngram | model | dflash | replay"),
    "model": ("", "memra.request", "the model directory's name (never a path, never the prompt)"),
    "pp": ("", "memra.request", "pipeline stages"),
    "trace_level": ("", "memra.request", "0, 1 or 2"),
    "prompt_tokens": ("{token}", "memra.request", "prompt length"),
    "cached_tokens": ("{token}", "memra.request, memra.first_token", "the prompt's leading tokens whose KV blocks "
                      "a batched engine shared from its prefix cache: its prefill ran only the rest (memra.prime_rows)"),
    "prompt": ("", "memra.request", "the prompt text: ONLY with --trace-content"),
    "output": ("", "memra.request", "the generated text: ONLY with --trace-content"),
    "kv_mb": ("MB", "memra.first_token", "the drafter state allocated for the session"),
    "cache_kv_alloc_ms": ("ms", "memra.first_token", "the target's cache states (KV, latents, recurrent "
                          "snapshots), a drained share of ttft.cache_alloc"),
    "graph_captures": ("", "memra.first_token", "step graphs captured while allocating (one per decode / verify "
                       "row count, and their level-2 twins; 0 when the engine reuses its cache)"),
    "graph_first_capture_ms": ("ms", "memra.first_token", "the first capture, a drained share of ttft.cache_alloc: "
                               "it pays torch.compile and the Triton kernels' JIT (or reads their on-disk caches)"),
    "graph_capture_ms": ("ms", "memra.first_token", "every later capture together, a drained share of "
                         "ttft.cache_alloc"),
    "graph_warmup_ms": ("ms", "memra.first_token", "the captures' eager warm-up runs together (kernel JIT, Triton "
                        "autotuning and torch.compile land here), a drained share of ttft.cache_alloc"),
    "graph_record_ms": ("ms", "memra.first_token", "the captures' recordings together, a drained share of "
                        "ttft.cache_alloc"),
    "graph_rows_ms": ("", "memra.first_token", "each captured row count's ms as rows:ms joined by / (- when "
                      "nothing was captured)"),
    "kernel_tune_configs": ("", "memra.first_token", "Triton autotuner configs benchmarked between the session's start "
                            "and its first token (0 once their timings are in the on-disk cache)"),
    "kernel_tune_ms": ("ms", "memra.first_token", "those keys' benchmarking, inside the captures' warm-ups"),
    "kernel_tune_cached": ("", "memra.first_token", "autotuner keys read from the on-disk cache instead (counted "
                           "where Triton reports it, 0 otherwise)"),
    "tap_sink_alloc_ms": ("ms", "memra.first_token", "the target's tap sink allocation (pp>1: the head's sink), "
                          "a drained share of ttft.cache_alloc; ~0 when the previous session's sink is reused"),
    "tap_sink_mb": ("MB", "memra.first_token", "the target's tap sink for the session (0: no taps kept)"),
    "prime_tap_dtoh_ms": ("ms", "memra.first_token", "tap readbacks inside the target prime (a share of ttft.prime): "
                          "0 on arm=device, where the taps never leave the device (the seed's eager arm counted "
                          "its host DtoH copies here)"),
    "draft_prime_h2d_ms": ("ms", "memra.first_token", "tap rows host -> device inside the drafter prime: 0 on arm=device"),
    "draft_prime_feat_ms": ("ms", "memra.first_token", "the drafter prime's feature GEMM (dflash: tap gather + fc + "
                            "hidden_norm over the prompt rows; mtp: none, 0), a drained share of ttft.draft_prime"),
    "draft_prime_kv_ms": ("ms", "memra.first_token", "the drafter prime's k/v ingest (per-layer k/v projections + "
                          "cache writes; mtp: its layers' forwards), a drained share of ttft.draft_prime"),
    "draft_prime_rows": ("{row}", "memra.first_token", "rows the drafter prime ingested (summed over its ingest calls)"),
    "draft_prime_chunks": ("{call}", "memra.first_token", "ingest calls in the drafter prime"),
    "draft_prime_arm": ("", "memra.first_token", "`device` (a tap drafter: the taps stay on the device) or `-` "
                        "(the drafter reads no taps)"),
    "batch_kv_used": ("{block}", "batch.step", "the paged KV pool's blocks in use after the step"),
    "batch_kv_free": ("{block}", "batch.step", "the paged KV pool's blocks free after the step (cached ones included)"),
    "batch_preempted": ("{request}", "batch.step", "requests the engine had preempted (swapped out) by the step's end"),
    "batch_predicted_ms": ("ms", "batch.step", "--spec-k auto: the step's time the engine's cost line (rows against "
                           "measured step time) forecast before it ran; beside memra.batch.forward_ms, what it took"),
    "batch_gap_ms": ("ms", "batch.step", "the device's idle time before the step: from the previous step's end to "
                     "this one's launch, when a request rode both (0 for a step launched behind a running one); "
                     "the host work between steps that the requests waited through"),
    "batch_rounds_ms": ("ms", "batch.step", "of memra.batch.gap_ms, the engine loop's chained rounds after the "
                        "previous step: acceptance, commits, the drafters' maintenance and the next drafts"),
    "batch_held_ms": ("ms", "batch.step", "of memra.batch.gap_ms, the engine loop holding this step back for a "
                      "request's next rows (a request busy on the host, or one not yet chained); the rest of the "
                      "gap is the loop packing and launching the step"),
    "expected_accepted": ("{token}", "spec.round", "--spec-k auto: the accepted drafts the engine expected when it "
                          "chose this round's K (memra.k) from the request's running acceptance; memra.accepted is "
                          "what came"),
    "drafted": ("{token}", "memra.request", "drafted tokens over the request"),
    "accepted_total": ("{token}", "memra.request", "accepted drafts over the request"),
    "batch_step": ("", "spec.round, spec.verify, stage.forward", "a batched request (--max-batch > 1): the id of the batch step its "
                   "verify rows rode in; every request of that step names the same id, so filtering on it shows "
                   "the step's requests side by side"),
    "batch_requests": ("", "spec.verify, spec.round (leader), stage.forward", "requests whose rows the batch step held (decode, verify and prefill)"),
    "batch_rows": ("{row}", "spec.verify, spec.round (leader), stage.forward", "rows the batch step held, every request's"),
    "batch_wait_ms": ("ms", "spec.verify, spec.round (leader)", "share of the verify: its rows waiting for the batch step to start "
                      "(the others' submissions: until 5 ms pass with none new, at most 20 ms; or a step already running)"),
    "batch_forward_ms": ("ms", "spec.verify, spec.round (leader)", "share of the verify: the batch step's forward, host to host (on a "
                         "GPU its launches; the device's finish is the verify's drain)"),
    "batch_draft_requests": ("", "spec.draft, spec.round (leader)", "a batched round the step's leader ran "
                             "with a tap drafter (DFlash, EAGLE-3, MTP): the requests whose drafts its draft forward made "
                             "together (batching/chain_drafts.py); the draft phase is that shared forward"),
    **{f"{p}_ms": ("ms", "spec.round (leader)", f"a batched round the engine loop ran (`memra.clock` = leader): its {p} "
                   f"phase; such a round is one span at every level, its phases these attributes (level 2: its "
                   f"step's verify sub-split is under the step's batch.step span); on an engine of one request at "
                   f"a time (--max-batch 1) the round keeps its five phase spans instead, and no batch.step") for p in ("draft", "verify", "accept", "rollback", "maint")},
    "fast_path": ("", "memra.request", "what the target's decode / verify steps ran: `graphs`, `compile`, `kernels` "
                  "and `ahead` (plain greedy decoding one step ahead of the host) joined by `+` (a default CUDA "
                  "run: `graphs+compile+kernels`, plain greedy: `graphs+compile+kernels+ahead`), or `eager`"),
}

_SPANS = [
    (C.SPAN_REQUEST, "-", "driver", "one per request; root, or child of an incoming W3C traceparent (--traceparent / TRACEPARENT)"),
    (C.SPAN_BURST, C.SPAN_REQUEST, "driver (pp=1) / head", "a burst of rounds; tokens stream to the caller per round inside it"),
    (C.SPAN_ROUND, C.SPAN_BURST, "driver / head", "one speculative round; its five phase spans tile it in clock order"),
    *[(C.PHASE_SPANS[p], C.SPAN_ROUND, "driver / head", f"the {p} phase, bounded on both sides by the moment its streams reached the boundary: timing events read in the next burst's first verify (CUDA; a phase that launched no device work ends at the boundary before's time or the host's arrival), or drained clock stamps (CPU, MEMRA_PHASE_CLOCK=drain) (plain greedy decoding one step ahead: from its step's device events, no drain; a batched greedy request whose rounds the step leader runs: its stamps, the verify ending at its step's readback)") for p in C.PHASES],
    *[(C.VERIFY_SUB_SPANS[b], C.PHASE_SPANS["verify"] + " / " + C.SPAN_BATCH_STEP, "driver / head", f"level 2: the {b} share of the verify walk (per-layer laps summed: drained, or the graph's device-clock stamps; laid end to end); for rounds the engine loop ran (--max-batch > 1, any pp), the step's walk, once, under its batch.step span") for b in C.VERIFY_SUB_SPANS],
    (C.SPAN_FIRST_TOKEN, C.SPAN_REQUEST, "driver / head", "profile on: everything between the session's prime and the first burst's end"),
    *[(C.ttft_span(b), C.SPAN_FIRST_TOKEN, "driver / head", "first-token bucket " + b) for b in C.TTFT_BUCKETS],
    (C.SPAN_PRIME_CHUNK, C.ttft_span("prime"), "driver / head", "profile on: one prefill chunk of the target's prime "
     "(laid end to end inside ttft.prime; pp > 1: each stage's own chunk spans are its stage.forward spans)"),
    (C.SPAN_BATCH_STEP, "-", "driver / head", "a batched engine (--max-batch > 1): one step of the engine loop, every "
     "request's rows in one forward, from its launch to its readback; its own trace (it serves many requests), made once "
     "by the first traced request that rode it; each such request's spec.round carries a span link to it with its share "
     "(memra.rows, memra.k, memra.accepted)"),
    (C.SPAN_STAGE_FORWARD, C.SPAN_REQUEST, "stage", "pp > 1: a stage actor's share of one forward walk (its layers, drained); batched, of one "
     "step of every request's rows, in the trace of the step's first request"),
]


def _sample_burst() -> BurstRecord:
    b = BurstRecord()
    b.reset(3, 4, 2)
    for i, (d, v, a, r, m, j) in enumerate(((2.1, 9.8, 0.4, 0.1, 0.2, 3), (2.0, 9.9, 0.4, 0.1, 0.2, 4))):
        rr = b.next_round()
        t = 10_000_000 * (i + 1)
        rr.t = [t]
        for ms in (d, v, a, r, m):
            t += int(ms * 1e6)
            rr.t.append(t)
        rr.index, rr.k, rr.j, rr.ctx = 24 + i, 4, j, 300 + 5 * i
        rr.sub_ns = {"kda": 4_100_000, "scan": 1_200_000, "mla": 2_300_000, "attn": 0, "ffn": 2_000_000}
    return b


def _lines() -> list[str]:
    b = _sample_burst()
    log = RoundsLog()
    for r in b.live():
        log.push(RoundProf(r.wall_ns / 1e6, r.phase_ns(0) / 1e6, r.phase_ns(1) / 1e6, r.phase_ns(2) / 1e6,
                           (r.phase_ns(3) + r.phase_ns(4)) / 1e6, r.k, r.j, r.ctx))
    pf = FirstTokenProf()
    pf.ms.update(cache_alloc=0.8, prime=41.2, anchor=0.3, draft_alloc=0.2, draft_prime=6.1, first_draft=2.1,
                 first_verify=9.8, first_accept=0.4, first_roll=0.1, first_maint=0.2)
    pf.first_round_tokens, pf.first_burst_ms, pf.first_burst_rounds, pf.first_burst_tokens = 4, 101.5, 8, 29
    pf.draft_kv_mb, pf.free_mb_before, pf.free_mb_after = 64.0, {"cuda0": 80123}, {"cuda0": 80011}
    pf.tap_sink_alloc_ms, pf.tap_sink_mb = 0.1, 8.0
    pf.draft_prime_feat_ms, pf.draft_prime_kv_ms = 1.9, 3.8
    pf.draft_prime_rows, pf.draft_prime_chunks, pf.draft_prime_arm = 512, 1, "device"
    pf.prime_chunk_rows, pf.prime_chunk_ms = [512], [41.0]
    loud: list[str] = []
    trace_level_from("2", "1", warn=loud.append)  # the [spec-trace] override line
    return [phase_line(b), phase_v_line(b), f"[{C.TAGS['prof']}] {pf.line()}",
            f"[{C.TAGS['prof_rounds']}] {log.rounds[0].line(0)}", f"[{C.TAGS['prof_summary']}] {log.summary()}",
            *loud]


def render() -> str:
    out = ["# Spans, attributes and line shapes", "",
           "Generated by `python -m memra_dist.tracing.spans_doc` from `memra_dist/tracing/conventions.py`",
           "(the one registry) and from the functions that print the lines; `tests/test_spans_doc.py` fails",
           "when this file is stale. Metrics: [metrics.md](metrics.md).", "",
           "## Spans", "", "| span | parent | emitted by (memra.role) | what it covers |", "|---|---|---|---|"]
    out += [f"| `{n}` | `{p}` | {who} | {what} |" if p != "-" else f"| `{n}` | - | {who} | {what} |" for n, p, who, what in _SPANS]
    out += ["", "Every phase span (and sub-bucket span) also carries one "
            f"`{C.FREE_MB_PREFIX}<device>` attribute (MB) per device of the engines that ran it: "
            "`cuda0`, `cuda1`, ... by physical GPU id, or `cpu` (host MemAvailable) in CPU mode. "
            "Start and end times are the recorded clock stamps; a burst's spans are built from its "
            "record after the burst, a round's worth at a time while later verify forwards run on the "
            "device (tracing/deferred.py), never inside a timed phase. Level 0 makes no spans at all.", "",
            "## Attributes", "", "| attribute | unit | on | meaning |", "|---|---|---|---|"]
    out += [f"| `{C.ATTR[k]}` | {u or '-'} | {on} | {what} |" for k, (u, on, what) in ATTR_DOC.items()]
    out += [f"| `{C.FREE_MB_PREFIX}<device>` | MB | phase, sub-bucket, stage and ttft spans | free memory of that device at the boundary |",
            "", "## Resource", "", "| key | value |", "|---|---|",
            f"| `{C.RESOURCE['service']}` | `OTEL_SERVICE_NAME`, default `{C.SERVICE_NAME_DEFAULT}` |",
            f"| `{C.RESOURCE['role']}` | {' / '.join(C.ROLES)} |",
            f"| `{C.RESOURCE['host']}` | the host name |", f"| `{C.RESOURCE['pid']}` | the process id |",
            "", "## Stderr lines (stable shapes)", "",
            "`[spec-phase]` per burst at level >= 1; `[spec-phase-v]` per burst at level 2 (vrest = verify",
            "minus the mixer buckets, vffn printed inside it, a class the model lacks prints 0);",
            "`[spec-prof]` once per request, `[spec-prof-rounds]` rows for the first 64 rounds and one",
            "`[spec-prof-summary]` with the profile on; `[spec-trace]` once when both trace variables are",
            "set and differ. Example lines, printed by the code itself from sample records:", "", "```"]
    out += _lines() + ["```", ""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        ok = DOC_PATH.exists() and DOC_PATH.read_text() == text
        if not ok:
            print(f"{DOC_PATH} is stale: run python -m memra_dist.tracing.spans_doc", file=sys.stderr)
        return 0 if ok else 1
    DOC_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
