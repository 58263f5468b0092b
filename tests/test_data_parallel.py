"""--data-parallel-size: one API process in front of two engine-core processes. A real
`ladle serve -dp 2` (started once for the module) driven with the openai client: requests spread
over both engines (seen in each engine's own /metrics series), seeded outputs equal one engine's
(the offline LLM's) whichever engine serves them, a disconnect frees KV blocks on the engine that
held them, and killing one engine ends the server. The router and the per-engine environment are
also tested alone."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest
from test_server import API_KEY, MODEL, RemoteServer, is_alive
from test_server_engine_death import kill_engine_while_serving

from ladle.config import EngineConfig
from ladle.frontend.engine_client import EngineClient, EngineDeadError, EngineRouter, engine_envs

MAX_MODEL_LEN = 2048
SERVER_ARGS = ("--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
               "--num-kv-blocks", "512", "--generation-config", "vllm", "--disable-access-log",
               "--disable-log-stats")
PROMPTS = [[100 + 37 * i + j for j in range(5 + i)] for i in range(4)]


@pytest.fixture(scope="module")
def server():
    # Room for exactly 32 requests in flight, if admission counts both engines' running slots.
    s = RemoteServer(*SERVER_ARGS, "--data-parallel-size", "2", "--max-num-seqs", "16",
                     "--max-waiting-requests", "0")
    pids = s.engine_pids()
    assert len(pids) == 2
    yield s
    assert s.stop() == 0, s.log()  # SIGTERM: a clean exit that stops both engines
    assert not any(is_alive(p) for p in pids), "an engine outlived the server"


def scrape(server) -> dict[tuple[str, str], float]:
    """(series, engine) -> value from /metrics; finished_reason kept in the series name."""
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"([^{\s#]+)\{([^}]*)\}\s+(\S+)$", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        name = m.group(1) + (f'{{finished_reason="{labels["finished_reason"]}"}}'
                             if "finished_reason" in labels else "")
        if "engine" in labels:
            out[name, labels["engine"]] = float(m.group(3))
    return out


def per_engine_delta(before, after, name) -> list[float]:
    return [after.get((name, e), 0.0) - before.get((name, e), 0.0) for e in ("0", "1")]


# The engine's own count of requests it scheduled (its queue-time observations) and the tokens
# its outputs carried: neither is the router's bookkeeping.
SCHEDULED = "ladle:request_queue_time_seconds_count"
GENERATED = "ladle:generation_tokens_total"
DONE = 'ladle:request_success_total{finished_reason="length"}'


def completion(client, prompt, seed, max_tokens=16):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0.8, seed=seed,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].token_ids, r.choices[0].text


@pytest.fixture(scope="module")
def reference():
    """One engine's (the offline LLM's) seeded outputs for PROMPTS: same checkpoint and dtype."""
    from ladle import LLM, SamplingParams

    llm = LLM(MODEL, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=16,
                                        ignore_eos=True) for i in range(len(PROMPTS))])
    return [o.outputs[0].token_ids for o in outs]


def test_metrics_show_both_engines(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for series in ("ladle:num_requests_running", "ladle:num_used_kv_blocks",
                   "ladle:num_kv_blocks", "ladle:generation_tokens_total"):
        for engine in ("0", "1"):
            assert re.search(rf'^{series}\{{[^}}]*engine="{engine}"', text, re.M), (series,
                                                                                    engine)
    m = scrape(server)
    assert m["ladle:num_kv_blocks", "0"] == m["ladle:num_kv_blocks", "1"] == 512


def test_concurrent_requests_spread_over_both_engines(server, reference):
    before = scrape(server)

    async def run():
        client = server.async_client(timeout=300)
        calls = [client.completions.create(
            model=MODEL, prompt=PROMPTS[i % 4], max_tokens=16, temperature=0.8,
            seed=100 + i % 4, extra_body={"ignore_eos": True, "return_token_ids": True})
            for i in range(32)]
        return await asyncio.gather(*calls)

    replies = asyncio.run(run())  # none is a 503: 2 x --max-num-seqs 16 run at once
    after = scrape(server)
    scheduled = per_engine_delta(before, after, SCHEDULED)
    assert sum(scheduled) == 32 and min(scheduled) >= 8, scheduled
    assert per_engine_delta(before, after, DONE) == scheduled
    assert per_engine_delta(before, after, GENERATED) == [16 * n for n in scheduled]
    # Seeded: whichever engine served it, each reply is the offline LLM's (one engine's) tokens.
    for i, r in enumerate(replies):
        assert r.choices[0].token_ids == reference[i % 4], i


def test_same_request_on_both_engines_gives_same_text(server, reference):
    client = server.client(timeout=120)
    served_by, texts = [], set()
    for _ in range(4):  # sequential: the idle engines take turns
        before = scrape(server)
        token_ids, text = completion(client, PROMPTS[1], seed=101)
        after = scrape(server)
        served_by.append(per_engine_delta(before, after, SCHEDULED).index(1.0))
        texts.add(text)
        assert token_ids == reference[1]
    assert set(served_by) == {0, 1}, served_by
    assert len(texts) == 1


def test_disconnect_aborts_on_the_owning_engine(server):
    client = server.client(timeout=120)
    num_streams = 4
    streaming = threading.Barrier(num_streams + 1, timeout=120)
    closing = threading.Event()
    errors = []

    def stream(i):
        try:
            s = client.completions.create(model=MODEL, prompt=PROMPTS[i], stream=True,
                                          max_tokens=MAX_MODEL_LEN - 64,
                                          extra_body={"ignore_eos": True})
            next(iter(s))  # the first chunk: the request runs on its engine
            streaming.wait()
            closing.wait(120)
            s.close()  # the client goes away mid-stream
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            streaming.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    try:
        streaming.wait()
        m = scrape(server)
        running = [m["ladle:num_requests_running", e] for e in ("0", "1")]
        assert running == [2, 2], running  # streams on both engines
        before = m
    finally:
        closing.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    deadline = time.monotonic() + 20
    while True:
        m = scrape(server)
        used = [m["ladle:num_used_kv_blocks", e] for e in ("0", "1")]
        running = [m["ladle:num_requests_running", e] for e in ("0", "1")]
        if used == [0, 0] and running == [0, 0]:
            break
        assert time.monotonic() < deadline, f"KV blocks {used}, running {running} 20 s after " \
                                            "the disconnects"
        time.sleep(0.1)
    assert per_engine_delta(before, m, 'ladle:request_success_total{finished_reason="abort"}') \
        == [2, 2]
    # Ended well before max_tokens: the aborts reached the engines that ran the streams.
    assert sum(per_engine_delta(before, m, GENERATED)) < num_streams * (MAX_MODEL_LEN - 64) / 2


def test_killing_one_engine_ends_the_server():
    server = RemoteServer(*SERVER_ARGS, "-dp", "2")
    pids = server.engine_pids()
    assert len(pids) == 2
    kill_engine_while_serving(server, lambda: pids[1])
    deadline = time.monotonic() + 10  # the surviving engine was stopped too: no orphan
    while is_alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(pids[0]), "engine 0 outlived the server"


def test_failed_engine_start_is_an_error_naming_the_engine(tmp_path):
    config = EngineConfig(model=str(tmp_path / "missing"), data_parallel_size=2)

    async def start():
        client = EngineClient(config)
        try:
            with pytest.raises(EngineDeadError, match=r"engine [01] \(pid \d+\)"):
                await client.start()
        finally:
            await client.shutdown()
        return client

    client = asyncio.run(start())
    assert len(client.pids) == 2 and not any(is_alive(p) for p in client.pids)


# ---- the parts alone ------------------------------------------------------------------------
def test_router_least_loaded_keeps_children_together_and_releases_once():
    r = EngineRouter(2)
    assert r.place(["a"]) == 0 and r.place(["b-0", "b-1", "b-2"]) == 1  # n=3: one engine
    assert r.place(["c"]) == 0 and r.place(["d"]) == 0  # 2 vs 3 in flight
    assert r.num_in_flight == [3, 3]
    for req_id in ("b-0", "b-1", "b-2"):
        assert r.release(req_id) == 1
    assert r.release("b-0") is None  # an abort that crossed the finish
    assert r.num_in_flight == [3, 0] and r.place(["e"]) == 1
    idle = EngineRouter(2)  # ties rotate: sequential requests alternate
    seq = []
    for i in range(4):
        seq.append(idle.place([str(i)]))
        idle.release(str(i))
    assert seq == [0, 1, 0, 1]


def test_engine_envs_split_threads_and_devices(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_envs(EngineConfig(device="cpu"), 8, 0) == [{}]  # one engine: as before
    assert engine_envs(EngineConfig(device="cpu", data_parallel_size=2), 2, 0) == [
        {"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "1"}]
    assert engine_envs(EngineConfig(device="cpu", data_parallel_size=3), 2, 0)[2] == {
        "OMP_NUM_THREADS": "1"}
    gpus = engine_envs(EngineConfig(data_parallel_size=2), 16, 4)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpus] == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
    assert engine_envs(EngineConfig(device="cuda", data_parallel_size=2), 16, 2) == [
        {"CUDA_VISIBLE_DEVICES": "5"}, {"CUDA_VISIBLE_DEVICES": "7"}]
    with pytest.raises(ValueError, match="--data-parallel-size 2: needs a CUDA device per "):
        engine_envs(EngineConfig(device="cuda", data_parallel_size=2), 16, 1)
    with pytest.raises(ValueError, match="--device cuda:1"):
        engine_envs(EngineConfig(device="cuda:1", data_parallel_size=2), 16, 2)


def test_bad_sizes_are_errors_naming_the_parameter():
    from ladle import LLM
    from ladle.entrypoints.cli import parse_serve_args

    with pytest.raises(ValueError, match="data_parallel_size: must be >= 1"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size: 2; the offline LLM runs one"):
        LLM(MODEL, data_parallel_size=2)
    with pytest.raises(SystemExit):
        parse_serve_args(["-dp", "0"])
    assert parse_serve_args(["-dp", "3"]).data_parallel_size == 3
