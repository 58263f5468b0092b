"""gpt-oss (GptOssForCausalLM): the Llama decoder with q/k/v/o biases, a learned sink logit per
head that joins every attention softmax (paged_attention's `sinks`), sliding (128) and full
layers as `layer_types` alternates them, YaRN rope, and on every layer a mixture of experts:

- the router (with a bias) picks the top k experts by logit, then softmaxes those k logits;
- an expert's gate and up rows are interleaved (gate, up, gate, up, ...); the gate is clamped
  from above and the up from both sides at `swiglu_limit`, the output is
  (up + 1) * gate * sigmoid(alpha * gate), and both projections have biases.

Checkpoints stack each layer's experts in one tensor, stored transposed (`experts.gate_up_proj`
(E, hidden, 2I), `experts.down_proj` (E, I, hidden), and their biases); `unfused` serves them as
per-expert tensors. An expert holds its gate rows and its up rows as the two halves of one
`gate_up_proj` (the checkpoint's interleaved rows are split at load), as every gated MLP in
ladle does, so the loader's fused shards, tensor parallelism and quantized parts apply
unchanged. The published gpt-oss-20b/120b files hold the expert weights in MXFP4 instead
(`*_blocks` (E, out, in / 32, 16): 32 four-bit e2m1 values per block, low nibble first;
`*_scales` (E, out, in / 32): a power of two, 2^(s - 127), per block). On one CPU process they
stay 4-bit: `keep_mxfp4` repacks each expert's rows into ggml's MXFP4 blocks (the same E8M0
scale byte, the nibbles in ggml's order) as QuantWeights for the quantized kernels, before any
dense memory is allocated; elsewhere (`--quantization none`, `-tp`, another device) they are
dequantized at load. A
GGUF file (models/gguf/mapping.py) stores gate, up and down as separate stacked tensors with
separate biases, the MXFP4 blocks kept for the quantized kernels. Harmony, the format gpt-oss speaks, is the output side's (entrypoints/harmony.py,
parsers/harmony.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ladle.models.moe import MoeConfig, MoeForCausalLM, RoutedExperts
from ladle.runner.cpu_kernels import linear

if TYPE_CHECKING:
    from ladle.distributed.group import TPGroup

# transformers' GptOssConfig defaults, for fields a config.json leaves out.
DEFAULTS = {"attention_bias": True, "sliding_window": 128, "rms_norm_eps": 1e-5,
            "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0, "head_dim": 64, "max_position_embeddings": 131072}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


# The 16 values of an e2m1 (FP4) nibble.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
              -6.0)


def mxfp4_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF MXFP4 rows, blocks (R, G, 16) uint8 (byte k: value 2k in its low nibble, 2k + 1 in
    its high one) and scales (R, G), as ggml's MXFP4 rows (R, G * 17): per block the scale byte
    (ggml reads 2^(e - 128) times doubled e2m1 values: the same numbers), then byte j holding
    value j low and value j + 16 high."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales[..., None], packed], dim=-1).reshape(blocks.shape[0], -1)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """(..., G, 16) uint8 blocks with (..., G) uint8 scales -> (..., G * 32) float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 \
            or tuple(scales.shape) != tuple(blocks.shape[:-1]) or blocks.shape[-1] != 16:
        raise ValueError(f"tensor {name}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} "
                         f"with scales {tuple(scales.shape)} {scales.dtype}; accepted: uint8 "
                         "blocks (..., G, 16) and uint8 scales (..., G)")
    lut = torch.tensor(FP4_VALUES)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = torch.ldexp(values.reshape(*blocks.shape[:-1], 32),
                         (scales.to(torch.int32) - 127)[..., None])
    return values.reshape(*blocks.shape[:-2], -1)


class GptOssExpert(nn.Module):
    """One expert: `gate_up_proj` (the gate's rows, then the up's) and `down_proj`, both with
    biases. Under tensor parallelism only rank 0 adds the down bias, so the all-reduce counts it
    once."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float, down_bias: bool):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter)
        self.down_proj = nn.Linear(inter, hidden)
        self.alpha, self.limit, self.down_bias = alpha, limit, down_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return linear(h, self.down_proj.weight, self.down_proj.bias if self.down_bias else None)


class GptOssMoe(RoutedExperts):
    def __init__(self, hidden: int, moe: MoeConfig, inter: int, alpha: float, limit: float,
                 tp: TPGroup | None):
        super().__init__()
        self.moe, self.tp = moe, tp
        self.router = nn.Linear(hidden, moe.num_experts)
        self.router.keep_dense = True  # as SparseMoeBlock's gate: never int8
        first = tp is None or tp.rank == 0
        self.experts = nn.ModuleList(GptOssExpert(hidden, inter, alpha, limit, first)
                                     for _ in range(moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k logits, softmaxed among themselves (in the model dtype, as transformers)."""
        logits = linear(x, self.router.weight, self.router.bias)
        top, ids = torch.topk(logits, self.moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids


class GptOssForCausalLM(MoeForCausalLM):
    def __init__(self, hf_config: dict, tp: TPGroup | None = None):
        hf = {**DEFAULTS, **hf_config}
        if not (hf.get("rope_scaling") or hf.get("rope_parameters")):
            hf["rope_scaling"] = DEFAULT_ROPE
        self.swiglu = (float(hf["swiglu_alpha"]), float(hf["swiglu_limit"]))
        super().__init__(hf, tp)
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else
                                          "full_attention" for i in range(n)]
        if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"config.json: layer_types must list {n} of sliding_attention / "
                             f"full_attention; got {types}")
        heads = self.config.num_heads if self.layout is None else self.layout.num_heads
        for layer, kind in zip(self.layers, types, strict=True):
            attn = layer.self_attn
            attn.window = hf["sliding_window"] if kind == "sliding_attention" else None
            attn.sinks = nn.Parameter(torch.empty(heads))

    @classmethod
    def read_config(cls, hf_config, switches):
        from ladle.models.llama import DecoderConfig

        # Sliding windows are per layer here (set above), not one for every layer.
        return DecoderConfig.from_hf(hf_config, **switches)

    @classmethod
    def read_moe(cls, hf: dict) -> MoeConfig:
        n = hf["num_hidden_layers"]
        return MoeConfig(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                         intermediate_size=hf["intermediate_size"], norm_topk_prob=False,
                         float32_weights=False, sparse_layers=frozenset(range(n)))

    def make_mlp(self, index: int, hf_config: dict) -> nn.Module:
        return GptOssMoe(self.config.hidden_size, self.moe, self.expert_slice(), *self.swiglu,
                         self.tp)

    def unfused(self, name: str, shape: tuple | None, sibling=None) -> list | None:
        """A layer's stacked experts as per-expert tensors, from either layout:

        - the HF checkpoint's `experts.gate_up_proj` (E, hidden, 2I) with gate and up columns
          interleaved, `down_proj` (E, I, hidden), their biases (E, 2I) and (E, hidden), or the
          weights as MXFP4 `*_blocks` with `*_scales` (read beside them through `sibling`);
        - a GGUF file's `experts.{gate,up,down}_proj.{weight,bias}` (E, out, in) and (E, out),
          as models/gguf/mapping.py names them.

        Weights come out as nn.Linear's (out, in): gate and up as the two shards of the
        expert's gate_up_proj."""
        stem, _, kind = name.rpartition(".")
        if kind in ("weight", "bias") and stem.endswith(("experts.gate_proj", "experts.up_proj",
                                                         "experts.down_proj")):
            stem, _, proj = stem.rpartition(".")  # GGUF: expert e is row block e
            num = self.moe.num_experts if shape is None else shape[0]
            sub = None if shape is None else tuple(shape[1:])
            return [(f"{stem}.{e}.{proj}.{kind}", sub, e) for e in range(num)]
        if not stem.endswith(".experts"):
            return None
        if kind in ("gate_up_proj_scales", "down_proj_scales"):
            return []  # read with their blocks
        num = self.moe.num_experts if shape is None else shape[0]
        if kind in ("gate_up_proj_blocks", "down_proj_blocks"):
            return self._mxfp4_parts(stem, kind.removesuffix("_blocks"), num, shape, sibling)
        if kind == "gate_up_proj":  # (E, hidden, 2I): column 2i is gate row i, 2i + 1 up row i
            sub = None if shape is None else (shape[2] // 2, shape[1])
            return [(f"{stem}.{e}.{proj}.weight", sub, lambda t, e=e, i=i: t[e][:, i::2].t())
                    for e in range(num) for i, proj in enumerate(("gate_proj", "up_proj"))]
        if kind == "gate_up_proj_bias":
            sub = None if shape is None else (shape[1] // 2,)
            return [(f"{stem}.{e}.{proj}.bias", sub, lambda t, e=e, i=i: t[e][i::2])
                    for e in range(num) for i, proj in enumerate(("gate_proj", "up_proj"))]
        if kind == "down_proj":  # (E, I, hidden)
            sub = None if shape is None else (shape[2], shape[1])
            return [(f"{stem}.{e}.down_proj.weight", sub, lambda t, e=e: t[e].t())
                    for e in range(num)]
        if kind == "down_proj_bias":
            sub = None if shape is None else (shape[1],)
            return [(f"{stem}.{e}.down_proj.bias", sub, e) for e in range(num)]
        return None

    def _mxfp4_parts(self, stem: str, base: str, num: int, shape: tuple | None,
                     sibling) -> list:
        """MXFP4 `{base}_blocks` (E, out, in / 32, 16): each expert's rows dequantized with
        their scales; gate_up's interleaved rows split into the gate and up shards."""
        scales: list[torch.Tensor] = []  # read once, for all experts

        def rows(blocks: torch.Tensor, e: int, pick: slice) -> torch.Tensor:
            if not scales:
                scales.append(sibling(f"{stem}.{base}_scales"))
            return dequantize_mxfp4(blocks[e][pick], scales[0][e][pick],
                                    f"{stem}.{base}_blocks")

        full = None if shape is None or len(shape) != 4 else shape[2] * 32
        if base == "down_proj":
            sub = None if full is None else (shape[1], full)
            return [(f"{stem}.{e}.down_proj.weight", sub,
                     lambda t, e=e: rows(t, e, slice(None))) for e in range(num)]
        sub = None if full is None else (shape[1] // 2, full)
        return [(f"{stem}.{e}.{proj}.weight", sub, lambda t, e=e, i=i: rows(t, e, slice(i, None, 2)))
                for e in range(num) for i, proj in enumerate(("gate_proj", "up_proj"))]

    def keep_mxfp4(self, read, dtype: torch.dtype) -> int:
        """Install each expert's gate|up and down as QuantWeights of its MXFP4 rows, repacked
        from the checkpoint's `*_blocks` / `*_scales` (read(name) -> tensor or None); the loader
        then skips those tensors (the weights are no parameters any more). Returns the number
        of stacked tensors kept (0: the checkpoint's experts are not MXFP4)."""
        from ladle.runner.quant import MXFP4, QuantPart, QuantWeight, install

        prefix = getattr(self, "checkpoint_prefix", "model.")
        kept = 0
        for name, block in self.named_modules():
            if not isinstance(block, GptOssMoe):
                continue
            stem = f"{prefix}{name}.experts"
            stored = {}
            for base in ("gate_up_proj", "down_proj"):
                blocks, scales = read(f"{stem}.{base}_blocks"), read(f"{stem}.{base}_scales")
                if blocks is None:
                    return kept
                if scales is None or blocks.dtype != torch.uint8 or blocks.dim() != 4 \
                        or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]) \
                        or scales.dtype != torch.uint8:
                    raise ValueError(
                        f"tensor {stem}.{base}_blocks: MXFP4 blocks "
                        f"{tuple(blocks.shape)} {blocks.dtype} with scales "
                        f"{None if scales is None else (tuple(scales.shape), scales.dtype)}; "
                        "accepted: uint8 blocks (E, out, in / 32, 16) and uint8 scales "
                        "(E, out, in / 32)")
                stored[base] = blocks, scales
                kept += 1
            for e, expert in enumerate(block.experts):
                b, sc = stored["gate_up_proj"]
                parts = [QuantPart(MXFP4, mxfp4_to_ggml(b[e][i::2], sc[e][i::2]))
                         for i in (0, 1)]  # gate rows, then up rows
                gu = expert.gate_up_proj
                if sum(p.rows for p in parts) != gu.out_features or \
                        b.shape[2] * 32 != gu.in_features:
                    raise ValueError(f"tensor {stem}.gate_up_proj_blocks has shape "
                                     f"{tuple(b.shape)}; the config needs "
                                     f"({len(block.experts)}, {gu.out_features}, "
                                     f"{gu.in_features // 32}, 16)")
                install(gu, "weight", QuantWeight(parts, gu.in_features, dtype))
                b, sc = stored["down_proj"]
                down = expert.down_proj
                if b.shape[1] != down.out_features or b.shape[2] * 32 != down.in_features:
                    raise ValueError(f"tensor {stem}.down_proj_blocks has shape "
                                     f"{tuple(b.shape)}; the config needs "
                                     f"({len(block.experts)}, {down.out_features}, "
                                     f"{down.in_features // 32}, 16)")
                install(down, "weight", QuantWeight([QuantPart(MXFP4, mxfp4_to_ggml(
                    b[e], sc[e]))], down.in_features, dtype))
        return kept

    def checkpoint_slice(self, pname: str, shard: int | None):
        if self.layout is not None and pname.endswith("self_attn.sinks"):
            h = self.layout.num_heads
            return 0, self.tp.rank * h, h
        # Experts: gate/up shards split by rows (weights and biases), down by columns, the down
        # bias whole (added on rank 0 only); the rest as the Llama decoder.
        return super().checkpoint_slice(pname, shard)
