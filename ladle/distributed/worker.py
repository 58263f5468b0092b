"""A model-parallel worker (ranks 1..N-1): loads its part of the model (its tensor-parallel
shard of its pipeline stage's layers) and runs it on the commands rank 0 sends, one at a time
and in order, so every rank's collectives line up. It never schedules or samples; what it needs
from a step arrives with the FORWARD command. A stage before the last sends its residual stream
on to the next stage inside the forward, and never gets a LOGITS command."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from ladle.distributed.group import TPGroup
from ladle.lifetime import die_with_parent
from ladle.native_memory import bound_native_memory, freeze_startup_heap, trim_heap

logger = logging.getLogger("ladle.distributed.worker")



class Command(IntEnum):
    """Rank 0 -> worker. The payload follows in the same pickled tuple."""

    KV_CACHE = 0  # (num_blocks, block_size, num_state_slots): allocate this rank's caches
    FORWARD = 1  # (input_ids, positions, AttentionMetadata, micro-batch index), all on CPU
    LOGITS = 2  # indices (or None) into the step's hidden states (its micro-batches joined)
    SHUTDOWN = 3  # leave the loop and the group
    COPY_BLOCKS = 4  # (sources, destinations): copy KV blocks (a beam search fork)
    STATES = 5  # (operation, argument): a hybrid's state slots (model_runner.apply_state_op)


@dataclass(slots=True)
class WorkerSpec:
    """Everything a worker needs to start; pickled into the new process or Ray actor."""

    rank: int
    world_size: int
    model_path: str
    hf_config: dict
    dtype: torch.dtype
    device: str
    store_host: str  # rank 0's TCPStore: rendezvous, then the ready / error handshake
    store_port: int
    control_addr: str  # ZMQ address rank 0's PUSH socket for this rank is bound to
    hostname: str | None  # interface gloo binds to; None: ask Ray for this node's address
    timeout_s: float  # per collective
    startup_timeout_s: float
    num_threads: int
    batch_invariant: bool  # the engine's --batch-invariant: this rank's kernels in that mode
    tp_size: int = 1  # world_size = tp_size x pp_size; rank -> (stage, tp rank) as executor.py
    pp_size: int = 1
    pp_partition: list[int] | None = None
    quantization: str | None = None
    parent_pid: int = 0  # mp: die with rank 0 (the parent); Ray kills its own actors
    # mp: rank 0 started us from its main thread, so the kernel's parent-death signal may be
    # used (ladle/lifetime.py)
    parent_death_signal: bool = True


def move(obj, device: torch.device):
    """obj (a tensor, or an attention-metadata dataclass holding tensors, lists of them, None
    or ints) with every tensor on `device`; a no-op when they already are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [move(o, device) for o in obj]
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: move(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


def run_worker(spec: WorkerSpec) -> None:
    """The worker process (or Ray actor call) from start to exit. An exception ends it; rank 0
    sees that as a failed collective or a dead worker and stops the engine. An mp worker dies
    with rank 0, also inside a collective (ladle/lifetime.py)."""
    if spec.parent_pid:
        die_with_parent(spec.parent_pid, f"tensor-parallel rank {spec.rank}",
                        use_signal=spec.parent_death_signal)
    bound_native_memory()
    stage_index = spec.pp_size - 1 - spec.rank // spec.tp_size
    tp_rank = spec.rank % spec.tp_size
    where = f"rank {spec.rank}" + (f", stage {stage_index}" if spec.pp_size > 1 else "")
    logging.basicConfig(level=os.environ.get("LADLE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [{where}] %(name)s: %(message)s")
    from datetime import timedelta

    from ladle.models.loader import load_model  # torch and the model: only once started

    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL binds this rank to its device
    store = dist.TCPStore(spec.store_host, spec.store_port, spec.world_size, is_master=False,
                          timeout=timedelta(seconds=spec.startup_timeout_s))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if device.type == "cpu":
            from ladle.runner.cpu_kernels import load_cpu_kernels

            load_cpu_kernels()
        if spec.batch_invariant:
            from ladle.runner.cpu_kernels import set_batch_invariant
            from ladle.runner.model_runner import check_batch_invariant

            check_batch_invariant(device, spec.dtype)
            set_batch_invariant(True)
        tp = TPGroup(tp_rank, spec.tp_size, device, spec.timeout_s) if spec.tp_size > 1 \
            else None
        stage = None
        if spec.pp_size > 1:
            from ladle.distributed.pipeline import PipelineStage, stage_layers
            from ladle.models.loader import model_class

            with torch.device("meta"):
                num_layers = model_class(spec.hf_config, Path(spec.model_path))(
                    spec.hf_config, tp).config.num_layers
            layers = stage_layers(num_layers, spec.pp_size, spec.pp_partition)[stage_index]
            stage = PipelineStage(stage_index, spec.pp_size, layers, timeout_s=spec.timeout_s)
        model = load_model(Path(spec.model_path), spec.hf_config, spec.dtype, device, tp,
                           spec.quantization, stage)
        sock.connect(spec.control_addr)
    except Exception as e:
        logger.exception("model-parallel worker failed to start")
        store.set(f"error/{spec.rank}", f"{type(e).__name__}: {e}")
        raise
    store.set(f"ready/{spec.rank}", "1")
    if tp is not None:
        tp.connect(store, spec.hostname, stage=stage_index)
    if stage is not None:
        stage.connect(store, tp_rank, device, spec.hostname)
    logger.info("worker rank %d of %d ready (pid %d)", spec.rank, spec.world_size, os.getpid())
    freeze_startup_heap()
    try:
        _serve(model, sock, spec, device)
    finally:
        if tp is not None:
            tp.close()
        if stage is not None:
            stage.close()
        sock.close()
        ctx.term()


@torch.inference_mode()
def _serve(model, sock: zmq.Socket, spec: WorkerSpec, device: torch.device) -> None:
    from ladle.models.gated_deltanet import GatedDeltaNetState
    from ladle.runner.model_runner import allocate_kv_caches, apply_state_op, copy_kv_blocks

    kv_caches, hidden = None, []
    while True:
        command, payload = pickle.loads(sock.recv())
        if command == Command.FORWARD:
            input_ids, positions, meta, micro_batch = payload
            if model.pp is not None:
                model.pp.micro_batch = micro_batch
            out = model(input_ids.to(device), positions.to(device), move(meta, device),
                        kv_caches)
            hidden = [out] if micro_batch == 0 else [*hidden, out]
            trim_heap(time.monotonic())  # (the engine loop's rhythm, per forward here)
        elif command == Command.LOGITS:  # the last stage's ranks only
            joined = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
            model.compute_logits(joined, None if payload is None else payload.to(device))
        elif command == Command.KV_CACHE:
            num_blocks, block_size, num_slots = payload
            kv_caches = allocate_kv_caches(model.config, model.num_local_kv_heads, num_blocks,
                                           block_size, spec.dtype, device, num_slots,
                                           layers=None if model.pp is None else model.pp.layers)
            states = [c for c in kv_caches if isinstance(c, GatedDeltaNetState)]
        elif command == Command.COPY_BLOCKS:
            src, dst = payload
            copy_kv_blocks(kv_caches, src.to(device), dst.to(device))
        elif command == Command.STATES:
            apply_state_op(states, *payload)
        elif command == Command.SHUTDOWN:
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel command {command!r}")

