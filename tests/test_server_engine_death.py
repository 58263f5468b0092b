"""Killing the engine-core process: /health turns unhealthy, requests in flight (streaming or
not) end with an error within seconds instead of hanging, and the server exits non-zero."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from test_server import API_KEY, AUTH, MODEL, RemoteServer


def test_engine_death_fails_requests_and_exits_nonzero():
    server = RemoteServer("--api-key", API_KEY, "--max-model-len", "2048",
                          "--disable-access-log")
    kill_engine_while_serving(server, server.engine_pid)


def kill_engine_while_serving(server: RemoteServer, engine_pid) -> None:
    """Start a stream and a plain request, SIGKILL the engine `engine_pid()` names, and check
    that both end with an error within seconds, /health fails and the server exits non-zero.
    Stops the server in any case."""
    try:
        results: dict[str, object] = {}
        started = threading.Event()

        def stream():
            client = server.client(timeout=60)
            try:
                for chunk in client.completions.create(
                        model=MODEL, prompt="Never ending", max_tokens=2000, stream=True,
                        extra_body={"ignore_eos": True}):
                    if chunk.choices and chunk.choices[0].text:
                        started.set()
                results["stream"] = "finished"
            except Exception as e:
                results["stream"] = e
            results["stream_t"] = time.monotonic()

        def non_stream():
            try:
                r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                               json={"model": MODEL, "prompt": "Also long", "max_tokens": 2000,
                                     "ignore_eos": True})
                results["plain"] = r
            except Exception as e:
                results["plain"] = e
            results["plain_t"] = time.monotonic()

        threads = [threading.Thread(target=stream), threading.Thread(target=non_stream)]
        for t in threads:
            t.start()
        assert started.wait(60), server.log()
        time.sleep(0.3)
        os.kill(engine_pid(), signal.SIGKILL)
        killed_at = time.monotonic()

        # /health fails (503 while the server winds down, then no server at all).
        deadline = killed_at + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(server.url + "/health", timeout=1).status_code == 503:
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("/health stayed healthy after the engine died")

        for t in threads:
            t.join(15)
        assert isinstance(results["stream"], openai.APIError), results["stream"]
        assert "engine" in str(results["stream"])
        plain = results["plain"]
        if isinstance(plain, httpx.Response):
            assert plain.status_code == 500 and "engine" in plain.json()["error"]["message"]
        else:  # the connection closed as the server exited: still an error, not a hang
            assert isinstance(plain, httpx.HTTPError), plain
        assert results["stream_t"] - killed_at < 5 and results["plain_t"] - killed_at < 5

        server.proc.wait(15)
        assert server.proc.returncode not in (0, None), server.log()
    finally:
        server.stop()
