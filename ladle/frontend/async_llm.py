"""AsyncLLM: the server's engine, in the API process. It owns the tokenizer, the InputProcessor,
the OutputProcessor and the EngineClient (one engine process, or --data-parallel-size of them).
One background task reads every engine's outputs, detokenizes them (stop strings abort the
request in its engine at once) and wakes the requests that changed; each request's async
iterator then takes whatever accumulated since it last looked, so a slow client gets bigger
deltas instead of a growing queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from ladle.config import EngineConfig
from ladle.frontend.engine_client import EngineClient, EngineDeadError
from ladle.frontend.metrics import IterationStats, ServerMetrics
from ladle.frontend.output_processor import ChoiceDelta, OutputProcessor, RequestState
from ladle.frontend.processor import InputProcessor, ProcessedRequest
from ladle.sampling_params import RequestLimits
from ladle.tokenizer import load_served_tokenizer

logger = logging.getLogger(__name__)


class OverloadedError(RuntimeError):
    """More requests than the server queues; the client should retry later (HTTP 503)."""

    retry_after_s = 1


@dataclass(slots=True)
class RequestUpdate:
    """What a request produced since the caller last looked."""

    state: RequestState  # prompt, cached-token count, prompt logprobs
    deltas: list[ChoiceDelta]  # one per choice that changed
    finished: bool  # every choice has finished


class _Stream:
    __slots__ = ("state", "event", "error")

    def __init__(self, state: RequestState):
        self.state = state
        self.event = asyncio.Event()
        self.error: BaseException | None = None


class AsyncLLM:
    def __init__(self, client: EngineClient, processor: InputProcessor,
                 output_processor: OutputProcessor, metrics: ServerMetrics):
        self.client = client
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.output_processor = output_processor
        self.metrics = metrics
        self.streams: dict[str, _Stream] = {}
        self.dead_error: EngineDeadError | None = None
        self._on_dead: list[Callable[[], None]] = []
        self._output_task: asyncio.Task | None = None
        # Choices that may be in the engines at once: the running ones (max_num_seqs per engine)
        # plus the waiting ones the server allows (--max-waiting-requests). None: no bound.
        self.max_in_flight: int | None = None
        self._num_admitting = 0  # choices of requests being preprocessed (see admitting())
        # Set while the server drains on SIGTERM: the error new requests get.
        self.refusing: BaseException | None = None

    @classmethod
    async def start(cls, config: EngineConfig, model_name: str | None = None) -> AsyncLLM:
        """Start the engine processes, wait until all have loaded the model, and start reading.
        A local checkpoint is checked meanwhile (`check_served_checkpoint`), so a broken one
        ends the start with a ModelLoadError naming the file before the engines have loaded it;
        a fetched one has its tokenizer checked once the engine has resolved it."""
        local = _local_model_path(config.model)
        client = EngineClient(config)
        checking = None if local is None else asyncio.ensure_future(
            asyncio.to_thread(check_served_checkpoint, config.tokenizer, local))
        starting = asyncio.ensure_future(client.start())
        try:
            tokenizer = None if checking is None else await checking
            ready = await starting
            if tokenizer is None:
                tokenizer = load_served_tokenizer(config.tokenizer, ready.model_path)
        except BaseException:
            for task in (checking, starting):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (checking, starting) if t is not None),
                                 return_exceptions=True)
            await client.shutdown()
            raise
        limits = RequestLimits(ready.vocab_size, config.max_logprobs, config.max_n,
                               beam_search=ready.beam_search)
        processor = InputProcessor(tokenizer, ready.model_path,
                                   max_model_len=ready.max_model_len, limits=limits,
                                   scheduling_policy=config.scheduling_policy)
        llm = cls(client, processor, OutputProcessor(tokenizer),
                  ServerMetrics(model_name or config.model,
                                num_engines=config.data_parallel_size))
        for i, engine in enumerate(client.engines):  # the cache size is known before any step
            llm.metrics.set_engine_stats(i, {"num_blocks": engine.ready.num_kv_blocks})
            llm.metrics.weight_bytes[i] = engine.ready.weight_bytes
        llm._output_task = asyncio.create_task(llm._output_loop())
        return llm

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    @property
    def model_path(self) -> str:
        return self.client.ready.model_path

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None

    def on_dead(self, callback: Callable[[], None]) -> None:
        """Call `callback` once when an engine process dies (which ends every engine's requests:
        the server stops, as vLLM's does)."""
        self._on_dead.append(callback)

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        await self.client.shutdown()

    # ---- requests ---------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Engine requests (choices) added and not finished."""
        return len(self.output_processor.child_of)

    @contextlib.contextmanager
    def admitting(self, n: int, num_prompts: int = 1):
        """Admission control around a request's preprocessing: raises OverloadedError (a 503
        with Retry-After at the edge) when its n engine requests per prompt (its choices, or
        its best_of candidates) would put more requests in the engines than they run
        (--max-num-seqs each) plus --max-waiting-requests (for the server, not per engine).
        Requests being preprocessed count as in flight, so a burst cannot slip past the bound
        while it tokenizes. (An n above --max-n is a 400 from preprocessing; it is not an
        overload.)"""
        if self.refusing is not None:
            raise self.refusing
        num_choices = min(n, self.processor.limits.max_n) * num_prompts
        busy = self.num_in_flight + self._num_admitting
        if self.max_in_flight is not None and busy + num_choices > self.max_in_flight:
            raise OverloadedError(
                f"the server is at capacity ({busy} requests in flight, at most "
                f"{self.max_in_flight}: --max-num-seqs per engine plus --max-waiting-requests); "
                "retry later")
        self._num_admitting += num_choices
        try:
            yield
        finally:
            self._num_admitting -= num_choices

    def fail_in_flight(self, error: BaseException) -> int:
        """End every request in flight with `error` (server shutdown); returns how many."""
        streams = list(self.streams.values())
        for stream in streams:
            stream.error = error
            stream.event.set()
        return len(streams)

    async def generate(self, req: ProcessedRequest) -> AsyncIterator[RequestUpdate]:
        """Run one processed request; yields updates until every choice has finished. Leaving
        the loop early (client disconnect, cancellation) aborts the request in the engine.
        Raises EngineDeadError if the engine dies meanwhile."""
        if self.dead_error is not None:
            raise self.dead_error
        state = self.output_processor.add_request(
            req.request_id, req.prompt, req.prompt_token_ids, req.child_ids, req.child_params,
            arrival_time=req.engine_requests[0].arrival_time, params=req.params)
        stream = _Stream(state)
        self.streams[req.request_id] = stream
        finished = False
        try:
            self.client.add_requests(req.engine_requests)
            while not finished:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                finished = state.finished
                deltas = state.take_deltas()
                if deltas or finished:
                    yield RequestUpdate(state, deltas, finished)
        finally:
            self.streams.pop(req.request_id, None)
            if not finished:
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (all its choices) and free its KV blocks in the engine."""
        child_ids = self.output_processor.abort(request_id)
        if child_ids:
            engine = self.client.owner(child_ids[0])
            self.metrics.record_aborted(len(child_ids), 0 if engine is None else engine)
            try:
                self.client.abort_requests(child_ids)
            except Exception:  # the engine is gone; nothing holds the blocks any more
                logger.debug("abort of %s not sent", request_id, exc_info=True)

    # ---- the output loop --------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                engine, outputs = await self.client.get_outputs()
                if outputs.stats is not None:
                    self.metrics.set_engine_stats(engine, outputs.stats)
                if outputs.outputs:
                    stats = IterationStats()
                    changed, to_abort = self.output_processor.process(outputs.outputs, stats)
                    if to_abort:
                        self.client.abort_requests(to_abort)
                    try:
                        self.metrics.record(stats, engine)
                    except Exception:  # metrics must never stop the loop that serves everyone
                        logger.exception("recording metrics failed")
                    for state in changed:
                        stream = self.streams.get(state.request_id)
                        if stream is not None:
                            stream.event.set()
                # Let the woken requests write their chunks before the next batch.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            logger.error("%s; failing %d request(s) in flight", e, len(self.streams))
            self._die(e)
        except Exception as e:
            logger.exception("the output loop failed")
            self._die(EngineDeadError(f"the output loop failed: {type(e).__name__}: {e}"))

    def _die(self, error: EngineDeadError) -> None:
        self.dead_error = error
        self.output_processor.fail_all(str(error))
        for stream in self.streams.values():
            stream.error = error
            stream.event.set()
        for callback in self._on_dead:
            callback()


def check_served_checkpoint(tokenizer: str | None, model_path: Path):
    """What the API process checks of a local checkpoint while the engines start, so a broken
    one fails in seconds rather than after a model load: its weights files' headers against its
    config (loader.check_checkpoint, the engine raises the same errors later), and the
    tokenizer against the model. Returns the tokenizer."""
    from ladle.models.loader import check_checkpoint, read_hf_config

    check_checkpoint(model_path, read_hf_config(model_path))
    return load_served_tokenizer(tokenizer, model_path)


def _local_model_path(model: str) -> Path | None:
    """The checkpoint path when `model` is a local file or directory (resolved as the engine
    resolves it, which for a local path reads nothing); None for the demo, a packaged model or a
    hub id, which the engine fetches."""
    if not Path(model).expanduser().exists():
        return None
    from ladle.models.loader import resolve_model_path

    return resolve_model_path(model)
