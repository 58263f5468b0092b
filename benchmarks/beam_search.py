"""Beam search's cost (issue 27, acceptance 3): a width-k search against k independent greedy
requests of the same length, in one engine, alternating within every repetition (this machine's
speed drifts between minutes; the median ratio is reported).

Both decode max_tokens tokens per row (ignore_eos) after the same prompt, so both run k rows for
max_tokens steps: the ratio is the search's overhead (each step's candidate selection, forks and
KV block copies) against plain decoding. The engine's prefill counter shows that the search
prefills its prompt once, where k requests prefill it k times (prefix caching off, so the
greedy requests cannot share theirs either).

    python benchmarks/beam_search.py [--model ladle-demo] [--width 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ladle import LLM, BeamSearchParams, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ladle-demo")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    engine = llm.engine
    k, n = args.width, args.max_tokens
    prompt = [1000 + i for i in range(args.prompt_tokens)]
    beam = BeamSearchParams(beam_width=k, max_tokens=n, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def run_beam():
        return llm.beam_search([{"prompt_token_ids": prompt}], beam)

    def run_greedy():
        return llm.generate([{"prompt_token_ids": prompt}] * k, greedy)

    run_beam(), run_greedy()  # warm-up
    times = {"beam": [], "greedy": []}
    prefill = {}
    for _ in range(args.repeats):
        for name, fn in (("beam", run_beam), ("greedy", run_greedy)):
            before = engine.scheduler.num_prefill_tokens
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            prefill[name] = engine.scheduler.num_prefill_tokens - before
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{args.model} {args.dtype}: prompt {args.prompt_tokens} tokens, {n} tokens per row, "
          f"{k} rows; median of {args.repeats}")
    print(f"  beam search, width {k}:  {med['beam']:.3f} s  ({k * n / med['beam']:.1f} row-tokens/s),"
          f" prefill {prefill['beam']} tokens")
    print(f"  {k} greedy requests:     {med['greedy']:.3f} s  ({k * n / med['greedy']:.1f} "
          f"tokens/s), prefill {prefill['greedy']} tokens")
    print(f"  beam / greedy throughput: {med['greedy'] / med['beam']:.2f}x (acceptance: >= 0.8)")


if __name__ == "__main__":
    main()
