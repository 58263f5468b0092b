"""Every engine default and cross-field check, in one place."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from ladle.distributed.kv_transfer import KVTransferConfig
from ladle.sampling_params import DEFAULT_MAX_N, INT64_MAX, INT64_MIN
from ladle.spec_decode.config import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "priority")
# --quantization (vLLM's flag): None = what the checkpoint is (gguf for a .gguf file, int8 for a
# compressed-tensors W8A8 checkpoint, else none); "gguf" = the weights come from a GGUF file;
# "none" = GGUF blocks are dequantized at load into --dtype; "int8" = a safetensors checkpoint's
# weights are quantized at load to int8 per output channel, run with int8 activations per token
# (models/int8.py). Until GGUF kernels land, a GGUF file always runs dequantized (the log says so).
QUANTIZATIONS = ("gguf", "none", "int8")
DISTRIBUTED_BACKENDS = ("mp", "ray")


@dataclass(slots=True)
class EngineConfig:
    model: str = "ladle-demo"
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    quantization: str | None = None  # None (the checkpoint's own) | gguf | none | int8
    device: str = "auto"  # auto: cuda when present, else cpu
    # Defaults to the model's max_position_embeddings; -1 ("auto"): that, shrunk to what the KV
    # cache can hold.
    max_model_len: int | None = None
    max_num_seqs: int = 128  # per engine
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    block_size: int = 16
    # KV-cache size: bytes ("4GiB", "512MB", 1e9) or a fraction of free device memory ("0.3").
    kv_cache_memory: str | float | int | None = None
    num_kv_blocks: int | None = None  # exact block count; overrides kv_cache_memory
    # vLLM's --gpu-memory-utilization: the fraction of the device's total memory (host memory on
    # CPU) this engine may hold; the KV cache gets what is left after the weights. Used when
    # kv_cache_memory and num_kv_blocks are unset.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # Hybrid (linear-attention) models: state snapshots the prefix cache keeps, each one
    # sequence's linear-layer state after a full block, in kv_cache_memory. None: max_num_seqs;
    # 0: no prefix caching for hybrids. Dense models ignore it.
    prefix_state_slots: int | None = None
    # Batch-invariant numerics (the README's "Same request, same tokens"): each token's logits
    # are the same bits whatever else the step holds. CPU kernels only.
    batch_invariant: bool = False
    seed: int = 0
    max_logprobs: int = 20  # -1: no cap but the vocabulary size
    max_n: int = DEFAULT_MAX_N  # choices per request (OpenAI's 128)
    scheduling_policy: str = "fcfs"  # fcfs | priority (requests' `priority` field counts)
    logits_processors: list[str] = field(default_factory=list)  # "module:Class"
    structured_outputs_backend: str = "auto"  # auto | xgrammar | guidance
    # Seconds a grammar compile may run (from its start, or from the request's arrival if it
    # joins a running compile) before the request waiting for it fails, alone.
    structured_outputs_compile_timeout: float = 30.0
    # Compiled grammars kept for reuse, in bytes (least recently used evicted first); 0 = none.
    structured_outputs_cache_bytes: int = 512 * 2**20
    reasoning_parser: str | None = None
    # Speculative decoding, off when None: {"method": "ngram", "num_speculative_tokens": k, ...}
    # as a dict or JSON string; checked into a SpeculativeConfig here.
    speculative_config: SpeculativeConfig | None = None
    # Engine-core processes behind one API process (`ladle serve` only; each a full engine with
    # its own KV cache sized as configured).
    data_parallel_size: int = 1
    # Tensor parallelism (docs/scaling.md): ranks that each hold 1/N of every layer; rank 0 is
    # the engine process, ranks 1..N-1 are workers started by the executor backend.
    tensor_parallel_size: int = 1
    # Pipeline parallelism (docs/scaling.md): stages that each hold a contiguous run of layers
    # (x tensor_parallel_size ranks each); the engine process is the last stage, which samples.
    pipeline_parallel_size: int = 1
    pp_layer_partition: list[int] | None = None  # layers per stage; None: as even as possible
    distributed_executor_backend: str = "mp"  # mp (local processes) | ray (actors, multi-node)
    # Prefill/decode disaggregation: vLLM's --kv-transfer-config (dict or JSON string:
    # kv_connector, kv_role, kv_connector_extra_config); checked into a KVTransferConfig here.
    kv_transfer_config: KVTransferConfig | None = None
    # Seconds one collective (or one command to a worker) may take before the engine gives up
    # on the group and stops; startup (workers loading their shards) gets ten times as long.
    distributed_timeout: float = 60.0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1 and self.max_model_len != -1:
            raise ValueError(f"max_model_len: must be >= 1 (or -1 for auto), got "
                             f"{self.max_model_len}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.prefix_state_slots is not None and self.prefix_state_slots < 0:
            raise ValueError(f"prefix_state_slots: must be >= 0 (0: no prefix caching for "
                             f"hybrid models), got {self.prefix_state_slots}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs: must be -1 (no cap) or >= 0, got {self.max_logprobs}")
        if self.max_n < 1:
            raise ValueError(f"max_n: must be >= 1, got {self.max_n}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: {self.scheduling_policy!r}; accepted: "
                             + ", ".join(SCHEDULING_POLICIES))
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: {self.quantization!r}; accepted: "
                             + ", ".join(QUANTIZATIONS))
        if self.structured_outputs_backend not in ("auto", "xgrammar", "guidance"):
            raise ValueError(
                f"structured_outputs_backend: {self.structured_outputs_backend!r}; "
                "accepted: auto, xgrammar, guidance"
            )
        timeout = self.structured_outputs_compile_timeout
        if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
            raise ValueError(f"structured_outputs_compile_timeout: must be a positive number of "
                             f"seconds, got {timeout!r}")
        if not isinstance(self.structured_outputs_cache_bytes, int) or \
                self.structured_outputs_cache_bytes < 0:
            raise ValueError(f"structured_outputs_cache_bytes: must be an integer >= 0, got "
                             f"{self.structured_outputs_cache_bytes!r}")
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.from_value(self.kv_transfer_config)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be an integer >= 1, got "
                             f"{self.tensor_parallel_size!r}")
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size: must be an integer >= 1, got "
                             f"{self.pipeline_parallel_size!r}")
        partition = self.pp_layer_partition
        if partition is not None and (
                not isinstance(partition, list) or len(partition) != self.pipeline_parallel_size
                or not all(isinstance(n, int) and n >= 1 for n in partition)):
            raise ValueError(f"pp_layer_partition: {partition!r}; accepted: one number of "
                             f"layers (>= 1) per pipeline stage, {self.pipeline_parallel_size} "
                             "in all")
        if self.distributed_executor_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"distributed_executor_backend: {self.distributed_executor_backend!r}"
                             "; accepted: " + ", ".join(DISTRIBUTED_BACKENDS))
        timeout = self.distributed_timeout
        if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
            raise ValueError(f"distributed_timeout: must be a positive number of seconds, got "
                             f"{timeout!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def check_priority(priority: int, scheduling_policy: str) -> None:
    """A request's priority: any int64 under the priority policy, only 0 under fcfs (as vLLM: a
    priority that would be ignored is an error, not a surprise)."""
    if not INT64_MIN <= priority <= INT64_MAX:
        raise ValueError(f"priority: {priority} is out of range; accepted: an integer in "
                         f"[{INT64_MIN}, {INT64_MAX}]")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(f"priority: {priority} needs the priority scheduling policy (start the "
                         "server with --scheduling-policy priority); accepted: 0")


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def kv_cache_bytes(spec: str | float | int | None, device: torch.device, needed: int) -> int:
    """Bytes for the KV cache. None: what max_num_seqs full-length requests would need, capped at
    a quarter of free memory. A value <= 1 is a fraction of free device memory."""
    free = free_memory(device)
    if spec is None:
        return int(min(needed, free * 0.25))
    if isinstance(spec, str):
        try:
            value = _parse_size(spec)
        except ValueError:
            raise ValueError(
                f"kv_cache_memory: {spec!r} is not a size; use bytes (e.g. 4GiB, 512MB, 1e9) or a "
                "fraction of free memory (e.g. 0.3)"
            ) from None
    else:
        value = float(spec)
    if value <= 0:
        raise ValueError(f"kv_cache_memory: must be positive, got {spec!r}")
    return int(value * free) if value <= 1 else int(value)


def kv_cache_bytes_from_utilization(utilization: float, device: torch.device, held: int,
                                    needed: int) -> int:
    """--gpu-memory-utilization: utilization x total memory, less the `held` bytes (weights)
    this engine already holds. On a CPU host, whose memory the OS and other processes share,
    the KV cache is further capped at `needed` (what max_num_seqs full-length requests use)."""
    total = _total_memory(device)
    budget = int(utilization * total) - held
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {utilization} of {total / 2**30:.1f} GiB leaves no room for "
            f"the KV cache after the weights ({held / 2**30:.2f} GiB); raise it")
    return budget if device.type == "cuda" else min(budget, needed)


def _total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
def _parse_size(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; use bytes (e.g. 4194304, 4MiB, 512KB)")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_bytes(text: str) -> int:
    """A positive byte count from "4194304", "4MiB", "512KB"."""
    value = int(_parse_size(text))
    if value < 1:
        raise ValueError(f"{text!r}: must be at least 1 byte")
    return value


def free_memory(device: torch.device) -> int:
    """Bytes the device can still give: CUDA's free memory, the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
