"""Continuous batching with chunked prefill.

Every request carries num_computed_tokens; each step gives every scheduled request as many new
tokens as the budget allows (1 while decoding, a chunk of the prompt while prefilling), so prefill
and decode mix in one batch. Running requests go first; when the KV cache runs out, the newest
running request (lowest priority first) is preempted: its blocks are freed and it recomputes
later. Waiting requests are admitted by (priority, arrival)."""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from ladle.distributed.kv_transfer import KVConnector
from ladle.engine.kv_cache_manager import KVCacheManager
from ladle.engine.request import Request, RequestStatus
from ladle.spec_decode.draft_model import DraftSlots
from ladle.spec_decode.ngram import NgramProposer


@dataclass(slots=True)
class SchedulerOutput:
    # Requests to run this step, in the order the model runner lays them out.
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # left the batch since last step
    failed: list[Request] = field(default_factory=list)  # e.g. grammar compile errors
    # Speculative decoding: draft tokens of decoding rows, run after the row's last token and
    # counted in num_scheduled_tokens (1 + len(drafts)). With a draft model they are reserved
    # slots here (-1) that the model runner fills in place before the forward.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # A hybrid's prefix caching: req_id -> (tokens into its chunk, snapshot slot) where the
    # state after a full block is kept, and (snapshot slot, request slot) copies to make
    # before the step (the state of a prefix-cache hit).
    snapshots: dict[str, tuple[int, int]] = field(default_factory=dict)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


LATENCY_KINDS = ("queue", "prefill", "decode", "inference")


def _new_latencies() -> dict[str, deque[float]]:
    return {k: deque(maxlen=10_000) for k in LATENCY_KINDS}


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        proposer: NgramProposer | DraftSlots | None = None,
        connector: KVConnector | None = None,
    ):
        self.kv_cache = kv_cache
        self.connector = connector  # prefill/decode disaggregation, when configured
        # Finished requests whose blocks a decode server has yet to read (NixlConnector).
        self.held_for_transfer: dict[str, Request] = {}
        self.proposer = proposer  # speculative decoding, when configured
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # heap by (priority, arrival)
        self.running: list[Request] = []  # admission order; the newest is last
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # since start, for metrics and tests
        self.num_prefill_tokens = 0  # prompt tokens computed since start (recomputes too)
        # Per-request phase times (time.monotonic(), the clock arrival_time uses) for metrics:
        # req_id -> [first scheduled, first token]; finished phases wait in `latencies` until
        # take_latencies() hands them to the stats message.
        # Bounded: the offline LLM never drains them.
        self._phase_start: dict[str, list[float | None]] = {}
        self.latencies = _new_latencies()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.requests[request.req_id] = request
        heapq.heappush(self.waiting, request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        self.kv_cache.begin_step()
        budget = self.max_num_batched_tokens
        for req in [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_GRAMMAR]:
            if req.grammar.poll() == "error":  # fails alone; nobody else waits for it
                req.error = req.grammar.error
                self.finish(req, RequestStatus.FINISHED_ERROR)
                out.failed.append(req)

        # 1. Running requests keep going; preempt from the back when blocks run out.
        i = 0
        num_stalled = 0  # beams waiting for their group's other beams: no row this step
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if _is_stalled(req):
                num_stalled += 1
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._propose(req, budget) if num_new == 1 else []
            num_new += len(drafts)
            while not self.kv_cache.allocate_slots(req, num_new):
                if drafts:  # drop the drafts before preempting anyone
                    drafts, num_new = [], 1
                    continue
                victim = max(self.running[i:], key=lambda r: (r.priority, r.arrival_time))
                budget += self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req was preempted itself; self.running shrank at or after i
            out.scheduled.append(req)
            out.num_scheduled_tokens[req.req_id] = num_new
            req.draft_token_ids = drafts
            if drafts:
                out.draft_token_ids[req.req_id] = drafts
            else:
                self._plan_snapshot(req, num_new, out)
            budget -= num_new
            i += 1

        # 2. Admit waiting requests while there is budget, a free row and cache room.
        while self.waiting and budget > 0 and len(self.running) - num_stalled < self.max_num_seqs:
            req = self.waiting[0]
            if not self._admissible(req):
                # Others may run; this one stays until its grammar compiles (or its group's
                # step, for a beam that has reported).
                ready = [r for r in self.waiting if self._admissible(r)]
                if not ready:
                    break
                req = min(ready)
            computed_blocks, num_cached, num_external = [], 0, 0
            if req.num_computed_tokens == 0:
                computed_blocks, num_cached = self.kv_cache.get_computed_blocks(req)
                if self.connector is not None and req.kv_transfer_params \
                        and req.num_preemptions == 0:
                    # Prompt tokens past the local hit whose KV the prefill server holds: they
                    # are loaded, not computed (only the missing blocks move).
                    num_external = self.connector.get_num_new_matched_tokens(req, num_cached)
            num_new = min(req.num_tokens - num_cached - num_external, budget)
            req.num_computed_tokens = num_cached
            if not self.kv_cache.allocate_slots(req, num_external + num_new, computed_blocks):
                req.num_computed_tokens = 0
                # Beams waiting for their group hold blocks that no step uses: the newest one
                # gives them back (it has reported; it recomputes after its group's step).
                stalled = [r for r in self.running if _is_stalled(r)]
                if stalled:
                    self._preempt(max(stalled, key=lambda r: (r.priority, r.arrival_time)), out)
                    num_stalled -= 1
                    continue
                break
            self.waiting.remove(req)
            heapq.heapify(self.waiting)
            if num_external:
                self.connector.update_state_after_alloc(
                    req, self.kv_cache.get_blocks(req.req_id), num_cached, num_external)
                req.num_computed_tokens = num_cached + num_external
            if req.num_preemptions == 0 or req.num_cached_tokens == 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.req_id not in self._phase_start:  # first time scheduled: it queued till now
                now = time.monotonic()
                self._phase_start[req.req_id] = [now, None]
                self.latencies["queue"].append(now - req.arrival_time)
            self.running.append(req)
            out.scheduled.append(req)
            out.num_scheduled_tokens[req.req_id] = num_new
            self._plan_snapshot(req, num_new, out)
            budget -= num_new
        out.state_copies = self.kv_cache.take_restores()
        return out

    def _plan_snapshot(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        snap = self.kv_cache.plan_snapshot(req, num_new)
        if snap is not None:
            out.snapshots[req.req_id] = snap

    def add_fork(self, req: Request, running: bool) -> None:
        """A beam forked from a running one (engine/beam_search.py): running when its KV was
        forked and a row is free, else waiting to recompute its tokens (prefix-cache hits)."""
        self.requests[req.req_id] = req
        if running:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        else:
            req.status = RequestStatus.WAITING
            heapq.heappush(self.waiting, req)

    def has_free_row(self) -> bool:
        return len(self.running) < self.max_num_seqs

    def _propose(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request: no more than the budget, the tokens it may
        still produce, or the room left in max_model_len allow (the step also samples one
        token after the drafts), cut at the first one its grammar would reject."""
        if self.proposer is None or not req.can_draft:
            return []
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)
        drafts = self.proposer.propose(req.all_token_ids, room)
        slot = req.grammar
        # (Draft-model slots are placeholders here, filled by the model runner: not checked.)
        if drafts and drafts[0] >= 0 and slot is not None and slot.matcher is not None \
                and slot.reasoning_ended:
            # Only an optimisation: a rejected draft could never be sampled (the bitmask of its
            # position forbids it), so verifying it would be wasted work.
            drafts = slot.matcher.validate_tokens(drafts)
        return drafts

    def _admissible(self, req: Request) -> bool:
        """Whether a waiting request may start: its grammar has compiled, and it is not a beam
        that has reported its candidates (it needs no step until its group's)."""
        if req.beam is not None and req.req_id in req.beam.pending:
            return False
        return req.status != RequestStatus.WAITING_FOR_GRAMMAR or self._grammar_ready(req)

    @staticmethod
    def _grammar_ready(req: Request) -> bool:
        if req.status != RequestStatus.WAITING_FOR_GRAMMAR:
            return True
        if req.grammar.poll() == "ready":
            req.status = RequestStatus.WAITING
            return True
        return False

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Preempt req; returns the tokens it had been given this step (back to the budget)."""
        self.running.remove(req)
        self.kv_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        heapq.heappush(self.waiting, req)
        req.draft_token_ids = []
        out.draft_token_ids.pop(req.req_id, None)
        out.snapshots.pop(req.req_id, None)
        if req in out.scheduled:
            out.scheduled.remove(req)
            return out.num_scheduled_tokens.pop(req.req_id)
        return 0

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance num_computed_tokens for what ran and publish newly full blocks."""
        now = time.monotonic()
        for req in out.scheduled:
            num = out.num_scheduled_tokens[req.req_id]
            self.num_prefill_tokens += max(0, min(num, req.num_prompt_tokens
                                                  - req.num_computed_tokens))
            req.num_computed_tokens += num
            self.kv_cache.cache_full_blocks(req, req.num_computed_tokens)
            if req.req_id in out.snapshots:
                self.kv_cache.publish_snapshot(out.snapshots[req.req_id][1])
            start = self._phase_start.get(req.req_id)
            if start and start[1] is None and req.num_computed_tokens >= req.num_prompt_tokens:
                start[1] = now  # the prompt is in: this step samples the first token
                self.latencies["prefill"].append(now - start[0])

    def release_transfers(self) -> bool:
        """Free the blocks of finished requests whose KV was read, or waited past the
        connector's timeout; whether any were."""
        if not self.held_for_transfer:
            return False
        done, _ = self.connector.get_finished()
        for req_id in done:
            req = self.held_for_transfer.pop(req_id, None)
            if req is not None:
                self.kv_cache.free(req)
        return bool(done)

    def take_latencies(self) -> dict[str, list[float]]:
        """Phase times finished since the last call (queue, prefill, decode, inference)."""
        taken, self.latencies = self.latencies, _new_latencies()
        return {k: list(v) for k, v in taken.items()}

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request in any state; its blocks are freed at once."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            heapq.heapify(self.waiting)
        req.status = status
        delay_free = False
        if self.connector is not None and req.kv_transfer_params:
            # A prefill server hands the prompt's KV over before the blocks go back (or keeps
            # them until the decode server has read them: release_transfers).
            delay_free, req.kv_transfer_params_out = self.connector.request_finished(
                req, self.kv_cache.get_blocks(req.req_id))
        if delay_free:
            self.held_for_transfer[req.req_id] = req
        else:
            self.kv_cache.free(req)
        start = self._phase_start.pop(req.req_id, None)
        if start and start[1] is not None:
            now = time.monotonic()
            self.latencies["decode"].append(now - start[1])
            self.latencies["inference"].append(now - start[0])
        self.finished_req_ids.add(req.req_id)
        del self.requests[req.req_id]


def _is_stalled(req: Request) -> bool:
    """A running beam that has reported and waits for its group's other beams: it has no token
    to compute, so it gets no row this step."""
    return req.beam is not None and req.num_tokens == req.num_computed_tokens
