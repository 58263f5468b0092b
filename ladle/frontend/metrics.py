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
            n = len(state.children) if state.num_returned is None else state.num_returned
            self.requests.append((len(state.prompt_token_ids), n))  # best_of: n, not candidates


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
    """Prometheus metrics of one server; its own registry, so several can live in a process.
    Every series carries an `engine` label (as vLLM's do): the engine gauges and counters are
    each engine's own, and a request's latencies and token counts go to the engine that served
    it (the one whose outputs carried its tokens)."""

    def __init__(self, model_name: str, max_model_len: int = 131072, num_engines: int = 1):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        names = ["model_name", "engine"]
        tokens = _buckets_1_2_5(max_model_len)
        success = Counter("ladle:request_success", "Finished requests (choices), by finish "
                          "reason.", [*names, "finished_reason"], registry=self.registry)
        counters = {key: Counter(name, doc, names, registry=self.registry) for key, name, doc in (
            ("prompt_tokens", "ladle:prompt_tokens", "Prefilled prompt tokens."),
            ("generation_tokens", "ladle:generation_tokens", "Generated tokens."),
        )}
        histograms = {key: Histogram(name, doc, names, buckets=buckets, registry=self.registry)
                      for key, name, doc, buckets in (
            ("ttft", "ladle:time_to_first_token_seconds", "Arrival to first output token.",
             _TTFT_BUCKETS),
            ("itl", "ladle:inter_token_latency_seconds",
             "Time between two output tokens of a choice.", _ITL_BUCKETS),
            ("e2e", "ladle:e2e_request_latency_seconds", "Arrival to the last output token.",
             _E2E_BUCKETS),
            *((kind, name, doc, _PHASE_BUCKETS) for kind, (name, doc) in _PHASES.items()),
            ("prompt_len", "ladle:request_prompt_tokens", "Prompt tokens of a finished request.",
             tokens),
            ("generation_len", "ladle:request_generation_tokens",
             "Generated tokens of a finished choice.", tokens),
            ("max_tokens", "ladle:request_params_max_tokens", "max_tokens of a finished choice.",
             tokens),
            ("n", "ladle:request_params_n", "n of a finished request.", (1, 2, 5, 10, 20)),
        )}
        self.engines = [_EngineSeries(model_name, str(i), success, counters, histograms)
                        for i in range(num_engines)]
        # Before any engine: a request whose client left mid-body is an abort of no choice.
        self.body_disconnects = Counter(
            "ladle:request_body_disconnects", "Requests whose client disconnected before "
            "sending the whole body (aborted before reaching an engine).", ["model_name"],
            registry=self.registry).labels(model_name=model_name)
        # Each engine's last EngineCore.stats() (gauges and counters since start).
        self.engine_stats: list[dict] = [{} for _ in range(num_engines)]
        # Each engine's weight bytes by storage type, from its ready message (fixed after start).
        self.weight_bytes: list[dict[str, int]] = [{} for _ in range(num_engines)]
        self.num_generation_tokens = 0  # since start, all engines, for the periodic log line
        self.registry.register(_EngineStatsCollector(self))

    def set_engine_stats(self, engine: int, stats: dict) -> None:
        # Phase times come once (the engine drains them into each stats message): observe them.
        series = self.engines[engine]
        for kind, values in (stats.get("latencies") or {}).items():
            for v in values:
                series.histograms[kind].observe(v)
        self.engine_stats[engine] = stats

    def record(self, stats: IterationStats, engine: int = 0) -> None:
        """One batch of outputs from `engine`."""
        series = self.engines[engine]
        h = series.histograms
        if stats.num_prompt_tokens:
            series.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            series.generation_tokens.inc(stats.num_generation_tokens)
            self.num_generation_tokens += stats.num_generation_tokens
        for t in stats.ttfts:
            h["ttft"].observe(t)
        for t in stats.itls:
            h["itl"].observe(t)
        for reason, e2e in stats.finished:
            series.success[reason].inc()
            h["e2e"].observe(e2e)
        for num_generated, max_tokens in stats.lengths:
            h["generation_len"].observe(num_generated)
            if max_tokens is not None:
                h["max_tokens"].observe(max_tokens)
        for num_prompt, n in stats.requests:
            h["prompt_len"].observe(num_prompt)
            h["n"].observe(n)

    def record_aborted(self, num_choices: int, engine: int = 0) -> None:
        """Requests the client left (disconnects): counted, not timed."""
        self.engines[engine].success["abort"].inc(num_choices)

    def record_body_disconnect(self) -> None:
        """A client that left before its request's body ended."""
        self.body_disconnects.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineSeries:
    """The API-side series of one engine (its label values bound once)."""

    def __init__(self, model_name: str, engine: str, success: Counter,
                 counters: dict[str, Counter], histograms: dict[str, Histogram]):
        labels = {"model_name": model_name, "engine": engine}
        # every finish reason's series exists from the start
        self.success = {reason: success.labels(finished_reason=reason, **labels)
                        for reason in ("stop", "length", "abort", "error")}
        self.prompt_tokens = counters["prompt_tokens"].labels(**labels)
        self.generation_tokens = counters["generation_tokens"].labels(**labels)
        self.histograms = {key: h.labels(**labels) for key, h in histograms.items()}


_G, _C = GaugeMetricFamily, CounterMetricFamily
# The engines' own series: (name, doc, key in EngineCore.stats(), family).
_ENGINE_SERIES = (
    ("ladle:num_requests_running", "Requests in the running batch.", "num_running", _G),
    ("ladle:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting", _G),
    ("ladle:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (1 = full).",
     "kv_cache_usage", _G),
    ("ladle:num_used_kv_blocks", "KV-cache blocks held by requests.", "num_used_blocks", _G),
    ("ladle:num_kv_blocks", "KV-cache blocks in total.", "num_blocks", _G),
    ("ladle:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries", _C),
    ("ladle:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits",
     _C),
    ("ladle:num_preemptions", "Requests preempted (KV blocks freed, recomputed later).",
     "num_preemptions", _C),
    ("ladle:prefill_tokens", "Prompt tokens computed by the engine (prefix-cache hits not "
     "counted; recomputes after preemption counted again; a beam search's prompt once).",
     "prefill_tokens", _C),
    ("ladle:grammar_compiles", "Structured-output grammars compiled.", "grammar_compiles", _C),
    ("ladle:grammar_cache_hits", "Structured-output requests that reused a compiled grammar.",
     "grammar_cache_hits", _C),
    ("ladle:grammar_compile_seconds", "Time spent compiling grammars.",
     "grammar_compile_seconds", _C),
    ("ladle:grammar_bitmask_seconds", "Time spent filling grammar bitmasks.",
     "grammar_bitmask_seconds", _C),
    ("ladle:engine_failed_runs", "Batches whose run raised (then re-run in halves to find the "
     "request at fault).", "failed_runs", _C),
    ("ladle:engine_failed_requests", "Requests ended by an exception only they caused.",
     "failed_requests", _C),
    # Structured-output compiles: cache behaviour, timeouts, compiles nobody waits for.
    ("ladle:grammar_cache_misses", "Structured-output requests that started a compile.",
     "grammar_cache_misses", _C),
    ("ladle:grammar_cache_evictions", "Compiled grammars evicted from the cache to keep it "
     "within --structured-outputs-cache-bytes.", "grammar_cache_evictions", _C),
    ("ladle:grammar_compile_timeouts", "Requests failed because their grammar did not compile "
     "within --structured-outputs-compile-timeout.", "grammar_compile_timeouts", _C),
    ("ladle:grammar_cache_bytes", "Bytes of compiled grammars in the cache.",
     "grammar_cache_bytes", _G),
    ("ladle:grammar_compiles_abandoned", "Compiles still running that no request waits for "
     "(timed out or aborted); they hold no worker slot.", "grammar_compiles_abandoned", _G),
    # Prefill/decode disaggregation (0 without --kv-transfer-config).
    ("ladle:kv_transfer_loaded_tokens", "Prompt tokens whose KV a decode server loaded from a "
     "prefill server instead of computing.", "kv_loaded_tokens", _C),
    ("ladle:kv_transfer_saved_tokens", "Prompt tokens whose KV a prefill server handed over.",
     "kv_saved_tokens", _C),
    ("ladle:kv_transfer_expired", "Handed-over KV that no decode server read within the "
     "connector's timeout (deleted).", "kv_transfers_expired", _C),
)
# vLLM's spec_decode series (with ladle's prefix), when the engine speculates.
_SPEC_SERIES = (
    ("ladle:spec_decode_num_drafts", "Request steps that carried speculative drafts.",
     "spec_decode_num_drafts"),
    ("ladle:spec_decode_num_draft_tokens", "Draft tokens proposed.",
     "spec_decode_num_draft_tokens"),
    ("ladle:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     "spec_decode_num_accepted_tokens"),
)


class _EngineStatsCollector:
    """Exposes each engine process's last EngineCore.stats() at scrape time, one sample per
    engine."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        model = self.metrics.model_name
        engines = [([model, str(i)], s) for i, s in enumerate(self.metrics.engine_stats)]
        labels = ["model_name", "engine"]
        for name, doc, key, family in _ENGINE_SERIES:
            m = family(name, doc, labels=labels)
            for lv, s in engines:
                m.add_metric(lv, float(s.get(key, 0)))
            yield m
        speculating = [(lv, s) for lv, s in engines if "spec_decode_num_drafts" in s]
        if speculating:
            for name, doc, key in _SPEC_SERIES:
                c = CounterMetricFamily(name, doc, labels=labels)
                for lv, s in speculating:
                    c.add_metric(lv, float(s.get(key, 0)))
                yield c
            c = CounterMetricFamily("ladle:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each draft position (0 = first).",
                                    labels=[*labels, "position"])
            for lv, s in speculating:
                for pos, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", [])):
                    c.add_metric([*lv, str(pos)], float(n))
            yield c
        g = GaugeMetricFamily("ladle:model_weight_bytes",
                              "Bytes of the model's weights in the engine (rank 0's shard "
                              "under tensor parallelism), by storage type.",
                              labels=[*labels, "dtype"])
        for (lv, _), by_dtype in zip(engines, self.metrics.weight_bytes, strict=True):
            for dtype, n in sorted(by_dtype.items()):
                g.add_metric([*lv, dtype], float(n))
        yield g
        g = GaugeMetricFamily("ladle:prefix_cache_hit_rate",
                              "Prefix-cache hits / queries since start, in tokens.",
                              labels=labels)
        for lv, s in engines:
            queries = s.get("prefix_cache_queries", 0)
            g.add_metric(lv, s.get("prefix_cache_hits", 0) / queries if queries else 0.0)
        yield g
