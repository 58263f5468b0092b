"""Sampler cost per step, in one script: ladle's sampler on (rows, 151936) logits for
  - greedy only,
  - all features on (temperature, top-k, top-p, min-p, logit bias, bad words, min_tokens,
    logprobs),
  - all features with every row seeded and penalized (presence, frequency, repetition),
and the penalty stage after 10, 500 and 4000 output tokens next to a history-histogram baseline
(counts rebuilt from each row's full output history every step, as vLLM does), implemented here;
and the settings most clients send (temperature alone; temperature with top_p = 0.9 and no
top_k) next to a full-sort baseline (sort every row, top-p on the sorted row, softmax, race),
on flat logits and on peaked ones whose nucleus is tens to hundreds of tokens, like a trained
model's.

    python benchmarks/sampler.py [--rows 1 16 64 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sampler_harness import Harness  # noqa: E402  (the real InputBatch + Sampler wiring)

from ladle.sampling_params import SamplingParams  # noqa: E402

V = 151936


def params(kind: str, i: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=8000)
    p = SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, max_tokens=8000, min_tokens=5,
        logit_bias={t: 1.5 for t in range(100, 110)}, logprobs=5, bad_words=["x"],
        seed=(1000 + i) if kind == "seeded_penalized" else None,
        presence_penalty=0.5 if kind == "seeded_penalized" else 0.0,
        frequency_penalty=0.3 if kind == "seeded_penalized" else 0.0,
        repetition_penalty=1.1 if kind == "seeded_penalized" else 1.0,
    )
    p.bad_words_token_ids = [[7], [8, 9]]
    return p


def time_steps(h: Harness, logits: torch.Tensor, n: int) -> float:
    h.step(logits)  # warm-up
    t = time.perf_counter()
    for _ in range(n):
        h.step(logits)
    return (time.perf_counter() - t) / n * 1000


def bench_kinds(rows: int, steps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, V, generator=g)
    out = {}
    for kind in ("greedy", "all_features", "seeded_penalized"):
        h = Harness(V, max_rows=rows)
        h.set_requests([(params(kind, i), [1, 2, 3], []) for i in range(rows)])
        out[kind] = time_steps(h, logits, steps)
    return out


def histogram_baseline(logits, histories, presence, frequency, repetition, prompt_mask):
    """Penalties the vLLM way: rebuild (rows, V) counts from every row's full history."""
    rows = logits.shape[0]
    L = max(len(h) for h in histories)
    padded = torch.full((rows, L), V, dtype=torch.long)
    for i, h in enumerate(histories):
        padded[i, : len(h)] = torch.tensor(h)
    counts = torch.zeros(rows, V + 1, dtype=torch.int32)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    counts = counts[:, :V]
    seen = (counts > 0) | prompt_mask
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition[:, None],
                                           logits * repetition[:, None]), logits)
    logits -= frequency[:, None] * counts
    logits -= presence[:, None] * (counts > 0)
    return logits


def bench_penalties(rows: int, history_len: int, steps: int = 5) -> tuple[float, float]:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, V, generator=g)
    hist = [torch.randint(0, V, (history_len,), generator=g).tolist() for _ in range(rows)]
    h = Harness(V, max_rows=rows, max_len=history_len + 8)
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.1, max_tokens=10000)
    h.set_requests([(p, [1, 2, 3], hist[i]) for i in range(rows)])
    pen = h.sampler.penalties
    meta = h.meta
    work = logits.clone()  # applied in place, repeatedly: only the timing matters here
    pen.apply(work, meta.presence, meta.frequency, meta.repetition, meta.penalties_used)
    t = time.perf_counter()
    for _ in range(steps):
        pen.apply(work, meta.presence, meta.frequency, meta.repetition, meta.penalties_used)
    ours = (time.perf_counter() - t) / steps * 1000
    prompt_mask = torch.zeros(rows, V, dtype=torch.bool)
    prompt_mask[:, [1, 2, 3]] = True
    t = time.perf_counter()
    for _ in range(steps):
        histogram_baseline(work, hist, meta.presence, meta.frequency, meta.repetition,
                           prompt_mask)
    base = (time.perf_counter() - t) / steps * 1000
    return ours, base


def client_params(kind: str) -> SamplingParams:
    if kind == "temperature":
        return SamplingParams(temperature=0.8, max_tokens=8000)
    return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8000)


def full_sort_baseline(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """What this sampler did before the fused race and the top-p candidates (temperature
    alone: softmax and the race over unsorted rows)."""
    x = logits / 0.8
    if top_p >= 1:
        probs = torch.softmax(x, dim=-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    vals, ids = x.sort(dim=-1, descending=True)
    probs = torch.softmax(vals, dim=-1)
    vals = vals.masked_fill(torch.cumsum(probs, dim=-1) - probs >= top_p, float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    choice = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    return ids.gather(1, choice[:, None])


def bench_client_settings(rows: int, steps: int) -> None:
    g = torch.Generator().manual_seed(2)
    for shape, scale in (("flat", 1.0), ("peaked", 5.0)):
        logits = torch.randn(rows, V, generator=g) * scale
        for kind in ("temperature", "top_p"):
            h = Harness(V, max_rows=rows)
            h.set_requests([(client_params(kind), [1, 2, 3], []) for _ in range(rows)])
            ours = time_steps(h, logits, steps)
            top_p = 0.9 if kind == "top_p" else 1.0
            full_sort_baseline(logits, top_p)
            t = time.perf_counter()
            for _ in range(max(1, steps // 2)):
                full_sort_baseline(logits, top_p)
            base = (time.perf_counter() - t) / max(1, steps // 2) * 1000
            print(f"{rows:>5} {shape:>7} {kind:>12} {ours:>9.2f} {base:>10.2f} "
                  f"{base / ours:>6.1f}x", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(f"vocab {V}, threads {torch.get_num_threads()}; ms per sampler step")
    print(f"{'rows':>5} {'greedy':>9} {'all feat':>9} {'+seed+pen':>10} {'ratio':>7}")
    for rows in args.rows:
        r = bench_kinds(rows, args.steps)
        ratio = r["seeded_penalized"] / r["greedy"]
        print(f"{rows:>5} {r['greedy']:>9.2f} {r['all_features']:>9.2f} "
              f"{r['seeded_penalized']:>10.2f} {ratio:>6.1f}x", flush=True)
    print("\nclient settings, ms per sampler step: ladle vs the full-sort baseline")
    print(f"{'rows':>5} {'logits':>7} {'setting':>12} {'ladle':>9} {'full sort':>10} {'ratio':>7}")
    for rows in args.rows:
        bench_client_settings(rows, args.steps)
    print("\npenalty stage at 64 rows, ms per step: ladle (incremental) vs history histogram")
    for n in (10, 500, 4000):
        ours, base = bench_penalties(64, n)
        print(f"  after {n:>5} output tokens: ladle {ours:7.2f}  histogram {base:8.2f}  "
              f"ratio {base / ours:5.1f}x", flush=True)


if __name__ == "__main__":
    main()
