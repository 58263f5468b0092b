"""A GGUF file's weights kept in their blocks: every linear (and the embedding) whose tensors are
of a type the quantized kernels run (runner/quant.py: Q8_0, Q4_0, Q5_0, Q4_K, Q6_K) becomes a
QuantWeight holding the file's bytes, installed on the meta-device model before any dense memory
is allocated. A fused projection takes one part per file tensor (a Q4_K_M file stores attn_v as
Q6_K beside Q4_K attn_q and attn_k). A tensor of another type inside such a projection is
dequantized to the model dtype as a dense part; a projection with no kernel type at all stays a
dense parameter for the usual loader. Norms and biases are always dense."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch
import torch.nn as nn

from ladle.models.gguf.mapping import _load, _unpermute_rotary, hf_tensor_names
from ladle.models.gguf.reader import GGUFFile, GGUFTensor
from ladle.models.loader import ModelLoadError, _target
from ladle.runner.quant import (
    BLOCK_SIZES,
    DENSE,
    QuantEmbedding,
    QuantPart,
    QuantWeight,
    install,
)

logger = logging.getLogger(__name__)


def install_gguf_blocks(model: nn.Module, gguf_file: GGUFFile, hf_config: dict,
                        dtype: torch.dtype) -> None:
    """Replace `model`'s (on the meta device) linear and embedding weights by the file's blocks;
    the parameters left are loaded by loader.load_weights as usual."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    by_param: dict[str, dict[int, GGUFTensor]] = {}
    for gguf_name, hf_name in hf_tensor_names(gguf_file, hf_config).items():
        target = _target(hf_name, model, params)
        if target is None:
            continue
        pname, shard = target
        by_param.setdefault(pname, {})[0 if shard is None else shard] = \
            gguf_file.tensors[gguf_name]
    kept: Counter[str] = Counter()
    dense: Counter[str] = Counter()
    for pname, shards in by_param.items():
        owner, attr = pname.rsplit(".", 1)
        module = modules[owner]
        if attr != "weight" or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        tensors = [shards[i] for i in sorted(shards)]
        if not any(int(t.ggml_type) in BLOCK_SIZES for t in tensors):
            continue
        param = params[pname]
        parts = [_part(t, gguf_file, hf_config, dtype) for t in tensors]
        if sum(p.rows for p in parts) != param.shape[0]:
            raise ModelLoadError(f"{gguf_file.path}: tensors {', '.join(t.name for t in tensors)} "
                                 f"have {sum(p.rows for p in parts)} rows, {pname} needs "
                                 f"{param.shape[0]}")
        for t, p in zip(tensors, parts, strict=True):
            (dense if p.kind == DENSE else kept)[t.ggml_type.name] += 1
        weight = QuantWeight(parts, param.shape[1], dtype)
        if isinstance(module, nn.Embedding):
            parent, _, child = owner.rpartition(".")
            setattr(modules[parent] if parent else model, child, QuantEmbedding(weight))
        else:
            install(module, "weight", weight)
    if kept:
        logger.info("%s: GGUF blocks kept for the quantized kernels (%s)", gguf_file.path,
                    ", ".join(f"{n} {name}" for name, n in sorted(kept.items())))
    if dense:
        logger.info("%s: tensors of types without a quantized kernel dequantized to %s (%s)",
                    gguf_file.path, str(dtype).removeprefix("torch."),
                    ", ".join(f"{n} {name}" for name, n in sorted(dense.items())))


def _part(tensor: GGUFTensor, gguf_file: GGUFFile, hf_config: dict,
          dtype: torch.dtype) -> QuantPart:
    kind = int(tensor.ggml_type)
    if kind not in BLOCK_SIZES:
        return QuantPart(DENSE, _load(tensor, gguf_file.architecture, hf_config).to(dtype))
    rows = tensor.shape[0]
    raw = torch.from_numpy(np.array(tensor.data, copy=True)).reshape(rows, -1)
    if gguf_file.architecture == "llama" and tensor.name.startswith("blk."):
        # The converter permuted the rows of q and k for its rotary layout; a row keeps its
        # blocks, so the inverse permutation moves whole rows of bytes.
        if ".attn_q." in tensor.name:
            raw = _unpermute_rotary(raw, hf_config["num_attention_heads"]).contiguous()
        elif ".attn_k." in tensor.name:
            raw = _unpermute_rotary(raw, hf_config["num_key_value_heads"]).contiguous()
    return QuantPart(kind, raw)
