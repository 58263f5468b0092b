"""Batch invariance (README "Same request, same tokens"; issue 22): what it costs, and whether it
holds at scale.

  --cost (default): the speed of each path with --batch-invariant against the same engine
    without it (today's fastest path), as a ratio: decode of 1 and of 32 rows (tok/s over 48
    tokens after a 16-token prompt), prefill of 128 and 1024 tokens (seconds for the prompt,
    prefix caching off). The mode is process-wide (runner/cpu_kernels.py), so one engine serves
    both, switched between measurements, and the two alternate within every repetition (the
    median is reported): this machine's speed drifts by tens of percent between minutes.
  --acceptance: the seeded requests of tests/invariance_cases.py (temperature 0.8, top_p 0.95,
    64 tokens, logprobs; --greedy: temperature 0), --requests of them (200 by default), run alone
    and then in every case there (a batch of 32 with other requests arriving, a prefix-cache
    hit, prefix caching off, max_num_batched_tokens 16 and 2048, preemption, ngram k = 2 and 4),
    with --batch-invariant; prints per case how many are identical (tokens and logprobs) and
    what the case exercised (preemptions, prefix-hit tokens, accepted drafts). --dp adds the
    data-parallel case, a `ladle serve -dp 2` against `-dp 1` over HTTP; --cases runs only the
    cases named (`dp` names that one; with it alone no engine runs the requests alone). A case that did not do what it is named for (no prefix-cache hit, no
    preemption, no accepted draft) fails as NOT EXERCISED.

Models (--model): ladle-demo (default), a checkpoint directory, or a .gguf file; --dtype
bfloat16 by default."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from invariance_cases import (  # noqa: E402
    EXERCISED,
    cases,
    completions_over_http,
    differences,
    evidence,
    make_requests,
    run_alone,
)

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.runner import cpu_kernels  # noqa: E402


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cost(model: str, dtype: str, reps: int) -> None:
    # max_model_len: the longest prompt is 1024 tokens; a 40k-context model's default would not
    # fit the KV cache.
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=32,
              max_num_batched_tokens=2048, max_model_len=2048, batch_invariant=True)
    vocab = llm.engine.vocab_size
    prompt16 = [[(7 * i + 13 * j) % 5000 + 10 for j in range(16)] for i in range(32)]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def decode(rows: int) -> float:  # tok/s of decode alone: (48-token run) - (1-token run)
        full = _timed(lambda: llm.generate(prompt16[:rows], greedy, use_tqdm=False))
        first = _timed(lambda: llm.generate(prompt16[:rows], one, use_tqdm=False))
        return rows * 47 / max(full - first, 1e-9)

    def prefill(n: int) -> float:  # seconds for an n-token prompt (one step with 2048 budget)
        prompt = [(11 * j) % (vocab - 20) + 10 for j in range(n)]
        return _timed(lambda: llm.generate([prompt], one, use_tqdm=False))

    paths = {"decode 1 row (tok/s)": lambda: decode(1),
             "decode 32 rows (tok/s)": lambda: decode(32),
             "prefill 128 tokens (s)": lambda: prefill(128),
             "prefill 1024 tokens (s)": lambda: prefill(1024)}
    for mode in (False, True):  # warm both modes (first-call allocations, oneDNN's plans)
        cpu_kernels.set_batch_invariant(mode)
        decode(2)
        prefill(64)
    print(f"{model} {dtype}, CPU kernels: {cpu_kernels.load_cpu_kernels().isa()}, "
          f"{reps} repetitions, median")
    print(f"{'path':28} {'default':>10} {'invariant':>10} {'cost':>8}")
    for name, fn in paths.items():
        got: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(reps):
            for mode in (False, True):
                cpu_kernels.set_batch_invariant(mode)
                got[mode].append(fn())
        base, inv = statistics.median(got[False]), statistics.median(got[True])
        # cost: how much slower the invariant path is (time ratio; > 1 is slower)
        ratio = base / inv if "tok/s" in name else inv / base
        print(f"{name:28} {base:10.3f} {inv:10.3f} {ratio:7.2f}x", flush=True)
    llm.close()


def acceptance(model: str, dtype: str, n: int, greedy: bool, dp: bool, seed: int,
               only: list[str] | None = None) -> bool:
    # max_model_len: the requests need < 256 tokens; a 40k-context model would not fit 32 of them.
    base = dict(dtype=dtype, batch_invariant=True, max_num_seqs=32, max_model_len=512)
    llm = LLM(model, **base)
    reqs = make_requests(n, seed, llm.engine.vocab_size, greedy=greedy)
    if only == ["dp"]:
        llm.close()
        return _dp_case(model, dtype, reqs)
    t = time.perf_counter()
    ref = run_alone(llm, reqs)
    llm.close()
    print(f"{model} {dtype} --batch-invariant, {n} {'greedy' if greedy else 'seeded'} requests: "
          f"alone in {time.perf_counter() - t:.0f} s", flush=True)
    ok = True
    for name, (kw, run) in cases(seed).items():
        if only and name not in only:
            continue
        t = time.perf_counter()
        llm = LLM(model, **(base | kw))
        got = run(llm, reqs)
        ev = evidence(llm)
        llm.close()
        diff = differences(ref, got)
        idle = name in EXERCISED and not ev[EXERCISED[name]]
        ok &= not diff and not idle
        print(f"  {name:30} {n - len(diff):4}/{n} identical  "
              f"{'(NOT EXERCISED: ' if idle else '('}{ev}; "
              f"{time.perf_counter() - t:.0f} s)", *diff[:3], sep="\n    " if diff else "",
              flush=True)
    if dp or (only and "dp" in only):
        ok &= _dp_case(model, dtype, reqs)
    return ok


def _dp_case(model: str, dtype: str, reqs) -> bool:
    """`ladle serve -dp 2` against `-dp 1`, the same requests sent 32 at a time over HTTP."""
    from test_server import API_KEY, RemoteServer  # tests/

    got = {}
    for dp in (1, 2):
        # --max-model-len as the in-process cases: a GGUF's 40k default context does not fit.
        server = RemoteServer("--api-key", API_KEY, "--dtype", dtype, "--batch-invariant",
                              "--data-parallel-size", str(dp), "--max-num-seqs", "32",
                              "--max-model-len", "512",
                              "--generation-config", "vllm", "--disable-log-stats", model=model)
        try:
            got[dp] = completions_over_http(server.url, API_KEY, reqs)
        finally:
            server.stop()
    diff = [i for i, (a, b) in enumerate(zip(got[1], got[2], strict=True)) if a != b]
    print(f"  {'-dp 2 against -dp 1 (HTTP)':30} {len(reqs) - len(diff):4}/{len(reqs)} "
          "identical", flush=True)
    return not diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ladle-demo")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--acceptance", action="store_true")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--dp", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", nargs="+", choices=[*cases(1), "dp"], metavar="CASE",
                    help="run only these cases (default: all; dp: the -dp 2 case)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.acceptance:
        sys.exit(0 if acceptance(args.model, args.dtype, args.requests, args.greedy, args.dp,
                                 args.seed, args.cases) else 1)
    cost(args.model, args.dtype, args.reps)


if __name__ == "__main__":
    main()
