"""Hybrid families: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text). Three of every four layers
(config `layer_types`, or every `full_attention_interval`-th layer full) are Gated DeltaNet
linear attention (gated_deltanet.py), whose per-sequence state lives in a slot rather than in
the paged KV cache; the others are full attention with:

- q_proj twice as wide: per head [query (head_dim) | gate (head_dim)]; the attention output is
  multiplied by sigmoid(gate) before o_proj;
- a (1 + w) RMSNorm on each q and k head (computed in float32, as Gemma's), then rotary on the
  first `partial_rotary_factor` of each head's dimensions only (Qwen3.5's multimodal rope
  gives text positions exactly this);
- every other RMSNorm of the model is (1 + w) as well.

The feed-forward block is the gated MLP, or (Qwen3-Next's sparse layers, every Qwen3.5-MoE
layer) a top-k mixture of experts (moe.py's kernel) plus a shared expert whose output is
scaled by sigmoid(shared_expert_gate(x)) and added.

The model's caches are per layer: (k, v) paged blocks for the attention layers and a
GatedDeltaNetState for the linear ones (runner/model_runner.py allocates both); the step's
segments (which tokens of the flat stream belong to which state slot) come in the attention
metadata.

Tensor parallelism splits the attention heads as llama.py does, the experts' and MLPs'
intermediate dimensions as moe.py does, and the linear layers by key head: rank r holds key
heads r*nk/N .. and the value heads that read them, so its state slots hold only those heads
(config.linear is this rank's share); every block's output projection is row-parallel, one
all-reduce per block."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ladle.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, state_bytes_per_slot
from ladle.models.layers import GatedMLP, GemmaRMSNorm, PartialRotaryEmbedding
from ladle.models.llama import DecoderConfig, ShardLayout, shard_layout, vocab_layers
from ladle.models.moe import MoeConfig, MoeForCausalLM, SparseMoeBlock, _sparse_layers
from ladle.runner.attention import AttentionMetadata, paged_attention
from ladle.runner.cpu_kernels import linear

if TYPE_CHECKING:
    from ladle.distributed.group import TPGroup

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(slots=True)
class HybridConfig(DecoderConfig):
    layer_types: tuple[str, ...] = ()  # per layer: "linear_attention" or "full_attention"
    linear: GatedDeltaNetConfig | None = None
    rotary_dim: int = 0  # leading dims of each head that rotary turns

    @property
    def num_kv_layers(self) -> int:
        """Layers with a paged KV cache (the full-attention ones)."""
        return self.layer_types.count(FULL)

    @property
    def num_state_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    def state_bytes_per_slot(self) -> int:
        """Bytes of one sequence's state over all linear layers."""
        return self.num_state_layers * state_bytes_per_slot(self.linear)


def read_hybrid_config(hf: dict) -> HybridConfig:
    """The decoder's dimensions, the layer pattern and the linear layers' config."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        interval = hf.get("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise ValueError(f"config.json: layer_types must list {n} entries (num_hidden_layers), "
                         f"each {LINEAR!r} or {FULL!r}; got {types}")
    rope = hf.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    hf = {k: v for k, v in hf.items() if k != "use_sliding_window"}
    cfg = HybridConfig.from_hf({"intermediate_size": hf.get("moe_intermediate_size", 512), **hf},
                               qk_norm=True, layer_types=tuple(types),
                               linear=GatedDeltaNetConfig.from_hf(hf))
    cfg.rotary_dim = int(cfg.head_dim * factor)
    if not 0 < cfg.rotary_dim <= cfg.head_dim or cfg.rotary_dim % 2:
        raise ValueError(f"config.json: partial_rotary_factor {factor} of head_dim "
                         f"{cfg.head_dim} gives {cfg.rotary_dim} rotary dims; accepted: an even "
                         "number from 2 to head_dim")
    return cfg


class GatedAttention(nn.Module):
    """Full attention with the output gate: q_proj's rows are [query | gate] per head."""

    def __init__(self, cfg: HybridConfig, layout: ShardLayout | None = None,
                 tp: TPGroup | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, \
            cfg.head_dim
        if layout is not None:  # column-parallel q/k/v: this rank's heads only
            self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.tp = tp
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # q (with its gate), k and v share one matmul; the loader writes the three checkpoint
        # tensors into slices.
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size,
                                  bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, rotary, meta: AttentionMetadata, kv_cache):
        T, D = x.shape[0], self.head_dim
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_gate = q_gate.view(T, self.num_heads, 2 * D)
        gate = q_gate[..., D:].reshape(T, self.q_size)
        q = self.q_norm(q_gate[..., :D].contiguous())  # (T, H, D)
        k = self.k_norm(k.reshape(T, self.num_kv_heads, D))
        q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v.reshape(T, self.num_kv_heads, D), kv_cache, meta,
                              self.scale)
        out = out.reshape(T, self.q_size) * torch.sigmoid(gate)
        if self.tp is None:
            return linear(out, self.o_proj.weight, self.o_proj.bias)
        y = self.tp.all_reduce(linear(out, self.o_proj.weight, None))  # row-parallel
        return y if self.o_proj.bias is None else y + self.o_proj.bias


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus a shared expert, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden: int, moe: MoeConfig, intermediate: int, shared: int,
                 tp: TPGroup | None = None):
        super().__init__(hidden, moe, intermediate, tp)
        # this rank's slice of the shared expert; the block reduces once, after the sum
        self.shared_expert = GatedMLP(hidden, shared)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.shared_expert_gate.keep_dense = True  # a router too: int8 leaves it dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        y = self.fused(x, weights, ids)
        if y is None:
            y = self.expert_loop(x, weights, ids)
        gate = torch.sigmoid(linear(x, self.shared_expert_gate.weight))  # (T, 1)
        y = y + gate * self.shared_expert(x)
        return y if self.tp is None else self.tp.all_reduce(y)


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, kind: str, mlp: nn.Module,
                 layout: ShardLayout | None = None, tp: TPGroup | None = None):
        super().__init__()
        self.kind = kind
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg.linear, tp)
        else:
            self.self_attn = GatedAttention(cfg, layout, tp)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, residual, positions, rotary, meta: AttentionMetadata, cache):
        """As llama.py's layer: (MLP output, residual stream before it); `cache` is this
        layer's (k, v) blocks or its GatedDeltaNetState."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.kind == LINEAR:
            h = self.linear_attn(h, meta.states, cache)
        else:
            h = self.self_attn(h, positions, rotary, meta, cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(MoeForCausalLM):
    """Qwen3-Next: experts with a shared expert on every `decoder_sparse_step`-th layer not in
    `mlp_only_layers` (when num_experts > 0), the gated MLP elsewhere; fused in_proj_qkvz /
    in_proj_ba linear layers."""

    hybrid = True  # per-request state slots beside the KV cache (engine/core.py reads this)
    # Published checkpoints carry a multi-token-prediction head (mtp.*) that only a speculative
    # method ladle does not have would use: skipped at load, as vLLM does without MTP.
    ignored_prefixes: tuple[str, ...] = ("mtp.",)

    def __init__(self, hf_config: dict, tp: TPGroup | None = None):
        nn.Module.__init__(self)
        self.moe = self.read_moe(hf_config)
        cfg = read_hybrid_config(hf_config)
        self.tp, self.layout = tp, None
        if tp is not None:
            self.layout = shard_layout(cfg, tp.rank, tp.world_size)
            self.full_linear = cfg.linear  # the checkpoint's shapes (checkpoint_slice)
            cfg = replace(cfg, linear=_linear_shard(cfg.linear, tp.world_size))
        self.config = cfg
        lay = self.layout
        self.num_local_kv_heads = cfg.num_kv_heads if lay is None else lay.num_kv_heads
        self.embed_tokens, self.lm_head = vocab_layers(cfg, lay, tp)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(cfg, kind, self.make_mlp(i, hf_config), lay, tp)
            for i, kind in enumerate(cfg.layer_types))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = PartialRotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings,
                                             cfg.rope_theta, cfg.rope_scaling)

    @classmethod
    def read_moe(cls, hf: dict) -> MoeConfig | None:
        num = hf.get("num_experts", 512)
        if not num:
            return None
        return MoeConfig(num_experts=num, top_k=hf.get("num_experts_per_tok", 10),
                         intermediate_size=hf.get("moe_intermediate_size", 512),
                         norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                         float32_weights=False,
                         sparse_layers=_sparse_layers(hf, num, hf.get("decoder_sparse_step", 1),
                                                      list(hf.get("mlp_only_layers") or [])))

    def make_mlp(self, index: int, hf_config: dict) -> nn.Module:
        hidden = hf_config["hidden_size"]
        if self.moe is None or index not in self.moe.sparse_layers:
            return GatedMLP(hidden, hf_config["intermediate_size"] if self.layout is None
                            else self.layout.intermediate_size, tp=self.tp)
        return SharedExpertMoeBlock(hidden, self.moe, self.expert_slice(),
                                    self._split(self._shared_size(hf_config), "shared expert"),
                                    self.tp)

    @staticmethod
    def _shared_size(hf_config: dict) -> int:
        return hf_config.get("shared_expert_intermediate_size", 512)

    def _split(self, n: int, what: str) -> int:
        """This rank's share of a dimension of n."""
        if self.tp is None:
            return n
        if n % self.tp.world_size:
            raise ValueError(f"tensor_parallel_size: {self.tp.world_size} does not divide the "
                             f"{what}'s intermediate size ({n}); use a divisor")
        return n // self.tp.world_size

    def checkpoint_slice(self, pname: str, shard: int | None):
        """This rank's part of a checkpoint tensor: the gated attention's q rows (query and
        gate of its heads), the shared expert's slice, the linear layers' key heads (their q,
        k and v rows of in_proj_qkv and of the conv as parts, in that order)."""
        lay = self.layout
        if lay is None:
            return None
        module, kind = pname.rsplit(".", 2)[-2:]
        r = self.tp.rank
        if ".shared_expert." in pname:
            n = self.get_submodule(pname.rsplit(".", 2)[0]).down_proj.weight.shape[1]
            if module == "gate_up_proj":
                return 0, r * n, n
            return (1, r * n, n) if module == "down_proj" else None
        if module == "qkv_proj" and shard == 0:
            n = 2 * lay.num_heads * self.config.head_dim
            return 0, r * n, n
        if ".linear_attn." not in pname:
            return super().checkpoint_slice(pname, shard)
        full, mine = self.full_linear, self.config.linear
        kd, vd, nv = mine.key_dim, mine.value_dim, mine.num_v_heads
        if module in ("in_proj_qkv", "conv1d"):  # channels [all q | all k | all v]
            return [(0, r * kd, kd), (0, full.key_dim + r * kd, kd),
                    (0, 2 * full.key_dim + r * vd, vd)]
        if module in ("in_proj_qkvz", "in_proj_ba"):  # rows grouped by key head
            rows = self.get_submodule(pname.rsplit(".", 1)[0]).weight.shape[0]
            return 0, r * rows, rows
        if module == "in_proj_z":
            return 0, r * vd, vd
        if module in ("in_proj_b", "in_proj_a"):
            return 0, r * nv, nv
        if kind in ("dt_bias", "A_log"):
            return 0, r * nv, nv
        if module == "out_proj":
            return 1, r * vd, vd
        return None  # the gated norm's weight: one head's, shared

    def shard_sizes(self, module: str) -> list[int]:
        if module.endswith("self_attn.qkv_proj"):
            cfg, lay = self.config, self.layout
            heads, kv = (cfg.num_heads, cfg.num_kv_heads) if lay is None else \
                (lay.num_heads, lay.num_kv_heads)
            return [2 * heads * cfg.head_dim] + [kv * cfg.head_dim] * 2
        if module.endswith("gate_up_proj") and not self._is_expert(module):
            # the dense MLP's or the shared expert's: each is half the fused rows
            return [self.get_submodule(module).weight.shape[0] // 2] * 2
        return super().shard_sizes(module)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (text): the gated MLP on every layer; split in_proj_qkv / z / b / a."""

    @classmethod
    def read_moe(cls, hf: dict) -> None:
        return None


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE (text): experts with a shared expert on every layer, routing weights always
    renormalised."""

    @classmethod
    def read_moe(cls, hf: dict) -> MoeConfig:
        num = hf.get("num_experts", 256)
        return MoeConfig(num_experts=num, top_k=hf.get("num_experts_per_tok", 8),
                         intermediate_size=hf.get("moe_intermediate_size", 512),
                         norm_topk_prob=True, float32_weights=False,
                         sparse_layers=frozenset(range(hf["num_hidden_layers"])))



class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """A published Qwen3.5 checkpoint (image-text-to-text), served as its text model: the
    config's text_config (loader.text_model_config), the language model's tensors under
    model.language_model.; the vision tower (model.visual.) is not loaded, and a request with
    an image is refused by the API as for every model."""

    text_of_multimodal = True
    checkpoint_prefix = "model.language_model."
    ignored_prefixes = ("mtp.", "model.visual.")


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's published checkpoint, as Qwen3_5ForConditionalGeneration."""

    text_of_multimodal = True
    checkpoint_prefix = "model.language_model."
    ignored_prefixes = ("mtp.", "model.visual.")

def _linear_shard(cfg: GatedDeltaNetConfig, world_size: int) -> GatedDeltaNetConfig:
    """One rank's share of the linear layers: 1/N of the key heads and of the value heads."""
    if cfg.num_k_heads % world_size:
        raise ValueError(f"tensor_parallel_size: {world_size} does not divide the linear "
                         f"layers' key heads (linear_num_key_heads {cfg.num_k_heads}); use a "
                         "divisor")
    return replace(cfg, num_k_heads=cfg.num_k_heads // world_size,
                   num_v_heads=cfg.num_v_heads // world_size)
