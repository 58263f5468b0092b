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
