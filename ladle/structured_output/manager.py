"""StructuredOutputManager: the engine side of structured outputs.

- add_request picks a backend per request (auto: xgrammar when it can express the constraint,
  else llguidance) and submits the compile to the compile pool; the request waits in
  WAITING_FOR_GRAMMAR and other requests never wait for it. Compiles are cached by
  (backend, kind, spec) within a byte bound, so a repeated schema is nearly free. A request
  whose grammar is not ready within the compile timeout fails alone; a compile nobody waits
  for is cancelled, or if already running, gives its worker slot back (compiler.py).
- submit_bitmask starts filling the step's bitmask, which the model runner calls just before
  the forward pass and collects just after: in a worker thread that overlaps the forward on an
  accelerator, inline on CPU (where the forward already uses every core).
- accept advances a request's matcher with its sampled token and says when it terminated; a
  token the grammar rejects raises GrammarRejectedError (the request fails, never "stops").
Rows in a prefill chunk, and rows still thinking (with a reasoning parser), are not masked."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ladle.reasoning import ReasoningConfig
from ladle.sampling_params import StructuredOutputsParams
from ladle.structured_output.backend import (
    ConstraintKey,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from ladle.structured_output.compiler import CompileJob, CompilePool, GrammarCache

logger = logging.getLogger(__name__)
BACKENDS = ("xgrammar", "guidance")
# Compiles that may run at once: a few slow constraints must not hold every slot (a compile
# that timed out gives its slot back, see CompilePool), and more than the cores cannot help.
NUM_COMPILE_WORKERS = max(4, min(8, os.cpu_count() or 1))


class GrammarRejectedError(ValueError):
    """A sampled token the request's grammar does not allow: the output so far breaks the
    constraint, so the request must fail rather than finish."""


def _backend_class(name: str) -> type[StructuredOutputBackend]:
    if name == "xgrammar":
        from ladle.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend
    from ladle.structured_output.guidance_backend import GuidanceBackend

    return GuidanceBackend


def choose_backend(params: StructuredOutputsParams, configured: str) -> str:
    """The backend for a request, or ValueError naming what is wrong with the constraint.
    Needs no tokenizer, so the API process calls it to answer bad requests with a 400."""
    key = ConstraintKey.from_params(params)
    wanted = params.backend or configured
    if wanted not in ("auto", *BACKENDS):
        raise ValueError(f"structured_outputs.backend: {wanted!r}; accepted: auto, "
                         + ", ".join(BACKENDS))
    names = BACKENDS if wanted == "auto" else (wanted,)
    reasons = {}
    for name in names:
        reason = _backend_class(name).check(key)
        if reason is None:
            return name
        reasons[name] = reason
    first = reasons[names[0]]
    raise ValueError(f"structured_outputs.{key.kind}: invalid or unsupported: {first}")


@dataclass(eq=False)
class GrammarSlot:
    """A request's grammar: pending while its compile runs, then a matcher (or an error)."""

    backend: StructuredOutputBackend
    key: tuple[str, ConstraintKey]  # (backend name, constraint): the cache key
    job: CompileJob
    timeout: float  # seconds the compile may run once started and this request waits
    added_at: float  # time.monotonic() when the request started waiting
    give_up: Callable[[GrammarSlot, bool], None]  # the manager's: stop waiting (timed out?)
    matcher: StructuredOutputGrammar | None = None
    error: str | None = None
    waiting: bool = True  # counted in job.num_waiters
    reasoning_ended: bool = True  # False while the request is thinking

    def poll(self) -> str:
        """'pending', 'ready' or 'error'."""
        if self.matcher is not None:
            return "ready"
        if self.error is not None:
            return "error"
        future = self.job.future
        if not future.done():
            # The clock runs from when the compile started (not while it waits in the queue
            # behind others) or when this request arrived, whichever is later.
            started = self.job.started_at
            if started is None or time.monotonic() < max(started, self.added_at) + self.timeout:
                return "pending"
            self.give_up(self, True)  # sets the error
            return "error"
        self.waiting = False
        try:
            self.matcher = self.backend.new_grammar(future.result())
            return "ready"
        except (Exception, CancelledError) as e:
            self.error = str(e) or type(e).__name__
            return "error"

    def is_ready(self) -> bool:
        return self.poll() != "pending"


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], configured: str,
                 reasoning: ReasoningConfig | None, max_num_reqs: int, compile_timeout: float,
                 cache_bytes: int, num_compile_workers: int = NUM_COMPILE_WORKERS,
                 overlap_fill: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.configured = configured
        self.reasoning = reasoning
        self.compile_timeout = compile_timeout
        self.backends: dict[str, StructuredOutputBackend] = {}
        self.cache = GrammarCache(cache_bytes)
        self.compile_pool = CompilePool(num_compile_workers, max_abandoned=num_compile_workers)
        # On an accelerator the fill overlaps the forward in a worker thread. On CPU the forward
        # keeps every core busy, so a fill thread only takes a core from one of its threads and
        # stalls the parallel regions that wait for it (measured on ladle-demo, 2 cores: 0.88x
        # of unconstrained at 1 and 8 requests with the thread); there it runs inline.
        self.fill_pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask")
                          if overlap_fill else None)
        self.bitmask = torch.full((max_num_reqs, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        # Counters for /metrics (the cache keeps its own hit / miss / eviction counts).
        self._stats_lock = threading.Lock()  # compiles finish on their own threads
        self.num_compiles = 0
        self.num_timeouts = 0
        self.compile_seconds = 0.0
        self.fill_seconds = 0.0

    def warm_up(self) -> None:
        """Build xgrammar's vocabulary tables now (about 0.6 s for a 150k vocabulary, holding the
        GIL): done lazily, the first constrained request would stall every running stream for
        that long. llguidance (auto's fallback, ~3 s) stays lazy."""
        if self.tokenizer is not None and self.configured in ("auto", "xgrammar"):
            self._backend("xgrammar")

    def _backend(self, name: str) -> StructuredOutputBackend:
        if name not in self.backends:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: this checkpoint has no tokenizer")
            self.backends[name] = _backend_class(name)(self.tokenizer, self.vocab_size,
                                                       self.eos_token_ids, self.cache.max_bytes)
        return self.backends[name]

    def add_request(self, request) -> None:
        params = request.sampling_params.structured_outputs
        name = choose_backend(params, self.configured)
        key = (name, ConstraintKey.from_params(params))
        backend = self._backend(name)
        job, cached = self.cache.get_or_add(key)
        if not cached:
            self.compile_pool.submit(job, lambda: self._compile(backend, key, job))
        job.num_waiters += 1
        slot = GrammarSlot(backend, key, job, self.compile_timeout, time.monotonic(),
                           self._give_up)
        if self.reasoning is not None:
            slot.reasoning_ended = self.reasoning.is_reasoning_end(request.prompt_token_ids)
        request.grammar = slot

    def fork(self, parent, child) -> None:
        """A beam search fork: the child gets a matcher of its own in the parent's state (a new
        matcher of the same compiled grammar, fed the parent's output tokens)."""
        slot: GrammarSlot = parent.grammar
        mine = GrammarSlot(slot.backend, slot.key, slot.job, slot.timeout, slot.added_at,
                           slot.give_up, waiting=False)
        child.grammar = mine
        if slot.matcher is None:  # (a fork exists only after its parent sampled)
            mine.error = slot.error
            return
        mine.matcher = slot.backend.new_grammar(slot.job.future.result())
        if self.reasoning is not None:
            mine.reasoning_ended = self.reasoning.is_reasoning_end(parent.prompt_token_ids)
        for token in parent.output_token_ids:
            self.accept(child, token)

    def abort(self, request) -> None:
        """The request is gone: if its grammar is still compiling, stop waiting for it."""
        slot: GrammarSlot | None = request.grammar
        if slot is not None and slot.waiting:
            self._give_up(slot, False)

    def _give_up(self, slot: GrammarSlot, timed_out: bool) -> None:
        """The slot stops waiting for its compile; the last waiter drops the compile."""
        slot.waiting = False
        kind = slot.key[1].kind
        if timed_out:
            slot.error = (f"structured_outputs.{kind}: the grammar did not compile within "
                          f"{self.compile_timeout:g} s (--structured-outputs-compile-timeout); "
                          "simplify the constraint or raise the timeout")
            with self._stats_lock:
                self.num_timeouts += 1
        job = slot.job
        job.num_waiters -= 1
        if job.num_waiters > 0 or job.future.done():
            return
        outcome = self.compile_pool.drop(job)
        if outcome == "cancelled":
            self.cache.discard(slot.key, job)
        elif outcome == "running":
            logger.warning("a %s compile nobody waits for keeps its worker slot: %d abandoned "
                           "compiles are running already", kind, self.compile_pool.num_abandoned)

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a running compile finishes or `timeout` seconds pass (the engine calls
        this when nothing else can run, instead of spinning)."""
        pending = self.cache.pending()
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def _compile(self, backend: StructuredOutputBackend, key, job: CompileJob):
        """Runs on a compile thread."""
        t = time.perf_counter()
        try:
            compiled = backend.compile(key[1])
        except BaseException:
            self.cache.discard(key, job)  # a later request tries again
            raise
        finally:
            with self._stats_lock:
                self.num_compiles += 1
                self.compile_seconds += time.perf_counter() - t
        self.cache.compiled(key, job, backend.compiled_size(compiled))
        return compiled

    # ---- per step ---------------------------------------------------------------------------
    def submit_bitmask(self, requests: list, samples_output: list[bool]) -> Future | None:
        """Start filling the bitmask rows of the constrained rows that sample an output token
        this step. Returns a future of (rows, bitmask), or None when no row is constrained."""
        jobs = [(row, req.grammar.matcher) for row, (req, s) in enumerate(
            zip(requests, samples_output, strict=True))
            if s and req.grammar is not None and req.grammar.reasoning_ended
            and req.grammar.matcher is not None]
        if not jobs:
            return None
        if self.fill_pool is not None:
            return self.fill_pool.submit(self._fill, jobs)
        done: Future = Future()
        done.set_result(self._fill(jobs))
        return done

    def _fill(self, jobs):
        t = time.perf_counter()
        for row, matcher in jobs:
            matcher.fill_bitmask(self.bitmask, row)
        self.fill_seconds += time.perf_counter() - t
        rows = [row for row, _ in jobs]
        return rows, self.bitmask[rows]

    def accept(self, request, token: int) -> bool:
        """Advance the request's matcher. Returns True when the constraint has terminated (the
        request should finish with 'stop'); raises GrammarRejectedError when the grammar does
        not allow the token (the request must fail: its output breaks the constraint)."""
        slot: GrammarSlot | None = request.grammar
        if slot is None or slot.matcher is None:
            return False
        if not slot.reasoning_ended:
            if self.reasoning is not None and token == self.reasoning.end_id:
                slot.reasoning_ended = True  # the answer starts with the next token
            return False
        try:
            accepted = slot.matcher.accept_tokens([token])
        except Exception as e:  # e.g. a token id the matcher does not know
            logger.warning("request %s: grammar accept failed: %s", request.req_id, e)
            accepted = False
        if not accepted:
            logger.error("request %s: sampled token %d rejected by its grammar", request.req_id,
                         token)
            raise GrammarRejectedError(
                f"structured_outputs.{slot.key[1].kind}: sampled token {token} is not allowed by "
                "the constraint (a logits processor after the grammar mask or a conflicting "
                "sampling parameter left no allowed token); the output would not match it")
        return slot.matcher.is_terminated()

    def stats(self) -> dict:
        c = self.cache
        return {
            "grammar_compiles": self.num_compiles,
            "grammar_cache_hits": c.num_hits,
            "grammar_cache_misses": c.num_misses,
            "grammar_cache_evictions": c.num_evictions,
            "grammar_cache_bytes": c.num_bytes,
            "grammar_compile_timeouts": self.num_timeouts,
            "grammar_compiles_abandoned": self.compile_pool.num_abandoned,
            "grammar_compile_seconds": self.compile_seconds,
            "grammar_bitmask_seconds": self.fill_seconds,
        }


_BIT_TABLE: dict[torch.device, torch.Tensor] = {}


def _bit_table(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: bit j of byte value b (little-endian within each 32-bit word)."""
    if device not in _BIT_TABLE:
        b = torch.arange(256, device=device)[:, None]
        _BIT_TABLE[device] = ((b >> torch.arange(8, device=device)) & 1).bool()
    return _BIT_TABLE[device]


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens whose bit is clear.
    bitmask: (len(rows), words) int32, bit t % 32 of word t // 32 = token t allowed.
    On CPU the kernel module does it in one pass; apply_bitmask_torch is its twin."""
    from ladle.runner import cpu_kernels  # the runner imports this module

    kernels = cpu_kernels.kernels_for(logits)
    if kernels is not None and logits.stride(1) == 1 and bitmask.device.type == "cpu":
        idx = torch.tensor(rows, dtype=torch.int64)
        kernels.apply_bitmask(logits, idx, bitmask.to(torch.int32).contiguous())
        return
    apply_bitmask_torch(logits, rows, bitmask)


def apply_bitmask_torch(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    R, V = len(rows), logits.shape[1]
    table = _bit_table(logits.device)
    # Unpack through a byte lookup table: one gather instead of 32 shift-and-mask passes.
    allowed = table[bitmask.to(logits.device).view(torch.uint8).long()].view(R, -1)[:, :V]
    if R == logits.shape[0] and rows == list(range(R)):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
