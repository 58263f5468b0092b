"""The CPU kernel build cache: built before the server is ready, keyed by what the build depends
on, never wedged by a build that was killed, and a failed build falls back to torch.

Every test uses its own LADLE_KERNEL_CACHE_DIR, never the shared one."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_server import MODEL, RemoteServer, child_pids, is_alive

from ladle.models.demo import ensure_demo_model
from ladle.runner import cpu_kernels


def _finished_builds(root: Path) -> list[Path]:
    return [p for p in root.glob("ladle_cpu_kernels-*") if cpu_kernels._library(p) is not None]


def build_processes(root: Path) -> list[int]:
    """Live processes working inside the kernel cache `root` (ninja, the compilers, the guard
    that ties them to the engine): their working directory is a private build directory."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "cwd").startswith(str(root)) \
                    and is_alive(int(entry.name)):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_killed_build_then_fresh_start_is_ready_when_healthy(tmp_path, monkeypatch):
    """SIGKILL the whole server (API process and engine, as an OOM killer or `kill -9` would)
    in the middle of the kernel build: every build process (ninja, the compilers) is gone
    within 5 s, as the engine is (issue 24); the next server on the same cache builds, reports
    healthy only once the kernels are loaded, and serves the first request."""
    ensure_demo_model()  # the demo checkpoint is not what this test times
    root = tmp_path / "kernels"
    monkeypatch.setenv("LADLE_KERNEL_CACHE_DIR", str(root))
    monkeypatch.delenv("LADLE_DISABLE_CPU_KERNELS", raising=False)
    log = open(tmp_path / "killed.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ladle.entrypoints.cli", "serve", MODEL, "--port",
         "0", "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        # Wait until the compiler is running inside a private build directory.
        while not any(root.glob(".build-*/*.ninja")):
            assert proc.poll() is None, Path(log.name).read_text()
            assert time.monotonic() < deadline, "the kernel build never started"
            time.sleep(0.1)
        engines = child_pids(proc.pid)
        assert engines, "no engine process"
        builders = build_processes(root)
        assert builders, "no build process"
        for pid in [proc.pid, *engines]:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        while build_processes(root) or any(is_alive(p) for p in engines):
            assert time.monotonic() - killed < 5, f"still building: {build_processes(root)}"
            time.sleep(0.02)
        print(f"{len(builders)} build processes gone {time.monotonic() - killed:.2f} s after "
              "the SIGKILL of the server")
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is gone, or what is left
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in build_processes(root):  # a failed guard's orphans (own process groups)
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert _finished_builds(root) == []  # nothing half-built is where a loader would look

    server = RemoteServer("--dtype", "float32", timeout=600)
    try:
        healthy_log = server.log()
        # The build happened in the engine before the API reported ready.
        assert "building CPU kernels" in healthy_log and "built in" in healthy_log, healthy_log
        assert healthy_log.index("built in") < healthy_log.index("serving " + MODEL)
        assert len(_finished_builds(root)) == 1
        t = time.perf_counter()
        reply = server.client().completions.create(model=MODEL, prompt="hello", max_tokens=4)
        first_request_s = time.perf_counter() - t
        print(f"first request after /health: {first_request_s * 1000:.0f} ms")
        assert reply.choices[0].finish_reason in ("stop", "length")
        # Nothing was compiled after the server said it was ready.
        assert server.log().count("building CPU kernels") == 1
    finally:
        assert server.stop() == 0, server.log()


def test_cache_key_follows_cpu_and_flags(monkeypatch):
    """A build for another CPU or with other flags is a different cache entry (it was built with
    -march=native, so loading it elsewhere could raise SIGILL)."""
    key = cpu_kernels.build_key()
    monkeypatch.setattr(cpu_kernels, "_cpu_features", lambda: "flags: sse2")
    assert cpu_kernels.build_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "_CFLAGS", cpu_kernels._CFLAGS + ["-O0"])
    assert cpu_kernels.build_key() != key


def test_cache_key_follows_every_source_and_header(tmp_path, monkeypatch):
    """The module is built from every .cpp in csrc/ and they include its headers: a change to
    any of them, or a new source, is a new build."""
    csrc = tmp_path / "csrc"
    shutil.copytree(Path(cpu_kernels.__file__).parent / "csrc", csrc)
    monkeypatch.setattr(cpu_kernels, "_CSRC", csrc)
    assert [p.name for p in cpu_kernels._sources()] == sorted(p.name for p in csrc.glob("*.cpp"))
    keys = {cpu_kernels.build_key()}
    with open(csrc / "vec.h", "a") as f:
        f.write("// a header change\n")
    keys.add(cpu_kernels.build_key())
    (csrc / "extra.cpp").write_text("// a new source\n")
    keys.add(cpu_kernels.build_key())
    assert len(keys) == 3


def test_failed_build_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LADLE_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LADLE_DISABLE_CPU_KERNELS", raising=False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    key = cpu_kernels.build_key()
    with caplog.at_level("WARNING"):
        assert cpu_kernels.load_cpu_kernels() is None
    assert "using the slower torch path" in caplog.text
    assert list(tmp_path.glob(".build-*")) == []  # the private directory is cleaned up
    # The attempt left the flags as they were (torch's load extends the lists it is given):
    # a later build in this process is keyed and built as the first would have been.
    assert cpu_kernels.build_key() == key
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    assert torch.equal(cpu_kernels.linear(x, w), torch.nn.functional.linear(x, w))


def test_stale_private_builds_are_removed(tmp_path):
    old = tmp_path / ".build-abc-123"
    old.mkdir()
    os.utime(old, (time.time() - 2 * 3600,) * 2)
    fresh = tmp_path / ".build-def-456"  # may be another engine's build in progress
    fresh.mkdir()
    cpu_kernels._remove_stale_builds(tmp_path)
    assert not old.exists() and fresh.exists()


@pytest.fixture(autouse=True)
def _restore_loaded_kernels():
    saved = dict(cpu_kernels._loaded)
    yield
    cpu_kernels._loaded.clear()
    cpu_kernels._loaded.update(saved)


def test_a_versioned_build_is_found(tmp_path):
    """A process that builds the module a second time (another cache directory) gets torch's
    versioned name, ladle_cpu_kernels_v1.so with PyInit_ladle_cpu_kernels_v1: the loader looks
    for either name and imports it under the name its init symbol has."""
    assert cpu_kernels._library(tmp_path) is None
    (tmp_path / "ladle_cpu_kernels_v1.so").write_bytes(b"")
    (tmp_path / "other.so").write_bytes(b"")
    assert cpu_kernels._library(tmp_path) == tmp_path / "ladle_cpu_kernels_v1.so"
    module = cpu_kernels.load_cpu_kernels()
    if module is not None:  # the real module imports under its file's name
        assert module.__name__ == Path(module.__file__).name.removesuffix(".so")
