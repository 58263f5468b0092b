"""Mistral: the Llama decoder with a sliding window (`sliding_window`, null for none) on every
layer, as transformers' modeling_mistral.py computes it."""

from ladle.models.llama import DecoderConfig, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_config(cls, hf_config: dict, switches: dict) -> DecoderConfig:
        # transformers' MistralConfig defaults: a key the file leaves out is read as these
        # (a missing sliding_window is 4096, not "none": only an explicit null turns it off).
        hf = {"max_position_embeddings": 4096 * 32, "sliding_window": 4096, **hf_config}
        return DecoderConfig.from_hf(hf, **switches, sliding_window=hf["sliding_window"])
