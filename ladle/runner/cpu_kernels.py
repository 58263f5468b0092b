"""CPU kernels for the decode path (the C++ sources in csrc/) and their pure-torch twins.

Decode on a CPU is bound by memory and by the number of ops per step: it must stream every
weight once per token, and in torch ops a layer is ~60 small dispatches. The C++ module reads the
paged KV cache in place, multiplies one or a few rows by a weight matrix at close to memory speed
(AVX512-BF16 `vdpbf16ps` where the CPU has it), and folds residual-add + RMSNorm and rotary into
one op each. Its sources are split by concern (csrc/attention.cpp, linear.cpp, elementwise.cpp,
sampler.cpp, moe.cpp, deltanet.cpp, quant.cpp for runner/quant.py, decode_stack.cpp for a
decoder's layers in one call (models/llama.py: decode_stack); the helpers they share in vec.h, the
module's bindings in bindings.cpp) and built as one module. Every kernel has a pure-torch twin below: the path on
other devices (CUDA keeps pure torch), without a compiler, after a failed build, or with
LADLE_DISABLE_CPU_KERNELS=1; the tests compare the two.

The module is built once per machine at engine start (ModelRunner), before the engine reports
ready. Its cache directory is keyed by the sources and headers in csrc/, the compiler flags, the
compiler, torch's version and the CPU's feature flags (the build uses -march=native, so a cache
shared with another CPU must not load it). A build runs in a private directory that is renamed
into place when complete, so an engine killed mid-build leaves nothing a later start would wait
on."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ladle.runner.quant import QuantWeight, quant_linear

logger = logging.getLogger(__name__)

_NAME = "ladle_cpu_kernels"
_CSRC = Path(__file__).parent / "csrc"  # every *.cpp there is built into the module
# Reassociation lets the dot products vectorise; no finite-math (softmax uses -inf).
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
           "-fno-trapping-math", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
# Above this many rows a matmul has enough work per weight for torch's GEMM (which packs the
# weights into its own blocked layout per call) to win. Measured on a Zen 4 (AVX512-BF16) at
# the Qwen3-0.6B shapes: the kernel is 1.0-1.9x torch's bf16 GEMM from 9 to 32 rows and about
# even at 64.
MAX_LINEAR_ROWS = 32
# Except in bfloat16 on an AVX2 build (no AVX512-BF16, no AMX): torch's bfloat16 GEMM has no
# fast path there (9 GFLOP/s on one core of this AVX2 EPYC, 3072 x 1024 weights), and the
# kernel's widen-and-FMA blocks ran 33-48 GFLOP/s from 16 to 512 rows (3.7-5.4x), so every row
# count takes the kernel. float32 keeps the limit (torch's GEMM wins from ~64 rows).
_ALL_ROWS_ISAS = ("avx2",)
# And in bfloat16 where the kernel runs on AMX-BF16 tiles (csrc/linear.cpp): up to this many rows,
# where torch's GEMM packs the weights per call. Measured on a Sapphire Rapids class Xeon (2
# cores), 0.6B TTFT: 64-token prompt 130 -> 97 ms, 128 167 -> 135, 256 237 -> 226, but 512 417 ->
# 449 (the kernel for every row count), so 256.
AMX_LINEAR_ROWS = 256


_row_limits: dict[torch.dtype, int] = {}


def max_linear_rows(dtype: torch.dtype) -> int:
    """The most rows of x for which `linear` (and the MoE kernel) run the kernel, not torch."""
    limit = _row_limits.get(dtype)
    if limit is None:
        module = load_cpu_kernels()
        bf16 = dtype == torch.bfloat16 and module is not None
        if bf16 and module.isa() in _ALL_ROWS_ISAS:
            limit = 1 << 62
        elif bf16 and module.linear_amx_available():
            limit = AMX_LINEAR_ROWS
        else:
            limit = MAX_LINEAR_ROWS
        _row_limits[dtype] = limit
    return limit


# Prefill chunks whose context is at most this many tokens attend through the paged decode
# kernel, each query a row of its own (as batch-invariant mode sends every chunk), rather than
# through torch's scaled_dot_product_attention: the kernel groups a chunk's consecutive queries
# on each KV head and reads the cache in place, where SDPA gathers a chunk with context into a
# copy and costs more than its work at these sizes. Measured on a Zen 4 (AVX-512 build, 2
# threads), Qwen3-0.6B heads (16 query, 8 KV, D 128), one fresh causal prompt, ms, SDPA /
# kernel: bfloat16 32 tokens 0.14 / 0.07, 128 1.16 / 0.74, 512 15.7 / 7.3, 1024 41.3 / 30.2,
# 1536 76 / 78, 2048 129 / 134; float32 128 1.13 / 0.58, 1024 40.3 / 37.3, 2048 129 / 135. The
# 0.6B Q8_0's 128-token TTFT: 265 -> 230 ms. Longer chunks keep SDPA. On AVX512-BF16 CPUs,
# outside batch-invariant mode, the kernel takes a bfloat16 chunk's rows in tiles
# (csrc/attention.cpp: tile_run). On the tile unit (AMX-BF16) they beat the row kernel 3-5x and
# SDPA up to ~1024 tokens and lose to SDPA past ~1500 (2048: 31 against 22 ms per layer); on the
# vector unit (vdpbf16ps, a Zen 4) they beat the row kernel 1.3-2.6x (measured on the Xeon with
# its tile unit off: benchmarks/attention_tiles.py), so the limit stays where the row kernel
# set it.
PREFILL_KERNEL_MAX_CTX = 1024
# Where the tiles run on AMX-BF16, SDPA's oneDNN kernels run on the tile unit too, and the
# row kernel loses to them past a few dozen tokens wherever the tiles do not take a chunk's rows:
# float32, Gemma 2's soft-cap, gpt-oss's sinks, a sliding window shorter than the context. The
# row limit of those chunks there. Measured on a 2-core Xeon (AMX), Qwen3-0.6B heads, one fresh
# causal prompt, ms, row kernel / SDPA (/ tiles): bfloat16 32 tokens 0.06 / 0.05 / 0.02, 64
# 0.17 / 0.11 / 0.06, 128 0.53 / 0.24 / 0.16, 512 8.75 / 2.43 / 1.85, 1024 34.3 / 6.84 / 7.10;
# float32 64 0.19 / 0.18, 128 0.64 / 0.56, 512 10.8 / 7.8, 1024 39.4 / 22.2. Gemma 3 270M
# (window 512) there, TTFT of 600 / 1000 tokens: 185 / 198 -> 121 / 129 ms (SDPA past 512).
PREFILL_ROWS_MAX_CTX_TILES = 64
# The builds whose decode kernel is vectorised (elsewhere its loops are scalar: SDPA prefills).
_VECTOR_ATTENTION_ISAS = ("avx512", "avx512-bf16")


def tile_attention_fit(model: torch.nn.Module) -> tuple[bool, int]:
    """(whether every attention layer of `model` is one the tile path takes: no soft-cap, no
    sink logits, a head dim that is a multiple of 32 up to 256; the smallest sliding window, 0
    for none): what prefill_kernel_max_ctx asks of a model. A tensor-parallel model
    (distributed/executor.py) is asked through this process's part, whose layers the ranks
    share."""
    if not isinstance(model, torch.nn.Module):
        model = model.model
    fit, window = True, 0
    for m in model.modules():
        if not (hasattr(m, "num_kv_heads") and hasattr(m, "head_dim") and hasattr(m, "scale")):
            continue  # not an attention layer
        fit = fit and getattr(m, "softcap", None) is None and getattr(m, "sinks", None) is None \
            and m.head_dim % 32 == 0 and m.head_dim <= 256
        w = getattr(m, "window", None) or 0
        window = w if w and (not window or w < window) else window
    return fit, window


def prefill_kernel_max_ctx(dtype: torch.dtype, device: torch.device, tiles_fit: bool = True,
                           window: int = 0) -> int:
    """Prefill chunks whose context (cached tokens plus the chunk) is at most this attend as
    rows of the paged decode kernel; 0 where that kernel does not run or is not vectorised.
    Where the tiles run on AMX, a bfloat16 model whose layers they take (`tiles_fit`) keeps
    PREFILL_KERNEL_MAX_CTX up to its smallest sliding `window` (past it the window cuts the
    rows out of the tiles), any other PREFILL_ROWS_MAX_CTX_TILES."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return 0
    module = load_cpu_kernels()
    if module is None or module.isa() not in _VECTOR_ATTENTION_ISAS:
        return 0
    if getattr(module, "attention_tiles_unit", lambda: "")() == "amx":
        if dtype != torch.bfloat16 or not tiles_fit:
            return PREFILL_ROWS_MAX_CTX_TILES
        return min(PREFILL_KERNEL_MAX_CTX, window) if window else PREFILL_KERNEL_MAX_CTX
    return PREFILL_KERNEL_MAX_CTX


# A private build directory older than this belongs to a build that died.
_STALE_BUILD_S = 3600

_loaded: dict[str, object] = {}  # "module" -> the extension once load_cpu_kernels() has run

# Batch-invariant mode (EngineConfig.batch_invariant, set once per process by the runner): every
# dense linear runs the kernel, for any number of rows, in the reduction order that makes a row's
# result independent of the rows beside it. The quantized linears need no mode: their tiles and
# panels sum every row in one order (csrc/quant.cpp).
_mode = {"batch_invariant": False}


def set_batch_invariant(on: bool) -> None:
    _mode["batch_invariant"] = bool(on)


def batch_invariant() -> bool:
    return _mode["batch_invariant"]


def cache_root() -> Path:
    """LADLE_KERNEL_CACHE_DIR, else LADLE_CACHE_DIR/kernels, else ~/.cache/ladle/kernels."""
    if os.environ.get("LADLE_KERNEL_CACHE_DIR"):
        return Path(os.environ["LADLE_KERNEL_CACHE_DIR"])
    base = os.environ.get("LADLE_CACHE_DIR") or Path.home() / ".cache" / "ladle"
    return Path(base) / "kernels"


def _cpu_features() -> str:
    """The CPU's model and feature flags: what -march=native compiles for."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.machine() + " " + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")  # x86 and arm spellings
    lines = {ln.split(":")[0].strip(): ln for ln in info.splitlines() if ":" in ln}
    return "\n".join(lines.get(k, "") for k in wanted)


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return cxx + " " + out.stdout.splitlines()[0] if out.stdout else cxx
    except (OSError, subprocess.SubprocessError):
        return cxx


def _sources() -> list[Path]:
    """The module's C++ sources, in a fixed order (ninja compiles them in parallel)."""
    return sorted(_CSRC.glob("*.cpp"))


def build_key() -> str:
    """What a built module depends on, hashed: a change in any part means a new build."""
    h = hashlib.sha256()
    for path in sorted(p for p in _CSRC.iterdir() if p.suffix in (".cpp", ".h")):
        for part in (path.name.encode(), path.read_bytes()):  # a rename is a change too
            h.update(part)
            h.update(b"\0")
    for part in (" ".join(_CFLAGS + _LDFLAGS).encode(), _compiler().encode(),
                 torch.__version__.encode(), _cpu_features().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def load_cpu_kernels():
    """The compiled module, or None when it cannot be had here (then the torch twins run).
    Builds it on first call when the cache has no build for this machine; later calls return
    the same module."""
    if "module" in _loaded:
        return _loaded["module"]
    module = None
    if os.environ.get("LADLE_DISABLE_CPU_KERNELS") == "1":
        logger.info("CPU kernels disabled (LADLE_DISABLE_CPU_KERNELS=1); using the torch path")
    else:
        try:
            module = _load_or_build(cache_root())
        except Exception as e:  # no compiler, no headers, read-only cache: all mean "use torch"
            logger.warning("CPU kernels unavailable (%s: %s); using the slower torch path",
                           type(e).__name__, e)
        else:
            _set_tables(module)
    _loaded["module"] = module
    return module


def _set_tables(module) -> None:
    """The data a kernel type needs that the sources do not hold: IQ2_XXS's, IQ3_XXS's,
    IQ3_S's, IQ2_XS's and IQ2_S's grids, from gguf-py (the format's definition), before any
    weight of those types can run."""
    from gguf import GGMLQuantizationType as T

    from ladle.models.gguf.quants import iq_grid  # (a cycle at import time)

    module.set_iq_grids(*(iq_grid(t) for t in (T.IQ2_XXS, T.IQ3_XXS, T.IQ3_S, T.IQ2_XS, T.IQ2_S)))


def _load_or_build(root: Path):
    key = build_key()
    final = root / f"{_NAME}-{key}"
    so = _library(final)
    if so is not None:
        module = _import(so)
        logger.info("CPU kernels (%s) loaded from %s", module.isa(), final)
        return module
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(root)
    from torch.utils.cpp_extension import load

    private = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=root))
    logger.info("building CPU kernels (paged decode attention, small-M linear, RMSNorm, rotary) "
                "with %s for this CPU into %s; once per machine, about a minute",
                " ".join(_CFLAGS), final)
    t = time.perf_counter()
    try:
        with _ninja_dies_with_us():
            # Copies: torch's load appends its own link flags to the lists it is given, which
            # would change build_key() (and every later build's flags) in this process.
            load(name=_NAME, sources=[str(s) for s in _sources()], extra_cflags=list(_CFLAGS),
                 extra_ldflags=list(_LDFLAGS), build_directory=str(private), verbose=False)
        try:
            private.rename(final)  # atomic: a reader sees no directory or a complete one
        except OSError:  # another engine finished first; use its build
            pass
    finally:
        shutil.rmtree(private, ignore_errors=True)
    so = _library(final)
    if so is None:
        raise ImportError(f"{final}: the build left no {_NAME}*.so")
    module = _import(so)
    logger.info("CPU kernels (%s) built in %.0f s", module.isa(), time.perf_counter() - t)
    return module


@contextlib.contextmanager
def _ninja_dies_with_us():
    """While the build runs, `ninja` on PATH (torch's cpp_extension runs it by name) is a shim
    that runs the real one under ladle/lifetime.py's guard: when this process dies, even by
    SIGKILL, ninja gets SIGTERM and stops its compilers, which otherwise run on for a minute
    as orphans. Linux only (elsewhere ninja runs as it is)."""
    ninja = shutil.which("ninja")
    if ninja is None or not sys.platform.startswith("linux"):
        yield
        return
    from ladle.lifetime import guarded_command_argv

    with tempfile.TemporaryDirectory(prefix="ladle-ninja-") as shim_dir:
        shim = Path(shim_dir) / "ninja"
        shim.write_text("#!/bin/sh\nexec " + shlex.join(guarded_command_argv([ninja]))
                        + ' "$@"\n')
        shim.chmod(0o755)
        path = os.environ.get("PATH", "")
        os.environ["PATH"] = shim_dir + os.pathsep + path
        try:
            yield
        finally:
            os.environ["PATH"] = path


def _library(build: Path) -> Path | None:
    """The module a build directory holds: ladle_cpu_kernels.so, or ladle_cpu_kernels_vN.so
    when the process that built it had built the module before (torch's cpp_extension then
    versions the name, and with it the module's init symbol)."""
    found = sorted(build.glob(f"{_NAME}*.so")) if build.is_dir() else []
    return found[0] if found else None


def _import(so: Path):
    name = so.name.removesuffix(".so")  # the init symbol's name: PyInit_<name>
    loader = importlib.machinery.ExtensionFileLoader(name, str(so))
    spec = importlib.util.spec_from_file_location(name, str(so), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _remove_stale_builds(root: Path) -> None:
    """Private directories of builds that were killed; harmless, but they take disk."""
    now = time.time()
    for d in root.glob(".build-*"):
        try:
            if now - d.stat().st_mtime > _STALE_BUILD_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def kernels_for(*tensors: torch.Tensor):
    """The kernel module when every tensor is a CPU tensor of one supported dtype, else None."""
    x = tensors[0]
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
        return None
    if any(t.dtype != x.dtype for t in tensors[1:]):
        return None
    return load_cpu_kernels()


_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def tensors_to_huge_pages(tensors: list[torch.Tensor], zero: bool = False) -> int:
    """Move these CPU tensors' storages (each once) into one mapping backed by 2 MiB pages
    (csrc/memory.cpp), in place: every tensor and view keeps its object, shape and offset;
    `zero`: the new memory is zeroed rather than copied (for tensors made with torch.empty).
    Returns the bytes moved: 0 without the kernels, off Linux, or where transparent huge pages
    are off ("never"), since the move would then buy nothing."""
    try:
        if "[never]" in _THP_ENABLED.read_text():
            return 0
    except OSError:
        return 0
    tensors = [t for t in tensors if t.device.type == "cpu"]
    kernels = load_cpu_kernels() if tensors else None
    if kernels is None:
        return 0
    return kernels.to_huge_pages(tensors, zero)


def weights_to_huge_pages(model: torch.nn.Module) -> int:
    """The model's CPU weights (parameters, buffers, QuantWeight parts, stacked experts: every
    tensor its modules hold) into 2 MiB pages (tensors_to_huge_pages). A decode step streams
    all of them once; on 4 KiB pages the same kernels read 10-25% slower (a Zen 4: the bf16
    one-row linear 28-32 -> 33-36 GB/s)."""
    return tensors_to_huge_pages(_held_tensors(model))


def _held_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor the model's modules hold: parameters, buffers and plain attributes, and
    those inside QuantWeights and lists, tuples and dicts of them (stacked experts' blocks)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(v, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif id(v) in seen or depth > 3:
            return
        elif isinstance(v, QuantWeight):
            seen.add(id(v))
            for part in v.parts:
                visit(part.data, depth + 1)
                visit(part.scale, depth + 1)
        elif isinstance(v, dict):
            seen.add(id(v))
            for item in v.values():
                visit(item, depth + 1)
        elif isinstance(v, (list, tuple)):
            seen.add(id(v))
            for item in v:
                visit(item, depth + 1)

    for m in model.modules():
        for v in vars(m).values():
            if not isinstance(v, torch.nn.Module):
                visit(v, 0)
    return out


def supports(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32)


# --- The kernels as the model calls them; each falls back to its twin. -------------------------

def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x (..., K) @ weight (N, K)^T + bias; the kernel for a few rows (decode), torch otherwise
    (see max_linear_rows); the kernel for every row count in batch-invariant mode. A
    QuantWeight (runner/quant.py) runs its quantized kernels for any number of rows."""
    if isinstance(weight, QuantWeight):
        return quant_linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    invariant = _mode["batch_invariant"]
    if 0 < rows and weight.is_contiguous():
        k = kernels_for(x, weight) if bias is None else kernels_for(x, weight, bias)
        if k is not None and (invariant or rows <= max_linear_rows(x.dtype)):
            x2 = x.reshape(rows, x.shape[-1])
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            return k.linear(x2, weight, bias, invariant).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def moe_swiglu(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
    """A mixture-of-experts block's SwiGLU experts in one call (csrc/moe.cpp): x (T, H), ids
    and float32 weights (T, k), the stacked gate_up (E, 2I, H) and down (E, H, I). The weighted
    sum (T, H), or None where the kernels cannot run (then RoutedExperts' loop, its twin, does).
    Experts with more than max_linear_rows rows use torch's GEMM, as `linear` does."""
    k = kernels_for(x, gate_up, down)
    if k is None:
        return None
    return k.moe_swiglu(x.contiguous(), ids.contiguous(), weights.float().contiguous(), gate_up,
                        down, max_linear_rows(x.dtype), _mode["batch_invariant"])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x: (R, D), or (T, H, D) heads read in place."""
    k = kernels_for(x, weight)
    if k is not None and _rows_in_place(x):
        return k.rms_norm(x, None, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm(residual + x), residual + x); the kernel writes the sum into `residual`."""
    k = kernels_for(x, residual, weight)
    if k is not None and _rows_in_place(x) and residual.is_contiguous():
        return k.rms_norm(x, residual, weight, eps), residual
    residual = residual + x
    return rms_norm_torch(residual, weight, eps), residual


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin: normalise in float32 like the HF reference, cast back, then weight multiply."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None, scale: torch.Tensor | None = None):
    """Gemma's RMSNorm, scaled by (1 + weight) in float32 and cast once; with a residual,
    (norm(residual + x), residual + x) with the sum rounded to x's dtype first, as HF adds. The
    kernel takes the scale (1 + weight in float32; `scale` when the caller keeps it) as a
    float32 weight, which it multiplies in float32 and rounds once."""
    if scale is None:
        scale = weight.float() + 1
    k = kernels_for(x) if residual is None else kernels_for(x, residual)
    if k is not None and _rows_in_place(x) and (residual is None or residual.is_contiguous()):
        return k.rms_norm(x, residual, scale, eps) if residual is None else \
            (k.rms_norm(x, residual, scale, eps), residual)
    if residual is None:
        return gemma_rms_norm_torch(x, weight, eps)
    residual = residual + x
    return gemma_rms_norm_torch(residual, weight, eps), residual


def gemma_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin, as HF's Gemma2/Gemma3 RMSNorm: normalise and scale in float32, cast once."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def _rows_in_place(x: torch.Tensor) -> bool:
    if x.stride(-1) != 1:
        return False
    return x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[-1])


def rotary(positions, q, k, cos, sin):
    """Neox rotary on q (T, H, D) and k (T, KVH, D); the kernel rotates both in place."""
    kern = kernels_for(q, k)
    if (kern is not None and cos.dtype == torch.float32 and q.stride(1) == q.shape[2]
            and k.stride(1) == k.shape[2] and q.stride(2) == 1 and k.stride(2) == 1):
        kern.rotary(q, k, positions, cos, sin)
        return q, k
    return rotary_torch(positions, q, k, cos, sin)


def rotary_torch(positions, q, k, cos, sin):
    c = cos[positions].unsqueeze(1)  # (T, 1, D/2)
    s = sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qk_norm_rotary(positions, q, k, wq, wk, eps: float, cos, sin):
    """Qwen3's per-head RMSNorm of q and k, then rotary: one op on the kernel path. q: (T, H, D)
    and k: (T, KVH, D) may be views into the qkv output; returns new (q, k)."""
    kern = kernels_for(q, k, wq, wk)
    if (kern is not None and cos.dtype == torch.float32 and _heads_adjacent(q)
            and _heads_adjacent(k)):
        return tuple(kern.qk_norm_rotary(q, k, wq, wk, eps, positions, cos, sin))
    return rotary_torch(positions, rms_norm_torch(q, wq, eps), rms_norm_torch(k, wk, eps),
                        cos, sin)


def write_kv_cache(k, v, k_cache, v_cache, slot_blocks, slot_offsets) -> None:
    """k, v: (T, KVH, D) into caches (num_blocks, KVH, bs, D) at (slot_blocks[t], :,
    slot_offsets[t])."""
    kern = kernels_for(k, v, k_cache, v_cache)
    if (kern is not None and _heads_adjacent(k) and _heads_adjacent(v)
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        kern.write_kv_cache(k, v, k_cache, v_cache, slot_blocks, slot_offsets)
        return
    k_cache[slot_blocks, :, slot_offsets] = k
    v_cache[slot_blocks, :, slot_offsets] = v


def copy_rows(dst: torch.Tensor, rows: torch.Tensor | int, src: torch.Tensor) -> None:
    """dst[rows] = src (rows a (D,) int64 tensor, or one index): a memcpy per row where the
    kernels run (torch's indexed assignment, the twin, goes element by element)."""
    kern = None if isinstance(rows, int) else kernels_for(dst, src)
    if kern is not None and dst.is_contiguous() and src.is_contiguous() \
            and rows.dtype == torch.int64:
        kern.copy_rows(dst, rows, src)
    else:
        dst[rows] = src


def gated_delta_step(q, k, v, g, beta, state, rows, keep):
    """Gated DeltaNet's recurrent step for D sequences (models/gated_deltanet.py): q, k
    (D, H, dk), v (D, H, dv), g and beta (D, H), float32; sequence i starts from
    state[rows[i]] (N, H, dk, dv), or from zeros where keep[i] is False. Returns (output
    (D, H, dv), the new states (D, H, dk, dv)); `state` is not written. The kernel reads each
    state once and writes the new one once; gated_delta_step_torch is its twin."""
    kern = kernels_for(q, k, v, g, beta, state)
    if kern is not None and q.dtype == torch.float32 and state.is_contiguous():
        out, new = kern.gated_delta_step(q.contiguous(), k.contiguous(), v.contiguous(),
                                         g.contiguous(), beta.contiguous(), state, rows, keep)
        return out, new
    return gated_delta_step_torch(q, k, v, g, beta, state, rows, keep)


def gated_delta_step_torch(q, k, v, g, beta, state, rows, keep):
    """The rule as transformers writes it: decay the state, read it at k, write the error."""
    s = torch.where(keep[:, None, None, None], state[rows], 0)
    s = s * g.exp()[..., None, None]
    predicted = (k.unsqueeze(-2) @ s).squeeze(-2)  # (D, H, dv): what the state recalls for k
    delta = beta.unsqueeze(-1) * (v - predicted)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q.unsqueeze(-2) @ s).squeeze(-2), s


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(R, 2I) = [gate | up] -> silu(gate) * up, (R, I)."""
    kern = kernels_for(gate_up)
    if kern is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return kern.silu_mul(gate_up)
    return silu_mul_torch(gate_up)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_mul(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """(R, 2I) = [gate | up] -> gelu(gate) * up, (R, I); Gemma's GeGLU ("tanh" is HF's
    gelu_pytorch_tanh, "none" the exact erf). The kernel computes each row alike wherever it
    sits in the batch; gelu_mul_torch is its twin."""
    kern = kernels_for(gate_up)
    if kern is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return kern.gelu_mul(gate_up, approximate == "tanh")
    return gelu_mul_torch(gate_up, approximate)


def gelu_mul_torch(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def _heads_adjacent(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


# Above this k a heap per row stops paying off against torch.topk's selection.
MAX_TOPK_KERNEL = 256


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest per row of x (R, V), sorted descending, like
    torch.topk (its twin); ties may come in another order."""
    kern = kernels_for(x)
    if (kern is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
            and 1 <= k <= min(MAX_TOPK_KERNEL, x.shape[1])):
        return tuple(kern.topk_rows(x, k))
    return x.topk(k, dim=-1)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Per-row logsumexp of x (R, V): one kernel pass per row; its twin is torch.logsumexp
    (7.6 ms at 32 x 152k on a 2-core Zen 4, the kernel ~1 ms)."""
    kern = kernels_for(x)
    if kern is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
        return kern.logsumexp_rows(x)
    return torch.logsumexp(x, dim=-1)


def top_p_mask(x: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor) -> bool:
    """In place on x (R, V): -inf on every token outside its row's nucleus (the smallest set of
    the largest tokens whose probability exp(x - lse) reaches top_p), by a radix select instead
    of a sort. Returns False, leaving x alone, where the kernel does not apply; the caller's
    sorted path (ops.mask_top_k_top_p) is the twin."""
    kern = kernels_for(x)
    if kern is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        return False
    kern.top_p_mask(x, lse.float().contiguous(), top_p.float().contiguous())
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value in each row of x (R, V): the first on ties, a NaN counting as
    the largest, like its twin torch.argmax(dim=-1). One kernel pass per row on one thread."""
    kern = kernels_for(x)
    if kern is not None and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0:
        return kern.argmax_rows(x)
    return x.argmax(dim=-1)
