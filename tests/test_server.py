"""The server end to end: a real `ladle serve ladle-demo` process (API process + engine-core
process) on 127.0.0.1, driven with the official openai client and httpx. One server is shared
by the module; it runs with --api-key, so every client here sends the key."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from ladle.models.demo import ensure_demo_model
from ladle.tokenizer import load_tokenizer

MODEL = "ladle-demo"
API_KEY = "test-key"
MAX_MODEL_LEN = 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def child_pids(pid: int, cmdline_part: str | None = None) -> list[int]:
    """Children of `pid` (whose command line contains `cmdline_part`), sorted."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and (
                cmdline_part is None or cmdline_part in cmdline):
            out.append(int(entry.name))
    return sorted(out)


def is_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class RemoteServer:
    """`python -m ladle.entrypoints.cli serve ...` in a subprocess, stopped by PID."""

    def __init__(self, *args: str, timeout: float = 180, model: str | None = MODEL,
                 scheme: str = "http", verify=True):
        # model None: the arguments name it (--model or --config); https: verify is what httpx
        # checks the certificate with.
        self.port = 0  # from the server's "serving ... on" line: --port 0 takes any free port
        self.url = ""  # when it binds, so no other process can take it in between
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="ladle-serve-", suffix=".log",
                                                    delete=False)
        # Kept past stop() for the tests that read it then; gone when the session ends.
        atexit.register(Path(self.log_file.name).unlink, missing_ok=True)
        # LADLE_TEST_SERVE_ARGS (e.g. "-tp 2") runs every server test module against another
        # engine layout: the same matrix, another configuration.
        extra = shlex.split(os.environ.get("LADLE_TEST_SERVE_ARGS", ""))
        # LADLE_TEST_MODEL=moe or mistral: the same matrix against another family, ladle-demo
        # as that family (tests/demo_variants.py), served under ladle-demo's name.
        if model == MODEL and os.environ.get("LADLE_TEST_MODEL"):
            from demo_variants import ensure_demo_variant

            model = ensure_demo_variant(os.environ["LADLE_TEST_MODEL"])
            extra = [*extra, "--served-model-name", MODEL]
        cmd = [sys.executable, "-m", "ladle.entrypoints.cli", "serve",
               *([model] if model else []), "--port", "0", *args, *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if not self.port and (m := re.search(r" on https?://[^ ]+:(\d+)", self.log())):
                self.port = int(m.group(1))
                self.url = f"{scheme}://127.0.0.1:{self.port}"
            try:
                if self.port and httpx.get(self.url + "/health", timeout=1,
                                           verify=verify).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return Path(self.log_file.name).read_text()[-5000:]

    def engine_pid(self) -> int:
        """The engine-core child of the server process."""
        return self.engine_pids()[0]

    def engine_pids(self) -> list[int]:
        """The engine-core children of the server process, by pid."""
        pids = child_pids(self.proc.pid, "ladle.engine.core_proc")
        if not pids:
            raise RuntimeError("no engine-core process found")
        return pids

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0,
                                  **kw)

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: name -> value (labels summed)."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r"([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
            if m:
                key = m.group(1) + ({} if not m.group(2) else _reason(m.group(2)))
                out[key] = out.get(key, 0.0) + float(m.group(3))
        return out

    def wait_idle(self, within: float = 30.0) -> float:
        """Seconds until no request runs or waits and no KV block is held; fails after
        `within` seconds (a hang guard: a loaded machine may take seconds to get there)."""
        t0 = time.monotonic()
        while True:
            m = self.metrics()
            if (m["ladle:num_requests_running"] == 0 and m["ladle:num_requests_waiting"] == 0
                    and m["ladle:num_used_kv_blocks"] == 0):
                return time.monotonic() - t0
            if time.monotonic() - t0 > within:
                pytest.fail(f"not idle {within} s later: running "
                            f"{m['ladle:num_requests_running']}, waiting "
                            f"{m['ladle:num_requests_waiting']}, KV blocks "
                            f"{m['ladle:num_used_kv_blocks']}")
            time.sleep(0.02)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def chat_server() -> RemoteServer:
    """The server the chat, Responses and Messages tests share the setup of: reasoning (qwen3)
    and hermes tool calls on ladle-demo, with an API key."""
    return RemoteServer("--api-key", API_KEY, "--max-model-len", "2048", "--dtype", "float32",
                        "--disable-access-log", "--reasoning-parser", "qwen3",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def _reason(labels: str) -> str:
    m = re.search(r'finished_reason="(\w+)"', labels)
    return f'{{finished_reason="{m.group(1)}"}}' if m else ""


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_demo_model())


def stream_text(chunks) -> tuple[dict[int, str], dict[int, str | None], object]:
    """Concatenated text per choice index, finish reasons, and the usage of the last chunk."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


# ---- 1. completions and chat ------------------------------------------------------------------
def test_completion_stream_equals_non_stream(client, tokenizer):
    prompt = "The history of the printing press"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=1234)
    full = client.completions.create(**kw, extra_body={"return_token_ids": True})
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == len(choice.token_ids) == 24
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    assert full.usage.prompt_tokens_details.cached_tokens is not None

    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finish, usage = stream_text(chunks)
    assert texts == {0: choice.text} and finish == {0: "length"}
    assert chunks[-1].choices == [] and usage.completion_tokens == 24
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three rivers."}]
    kw = dict(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0.8, seed=7)
    full = client.chat.completions.create(**kw)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20

    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True,
                                           "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    texts, finish, usage = stream_text(chunks)
    assert texts == {0: msg.content} and finish == {0: "length"}
    assert usage.completion_tokens == 20 and chunks[-1].choices == []
    # continuous_usage_stats: every chunk carries the usage so far, never decreasing.
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 20


def test_n_choices_stream_by_index(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=3,
              n=3)
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert len({c.text for c in full.choices}) == 3  # seeds seed + i: three different samples
    assert full.usage.completion_tokens == 36
    texts, finish, _ = stream_text(client.completions.create(**kw, stream=True))
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {0: "length", 1: "length", 2: "length"}

    chat_kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                   max_tokens=8, temperature=1.0, seed=11)
    full = client.chat.completions.create(**chat_kw)
    texts, _, _ = stream_text(client.chat.completions.create(**chat_kw, stream=True))
    assert texts == {c.index: c.message.content for c in full.choices}


def test_batch_of_prompts(client, tokenizer):
    full = client.completions.create(model=MODEL, prompt=["a b c", "the end"], max_tokens=5,
                                     temperature=0, n=2)
    assert sorted(c.index for c in full.choices) == [0, 1, 2, 3]  # prompt * n + choice
    by_index = {c.index: c.text for c in full.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy
    assert full.usage.prompt_tokens == len(tokenizer.encode("a b c")) + len(
        tokenizer.encode("the end"))
    assert full.usage.completion_tokens == 20
    ids = client.completions.create(model=MODEL, prompt=[[100, 200, 300], [5, 6]], max_tokens=3,
                                    temperature=0)
    assert ids.usage.prompt_tokens == 5 and len(ids.choices) == 2


def test_logprobs(client):
    full = client.completions.create(model=MODEL, prompt="Logprobs please", max_tokens=6,
                                     temperature=0, logprobs=3)
    lp = full.choices[0].logprobs
    if lp is None or not lp.tokens:
        pytest.skip("the engine does not fill EngineCoreOutput.logprobs yet")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(d) <= 4 for d in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    # Greedy: the sampled token is the most likely one.
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(value, abs=1e-4) and top[tok] == value

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4)
        assert bytes(c.bytes).decode(errors="replace")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, stream=True))
    streamed = [x.token for ch in chunks for c in ch.choices if c.logprobs
                for x in c.logprobs.content]
    assert streamed == [c.token for c in content]


def test_echo_and_prompt_logprobs(client, tokenizer):
    prompt = "Echo this prompt"
    num_prompt = len(tokenizer.encode(prompt))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(prompt) and r.usage.completion_tokens == 3
    lp = c.logprobs
    assert len(lp.tokens) == num_prompt + 3
    # The first prompt token has nothing before it to be predicted from.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[num_prompt] == len(prompt)

    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].prompt_logprobs
    assert len(pl) == num_prompt and pl[0] is None
    ids = tokenizer.encode(prompt)
    for token_id, entry in zip(ids[1:], pl[1:], strict=True):
        assert str(token_id) in entry and 2 <= len(entry) <= 3  # the prompt's token + top-2


# ---- 2. stop strings --------------------------------------------------------------------------
def _stop_strings(tokenizer, token_ids: list[int], text: str) -> dict[int, tuple[str, int]]:
    """Stop strings cut from the greedy output that span 1, 2 and 3 tokens: {span: (stop
    string, where it starts in the text)}. Each starts inside a token and ends inside one."""
    prefixes = [tokenizer.decode(token_ids[:k]) for k in range(len(token_ids) + 1)]
    bounds = [len(p) for p in prefixes]
    # A boundary is usable where the tokens so far decode to a prefix of the text (random
    # tokens can split a character, which decodes to U+FFFD until it completes).
    usable = [text.startswith(p) for p in prefixes]
    found = {}
    for span in (1, 2, 3):
        for i in range(2, len(token_ids) - span):
            if not all(usable[i : i + span + 1]):
                continue
            if span == 1:
                start, end = bounds[i] + 1, bounds[i + 1]
            else:
                start, end = bounds[i] + 1, bounds[i + span] - 1
            stop = text[start:end]
            # Inside the tokens it should span, and its first occurrence in the text.
            inside = all(bounds[j + 1] - bounds[j] >= 2 for j in (i, i + span - 1))
            if len(stop) >= 2 and inside and text.find(stop) == start:
                found[span] = (stop, start)
                break
    assert set(found) == {1, 2, 3}, f"no stop strings found in {text!r}"
    return found


def test_stop_strings_never_reach_the_client(server, client, tokenizer):
    prompt = "Stop strings are"  # under one KV block: no prefix-cache hit changes the numerics
    kw = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=200)
    ref = client.completions.create(**{**kw, "max_tokens": 40},
                                    extra_body={"return_token_ids": True})
    ids, text = ref.choices[0].token_ids, ref.choices[0].text
    for span, (stop, start) in _stop_strings(tokenizer, ids, text).items():
        expected = text[:start]
        full = client.completions.create(**kw, stop=[stop])
        c = full.choices[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (expected, "stop", stop), span
        server.wait_idle()  # the engine was told to stop at once: its blocks are free

        deltas, finish = [], None
        for chunk in client.completions.create(**kw, stop=[stop], stream=True):
            for ch in chunk.choices:
                deltas.append(ch.text)
                finish = ch.finish_reason or finish
        # Not even a prefix of the stop string went out in an earlier delta.
        assert "".join(deltas) == expected and finish == "stop", (span, deltas)
        server.wait_idle()

    # include_stop_str_in_output keeps the match.
    stop, start = _stop_strings(tokenizer, ids, text)[2]
    full = client.completions.create(**kw, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert full.choices[0].text == text[:start + len(stop)]


# ---- 3. bad input -----------------------------------------------------------------------------
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (path, body (dict, or raw bytes), status, param)
    (C, b'{"model": "ladle-demo", "prompt": ', 400, None),
    (C, b'["not", "an", "object"]', 400, None),
    (C, {"model": MODEL}, 400, "prompt"),
    (CH, {"model": MODEL}, 400, "messages"),
    (CH, {"model": MODEL, "messages": []}, 400, "messages"),
    (CH, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    (C, {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"model": MODEL, "prompt": "x", "top_k": -5}, 400, "top_k"),
    (C, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    (CH, {"model": MODEL, "messages": MSG, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens"),
    (C, {"model": MODEL, "prompt": list(range(100, 1200))}, 400, "prompt"),
    (CH, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 1200}]}, 400,
     "messages"),
    (C, {"model": MODEL, "prompt": [151936 + 5]}, 400, "prompt"),
    (C, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    (C, {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    (C, {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (CH, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CH, {"model": MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 30}, 400,
     "top_logprobs"),
    (C, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    (C, {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    (C, {"model": MODEL, "prompt": "x", "stream": True, "prompt_logprobs": 1}, 400,
     "prompt_logprobs"),
    (CH, {"model": MODEL, "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400,
     "response_format.json_schema.schema"),
    (CH, {"model": MODEL, "messages": MSG,
          "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"999999999": 1}}, 400, "logit_bias"),
    (C, {"model": MODEL, "prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    (C, {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"model": MODEL, "prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    (C, {"model": MODEL, "prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
    (C, {"model": MODEL, "prompt": "x", "seed": "abc"}, 400, "seed"),
    (CH, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content"),
    (CH, {"model": MODEL, "messages": [{"role": "assistant", "content": "x"}],
          "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/no-such-endpoint", {}, 404, None),
]


def test_bad_inputs_get_openai_shaped_4xx(server):
    assert len(BAD_INPUTS) >= 20
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path, body, status, param in BAD_INPUTS:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(path, json=body)
            case = f"{path} {body!r:.120}: {r.status_code} {r.text[:300]}"
            assert r.status_code == status, case
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, case
            assert error["message"] and error["type"], case
            if param is not None:
                assert error["param"] == param, case
                assert param.split(".")[0] in error["message"], case
            # The server keeps serving.
            ok = http.post(C, json={"model": MODEL, "prompt": "ok", "max_tokens": 1})
            assert ok.status_code == 200, case
    server.wait_idle()


# ---- 4. concurrency and disconnects -----------------------------------------------------------
def test_64_concurrent_streams(server):
    async def one(client, i):
        texts, n_chunks, usage, finish = [], 0, None, None
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i}:", max_tokens=16, temperature=1.0, seed=i,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            n_chunks += 1
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts.append(c.text)
                finish = c.finish_reason or finish
        return "".join(texts), usage, finish

    async def main():
        client = server.async_client(timeout=120)
        results = await asyncio.gather(*[one(client, i) for i in range(64)])
        await client.close()
        return results

    results = asyncio.run(main())
    assert len(results) == 64
    for text, usage, finish in results:
        assert text and finish == "length" and usage.completion_tokens == 16
    # Seeded sampling does not depend on the batch: request 5 alone gives the same text.
    alone = server.client().completions.create(model=MODEL, prompt="Request number 5:",
                                               max_tokens=16, temperature=1.0, seed=5)
    assert alone.choices[0].text == results[5][0]
    server.wait_idle()


def test_disconnects_abort_and_free_blocks(server):
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 900, "temperature": 1.0,
            "stream": True, "ignore_eos": True}

    def read_then_drop(i):
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            with http.stream("POST", C, json={**body, "seed": i}) as r:
                assert r.status_code == 200
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data: {")
                    if n >= 3:
                        break
            # Leaving the with-blocks closes the connection: the client is gone.

    aborted = 'ladle:request_success_total{finished_reason="abort"}'
    before = server.metrics()
    threads = [threading.Thread(target=read_then_drop, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    print(f"idle {server.wait_idle():.2f} s after the disconnects")
    after = server.metrics()
    # All 16 were aborted in the engine (and their blocks freed), long before max_tokens.
    assert after[aborted] - before[aborted] == 16
    generated = after["ladle:generation_tokens_total"] - before["ladle:generation_tokens_total"]
    assert generated < 16 * body["max_tokens"] / 2, generated

    # A non-streaming client that gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + C, headers=AUTH, timeout=1.0,
                   json={**body, "stream": False})
    server.wait_idle()
    assert server.metrics()[aborted] - after[aborted] == 1


# ---- 6. auth and the small endpoints ----------------------------------------------------------
def test_api_key(server):
    no_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        no_key.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert info.value.status_code == 401
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_models_tokenize_detokenize_request_id(server, client, tokenizer):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world",
                                                   "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
    assert "".join(r["token_strs"]) == "hello world"
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": MSG}).json()["tokens"]
    assert tokenizer.decode(chat_ids).endswith("<|im_start|>assistant\n")
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "hello world"}
    resp = httpx.post(server.url + C, headers={**AUTH, "X-Request-Id": "my-id-42"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert resp.headers["x-request-id"] == "my-id-42"
    assert resp.json()["id"] == "cmpl-my-id-42"


def test_metrics(server):
    m = server.metrics()
    for name in ("ladle:num_requests_running", "ladle:num_requests_waiting",
                 "ladle:kv_cache_usage_perc", "ladle:prefix_cache_hit_rate",
                 "ladle:prefix_cache_queries_total", "ladle:prefix_cache_hits_total"):
        assert name in m, name
    assert m['ladle:request_success_total{finished_reason="length"}'] > 0
    assert m['ladle:request_success_total{finished_reason="stop"}'] > 0
    assert m["ladle:time_to_first_token_seconds_count"] > 0
    assert m["ladle:inter_token_latency_seconds_count"] > 0
    assert m["ladle:e2e_request_latency_seconds_count"] > 0
    assert m["ladle:prompt_tokens_total"] > 0 and m["ladle:generation_tokens_total"] > 0


def test_unknown_fields_are_ignored(server):
    r = httpx.post(server.url + CH, headers=AUTH, json={
        "model": MODEL, "messages": MSG, "max_tokens": 2, "a_field_from_the_future": {"x": 1},
        "user": "someone", "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    assert "a_field_from_the_future" in server.log()


def test_openai_error_frames_are_json(server):
    # A stream that fails before it starts is a plain 4xx, not a broken stream.
    r = httpx.post(server.url + C, headers=AUTH, json={
        "model": MODEL, "prompt": "x", "stream": True, "temperature": -3})
    assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "temperature"
