"""Serving metrics: per-step stats gathered by the output loop (IterationStats) and their
Prometheus form (ServerMetrics), with the engine's gauges as the engine process last sent them.
Names follow vLLM's, under the `ladle:` prefix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from ladle.frontend.output_processor import ChildState, RequestState

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


@dataclass
class IterationStats:
    """What one batch of engine outputs did, for metrics. Times are time.monotonic()."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)  # per request: arrival to first token
    itls: list[float] = field(default_factory=list)  # per choice: gap between two tokens
    finished: list[tuple[str, float]] = field(default_factory=list)  # (finish reason, e2e)
    # per finished choice: (generation tokens, max_tokens); per request: (prompt tokens, n)
    lengths: list[tuple[int, int | None]] = field(default_factory=list)
    requests: list[tuple[int, int]] = field(default_factory=list)

    def record_tokens(self, state: RequestState, child: ChildState, num_new: int,
                      now: float) -> None:
        """Called before the tokens are applied, so an empty child means its first tokens."""
        if not child.token_ids:
            self.num_prompt_tokens += len(state.prompt_token_ids)
            if state.first_token_time is None:
                self.ttfts.append(now - state.arrival_time)
        else:
            self.itls.extend([(now - child.last_token_time) / num_new] * num_new)
        self.num_generation_tokens += num_new

    def record_finished(self, state: RequestState, child: ChildState, now: float) -> None:
        self.finished.append((child.finish_reason or "abort", now - state.arrival_time))
        self.lengths.append((len(child.token_ids), child.params.max_tokens))
        if child.index == 0:
            self.requests.append((len(state.prompt_token_ids), len(state.children)))


def _buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# The engine's phase times (EngineCore.stats()["latencies"]) and their series.
_PHASES = {
    "queue": ("ladle:request_queue_time_seconds", "Arrival to first scheduled."),
    "prefill": ("ladle:request_prefill_time_seconds", "First scheduled to first token."),
    "decode": ("ladle:request_decode_time_seconds", "First token to the last one."),
    "inference": ("ladle:request_inference_time_seconds", "First scheduled to finished."),
}


class ServerMetrics:
    """Prometheus metrics of one server; its own registry, so several can live in a process."""

    def __init__(self, model_name: str, max_model_len: int = 131072):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.labels = labels
        names = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*names, *extra], registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(
                **labels)

        self.request_success = counter("ladle:request_success", "Finished requests (choices), "
                                       "by finish reason.", ["finished_reason"])
        for reason in ("stop", "length", "abort", "error"):  # every series exists from the start
            self.request_success.labels(finished_reason=reason, **labels)
        self.prompt_tokens = counter("ladle:prompt_tokens", "Prefilled prompt tokens.").labels(
            **labels)
        self.generation_tokens = counter("ladle:generation_tokens",
                                         "Generated tokens.").labels(**labels)
        self.ttft = histogram("ladle:time_to_first_token_seconds",
                              "Arrival to first output token.", _TTFT_BUCKETS)
        self.itl = histogram("ladle:inter_token_latency_seconds",
                             "Time between two output tokens of a choice.", _ITL_BUCKETS)
        self.e2e = histogram("ladle:e2e_request_latency_seconds",
                             "Arrival to the last output token.", _E2E_BUCKETS)
        self.phases = {k: histogram(name, doc, _PHASE_BUCKETS)
                       for k, (name, doc) in _PHASES.items()}
        tokens = _buckets_1_2_5(max_model_len)
        self.prompt_len = histogram("ladle:request_prompt_tokens",
                                    "Prompt tokens of a finished request.", tokens)
        self.generation_len = histogram("ladle:request_generation_tokens",
                                        "Generated tokens of a finished choice.", tokens)
        self.max_tokens = histogram("ladle:request_params_max_tokens",
                                    "max_tokens of a finished choice.", tokens)
        self.n = histogram("ladle:request_params_n", "n of a finished request.",
                           (1, 2, 5, 10, 20))
        self._engine_stats: dict = {}
        self.num_generation_tokens = 0  # since start, for the periodic log line
        self.registry.register(_EngineStatsCollector(self))

    @property
    def engine_stats(self) -> dict:
        """The engine's last EngineCore.stats() (gauges and counters since start)."""
        return self._engine_stats

    @engine_stats.setter
    def engine_stats(self, stats: dict) -> None:
        # Phase times come once (the engine drains them into each stats message): observe them.
        for kind, values in (stats.get("latencies") or {}).items():
            for v in values:
                self.phases[kind].observe(v)
        self._engine_stats = stats

    def record(self, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
            self.num_generation_tokens += stats.num_generation_tokens
        for t in stats.ttfts:
            self.ttft.observe(t)
        for t in stats.itls:
            self.itl.observe(t)
        for reason, e2e in stats.finished:
            self.request_success.labels(finished_reason=reason, **self.labels).inc()
            self.e2e.observe(e2e)
        for num_generated, max_tokens in stats.lengths:
            self.generation_len.observe(num_generated)
            if max_tokens is not None:
                self.max_tokens.observe(max_tokens)
        for num_prompt, n in stats.requests:
            self.prompt_len.observe(num_prompt)
            self.n.observe(n)

    def record_aborted(self, num_choices: int) -> None:
        """Requests the client left (disconnects): counted, not timed."""
        self.request_success.labels(finished_reason="abort", **self.labels).inc(num_choices)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStatsCollector:
    """Exposes the engine process's last EngineCore.stats() at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.engine_stats
        lv = [self.metrics.labels["model_name"]]
        gauges = (
            ("ladle:num_requests_running", "Requests in the running batch.", "num_running"),
            ("ladle:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            ("ladle:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests "
             "(1 = full).", "kv_cache_usage"),
            ("ladle:num_used_kv_blocks", "KV-cache blocks held by requests.", "num_used_blocks"),
            ("ladle:num_kv_blocks", "KV-cache blocks in total.", "num_blocks"),
        )
        for name, doc, key in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(lv, float(s.get(key, 0)))
            yield g
        queries, hits = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
        for name, doc, value in (
            ("ladle:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries),
            ("ladle:prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits),
            ("ladle:num_preemptions", "Requests preempted (KV blocks freed, recomputed later).",
             s.get("num_preemptions", 0)),
            ("ladle:grammar_compiles", "Structured-output grammars compiled.",
             s.get("grammar_compiles", 0)),
            ("ladle:grammar_cache_hits", "Structured-output requests that reused a compiled "
             "grammar.", s.get("grammar_cache_hits", 0)),
            ("ladle:grammar_compile_seconds", "Time spent compiling grammars.",
             s.get("grammar_compile_seconds", 0.0)),
            ("ladle:grammar_bitmask_seconds", "Time spent filling grammar bitmasks.",
             s.get("grammar_bitmask_seconds", 0.0)),
            ("ladle:engine_failed_runs", "Batches whose run raised (then re-run in halves to "
             "find the request at fault).", s.get("failed_runs", 0)),
            ("ladle:engine_failed_requests", "Requests ended by an exception only they caused.",
             s.get("failed_requests", 0)),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(lv, float(value))
            yield c
        # Structured-output compiles: cache behaviour, timeouts, compiles nobody waits for.
        for name, doc, key, family in (
            ("ladle:grammar_cache_misses", "Structured-output requests that started a compile.",
             "grammar_cache_misses", CounterMetricFamily),
            ("ladle:grammar_cache_evictions", "Compiled grammars evicted from the cache to keep "
             "it within --structured-outputs-cache-bytes.", "grammar_cache_evictions",
             CounterMetricFamily),
            ("ladle:grammar_compile_timeouts", "Requests failed because their grammar did not "
             "compile within --structured-outputs-compile-timeout.", "grammar_compile_timeouts",
             CounterMetricFamily),
            ("ladle:grammar_cache_bytes", "Bytes of compiled grammars in the cache.",
             "grammar_cache_bytes", GaugeMetricFamily),
            ("ladle:grammar_compiles_abandoned", "Compiles still running that no request waits "
             "for (timed out or aborted); they hold no worker slot.",
             "grammar_compiles_abandoned", GaugeMetricFamily),
        ):
            m = family(name, doc, labels=["model_name"])
            m.add_metric(lv, float(s.get(key, 0)))
            yield m
        yield from _spec_decode_metrics(s, lv)
        g = GaugeMetricFamily("ladle:prefix_cache_hit_rate",
                              "Prefix-cache hits / queries since start, in tokens.",
                              labels=["model_name"])
        g.add_metric(lv, hits / queries if queries else 0.0)
        yield g


def _spec_decode_metrics(s: dict, lv: list[str]):
    """vLLM's spec_decode series (with ladle's prefix), when the engine speculates."""
    if "spec_decode_num_drafts" not in s:
        return
    for name, doc, key in (
        ("ladle:spec_decode_num_drafts", "Request steps that carried speculative drafts.",
         "spec_decode_num_drafts"),
        ("ladle:spec_decode_num_draft_tokens", "Draft tokens proposed.",
         "spec_decode_num_draft_tokens"),
        ("ladle:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
         "spec_decode_num_accepted_tokens"),
    ):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric(lv, float(s.get(key, 0)))
        yield c
    c = CounterMetricFamily("ladle:spec_decode_num_accepted_tokens_per_pos",
                            "Draft tokens accepted at each draft position (0 = first).",
                            labels=["model_name", "position"])
    for pos, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", [])):
        c.add_metric([*lv, str(pos)], float(n))
    yield c
