"""The Llama decoder, which Qwen2 and Qwen3 specialise with a few switches.

Tokens of all sequences in a step are flattened into one (T,) stream; attention splits them back
into sequences through the AttentionMetadata that the model runner builds once per step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ladle.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from ladle.runner import cpu_kernels
from ladle.runner.attention import AttentionMetadata, paged_attention
from ladle.runner.cpu_kernels import linear
from ladle.runner.quant import QuantWeight

if TYPE_CHECKING:
    from ladle.distributed.group import TPGroup
    from ladle.distributed.pipeline import PipelineStage


def decoder_forward(model, input_ids, positions, meta: AttentionMetadata,
                    kv_caches) -> torch.Tensor | None:
    """The decoder's forward over the model's parts (embed, run_layer, final_norm): the whole
    model, or as one pipeline stage, its layers between receiving the residual stream from the
    previous stage (or embedding, on the first) and sending it to the next (or the final norm,
    on the last; the other stages return None)."""
    stage = model.pp
    if stage is None:
        x, residual = model.embed(input_ids), None
        stack = decode_stack(model, x, meta, kv_caches)
        if stack is not None:  # the same kernels in the same order, without Python between
            d = meta.decode
            out = stack[0].run(x, positions, stack[1], d.block_table, d.ctx_lens,
                               meta.slot_blocks, meta.slot_offsets,
                               [c[0] for c in kv_caches], [c[1] for c in kv_caches],
                               cpu_kernels.batch_invariant())
            # The stack ran the final norm too where it mirrors the model's (stack_final_norm).
            return out[0] if len(out) == 1 else model.final_norm(*out)
        for i, kv_cache in enumerate(kv_caches):
            x, residual = model.run_layer(i, x, residual, positions, meta, kv_cache)
        return model.final_norm(x, residual)
    if stage.first:
        start = time.time()
        x, residual = model.embed(input_ids), None
    else:
        x, residual = stage.recv(input_ids.shape[0], model.config.hidden_size,
                                 model.pp_dtype, input_ids.device, model.has_residual)
        start = time.time()
    for i in stage.layers:
        x, residual = model.run_layer(i, x, residual, positions, meta, kv_caches[i])
    if not stage.last:
        stage.computed(start)
        stage.send(x, residual)
        return None
    x = model.final_norm(x, residual)
    stage.computed(start)
    return x


def decode_stack(model, x: torch.Tensor, meta: AttentionMetadata, kv_caches):
    """(DecodeStack, its rope tables) to run all of `model`'s layers for this step in one C++
    call (csrc/decode_stack.cpp), or None for the Python loop. It applies when every row of the
    step decodes and the model's `build_decode_stack` mirrors its layers (LlamaForCausalLM's
    own with gated MLPs or SparseMoeBlock experts: Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE,
    Mixtral; Gemma 2 and 3; one process, CPU kernels); built on the first such step."""
    d = meta.decode
    if d is None or meta.prefills or d.rows.shape[0] != x.shape[0] or meta.states is not None:
        return None
    stack = model._decode_stack
    if stack is None:
        contiguous = all(c.is_contiguous() for pair in kv_caches for c in pair)
        stack = model._decode_stack = contiguous and model.build_decode_stack() or False
    if stack is False:
        return None
    decode, tables, dtype, row_limit = stack
    if (x.dtype != dtype or not x.is_contiguous() or kv_caches[0][0].dtype != dtype
            or (x.shape[0] > row_limit and not cpu_kernels.batch_invariant())):
        return None
    return decode, tables


def stack_kernels(model, dtype: torch.dtype, rotaries: list):
    """The kernel module when a DecodeStack can run `model` in `dtype` with these rotary
    embeddings (one process, CPU, float32 tables), else None."""
    if (model.tp is not None or model.pp is not None or dtype not in (torch.bfloat16, torch.float32)
            or any(type(r) is not RotaryEmbedding or r.cos.dtype != torch.float32
                   or r.cos.device.type != "cpu" for r in rotaries)):
        return None
    kernels = cpu_kernels.load_cpu_kernels()
    return kernels if kernels is not None and hasattr(kernels, "DecodeStack") else None


def stack_final_norm(model, stack, norm_type: type, weight: torch.Tensor) -> None:
    """Give the DecodeStack the model's final norm when `model.final_norm` is
    LlamaForCausalLM's (self.norm(x, residual)) and the norm is a `norm_type` it mirrors;
    `weight`: the norm's kernel weight (Gemma: its float32 scale)."""
    norm = model.norm
    if (type(model).final_norm is LlamaForCausalLM.final_norm and type(norm) is norm_type
            and norm.eps == model.config.rms_norm_eps and norm.weight.device.type == "cpu"):
        stack.set_final_norm(weight)


def stack_linear(module: nn.Linear, dtype: torch.dtype) -> tuple | None:
    """A DecodeStack's spec of a linear: (dense weight or None, bias or None, block parts, their
    types, scales, first columns, N, rotation block or 0), run as cpu_kernels.linear runs it;
    None where it cannot."""
    w, b = module.weight, module.bias
    b = None if b is None else b.detach()
    if b is not None and (b.dtype != dtype or not b.is_contiguous()):
        return None
    if isinstance(w, QuantWeight):  # quant_linear: one quant_matmul over the block parts
        if not w.on_cpu or w.dtype != dtype or w._dense:
            return None
        return (None, b, *w._kernel_args, w.shape[0], w.rotation)
    if w.dtype != dtype or not w.is_contiguous() or w.device.type != "cpu":
        return None
    return (w.detach(), b, [], [], [], [], w.shape[0], 0)


def stack_row_limit(specs: list[tuple], dtype: torch.dtype) -> int:
    """The most rows a DecodeStack of these linears takes: a dense weight runs the small-M
    kernel only up to max_linear_rows (above, `linear` takes torch's GEMM), blocks any."""
    dense = any(s is not None and s[0] is not None for s in specs)
    return cpu_kernels.max_linear_rows(dtype) if dense else 1 << 62


def _moe_spec(block, dtype: torch.dtype) -> tuple | None:
    """The DecodeStack's spec of a SparseMoeBlock whose experts run fused (stacked dense or
    GGUF blocks, SparseMoeBlock.fused), else None (its per-expert loop stays in Python)."""
    router = stack_linear(block.gate, dtype)
    if router is None or block.tp is not None:
        return None
    if block.quant_stacked is not None:
        gate, gate_type, up, up_type, down, down_type = block.quant_stacked
        if gate.device.type != "cpu":
            return None
        experts = (None, None, 0, [gate, up, down], [gate_type, up_type, down_type])
    elif block.stacked is not None and block.stacked[0].dtype == dtype:
        experts = (*block.stacked, cpu_kernels.max_linear_rows(dtype), [], [])
    else:
        return None
    cfg = block.moe
    return (router, cfg.top_k, cfg.norm_topk_prob, cfg.float32_weights, *experts)


@dataclass(slots=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v only
    o_bias: bool = False  # Llama's `attention_bias` also covers o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 normalises each head of q and k before rotary
    sliding_window: int | None = None  # every layer attends to its last `sliding_window` tokens

    @classmethod
    def from_hf(cls, hf: dict, **switches) -> DecoderConfig:
        """Read a published config.json. Older files carry rope_theta/rope_scaling at the top
        level; transformers 5 writes them inside rope_parameters. Both are accepted."""
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling") or rope or None
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if hf.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported by ladle")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **switches,
        )


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one tensor-parallel rank holds: its q heads, its KV heads (replicated when there
    are fewer KV heads than ranks), its slice of the MLP and of the (padded) vocabulary."""

    rank: int
    world_size: int
    num_heads: int  # q heads on this rank
    num_kv_heads: int  # KV heads on this rank (its KV cache holds only these)
    kv_head_start: int  # index of its first KV head in the checkpoint
    intermediate_size: int
    vocab_per_rank: int  # ceil(vocab / world_size): the last rank's slice is zero-padded


def shard_layout(cfg: DecoderConfig, rank: int, world_size: int) -> ShardLayout:
    """Split the model over `world_size` ranks, or say which dimension does not divide.
    KV heads replicate (as in vLLM) when world_size is a multiple of num_key_value_heads; the
    vocabulary is padded to a multiple of world_size (padded logits are dropped on rank 0)."""
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size: {world_size} does not divide the model's "
                         f"num_attention_heads ({heads}); use a divisor of it")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size: {world_size} neither divides the model's "
                         f"num_key_value_heads ({kv_heads}) nor is a multiple of it (KV heads "
                         "are split, or replicated when there are fewer than ranks)")
    if cfg.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size: {world_size} does not divide the model's "
                         f"intermediate_size ({cfg.intermediate_size})")
    if kv_heads >= world_size:
        num_kv = kv_heads // world_size
        kv_start = rank * num_kv
    else:  # each KV head is held by world_size // kv_heads consecutive ranks
        num_kv, kv_start = 1, rank // (world_size // kv_heads)
    return ShardLayout(rank, world_size, heads // world_size, num_kv, kv_start,
                       cfg.intermediate_size // world_size, -(-cfg.vocab_size // world_size))


def vocab_layers(cfg, lay: ShardLayout | None, tp: TPGroup | None):
    """(embedding, lm_head or None when tied) of this rank: the whole vocabulary, or with a
    layout this rank's zero-padded slice of it. `cfg` needs vocab_size, hidden_size and
    tie_word_embeddings (DecoderConfig and GemmaConfig both have them)."""
    num_vocab = cfg.vocab_size if lay is None else lay.vocab_per_rank
    if lay is None:
        # Built without nn.Embedding's random init, which the checkpoint overwrites anyway: on
        # the meta device its normal_() runs a torch._refs kernel that imports torch._dynamo
        # (1.1 s of the engine's start) and with it triton.
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                             _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
    else:
        embed = VocabParallelEmbedding(num_vocab, cfg.hidden_size, lay.rank * num_vocab, tp)
    # Tied: the embedding matrix doubles as the output projection.
    head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, num_vocab, bias=False)
    return embed, head


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layout: ShardLayout | None = None,
                 tp: TPGroup | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if layout is not None:  # column-parallel q/k/v: this rank's heads only
            self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.tp = tp
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # q, k and v share one matmul; the loader writes the three checkpoint tensors into slices.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.sliding_window
        self.register_parameter("sinks", None)  # gpt-oss's per-head sink logits (gpt_oss.py)

    def forward(self, x, positions, rotary, meta: AttentionMetadata, kv_cache):
        T = x.shape[0]
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = rotary.with_qk_norm(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window,
                              sinks=self.sinks)  # (T, H, D)
        if self.tp is None:
            return linear(out.reshape(T, self.q_size), self.o_proj.weight, self.o_proj.bias)
        # Row-parallel: each rank's heads give a partial sum; the bias is added once, after it.
        y = self.tp.all_reduce(linear(out.reshape(T, self.q_size), self.o_proj.weight, None))
        return y if self.o_proj.bias is None else y + self.o_proj.bias


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layout: ShardLayout | None = None,
                 tp: TPGroup | None = None, mlp: nn.Module | None = None):
        """`mlp`: the feed-forward block (a family's own, such as a mixture of experts); by
        default the gated MLP of the config's intermediate size."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layout, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if mlp is None:
            intermediate = cfg.intermediate_size if layout is None else layout.intermediate_size
            mlp = GatedMLP(cfg.hidden_size, intermediate, bias=cfg.mlp_bias, tp=tp)
        self.mlp = mlp

    def forward(self, x, residual, positions, rotary, meta, kv_cache):
        """Returns (this layer's MLP output, the residual stream before it). The residual add is
        deferred into the next norm, so each add and norm is one pass (same sums, same order as
        `x = x + f(norm(x))`)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """With `tp`, this process's shard of the model for rank tp.rank (ShardLayout says which);
    forward then all-reduces inside, and compute_logits returns the full logits on rank 0 only.
    Without it, the whole model and no distributed code at all."""

    switches: dict = {}

    def __init__(self, hf_config: dict, tp: TPGroup | None = None):
        super().__init__()
        if hf_config.get("mlp_bias") or hf_config.get("attention_bias"):
            switches = {**self.switches, "mlp_bias": bool(hf_config.get("mlp_bias"))}
            if hf_config.get("attention_bias"):
                switches.update(qkv_bias=True, o_bias=True)
        else:
            switches = dict(self.switches)
        cfg = self.config = self.read_config(hf_config, switches)
        self.tp = tp
        self.layout = None if tp is None else shard_layout(cfg, tp.rank, tp.world_size)
        lay = self.layout
        # The heads this process's KV cache holds (the model runner sizes the cache with it).
        self.num_local_kv_heads = cfg.num_kv_heads if lay is None else lay.num_kv_heads
        self.embed_tokens, self.lm_head = vocab_layers(cfg, lay, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, lay, tp, self.make_mlp(i, hf_config))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    @classmethod
    def read_config(cls, hf_config: dict, switches: dict) -> DecoderConfig:
        """The decoder's dimensions from config.json; a family with more fields reads them
        here."""
        return DecoderConfig.from_hf(hf_config, **switches)

    def make_mlp(self, index: int, hf_config: dict) -> nn.Module | None:
        """Layer `index`'s feed-forward block; None: the config's gated MLP. Mixture-of-experts
        families return their experts' block on their sparse layers."""
        return None

    # A pipeline stage (distributed/pipeline.py) when this model is one; None: all layers.
    pp: PipelineStage | None = None
    # build_decode_stack's (DecodeStack, rope tables, dtype, row limit) once built by
    # decode_stack; False where it cannot run.
    _decode_stack = None
    # Whether the layers pass a residual stream beside x (what a pipeline stage sends on).
    has_residual = True

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """input_ids, positions: (T,). Returns final hidden states (T, hidden)."""
        return decoder_forward(self, input_ids, positions, meta, kv_caches)

    # The three parts of the forward that families specialise (decoder_forward runs them).
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def run_layer(self, index: int, x, residual, positions, meta, kv_cache):
        return self.layers[index](x, residual, positions, self.rotary, meta, kv_cache)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.norm(x, residual)[0]

    def build_decode_stack(self):
        """(DecodeStack, rope tables, dtype, row limit) running this model's layers as
        DecoderLayer.forward does (llama.py: decode_stack), or None when a layer is not one it
        mirrors (a family's own layer, norm or rotary; experts that loop in Python)."""
        from ladle.models.moe import SparseMoeBlock  # (moe.py builds on this module)

        layers = self.layers
        if type(self).run_layer is not LlamaForCausalLM.run_layer or \
                any(type(layer) is not DecoderLayer for layer in layers):
            return None
        cfg = self.config
        dtype = layers[0].input_layernorm.weight.dtype
        kernels = stack_kernels(self, dtype, [self.rotary])
        if kernels is None:
            return None
        stack = kernels.DecodeStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.rms_norm_eps, layers[0].self_attn.scale)
        specs = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if attn.q_norm is not None:
                norms += [attn.q_norm, attn.k_norm]
            if (type(attn) is not Attention or attn.sinks is not None
                    or attn.scale != layers[0].self_attn.scale
                    or (attn.num_heads, attn.num_kv_heads) != (cfg.num_heads, cfg.num_kv_heads)
                    or any(type(n) is not RMSNorm or n.eps != cfg.rms_norm_eps
                           or n.weight.dtype != dtype or n.weight.device.type != "cpu"
                           for n in norms)):
                return None
            qkv, o = stack_linear(attn.qkv_proj, dtype), stack_linear(attn.o_proj, dtype)
            gate_up = down = moe = None
            if type(mlp) is GatedMLP and mlp.activation == "silu" and mlp.tp is None:
                gate_up = stack_linear(mlp.gate_up_proj, dtype)
                down = stack_linear(mlp.down_proj, dtype)
                if gate_up is None or down is None:
                    return None
            elif type(mlp) is SparseMoeBlock:
                moe = _moe_spec(mlp, dtype)
                if moe is None:
                    return None
            else:
                return None
            if qkv is None or o is None:
                return None
            specs += [qkv, o, gate_up, down, moe and moe[0]]
            w = [n.weight.detach() for n in norms]
            stack.add_layer(w[0], w[1], None, None, *(w[2:] or (None, None)), True, 0,
                            attn.window or 0, 0.0, 0, qkv, o, gate_up, down, moe)
        if self.norm.weight.dtype == dtype:
            stack_final_norm(self, stack, RMSNorm, self.norm.weight.detach())
        return stack, [self.rotary.cos, self.rotary.sin], dtype, stack_row_limit(specs, dtype)

    def compute_logits(self, hidden: torch.Tensor,
                       indices: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits (N, vocab) at rows `indices` of hidden (T, hidden), or at every row; the head
        is the most expensive matmul, so it runs only on the positions that sample, never on
        every prompt token. Tensor-parallel: each rank computes its vocabulary slice and rank 0
        gets them joined (other ranks get None)."""
        if indices is not None:
            hidden = hidden[indices]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight)
        if self.tp is None:
            return logits
        return self.tp.gather_vocab(logits, self.config.vocab_size)

    # Checkpoint names that map into a fused parameter: name fragment -> (fused, shard index).
    stacked = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def shard_sizes(self, module: str) -> list[int]:
        """Rows of each checkpoint tensor inside the fused parameter of `module` (its dotted
        name, "layers.0.self_attn.qkv_proj"): this rank's part."""
        cfg, lay = self.config, self.layout
        fused = module.rsplit(".", 1)[-1]
        heads, kv_heads = (cfg.num_heads, cfg.num_kv_heads) if lay is None else \
            (lay.num_heads, lay.num_kv_heads)
        if fused == "qkv_proj":
            return [heads * cfg.head_dim] + [kv_heads * cfg.head_dim] * 2
        return [cfg.intermediate_size if lay is None else lay.intermediate_size] * 2

    def checkpoint_slice(self, pname: str, shard: int | None) -> tuple[int, int, int] | None:
        """The part (dim, start, length) of the checkpoint tensor loaded into parameter `pname`
        (its `shard` for a fused one) that this rank holds; None: all of it. A slice past the
        end of the vocabulary is zero-padded by the loader."""
        lay = self.layout
        if lay is None:
            return None
        module, kind = pname.rsplit(".", 2)[-2:]
        d = self.config.head_dim
        if module == "qkv_proj":
            if shard == 0:
                return 0, lay.rank * lay.num_heads * d, lay.num_heads * d
            return 0, lay.kv_head_start * d, lay.num_kv_heads * d
        if module == "gate_up_proj":
            return 0, lay.rank * lay.intermediate_size, lay.intermediate_size
        if kind == "weight" and module in ("o_proj", "down_proj"):  # row-parallel: input dim
            n = lay.num_heads * d if module == "o_proj" else lay.intermediate_size
            return 1, lay.rank * n, n
        if module in ("embed_tokens", "lm_head"):
            return 0, lay.rank * lay.vocab_per_rank, lay.vocab_per_rank
        return None
