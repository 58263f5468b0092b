"""A server run the way an operator runs it (issue 24): killed by an OOM killer or a supervisor's
`kill -9` while busy, and hit by clients that leave in the middle of their requests. Every
ladle process ends with the API process, plain, with tensor parallelism and with data
parallelism; an abort storm on the four generation routes logs nothing alarming, keeps /health
fast and leaves the gauges at 0. (A SIGKILL in the middle of a kernel build: test_kernel_cache.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import MODEL, RemoteServer, child_pids, is_alive

EXIT_WITHIN_S = 5.0  # the bound: every process gone this long after the SIGKILL
NUM_STREAMS = 8


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (engines, their tensor-parallel workers, helpers)."""
    out, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        out += children
        todo += children
    return out


def kill_api_while_streaming(server: RemoteServer) -> float:
    """Start NUM_STREAMS long streams, SIGKILL the API process once all of them stream, and
    return the seconds until every process it had started is gone (fails past EXIT_WITHIN_S).
    The streams' readers are slow, so the engines' output queues fill as the issue found."""
    started = threading.Semaphore(0)
    refused: list[str] = []

    def stream(i: int) -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": f"story number {i}", "max_tokens": 1500,
                    "ignore_eos": True, "stream": True}) as r:
                if r.status_code != 200:
                    refused.append(r.read().decode())
                    started.release()
                    return
                for n, _ in enumerate(r.iter_lines()):
                    if n == 1:
                        started.release()
                    time.sleep(0.02)
        except httpx.HTTPError:
            pass  # the server is gone: what this test does

    threads = [threading.Thread(target=stream, args=(i,), daemon=True)
               for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=120), server.log()
    assert not refused, refused
    time.sleep(0.5)
    procs = descendants(server.proc.pid)
    assert child_pids(server.proc.pid, "ladle.engine.core_proc"), procs
    os.kill(server.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    server.proc.wait()
    while any(is_alive(p) for p in procs):
        if time.monotonic() - killed > EXIT_WITHIN_S:
            alive = [p for p in procs if is_alive(p)]
            for p in alive:
                os.kill(p, signal.SIGKILL)
            pytest.fail(f"{alive} of {procs} still alive {EXIT_WITHIN_S} s after the API "
                        "process was killed")
        time.sleep(0.02)
    took = time.monotonic() - killed
    print(f"{len(procs)} processes ({', '.join(map(str, procs))}) gone {took:.2f} s after the "
          "SIGKILL of the API process")
    for t in threads:
        t.join(10)
    return took


@pytest.fixture(scope="module")
def server():
    s = RemoteServer("--max-model-len", "2048", "--max-num-seqs", "32", "--disable-access-log")
    yield s
    s.stop()


# ---- clients that leave -----------------------------------------------------------------------
ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 300},
    "/v1/completions": {"prompt": "hi there", "max_tokens": 300},
    "/v1/responses": {"input": "hi", "max_output_tokens": 300},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300},
}
MODES = ("mid-body", "mid-stream", "before the response")


async def leave(port: int, i: int) -> None:
    """One request on a raw connection that the client closes: half its body sent, after the
    first streamed event, or while a non-streaming response is being made."""
    route = list(ROUTES)[i % len(ROUTES)]
    mode = MODES[i // len(ROUTES) % len(MODES)]
    body = json.dumps({"model": MODEL, **ROUTES[route],
                       "stream": mode == "mid-stream"}).encode()
    head = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if mode == "mid-body":
        writer.write(head + body[:len(body) // 2])
        await writer.drain()
        await asyncio.sleep(0.01)
    elif mode == "mid-stream":
        writer.write(head + body)
        received = b""
        while b"data:" not in received:
            chunk = await asyncio.wait_for(reader.read(4096), 60)
            assert chunk, f"{route}: the connection closed before the first event"
            received += chunk
    else:
        writer.write(head + body)
        await writer.drain()
        await asyncio.sleep(0.05)
    writer.close()


async def abort_storm(port: int, num_requests: int, concurrency: int) -> None:
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with slots:
            await leave(port, i)

    await asyncio.gather(*(one(i) for i in range(num_requests)))


# Polls /health until a line arrives on stdin, then prints the slowest answer in seconds; a
# status other than 200 ends it with an error.
HEALTH_WATCHER = """
import select, sys, time
import httpx
worst = 0.0
while not select.select([sys.stdin], [], [], 0.05)[0]:
    t = time.monotonic()
    assert httpx.get(sys.argv[1] + "/health", timeout=5).status_code == 200
    worst = max(worst, time.monotonic() - t)
print(worst)
"""


def test_an_abort_storm_is_quiet_and_leaves_nothing_behind(server):
    """500 requests on chat, completions, responses and messages whose clients leave mid-body,
    mid-stream or before the response: no traceback and no ERROR line in the log, /health
    answers within 2 s throughout, the engine's gauges return to 0, and every abort is
    counted (mid-body ones, which never reach an engine, on their own counter)."""
    before = server.metrics()
    # /health is polled from a process of its own: a thread here would share this process's
    # GIL with the storm's 32 clients, and measure them rather than the server.
    watcher = subprocess.Popen(
        [sys.executable, "-c", HEALTH_WATCHER, server.url], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    t = time.monotonic()
    try:
        asyncio.run(abort_storm(server.port, 500, 32))
    finally:
        out, _ = watcher.communicate("stop\n", timeout=30)
    worst = [float(out.split()[-1])]
    print(f"storm of 500 in {time.monotonic() - t:.1f} s; slowest /health "
          f"{worst[0] * 1000:.0f} ms")
    server.wait_idle()
    after = server.metrics()
    num_mid_body = sum(1 for i in range(500) if MODES[i // len(ROUTES) % len(MODES)]
                       == "mid-body")
    assert after["ladle:request_body_disconnects_total"] - before.get(
        "ladle:request_body_disconnects_total", 0) == num_mid_body
    aborted = 'ladle:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == 500 - num_mid_body
    # The machine's 2 cores are shared with the storm's clients and CI's other test worker (a
    # watcher thread in this process measured up to 1.26 s there, storm 2.7 s). A loop blocked
    # by the storm's aborts would hold /health for the storm's length.
    assert watcher.returncode == 0 and worst[0] < 2.0
    log = open(server.log_file.name).read()
    alarming = [ln for ln in log.splitlines() if "Traceback" in ln or " ERROR " in ln]
    assert not alarming, "\n".join(alarming[:20])


# ---- a killed API process ---------------------------------------------------------------------
def test_sigkill_of_the_busy_api_process_ends_the_engine(server):
    """The issue's finding: with 8 long streams running, the engine outlived a SIGKILLed API
    process (parent pid 1, blocked in its output send). Now it is gone within 5 s."""
    kill_api_while_streaming(server)


@pytest.mark.parametrize("layout", [["-tp", "2"], ["-dp", "2"]], ids=["tp2", "dp2"])
def test_sigkill_of_the_api_process_ends_every_engine_and_worker(layout):
    """The same with two tensor-parallel ranks (the worker is the engine's child, maybe inside
    a collective) and with two data-parallel engines."""
    server = RemoteServer("--max-model-len", "2048", "--disable-access-log", *layout)
    try:
        kill_api_while_streaming(server)
    finally:
        server.stop()


def test_a_child_without_the_parent_death_signal_still_exits():
    """The watchdog (ladle/lifetime.py) alone, as where the kernel's parent-death signal is not
    used (another OS, a launch from a thread that may end first): a busy child exits within a
    second of its parent's SIGKILL."""
    child = ("import os, sys, time\n"
             "from ladle.lifetime import die_with_parent\n"
             "die_with_parent(int(sys.argv[1]), 'test child', use_signal=False)\n"
             "print(os.getpid(), flush=True)\n"
             "while True:\n"
             "    sum(range(10000))\n")
    parent = ("import subprocess, sys, os\n"
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())])\n"
              "p.wait()\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child_pid = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = time.monotonic()
    while is_alive(child_pid):
        assert time.monotonic() - killed < 1.0, "the child outlived its parent by a second"
        time.sleep(0.01)


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads():
    """The listening socket is bound before the engine starts (as vLLM does): a taken --port
    ends `ladle serve` with one line naming the flag, without loading the model for nothing;
    and no engine, worker or outgoing connection can take the port while the model loads."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "ladle.entrypoints.cli", "serve", MODEL,
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if f"--port {port}" in ln and "in use" in ln]
    assert len(lines) == 1, out[-3000:]
    assert "engine core starting" not in out, out[-3000:]


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_a_one_line_error(port):
    """getaddrinfo would take 70000 as 4464: the range is checked first, naming the flag."""
    proc = subprocess.run([sys.executable, "-m", "ladle.entrypoints.cli", "serve", MODEL,
                           "--port", port], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "engine core starting" not in out, out[-3000:]
    assert [ln for ln in out.splitlines() if f"--port {port}: must be in 0..65535" in ln], out
