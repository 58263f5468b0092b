"""The draft-model method of speculative decoding: a small checkpoint with the target's
vocabulary drafts up to k tokens per decoding row, autoregressively and batched over rows, each
drawn from its own processed distribution q (recorded for the target's rejection sampling).

KV cache: the draft has its own layer tensors but the target's block size, block count and
block ids. One KVCacheManager and one block table per row serve both models, so there is no
second allocator: every slot the scheduler reserves (prompt chunks, the last token, draft slots)
exists in both caches, and a prefix-cache hit is a hit for both (the draft processes every token
the target processes, in the same step, before the target runs).

Each step, from ModelRunner.execute (before the target's forward):
  1. catch-up: one draft forward over every scheduled row's tokens the draft has not processed
     yet (a prompt chunk; the accepted tokens and the last sampled one), from the row's
     InputBatch.num_draft_computed; the positions past the row's known tokens held rejected
     drafts, so coverage is clipped to num_tokens - 1 first;
  2. drafting: the logits at each drafting row's last token give q_1 and the first draft, then
     one single-token forward per further draft (rows with fewer reserved slots drop out).
The draft's last token is never fed back, so after a step whose drafts were all accepted the
draft lags the target by that one token until the next catch-up; should the request end right
then, a block it published holds one slot the draft never wrote, and a later prefix hit on it
drafts from slightly different draft KV: a cost in acceptance, never in correctness (rejection
sampling is exact for any q, as long as q is what the draft token was drawn from).

q is the draft's logits with the request's temperature, min-p, top-k and top-p (in the
sampler's order); penalties, logit_bias, bad_words, allowed_token_ids and grammars act on the
target's p only (they lower acceptance, never change the output distribution). Greedy rows
draft the draft's argmax; the target verifies them by argmax agreement. Seeded rows draw drafts
from the counter-based noise on its own stream (noise.DRAFT_STREAM), keyed by the output
position the draft stands for, so a seeded request repeats exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ladle.sample.noise import DRAFT_STREAM
from ladle.sample.ops import (
    NEG_INF,
    TOPK_CANDIDATE_LIMIT,
    mask_top_k_top_p,
    race,
    restrict_top_k_top_p,
)
from ladle.sample.rejection import DraftTest

if TYPE_CHECKING:
    from ladle.runner.model_runner import ModelRunner

PENDING = -1  # a reserved draft slot whose token the draft model fills in before the forward


class DraftSlots:
    """The scheduler's proposer for the draft-model method: drafts need a forward of the draft
    model, which runs in the model runner after scheduling, so at schedule time only the slots
    are reserved (k per decoding row, fewer when the budget or the request's room is short)."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        return [PENDING] * max(min(self.k, max_drafts), 0)


@dataclass(slots=True)
class DraftProposals:
    """One step's drafts, by batch row, and the q of the random rows' drafts."""

    token_ids: np.ndarray  # (R, k) int64, -1 past each row's drafts
    q_index: np.ndarray  # (R,) row of `q` holding a random row's q, -1 for the others
    q: torch.Tensor | None  # (N, k, V) float32: q of each random drafting row, per draft

    def test(self, position: int, rows: list[int] | None, device) -> DraftTest | None:
        """The rejection tests at draft `position` (0 = the first draft), for the random rows
        with a draft there (among `rows` when given)."""
        if self.q is None or position >= self.token_ids.shape[1]:
            return None
        has = (self.q_index >= 0) & (self.token_ids[:, position] >= 0)
        if rows is not None:
            among = np.zeros_like(has)
            among[rows] = True
            has &= among
        sel = np.nonzero(has)[0]
        if not len(sel):
            return None
        return DraftTest(
            rows=torch.from_numpy(sel).to(device),
            token_ids=torch.from_numpy(self.token_ids[sel, position]).to(device),
            probs=self.q[torch.from_numpy(self.q_index[sel]).to(device), position],
        )


class DraftModel:
    def __init__(self, model, device: torch.device, num_blocks: int, block_size: int, k: int):
        self.model = model
        self.k = k
        cfg = model.config
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self._q_buf: torch.Tensor | None = None  # reused across steps (grown when needed)

    @torch.inference_mode()
    def propose(self, runner: ModelRunner, num_sched: np.ndarray, num_drafts: np.ndarray,
                num_computed: np.ndarray) -> DraftProposals:
        """Catch up on this step's tokens and draft num_drafts[r] tokens for each row r (batch
        order; num_sched counts the draft slots). Writes the drafts into the batch's token ids
        after each row's known tokens."""
        batch = runner.input_batch
        R = batch.num_reqs
        num_tokens = batch.num_tokens[:R]
        target_end = num_computed + num_sched - num_drafts  # the target's tokens, drafts aside
        drafting = num_drafts > 0
        done = np.minimum(batch.num_draft_computed[:R], num_tokens - 1)
        # A drafting row feeds at least its last token: its logits give the first draft.
        start = np.minimum(done, np.where(drafting, target_end - 1, target_end))
        rows = np.nonzero(target_end > start)[0]
        kmax = int(num_drafts.max()) if R else 0
        token_ids = np.full((R, kmax), PENDING, dtype=np.int64)
        q_index = np.full(R, -1, dtype=np.int64)
        if not len(rows):
            return DraftProposals(token_ids, q_index, None)
        hidden, ends = self._forward(runner, rows, target_end[rows] - start[rows], start[rows])
        batch.num_draft_computed[rows] = target_end[rows]
        draft_rows = np.nonzero(drafting)[0]
        if not len(draft_rows):
            return DraftProposals(token_ids, q_index, None)
        last = ends[np.searchsorted(rows, draft_rows)] - 1
        logits = self.model.compute_logits(hidden[torch.from_numpy(last).to(runner.device)])

        meta = runner.sampling_metadata
        is_greedy = meta.is_greedy.cpu().numpy()
        random_rows = draft_rows[~is_greedy[draft_rows]]
        q = None
        if len(random_rows):
            q = self._q_workspace((len(random_rows), kmax, runner.vocab_size), runner.device)
            q_index[random_rows] = np.arange(len(random_rows))
        first_output = num_tokens - batch.num_prompt_tokens[:R]  # output position of draft 0
        live = draft_rows
        for j in range(kmax):
            if j:
                live = live[num_drafts[live] > j]
                pos = num_tokens[live] + j - 1  # the previous draft, fed back
                hidden, _ = self._forward(runner, live, np.ones(len(live), dtype=np.int64), pos)
                logits = self.model.compute_logits(hidden)
            drafted = self._draw(runner, logits, live, first_output[live] + j, is_greedy,
                                 q, q_index, j)
            token_ids[live, j] = drafted
            batch.token_ids[live, num_tokens[live] + j] = drafted
        batch.num_draft_computed[draft_rows] = num_tokens[draft_rows] + num_drafts[draft_rows] - 1
        return DraftProposals(token_ids, q_index, q)

    def _forward(self, runner: ModelRunner, rows, num_new, start):
        input_ids, pos, attn, _, ends = runner.flat_inputs(rows, num_new, start)
        return self.model(input_ids, pos, attn, self.kv_caches), ends

    def _q_workspace(self, shape, device) -> torch.Tensor:
        n = shape[0] * shape[1] * shape[2]
        if self._q_buf is None or self._q_buf.numel() < n:
            self._q_buf = torch.empty(n, dtype=torch.float32, device=device)
        return self._q_buf[:n].view(shape)

    def _draw(self, runner: ModelRunner, logits: torch.Tensor, rows: np.ndarray,
              positions: np.ndarray, is_greedy: np.ndarray, q: torch.Tensor | None,
              q_index: np.ndarray, j: int) -> np.ndarray:
        """One draft token per row of `logits` (batch rows `rows`): the argmax on greedy rows;
        on random rows a draw from q, which is recorded in q[q_index[row], j]."""
        tokens = logits.argmax(dim=-1).cpu().numpy()
        rand = np.nonzero(~is_greedy[rows])[0]
        if not len(rand):
            return tokens
        dev = runner.device
        r = torch.from_numpy(rows[rand]).to(dev)
        meta = runner.sampling_metadata
        scaled = logits[torch.from_numpy(rand).to(dev)].float() / meta.temperature[r][:, None]
        min_p = torch.from_numpy(runner.input_batch.columns["min_p"][rows[rand]]).to(dev)
        if bool((min_p > 0).any()):  # as MinPProcessor: logit < max + log(min_p) is dropped
            cutoff = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
            scaled.masked_fill_(scaled < cutoff, NEG_INF)
        top_k, top_p = meta.top_k[r], meta.top_p[r]
        need_top_k, need_top_p = bool((top_k > 0).any()), bool((top_p < 1).any())
        seeds, has_seed = meta.seeds[r], meta.has_seed[r]
        pos = torch.from_numpy(positions[rand]).to(dev)
        k = None
        if need_top_k or need_top_p:
            if bool((top_k > 0).all()) and int(top_k.max()) <= TOPK_CANDIDATE_LIMIT:
                k = int(top_k.max())
            else:  # as the sampler: a -inf mask on the full rows rather than a full sort
                scaled = mask_top_k_top_p(scaled, top_k, top_p)
        if k is None:
            probs = torch.softmax(scaled, dim=-1)
            noise = runner.sampler.draw_noise(seeds, has_seed, pos, None, DRAFT_STREAM)
            drawn = race(probs, noise)
        else:
            vals, ids = restrict_top_k_top_p(scaled, top_k, top_p, k, need_top_p)
            cand = torch.softmax(vals, dim=-1)
            noise = runner.sampler.draw_noise(seeds, has_seed, pos, ids, DRAFT_STREAM)
            drawn = ids.gather(1, race(cand, noise)[:, None])[:, 0]
            probs = torch.zeros_like(scaled).scatter_(1, ids, cand)
        q[torch.from_numpy(q_index[rows[rand]]).to(dev), j] = probs
        tokens[rand] = drawn.cpu().numpy()
        return tokens
