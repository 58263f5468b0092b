"""SamplingParams: what one request asks of the output side. Checked in __post_init__; every
error names the field and the accepted values. Semantics follow vLLM's SamplingParams."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

_GREEDY_EPS = 1e-5  # temperatures below this mean greedy, as in vLLM
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")

# Bounds on what one request may ask for. They are checked here and nowhere else; the server
# turns the ValueError into a 400 that names the field. The ones a server may change (n, logprobs)
# are arguments of verify_for_model.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
DEFAULT_MAX_N = 128  # OpenAI's limit on n; --max-n raises it
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 1024
MAX_THINKING_TOKEN_BUDGET = 2**31 - 1


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request may ask for on this server: the model's vocabulary and the caps the server
    was started with (--max-logprobs, -1 for none but the vocabulary; --max-n)."""

    vocab_size: int
    max_logprobs: int = 20
    max_n: int = DEFAULT_MAX_N
    beam_search: bool = True  # False: the model's requests cannot fork (hybrid models)


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint kind; the engine compiles it into a grammar."""

    json: str | dict | None = None  # a JSON Schema (dict or its JSON text)
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    backend: str | None = None  # chosen by the engine when None

    def __post_init__(self):
        kinds = [k for k in ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar, "
                f"structural_tag must be set (got {kinds or 'none'})"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice: must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        for k in ("json", "json_object", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, k) not in (None, False):
                return k
        raise AssertionError("validated in __post_init__")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions returned per prompt
    best_of: int | None = None  # candidates drawn; the n with the highest cumulative logprob return
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias, clamped to [-100, 100]
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per output token (plus the sampled token's)
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw_logprobs"
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    thinking_token_budget: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None  # free-form, read by custom logits processors
    # Beam search (engine/beam_search.py): 0 = off, else the beams kept per step; the n best
    # finished beams are returned. Scores are sum(logprob) / generated_length ** length_penalty;
    # early_stopping is True, False or "never", as transformers defines them.
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Filled in by the engine from the tokenizer, not by users.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            bad = [v for v in bias.values() if not math.isfinite(v)]
            _check(not bad, "logit_bias", bad[:1], "finite biases (clamped to [-100, 100])")
            self.logit_bias = {k: max(-100.0, min(100.0, v)) for k, v in bias.items()}
        if self.seed is not None:
            self.seed = int(self.seed)
        if self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self) -> None:
        _check(self.n >= 1, "n", self.n, "an integer >= 1")
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of", self.best_of,
                   f"None or an integer >= n ({self.n})")
        # NaN fails every comparison below; infinities are ruled out by name.
        _check(0 <= self.temperature < math.inf, "temperature", self.temperature,
               "a finite float >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "a float in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k,
               "-1 or 0 (off) or an integer >= 1 (at or above the vocabulary size: off)")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "a float in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(-2 <= v <= 2, name, v, "a float in [-2, 2]")
        _check(0 < self.repetition_penalty < math.inf, "repetition_penalty",
               self.repetition_penalty, "a finite float > 0")
        if self.seed is not None:
            _check(INT64_MIN <= self.seed <= INT64_MAX, "seed", self.seed,
                   f"an integer in [{INT64_MIN}, {INT64_MAX}]")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"an integer <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check(self.logprobs >= 0, "logprobs", self.logprobs, "an integer >= 0")
        if self.prompt_logprobs is not None:
            _check(self.prompt_logprobs >= 0, "prompt_logprobs", self.prompt_logprobs,
                   "an integer >= 0")
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", self.logprobs_mode,
               "one of " + ", ".join(LOGPROBS_MODES))
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", self.allowed_token_ids,
                   "a non-empty list of token ids")
        if self.thinking_token_budget is not None:
            _check(0 <= self.thinking_token_budget <= MAX_THINKING_TOKEN_BUDGET,
                   "thinking_token_budget", self.thinking_token_budget,
                   f"an integer in [0, {MAX_THINKING_TOKEN_BUDGET}]")
        self._verify_beam_search()
        _check_count(self.stop, MAX_STOP_STRINGS, "stop", "strings")
        for s in self.stop:
            _check(0 < len(s) <= MAX_STOP_STRING_CHARS, "stop", s[:40],
                   f"non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        _check_count(self.stop_token_ids, MAX_STOP_TOKEN_IDS, "stop_token_ids", "token ids")
        if self.bad_words is not None:
            _check_count(self.bad_words, MAX_BAD_WORDS, "bad_words", "words")
            for w in self.bad_words:
                _check(len(w) <= MAX_BAD_WORD_CHARS, "bad_words", w[:40],
                       f"words of at most {MAX_BAD_WORD_CHARS} characters")

    def _verify_beam_search(self) -> None:
        _check(isinstance(self.beam_width, int) and self.beam_width >= 0, "beam_width",
               self.beam_width, "0 (no beam search) or an integer >= 1")
        _check(math.isfinite(self.length_penalty), "length_penalty", self.length_penalty,
               "a finite float")
        _check(self.early_stopping in (True, False, "never"), "early_stopping",
               self.early_stopping, 'true, false or "never"')
        if not self.beam_width:
            _check(self.length_penalty == 1.0, "length_penalty", self.length_penalty,
                   "1.0 unless beam search is on (it only scores beams)")
            _check(self.early_stopping is False, "early_stopping", self.early_stopping,
                   "false unless beam search is on (it only ends beam searches)")
            return
        _check(self.temperature < _GREEDY_EPS, "temperature", self.temperature,
               "0 with beam search (sampled beam search is not implemented)")
        _check(self.best_of is None, "best_of", self.best_of,
               "None with beam_width (the width is the search's candidates)")
        _check(self.n <= self.beam_width, "n", self.n,
               f"at most the beam width ({self.beam_width}): the n best beams are returned")
        _check(not self.stop, "stop", self.stop,
               "no stop strings with beam search (they are matched on streamed text, after the "
               "search has chosen its beams); use stop_token_ids")
        _check(self.prompt_logprobs is None, "prompt_logprobs", self.prompt_logprobs,
               "none with beam search")
        _check(self.thinking_token_budget is None, "thinking_token_budget",
               self.thinking_token_budget, "none with beam search")

    def verify_for_model(self, limits: RequestLimits) -> None:
        """Checks that need the model or the server's limits: token ids in range, list sizes up
        to the vocabulary, n and logprobs under the server's caps. A top_k at or above the
        vocabulary size means no top-k (as vLLM)."""
        vocab_size, max_logprobs, max_n = limits.vocab_size, limits.max_logprobs, limits.max_n
        if self.beam_width and not limits.beam_search:
            raise ValueError("use_beam_search: this model (hybrid linear attention) keeps "
                             "one recurrent state per request, which beams cannot fork yet; "
                             "accepted: use_beam_search false")
        for name in ("n", "best_of", "beam_width"):  # best_of >= n is checked in verify()
            v = getattr(self, name)
            _check(v is None or v <= max_n, name, v,
                   f"an integer in [1, {max_n}] (the server's --max-n)")
        if self.top_k >= vocab_size:
            self.top_k = 0
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            ids = getattr(self, name) or []
            _check_count(ids, vocab_size, name, "entries (the vocabulary size)")
            bad = [t for t in ids if not 0 <= int(t) < vocab_size]
            if bad:
                raise ValueError(
                    f"{name}: token id(s) {bad[:5]} outside the vocabulary; accepted: 0 to "
                    f"{vocab_size - 1}"
                )
        cap = vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v > cap:
                raise ValueError(
                    f"{name}: {v} is out of range; accepted: 0 to {cap} (the server's "
                    "--max-logprobs; -1 allows up to the vocabulary size)"
                )

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenise bad_words the way vLLM does: each word as written and with a leading
        space (the form it takes mid-sentence), so both spellings are banned. Runs in the
        frontend; the engine only sees token ids."""
        if not self.bad_words:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if plain:
                seqs.append(plain)
            # The spaced form counts only when the space makes a different word token of the
            # same length (not a lone space token in front of the plain form).
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(spaced)
        self.bad_words_token_ids = seqs

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def num_candidates(self) -> int:
        """Outputs drawn for one prompt: best_of when given, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def is_ranked(self) -> bool:
        """best_of > n: the candidates are ranked by cumulative logprob and the best n returned
        (OpenAI's best_of; vLLM V0's ranking for sampling). The value ranked is the sampled
        token's logprob as the engine reports it under logprobs_mode, by default raw_logprobs:
        the model's own distribution, before temperature, penalties, biases and top-k/top-p."""
        return self.best_of is not None and self.best_of > self.n

    @property
    def all_stop_token_ids(self) -> list[int]:
        return self.stop_token_ids or []

    def child(self, index: int) -> SamplingParams:
        """Params of choice (or best_of candidate) `index` of a request: one output, seed +
        index."""
        from dataclasses import replace

        # seed + index, wrapped within int64 so the largest seed still has n children
        seed = None if self.seed is None else (self.seed + index + 2**63) % 2**64 - 2**63
        return replace(self, n=1, best_of=None, seed=seed)


def _check(ok: bool, name: str, value, accepted: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {value!r} is invalid; accepted: {accepted}")


def _check_count(items, most: int, name: str, what: str) -> None:
    if len(items) > most:
        raise ValueError(f"{name}: {len(items)} given; accepted: at most {most} {what}")


@dataclass(slots=True)
class BeamSearchParams:
    """LLM.beam_search's parameters, as vLLM's (plus early_stopping). The search is
    transformers' `generate(num_beams=beam_width, do_sample=False)`: see engine/beam_search.py."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # only 0: sampled beam search is not implemented
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    logprobs: int | None = None  # top logprobs per token of each returned beam
    skip_special_tokens: bool = True

    def to_sampling_params(self) -> SamplingParams:
        """The engine's form: n = beam_width (every beam is returned, best first)."""
        return SamplingParams(n=self.beam_width, beam_width=self.beam_width,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              temperature=self.temperature, length_penalty=self.length_penalty,
                              early_stopping=self.early_stopping, logprobs=self.logprobs,
                              skip_special_tokens=self.skip_special_tokens)
