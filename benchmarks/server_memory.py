"""Resident memory of a served model, Q4_K_M against bf16 (issue 21, line 6: a Q4_K_M server
<= 0.35x the same model in bf16), at more than one model size.

For each model, `ladle serve` of the bf16 safetensors checkpoint, then of its Q4_K_M file
(llama.cpp's converter, then its quantize API, as compare.py makes them), one server at a time,
each with the same flags (by default `--max-model-len 2048 --kv-cache-memory 512MiB`; more after
`--`). After one completion (a ~128-token prompt, 16 tokens out) it reads the resident memory
(VmRSS) of the API process and of the engine process, and the weight bytes the server reports
on /metrics (`ladle:model_weight_bytes`), and prints them with the ratio. The KV cache is
allocated whole at start, so it is resident in both servers alike.

Models (random weights, Qwen's tokenizer, built once into the ladle cache directory):
  0.6b: compare.py's Qwen3-0.6B shape (1.19 GB in bf16);
  8b:   Qwen3-8B's shapes (16.4 GB in bf16, written shard by shard; making its Q4_K_M file takes
        ~38 GB of disk for a while, its bf16 GGUF step deleted after; its bf16 server ~18 GB of
        memory).

    python benchmarks/server_memory.py [--models 0.6b,8b] [-- more ladle serve arguments]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

# Qwen3-8B's config.json (the shapes; the weights here are random).
QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
SHARD_BYTES = 4 << 30


def qwen3_8b_checkpoint() -> Path:
    """Random bf16 weights with Qwen3-8B's shapes and names, written a shard at a time (so at
    most one shard is in memory), with config.json and the safetensors index."""
    import torch
    from safetensors.torch import save_file

    from ladle.models.qwen_tokenizer import write_qwen_tokenizer

    root = Path(os.environ.get("LADLE_CACHE_DIR", Path.home() / ".cache" / "ladle"))
    path = root / "qwen3-8b-shaped-random"
    if (path / "model.safetensors.index.json").exists():
        return path
    c = QWEN3_8B
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (c["vocab_size"], h)}
    tmp = path.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        if size and size + 2 * n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += 2 * n
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in names.items():
            if len(shape) == 1:  # norms
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            weight_map[name] = file
            total += tensors[name].numel() * 2
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
         "hidden_act": "silu", "attention_bias": False, "bos_token_id": 151643,
         "eos_token_id": 151645, **c}, indent=1))
    write_qwen_tokenizer(tmp, c["max_position_embeddings"])
    tmp.rename(path)
    return path


def checkpoint(name: str) -> Path:
    if name == "0.6b":
        from throughput import qwen3_06b_checkpoint

        return qwen3_06b_checkpoint()
    if name == "8b":
        return qwen3_8b_checkpoint()
    raise SystemExit(f"--models: {name!r}; accepted: 0.6b, 8b")


def weight_bytes(url: str) -> int:
    """The sum of the server's ladle:model_weight_bytes gauge (every dtype)."""
    total = 0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("ladle:model_weight_bytes{"):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def measure(model: str, serve_args: list[str]) -> dict:
    """One server of `model` (a directory or a .gguf file) after one completion."""
    from memory_soak import rss_mib
    from test_server import API_KEY, RemoteServer

    server = RemoteServer("--api-key", API_KEY, "--disable-log-stats", "--dtype", "bfloat16",
                          *serve_args, model=model, timeout=1800)
    try:
        prompt = " ".join(["the river stone blue seven apple run north"] * 16)
        r = httpx.post(server.url + "/v1/completions", timeout=600,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"prompt": prompt, "max_tokens": 16, "temperature": 0})
        r.raise_for_status()
        time.sleep(2)  # the freed request buffers back to the allocator
        api = rss_mib(server.proc.pid)
        engines = [rss_mib(p) for p in server.engine_pids()]
        return {"api": api, "engine": sum(engines), "total": api + sum(engines),
                "weights": weight_bytes(server.url) / 2**20}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("serve_args", nargs="*",
                    help="after --: ladle serve arguments for both servers (default: "
                         "--max-model-len 2048 --kv-cache-memory 512MiB)")
    args = ap.parse_args()
    serve_args = args.serve_args or ["--max-model-len", "2048", "--kv-cache-memory", "512MiB"]
    import compare

    llama_py = compare.LLAMA_DIR / "venv" / "bin" / "python"
    if not llama_py.exists():
        raise SystemExit(f"llama.cpp's Python ({llama_py}) is missing: run "
                         "benchmarks/build_llama_cpp.sh first (its converter and quantize "
                         "make the Q4_K_M file)")
    rows = []
    for name in args.models.split(","):
        path = checkpoint(name)
        q4 = compare.quantized_gguf(path, "q4_k_m", llama_py)
        if name == "8b":  # the converter's bf16 file, only the way to Q4_K_M: 16 GB
            (path / "model-bf16.gguf").unlink(missing_ok=True)
        bf16 = measure(str(path), serve_args)
        quant = measure(str(q4), serve_args)
        rows.append((name, bf16, quant))
        print(json.dumps({"model": name, "bf16": bf16, "q4_k_m": quant}), flush=True)
    print(f"\nladle serve {' '.join(serve_args)}; resident MiB after one request (VmRSS)")
    print("| model | server | API | engine | total | weights | Q4_K_M / bf16 total "
          "| weights alone |")
    print("|---|---|---|---|---|---|---|---|")
    for name, b, q in rows:
        for label, m in (("bf16", b), ("Q4_K_M", q)):
            ratio = f"**{q['total'] / b['total']:.2f}x**" if m is q else ""
            weights = f"{q['weights'] / b['weights']:.2f}x" if m is q else ""
            print(f"| {name} | {label} | {m['api']:.0f} | {m['engine']:.0f} | {m['total']:.0f} "
                  f"| {m['weights']:.0f} | {ratio} | {weights} |")


if __name__ == "__main__":
    main()
