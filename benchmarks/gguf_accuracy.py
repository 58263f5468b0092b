"""How close ladle's next-token distributions on a quantized GGUF file are to llama.cpp's and to a
float32 reference, on the same file and the same real text (issue 21, acceptance 1); and how
often `--quantization int8` keeps bf16's top-1 token on a trained model (acceptance 4).

The text: tests/data/english.txt, tokenized by the model's tokenizer (ladle's, read from the
file), BOS first, cut to BOS + N tokens (--positions, default 256). Teacher-forced: every system
runs that one sequence and gives a full next-token distribution at each of the N positions whose
next token is in the text. The systems, on the same file (default the Gemma 3 270M Q4_K_M file
that ladle ships, `gemma-3-270m`):
  - ladle, in process, as it serves the file (--quantization default: gguf, --dtype auto):
    the engine runs the sequence as one prefill step, and the logits at every position come from
    the model's own head (`compute_logits`) applied to the hidden states of that step, caught by
    a forward hook on the engine's model;
  - llama.cpp, through llama-cpp-python (Llama(logits_all=True), eval, scores), in the virtual
    environment that benchmarks/build_llama_cpp.sh builds;
  - transformers' own load of the file (its dequantization to float32) run in float32: the
    reference of what the quantized weights compute without further rounding.
Printed: mean KL(llama.cpp || ladle), KL(llama.cpp || transformers-f32), KL(f32 || ladle),
KL(f32 || llama.cpp), each system's perplexity of the text and top-1 agreements, and the two
checks of acceptance 1:
  - ladle at least as close to llama.cpp as the float32 run is: KL(llama.cpp || ladle) <=
    KL(llama.cpp || f32);
  - ladle no further from f32 than llama.cpp, within 10%: KL(f32 || ladle) <= 1.1 x
    KL(f32 || llama.cpp).
Then acceptance 4's last part: the same file dequantized to bf16 in ladle (quantization="none",
dtype bfloat16), then that model quantized by ladle.models.int8.quantize_model_int8 (skipped with
a message while that does not exist): top-1 next-token agreement with the bf16 run over the same
positions (target >= 95%), and mean KL(bf16 || int8).

    python benchmarks/gguf_accuracy.py [--model gemma-3-270m | path/to/file.gguf]
        [--positions 256] [--dtype auto] [--skip-llama] [--skip-hf] [--skip-int8]
        [--llama-no-repack]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "tests" / "data" / "english.txt"
LLAMA_DIR = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache/ladle-bench/llama-cpp"))



def model_file(model: str) -> Path:
    """A packaged model's name (assembled on first use) or a .gguf path."""
    from ladle.models.packaged import PACKAGED_MODELS, ensure_packaged_model

    if model in PACKAGED_MODELS:
        return ensure_packaged_model(model)
    return Path(model).expanduser().resolve()


def ladle_engine(path: Path, **kw):
    """An LLM for one sequence at a time, prefilled in one step; no prefix cache, so a rerun of
    the same tokens computes them again."""
    from ladle import LLM

    return LLM(str(path), max_num_seqs=1, max_model_len=1024, max_num_batched_tokens=2048,
               enable_prefix_caching=False, kv_cache_memory="256MB", **kw)


def ladle_logits(llm, ids: list[int]):
    """ladle's logits at every position of one prefill step, as the tests read them
    (tests/prompt_logits.py; imported here, since the llama.cpp worker runs this file where
    ladle and torch are not installed)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from prompt_logits import prompt_logits

    return prompt_logits(llm, ids)


def kl(p_logits, q_logits) -> float:
    """Mean over positions of KL(P || Q), in nats, computed in float64 (tests/prompt_logits.py)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from prompt_logits import mean_kl

    return mean_kl(p_logits, q_logits)


def text_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer(TEXT.read_text(), add_special_tokens=False).input_ids
    if len(ids) < n:
        raise SystemExit(f"{TEXT} gives {len(ids)} tokens; --positions {n} needs more")
    bos = tokenizer.bos_token_id
    if bos is None:
        raise SystemExit("the tokenizer has no BOS token")
    return [bos] + ids[:n]


def llama_logits(path: Path, ids: list[int], tmp: Path):
    """llama.cpp's logits at every position, from a worker in llama-cpp-python's environment."""
    import numpy as np
    import torch

    py = LLAMA_DIR / "venv" / "bin" / "python"
    ids_file, out = tmp / "ids.json", tmp / "llama_logits.npy"
    ids_file.write_text(json.dumps(ids))
    res = subprocess.run([str(py), str(Path(__file__).resolve()), "--worker", str(path),
                          str(ids_file), str(out)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed: {res.stderr[-2000:]}")
    return torch.from_numpy(np.load(out))


def worker_llama(path: str, ids_file: str, out: str) -> None:
    import numpy as np
    from llama_cpp import Llama

    sys.path.insert(0, str(HERE))
    from compare import llama_extra_buffers_as_asked

    llama_extra_buffers_as_asked()
    ids = json.loads(Path(ids_file).read_text())
    n_ctx = max(512, -(-len(ids) // 256) * 256)
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=os.cpu_count(), verbose=False)
    llm.eval(ids)
    np.save(out, np.asarray(llm.scores[:len(ids)], dtype=np.float32))


def hf_logits(path: Path, ids: list[int]):
    """transformers' dequantized load of the file, run in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def perplexity(logits, targets) -> float:
    import torch

    lp = torch.log_softmax(logits.double(), -1)
    return float(torch.exp(-lp.gather(1, targets[:, None]).mean()))


def top1(a, b) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).double().mean())


def int8_agreement(path: Path, ids: list[int], n: int) -> None:
    """bf16 (the file dequantized) against that model quantized by quantize_model_int8."""
    try:
        from ladle.models.int8 import quantize_model_int8
    except ImportError as e:
        print(f"\nint8 top-1 agreement: skipped (ladle.models.int8.quantize_model_int8 is not "
              f"available here: {e})")
        return
    llm = ladle_engine(path, dtype="bfloat16", quantization="none")
    try:
        bf16 = ladle_logits(llm, ids)[:n]
        runner = llm.engine.runner
        res = quantize_model_int8(runner.model)
        if res is not None and res is not runner.model and hasattr(res, "compute_logits"):
            runner.model = res  # a new module rather than the same one changed in place
        try:  # as the loader then lays the int8 rows out for the kernels
            from ladle.runner.quant import repack_for_kernels

            repack_for_kernels(runner.model)
        except ImportError:
            pass
        int8 = ladle_logits(llm, ids)[:n]
    finally:
        llm.close()
    agree = top1(bf16, int8)
    print(f"\nint8 (--quantization int8 on the file dequantized to bf16) against bf16, {n} "
          f"positions: top-1 agreement {agree:.1%} (target >= 95%: "
          f"{'met' if agree >= 0.95 else 'NOT met'}), mean KL(bf16 || int8) "
          f"{kl(bf16, int8):.5f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m",
                    help="a packaged model's name or a .gguf file")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--dtype", default="auto", help="ladle's dtype for the GGUF run")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-int8", action="store_true")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp without its extra weight buffers (repacking, AMX), as "
                         "compare.py's flag: on a KVM Xeon its AMX buffers crash")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_llama(*args.worker)
        return

    import torch

    if args.llama_no_repack:
        sys.path.insert(0, str(HERE))
        from compare import NO_REPACK_ENV

        os.environ[NO_REPACK_ENV] = "1"  # read by the llama.cpp worker
    path, n = model_file(args.model), args.positions
    print(f"model: {path}; text: {TEXT.name}, BOS + {n} tokens", flush=True)
    llm = ladle_engine(path, dtype=args.dtype)
    try:
        ids = text_ids(llm.get_tokenizer(), n)
        logits = {"ladle": ladle_logits(llm, ids)[:n]}
    finally:
        llm.close()
    del llm
    print(f"ladle: done ({args.dtype}, default quantization)", flush=True)
    py = LLAMA_DIR / "venv" / "bin" / "python"
    if not args.skip_llama:
        if py.exists():
            with tempfile.TemporaryDirectory() as tmp:
                logits["llama.cpp"] = llama_logits(path, ids, Path(tmp))[:n]
            print("llama.cpp: done", flush=True)
        else:
            print(f"llama.cpp: skipped (no llama-cpp-python under {LLAMA_DIR}; run "
                  "benchmarks/build_llama_cpp.sh)")
    if not args.skip_hf:
        logits["f32"] = hf_logits(path, ids)[:n]
        print("transformers float32: done", flush=True)

    targets = torch.tensor(ids[1:n + 1])
    print(f"\n{n} teacher-forced positions of {TEXT.name}")
    for name, lg in logits.items():
        print(f"  {name:10} perplexity {perplexity(lg, targets):8.3f}, top-1 = next text token "
              f"{float((lg.argmax(-1) == targets).double().mean()):.1%}")
    names = list(logits)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            print(f"  top-1 agreement {a} / {b}: {top1(logits[a], logits[b]):.1%}")
    pairs = [("llama.cpp", "ladle"), ("llama.cpp", "f32"), ("f32", "ladle"), ("f32", "llama.cpp")]
    kls = {(p, q): kl(logits[p], logits[q]) for p, q in pairs if p in logits and q in logits}
    label = {"f32": "transformers-f32"}
    for (p, q), v in kls.items():
        print(f"  mean KL({label.get(p, p)} || {label.get(q, q)}) = {v:.5f}")
    if len(kls) == 4:
        a, b = kls["llama.cpp", "ladle"], kls["llama.cpp", "f32"]
        c, d = kls["f32", "ladle"], kls["f32", "llama.cpp"]
        print("acceptance 1:")
        print(f"  ladle at least as close to llama.cpp as f32 is: {a:.5f} <= {b:.5f}: "
              f"{'met' if a <= b else 'NOT met'}")
        print(f"  KL(f32 || ladle) <= 1.1 x KL(f32 || llama.cpp): {c:.5f} <= {1.1 * d:.5f}: "
              f"{'met' if c <= 1.1 * d else 'NOT met'}")
    sys.stdout.flush()
    if not args.skip_int8:
        int8_agreement(path, ids, n)


if __name__ == "__main__":
    main()
