"""The API process's end of the engine link: starts the engine-core process, pushes requests and
aborts to it over a ZMQ PUSH socket and pulls its outputs over a PULL socket (ipc:// sockets in a
private temp dir; msgpack via msgspec). It watches the process: if it exits, the next read
raises EngineDeadError. See ladle/engine/core_proc.py for the other end."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import sys
import tempfile

import msgspec
import zmq
import zmq.asyncio

from ladle.config import EngineConfig
from ladle.engine.core_proc import EngineReady, RequestType
from ladle.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting reader checks that the engine process is alive


class EngineDeadError(RuntimeError):
    """The engine-core process exited; nothing more will come from it."""


class EngineClient:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="ladle-")
        self.input_addr = f"ipc://{self._dir}/input"
        self.output_addr = f"ipc://{self._dir}/output"
        # Sends are synchronous and never block (no high-water mark): an abort must go out
        # even from a cancelled task's cleanup, where nothing can be awaited.
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(self.input_addr)
        self._ctx = zmq.asyncio.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self.output_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.proc: subprocess.Popen | None = None
        self.ready: EngineReady | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> EngineReady:
        """Start the engine process and wait for its handshake (the model is loaded then)."""
        cmd = [sys.executable, "-m", "ladle.engine.core_proc", "--input", self.input_addr,
               "--output", self.output_addr,
               "--config", msgspec.json.encode(self.config).decode()]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        logger.info("engine core process started (pid %d); loading %s", self.proc.pid,
                    self.config.model)
        frame = await self._recv()
        ready = msgspec.msgpack.decode(frame, type=EngineReady)
        if ready.error is not None:
            raise EngineDeadError(f"the engine failed to start: {ready.error}")
        self.ready = ready
        return ready

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exit_code(self) -> int | None:
        """The engine process's exit code once it has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    async def shutdown(self, timeout: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            for _ in range(int(timeout / 0.05)):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.05)
            else:
                self.proc.kill()
                self.proc.wait()
        self._input.close()
        self._output.close()
        self._sync_ctx.term()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- messages ---------------------------------------------------------------------------
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        for req in requests:
            self._input.send_multipart([RequestType.ADD.value, self._encoder.encode(req)],
                                       copy=False)

    def abort_requests(self, req_ids: list[str]) -> None:
        """Safe to call at any time, also after the engine died (then it does nothing)."""
        if req_ids and self.exit_code() is None:
            self._input.send_multipart([RequestType.ABORT.value, self._encoder.encode(req_ids)],
                                       copy=False)

    async def get_outputs(self) -> EngineCoreOutputs:
        """The next batch of outputs; raises EngineDeadError once the process has exited."""
        return self._decoder.decode(await self._recv())

    async def _recv(self) -> bytes:
        while True:
            if await self._output.poll(_POLL_MS):
                return await self._output.recv(copy=True)
            self._check_alive()

    def _check_alive(self) -> None:
        code = self.exit_code()
        if code is not None:
            raise EngineDeadError(f"the engine process (pid {self.pid}) exited with code {code}")

