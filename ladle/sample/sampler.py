"""The sampler: one vectorised pass over the (rows, vocab) logits of a step, every row with its
own parameters.

Steps, in order (each skipped when no row needs it):
   1. raw snapshot for rows that asked for raw logprobs / raw logits
   2. float32 (beam-search rows arrive as log-probabilities: transformers scores beams so,
      before its processors); a step whose rows are all greedy with nothing else to do (no
      logprobs, penalties, beams or argmax-changing processor rows) instead takes the argmax of
      the model's logits as they are and ends here
   3. processors that can change the argmax: allowed_token_ids, bad_words, min_tokens,
      logit_bias, then custom ones
   4. penalties: repetition, frequency, presence (incremental counts, see penalties.py)
   5. thinking-token budget (forces the end-of-thinking token once the budget is spent)
      beam-search rows: their top candidates (engine/beam_search.py), not a sampled token
   6. greedy argmax for greedy rows
   7. temperature
   8. processors that cannot change the argmax: min_p, then custom ones
   9. top-k, then top-p on the mass top-k left: on the top-k candidates only when every random
      row has a small top_k; otherwise as a -inf mask on the full rows (ops.mask_top_k_top_p:
      a top-p row's nucleus from its largest 256 tokens, else the radix-select kernel, else a
      sort)
  10. sampling by exponential race, argmax(p / E) with E ~ Exp(1) from a counter-based hash of
      (seed, output position, token id): a seeded row's own seed, an unseeded row's drawn fresh
      from the engine's generator each step; over full rows one fused kernel pass on CPU
      (rows testing a draft-model token at this position instead keep it with probability
      min(1, p/q) or draw from the residual max(0, p - q): rejection.py)
  11. per-row choice between the greedy and the random token
  12. logprobs: top-k values plus the sampled token's value and rank, from the raw or the
      processed distribution as each row's logprobs_mode says
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.reasoning import ReasoningConfig
from ladle.runner import cpu_kernels
from ladle.sample.logits_processors.builtin import (
    AllowedTokenIdsProcessor,
    BadWordsProcessor,
    LogitBiasProcessor,
    MinPProcessor,
    MinTokensProcessor,
    ThinkingBudgetProcessor,
)
from ladle.sample.logits_processors.interface import (
    BatchUpdate,
    LogitsProcessor,
    ProcessorConfig,
    RowStateProcessor,
)
from ladle.sample.metadata import SamplingMetadata
from ladle.sample.noise import TOKEN_STREAM, SeededNoise
from ladle.sample.ops import NEG_INF, mask_top_k_top_p, race, restrict_top_k_top_p
from ladle.sample.penalties import PenaltyState
from ladle.sample.rejection import DraftTest, accept_or_resample


@dataclass(slots=True)
class LogprobsTensors:
    """For the rows that asked (meta.logprob_rows), k = the largest num_logprobs."""

    token_ids: torch.Tensor  # (N, k) in rank order
    values: torch.Tensor  # (N, k)
    sampled_values: torch.Tensor  # (N,)
    sampled_ranks: torch.Tensor  # (N,) 1 = most likely


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # (R,) int64
    logprobs: LogprobsTensors | None = None
    beam: tuple[torch.Tensor, torch.Tensor] | None = None  # beam rows' top (values, ids)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, generator: torch.Generator,
                 penalties: PenaltyState, argmax_changing: list[LogitsProcessor],
                 thinking: LogitsProcessor | None, argmax_invariant: list[LogitsProcessor]):
        self.noise = SeededNoise(vocab_size, device)
        self.generator = generator
        self.penalties = penalties
        self.argmax_changing = argmax_changing
        self.thinking = thinking
        self.argmax_invariant = argmax_invariant
        self.workspaces: dict[str, torch.Tensor] = {}  # per-step (rows, V) scratch, reused

    @classmethod
    def build(cls, vocab_size: int, device: torch.device, max_num_reqs: int,
              generator: torch.Generator, reasoning: ReasoningConfig | None = None,
              custom: list[LogitsProcessor] = ()) -> Sampler:
        """The sampler with the built-in processors in pipeline order, plus custom ones placed
        by is_argmax_invariant()."""
        pcfg = ProcessorConfig(vocab_size, device, max_num_reqs)
        changing: list[LogitsProcessor] = [
            AllowedTokenIdsProcessor(pcfg), BadWordsProcessor(pcfg), MinTokensProcessor(pcfg),
            LogitBiasProcessor(pcfg),
        ]
        invariant: list[LogitsProcessor] = [MinPProcessor(pcfg)]
        for p in custom:
            (invariant if p.is_argmax_invariant() else changing).append(p)
        return cls(vocab_size, device, generator, PenaltyState(max_num_reqs, vocab_size, device),
                   changing, ThinkingBudgetProcessor(pcfg, reasoning), invariant)

    def _workspace(self, name: str, shape) -> torch.Tensor:
        """A float32 buffer of `shape` kept across steps (grown when a batch needs more)."""
        n = shape[0] * shape[1]
        buf = self.workspaces.get(name)
        if buf is None or buf.numel() < n:
            buf = self.workspaces[name] = torch.empty(n, dtype=torch.float32,
                                                      device=self.noise.token_key.device)
        return buf[:n].view(shape)

    @property
    def processors(self) -> list[LogitsProcessor]:
        extra = [self.thinking] if self.thinking is not None else []
        return self.argmax_changing + extra + self.argmax_invariant

    def update_state(self, update: BatchUpdate | None) -> None:
        self.penalties.update_state(update)
        for p in self.processors:
            p.update_state(update)

    def accept(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Tokens accepted into rows' outputs this step (for the incremental penalty counts)."""
        self.penalties.accept(rows, token_ids)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 output_positions: torch.Tensor, verify: bool = False,
                 draft: DraftTest | None = None) -> SamplerOutput:
        """logits: (R, V) in batch-row order, owned by the sampler from here on (stages work in
        place); output_positions: (R,) index of the token being sampled within each request's
        output (the counter of the seeded noise). verify: a further draft position of a
        speculative step; processors that do not support positions are skipped (their
        requests are never drafted, so none of their rows is verified). draft: draft-model tokens
        to test at this position (random rows only), by rejection sampling. Beam-search rows
        (meta.beam_rows) come in as log-probabilities (ModelRunner.execute)."""
        if logits.dtype != torch.float32 and self._argmax_only(meta):
            # The float32 copy below would change nothing this step reads: bfloat16 widens to
            # float32 exactly, so the argmax of the model's own logits is the same token (152k
            # tokens, caches cold: one row 150-180 -> 90-115 us, 32 rows 0.97 -> 0.35 ms).
            return SamplerOutput(cpu_kernels.argmax(logits))
        raw = None
        if meta.any_raw_logprobs:
            # Later stages work in place, so the raw logits are copied, into a buffer reused
            # across steps: a fresh (rows, V) tensor would page-fault its whole size on CPU.
            rows = meta.logprob_rows
            src = logits if rows.shape[0] == meta.num_rows else logits[rows]
            raw = self._workspace("raw", src.shape).copy_(src)
        if logits.dtype != torch.float32:
            # Into a reused buffer: a fresh (rows, V) float32 tensor page-faults its whole size
            # on CPU every step (39 MB at 64 rows).
            logits = self._workspace("logits", logits.shape).copy_(logits)
        for p in self.argmax_changing:
            if not verify or p.supports_positions():
                logits = p.apply(logits)
        if not meta.no_penalties:
            logits = self.penalties.apply(logits, meta.presence, meta.frequency, meta.repetition,
                                          meta.penalties_used)
        if self.thinking is not None:
            logits = self.thinking.apply(logits)
        beam = None
        if meta.beam_rows is not None and not verify:
            # Beam rows hold processed log-probabilities here: their candidates.
            beam = cpu_kernels.topk(logits.index_select(0, meta.beam_rows), meta.beam_k)
        greedy = None if meta.all_random else cpu_kernels.argmax(logits)
        if meta.all_greedy:
            sampled, processed = greedy, logits
        else:
            logits.div_(meta.temperature[:, None])
            for p in self.argmax_invariant:
                if not verify or p.supports_positions():
                    logits = p.apply(logits)
            sampled, processed = self._sample_random(logits, meta, output_positions, draft)
            if greedy is not None:
                sampled = torch.where(meta.is_greedy, greedy, sampled)
        lp = None
        if meta.max_num_logprobs >= 0:
            lp = self._logprobs(raw, processed, sampled, meta)
        return SamplerOutput(sampled, lp, None if beam is None else tuple(beam))

    def _argmax_only(self, meta: SamplingMetadata) -> bool:
        """Whether every row's token this step is the argmax of its logits as they come: all
        rows greedy, no logprobs (so no processed logits to report), penalties, beams, or
        argmax-changing processor with a row (a plug-in that keeps no RowStateProcessor
        states counts as acting on every row)."""
        if not meta.all_greedy or meta.max_num_logprobs >= 0 or not meta.no_penalties \
                or meta.beam_rows is not None:
            return False
        extra = [self.thinking] if self.thinking is not None else []
        return not any(not isinstance(p, RowStateProcessor) or p.states
                       for p in self.argmax_changing + extra)

    def _noise(self, meta: SamplingMetadata, positions, ids: torch.Tensor | None):
        return self.draw_noise(meta.seeds, meta.has_seed, positions, ids,
                               all_seeded=meta.all_seeded, any_seeded=meta.any_seeded)

    def draw_noise(self, seeds, has_seed, positions, ids: torch.Tensor | None,
                   stream: int = TOKEN_STREAM, all_seeded: bool | None = None,
                   any_seeded: bool | None = None) -> torch.Tensor:
        """Exp(1) noise over the token ids (R, K), or (R, V) for ids None, from the hash of
        (seed, position, token id) on `stream`, the seeds from noise_seeds."""
        return self.noise.exponential(self.noise_seeds(seeds, has_seed, all_seeded, any_seeded),
                                      positions, ids, stream)

    def noise_seeds(self, seeds, has_seed, all_seeded: bool | None = None,
                    any_seeded: bool | None = None) -> torch.Tensor:
        """The seeds of the hashed noise: a seeded row's own; an unseeded row a fresh random one
        from the engine's generator on every call, so its draws are independent from step to
        step and from stream to stream. (Unseeded rows used to draw torch's exponential_, which
        takes ~90 ms for 32 x 152k on a 2-core CPU.)"""
        if all_seeded is None:
            all_seeded = bool(has_seed.all())
            any_seeded = bool(has_seed.any())
        if all_seeded:
            return seeds
        fresh = torch.randint(-(2**63), 2**63 - 1, seeds.shape, generator=self.generator,
                              device=seeds.device)
        return torch.where(has_seed, seeds, fresh) if any_seeded else fresh

    def _race_seeds(self, meta: SamplingMetadata) -> torch.Tensor:
        return self.noise_seeds(meta.seeds, meta.has_seed, meta.all_seeded, meta.any_seeded)

    def _sample_random(self, logits, meta: SamplingMetadata, positions,
                       draft: DraftTest | None = None):
        """Returns the sampled ids and the final logits (what the token was drawn from; the
        full (R, V) tensor, with -inf where top-k/top-p removed a token)."""
        if draft is not None:
            def test_noise(rows, ids, stream):
                return self.draw_noise(meta.seeds[rows], meta.has_seed[rows], positions[rows],
                                       ids, stream)
        restricted = meta.need_top_k or meta.need_top_p
        if restricted and meta.candidate_k is None:
            # Some row has no top-k, so no few candidates hold every row's draw: top-k/top-p
            # become a -inf mask on the full rows (ops.mask_top_k_top_p: no full sort).
            logits = mask_top_k_top_p(logits, meta.top_k, meta.top_p)
            restricted = False
        if not restricted:
            # The race fused with its hashed noise (rows without a draft draw what plain
            # decoding draws); rows with a draft then test it against their probabilities.
            sampled = self.noise.race(logits, self._race_seeds(meta), positions)
            if draft is not None:
                probs = torch.softmax(logits[draft.rows], dim=-1)
                sampled[draft.rows] = accept_or_resample(probs, None, draft, test_noise)
            return sampled, logits
        vals, ids = restrict_top_k_top_p(logits, meta.top_k, meta.top_p, meta.candidate_k,
                                         meta.need_top_p)
        probs = torch.softmax(vals, dim=-1)
        choice = race(probs, self._noise(meta, positions, ids))
        sampled = ids.gather(1, choice[:, None])[:, 0]
        if draft is not None:
            sampled[draft.rows] = accept_or_resample(probs[draft.rows], ids[draft.rows], draft,
                                                     test_noise)
        final = None
        if meta.any_processed_logprobs:
            final = torch.full_like(logits, NEG_INF).scatter_(1, ids, vals)
        return sampled, final

    @staticmethod
    def _logprobs(raw, processed, sampled, meta: SamplingMetadata) -> LogprobsTensors:
        rows = meta.logprob_rows
        all_rows = rows.shape[0] == meta.num_rows  # rows are 0..R-1 then: no gather needed
        if processed is not None and meta.any_processed_logprobs:
            processed = processed if all_rows else processed[rows]
        if raw is not None and processed is not None and meta.any_processed_logprobs:
            src = torch.where(meta.logprobs_raw[:, None], raw, processed)
        else:
            src = raw if raw is not None else processed
        # Top-k and ranks are the same on logits as on log_softmax(logits) (a per-row shift),
        # so no (rows, V) log_softmax is materialised: only the per-row logsumexp.
        chosen = sampled if all_rows else sampled[rows]
        shift, chosen_logits, ranks = logprob_stats(src, chosen)
        if meta.any_logit_mode:
            shift = shift.masked_fill(meta.logprobs_as_logits, 0.0)
        k = max(meta.max_num_logprobs, 0)
        values, token_ids = (cpu_kernels.topk(src, k) if k
                             else (src[:, :0], chosen[:, None][:, :0]))
        values = values - shift[:, None]
        sampled_values = chosen_logits - shift
        return LogprobsTensors(token_ids, values, sampled_values, ranks)


def logprob_stats(src: torch.Tensor, chosen: torch.Tensor):
    """Per row of src (N, V): logsumexp, src[chosen] and the rank of chosen (1 = largest). On
    CPU one kernel pass per row; logprob_stats_torch is its twin."""
    kernels = cpu_kernels.kernels_for(src)
    if kernels is not None and src.dtype == torch.float32 and src.is_contiguous():
        return tuple(kernels.logprob_stats(src, chosen))
    return logprob_stats_torch(src, chosen)


def logprob_stats_torch(src: torch.Tensor, chosen: torch.Tensor):
    chosen_logits = src.gather(1, chosen[:, None])[:, 0]
    ranks = (src > chosen_logits[:, None]).sum(dim=-1) + 1
    return torch.logsumexp(src, dim=-1), chosen_logits, ranks
