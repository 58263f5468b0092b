"""Beam search inside the continuous batch.

A beam search request is a BeamGroup: its beams are ordinary requests of the scheduler, one row
each in the batch, decoding one token per step next to everything else. Each step every running
beam's row reports its best candidates (log_softmax of the logits, then the logits processors
and the grammar mask, as transformers scores beams); once all of a group's beams have reported,
`select` picks the group's next beams and its finished hypotheses. The engine then applies the
choice: a beam with no continuation is freed, the first continuation of a beam goes on in the
beam's own request and row, and each further one forks it (the KV blocks of its computed tokens
are shared, reference-counted, and only the last partial block is copied). So a width-k search
costs k decode rows, and its prompt is prefilled once.

The semantics are transformers' `generate(num_beams=k, do_sample=False)` (its `_beam_search`):
  - a step keeps the top (1 + number of stop tokens, at least 2) x k candidates over all beams,
    by the beam's score plus the token's log-probability (float32, as transformers adds them);
  - a candidate that ends its beam (a stop token, or the length limit) becomes a finished
    hypothesis only when it ranks among the first k, scored sum_logprob / generated_length **
    length_penalty, and only while the search can still improve (early_stopping);
  - the k best candidates that do not end go on;
  - the search ends when no candidate goes on, when k hypotheses are finished and early_stopping
    is True, or when the best running beam cannot beat the worst of k finished hypotheses
    (early_stopping False: judged at the current length; "never" with a positive
    length_penalty: at the longest length still allowed).
One difference, in degenerate cases only: where fewer than k candidates can go on (every other
one is -inf, e.g. a grammar or allowed_token_ids admits fewer tokens than there are beams),
transformers keeps running placeholder beams with a -1e9 score; here they are not run."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ladle.engine.request import FinishReason, Request
from ladle.sampling_params import SamplingParams


@dataclass(slots=True)
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]  # generated, the ending token included
    cum_logprob: float  # sum of the tokens' log-probabilities
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    logprobs: list[tuple]  # per token: (top ids, top values, chosen value, chosen rank)
    finish_reason: FinishReason
    stop_reason: int | None  # the stop_token_id that ended it (not EOS)
    ended_by_stop_token: bool


@dataclass(slots=True)
class Continuation:
    """A running beam's next token, chosen by `select`."""

    parent: Request
    token: int
    score: float  # the beam's new running score
    entry: tuple  # the token's logprob entry (see Hypothesis.logprobs)


class BeamGroup:
    def __init__(self, req_id: str, output_ids: list[str], params: SamplingParams,
                 eos_token_ids: list[int], max_tokens: int, max_model_len: int,
                 num_prompt_tokens: int, vocab_size: int):
        self.req_id = req_id
        self.output_ids = output_ids  # the frontend's request ids, one per returned beam
        self.params = params
        self.width = params.beam_width
        self.stop_ids = set(params.stop_token_ids or ())
        self.eos_ids = set() if params.ignore_eos else set(eos_token_ids)
        num_stops = len(self.stop_ids | self.eos_ids)
        self.num_keep = min(max(2, 1 + num_stops) * self.width, vocab_size)  # candidates kept
        # What each beam's row reports: the candidates, or more for top logprobs.
        self.num_candidates = min(max(self.num_keep, params.logprobs or 0), vocab_size)
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        self.running: list[Request] = []  # best first
        self.pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # this step's candidates
        self.finished: list[Hypothesis] = []  # at most width, best first
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.num_forks = 0
        self.num_cached_tokens = 0

    def next_beam_id(self) -> str:
        self.num_forks += 1
        return f"{self.req_id}/beam{self.num_forks}"

    def report(self, req: Request, values: np.ndarray, ids: np.ndarray) -> bool:
        """A beam's candidates for this step (values best first); True when every running beam
        of the group has reported and `select` can run."""
        self.pending[req.req_id] = (values, ids)
        return all(b.req_id in self.pending for b in self.running)

    def select(self) -> tuple[list[Continuation], bool]:
        """The group's step: the continuations of the beams that go on (best first), and
        whether the search is over (self.finished then holds the result)."""
        beams = self.running
        pending, self.pending = self.pending, {}
        k = self.num_keep
        values = np.stack([pending[b.req_id][0][:k] for b in beams]).astype(np.float32)
        ids = np.stack([pending[b.req_id][1][:k] for b in beams])
        running = np.array([b.beam_score for b in beams], dtype=np.float32)
        total = (running[:, None] + values).ravel()  # float32, as transformers sums them
        order = np.argsort(-total, kind="stable")[:k]  # ties: the earlier beam, then rank
        gen_len = beams[0].num_output_tokens + 1
        at_length = (gen_len >= self.max_tokens
                     or self.num_prompt_tokens + gen_len >= self.max_model_len)
        params = self.params
        nlp = params.logprobs or 0
        going: list[Continuation] = []
        ended: list[Hypothesis] = []
        penalty = np.float32(float(gen_len) ** params.length_penalty)
        for pos, flat in enumerate(order):
            score = total[flat]
            if not np.isfinite(score):
                break  # the rest are -inf too
            b, j = divmod(int(flat), values.shape[1])
            token = int(ids[b, j])
            by_token = gen_len >= params.min_tokens and (token in self.eos_ids
                                                         or token in self.stop_ids)
            parent = beams[b]
            entry = (pending[parent.req_id][1][:nlp].tolist(),
                     pending[parent.req_id][0][:nlp].tolist(), float(values[b, j]), j + 1)
            if by_token or at_length:
                if pos < self.width:  # only the first k may finish
                    ended.append(Hypothesis(
                        parent.output_token_ids + [token], float(score),
                        float(np.float32(score) / penalty), parent.beam_logprobs + [entry],
                        FinishReason.STOP if by_token else FinishReason.LENGTH,
                        token if by_token and token in self.stop_ids
                        and token not in self.eos_ids else None, by_token))
            elif len(going) < self.width:
                going.append(Continuation(parent, token, float(score), entry))
        full = len(self.finished) == self.width
        if ended and self.improvable and not (full and params.early_stopping is True):
            merged = self.finished + ended  # stable: earlier hypotheses win ties
            merged.sort(key=lambda h: -h.score)
            self.finished = merged[: self.width]
        if going and len(self.finished) == self.width:
            if params.early_stopping == "never" and params.length_penalty > 0:
                best_len = self.max_tokens
            else:
                best_len = gen_len
            best = np.float32(going[0].score) / np.float32(float(best_len) ** params.length_penalty)
            self.improvable = self.improvable and bool(best > min(h.score for h in self.finished))
        done = (not going or not self.improvable
                or (len(self.finished) == self.width and params.early_stopping is True))
        return going, done
