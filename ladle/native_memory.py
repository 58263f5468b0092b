"""Native memory of an engine process bounded by its configuration, not by its traffic history.

What an engine process holds in steady state: the weights, the KV cache (both sized at start),
torch's and the sampler's per-step buffers (sized by --max-num-seqs and --max-num-batched-tokens,
reused), the compiled-grammar cache (--structured-outputs-cache-bytes), and two caches that key on
shapes, which this module bounds before the model loads:

- oneDNN's primitive cache (torch's CPU matmuls above the CPU kernels' row limit): one entry per
  GEMM shape, so per tokens-per-step count; LRU-capped at ONEDNN_PRIMITIVE_CACHE entries (one
  step's linears), unless the environment already sets ONEDNN_PRIMITIVE_CACHE_CAPACITY;
- glibc malloc: left alone, its mmap threshold moves with the sizes freed (up to 32 MiB) and
  its trim threshold with it, so what the heap keeps depends on the traffic's history. Both are
  fixed here at 32 MiB (MMAP_THRESHOLD, TRIM_THRESHOLD): a step's activation buffers below that
  come from the heap and its freed pages serve the next steps, and every TRIM_EVERY_S (2 s) the
  engine loop gives the heap's free pages back (trim_heap: malloc_trim, which also releases
  the holes between live chunks that steps of different sizes leave). Measured: with a 1 MiB
  mmap threshold (the previous bound) every activation buffer of a prefill step was a fresh
  mapping, faulted in and zeroed: 217k minor faults and 2109 ms for eight 128-token prompts of
  the 0.6B Q8_0 in one step (in process), against ~1000 and 1737 ms with these thresholds; in
  `ladle serve` under eight streaming clients (two rounds of 128 + 64 tokens) the engine took
  140k-420k faults, with the 2 s trims 40k-145k; `benchmarks/memory_soak.py
  --requests 1500`: the engine's resident memory after 500 requests 2233 -> 2275 MiB at the end
  with 1 MiB, 2137 -> 2087 (peak +18) with this. Arenas are capped at MALLOC_ARENAS (the engine
  allocates from few threads).

Only ladle's own processes call this (the engine core, tensor-parallel workers): the offline LLM
runs in the user's process, whose allocator is the user's.

The Python heap of a ladle process (the engine core, a worker, the API server) is frozen once it
has started (freeze_startup_heap): torch, transformers and the model's modules leave ~360k
objects that live as long as the process, and each full collection of the cyclic GC walked them
all (~175 ms on a 2-core Zen 4 for the engine of the 0.6B), a stall of every stream whenever a
burst of requests tipped the oldest generation over its threshold."""

from __future__ import annotations

import ctypes
import gc
import os
import sys

ONEDNN_PRIMITIVE_CACHE = 32
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 32 << 20
MALLOC_ARENAS = 4
TRIM_EVERY_S = 2.0
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
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
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    mallopt(_M_ARENA_MAX, MALLOC_ARENAS)
    _trim["fn"] = getattr(libc, "malloc_trim", None)


_trim: dict = {"fn": None, "at": 0.0}


def trim_heap(now: float) -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim, which also releases
    free pages between live chunks), at most once per TRIM_EVERY_S: what a step frees below
    MMAP_THRESHOLD stays in the heap for the next steps, and holes that step sizes leave behind
    do not accumulate. The engine loop calls it between steps; a no-op off glibc."""
    fn = _trim["fn"]
    if fn is not None and now - _trim["at"] >= TRIM_EVERY_S:
        fn(0)
        _trim["at"] = now


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now into the GC's permanent generation, which
    collections do not walk (what CPython's gc.freeze is for: objects that live as long as the
    process), and give the heap's free pages back (glibc's malloc_trim): what the start freed
    between live chunks stays resident otherwise. Building a tokenizer from a GGUF file's
    151k-token vocabulary frees ~100 MB that way (the API process of a 0.6B Q4_K_M server 631 ->
    529 MiB; the engine's loop trims on its own). Call once, when the process has started and
    before it serves. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    trim = _trim["fn"] or _malloc_trim()
    if trim is not None:
        trim(0)
    return gc.get_freeze_count()


def _malloc_trim():
    """glibc's malloc_trim, or None (another libc, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None
