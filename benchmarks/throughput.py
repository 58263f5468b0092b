"""Offline throughput: ladle against transformers on the same requests, in one script.

64 requests, prompt lengths drawn from 32..512, output lengths from 16..256 (fixed seed,
ignore_eos), on a random-weight checkpoint shaped like Qwen3-0.6B in bfloat16. Peers:
transformers' static padded `generate` and its continuous-batching manager. Also reports
single-request decode tokens/s and time to first token for a 128-token prompt.

    python benchmarks/throughput.py [--num-requests 64] [--skip-static] [--skip-cb]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch

QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def qwen3_06b_checkpoint() -> Path:
    """Random weights with Qwen3-0.6B's shapes, built once into the ladle cache directory."""
    root = Path(os.environ.get("LADLE_CACHE_DIR", Path.home() / ".cache" / "ladle"))
    path = root / "qwen3-0.6b-shaped-random"
    if (path / "model.safetensors").exists():
        return path
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3Config(**QWEN3_06B, torch_dtype="bfloat16")
    with torch.device("cpu"):
        model = tf.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    from ladle.models.qwen_tokenizer import write_qwen_tokenizer

    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp)
    write_qwen_tokenizer(tmp, QWEN3_06B["max_position_embeddings"])
    tmp.rename(path)
    return path


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 100000) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    outputs = [rng.randint(16, 256) for _ in range(n)]
    return prompts, outputs


def bench_ladle(path, prompts, outputs):
    from ladle import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=len(prompts), max_model_len=1024,
              max_num_batched_tokens=2048, kv_cache_memory="4GiB")
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=4))  # warm-up
    t = time.perf_counter()
    res = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    assert n_out == sum(outputs)
    # Single request: TTFT of a 128-token prompt, then decode speed.
    p128 = prompts[0][:128]
    t = time.perf_counter()
    llm.generate([p128], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([p128], SamplingParams(temperature=0, max_tokens=65, ignore_eos=True))
    single = 64 / (time.perf_counter() - t - ttft)
    return n_out / dt, single, ttft


def hf_model(path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


@torch.inference_mode()
def bench_hf_static(model, prompts, outputs, batch_size):
    """Left-padded batches of `generate`; every request in a batch runs to the batch's longest
    output, and only the tokens each request asked for are counted."""
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ps, outs = prompts[i : i + batch_size], outputs[i : i + batch_size]
        L = max(map(len, ps))
        ids = torch.tensor([[0] * (L - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outs),
                       min_new_tokens=max(outs), do_sample=False, pad_token_id=0)
    return sum(outputs) / (time.perf_counter() - t)


@torch.inference_mode()
def bench_hf_cb(model, prompts, outputs):
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1,
                           pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    t = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, outputs, strict=True)):
        manager.add_request(p, request_id=str(i), max_new_tokens=m)
    n = 0
    for _ in prompts:
        r = manager.get_result(timeout=3600)
        n += len(r.generated_tokens)
    dt = time.perf_counter() - t
    manager.stop(block=True)
    return n / dt


@torch.inference_mode()
def bench_hf_single(model, prompt):
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=65, min_new_tokens=65, do_sample=False, pad_token_id=0)
    return 64 / (time.perf_counter() - t - ttft), ttft


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--static-batch", type=int, default=16, help="transformers generate batch")
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--skip-cb", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = qwen3_06b_checkpoint()
    prompts, outputs = workload(args.num_requests)
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {sum(outputs)} "
          f"output tokens, threads={torch.get_num_threads()}")
    tput, single, ttft = bench_ladle(path, prompts, outputs)
    print(f"ladle:            {tput:8.1f} output tok/s | single request {single:5.1f} tok/s, "
          f"TTFT(128) {ttft * 1000:6.0f} ms", flush=True)
    model = hf_model(path)
    peers = {}
    hf_single, hf_ttft = bench_hf_single(model, prompts[0][:128])
    print(f"transformers single request {hf_single:5.1f} tok/s, TTFT(128) {hf_ttft * 1000:6.0f} ms",
          flush=True)
    if not args.skip_static:
        peers["generate"] = bench_hf_static(model, prompts, outputs, args.static_batch)
        print(f"transformers generate (batch {args.static_batch}): {peers['generate']:8.1f} tok/s",
              flush=True)
    if not args.skip_cb:
        peers["continuous batching"] = bench_hf_cb(model, prompts, outputs)
        print(f"transformers continuous batching: {peers['continuous batching']:8.1f} tok/s",
              flush=True)
    if peers:
        best = max(peers, key=peers.get)
        print(f"ratio ladle / best transformers ({best}): {tput / peers[best]:.2f}x")
    print(f"ratio single-request decode ladle / transformers: {single / hf_single:.2f}x")


if __name__ == "__main__":
    main()
