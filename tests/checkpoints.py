"""Tiny random-weight checkpoints written by transformers itself, the numerical reference."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3")


def make_checkpoint(arch: str, path: Path, dtype: torch.dtype = torch.float32, *, vocab_size=512,
                    tie=False, rope_scaling=None, max_shard_size=None, seed=0):
    """Save a small random model of `arch` to `path`; returns the transformers model (eval)."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tie, rms_norm_eps=1e-6,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=1e6)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32, rope_theta=1e6)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # larger weights than the default init, so tokens differ step to step
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5 if "embed" in name else 0.15)
            elif "norm" not in name:
                p.normal_(0, 0.1)  # biases
    model = model.to(dtype).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model
