"""Built-in processors: allowed_token_ids, bad_words, min_tokens, logit_bias, min_p, and the
thinking-token budget. Each keeps state only for the rows that use it and costs nothing when no
row does."""

from __future__ import annotations

import torch

from ladle.reasoning import ReasoningConfig
from ladle.runner import cpu_kernels
from ladle.sample.logits_processors.interface import (
    AddedRow,
    BatchUpdate,
    ProcessorConfig,
    RowStateProcessor,
)

NEG_INF = float("-inf")


class AllowedTokenIdsProcessor(RowStateProcessor):
    """Every token outside allowed_token_ids gets -inf."""

    def __init__(self, config: ProcessorConfig):
        super().__init__(config)
        self.rows: torch.Tensor | None = None
        self.banned: torch.Tensor | None = None  # (active rows, V) bool

    def supports_positions(self) -> bool:
        return True  # reads the live output list or per-request constants only

    def is_argmax_invariant(self) -> bool:
        return False

    def new_state(self, a: AddedRow):
        return a.params.allowed_token_ids

    def update_state(self, update: BatchUpdate | None) -> bool:
        if super().update_state(update):
            rows = sorted(self.states)
            banned = torch.ones(len(rows), self.config.vocab_size, dtype=torch.bool)
            for i, r in enumerate(rows):
                banned[i, self.states[r]] = False
            self.rows = torch.tensor(rows, dtype=torch.long, device=self.config.device)
            self.banned = banned.to(self.config.device)
        return False

    def apply(self, logits):
        if self.states:
            logits[self.rows] = logits[self.rows].masked_fill(self.banned, NEG_INF)
        return logits


class BadWordsProcessor(RowStateProcessor):
    """A single-token bad word is always banned; a multi-token one bans its last token only
    when the output so far ends with the word's other tokens."""

    def supports_positions(self) -> bool:
        return True  # reads the live output list or per-request constants only

    def is_argmax_invariant(self) -> bool:
        return False

    def new_state(self, a: AddedRow):
        seqs = a.params.bad_words_token_ids
        return (seqs, a.output_token_ids) if seqs else None

    def apply(self, logits):
        rows, toks = [], []
        for row, (seqs, out) in self.states.items():
            for seq in seqs:
                n = len(seq) - 1
                if n == 0 or (len(out) >= n and out[-n:] == seq[:-1]):
                    rows.append(row)
                    toks.append(seq[-1])
        if rows:
            logits[rows, toks] = NEG_INF
        return logits


class MinTokensProcessor(RowStateProcessor):
    """EOS and stop_token_ids get -inf until the row has min_tokens output tokens, unless they
    are all the row has left: a hard constraint applied before this one (a grammar that can only
    end, allowed_token_ids, bad_words) wins over min_tokens, so no row is ever left with every
    token at -inf (which would sample an arbitrary token the constraint forbids)."""

    def supports_positions(self) -> bool:
        return True  # reads the live output list or per-request constants only

    def is_argmax_invariant(self) -> bool:
        return False

    def new_state(self, a: AddedRow):
        p = a.params
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(a.eos_token_ids))
        if p.min_tokens > 0 and stops:
            # Only a row with a hard constraint can be left with nothing but stop tokens.
            constrained = bool(p.structured_outputs or p.allowed_token_ids or p.bad_words)
            return p.min_tokens, stops, a.output_token_ids, constrained
        return None

    def apply(self, logits):
        rows, toks, scan = [], [], []
        for row, (min_tokens, stops, out, constrained) in self.states.items():
            if len(out) < min_tokens:
                rows += [row] * len(stops)
                toks += stops
                if constrained:
                    scan.append(row)
        if not rows:
            return logits
        if not scan:
            logits[rows, toks] = NEG_INF
            return logits
        dev = logits.device
        r, t = torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)
        kept = logits[r, t]
        logits[r, t] = NEG_INF
        # Rows left with no finite logit get their stop tokens back as they were (a stop token
        # the constraint forbids stays forbidden).
        empty = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev)
        # The max of every row (one read pass) rather than of logits[scan]: that gather copies
        # the rows, a fresh (rows, V) tensor that page-faults its whole size on CPU.
        empty[scan] = torch.isneginf(logits.amax(dim=-1)[scan])
        logits[r, t] = torch.where(empty[r], kept, NEG_INF)
        return logits


class LogitBiasProcessor(RowStateProcessor):
    """Adds logit_bias[token] to the row's logit of token (values already clamped to
    [-100, 100] by SamplingParams)."""

    def __init__(self, config: ProcessorConfig):
        super().__init__(config)
        self.index: tuple[torch.Tensor, torch.Tensor] | None = None
        self.values: torch.Tensor | None = None

    def supports_positions(self) -> bool:
        return True  # reads the live output list or per-request constants only

    def is_argmax_invariant(self) -> bool:
        return False

    def new_state(self, a: AddedRow):
        return a.params.logit_bias or None

    def update_state(self, update: BatchUpdate | None) -> bool:
        if super().update_state(update):
            rows, toks, vals = [], [], []
            for r, bias in self.states.items():
                rows += [r] * len(bias)
                toks += list(bias)
                vals += list(bias.values())
            dev = self.config.device
            self.index = (torch.tensor(rows, dtype=torch.long, device=dev),
                          torch.tensor(toks, dtype=torch.long, device=dev))
            self.values = torch.tensor(vals, dtype=torch.float32, device=dev)
        return False

    def apply(self, logits):
        if self.states:
            logits.index_put_(self.index, self.values, accumulate=True)
        return logits


class MinPProcessor(RowStateProcessor):
    """Drops tokens whose probability is below min_p times the row's top probability. On
    temperature-scaled logits that is: logit < max_logit + log(min_p); no softmax needed.
    Rows without min_p have log(0) = -inf as their margin, so one pass serves the batch."""

    def __init__(self, config: ProcessorConfig):
        super().__init__(config)
        self.log_min_p = torch.full((config.max_num_reqs,), NEG_INF, device=config.device)

    def supports_positions(self) -> bool:
        return True  # reads the live output list or per-request constants only

    def is_argmax_invariant(self) -> bool:
        return True

    def new_state(self, a: AddedRow):
        return a.params.min_p if a.params.min_p > 0 else None

    def update_state(self, update: BatchUpdate | None) -> bool:
        if super().update_state(update):
            self.log_min_p.fill_(NEG_INF)
            for r, min_p in self.states.items():
                self.log_min_p[r] = float(torch.tensor(min_p).log())
        return False

    def apply(self, logits):
        if self.states:
            R = logits.shape[0]
            kernels = cpu_kernels.kernels_for(logits, self.log_min_p)
            if kernels is not None and logits.is_contiguous():
                kernels.min_p(logits, self.log_min_p[:R])  # one read per row, no (R, V) mask
            else:
                cutoff = logits.max(dim=-1, keepdim=True).values + self.log_min_p[:R, None]
                logits.masked_fill_(logits < cutoff, NEG_INF)
        return logits


class ThinkingBudgetProcessor(RowStateProcessor):
    """Ends the thinking phase once thinking_token_budget tokens were spent in it, by forcing
    the end-of-thinking token. Whether a row starts in thinking follows ReasoningConfig (the
    prompt's last think tag); a later <think> in the output restarts the count."""

    def __init__(self, config: ProcessorConfig, reasoning: ReasoningConfig | None):
        super().__init__(config)
        self.reasoning = reasoning

    def supports_positions(self) -> bool:
        return True  # reads the live output list or per-request constants only

    def is_argmax_invariant(self) -> bool:
        return False

    def new_state(self, a: AddedRow):
        budget = a.params.thinking_token_budget
        if budget is None or self.reasoning is None:
            return None
        thinking = not self.reasoning.is_reasoning_end(a.prompt_token_ids)
        # [budget, output list, tokens seen, thinking?, tokens spent thinking]
        return [budget, a.output_token_ids, 0, thinking, 0]

    def apply(self, logits):
        force = []
        start, end = (self.reasoning.start_id, self.reasoning.end_id) if self.reasoning else (0, 0)
        for row, st in self.states.items():
            budget, out, seen, thinking, spent = st
            for t in out[seen:]:
                if t == start:
                    thinking, spent = True, 0
                elif t == end:
                    thinking = False
                elif thinking:
                    spent += 1
            st[2:] = [len(out), thinking, spent]
            if thinking and spent >= budget:
                force.append(row)
        if force:
            logits[force] = NEG_INF
            logits[force, end] = 0.0
        return logits
