"""`ladle-demo` as other families, for running the server test matrix against them (issue 25):
`LADLE_TEST_MODEL=moe` or `=mistral` makes tests/test_server.py's servers serve that variant
under the name `ladle-demo`. Each keeps ladle-demo's embeddings, head and structural prior,
tokenizer, chat template and generation config:

- moe: Qwen3-MoE, each layer's MLP replaced by 8 experts of 384 (top 2, renormalised), each
  expert's rows taken from the demo MLP's and scaled so the block adds an update of the demo's
  size; no expert writes residual dimension 0, which carries the demo's per-token prior;
- mistral: Mistral (no q/k norms) with a 64-token sliding window on every layer."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ladle.models.demo import default_cache_dir, demo_config, demo_state_dict, ensure_demo_model

NUM_EXPERTS, TOP_K, EXPERT_SIZE = 8, 2, 384
VARIANTS = ("moe", "mistral")


def ensure_demo_variant(kind: str) -> str:
    if kind not in VARIANTS:
        raise ValueError(f"LADLE_TEST_MODEL={kind!r}; accepted: {', '.join(VARIANTS)}")
    final = default_cache_dir() / f"ladle-demo-{kind}-v1"
    if (final / "model.safetensors").is_file():
        return str(final)
    demo = Path(ensure_demo_model())
    weights = demo_state_dict(demo_config())
    config = (_moe if kind == "moe" else _mistral)(weights)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / name, tmp / name)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _mistral(weights: dict) -> dict:
    for name in [n for n in weights if n.endswith(("q_norm.weight", "k_norm.weight"))]:
        del weights[name]
    return demo_config() | {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                            "sliding_window": 64}


def _moe(weights: dict) -> dict:
    config = demo_config() | {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "num_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True,
        "moe_intermediate_size": EXPERT_SIZE, "decoder_sparse_step": 1, "mlp_only_layers": []}
    gen = torch.Generator().manual_seed(1)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        gate, up, down = (weights.pop(p + f"{n}_proj.weight").float()
                          for n in ("gate", "up", "down"))
        weights[p + "gate.weight"] = (torch.randn(NUM_EXPERTS, hidden, generator=gen)
                                      * hidden**-0.5).to(torch.bfloat16)
        for e in range(NUM_EXPERTS):
            rows = torch.randperm(inter, generator=gen)[:EXPERT_SIZE]
            q = f"{p}experts.{e}."
            weights[q + "gate_proj.weight"] = gate[rows].to(torch.bfloat16)
            weights[q + "up_proj.weight"] = up[rows].to(torch.bfloat16)
            # A half-width MLP's output is ~sqrt(1/2) of the full one: scale it back.
            weights[q + "down_proj.weight"] = (down[:, rows] * (inter / EXPERT_SIZE) ** 0.5
                                               ).to(torch.bfloat16)
    return config
