"""EngineCore: owns the scheduler, the KV-cache manager and the model runner, and steps them.

One step is three verbs: schedule, execute, update. It knows tokens only; text (detokenizing,
stop strings) is the frontend's job. The API server drives it from a separate process; the
offline LLM drives it in-process. Both call add_request / abort_request / step."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ladle.config import (
    EngineConfig,
    check_priority,
    kv_cache_bytes,
    kv_cache_bytes_from_utilization,
)
from ladle.distributed.group import WorkerGroupError
from ladle.distributed.kv_transfer import check_kv_transfer_params, make_connector
from ladle.engine.beam_search import BeamGroup, Continuation
from ladle.engine.kv_cache_manager import KVCacheManager
from ladle.engine.request import FinishReason, Request, RequestStatus
from ladle.engine.scheduler import Scheduler, SchedulerOutput
from ladle.messages import EngineCoreOutput, EngineCoreRequest, Logprobs
from ladle.models.loader import (
    check_quantization,
    load_model,
    model_class,
    read_hf_config,
    resolve_dtype,
    resolve_model_path,
)
from ladle.models.registry import SERVED_LEN_KEY
from ladle.reasoning import ReasoningConfig
from ladle.runner import cpu_kernels
from ladle.runner.model_runner import ModelRunner, RunnerOutput
from ladle.runner.quant import weight_bytes
from ladle.sampling_params import RequestLimits
from ladle.spec_decode.draft_model import DraftModel, DraftSlots
from ladle.spec_decode.ngram import NgramProposer
from ladle.structured_output.manager import GrammarRejectedError, StructuredOutputManager
from ladle.tokenizer import eos_token_ids, has_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, keep_logits: bool = False):
        self.config = config
        device = config.torch_device()
        self.model_path = resolve_model_path(config.model)
        # With the served context (registry.SERVED_LEN_KEY): Phi-3's LongRoPE depends on it.
        hf_config = {**read_hf_config(self.model_path), SERVED_LEN_KEY: config.max_model_len}
        check_quantization(self.model_path, config.quantization, hf_config,
                           config.tensor_parallel_size)
        self.dtype = resolve_dtype(config.dtype, hf_config, device)
        # Hybrid models: linear-attention layers with per-request state slots.
        self.hybrid = bool(getattr(model_class(hf_config, self.model_path), "hybrid", False))
        torch.manual_seed(config.seed)
        # Rank 0's driver of the worker ranks when tensor or pipeline parallel size is > 1.
        self.model_group = None
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            from ladle.distributed.executor import TensorParallelModel

            model = self.model_group = TensorParallelModel(
                self.model_path, hf_config, self.dtype, device, config.tensor_parallel_size,
                config.distributed_executor_backend, config.distributed_timeout,
                config.batch_invariant, config.pipeline_parallel_size,
                config.pp_layer_partition, config.quantization)
        else:
            model = load_model(self.model_path, hf_config, self.dtype, device,
                               quantization=config.quantization)
        try:
            self._init_rest(config, model, device, hf_config, keep_logits)
        except BaseException:
            self.close()
            raise

    def _init_rest(self, config, model, device, hf_config, keep_logits) -> None:
        mcfg = model.config
        # Rank 0's weights (its shard under tensor parallelism), by storage type: logged here,
        # sent once in the ready message for /metrics.
        self.weight_bytes = weight_bytes(model if self.model_group is None else model.model)
        logger.info("weights: %s", describe_bytes(self.weight_bytes))
        self.vocab_size = mcfg.vocab_size
        self.limits = RequestLimits(self.vocab_size, config.max_logprobs, config.max_n,
                                    beam_search=not self.hybrid)
        is_auto_len = config.max_model_len == -1  # "auto": shrunk below to what the KV holds
        self.max_model_len = (None if is_auto_len else config.max_model_len) or \
            mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({mcfg.max_position_embeddings})"
            )
        bs = config.block_size
        # Under pipeline parallelism each stage holds its own layers' KV, and every stage the
        # same number of blocks: sized by the stage with the most KV layers.
        per_block = ModelRunner.kv_bytes_per_block(
            mcfg, self.dtype, bs, model.num_local_kv_heads,
            getattr(model, "max_stage_kv_layers", None) if self.model_group else None)
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = _load_draft_model(spec.model, self.vocab_size, self.max_model_len,
                                      self.dtype, device)
            # The draft's cache has the same blocks (see spec_decode/draft_model.py): the KV
            # memory is shared between the two caches, block for block.
            per_block += ModelRunner.kv_bytes_per_block(draft.config, self.dtype, bs)
        # A hybrid's state slots (one per running request, every linear layer, and the prefix
        # cache's snapshots) come out of the same memory as the KV blocks.
        num_snapshots = 0
        if self.hybrid and config.enable_prefix_caching:
            num_snapshots = config.max_num_seqs if config.prefix_state_slots is None else \
                config.prefix_state_slots
        num_state_slots = config.max_num_seqs + num_snapshots if self.hybrid else 0
        state_bytes = mcfg.state_bytes_per_slot() * num_state_slots if self.hybrid else 0
        needed = per_block * -(-self.max_model_len // bs) * config.max_num_seqs + state_bytes
        if config.num_kv_blocks is None and config.kv_cache_memory is None and \
                config.gpu_memory_utilization is not None:
            held = sum(self.weight_bytes.values()) + (
                0 if draft is None else sum(weight_bytes(draft).values()))
            budget = kv_cache_bytes_from_utilization(
                config.gpu_memory_utilization, device, held, needed)
        else:
            budget = None if config.num_kv_blocks else \
                kv_cache_bytes(config.kv_cache_memory, device, needed)
        if budget is not None and budget < state_bytes:
            raise ValueError(
                f"kv_cache_memory: {budget / 2**20:.1f} MiB, but the state slots of "
                f"max_num_seqs={config.max_num_seqs} requests and prefix_state_slots="
                f"{num_snapshots} snapshots take {state_bytes / 2**20:.1f} MiB "
                f"({mcfg.state_bytes_per_slot() / 2**20:.2f} MiB each) before any KV block; "
                "give more memory or lower max_num_seqs or prefix_state_slots")
        num_blocks = config.num_kv_blocks or (budget - state_bytes) // per_block
        if is_auto_len and num_blocks * bs < self.max_model_len:
            logger.info("max_model_len auto: %d tokens (what %d KV blocks hold)",
                        num_blocks * bs, num_blocks)
            self.max_model_len = num_blocks * bs
        min_blocks = -(-self.max_model_len // bs)
        if num_blocks < min_blocks:
            raise ValueError(
                f"kv_cache_memory: room for {num_blocks} blocks of {bs} tokens, but one request "
                f"of max_model_len={self.max_model_len} needs {min_blocks}; give more memory or "
                "lower max_model_len"
            )
        prefix_caching = config.enable_prefix_caching and (not self.hybrid or num_snapshots > 0)
        if self.hybrid:
            logger.info("state slots: %d (max_num_seqs) + %d prefix-cache snapshots of %.2f "
                        "MiB, %.1f MiB in all", config.max_num_seqs, num_snapshots,
                        mcfg.state_bytes_per_slot() / 2**20, state_bytes / 2**20)
        self.kv_cache = KVCacheManager(num_blocks, bs, prefix_caching,
                                       config.max_num_seqs if self.hybrid else 0, num_snapshots)
        if self.model_group is not None:
            # every rank: the same blocks and state slots
            self.model_group.init_kv_cache(num_blocks, bs, num_state_slots)
        proposer = drafter = None
        if draft is not None:
            proposer = DraftSlots(spec.num_speculative_tokens)
            drafter = DraftModel(draft, device, num_blocks, bs, spec.num_speculative_tokens)
        elif spec is not None:
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                     spec.num_speculative_tokens)
        # Prefill/decode disaggregation: the connector reads and writes this process's cache.
        self.kv_connector = None
        if config.kv_transfer_config is not None:
            if self.model_group is not None or self.hybrid:
                raise ValueError(
                    "kv_transfer_config: prefill/decode disaggregation needs the whole model in "
                    "the engine process (no -tp / -pp) and a paged KV cache (not a hybrid "
                    "model's state slots)")
            self.kv_connector = make_connector(config.kv_transfer_config, bs)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            proposer, self.kv_connector,
        )
        # Speculative decoding counters: drafts proposed and accepted, and accepted per draft
        # position (index 0 = the first draft of a step).
        self.spec_k = 0 if spec is None else spec.num_speculative_tokens
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafted_steps = 0  # (request, step) pairs that had drafts
        self.accepted_per_position = [0] * self.spec_k
        self._undrafted_logged: set[str] = set()
        # The engine needs the tokenizer only for facts about the vocabulary (thinking tokens,
        # grammars); text never passes through this process. A checkpoint without tokenizer
        # files still serves token-id requests.
        tok_path = config.tokenizer or self.model_path
        self.tokenizer = load_tokenizer(tok_path) if has_tokenizer(tok_path) else None
        self.reasoning = ReasoningConfig.from_tokenizer(config.reasoning_parser, self.tokenizer)
        self.runner = ModelRunner(model, device, num_blocks, bs, config.max_num_seqs,
                                  self.max_model_len, config.seed, keep_logits,
                                  config.logits_processors, self.reasoning, drafter,
                                  config.batch_invariant, num_state_slots)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.runner.kv_caches)
        eos = _eos_ids(self.tokenizer, self.model_path)
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, eos, config.structured_outputs_backend,
            self.reasoning, config.max_num_seqs, config.structured_outputs_compile_timeout,
            config.structured_outputs_cache_bytes, overlap_fill=device.type != "cpu")
        self.structured.warm_up()  # before ready, not inside the first constrained step
        self.hf_config = hf_config
        # Beam searches (engine/beam_search.py), by their request id and by each output id.
        self.beam_groups: dict[str, BeamGroup] = {}
        self.num_steps = 0
        self.num_failed_runs = 0  # batches that raised (then split to find the request at fault)
        self.num_failed_requests = 0  # requests ended by an exception only they caused
        self.last_logits = None  # (R, V) of the last step when keep_logits (tests)
        self.last_req_ids: list[str] = []
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, bs,
                    num_blocks * per_block / 2**20)

    def check_health(self) -> None:
        """Raises WorkerGroupError when a tensor-parallel worker is gone (the engine must
        stop); a no-op on one rank."""
        if self.model_group is not None:
            self.model_group.check_workers()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and leave batch-invariant mode (process-wide:
        a later engine or kernel call in this process starts from the default). The engine
        cannot step afterwards."""
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.close()
        if getattr(self, "runner", None) is not None and self.runner.batch_invariant:
            cpu_kernels.set_batch_invariant(False)
        if self.model_group is not None:
            self.model_group.close()
            self.model_group = None

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue a request. ValueError names the field at fault."""
        if req.req_id in self.scheduler.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        params = req.sampling_params
        n_prompt = len(req.prompt_token_ids)
        if n_prompt == 0:
            raise ValueError("prompt: must contain at least one token")
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt: {n_prompt} tokens, but max_model_len is {self.max_model_len}; the "
                "prompt must leave room for at least one output token"
            )
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id(s) {bad[:5]} outside the vocabulary (0 to "
                             f"{self.vocab_size - 1})")
        params.verify_for_model(self.limits)
        check_priority(req.priority, self.config.scheduling_policy)
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError("bad_words: not tokenised; call SamplingParams.update_from_tokenizer "
                             "in the frontend before sending the request")
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise ValueError("thinking_token_budget: needs a reasoning parser (start the engine "
                             "with --reasoning-parser) to know when thinking starts and ends")
        for proc in self.runner.custom_processors:
            proc.validate_params(params)
        request = Request(req.req_id, req.prompt_token_ids, params, req.eos_token_ids,
                          req.priority, req.cache_salt, req.arrival_time)
        if self.spec_k:
            request.can_draft = self._can_draft(params)
        room = self.max_model_len - n_prompt
        request.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if req.kv_transfer_params is not None:
            request.kv_transfer_params = check_kv_transfer_params(req.kv_transfer_params)
            if self.kv_connector is None:
                raise ValueError("kv_transfer_params: this server has no --kv-transfer-config "
                                 "(start it as a prefill or decode server to use them)")
        if params.beam_width:
            self._add_beam_group(req, request)
        if params.structured_outputs is not None:
            self.structured.add_request(request)  # compiles in the background
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.scheduler.add_request(request)

    def _add_beam_group(self, req: EngineCoreRequest, request: Request) -> None:
        """The request starts a beam search: it is the group's first beam (its prompt is
        prefilled once; the first step forks it into the other beams)."""
        n = request.sampling_params.n
        output_ids = req.output_ids or ([f"{req.req_id}-{i}" for i in range(n)] if n > 1
                                        else [req.req_id])
        if len(output_ids) != n:
            raise ValueError(f"output_ids: {len(output_ids)} given for n={n}")
        taken = [i for i in output_ids if i in self.beam_groups and i != req.req_id]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        group = BeamGroup(req.req_id, output_ids, request.sampling_params, request.eos_token_ids,
                          request.max_tokens, self.max_model_len, len(req.prompt_token_ids),
                          self.vocab_size)
        request.beam = group
        request.beam_candidates = group.num_candidates
        request.can_draft = False
        group.running.append(request)
        for i in {req.req_id, *output_ids}:
            self.beam_groups[i] = group

    def _can_draft(self, params) -> bool:
        """False when a custom processor that cannot see draft positions applies to the
        request: it then decodes one token per step (logged once per processor)."""
        for proc in self.runner.custom_processors:
            if not proc.supports_positions() and proc.applies_to(params):
                name = type(proc).__qualname__
                if name not in self._undrafted_logged:
                    self._undrafted_logged.add(name)
                    logger.warning("logits processor %s does not declare supports_positions(); "
                                   "the requests it applies to run without speculative drafts",
                                   name)
                return False
        return True

    def abort_request(self, req_id: str) -> None:
        group = self.beam_groups.get(req_id)
        if group is not None:
            for beam in group.running:
                self.structured.abort(beam)
            self._end_beam_group(group, RequestStatus.FINISHED_ABORTED)
            return
        req = self.scheduler.requests.get(req_id)
        if req is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self.structured.abort(req)  # a compile only it waited for is cancelled

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------
    def release_transfers(self) -> bool:
        """Blocks held for a decode server that has read them (or timed out) go back; whether
        any did (the engine loop calls this while idle too)."""
        return self.scheduler.release_transfers()

    def step(self) -> list[EngineCoreOutput]:
        self.scheduler.release_transfers()
        sched = self.scheduler.schedule()
        failed = [EngineCoreOutput(req_id=r.req_id, new_token_ids=[],
                                   finish_reason=int(FinishReason.ERROR), error=r.error,
                                   is_server_error=r.is_server_error)
                  for r in sched.failed]
        if sched.is_empty:
            if self.scheduler.waiting:  # only grammars still compiling: wait, do not spin
                self.structured.wait_for_compiles(timeout=0.005)
            return failed
        if sched.state_copies:  # prefix-cache hits of a hybrid: their state, before the step
            self.runner.copy_states(sched.state_copies)
        if self.kv_connector is not None:  # the prefill server's KV, before the forward
            for req_id, why in self.kv_connector.start_load_kv().items():
                req = self.scheduler.requests[req_id]
                failed += self._fail(req, RuntimeError(why))
                sched = _sub_schedule(sched, [r for r in sched.scheduled if r is not req])
            if sched.is_empty:
                return failed
        outputs = self._execute_isolating(sched)
        self.num_steps += 1
        return failed + outputs

    def _execute_isolating(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """Run one batch; if it raises, find the request(s) it raised for. The runner's batch
        state is rebuilt, the batch is split in halves and each half runs again, down to single
        requests: a request that fails alone ends with an error (blocks freed), every other one
        gets its token as if nothing happened. Nothing of a failed run is kept: tokens are only
        accepted, and blocks only published to the prefix cache, after a run succeeds. A device
        fault (state unknown) is re-raised and ends the engine."""
        try:
            blocks = {r.req_id: self.kv_cache.get_blocks(r.req_id) for r in sched.scheduled}
            slots = {r.req_id: self.kv_cache.get_slot(r.req_id) for r in sched.scheduled} \
                if self.hybrid else None
            out = self.runner.execute(sched, blocks, self.structured, slots)
        except Exception as e:
            if is_device_fault(e):
                raise
            self.num_failed_runs += 1
            self.runner.reset_batch()
            if len(sched.scheduled) == 1:
                return self._fail(sched.scheduled[0], e)
            logger.warning("a step of %d requests raised %s: %s; isolating the request(s) at "
                           "fault", len(sched.scheduled), type(e).__name__, e)
            half = len(sched.scheduled) // 2
            return [o for part in (sched.scheduled[:half], sched.scheduled[half:])
                    for o in self._execute_isolating(_sub_schedule(sched, part))]
        self.scheduler.update_after_step(sched)
        if out.logits is not None:
            self.last_logits, self.last_req_ids = out.logits, out.req_ids
        return self._update(sched, out)

    def _fail(self, req: Request, e: Exception) -> list[EngineCoreOutput]:
        """End one request (a beam search: all of it) with the exception that only it causes."""
        logger.error("request %s failed in the engine", req.req_id,
                     exc_info=(type(e), e, e.__traceback__))
        self.num_failed_requests += 1
        error = f"the request failed in the engine: {type(e).__name__}: {e}"
        if req.beam is not None:
            return self._end_beam_group(req.beam, RequestStatus.FINISHED_ERROR, error)
        req.error = error
        req.is_server_error = True
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(req_id=req.req_id, new_token_ids=[],
                                 finish_reason=int(FinishReason.ERROR), error=req.error,
                                 is_server_error=True)]

    def _update(self, sched: SchedulerOutput, out: RunnerOutput) -> list[EngineCoreOutput]:
        """Accept the sampled token of every row that finished its prompt; stop what is done.
        Rows with drafts go on position by position while the sampled token equals the draft
        (each position sampled with the state after the tokens before it)."""
        outputs: dict[str, EngineCoreOutput] = {}
        sampling = []
        for req in sched.scheduled:
            if req.req_id in out.prompt_logprobs:
                if out.prompt_logprobs[req.req_id].start == 0:
                    req.prompt_logprobs_parts = []  # first chunk (again, after a preemption)
                req.prompt_logprobs_parts.append(out.prompt_logprobs[req.req_id])
            if req.num_computed_tokens >= req.num_tokens:
                sampling.append(req)  # else a prompt chunk: its sample is not an output token
        beams = [r for r in sampling if r.beam is not None]
        if beams:
            sampling = [r for r in sampling if r.beam is None]
        going = self._accept(sampling, out, outputs, 0)
        if beams:
            for o in self._advance_beams(beams, out):
                outputs[o.req_id] = o
        if sched.draft_token_ids:
            self._verify(going, outputs)
            self._settle_drafts(sched)
        return list(outputs.values())

    def _verify(self, going: list[Request], outputs: dict[str, EngineCoreOutput]) -> None:
        """Sample the further draft positions of the rows still agreeing with their drafts."""
        rows = self.runner.input_batch.req_id_to_row
        position = 1
        while going:
            try:
                out = self.runner.sample_verify(position, [rows[r.req_id] for r in going],
                                                self.structured)
            except Exception as e:
                if is_device_fault(e):
                    raise
                # What was accepted so far is exact; the rest of the drafts are dropped.
                logger.exception("verifying draft position %d failed", position)
                self.runner.reset_batch()
                return
            going = self._accept(going, out, outputs, position)
            position += 1

    def _accept(self, reqs: list[Request], out: RunnerOutput,
                outputs: dict[str, EngineCoreOutput], position: int) -> list[Request]:
        """Append each request's token sampled at draft `position` (0: the plain decode
        position); returns the requests whose token equals their draft there and go on."""
        rows = self.runner.input_batch.req_id_to_row
        sampled = out.sampled_token_ids
        lp_index = {int(r): i for i, r in enumerate(out.logprob_rows)}
        accepted_rows, accepted_tokens, going = [], [], []
        for req in reqs:
            row = rows[req.req_id]
            token = int(sampled[row])
            req.append_output_token(token)
            accepted_rows.append(row)
            accepted_tokens.append(token)
            status = self._check_stop(req, token)
            by_token = status == RequestStatus.FINISHED_STOPPED
            if req.grammar is not None:
                try:
                    if self.structured.accept(req, token) and status is None:
                        status = RequestStatus.FINISHED_STOPPED  # the constraint is complete
                except GrammarRejectedError as e:  # never "stop" with output breaking it
                    req.error, status = str(e), RequestStatus.FINISHED_ERROR
                    req.is_server_error = True  # the mask allowed it: ladle's fault
            if status is not None:
                self.scheduler.finish(req, status)
            lp = _token_logprobs(out, lp_index.get(row), int(out.num_logprobs[row]))
            o = outputs.get(req.req_id)
            if o is None:
                outputs[req.req_id] = EngineCoreOutput(
                    req_id=req.req_id,
                    new_token_ids=[token],
                    finish_reason=None if status is None else int(req.finish_reason),
                    stop_reason=req.stop_reason,
                    ended_by_stop_token=by_token,
                    num_cached_tokens=req.num_cached_tokens,
                    logprobs=lp,
                    prompt_logprobs=_prompt_logprobs(req),
                    error=req.error,
                    is_server_error=req.is_server_error,
                    kv_transfer_params=req.kv_transfer_params_out,
                )
            else:  # a further position of a speculative step
                o.new_token_ids.append(token)
                o.finish_reason = None if status is None else int(req.finish_reason)
                o.stop_reason = req.stop_reason
                o.ended_by_stop_token = by_token
                o.error, o.is_server_error = req.error, req.is_server_error
                o.kv_transfer_params = req.kv_transfer_params_out
                if lp is not None:
                    for mine, more in ((o.logprobs.token_ids, lp.token_ids),
                                       (o.logprobs.values, lp.values),
                                       (o.logprobs.sampled_values, lp.sampled_values),
                                       (o.logprobs.sampled_ranks, lp.sampled_ranks)):
                        mine.extend(more)
            drafts = req.draft_token_ids
            if status is None and position < len(drafts) and token == drafts[position]:
                going.append(req)
                self.accepted_per_position[position] += 1
        if accepted_rows:
            try:
                self.runner.accept_tokens(np.array(accepted_rows), np.array(accepted_tokens))
            except Exception as e:
                if is_device_fault(e):
                    raise
                # The tokens are the requests' own now; the batch state is rebuilt from them.
                logger.exception("updating the batch state with this step's tokens failed")
                self.runner.reset_batch()
                return []
        return going

    def _settle_drafts(self, sched: SchedulerOutput) -> None:
        """After verification: KV counts only the accepted tokens, the slots of rejected drafts
        are given back, and full blocks of accepted tokens are published to the prefix cache
        (rejected drafts never are: hashes cover known tokens only)."""
        kept: dict[int, int] = {}  # a hybrid's state slot -> its step's tokens kept
        for req in sched.scheduled:
            drafts = sched.draft_token_ids.get(req.req_id)
            if not drafts:
                continue
            self.num_drafted_steps += 1
            self.num_draft_tokens += len(drafts)
            req.draft_token_ids = []
            if req.is_finished:
                continue
            # Every token but the last sampled one has its KV computed now.
            before = req.num_computed_tokens - sched.num_scheduled_tokens[req.req_id]
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            if self.hybrid:
                kept[self.kv_cache.get_slot(req.req_id)] = req.num_computed_tokens - before
            self.kv_cache.trim(req, req.num_tokens)
            row = self.runner.input_batch.req_id_to_row.get(req.req_id)
            if row is not None:  # (absent after a batch reset: rebuilt from the blocks then)
                self.runner.input_batch.trim_blocks(row, len(self.kv_cache.get_blocks(req.req_id)))
            self.kv_cache.cache_full_blocks(req, req.num_computed_tokens)
        if self.hybrid:
            self.runner.settle_states(kept)
        self.num_accepted_tokens = sum(self.accepted_per_position)

    # ---- beam search ------------------------------------------------------------------------
    def _advance_beams(self, beams: list[Request], out: RunnerOutput) -> list[EngineCoreOutput]:
        """Hand each beam's candidates to its group; every group whose beams have all reported
        takes its step (engine/beam_search.py): beams are continued, forked or freed, and a
        finished search reports its best beams."""
        rows = self.runner.input_batch.req_id_to_row
        index = {int(r): i for i, r in enumerate(out.beam_rows)}
        ready: dict[int, BeamGroup] = {}
        for req in beams:
            i = index[rows[req.req_id]]
            if req.beam.report(req, out.beam_values[i], out.beam_ids[i]):
                ready[id(req.beam)] = req.beam
        outputs: list[EngineCoreOutput] = []
        copies: list[tuple[int, int]] = []
        accepted_rows, accepted_tokens = [], []
        for group in ready.values():
            if group.num_cached_tokens == 0 and group.running:
                group.num_cached_tokens = group.running[0].num_cached_tokens
            going, done = group.select()
            if done:
                outputs += self._end_beam_group(group, RequestStatus.FINISHED_STOPPED)
                continue
            try:
                for req, token in self._continue_beams(group, going, copies):
                    row = rows.get(req.req_id)
                    if row is not None and req.status == RequestStatus.RUNNING:
                        accepted_rows.append(row)
                        accepted_tokens.append(token)
            except GrammarRejectedError as e:
                outputs += self._end_beam_group(group, RequestStatus.FINISHED_ERROR, str(e))
        if copies:
            self.runner.copy_blocks(copies)
        if accepted_rows:
            self.runner.accept_tokens(np.array(accepted_rows), np.array(accepted_tokens))
        return outputs

    def _continue_beams(self, group: BeamGroup, going: list[Continuation],
                        copies: list[tuple[int, int]]) -> list[tuple[Request, int]]:
        """Make the group's running beams `going`: a beam's first continuation goes on in its
        own request, further ones fork it, beams without one are freed. Returns (request,
        token) of each beam in its new order; the KV copies the forks need go to `copies`."""
        children: dict[str, list[Continuation]] = {}
        for c in going:
            children.setdefault(c.parent.req_id, []).append(c)
        for beam in group.running:
            if beam.req_id not in children:
                self.scheduler.finish(beam, RequestStatus.FINISHED_STOPPED)
        placed: dict[int, Request] = {}  # id(continuation) -> its request
        for cs in children.values():  # forks first: they copy the parent's state before it moves on
            for c in cs[1:]:
                placed[id(c)] = self._fork_beam(group, c.parent, copies)
            placed[id(cs[0])] = cs[0].parent
        result = []
        for c in going:
            req = placed[id(c)]
            req.append_output_token(c.token)
            req.beam_score = c.score
            req.beam_logprobs = req.beam_logprobs + [c.entry]
            if req.grammar is not None:
                self.structured.accept(req, c.token)
            result.append((req, c.token))
        group.running = [req for req, _ in result]
        return result

    def _fork_beam(self, group: BeamGroup, parent: Request,
                   copies: list[tuple[int, int]]) -> Request:
        """A new beam with the parent's tokens, state and (shared) KV. Without a free row or
        block it waits like a preempted request and recomputes (its full blocks are prefix-cache
        hits)."""
        child = Request(group.next_beam_id(), parent.prompt_token_ids, parent.sampling_params,
                        parent.eos_token_ids, parent.priority, parent.cache_salt,
                        parent.arrival_time)
        child.output_token_ids = list(parent.output_token_ids)
        child.all_token_ids = list(parent.all_token_ids)
        child.block_hashes = list(parent.block_hashes)
        child.max_tokens = parent.max_tokens
        child.can_draft = False
        child.beam = group
        child.beam_candidates = parent.beam_candidates
        child.beam_logprobs = list(parent.beam_logprobs)
        child.num_cached_tokens = parent.num_cached_tokens
        if parent.grammar is not None:
            self.structured.fork(parent, child)
        running = False
        if parent.status == RequestStatus.RUNNING and self.scheduler.has_free_row():
            try:
                copy = self.kv_cache.fork(parent, child)
            except MemoryError:
                pass
            else:
                running = True
                child.num_computed_tokens = parent.num_computed_tokens
                if copy is not None:
                    copies.append(copy)
        self.scheduler.add_fork(child, running)
        return child

    def _end_beam_group(self, group: BeamGroup, status: RequestStatus,
                        error: str | None = None) -> list[EngineCoreOutput]:
        """Free every beam of the group; a finished search reports its n best hypotheses under
        the output ids (fewer hypotheses than n, possible only when fewer tokens than beams are
        allowed, leave the rest empty), a failed one an error under each."""
        for beam in group.running:
            self.scheduler.finish(beam, status)
        group.running = []
        for i in {group.req_id, *group.output_ids}:
            if self.beam_groups.get(i) is group:
                del self.beam_groups[i]
        if status == RequestStatus.FINISHED_ABORTED:
            return []
        if error is not None:
            return [EngineCoreOutput(req_id=i, new_token_ids=[],
                                     finish_reason=int(FinishReason.ERROR), error=error,
                                     is_server_error=True) for i in group.output_ids]
        want_lp = group.params.logprobs is not None
        outputs = []
        for i, out_id in enumerate(group.output_ids):
            if i >= len(group.finished):
                outputs.append(EngineCoreOutput(req_id=out_id, new_token_ids=[],
                                                finish_reason=int(FinishReason.STOP)))
                continue
            h = group.finished[i]
            lp = None
            if want_lp:
                lp = Logprobs(token_ids=[e[0] for e in h.logprobs], values=[e[1] for e in h.logprobs],
                              sampled_values=[e[2] for e in h.logprobs],
                              sampled_ranks=[e[3] for e in h.logprobs])
            outputs.append(EngineCoreOutput(
                req_id=out_id, new_token_ids=h.token_ids, finish_reason=int(h.finish_reason),
                stop_reason=h.stop_reason, ended_by_stop_token=h.ended_by_stop_token,
                num_cached_tokens=group.num_cached_tokens, logprobs=lp,
                cumulative_logprob=h.cum_logprob, beam_score=h.score))
        return outputs

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def stats(self) -> dict:
        kv = self.kv_cache
        return self.structured.stats() | {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": kv.usage,
            "num_used_blocks": kv.num_used_blocks,
            "num_blocks": kv.num_blocks,
            "prefix_cache_queries": kv.num_prefix_queries,
            "prefix_cache_hits": kv.num_prefix_hits,
            "failed_runs": self.num_failed_runs,
            "failed_requests": self.num_failed_requests,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefill_tokens": self.scheduler.num_prefill_tokens,
            "latencies": self.scheduler.take_latencies(),  # drained: call once per message
        } | self._spec_stats() | (self.kv_connector.stats() if self.kv_connector else {})

    def _spec_stats(self) -> dict:
        """vLLM's spec_decode counters (only when speculative decoding is on)."""
        if not self.spec_k:
            return {}
        return {
            "spec_decode_num_drafts": self.num_drafted_steps,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }


def is_device_fault(e: BaseException) -> bool:
    """An error after which the device's state is unknown (a CUDA fault, an illegal address, a
    device-side assert), or a tensor-parallel group that lost a rank or a collective: the
    engine must stop. Anything else is a request's problem."""
    if isinstance(e, WorkerGroupError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)


def _sub_schedule(sched: SchedulerOutput, part: list[Request]) -> SchedulerOutput:
    """The part of a step's schedule that concerns `part` (after a batch reset, so nothing was
    preempted from the runner's point of view)."""
    return SchedulerOutput(
        scheduled=part,
        num_scheduled_tokens={r.req_id: sched.num_scheduled_tokens[r.req_id] for r in part},
        draft_token_ids={r.req_id: sched.draft_token_ids[r.req_id] for r in part
                         if r.req_id in sched.draft_token_ids},
        snapshots={r.req_id: sched.snapshots[r.req_id] for r in part
                   if r.req_id in sched.snapshots},
    )


def _token_logprobs(out: RunnerOutput, i: int | None, k: int) -> Logprobs | None:
    if i is None:
        return None
    lp = out.logprobs
    return Logprobs(
        token_ids=[lp.token_ids[i, :k].tolist()],
        values=[lp.values[i, :k].tolist()],
        sampled_values=[float(lp.sampled_values[i])],
        sampled_ranks=[int(lp.sampled_ranks[i])],
    )


def _prompt_logprobs(req: Request) -> Logprobs | None:
    """Sent once, with the first output token: entries for prompt tokens 1..n-1."""
    parts = req.prompt_logprobs_parts
    if not parts or req.num_output_tokens != 1:
        return None
    req.prompt_logprobs_parts = []
    return Logprobs(
        token_ids=[row.tolist() for p in parts for row in p.token_ids],
        values=[row.tolist() for p in parts for row in p.values],
        sampled_values=[float(v) for p in parts for v in p.target_values],
        sampled_ranks=[int(r) for p in parts for r in p.target_ranks],
    )


def _load_draft_model(path: str, vocab_size: int, max_model_len: int, dtype: torch.dtype,
                      device: torch.device):
    """The draft checkpoint of the draft_model method, loaded as the target is; its vocabulary
    must be the target's and its positions must reach max_model_len."""
    draft_path = resolve_model_path(path)
    hf_config = read_hf_config(draft_path)
    draft_vocab = hf_config.get("vocab_size")
    if draft_vocab != vocab_size:
        raise ValueError(f"speculative_config.model: the draft model {path!r} has vocab_size "
                         f"{draft_vocab}, the target has {vocab_size}; the draft must use the "
                         "target's tokenizer and vocabulary")
    positions = hf_config.get("max_position_embeddings")
    if positions is not None and positions < max_model_len:
        raise ValueError(f"speculative_config.model: the draft model {path!r} has "
                         f"max_position_embeddings {positions}, below max_model_len "
                         f"({max_model_len}); lower max_model_len or use a draft with longer "
                         "positions")
    if getattr(model_class(hf_config, draft_path), "hybrid", False):
        raise ValueError(f"speculative_config.model: the draft model {path!r} has "
                         "linear-attention layers, whose state the draft cannot keep yet; "
                         "accepted: a draft without them (a dense model of the same vocabulary)")
    return load_model(draft_path, hf_config, dtype, device)


def _eos_ids(tokenizer, model_path) -> list[int]:
    return eos_token_ids(tokenizer, model_path) if tokenizer is not None else []


def describe_bytes(by_kind: dict[str, int]) -> str:
    """The total, then each kind, largest first: "154.2 MiB (int8 127.0 MiB, bfloat16 27.2 MiB)"."""
    def size(n: int) -> str:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if n >= 2**shift or unit == "KiB":
                return f"{n / 2**shift:.1f} {unit}"

    kinds = sorted(by_kind.items(), key=lambda kv: -kv[1])
    return f"{size(sum(by_kind.values()))} (" + ", ".join(f"{k} {size(n)}" for k, n in kinds) + ")"


__all__ = ["EngineCore", "FinishReason"]

