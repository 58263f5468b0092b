"""Prefill attention on the CPU: the paged kernel's rows, its tiles on the vector unit
(AVX512-BF16's vdpbf16ps, what a Zen 4 runs) and on the tile unit (AMX-BF16, where the CPU has
one), against torch's scaled_dot_product_attention on the same queries, keys and values laid
out contiguously (its best case: ladle's SDPA path first gathers a chunk's context from the
paged cache).

One fresh causal prompt of N tokens per call, bfloat16, the cache's blocks in random order;
the methods alternate call by call (this machine's speed drifts between seconds) and each
prints its median, ms per layer, and its ratio to SDPA and to the rows. The rows are
batch-invariant mode's path; the tiles are what a prefill chunk of a bfloat16 model takes
outside it (csrc/attention.cpp: tile_run).

    python benchmarks/attention_tiles.py [--tokens 128,512,1024] [--reps 11]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ladle.runner import cpu_kernels  # noqa: E402
from ladle.runner.attention import DecodeBatch, decode_attention  # noqa: E402

# (name, query heads, KV heads, head dim)
HEADS = [("Qwen3-0.6B", 16, 8, 128), ("Gemma 3 270M", 4, 1, 256)]
BLOCK = 16


def time_methods(kernels, methods, H, KVH, D, n, reps) -> dict[str, float]:
    """Each method's median ms over `reps` alternating calls on one fresh N-token prompt."""
    g = torch.Generator().manual_seed(n)
    nblocks = n // BLOCK + 8
    kc = torch.randn(nblocks, KVH, BLOCK, D, generator=g).bfloat16()
    vc = torch.randn(nblocks, KVH, BLOCK, D, generator=g).bfloat16()
    table = torch.randperm(nblocks, generator=g)[:(n + BLOCK - 1) // BLOCK]
    q = (torch.randn(n, H, D, generator=g) * 2).bfloat16()
    batch = DecodeBatch(rows=torch.arange(n), block_table=table.expand(n, -1).contiguous(),
                        ctx_lens=torch.arange(1, n + 1))
    # SDPA's operands: the same keys and values in position order, (1, heads, n, D)
    slots = table.repeat_interleave(BLOCK)[:n] * BLOCK + torch.arange(n) % BLOCK
    k = kc.transpose(1, 2).reshape(-1, KVH, D)[slots].transpose(0, 1).unsqueeze(0)
    v = vc.transpose(1, 2).reshape(-1, KVH, D)[slots].transpose(0, 1).unsqueeze(0)
    qs = q.transpose(0, 1).unsqueeze(0)

    def run(method):
        if method == "SDPA":
            return F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=D**-0.5,
                                                  enable_gqa=True)
        kernels.set_attention_amx(method == "AMX tiles")
        cpu_kernels.set_batch_invariant(method == "rows")
        try:
            return decode_attention(q, kc, vc, batch, D**-0.5)
        finally:
            cpu_kernels.set_batch_invariant(False)
            kernels.set_attention_amx(True)

    times = {m: [] for m in methods}
    for m in methods:
        run(m)
    for _ in range(reps):
        for m in methods:
            t = time.perf_counter()
            run(m)
            times[m].append(time.perf_counter() - t)
    return {m: statistics.median(v) * 1e3 for m, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,512,1024")
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    kernels = cpu_kernels.load_cpu_kernels()
    if kernels is None or not kernels.attention_tiles_available():
        sys.exit("no attention tiles here (the kernels need AVX512-BF16)")
    has_amx = kernels.set_attention_amx(True)
    print(f"kernels: {kernels.isa()}; tile unit: {'AMX-BF16' if has_amx else 'none'}; "
          f"{torch.get_num_threads()} threads")
    methods = ["rows", "vector tiles"] + (["AMX tiles"] if has_amx else []) + ["SDPA"]
    print("| heads | tokens | " + " | ".join(f"{m}, ms" for m in methods)
          + " | vector tiles / rows | vector tiles / SDPA |")
    print("|" + "---|" * (2 + len(methods) + 2))
    for name, H, KVH, D in HEADS:
        for n in (int(x) for x in args.tokens.split(",")):
            med = time_methods(kernels, methods, H, KVH, D, n, args.reps)
            print(f"| {name} ({H} q, {KVH} kv, D {D}) | {n} | "
                  + " | ".join(f"{med[m]:.3f}" for m in methods)
                  + f" | {med['vector tiles'] / med['rows']:.2f}x"
                  + f" | {med['vector tiles'] / med['SDPA']:.2f}x |", flush=True)
    print("(ratios below 1: the vector tiles are faster)")


if __name__ == "__main__":
    main()
