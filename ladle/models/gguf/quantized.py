"""A GGUF file's weights kept in their blocks: every linear (and the embedding) whose tensors are
of a type the quantized kernels run (runner/quant.py: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, IQ4_NL,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) becomes a QuantWeight holding the file's bytes (IQ4_XS's, IQ2_XXS's,
IQ3_XXS's and IQ3_S's sub-blocks rewritten as blocks of 32: `WIDENED`), installed on the
meta-device model before any dense memory is allocated. A fused projection takes one part per file
tensor (a Q4_K_M file stores attn_v as Q6_K beside Q4_K attn_q and attn_k). A tensor of another type
inside such a projection is dequantized to the model dtype as a dense part; a projection with no
kernel type at all stays a dense parameter for the usual loader. Norms and biases are always dense,
and so is a router (`keep_dense`: its logits choose the experts). A layer's experts are stacked in
one tensor per projection; each expert's rows are a contiguous run of its bytes, found through the
family's `unfused` (as the loader splits them), and each expert's linear gets a QuantWeight of its
run."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from gguf import GGMLQuantizationType

from ladle.config import free_memory
from ladle.models.gguf.mapping import (
    TILED_VALUE_HEADS,
    _load,
    _unpermute_rotary,
    hf_tensor_names,
    untile_value_rows,
)
from ladle.models.gguf.quants import (
    dequantize,
    iq2_s_as_32,
    iq2_xs_as_32,
    iq2_xxs_as_32,
    iq3_s_as_32,
    iq3_xxs_as_32,
    iq4_xs_as_32,
)
from ladle.models.gguf.reader import GGUFFile, GGUFTensor
from ladle.models.loader import ModelLoadError, _target
from ladle.runner.quant import (
    BLOCK_SIZES,
    BLOCK_TYPES,
    DENSE,
    IQ2_S_32,
    IQ2_XS_32,
    IQ2_XXS_32,
    IQ3_S_32,
    IQ3_XXS_32,
    IQ4_XS_32,
    QuantEmbedding,
    QuantPart,
    QuantWeight,
    install,
)

logger = logging.getLogger(__name__)

# ggml types whose blocks are rewritten at load, exactly, as blocks of a kernel type (their bytes
# grow, but far less than dequantized): type -> (kernel type, rewrite, how, for the log line).
# IQ4_XS's sub-blocks run as IQ4_NL-style blocks with a float32 scale each (1.18x its bytes);
# IQ2_XXS's 32s each with a float32 scale and 32 sign bits (1.45x), IQ3_XXS's and IQ3_S's with
# their values' 3-bit level codes too (1.63x, 1.45x); IQ2_XS's and IQ2_S's with d / 8, the sign
# bits and their halves' scales (1.51x, 1.37x).
WIDENED = {int(GGMLQuantizationType.IQ4_XS): (IQ4_XS_32, iq4_xs_as_32, "in blocks of 32"),
           int(GGMLQuantizationType.IQ2_XXS): (IQ2_XXS_32, iq2_xxs_as_32, "in blocks of 32"),
           int(GGMLQuantizationType.IQ3_XXS): (IQ3_XXS_32, iq3_xxs_as_32, "in blocks of 32"),
           int(GGMLQuantizationType.IQ3_S): (IQ3_S_32, iq3_s_as_32, "in blocks of 32"),
           int(GGMLQuantizationType.IQ2_XS): (IQ2_XS_32, iq2_xs_as_32, "in blocks of 32"),
           int(GGMLQuantizationType.IQ2_S): (IQ2_S_32, iq2_s_as_32, "in blocks of 32")}


def install_gguf_blocks(model: nn.Module, gguf_file: GGUFFile, hf_config: dict,
                        dtype: torch.dtype) -> None:
    """Replace `model`'s (on the meta device) linear and embedding weights by the file's blocks;
    the parameters left are loaded by loader.load_weights as usual."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    unfused = getattr(model, "unfused", None)
    # parameter -> shard -> (file tensor, index of the parameter's rows in it or None: all).
    by_param: dict[str, dict[int, tuple[GGUFTensor, Any]]] = {}
    for gguf_name, hf_name in hf_tensor_names(gguf_file, hf_config).items():
        tensor = gguf_file.tensors[gguf_name]
        parts = None if unfused is None else unfused(hf_name, tensor.shape)
        for name, _, index in parts or [(hf_name, None, None)]:
            target = _target(name, model, params)
            if target is None:
                continue
            pname, shard = target
            by_param.setdefault(pname, {})[0 if shard is None else shard] = (tensor, index)
    _check_dense_fits(gguf_file, by_param, dtype)
    # ggml type -> names of the file tensors kept in blocks / dequantized (a stacked experts'
    # tensor counts once, not once per expert).
    kept: dict[str, set[str]] = {}
    dense: dict[str, set[str]] = {}
    for pname, shards in by_param.items():
        owner, attr = pname.rsplit(".", 1)
        module = modules[owner]
        if attr != "weight" or not isinstance(module, (nn.Linear, nn.Embedding)) \
                or getattr(module, "keep_dense", False):
            continue
        pieces = [shards[i] for i in sorted(shards)]
        tensors = [t for t, _ in pieces]
        if not any(_kept(int(t.ggml_type)) for t in tensors):
            continue
        param = params[pname]
        parts = [_part(t, index, gguf_file, hf_config, dtype) for t, index in pieces]
        if sum(p.rows for p in parts) != param.shape[0]:
            raise ModelLoadError(f"{gguf_file.path}: tensors {', '.join(t.name for t in tensors)} "
                                 f"have {sum(p.rows for p in parts)} rows, {pname} needs "
                                 f"{param.shape[0]}")
        for t, p in zip(tensors, parts, strict=True):
            name = t.ggml_type.name
            if int(t.ggml_type) in WIDENED:
                name += " " + WIDENED[int(t.ggml_type)][2]
            (dense if p.kind == DENSE else kept).setdefault(name, set()).add(t.name)
        weight = QuantWeight(parts, param.shape[1], dtype)
        if gguf_file.architecture in TILED_VALUE_HEADS and pname.endswith("linear_attn.out_proj.weight") \
                and parts[0].kind != DENSE:
            # Its columns stay in the file's value-head order: the input is put in it instead.
            modules[owner.rpartition(".")[0]].out_columns = _tiled_value_order(hf_config)
        if isinstance(module, nn.Embedding):
            parent, _, child = owner.rpartition(".")
            setattr(modules[parent] if parent else model, child, QuantEmbedding(weight))
        else:
            install(module, "weight", weight)
    if kept:
        logger.info("%s: GGUF blocks kept for the quantized kernels (%s)", gguf_file.path,
                    ", ".join(f"{len(n)} {name}" for name, n in sorted(kept.items())))
    if dense:
        logger.info("%s: tensors of types without a quantized kernel dequantized to %s (%s)",
                    gguf_file.path, str(dtype).removeprefix("torch."),
                    ", ".join(f"{len(n)} {name}" for name, n in sorted(dense.items())))


def _check_dense_fits(gguf_file: GGUFFile, by_param: dict, dtype: torch.dtype) -> None:
    """The file's quantized tensors of types no kernel runs (IQ1_S, IQ1_M, TQ1_0, TQ2_0,
    NVFP4) are
    dequantized at load, several times their bytes: a clear error before that, where they
    would not fit in the memory available, instead of the engine killed for memory."""
    tensors = {t.name: t for shards in by_param.values() for t, _ in shards.values()
               if not _kept(int(t.ggml_type)) and int(t.ggml_type) in _DEQUANTIZED_ONLY}
    if not tensors:
        return
    need = sum(int(np.prod(t.shape)) for t in tensors.values()) * dtype.itemsize
    free = free_memory(torch.device("cpu"))
    if need > free:
        types = sorted({t.ggml_type.name for t in tensors.values()})
        raise ModelLoadError(
            f"{gguf_file.path}: its {len(tensors)} {'/'.join(types)} tensors have no quantized "
            f"kernel and would take {need / 2**30:.1f} GiB dequantized to "
            f"{str(dtype).removeprefix('torch.')}, more than the {free / 2**30:.1f} GiB of memory "
            "available; kernel types: " + ", ".join(sorted(BLOCK_TYPES.values())))


# Quantized types ladle reads only by dequantizing them at load (`_check_dense_fits`).
_DEQUANTIZED_ONLY = {int(GGMLQuantizationType.IQ1_S), int(GGMLQuantizationType.IQ1_M),
                     int(GGMLQuantizationType.TQ1_0), int(GGMLQuantizationType.TQ2_0),
                     int(GGMLQuantizationType.NVFP4)}


def _part(tensor: GGUFTensor, index: Any, gguf_file: GGUFFile, hf_config: dict,
          dtype: torch.dtype) -> QuantPart:
    """The rows of `tensor` at `index` (None: all; else an index into its leading dimensions,
    such as one expert of a stacked tensor) as one part: its bytes, or dense values."""
    kind = int(tensor.ggml_type)
    if index is None and not _kept(kind):
        return QuantPart(DENSE, _load(tensor, gguf_file.architecture, hf_config).to(dtype))
    # (..., rows, bytes per row): a row's blocks are contiguous, so an index into the leading
    # dimensions picks whole rows; only those bytes are read out of the file.
    rows = tensor.data.reshape(*tensor.shape[:-1], -1)
    if index is not None:
        rows = rows[index]
    if not _kept(kind):  # one expert's rows of a stacked tensor, dequantized alone
        num_rows = rows.size // rows.shape[-1]
        return QuantPart(DENSE, dequantize(rows, kind, (num_rows, tensor.shape[-1])).to(dtype))
    raw = torch.from_numpy(np.array(rows, copy=True)).reshape(-1, rows.shape[-1])
    if gguf_file.architecture in TILED_VALUE_HEADS and tensor.name.startswith("blk."):
        # A linear layer's input projections: value-head rows back in HF's order.
        raw = untile_value_rows(raw, tensor.name.split(".", 2)[2], hf_config)
    if kind in WIDENED:
        kind, rewrite, _ = WIDENED[kind]
        raw = rewrite(raw)
    if gguf_file.architecture == "llama" and tensor.name.startswith("blk."):
        # The converter permuted the rows of q and k for its rotary layout; a row keeps its
        # blocks, so the inverse permutation moves whole rows of bytes.
        if ".attn_q." in tensor.name:
            raw = _unpermute_rotary(raw, hf_config["num_attention_heads"]).contiguous()
        elif ".attn_k." in tensor.name:
            raw = _unpermute_rotary(raw, hf_config["num_key_value_heads"]).contiguous()
    return QuantPart(kind, raw)


def _tiled_value_order(hf_config: dict) -> torch.Tensor:
    """The value channel (HF's grouped order) at each position of llama.cpp's tiled order."""
    nk, nv = hf_config["linear_num_key_heads"], hf_config["linear_num_value_heads"]
    dv = hf_config["linear_value_head_dim"]
    return torch.arange(nv * dv).reshape(nk, nv // nk, dv).transpose(0, 1).reshape(-1)


def _kept(kind: int) -> bool:
    """Blocks of this ggml type stay blocks (perhaps widened)."""
    return kind in BLOCK_SIZES or kind in WIDENED
