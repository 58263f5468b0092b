"""Mixture-of-experts families: Qwen3-MoE and Mixtral. Both are the Llama decoder (llama.py)
whose feed-forward block, on its sparse layers, is a router over experts, each expert a gated
MLP (SwiGLU):

- the router's logits (model dtype) go through a softmax in float32 over all experts, the top k
  are kept and, with `norm_topk_prob` (always for Mixtral), renormalised to sum to 1;
- each token's output is the weighted sum of its k experts' outputs.

The step's T tokens are routed at once: the T * k (token, expert) pairs are sorted by expert,
every expert's rows are gathered into one small GEMM (gate/up, fused SiLU, down), and each
token's weighted outputs are summed in expert order. On the CPU that is one kernel call per
layer over the layer's stacked weights: runner/csrc/moe.cpp for dense experts, quant.cpp's
moe_quant_swiglu for experts in GGUF blocks. Their twin, and the path of int8 experts, is a
Python loop over the experts that received rows, never over tokens.

Tensor parallelism splits every expert's intermediate dimension across ranks (gate/up
column-parallel, down row-parallel) and replicates the router: one all-reduce per MoE block, as
for a dense MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ladle.models.layers import GatedMLP
from ladle.models.llama import DecoderConfig, LlamaForCausalLM
from ladle.runner.cpu_kernels import linear, moe_swiglu
from ladle.runner.quant import QuantWeight, moe_quant_swiglu, stack_expert_blocks

if TYPE_CHECKING:
    from ladle.distributed.group import TPGroup


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool
    # Mixtral keeps the routing weights in float32 (each expert's output is scaled in float32,
    # then cast); Qwen3-MoE casts them to the model dtype first. transformers does each.
    float32_weights: bool
    sparse_layers: frozenset[int]  # the layers whose MLP is the experts' block

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok is {self.top_k}; accepted: 1 "
                             f"to the number of experts ({self.num_experts})")


class RoutedExperts(nn.Module):
    """What every MoE block shares: `route` (a family's) picks each token's experts and weights;
    `experts` (an nn.ModuleList, each called on its rows) run one GEMM per expert that received
    rows; the weighted outputs are added into their tokens' rows; one all-reduce under TP."""

    moe: MoeConfig
    tp: TPGroup | None
    experts: nn.ModuleList

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each (T, top_k)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        y = self.fused(x, weights, ids)
        if y is None:
            y = self.expert_loop(x, weights, ids)
        return y if self.tp is None else self.tp.all_reduce(y)

    def fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """The weighted sum from one kernel call, or None (then `expert_loop`)."""
        return None

    def expert_loop(self, x: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
        """The weighted sum, one module call per expert that received rows: the fused
        kernel's twin, and the path of quantized or non-SwiGLU experts."""
        T = x.shape[0]
        k = self.moe.top_k
        flat = ids.reshape(-1)  # (T * k,): pair p is token p // k's choice p % k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        token = order // k
        rows = x.index_select(0, token)  # (T * k, hidden), expert by expert
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                out[start:start + n] = self.experts[expert](rows[start:start + n])
                start += n
        scaled = (out * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
        # Each token's k outputs, gathered in the order of their expert ids and added left to
        # right: transformers' sum (index_add_ over the experts in order), without index_add_
        # itself (several ms per layer on CPU).
        by_expert = ids.argsort(dim=-1, stable=True)  # (T, k)
        pair = (torch.arange(T, device=x.device)[:, None] * k + by_expert).reshape(-1)
        parts = scaled.index_select(0, torch.argsort(order).index_select(0, pair)).view(T, k, -1)
        y = parts[:, 0].clone()
        for j in range(1, k):
            y += parts[:, j]
        return y


class SparseMoeBlock(RoutedExperts):
    """Qwen3-MoE's and Mixtral's: the router (`gate`, as checkpoints name it) and the experts,
    each a GatedMLP of this rank's slice of the expert's intermediate dimension."""

    def __init__(self, hidden: int, moe: MoeConfig, intermediate: int, tp: TPGroup | None):
        super().__init__()
        self.moe, self.tp = moe, tp
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        # --quantization int8 leaves the router dense (as quantized MoE checkpoints do): it is
        # tiny, and int8 logits would move tokens between experts at near-ties.
        self.gate.keep_dense = True
        # tp=None: no all-reduce per expert; the block reduces once, after the weighted sum.
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate)
                                     for _ in range(moe.num_experts))
        # (gate_up (E, 2I, H), down (E, H, I)) once loaded dense, or the experts' GGUF blocks
        # stacked per projection (quant.stack_expert_blocks): see after_load.
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self.quant_stacked: tuple | None = None

    def after_load(self) -> None:
        """Stacks the layer's expert weights for the fused kernel (runner/csrc/moe.cpp); each
        expert's parameters become views of the stack, so no second copy is kept. The load's
        peak grows by one layer's experts. Experts in GGUF blocks (one type per projection, as a
        file stores them) are stacked too, for quant.cpp's moe_quant_swiglu; int8 experts keep
        the loop, their linears running the quantized kernels."""
        pairs = [(m.gate_up_proj.weight, m.down_proj.weight) for m in self.experts]
        if all(isinstance(w, QuantWeight) and w.on_cpu for pair in pairs for w in pair):
            self.quant_stacked = stack_expert_blocks([g for g, _ in pairs], [d for _, d in pairs])
            return
        if not all(isinstance(w, nn.Parameter) and w.device.type == "cpu"
                   for pair in pairs for w in pair):
            return
        gate_up = torch.stack([g.data for g, _ in pairs])
        down = torch.stack([d.data for _, d in pairs])
        for e, m in enumerate(self.experts):
            m.gate_up_proj.weight.data = gate_up[e]
            m.down_proj.weight.data = down[e]
        self.stacked = (gate_up, down)

    def fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        if self.quant_stacked is not None:
            return moe_quant_swiglu(x, ids, weights, self.quant_stacked)
        if self.stacked is None:
            return None
        return moe_swiglu(x, ids, weights, *self.stacked)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The softmax over all experts in float32, then the top k (best first)."""
        logits = linear(x, self.gate.weight)  # (T, E) in the model dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.moe.float32_weights:
            weights = weights.to(x.dtype)
        return weights, ids


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama decoder with the experts' block on the sparse layers and the dense gated MLP
    (config intermediate_size) elsewhere. Subclasses read their family's config fields."""

    def __init__(self, hf_config: dict, tp: TPGroup | None = None):
        self.moe = self.read_moe(hf_config)
        super().__init__(hf_config, tp)

    @classmethod
    def read_moe(cls, hf: dict) -> MoeConfig:
        raise NotImplementedError

    def make_mlp(self, index: int, hf_config: dict) -> nn.Module | None:
        if index not in self.moe.sparse_layers:
            return None
        return SparseMoeBlock(self.config.hidden_size, self.moe, self.expert_slice(), self.tp)

    def expert_slice(self) -> int:
        """This rank's share of each expert's intermediate dimension."""
        inter = self.moe.intermediate_size
        if self.tp is not None:
            if inter % self.tp.world_size:
                raise ValueError(f"tensor_parallel_size: {self.tp.world_size} does not divide "
                                 f"the experts' intermediate size ({inter}); use a divisor")
            inter //= self.tp.world_size
        return inter

    def unfused(self, name: str, shape: tuple | None, sibling=None) -> list | None:
        """A layer's experts stacked in one tensor, as transformers 5 holds them in memory
        (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I)) or as a
        GGUF file stores them (one per projection: `mlp.experts.gate_proj.weight` and
        `up_proj.weight` (E, I, H), `down_proj.weight`, as models/gguf/mapping.py names them):
        the per-expert checkpoint tensors it holds, as (name, shape, index into it)."""
        stem, _, kind = name.removesuffix(".weight").rpartition(".")
        if not stem.endswith(".experts") or kind not in ("gate_up_proj", "gate_proj", "up_proj",
                                                         "down_proj"):
            return None
        num, inter = self.moe.num_experts, self.moe.intermediate_size
        if shape is not None:
            if len(shape) != 3:
                return None  # not a stacked tensor: the loader names it as unexpected
            num = shape[0]
            inter = shape[1] // 2 if kind == "gate_up_proj" else shape[2]
        parts = []
        for e in range(num):
            if kind != "gate_up_proj":  # one projection: expert e is row block e
                parts.append((f"{stem}.{e}.{kind}.weight",
                              None if shape is None else tuple(shape[1:]), e))
                continue
            for i, proj in enumerate(("gate_proj", "up_proj")):
                parts.append((f"{stem}.{e}.{proj}.weight",
                              None if shape is None else (inter, shape[2]),
                              (e, slice(i * inter, (i + 1) * inter))))
        return parts

    def _is_expert(self, name: str) -> bool:
        return ".experts." in name

    def shard_sizes(self, module: str) -> list[int]:
        if self._is_expert(module) and module.endswith("gate_up_proj"):
            per_rank = self.moe.intermediate_size // (1 if self.tp is None else self.tp.world_size)
            return [per_rank, per_rank]
        return super().shard_sizes(module)

    def checkpoint_slice(self, pname: str, shard: int | None) -> tuple[int, int, int] | None:
        if self.layout is None or not self._is_expert(pname):
            return super().checkpoint_slice(pname, shard)  # the router: replicated (None)
        n = self.moe.intermediate_size // self.tp.world_size
        if ".gate_up_proj." in pname:
            return 0, self.tp.rank * n, n
        if pname.endswith("down_proj.weight"):
            return 1, self.tp.rank * n, n
        return None  # a bias of down_proj (none in these families)


def _sparse_layers(hf: dict, num_experts: int, step: int, dense: list[int]) -> frozenset[int]:
    if step < 1:
        raise ValueError(f"config.json: decoder_sparse_step is {step}; accepted: >= 1")
    return frozenset(i for i in range(hf["num_hidden_layers"])
                     if num_experts > 0 and i not in dense and (i + 1) % step == 0)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention (per-head q/k norms);
    the experts on every `decoder_sparse_step`-th layer not in `mlp_only_layers`; routing
    weights renormalised when `norm_topk_prob` (transformers' default: false)."""

    switches = {"qk_norm": True}

    @classmethod
    def read_config(cls, hf_config: dict, switches: dict) -> DecoderConfig:
        window = hf_config.get("sliding_window", 4096) if hf_config.get("use_sliding_window") \
            else None
        hf = {k: v for k, v in hf_config.items() if k != "use_sliding_window"}
        return DecoderConfig.from_hf({"intermediate_size": 6144, **hf}, **switches,
                                     sliding_window=window)

    @classmethod
    def read_moe(cls, hf: dict) -> MoeConfig:
        # Published configs say num_experts; transformers 5 writes num_local_experts.
        num = hf.get("num_experts", hf.get("num_local_experts", 128))
        return MoeConfig(num_experts=num, top_k=hf.get("num_experts_per_tok", 8),
                         intermediate_size=hf.get("moe_intermediate_size", 768),
                         norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                         float32_weights=False,
                         sparse_layers=_sparse_layers(hf, num, hf.get("decoder_sparse_step", 1),
                                                      list(hf.get("mlp_only_layers") or [])))


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Llama's attention (with `sliding_window` when set), the experts on every layer
    (`intermediate_size` is an expert's), routing weights always renormalised and kept in
    float32. Checkpoints name the block `block_sparse_moe` and the experts' projections w1
    (gate), w3 (up) and w2 (down)."""

    renames = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
               (".w3.", ".up_proj."), (".w2.", ".down_proj."))

    @classmethod
    def read_config(cls, hf_config: dict, switches: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(hf_config, **switches,
                                     sliding_window=hf_config.get("sliding_window"))

    @classmethod
    def read_moe(cls, hf: dict) -> MoeConfig:
        num = hf.get("num_local_experts", hf.get("num_experts", 8))
        return MoeConfig(num_experts=num, top_k=hf.get("num_experts_per_tok", 2),
                         intermediate_size=hf.get("intermediate_size", 14336),
                         norm_topk_prob=True, float32_weights=True,
                         sparse_layers=frozenset(range(hf["num_hidden_layers"])))
