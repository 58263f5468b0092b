"""`ladle serve` starts each family of issue 25 and serves it as the in-process engine does
(gpt-oss's server is tests/test_harmony.py's; the full server matrix runs against a MoE and a
dense one with LADLE_TEST_MODEL, as the README says). Each family's tiny random
float32 checkpoint (the builders of test_dense_families.py and test_moe.py, with ladle-demo's
vocabulary) gets ladle-demo's tokenizer, chat template and generation config, and one server:
- a completion from token ids, greedy, gives transformers' `generate` tokens (read back as
  token ids through the logprobs) and their logprobs within float32 rounding;
- a streamed chat completion concatenates to the same request unstreamed, which is served from
  the prefix cache (cached_tokens), and the server exits cleanly."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_dense_families import PROMPTS, make_family_checkpoint
from test_moe import make_moe_checkpoint
from test_server import RemoteServer

from ladle.models.demo import demo_config, ensure_demo_model

FAMILIES = ("mistral", "phi3", "olmo2", "granite", "qwen3_moe-top4", "mixtral-top2-window")
NUM_TOKENS = 16
MIN_MARGIN = 1e-3  # transformers' top-2 logit gap at each greedy step: far above float32 rounding


def greedy_with_margin(ref, prompt: list[int]) -> tuple[list[int], list[float], float]:
    """transformers' greedy tokens, their logprobs, and the smallest top-2 logit gap."""
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0, output_scores=True,
                           return_dict_in_generate=True)
    scores = torch.cat(out.scores).float()
    toks = out.sequences[0, len(prompt):]
    logprobs = scores.log_softmax(-1).gather(1, toks[:, None])[:, 0]
    top2 = scores.topk(2).values
    return toks.tolist(), logprobs.tolist(), (top2[:, 0] - top2[:, 1]).min().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_ladle_serve_runs_the_family(family, tmp_path):
    vocab = demo_config()["vocab_size"]
    if family in ("qwen3_moe-top4", "mixtral-top2-window"):
        ref = make_moe_checkpoint(family, tmp_path, vocab_size=vocab)
    else:
        ref = make_family_checkpoint(family, tmp_path, vocab_size=vocab)
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{demo}/{name}", tmp_path / name)
    # The first prompt whose greedy run has no near-tie for float32 rounding to flip (with a
    # 152k vocabulary some runs have one).
    prompt, want, want_logprobs = next(
        (p, toks, lps) for p in PROMPTS
        for toks, lps, margin in [greedy_with_margin(ref, p)] if margin >= MIN_MARGIN)

    server = RemoteServer("--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4",
                          "--disable-access-log", model=str(tmp_path))
    try:
        client = server.client()
        model = client.models.list().data[0].id
        done = client.completions.create(
            model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        got = [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens]
        assert got == want
        logprobs = done.choices[0].logprobs.token_logprobs
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4

        question = [{"role": "user", "content": "Tell me about the sea. " * 12}]
        stream = client.chat.completions.create(model=model, messages=question, max_tokens=8,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        again = client.chat.completions.create(model=model, messages=question, max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].finish_reason == "length"
        assert again.choices[0].message.content == streamed
        assert again.usage.prompt_tokens_details.cached_tokens >= 48
    finally:
        assert server.stop() == 0, server.log()
