"""Opens a GGUF file memory-mapped and checks everything that can be checked without reading the
weights: the header, the metadata, the architecture, every tensor's type and where its bytes lie.
Owns `GGUFFile`: metadata as plain python values, tensors as byte views of the mapping.

The header is parsed here rather than by gguf-py's `GGUFReader` (whose type tables we use): that
reader walks every array element in python, 23 s for Gemma 3's 262,144-token vocabulary, and an
array whose length points past the end of the file makes it read nothing, element after element,
instead of failing. Here a scalar array is one numpy view, and a length is checked against the
bytes left before anything is read, so a bad file fails in milliseconds."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ladle.models.gguf.quants import SUPPORTED_TYPES, dequantize
from ladle.models.loader import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "gemma2", "qwen3moe",
                           "gpt-oss", "qwen35", "qwen35moe", "qwen3next")
SUPPORTED_VERSIONS = (2, 3)  # what llama.cpp reads; version 1 had 32-bit counts
MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# Little-endian numpy dtype of each fixed-size metadata value type.
_SCALAR_DTYPES = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # torch order: ggml's `ne` reversed, so rows first
    ggml_type: GGMLQuantizationType
    data: np.ndarray  # uint8 view of the mapping: this tensor's bytes, exactly

    def dequantize(self) -> torch.Tensor:
        """This tensor as float32, in a new tensor (the mapping is never written)."""
        return dequantize(self.data, self.ggml_type, self.shape)


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    version: int
    architecture: str  # general.architecture, one of SUPPORTED_ARCHITECTURES
    metadata: dict[str, Any]  # key -> str, int, float, bool or a list of them
    tensors: dict[str, GGUFTensor]  # in file order


def open_gguf(path: str | Path) -> GGUFFile:
    """Map the file and check it; a file that cannot be served is a ModelLoadError that names it
    and says what is wrong (never a traceback from deep inside a parser)."""
    path = Path(path).expanduser()
    parser, version, num_tensors, metadata = _read_header(path)
    architecture = _architecture(metadata, path)
    infos = [parser.tensor_info() for _ in range(num_tensors)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: general.alignment is {alignment!r}; "
                             "it must be a power of two")
    data_start = -(-parser.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, ne, type_id, offset in infos:
        if name in tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} is described twice")
        tensors[name] = _tensor(parser.buf, path, name, ne, type_id, data_start, offset,
                                alignment, parser.size)
    return GGUFFile(path, version, architecture, metadata, tensors)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The file's metadata alone, checked as open_gguf checks it, for any architecture (a
    tokenizer can come from a file whose model ladle does not run)."""
    return _read_header(Path(path).expanduser())[3]


def _read_header(path: Path) -> tuple[_Parser, int, int, dict[str, Any]]:
    """(parser left at the tensor table, version, tensor count, metadata)."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot be read ({e.strerror}); accepted: a file the user "
                             f"running ladle (uid {os.getuid()}) can read") from e
    if head[:4] != MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {head[:4]!r}, "
                             f"a GGUF file with {MAGIC!r})")
    if len(head) < 8:
        raise ModelLoadError(f"{path}: truncated: the file ends inside the GGUF header")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in SUPPORTED_VERSIONS:
        swapped = version & 0xFFFF == 0  # a big-endian file read little-endian
        what = "a big-endian GGUF file" if swapped else f"GGUF version {version}"
        raise ModelLoadError(f"{path}: {what} is not supported; supported: little-endian GGUF "
                             f"version {' or '.join(map(str, SUPPORTED_VERSIONS))}")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    parser = _Parser(buf, path)
    parser.pos = 8
    num_tensors = parser.u64("the tensor count")
    num_kv = parser.u64("the metadata count")
    # Each entry takes at least 12 bytes: a count past that is corruption, not a loop to run.
    parser.need(12 * num_kv + 12 * num_tensors, f"{num_kv} metadata entries and "
                f"{num_tensors} tensor descriptions")
    return parser, version, num_tensors, parser.metadata(num_kv)


class _Parser:
    """Reads GGUF's little-endian fields from the mapping; a read past its end is a
    ModelLoadError that says what was being read."""

    def __init__(self, buf: np.ndarray, path: Path):
        self.buf, self.view, self.path = buf, memoryview(buf), path
        self.size, self.pos = len(buf), 0

    def need(self, num_bytes: int, what: str) -> None:
        if self.pos + num_bytes > self.size:
            raise ModelLoadError(f"{self.path}: truncated: {what} runs past the end of the file "
                                 f"({self.size} bytes)")

    def u32(self, what: str) -> int:
        self.need(4, what)
        self.pos += 4
        return struct.unpack_from("<I", self.view, self.pos - 4)[0]

    def u64(self, what: str) -> int:
        self.need(8, what)
        self.pos += 8
        return struct.unpack_from("<Q", self.view, self.pos - 8)[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        self.pos += n
        try:
            return str(self.view[self.pos - n:self.pos], "utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path}: {what}: a string that is not UTF-8 ({e})") from e

    def value_type(self, what: str) -> GGUFValueType:
        type_id = self.u32(what)
        try:
            return GGUFValueType(type_id)
        except ValueError:
            raise ModelLoadError(f"{self.path}: {what}: unknown value type {type_id} "
                                 "(corrupt metadata)") from None

    def metadata(self, num_kv: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for i in range(num_kv):
            key = self.string(f"metadata key #{i}")
            if key in metadata:
                raise ModelLoadError(f"{self.path}: metadata key {key!r} appears twice")
            metadata[key] = self.value(self.value_type(f"metadata {key!r}"), f"metadata {key!r}")
        return metadata

    def value(self, vtype: GGUFValueType, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what)
        dtype = _SCALAR_DTYPES[vtype]
        self.need(dtype.itemsize, what)
        value = np.frombuffer(self.view, dtype, 1, self.pos)[0]
        self.pos += dtype.itemsize
        if vtype == GGUFValueType.FLOAT32:
            # The shortest decimal that is this float32: 1e-06, as the config.json it came from
            # said, not 9.999999974752427e-07 (both are the same float32).
            return float(str(value))
        return value.item()

    def array(self, what: str) -> list:
        item_type = self.value_type(what)
        count = self.u64(what)
        if item_type in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[item_type]
            self.need(count * dtype.itemsize, what)
            values = np.frombuffer(self.view, dtype, count, self.pos)
            self.pos += count * dtype.itemsize
            return values.tolist()
        # Strings and arrays: at least their 8-byte length (arrays 12) each.
        self.need(count * (8 if item_type == GGUFValueType.STRING else 12), what)
        if item_type == GGUFValueType.STRING:
            return self.strings(count, what)
        return [self.array(what) for _ in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row (a vocabulary: 262,144 for Gemma 3), in one tight loop;
        the same checks as `string`, without a method call per field."""
        view, size, pos = self.view, self.size, self.pos
        unpack = struct.Struct("<Q").unpack_from
        out = []
        try:
            for _ in range(count):
                if pos + 8 > size:
                    break
                n = unpack(view, pos)[0]
                pos += 8
                if pos + n > size:
                    break
                out.append(str(view[pos:pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path}: {what}: a string that is not UTF-8 ({e})") from e
        self.pos = pos
        if len(out) < count:
            raise ModelLoadError(f"{self.path}: truncated: {what} runs past the end of the file "
                                 f"({size} bytes)")
        return out

    def tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self.string("a tensor name")
        what = f"the description of tensor {name!r}"
        num_dims = self.u32(what)
        if num_dims > MAX_DIMS:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has {num_dims} dimensions; "
                                 f"ggml allows at most {MAX_DIMS}")
        ne = [self.u64(what) for _ in range(num_dims)]
        return name, ne, self.u32(what), self.u64(what)


def _architecture(metadata: dict[str, Any], path: Path) -> str:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        found = "no general.architecture" if arch is None else f"architecture {arch!r}"
        raise ModelLoadError(f"{path}: {found} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _tensor(buf: np.ndarray, path: Path, name: str, ne: list[int], type_id: int,
            data_start: int, offset: int, alignment: int, size: int) -> GGUFTensor:
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {name!r} has unknown ggml type id {type_id}; "
                             f"supported: {supported}") from None
    if ggml_type not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{path}: tensor {name!r} is {ggml_type.name}, a type ladle does not "
                             f"read; supported: {supported}")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if ne and ne[0] % block_size:
        raise ModelLoadError(f"{path}: tensor {name!r}: rows of {ne[0]} values do not split "
                             f"into {ggml_type.name} blocks of {block_size}")
    if offset % alignment:
        raise ModelLoadError(f"{path}: tensor {name!r}: data offset {offset} is not a "
                             f"multiple of the file's alignment ({alignment})")
    num_bytes = int(np.prod(ne, dtype=object)) // block_size * type_size
    start = data_start + offset
    if start + num_bytes > size:
        raise ModelLoadError(f"{path}: truncated: tensor {name!r} needs bytes {start} to "
                             f"{start + num_bytes}, past the end of the file ({size} bytes)")
    return GGUFTensor(name, tuple(reversed(ne)), ggml_type, buf[start:start + num_bytes])
