"""The llguidance backend: broader JSON Schema coverage; Lark grammars natively."""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance as llg
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import any_to_lark

from ladle.structured_output.backend import (
    MAX_JSON_WHITESPACE,
    ConstraintKey,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

# llguidance reports no memory size. A compiled matcher holds about 64 KiB plus 64 bytes per
# character of the grammar it was built from (measured with glibc's mallinfo2 on llguidance 1.9
# over JSON schemas, choices and regexes of 2 to 300 parts: within a factor of 2).
_BASE_BYTES = 64 * 2**10
_BYTES_PER_GRAMMAR_CHAR = 64


@dataclass(frozen=True, slots=True)
class GuidanceCompiled:
    matcher: llg.LLMatcher  # the template: each request gets a deep copy
    size_bytes: int  # estimated, see _BYTES_PER_GRAMMAR_CHAR


def _grammar(key: ConstraintKey) -> str:
    """The llguidance grammar (JSON text) for a constraint."""
    defaults = {"whitespace_flexible": key.any_whitespace}
    if key.any_whitespace:
        defaults["whitespace_pattern"] = f"[ \\t\\n\\r]{{0,{MAX_JSON_WHITESPACE}}}"
    if key.kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(key.spec, defaults=defaults)
    if key.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
    if key.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(key.spec)
    if key.kind == "choice":
        choices = json.loads(key.spec)
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    if key.kind == "grammar":
        return llg.LLMatcher.grammar_from_lark(any_to_lark(key.spec))
    if key.kind == "structural_tag":
        raise ValueError("structural_tag is served by the xgrammar backend only")
    raise ValueError(f"unknown kind {key.kind!r}")


class GuidanceGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: llg.LLMatcher):
        self.matcher = matcher

    def accept_tokens(self, token_ids):
        return self.matcher.consume_tokens(token_ids) and not self.matcher.is_error()

    def validate_tokens(self, token_ids):
        return token_ids[: self.matcher.validate_tokens(token_ids)]

    def rollback(self, num_tokens):
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self):
        return self.matcher.is_stopped()

    def reset(self):
        self.matcher.reset()


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer, vocab_size, eos_token_ids, cache_bytes=0):
        super().__init__(tokenizer, vocab_size, eos_token_ids, cache_bytes)
        self.lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                  eos_token=eos_token_ids[0] if eos_token_ids
                                                  else None)

    @staticmethod
    def check(key: ConstraintKey) -> str | None:
        try:
            grammar = _grammar(key)
        except Exception as e:
            return str(e).strip() or type(e).__name__
        err = llg.LLMatcher.validate_grammar(grammar)
        return err or None

    def compile(self, key: ConstraintKey):
        try:
            grammar = _grammar(key)
        except Exception as e:
            raise ValueError(f"structured_outputs.{key.kind}: {e}") from e
        # Building a matcher compiles the grammar; keep one as the template to copy.
        matcher = llg.LLMatcher(self.lltok, grammar)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{key.kind}: {matcher.get_error()}")
        return GuidanceCompiled(matcher, _BASE_BYTES + _BYTES_PER_GRAMMAR_CHAR * len(grammar))

    def new_grammar(self, compiled: GuidanceCompiled) -> GuidanceGrammar:
        return GuidanceGrammar(compiled.matcher.deep_copy())

    def compiled_size(self, compiled: GuidanceCompiled) -> int:
        return compiled.size_bytes
