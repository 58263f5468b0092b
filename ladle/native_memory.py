"""Native memory of an engine process bounded by its configuration, not by its traffic history.

What an engine process holds in steady state: the weights, the KV cache (both sized at start),
torch's and the sampler's per-step buffers (sized by --max-num-seqs and --max-num-batched-tokens,
reused), the compiled-grammar cache (--structured-outputs-cache-bytes), and two caches that key on
shapes, which this module bounds before the model loads:

- oneDNN's primitive cache (torch's CPU matmuls above the CPU kernels' row limit): one entry per
  GEMM shape, so per tokens-per-step count; LRU-capped at ONEDNN_PRIMITIVE_CACHE entries (one
  step's linears), unless the environment already sets ONEDNN_PRIMITIVE_CACHE_CAPACITY;
- glibc malloc: its mmap threshold rises to 32 MiB after large frees, after which activation and
  logits buffers of every step size are carved from the heap and fragment it; fixing it at
  MMAP_THRESHOLD returns every large buffer to the OS when freed. Arenas are capped at
  MALLOC_ARENAS (the engine allocates from few threads).

Only ladle's own processes call this (the engine core, tensor-parallel workers): the offline LLM
runs in the user's process, whose allocator is the user's."""

from __future__ import annotations

import ctypes
import os
import sys

ONEDNN_PRIMITIVE_CACHE = 32
MMAP_THRESHOLD = 1 << 20
MALLOC_ARENAS = 4
_M_MMAP_THRESHOLD = -3  # <malloc.h>
_M_ARENA_MAX = -8


def bound_native_memory() -> None:
    """Call first thing in an engine process, before torch runs anything."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE))
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt  # glibc; absent from musl
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(_M_ARENA_MAX, MALLOC_ARENAS)
