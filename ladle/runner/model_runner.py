"""The model runner: turns a SchedulerOutput into one forward pass and one sampler call.

Inputs are built with array ops over the persistent batch (token ids, positions and cache slots
of every scheduled token), the forward runs on the flat token stream, logits are computed only at
each row's last scheduled position (plus prompt positions of rows that asked for prompt
logprobs), and the sampler draws one token per row. Rows still in the middle of their prompt
sample too; the engine discards those tokens.

Speculative decoding: a row with d draft tokens runs its last token plus the drafts in the same
forward, and logits are kept at all 1 + d positions. execute() samples the first position as
always; the engine then calls sample_verify() once per further position, for the rows whose
earlier drafts were all accepted, so every position is sampled by the same sampler with the
state (penalty counts, processors' output lists, grammar) as of the tokens accepted before it.
With a draft model (spec_decode/draft_model.py), execute() first lets it catch up and fill the
draft slots, and random rows test its tokens by rejection sampling at each position."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ladle.engine.scheduler import SchedulerOutput
from ladle.models.gated_deltanet import GatedDeltaNetState, SegmentPlan
from ladle.reasoning import ReasoningConfig
from ladle.runner import cpu_kernels
from ladle.runner.attention import AttentionMetadata, DecodeBatch, build_prefill
from ladle.runner.input_batch import InputBatch
from ladle.sample.logits_processors.custom import load_custom_processors
from ladle.sample.logits_processors.interface import ProcessorConfig
from ladle.sample.metadata import SamplingMetadata
from ladle.sample.rejection import DraftTest
from ladle.sample.sampler import LogprobsTensors, Sampler
from ladle.spec_decode.draft_model import DraftModel, DraftProposals
from ladle.structured_output.manager import StructuredOutputManager, apply_bitmask


@dataclass(slots=True)
class PromptLogprobs:
    """For prompt positions 1..n-1 of one chunk: the top-k and the actual prompt token."""

    start: int  # first prompt position of the chunk (0 for the first chunk)
    token_ids: np.ndarray  # (n, k)
    values: np.ndarray  # (n, k)
    target_values: np.ndarray  # (n,)
    target_ranks: np.ndarray  # (n,)


@dataclass(slots=True)
class RunnerOutput:
    req_ids: list[str]  # row order
    sampled_token_ids: np.ndarray  # (R,) one token per row
    logprob_rows: np.ndarray  # rows that have logprobs, in the order of `logprobs`
    num_logprobs: np.ndarray  # (R,) requested top-k per row, -1 = none
    logprobs: LogprobsTensors | None = None  # on CPU
    # Beam search rows and their candidates, best first: (B,), (B, K) values and token ids.
    beam_rows: np.ndarray | None = None
    beam_values: np.ndarray | None = None
    beam_ids: np.ndarray | None = None
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # (R, V) kept only when asked (tests, debugging)


class ModelRunner:
    def __init__(self, model, device: torch.device, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_model_len: int, seed: int, keep_logits: bool = False,
                 logits_processors: list[str] | None = None,
                 reasoning: ReasoningConfig | None = None, drafter: DraftModel | None = None,
                 batch_invariant: bool = False, num_state_slots: int | None = None):
        self.model = model
        self.drafter = drafter  # speculative decoding's draft model, when configured
        self.draft_proposals: DraftProposals | None = None  # of the current step
        self.device = device
        if device.type == "cpu":
            # Build (or load) the CPU kernels now, so the engine reports ready only when its
            # first step will not stop to compile; a failed build logs and uses torch ops.
            cpu_kernels.load_cpu_kernels()
        dtype = next(model.parameters()).dtype
        if batch_invariant:
            check_batch_invariant(device, dtype)
        cpu_kernels.set_batch_invariant(batch_invariant)
        self.batch_invariant = batch_invariant
        # Prefill chunks up to this context attend as decode-kernel rows (_attention_layout).
        self.prefill_rows_ctx = cpu_kernels.prefill_kernel_max_ctx(
            dtype, device, *cpu_kernels.tile_attention_fit(model))
        self.block_size = block_size
        self.max_model_len = max_model_len
        cfg = model.config
        self.vocab_size = cfg.vocab_size
        # One cache per layer: paged (k, v) blocks, or a hybrid's linear-attention state slots:
        # one per running request and the prefix cache's snapshots (the KV cache manager hands
        # them out; default max_num_seqs, no snapshots).
        self.kv_caches = allocate_kv_caches(cfg, model.num_local_kv_heads, num_blocks,
                                            block_size, dtype, device,
                                            num_slots=num_state_slots or max_num_seqs,
                                            layers=getattr(model, "pp_layers", None))
        self.states = [c for c in self.kv_caches if isinstance(c, GatedDeltaNetState)]
        self.row_slots = np.zeros(max_num_seqs, dtype=np.int64)  # state slot of each batch row
        # Prefix-cache snapshot of each row this step: tokens into its chunk (0: none), slot.
        self.row_snap_len = np.zeros(max_num_seqs, dtype=np.int64)
        self.row_snap_slot = np.full(max_num_seqs, -1, dtype=np.int64)
        self.max_num_seqs = max_num_seqs
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.logits_processor_names = list(logits_processors or [])
        self.reasoning = reasoning
        self.keep_logits = keep_logits
        # Logits at the draft positions of the last step: (drafts, V), and per row the index of
        # its first draft position there (-1: no drafts).
        self.verify_logits: torch.Tensor | None = None
        self.verify_start = np.zeros(0, dtype=np.int64)
        self.reset_batch()

    def reset_batch(self) -> None:
        """A fresh persistent batch, sampler and logits processors: every request re-enters
        the batch on its next step with its state rebuilt from its tokens (as after a
        preemption). The engine calls this after a step raised, when the row state of the batch
        or of a processor may be half-updated."""
        vocab_size = self.vocab_size
        max_blocks = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(self.max_num_seqs, self.max_model_len, max_blocks)
        pcfg = ProcessorConfig(vocab_size, self.device, self.max_num_seqs)
        self.custom_processors = load_custom_processors(self.logits_processor_names, pcfg)
        self.sampler = Sampler.build(vocab_size, self.device, self.max_num_seqs, self.generator,
                                     self.reasoning, self.custom_processors)
        self.sampling_metadata: SamplingMetadata | None = None
        if getattr(self, "states", None):  # writes of a step that raised
            self._state_op("discard")

    @staticmethod
    def kv_bytes_per_block(model_config, dtype: torch.dtype, block_size: int,
                           num_kv_heads: int | None = None, num_layers: int | None = None
                           ) -> int:
        """Bytes of one block over all layers; `num_kv_heads`: the heads this process holds
        (a tensor-parallel rank's share), default all of the model's; `num_layers`: the KV
        layers it holds (a pipeline stage's), default all of them."""
        c = model_config
        elem = torch.empty((), dtype=dtype).element_size()
        heads = c.num_kv_heads if num_kv_heads is None else num_kv_heads
        layers = _num_kv_layers(c) if num_layers is None else num_layers
        return 2 * layers * block_size * heads * c.head_dim * elem

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv_blocks: dict[str, list[int]],
                structured: StructuredOutputManager | None = None,
                state_slots: dict[str, int] | None = None) -> RunnerOutput:
        """One step. `state_slots`: each request's state slot (hybrid models); the slots'
        new states are kept only when the whole step succeeds."""
        batch = self.input_batch
        update = batch.update(sched.scheduled, reset={r.req_id for r in sched.preempted})
        self.sampler.update_state(update)
        if update is not None or self.sampling_metadata is None:
            self.sampling_metadata = SamplingMetadata.from_columns(
                batch.columns, batch.num_reqs, self.device, batch.beam_candidates
            )
        meta = self.sampling_metadata
        R = batch.num_reqs
        reqs = batch.requests[:R]
        drafts = sched.draft_token_ids
        num_drafts = np.zeros(R, dtype=np.int64)
        for row, req in enumerate(reqs):
            batch.set_blocks(row, kv_blocks[req.req_id])
            if self.states:
                self.row_slots[row] = state_slots[req.req_id]
                self.row_snap_len[row], self.row_snap_slot[row] = \
                    sched.snapshots.get(req.req_id, (0, -1))
            if req.req_id in drafts:
                num_drafts[row] = len(drafts[req.req_id])
        num_sched = np.array([sched.num_scheduled_tokens[r.req_id] for r in reqs], dtype=np.int64)
        num_computed = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        self.draft_proposals = None
        if self.drafter is not None:
            # The draft model catches up on this step's tokens and fills the reserved draft
            # slots (the scheduler's lists, shared with the requests) before the target runs.
            self.draft_proposals = self.drafter.propose(self, num_sched, num_drafts, num_computed)
            for row in np.nonzero(num_drafts)[0]:
                drafts[reqs[row].req_id][:] = \
                    self.draft_proposals.token_ids[row, :num_drafts[row]].tolist()
        for row in np.nonzero(num_drafts)[0]:
            batch.write_drafts(row, drafts[reqs[row].req_id])

        # Flat token layout: row r contributes num_sched[r] tokens starting at num_computed[r].
        input_ids, pos, attn, starts, ends = self.flat_inputs(np.arange(R), num_sched,
                                                              num_computed, num_drafts > 0)
        # Grammar bitmasks are filled in a worker thread while the forward runs.
        samples_output = (num_computed + num_sched >= batch.num_tokens[:R]).tolist()
        mask_job = structured.submit_bitmask(reqs, samples_output) if structured else None
        hidden = self._forward(input_ids, pos, attn, num_sched, num_computed, num_drafts)
        last = ends - 1 - num_drafts  # each row's last known token: it samples the next one
        # (Rising within [0, T): T of them are every position, so no gather.)
        every = len(last) == ends[-1]
        logits = self.model.compute_logits(
            hidden, None if every else torch.from_numpy(last).to(self.device))
        self._keep_verify_logits(hidden, last, num_drafts)
        kept = logits.float().clone() if self.keep_logits else None
        if meta.beam_rows is not None:
            # Beams score tokens as transformers does: log_softmax of the raw float32 logits (its
            # own rounding: x - max - log(sum), not x - logsumexp), then the grammar mask and
            # the processors. (index_select / index_copy_: advanced indexing is slow on CPU.)
            logits = logits.float()
            rows = meta.beam_rows
            logits.index_copy_(0, rows, torch.log_softmax(logits.index_select(0, rows), dim=-1))
        if mask_job is not None:
            apply_bitmask(logits, *mask_job.result())
        prompt_lp = self._prompt_logprobs(hidden, reqs, num_sched, num_computed, starts)
        output_positions = torch.from_numpy(
            batch.num_tokens[:R] - batch.num_prompt_tokens[:R]
        ).to(self.device)
        out = self.sampler(logits, meta, output_positions, draft=self._draft_test(0))
        lp = out.logprobs
        if lp is not None:
            lp = LogprobsTensors(lp.token_ids.cpu(), lp.values.cpu(), lp.sampled_values.cpu(),
                                 lp.sampled_ranks.cpu())
        beam = (None, None, None)
        if out.beam is not None:
            beam = (meta.beam_rows.cpu().numpy(), out.beam[0].cpu().numpy(),
                    out.beam[1].cpu().numpy())
        if self.states:  # the step succeeded: its requests' states move on
            self._state_op("commit")
        return RunnerOutput(
            req_ids=[r.req_id for r in reqs],
            sampled_token_ids=out.sampled_token_ids.cpu().numpy(),
            logprob_rows=meta.logprob_rows.cpu().numpy(),
            num_logprobs=meta.num_logprobs,
            logprobs=lp,
            beam_rows=beam[0],
            beam_values=beam[1],
            beam_ids=beam[2],
            prompt_logprobs=prompt_lp,
            logits=kept,
        )

    def _keep_verify_logits(self, hidden, last: np.ndarray, num_drafts: np.ndarray) -> None:
        """Logits at every draft position (the positions after each row's last token)."""
        self.verify_logits = None
        if not num_drafts.any():
            return
        rows = np.nonzero(num_drafts)[0]
        flat = np.concatenate([np.arange(last[r] + 1, last[r] + 1 + num_drafts[r]) for r in rows])
        self.verify_logits = self.model.compute_logits(hidden,
                                                       torch.from_numpy(flat).to(self.device))
        self.verify_start = np.full(len(last), -1, dtype=np.int64)
        self.verify_start[rows] = np.cumsum(num_drafts[rows]) - num_drafts[rows]

    @torch.inference_mode()
    def sample_verify(self, position: int, rows: list[int],
                      structured: StructuredOutputManager | None = None) -> RunnerOutput:
        """Sample draft position `position` (1 = the token after the first draft) for `rows`,
        whose drafts before it were all accepted, exactly as a plain decode step would: same
        processors, penalties, grammar bitmask and seeded noise for that output position. The
        other rows get neutral logits and their samples mean nothing."""
        batch = self.input_batch
        meta = self.sampling_metadata
        R = batch.num_reqs
        idx = torch.from_numpy(self.verify_start[rows] + position - 1).to(self.device)
        logits = torch.zeros((R, self.vocab_size), dtype=self.verify_logits.dtype,
                             device=self.device)
        logits[torch.tensor(rows, device=self.device)] = self.verify_logits[idx]
        if structured is not None:
            active = np.zeros(R, dtype=bool)
            active[rows] = True
            job = structured.submit_bitmask(batch.requests[:R], active.tolist())
            if job is not None:
                apply_bitmask(logits, *job.result())
        output_positions = torch.from_numpy(
            batch.num_tokens[:R] - batch.num_prompt_tokens[:R]
        ).to(self.device)
        out = self.sampler(logits, meta, output_positions, verify=True,
                           draft=self._draft_test(position, rows))
        lp = out.logprobs
        if lp is not None:
            lp = LogprobsTensors(lp.token_ids.cpu(), lp.values.cpu(), lp.sampled_values.cpu(),
                                 lp.sampled_ranks.cpu())
        return RunnerOutput(
            req_ids=[r.req_id for r in batch.requests[:R]],
            sampled_token_ids=out.sampled_token_ids.cpu().numpy(),
            logprob_rows=meta.logprob_rows.cpu().numpy(),
            num_logprobs=meta.num_logprobs,
            logprobs=lp,
        )

    def _prompt_logprobs(self, hidden, reqs, num_sched, num_computed, starts):
        """Raw logprobs of each prompt token given the tokens before it, for the rows that
        asked, computed on this step's chunk of their prompt."""
        out: dict[str, PromptLogprobs] = {}
        for row, req in enumerate(reqs):
            k = req.sampling_params.prompt_logprobs
            n_prompt = req.num_prompt_tokens
            s = int(num_computed[row])
            e = min(s + int(num_sched[row]), n_prompt - 1)  # positions predicting a prompt token
            if k is None or e <= s:
                continue
            flat = torch.arange(int(starts[row]), int(starts[row]) + e - s, device=self.device)
            lps = torch.log_softmax(self.model.compute_logits(hidden, flat).float(), dim=-1)
            targets = torch.tensor(req.prompt_token_ids[s + 1 : e + 1], device=self.device)
            target_vals = lps.gather(1, targets[:, None])[:, 0]
            ranks = (lps > target_vals[:, None]).sum(-1) + 1
            vals, ids = lps.topk(k, dim=-1) if k else (lps[:, :0], targets[:, None][:, :0])
            out[req.req_id] = PromptLogprobs(s, ids.cpu().numpy(), vals.cpu().numpy(),
                                             target_vals.cpu().numpy(), ranks.cpu().numpy())
        return out

    def _forward(self, input_ids, pos, attn, num_sched: np.ndarray, num_computed: np.ndarray,
                 num_drafts: np.ndarray) -> torch.Tensor:
        """The step's forward. Under pipeline parallelism (a model with `micro_batches` > 1)
        the rows are cut into up to that many runs of about equal tokens, each with its own
        inputs, so the stages work on different runs at once; the hidden states come back in
        the flat layout of all rows. A hybrid's state slots are planned for the whole step, so
        it runs as one part."""
        parts = min(getattr(self.model, "micro_batches", 1), len(num_sched))
        if parts <= 1 or self.states:
            return self.model(input_ids, pos, attn, self.kv_caches)
        ends = np.cumsum(num_sched)
        # Row i starts a new run where the tokens before it first pass k / parts of the total.
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="left") + 1
        cuts = np.unique(np.clip(cuts, 1, len(num_sched) - 1))
        runs = np.split(np.arange(len(num_sched)), cuts)
        drafted = num_drafts > 0
        inputs = [self.flat_inputs(rows, num_sched[rows], num_computed[rows], drafted[rows])[:3]
                  for rows in runs]
        return self.model.forward_micro_batches(inputs, self.kv_caches)

    def flat_inputs(self, rows: np.ndarray, num_new: np.ndarray, start: np.ndarray,
                    drafted: np.ndarray | None = None):
        """The flat token stream where batch row rows[i] contributes num_new[i] of its tokens
        from position start[i]: input ids and positions (device tensors), attention metadata,
        and each row's [start, end) in the stream (numpy). The draft model builds its inputs
        here too (same block table). `drafted`: the rows verifying drafts (a hybrid keeps their
        state after every position)."""
        batch = self.input_batch
        ends = np.cumsum(num_new)
        starts = ends - num_new
        T = int(ends[-1])
        if T == len(rows) and not self.states:  # (each row brings at least one)
            return self._decode_inputs(rows, start.copy(), starts, ends)
        local = np.repeat(np.arange(len(rows)), num_new)
        row_of = rows[local]
        pos = start[local] + (np.arange(T) - starts[local])
        bs = self.block_size
        attn = AttentionMetadata(
            slot_blocks=torch.from_numpy(batch.block_table[row_of, pos // bs]).to(self.device),
            slot_offsets=torch.from_numpy(pos % bs).to(self.device),
            **self._attention_layout(rows, num_new, start, starts),
        )
        if self.states:  # a fresh state for a sequence's first tokens, else its slot's
            attn.states = SegmentPlan.from_arrays(starts, num_new, self.row_slots[rows],
                                                  start == 0, drafted, self.device,
                                                  self.row_snap_len[rows],
                                                  self.row_snap_slot[rows])
        return (torch.from_numpy(batch.token_ids[row_of, pos]).to(self.device),
                torch.from_numpy(pos).to(self.device), attn, starts, ends)

    def _decode_inputs(self, rows: np.ndarray, pos: np.ndarray, starts: np.ndarray,
                       ends: np.ndarray):
        """flat_inputs where every row brings one token (at pos[i]), as its general layout
        gives them: the step's tokens are the rows, all attending as decode rows. (A decode
        step runs this every time: a dozen fewer numpy calls, each some microseconds with the
        caches cold from streaming the weights; 122 -> 73 us on a 2-core Zen 4.)"""
        table, bs, dev = self.input_batch.block_table, self.block_size, self.device
        ctx = pos + 1
        decode = DecodeBatch(
            rows=torch.from_numpy(starts).to(dev),
            block_table=torch.from_numpy(table[rows, :-(-int(ctx.max()) // bs)]).to(dev),
            ctx_lens=torch.from_numpy(ctx).to(dev),
        )
        attn = AttentionMetadata(slot_blocks=torch.from_numpy(table[rows, pos // bs]).to(dev),
                                 slot_offsets=torch.from_numpy(pos % bs).to(dev),
                                 decode=decode, prefills=[])
        return (torch.from_numpy(self.input_batch.token_ids[rows, pos]).to(dev),
                torch.from_numpy(pos).to(dev), attn, starts, ends)

    def _attention_layout(self, batch_rows, num_sched, num_computed, starts) -> dict:
        """Decode rows attend in one batched call of the paged decode kernel, and with them the
        prefill chunks (and verifications) whose context is at most prefill_rows_ctx, each
        query a row: the query at position p attends to the cached positions 0..p (the chunk's
        keys are in the cache by then), reduced in one order whatever the step holds. Longer
        chunks run one SDPA call each. In batch-invariant mode every token is such a row, so a
        position's result does not depend on the chunk it came in."""
        ctx = num_computed + num_sched
        bs = self.block_size
        table = self.input_batch.block_table
        as_rows = (num_sched == 1) | (ctx <= self.prefill_rows_ctx)
        if cpu_kernels.batch_invariant():
            as_rows[:] = True
        decode = None
        sel = np.nonzero(as_rows)[0]
        if len(sel):
            n = num_sched[sel]
            local = np.repeat(sel, n)  # batch row of each token
            offs = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # its index in its row
            token_ctx = np.repeat(num_computed[sel], n) + offs + 1
            num_blocks = -(-int(token_ctx.max()) // bs)
            decode = DecodeBatch(
                rows=torch.from_numpy(np.repeat(starts[sel], n) + offs).to(self.device),
                block_table=torch.from_numpy(table[batch_rows[local], :num_blocks]).to(self.device),
                ctx_lens=torch.from_numpy(token_ctx).to(self.device),
            )
        prefills = [
            build_prefill(int(starts[r]), int(num_sched[r]), int(ctx[r]),
                          torch.from_numpy(table[batch_rows[r], : -(-int(ctx[r]) // bs)]), bs,
                          self.device)
            for r in np.nonzero(~as_rows)[0]
        ]
        return {"decode": decode, "prefills": prefills}

    def _draft_test(self, position: int, rows: list[int] | None = None) -> DraftTest | None:
        """The draft-model tokens to test by rejection sampling at draft `position` (random rows
        with a draft there; among `rows` when given). None without a draft model."""
        proposals = self.draft_proposals
        return None if proposals is None else proposals.test(position, rows, self.device)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer: a forked beam's private copy of
        its parent's last partial block. Tensor-parallel workers copy their shards too."""
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        copy_kv_blocks(self.kv_caches, src, dst)
        copy_remote = getattr(self.model, "copy_kv_blocks", None)
        if copy_remote is not None:
            copy_remote(src, dst)

    @torch.inference_mode()
    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """(source, destination) state slots: a prefix-cache hit's request slot takes the
        snapshot of its last cached block, in every linear layer."""
        self._state_op("copy", copies)

    @torch.inference_mode()
    def settle_states(self, kept: dict[int, int]) -> None:
        """After verification: state slot -> tokens of its speculative step that were kept
        (the last known token and the accepted drafts); each slot takes its state after them."""
        self._state_op("settle", kept)

    def _state_op(self, op: str, arg=None) -> None:
        """A state operation on this process's linear layers and, tensor-parallel, on the
        workers' (each holds the state of its own heads)."""
        apply_state_op(self.states, op, arg)
        remote = getattr(self.model, "state_op", None)
        if remote is not None:
            remote(op, arg)

    @torch.inference_mode()
    def accept_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append the tokens the engine accepted (one per listed row) to the batch state."""
        self.input_batch.append_tokens(rows, token_ids)
        self.sampler.accept(torch.from_numpy(rows).to(self.device),
                            torch.from_numpy(token_ids).to(self.device))


def check_batch_invariant(device: torch.device, dtype: torch.dtype) -> None:
    """Batch-invariant mode runs on the CPU kernels (the linears, attention and sampler whose
    reduction order it fixes); elsewhere it is an error, not a promise quietly broken."""
    if device.type != "cpu":
        raise ValueError(f"batch_invariant: runs on the CPU kernels; the device is {device}. "
                         "Accepted: --device cpu, or leave --batch-invariant off")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"batch_invariant: the CPU kernels run bfloat16 and float32; the model "
                         f"is {dtype}. Accepted: --dtype bfloat16 or float32")
    if cpu_kernels.load_cpu_kernels() is None:
        raise ValueError("batch_invariant: the CPU kernels are unavailable (disabled by "
                         "LADLE_DISABLE_CPU_KERNELS or their build failed; see the log above). "
                         "Accepted: a machine where they build, or leave --batch-invariant off")


def copy_kv_blocks(kv_caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    for cache in kv_caches:
        if isinstance(cache, tuple):  # (a hybrid's state slots are not blocks)
            k, v = cache
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))


def apply_state_op(states: list[GatedDeltaNetState], op: str, arg=None) -> None:
    """commit / discard a step's writes, settle (slot -> tokens kept) speculative rows, copy
    [(source, destination)] slots: on every linear layer's state."""
    for state in states:
        if op == "commit":
            state.commit()
        elif op == "discard":
            state.discard()
        elif op == "settle":
            state.settle(arg)
        elif op == "copy":
            for src, dst in arg:
                state.copy_slot(src, dst)
        else:
            raise ValueError(f"state operation {op!r}; accepted: commit, discard, settle, copy")


def _num_kv_layers(model_config) -> int:
    """Layers with paged KV: all of them, but a hybrid's full-attention layers only."""
    return getattr(model_config, "num_kv_layers", model_config.num_layers)


def allocate_kv_caches(model_config, num_kv_heads: int, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device, num_slots: int = 0,
                       layers: range | None = None) -> list:
    """One cache per layer: a (k, v) pair, each (num_blocks, num_kv_heads, block_size, D), or
    for a hybrid's linear-attention layer a GatedDeltaNetState of `num_slots` slots whose
    writes wait for commit(); zeros. `layers`: a pipeline stage's, the others get None."""
    shape = (num_blocks, num_kv_heads, block_size, model_config.head_dim)
    kinds = getattr(model_config, "layer_types", None) or ("full_attention",) * \
        model_config.num_layers
    caches = [None if layers is not None and i not in layers else
              GatedDeltaNetState.allocate(model_config.linear, num_slots, device, deferred=True)
              if kind == "linear_attention" else
              (torch.empty(shape, dtype=dtype, device=device),
               torch.empty(shape, dtype=dtype, device=device))
              for i, kind in enumerate(kinds)]
    # Zeros. Attention reads a sequence's blocks from wherever the free list put them (after
    # hours of traffic, anywhere in the cache): on the CPU they live on 2 MiB pages, which the
    # TLB covers (a 2-core Xeon, Qwen3-0.6B heads, a layer's decode attention over blocks
    # scattered at random, after 32 MB of weights streamed: one sequence of 4000 tokens 797 ->
    # 693 us, 16 of 1000 tokens 2344 -> 2191; a fresh engine's consecutive blocks read the same
    # either way). Written once at start either way (zeroed there, or here).
    kv = [t for c in caches if isinstance(c, tuple) for t in c]
    if not cpu_kernels.tensors_to_huge_pages(kv, zero=True):
        for t in kv:
            t.zero_()
    return caches
