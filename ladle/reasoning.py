"""Token-level view of a request's thinking phase, shared by the engine's consumers of it (the
thinking-token budget and structured outputs). The text-level parsers live in parsers/."""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True, slots=True)
class ReasoningConfig:
    parser: str  # qwen3 | deepseek_r1
    start_id: int  # <think>
    end_id: int  # </think>

    @classmethod
    def from_tokenizer(cls, parser: str | None, tokenizer) -> ReasoningConfig | None:
        if parser is None:
            return None
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: {parser!r} is unknown; accepted: "
                             + ", ".join(REASONING_PARSERS))
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        if "<think>" not in vocab or "</think>" not in vocab:
            raise ValueError(f"reasoning_parser: {parser!r} needs <think> and </think> tokens, "
                             "which this model's tokenizer does not have")
        return cls(parser, vocab["<think>"], vocab["</think>"])

    def is_reasoning_end(self, prompt_token_ids: list[int]) -> bool:
        """Whether output starts after the thinking phase. The last think tag in the prompt
        decides: </think> (e.g. Qwen3 with enable_thinking=false) means ended; <think> or no tag
        means the output opens with thinking, which ends at the first </think>."""
        for t in reversed(prompt_token_ids):
            if t == self.end_id:
                return True
            if t == self.start_id:
                return False
        return False
