"""Mistral, Phi-3, OLMo 2 and Granite against transformers, on tiny random-weight float32
checkpoints that transformers itself writes: greedy tokens equal to `generate` and logits within
float32 rounding of a transformers forward, for 4 prompts x 32 tokens, plain, in chunks and
through prefix-cache hits, and with -tp 2. Prompts are 40-120 tokens, so
Mistral's window (12) and Phi-3's (16) slide. Phi-3 with LongRoPE: short factors when
max_model_len is at most original_max_position_embeddings, long ones (and a prompt longer than
that, which transformers rotates wholly with them) otherwise."""

from __future__ import annotations

import pytest
import torch
from test_engine_numerics import reference_logits, run

from ladle.config import EngineConfig
from ladle.engine.core import EngineCore
from ladle.models.phi3 import read_rope
from ladle.models.registry import SERVED_LEN_KEY

NUM_DECODE = 32
FP32_TOL = 2e-4  # as tests/test_engine_numerics.py: float32 agrees to rounding
_gen = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (40, 63, 88, 120)]
LONGROPE_ORIGINAL = 256  # original_max_position_embeddings of the LongRoPE checkpoint
_factors = torch.Generator().manual_seed(3)
SHORT_FACTOR = (1 + 3 * torch.rand(6, generator=_factors)).tolist()  # 6: rotary_dim 12 / 2
LONG_FACTOR = (2 + 14 * torch.rand(6, generator=_factors)).tolist()

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
# family -> (transformers config class and model class names, config fields, engine options).
FAMILIES = {
    # head_dim 32 with hidden 64 and 4 heads: head_dim is read from the config, not derived.
    "mistral": ("Mistral", dict(head_dim=32, sliding_window=12), {}),
    "phi3": ("Phi3", dict(partial_rotary_factor=0.5, sliding_window=16), {}),
    # max_position_embeddings / original = 2: attention factor sqrt(1 + ln 2 / ln 256).
    "phi3-longrope": ("Phi3", dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=LONGROPE_ORIGINAL,
        rope_scaling={"rope_type": "longrope", "rope_theta": 10000.0,
                      "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}),
        dict(max_model_len=LONGROPE_ORIGINAL)),  # short factors, as transformers below 256
    "olmo2": ("Olmo2", dict(attention_bias=True), {}),
    "granite": ("Granite", dict(embedding_multiplier=6.0, residual_multiplier=0.5,
                                attention_multiplier=0.15, logits_scaling=4.0), {}),
}


def make_family_checkpoint(family: str, path, **fields) -> torch.nn.Module:
    """Save a small random model of `family` to `path` (`fields` override its config); returns
    the transformers model (eval).
    Spread for greedy margins: matrices N(0, 0.15), embeddings N(0, 0.5), and lm_head N(0, 0.6),
    four times the other matrices, so the logits span about +-20 and the top two differ by
    1e-3 or more at nearly every step, against float32 errors of about 3e-5; norm weights
    N(1, 0.3) (OLMo 2's post-norms scale what each block adds), biases N(0, 0.1)."""
    import transformers as tf

    name, own, _ = FAMILIES[family]
    cfg = getattr(tf, f"{name}Config")(**(COMMON | own | fields))
    torch.manual_seed(0)
    model = getattr(tf, f"{name}ForCausalLM")(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lm_head" in pname:
                p.normal_(0, 0.6)
            elif p.dim() == 2:
                p.normal_(0, 0.5 if "embed" in pname else 0.15)
            elif "norm" in pname:
                p.normal_(1, 0.3)
            else:
                p.normal_(0, 0.1)
    model = model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, checkpoint path, transformers model, transformers' greedy continuations)."""
    path = tmp_path_factory.mktemp(request.param)
    ref = make_family_checkpoint(request.param, path)
    return request.param, path, ref, [generate(ref, p) for p in PROMPTS]


def generate(ref, prompt, num=NUM_DECODE) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=num, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine(family: str, path, **kw) -> EngineCore:
    kw = {"kv_cache_memory": "16MB", **FAMILIES[family][2], **kw}
    return EngineCore(EngineConfig(model=str(path), dtype="float32", **kw), keep_logits=True)


def assert_matches(ref, prompts, toks, logs, want_toks):
    for p, t, ours, want in zip(prompts, toks, logs, want_toks, strict=True):
        assert t == want
        err = (ours - reference_logits(ref, p, t)).abs().max().item()
        assert err <= FP32_TOL, err


def test_greedy_and_logits_match_transformers(family):
    name, path, ref, expected = family
    toks, logs = run(engine(name, path), PROMPTS)
    assert_matches(ref, PROMPTS, toks, logs, expected)
    assert all(len(set(t)) > 4 for t in toks)  # tokens vary, so equality means something


def test_chunked_prefill_and_prefix_cache_hits(family):
    """Prompts in 16-token chunks (each attends the earlier chunks from the cache, through the
    window where there is one), then the same prompts again on the same engine: their blocks
    come from the prefix cache."""
    name, path, ref, expected = family
    eng = engine(name, path, max_num_batched_tokens=16)
    toks, logs = run(eng, PROMPTS)
    assert eng.num_steps >= sum(len(p) for p in PROMPTS) // 16  # 311 prompt tokens: 19 chunks
    assert_matches(ref, PROMPTS, toks, logs, expected)
    hits_before = eng.kv_cache.num_prefix_hits
    toks, logs = run(eng, PROMPTS, start=100)
    # Every whole block of each prompt (2, 3, 5 and 7 blocks of 16 tokens) is a hit.
    assert eng.kv_cache.num_prefix_hits - hits_before >= 16 * (2 + 3 + 5 + 7)
    assert_matches(ref, PROMPTS, toks, logs, expected)


def test_tp2_matches_transformers(family):
    """-tp 2 (gloo), every family: Phi-3's fused qkv_proj and gate_up_proj are cut into each
    rank's q, k, v (gate, up) rows at load; OLMo 2's q/k norms span both ranks' heads (one
    all-reduce of the sums of squares); Mistral's window and Granite's multipliers ride on the
    Llama decoder's split."""
    name, path, ref, expected = family
    eng = engine(name, path, tensor_parallel_size=2)
    try:
        toks, logs = run(eng, PROMPTS)
    finally:
        eng.close()
    assert_matches(ref, PROMPTS, toks, logs, expected)


def test_longrope_long_factors_above_the_original_length(family):
    """max_model_len above original_max_position_embeddings: long factors at every position
    (vLLM's choice), which is what transformers uses for a prompt longer than the original
    length."""
    name, path, ref, _ = family
    if name != "phi3-longrope":
        pytest.skip("LongRoPE checkpoint only")
    prompt = torch.randint(3, 500, (LONGROPE_ORIGINAL + 44,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    toks, logs = run(engine(name, path, max_model_len=512), [prompt])
    assert_matches(ref, [prompt], toks, logs, [generate(ref, prompt)])


def test_phi3_rope_reads_both_config_styles():
    """Published Phi-3.5 / Phi-4-mini files: rope_scaling with `type` and a top-level
    partial_rotary_factor; transformers 5 writes rope_parameters. Both read alike; the factor
    set follows the served length."""
    old = {"rope_theta": 10000.0, "partial_rotary_factor": 0.75, "max_position_embeddings": 512,
           "original_max_position_embeddings": 256,
           "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTOR,
                            "long_factor": LONG_FACTOR}}
    new = {"max_position_embeddings": 512, "original_max_position_embeddings": 256,
           "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.75, "short_factor": SHORT_FACTOR,
                               "long_factor": LONG_FACTOR}}
    assert read_rope(old, 16) == read_rope(new, 16)
    assert read_rope(old, 16).longrope.factors == tuple(LONG_FACTOR)  # served: up to 512
    short = read_rope({**old, SERVED_LEN_KEY: 256}, 16).longrope
    assert short.factors == tuple(SHORT_FACTOR) and not short.is_long
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        read_rope({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 16)
