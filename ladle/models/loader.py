"""Find a checkpoint (a local directory of safetensors, a GGUF file or a directory holding one,
the built-in `ladle-demo`, a packaged model such as `gemma-3-270m`, or a hub id), build its model
class and load its weights exactly as they are published. Both formats feed one loop
(`load_weights`) as (Hugging Face tensor name, reader) pairs."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ladle.models.layers import RotaryEmbedding
from ladle.models.llama import LlamaForCausalLM
from ladle.models.registry import ARCHITECTURES, architecture_class

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
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:  # unreadable, or not JSON
        raise ModelLoadError(f"{cfg_file}: cannot be read as JSON ({e}); accepted: the "
                             "checkpoint's config.json as published") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file}: holds a {type(cfg).__name__}, not a JSON object")
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cls = next((c for c in map(architecture_class, cfg.get("architectures") or []) if c),
                   None)
        if not getattr(cls, "text_of_multimodal", False):
            served = [a for a in ARCHITECTURES
                      if getattr(architecture_class(a), "text_of_multimodal", False)]
            raise ModelLoadError(f"{cfg_file}: multimodal checkpoints are served for their text "
                                 f"model only for {', '.join(served)}; architectures "
                                 f"{cfg.get('architectures')} is not one of them")
        cfg = text_model_config(cfg)
    return cfg


def text_model_config(cfg: dict) -> dict:
    """A multimodal config.json as its text model's: text_config's fields, with the file's
    architectures, dtype and tie_word_embeddings (the top level's wins, as in transformers)."""
    text = dict(cfg["text_config"])
    for key in ("architectures", "tie_word_embeddings", "torch_dtype", "dtype"):
        if key in cfg:
            text[key] = cfg[key]
    return text


def model_class(hf_config: dict, path: Path) -> type[torch.nn.Module]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        cls = architecture_class(arch)
        if cls is not None:
            return cls
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
               tp=None, quantization: str | None = None, stage=None):
    """The model, or with `tp` (a TPGroup) this rank's shard of it: each rank reads only its
    slices of the checkpoint tensors. With `stage` (a distributed.pipeline.PipelineStage) only
    that pipeline stage's layers (and embedding or head) exist, and only their tensors are
    read. A compressed-tensors checkpoint keeps its int8 weights as stored (its ignored
    layers, such as lm_head, dense); `quantization` "int8" quantizes every weight still dense
    after the load (models/int8.py)."""
    cls = model_class(hf_config, path)
    with torch.device("meta"):
        model = cls(hf_config, tp)
    if stage is not None:
        from ladle.distributed.pipeline import prune_to_stage

        prune_to_stage(model, stage)
        model.pp_dtype = dtype
    if is_gguf(path):
        _gguf_weights(model, path, hf_config, dtype, device, tp, quantization)
    elif hasattr(model, "keep_mxfp4") and quantization != "none" and tp is None \
            and device.type == "cpu":
        # gpt-oss's published MXFP4 experts stay 4-bit for the quantized kernels.
        try:
            kept = model.keep_mxfp4(_named_reader(path), dtype)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from e
        if kept:
            logger.info("%s: MXFP4 experts kept 4-bit for the quantized kernels (%d tensors)",
                        path, kept)
    model = model.to_empty(device=device).to(dtype)
    # Buffers (rotary tables) were created on meta: every rotary rebuilds its own, in float32
    # on the real device (a model may hold several: Gemma 3's local and global ones).
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.rebuild(device)
    from ladle.models import int8

    stored_int8 = {} if int8.checkpoint_is_int8(hf_config, path / "config.json") else None
    load_weights(model, path, stored_int8, hf_config)
    if stored_int8:
        int8.install_checkpoint_int8(model, stored_int8, path)
    if quantization == "int8":
        int8.quantize_model_int8(model)
    for module in model.modules():  # layouts a module builds from its loaded weights
        hook = getattr(module, "after_load", None)
        if hook is not None:
            hook()
    from ladle.runner.quant import repack_for_kernels

    repacked = repack_for_kernels(model)
    if repacked:
        logger.info("%s: %d Q4_K/Q5_K/Q6_K/Q8_0/Q5_0 weight parts repacked by 16 rows for the "
                    "AVX-512 VNNI kernels", path, repacked)
    if device.type == "cpu":
        from ladle.runner.cpu_kernels import weights_to_huge_pages

        t = time.perf_counter()
        moved = weights_to_huge_pages(model)
        if moved:
            logger.info("%s: %.0f MiB of weights moved into memory advised for 2 MiB pages in "
                        "%.2f s", path, moved / 2**20, time.perf_counter() - t)
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


def _checkpoint_tensors(path: Path, model=None):
    """(file, checkpoint tensor name, shape or None, read) for every tensor, where read(part)
    returns the tensor, or only the part (dim, start, length) of it that this tensor-parallel
    rank holds (part None: all of it). Nothing is read until `read` is called. A tensor that
    holds several of the model's (a layer's experts stacked in one, which a family's
    `unfused(name, shape, sibling)` lists as (name, shape, index) triples; index: an index into
    the stored tensor, or a function of it; sibling(name) reads another stored tensor, such as
    the scales of quantized blocks) comes as those tensors."""
    unfused = getattr(model, "unfused", None)
    read_named = None if is_gguf(path) else _named_reader(path)

    def sibling(other: str) -> torch.Tensor:
        if (t := None if read_named is None else read_named(other)) is not None:
            return t
        raise ModelLoadError(f"{path}: tensor {other} is missing; accepted: a checkpoint with "
                             "every tensor of the model")

    for file, name, shape, read in _stored_tensors(path):
        try:
            parts = None if unfused is None else unfused(name, shape, sibling)
        except ValueError as e:  # a stored layout the family does not read
            raise ModelLoadError(f"{file}: {e}") from e
        if parts is None:
            yield file, name, shape, read
            continue
        whole: list[torch.Tensor] = []  # the stored tensor, read once for all its parts

        def piece(part, index, sub, read=read, whole=whole, file=file):
            if not whole:
                whole.append(read(None))
            try:
                t = index(whole[0]) if callable(index) else whole[0][index]
            except ValueError as e:  # a family's decoding (MXFP4 blocks and scales) refused it
                raise ModelLoadError(f"{file}: {e}") from e
            return t if part is None else _read_slice(t, sub, part)

        for sub, sub_shape, index in parts:
            yield file, sub, sub_shape, (lambda part, index=index, sub=sub, piece=piece:
                                         piece(part, index, sub))


def _named_reader(path: Path):
    """read(name) -> the safetensors checkpoint's tensor `name`, or None when no file holds it
    (the files' names are indexed on first use)."""
    where: dict[str, Path] = {}

    def read(name: str) -> torch.Tensor | None:
        if not where:
            for file in _weight_files(path):
                with _open_safetensors(file) as f:
                    where.update(dict.fromkeys(f.keys(), file))
        if name not in where:
            return None
        with _open_safetensors(where[name]) as f:
            return f.get_tensor(name)

    return read


def _stored_tensors(path: Path):
    """_checkpoint_tensors as the files store them."""
    if is_gguf(path):
        from ladle.models.gguf import hf_config_from_gguf, iter_hf_tensors, open_gguf

        reader = open_gguf(path)
        # Shapes None: iter_hf_tensors has checked each against the model's already.
        for name, load in iter_hf_tensors(reader, hf_config_from_gguf(reader)):
            # GGUF blocks are dequantized whole (float32); a rank then keeps its slice.
            yield path, name, None, (lambda part, load=load, name=name:
                                     load() if part is None else _read_slice(load(), name, part))
        return
    for file in _weight_files(path):
        with _open_safetensors(file) as f:
            for name in f.keys():
                yield file, name, tuple(f.get_slice(name).get_shape()), (
                    lambda part, f=f, name=name: f.get_tensor(name) if part is None
                    else _read_slice(f.get_slice(name), name, part))


def _open_safetensors(file: Path):
    """safe_open, with a ModelLoadError naming the file when it cannot be read or is not whole
    (safetensors itself reports a file it may not read as "No such file or directory")."""
    try:
        with open(file, "rb"):
            pass
    except OSError as e:
        raise ModelLoadError(f"{file}: cannot be read ({e.strerror}); accepted: a file the "
                             f"user running ladle (uid {os.getuid()}) can read") from e
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # SafetensorError: a header that does not parse or cover the file
        raise ModelLoadError(
            f"{file}: not a complete safetensors file ({e}; {file.stat().st_size} bytes): "
            "truncated or still being copied? Accepted: the file as published (copy or "
            "download it again)") from e


def meta_model(hf_config: dict, path: Path) -> torch.nn.Module:
    """The checkpoint's model class built on the meta device (no memory, no init), for its
    parameters' names and shapes; a config it cannot be built from is a ModelLoadError naming
    the config file."""
    cls = model_class(hf_config, path)
    try:
        with torch.device("meta"):
            return cls(hf_config, None)
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # a field missing or odd
        raise ModelLoadError(f"{_config_file(path)}: does not describe a {cls.__name__} "
                             f"({type(e).__name__}: {e}); accepted: the config these weights "
                             "were saved with") from e


def check_checkpoint(path: Path, hf_config: dict) -> None:
    """Everything about a checkpoint that can be checked without reading its weights (headers
    only), so that `ladle serve` refuses a broken one in seconds, not after a model load: every
    weights file can be read and is whole, and its tensors are exactly the model's (none
    missing, none the model has no place for, each of the shape the config gives).
    ModelLoadError names the file, and for a shape config.json and the field; the load itself
    raises the same errors."""
    model = meta_model(hf_config, path)
    params = dict(model.named_parameters())
    from ladle.models import int8

    is_int8 = not is_gguf(path) and int8.checkpoint_is_int8(hf_config, path / "config.json")
    loaded: set[str] = set()
    for file, name, shape, _ in _checkpoint_tensors(path, model):
        target = _checked_target(name, file, path, model, params, is_int8)
        if target is None:
            continue
        pname, shard, is_scale = target
        if shape is not None and not is_scale:  # int8.py checks a scale against its weight
            expected = _expected_shape(model, params[pname], pname, shard)
            if shape != expected:
                raise _shape_error(file, name, shape, expected, path, hf_config)
        loaded.add(_loaded_key(pname, shard))
    _check_complete(model, params, loaded, path)


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, path: Path, int8: dict | None = None,
                 hf_config: dict | None = None) -> None:
    """Copy the checkpoint's tensors into the model's parameters. With `int8` (a dict, for a
    compressed-tensors checkpoint) int8 weights and their `weight_scale`s are collected there
    by (parameter name, shard) instead, for int8.install_checkpoint_int8. `hf_config` lets a
    shape error name the config field at fault."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with tqdm(total=len(params), desc="Loading weights", unit="tensor", leave=False,
              disable=os.environ.get("LADLE_NO_PROGRESS") == "1") as bar:
        for file, name, _, read in _checkpoint_tensors(path, model):
            target = _checked_target(name, file, path, model, params, int8 is not None)
            if target is None:
                continue
            pname, shard, is_scale = target
            tensor = read(model.checkpoint_slice(pname, shard))
            param = params[pname]
            if is_scale or tensor.dtype == torch.int8:
                if int8 is None:
                    raise ModelLoadError(f"{file}: tensor {name} is int8, but {path} has no "
                                         "quantization_config in config.json to scale it; "
                                         "accepted: a compressed-tensors int8 checkpoint")
                kind = "weight_scale" if is_scale else "weight"
                int8.setdefault((pname, shard), {})[kind] = (name, tensor)
                if is_scale:
                    continue
            else:
                if shard is None:
                    dst = param
                else:
                    sizes = _shard_sizes(model, pname)
                    dst = param.narrow(0, sum(sizes[:shard]), sizes[shard])
                if dst.shape != tensor.shape:
                    raise _shape_error(file, name, tuple(tensor.shape), tuple(dst.shape), path,
                                       hf_config)
                dst.copy_(tensor)
            loaded.add(_loaded_key(pname, shard))
            bar.update(1)
    _check_complete(model, params, loaded, path)


def _checked_target(name: str, file: Path, path: Path, model, params: dict, is_int8: bool
                    ) -> tuple[str, int | None, bool] | None:
    """(parameter, shard, is an int8 weight_scale) that checkpoint tensor `name` loads into;
    None for a tensor a checkpoint may hold that the model rebuilds or shares (rotary tables,
    a tied head's copy of the embedding); a ModelLoadError naming the file for any other
    tensor the model has no place for."""
    is_scale = is_int8 and name.endswith(".weight_scale")
    target = _target(name.removesuffix("_scale") if is_scale else name, model, params)
    if target is not None:
        return (*target, is_scale)
    if name.startswith(getattr(model, "ignored_prefixes", ())):
        return None  # held for what ladle does not run (a vision tower, an MTP head)
    bare = name.removeprefix("model.")
    stage = getattr(model, "pp", None)
    if stage is not None and not stage.holds(_renamed(name.removeprefix(
            getattr(model, "checkpoint_prefix", "model.")), model)):
        return None  # another pipeline stage's weight
    if "rotary_emb" in bare or (bare.startswith("lm_head.") and model.lm_head is None) \
            or _holds_blocks(bare, model):
        return None
    raise ModelLoadError(
        f"{file}: unexpected tensor {name}: {type(model).__name__} as {_config_file(path)} "
        "describes it has no such weight; accepted: that model's tensors only (is config.json "
        "the one these weights were saved with?)")


def _holds_blocks(name: str, model) -> bool:
    """The weight `name` (or the fused one it is part of) is a QuantWeight already, installed
    from a GGUF file's blocks before the load (models/gguf/quantized.py)."""
    from ladle.runner.quant import QuantWeight

    name = _renamed(name, model)
    for part, (fused, _) in model.stacked.items():
        name = name.replace(f".{part}.", f".{fused}.")
    owner, _, attr = name.rpartition(".")
    try:
        return isinstance(getattr(model.get_submodule(owner), attr, None), QuantWeight)
    except AttributeError:  # no such module
        return False


def _shard_sizes(model, pname: str) -> list[int]:
    return model.shard_sizes(pname.rsplit(".", 1)[0])


def _expected_shape(model, param: torch.Tensor, pname: str, shard: int | None) -> tuple:
    """The shape checkpoint tensor (`pname`, `shard`) must have (one rank, no split)."""
    if shard is None:
        return tuple(param.shape)
    return (_shard_sizes(model, pname)[shard], *param.shape[1:])


def _loaded_key(pname: str, shard: int | None) -> str:
    return pname if shard is None else f"{pname}#{shard}"


def _expected_keys(model, params: dict) -> set[str]:
    """The loaded-parameter key of every checkpoint tensor the model needs (one per shard of
    a fused projection)."""
    expected = set()
    for pname in params:
        fused = pname.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        if fused in ("qkv_proj", "gate_up_proj"):
            expected |= {f"{pname}#{i}"
                         for i in range(len(model.shard_sizes(pname.rsplit(".", 1)[0])))}
        else:
            expected.add(pname)
    return expected


def checkpoint_shapes(model) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the model's checkpoint as published (a model built on
    the meta device will do), the names and shapes `check_checkpoint` accepts."""
    params = dict(model.named_parameters())
    out = {}
    for key in sorted(_expected_keys(model, params)):
        pname, _, shard = key.partition("#")
        out[_checkpoint_name(key, model)] = _expected_shape(
            model, params[pname], pname, int(shard) if shard else None)
    return out


def _check_complete(model, params: dict, loaded: set[str], path: Path) -> None:
    """ModelLoadError naming the checkpoint's tensors that no file holds."""
    expected = _expected_keys(model, params)
    missing = [_checkpoint_name(key, model) for key in sorted(expected - loaded)]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        files = _weight_files(path) if not is_gguf(path) else [path]
        where = files[0] if len(files) == 1 else f"{path} ({len(files)} weights files)"
        raise ModelLoadError(f"{where}: missing tensor(s) {shown}: {type(model).__name__} as "
                             f"{_config_file(path)} describes it needs them; accepted: a "
                             "checkpoint with every weight of that model")


def _checkpoint_name(key: str, model) -> str:
    """A loaded-parameter key ("layers.0.self_attn.qkv_proj.weight#1") as the checkpoint names
    the tensor ("model.layers.0.self_attn.k_proj.weight")."""
    pname, _, shard = key.partition("#")
    if shard:
        parts = {v: k for k, v in model.stacked.items()}
        fused = pname.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        pname = pname.replace(f".{fused}.", f".{parts[(fused, int(shard))]}.")
    for old, new in reversed(getattr(model, "renames", ())):
        pname = pname.replace(new, old)
    return pname if pname.startswith("lm_head.") else \
        f"{getattr(model, 'checkpoint_prefix', 'model.')}{pname}"


def _config_file(path: Path) -> Path:
    """Where a checkpoint's configuration is: config.json, or a GGUF file's own metadata."""
    return path if is_gguf(path) else path / "config.json"


def _shape_error(file: Path, name: str, shape: tuple, expected: tuple, path: Path,
                 hf_config: dict | None) -> ModelLoadError:
    """A tensor whose shape is not the one the config gives: names the file, the tensor, the
    config file and the config fields that set the dimensions that differ."""
    fields: list[str] = []
    if hf_config is not None and len(shape) == len(expected):
        for got, want in zip(shape, expected, strict=True):
            if got != want:
                fields += [f"{k} is {want}" for k in size_fields(want, hf_config, path)]
    why = f" ({', '.join(dict.fromkeys(fields))})" if fields else ""
    return ModelLoadError(
        f"{file}: tensor {name} has shape {shape}, but {_config_file(path)} makes it "
        f"{expected}{why}; the weights and the config disagree: accepted: the config these "
        "weights were saved with")


def size_fields(size: int, hf_config: dict, path: Path) -> list[str]:
    """The config fields (config.json's, or a GGUF file's metadata keys) that give a tensor
    dimension of `size`."""
    heads = hf_config.get("num_attention_heads") or 0
    hidden = hf_config.get("hidden_size") or 0
    head_dim = hf_config.get("head_dim") or (hidden // heads if heads else 0)
    kv_heads = hf_config.get("num_key_value_heads") or heads
    sizes = {"hidden_size": hidden, "intermediate_size": hf_config.get("intermediate_size"),
             "vocab_size": hf_config.get("vocab_size"), "head_dim": head_dim,
             "num_attention_heads x head_dim": heads * head_dim,
             "num_key_value_heads x head_dim": kv_heads * head_dim,
             "moe_intermediate_size": hf_config.get("moe_intermediate_size"),
             "num_experts": hf_config.get("num_experts"),
             "num_local_experts": hf_config.get("num_local_experts")}
    names = [k for k, v in sizes.items() if v == size]
    if is_gguf(path):
        from ladle.models.gguf.mapping import gguf_field_names

        names = gguf_field_names(names, hf_config)
    return names


def _target(name: str, model, params: dict) -> tuple[str, int | None] | None:
    """Map a checkpoint tensor name to (parameter name, shard index or None); None when the
    model has no parameter for it (`_checked_target` tells the expected ones from the rest)."""
    prefix = getattr(model, "checkpoint_prefix", "model.")
    if name.startswith(prefix):
        name = name[len(prefix):]
    name = _renamed(name, model)
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
    return None


def _renamed(name: str, model) -> str:
    """A checkpoint name in the model's own module names: a family whose checkpoints name
    modules otherwise (Mixtral's block_sparse_moe, w1/w2/w3) lists `renames` (old, new)."""
    for old, new in getattr(model, "renames", ()):
        name = name.replace(old, new)
    return name


def _read_slice(view, name: str, part: tuple[int, int, int] | list) -> torch.Tensor:
    """Indices [start, start + length) along `dim` of tensor `name` (`view`: a
    safetensors slice, read without loading the rest, or a tensor); rows past the end (the
    padded vocabulary) are zeros. `part` may be a list of such parts along one dim, joined in
    order (a rank's share of a tensor that fuses several projections: q, k and v rows, or each
    expert's gate and up rows)."""
    if isinstance(part, list):
        return torch.cat([_read_slice(view, name, p) for p in part], dim=part[0][0])
    dim, start, length = part
    size = view.get_shape()[dim] if hasattr(view, "get_shape") else view.shape[dim]
    start, end = min(start, size), min(start + length, size)  # a slice wholly past the end
    # A slice wholly past the end is empty, then all padding.
    tensor = view[(slice(None),) * dim + (slice(start, end),)]
    if end - start < length:
        if dim != 0:
            raise ModelLoadError(f"weight {name}: {size} entries along dim {dim}, too few "
                                 "to split")
        tensor = torch.cat([tensor, tensor.new_zeros((length - (end - start),
                                                      *tensor.shape[1:]))])
    return tensor

