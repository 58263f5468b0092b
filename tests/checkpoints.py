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


GEMMA_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"]


def make_gemma_checkpoint(arch: str, path: Path, dtype: torch.dtype = torch.float32, *,
                          vocab_size=512, sliding_window=16, seed=0, **overrides):
    """Save a small random Gemma 2 or Gemma 3 (text) model to `path`: 4 layers mixing sliding
    and full attention, head_dim 16, tied embeddings; Gemma 2 with both soft-caps on (its
    defaults). Returns the transformers model (eval, eager attention: the path that applies
    soft-capping)."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, sliding_window=sliding_window, layer_types=GEMMA_LAYER_TYPES,
        query_pre_attn_scalar=24, attn_implementation="eager",
    )
    common.update(overrides)
    if arch == "gemma2":
        cfg = tf.Gemma2Config(**{"attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0,
                                 **common})
        cls = tf.Gemma2ForCausalLM
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(**common)
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    # Random (1 + w) norms, and large post-attention/feedforward scales: with tied embeddings
    # scaled by sqrt(hidden), a model whose layers add little repeats its input token; these
    # give 5-20 distinct greedy tokens in 24 with top-2 logit gaps above 0.01.
    post_scale = 10.0 if arch == "gemma3" else 5.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "post_" in name:
                p.normal_(post_scale, 0.5)
            elif "norm" in name:
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.3)
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    return model
