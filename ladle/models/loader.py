"""Find a checkpoint (a local directory of safetensors, a GGUF file or a directory holding one,
the built-in `ladle-demo`, a packaged model such as `gemma-3-270m`, or a hub id), build its model
class and load its weights exactly as they are published. Both formats feed one loop
(`load_weights`) as (Hugging Face tensor name, reader) pairs."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ladle.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from ladle.models.layers import RotaryEmbedding
from ladle.models.llama import LlamaForCausalLM
from ladle.models.qwen2 import Qwen2ForCausalLM
from ladle.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
DEMO_MODEL = "ladle-demo"
logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A checkpoint that cannot be found, read or served; the message names the file at fault."""


def resolve_model_path(model: str) -> Path:
    """A local directory is used as it is; `ladle-demo` is built locally on first use; anything
    else is a hub id fetched with huggingface_hub (config, weights and tokenizer files only)."""
    if model == DEMO_MODEL:
        from ladle.models.demo import ensure_demo_model

        return Path(ensure_demo_model())
    from ladle.models.packaged import PACKAGED_MODELS, ensure_packaged_model

    if model in PACKAGED_MODELS:
        return ensure_packaged_model(model)
    path = Path(model).expanduser()
    if path.is_file():
        return path  # a GGUF file (its header is checked when it is read)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").is_file():
            if len(ggufs) > 1:
                raise ModelLoadError(
                    f"{path}: holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)})"
                    "; pass the one to serve (split multi-part GGUF files are not supported)")
            return ggufs[0]
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model {model!r}: not a directory and not a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            model,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken"],
        )
    except Exception as e:  # network errors, missing repos and gated repos all end here
        raise ModelLoadError(
            f"model {model!r}: not a local directory, and downloading it from the Hugging Face "
            f"hub failed ({type(e).__name__}: {e}). Offline? Pass a local checkpoint directory."
        ) from e
    return Path(local)


def is_gguf(path: Path) -> bool:
    """A resolved model path names a GGUF file (a checkpoint directory otherwise)."""
    return path.is_file()


def check_quantization(path: Path, quantization: str | None, hf_config: dict | None = None,
                       tensor_parallel_size: int = 1) -> None:
    """--quantization against the checkpoint. gguf names the format of a .gguf file, so it
    cannot apply to safetensors; int8 quantizes a safetensors checkpoint at load, so it cannot
    apply to a GGUF file. With `hf_config`, a quantization_config is checked too (only
    compressed-tensors int8 runs): such a checkpoint is int8 already, and `none` would ask ladle
    to dequantize it, which it does not (the weights are rounded already; it would only double
    their memory). int8 runs on one rank."""
    if quantization == "gguf" and not is_gguf(path):
        raise ModelLoadError(f"quantization: gguf needs a .gguf model file, but {path} is a "
                             "safetensors checkpoint; accepted for it: int8, none (or leave it "
                             "unset)")
    if quantization == "int8" and is_gguf(path):
        raise ModelLoadError(f"quantization: int8 quantizes a safetensors checkpoint at load, but "
                             f"{path} is a GGUF file; accepted for it: gguf, none (or leave it "
                             "unset)")
    if hf_config is None:
        return
    from ladle.models.int8 import checkpoint_is_int8

    is_int8 = checkpoint_is_int8(hf_config, path / "config.json")
    if is_int8 and quantization == "none":
        raise ModelLoadError(f"quantization: none, but {path / 'config.json'} describes int8 "
                             "weights (compressed-tensors), which ladle runs as they are; "
                             "accepted for it: int8 (or leave it unset)")
    if (is_int8 or quantization == "int8") and tensor_parallel_size > 1:
        raise ModelLoadError(f"tensor_parallel_size: {tensor_parallel_size}, but int8 weights "
                             f"({path}) run on one rank only; accepted with them: 1")


def read_hf_config(path: Path) -> dict:
    """config.json of a checkpoint directory; for a GGUF file, the same keys read from its
    `{arch}.*` metadata."""
    if is_gguf(path):
        from ladle.models.gguf import hf_config_from_gguf, open_gguf

        # A GGUF file records no float dtype of its own: `auto` runs it in bfloat16.
        return {"torch_dtype": "bfloat16"} | hf_config_from_gguf(open_gguf(path))
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file}: missing; a checkpoint directory needs config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        raise ModelLoadError(f"{cfg_file}: multimodal checkpoints are not supported")
    return cfg


def model_class(hf_config: dict, path: Path) -> type[torch.nn.Module]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ModelLoadError(
        f"{path / 'config.json'}: architectures {archs} not supported; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict, device: torch.device) -> torch.dtype:
    """`auto` takes the checkpoint's dtype; float16 becomes bfloat16 on CPU, where float16
    matmuls are slow and bfloat16 ones run on AMX."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
             "float32": torch.float32, "float": torch.float32}
    if dtype == "auto":
        name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
        resolved = names.get(name, torch.float32)
        if resolved == torch.float16 and device.type == "cpu":
            resolved = torch.bfloat16
        return resolved
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, bfloat16, float16 or float32")
    return names[dtype]


def load_model(path: Path, hf_config: dict, dtype: torch.dtype, device: torch.device,
               tp=None, quantization: str | None = None):
    """The model, or with `tp` (a TPGroup) this rank's shard of it: each rank reads only its
    slices of the checkpoint tensors. A compressed-tensors checkpoint keeps its int8 weights as
    stored (its ignored layers, such as lm_head, dense); `quantization` "int8" quantizes every
    weight still dense after the load (models/int8.py)."""
    cls = model_class(hf_config, path)
    with torch.device("meta"):
        model = cls(hf_config, tp)
    if is_gguf(path):
        _gguf_weights(model, path, hf_config, dtype, device, tp, quantization)
    model = model.to_empty(device=device).to(dtype)
    # Buffers (rotary tables) were created on meta: every rotary rebuilds its own, in float32
    # on the real device (a model may hold several: Gemma 3's local and global ones).
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.rebuild(device)
    from ladle.models import int8

    stored_int8 = {} if int8.checkpoint_is_int8(hf_config, path / "config.json") else None
    load_weights(model, path, stored_int8)
    if stored_int8:
        int8.install_checkpoint_int8(model, stored_int8, path)
    if quantization == "int8":
        int8.quantize_model_int8(model)
    return model.eval()


def _gguf_weights(model, path: Path, hf_config: dict, dtype: torch.dtype, device: torch.device,
                  tp, quantization: str | None) -> None:
    """A GGUF file's blocks stay quantized (models/gguf/quantized.py) on one CPU process; with
    --quantization none, on another device or across tensor-parallel ranks they are dequantized
    to the model dtype by the usual load."""
    if quantization != "none" and tp is None and device.type == "cpu":
        from ladle.models.gguf import open_gguf
        from ladle.models.gguf.quantized import install_gguf_blocks

        install_gguf_blocks(model, open_gguf(path), hf_config, dtype)
        return
    if tp is None or tp.rank == 0:
        why = ("--quantization none" if quantization == "none" else
               "the quantized kernels run on the CPU" if device.type != "cpu" else
               "the quantized kernels do not split across tensor-parallel ranks")
        logger.info("%s: GGUF blocks dequantized to %s at load (%s)", path,
                    str(dtype).removeprefix("torch."), why)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights file (model.safetensors expected)")
    return files


def _checkpoint_tensors(path: Path):
    """(checkpoint tensor name, read) pairs, where read(part) returns the tensor, or only the
    part (dim, start, length) of it that this tensor-parallel rank holds (part None: all)."""
    if is_gguf(path):
        from ladle.models.gguf import hf_config_from_gguf, iter_hf_tensors, open_gguf

        reader = open_gguf(path)
        for name, load in iter_hf_tensors(reader, hf_config_from_gguf(reader)):
            # GGUF blocks are dequantized whole (float32); a rank then keeps its slice.
            yield name, (lambda part, load=load, name=name:
                         load() if part is None else _read_slice(load(), name, part))
        return
    for file in _weight_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, (lambda part, f=f, name=name: f.get_tensor(name) if part is None
                             else _read_slice(f.get_slice(name), name, part))


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, path: Path, int8: dict | None = None) -> None:
    """Copy the checkpoint's tensors into the model's parameters. With `int8` (a dict, for a
    compressed-tensors checkpoint) int8 weights and their `weight_scale`s are collected there
    by (parameter name, shard) instead, for int8.install_checkpoint_int8."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with tqdm(total=len(params), desc="Loading weights", unit="tensor", leave=False,
              disable=os.environ.get("LADLE_NO_PROGRESS") == "1") as bar:
        for name, read in _checkpoint_tensors(path):
            is_scale = int8 is not None and name.endswith(".weight_scale")
            target = _target(name.removesuffix("_scale") if is_scale else name, model, params)
            if target is None:
                continue
            pname, shard = target
            tensor = read(model.checkpoint_slice(pname, shard))
            param = params[pname]
            if is_scale or tensor.dtype == torch.int8:
                if int8 is None:
                    raise ModelLoadError(f"{path}: tensor {name} is int8, but config.json has no "
                                         "quantization_config to scale it; accepted: a "
                                         "compressed-tensors int8 checkpoint")
                kind = "weight_scale" if is_scale else "weight"
                int8.setdefault((pname, shard), {})[kind] = (name, tensor)
                if is_scale:
                    continue
            elif shard is None:
                _copy(param, tensor, name)
            else:
                sizes = model.shard_sizes(pname.rsplit(".", 1)[0].rsplit(".", 1)[1])
                start = sum(sizes[:shard])
                _copy(param.narrow(0, start, sizes[shard]), tensor, name)
            loaded.add(pname if shard is None else f"{pname}#{shard}")
            bar.update(1)
    expected = set()
    for pname in params:
        fused = pname.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        if fused in ("qkv_proj", "gate_up_proj"):
            expected |= {f"{pname}#{i}" for i in range(len(model.shard_sizes(fused)))}
        else:
            expected.add(pname)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ModelLoadError(f"{path}: weights missing from the checkpoint: {shown}")


def _target(name: str, model, params: dict) -> tuple[str, int | None] | None:
    """Map a checkpoint tensor name to (parameter name, shard index or None)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if "rotary_emb" in name:
        return None
    if name.startswith("lm_head.") and model.lm_head is None:
        return None  # tied: some checkpoints still store a copy of the embedding
    for part, (fused, shard) in model.stacked.items():
        if f".{part}." in name:
            pname = name.replace(f".{part}.", f".{fused}.")
            if pname in params:
                return pname, shard
    if name in params:
        return name, None
    return None  # tensors of heads ladle does not run (e.g. mtp layers) are skipped


def _read_slice(view, name: str, part: tuple[int, int, int]) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of tensor `name` (`view`: a
    safetensors slice, read without loading the rest, or a tensor); rows past the end (the
    padded vocabulary) are zeros."""
    dim, start, length = part
    size = view.get_shape()[dim] if hasattr(view, "get_shape") else view.shape[dim]
    start, end = min(start, size), min(start + length, size)  # a slice wholly past the end
    tensor = view[start:end] if dim == 0 else view[:, start:end]  # is empty, then all padding
    if end - start < length:
        if dim != 0:
            raise ModelLoadError(f"weight {name}: {size} columns, too few to split")
        tensor = torch.cat([tensor, tensor.new_zeros((length - (end - start),
                                                      *tensor.shape[1:]))])
    return tensor


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ModelLoadError(f"weight {name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
