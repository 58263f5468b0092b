"""GGUF checkpoints: `reader` maps and checks the file, `quants` dequantizes its tensor types in
torch, `mapping` turns its metadata and tensors into what the Hugging Face checkpoint had."""

from ladle.models.gguf.mapping import hf_config_from_gguf, hf_tensor_names, iter_hf_tensors
from ladle.models.gguf.quants import SUPPORTED_TYPES, dequantize
from ladle.models.gguf.reader import (
    SUPPORTED_ARCHITECTURES,
    GGUFFile,
    GGUFTensor,
    open_gguf,
    read_metadata,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TYPES",
    "GGUFFile",
    "GGUFTensor",
    "dequantize",
    "hf_config_from_gguf",
    "hf_tensor_names",
    "iter_hf_tensors",
    "open_gguf",
    "read_metadata",
]
