"""Prefill/decode disaggregation on one machine: a prefill server (P), a decode server (D) and
`ladle proxy` in front, over SharedStorageConnector and NixlConnector (when NIXL is installed), against one plain
server (the reference),
all with --batch-invariant so that a token computed as D's single-token step and as part of the
reference's prefill chunk is the same number.

- Through the proxy: greedy, seeded, penalties, min_tokens, stop strings, logprobs,
  json_schema, streaming and a required tool call give the reference's output exactly.
- D computes at most one prompt token per request (ladle:prefill_tokens), the rest comes from
  P (ladle:kv_transfer_loaded_tokens); with D's prefix cache holding the start of a prompt,
  only the rest moves. A prompt shorter than one block and a partial last block work.
- P frees its blocks after every hand-over (NIXL: after D's read), hands nothing over for an
  aborted request, and drops a hand-over that no D reads within its timeout."""

from __future__ import annotations

import atexit
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_server import API_KEY, MODEL, RemoteServer

COMMON = ("--api-key", API_KEY, "--max-model-len", "1024", "--batch-invariant",
          "--disable-access-log")


def kv_config(connector: str, role: str, path: str, timeout_s: float = 120) -> str:
    extra = {"timeout_s": timeout_s}
    if connector == "SharedStorageConnector":
        extra["shared_storage_path"] = path
    return json.dumps({"kv_connector": connector, "kv_role": role,
                       "kv_connector_extra_config": extra})


class Proxy:
    def __init__(self, prefill: str, decode: str):
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="ladle-proxy-", delete=False)
        atexit.register(Path(self.log_file.name).unlink, missing_ok=True)  # at the session's end
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ladle.entrypoints.cli", "proxy", "--port", "0",
             "--prefill", prefill, "--decode", decode],
            stdout=self.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (m := re.search(r" on http://[^ ]+:(\d+)", self.log())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"proxy did not start:\n{self.log()}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{m.group(1)}"
        # The port listens from the log line on, so the first request waits, never refused.
        assert httpx.get(self.url + "/proxy/stats", timeout=30).status_code == 200

    def log(self) -> str:
        return open(self.log_file.name).read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def reference():
    server = RemoteServer(*COMMON)
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["SharedStorageConnector", "NixlConnector"])
def cluster(request, reference, tmp_path_factory):
    connector = request.param
    if connector == "NixlConnector":
        from ladle.distributed.kv_transfer import _nixl_api

        if _nixl_api() is None:
            pytest.skip("NIXL is not installed (pip install --no-deps nixl-cu12)")
    storage = str(tmp_path_factory.mktemp("kv"))
    servers = []
    try:
        prefill = RemoteServer(*COMMON, "--kv-transfer-config",
                               kv_config(connector, "kv_producer", storage, timeout_s=3))
        servers.append(prefill)
        decode = RemoteServer(*COMMON, "--kv-transfer-config",
                              kv_config(connector, "kv_consumer", storage))
        servers.append(decode)
        proxy = Proxy(prefill.url, decode.url)
        servers.append(proxy)
        yield {"ref": reference, "prefill": prefill, "decode": decode, "proxy": proxy,
               "storage": storage, "connector": connector}
    finally:
        for s in reversed(servers):
            s.stop()


def wait_for(server, name: str, value: float, timeout: float = 10) -> float:
    """The metric once it equals `value` (P frees held blocks within its idle poll, 1 s)."""
    deadline = time.monotonic() + timeout
    while (got := metric(server, name)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


def metric(server, name: str) -> float:
    """A series' value on /metrics (a counter's is NAME_total)."""
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] in (name, name + "_total"))


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                            "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
LONG = "The history of the city goes back many centuries, and its people " * 6

COMPLETIONS = [
    dict(prompt="Once upon a time", max_tokens=24, temperature=0, logprobs=3),
    dict(prompt="The capital of France is", max_tokens=24, temperature=0.9, seed=7,
         presence_penalty=0.5, frequency_penalty=0.3, extra_body={"repetition_penalty": 1.2}),
    dict(prompt="Numbers: 1, 2, 3,", max_tokens=20, temperature=0.7, seed=11,
         logit_bias={"15": 5.0}, extra_body={"min_tokens": 12}),
    dict(prompt="Hi", max_tokens=16, temperature=0.8, seed=3),  # shorter than one block
    dict(prompt=LONG, max_tokens=16, temperature=0, stop=["\n", " the "]),  # partial last block
]


def completion(c: openai.OpenAI, kw: dict):
    out = c.completions.create(model=MODEL, **kw).choices[0]
    return out.text, out.finish_reason, out.logprobs and out.logprobs.top_logprobs


@pytest.mark.parametrize("case", range(len(COMPLETIONS)))
def test_completions_through_the_proxy_equal_one_server(cluster, case):
    kw = COMPLETIONS[case]
    prefill_before = metric(cluster["decode"], "ladle:prefill_tokens")
    loaded_before = metric(cluster["decode"], "ladle:kv_transfer_loaded_tokens")
    ours = completion(client(cluster["proxy"].url), kw)
    theirs = completion(client(cluster["ref"].url), kw)
    assert ours[:2] == theirs[:2]
    if ours[2] is not None:
        for a, b in zip(ours[2], theirs[2], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) <= 1e-5 for t in a)
    computed = metric(cluster["decode"], "ladle:prefill_tokens") - prefill_before
    loaded = metric(cluster["decode"], "ladle:kv_transfer_loaded_tokens") - loaded_before
    assert computed <= 1, computed  # D computed the last prompt token at most
    if kw["prompt"] != "Hi":
        assert loaded > 0
    assert not list_handovers(cluster)  # D consumed the hand-over
    # P freed its blocks (NIXL: once D's read notified it)
    assert wait_for(cluster["prefill"], "ladle:num_used_kv_blocks", 0) == 0


def list_handovers(cluster) -> list[str]:
    """SharedStorageConnector's files not read yet."""
    import os

    return [n for n in os.listdir(cluster["storage"]) if n.endswith(".safetensors")]


def test_chat_json_schema_streaming_and_tool_call(cluster):
    messages = [{"role": "user", "content": "Give me a person as JSON."}]
    for kw in (dict(response_format={"type": "json_schema", "json_schema": {
                    "name": "person", "schema": SCHEMA}}, temperature=0.8, seed=5),
               dict(tools=TOOLS, tool_choice="required", temperature=0.7, seed=2)):
        ours = client(cluster["proxy"].url).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, **kw).choices[0].message
        theirs = client(cluster["ref"].url).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, **kw).choices[0].message
        assert ours.content == theirs.content
        assert [(t.function.name, t.function.arguments) for t in ours.tool_calls or []] == \
            [(t.function.name, t.function.arguments) for t in theirs.tool_calls or []]
        if "tools" in kw:
            assert json.loads(ours.tool_calls[0].function.arguments)["city"]
        else:
            assert set(json.loads(ours.content)) >= {"name", "age"}

    def streamed(url):
        stream = client(url).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=32, temperature=0.9, seed=9, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    assert streamed(cluster["proxy"].url) == streamed(cluster["ref"].url)


def test_a_prefix_cached_on_decode_moves_only_the_rest(cluster):
    """The same long prompt twice with another ending: the second time D's prefix cache holds
    the shared blocks, and only the tokens after them are loaded."""
    c = client(cluster["proxy"].url)
    base = LONG * 2
    c.completions.create(model=MODEL, prompt=base + "First.", max_tokens=4, temperature=0)
    loaded_before = metric(cluster["decode"], "ladle:kv_transfer_loaded_tokens")
    hits_before = metric(cluster["decode"], "ladle:prefix_cache_hits")
    kw = dict(prompt=base + "Second, different.", max_tokens=12, temperature=0)
    ours = completion(c, kw)
    loaded = metric(cluster["decode"], "ladle:kv_transfer_loaded_tokens") - loaded_before
    hits = metric(cluster["decode"], "ladle:prefix_cache_hits") - hits_before
    num_prompt = len(httpx.post(cluster["ref"].url + "/tokenize", json={
        "model": MODEL, "prompt": kw["prompt"]},
        headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"])
    assert hits >= 16 and 0 < loaded and hits + loaded == num_prompt - 1
    assert ours[:2] == completion(client(cluster["ref"].url), kw)[:2]


def test_prefill_frees_on_abort_and_expires_unread_handovers(cluster):
    prefill = cluster["prefill"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    saved_before = metric(prefill, "ladle:kv_transfer_saved_tokens")
    # Aborted: a client that leaves a stream with do_remote_decode gets nothing handed over.
    with httpx.stream("POST", prefill.url + "/v1/completions", headers=headers, json={
            "model": MODEL, "prompt": LONG, "max_tokens": 200, "stream": True,
            "ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}},
            timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 10
    while metric(prefill, "ladle:num_used_kv_blocks") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(prefill, "ladle:num_used_kv_blocks") == 0
    assert metric(prefill, "ladle:kv_transfer_saved_tokens") == saved_before
    assert not list_handovers(cluster)
    # Unread: a hand-over with no decode request after it is dropped after P's timeout (3 s):
    # NIXL: P holds its blocks until then; shared storage: P's next hand-over deletes the file.
    body = {"model": MODEL, "prompt": "Unread", "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(prefill.url + "/v1/completions", headers=headers, json=body,
                        timeout=60).json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and re.fullmatch(r"[0-9a-f]{32}", params["transfer_id"])
    if cluster["connector"] == "NixlConnector":
        assert params["remote_block_ids"] and params["remote_port"] > 0
        assert metric(prefill, "ladle:num_used_kv_blocks") > 0  # held for the read
        assert wait_for(prefill, "ladle:num_used_kv_blocks", 0) == 0
        assert metric(prefill, "ladle:kv_transfer_expired") >= 1
        return
    assert list_handovers(cluster) == [params["transfer_id"] + ".safetensors"]
    time.sleep(3.5)
    httpx.post(prefill.url + "/v1/completions", headers=headers,
               json={**body, "prompt": "Another"}, timeout=60)
    assert params["transfer_id"] + ".safetensors" not in list_handovers(cluster)
    assert metric(prefill, "ladle:kv_transfer_expired") >= 1
    for name in list_handovers(cluster):  # the last one, for the tests after this
        (Path(cluster["storage"]) / name).unlink()


@pytest.mark.parametrize("params,message", [
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode: must be a bool"),
    ({"transfer_id": "../../etc/passwd"}, "kv_transfer_params.transfer_id: must be 32"),
    ({"remote_rank": 0}, "kv_transfer_params.remote_rank: unknown"),
    ({"remote_block_ids": [1, -1]}, "kv_transfer_params.remote_block_ids: at most"),
])
def test_bad_kv_transfer_params_are_400s_naming_the_key(cluster, params, message):
    r = httpx.post(cluster["decode"].url + "/v1/completions",
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                         "kv_transfer_params": params})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    r = httpx.post(cluster["ref"].url + "/v1/completions",
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "no --kv-transfer-config" in r.json()["error"]["message"]


@pytest.mark.parametrize("value,message", [
    ("{bad", "kv_transfer_config: not JSON"),
    ('{"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}',
     "kv_connector: 'P2pNcclConnector'; accepted: SharedStorageConnector, NixlConnector"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}',
     "shared_storage_path: required"),
    ('{"kv_connector": "NixlConnector", "kv_role": "sender"}', "kv_role: 'sender'; accepted"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"timeout_s": -1}}', "timeout_s: must be a positive number"),
])
def test_bad_kv_transfer_config_is_a_usage_error(capsys, value, message):
    from ladle.entrypoints.cli import parse_serve_args

    with pytest.raises(SystemExit) as e:
        parse_serve_args(["--kv-transfer-config", value])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
