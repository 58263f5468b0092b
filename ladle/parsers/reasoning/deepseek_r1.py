"""DeepSeek-R1 reasoning: the output is reasoning until </think>, with or without <think>.

R1's newer chat templates end the prompt with "<think>\\n", so the model writes only </think>;
older ones let the model write <think> itself; both read the same. Output that never writes
</think> (cut by max_tokens, or the model never stopped thinking) is all reasoning.
"""

from ladle.parsers.reasoning.base import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    # The base parser's default already reads output without a start tag as reasoning, whatever
    # `prompt_ends_in_think` says.
    pass
