"""Qwen3 reasoning: <think>...</think>, which the model may skip entirely.

- Output opening with <think> (Qwen3 hybrid, enable_thinking=true): reasoning until </think>.
- The prompt already ends in <think> (Qwen3-*-Thinking-2507 templates; pass
  `prompt_ends_in_think=True`): reasoning from the first character until </think>.
- Otherwise (enable_thinking=false: the template wrote an empty think block): all content.
- Output that ends inside reasoning (e.g. cut by max_tokens) is all reasoning.

The one stream/non-stream difference: when neither the prompt nor the output opened a think
block but a bare </think> appears, `extract` treats the text before it as reasoning (the prompt
must have opened the block), while a stream has already sent that text as content; it only drops
the tag. Pass `prompt_ends_in_think` (see parsers/choice.py's output_starts_in_reasoning) to avoid
the case.
"""

from ladle.parsers.reasoning.base import ReasoningParser, ReasoningParserManager, _Phase


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    def _phase_without_start_tag(self) -> _Phase:
        return _Phase.REASONING if self.prompt_ends_in_think else _Phase.IMPLICIT_CONTENT

    def extract(self, text: str) -> tuple[str | None, str | None]:
        if not self.prompt_ends_in_think and not text.lstrip().startswith(self.start_tag):
            reasoning, tag, content = text.partition(self.end_tag)
            if tag:
                return reasoning or None, content or None
        return super().extract(text)
