"""The persistent input batch: every request in the step owns a row that survives across steps.

Per-request state lives in per-row arrays (token ids, block table, sampling parameters). When the
set of requests changes, rows are removed, refilled and compacted, and the change is recorded as a
BatchUpdate so the sampler and logits processors can move their own row-indexed state the same
way. Sampling columns are declared once, in SAMPLING_COLUMNS, so add/move/clear cannot drift."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ladle.engine.request import Request
from ladle.sample.logits_processors.interface import AddedRow, BatchUpdate
from ladle.sampling_params import LOGPROBS_MODES, SamplingParams, SamplingType

# name -> (dtype, value for a request's params). The sampler reads these columns.
SAMPLING_COLUMNS: dict[str, tuple[type, Callable[[SamplingParams], object]]] = {
    "temperature": (np.float32, lambda p: p.temperature),
    "is_greedy": (np.bool_, lambda p: p.sampling_type == SamplingType.GREEDY),
    "has_seed": (np.bool_, lambda p: p.seed is not None),
    "seed": (np.int64, lambda p: 0 if p.seed is None else p.seed & 0x7FFFFFFFFFFFFFFF),
    "top_k": (np.int32, lambda p: p.top_k),
    "top_p": (np.float32, lambda p: p.top_p),
    "min_p": (np.float32, lambda p: p.min_p),
    "presence_penalty": (np.float32, lambda p: p.presence_penalty),
    "frequency_penalty": (np.float32, lambda p: p.frequency_penalty),
    "repetition_penalty": (np.float32, lambda p: p.repetition_penalty),
    # A beam's logprobs come from its candidates (engine/beam_search.py), not this column.
    "num_logprobs": (np.int32,
                     lambda p: -1 if p.logprobs is None or p.beam_width else p.logprobs),
    "logprobs_mode": (np.int8, lambda p: LOGPROBS_MODES.index(p.logprobs_mode)),
}


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int):
        self.max_num_reqs = max_num_reqs
        self.requests: list[Request | None] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self.num_reqs = 0
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # known tokens per row
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Tokens whose KV the draft model has written (speculative decoding with a draft model;
        # positions past the known tokens may hold rejected drafts: see DraftModel.propose).
        self.num_draft_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.columns = {name: np.zeros(max_num_reqs, dtype=dt)
                        for name, (dt, _) in SAMPLING_COLUMNS.items()}
        # Beam search: the candidates a beam's row reports each step (0: not a beam).
        self.beam_candidates = np.zeros(max_num_reqs, dtype=np.int32)
        self._row_arrays = [self.token_ids, self.num_tokens, self.num_prompt_tokens,
                            self.block_table, self.num_blocks, self.num_draft_computed,
                            self.beam_candidates, *self.columns.values()]

    @property
    def req_ids(self) -> list[str]:
        return [r.req_id for r in self.requests[: self.num_reqs]]

    def update(self, scheduled: list[Request], reset: set[str] = frozenset()) -> BatchUpdate | None:
        """Make the rows hold exactly `scheduled`; requests in `reset` (preempted since their row
        was written) get a fresh row. Returns None when nothing changed."""
        # By identity: a finished request's id may come back as a new request at once.
        wanted = {r.req_id: r for r in scheduled if r.req_id not in reset}
        upd = BatchUpdate(batch_size=0)
        for row in range(self.num_reqs):
            req = self.requests[row]
            if req is not None and wanted.get(req.req_id) is not req:
                del self.req_id_to_row[req.req_id]
                self.requests[row] = None
                upd.removed.append(row)
        holes = sorted(upd.removed, reverse=True)  # pop() gives the lowest hole
        for req in scheduled:
            if req.req_id in self.req_id_to_row:
                continue
            row = holes.pop() if holes else self.num_reqs
            if row == self.num_reqs:
                self.num_reqs += 1
            self._write_row(row, req)
            upd.added.append(AddedRow(row, req.sampling_params, req.prompt_token_ids,
                                      req.output_token_ids, req.eos_token_ids))
        # Compact: move the last rows down into the remaining holes.
        holes.sort()
        last = self.num_reqs - 1
        for hole in holes:
            while last > hole and self.requests[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            upd.moved.append((last, hole))
            last -= 1
        self.num_reqs = len(scheduled)
        upd.batch_size = self.num_reqs
        if not (upd.removed or upd.added or upd.moved):
            return None
        return upd

    def _write_row(self, row: int, req: Request) -> None:
        self.requests[row] = req
        self.req_id_to_row[req.req_id] = row
        n = req.num_tokens
        self.token_ids[row, :n] = req.all_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_blocks[row] = 0
        # A new row's computed tokens are prefix-cache hits (or none): blocks the draft model
        # wrote too, since it runs on every token the target runs on.
        self.num_draft_computed[row] = req.num_computed_tokens
        for name, (_, get) in SAMPLING_COLUMNS.items():
            self.columns[name][row] = get(req.sampling_params)
        self.beam_candidates[row] = req.beam_candidates

    def _move_row(self, src: int, dst: int) -> None:
        for arr in self._row_arrays:
            arr[dst] = arr[src]
        req = self.requests[src]
        self.requests[dst], self.requests[src] = req, None
        self.req_id_to_row[req.req_id] = dst

    def set_blocks(self, row: int, blocks: list[int]) -> None:
        """Record blocks appended since the last step (a request only appends blocks; the tail
        that speculative decoding gives back is dropped with trim_blocks first)."""
        have = self.num_blocks[row]
        if len(blocks) > have:
            self.block_table[row, have : len(blocks)] = blocks[have:]
            self.num_blocks[row] = len(blocks)

    def trim_blocks(self, row: int, num_blocks: int) -> None:
        """The KV manager gave back the row's blocks past the first num_blocks."""
        self.num_blocks[row] = min(self.num_blocks[row], num_blocks)

    def write_drafts(self, row: int, drafts: list[int]) -> None:
        """Place draft tokens after the row's known tokens, as the forward's inputs; they stay
        outside num_tokens, so the accepted ones are appended over themselves and the rest are
        overwritten later."""
        n = self.num_tokens[row]
        self.token_ids[row, n : n + len(drafts)] = drafts

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Vectorised append of one token to each of `rows`."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
