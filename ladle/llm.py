"""The offline API, shaped like vLLM's: LLM(model).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from tqdm import tqdm

from ladle.config import EngineConfig
from ladle.engine.core import EngineCore
from ladle.engine.request import FinishReason
from ladle.frontend.output_processor import OutputProcessor
from ladle.frontend.processor import InputProcessor, Prompt
from ladle.messages import EngineCoreOutput, EngineCoreRequest
from ladle.outputs import BeamSearchOutput, BeamSearchSequence, Logprob, RequestOutput
from ladle.sampling_params import BeamSearchParams, SamplingParams
from ladle.tokenizer import load_tokenizer


class LLM:
    """Runs an EngineCore in this process. Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str = "ladle-demo", **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        if self.config.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size: {self.config.data_parallel_size}; the offline "
                             "LLM runs one engine in this process (serve several with `ladle "
                             "serve --data-parallel-size N`); accepted: 1")
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.engine.model_path)
        self.processor = InputProcessor(
            self.tokenizer, self.engine.model_path, max_model_len=self.engine.max_model_len,
            limits=self.engine.limits, scheduling_policy=self.config.scheduling_policy,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op with one rank); the LLM is unusable after.
        Workers also stop when this process exits."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, {"prompt_token_ids": [...]}, or a list of
        these. sampling_params: one for all prompts, or one per prompt."""
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts; "
                                 "pass one, or one per prompt")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(self._add(p, sp))
        except Exception:
            for rid in ids:  # a bad prompt rejects the whole call and leaves nothing queued
                for cid in self.output_processor.abort(rid):
                    self.engine.abort_request(cid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the model's chat template renders
        each into a prompt."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.processor.render_chat(conv, tools=tools,
                                       add_generation_prompt=add_generation_prompt,
                                       chat_template_kwargs=chat_template_kwargs)
            for conv in convs
        ]
        # The template already wrote any BOS; tokenising must not add a second one.
        prompts = [{"prompt": p, "prompt_token_ids": self.processor.encode(p, False)}
                   for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt],
                    params: BeamSearchParams | Sequence[BeamSearchParams],
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for each prompt, as vLLM's LLM.beam_search (params: one for all prompts,
        or one per prompt): every beam_width beam comes back, best first. The searches run
        together inside the engine's batch (engine/beam_search.py): each prompt is prefilled
        once, and a search decodes beam_width rows."""
        prompts = self._as_list(prompts)
        if isinstance(params, BeamSearchParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts; pass one, "
                             "or one per prompt")
        requests = []
        for prompt, bp in zip(prompts, params, strict=True):
            sp = bp.to_sampling_params()
            sp.verify_for_model(self.engine.limits)
            _, token_ids = self.processor.tokenize(prompt)
            self.processor.check_prompt(token_ids)
            rid = f"beam-{next(self._ids)}"
            requests.append(EngineCoreRequest(
                rid, token_ids, sp, self.processor.eos_token_ids, time.monotonic(),
                output_ids=[f"{rid}-{i}" for i in range(sp.n)]))
        results: dict[str, EngineCoreOutput] = {}
        try:
            for r in requests:
                self.engine.add_request(r)
            bar = tqdm(total=len(requests), desc="Beam search", disable=not use_tqdm)
            while self.engine.has_unfinished_requests():
                for o in self.engine.step():
                    results[o.req_id] = o
                    if o.error is not None:
                        raise RuntimeError(f"beam search {o.req_id}: {o.error}")
                    bar.update(1 / len(requests[0].output_ids))
            bar.close()
        except BaseException:
            for r in requests:
                self.engine.abort_request(r.req_id)
            raise
        return [BeamSearchOutput([self._beam_sequence(r.prompt_token_ids, results[i],
                                                      r.sampling_params)
                                  for i in r.output_ids if results[i].new_token_ids])
                for r in requests]

    def _beam_sequence(self, prompt_ids: list[int], o: EngineCoreOutput,
                       sp: SamplingParams) -> BeamSearchSequence:
        logprobs = None
        if o.logprobs is not None:
            lp = o.logprobs
            logprobs = []
            for tok, ids, vals, value, rank in zip(o.new_token_ids, lp.token_ids, lp.values,
                                                   lp.sampled_values, lp.sampled_ranks,
                                                   strict=True):
                entry = {t: Logprob(v, r + 1) for r, (t, v) in enumerate(zip(ids, vals, strict=True))}
                entry[tok] = Logprob(value, rank)
                logprobs.append(entry)
        return BeamSearchSequence(
            tokens=prompt_ids + o.new_token_ids, cum_logprob=o.cumulative_logprob,
            score=o.beam_score,
            text=self.tokenizer.decode(o.new_token_ids, skip_special_tokens=sp.skip_special_tokens),
            finish_reason=str(FinishReason(o.finish_reason)), stop_reason=o.stop_reason,
            logprobs=logprobs)

    # ---- internals --------------------------------------------------------------------------
    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if prompts and isinstance(prompts[0], int):
            return [list(prompts)]
        return list(prompts)

    def _add(self, prompt: Prompt, params: SamplingParams) -> str:
        req = self.processor.process(str(next(self._ids)), prompt, params)
        self.output_processor.add_request(req.request_id, req.prompt, req.prompt_token_ids,
                                          req.child_ids, req.child_params, params=req.params)
        try:
            for engine_req in req.engine_requests:
                self.engine.add_request(engine_req)
        except Exception:
            for cid in self.output_processor.abort(req.request_id):
                self.engine.abort_request(cid)
            raise
        return req.request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            changed, to_abort = self.output_processor.process(self.engine.step())
            for rid in to_abort:
                self.engine.abort_request(rid)
            for state in changed:
                if state.finished:
                    done[state.request_id] = state.to_output()
                    bar.update(1)
        bar.close()
        return [done[r] for r in request_ids]
