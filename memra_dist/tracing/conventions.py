"""The one registry of names: spans, attributes, metrics, resource keys, stderr tags.

Docs (`docs/spans.md`), dashboards (`dashboards/`) and tests read these constants; nothing
else spells a name. Units are in the attribute's suffix or its doc string.
"""

from __future__ import annotations

__all__ = [
    "SPAN_REQUEST", "SPAN_BURST", "SPAN_ROUND", "PHASES", "PHASE_SPANS", "VERIFY_SUB_SPANS",
    "SPAN_FIRST_TOKEN", "SPAN_PRIME_CHUNK", "TTFT_BUCKETS", "ttft_span", "SPAN_STAGE_FORWARD", "ATTR", "RESOURCE",
    "free_mb_attr", "METRICS", "METRIC_ATTR", "METRIC_META", "SPANMETRICS", "SPANMETRICS_NAMESPACE", "TAGS", "MIXER_CLASSES", "SERVICE_NAME_DEFAULT",
]

SERVICE_NAME_DEFAULT = "memra-dist"

# ---- spans ----
SPAN_REQUEST = "memra.request"  # root, or child of an incoming W3C traceparent
SPAN_BURST = "spec.burst"
SPAN_ROUND = "spec.round"
PHASES = ("draft", "verify", "accept", "rollback", "maint")  # clock order within a round
PHASE_SPANS = {p: f"spec.{p}" for p in PHASES}
MIXER_CLASSES = ("kda", "mla", "attn")  # level-2 verify sub-buckets by mixer class
VERIFY_SUB_SPANS = {
    "kda": "spec.verify.kda",  # carries ATTR["scan_ms"]
    "mla": "spec.verify.mla",
    "attn": "spec.verify.attn",  # GQA class
    "ffn": "spec.verify.ffn",
    "rest": "spec.verify.rest",  # verify minus the mixer buckets
}
SPAN_FIRST_TOKEN = "memra.first_token"
# first-token profile buckets (ms; docs/seed-names.md maps them); a bucket the route never runs is 0.0
TTFT_BUCKETS = (
    "cache_alloc", "prime", "capture", "anchor", "draft_alloc", "draft_prime",
    "first_draft", "first_verify", "first_accept", "first_roll", "first_maint",
)
SPAN_PRIME_CHUNK = "ttft.prime.chunk"  # one prefill chunk of the target's prime (under ttft.prime)
SPAN_STAGE_FORWARD = "stage.forward"  # a pipeline stage's share of one forward walk (or of one batch step)
SPAN_BATCH_STEP = "batch.step"  # one step of a batched engine, its own trace; the rounds that rode it link to it


def ttft_span(bucket: str) -> str:
    return f"ttft.{bucket}"


# ---- attributes ----
ATTR = {
    "round": "memra.round",  # round index within the request (int)
    "burst": "memra.burst",  # burst index within the request (int)
    "k": "memra.k",  # drafted tokens that entered the verify (int)
    "accepted": "memra.accepted",  # accepted drafts j, 0 <= j <= k (int)
    "ctx": "memra.ctx",  # committed target rows at round entry (int)
    "stage": "memra.stage",  # pipeline stage index (int)
    "session": "memra.session",  # on stage spans: the cache slot of the session served (int)
    "phase": "memra.phase",  # on stage spans: the phase the forward served (prime, verify; batch: a batched pipeline step)
    "rows": "memra.rows",  # rows in a forward (int)
    "scan_ms": "memra.scan_ms",  # KDA recurrent-scan share inside spec.verify.kda (ms)
    "seq_rows": "memra.seq_rows",  # verify rows that took a per-row mixer arm (int)
    "draft_forwards": "memra.draft_forwards",  # on spec.draft: draft-network forwards in the phase (int)
    "host_ms": "memra.host_ms",  # on phase spans: the phase until the host reached its end boundary (ms)
    "clock": "memra.clock",  # on spec.burst: how its phases were timed: events | drain | ahead | leader
    "tokens": "memra.tokens",  # tokens committed (int)
    "rounds": "memra.rounds",  # rounds in a burst / request (int)
    "drafter": "memra.drafter",
    "model": "memra.model",  # model directory name (never the prompt)
    "pp": "memra.pp",
    "trace_level": "memra.trace_level",
    "prompt_tokens": "memra.prompt_tokens",
    "cached_tokens": "memra.cached_tokens",  # prompt tokens shared from the prefix cache, not prefilled (int)
    "prompt": "memra.prompt",  # only with --trace-content
    "output": "memra.output",  # only with --trace-content
    "kv_mb": "memra.draft_kv_mb",
    # first-token depth of the tap-drafter path (on memra.first_token; the seed's names, phase/first_token.py)
    "cache_kv_alloc_ms": "memra.cache_kv_alloc_ms",  # share of ttft.cache_alloc: the cache states (ms)
    "graph_captures": "memra.graph_captures",  # step graphs captured in ttft.cache_alloc (int)
    "graph_first_capture_ms": "memra.graph_first_capture_ms",  # share of ttft.cache_alloc: the first capture (ms)
    "graph_capture_ms": "memra.graph_capture_ms",  # share of ttft.cache_alloc: the other captures (ms)
    "graph_warmup_ms": "memra.graph_warmup_ms",  # share of ttft.cache_alloc: the captures' warm-up runs (ms)
    "graph_record_ms": "memra.graph_record_ms",  # share of ttft.cache_alloc: the captures' recordings (ms)
    "graph_rows_ms": "memra.graph_rows_ms",  # each captured row count's ms, rows:ms/... (str)
    "kernel_tune_configs": "memra.kernel_tune_configs",  # Triton autotuner configs benchmarked before the first token (int)
    "kernel_tune_ms": "memra.kernel_tune_ms",  # their benchmarking (ms)
    "kernel_tune_cached": "memra.kernel_tune_cached",  # keys read from the on-disk tuning cache (int)
    "tap_sink_alloc_ms": "memra.tap_sink_alloc_ms",  # share of ttft.cache_alloc (ms)
    "tap_sink_mb": "memra.tap_sink_mb",  # the target's tap sink (MB)
    "prime_chunks": "memra.prime_chunks",  # prefill forwards of the target's prime (int)
    "prime_rows": "memra.prime_rows",  # prompt rows they ran (int)
    "prime_chunk_mean_ms": "memra.prime_chunk_mean_ms",  # mean drained time of a prime chunk (ms)
    "prime_chunk_max_ms": "memra.prime_chunk_max_ms",  # the slowest prime chunk (ms)
    "chunk": "memra.chunk",  # on ttft.prime.chunk: the chunk's index in the prime (int)
    "prime_tap_dtoh_ms": "memra.prime_tap_dtoh_ms",  # share of ttft.prime: 0 on arm=device (ms)
    "draft_prime_h2d_ms": "memra.draft_prime_h2d_ms",  # share of ttft.draft_prime: 0 on arm=device (ms)
    "draft_prime_feat_ms": "memra.draft_prime_feat_ms",  # share of ttft.draft_prime (ms)
    "draft_prime_kv_ms": "memra.draft_prime_kv_ms",  # share of ttft.draft_prime (ms)
    "draft_prime_rows": "memra.draft_prime_rows",  # rows ingested by the drafter prime (int)
    "draft_prime_chunks": "memra.draft_prime_chunks",  # ingest calls in the prime (int)
    "draft_prime_arm": "memra.draft_prime_arm",  # device | - (no taps read)
    "drafted": "memra.drafted",  # request total of drafted tokens (int)
    "accepted_total": "memra.accepted_total",  # request total of accepted drafts (int)
    # a batched request (--max-batch > 1, batching/): the batch step its verify rows rode in
    "batch_step": "memra.batch.step",  # on spec.round / spec.verify: the step's id, shared by every request in it (int)
    "batch_requests": "memra.batch.requests",  # requests whose rows the step held (int)
    "batch_rows": "memra.batch.rows",  # rows the step held, every request's (int)
    "batch_wait_ms": "memra.batch.wait_ms",  # share of spec.verify: its rows waiting for the step to start (ms)
    "batch_forward_ms": "memra.batch.forward_ms",  # share of spec.verify: the step's forward, host to host (ms)
    "batch_draft_requests": "memra.batch.draft_requests",  # on spec.draft / spec.round: requests its draft forward held
    "batch_kv_used": "memra.batch.kv_used",  # on batch.step: the paged pool's blocks in use after the step (int)
    "batch_kv_free": "memra.batch.kv_free",  # on batch.step: ... and free (int)
    "batch_preempted": "memra.batch.preempted",  # on batch.step: requests preempted so far (int)
    "batch_predicted_ms": "memra.batch.predicted_ms",  # on batch.step (--spec-k auto): its cost line's forecast (ms)
    "batch_gap_ms": "memra.batch.gap_ms",  # on batch.step: the device idle before it, requests mid-generation waiting (ms)
    "batch_rounds_ms": "memra.batch.rounds_ms",  # ... of it, the loop's rounds after the step before (ms)
    "batch_held_ms": "memra.batch.held_ms",  # ... of it, the loop holding the step for a request on the host (ms)
    "expected_accepted": "memra.spec_k.expected",  # on spec.round (--spec-k auto): accepted drafts its K was chosen for
    # a batched round run by the step's leader, at level 1: its phases as attributes of spec.round (ms)
    **{f"{p}_ms": f"memra.{p}_ms" for p in PHASES},
    "fast_path": "memra.fast_path",  # what the target's steps ran: graphs+compile+kernels(+ahead) ... | eager
}
FREE_MB_PREFIX = "memra.free_mb."  # + device label: cuda0, cuda1, ... or cpu (MB)


def free_mb_attr(label: str) -> str:
    return FREE_MB_PREFIX + label


RESOURCE = {
    "service": "service.name",
    "role": "memra.role",  # driver | stage | head
    "host": "host.name",
    "pid": "process.pid",
}
ROLES = ("driver", "stage", "head")

# ---- metrics (OpenTelemetry instrument names; Prometheus turns '.' into '_') ----
METRICS = {
    "phase_duration": "memra.spec.phase.duration",  # histogram, ms, attr memra.phase
    "phase_host_duration": "memra.spec.phase.host.duration",  # histogram, ms, attr memra.phase
    "verify_sub_duration": "memra.spec.verify.sub.duration",  # histogram, ms, attr memra.bucket
    "drafted": "memra.spec.drafted",  # counter, tokens
    "accepted": "memra.spec.accepted",  # counter, tokens
    "tokens_per_round": "memra.spec.tokens_per_round",  # histogram
    "acceptance": "memra.spec.acceptance",  # histogram, ratio per burst
    "first_token": "memra.first_token.duration",  # histogram, ms, attr memra.bucket
    "free_memory": "memra.device.free_memory",  # gauge, MB, attr memra.device
    "slow_rounds": "memra.spec.slow_rounds",  # counter, rounds past 1.5x the median
    "round_duration": "memra.spec.round.duration",  # histogram, ms
    "batch_requests": "memra.batch.requests",  # histogram, requests in the batch step of a round's verify
    "batch_wait": "memra.batch.wait.duration",  # histogram, ms, a batched verify waiting for its step
    "batch_draft_requests": "memra.batch.draft_requests",  # histogram, requests in a leader round's shared draft forward
    "kv_blocks": "memra.batch.kv_blocks",  # gauge, blocks of the paged KV pool, attr memra.kv_state (used | free)
    "batch_preemptions": "memra.batch.preemptions",  # gauge, requests the engine has preempted so far
    "prefix_evictions": "memra.prefix_cache.evictions",  # gauge, cached blocks the engine has evicted so far
    "spec_k_chosen": "memra.spec_k.chosen",  # histogram, drafts: the K --spec-k auto chose for a round
    "spec_k_expected": "memra.spec_k.expected",  # counter, tokens: accepted drafts those Ks were chosen for
    "spec_k_accepted": "memra.spec_k.accepted",  # counter, tokens: accepted drafts of those rounds
    "batch_idle": "memra.batch.idle.duration",  # histogram, ms: the device idle before a round's step, by memra.part
    "batch_step": "memra.batch.step.duration",  # histogram, ms: the forward of a round's step
    "batch_step_predicted": "memra.batch.step.predicted",  # histogram, ms: --spec-k auto's forecast of that step
    "position_reached": "memra.spec.position.reached",  # counter, drafts that reached their position, by memra.draft_position
    "position_accepted": "memra.spec.position.accepted",  # counter, ... and were accepted there
}
METRIC_ATTR = {"phase": "memra.phase", "bucket": "memra.bucket", "device": "memra.device", "kv_state": "memra.kv_state",
               "part": "memra.part", "position": "memra.draft_position"}
# kind, UCUM unit and description of each instrument (docs/metrics.md and the dashboards read
# these; the Prometheus form of a name adds the unit word and _total / _bucket suffixes)
METRIC_META = {
    "phase_duration": ("histogram", "ms", "Phase wall time per round, by phase (memra.phase: draft, verify, accept, rollback, maint)."),
    "phase_host_duration": ("histogram", "ms", "A phase's host part per round, by phase: until the host reached the "
                            "phase's end boundary (launches, host work, waits such as a readback); rounds "
                            "run one step ahead record none."),
    "verify_sub_duration": ("histogram", "ms", "Level-2 verify sub-bucket time per round, by memra.bucket (kda, mla, attn, ffn, rest)."),
    "drafted": ("counter", "{token}", "Drafted tokens that entered a verify."),
    "accepted": ("counter", "{token}", "Drafted tokens the verify accepted."),
    "tokens_per_round": ("histogram", "{token}", "Tokens committed per round (accepted drafts + the bonus/recovered token)."),
    "acceptance": ("histogram", "1", "Accepted / drafted, one value per burst."),
    "first_token": ("histogram", "ms", "First-token profile buckets (memra.bucket: the TTFT bucket names), once per request."),
    "free_memory": ("gauge", "MBy", "Free memory per device (memra.device: cuda0, cuda1, ... or cpu) at the last phase boundary of a burst."),
    "slow_rounds": ("counter", "{round}", "Rounds whose wall time is past 1.5x the median round of their burst."),
    "round_duration": ("histogram", "ms", "Round wall time (draft through maint)."),
    "batch_requests": ("histogram", "{request}", "Batched engines (--max-batch > 1): requests whose rows shared "
                       "the batch step a round's verify rode in, one value per round."),
    "batch_wait": ("histogram", "ms", "Batched engines: a round's verify waiting for its batch step to start "
                   "(the other requests' submissions: until 5 ms pass with none new, at most 20 ms; or a step already running)."),
    "batch_draft_requests": ("histogram", "{request}", "Batched engines with a tap drafter (DFlash, EAGLE-3, MTP): "
                             "requests whose drafts the step leader made in one shared draft forward, one value "
                             "per round drafted that way."),
    "kv_blocks": ("gauge", "{block}", "Batched engines: blocks of the paged KV pool by memra.kv_state (used, free; "
                  "cached: blocks the prefix cache keeps for later requests, in use or evictable, counted in used or free) "
                  "after the last batch step a burst saw."),
    "batch_preemptions": ("gauge", "{preemption}", "Batched engines: requests preempted so far (their K/V swapped "
                          "to host memory to let another grow; each comes back bitwise before its next forward), "
                          "as of the last batch step a burst saw. Rising: the KV pool (--kv-rows) is short."),
    "spec_k_chosen": ("histogram", "{draft}", "--spec-k auto (batched engines): the K chosen for a round by the step's "
                      "expected goodput (0: the request decoded plainly that step), one value per round."),
    "spec_k_expected": ("counter", "{token}", "--spec-k auto: accepted drafts the chosen Ks were expected to bring "
                        "(from each request's running acceptance per draft position)."),
    "spec_k_accepted": ("counter", "{token}", "--spec-k auto: accepted drafts those rounds brought (against "
                        "memra.spec_k.expected: how well the acceptance model forecasts)."),
    "batch_idle": ("histogram", "ms", "Batched engines: the device idle before the batch step a round's verify rode in "
                   "(from the previous step's end to its launch; 0 when it was launched behind a running step), "
                   "one value per round and part (memra.part): rounds, the engine loop's rounds after the "
                   "previous step (acceptance, drafters, next drafts); held, the loop holding the step for a "
                   "request still on the host; other, the rest."),
    "batch_step": ("histogram", "ms", "Batched engines: the forward of the batch step a round's verify rode in (from "
                   "its launch to its device work done), one value per round."),
    "batch_step_predicted": ("histogram", "ms", "--spec-k auto (batched engines): the time the engine's step cost "
                             "model forecast for that step's rows before it ran (its bucket's time where steps replay "
                             "CUDA graphs), one value per round: against memra.batch.step.duration, how well the "
                             "model the K choice weighs forecasts the steps."),
    "position_reached": ("counter", "{draft}", "Drafts that reached their position in a round's verify (every draft "
                         "before them accepted), by memra.draft_position (1 = the first draft)."),
    "position_accepted": ("counter", "{draft}", "Drafts accepted at their position, by memra.draft_position: over "
                          "memra.spec.position.reached, the acceptance per draft position that --spec-k auto's "
                          "choice weighs (each later position's share is given the ones before it)."),
    "prefix_evictions": ("gauge", "{block}", "Batched engines with the prefix cache: cached blocks evicted so far (the "
                         "least recently used, only when no free block was left), as of the last batch step a burst "
                         "saw. Rising fast: the pool is too small to keep the prompts the load repeats."),
}

# The Collector's spanmetrics connector turns our spans into these (namespace set in
# cluster/observability/otel-collector.yaml; Prometheus label span_name = a span name above)
SPANMETRICS_NAMESPACE = "traces.span.metrics"
SPANMETRICS = {"duration": SPANMETRICS_NAMESPACE + ".duration", "calls": SPANMETRICS_NAMESPACE + ".calls"}

# ---- stderr line tags (stable: scripts grep for them) ----
TAGS = {
    "phase": "spec-phase",
    "phase_v": "spec-phase-v",
    "prof": "spec-prof",
    "prof_rounds": "spec-prof-rounds",
    "prof_summary": "spec-prof-summary",
    "trace": "spec-trace",
}
