"""What parallelism costs on this host, on the Qwen3-0.6B-shaped random checkpoint (bfloat16).

Tensor parallel: -tp 2 (1 torch thread per rank) against -tp 1 (2 threads), the same greedy
requests; throughput ratio, and rank 0's per-step all-reduce count, bytes and time (measured
in TPGroup) next to the step time. On a 2-core host TP cannot speed anything up; the numbers
say what the split costs, and docs/scaling.md turns the bytes into when TP pays elsewhere.

Pipeline parallel (--part pp): -pp 2 (1 torch thread per stage) against -pp 1 (2 threads),
`--num-requests` (default 8 here) concurrent greedy requests. Each stage records when it computed
(LADLE_PP_TRACE); printed: each stage's busy share of the run, the share of the time when both
were busy (the overlap the micro-batches buy), bytes sent between the stages per token, and
whether the tokens equal -pp 1's.

Data parallel (--part dp): `ladle serve --data-parallel-size 2` (half the cores per engine)
against one engine on all cores and against one engine on half the cores, 32 concurrent
streams (benchmarks/parallel_dp.py).

    python benchmarks/parallel.py [--part tp|pp|dp|all] [--num-requests 4] [--prompt-len 128]
                                  [--output-len 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import QWEN3_06B, qwen3_06b_checkpoint  # noqa: E402


def all_reduce_bytes_per_token(hidden: int, num_layers: int, elem: int) -> int:
    """Per token and step: one all-reduce of the embedding, then two per layer (after o_proj
    and after down_proj), each a `hidden`-wide row."""
    return (1 + 2 * num_layers) * hidden * elem


def run_tp(path: Path, tp: int, threads: int, prompts, output_len: int) -> dict:
    from ladle import LLM, SamplingParams

    torch.set_num_threads(threads)  # tp > 1: each rank takes cores // tp (the engine's rule)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=1024, max_num_seqs=len(prompts),
              kv_cache_memory="1GiB", tensor_parallel_size=tp)
    try:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up
        group = llm.engine.model_group.tp if tp > 1 else None
        if group is not None:
            group.num_all_reduces, group.all_reduce_bytes, group.all_reduce_seconds = 0, 0, 0.0
        steps0 = llm.engine.num_steps
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t
        steps = llm.engine.num_steps - steps0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "tok_s": n_out / dt, "steps": steps, "step_ms": 1e3 * dt / steps,
            "ar_per_step": group.num_all_reduces / steps if group else 0.0,
            "ar_bytes_per_step": group.all_reduce_bytes / steps if group else 0.0,
            "ar_ms_per_step": 1e3 * group.all_reduce_seconds / steps if group else 0.0,
        }
    finally:
        llm.close()


def bench_tensor_parallel(args) -> None:
    import random

    path = qwen3_06b_checkpoint()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(args.prompt_len)]
               for _ in range(args.num_requests)]
    one = run_tp(path, 1, 2, prompts, args.output_len)
    two = run_tp(path, 2, 1, prompts, args.output_len)
    # One process with one thread: separates the cost of the split from that of two OpenMP
    # threads on contended cores (a parallel region waits for its slowest thread).
    single = run_tp(path, 1, 1, prompts, args.output_len)
    hidden, layers = QWEN3_06B["hidden_size"], QWEN3_06B["num_hidden_layers"]
    tokens = args.num_requests * (args.prompt_len + args.output_len)
    print(f"Qwen3-0.6B shape, bf16, {args.num_requests} requests x {args.prompt_len} prompt + "
          f"{args.output_len} output tokens (greedy)")
    print(f"  -tp 1 (2 threads):        {one['tok_s']:7.1f} output tok/s, "
          f"{one['step_ms']:7.1f} ms/step over {one['steps']} steps")
    print(f"  -tp 2 (1 thread / rank):  {two['tok_s']:7.1f} output tok/s, "
          f"{two['step_ms']:7.1f} ms/step over {two['steps']} steps")
    print(f"  -tp 1 (1 thread):         {single['tok_s']:7.1f} output tok/s, "
          f"{single['step_ms']:7.1f} ms/step over {single['steps']} steps")
    print(f"  throughput ratio tp2/tp1: {two['tok_s'] / one['tok_s']:.2f} (2 threads), "
          f"{two['tok_s'] / single['tok_s']:.2f} (1 thread)")
    print(f"  -tp 2 all-reduces per step: {two['ar_per_step']:.0f}, "
          f"{two['ar_bytes_per_step'] / 2**10:.1f} KiB, {two['ar_ms_per_step']:.2f} ms "
          f"({100 * two['ar_ms_per_step'] / two['step_ms']:.0f}% of the step; -tp 1: none)")
    per_token = all_reduce_bytes_per_token(hidden, layers, 2)
    print(f"  all-reduce bytes per token: {per_token / 2**10:.1f} KiB "
          f"((1 + 2 x {layers} layers) x {hidden} x 2 B); all tokens of the run: "
          f"{tokens * per_token / 2**20:.1f} MiB")
    # bf16: each rank rounds its partial sum before the all-reduce, so near-ties of a
    # random-weight model can flip (float32 is exact to 1e-5: tests/test_tensor_parallel.py).
    same = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(one["tokens"], two["tokens"], strict=True)]
    print(f"  greedy tokens equal to -tp 1 before the first difference (bf16), per request: "
          f"{same} of {args.output_len}")


def run_pp(path: Path, pp: int, threads: int, prompts, output_len: int, trace: Path) -> dict:
    import os

    from ladle import LLM, SamplingParams

    torch.set_num_threads(threads)
    os.environ["LADLE_PP_TRACE"] = str(trace)
    try:
        llm = LLM(str(path), dtype="bfloat16", max_model_len=1024, max_num_seqs=len(prompts),
                  kv_cache_memory="1GiB", pipeline_parallel_size=pp)
    finally:
        del os.environ["LADLE_PP_TRACE"]
    stage = llm.engine.model_group.stage if pp > 1 else None
    try:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up
        if stage is not None:
            stage.trace.clear()
        t0 = time.time()
        outs = llm.generate(prompts, params)
        t1 = time.time()
    finally:
        llm.close()  # the stages write their traces
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"tokens": [o.outputs[0].token_ids for o in outs], "tok_s": n_out / (t1 - t0),
              "window": (t0, t1)}
    if pp > 1:
        import json

        result["busy"] = [[(a, b) for a, b in json.loads(
            (trace / f"stage{i}-rank0.json").read_text()) if a >= t0 and b <= t1]
            for i in range(pp)]
    return result


def _covered(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _both_busy(xs, ys) -> float:
    """Seconds when an interval of xs and one of ys are both open (each list disjoint)."""
    total, j = 0.0, 0
    ys = sorted(ys)
    for a, b in sorted(xs):
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += max(0.0, min(b, ys[k][1]) - max(a, ys[k][0]))
            k += 1
    return total


def bench_pipeline_parallel(args) -> None:
    import random
    import tempfile

    path = qwen3_06b_checkpoint()
    rng = random.Random(0)
    n = args.num_requests if args.num_requests != 4 else 8
    prompts = [[rng.randrange(1000, 100000) for _ in range(args.prompt_len)] for _ in range(n)]
    one = run_pp(path, 1, 2, prompts, args.output_len, Path(tempfile.mkdtemp()))
    two = run_pp(path, 2, 1, prompts, args.output_len, Path(tempfile.mkdtemp()))
    (t0, t1), busy = two["window"], two["busy"]
    wall = t1 - t0
    covered = [_covered(b) for b in busy]
    both = _both_busy(busy[0], busy[1])
    hidden, layers = QWEN3_06B["hidden_size"], QWEN3_06B["num_hidden_layers"]
    print(f"Qwen3-0.6B shape, bf16, {n} concurrent requests x {args.prompt_len} prompt + "
          f"{args.output_len} output tokens (greedy)")
    print(f"  -pp 1 (2 threads):          {one['tok_s']:7.1f} output tok/s")
    print(f"  -pp 2 (1 thread / stage):   {two['tok_s']:7.1f} output tok/s "
          f"(ratio {two['tok_s'] / one['tok_s']:.2f})")
    print(f"  stage busy share of the run: stage 0 {covered[0] / wall:.0%}, stage 1 "
          f"{covered[1] / wall:.0%}; both at once {both / wall:.0%} of the run, "
          f"{both / max(covered[1], 1e-9):.0%} of stage 1's busy time")
    print(f"  parts computed: stage 0 {len(busy[0])}, stage 1 {len(busy[1])} "
          f"(micro-batches: up to 2 per step)")
    print(f"  bytes between stages per token: {2 * hidden * 2} B (hidden + residual, bf16, "
          f"{hidden} wide; {layers} layers split {layers // 2}+{layers - layers // 2})")
    same = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(one["tokens"], two["tokens"], strict=True)]
    print(f"  greedy tokens equal to -pp 1 before the first difference, per request: {same} "
          f"of {args.output_len}")


def bench_data_parallel(args) -> None:
    """DP=2 against DP=1: throughput of two engine processes behind one API (half the cores
    each) against one engine on all cores, with `ladle serve` and 32 concurrent streams
    (benchmarks/parallel_dp.py, which also runs alone)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import parallel_dp

    parallel_dp.report(parallel_dp.run_dp(args.dp_model, rounds=args.dp_rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["tp", "pp", "dp", "all"], default="tp")
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dp-model", default="tiny", help="--part dp: tiny, 0.6b, or a directory")
    ap.add_argument("--dp-rounds", type=int, default=3, help="--part dp: passes of each layout")
    args = ap.parse_args()
    if args.part in ("tp", "all"):
        bench_tensor_parallel(args)
    if args.part in ("pp", "all"):
        bench_pipeline_parallel(args)
    if args.part in ("dp", "all"):
        bench_data_parallel(args)


if __name__ == "__main__":
    main()
