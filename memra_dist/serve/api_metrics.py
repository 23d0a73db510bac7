"""The HTTP API's metrics, served as Prometheus text on GET /metrics: the names (read by
dashboards/generate.py and the tests) and the per-process registry that counts them.

Names follow the OpenTelemetry -> Prometheus rule the engine's metrics follow
(tracing/metrics.prometheus_name: dots become '_', counters end in '_total'; '{...}' units add
no word), so a dashboard query reads the same whichever way the series arrive."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["API_METRICS", "API_METRIC_META", "OUTCOME_LABEL", "OUTCOMES", "api_prometheus_name", "ApiMetrics",
           "CONTENT_TYPE"]

API_METRICS = {
    "in_flight": "memra.api.in_flight",  # gauge: requests holding an engine session
    "queue_depth": "memra.api.queue_depth",  # gauge: requests waiting for a session
    "requests": "memra.api.requests",  # counter, by outcome
    "tokens": "memra.api.tokens",  # counter: completion tokens generated
    "prefix_queries": "memra.prefix_cache.queries",  # counter: prompt tokens looked up in the prefix cache
    "prefix_hits": "memra.prefix_cache.hits",  # counter: prompt tokens found there (not prefilled)
}
API_METRIC_META = {
    "in_flight": ("gauge", "{request}", "Requests holding one of the engine's sessions (generating, or unwinding an abort)."),
    "queue_depth": ("gauge", "{request}", "Requests waiting for a session (at most --max-queue; beyond it: 429)."),
    "requests": ("counter", "{request}", "Completion requests answered, by outcome."),
    "tokens": ("counter", "{token}", "Completion tokens generated (streamed or not, aborted requests included)."),
    "prefix_queries": ("counter", "{token}", "Prompt tokens of completed requests on a batched engine with the "
                       "prefix cache on (--max-batch > 1, no --no-prefix-cache)."),
    "prefix_hits": ("counter", "{token}", "Of those, the tokens whose KV blocks the engine shared from its prefix "
                    "cache (usage.prompt_tokens_details.cached_tokens): not prefilled again."),
}
OUTCOME_LABEL = "outcome"
# ok: completed; bad_request: 400/404/413/415; rejected: 429 (queue full) / 503 (too many open requests, the
# server draining, or still queued when a stop cut it); aborted: the client went away (uploading, queued,
# generating, streaming), its body did not come (408), or a stop cut it while it generated; error: 500
OUTCOMES = ("ok", "bad_request", "rejected", "aborted", "error")
CONTENT_TYPE = CONTENT_TYPE_LATEST


def api_prometheus_name(key: str) -> str:
    """The series name of API_METRICS[key] (counters with their '_total')."""
    base = API_METRICS[key].replace(".", "_")
    return base + "_total" if API_METRIC_META[key][0] == "counter" else base


class ApiMetrics:
    """Counters and gauges of one server process, in their own registry (no global state).
    `in_flight` / `queue_depth`: callables read at scrape time."""

    def __init__(self, in_flight=lambda: 0, queue_depth=lambda: 0):
        self.registry = CollectorRegistry(auto_describe=True)
        desc = {k: v[2] for k, v in API_METRIC_META.items()}
        name = {k: v.replace(".", "_") for k, v in API_METRICS.items()}  # Counter adds _total itself
        Gauge(name["in_flight"], desc["in_flight"], registry=self.registry).set_function(in_flight)
        Gauge(name["queue_depth"], desc["queue_depth"], registry=self.registry).set_function(queue_depth)
        self._requests = Counter(name["requests"], desc["requests"], [OUTCOME_LABEL], registry=self.registry)
        self._tokens = Counter(name["tokens"], desc["tokens"], registry=self.registry)
        self._queries = Counter(name["prefix_queries"], desc["prefix_queries"], registry=self.registry)
        self._hits = Counter(name["prefix_hits"], desc["prefix_hits"], registry=self.registry)
        for o in OUTCOMES:  # every outcome present from the start (a rate of a series that appears late is wrong)
            self._requests.labels(o)

    def outcome(self, outcome: str) -> None:
        self._requests.labels(outcome).inc()

    def tokens(self, n: int) -> None:
        if n:
            self._tokens.inc(n)

    def prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A completed request's prompt, looked up in the prefix cache, and the tokens found."""
        self._queries.inc(prompt_tokens)
        self._hits.inc(cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
