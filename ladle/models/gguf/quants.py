"""Dequantizers for GGUF's tensor types, in torch and vectorised over blocks: the pure-torch
twins of ladle's quantized kernels, equal to gguf-py's `gguf.quants.dequantize` bit for bit.

Exactness comes cheap: a scale is fp16 (11 significant bits) and quants and sub-block scales are
small integers, so every product (`d * scale`, then `* q`) is exact in float32 whatever the
order; the one rounding is adding the min (`- dmin * min`, `+ m`), done once, in float32. A
kernel may therefore fuse that multiply-add and still match.

A row is a run of blocks of `block_size` values stored in `type_size` bytes (gguf's
GGML_QUANT_SIZES). Each `_dequantize_*` maps blocks (n, type_size) uint8 to values
(n, block_size) float32. Multi-byte fields are little-endian; `d`, `m`, `dmin` are fp16."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ladle.runner.quant import IQ2_S_32, IQ2_XS_32, IQ2_XXS_32, IQ3_S_32, IQ3_XXS_32, IQ4_XS_32

QK_K = 256  # values in a k-quant super-block
# Values dequantized per step: bounds the temporaries (a few times this many floats) when a
# whole embedding matrix is dequantized at once.
_CHUNK_VALUES = 1 << 24


def dequantize(raw: np.ndarray | torch.Tensor, ggml_type: GGMLQuantizationType | int,
               shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of a tensor of `ggml_type` (or of a layout a type runs in: ladle's
    IQ4_XS_32, IQ2_XXS_32, IQ3_XXS_32, IQ3_S_32, IQ2_XS_32, IQ2_S_32) whose bytes are `raw`
    (numpy or torch, uint8, any shape), in `shape` (torch order). Always new memory: `raw` may
    be a read-only view of a memory-mapped file, and is only read."""
    if ggml_type in _KERNEL_LAYOUTS:
        name, (block_size, type_size), fn = _KERNEL_LAYOUTS[ggml_type]
    else:
        ggml_type = GGMLQuantizationType(ggml_type)
        if ggml_type not in _DEQUANTIZERS:
            raise ValueError(f"ggml type {ggml_type.name} cannot be dequantized; supported: "
                             f"{', '.join(t.name for t in SUPPORTED_TYPES)}")
        name, fn = ggml_type.name, _DEQUANTIZERS[ggml_type]
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    shape = tuple(int(s) for s in shape)
    if shape and shape[-1] % block_size:
        raise ValueError(f"shape {shape}: rows of {shape[-1]} values do not split into "
                         f"{name} blocks of {block_size}")
    num_blocks = math.prod(shape) // block_size
    data = _uint8_tensor(raw)
    if data.numel() != num_blocks * type_size:
        raise ValueError(f"{name} tensor of shape {shape} takes "
                         f"{num_blocks * type_size} bytes, got {data.numel()}")
    blocks = data.reshape(num_blocks, type_size)
    out = torch.empty(num_blocks, block_size, dtype=torch.float32)
    step = max(1, _CHUNK_VALUES // block_size)
    for start in range(0, num_blocks, step):
        out[start:start + step] = fn(blocks[start:start + step])
    return out.reshape(shape)


def _uint8_tensor(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        if raw.dtype != torch.uint8:
            raise ValueError(f"raw bytes must be uint8, got {raw.dtype}")
        return raw.reshape(-1)
    raw = np.ascontiguousarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"raw bytes must be uint8, got {raw.dtype}")
    with warnings.catch_warnings():
        # A read-only mapping: torch warns that writes would fail; nothing here writes to it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).reshape(-1)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, as float32 (n, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _fields(packed: torch.Tensor, width: int) -> torch.Tensor:
    """(..., m) bytes -> (..., 8 // width, m): field i holds bits [i*width, (i+1)*width) of
    each byte. ggml packs a run of values into the low bits of m bytes, the next run into the
    next bits, so reshaping the result to (..., 8 // width * m) puts values in order."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device).view(-1, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


# ---- float types ----------------------------------------------------------------------------

def _dequantize_f32(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float32)


def _dequantize_f16(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float16).float()


def _dequantize_bf16(b: torch.Tensor) -> torch.Tensor:
    # bf16 is the high half of a float32: widening is exact.
    return b.view(torch.bfloat16).float()


# ---- 32-value blocks ------------------------------------------------------------------------

def _dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    # 34 bytes: d, qs int8[32].  y = q * d
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: value j < 16 is the low nibble of byte j, 16 + j its high one."""
    return _fields(qs, 4).reshape(qs.shape[0], 32)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """qh (n, 4), a little-endian uint32 -> (n, 32): bit j is the 5th bit of value j."""
    return _fields(qh, 1).transpose(1, 2).reshape(qh.shape[0], 32)


def _dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    # 18 bytes: d, qs[16] (nibbles).  y = (q - 8) * d
    q = _nibbles(b[:, 2:]).to(torch.int8) - 8
    return q.float() * _f16(b, 0)


def _dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    # 20 bytes: d, m, qs[16] (nibbles).  y = q * d + m
    return _nibbles(b[:, 4:]).float() * _f16(b, 0) + _f16(b, 2)


def _dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    # 22 bytes: d, qh[4] (5th bits), qs[16] (low nibbles).  y = (q - 16) * d
    q = (_nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return q.float() * _f16(b, 0)


def _dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    # 24 bytes: d, m, qh[4] (5th bits), qs[16] (low nibbles).  y = q * d + m
    q = _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4)
    return q.float() * _f16(b, 0) + _f16(b, 2)


# MXFP4 (gpt-oss's experts): a block's 32 values are e2m1 codes (1 sign, 2 exponent, 1 mantissa
# bits) as ggml stores them, times 2 (integers): 0, 1, 2, 3, 4, 6, 8, 12 and their negatives.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _dequantize_mxfp4(b: torch.Tensor) -> torch.Tensor:
    # 17 bytes: e (E8M0), qs[16] (nibbles, ggml's order).  y = value(q) * 2^(e - 128): the
    # doubled e2m1 values times half the block's power of two, as ggml_e8m0_to_fp32_half (for
    # e = 0 and 1 a float32 subnormal, which ldexp gives exactly).
    q = torch.tensor(MXFP4_VALUES, dtype=torch.float32)[_nibbles(b[:, 1:]).long()]
    return torch.ldexp(q, b[:, :1].to(torch.int32) - 128)


# ---- non-linear 4-bit: nibbles index a table of 16 int8 values ---------------------------------

# ggml's kvalues_iq4nl: IQ4_NL's and IQ4_XS's 16 values, spaced for a normal distribution.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_values(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16 * m) bytes of nibbles, 32 values per 16 bytes as Q4_0's (value j < 16 the low
    nibble of byte j, 16 + j its high one) -> (n, 32 * m) int8 table values."""
    n = qs.shape[0]
    nibbles = _fields(qs.reshape(n, -1, 16), 4).reshape(n, -1)
    return torch.tensor(IQ4_VALUES, dtype=torch.int8)[nibbles.long()]


def _dequantize_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    # 18 bytes: d, qs[16] (nibbles).  y = d * IQ4_VALUES[q]
    return _iq4_values(b[:, 2:]).float() * _f16(b, 0)


def _dequantize_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # 136 bytes: d, scales_h (a little-endian uint16: bits 2j, 2j + 1 are the high 2 bits of
    # sub-block j's scale), scales_l[4] (sub-block 2i's low 4 bits in byte i's low nibble,
    # 2i + 1's in its high one), qs[128] (each 32-value sub-block's nibbles as IQ4_NL's).
    # A scale is stored offset by 32.  y = (d * scale) * IQ4_VALUES[q]
    n = b.shape[0]
    dl = _iq4_xs_scales(b).unsqueeze(-1)  # (n, 8, 1)
    return (dl * _iq4_values(b[:, 8:]).reshape(n, 8, 32).float()).reshape(n, QK_K)


def _iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:
    """(n, 8) float32: d times each sub-block's 6-bit scale (exact: 11 bits times 6)."""
    n = b.shape[0]
    high = _fields(b[:, 2:4], 2).transpose(1, 2).reshape(n, 8)
    low = _fields(b[:, 4:8], 4).transpose(1, 2).reshape(n, 8)
    scales = (low | (high << 4)).to(torch.int8) - 32
    return _f16(b, 0) * scales.float()


def iq4_xs_as_32(raw: torch.Tensor) -> torch.Tensor:
    """IQ4_XS rows (..., 136 * blocks) uint8 as IQ4_XS_32 rows (..., 160 * blocks), the layout the
    quantized kernels run: each sub-block of 32 its own block, its float32 scale (d times the
    sub-block's scale, exact in float32; float16 would round it) then its 16 bytes of nibbles,
    so it multiplies as IQ4_NL's blocks do. 20 bytes per 32 values against 17."""
    lead = raw.shape[:-1]
    b = raw.reshape(-1, 136)
    n = b.shape[0]
    out = torch.empty(n, 8, 20, dtype=torch.uint8)
    out[:, :, :4] = _iq4_xs_scales(b).contiguous().view(torch.uint8).reshape(n, 8, 4)
    out[:, :, 4:] = b[:, 8:].reshape(n, 8, 16)
    return out.reshape(*lead, -1)


def _dequantize_iq4_xs_32(b: torch.Tensor) -> torch.Tensor:
    # 20 bytes: a float32 scale, then 16 bytes of nibbles as IQ4_NL's.  y = scale * value
    return _iq4_values(b[:, 4:]).float() * b[:, :4].contiguous().view(torch.float32)


# ---- i-quants on a grid: IQ2_XXS, IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S --------------------------------
# A super-block of 256 values: d, then per 32 values grid indices and a little-endian uint32
# word whose bits 7k .. 7k + 6 (k = 0 .. 3) are the signs of values 8k .. 8k + 7 (the eighth
# sign makes the count of minus signs even) and whose top 4 bits are a scale s. An index picks 8
# (IQ2_XXS) or 4 (IQ3_XXS) magnitudes from the type's fixed grid (ggml's iq2xxs_grid /
# iq3xxs_grid, as gguf-py ships them). y = d * (s + 1/2) / 4 (IQ3_XXS: / 2) * magnitude * sign,
# every step exact in float32 (11 bits times 5 times 6).

@functools.cache
def iq_grid(ggml_type: GGMLQuantizationType | int) -> torch.Tensor:
    """uint8 (256, 8) for IQ2_XXS, (256, 4) for IQ3_XXS, (512, 4) for IQ3_S, (512, 8) for
    IQ2_XS, (1024, 8) for IQ2_S: the magnitudes index i picks."""
    cls = {GGMLQuantizationType.IQ2_XXS: gguf.quants.IQ2_XXS,
           GGMLQuantizationType.IQ3_XXS: gguf.quants.IQ3_XXS,
           GGMLQuantizationType.IQ3_S: gguf.quants.IQ3_S,
           GGMLQuantizationType.IQ2_XS: gguf.quants.IQ2_XS,
           GGMLQuantizationType.IQ2_S: gguf.quants.IQ2_S}[GGMLQuantizationType(ggml_type)]
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).astype(np.uint8))


# The sign byte of 7 sign bits: bit 7 set where the seven have an odd count (ggml's ksigns).
_SIGN_BYTES = torch.tensor([i | (bin(i).count("1") & 1) << 7 for i in range(128)],
                           dtype=torch.uint8)
# type -> (bytes per super-block, bytes of grid indices per 32 values, where the words start)
_GRID_LAYOUT = {GGMLQuantizationType.IQ2_XXS: (66, 4, None),
                GGMLQuantizationType.IQ3_XXS: (98, 8, 66)}


def _grid_as_32(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """Super-blocks (..., bytes * blocks) -> blocks of 32: each 32's float32 scale (d * (s + 1/2)
    / 4, IQ3_XXS / 2: exact), its grid indices as stored (IQ3_XXS: its values' level codes,
    _as_codes), then its 32 sign bits (a little-endian uint32, bit i: value i negative; the
    eighth of each 8 computed), so the kernels unpack neither."""
    size, idx, words = _GRID_LAYOUT[ggml_type]
    lead = raw.shape[:-1]
    b = raw.reshape(-1, size)
    n = b.shape[0]
    if words is None:  # IQ2_XXS: each 32's indices, then its word
        pairs = b[:, 2:].reshape(n, 8, 8)
        indices, word_bytes = pairs[:, :, :4], pairs[:, :, 4:]
    else:
        indices = b[:, 2:words].reshape(n, 8, idx)
        word_bytes = b[:, words:].reshape(n, 8, 4)
    word = word_bytes.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # (n, 8, 1)
    step = 0.25 if ggml_type == GGMLQuantizationType.IQ2_XXS else 0.5
    scale = _f16(b, 0).unsqueeze(-1) * ((word >> 28).float() + 0.5) * step  # (n, 8, 1)
    signs = _SIGN_BYTES[(word >> torch.tensor([0, 7, 14, 21])) & 127]  # (n, 8, 4)
    scale = scale.contiguous().view(torch.uint8)
    if ggml_type == GGMLQuantizationType.IQ3_XXS:
        return _as_codes(scale, indices.long(), signs, ggml_type).reshape(*lead, -1)
    out = torch.empty(n, 8, 8 + idx, dtype=torch.uint8)
    out[:, :, :4] = scale
    out[:, :, 4:4 + idx] = indices
    out[:, :, 4 + idx:] = signs
    return out.reshape(*lead, -1)


def iq2_xxs_as_32(raw: torch.Tensor) -> torch.Tensor:
    """IQ2_XXS rows (..., 66 * blocks) as IQ2_XXS_32 rows (..., 96 * blocks): 12 bytes per 32
    values against 8.25."""
    return _grid_as_32(raw, GGMLQuantizationType.IQ2_XXS)


def iq3_xxs_as_32(raw: torch.Tensor) -> torch.Tensor:
    """IQ3_XXS rows (..., 98 * blocks) as IQ3_XXS_32 rows (..., 160 * blocks): 20 bytes per 32
    values against 12.25."""
    return _grid_as_32(raw, GGMLQuantizationType.IQ3_XXS)


# The IQ3 grids' magnitudes are 8 levels each (IQ3_XXS 4, 12, .. 52, 62; IQ3_S 1, 3, .. 15): their
# blocks of 32 (IQ3_XXS_32, IQ3_S_32, one layout of 20 bytes) hold each value's level as a 3-bit
# code, value i's in bits 3i .. 3i + 2 of 12 bytes (the kernels expand codes in registers, where
# indices took a gather per 32 values), between the float32 scale and the 32 sign bits.

@functools.cache
def iq3_levels(ggml_type: GGMLQuantizationType | int) -> torch.Tensor:
    """uint8 (8,): an IQ3 grid's distinct magnitudes, ascending (code c: levels[c])."""
    return torch.from_numpy(np.unique(iq_grid(ggml_type).numpy()))


@functools.cache
def _grid_codes(ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """int64 (entries, 4): each grid entry's magnitudes as level codes."""
    return torch.searchsorted(iq3_levels(ggml_type).long(), iq_grid(ggml_type).long())


def _as_codes(scale: torch.Tensor, index: torch.Tensor, signs: torch.Tensor,
              ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """(n, 8, 20) blocks of 32 from each 32's scale bytes (n, 8, 4), grid indices (n, 8, 8)
    and sign bytes (n, 8, 4)."""
    n = index.shape[0]
    codes = _grid_codes(ggml_type)[index].reshape(n, 8, 4, 8)  # 4 runs of 8 values
    word = (codes << (3 * torch.arange(8))).sum(-1)  # (n, 8, 4): 24 bits each
    out = torch.empty(n, 8, 20, dtype=torch.uint8)
    out[:, :, :4] = scale
    out[:, :, 4:16] = ((word.unsqueeze(-1) >> torch.tensor([0, 8, 16])) & 255).reshape(n, 8, 12)
    out[:, :, 16:] = signs
    return out


# IQ3_S: 110 bytes, d, qs[64] (the low 8 bits of 8 grid indices per 32 values), qh[8] (their
# ninth bits, bit k of byte j: index k of sub-block j), signs[32] (4 bytes per 32 values, bit i
# of the 32: value i negative), scales[4] (4 bits per 32 values, sub-block 2i's the low nibble of
# byte i).  y = d * (2s + 1) * mag * sign


def iq3_s_as_32(raw: torch.Tensor) -> torch.Tensor:
    """IQ3_S rows (..., 110 * blocks) as IQ3_S_32 rows (..., 160 * blocks): each 32's float32
    scale d * (2s + 1) (exact), its values' level codes, the 32 sign bits: 20 bytes per 32
    values against 13.75."""
    lead = raw.shape[:-1]
    b = raw.reshape(-1, 110)
    n = b.shape[0]
    s = _fields(b[:, 106:110], 4).transpose(1, 2).reshape(n, 8, 1)
    scale = (_f16(b, 0).unsqueeze(-1) * (2 * s + 1).float()).view(torch.uint8)
    ninth = _fields(b[:, 66:74], 1).transpose(1, 2).long()  # (n, 8, 8): bit k of byte j
    index = b[:, 2:66].reshape(n, 8, 8).long() | ninth << 8
    return _as_codes(scale, index, b[:, 74:106].reshape(n, 8, 4), GGMLQuantizationType.IQ3_S
                     ).reshape(*lead, -1)


# IQ2_XS: 74 bytes, d, qs[32] (a little-endian uint16 per 8 values: a 9-bit grid index, then
# the 7-bit index of their sign byte as IQ2_XXS's), scales[8] (per 32 values: the low nibble
# for values 0-15, the high one for 16-31). IQ2_S: 82 bytes, d, qs[32] (the low 8 bits of an
# index per 8 values), signs[32] (a byte per 8 values, bit i: value i negative), qh[8] (per 32
# values: bits 2k, 2k + 1 the high bits of index k), scales[8] as IQ2_XS's. Both pick 8
# magnitudes per index (grids of 512 and 1024 entries); y = d * (s + 1/2) / 4 * mag * sign per 16
# values. As blocks of 32 (IQ2_XS_32, IQ2_S_32: one layout, 14 bytes): the float32 d / 8, the
# indices' low bytes, the 32 sign bits, the byte of the indices' high bits (qh's), the byte of
# the halves' scales; the kernels multiply a half's integer sum by 2s + 1.


def _grid_halves_as_32(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    size = 74 if ggml_type == GGMLQuantizationType.IQ2_XS else 82
    lead = raw.shape[:-1]
    b = raw.reshape(-1, size)
    n = b.shape[0]
    out = torch.empty(n, 8, 14, dtype=torch.uint8)
    out[:, :, :4] = (_f16(b, 0) / 8).unsqueeze(-1).expand(n, 8, 1).contiguous().view(torch.uint8)
    if ggml_type == GGMLQuantizationType.IQ2_XS:
        qs = b[:, 2:66].contiguous().view(torch.int16).long().reshape(n, 8, 4) & 0xFFFF
        out[:, :, 4:8] = qs & 255
        out[:, :, 8:12] = _SIGN_BYTES[qs >> 9]
        out[:, :, 12] = (((qs >> 8) & 1) << torch.tensor([0, 2, 4, 6])).sum(-1)
        out[:, :, 13] = b[:, 66:74]
    else:
        out[:, :, 4:8] = b[:, 2:34].reshape(n, 8, 4)
        out[:, :, 8:12] = b[:, 34:66].reshape(n, 8, 4)
        out[:, :, 12] = b[:, 66:74]
        out[:, :, 13] = b[:, 74:82]
    return out.reshape(*lead, -1)


def iq2_xs_as_32(raw: torch.Tensor) -> torch.Tensor:
    """IQ2_XS rows (..., 74 * blocks) as IQ2_XS_32 rows (..., 112 * blocks): 14 bytes per 32
    values against 9.25."""
    return _grid_halves_as_32(raw, GGMLQuantizationType.IQ2_XS)


def iq2_s_as_32(raw: torch.Tensor) -> torch.Tensor:
    """IQ2_S rows (..., 82 * blocks) as IQ2_S_32 rows (..., 112 * blocks): 14 bytes per 32
    values against 10.25."""
    return _grid_halves_as_32(raw, GGMLQuantizationType.IQ2_S)


def _grid_halves_values(b: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    # Blocks of 32 (n, 14).  y = d / 8 * (2s + 1) * mag * sign, s per 16 values
    n = b.shape[0]
    high = _fields(b[:, 12:13], 2).reshape(n, 4).long()
    if ggml_type == GGMLQuantizationType.IQ2_XS:  # 9-bit indices (the kernels mask alike)
        high &= 1
    index = b[:, 4:8].long() | high << 8
    mag = iq_grid(ggml_type)[index].reshape(n, 32).float()
    negative = _fields(b[:, 8:12], 1).transpose(1, 2).reshape(n, 32).bool()
    half = (2 * _fields(b[:, 13:14], 4).reshape(n, 2) + 1).float().repeat_interleave(16, dim=1)
    return torch.where(negative, -mag, mag) * half * b[:, :4].contiguous().view(torch.float32)


def _grid_values(b: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    # Blocks of 32 (n, 12 / 20): the scale, grid indices (IQ2_XXS) or level codes (IQ3), sign
    # bits.  y = scale * mag * sign
    n = b.shape[0]
    if ggml_type == GGMLQuantizationType.IQ2_XXS:
        mag, signs = iq_grid(ggml_type)[b[:, 4:8].long()].reshape(n, 32), b[:, 8:12]
    else:
        three = b[:, 4:16].reshape(n, 4, 3).long()
        word = three[..., 0] | three[..., 1] << 8 | three[..., 2] << 16  # 8 codes each
        codes = (word.unsqueeze(-1) >> (3 * torch.arange(8))) & 7
        mag, signs = iq3_levels(ggml_type)[codes.reshape(n, 32)], b[:, 16:20]
    negative = _fields(signs, 1).transpose(1, 2).reshape(n, 32).bool()
    mag = mag.float()
    return torch.where(negative, -mag, mag) * b[:, :4].contiguous().view(torch.float32)


def _grid_dequantizers(ggml_type: GGMLQuantizationType, as_32: Callable, size: int,
                       values: Callable) -> tuple[Callable, Callable]:
    """A grid type's dequantizers: of its blocks of 32 (n, size) and of the file's super-blocks
    (n, bytes), through the rewrite into blocks of 32."""
    def blocks_32(b: torch.Tensor) -> torch.Tensor:
        return values(b, ggml_type)

    def super_blocks(b: torch.Tensor) -> torch.Tensor:
        return blocks_32(as_32(b).reshape(-1, size)).reshape(b.shape[0], QK_K)
    return blocks_32, super_blocks


T = GGMLQuantizationType
_dequantize_iq2_xxs_32, _dequantize_iq2_xxs = _grid_dequantizers(T.IQ2_XXS, iq2_xxs_as_32, 12,
                                                                 _grid_values)
_dequantize_iq3_xxs_32, _dequantize_iq3_xxs = _grid_dequantizers(T.IQ3_XXS, iq3_xxs_as_32, 20,
                                                                 _grid_values)
_dequantize_iq3_s_32, _dequantize_iq3_s = _grid_dequantizers(T.IQ3_S, iq3_s_as_32, 20,
                                                             _grid_values)
_dequantize_iq2_xs_32, _dequantize_iq2_xs = _grid_dequantizers(T.IQ2_XS, iq2_xs_as_32, 14,
                                                               _grid_halves_values)
_dequantize_iq2_s_32, _dequantize_iq2_s = _grid_dequantizers(T.IQ2_S, iq2_s_as_32, 14,
                                                             _grid_halves_values)
del T


# ---- types ladle only dequantizes at load ------------------------------------------------------
# IQ1_S, IQ1_M, TQ1_0, TQ2_0, NVFP4: no kernel runs them, so their tensors are dequantized at load
# (quantized.py checks that fits), by gguf-py's own numpy dequantizer, the definition the others
# here are tested against.

def _by_gguf_py(ggml_type: GGMLQuantizationType) -> Callable[[torch.Tensor], torch.Tensor]:
    def dequantize_blocks(b: torch.Tensor) -> torch.Tensor:
        values = gguf.quants.dequantize(np.ascontiguousarray(b.numpy()), ggml_type)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return dequantize_blocks


# ---- k-quants: 256-value super-blocks of 16 or 8 sub-blocks ---------------------------------

def _dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    # 84 bytes: scales[16] (per 16 values: scale in the low nibble, min in the high one),
    # qs[64] (2 bits a value: each half of 128 values is 4 runs of 32 in 32 bytes), d, dmin.
    # y = (d * scale) * q - (dmin * min)
    n = b.shape[0]
    scales = b[:, :16]
    q = _fields(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    dl = (_f16(b, 80) * (scales & 0xF).float()).unsqueeze(-1)  # (n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)
    return (dl * q - ml).reshape(n, QK_K)


def q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales: the low 4 bits of scale i are the low nibble of
    byte i (i < 8) or the high nibble of byte i - 8; its high 2 bits are bits 2 * (i // 4) of
    byte 8 + i % 4; stored offset by 32."""
    n = packed.shape[0]
    low = _fields(packed[:, :8], 4).reshape(n, 16)
    high = _fields(packed[:, 8:], 2).reshape(n, 16)
    return (low | (high << 4)).to(torch.int8) - 32


def pack_q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """q3_k_scales' inverse: (n, 16) int8 scales (-32..31) -> their (n, 12) bytes."""
    u = (scales.to(torch.int16) + 32).to(torch.uint8)
    low, high = u & 0xF, u >> 4
    out = torch.empty(u.shape[0], 12, dtype=torch.uint8)
    out[:, :8] = low[:, :8] | (low[:, 8:] << 4)
    out[:, 8:] = high[:, 0:4] | (high[:, 4:8] << 2) | (high[:, 8:12] << 4) | (high[:, 12:16] << 6)
    return out


def _q3_k_values(b: torch.Tensor) -> torch.Tensor:
    """110-byte Q3_K blocks -> their q (n, 16, 16) int8, -4..3: hmask[32] (value v's 3rd bit is
    bit v // 32 of byte v % 32), qs[64] (low 2 bits, laid out as Q2_K's); a value is its low 2
    bits, minus 4 when its hmask bit is clear."""
    n = b.shape[0]
    low = _fields(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16).to(torch.int8)
    hbit = _fields(b[:, :32], 1).reshape(n, 16, 16).to(torch.int8)
    return low - 4 * (1 - hbit)


def _dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    # 110 bytes: hmask[32], qs[64] (the values: _q3_k_values), scales[12] (16 6-bit), d.
    # y = (d * scale) * q
    n = b.shape[0]
    dl = (_f16(b, 108) * q3_k_scales(b[:, 96:108]).float()).unsqueeze(-1)  # (n, 16, 1)
    return (dl * _q3_k_values(b).float()).reshape(n, QK_K)


def _scales_mins_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 scales and 8 mins of 6 bits (ggml's get_scale_min_k4): sub-blocks 0-3
    keep theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 have
    their low 4 bits in bytes 8-11 (scale low nibble, min high nibble) and their high 2 bits
    in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    sc_lo, m_lo, packed_hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([sc_lo & 63, (packed_hi & 0xF) | ((sc_lo >> 6) << 4)], dim=1)
    mins = torch.cat([m_lo & 63, (packed_hi >> 4) | ((m_lo >> 6) << 4)], dim=1)
    return scales, mins


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    # 144 bytes: d, dmin, scales[12] (8 scales, 8 mins), qs[128]: each 64 values are 32 bytes,
    # low nibbles first.  Per 32-value sub-block: y = (d * scale) * q - (dmin * min)
    n = b.shape[0]
    scales, mins = _scales_mins_k4(b[:, 4:16])
    q = _fields(b[:, 16:].reshape(n, 4, 32), 4).reshape(n, 8, 32).float()
    dl = (_f16(b, 0) * scales.float()).unsqueeze(-1)  # (n, 8, 1)
    ml = (_f16(b, 2) * mins.float()).unsqueeze(-1)
    return (dl * q - ml).reshape(n, QK_K)


def _dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    # 176 bytes: d, dmin, scales[12] (as Q4_K), qh[32] (value v's 5th bit is bit v // 32 of
    # byte v % 32), qs[128] (low nibbles, as Q4_K).  y = (d * scale) * q - (dmin * min)
    n = b.shape[0]
    scales, mins = _scales_mins_k4(b[:, 4:16])
    low = _fields(b[:, 48:].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    high = _fields(b[:, 16:48], 1).reshape(n, 8, 32)
    q = (low | (high << 4)).float()
    dl = (_f16(b, 0) * scales.float()).unsqueeze(-1)  # (n, 8, 1)
    ml = (_f16(b, 2) * mins.float()).unsqueeze(-1)
    return (dl * q - ml).reshape(n, QK_K)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    # 210 bytes: ql[128] (low 4 bits: each half of 128 values is 64 bytes, low nibbles
    # first), qh[64] (high 2 bits: each half is 32 bytes holding 4 runs of 32 values),
    # scales int8[16] (per 16 values), d.  y = (d * scale) * (q - 32)
    n = b.shape[0]
    low = _fields(b[:, :128].reshape(n, 2, 64), 4).reshape(n, QK_K)
    high = _fields(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, QK_K)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    dl = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # (n, 16, 1)
    return (dl * q).reshape(n, QK_K)


_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.F32: _dequantize_f32,
    GGMLQuantizationType.F16: _dequantize_f16,
    GGMLQuantizationType.BF16: _dequantize_bf16,
    GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    GGMLQuantizationType.Q4_1: _dequantize_q4_1,
    GGMLQuantizationType.Q5_0: _dequantize_q5_0,
    GGMLQuantizationType.Q5_1: _dequantize_q5_1,
    GGMLQuantizationType.MXFP4: _dequantize_mxfp4,
    GGMLQuantizationType.IQ4_NL: _dequantize_iq4_nl,
    GGMLQuantizationType.IQ4_XS: _dequantize_iq4_xs,
    GGMLQuantizationType.IQ2_XXS: _dequantize_iq2_xxs,
    GGMLQuantizationType.IQ3_XXS: _dequantize_iq3_xxs,
    GGMLQuantizationType.IQ2_XS: _dequantize_iq2_xs,
    GGMLQuantizationType.IQ2_S: _dequantize_iq2_s,
    GGMLQuantizationType.IQ3_S: _dequantize_iq3_s,
    GGMLQuantizationType.IQ1_S: _by_gguf_py(GGMLQuantizationType.IQ1_S),
    GGMLQuantizationType.IQ1_M: _by_gguf_py(GGMLQuantizationType.IQ1_M),
    GGMLQuantizationType.TQ1_0: _by_gguf_py(GGMLQuantizationType.TQ1_0),
    GGMLQuantizationType.TQ2_0: _by_gguf_py(GGMLQuantizationType.TQ2_0),
    GGMLQuantizationType.NVFP4: _by_gguf_py(GGMLQuantizationType.NVFP4),
    GGMLQuantizationType.Q2_K: _dequantize_q2_k,
    GGMLQuantizationType.Q3_K: _dequantize_q3_k,
    GGMLQuantizationType.Q4_K: _dequantize_q4_k,
    GGMLQuantizationType.Q5_K: _dequantize_q5_k,
    GGMLQuantizationType.Q6_K: _dequantize_q6_k,
}
SUPPORTED_TYPES = tuple(_DEQUANTIZERS)
# The layouts types run in (ladle's own ids): name, (values, bytes) per block, dequantizer.
_KERNEL_LAYOUTS = {IQ4_XS_32: ("IQ4_XS_32", (32, 20), _dequantize_iq4_xs_32),
                   IQ2_XXS_32: ("IQ2_XXS_32", (32, 12), _dequantize_iq2_xxs_32),
                   IQ3_XXS_32: ("IQ3_XXS_32", (32, 20), _dequantize_iq3_xxs_32),
                   IQ3_S_32: ("IQ3_S_32", (32, 20), _dequantize_iq3_s_32),
                   IQ2_XS_32: ("IQ2_XS_32", (32, 14), _dequantize_iq2_xs_32),
                   IQ2_S_32: ("IQ2_S_32", (32, 14), _dequantize_iq2_s_32)}
