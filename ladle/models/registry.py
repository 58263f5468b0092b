"""The one registry of the architectures ladle serves: config.json's `architectures` name ->
(module under ladle/models/, class). A family lives in its own module over the shared layers
(layers.py, llama.py's attention and decoder layer); its module is imported only when a
checkpoint names it."""

from __future__ import annotations

import importlib

import torch

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5MoeForCausalLM"),
    # Image-text-to-text checkpoints served as their text model (the vision tower not loaded)
    "Qwen3_5ForConditionalGeneration": ("qwen3_next", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_next", "Qwen3_5MoeForConditionalGeneration"),
}

# The engine adds this key to the config dict it builds a model from: its max_model_len (None:
# not given; -1: "auto"). A family whose weights' meaning depends on the served context reads
# it: Phi-3's LongRoPE picks its factor set by it, as vLLM does (models/phi3.py).
SERVED_LEN_KEY = "ladle_max_model_len"


def architecture_class(arch: str) -> type[torch.nn.Module] | None:
    """The model class registered for `arch`, or None."""
    entry = ARCHITECTURES.get(arch)
    if entry is None:
        return None
    module, name = entry
    return getattr(importlib.import_module(f"ladle.models.{module}"), name)
