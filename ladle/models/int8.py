"""int8 weights for Hugging Face checkpoints (W8A8: symmetric int8 per output channel, dynamic
int8 activations per block of 32 values of a token, both run by runner/quant.py's INT8_ROW
parts; a checkpoint that names per-token activations gets these finer ones):
  - `--quantization int8` quantizes a bf16/fp16/fp32 checkpoint after the dense load
    (`quantize_model_int8`);
  - a compressed-tensors checkpoint (vLLM's format, as llm-compressor publishes W8A8 models) is
    checked here (`checkpoint_is_int8`) and its int8 tensors become the same parts, as stored
    (`install_checkpoint_int8`).

Every linear (q|k|v, o, gate|up, down, lm_head) and the embedding are int8; norms, biases and
the KV cache stay in the model dtype. What `--quantization int8` quantizes is rotated first
(runner/quant.py's `rotation_block`, `rotated_weight`): each linear then rotates its
activations, and the embedding's rows are rotated back at lookup; a checkpoint's int8 tensors
run as stored, unrotated. The embedding is int8 too, looked up by dequantizing its
rows: a tied model then keeps one int8 table that both the lookup and the head read (a dense
table beside an int8 copy would hold 3 bytes per vocabulary weight instead of 1; in Qwen3-0.6B
the table is a quarter of the weights)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from torch import nn

from ladle.models.loader import ModelLoadError
from ladle.runner.quant import (
    DENSE,
    INT8_ROW,
    QuantEmbedding,
    QuantPart,
    QuantWeight,
    install,
    quantize_weight_rows,
    rotation_block,
)

logger = logging.getLogger(__name__)

# What a compressed-tensors config must say for ladle to run it: (field, accepted values, the
# compressed-tensors default when the field is absent). QuantizationArgs' defaults are 8 bits,
# int, symmetric, static, and strategy "tensor" when no group size is given.
_WEIGHTS = (("num_bits", (8,), 8), ("type", ("int",), "int"), ("symmetric", (True,), True),
            ("strategy", ("channel", "tensor"), "tensor"), ("dynamic", (False,), False),
            ("group_size", (None,), None), ("block_structure", (None,), None))
_ACTIVATIONS = (("num_bits", (8,), 8), ("type", ("int",), "int"), ("symmetric", (True,), True),
                ("strategy", ("token",), "tensor"), ("dynamic", (True,), False))
ACCEPTED = ("compressed-tensors int8 W8A8 (format int-quantized: 8-bit symmetric int weights per "
            "channel or per tensor, dynamic per-token 8-bit symmetric int input activations), "
            "or gpt-oss's quant_method mxfp4")


def checkpoint_is_int8(hf_config: dict, cfg_file: Path) -> bool:
    """True for a compressed-tensors W8A8 int8 checkpoint, False for one without a
    quantization_config; anything else in a quantization_config is a ModelLoadError naming the
    file and the field."""
    key = next((k for k in ("quantization_config", "compression_config") if hf_config.get(k)),
               None)
    if key is None:
        return False
    qc = hf_config[key]

    def reject(field: str, value, accepted: str):
        where = f"{key}.{field}" if field else key
        raise ModelLoadError(f"{cfg_file}: {where} is {json.dumps(value)}; accepted: "
                             f"{accepted} (ladle runs {ACCEPTED})")

    if not isinstance(qc, dict):
        reject("", qc, "an object")
    if qc.get("quant_method") == "mxfp4" and hf_config.get("model_type") == "gpt_oss":
        return False  # gpt-oss's published MXFP4 experts: models/gpt_oss.py reads them
    if qc.get("quant_method") != "compressed-tensors":
        reject("quant_method", qc.get("quant_method"), '"compressed-tensors"')
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(field):  # the KV cache stays in the model dtype
            reject(field, qc[field], "null or {}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        reject("config_groups", groups, "at least one group")
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            reject(where, group, "an object")
        fmt = group.get("format") or qc.get("format")
        if fmt != "int-quantized":
            reject(f"{where}.format" if group.get("format") else "format", fmt,
                   '"int-quantized"')
        for part, rules in (("weights", _WEIGHTS), ("input_activations", _ACTIVATIONS)):
            args = group.get(part)
            if not isinstance(args, dict):
                reject(f"{where}.{part}", args, "an object (weight-only schemes are not run)"
                       if part == "input_activations" else "an object")
            for field, accepted, default in rules:
                value = args.get(field, default)
                if field == "strategy" and value is None:
                    value = default
                if value not in accepted:
                    reject(f"{where}.{part}.{field}", value,
                           " or ".join(json.dumps(a) for a in accepted))
        if group.get("output_activations"):
            reject(f"{where}.output_activations", group["output_activations"], "null")
    return True


def _merged(parts: list[QuantPart]) -> list[QuantPart]:
    """Adjacent INT8_ROW parts joined into one (one kernel call for all of q|k|v)."""
    out: list[QuantPart] = []
    for p in parts:
        if out and p.kind == INT8_ROW and out[-1].kind == INT8_ROW:
            prev = out.pop()
            p = QuantPart(INT8_ROW, torch.cat([prev.data, p.data]),
                          torch.cat([prev.scale, p.scale]))
        out.append(p)
    return out


def _quantized(w: torch.Tensor) -> QuantWeight:
    """A dense (N, K) weight as int8 rows, quantized in the Hadamard rotation of its K
    (quant.rotation_block; none where K has no power-of-two factor of 32 or more)."""
    rotation = rotation_block(w.shape[1])
    return QuantWeight([quantize_weight_rows(w, rotation)], w.shape[1], w.dtype, rotation)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def quantize_model_int8(model: nn.Module) -> None:
    """Every nn.Linear weight and the nn.Embedding table to int8 per row
    (quant.quantize_weight_rows), in place; parts already int8 (from a compressed-tensors file)
    are kept as they are. Each dense weight is freed as soon as its int8 copy exists, so the
    peak is the dense model plus one weight."""
    t0 = time.perf_counter()
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not getattr(module, "keep_dense", False):
            w = module.weight
            if isinstance(w, QuantWeight):
                if all(p.kind != DENSE for p in w.parts):
                    continue
                parts = [quantize_weight_rows(p.data) if p.kind == DENSE else p for p in w.parts]
                qw = QuantWeight(_merged(parts), w.in_features, w.dtype)
            else:
                qw = _quantized(w.data)
            install(module, "weight", qw)
            count += 1
        elif isinstance(module, nn.Embedding):
            _set_module(model, name, QuantEmbedding(_quantized(module.weight.data)))
            count += 1
    logger.info("int8: %d weights quantized at load (per output channel) in %.1f s", count,
                time.perf_counter() - t0)


def install_checkpoint_int8(model: nn.Module, int8: dict, path: Path) -> None:
    """The int8 tensors load_weights collected from a compressed-tensors checkpoint, as
    QuantWeights in place of their (already allocated) dense parameters. `int8` maps (parameter
    name, shard or None) to {"weight": (name, int8 (rows, K)), "weight_scale": (name, scale)}.
    A fused parameter whose shards are not all int8 (a file that ignores k_proj, say) keeps its
    dense shards as DENSE parts."""
    by_param: dict[str, dict] = {}
    for (pname, shard), found in int8.items():
        if "weight" not in found:  # a float weight on the int8 grid (quantization_status
            name = found["weight_scale"][0]  # "frozen"), not the compressed tensors
            raise ModelLoadError(f"{path}: {name} scales a weight that is not stored as int8; "
                                 "accepted: int8 weights (a compressed checkpoint)")
        if "weight_scale" not in found:
            name = found["weight"][0]
            raise ModelLoadError(f"{path}: {name} is int8 but the checkpoint has no "
                                 f"{name}_scale for it")
        by_param.setdefault(pname, {})[shard] = found
    for pname, shards in by_param.items():
        module_name = pname.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        dense = module.weight
        if None in shards:
            rows = [(None, 0, dense.shape[0])]
        else:
            sizes = model.shard_sizes(module_name)
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            rows = [(i, starts[i], sizes[i]) for i in range(len(sizes))]
        parts = []
        for shard, start, num in rows:
            if shard not in shards:
                parts.append(QuantPart(DENSE, dense.data.narrow(0, start, num).clone()))
                continue
            (wname, q), (sname, scale) = shards[shard]["weight"], shards[shard]["weight_scale"]
            if tuple(q.shape) != (num, dense.shape[1]):
                raise ModelLoadError(f"{path}: {wname} has shape {tuple(q.shape)}, expected "
                                     f"{(num, dense.shape[1])}")
            scale = scale.float().reshape(-1)
            if scale.numel() == 1:  # strategy "tensor": one scale for every row
                scale = scale.expand(num)
            elif scale.numel() != num:
                raise ModelLoadError(f"{path}: {sname} has shape {tuple(scale.shape)}; accepted: "
                                     f"({num}, 1) (per channel) or (1,) (per tensor)")
            parts.append(QuantPart(INT8_ROW, q.contiguous(), scale.contiguous()))
        qw = QuantWeight(_merged(parts), dense.shape[1], dense.dtype)
        if isinstance(module, nn.Embedding):
            _set_module(model, module_name, QuantEmbedding(qw))
        else:
            install(module, "weight", qw)
