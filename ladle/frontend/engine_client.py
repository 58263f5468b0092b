"""The API process's end of the engine link: starts the engine-core processes (one, or
--data-parallel-size of them), pushes requests and aborts to each over its own ZMQ PUSH socket
and pulls its outputs over its own PULL socket (ipc:// sockets in a private temp dir; msgpack via
msgspec). `EngineClient` routes each request to the least-loaded engine and sends aborts to the
engine that owns the request; it watches every process: if any exits, the next read raises
EngineDeadError. See ladle/engine/core_proc.py for the other end."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import msgspec
import torch
import zmq
import zmq.asyncio

from ladle.config import EngineConfig
from ladle.engine.core_proc import EngineReady, RequestType
from ladle.lifetime import forks_from_main_thread
from ladle.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting reader checks that the engine processes are alive
_ALIVE_CHECK_S = 0.1  # ... and how often a busy one does (one engine may die while others talk)


class EngineDeadError(RuntimeError):
    """An engine-core process exited; nothing more will come from the server's engines."""


def engine_envs(config: EngineConfig, num_cpus: int, num_cuda: int) -> list[dict[str, str]]:
    """What each of the config.data_parallel_size engine processes adds to its environment.

    CPU threads: with several engines on one host each gets an equal share of the cores
    (OMP_NUM_THREADS = cores // engines, at least 1), so they do not oversubscribe them; an
    OMP_NUM_THREADS the user set wins. One engine keeps torch's default (every core).
    CUDA: engine i sees only its own devices (CUDA_VISIBLE_DEVICES, an equal slice of the visible
    ones), so every engine runs on "cuda" without knowing about the others. ValueError names the
    flag when the devices cannot be split."""
    n = config.data_parallel_size
    envs: list[dict[str, str]] = [{} for _ in range(n)]
    if n == 1:
        return envs
    if "OMP_NUM_THREADS" not in os.environ:
        for env in envs:
            env["OMP_NUM_THREADS"] = str(max(1, num_cpus // n))
    on_cuda = config.device.startswith("cuda") or (config.device == "auto" and num_cuda > 0)
    if not on_cuda:
        return envs
    if config.device not in ("auto", "cuda"):
        raise ValueError(f"--device {config.device}: with --data-parallel-size {n} each engine "
                         "takes its own device; accepted: cuda or auto")
    if num_cuda < n:
        raise ValueError(f"--data-parallel-size {n}: needs a CUDA device per engine, "
                         f"{num_cuda} visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(num_cuda)]
    per_engine = num_cuda // n
    for i, env in enumerate(envs):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i * per_engine:(i + 1) * per_engine])
    return envs


class EngineRouter:
    """Which engine owns each engine request, and how loaded each engine is: the choices the API
    has sent it and not yet seen finish (its waiting + running, as the API sees them; always
    current, while the engine's own gauges lag a step). The least loaded engine gets the next
    request; ties rotate, so light sequential traffic alternates between engines."""

    def __init__(self, num_engines: int):
        self.num_in_flight = [0] * num_engines
        self.owner: dict[str, int] = {}  # engine request id -> engine index
        self._next = 0  # where the search for the least loaded starts (rotates)

    def place(self, req_ids: list[str]) -> int:
        """Pick the engine for one request's choices (all on one engine: prefix and seeds stay
        together) and record them as in flight there."""
        n = len(self.num_in_flight)
        order = [(self._next + k) % n for k in range(n)]
        index = min(order, key=lambda i: self.num_in_flight[i])
        self._next = (index + 1) % n
        for req_id in req_ids:
            self.owner[req_id] = index
        self.num_in_flight[index] += len(req_ids)
        return index

    def release(self, req_id: str) -> int | None:
        """The request finished or was aborted: its engine, or None if it was released before
        (an abort that crossed the engine's finish)."""
        index = self.owner.pop(req_id, None)
        if index is not None:
            self.num_in_flight[index] -= 1
        return index


class EngineProcess:
    """One engine-core process and its socket pair."""

    def __init__(self, config: EngineConfig, index: int, sync_ctx: zmq.Context,
                 async_ctx: zmq.asyncio.Context, env: dict[str, str]):
        self.config = config
        self.index = index
        self.env = env
        self._dir = tempfile.mkdtemp(prefix=f"ladle-engine{index}-")
        self.input_addr = f"ipc://{self._dir}/input"
        self.output_addr = f"ipc://{self._dir}/output"
        # Sends are synchronous and never block (no high-water mark): an abort must go out
        # even from a cancelled task's cleanup, where nothing can be awaited.
        self.input = sync_ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(self.input_addr)
        self.output = async_ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(self.output_addr)
        self.proc: subprocess.Popen | None = None
        self.ready: EngineReady | None = None

    @property
    def name(self) -> str:
        return f"engine {self.index}" + ("" if self.proc is None else f" (pid {self.proc.pid})")

    def launch(self) -> None:
        # The engine dies with this process, however this one ends (ladle/lifetime.py).
        cmd = [sys.executable, "-m", "ladle.engine.core_proc", "--input", self.input_addr,
               "--output", self.output_addr,
               "--config", msgspec.json.encode(self.config).decode(),
               "--parent-pid", str(os.getpid()),
               *([] if forks_from_main_thread() else ["--no-parent-death-signal"])]
        env = {**os.environ, **self.env} if self.env else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)
        logger.info("%s started%s; loading %s", self.name,
                    "".join(f", {k}={v}" for k, v in self.env.items()), self.config.model)

    async def wait_ready(self) -> EngineReady:
        """The handshake (the model is loaded then); EngineDeadError names this engine."""
        while not await self.output.poll(_POLL_MS):
            self.check_alive()
        ready = msgspec.msgpack.decode(await self.output.recv(), type=EngineReady)
        if ready.error is not None:
            raise EngineDeadError(f"{self.name} failed to start: {ready.error}")
        self.ready = ready
        return ready

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def check_alive(self) -> None:
        code = self.exit_code()
        if code is not None:
            raise EngineDeadError(f"the engine process {self.name} exited with code {code}")

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.input.close()
        self.output.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class EngineClient:
    """The server's engines: config.data_parallel_size engine processes behind one interface."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        looks_for_cuda = config.data_parallel_size > 1 and config.device != "cpu"
        num_cuda = torch.cuda.device_count() if looks_for_cuda and torch.cuda.is_available() else 0
        envs = engine_envs(config, len(os.sched_getaffinity(0)), num_cuda)
        # Each engine is one engine to itself; it gets its own seed for unseeded sampling
        # (seeded requests do not depend on it), so two engines never draw the same stream.
        self.engines = [
            EngineProcess(replace(config, seed=config.seed + i, data_parallel_size=1), i,
                          self._sync_ctx, self._ctx, envs[i])
            for i in range(config.data_parallel_size)]
        self.router = EngineRouter(len(self.engines))
        self._poller = zmq.asyncio.Poller()
        for engine in self.engines:
            self._poller.register(engine.output, zmq.POLLIN)
        self._by_socket = {engine.output: engine for engine in self.engines}
        self._ready_sockets: list = []  # sockets with outputs not yet read, in order
        self._last_alive_check = 0.0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.ready: EngineReady | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> EngineReady:
        """Start every engine process at once (they load in parallel) and wait for all their
        handshakes. Raises EngineDeadError naming the engine that failed."""
        for engine in self.engines:
            engine.launch()
        waits = [asyncio.ensure_future(e.wait_ready()) for e in self.engines]
        try:
            readies = await asyncio.gather(*waits)
        except BaseException:  # one failed: stop waiting for the others (shutdown follows)
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            raise
        first = readies[0]
        for engine, ready in zip(self.engines[1:], readies[1:], strict=True):
            if (ready.vocab_size, ready.model_path) != (first.vocab_size, first.model_path):
                raise EngineDeadError(f"{engine.name} loaded {ready.model_path} (vocabulary "
                                      f"{ready.vocab_size}), engine 0 {first.model_path} "
                                      f"({first.vocab_size})")
        # With --max-model-len auto each engine fits its own cache; serve what all can hold.
        self.ready = msgspec.structs.replace(
            first, max_model_len=min(r.max_model_len for r in readies))
        return self.ready

    @property
    def pids(self) -> list[int]:
        return [e.proc.pid for e in self.engines if e.proc is not None]

    def exit_codes(self) -> list[int | None]:
        """Each engine process's exit code once it has exited, else None."""
        return [e.exit_code() for e in self.engines]

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every engine process (SIGTERM, then SIGKILL after `timeout` seconds)."""
        for engine in self.engines:
            engine.terminate()
        deadline = time.monotonic() + timeout
        while None in self.exit_codes() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for engine in self.engines:
            engine.close()
        self._sync_ctx.term()
        self._ctx.term()

    # ---- messages ---------------------------------------------------------------------------
    def add_requests(self, requests: list[EngineCoreRequest]) -> int:
        """Send one request's choices to the least-loaded engine; returns its index."""
        self._check_alive()
        # (a beam search is one engine request that answers under n output ids)
        index = self.router.place([i for req in requests for i in (req.output_ids or [req.req_id])])
        sock = self.engines[index].input
        for req in requests:
            sock.send_multipart([RequestType.ADD.value, self._encoder.encode(req)], copy=False)
        return index

    def owner(self, req_id: str) -> int | None:
        """The engine serving an engine request that has not finished, else None."""
        return self.router.owner.get(req_id)

    def abort_requests(self, req_ids: list[str]) -> None:
        """Abort on the engines that own them. Safe to call at any time, also after an engine
        died (then it does nothing) or for requests already finished."""
        by_engine: dict[int, list[str]] = {}
        for req_id in req_ids:
            index = self.router.release(req_id)
            if index is not None:
                by_engine.setdefault(index, []).append(req_id)
        for index, ids in by_engine.items():
            engine = self.engines[index]
            if engine.exit_code() is None:
                engine.input.send_multipart([RequestType.ABORT.value, self._encoder.encode(ids)],
                                            copy=False)

    async def get_outputs(self) -> tuple[int, EngineCoreOutputs]:
        """The next batch of outputs and the index of the engine that sent it; raises
        EngineDeadError once any engine process has exited."""
        while not self._ready_sockets:
            events = await self._poller.poll(_POLL_MS)
            self._ready_sockets = [sock for sock, _ in events]
            self._check_alive()
        now = time.monotonic()
        if now - self._last_alive_check > _ALIVE_CHECK_S:
            self._check_alive()
            self._last_alive_check = now
        engine = self._by_socket[self._ready_sockets.pop(0)]
        outputs = self._decoder.decode(await engine.output.recv(copy=True))
        for out in outputs.outputs:
            if out.finish_reason is not None:
                self.router.release(out.req_id)
        return engine.index, outputs

    def _check_alive(self) -> None:
        for engine in self.engines:
            engine.check_alive()

