"""SpeculativeConfig: the `speculative_config` of the engine (vLLM's JSON shape), checked once
at startup so a bad field is an error naming it, never a silent fallback."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # one verification step computes logits at 1 + k positions per row


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up in prompt + output
    prompt_lookup_max: int = 4  # longest; the longest match wins
    model: str | None = None  # draft_model only

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI flag) or an instance; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 3}')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; accepted: "
                             + ", ".join(sorted(known)))
        if "method" not in value:
            raise ValueError("speculative_config.method: required; accepted: " + ", ".join(METHODS))
        lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(value))
        if value["method"] == "draft_model" and lookup:
            raise ValueError(f"speculative_config.{lookup[0]}: only used by method 'ngram'; "
                             "the draft_model method drafts with its model")
        return cls(**value)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} is not supported; "
                             "accepted: " + ", ".join(METHODS))
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: {k!r}; accepted: an "
                             f"integer from 1 to {MAX_SPECULATIVE_TOKENS}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config.{name}: {v!r}; accepted: an integer "
                                     ">= 1")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min: {lo} is greater than "
                                 f"prompt_lookup_max ({hi})")
            if self.model is not None:
                raise ValueError("speculative_config.model: only used by method 'draft_model'; "
                                 "the ngram method has no draft model")
        else:
            if not self.model:
                raise ValueError("speculative_config.model: method 'draft_model' needs the path "
                                 "of a draft checkpoint")
            if not os.path.isdir(self.model):
                raise ValueError(f"speculative_config.model: {self.model!r} is not a checkpoint "
                                 "directory (accepted: a local directory with config.json and "
                                 "safetensors, sharing the target's vocabulary)")
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(f"speculative_config.model: {self.model!r} has no config.json; "
                                 "accepted: a checkpoint directory")
