"""Prometheus metrics through prometheus_client, one registry per app.

Names follow vLLM's where an equivalent exists, under a `prelude:` prefix instead of
`vllm:` (so an existing dashboard needs only the prefix changed): running/waiting
requests, KV cache usage, prefix-cache queries/hits, TTFT/TPOT/E2E/queue-time
histograms, prompt/generation tokens, finished requests by reason.

With several processes (`--api-server-count`), prometheus_client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR, set by the supervisor before any process starts) keeps every
process's counters and histograms in files there; a scrape of any HTTP process merges
them: its HTTP counts, the other HTTP processes', and the engine process's.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prelude.engine.metrics import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets for the same histograms (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _EngineGauges(Collector):
    """Gauges and engine-owned counters, read from the engine at scrape time."""

    def __init__(self, read: Callable[[], dict[str, float]], model_name: str,
                 extra: Callable[[], dict[str, float]] | None = None) -> None:
        self._read = read
        self._model = model_name
        self._extra = extra

    def _gauge(self, name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name", *labels])
        g.add_metric([self._model, *labels.values()], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self._model], value)
        return c

    def collect(self) -> Iterator[Metric]:
        m = self._read()
        get = lambda key: float(m.get(key, 0.0))  # noqa: E731 - fakes report fewer keys
        running = GaugeMetricFamily("prelude:num_requests_running", "Requests in model execution (by class).",
                                    labels=["model_name", "exec_class"])
        running.add_metric([self._model, "paged"], get("requests_running_paged"))
        running.add_metric([self._model, "oneshot"], get("requests_running_oneshot"))
        yield running
        waiting = GaugeMetricFamily("prelude:num_requests_waiting", "Requests waiting to be scheduled (by class).",
                                    labels=["model_name", "exec_class"])
        waiting.add_metric([self._model, "paged"], get("requests_waiting_paged"))
        waiting.add_metric([self._model, "oneshot"], get("requests_waiting_oneshot"))
        yield waiting
        total, free, cached = get("kv_blocks_total"), get("kv_blocks_free"), get("kv_blocks_cached_evictable")
        used = max(0.0, total - free - cached)
        yield self._gauge("prelude:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of blocks held.",
                          used / total if total else 0.0)
        blocks = GaugeMetricFamily("prelude:kv_blocks", "KV blocks by state: used (held by requests), free, "
                                   "cached (unreferenced, reusable by prefix hits)", labels=["model_name", "state"])
        for state, value in (("used", used), ("free", free), ("cached", cached)):
            blocks.add_metric([self._model, state], value)
        yield blocks
        if wtotal := get("kv_window_blocks_total"):  # sliding layers with a pool of their own
            wfree, wcached = get("kv_window_blocks_free"), get("kv_window_blocks_cached_evictable")
            window = GaugeMetricFamily("prelude:kv_window_blocks", "The sliding-window layers' KV blocks by state: "
                                       "used (held by requests' windows and steps), free, cached (unreferenced)",
                                       labels=["model_name", "state"])
            for state, value in (("used", max(0.0, wtotal - wfree - wcached)), ("free", wfree), ("cached", wcached)):
                window.add_metric([self._model, state], value)
            yield window
        yield self._counter("prelude:prefix_cache_queries", "Prefix-cache lookups (requests).",
                            get("prefix_cache_queries_total"))
        yield self._counter("prelude:prefix_cache_hits", "Prefix-cache lookups that reused blocks.",
                            get("prefix_cache_hits_total"))
        yield self._counter("prelude:prefix_cache_reused_tokens", "Prompt tokens served from the prefix cache.",
                            get("prefix_reused_tokens_total"))
        yield self._counter("prelude:prefix_cache_computed_tokens", "Prompt tokens computed (not reused).",
                            get("prefix_computed_tokens_total"))
        yield self._counter("prelude:prefix_cache_evicted_blocks", "Cached blocks evicted.",
                            get("prefix_evicted_blocks_total"))
        yield self._counter("prelude:prefix_cache_deferred_requests", "Requests deferred one step for a leader.",
                            get("prefix_deferred_requests_total"))
        yield self._counter("prelude:prefix_cache_rider_requests",
                            "OneShot requests that read a leader's prefix blocks in the leader's own step.",
                            get("prefix_rider_requests_total"))
        for name, value in (self._extra() if self._extra else {}).items():
            yield self._counter(f"prelude:{name}", name.replace("_", " "), value)


class _ClusterMetrics(Collector):
    """Scale-out families (router decisions, replicas, LAPS pools) from a client that has
    `cluster_metrics()` (prelude.cluster.client.RayEngineClient), read at scrape time."""

    def __init__(self, read: Callable[[], list[tuple[str, str, str, dict[str, str], float]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for name, kind, doc, labels, value in self._read():
            family = families.get(name)
            if family is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = families[name] = cls(f"prelude:{name}", doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
        yield from families.values()


class ServerMetrics:
    """The app's registry. The engine thread reports finished requests and steps
    (EngineObserver); the HTTP layer counts requests by route, status and class."""

    def __init__(self, engine: Any, extra: Callable[[], dict[str, float]] | None = None) -> None:
        self.model_name = engine.model_name
        self.registry = CollectorRegistry(auto_describe=True)
        # (metric, label values) -> child. Written by the engine thread and the event loop
        # at once: a race makes one child twice, and prometheus_client returns the same
        # child for the same labels, so nothing is lost.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        labels = ["model_name"]
        r = self.registry
        self.http_requests = Counter("prelude:http_requests", "HTTP requests by route, status and execution class.",
                                     ["route", "status", "exec_class"], registry=r)
        self.request_success = Counter("prelude:request_success", "Finished requests by finish reason.",
                                       [*labels, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("prelude:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("prelude:generation_tokens", "Tokens generated.", labels, registry=r)
        self.ttft = Histogram("prelude:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("prelude:time_per_output_token_seconds", "Time per output token after the first.",
                              labels, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("prelude:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("prelude:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.step = Histogram("prelude:step_duration_seconds", "Duration of one engine step by batch kind.",
                              [*labels, "kind"], buckets=_STEP_BUCKETS, registry=r)
        self.step_tokens = Counter("prelude:step_tokens", "Tokens computed by engine steps, by batch kind.",
                                   [*labels, "kind"], registry=r)
        self.decisions = Counter("prelude:decisions", "Typed-decision requests answered, by route.",
                                 [*labels, "route"], registry=r)
        self.decision_questions = Counter(
            "prelude:decision_questions", "Typed-decision questions answered, by route, type and outcome "
            "(answered or refused).", [*labels, "route", "type", "outcome"], registry=r)
        collectors: list[Collector] = [_EngineGauges(engine.metrics, self.model_name, extra)]
        if hasattr(engine, "cluster_metrics"):
            collectors.append(_ClusterMetrics(engine.cluster_metrics))
        for c in collectors:
            r.register(c)
        self._multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if self._multiprocess_dir:
            # Counters and histograms live in the shared files: a scrape reads them all.
            self._scrape = CollectorRegistry(auto_describe=True)
            multiprocess.MultiProcessCollector(self._scrape, self._multiprocess_dir)
            for c in collectors:
                self._scrape.register(c)
        else:
            self._scrape = r

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once: `labels()` takes a lock and builds its
        key each call, about ten calls a request. Made on first use, as before, so a
        series appears in /metrics only once it has counted something."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # --- EngineObserver (engine thread) ------------------------------------------------

    def request_finished(self, m: RequestMetrics) -> None:
        model = self.model_name
        self._child(self.request_success, model, m.finish_reason or "unknown").inc()
        self._child(self.prompt_tokens, model).inc(m.prompt_tokens)
        self._child(self.generation_tokens, model).inc(m.output_tokens)
        if m.ttft_s is not None:
            self._child(self.ttft, model).observe(m.ttft_s)
        if m.tpot_s is not None:
            self._child(self.tpot, model).observe(m.tpot_s)
        if m.jct_s is not None:
            self._child(self.e2e, model).observe(m.jct_s)
        if m.queue_s is not None:
            self._child(self.queue, model).observe(m.queue_s)

    def step_finished(self, kind: str, seconds: float, num_tokens: int) -> None:
        self._child(self.step, self.model_name, kind).observe(seconds)
        self._child(self.step_tokens, self.model_name, kind).inc(num_tokens)

    # --- HTTP -----------------------------------------------------------------------

    def count_request(self, route: str, status: int, exec_class: str) -> None:
        self._child(self.http_requests, route, str(status), exec_class).inc()

    def count_decision(self, route: str, questions: list[tuple[str, bool]]) -> None:
        """One typed-decision request: its questions' (type, refused)."""
        self._child(self.decisions, self.model_name, route).inc()
        for kind, refused in questions:
            self._child(self.decision_questions, self.model_name, route, kind,
                        "refused" if refused else "answered").inc()

    def exposition(self) -> bytes:
        return generate_latest(self._scrape)
