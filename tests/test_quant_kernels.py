"""The quantized kernels (runner/csrc/quant.cpp) against their definitions: activations
quantized bit for bit as the torch twin does, every GGUF block type's linear equal to the float64
product of the dequantized weights and activations (1e-5 of the sum of |products|: the float32
scaling's rounding, with no room for a wrong bit or a misplaced block), rows dequantized exactly
as gguf-py's layout, and a fused weight of mixed parts (blocks of two types and a dense part)
giving the twin's result."""

import contextlib

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from ladle.models.gguf.quants import dequantize
from ladle.runner import cpu_kernels
from ladle.runner import quant as Q
from ladle.runner.cpu_kernels import load_cpu_kernels

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None or not hasattr(kernels, "quant_matmul"),
                                   reason="no compiled CPU kernels here")

# Byte offsets of each type's fp16 scale fields (d; Q4_K also dmin), as gguf-py lays blocks out.
F16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
              Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_NL: [0],
              Q.IQ4_XS_32: [], Q.MXFP4: [], Q.IQ2_XXS_32: [], Q.IQ3_XXS_32: [],
              Q.IQ3_S_32: [], Q.IQ2_XS_32: [], Q.IQ2_S_32: []}


def random_blocks(kind: int, rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random bytes (every bit pattern of quants, sub-scales, high bits) with sane fp16 scales
    (MXFP4: E8M0 exponents around 2^0, scales 2^-13 .. 2^6)."""
    values, size = Q.BLOCK_SIZES[kind]
    raw = torch.randint(0, 256, (rows, k // values, size), dtype=torch.uint8, generator=g)
    for off in F16_FIELDS[kind]:
        scale = (torch.rand(rows, k // values, generator=g) * 0.02 + 1e-3).half()
        raw[:, :, off:off + 2] = scale.view(torch.uint8).reshape(rows, k // values, 2)
    if kind == Q.MXFP4:
        raw[:, :, 0] = torch.randint(115, 135, (rows, k // values), dtype=torch.uint8, generator=g)
    if kind in (Q.IQ2_XXS_32, Q.IQ3_XXS_32, Q.IQ3_S_32):  # float32: float16 d times (s + 1/2) / 4
        d = (torch.rand(rows, k // values, generator=g) * 0.002 + 1e-4).half().float()
        s = torch.randint(0, 16, (rows, k // values), generator=g).float() + 0.5
        raw[:, :, :4] = (d * s * 0.25).view(torch.uint8).reshape(rows, k // values, 4)
    if kind in (Q.IQ2_XS_32, Q.IQ2_S_32):  # float32 d / 8; IQ2_XS's indices 9 bits
        d = (torch.rand(rows, k // values, generator=g) * 0.002 + 1e-4).half().float()
        raw[:, :, :4] = (d / 8).view(torch.uint8).reshape(rows, k // values, 4)
        if kind == Q.IQ2_XS_32:
            raw[:, :, 12] &= 0x55
    if kind == Q.IQ4_XS_32:  # a float32 scale: float16 d times a 6-bit scale -32 .. 31
        d = (torch.rand(rows, k // values, generator=g) * 0.002 + 1e-4).half().float()
        sc = torch.randint(-32, 32, (rows, k // values), generator=g).float()
        raw[:, :, :4] = (d * sc).view(torch.uint8).reshape(rows, k // values, 4)
    return raw.reshape(rows, -1).contiguous()


def relative_error(y: torch.Tensor, x: torch.Tensor, w: Q.QuantWeight) -> float:
    """max |y - ref| / sum_k |x_k w_k| over the outputs, with the quantized activations (of x
    rotated and the weights as held, for a rotated weight)."""
    ref = Q.linear_reference(x, w)
    held = torch.cat([p.dequantize(w.in_features) for p in w.parts])
    xr = Q.rotate_rows(x.contiguous(), w.rotation) if w.rotation else x
    bound = Q.dequantized_activations(xr).abs() @ held.double().abs().T
    return ((y.double() - ref).abs() / bound.clamp_min(1e-30)).max().item()


def hadamard(b: int) -> torch.Tensor:
    """Sylvester's b x b matrix of +-1, float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_the_hadamard_product(dtype):
    """rotate_rows: each block of B values (the largest power of two dividing K, at most 1024)
    times Sylvester's Hadamard matrix and 2^-(log2 B // 2): the kernel gives the twin's bits
    (float32 butterflies in one order), the twin the float64 product within float32 rounding
    (then rounded to the dtype); a weight rotated at load gives the same product and rotates
    back to itself."""
    g = torch.Generator().manual_seed(8)
    assert [Q.rotation_block(k) for k in (96, 640, 1024, 3072, 4096, 16, 100)] == \
        [32, 128, 1024, 1024, 1024, 0, 0]
    for k in (96, 640, 1024, 3072):
        b = Q.rotation_block(k)
        x = (torch.randn(5, k, generator=g) * 3).to(dtype)
        x[1, 7] = 1e4  # an outlier
        x[2] = 0
        got = Q.rotate_rows_torch(x, b)
        if kernels is not None and hasattr(kernels, "rotate_rows"):
            assert torch.equal(kernels.rotate_rows(x, b), got), k
        exact = (x.double().reshape(5, k // b, b) @ hadamard(b)).reshape(5, k) \
            * 2.0 ** -((b.bit_length() - 1) // 2)
        tol = 2e-6 if dtype == torch.float32 else 2**-8
        assert ((got.double() - exact).abs() <= tol * exact.abs() + 1e-6 * exact.abs().max(-1, True)
                .values).all(), k
        w = torch.randn(7, k, generator=g)
        wr = Q.rotated_weight(w, b)
        xf = x.float()
        assert torch.allclose(Q.rotate_rows(xf, b).double() @ wr.double().T,
                              xf.double() @ w.double().T, rtol=1e-5, atol=1e-5 * x.abs().max().item())
        assert torch.allclose(Q.rotate_rows(wr, b), w, atol=1e-5)


@needs_kernels
def test_a_rotated_int8_linear_spreads_an_outlier_channel():
    """An int8 weight quantized in the rotation (as `--quantization int8` does) multiplies
    activations rotated the same way: the reference's product of its own quantized operands
    (1e-5), and, with six outlier channels 100x the rest, closer to the float product than the
    same weight quantized without rotation (an outlier no longer sets its block's int8 step
    alone; seen: 0.49-0.59 of the error over five seeds). Its rows, looked up (an embedding),
    are the weight's. A rotation that does not fit K is refused."""
    g = torch.Generator().manual_seed(9)
    k, n = 640, 48
    dense = torch.randn(n, k, generator=g)
    plain = Q.QuantWeight([Q.quantize_weight_rows(dense)], k, torch.float32)
    b = Q.rotation_block(k)
    rotated = Q.QuantWeight([Q.quantize_weight_rows(dense, b)], k, torch.float32, b)
    x = torch.randn(6, k, generator=g)
    x[:, [5, 70, 200, 330, 400, 600]] *= 100
    exact = x.double() @ dense.double().T
    y = Q.quant_linear(x, rotated)
    assert relative_error(y, x, rotated) < 1e-5
    err_rot = ((y.double() - exact).norm() / exact.norm()).item()
    err_plain = ((Q.quant_linear(x, plain).double() - exact).norm() / exact.norm()).item()
    assert err_rot < 0.7 * err_plain, (err_rot, err_plain)
    ids = torch.tensor([0, 5, 47, 5])
    rows = Q.quant_rows(rotated, ids)
    assert (rows - dense[ids]).abs().max() < 0.02 * dense.abs().max()
    assert torch.allclose(rotated.dequantize()[ids], rows, atol=1e-6)
    # a rotation that is not K's block is refused, in the weight and in the kernel call
    with pytest.raises(ValueError, match="rotation 64: expected 128"):
        Q.QuantWeight(rotated.parts, k, torch.float32, 64)
    y = torch.empty(6, n)
    for bad in (48, 2048, 256):  # not a power of two; too large; does not divide 640
        with pytest.raises(RuntimeError, match="rotation must be 0 or a power of two"):
            kernels.quant_matmul(x, *rotated._kernel_args, y, False, bad)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_quantize_like_the_twin(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 512, generator=g).to(dtype)
    x[2, 32:64] = 0  # an all-zero block: scale 0, quants 0
    x[3, 7] = 50.0  # an outlier: only its own block's scale grows
    q, d, s = kernels.quantize_blocks(x)
    q2, d2, s2 = Q.quantize_blocks_torch(x)
    assert torch.equal(q, q2) and torch.equal(d, d2)
    torch.testing.assert_close(s, s2, rtol=1e-6, atol=0)
    assert d[2, 1] == 0 and not q[2, 32:64].any()
    assert q[3, 7] == 127 and d[3, 1] < 0.1 * d[3, 0]


@needs_kernels
@pytest.mark.parametrize("kind", sorted(Q.BLOCK_TYPES), ids=lambda k: Q.BLOCK_TYPES[k])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_linear_equals_the_dequantized_product(kind, dtype):
    g = torch.Generator().manual_seed(kind)
    # M: decode (1), register-tile remainders (2, 3, 5), prefill; N: tile remainders.
    # M >= 12 takes the panels where the build has them: 16 weight rows each (remainders: 6,
    # 13, 33), 8 activation rows at a time (remainders 4, 2, 1: 12, 15, 37).
    for m, n, k in [(1, 37, 256), (2, 7, 256), (3, 8, 512), (4, 11, 256), (5, 9, 768),
                    (12, 16, 256), (15, 40, 512), (17, 6, 256), (37, 13, 512), (64, 33, 1024)]:
        w = Q.QuantWeight([Q.QuantPart(kind, random_blocks(kind, n, k, g))], k, dtype)
        x = torch.randn(m, k, generator=g).to(dtype)
        y = Q.quant_linear(x, w).float()
        assert y.dtype == torch.float32 and y.shape == (m, n)
        err = relative_error(y, x, w)
        # bfloat16 outputs are rounded to 8 bits: half an ulp of |y| <= sum|products|.
        assert err < (1e-5 if dtype == torch.float32 else 4e-3), (Q.BLOCK_TYPES[kind], m, n, k, err)


@needs_kernels
@pytest.mark.parametrize("kind", sorted(Q.BLOCK_TYPES), ids=lambda k: Q.BLOCK_TYPES[k])
def test_rows_dequantize_exactly(kind):
    g = torch.Generator().manual_seed(kind)
    raw = random_blocks(kind, 50, 512, g)
    w = Q.QuantWeight([Q.QuantPart(kind, raw)], 512, torch.float32)
    ids = torch.tensor([49, 0, 7, 7, 23])
    assert torch.equal(Q.quant_rows(w, ids), dequantize(raw[ids], kind, (5, 512)))
    emb = Q.QuantEmbedding(w)
    assert torch.equal(emb(ids.view(1, 5)), dequantize(raw[ids], kind, (5, 512)).view(1, 5, 512))


@needs_kernels
@pytest.mark.parametrize("kind", [Q.Q3_K, Q.Q2_K], ids=lambda k: Q.BLOCK_TYPES[k])
def test_k_quant_scales_and_high_bits_at_their_extremes(kind):
    """Q3_K's packed 6-bit scales (-32 and 31) and hmask bits (all clear: every q - 4; all set)
    and Q2_K's scale and min nibbles (0 and 15), every byte 0x00 or 0xFF but the fp16 fields:
    rows looked up exactly as gguf-py's, and the linear (rows, tiles, panels) equal to the
    dequantized product."""
    g = torch.Generator().manual_seed(5)
    k, n = 512, 24
    head = slice(0, 108) if kind == Q.Q3_K else slice(0, 80)  # all but d (and dmin)
    for fill in (0x00, 0xFF):
        raw = random_blocks(kind, n, k, g).reshape(n, k // 256, -1)
        raw[::2, :, head] = fill
        raw = raw.reshape(n, -1).contiguous()
        want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), kind)).reshape(n, k)
        w = Q.QuantWeight([Q.QuantPart(kind, raw)], k, torch.float32)
        assert torch.equal(Q.quant_rows(w, torch.arange(n)), want)
        for m in (1, 3, 16):
            x = torch.randn(m, k, generator=g)
            assert relative_error(Q.quant_linear(x, w), x, w) < 1e-5, (fill, m)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("repack", [False, True], ids=["rows", "r16"])
@pytest.mark.parametrize("rotation", [0, 256])
def test_int8_rows_look_up_like_the_twin(dtype, repack, rotation):
    """The embedding's lookup of `--quantization int8` rows (repacked by 16 or not, rotated or
    not): the kernel gives the twin's bits (float32 q x scale, rotated back, rounded once), the
    rows of the dequantized weight; a missing scale or a rotation that does not divide the row is
    refused by name."""
    if repack and not kernels.quant_r16():
        pytest.skip("this build does not run repacked blocks (AVX-512 VNNI)")
    g = torch.Generator().manual_seed(12)
    part = Q.quantize_weight_rows(torch.randn(48, 768, generator=g), rotation)
    part.scale[5] = 0.0  # an all-zero row
    if repack:
        part = repacked(part)
    w = Q.QuantWeight([part], 768, dtype, rotation)
    ids = torch.tensor([47, 0, 5, 17, 17, 31, 16])
    got = Q.quant_rows(w, ids)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Q, "_kernels", lambda x: None)
        want = Q.quant_rows(w, ids)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(got, w.dequantize()[ids].to(dtype))
    assert not got[2].any()
    out = torch.empty(len(ids), 768, dtype=dtype)
    with pytest.raises(RuntimeError, match="int8 rows need their float32 scale"):
        kernels.dequantize_rows(part.data, part.kind, ids, out)
    with pytest.raises(RuntimeError, match="rotation must be 0"):
        kernels.dequantize_rows(part.data, part.kind, ids, out, part.scale, 512)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_linear(dtype):
    """int8 rows with a scale each, activations per block of 32: the reference's product."""
    g = torch.Generator().manual_seed(3)
    for m, n in [(1, 40), (1, 3), (4, 40), (7, 9), (33, 5)]:
        part = Q.quantize_weight_rows(torch.randn(n, 384, generator=g))
        w = Q.QuantWeight([part], 384, dtype)
        x = torch.randn(m, 384, generator=g).to(dtype)
        x[0, :32] *= 100  # an outlier block keeps its own scale
        err = relative_error(Q.quant_linear(x, w).float(), x, w)
        assert err < (1e-5 if dtype == torch.float32 else 4e-3), (m, n, err)


@needs_kernels
def test_one_call_runs_every_part_into_its_columns():
    """q|k|v-like parts of five kinds, each rows not a multiple of the tile, for decode (1 row)
    and prefill rows: each column block is its own part's product, nothing written twice or
    skipped (the output starts as NaN)."""
    g = torch.Generator().manual_seed(6)
    k = 512
    parts = [Q.QuantPart(Q.Q5_0, random_blocks(Q.Q5_0, 13, k, g)),
             Q.quantize_weight_rows(torch.randn(7, k, generator=g)),
             Q.QuantPart(Q.Q8_0, random_blocks(Q.Q8_0, 5, k, g)),
             Q.QuantPart(Q.MXFP4, random_blocks(Q.MXFP4, 11, k, g)),
             Q.QuantPart(Q.Q6_K, random_blocks(Q.Q6_K, 3, k, g))]
    w = Q.QuantWeight(parts, k, torch.float32)
    for m in (1, 2, 9):
        x = torch.randn(m, k, generator=g)
        y = torch.full((m, w.shape[0]), float("nan"))
        kernels.quant_matmul(x, *w._kernel_args, y, False)
        assert relative_error(y, x, w) < 1e-5, m


@needs_kernels
def test_mixed_parts_match_the_twin(monkeypatch):
    """A fused projection whose rows come from a Q4_K, a Q6_K and a dense (bf16) tensor, with
    a bias: the kernels' result equals the torch twin's (the same math) and the reference."""
    g = torch.Generator().manual_seed(4)
    k = 512
    parts = [Q.QuantPart(Q.Q4_K, random_blocks(Q.Q4_K, 24, k, g)),
             Q.QuantPart(Q.Q6_K, random_blocks(Q.Q6_K, 8, k, g)),
             Q.QuantPart(Q.DENSE, torch.randn(8, k, generator=g).to(torch.bfloat16) * 0.02)]
    w = Q.QuantWeight(parts, k, torch.bfloat16)
    bias = torch.randn(40, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 3, k, generator=g).to(torch.bfloat16)
    y = Q.quant_linear(x, w, bias)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    monkeypatch.setattr(Q, "_kernels", lambda x: None)
    twin = Q.quant_linear(x, w, bias)
    torch.testing.assert_close(y.float(), twin.float(), rtol=1e-2, atol=2e-2)
    ref = Q.linear_reference(x.reshape(6, k), w) + bias.double()
    torch.testing.assert_close(y.reshape(6, 40).double(), ref, rtol=1e-2, atol=2e-2)


# MXFP4 by its definition (the OCP MX spec's e2m1, as ggml stores it): the e2m1 value of each
# nibble code 0..15 (sign bit 3), and the block scale 2^(e - 127) of the E8M0 byte e.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
MXFP4_EXPONENTS = [0, 1, 127, 200]  # subnormal 2^-128 and 2^-127 (halved), 2^-1, 2^72


def mxfp4_spec_blocks() -> tuple[torch.Tensor, torch.Tensor]:
    """One row per exponent, 8 blocks each, with every nibble code in every position of a byte:
    block b's byte j (0..15) has low nibble (j + b) % 16 (value j) and high nibble (5 j + 3 b + 1)
    % 16 (value j + 16). -> (raw uint8 (4, 8 * 17), float64 values (4, 256) by the spec)."""
    raw = torch.zeros(len(MXFP4_EXPONENTS), 8, 17, dtype=torch.uint8)
    values = torch.zeros(len(MXFP4_EXPONENTS), 8, 32, dtype=torch.float64)
    for r, e in enumerate(MXFP4_EXPONENTS):
        for b in range(8):
            raw[r, b, 0] = e
            for j in range(16):
                lo, hi = (j + b) % 16, (5 * j + 3 * b + 1) % 16
                raw[r, b, 1 + j] = lo | hi << 4
                values[r, b, j] = E2M1[lo] * 2.0 ** (e - 127)
                values[r, b, j + 16] = E2M1[hi] * 2.0 ** (e - 127)
    return raw.reshape(len(MXFP4_EXPONENTS), -1), values.reshape(len(MXFP4_EXPONENTS), -1)


@needs_kernels
def test_mxfp4_rows_follow_the_spec():
    """Every nibble code in both halves of a byte, at exponents 0 and 1 (float32 subnormal
    scales), 127 and 200: the kernel's rows, quants.py's dequantizer and gguf-py's all give the
    e2m1 values times 2^(e - 127), exactly."""
    raw, spec = mxfp4_spec_blocks()
    expected = spec.float()
    assert torch.equal(expected.double(), spec)  # every value exact in float32
    assert expected[0].abs().min() == 0 and 0 < expected[0].abs()[expected[0] != 0].min() < 1e-38
    ids = torch.tensor([3, 0, 1, 2, 0])
    w = Q.QuantWeight([Q.QuantPart(Q.MXFP4, raw)], 256, torch.float32)
    assert torch.equal(Q.quant_rows(w, ids), expected[ids])
    assert torch.equal(dequantize(raw, Q.MXFP4, (4, 256)), expected)
    theirs = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(theirs, expected.numpy())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_linear_at_extreme_exponents(dtype, monkeypatch):
    """The spec blocks' rows (each row one exponent: 0, 1, 127, 200) and their sign-flipped and
    shuffled copies, 13 rows (odd N) by 256, for decode and prefill row counts: each row equal to
    the float64 product, and the twin's result the kernel's. The activations are large (d_x ~ 20)
    so that the subnormal weight scales times d_x are normal floats, as the check needs."""
    raw, _ = mxfp4_spec_blocks()
    g = torch.Generator().manual_seed(8)
    blocks = raw.view(4, 8, 17)
    more = blocks[torch.randint(0, 4, (9,), generator=g)].clone()
    more[:, :, 1:] ^= 0x88  # flip the sign bit of every nibble
    more = more[:, torch.randperm(8, generator=g)]
    w = Q.QuantWeight([Q.QuantPart(Q.MXFP4, torch.cat([blocks, more]).reshape(13, -1))], 256,
                      dtype)
    for m in (1, 2, 3, 4, 5, 37):
        x = (torch.randn(m, 256, generator=g) * 1000).to(dtype)
        y = Q.quant_linear(x, w)
        tol = 1e-5 if dtype == torch.float32 else 4e-3
        err = relative_error(y.float(), x, w)
        assert err < tol, (m, err)
        with monkeypatch.context() as mp:
            mp.setattr(Q, "_kernels", lambda x: None)
            twin = Q.quant_linear(x, w)
        bound = Q.dequantized_activations(x).abs() @ w.dequantize().double().abs().T
        assert ((y.double() - twin.double()).abs() / bound).max() < 2 * tol, m


needs_r16 = pytest.mark.skipif(kernels is None or not hasattr(kernels, "quant_r16")
                               or not kernels.quant_r16(),
                               reason="this build does not run repacked blocks (AVX-512 VNNI)")
R16_KINDS = sorted(Q.R16_OF)
# The repacked kinds the tile unit takes (Q5_0's repacked rows run on the vector kernel only),
# and what AMX-BF16 takes dequantized (test_bf16_tiles_*): those, and Q4_0 and Q5_0 blocks.
TILE_KINDS = [k for k in R16_KINDS if k != Q.Q5_0]
BF16_KINDS = TILE_KINDS + [Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS_32]
R16_ID = {Q.INT8_ROW: "int8", **Q.BLOCK_TYPES}.get


def r16_weight(kind: int, rows: int, k: int, g: torch.Generator) -> Q.QuantPart:
    """A part of `kind` (a key of R16_OF): random blocks, or int8 rows of random weights."""
    if kind == Q.INT8_ROW:
        return Q.quantize_weight_rows(torch.randn(rows, k, generator=g))
    return Q.QuantPart(kind, random_blocks(kind, rows, k, g))


def repacked(p: Q.QuantPart) -> Q.QuantPart:
    """Repacked by 16 rows as the loader does on VNNI builds (Q5_0 too: see tile_repacked); Q4_0
    stays as it is."""
    if p.kind not in Q.R16_OF:
        return p
    return Q.QuantPart(Q.R16_OF[p.kind], Q.repack_r16(p.data, p.kind), p.scale)


def tile_repacked(p: Q.QuantPart) -> Q.QuantPart:
    """As the loader on CPUs with AMX-BF16, which takes Q5_0 blocks as they are."""
    return p if p.kind == Q.Q5_0 else repacked(p)


def tile_kind(kind: int) -> int:
    """The kind tile_repacked gives a part of `kind`."""
    return kind if kind == Q.Q5_0 else Q.R16_OF.get(kind, kind)


@contextlib.contextmanager
def batch_invariant_mode():
    """`--batch-invariant` for the block: quantized parts keep the integer path at every row
    count (outside it, calls of enough bfloat16 rows run on AMX-BF16 where the CPU has it:
    test_bf16_tiles_*)."""
    was = cpu_kernels.batch_invariant()
    cpu_kernels.set_batch_invariant(True)
    try:
        yield
    finally:
        cpu_kernels.set_batch_invariant(was)


@pytest.mark.parametrize("kind", R16_KINDS, ids=R16_ID)
def test_repack_is_a_permutation_the_twin_reads(kind):
    """repack_r16 moves every bit and loses none (unpack gives the file's bytes back), and a
    repacked part dequantizes (the torch twin; the embedding's row lookup, kernel and twin) as
    its blocks do."""
    g = torch.Generator().manual_seed(11)
    part = r16_weight(kind, 48, 768, g)
    r16 = repacked(part)
    assert r16.data.shape == (48, 768 // Q.R16_SIZES[r16.kind][0] * Q.R16_SIZES[r16.kind][1])
    assert torch.equal(Q.unpack_r16(r16.data, r16.kind), part.data)
    packed = r16.data
    w = Q.QuantWeight([r16], 768, torch.float32)
    assert w.parts[0].name() == part.name()
    assert torch.equal(w.dequantize(), part.dequantize(768))
    ids = torch.tensor([47, 0, 17, 17, 31])
    want = part.dequantize(768)[ids]
    if kernels is None or kernels.quant_r16():  # (builds without AVX-512 VNNI never repack)
        assert torch.equal(Q.quant_rows(w, ids), want)
        assert torch.equal(Q._part_rows(w.parts[0], ids, w), want)  # the kernel's lookup, or
    with pytest.MonkeyPatch.context() as mp:  # the twin's where none is built
        mp.setattr(Q, "_kernels", lambda x: None)
        assert torch.equal(Q.quant_rows(w, ids), want)
    with pytest.raises(ValueError, match="multiple of 16"):
        Q.QuantWeight([Q.QuantPart(r16.kind, packed[:40], part.scale)], 768, torch.float32)


@needs_r16
@pytest.mark.parametrize("kind", R16_KINDS, ids=R16_ID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repacked_blocks_give_the_blocks_bits(kind, dtype):
    """The repacked kernel (decode and batched rows in fours or twos, prefill as the panels)
    computes the tiles' and panels' one order: its result equals the GGUF blocks' bit for bit,
    for any M, in a fused weight beside parts of other types, and the reference within 1e-5."""
    g = torch.Generator().manual_seed(12 + kind)
    for m, n, k in [(1, 16, 256), (2, 48, 512), (3, 32, 256), (5, 64, 768), (12, 16, 512),
                    (13, 32, 256), (40, 48, 1024)]:
        part = r16_weight(kind, n, k, g)
        blocks = Q.QuantWeight([part], k, dtype)
        packed = Q.QuantWeight([repacked(part)], k, dtype)
        x = torch.randn(m, k, generator=g).to(dtype)
        with batch_invariant_mode():  # (both: AMX-BF16 takes 8-20+ bfloat16 rows otherwise)
            y = Q.quant_linear(x, packed)
            assert torch.equal(y, Q.quant_linear(x, blocks)), (m, n, k)
        assert relative_error(y.float(), x, packed) < (1e-5 if dtype == torch.float32 else 4e-3)
    # q|k|v-like: a repacked part, a Q4_0 and a part of 8 rows (not repackable) in one call.
    k = 512
    parts = [r16_weight(kind, 32, k, g), Q.QuantPart(Q.Q4_0, random_blocks(Q.Q4_0, 16, k, g)),
             r16_weight(kind, 8, k, g)]
    fused = Q.QuantWeight([repacked(parts[0]), *parts[1:]], k, dtype)
    plain = Q.QuantWeight(parts, k, dtype)
    for m in (1, 4, 16):
        x = torch.randn(m, k, generator=g).to(dtype)
        assert torch.equal(Q.quant_linear(x, fused), Q.quant_linear(x, plain)), m


def cpu_has_amx_int8() -> bool:
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    return "amx_int8" in flags.split()


@needs_r16
@pytest.mark.parametrize("kind", R16_KINDS, ids=R16_ID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_tiles_give_the_vector_kernels_bits(kind, dtype):
    """On a CPU with AMX-INT8 the repacked parts run 16 activation rows at a time on the tile
    unit (the rest of the rows on the vector kernel): the same bits as the vector kernel for
    every row, float32 and bfloat16, with one 16-row chunk and with two and a remainder, at K
    of one and of several super-blocks, and (32-value blocks) at a K of 21 blocks, which ends
    the tile program's spans short, and at 8 and 15 rows, which Q8_0 and int8 rows run on the
    tiles as one sixteen padded with zero rows; a last partial sixteen of 8 (Q6_K), 10 (Q8_0,
    int8 rows) or 13 (Q4_K) rows or more also runs padded on the tiles (24, 29 and 31 rows).
    Elsewhere AMX stays off and the call says so."""
    if not cpu_has_amx_int8():
        assert kernels.set_quant_amx(True) is False
        pytest.skip("this CPU has no AMX-INT8")
    assert kernels.set_quant_amx(True), "AMX-INT8 on the CPU but not in use"
    assert "amx-int8" in kernels.quant_isa()
    g = torch.Generator().manual_seed(21 + kind)
    try:
        shapes = [(16, 32, 256), (37, 48, 1024), (20, 16, 2048), (24, 16, 1024),
                  (29, 48, 768), (31, 32, 512)]
        if kind in (Q.INT8_ROW, Q.Q8_0):  # and 8-15 rows, one padded sixteen (amx_small)
            shapes += [(33, 16, 672), (8, 48, 1024), (15, 32, 672)]
        for m, n, k in shapes:
            w = Q.QuantWeight([repacked(r16_weight(kind, n, k, g))], k, dtype)
            x = torch.randn(m, k, generator=g).to(dtype)
            x[3] = 0  # an all-zero activation row (its blocks' scale 0)
            with batch_invariant_mode():  # the int8 tiles (AMX-BF16 from 8-20 rows otherwise)
                amx = Q.quant_linear(x, w)
                assert not kernels.set_quant_amx(False)
                vector = Q.quant_linear(x, w)
                kernels.set_quant_amx(True)
            assert torch.equal(amx, vector), (m, n, k)
            assert relative_error(amx.float(), x, w) < (1e-5 if dtype == torch.float32 else 4e-3)
    finally:
        kernels.set_quant_amx(True)


@needs_r16
def test_repack_for_kernels_keeps_stacked_experts():
    """A model's Q4_K, Q6_K and Q8_0 parts of 16-row multiples are repacked, the embedding's
    table too (shared with a tied lm_head: both read the new layout), and Q5_0's where AMX-BF16
    does not take its blocks as they are; a part of other rows and experts stacked for the fused
    MoE keep their GGUF blocks; outputs and rows do not move."""
    g = torch.Generator().manual_seed(13)
    k = 256
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(k, 72, bias=False)
    model.expert = torch.nn.Linear(k, 16, bias=False)
    table_raw = random_blocks(Q.Q6_K, 32, k, g)
    table = Q.QuantWeight([Q.QuantPart(Q.Q6_K, table_raw)], k, torch.float32)
    model.embed = Q.QuantEmbedding(table)
    model.lm_head = torch.nn.Linear(k, 32, bias=False)
    Q.install(model.lm_head, "weight", table)
    Q.install(model.proj, "weight", Q.QuantWeight(
        [Q.QuantPart(Q.Q4_K, random_blocks(Q.Q4_K, 32, k, g)),
         Q.QuantPart(Q.Q8_0, random_blocks(Q.Q8_0, 16, k, g)),
         Q.QuantPart(Q.Q4_K, random_blocks(Q.Q4_K, 8, k, g)),
         Q.QuantPart(Q.Q5_0, random_blocks(Q.Q5_0, 16, k, g))], k, torch.float32))
    stacked = Q.QuantWeight([Q.QuantPart(Q.Q4_K, random_blocks(Q.Q4_K, 16, k, g))], k,
                            torch.float32)
    stacked.stacked = True
    Q.install(model.expert, "weight", stacked)
    x = torch.randn(3, k, generator=g)
    before = (Q.quant_linear(x, model.proj.weight), Q.quant_linear(x, model.lm_head.weight))
    ids = torch.tensor([[31, 0, 5]])
    rows = model.embed(ids)
    q5_repacked = kernels.quant_bf16_min_rows(Q.Q5_0) == 0  # (no AMX-BF16 here)
    assert Q.repack_for_kernels(model) == 3 + q5_repacked
    assert [p.kind for p in model.proj.weight.parts] == [
        Q.Q4_K_R16, Q.Q8_0_R16, Q.Q4_K, Q.Q5_0_R16 if q5_repacked else Q.Q5_0]
    assert [p.kind for p in table.parts] == [Q.Q6_K_R16] and model.lm_head.weight is table
    assert [p.kind for p in stacked.parts] == [Q.Q4_K]
    assert torch.equal(Q.quant_linear(x, model.proj.weight), before[0])
    assert torch.equal(Q.quant_linear(x, model.lm_head.weight), before[1])
    assert torch.equal(model.embed(ids), rows)
    assert Q.weight_bytes(model) == {"Q4_K": 32 * 148 + 8 * 144 + 16 * 144, "Q8_0": 16 * 272,
                                     "Q6_K": 32 * 210, "Q5_0": 16 * 176}


@needs_kernels
def test_grids_are_set_once_and_checked():
    """The i-quants' grids reach the kernels once per process (cpu_kernels does it when they
    load): the same grids again are accepted, other values, sizes or an IQ3 grid that is not 8
    levels are refused with the reason, and the kernels keep the first set."""
    from gguf import GGMLQuantizationType as T

    from ladle.models.gguf.quants import iq_grid

    grids = [iq_grid(t).contiguous() for t in (T.IQ2_XXS, T.IQ3_XXS, T.IQ3_S, T.IQ2_XS, T.IQ2_S)]
    kernels.set_iq_grids(*grids)
    other = [g.clone() for g in grids]
    other[3][0, 0] += 1
    with pytest.raises(RuntimeError, match="already set, to other values"):
        kernels.set_iq_grids(*other)
    nine = [g.clone() for g in grids]
    nine[1][0, 0] = 5  # a ninth level
    with pytest.raises(RuntimeError, match="more than 8 distinct values"):
        kernels.set_iq_grids(*nine)
    with pytest.raises(RuntimeError, match="512 x 8 \\(IQ2_XS\\)"):
        kernels.set_iq_grids(*grids[:3], grids[3][:256], grids[4])
    kind = Q.IQ3_XXS_32
    raw = random_blocks(kind, 16, 256, torch.Generator().manual_seed(1))
    w = Q.QuantWeight([Q.QuantPart(kind, raw)], 256, torch.float32)
    assert torch.equal(Q.quant_rows(w, torch.arange(16)), dequantize(raw, kind, (16, 256)))


def test_weight_shapes_are_checked():
    g = torch.Generator().manual_seed(5)
    with pytest.raises(ValueError, match="does not hold 512 values"):
        Q.QuantWeight([Q.QuantPart(Q.Q8_0, random_blocks(Q.Q8_0, 4, 256, g))], 512, torch.float32)


@needs_kernels
@pytest.mark.parametrize("kind", sorted(Q.BLOCK_TYPES) + [Q.INT8_ROW] + sorted(Q.R16_BASE),
                         ids=lambda k: R16_ID(k) or R16_ID(Q.R16_BASE[k]) + "_R16")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind, dtype):
    """Every row sums its blocks in one order whatever else the call holds: a decode row, a
    tile of 2 or 4 rows, a remainder row, or (12 rows and more on AVX-512 VNNI builds) a panel,
    so a token's result is bit-identical alone, in a batch of any size, or at any position of a
    prefill (float32 shows every bit: a K-quant row alone once summed its super-block before
    d, and panels took their bias off in float). With no flag, except repacked, Q4_0 and Q5_0
    parts in bfloat16 from 8-20 rows on AMX-BF16 CPUs (test_bf16_tiles_*): so under
    `--batch-invariant`, which holds for every kind. 21 weight rows: two tiles and a
    remainder, a panel and a remainder."""
    if kind in Q.R16_BASE and not (hasattr(kernels, "quant_r16") and kernels.quant_r16()):
        pytest.skip("this build does not run repacked blocks")
    g = torch.Generator().manual_seed(7)
    base = Q.R16_BASE.get(kind, kind)
    k, n, rows = (512 if Q.BLOCK_SIZES.get(base, (32,))[0] == 256 else 800), 21, 40
    if kind == Q.INT8_ROW:
        part = Q.quantize_weight_rows(torch.randn(n, k, generator=g))
    elif kind in Q.R16_BASE:  # two groups of 16 rows
        part = repacked(r16_weight(Q.R16_BASE[kind], 32, k, g))
    else:
        part = Q.QuantPart(kind, random_blocks(kind, n, k, g))
    w = Q.QuantWeight([part], k, dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    with batch_invariant_mode():
        alone = torch.cat([Q.quant_linear(x[i:i + 1], w) for i in range(rows)])
        for m in (2, 3, 5, 8, 11, 12, 13, 17, 31, 40):
            assert torch.equal(Q.quant_linear(x[:m], w), alone[:m]), m
        assert torch.equal(Q.quant_linear(x[3:30], w), alone[3:30])
    assert relative_error(alone.float(), x, w) < (1e-5 if dtype == torch.float32 else 4e-3)


def cpu_has(flag: str) -> bool:
    line = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    return flag in line.split()


needs_bf16_tiles = pytest.mark.skipif(
    kernels is None or not hasattr(kernels, "quant_bf16_min_rows")
    or kernels.quant_bf16_min_rows(Q.Q8_0_R16) == 0, reason="no AMX-BF16 here (or no kernels)")


@needs_kernels
def test_bf16_tiles_run_where_the_cpu_has_them():
    """An AVX-512 build on a CPU with AMX-BF16 and AMX-INT8 takes the dequantizing path for
    every repacked type (so the tests below cannot skip there unnoticed), from 8 to 20 rows by
    type, and Q4_0 and Q5_0 from their panels; elsewhere it says it never does. Other types
    that are not repacked never take it."""
    want = kernels.quant_r16() and cpu_has("amx_bf16") and cpu_has("amx_int8")
    for kind in BF16_KINDS:
        rows = kernels.quant_bf16_min_rows(tile_kind(kind))
        assert (8 <= rows <= 20) if want else rows == 0, (kind, rows)
    for kind in (Q.Q8_0, Q.Q4_K, Q.MXFP4):  # as stored, not repacked
        assert kernels.quant_bf16_min_rows(kind) == 0
    if want:
        assert "amx-bf16" in kernels.quant_isa()


@needs_bf16_tiles
@pytest.mark.parametrize("kind", BF16_KINDS, ids=R16_ID)
def test_bf16_tiles_compute_the_bf16_weights_product(kind):
    """From quant_bf16_min_rows(type) bfloat16 rows outside batch-invariant mode, repacked
    parts (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, int8 rows) and Q4_0, Q5_0, Q4_1, Q5_1, IQ4_NL and
    IQ4_XS parts of whole sixteens of rows run dequantized on AMX-BF16: each output equals the
    float64 product of the activations as given and the weights rounded to bfloat16 (bf16 of the
    dequantized weight; int8 rows: q, then the row scale) within 1e-6 of the sum of |products|
    (float32 sums: no room for a misplaced value, sub-block scale or min), every column written
    once (out starts as NaN), odd and even group counts, a partial last sixteen of rows, two parts
    into their columns. One row fewer, in batch-invariant mode, and beside a part that cannot take
    it, the call keeps the integer path's bits."""
    g = torch.Generator().manual_seed(31 + kind)
    min_rows = kernels.quant_bf16_min_rows(tile_kind(kind))
    # (from the fewest rows, a partial sixteen; 200 rows at K 3072: two chunks, 160 and 40)
    for m, ns, k in [(min_rows, [16], 256), (32, [16], 256), (37, [48], 1024),
                     (64, [32, 16], 768), (200, [80], 3072)]:
        w = Q.QuantWeight([tile_repacked(r16_weight(kind, n, k, g)) for n in ns], k,
                          torch.bfloat16)
        x = torch.randn(m, k, generator=g).bfloat16()
        x[5] = 0  # an all-zero row
        y = torch.full((m, sum(ns)), float("nan"))
        kernels.quant_matmul(x, *w._kernel_args, y, False)
        bound = x.double().abs() @ w.dequantize().double().abs().T
        err = ((y.double() - Q.bf16_tiles_reference(x, w)).abs() / bound.clamp_min(1e-30)).max()
        assert err < 1e-6, (m, ns, k, err.item())
        assert not y[5].any()
        integer = torch.full_like(y, float("nan"))
        kernels.quant_matmul(x, *w._kernel_args, integer, True)
        assert relative_error(integer, x, w) < 1e-5
        assert not torch.equal(y, integer)  # a different product (not the int8 path)
        # the model's call: bfloat16 out, rounded once
        out = Q.quant_linear(x, w)
        assert torch.equal(out, y.bfloat16()), (m, ns, k)
        with batch_invariant_mode():
            assert torch.equal(Q.quant_linear(x, w), integer.bfloat16())
        short = x[:min_rows - 1]
        assert torch.equal(Q.quant_linear(short, w), integer[:min_rows - 1].bfloat16())
    # beside a part that cannot (Q4_0 rows not a whole sixteen) the call keeps the integer path
    k = 512
    parts = [r16_weight(kind, 32, k, g), Q.QuantPart(Q.Q4_0, random_blocks(Q.Q4_0, 24, k, g))]
    w = Q.QuantWeight([tile_repacked(parts[0]), parts[1]], k, torch.bfloat16)
    x = torch.randn(40, k, generator=g).bfloat16()
    with batch_invariant_mode():
        want = Q.quant_linear(x, w)
    assert torch.equal(Q.quant_linear(x, w), want)


@needs_bf16_tiles
def test_bf16_tiles_take_a_q4_k_m_fused_weight():
    """A Q4_K_M file's fused q|k|v or gate|up mixes Q4_K and Q6_K parts: one call, each part's
    columns its own bf16-weights product; the call takes that path from the larger of its
    types' row counts (below it, Q6_K alone would, the mixed call keeps the integer path)."""
    g = torch.Generator().manual_seed(41)
    k = 512
    parts = [r16_weight(Q.Q4_K, 32, k, g), r16_weight(Q.Q6_K, 16, k, g),
             r16_weight(Q.Q4_K, 16, k, g)]
    w = Q.QuantWeight([repacked(p) for p in parts], k, torch.bfloat16)
    x = torch.randn(45, k, generator=g).bfloat16()
    y = torch.full((45, 64), float("nan"))
    kernels.quant_matmul(x, *w._kernel_args, y, False)
    bound = x.double().abs() @ w.dequantize().double().abs().T
    assert ((y.double() - Q.bf16_tiles_reference(x, w)).abs() / bound).max() < 1e-6
    q4k, q6k = (kernels.quant_bf16_min_rows(Q.R16_OF[t]) for t in (Q.Q4_K, Q.Q6_K))
    assert q6k < q4k
    x = x[:q4k - 1]
    with batch_invariant_mode():
        integer = Q.quant_linear(x, w)
    assert torch.equal(Q.quant_linear(x, w), integer)
    alone = Q.QuantWeight([w.parts[1]], k, torch.bfloat16)  # the Q6_K part by itself
    y = Q.quant_linear(x, alone).double()
    ref = Q.bf16_tiles_reference(x, alone)
    assert ((y - ref).abs() <= 2**-7 * ref.abs() + 1e-6 * (x.double().abs() @ alone.dequantize().double().abs().T)).all()
    assert not torch.equal(y.bfloat16(), integer[:, 32:48])


@needs_bf16_tiles
@pytest.mark.parametrize("kind", TILE_KINDS, ids=R16_ID)
def test_bf16_gemm_for_long_prefills(kind):
    """From quant_bf16_gemm_rows() rows the dequantized weights (the same bf16 values, written
    row-major) go to torch's GEMM, whose output is rounded to bfloat16: each output within
    2^-8 of itself (that rounding) plus 1e-6 of the sum of |products| of the float64 reference;
    more than one chunk of 1024 output rows, two parts into their columns, every column written
    once."""
    rows = kernels.quant_bf16_gemm_rows()
    assert rows >= kernels.quant_bf16_min_rows(Q.R16_OF[kind])
    g = torch.Generator().manual_seed(51 + kind)
    for m, ns, k in [(rows, [48], 512), (rows + 3, [1040, 32], 256)]:
        w = Q.QuantWeight([repacked(r16_weight(kind, n, k, g)) for n in ns], k, torch.bfloat16)
        x = torch.randn(m, k, generator=g).bfloat16()
        y = torch.full((m, sum(ns)), float("nan"))
        kernels.quant_matmul(x, *w._kernel_args, y, False)
        ref = Q.bf16_tiles_reference(x, w)
        bound = x.double().abs() @ w.dequantize().double().abs().T
        assert ((y.double() - ref).abs() <= 2**-7 * ref.abs() + 1e-6 * bound).all(), (m, ns, k)
        with batch_invariant_mode():
            integer = Q.quant_linear(x, w)
        assert relative_error(integer.float(), x, w) < 4e-3


needs_token_tiles = pytest.mark.skipif(
    kernels is None or not hasattr(kernels, "quant_token_min_rows")
    or kernels.quant_token_min_rows() == 0, reason="no AVX-512 VNNI here (or no kernels)")


def rotated_int8(ns: list[int], k: int, g: torch.Generator) -> Q.QuantWeight:
    """`--quantization int8`'s weight: rows quantized in the rotation, repacked by 16."""
    b = Q.rotation_block(k)
    parts = [Q.quantize_weight_rows(torch.randn(n, k, generator=g), b) for n in ns]
    return Q.QuantWeight([repacked(p) for p in parts], k, torch.bfloat16, b)


@needs_token_tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_int8_rows_take_per_token_tiles(dtype):
    """From quant_token_min_rows() rows outside batch-invariant mode, rotated int8 rows run
    with the activations quantized per token (on AMX-INT8's tiles where the CPU has them, else
    on AVX-512 VNNI; where both run, with the same bits): each output is token_reference's (one
    integer sum over K, times the row's and the weight row's scales) within 1e-6 of the sum of
    |products|, every column written once (out starts as NaN), two parts into their columns, a
    partial last sixteen of rows, an all-zero row. One row fewer, in batch-invariant mode, and
    with the rotation left out (a checkpoint's int8 rows), the call keeps its other paths."""
    g = torch.Generator().manual_seed(61)
    min_rows = kernels.quant_token_min_rows()
    amx = kernels.set_quant_amx(True)
    # rotation blocks 128 (640), 512 (1536) and 1024: the row's max taken in its last pass
    for m, ns, k in [(min_rows, [48], 640), (20, [64, 32], 1024), (37, [32], 1024),
                     (19, [32], 1536), (128, [96], 3072)]:
        w = rotated_int8(ns, k, g)
        x = torch.randn(m, k, generator=g).to(dtype)
        x[1, :5] *= 50
        x[-1] = 0
        ys = []
        try:
            for on in [True, False] if amx else [False]:
                kernels.set_quant_amx(on)
                ys.append(torch.full((m, sum(ns)), float("nan")))
                kernels.quant_matmul(x, *w._kernel_args, ys[-1], False, w.rotation)
        finally:
            kernels.set_quant_amx(True)
        y = ys[0]
        assert all(torch.equal(y, other) for other in ys[1:]), (m, ns, k)  # the same bits
        q, d = Q.quantize_rows_torch(Q.rotate_rows(x.float(), w.rotation))
        held = torch.cat([Q.unpack_r16(p.data, p.kind) for p in w.parts]).double()
        scale = torch.cat([p.scale for p in w.parts]).double()
        bound = (q.double().abs() @ held.abs().T) * d.double()[:, None] * scale
        err = ((y.double() - Q.token_reference(x, w)).abs() / bound.clamp_min(1e-30)).max()
        assert err < 1e-6, (m, ns, k, err.item())
        assert not y[-1].any()
        out = Q.quant_linear(x, w)  # the model's call: out in w.dtype, rounded once
        assert torch.equal(out, y.bfloat16()), (m, ns, k)
        with batch_invariant_mode():
            integer = Q.quant_linear(x, w)
        assert relative_error(integer.float(), x, w) < 4e-3
        assert not torch.equal(integer, out)
        short = x[:min_rows - 1]
        assert relative_error(Q.quant_linear(short, w).float(), short, w) < 4e-3
    plain = Q.QuantWeight(w.parts, k, torch.bfloat16)  # the same rows, not rotated
    y = torch.full((128, 96), float("nan"))
    kernels.quant_matmul(x, *plain._kernel_args, y, False)
    assert not torch.allclose(y.double(), Q.token_reference(x, w), rtol=1e-3)
    # K not a multiple of 64 (a sixteen's chunk): the per-block path, whatever the row count.
    w = rotated_int8([32], 96, g)
    x = torch.randn(20, 96, generator=g)
    y = torch.full((20, 32), float("nan"))
    kernels.quant_matmul(x, *w._kernel_args, y, False, w.rotation)
    ref = Q.linear_reference(x, w)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
