"""/metrics carries vLLM's series under the ladle: prefix, and each moves by what the requests
did: a real server with a KV cache small enough that two long requests preempt one another."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_server import API_KEY, RemoteServer

from ladle.models.demo import ensure_demo_model
from ladle.tokenizer import load_tokenizer

SERIES = [
    "ladle:num_requests_running", "ladle:num_requests_waiting", "ladle:kv_cache_usage_perc",
    "ladle:prefix_cache_queries_total", "ladle:prefix_cache_hits_total",
    "ladle:num_preemptions_total", "ladle:prompt_tokens_total", "ladle:generation_tokens_total",
    "ladle:request_success_total", "ladle:time_to_first_token_seconds_count",
    "ladle:inter_token_latency_seconds_count", "ladle:e2e_request_latency_seconds_count",
    "ladle:request_queue_time_seconds_count", "ladle:request_prefill_time_seconds_count",
    "ladle:request_decode_time_seconds_count", "ladle:request_inference_time_seconds_count",
    "ladle:request_prompt_tokens_count", "ladle:request_generation_tokens_count",
    "ladle:request_params_n_count", "ladle:request_params_max_tokens_count",
]


@pytest.fixture(scope="module")
def server():
    # 8 blocks of 16 tokens: one 125-token request fills the cache, so two preempt. The
    # context length is vLLM's "auto": what the cache holds (128 tokens).
    s = RemoteServer("--api-key", API_KEY, "--num-gpu-blocks-override", "8", "--max-model-len",
                     "auto", "--disable-log-stats")
    yield s
    assert s.stop() == 0, s.log()


def scrape(server) -> dict[str, float]:
    """name{labels} -> value, with model_name and engine (one engine here) dropped and the rest
    of the labels kept."""
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"([^{\s#]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if m:
            labels = ",".join(x for x in (m.group(2) or "").split(",")
                              if x and not x.startswith(("model_name", 'engine="0"')))
            out[m.group(1) + (f"{{{labels}}}" if labels else "")] = float(m.group(3))
    return out


def delta(before, after, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_max_model_len_auto_is_what_the_cache_holds(server):
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert models.json()["data"][0]["max_model_len"] == 8 * 16


def test_every_series_is_exposed(server):
    names = {k.split("{")[0] for k in scrape(server)}
    missing = [s for s in SERIES if s not in names]
    assert not missing, missing


def test_counters_move_by_what_the_requests_did(server):
    client = server.client(timeout=120)
    tokenizer = load_tokenizer(ensure_demo_model())
    prompt = " ".join(f"word{i}" for i in range(20))
    num_prompt = len(tokenizer.encode(prompt))
    before = scrape(server)
    first = client.completions.create(model="ladle-demo", prompt=prompt, max_tokens=5,
                                      extra_body={"ignore_eos": True})
    again = client.completions.create(model="ladle-demo", prompt=prompt, max_tokens=7, n=2,
                                      seed=1, extra_body={"ignore_eos": True})
    after = scrape(server)
    assert first.usage.prompt_tokens == num_prompt
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * (num_prompt // 16 - 1) > 0  # the second request hit the cache
    # Two requests, three choices (the n=2 children each look the prompt up).
    assert delta(before, after, "ladle:prefix_cache_queries_total") == 3 * num_prompt
    assert delta(before, after, "ladle:prefix_cache_hits_total") >= cached
    assert delta(before, after, "ladle:prompt_tokens_total") == 3 * num_prompt
    assert delta(before, after, "ladle:generation_tokens_total") == 5 + 2 * 7
    assert delta(before, after, 'ladle:request_success_total{finished_reason="length"}') == 3
    for name, count in (("time_to_first_token_seconds", 2), ("e2e_request_latency_seconds", 3),
                        ("inter_token_latency_seconds", 4 + 2 * 6),
                        ("request_queue_time_seconds", 3), ("request_prefill_time_seconds", 3),
                        ("request_decode_time_seconds", 3),
                        ("request_inference_time_seconds", 3),
                        ("request_generation_tokens", 3), ("request_params_max_tokens", 3),
                        ("request_prompt_tokens", 2), ("request_params_n", 2)):
        assert delta(before, after, f"ladle:{name}_count") == count, name
    assert delta(before, after, "ladle:request_generation_tokens_sum") == 5 + 2 * 7
    assert delta(before, after, "ladle:request_params_max_tokens_sum") == 5 + 2 * 7
    assert delta(before, after, "ladle:request_prompt_tokens_sum") == 2 * num_prompt
    assert delta(before, after, "ladle:request_params_n_sum") == 1 + 2
    assert delta(before, after, "ladle:num_preemptions_total") == 0


def test_a_full_cache_preempts_and_counts_it(server):
    client = server.client(timeout=120)
    before = scrape(server)

    def run(i):  # 50-token prompts growing to 125 tokens: both cannot fit in 8 blocks
        prompt = [1000 + 7 * i + j for j in range(50)]
        return client.completions.create(model="ladle-demo", prompt=prompt, max_tokens=75,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(run, range(2)))
    after = scrape(server)
    assert all(r.usage.completion_tokens == 75 for r in replies)
    assert delta(before, after, "ladle:num_preemptions_total") >= 1
    assert delta(before, after, "ladle:generation_tokens_total") == 150
    assert delta(before, after, 'ladle:request_success_total{finished_reason="length"}') == 2
    # A preempted request is queued, prefilled and decoded once, as vLLM counts it.
    assert delta(before, after, "ladle:request_queue_time_seconds_count") == 2
    server.wait_idle()
    assert scrape(server)["ladle:kv_cache_usage_perc"] == 0


def test_the_example_dashboard_charts_only_series_ladle_exposes(server):
    dashboard = json.loads((Path(__file__).parents[1] / "examples" /
                            "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", n)
            for e in exprs for n in re.findall(r"ladle:[a-z0-9_]+", e)}
    exposed = {re.sub(r"_(bucket|sum|count)$", "", k.split("{")[0]) for k in scrape(server)}
    assert used <= exposed, used - exposed
    assert {re.sub(r"_count$", "", s) for s in SERIES} <= used  # every series is charted
