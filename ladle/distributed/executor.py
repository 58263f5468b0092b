"""Rank 0's side of tensor parallelism: starts the worker ranks (`mp`: spawned processes; `ray`:
actors in a placement group), and gives the model runner a model whose calls run rank 0's shard
while driving the workers through the same call, in lockstep.

Per step the runner makes one forward call and one to three compute_logits calls; each becomes
one command to every worker (the step's inputs travel with FORWARD, already flat tensors), and
the collectives inside the model do the rest. Sampling stays on rank 0: ranks cannot diverge,
because a sampled token reaches the workers only as the next step's input id."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from ladle.distributed.group import TPGroup, WorkerGroupError
from ladle.distributed.pipeline import PipelineStage, kv_layers_in, stage_layers
from ladle.distributed.worker import Command, WorkerSpec, move, run_worker
from ladle.lifetime import forks_from_main_thread
from ladle.models.loader import load_model, model_class

logger = logging.getLogger("ladle.distributed.executor")

# Startup (workers importing torch and reading their shards) may take this many times the
# per-collective timeout.
_STARTUP_FACTOR = 10


def threads_per_rank(world_size: int) -> int:
    """Each rank's torch threads: the cores split evenly, unless OMP_NUM_THREADS says."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, len(os.sched_getaffinity(0)) // world_size)


class TensorParallelModel:
    """What the model runner sees in the engine process when tensor_parallel_size or
    pipeline_parallel_size is > 1: the model's interface (forward, compute_logits, config,
    parameters), backed by this process's part and the worker ranks. Any failure inside a call
    is a WorkerGroupError: after one, the ranks may be at different collectives, so the engine
    must stop, not retry.

    Ranks: world = pp x tp. The engine process is rank 0, tensor-parallel rank 0 of the *last*
    pipeline stage (where sampling is); rank g is stage pp - 1 - g // tp, tensor-parallel rank
    g % tp of it (distributed/pipeline.py)."""

    def __init__(self, model_path: Path, hf_config: dict, dtype: torch.dtype,
                 device: torch.device, world_size: int, backend: str, timeout_s: float,
                 batch_invariant: bool = False, pp_size: int = 1,
                 pp_partition: list[int] | None = None, quantization: str | None = None):
        self.tp_size, self.pp_size = world_size, pp_size
        self.world_size = world_size * pp_size
        self.timeout_s = timeout_s
        startup_s = timeout_s * _STARTUP_FACTOR
        cls = model_class(hf_config, model_path)
        with torch.device("meta"):  # check the split before starting anything (clear error)
            probe = cls(hf_config, TPGroup(0, world_size, device, 1) if world_size > 1 else None)
        self.stages = stage_layers(probe.config.num_layers, pp_size, pp_partition)
        # The most KV layers any stage holds: every stage allocates the same number of blocks.
        self.max_stage_kv_layers = max(kv_layers_in(probe.config, r) for r in self.stages)
        num_threads = threads_per_rank(self.world_size)
        # Restored by close(): an offline LLM shares this process with its caller.
        self._caller_threads = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        self.tp = TPGroup(0, world_size, device, timeout_s) if world_size > 1 else None
        self.stage = PipelineStage(pp_size - 1, pp_size, self.stages[-1], timeout_s=timeout_s) \
            if pp_size > 1 else None
        self.pp_layers = None if self.stage is None else self.stage.layers
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket] = []
        self._ipc_dir: str | None = None
        self._launcher = _RayLauncher() if backend == "ray" else _ProcessLauncher()
        host = self._launcher.host()
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=startup_s))
        try:
            specs = []
            for rank in range(1, self.world_size):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                specs.append(WorkerSpec(
                    rank=rank, world_size=self.world_size, model_path=str(model_path),
                    hf_config=hf_config, dtype=dtype, device=_rank_device(device, rank, backend),
                    store_host=host, store_port=self._store.port,
                    control_addr=self._bind(sock, backend, host),
                    hostname=self._launcher.worker_hostname(), timeout_s=timeout_s,
                    startup_timeout_s=startup_s,
                    num_threads=num_threads, batch_invariant=batch_invariant,
                    tp_size=world_size, pp_size=pp_size, pp_partition=pp_partition,
                    quantization=quantization,
                    parent_pid=os.getpid(),
                    parent_death_signal=forks_from_main_thread()))
                self._socks.append(sock)
            self._launcher.start(specs)
            self.model = load_model(model_path, hf_config, dtype, device, self.tp, quantization,
                                    self.stage)
            self._wait_ready(startup_s)
            if self.tp is not None:
                self.tp.connect(self._store, host, stage=pp_size - 1)
            if self.stage is not None:
                self.stage.connect(self._store, 0, device, host)
        except BaseException:
            self.close()
            raise
        self.config = self.model.config
        self.num_local_kv_heads = self.model.num_local_kv_heads
        logger.info("model parallel: %d pipeline stage(s) (layers %s) x %d tensor-parallel "
                    "rank(s), %s backend, %d torch threads each", pp_size,
                    ", ".join(f"{r.start}-{r.stop - 1}" for r in self.stages), world_size,
                    backend, num_threads)

    # ---- the model's interface --------------------------------------------------------------
    def parameters(self):
        return self.model.parameters()

    def state_dict(self):
        return self.model.state_dict()

    def init_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        """Rank 0 sized the cache; every worker allocates the same number of blocks (and of a
        hybrid's state slots, each holding its own heads)."""
        self._send(Command.KV_CACHE, (num_blocks, block_size, num_state_slots))

    def state_op(self, op: str, arg=None) -> None:
        """The workers apply a state operation rank 0's runner applied (commit, discard,
        settle, copy), in command order after the forward it concerns."""
        self._send(Command.STATES, (op, arg))

    def __call__(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:
        return self.forward_micro_batches([(input_ids, positions, meta)], kv_caches)

    @property
    def micro_batches(self) -> int:
        """How many parts the runner may split a step into: one per stage, so that with
        enough rows every stage has one to work on."""
        return self.pp_size

    def forward_micro_batches(self, parts: list, kv_caches) -> torch.Tensor:
        """One step's forward over `parts` [(input_ids, positions, meta)], each a run of
        whole rows, in order: every part goes to the workers first, so the first stage starts
        on part 2 while the next stage runs part 1 (pipelined); the hidden states of the last
        stage (this process) come back joined in part order."""
        cpu = torch.device("cpu")
        for i, (input_ids, positions, meta) in enumerate(parts):
            self._send(Command.FORWARD, (input_ids.to(cpu), positions.to(cpu), move(meta, cpu),
                                         i))
        hidden = []
        for i, (input_ids, positions, meta) in enumerate(parts):
            if self.stage is not None:
                self.stage.micro_batch = i
            hidden.append(self._guarded(self.model, input_ids, positions, meta, kv_caches))
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def copy_kv_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The workers copy KV blocks in their shards (rank 0's own copy is the runner's)."""
        self._send(Command.COPY_BLOCKS, (src.to("cpu"), dst.to("cpu")))

    def compute_logits(self, hidden, indices=None) -> torch.Tensor:
        # Only the last stage (this process's) has a head: its tensor-parallel ranks, 1..tp-1.
        self._send(Command.LOGITS, None if indices is None else indices.to("cpu"),
                   last=self.tp_size)
        return self._guarded(self.model.compute_logits, hidden, indices)

    # ---- health and shutdown ----------------------------------------------------------------
    def check_workers(self) -> None:
        """Raise WorkerGroupError when a worker has exited (the engine loop calls this while
        idle, so a dead worker ends the engine even with no step to fail)."""
        dead = self._launcher.dead_ranks()
        if dead:
            raise WorkerGroupError(f"model-parallel worker rank(s) {dead} exited; the engine "
                                   "cannot run the model without them")

    def close(self) -> None:
        """Stop the workers (asked first, then killed), leave the group, free the sockets."""
        for sock in self._socks:
            try:
                sock.send(pickle.dumps((Command.SHUTDOWN, None)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._launcher.stop(timeout_s=5.0)
        if self.tp is not None:
            self.tp.close()
        if self.stage is not None:
            self.stage.close()
        self._store = None  # the rendezvous port is free again
        for sock in self._socks:
            sock.close()
        self._socks = []
        self._ctx.term()
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        torch.set_num_threads(self._caller_threads)

    # ---- internals --------------------------------------------------------------------------
    def _bind(self, sock: zmq.Socket, backend: str, host: str) -> str:
        if backend == "mp":  # local only: a socket file in a private directory
            self._ipc_dir = self._ipc_dir or tempfile.mkdtemp(prefix="ladle-tp-")
            addr = f"ipc://{self._ipc_dir}/rank{len(self._socks) + 1}"
            sock.bind(addr)
            return addr
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"

    def _send(self, command: Command, payload, last: int | None = None) -> None:
        """Queue the command for every worker (ranks 1 .. `last` - 1 only, when given). A
        socket refuses it only when its worker is not connected (not yet, or no longer): then
        wait for it, but stop at once if a worker has died rather than after the timeout."""
        msg = pickle.dumps((command, payload), protocol=pickle.HIGHEST_PROTOCOL)
        socks = self._socks if last is None else self._socks[:last - 1]
        for rank, sock in enumerate(socks, start=1):
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    sock.send(msg, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    self.check_workers()
                    if time.monotonic() > deadline:
                        raise WorkerGroupError(
                            f"model-parallel worker rank {rank} took no command for "
                            f"{self.timeout_s:g} s (distributed_timeout)") from None
                    time.sleep(0.005)

    @staticmethod
    def _guarded(fn, *args):
        try:
            return fn(*args)
        except WorkerGroupError:
            raise
        except Exception as e:  # the workers may be inside a collective rank 0 never reaches
            raise WorkerGroupError(f"rank 0 failed inside its part of the model: "
                                   f"{type(e).__name__}: {e}") from e

    def _wait_ready(self, startup_s: float) -> None:
        deadline = time.monotonic() + startup_s
        waiting = set(range(1, self.world_size))
        while waiting:
            for rank in sorted(waiting):
                if self._store.check([f"error/{rank}"]):
                    error = self._store.get(f"error/{rank}").decode()
                    raise WorkerGroupError(f"model-parallel worker rank {rank} failed to "
                                           f"start: {error}")
                if self._store.check([f"ready/{rank}"]):
                    waiting.discard(rank)
            self.check_workers()
            if waiting and time.monotonic() > deadline:
                raise WorkerGroupError(
                    f"model-parallel worker rank(s) {sorted(waiting)} not ready after "
                    f"{startup_s:g} s ({_STARTUP_FACTOR} x distributed_timeout)")
            time.sleep(0.05)


def _rank_device(device: torch.device, rank: int, backend: str) -> str:
    """CPU ranks share the host; CUDA ranks get one device each (Ray already gives each actor
    its own GPU as cuda:0)."""
    if device.type != "cuda":
        return str(device)
    return "cuda:0" if backend == "ray" else f"cuda:{rank}"


class _ProcessLauncher:
    """`mp`: workers are spawned children of the engine process, on this host. They die with
    it, however it ends (ladle/lifetime.py); daemonic, so a normal exit stops them first."""

    def __init__(self):
        self.procs = []

    def host(self) -> str:
        return "127.0.0.1"

    def worker_hostname(self) -> str:
        return "127.0.0.1"

    def start(self, specs: list[WorkerSpec]) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork a process holding threads
        for spec in specs:
            proc = ctx.Process(target=run_worker, args=(spec,), daemon=True,
                               name=f"ladle-tp-rank{spec.rank}")
            proc.start()
            self.procs.append((spec.rank, proc))

    def pids(self) -> list[int]:
        return [proc.pid for _, proc in self.procs]

    def dead_ranks(self) -> list[int]:
        return [rank for rank, proc in self.procs if proc.exitcode is not None]

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for _, proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
        self.procs = []


class _RayWorker:
    """The Ray actor body: one worker rank; `run` holds the actor until the worker exits."""

    def run(self, spec: WorkerSpec) -> None:
        import ray

        spec.hostname = ray.util.get_node_ip_address()
        spec.parent_pid = 0  # not our parent: Ray ends the actor when its owner dies
        run_worker(spec)


class _RayLauncher:
    """`ray`: workers are actors in a placement group (one bundle per worker rank), on any
    node of the Ray cluster: a running one (RAY_ADDRESS, or `ray start` on this host), else a
    local instance started here. Rank 0 stays in the engine process, on this node."""

    def __init__(self):
        try:
            import ray
        except ImportError as e:
            raise ValueError("distributed_executor_backend: 'ray' needs the ray package "
                             "(pip install 'ladle[ray]'); or use 'mp' on one host") from e
        self.ray = ray
        # Ours to end when it is ours: stop() shuts down what this init started (a local
        # instance, or the connection to RAY_ADDRESS's cluster), not the caller's own ray.init.
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     log_to_driver=True)
        self.actors, self.refs, self.group = [], [], None

    def host(self) -> str:
        return self.ray.util.get_node_ip_address()

    def worker_hostname(self) -> None:
        return None  # each actor asks Ray for its own node's address

    def start(self, specs: list[WorkerSpec]) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        uses_gpu = specs[0].device.startswith("cuda")
        bundle = {"GPU": 1} if uses_gpu else {"CPU": 1}
        self.group = placement_group([bundle] * len(specs), strategy="PACK")
        self.ray.get(self.group.ready(), timeout=specs[0].startup_timeout_s)
        actor_cls = self.ray.remote(_RayWorker)
        for i, spec in enumerate(specs):
            actor = actor_cls.options(
                num_cpus=0 if uses_gpu else 1, num_gpus=1 if uses_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=i),
                runtime_env={"env_vars": _worker_env()},
            ).remote()
            self.actors.append((spec.rank, actor))
            self.refs.append(actor.run.remote(spec))

    def dead_ranks(self) -> list[int]:
        done, _ = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return [rank for (rank, _), ref in zip(self.actors, self.refs, strict=True)
                if ref in done]

    def stop(self, timeout_s: float) -> None:
        if self.refs:
            self.ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        for _, actor in self.actors:
            self.ray.kill(actor)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        self.actors, self.refs, self.group = [], [], None
        if self.owns_ray:  # (not left to ray's atexit hook: the engine core ends without one)
            self.ray.shutdown()
            self.owns_ray = False


def _worker_env() -> dict[str, str]:
    """What a Ray actor must share with the engine process to import and run the same ladle
    (a source checkout on PYTHONPATH, ladle's own settings)."""
    return {k: v for k, v in os.environ.items()
            if k == "PYTHONPATH" or k.startswith("LADLE_")}
