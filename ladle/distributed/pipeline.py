"""Pipeline parallelism: the model's layers split into stages, each stage a group of processes
(its tensor-parallel ranks) holding only its layers' weights and KV cache.

- `stage_layers` decides the split: even (the remainder to the earlier stages, as vLLM does),
  or the user's `--pp-layer-partition`.
- `prune_to_stage` cuts a model built on the meta device down to one stage before any memory
  is allocated: the other stages' layers become `MissingLayer`s (no parameters), the embedding
  stays on the first stage (and on the last when the head is tied to it), the final norm and
  the head on the last. The loader then skips every checkpoint tensor of a pruned module
  (`PipelineStage.holds`), so each stage reads only its own weights.
- `PipelineStage.send` / `recv` move the residual stream between neighbouring stages: the
  hidden states, then the residual (families without one send only the hidden states), as
  contiguous tensors over the stage link (gloo on CPU, NCCL on CUDA). The shapes need no
  message of their own: every stage gets the step's metadata (token count, positions,
  attention layout) in the same FORWARD command before the tensors move.

The engine process is the *last* stage (its tensor-parallel rank 0): it owns the sampler, the
logits processors, grammar bitmasks and seeded noise, exactly as without pipelining, so no
sampling state is ever split or copied. The first stage gets the sampled tokens as the next
step's input ids, with the FORWARD command.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ladle.distributed.group import WorkerGroupError


def stage_layers(num_layers: int, pp_size: int, partition: list[int] | None = None
                 ) -> list[range]:
    """Each stage's layers, in order. `partition`: the number of layers of each stage (summing
    to num_layers); default: as even as possible, earlier stages taking the remainder."""
    if partition is not None:
        if len(partition) != pp_size or any(n < 1 for n in partition) or \
                sum(partition) != num_layers:
            raise ValueError(f"pp_layer_partition: {partition} must give {pp_size} stages (the "
                             f"pipeline_parallel_size) at least one layer each, summing to the "
                             f"model's {num_layers} layers")
        sizes = list(partition)
    else:
        if pp_size > num_layers:
            raise ValueError(f"pipeline_parallel_size: {pp_size} stages, but the model has "
                             f"only {num_layers} layers; accepted: 1..{num_layers}")
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + (1 if i < extra else 0) for i in range(pp_size)]
    ranges, start = [], 0
    for n in sizes:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def kv_layers_in(model_config, layers: range) -> int:
    """How many of `layers` keep a paged KV cache (a hybrid's linear-attention layers keep
    state slots instead)."""
    kinds = getattr(model_config, "layer_types", None)
    if not kinds:
        return len(layers)
    return sum(kinds[i] != "linear_attention" for i in layers)


class MissingLayer(nn.Module):
    """The place of a layer another stage holds: no parameters; never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage ran a layer that another stage holds")


@dataclass
class PipelineStage:
    """Stage `index` of `size`, holding layers `layers`. `link`: the process group of this
    tensor-parallel rank's column (one rank per stage, rank = stage index), over which the
    residual stream moves; None until `connect`."""

    index: int
    size: int
    layers: range
    keeps_embedding: bool = True
    keeps_head: bool = True
    link: object = None
    timeout_s: float = 60.0
    # The part of the step being run (executor.forward_micro_batches): its tensors travel
    # under their own tags, so parts in flight between two stages never mix.
    micro_batch: int = 0
    # Measured for docs/scaling.md: bytes this stage sent on, seconds spent waiting to receive.
    sent_bytes: int = 0
    recv_seconds: float = 0.0
    # With LADLE_PP_TRACE=DIR: (start, end) wall-clock times of each part this stage computed,
    # written to DIR/stage<index>-rank<column>.json when the stage closes
    # (benchmarks/pipeline.py reads them for the stages' overlap).
    trace: list | None = None
    trace_dir: str | None = None
    column: int = 0

    def __post_init__(self):
        self.trace_dir = os.environ.get("LADLE_PP_TRACE") or None
        if self.trace_dir:
            self.trace = []

    def computed(self, start: float) -> None:
        """A part's compute (between receiving and sending) ran from `start` until now."""
        if self.trace is not None:
            self.trace.append((start, time.time()))

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def connect(self, store: dist.Store, column: int, device: torch.device,
                hostname: str | None) -> None:
        """Join the link of tensor-parallel rank `column` (every stage's rank of that column)."""
        self.column = column
        store = dist.PrefixStore(f"ladle-pp{column}", store)
        timeout = timedelta(seconds=self.timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.link = dist.ProcessGroupNCCL(store, self.index, self.size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
            self.link = dist.ProcessGroupGloo(store, self.index, self.size, opts)

    def send(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """The residual stream to the next stage (x, then the residual when there is one)."""
        for i, t in enumerate((x, residual)):
            if t is None:
                continue
            t = t.contiguous()
            try:
                self.link.send([t], self.index + 1, 2 * self.micro_batch + i).wait()
            except RuntimeError as e:
                raise WorkerGroupError(f"pipeline stage {self.index} could not send to stage "
                                       f"{self.index + 1} (it died or timed out): {e}") from e
            self.sent_bytes += t.numel() * t.element_size()

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
             with_residual: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The previous stage's residual stream for a step of `num_tokens` tokens."""
        t0 = time.perf_counter()
        out = []
        for i in range(2 if with_residual else 1):
            t = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
            try:
                self.link.recv([t], self.index - 1, 2 * self.micro_batch + i).wait()
            except RuntimeError as e:
                raise WorkerGroupError(f"pipeline stage {self.index} got nothing from stage "
                                       f"{self.index - 1} (it died or timed out): {e}") from e
            out.append(t)
        self.recv_seconds += time.perf_counter() - t0
        return out[0], (out[1] if with_residual else None)

    def holds(self, module_name: str) -> bool:
        """Whether this stage holds the model's module (or parameter) `module_name` (the
        model's own dotted names: "layers.3.mlp.gate_up_proj", "embed_tokens", "norm")."""
        head, _, rest = module_name.partition(".")
        if head == "layers":
            index = rest.partition(".")[0]
            return not index.isdigit() or int(index) in self.layers
        if head == "embed_tokens":
            return self.keeps_embedding
        if head in ("norm", "lm_head"):
            return self.keeps_head
        return True

    def close(self) -> None:
        if self.trace is not None:
            path = Path(self.trace_dir) / f"stage{self.index}-rank{self.column}.json"
            path.write_text(json.dumps(self.trace))
            self.trace = []
        if self.link is not None:
            try:
                self.link.shutdown()
            except Exception:  # peers already gone: nothing left to release
                pass
            self.link = None


def prune_to_stage(model: nn.Module, stage: PipelineStage) -> None:
    """Cut `model` (on the meta device) down to `stage`: the other stages' layers, and the
    embedding, norm and head where the stage does not use them, are replaced by MissingLayer.
    The model's forward (models/llama.py `decoder_forward`) then runs only its own layers."""
    tied = getattr(model, "lm_head", None) is None
    stage.keeps_embedding = stage.first or (stage.last and tied)
    stage.keeps_head = stage.last
    for i in range(len(model.layers)):
        if i not in stage.layers:
            model.layers[i] = MissingLayer()
    if not stage.keeps_embedding:
        model.embed_tokens = MissingLayer()
    if not stage.last:
        model.norm = MissingLayer()
        if not tied:
            model.lm_head = MissingLayer()
    model.pp = stage
