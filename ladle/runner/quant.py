"""Quantized weights and the linears that multiply by them (csrc/quant.cpp), with pure-torch twins.

A `QuantWeight` stands where a linear's (N, K) weight tensor would be. Its rows are a list of
`QuantPart`s, because a fused projection (q|k|v, gate|up) may hold tensors of different types
(a Q4_K_M file stores attn_v as Q6_K beside a Q4_K attn_q). A part is one of:
  - GGUF blocks kept as they are in the file (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, IQ4_NL,
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; IQ4_XS's, IQ2_XXS's, IQ2_XS's, IQ2_S's, IQ3_XXS's and
    IQ3_S's sub-blocks as blocks of 32, IQ4_XS_32, IQ2_XXS_32, IQ2_XS_32, IQ2_S_32,
    IQ3_XXS_32, IQ3_S_32): uint8 (rows, row_bytes);
  - INT8_ROW: symmetric int8 per output channel, int8 (rows, K) with a float32 scale per row
    (`--quantization int8`, compressed-tensors W8A8 checkpoints);
  - DENSE: the model dtype (rows, K), for a GGUF type the kernels do not run (dequantized at
    load, with a log line).

How a quantized linear multiplies (ggml's scheme, for reading only; the code is ours):
  - the activations are quantized once per call, for all parts: per block of 32 values to int8
    with a float32 scale (d = max|x| / 127, q = round(x / d), ties to even). The K-quants take
    them in blocks of 32 too, not in ggml's super-blocks of 256 (Q8_K): more accurate on the
    Gemma file (KL from float32 0.0031 against 0.0056), and no slower here. INT8_ROW parts
    take them per block too, not per token: a trained model's activations have outlier
    channels, and one scale per token rounds the rest of the row to a few levels (Gemma 3
    270M with int8 weights: top-1 agreement with bf16 87.9% per token, 94.1% per block); an
    int8 weight quantized at load is also rotated (`rotate_rows`, below), and so are its
    activations before they are quantized;
  - the dot products are integer (AVX2 `vpmaddubsw`, or VNNI `vpdpbusd` where the CPU has it),
    scaled per block in float32;
  - one kernel call (`quant_matmul`) quantizes the activations and runs every part in one
    parallel region.
So a kernel's result equals, up to float32 rounding, the float64 product of the dequantized weights
with the quantized-then-dequantized activations: `linear_reference` below, which the tests compare
the kernels with. One exception, on CPUs with AMX-BF16 outside batch-invariant mode: a call of
enough bfloat16 rows (`quant_bf16_min_rows(type)`, 8-20 by type) whose parts are all repacked (Q4_K,
Q5_K, Q6_K, Q8_0, INT8_ROW, Q3_K, Q2_K) or Q4_0/Q5_0/Q4_1/Q5_1/IQ4 of whole sixteens of rows
dequantizes the weights to bfloat16 tiles instead and multiplies the activations as they are
(prefill, decode batches; `bf16_tiles_reference`). And on CPUs with AVX-512 VNNI (on AMX-INT8's
tiles where present), also outside that mode: a call of 4 or more rows (`quant_token_min_rows()`)
of a rotated weight of int8 rows quantizes the rotated activations per token (row) instead of per
block, and sums all of K in one integer (`token_reference`).

The twins (`_linear_torch`, `_rows_torch`) run where the kernels do not: on other devices,
without a compiler, or with LADLE_DISABLE_CPU_KERNELS=1. They quantize the activations the same
way and dequantize the weights per call, so they are slow but give the same numbers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

# GGML type ids of the block formats the kernels run (gguf's GGMLQuantizationType values).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4 = (2, 3, 6, 7, 8, 10, 11,
                                                                           12, 13, 14, 20, 39)
# IQ4_XS as the kernels run it (gguf/quants.py's iq4_xs_as_32): each sub-block of 32 a block of
# its own, a float32 scale and IQ4_NL's nibbles. Counted as IQ4_XS.
IQ4_XS_32 = -9
# IQ2_XXS as the kernels run it (gguf/quants.py's iq2_xxs_as_32): each 32 values a block of
# their own, a float32 scale, their grid indices as stored and 32 sign bits; IQ3_XXS and IQ3_S
# alike (iq3_xxs_as_32, iq3_s_as_32; one layout) with each value's 3-bit level code in place of
# the indices. Counted as IQ2_XXS, IQ3_XXS, IQ3_S.
IQ2_XXS_32, IQ3_XXS_32, IQ3_S_32 = -12, -13, -14
# IQ2_XS and IQ2_S alike (gguf/quants.py's iq2_xs_as_32, iq2_s_as_32; one layout): the float32
# d / 8, the indices' low bytes, 32 sign bits, a byte of the indices' high bits, a byte of the
# two halves' 4-bit scales. Counted as IQ2_XS, IQ2_S.
IQ2_XS_32, IQ2_S_32 = -15, -16
BLOCK_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
               Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
               IQ4_NL: "IQ4_NL", IQ4_XS_32: "IQ4_XS", MXFP4: "MXFP4", IQ2_XXS_32: "IQ2_XXS",
               IQ3_XXS_32: "IQ3_XXS", IQ3_S_32: "IQ3_S", IQ2_XS_32: "IQ2_XS", IQ2_S_32: "IQ2_S"}
# (values per block, bytes per block): gguf's GGML_QUANT_SIZES for the types above.
BLOCK_SIZES = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
               Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176),
               Q6_K: (256, 210), IQ4_NL: (32, 18), IQ4_XS_32: (32, 20), MXFP4: (32, 17),
               IQ2_XXS_32: (32, 12), IQ3_XXS_32: (32, 20), IQ3_S_32: (32, 20),
               IQ2_XS_32: (32, 14), IQ2_S_32: (32, 14)}
INT8_ROW = -1  # int8 rows with a float32 scale per row
DENSE = -2  # the model dtype
# Blocks (and int8 rows) repacked at load by 16 rows for the AVX-512 VNNI kernels (repack_r16):
# each kind, the kind it holds, and its (values per block, bytes per row and block): Q4_K's and
# Q5_K's 6-bit scales become bytes (148 against 144; 180 against 176); the others keep their
# size.
(Q4_K_R16, Q6_K_R16, Q8_0_R16, INT8_ROW_R16, Q5_0_R16, Q5_K_R16, Q3_K_R16,
 Q2_K_R16) = (-3, -4, -5, -6, -7, -8, -10, -11)
R16_OF = {Q4_K: Q4_K_R16, Q6_K: Q6_K_R16, Q8_0: Q8_0_R16, INT8_ROW: INT8_ROW_R16,
          Q5_0: Q5_0_R16, Q5_K: Q5_K_R16, Q3_K: Q3_K_R16, Q2_K: Q2_K_R16}
R16_BASE = {v: k for k, v in R16_OF.items()}
R16_SIZES = {Q4_K_R16: (256, 148), Q6_K_R16: (256, 210), Q8_0_R16: (32, 34),
             INT8_ROW_R16: (32, 32), Q5_0_R16: (32, 22), Q5_K_R16: (256, 180),
             Q3_K_R16: (256, 114), Q2_K_R16: (256, 84)}
R16_ROWS = 16

ACT_BLOCK = 32  # activations are quantized per this many values


@dataclass
class QuantPart:
    kind: int  # a key of BLOCK_TYPES, INT8_ROW or DENSE
    data: torch.Tensor  # blocks: uint8 (rows, row_bytes); INT8_ROW: int8 (rows, K); DENSE
    scale: torch.Tensor | None = None  # INT8_ROW: float32 (rows,)

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())

    def name(self) -> str:
        if self.kind in R16_BASE:  # counted (weight_bytes, /metrics) as the kind it holds
            return QuantPart(R16_BASE[self.kind], self.data).name()
        return BLOCK_TYPES.get(self.kind) or {INT8_ROW: "int8", DENSE: str(self.data.dtype)
                                              .removeprefix("torch.")}[self.kind]

    def dequantize(self, k: int) -> torch.Tensor:
        """float32 (rows, k)."""
        if self.kind == DENSE:
            return self.data.float()
        if self.kind in (INT8_ROW, INT8_ROW_R16):
            data = self.data if self.kind == INT8_ROW else unpack_r16(self.data, self.kind)
            return data.float() * self.scale[:, None]
        from ladle.models.gguf.quants import dequantize  # (a cycle at import time)

        if self.kind in R16_BASE:
            return dequantize(unpack_r16(self.data, self.kind), R16_BASE[self.kind],
                              (self.rows, k))
        return dequantize(self.data, self.kind, (self.rows, k))


class QuantWeight:
    """A linear's (N, K) weight held quantized, in row parts; `dtype` is what the linear
    returns (the model dtype)."""

    def __init__(self, parts: list[QuantPart], in_features: int, dtype: torch.dtype,
                 rotation: int = 0):
        """rotation: 0, or the Hadamard block (`rotation_block`) the parts were quantized in
        (`rotated_weight`): then every product first rotates the activations by `rotate_rows`,
        and the table's rows (an embedding) are rotated back after dequantizing."""
        self.parts, self.in_features, self.dtype = parts, in_features, dtype
        if rotation and (rotation != rotation_block(in_features) or
                         any(p.kind == DENSE for p in parts)):
            raise ValueError(f"rotation {rotation}: expected {rotation_block(in_features)} for "
                             f"{in_features} columns, and no dense part")
        self.rotation = rotation
        self.shape = (sum(p.rows for p in parts), in_features)
        self.on_cpu = parts[0].data.is_cpu
        self.stacked = False  # views of stacked experts' tensors (stack_expert_blocks)
        for p in parts:
            if p.kind in BLOCK_SIZES or p.kind in R16_SIZES:
                block, size = BLOCK_SIZES.get(p.kind) or R16_SIZES[p.kind]
                if in_features % block or p.data.shape[1] != in_features // block * size:
                    raise ValueError(f"{p.name()} part of {p.data.shape[1]} bytes per row does "
                                     f"not hold {in_features} values")
                if p.kind in R16_SIZES and p.rows % R16_ROWS:
                    raise ValueError(f"repacked {p.name()} part of {p.rows} rows: a multiple of "
                                     f"{R16_ROWS} expected")
            elif p.data.shape[1] != in_features:
                raise ValueError(f"{p.name()} part has {p.data.shape[1]} columns, expected "
                                 f"{in_features}")
        # What one quant_matmul call takes: the kernel parts' tensors, types, scales and first
        # columns; the dense parts are multiplied beside it.
        no_scale = torch.empty(0)
        self._kernel_args = ([], [], [], [])
        self._dense: list[tuple[int, QuantPart]] = []
        col = 0
        for p in parts:
            if p.kind == DENSE:
                self._dense.append((col, p))
            else:
                for arg, v in zip(self._kernel_args, (p.data, p.kind, no_scale if p.scale is None
                                                      else p.scale, col), strict=True):
                    arg.append(v)
            col += p.rows

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].data.device

    def describe(self) -> str:
        return "+".join(p.name() for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The float32 (N, K) weight (rotated back, where it was rotated)."""
        w = torch.cat([p.dequantize(self.in_features) for p in self.parts])
        return rotate_rows(w, self.rotation) if self.rotation else w


_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
_cpu = None  # ladle.runner.cpu_kernels, bound on first use (it imports this module)


def _kernels(x: torch.Tensor):
    """The kernel module for a CPU tensor of a kernel dtype, else None. On the path of every
    quantized linear, so it costs no more than a few attribute reads."""
    global _cpu
    if not x.is_cpu or x.dtype not in _KERNEL_DTYPES:
        return None
    if _cpu is None:
        from ladle.runner import cpu_kernels

        _cpu = cpu_kernels
    k = _cpu.load_cpu_kernels()
    return k if k is not None and hasattr(k, "quant_matmul") else None


# --- the Hadamard rotation of `--quantization int8` ----------------------------------------------
# An int8 weight quantized at load is rotated first: each block of B values of its rows times
# the B x B Hadamard matrix H (entries +-1; H H = B I), B the largest power of two dividing K, at
# most ROTATION_MAX. Each linear then rotates its activations the same way, so the product is
# unchanged in real numbers, while a trained model's outlier channels (Gemma's reach ~100x the
# median) are spread over their block instead of setting the int8 step of the block or row
# alone. On Gemma 3 270M (benchmarks/gguf_accuracy.py, 256 positions) mean KL(bf16 || int8)
# 0.00779 -> 0.00373, top-1 agreement 93.8% -> 95.3% (QuaRot's observation, arXiv:2404.00456,
# without its learned parts). A cap of 128 measured about the same (KL 0.0044 against 0.0040
# for 1024 in a float32 emulation); random sign flips before H did not help.
ROTATION_MAX = 1024


def rotation_block(k: int) -> int:
    """The Hadamard block for rows of k values: the largest power of two dividing k, at most
    ROTATION_MAX; 0 (no rotation) when that is below 32."""
    b = min(k & -k, ROTATION_MAX)
    return b if b >= 32 else 0


def rotate_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (M, K) with each block of `block` values times H, times 2^-(log2(block) // 2) (a power
    of two, so exact), in x's dtype: the kernel (csrc/quant.cpp) or its twin, bit for bit."""
    k = _kernels(x)
    if k is not None and x.is_contiguous() and x.dim() == 2:
        return k.rotate_rows(x, block)
    return rotate_rows_torch(x, block)


def rotate_rows_torch(x: torch.Tensor, block: int) -> torch.Tensor:
    """The butterflies in float32, stage h = 1, 2, ... block/2 taking (a, b) at (j, j + h) to
    (a + b, a - b), as the kernel orders them."""
    y = x.float().reshape(-1, block)
    h = 1
    while h < block:
        v = y.view(y.shape[0], block // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(y.shape[0], block)
        h *= 2
    e = (block.bit_length() - 1) // 2
    return (y * 2.0 ** -e).to(x.dtype).view(x.shape)


def rotated_weight(w: torch.Tensor, block: int) -> torch.Tensor:
    """float32 W' with rotate_rows(x) @ W'^T = x @ W^T and rotate_rows(W') = W: W H scaled by
    2^-(log2(block) - log2(block) // 2)."""
    return rotate_rows(w.float().contiguous(), block) * (0.5 if (block.bit_length() - 1) % 2 else 1.0)


# --- activations -----------------------------------------------------------------------------

def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q int8 (M, K), d float32 (M, K/32), s float32 (M, K/32)): per block of
    32, d = max|x| / 127 and q = round(x * (127 / max|x|)) (0 where the block is all zero);
    s = d * sum(q), which a block with a min (Q4_K) needs."""
    k = _kernels(x)
    if k is not None and x.is_contiguous():
        return tuple(k.quantize_blocks(x))
    return quantize_blocks_torch(x)


def quantize_blocks_torch(x: torch.Tensor):
    m, kk = x.shape
    xb = x.float().reshape(m, kk // ACT_BLOCK, ACT_BLOCK)
    amax = xb.abs().amax(-1)
    q = torch.round(xb * _inverse_scale(amax)[..., None]).to(torch.int8)
    d = amax / 127.0
    s = d * q.sum(-1, dtype=torch.int32).float()
    return q.reshape(m, kk), d, s


def _inverse_scale(amax: torch.Tensor) -> torch.Tensor:
    """127 / amax, correctly rounded as the kernels' float32 division is (torch computes
    `127.0 / t` as 127 * (1 / t), which differs in the last bit), and 0 where amax is 0."""
    inv = torch.full_like(amax, 127.0) / amax
    return torch.where(amax > 0, inv, torch.zeros_like(amax))


def quantize_rows_torch(x: torch.Tensor):
    """Per row: x (M, K) -> (q int8 (M, K), d float32 (M,)), the rule of a block of
    quantize_blocks over the whole row."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    return torch.round(xf * _inverse_scale(amax)[:, None]).to(torch.int8), amax / 127.0


def quantize_weight_rows(w: torch.Tensor, rotation: int = 0) -> QuantPart:
    """Symmetric int8 per output channel (row): scale = max|w| / 127, q = round(w / scale);
    what `--quantization int8` does to a bf16/fp16/fp32 weight at load, with `rotation` (a
    `rotation_block`) to the rotated weight (rotated_weight)."""
    qs, ds = [], []
    for rows in w.split(4096):  # float32 copies of a few MB at a time, not of the whole table
        q, d = quantize_rows_torch(rotated_weight(rows, rotation) if rotation else rows)
        qs.append(q)
        ds.append(d)
    return QuantPart(INT8_ROW, torch.cat(qs).contiguous(), torch.cat(ds).contiguous())


# --- the linear ------------------------------------------------------------------------------

def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None):
    """x (..., K) @ w^T (+ bias) -> (..., N) in w.dtype."""
    flat = x.dim() == 2  # the models' (tokens, hidden): no reshape, ~2 us each in torch
    x2 = x if flat else x.reshape(-1, w.in_features)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    k = _kernels(x2) if w.on_cpu else None
    if k is None:
        y = _linear_torch(rotate_rows(x2, w.rotation) if w.rotation else x2, w)
    else:
        y = torch.empty(x2.shape[0], w.shape[0], dtype=w.dtype)
        k.quant_matmul(x2, *w._kernel_args, y, _cpu.batch_invariant(), w.rotation)
        for col, p in w._dense:  # (the dense kernel for decode rows: torch's bfloat16 GEMV ran
            # the 0.6B IQ3_XXS file's dequantized IQ2_S attn_q and attn_k at a third of its speed)
            y.narrow(1, col, p.rows).copy_(_cpu.linear(x2.to(p.data.dtype), p.data))
    if bias is not None:
        y += bias
    return y if flat else y.view(*x.shape[:-1], w.shape[0])


def _linear_torch(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    outs = []
    xa = None
    for p in w.parts:
        if p.kind == DENSE:
            outs.append(torch.nn.functional.linear(x.to(p.data.dtype), p.data).float())
            continue
        if xa is None:
            xa = dequantized_activations(x).float()
        outs.append(xa @ p.dequantize(w.in_features).T)
    return torch.cat(outs, dim=1).to(w.dtype)


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """float64 (M, K): x quantized per block of 32 and dequantized."""
    q, d, _ = quantize_blocks_torch(x)
    m = x.shape[0]
    return (q.double().reshape(m, -1, ACT_BLOCK) * d.double()[..., None]).reshape(m, -1)


def linear_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """float64: the dequantized weights times the quantized-then-dequantized activations
    (rotated first where the weight is); what every kernel computes up to float32 rounding."""
    if w.rotation:
        x = rotate_rows(x.contiguous(), w.rotation)
    outs = []
    xa = dequantized_activations(x)
    for p in w.parts:
        wd = p.dequantize(w.in_features).double()
        outs.append((x.to(p.data.dtype).double() if p.kind == DENSE else xa) @ wd.T)
    return torch.cat(outs, dim=1)


def bf16_tiles_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """float64: what the kernel computes on AMX-BF16 (a call of `quant_bf16_min_rows(type)`
    rows or more of bfloat16 activations, every part repacked or Q4_0/Q5_0/Q4_1/Q5_1/IQ4 of
    whole sixteens of rows, outside batch-invariant mode): the activations as given times the
    dequantized weights rounded to bfloat16 (each formed in float32 first, exactly or with the
    one rounding of Q4_1's and Q5_1's d q + m, Q2_K's d sc q - dmin m; int8 rows: q exactly,
    the row scale applied to the sum); activations rotated first where the weight is."""
    if w.rotation:
        x = rotate_rows(x.contiguous(), w.rotation)
    outs = []
    for p in w.parts:
        if R16_BASE.get(p.kind, p.kind) == INT8_ROW:
            q = unpack_r16(p.data, p.kind) if p.kind in R16_BASE else p.data
            outs.append((x.double() @ q.double().T) * p.scale.double())
        else:
            outs.append(x.double() @ p.dequantize(w.in_features).bfloat16().double().T)
    return torch.cat(outs, dim=1)



def token_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """float64: what the kernel computes on AVX-512 VNNI (and AMX-INT8) for a rotated weight of
    int8 rows repacked by 16 (`--quantization int8`), from quant_token_min_rows() rows outside
    batch-invariant mode: the activations rotated in float32 (not rounded to their dtype
    first), quantized per row (token), times the int8 rows, each product's integer sum times
    the product of the row's and the weight row's scales."""
    q, d = quantize_rows_torch(rotate_rows(x.float().contiguous(), w.rotation))
    outs = []
    for p in w.parts:
        wq = unpack_r16(p.data, p.kind) if p.kind in R16_BASE else p.data
        outs.append((q.double() @ wq.double().T) * (d.double()[:, None] * p.scale.double()))
    return torch.cat(outs, dim=1)

# --- rows (the embedding) --------------------------------------------------------------------

def quant_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (T,) of w, dequantized to w.dtype: (T, K). ids must be in range."""
    if len(w.parts) == 1:
        return _part_rows(w.parts[0], ids, w)
    out = torch.empty(ids.shape[0], w.in_features, dtype=w.dtype, device=w.device)
    start = 0
    for p in w.parts:
        sel = ((ids >= start) & (ids < start + p.rows)).nonzero().squeeze(1)
        if sel.numel():
            out[sel] = _part_rows(p, ids[sel] - start, w)
        start += p.rows
    return out


def _part_rows(p: QuantPart, local: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    if p.kind == DENSE:
        return p.data[local].to(w.dtype)
    out = torch.empty(local.shape[0], w.in_features, dtype=w.dtype, device=w.device)
    k = _kernels(out)
    int8 = p.kind in (INT8_ROW, INT8_ROW_R16)
    if k is not None:
        k.dequantize_rows(p.data, p.kind, local.to(torch.int64).contiguous(), out,
                          p.scale if int8 else None, w.rotation if int8 else 0)
        return out
    if int8:  # the kernel's twin: float32 rows, rotated back, rounded to the dtype once
        q = p.data[local] if p.kind == INT8_ROW else _r16_rows(p, local)
        rows = q.float() * p.scale[local, None]
        return (rotate_rows(rows, w.rotation) if w.rotation else rows).to(w.dtype)
    from ladle.models.gguf.quants import dequantize

    if p.kind in R16_BASE:
        return dequantize(_r16_rows(p, local), R16_BASE[p.kind],
                          (local.shape[0], w.in_features)).to(w.dtype)
    return dequantize(p.data[local], p.kind, (local.shape[0], w.in_features)).to(w.dtype)


def _r16_rows(p: QuantPart, local: torch.Tensor) -> torch.Tensor:
    """Rows `local` of a repacked part, unpacked from their groups: (T, the held kind's row)."""
    rb = p.data.shape[1]
    groups = p.data.reshape(-1, R16_ROWS * rb)[local // R16_ROWS].view(-1, rb)
    rows = unpack_r16(groups, p.kind).view(local.shape[0], R16_ROWS, -1)
    return rows[torch.arange(local.shape[0]), local % R16_ROWS]


class QuantEmbedding(nn.Module):
    """An embedding whose table is a QuantWeight; `.weight` is that QuantWeight, so a tied
    lm_head multiplies by the same blocks."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return quant_rows(self.weight, input_ids.reshape(-1)).view(*input_ids.shape, -1)


def install(module: nn.Module, name: str, weight: QuantWeight) -> None:
    """Replace parameter `name` of `module` (an nn.Linear's weight) by `weight`."""
    module._parameters.pop(name, None)
    object.__setattr__(module, name, weight)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights by storage kind ("bfloat16", "Q4_K", "int8", ...): the dense
    parameters and every QuantWeight, each counted once (a tied one is shared)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    for m in model.modules():
        for w in list(vars(m).values()):
            if isinstance(w, QuantWeight) and id(w) not in seen:
                seen.add(id(w))
                for part in w.parts:
                    out[part.name()] = out.get(part.name(), 0) + part.nbytes
    return out


def stack_expert_blocks(gate_ups: list[QuantWeight], downs: list[QuantWeight]) -> tuple | None:
    """A layer's SwiGLU experts held in GGUF blocks, stacked for `moe_quant_swiglu`: (gate
    (E, I, row bytes), its type, up, its type, down (E, H, row bytes), its type), each expert's
    QuantWeights rebuilt over views of the stacks (so no bytes are held twice); Q4_K, Q5_K, Q6_K and
    Q8_0 stacks repacked by 16 rows where the kernels run that (repack_r16). None when an
    expert is not [gate, up] + [down] block parts of one type per projection (int8 rows, dense
    parts: the per-expert loop runs them)."""
    layout = [[p.kind for p in w.parts] for w in gate_ups + downs]
    first_gu, first_down = layout[0], layout[len(gate_ups)]
    if len(first_gu) != 2 or len(first_down) != 1 or \
            any(k not in BLOCK_SIZES for k in first_gu + first_down) or \
            any(kinds != first_gu for kinds in layout[:len(gate_ups)]) or \
            any(kinds != first_down for kinds in layout[len(gate_ups):]):
        return None
    stacks = [torch.stack([w.parts[i].data for w in ws])
              for ws, i in ((gate_ups, 0), (gate_ups, 1), (downs, 0))]
    kinds = [first_gu[0], first_gu[1], first_down[0]]
    if gate_ups[0].on_cpu and _r16_kernels():  # as repack_for_kernels, per expert's rows
        for i, (st, kind) in enumerate(zip(stacks, kinds, strict=True)):
            if kind in R16_OF and st.shape[1] % R16_ROWS == 0 and _repacks(kind):
                e, n, rb = st.shape
                stacks[i] = repack_r16(st.reshape(e * n, rb), kind).reshape(e, n, -1)
                kinds[i] = R16_OF[kind]
    gate, up, down = stacks
    first_gu, first_down = kinds[:2], kinds[2:]
    for e, (gu, dn) in enumerate(zip(gate_ups, downs, strict=True)):
        gu.__init__([QuantPart(first_gu[0], gate[e]), QuantPart(first_gu[1], up[e])],
                    gu.in_features, gu.dtype)
        dn.__init__([QuantPart(first_down[0], down[e])], dn.in_features, dn.dtype)
        gu.stacked = dn.stacked = True
    return gate, first_gu[0], up, first_gu[1], down, first_down[0]


def moe_quant_swiglu(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     stacked: tuple) -> torch.Tensor | None:
    """The weighted sum of a layer's quantized SwiGLU experts in one kernel call (quant.cpp),
    bit-equal to RoutedExperts' loop of quant_linear calls; None where the kernels cannot run
    (then that loop, its twin, does)."""
    k = _kernels(x)
    if k is None or stacked[0].device != x.device:
        return None
    return k.moe_quant_swiglu(x.contiguous(), ids.contiguous(), weights.float().contiguous(),
                              *stacked)


# --- blocks repacked by 16 rows (csrc/quant.cpp's r16_rows, which documents the layouts) ------
# Per 16 rows (16g .. 16g + 15) and block, the rows' fields side by side: float16 scales by row,
# sub-block scales by sub-block then row, and the values interleaved by 4 bytes (dword r of each
# 64 bytes is row r's). A part keeps its (rows, row bytes) shape; a group's 16 x row bytes hold
# its blocks in this order.

def _by_dword(v: torch.Tensor) -> torch.Tensor:
    """(G, nb, 16, ..., n) bytes, n a multiple of 4 -> (G, nb, ..., n / 4, 16, 4): the rows'
    dwords side by side (the inner dims before n keep their order)."""
    *lead, n = v.shape
    v = v.reshape(*lead, n // 4, 4)
    return v.movedim(2, -2)


def _from_dword(v: torch.Tensor) -> torch.Tensor:
    """The inverse of _by_dword: (G, nb, ..., n / 4, 16, 4) -> (G, nb, 16, ..., n)."""
    v = v.movedim(-2, 2)
    return v.reshape(*v.shape[:-2], v.shape[-2] * 4)


def repack_r16(data: torch.Tensor, kind: int) -> torch.Tensor:
    """Rows (N, row bytes) of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 or int8 (`kind`), N a
    multiple of 16 -> the rows of R16_OF[kind], uint8, bytes moved (Q3_K's, Q4_K's and Q5_K's
    scales unpacked, Q8_0's and int8's values + 128, Q5_0's and Q5_K's high bits regrouped by
    dword slot)."""
    if kind == INT8_ROW:  # as Q8_0's values, without a scale per block
        data = data.view(torch.uint8)
    n, rb = data.shape
    size = BLOCK_SIZES[kind][1] if kind != INT8_ROW else 32
    nb = rb // size
    b = data.reshape(n // R16_ROWS, R16_ROWS, nb, size).transpose(1, 2)  # (G, nb, 16, size)
    g = b.shape[:2]
    if kind in (Q4_K, Q5_K):
        packed = b[..., 4:16]
        sc_lo, m_lo, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        scales = torch.cat([sc_lo & 63, (hi & 0xF) | ((sc_lo >> 6) << 4)], dim=-1)
        mins = torch.cat([m_lo & 63, (hi >> 4) | ((m_lo >> 6) << 4)], dim=-1)
        qs = b[..., 16:144] if kind == Q4_K else b[..., 48:176]
        fields = [b[..., 0:2], b[..., 2:4], scales, mins,
                  _by_dword(qs.reshape(*g, R16_ROWS, 4, 32))]
        if kind == Q5_K:  # per sub-block j, row r's byte p holds in bit t value 4t + p's fifth
            # bit (qh byte 4t + p, bit j), as Q5_0's high bytes
            bits = (b[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8)
                    .reshape(8, 1)) & 1  # (.., 16, j, l)
            bits = bits.reshape(*g, R16_ROWS, 8, 8, 4)  # (.., 16, j, t, p)
            high = torch.zeros(*g, R16_ROWS, 8, 4, dtype=torch.uint8)
            for t in range(8):
                high |= bits[..., t, :] << t
            fields.append(high.transpose(2, 3))  # (.., j, 16, p)
    elif kind == Q6_K:  # per half and dword slot: ql's two chunks, then qh
        ql = _by_dword(b[..., 0:128].reshape(*g, R16_ROWS, 2, 2, 32))  # (.., half, c, t, 16, 4)
        qh = _by_dword(b[..., 128:192].reshape(*g, R16_ROWS, 2, 32))  # (.., half, t, 16, 4)
        fields = [b[..., 208:210], b[..., 192:208],
                  torch.cat([ql.transpose(2 + 1, 2 + 2), qh.unsqueeze(4)], dim=4)]
    elif kind == Q2_K:  # d, dmin, the scale | min bytes, then per dword slot qs's halves
        qs = _by_dword(b[..., 16:80].reshape(*g, R16_ROWS, 2, 32))  # (.., half, t, 16, 4)
        fields = [b[..., 80:82], b[..., 82:84], b[..., 0:16], qs.transpose(2, 3)]
    elif kind == Q3_K:  # Q6_K's header (scales unpacked to int8), then per dword slot qs's
        # halves and hmask as stored
        from ladle.models.gguf.quants import q3_k_scales

        scales = q3_k_scales(b[..., 96:108].reshape(-1, 12)).view(torch.uint8)
        qs = _by_dword(b[..., 32:96].reshape(*g, R16_ROWS, 2, 32))  # (.., half, t, 16, 4)
        hm = _by_dword(b[..., 0:32])  # (.., t, 16, 4)
        fields = [b[..., 108:110], scales.reshape(*g, R16_ROWS, 16),
                  torch.cat([qs.transpose(2, 3), hm.unsqueeze(3)], dim=3)]
    elif kind == Q8_0:
        fields = [b[..., 0:2], _by_dword(b[..., 2:] ^ 0x80)]
    elif kind == Q5_0:  # row r's byte p holds in bit t value 4t + p's high bit (qh bit 4t + p)
        # in uint8 throughout: 32 bytes of bits per 22-byte block while it runs
        bits = (b[..., 2:6].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        bits = bits.reshape(*g, R16_ROWS, 8, 4)  # (.., t, p): qh bit 8 byte + i = 4t + p
        high = torch.zeros(*g, R16_ROWS, 4, dtype=torch.uint8)
        for t in range(8):
            high |= bits[..., t, :] << t
        fields = [b[..., 0:2], high.reshape(*g, -1), _by_dword(b[..., 6:22])]
    else:
        fields = [_by_dword(b ^ 0x80)]
    # fields with a row dim at 2 (d, scales): by row (d) or by sub-block then row (scales).
    out = [f.transpose(2, 3).reshape(*g, -1) if f.dim() == 4 and f.shape[-1] > 2 else
           f.reshape(*g, -1) for f in fields]
    return torch.cat(out, dim=-1).reshape(n, rb * R16_SIZES[R16_OF[kind]][1] // size)


def unpack_r16(data: torch.Tensor, kind: int) -> torch.Tensor:
    """The inverse of repack_r16 for a repacked `kind`: the rows' blocks (int8 rows: int8),
    bit for bit."""
    n, rb = data.shape
    base = R16_BASE[kind]
    size = R16_SIZES[kind][1]
    nb = rb // size
    v = data.reshape(n // R16_ROWS, nb, R16_ROWS * size)
    g = v.shape[:2]

    def take(nbytes: int) -> torch.Tensor:
        nonlocal v
        out, v = v[..., :nbytes], v[..., nbytes:]
        return out

    def by_row(nbytes: int) -> torch.Tensor:  # (G, nb, 16, nbytes) of a field stored by row
        return take(R16_ROWS * nbytes).reshape(*g, R16_ROWS, nbytes)

    def by_sub(subs: int) -> torch.Tensor:  # stored by sub-block then row
        return take(subs * R16_ROWS).reshape(*g, subs, R16_ROWS).transpose(2, 3)

    def values(*inner: int) -> torch.Tensor:
        count = R16_ROWS
        for i in inner:
            count *= i
        return _from_dword(take(count).reshape(*g, *inner[:-1], inner[-1] // 4, R16_ROWS, 4))

    if base in (Q4_K, Q5_K):
        d, dmin, scales, mins = by_row(2), by_row(2), by_sub(8), by_sub(8)
        packed = torch.cat([scales[..., :4] | ((scales[..., 4:] >> 4) << 6),
                            mins[..., :4] | ((mins[..., 4:] >> 4) << 6),
                            (scales[..., 4:] & 0xF) | ((mins[..., 4:] & 0xF) << 4)], dim=-1)
        qs = values(4, 32).reshape(*g, R16_ROWS, 128)
        blocks = [d, dmin, packed, qs]
        if base == Q5_K:
            high = take(8 * R16_ROWS * 4).reshape(*g, 8, R16_ROWS, 4)  # (.., j, 16, p)
            bits = (high.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)) & 1
            bits = bits.permute(0, 1, 3, 2, 4, 5)  # (.., 16, j, t, p)
            qh = torch.zeros(*g, R16_ROWS, 32, dtype=torch.uint8)
            for j in range(8):
                qh |= bits[..., j, :, :].reshape(*g, R16_ROWS, 32) << j
            blocks = [d, dmin, packed, qh, qs]
    elif base == Q6_K:
        d, scales = by_row(2), by_sub(16)
        q = take(3072).reshape(*g, 2, 8, 3, R16_ROWS, 4)  # (.., half, t, [ql c0, ql c1, qh])
        ql = _from_dword(q[..., :2, :, :].transpose(3, 4))  # (.., 16, half, c, 32)
        qh = _from_dword(q[..., 2, :, :])  # (.., 16, half, 32)
        blocks = [ql.reshape(*g, R16_ROWS, 128), qh.reshape(*g, R16_ROWS, 64), scales, d]
    elif base == Q2_K:
        d, dmin, sm = by_row(2), by_row(2), by_sub(16)
        q = take(1024).reshape(*g, 8, 2, R16_ROWS, 4)  # (.., t, half, 16, 4)
        qs = _from_dword(q.transpose(2, 3))  # (.., 16, half, 32)
        blocks = [sm, qs.reshape(*g, R16_ROWS, 64), d, dmin]
    elif base == Q3_K:
        from ladle.models.gguf.quants import pack_q3_k_scales

        d, scales = by_row(2), by_sub(16)
        q = take(1536).reshape(*g, 8, 3, R16_ROWS, 4)  # (.., t, [qs half 0, half 1, hmask])
        qs = _from_dword(q[..., :2, :, :].transpose(2, 3))  # (.., 16, half, 32)
        hm = _from_dword(q[..., 2, :, :])  # (.., 16, 32)
        packed = pack_q3_k_scales(scales.reshape(-1, 16).view(torch.int8)).reshape(*g, R16_ROWS, 12)
        blocks = [hm, qs.reshape(*g, R16_ROWS, 64), packed, d]
    elif base == Q8_0:
        d = by_row(2)
        blocks = [d, values(32) ^ 0x80]
    elif base == Q5_0:
        d, high = by_row(2), by_row(4)  # (.., 16, p): bit t is value 4t + p's
        bits = (high.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)) & 1
        bits = bits.reshape(*g, R16_ROWS, 4, 8)  # (.., 16, t, p) as qh's (byte, bit)
        qh = torch.zeros(*g, R16_ROWS, 4, dtype=torch.uint8)
        for i in range(8):
            qh |= bits[..., i] << i
        blocks = [d, qh, values(16)]
    else:
        blocks = [values(32) ^ 0x80]
    out = torch.cat(blocks, dim=-1)  # (G, nb, 16, block bytes)
    out = out.transpose(1, 2).reshape(n, nb * (32 if base == INT8_ROW else BLOCK_SIZES[base][1]))
    return out.view(torch.int8) if base == INT8_ROW else out


def _r16_kernels() -> bool:
    """Whether this machine's kernels run the repacked kinds (AVX-512 VNNI builds)."""
    from ladle.runner.cpu_kernels import load_cpu_kernels

    k = load_cpu_kernels()
    return k is not None and hasattr(k, "quant_r16") and k.quant_r16()


def _repacks(kind: int) -> bool:
    """Whether the loader repacks parts of `kind` (a key of R16_OF) on this machine: every kind
    where the kernels run them, but Q5_0 not where AMX-BF16 takes its blocks as they are for
    prefill (quant_bf16_min_rows), which its repacked rows, vector-kernel only, would lose."""
    if kind != Q5_0:
        return True
    from ladle.runner.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels().quant_bf16_min_rows(Q5_0) == 0


def repack_for_kernels(model: nn.Module) -> int:
    """Repack the model's Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 and int8 weight parts of a multiple of 16
    rows for the kernels, where this build runs them (AVX-512 VNNI; Q5_0: see _repacks); returns
    how many parts. Embedding tables too (a tied lm_head multiplies by them; the row lookup
    reads the layout). Experts stacked for the fused MoE are views of their stacks, which
    stack_expert_blocks repacks."""
    todo: dict[int, QuantWeight] = {}
    for m in model.modules():
        for w in vars(m).values():
            if isinstance(w, QuantWeight) and not w.stacked and w.on_cpu and \
                    any(p.kind in R16_OF and p.rows % R16_ROWS == 0 for p in w.parts):
                todo[id(w)] = w
    if not todo or not _r16_kernels():
        return 0
    done = 0
    for w in todo.values():
        parts = [QuantPart(R16_OF[p.kind], repack_r16(p.data, p.kind), p.scale)
                 if p.kind in R16_OF and p.rows % R16_ROWS == 0 and _repacks(p.kind) else p
                 for p in w.parts]
        done += sum(p.kind in R16_BASE for p in parts)
        w.__init__(parts, w.in_features, w.dtype, w.rotation)
    return done
