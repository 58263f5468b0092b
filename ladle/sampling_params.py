"""SamplingParams: what one request asks of the output side. Checked in __post_init__; every
error names the field and the accepted values. Semantics follow vLLM's SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

_GREEDY_EPS = 1e-5  # temperatures below this mean greedy, as in vLLM
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


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
    best_of: int | None = None  # accepted only equal to n (ranking extra candidates is not built)
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
    # Filled in by the engine from the tokenizer, not by users.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): max(-100.0, min(100.0, float(v)))
                               for k, v in self.logit_bias.items()}
        if self.seed is not None:
            self.seed = int(self.seed)
        if self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self) -> None:
        _check(self.n >= 1, "n", self.n, "an integer >= 1")
        if self.best_of is not None:
            _check(self.best_of == self.n, "best_of", self.best_of,
                   f"None or equal to n ({self.n}); ranking extra candidates is not supported")
        _check(self.temperature >= 0, "temperature", self.temperature, "a float >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "a float in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "-1 or 0 (off) or an integer >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "a float in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(-2 <= v <= 2, name, v, "a float in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty,
               "a float > 0")
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
            _check(self.thinking_token_budget >= 0, "thinking_token_budget",
                   self.thinking_token_budget, "an integer >= 0")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids in range, logprobs under the server's cap."""
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            ids = getattr(self, name) or []
            bad = [t for t in ids if not 0 <= int(t) < vocab_size]
            if bad:
                raise ValueError(
                    f"{name}: token id(s) {bad[:5]} outside the vocabulary; accepted: 0 to "
                    f"{vocab_size - 1}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and max_logprobs >= 0 and v > max_logprobs:
                raise ValueError(
                    f"{name}: {v} is above the server's maximum ({max_logprobs}); "
                    "accepted: 0 to max_logprobs (raise it with --max-logprobs)"
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
    def all_stop_token_ids(self) -> list[int]:
        return self.stop_token_ids or []

    def child(self, index: int) -> SamplingParams:
        """Params of choice `index` of an n > 1 request: one output, seed + index."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, best_of=None, seed=seed)


def _check(ok: bool, name: str, value, accepted: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {value!r} is invalid; accepted: {accepted}")
