"""The engine process's malloc settings (ladle/native_memory.py), in a fresh process as the
engine core sets them: activation-sized buffers freed by a step stay in the heap for the next
one (no page faults per step), and trim_heap gives their pages back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, time
import torch
from ladle.native_memory import bound_native_memory, trim_heap
bound_native_memory()

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

base = rss_mib()
bufs = [torch.ones(1 << 20) for _ in range(64)]  # 4 MiB each, 256 MiB: below the mmap threshold
pin = torch.ones(1 << 18)  # 1 MiB live above them: the heap's top cannot just shrink
del bufs
kept = rss_mib()
trim_heap(time.monotonic() + 1e9)
print(json.dumps({"base": base, "kept": kept, "trimmed": rss_mib()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
def test_freed_step_buffers_stay_until_trim_heap_returns_them():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["kept"] - m["base"] > 200, m  # freed, still resident: the next step reuses them
    assert m["trimmed"] - m["base"] < 32, m  # given back to the system


WEIGHTS_CHILD = r"""
import json
import torch
from ladle.runner import quant as Q
from ladle.runner.cpu_kernels import load_cpu_kernels, weights_to_huge_pages

def smaps(key):
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

g = torch.Generator().manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(4096, 1024, generator=g).bfloat16(),
                                        requires_grad=False)
        self.norm = torch.nn.Parameter(torch.ones(1024), requires_grad=False)
        self.register_buffer("table", torch.randn(3000, 700, generator=g))
        # Q8_0 rows: f16 scale 0.01 then 32 int8 values, per block of 32
        blocks = torch.randint(-127, 128, (2048, 32, 34), generator=g, dtype=torch.int8)
        blocks = blocks.view(torch.uint8).clone()
        blocks[:, :, :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        self.q = Q.QuantWeight([Q.QuantPart(Q.Q8_0, blocks.view(2048, -1))], 1024,
                               torch.float32)
        self.stack = [torch.randn(512, 1024, generator=g), torch.arange(10)]
class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = Net()
        self.head = torch.nn.Linear(1024, 4096, bias=False)
        self.head.weight = self.net.embed  # tied
        self.half = self.net.table[:, ::2]  # a strided view of a buffer

m = Outer()
load_cpu_kernels()
x = torch.randn(3, 1024, generator=g)
tensors = {"embed": m.net.embed, "norm": m.net.norm, "table": m.net.table, "half": m.half,
           "q": m.net.q.parts[0].data, "s0": m.net.stack[0], "s1": m.net.stack[1]}
before = {k: t.clone() for k, t in tensors.items()}
ptrs = {k: t.data_ptr() for k, t in tensors.items()}
y = Q.quant_linear(x, m.net.q)
huge, rss = smaps("AnonHugePages"), smaps("Rss")
moved = weights_to_huge_pages(m)
print(json.dumps({
    "moved": moved,
    "expected": sum((t.untyped_storage().nbytes() + 63) // 64 * 64 for t in
                    (m.net.embed, m.net.norm, m.net.table, m.net.q.parts[0].data,
                     m.net.stack[0], m.net.stack[1])),
    "equal": {k: bool(torch.equal(t, before[k])) for k, t in tensors.items()},
    "moved_ptrs": {k: t.data_ptr() != ptrs[k] for k, t in tensors.items()},
    "tied": m.head.weight.data_ptr() == m.net.embed.data_ptr(),
    "view": m.half.untyped_storage().data_ptr() == m.net.table.untyped_storage().data_ptr()
            and m.half.stride() == (700, 2),
    "same_output": bool(torch.equal(Q.quant_linear(x, m.net.q), y)),
    "huge_mib": smaps("AnonHugePages") - huge, "rss_mib": smaps("Rss") - rss,
    "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read(),
}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages (Linux)")
def test_weights_move_into_huge_pages_in_place():
    """weights_to_huge_pages (loader.py calls it on every CPU model): every tensor the modules
    hold - parameters, buffers, plain attributes, QuantWeight parts, lists - moves once per
    storage with its values; tied weights stay one storage and views keep their strides; the
    kernels then read the new memory (same output); the pages are 2 MiB ones where the kernel
    allows them, and the old memory is given back (resident memory does not double)."""
    out = subprocess.run([sys.executable, "-c", WEIGHTS_CHILD], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    if "[never]" in m["thp"]:
        assert m["moved"] == 0, m  # nothing to gain: left where they are
        return
    assert m["moved"] == m["expected"], m
    assert all(m["equal"].values()) and all(m["moved_ptrs"].values()), m
    assert m["tied"] and m["view"] and m["same_output"], m
    total = m["moved"] / 2**20  # ~28 MiB
    assert m["huge_mib"] >= total - 4, m  # all but the partial 2 MiB pages at the ends
    assert m["rss_mib"] < 8, m  # the old storages freed and trimmed, not kept beside the copy


KV_CHILD = r"""
import json, types
import torch
from ladle.runner.cpu_kernels import load_cpu_kernels
from ladle.runner.model_runner import allocate_kv_caches

def smaps(key):
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

k = load_cpu_kernels()
cfg = types.SimpleNamespace(head_dim=64, num_layers=3, layer_types=None)
huge, rss = smaps("AnonHugePages"), smaps("Rss")
caches = allocate_kv_caches(cfg, 4, 1024, 16, torch.bfloat16, torch.device("cpu"))  # 48 MiB
after_huge, after_rss = smaps("AnonHugePages"), smaps("Rss")
tensors = [t for pair in caches for t in pair]
zeros = all(bool((t == 0).all()) for t in tensors)
ptrs = sorted(t.data_ptr() for t in tensors)
# a token's keys and values written to slot (block 7, offset 3) of layer 1 and read back
kv = torch.randn(2, 1, 4, 64).bfloat16()
k.write_kv_cache(kv[0], kv[1], caches[1][0], caches[1][1], torch.tensor([7]), torch.tensor([3]))
print(json.dumps({
    "zeros": zeros, "shape": list(caches[0][0].shape),
    "distinct": len(set(ptrs)) == len(ptrs) and all(b - a >= 8 * 2**20 for a, b in zip(ptrs, ptrs[1:])),
    "written": bool(torch.equal(caches[1][0][7, :, 3], kv[0, 0]))
               and bool(torch.equal(caches[1][1][7, :, 3], kv[1, 0])),
    "others_zero": bool((caches[0][0] == 0).all()) and bool((caches[2][1] == 0).all()),
    "huge_mib": after_huge - huge, "rss_mib": after_rss - rss,
    "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read(),
}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages (Linux)")
def test_kv_cache_lives_on_huge_pages():
    """allocate_kv_caches on the CPU: zeroed caches of the asked shape, one storage per layer's
    keys and values, on 2 MiB pages where the kernel allows them (attention reads each sequence's
    blocks from anywhere in the cache), written once: resident memory grows by the caches' size,
    not twice it; a slot written through the kernels reads back."""
    out = subprocess.run([sys.executable, "-c", KV_CHILD], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["zeros"] and m["distinct"] and m["written"] and m["others_zero"], m
    assert m["shape"] == [1024, 4, 16, 64], m
    assert 44 <= m["rss_mib"] < 60, m  # 48 MiB of caches, resident once
    if "[never]" not in m["thp"]:
        assert m["huge_mib"] >= 44, m


FREEZE_CHILD = r"""
import gc, json
import torch, transformers  # the libraries an engine or API process has loaded at start
from ladle.native_memory import freeze_startup_heap
before = len(gc.get_objects())
frozen = freeze_startup_heap()
garbage = [[] for _ in range(10)]
for a, b in zip(garbage, garbage[1:]):  # cycles made after the start are still collected
    a.append(b); b.append(a)
del garbage, a, b
print(json.dumps({"before": before, "frozen": frozen, "walked": len(gc.get_objects()),
                  "collected": gc.collect()}))
"""


def test_the_startup_heap_is_frozen_and_later_cycles_are_still_collected():
    """freeze_startup_heap (the engine core, workers and the API server call it once started):
    what the imports left is out of every later collection's walk; new garbage is not."""
    out = subprocess.run([sys.executable, "-c", FREEZE_CHILD], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["before"] > 50_000 and m["frozen"] >= 0.9 * m["before"], m
    assert m["walked"] < 1000, m  # a full collection walks what came after the freeze only
    assert m["collected"] >= 10, m


TRIM_CHILD = r"""
import json
from ladle.native_memory import freeze_startup_heap

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

# What a start leaves: 200 MB of 1 KB chunks (malloc's, not Python's small-object arenas) of
# which one in 64 stays alive, so the freed rest are holes between live chunks, which glibc
# keeps resident (it trims only a free top of the heap by itself).
chunks = [bytes(1024) for _ in range(200_000)]
kept = chunks[::64]
del chunks
before = rss_mib()
freeze_startup_heap()
print(json.dumps({"before": before, "after": rss_mib(), "kept": len(kept)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_startup_heap_gives_its_free_pages_back():
    """freeze_startup_heap also hands back the free pages a start leaves between live chunks
    (a GGUF tokenizer build's ~100 MB in the API process): resident memory falls by most of
    the 200 MB freed."""
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["before"] - m["after"] > 120, m
