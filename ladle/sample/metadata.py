"""SamplingMetadata: the device tensors the sampler reads, rebuilt only when the batch changes,
plus short-circuit flags so a step skips every stage no row needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ladle.sample.ops import TOPK_CANDIDATE_LIMIT
from ladle.sampling_params import LOGPROBS_MODES

RAW_MODES = (LOGPROBS_MODES.index("raw_logprobs"), LOGPROBS_MODES.index("raw_logits"))
LOGIT_MODES = (LOGPROBS_MODES.index("raw_logits"), LOGPROBS_MODES.index("processed_logits"))


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    temperature: torch.Tensor  # (R,) float32; 1.0 on greedy rows so division is harmless
    is_greedy: torch.Tensor  # (R,) bool
    all_greedy: bool
    all_random: bool
    has_seed: torch.Tensor  # (R,) bool, random rows with a seed
    any_seeded: bool
    all_seeded: bool
    seeds: torch.Tensor  # (R,) int64
    top_k: torch.Tensor  # (R,) int32, 0 = off
    top_p: torch.Tensor  # (R,) float32
    need_top_k: bool
    need_top_p: bool
    # Candidates for the race: the largest top_k when every random row has a small top_k,
    # None for a full sort.
    candidate_k: int | None
    no_penalties: bool
    penalties_used: tuple[bool, bool, bool]  # any row with (repetition, frequency, presence)
    presence: torch.Tensor  # (R,) float32
    frequency: torch.Tensor
    repetition: torch.Tensor
    num_logprobs: np.ndarray  # (R,) int, -1 = none (CPU: used to slice outputs)
    logprob_rows: torch.Tensor  # rows that want logprobs
    max_num_logprobs: int  # -1 when no row wants logprobs
    logprobs_raw: torch.Tensor  # (rows wanting logprobs,) bool: from the raw logits
    logprobs_as_logits: torch.Tensor  # (rows wanting logprobs,) bool: values, not log_softmax
    any_raw_logprobs: bool
    any_logit_mode: bool  # some row wants raw_logits / processed_logits values
    any_processed_logprobs: bool
    # Beam search rows (engine/beam_search.py): they report their top beam_k log-probabilities
    # (log_softmax, then the processors); None when the step has none.
    beam_rows: torch.Tensor | None = None
    beam_k: int = 0

    @classmethod
    def from_columns(cls, cols: dict[str, np.ndarray], n: int, device,
                     beam_candidates: np.ndarray | None = None) -> SamplingMetadata:
        def t(x):
            return torch.from_numpy(np.ascontiguousarray(x)).to(device)

        is_greedy = cols["is_greedy"][:n]
        random = ~is_greedy
        has_seed = cols["has_seed"][:n] & random
        top_k = cols["top_k"][:n]
        top_p = cols["top_p"][:n]
        need_top_k = bool((top_k[random] > 0).any())
        need_top_p = bool((top_p[random] < 1).any())
        candidate_k = None
        rk = top_k[random]
        if len(rk) and (rk > 0).all() and rk.max() <= TOPK_CANDIDATE_LIMIT:
            candidate_k = int(rk.max())
        presence, frequency = cols["presence_penalty"][:n], cols["frequency_penalty"][:n]
        repetition = cols["repetition_penalty"][:n]
        num_logprobs = cols["num_logprobs"][:n].copy()
        lp_rows = np.nonzero(num_logprobs >= 0)[0]
        modes = cols["logprobs_mode"][:n][lp_rows]
        raw = np.isin(modes, RAW_MODES)
        beam = np.zeros(0, dtype=np.int32) if beam_candidates is None else beam_candidates[:n]
        beam_rows = np.nonzero(beam)[0]
        return cls(
            num_rows=n,
            temperature=t(np.where(is_greedy, 1.0, cols["temperature"][:n]).astype(np.float32)),
            is_greedy=t(is_greedy),
            all_greedy=bool(is_greedy.all()),
            all_random=not bool(is_greedy.any()),
            has_seed=t(has_seed),
            any_seeded=bool(has_seed.any()),
            all_seeded=bool(has_seed.all()),
            seeds=t(cols["seed"][:n]),
            top_k=t(top_k),
            top_p=t(top_p),
            need_top_k=need_top_k,
            need_top_p=need_top_p,
            candidate_k=candidate_k,
            no_penalties=bool((presence == 0).all() and (frequency == 0).all()
                              and (repetition == 1).all()),
            penalties_used=(bool((repetition != 1).any()), bool((frequency != 0).any()),
                            bool((presence != 0).any())),
            presence=t(presence),
            frequency=t(frequency),
            repetition=t(repetition),
            num_logprobs=num_logprobs,
            logprob_rows=t(lp_rows.astype(np.int64)),
            max_num_logprobs=int(num_logprobs.max()) if n else -1,
            logprobs_raw=t(raw),
            logprobs_as_logits=t(np.isin(modes, LOGIT_MODES)),
            any_raw_logprobs=bool(raw.any()),
            any_logit_mode=bool(np.isin(modes, LOGIT_MODES).any()),
            any_processed_logprobs=bool((~raw).any()),
            beam_rows=t(beam_rows.astype(np.int64)) if len(beam_rows) else None,
            beam_k=int(beam.max()) if len(beam_rows) else 0,
        )
