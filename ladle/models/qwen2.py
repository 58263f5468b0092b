"""Qwen2: the Llama decoder with biases on the q, k and v projections."""

from ladle.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    switches = {"qkv_bias": True}
