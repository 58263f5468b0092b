"""A tensor-parallel group: this process's rank, the world size, and the two collectives the
model needs (the all-reduce after a row-parallel layer, the gather of vocab-parallel logits to
rank 0). The process group is an object held here, never torch.distributed's global default,
so an engine can be closed and another started in the same process."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


class WorkerGroupError(RuntimeError):
    """A collective failed, or a rank is gone or stopped answering: the group's state is
    unknown (like a device fault), so the engine stops instead of retrying the step."""


class TPGroup:
    """Rank `rank` of `world_size`. Built before the process group exists (layers need only
    the sizes to shape themselves); `connect` joins the group once every rank has loaded."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.pg = None
        # Measured by benchmarks/parallel.py: bytes this rank sent into all-reduces and the
        # seconds it spent in them (waiting for the slowest rank included).
        self.num_all_reduces = 0
        self.all_reduce_bytes = 0
        self.all_reduce_seconds = 0.0

    def connect(self, store: dist.Store, hostname: str, stage: int = 0) -> None:
        """Join the process group (of pipeline stage `stage`'s ranks): NCCL for CUDA tensors,
        gloo (over `hostname`'s interface) otherwise. Every collective then fails after
        `timeout` instead of hanging."""
        store = dist.PrefixStore(f"ladle-tp{stage}", store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; every rank gets the same tensor."""
        t = time.perf_counter()
        try:
            self.pg.allreduce([x]).wait()
        except RuntimeError as e:
            raise WorkerGroupError(f"tensor-parallel all-reduce failed on rank {self.rank} (a "
                                   f"rank died or timed out): {e}") from e
        self.num_all_reduces += 1
        self.all_reduce_bytes += x.numel() * x.element_size()
        self.all_reduce_seconds += time.perf_counter() - t
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's (N, V/world) slice of the logits, joined on rank 0 into (N, vocab_size)
        (the padding past the real vocabulary dropped, so it is never sampled); None on the
        other ranks, which never sample."""
        logits = logits.contiguous()
        outs = [[torch.empty_like(logits) for _ in range(self.world_size)]] if self.rank == 0 \
            else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        try:
            self.pg.gather(outs, [logits], opts).wait()
        except RuntimeError as e:
            raise WorkerGroupError(f"tensor-parallel logits gather failed on rank {self.rank} "
                                   f"(a rank died or timed out): {e}") from e
        if self.rank != 0:
            return None
        return torch.cat(outs[0], dim=-1)[:, :vocab_size]

    def close(self) -> None:
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception:  # a group whose peers are already gone: nothing left to release
                pass
            self.pg = None
