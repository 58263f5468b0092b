"""Mixture-of-experts decode (issue 25): ladle against llama.cpp on the same Qwen3-MoE-shaped
random checkpoint, and against a dense model of the same active size.

Checkpoints (random bf16 weights, Qwen's tokenizer, built once into the ladle cache directory):
  - moe: Qwen3-MoE, hidden 1024, 12 layers, 16 q / 8 KV heads of 128, 64 experts of 512
    (top 8, norm_topk_prob), tied 152k vocabulary: 1.43B weights, 0.38B active per token;
  - dense: Qwen3 with the same attention and vocabulary and one MLP of 8 x 512 = 4096: the MoE's
    active size, dense.
llama.cpp runs the bf16 GGUF that its own converter makes of each checkpoint (the same weights).
With --gguf q4_k_m, q3_k_m, q2_k, iq3_xxs or iq2_xxs, that GGUF is quantized by llama.cpp's
quantize (its default tensor-type mix for the type; the i-quants with a uniform importance
matrix, as compare.py makes them) and both systems run the quantized file (the 2-3 bit files
people run large MoE models from on CPU).

Cases, interleaved per repetition (medians reported), each system in its own process:
  - single-stream decode tok/s (64 tokens after a 128-token prompt) and TTFT;
  - 32 x (128 in, 128 out) output tok/s: ladle's LLM against llama-server with 32 slots (when
    benchmarks/build_llama_cpp.sh built it).
Printed: ladle MoE / llama.cpp MoE (single, batched; issue 25's targets >= 1.0x and >= 2x) and
ladle's MoE decode time per token / its dense-active decode time per token (target <= 1.5x).

    nice -n 19 benchmarks/build_llama_cpp.sh    # once
    python benchmarks/moe.py [--reps 2] [--skip-llama] [--skip-batch]
        [--gguf bf16|q4_k_m|q3_k_m|q2_k|iq3_xxs|iq2_xxs] [--llama-no-repack]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare  # noqa: E402  (the workers, the GGUF conversion and llama-server driving)

COMMON = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, rope_theta=1e6,
              rms_norm_eps=1e-6, tie_word_embeddings=True)
MOE = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True,
           intermediate_size=4096)


def build(kind: str) -> Path:
    def make():
        import torch
        import transformers as tf

        if kind == "moe":
            model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**COMMON, **MOE, dtype="bfloat16"))
        else:
            inter = MOE["num_experts_per_tok"] * MOE["moe_intermediate_size"]
            model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, intermediate_size=inter,
                                                       dtype="bfloat16"))
        return model.to(torch.bfloat16)

    return compare.random_checkpoint(f"qwen3-{kind}-bench-random", make,
                                     COMMON["max_position_embeddings"])


def med(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-batch", action="store_true")
    ap.add_argument("--gguf", choices=("bf16", "q4_k_m", "q3_k_m", "q2_k", "iq3_xxs", "iq2_xxs"),
                    default="bf16",
                    help="the file both systems run (bf16: ladle the safetensors checkpoint)")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp without its extra weight buffers (compare.py's flag)")
    args = ap.parse_args()
    if args.llama_no_repack:
        os.environ[compare.NO_REPACK_ENV] = "1"
    llama_py = compare.LLAMA_DIR / "venv" / "bin" / "python"
    has_llama = not args.skip_llama and llama_py.exists()
    has_server = (compare.LLAMA_DIR / "server-build" / "bin" / "llama-server").exists()
    print(f"cores={os.cpu_count()} load={os.getloadavg()[0]:.1f}; llama.cpp: "
          f"{'yes' if has_llama else 'no'}, llama-server: {'yes' if has_server else 'no'}",
          flush=True)
    paths = {k: build(k) for k in ("moe", "dense")}
    if args.gguf != "bf16":  # both systems on the quantized file
        if not llama_py.exists():
            sys.exit(f"--gguf {args.gguf} needs llama.cpp's quantize API: run "
                     "benchmarks/build_llama_cpp.sh")
        ggufs = {k: compare.quantized_gguf(p, args.gguf, llama_py) for k, p in paths.items()}
    else:
        ggufs = {k: compare.gguf(p, "bf16") for k, p in paths.items()} if has_llama else {}
    texts = compare.text_prompts(paths["moe"], compare.BATCH)
    ladle_files = paths if args.gguf == "bf16" else ggufs
    batch = not args.skip_batch
    results: dict[str, list[dict]] = {}
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    for rep in range(args.reps):
        print(f"repetition {rep + 1}/{args.reps}", flush=True)
        for kind, path in ladle_files.items():
            cases = "single,batch" if batch else "single"
            r = compare.run_worker(sys.executable, ["ladle", str(path), "bfloat16", cases, "-"])
            results.setdefault(f"ladle {kind}", []).append(r)
            print(f"  ladle {kind}: {r}", flush=True)
            if has_llama:
                r = compare.run_worker(str(llama_py), ["llama", str(ggufs[kind]), args.gguf,
                                                       "single"])
                if batch and has_server and kind == "moe":
                    b = compare.guarded(compare.server_llama, ggufs[kind], texts, compare.BATCH,
                                        compare.BATCH_OUT, 1, log_dir)
                    if b:
                        r["batch_tps"] = b["server_tps"]
                results.setdefault(f"llama.cpp {kind}", []).append(r)
                print(f"  llama.cpp {kind}: {r}", flush=True)

    print("\nmedians:")
    for system, runs in results.items():
        cells = {k: med(runs, k) for k in ("decode_tps", "ttft_ms", "batch_tps")}
        print(f"  {system:18s} " + "  ".join(f"{k} {v:.1f}" for k, v in cells.items()
                                              if v is not None))

    def ratio(a: str, b: str, key: str) -> str:
        x, y = med(results.get(a, []), key), med(results.get(b, []), key)
        return "n/a" if x is None or y is None else f"{x / y:.2f}x"

    print("\nratios:")
    print(f"  MoE single-stream decode, ladle / llama.cpp: "
          f"{ratio('ladle moe', 'llama.cpp moe', 'decode_tps')} (target >= 1.0x)")
    print(f"  MoE 32 x (128, 128), ladle / llama-server: "
          f"{ratio('ladle moe', 'llama.cpp moe', 'batch_tps')} (target >= 2x)")
    print(f"  ladle MoE decode cost per token / dense of the same active size: "
          f"{ratio('ladle dense', 'ladle moe', 'decode_tps')} (target <= 1.5x)")
    print(f"  llama.cpp the same: {ratio('llama.cpp dense', 'llama.cpp moe', 'decode_tps')}")


if __name__ == "__main__":
    main()
