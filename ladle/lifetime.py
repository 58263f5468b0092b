"""Processes that never outlive the process that started them: the engine-core process (the API
process's child), tensor-parallel workers (the engine's) and a CPU kernel build's compilers.
A SIGKILL of the parent (an OOM killer, `kill -9`, a supervisor) runs no cleanup in it, so each
child notices by itself, busy or not, by two means:

- the parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`): the kernel kills the child when the
  parent exits, wherever the child is (a blocked send, a collective, a compiler). The kernel
  ties it to the parent *thread* that forked the child, so a launcher asks for it only when it
  forks from a thread that lives as long as its process (`forks_from_main_thread`);
- a watchdog thread that checks every WATCH_INTERVAL_S that the parent is still its parent:
  the fallback elsewhere, for launches from other threads, and for a parent that died before
  the prctl.

`python -I ladle/lifetime.py PARENT_PID COMMAND ARGS...` runs a command (ninja, for the kernel
build) with the same guarantee: see `run_guarded`.

`end_process` ends the server's two processes once they stopped cleanly, without the
interpreter's teardown."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time

WATCH_INTERVAL_S = 0.2
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_process(run) -> None:
    """Runs run(); once it returned or called sys.exit (the SIGTERM handlers do), ends the
    process at once with that code, skipping the interpreter's teardown: the process's own
    cleanup has run in its finally blocks and lifespan hooks by then, and the teardown's only
    visible effect was third-party bindings' leak reports (triton's nanobind module, which
    torch._dynamo imports when transformers' model code is loaded for a GGUF file's tensor
    names: ~70 lines of "nanobind: leaked" on every stop). An exception other than SystemExit
    ends the process as usual, with its traceback."""
    try:
        run()
        code = 0
    except SystemExit as e:  # sys.exit's rules: None is 0; a message goes to stderr, code 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def forks_from_main_thread() -> bool:
    """Whether a child started now may rely on the parent-death signal: the forking thread is
    the main one, which ends only with the process."""
    return threading.current_thread() is threading.main_thread()


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent (thread) exits; False where
    that does not exist (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int, name: str, use_signal: bool = True) -> None:
    """Call first thing in a child: it is killed (SIGKILL: a blocked main thread runs no Python
    handler) when process `parent_pid` exits, and exits at once if it already has.
    `use_signal`: the parent forked us from its main thread (see the module docstring)."""
    if use_signal:
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        _exit_orphaned(parent_pid, name)
    threading.Thread(target=_watch, args=(parent_pid, name), daemon=True,
                     name="ladle-parent-watch").start()


def _watch(parent_pid: int, name: str) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_INTERVAL_S)
    _exit_orphaned(parent_pid, name)


def _exit_orphaned(parent_pid: int, name: str) -> None:
    # No logging (its lock may be held by a thread that never runs again) and no cleanup: the
    # parent that would read our outputs is gone, and the main thread may be blocked.
    try:
        os.write(2, f"{name} (pid {os.getpid()}): its parent process {parent_pid} is gone; "
                    "exiting\n".encode())
    except OSError:
        pass
    os._exit(1)


def guarded_command_argv(command: list[str]) -> list[str]:
    """argv that runs `command` under `run_guarded`, tied to this process. Start it from the
    thread that waits for it (subprocess.run), so the parent-death signal cannot fire early.
    This file runs as a script (it imports nothing of ladle), isolated (-I: no directory of
    ours on sys.path), so it works from any working directory, installed or not."""
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), *command]


def run_guarded(parent_pid: int, command: list[str]) -> int:
    """Run `command` so that it ends with process `parent_pid`, also when that is SIGKILLed,
    and return its exit code (128 + N when a signal N ended it, as a shell does).

    This guard dies with the parent (parent-death signal, SIGKILL), and the command gets SIGTERM
    when the guard dies, however it dies (the guard's parent may also kill it directly, as
    subprocess.run does on an exception). SIGTERM rather than SIGKILL, because the command may
    have children to stop: ninja runs each compiler in its own process group and on SIGTERM
    sends SIGTERM to each group. The guard starts a new session first, so a signal to the
    server's process group (Ctrl-C, `kill -- -PGID`) reaches the command only through the guard
    and its parent, never killing ninja before it can stop its compilers."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        return 1
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    guard_pid = os.getpid()

    def tie_to_guard() -> None:  # in the child, between fork and exec
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != guard_pid:
            os._exit(1)

    proc = subprocess.Popen(command, preexec_fn=tie_to_guard)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # passed on, then we wait
        signal.signal(sig, lambda s, _: proc.send_signal(s))
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(run_guarded(int(sys.argv[1]), sys.argv[2:]))
