"""Qwen3: the Llama decoder with an RMSNorm on each head of q and k before rotary."""

from ladle.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    switches = {"qk_norm": True}
