"""ladle: an OpenAI-compatible LLM inference server with vLLM's semantics."""

from ladle.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from ladle.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]


def __getattr__(name):
    # LLM pulls in torch and the engine; keep `import ladle` light for the API process.
    if name == "LLM":
        from ladle.llm import LLM

        return LLM
    raise AttributeError(name)
