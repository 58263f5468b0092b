"""The engine-core process: builds an EngineCore and runs its loop behind two ZMQ sockets.

    API process                                engine-core process
    PUSH  --(ADD EngineCoreRequest | ABORT [ids])-->  PULL   input
    PULL  <--(EngineReady, then EngineCoreOutputs)--  PUSH   output

Each loop turn drains the input socket without blocking, steps once if there is work, and sends
that step's outputs with EngineCore.stats(). When idle it blocks on the input socket. No HTTP and
no text work happens here: the process knows token ids only.

The process never outlives the API process (ladle/lifetime.py: the parent-death signal and a
watchdog), and no send blocks for ever: a send that the API has not taken within
_SEND_STALL_S ends the process.

    python -m ladle.engine.core_proc --input ipc://... --output ipc://... --config '{json}' \
        --parent-pid PID [--no-parent-death-signal]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from enum import Enum

import msgspec
import zmq

from ladle.config import EngineConfig
from ladle.engine.request import FinishReason
from ladle.lifetime import die_with_parent, end_process
from ladle.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from ladle.native_memory import bound_native_memory, freeze_startup_heap, trim_heap

logger = logging.getLogger("ladle.engine.core_proc")

# How often an idle engine wakes up to check its tensor-parallel workers.
_IDLE_POLL_MS = 1000
_STATS_EVERY_S = 0.25  # the longest the API's gauges lag a busy engine that emits nothing
# A send blocks only when the API process stops reading (its socket queue is full), and then for
# at most this long: an API process that takes nothing for a minute is hung, and the engine
# ends rather than wait with it.
_SEND_STALL_S = 60


class EngineOutputStalled(RuntimeError):
    """The API process took no output for _SEND_STALL_S seconds."""


class RequestType(bytes, Enum):
    """First frame of every API -> engine message; the second frame is the msgpack payload."""

    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list[str], engine request ids


class EngineReady(msgspec.Struct, omit_defaults=True):
    """The engine's first message on the output socket: it loaded the model, or why not."""

    vocab_size: int = 0
    max_model_len: int = 0
    model_path: str = ""  # the resolved checkpoint directory (tokenizer and generation_config)
    num_kv_blocks: int = 0
    block_size: int = 0
    pid: int = 0
    # Bytes of the model's weights by storage type ("bfloat16", "int8", "Q4_K"), sent once
    # here rather than with every step's stats: /metrics' ladle:model_weight_bytes.
    weight_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    beam_search: bool = True  # False: requests cannot fork (a hybrid model's state slots)
    error: str | None = None  # set when the engine failed to start; it then exits non-zero


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the engine process: handshake, then the busy loop until SIGTERM (or the
    API process's death, which kills this one: ladle/lifetime.py). A request's own failure ends
    that request (EngineCore.step isolates it); only a device fault escapes the step and ends
    the process with a non-zero code (the API process watches for that and fails the requests
    in flight)."""
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.setsockopt(zmq.SNDTIMEO, _SEND_STALL_S * 1000)
    out_sock.connect(output_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(input_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        from ladle.engine.core import EngineCore  # torch and the model: only in this process

        engine = EngineCore(config)
    except Exception as e:
        if isinstance(e, ValueError):  # a checkpoint or setting at fault (ModelLoadError is
            # one): its message names it, and the API process logs it as the one line
            logger.debug("engine core failed to start", exc_info=True)
        else:
            logger.exception("engine core failed to start")
        _send(out_sock, encoder.encode(EngineReady(error=f"{type(e).__name__}: {e}")))
        out_sock.close()
        ctx.term()
        sys.exit(1)
    freeze_startup_heap()  # the model and its modules: never garbage, never walked again
    _send(out_sock, encoder.encode(EngineReady(
        vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
        model_path=str(engine.model_path), num_kv_blocks=engine.kv_cache.num_blocks,
        block_size=config.block_size, pid=os.getpid(), weight_bytes=engine.weight_bytes,
        beam_search=engine.limits.beam_search,
    )))
    try:
        EngineCoreLoop(engine, in_sock, out_sock).run()
    except EngineOutputStalled as e:
        logger.error("%s", e)
        sys.exit(1)
    finally:
        engine.close()  # tensor-parallel workers stop with the engine, whatever ended it


class EngineCoreLoop:
    def __init__(self, engine, in_sock: zmq.Socket, out_sock: zmq.Socket):
        self.engine = engine
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)
        self.encoder = msgspec.msgpack.Encoder()
        self.add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.abort_decoder = msgspec.msgpack.Decoder(list[str])
        self.errors: list[EngineCoreOutput] = []  # requests rejected since the last send
        self.is_dirty = False  # the engine's state changed since the last stats were sent
        self.sent_at = time.monotonic()  # when outputs or stats last went out

    def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                if self.is_dirty or self.errors:
                    self._send([])  # aborts freed blocks: report the idle gauges once
                while not self.poller.poll(_IDLE_POLL_MS):
                    engine.check_health()  # a dead TP worker ends the engine even when idle
                    trim_heap(time.monotonic())  # the last steps' free pages, once idle too
                    if engine.release_transfers():  # a decode server read a prefill's KV
                        self._send([])
            self._drain_input()
            outputs = engine.step() if engine.has_unfinished_requests() else []
            # Steps without outputs (a beam search's steps, long prefill chunks) still refresh
            # the API's gauges (/metrics) every _STATS_EVERY_S.
            if outputs or self.errors or time.monotonic() - self.sent_at > _STATS_EVERY_S:
                self._send(outputs)
            trim_heap(time.monotonic())

    def _drain_input(self) -> None:
        while True:
            try:
                kind, payload = self.in_sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.is_dirty = True
            if kind.bytes == RequestType.ADD.value:
                req = self.add_decoder.decode(payload.buffer)
                try:
                    self.engine.add_request(req)
                except Exception as e:  # a bad request or a processor's validate_params: it
                    # fails alone (the API process validates first; this is the backstop)
                    if not isinstance(e, ValueError):
                        logger.exception("adding request %s failed", req.req_id)
                    self.errors.append(EngineCoreOutput(
                        req_id=req.req_id, new_token_ids=[], finish_reason=int(FinishReason.ERROR),
                        error=f"{e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}",
                        is_server_error=not isinstance(e, ValueError)))
            elif kind.bytes == RequestType.ABORT.value:
                for req_id in self.abort_decoder.decode(payload.buffer):
                    self.engine.abort_request(req_id)
            else:
                logger.error("unknown request type %r", kind.bytes)

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        if self.errors:
            outputs = self.errors + outputs
            self.errors = []
        msg = EngineCoreOutputs(outputs=outputs, stats=self.engine.stats())
        _send(self.out_sock, self.encoder.encode(msg))
        self.is_dirty = False
        self.sent_at = time.monotonic()


def _send(sock: zmq.Socket, data: bytes) -> None:
    """Send on the output socket (SNDTIMEO _SEND_STALL_S); EngineOutputStalled when the API
    process took nothing for that long. Its death ends this process sooner (ladle/lifetime.py)."""
    try:
        sock.send(data, copy=False)
    except zmq.Again:
        raise EngineOutputStalled(f"the API process took no engine output for {_SEND_STALL_S} "
                                  "s; engine core stopping") from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="ladle engine-core process (started by ladle serve)")
    ap.add_argument("--input", required=True, help="ZMQ address the API process pushes to")
    ap.add_argument("--output", required=True, help="ZMQ address the API process pulls from")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="exit when this process (the API process) exits")
    ap.add_argument("--no-parent-death-signal", action="store_true",
                    help="the parent started us from a thread that may end before it does: "
                         "watch it without the kernel's parent-death signal")
    args = ap.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid, "engine core",
                        use_signal=not args.no_parent_death_signal)
    bound_native_memory()
    logging.basicConfig(level=os.environ.get("LADLE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group: the API process decides when the
    # engine stops (it sends SIGTERM), so in-flight requests can end cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = msgspec.json.decode(args.config.encode(), type=EngineConfig)
    t = time.perf_counter()
    logger.info("engine core starting (pid %d, model %s)", os.getpid(), config.model)
    run_engine_core(config, args.input, args.output)
    logger.info("engine core stopped after %.0f s", time.perf_counter() - t)


if __name__ == "__main__":
    end_process(main)
