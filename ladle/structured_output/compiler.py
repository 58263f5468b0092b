"""Grammar compiles off the engine thread: the worker pool (a compile nobody waits for gives its
slot back) and the cache of compiled grammars (bounded in bytes, least recently used first out).
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

EXIT_WAIT_S = 2.0  # how long exit waits for compiles still running (most take milliseconds)


@dataclass(eq=False)
class CompileJob:
    """One compile, shared by every request waiting for the same constraint."""

    future: Future = field(default_factory=Future)
    started_at: float | None = None  # time.monotonic() when a worker took it up
    num_waiters: int = 0  # requests waiting for it that have not timed out or been aborted
    size_bytes: int | None = None  # as the backend measures it; None until compiled


class CompilePool:
    """Runs compiles on daemon threads, at most `num_workers` counted at once.

    A compile nobody waits for any more (its requests timed out or were aborted) is cancelled
    while it is queued. Once running it cannot be stopped: xgrammar and llguidance compile in
    native code with no cancel hook. It is then abandoned: it runs to its end on its own thread
    but gives its slot to the next compile, so hung compiles cannot hold every slot. At most
    `max_abandoned` run so at once (past that a stuck compile keeps its slot), which bounds the
    threads at num_workers + max_abandoned. Daemon threads: a hung compile never blocks exit."""

    def __init__(self, num_workers: int, max_abandoned: int):
        self.num_workers = num_workers
        self.max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._queue: deque[tuple[CompileJob, Callable[[], object]]] = deque()
        self._running: set[Future] = set()  # holding a slot
        self._abandoned: set[Future] = set()
        atexit.register(self.shutdown, EXIT_WAIT_S)

    def submit(self, job: CompileJob, fn: Callable[[], object]) -> None:
        """Run fn() for the job; its result or exception lands in job.future."""
        with self._lock:
            self._queue.append((job, fn))
            self._start_queued()

    def drop(self, job: CompileJob) -> str:
        """Nobody waits for the job any more. Returns 'cancelled' (it had not started),
        'abandoned' (it runs on without a slot), or 'running' (it keeps its slot: too many are
        abandoned already, or it just finished)."""
        if job.future.cancel():
            return "cancelled"
        with self._lock:
            f = job.future
            if f in self._abandoned:
                return "abandoned"
            if f in self._running and len(self._abandoned) < self.max_abandoned:
                self._running.remove(f)
                self._abandoned.add(f)
                self._start_queued()
                return "abandoned"
        return "running"

    def shutdown(self, wait_s: float) -> None:
        """Cancel the queued compiles and give the running ones up to wait_s to end. Run at
        exit: a compile that returns while the interpreter is finalizing kills its thread
        through native frames, which aborts the process (CPython before 3.14)."""
        with self._lock:
            for job, _ in self._queue:
                job.future.cancel()
            self._queue.clear()
            running = list(self._running | self._abandoned)
        if running:
            wait(running, timeout=wait_s)

    @property
    def num_abandoned(self) -> int:
        return len(self._abandoned)

    def _start_queued(self) -> None:  # with the lock held
        while self._queue and len(self._running) < self.num_workers:
            job, fn = self._queue.popleft()
            if job.future.set_running_or_notify_cancel():  # False: cancelled while queued
                job.started_at = time.monotonic()
                self._running.add(job.future)
                threading.Thread(target=self._run, args=(job.future, fn), daemon=True,
                                 name="grammar-compile").start()

    def _run(self, future: Future, fn: Callable[[], object]) -> None:
        try:
            result = fn()
        except BaseException as e:  # the waiting requests report it
            future.set_exception(e)
        else:
            future.set_result(result)
        finally:
            with self._lock:
                self._running.discard(future)
                self._abandoned.discard(future)
                self._start_queued()


class GrammarCache:
    """Compile jobs by key. Compiled ones hold at most `max_bytes` together (sizes as the backend
    reports them), least recently used evicted first; ones still compiling have no size yet and
    stay. An evicted grammar lives on in the requests using it; the bound is on what the cache
    keeps for later requests. Thread-safe: jobs finish on compile threads."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._jobs: OrderedDict[object, CompileJob] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    def get_or_add(self, key) -> tuple[CompileJob, bool]:
        """The job for key and True; or a new job, added, and False (the caller submits it)."""
        with self._lock:
            job = self._jobs.get(key)
            if job is not None:
                self._jobs.move_to_end(key)
                self.num_hits += 1
                return job, True
            job = self._jobs[key] = CompileJob()
            self.num_misses += 1
            return job, False

    def compiled(self, key, job: CompileJob, size_bytes: int) -> None:
        """The job compiled: count its bytes and evict down to the bound (maybe itself)."""
        with self._lock:
            if self._jobs.get(key) is not job:
                return  # dropped meanwhile
            job.size_bytes = size_bytes
            self._jobs.move_to_end(key)  # its requests are about to use it
            # Evict before publishing the total: stats read num_bytes without the lock.
            total = self.num_bytes + size_bytes
            for k in [k for k, j in self._jobs.items() if j.size_bytes is not None]:
                if total <= self.max_bytes:
                    break
                total -= self._jobs.pop(k).size_bytes
                self.num_evictions += 1
            self.num_bytes = total

    def discard(self, key, job: CompileJob) -> None:
        """Forget a job that failed or was cancelled (a later request compiles afresh)."""
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]
                if job.size_bytes is not None:
                    self.num_bytes -= job.size_bytes

    def pending(self) -> list[Future]:
        with self._lock:
            return [j.future for j in self._jobs.values() if j.size_bytes is None]

    def __len__(self) -> int:
        return len(self._jobs)
