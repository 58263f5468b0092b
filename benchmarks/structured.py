"""Structured-output cost, in one script: output tokens/s with every request under a JSON schema
against the same requests unconstrained (same prompts, same output lengths, ignore_eos), at 1, 8
and 32 concurrent requests, as medians of interleaved repetitions; cold and cached compile times;
bitmask time per step next to the step time (on CPU the bitmask is filled between forwards; on an
accelerator in a worker thread while the forward runs).

    python benchmarks/structured.py [--model ladle-demo | --model qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from ladle import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{2,10}$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "cyan"]},
                 "minItems": 1, "maxItems": 4},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "active"],
}


def model_path(name: str) -> str:
    if name == "qwen3-0.6b":
        sys.path.insert(0, str(Path(__file__).parent))
        from throughput import qwen3_06b_checkpoint

        return str(qwen3_06b_checkpoint())
    return name


def run(llm: LLM, n: int, constrained: bool, lengths: list[int] | None):
    prompts = [f"Record {i}:" for i in range(n)]
    if constrained:
        so = StructuredOutputsParams(json=SCHEMA)
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=1000, structured_outputs=so)
                  for i in range(n)]
    else:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=m, ignore_eos=True)
                  for i, m in enumerate(lengths)]
    eng = llm.engine
    steps0, fill0 = eng.num_steps, eng.structured.fill_seconds
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    toks = [len(o.outputs[0].token_ids) for o in outs]
    steps = eng.num_steps - steps0
    return sum(toks) / dt, toks, dt / max(steps, 1), (eng.structured.fill_seconds - fill0) / max(
        steps, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ladle-demo")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=3,
                    help="constrained and free runs interleaved this many times; medians")
    args = ap.parse_args()
    llm = LLM(model_path(args.model), max_num_seqs=max(args.concurrency), max_model_len=2048,
              kv_cache_memory="2GiB")
    mgr = llm.engine.structured
    # Compile times: a new schema (cold), then the same schema again (cache).
    t = time.perf_counter()
    llm.generate(["warm"], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(
        json=SCHEMA)))
    cold = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(["warm"], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(
        json=SCHEMA)))
    cached = time.perf_counter() - t
    print(f"model {args.model}: first request with the schema {cold * 1000:.0f} ms "
          f"(compile {mgr.compile_seconds * 1000:.0f} ms), repeat {cached * 1000:.0f} ms "
          f"(cache hits {mgr.stats()['grammar_cache_hits']})")
    print(f"{'conc':>5} {'json tok/s':>11} {'free tok/s':>11} {'ratio':>6} {'step ms':>8} "
          f"{'bitmask ms/step':>16}")
    for n in args.concurrency:
        rows = []
        for _ in range(args.reps):  # interleaved: the machine's speed drifts between runs
            c_tps, lengths, step_s, fill_s = run(llm, n, True, None)
            f_tps, _, _, _ = run(llm, n, False, lengths)
            rows.append((c_tps, f_tps, c_tps / f_tps, step_s, fill_s))
        c_tps, f_tps, ratio, step_s, fill_s = (statistics.median(col) for col in zip(*rows, strict=True))
        print(f"{n:>5} {c_tps:>11.1f} {f_tps:>11.1f} {ratio:>6.2f} "
              f"{step_s * 1000:>8.1f} {fill_s * 1000:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
