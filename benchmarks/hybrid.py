"""Hybrid linear-attention decode: a Qwen3.5-shaped hybrid (Gated DeltaNet + full attention)
against a dense Qwen3 of the same size in ladle, and against llama.cpp on the same weights
where llama.cpp's converter and runtime handle the architecture. Shows that the per-token
decode cost of the linear layers does not grow with the context: decode is timed after a
256-token and after a 4096-token prompt.

Checkpoints (random bf16 weights, Qwen's tokenizer, tied 152k vocabulary, built once into the
ladle cache directory):
  - hybrid: Qwen3_5ForCausalLM (Qwen3.5-0.8B's layout), hidden 1024, 24 layers in the pattern
    3 x linear_attention : 1 x full_attention (18 Gated DeltaNet layers, 6 full ones);
    Gated DeltaNet 16 key heads / 16 value heads of 128, conv kernel 4; full attention 8 q /
    2 KV heads of 256 with the output gate, q/k norms and partial rotary (0.25 of each head);
    gated MLP of 3584: 0.65B weights;
  - dense: Qwen3ForCausalLM with the same hidden size, layer count, full-attention shape
    (8 q / 2 KV heads of 256), MLP and vocabulary on all 24 layers: 0.55B weights.
llama.cpp runs the bf16 GGUF that its own converter (in the llama-cpp-python sources that
benchmarks/build_llama_cpp.sh built) makes of each checkpoint; with --gguf q8_0 the converter
makes Q8_0 files and ladle runs those same files too (its quantized kernels; the Qwen3.5 GGUF
load undoes the converter's changes). For the hybrid the conversion takes the converter's
--no-mtp (its Qwen3.5 class otherwise requires multi-token-prediction layers,
which a transformers Qwen3_5ForCausalLM checkpoint does not have). Whether that converter and
that library handle Qwen3_5ForCausalLM is found out at run time (converter registration,
conversion, model load); when they do not, the run says why and goes on without llama.cpp.

Cases, per system and model in its own process (one load, both contexts), interleaved per
repetition (medians over repetitions reported): single-stream greedy decode of 64 tokens
(ignore_eos) after a fresh 256-token and 4096-token prompt (random token ids, a new prompt each
time, so no prefix cache answers). Decode is timed apart from the prefill, token by token; the
per-token time of a run is the median of its 64 steps (the mean is in the raw lines), which
another process on the machine moves less than the mean:
  - ladle: the offline LLM, every EngineCore.step() time-stamped: a step = the time between
    two steps that gave a token; TTFT = generate() called to the step with the first token;
  - llama.cpp: llama-cpp-python's Llama: TTFT = eval(prompt) + sampling, a step =
    eval([token]) + sampling.
Printed: decode ms/token and tok/s at both contexts, the 4096/256 ratio of the per-token time
(the hybrid's should grow far less than the dense model's: only its full-attention quarter
reads a longer KV cache), the growth in ms/token of the hybrid against the dense model's
(about 6/24 = 0.25 when the linear layers do not grow), hybrid/dense decode tok/s, and
ladle/llama.cpp decode tok/s; TTFT (the prefill) as well.

Other processes on the machine: with 2 cores, a run that shares them decodes many times slower
(each step's threads wait for a core; seen: 20x), in ladle and llama.cpp alike. So each run
starts when the machine is quiet (waiting up to --wait seconds), the worker measures how many
cores other processes kept busy during each decode (/proc/stat less its own CPU time), a run
above --max-other-cores is run again (--retries) and marked contended, and the medians use the
uncontended runs where there are any (the table says how many, and marks a row that had none).
On 2 idle cores, --reps 2 takes about 9 minutes (the 4096-token prefills are most of it).

    nice -n 19 benchmarks/build_llama_cpp.sh    # once (for the llama.cpp column)
    python benchmarks/hybrid.py [--reps N] [--skip-llama] [--gguf bf16|q8_0]
        [--llama-no-repack]
        [--max-other-cores 0.25] [--retries 1] [--wait 90]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare  # noqa: E402  (cache_root, prompts, gguf conversion, LLAMA_DIR)

CONTEXTS = (256, 4096)
DECODE_TOKENS = 64

COMMON = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
              num_key_value_heads=2, head_dim=256, intermediate_size=3584,
              max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True)
LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4)
ROPE_THETA = 1e7


def build(kind: str) -> Path:
    def make():
        import torch
        import transformers as tf

        if kind == "hybrid":
            layers = COMMON["num_hidden_layers"]
            types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(layers)]
            rope = dict(rope_type="default", rope_theta=ROPE_THETA, partial_rotary_factor=0.25)
            cfg = tf.Qwen3_5TextConfig(**COMMON, **LINEAR, layer_types=types,
                                       rope_parameters=rope, dtype="bfloat16")
            model = tf.Qwen3_5ForCausalLM(cfg)
        else:
            rope = dict(rope_type="default", rope_theta=ROPE_THETA)
            model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, rope_parameters=rope,
                                                       dtype="bfloat16"))
        return model.to(torch.bfloat16)

    return compare.random_checkpoint(f"qwen3_5-hybrid-bench-{kind}-random", make,
                                     COMMON["max_position_embeddings"])


def weights_count(path: Path) -> int:
    """Parameters in the checkpoint's safetensors files (the tied head once)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():  # noqa: SIM118  (safe_open has no __iter__)
                shape = st.get_slice(name).get_shape()
                size = 1
                for d in shape:
                    size *= d
                n += size
    return n


# --- Workers: one system, one model, one process; print one JSON line. ----------------------

def decode_prompts(rep: int) -> dict[int, list[int]]:
    """A fresh prompt per context and repetition (no prefix-cache hits), the same for every
    system of that repetition."""
    return {c: compare.prompts(1, c, seed=1000 + 10 * rep + i)[0] for i, c in enumerate(CONTEXTS)}


def worker_ladle(path: str, rep: int) -> dict:
    from ladle import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=2048,
              max_model_len=max(CONTEXTS) + DECODE_TOKENS + 64, kv_cache_memory="2GiB")
    stamps: list[tuple[float, int, tuple | None]] = []  # (end of a step, tokens, CPU seconds)
    step = llm.engine.step

    def timed_step():
        out = step()
        stamps.append((time.perf_counter(), sum(len(o.new_token_ids) for o in out),
                       cpu_seconds()))
        return out

    llm.engine.step = timed_step
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
    llm.generate([compare.prompts(1, 16, seed=999)[0]],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    out = {}
    for ctx, prompt in decode_prompts(rep).items():
        stamps.clear()
        t0 = time.perf_counter()
        res = llm.generate([prompt], params)
        got = len(res[0].outputs[0].token_ids)
        steps = [st for st in stamps if st[1]]
        tokens = sum(st[1] for st in steps[1:])
        if got != DECODE_TOKENS + 1 or tokens != len(steps) - 1:
            raise RuntimeError(f"context {ctx}: {got} tokens generated, {tokens} after the first "
                               f"in {len(steps) - 1} steps (expected one per step)")
        out[f"ttft_ms_{ctx}"] = 1e3 * (steps[0][0] - t0)
        out.update(decode_stats(ctx, [b[0] - a[0] for a, b in zip(steps, steps[1:],
                                                                     strict=False)],
                                other_cores(steps[0][2], steps[-1][2],
                                            steps[-1][0] - steps[0][0])))
    return out


def decode_stats(ctx: int, times: list[float], others: float | None) -> dict:
    """Per-token decode ms at this context: the median step (what is reported; a step that
    another process on the machine preempted moves it little) and the mean; and how many
    cores other processes kept busy meanwhile."""
    out = {f"decode_ms_{ctx}": 1e3 * statistics.median(times),
           f"decode_mean_ms_{ctx}": 1e3 * sum(times) / len(times)}
    if others is not None:
        out[f"other_cores_{ctx}"] = others
    return out


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the machine's processes have run: user, nice, system, irq, softirq; this
    process's, all its threads), or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK"), time.process_time()


def other_cores(a: tuple | None, b: tuple | None, wall: float) -> float | None:
    """Cores other processes kept busy, on average, between snapshots a and b of
    cpu_seconds(). On this 2-core machine a run that shares them decodes many times slower
    (each step's threads wait for a core), whatever the median does."""
    if a is None or b is None or wall <= 0:
        return None
    return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / wall)


def worker_llama(path: str, rep: int) -> dict:
    """llama-cpp-python in process; a model its library cannot load gives {"unavailable"}."""
    compare.llama_extra_buffers_as_asked()  # --llama-no-repack
    from llama_cpp import Llama

    try:
        llm = Llama(model_path=path, n_ctx=max(CONTEXTS) + DECODE_TOKENS + 64, n_batch=512,
                    n_threads=os.cpu_count(), verbose=False)
    except Exception as e:  # "Failed to load model from file": an architecture it lacks
        return {"unavailable": f"llama-cpp-python could not load {Path(path).name}: "
                               f"{type(e).__name__}: {str(e)[:300]}"}

    def generate(ids: list[int], n: int) -> tuple[float, list[float], float | None]:
        """(prefill seconds incl. the first token's sampling, seconds of each decode step,
        cores other processes used meanwhile)"""
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = llm.sample(top_k=1, temp=0.0)
        t, cpu = [time.perf_counter()], cpu_seconds()
        for _ in range(n):
            llm.eval([tok])
            tok = llm.sample(top_k=1, temp=0.0)
            t.append(time.perf_counter())
        steps = [b - a for a, b in zip(t, t[1:], strict=False)]
        return t[0] - t0, steps, other_cores(cpu, cpu_seconds(), t[-1] - t[0])

    generate(compare.prompts(1, 16, seed=999)[0], 4)  # warm-up
    out = {}
    for ctx, prompt in decode_prompts(rep).items():
        prefill, steps, others = generate(prompt, DECODE_TOKENS)
        out[f"ttft_ms_{ctx}"] = 1e3 * prefill
        out.update(decode_stats(ctx, steps, others))
    return out


def run_worker(python: str, args: list[str]) -> dict:
    """This file's worker in a process of its own (compare.run_worker runs compare.py's)."""
    out = subprocess.run([python, str(Path(__file__).resolve()), "--worker", *args],
                         capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        print(f"  worker {args[:2]} failed:\n{out.stderr[-1500:]}", file=sys.stderr)
        return {}
    return json.loads(lines[-1])


# --- llama.cpp's support of the architecture, found at run time ------------------------------

def converter_support(arch: str) -> str | None:
    """None when llama.cpp's converter registers `arch`, else why not."""
    src = compare.LLAMA_DIR / "src" / "vendor" / "llama.cpp"
    files = [src / "convert_hf_to_gguf.py", *sorted((src / "conversion").glob("*.py"))]
    files = [f for f in files if f.exists()]
    if not files:
        return f"no convert_hf_to_gguf.py under {src}"
    if not any(f'"{arch}"' in f.read_text(errors="replace") for f in files):
        return f"its converter ({src / 'convert_hf_to_gguf.py'}) registers no {arch}"
    return None


def convert_without_mtp(path: Path, outtype: str = "bf16") -> Path:
    """compare.gguf's conversion with the converter's --no-mtp: its Qwen3-Next/Qwen3.5 classes
    expect multi-token-prediction (mtp.*) layers unless told there are none, and a
    transformers Qwen3_5ForCausalLM checkpoint has none. Raises RuntimeError with the
    converter's last error line."""
    src = compare.LLAMA_DIR / "src" / "vendor" / "llama.cpp"
    out = path / f"model-{outtype}.gguf"
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    res = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(path),
                          "--outtype", outtype, "--no-mtp", "--outfile", str(tmp)],
                         env=dict(os.environ, PYTHONPATH=str(src / "gguf-py")),
                         capture_output=True, text=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        raise RuntimeError(lines[-1] if lines else f"exit status {res.returncode}")
    os.rename(tmp, out)
    return out


def llama_ggufs(paths: dict[str, Path], outtype: str = "bf16"
                ) -> tuple[dict[str, Path], dict[str, str]]:
    """The GGUF (`outtype`: bf16 or q8_0) of each checkpoint, made by llama.cpp's converter,
    and why a model has none."""
    src = compare.LLAMA_DIR / "src" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    no_mtp = src.exists() and "--no-mtp" in src.read_text(errors="replace")
    ggufs, why = {}, {}
    for kind, path in paths.items():
        arch = json.loads((path / "config.json").read_text())["architectures"][0]
        reason = converter_support(arch)
        if reason is None:
            t = time.perf_counter()
            try:
                ggufs[kind] = compare.gguf(path, outtype)
            except subprocess.CalledProcessError as e:
                reason = f"its converter failed on {arch} (exit status {e.returncode})"
                if no_mtp:
                    try:
                        ggufs[kind] = convert_without_mtp(path, outtype)
                        reason = None
                    except RuntimeError as e2:
                        reason += f", and with --no-mtp: {e2}"
            if kind in ggufs:
                print(f"  {kind}: {ggufs[kind]} ({time.perf_counter() - t:.0f} s)", flush=True)
        if reason is not None:
            why[kind] = reason
    return ggufs, why


# --- The run ---------------------------------------------------------------------------------

def clean(runs: list[dict]) -> list[dict]:
    """The uncontended runs, or all of them when every one was contended."""
    return [r for r in runs if not r.get("contended")] or runs


def med(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in clean(runs) if key in r]
    return statistics.median(vals) if vals else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--max-other-cores", type=float, default=0.25,
                    help="a run whose decode other processes shared more (cores, on average) "
                         "is contended: run again, and left out of the medians where an "
                         "uncontended run exists")
    ap.add_argument("--retries", type=int, default=1, help="reruns of a contended run")
    ap.add_argument("--wait", type=float, default=90,
                    help="seconds to wait, before each run, for the other processes to stop")
    ap.add_argument("--gguf", choices=("bf16", "q8_0"), default="bf16",
                    help="the GGUF llama.cpp runs; q8_0: ladle runs that same file too "
                         "(bf16: ladle runs the safetensors checkpoint)")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp without its extra weight buffers (repacking, AMX), as "
                         "compare.py's flag: its AMX buffers crash on some KVM Xeons")
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_no_repack:
        os.environ[compare.NO_REPACK_ENV] = "1"  # the llama.cpp workers read it
    if args.worker:
        kind, path, rep = args.worker
        fn = {"ladle": worker_ladle, "llama": worker_llama}[kind]
        print(json.dumps(fn(path, int(rep))))
        return

    llama_py = compare.LLAMA_DIR / "venv" / "bin" / "python"
    has_llama = not args.skip_llama and llama_py.exists() and subprocess.run(
        [str(llama_py), "-c", "import llama_cpp"], capture_output=True).returncode == 0
    if not args.skip_llama and not has_llama:
        print(f"llama-cpp-python not found under {compare.LLAMA_DIR}; run "
              "benchmarks/build_llama_cpp.sh (no llama.cpp column)")
    print(f"cores={os.cpu_count()} load={os.getloadavg()[0]:.1f} (other processes share the CPU; "
          "only ratios within this run count)", flush=True)
    t = time.perf_counter()
    paths = {k: build(k) for k in ("hybrid", "dense")}
    for k, p in paths.items():
        print(f"  {k}: {p} ({weights_count(p) / 1e9:.2f}B weights)")
    print(f"checkpoints ready ({time.perf_counter() - t:.0f} s)", flush=True)
    ggufs: dict[str, Path] = {}
    unsupported: dict[str, str] = {}
    if has_llama or args.gguf != "bf16":
        print(f"llama.cpp {args.gguf} GGUF conversions:", flush=True)
        ggufs, unsupported = llama_ggufs(paths, args.gguf)
    ladle_models = {k: ggufs[k] if args.gguf != "bf16" and k in ggufs else p
                    for k, p in paths.items()}
    results: dict[str, list[dict]] = {}
    for rep in range(args.reps):
        print(f"repetition {rep + 1}/{args.reps} (load {os.getloadavg()[0]:.1f})", flush=True)
        for kind in paths:
            systems = [("ladle", sys.executable, ladle_models[kind])]
            if has_llama and kind in ggufs:
                systems.append(("llama.cpp", str(llama_py), ggufs[kind]))
            for system, python, model in systems:
                r = measured(f"{system} {kind}", python,
                             [system.split(".")[0], str(model), str(rep)], args)
                if "unavailable" in r:
                    unsupported[kind] = r["unavailable"]
                    ggufs.pop(kind)
                elif r:
                    results.setdefault(f"{system} {kind}", []).append(r)
    report(results, unsupported, args)


def wait_quiet(limit: float, threshold: float) -> tuple[float, float | None]:
    """Wait up to `limit` seconds for a 3-second window in which other processes keep fewer
    than `threshold` cores busy; returns (seconds waited, their cores in the last window)."""
    t0 = time.monotonic()
    while True:
        a, t = cpu_seconds(), time.monotonic()
        time.sleep(3)
        others = other_cores(a, cpu_seconds(), time.monotonic() - t)
        if others is None or others < threshold or time.monotonic() - t0 >= limit:
            return time.monotonic() - t0, others


def measured(name: str, python: str, worker_args: list[str], args) -> dict:
    """One worker run, started when the machine is quiet, run again (up to args.retries
    times) when other processes shared the cores during its decode; the run whose decode they
    shared least is kept, marked "contended" when that was still above args.max_other_cores."""
    runs = []
    for attempt in range(args.retries + 1):
        waited, others = wait_quiet(args.wait, args.max_other_cores)
        if waited > 5:
            print(f"  (waited {waited:.0f} s for other processes; they used "
                  f"{others:.2f} cores)", flush=True)
        t = time.perf_counter()
        r = run_worker(python, worker_args)
        shared = max((r.get(f"other_cores_{c}") or 0.0 for c in CONTEXTS), default=0.0)
        if shared > args.max_other_cores:
            r["contended"] = True
        print(f"  {name} ({time.perf_counter() - t:.0f} s): "
              + json.dumps({k: round(v, 2) if isinstance(v, float) else v
                            for k, v in r.items()}), flush=True)
        runs.append((shared, r))
        if not r.get("contended"):
            break
        if attempt < args.retries:
            print(f"  {name}: other processes kept {shared:.2f} cores busy during its decode; "
                  "again", flush=True)
    return min(runs, key=lambda x: x[0])[1]


def report(results: dict[str, list[dict]], unsupported: dict[str, str], args) -> None:
    lo, hi = CONTEXTS
    ms = {s: {c: med(runs, f"decode_ms_{c}") for c in CONTEXTS} for s, runs in results.items()}
    print(f"\nmedians over the uncontended runs of {args.reps} interleaved repetitions; decode: "
          f"{DECODE_TOKENS} tokens after a prompt of the given length, one stream; weights: "
          + ("bf16" if args.gguf == "bf16" else f"the {args.gguf} GGUF in both"))
    head = (f"| {'':20} | " + " | ".join(f"decode ms/tok @{c}" for c in CONTEXTS) + " | "
            + " | ".join(f"tok/s @{c}" for c in CONTEXTS) + f" | ms/tok {hi}/{lo} | "
            + " | ".join(f"TTFT ms @{c}" for c in CONTEXTS) + " | runs |")
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    contended = []
    for s, runs in results.items():
        m = ms[s]
        cells = [f"{m[c]:>17.1f}" if m[c] else f"{'-':>17}" for c in CONTEXTS]
        cells += [f"{1e3 / m[c]:>10.1f}" if m[c] else f"{'-':>10}" for c in CONTEXTS]
        cells.append(f"{m[hi] / m[lo]:>15.2f}x" if m[hi] and m[lo] else f"{'-':>16}")
        ttft = [med(runs, f"ttft_ms_{c}") for c in CONTEXTS]
        cells += [f"{v:>12.0f}" if v else f"{'-':>12}" for v in ttft]
        used = clean(runs)
        mark = " *" if used[0].get("contended") else ""
        if mark:
            contended.append(s)
        cells.append(f"{len(used)}/{len(runs)}{mark}")
        print(f"| {s + mark:20} | " + " | ".join(cells) + " |")
    if contended:
        print(f"* every run of {', '.join(contended)} shared the cores with other processes "
              f"(> {args.max_other_cores} cores busy during a decode): its numbers are "
              "slower than this machine's")

    def ratio(num: str, den: str, c: int) -> str:
        """num's decode tok/s / den's at context c."""
        a, b = ms.get(num, {}).get(c), ms.get(den, {}).get(c)
        return "n/a" if not a or not b else f"{b / a:.2f}x"

    print("\nratios (decode tok/s):")
    for system in ("ladle", "llama.cpp"):
        if f"{system} hybrid" in ms and f"{system} dense" in ms:
            print(f"  {system} hybrid / dense: "
                  + ", ".join(f"{ratio(f'{system} hybrid', f'{system} dense', c)} @{c}"
                              for c in CONTEXTS))
    for kind in ("hybrid", "dense"):
        if f"llama.cpp {kind}" in ms:
            print(f"  {kind} ladle / llama.cpp: "
                  + ", ".join(f"{ratio(f'ladle {kind}', f'llama.cpp {kind}', c)} @{c}"
                              for c in CONTEXTS))
    print(f"\ncontext growth, decode ms/token from {lo} to {hi} tokens of context "
          "(the hybrid has 6 full-attention layers of 24: about 0.25 of the dense model's "
          "growth when its 18 linear layers do not grow):")
    for system in ("ladle", "llama.cpp"):
        h, d = ms.get(f"{system} hybrid"), ms.get(f"{system} dense")
        if not h or not d or not all(h.values()) or not all(d.values()):
            continue
        gh, gd = h[hi] - h[lo], d[hi] - d[lo]
        share = f"{gh / gd:.2f}" if gd > 0 else "n/a (the dense model did not slow down)"
        print(f"  {system}: hybrid {gh:+.1f} ms ({h[hi] / h[lo]:.2f}x), dense {gd:+.1f} ms "
              f"({d[hi] / d[lo]:.2f}x); hybrid growth / dense growth = {share}")
    for kind, why in unsupported.items():
        print(f"llama.cpp {kind}: not run; llama.cpp in this build does not handle the "
              f"architecture: {why}")


if __name__ == "__main__":
    main()
