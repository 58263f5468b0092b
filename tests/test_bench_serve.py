"""benchmarks/serve.py's CPU accounting: the per-process CPU time it reads from /proc is the
process's own, and the engine processes are found as the server's children."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve.py"
    spec = importlib.util.spec_from_file_location("ladle_bench_serve", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_cpu_meter_charges_the_children_by_their_work():
    bench = _bench()
    # Two children: one burns 0.5 s of CPU once told to, the other sleeps.
    busy = subprocess.Popen([sys.executable, "-c",
                             "import sys, time\nsys.stdin.readline()\n"
                             "t = time.process_time()\n"
                             "while time.process_time() - t < 0.5: pass\n"
                             "time.sleep(60)"], stdin=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        meter = bench.CpuMeter(os.getpid())
        assert {busy.pid, idle.pid} <= set(meter.engine_pids)
        meter.engine_pids = [busy.pid, idle.pid]
        idle_meter = bench.CpuMeter(os.getpid())
        idle_meter.engine_pids = [idle.pid]
        time.sleep(0.5)  # both children have started up (their imports are not measured)
        meter.start()
        idle_meter.start()
        base = bench.cpu_seconds(busy.pid)
        busy.stdin.write("go\n")
        busy.stdin.flush()
        deadline = time.monotonic() + 120  # generous: the machine may be loaded
        while bench.cpu_seconds(busy.pid) - base < 0.48 and time.monotonic() < deadline:
            time.sleep(0.05)
        both, idle_only = meter.stop(num_tokens=1000), idle_meter.stop(num_tokens=1000)
        # 0.5 s of CPU over 1000 tokens is 500 us per token; the sleeper spends almost none.
        assert both["engine_cpu_us_per_token"] >= 450
        assert idle_only["engine_cpu_us_per_token"] < 100
        assert bench.cpu_seconds(2**22 + 12345) == 0.0  # a process that is gone reads as 0
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
