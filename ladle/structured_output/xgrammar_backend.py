"""The xgrammar backend (the default)."""

from __future__ import annotations

import json

import torch
import xgrammar as xgr

from ladle.structured_output.backend import (
    MAX_JSON_WHITESPACE,
    ConstraintKey,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)


def choice_to_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _is_ebnf(text: str) -> bool:
    return "::=" in text


def _has_length_limited_string(node) -> bool:
    if isinstance(node, dict):
        if "minLength" in node or "maxLength" in node:
            return True
        return any(_has_length_limited_string(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_length_limited_string(v) for v in node)
    return False


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    def accept_tokens(self, token_ids):
        return all(self.matcher.accept_token(t) for t in token_ids)

    def validate_tokens(self, token_ids):
        accepted = []
        for t in token_ids:
            if not self.matcher.accept_token(t):
                break
            accepted.append(t)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens):
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self):
        return self.matcher.is_terminated()

    def reset(self):
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size, eos_token_ids, cache_bytes=0):
        super().__init__(tokenizer, vocab_size, eos_token_ids, cache_bytes)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=eos_token_ids)
        # xgrammar's own cache also keeps compiled sub-rules, which makes compiling schemas
        # that share parts much faster (20x and more), so it stays on; by default it never
        # evicts, so it gets the same byte bound as the manager's cache.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=cache_bytes > 0,
                                            cache_limit_bytes=max(cache_bytes, 1))

    @staticmethod
    def check(key: ConstraintKey) -> str | None:
        try:
            if key.kind == "json":
                xgr.Grammar.from_json_schema(key.spec, any_whitespace=key.any_whitespace)
                # xgrammar 0.2 lets raw control characters (a tab) into strings that have
                # minLength/maxLength, which strict JSON parsers reject: leave those to
                # llguidance.
                if _has_length_limited_string(json.loads(key.spec)):
                    return "strings with minLength/maxLength are not emitted as valid JSON"
            elif key.kind == "regex":
                xgr.Grammar.from_regex(key.spec)
            elif key.kind == "grammar":
                if _is_ebnf(key.spec):
                    xgr.Grammar.from_ebnf(key.spec)
                else:
                    xgr.Grammar.from_lark(key.spec)
            elif key.kind == "structural_tag":
                xgr.Grammar.from_structural_tag(key.spec)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the reason
            return _reason(e)
        return None

    def compile(self, key: ConstraintKey):
        c = self.compiler
        try:
            if key.kind == "json":
                return c.compile_json_schema(key.spec, any_whitespace=key.any_whitespace,
                                             max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if key.kind == "json_object":
                # Any object (not strict: any properties, any values), with whitespace capped as
                # for a schema.
                return c.compile_json_schema('{"type": "object"}',
                                             any_whitespace=key.any_whitespace, strict_mode=False,
                                             max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if key.kind == "regex":
                return c.compile_regex(key.spec)
            if key.kind == "choice":
                return c.compile_grammar(choice_to_ebnf(json.loads(key.spec)))
            if key.kind == "grammar":
                return c.compile_grammar(key.spec) if _is_ebnf(key.spec) else c.compile_lark(
                    key.spec)
            if key.kind == "structural_tag":
                return c.compile_structural_tag(key.spec)
        except Exception as e:
            raise ValueError(f"structured_outputs.{key.kind}: {_reason(e)}") from e
        raise ValueError(f"structured_outputs: unknown kind {key.kind!r}")

    def new_grammar(self, compiled) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))

    def compiled_size(self, compiled: xgr.CompiledGrammar) -> int:
        return compiled.memory_size_bytes


def _reason(e: Exception) -> str:
    # xgrammar prefixes messages with "[time] file:line: "; keep what follows.
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
