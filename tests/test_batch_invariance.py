"""--batch-invariant (README "Same request, same tokens"): a seeded or greedy request gives the
same tokens and logprobs, to the bit, alone and in every way an engine can run it: in a batch
with other requests arriving mid-decode, after a prefix-cache hit, without prefix caching, in
16-token prefill chunks, after a preemption, with ngram speculation, behind `-dp 2`; in
bfloat16 and from a Q8_0 GGUF. Each case also shows it exercised what it names (preemptions,
prefix-hit tokens, accepted drafts). benchmarks/batch_invariance.py runs the same cases with 200
requests each, and measures what the mode costs."""

from __future__ import annotations

import pytest
import torch
from invariance_cases import (
    EXERCISED,
    cases,
    completions_over_http,
    differences,
    evidence,
    make_requests,
    run_alone,
    run_together,
    run_with_arrivals,
)
from test_server import API_KEY, RemoteServer

from ladle import LLM
from ladle.models.demo import ensure_demo_model
from ladle.runner import cpu_kernels
from ladle.runner.model_runner import check_batch_invariant

NUM = 8  # requests per case: seeded ones and greedy ones
TOKENS = 20
# The cases here: every one of tests/invariance_cases.py but "max_num_batched_tokens 2048", the
# default budget, which "prefix caching off" and "prefix-cache hit" already run with.
CASES = [name for name in cases(seed=5) if name != "max_num_batched_tokens 2048"]
BASE = dict(dtype="bfloat16", batch_invariant=True, max_num_seqs=32)


def requests(vocab: int):
    return (make_requests(NUM // 2, 3, vocab, TOKENS)
            + make_requests(NUM - NUM // 2, 4, vocab, TOKENS, greedy=True))


@pytest.fixture(scope="module")
def demo_reference():
    llm = LLM("ladle-demo", **BASE)
    reqs = requests(llm.engine.vocab_size)
    ref = run_alone(llm, reqs)
    assert cpu_kernels.batch_invariant()
    llm.close()
    assert not cpu_kernels.batch_invariant(), "the mode outlived its engine"
    return reqs, ref


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_request_is_the_same_in_every_case(demo_reference, case):
    reqs, ref = demo_reference
    assert_case_matches("ladle-demo", reqs, ref, case)


def assert_case_matches(model: str, reqs, ref, case: str) -> None:
    """The requests run the case's way on `model` give the reference results, and the case did
    what it is named for (a hit, a preemption, accepted drafts)."""
    kw, run = cases(seed=5)[case]
    llm = LLM(model, **(BASE | kw))
    got = run(llm, reqs)
    done = evidence(llm)
    llm.close()
    assert differences(ref, got) == []
    if case in EXERCISED:
        assert done[EXERCISED[case]] > 0, done


def test_greedy_with_a_draft_model_is_the_same(demo_reference):
    """Draft-model speculation (the demo drafting for itself, k = 3) in bfloat16: greedy rows
    are verified by argmax agreement, so their tokens and logprobs are plain decoding's. (Seeded
    rows are rejection-sampled from their own noise streams, by design not plain decoding's.)"""
    reqs, ref = demo_reference
    greedy = [i for i, (_, p) in enumerate(reqs) if p.temperature == 0]
    spec = {"method": "draft_model", "model": str(ensure_demo_model()),
            "num_speculative_tokens": 3}
    llm = LLM("ladle-demo", **BASE, speculative_config=spec)
    got = run_together(llm, [reqs[i] for i in greedy])
    done = evidence(llm)
    llm.close()
    assert differences([ref[i] for i in greedy], got) == []
    assert done["accepted_drafts"] > 0, done


def test_q8_0_gguf_request_is_the_same_alone_and_in_a_crowd(tmp_path_factory):
    """A Q8_0 file with its blocks kept: alone against one engine that does everything at once
    (16-token chunks, a cache small enough to preempt, ngram drafts, others arriving)."""
    import gguf_convert
    from test_gguf import build_checkpoint

    path = tmp_path_factory.mktemp("bi") / "qwen3"
    build_checkpoint("qwen3", path)
    gguf = str(gguf_convert.convert_cached(path, "q8_0"))
    llm = LLM(gguf, **BASE)
    reqs = requests(llm.engine.vocab_size)
    ref = run_alone(llm, reqs)
    llm.close()
    llm = LLM(gguf, **BASE, max_num_batched_tokens=16, num_kv_blocks=10, max_model_len=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = run_with_arrivals(llm, reqs, seed=9, vocab=llm.engine.vocab_size)
    done = evidence(llm)
    llm.close()
    assert differences(ref, got) == []
    assert done["preemptions"] > 0 and done["accepted_drafts"] > 0, done


def test_data_parallel_server_gives_the_offline_result(demo_reference):
    """`ladle serve --batch-invariant -dp 2`, the requests sent all at once over HTTP: each
    text and each sampled token's logprob equal the request run alone offline."""
    reqs, ref = demo_reference
    llm = LLM("ladle-demo", **BASE)
    tok = llm.get_tokenizer()
    llm.close()
    server = RemoteServer("--api-key", API_KEY, "--dtype", "bfloat16", "--batch-invariant",
                          "-dp", "2", "--generation-config", "vllm", "--disable-log-stats")
    try:
        got = completions_over_http(server.url, API_KEY, reqs)
    finally:
        assert server.stop() == 0, server.log()
    for (ids, lps), out in zip(ref, got, strict=True):
        assert out["text"] == tok.decode(ids)
        sampled = [next(lp for t, lp, _ in pos if t == i) for i, pos in zip(ids, lps, strict=True)]
        assert out["logprobs"]["token_logprobs"] == sampled


def test_the_mode_needs_the_cpu_kernels():
    with pytest.raises(ValueError, match="batch_invariant: runs on the CPU kernels; the device "
                                         "is meta"):
        check_batch_invariant(torch.device("meta"), torch.bfloat16)
    with pytest.raises(ValueError, match="batch_invariant: the CPU kernels run bfloat16 and "
                                         "float32; the model is torch.float16"):
        check_batch_invariant(torch.device("cpu"), torch.float16)


def test_kernel_linear_rows_do_not_depend_on_the_batch():
    """The dense linear in invariant mode: any row of any M (1 to 70) gives the bits it gives
    alone, for bf16 and f32, with a bias and N not a multiple of the 4-row blocks."""
    kernels = cpu_kernels.load_cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(203, 160, generator=g).to(dtype)
        b = torch.randn(203, generator=g).to(dtype)
        x = torch.randn(70, 160, generator=g).to(dtype)
        alone = torch.cat([kernels.linear(x[i:i + 1], w, b, True) for i in range(70)])
        for m in (2, 3, 5, 8, 33, 70):
            assert torch.equal(kernels.linear(x[:m], w, b, True), alone[:m]), (dtype, m)


def test_tensor_parallel_request_is_the_same_alone_and_in_a_crowd():
    """`-tp 2` with the flag: the workers run their kernels in the mode too, so a request's
    bits under -tp 2 do not depend on the batch (they are not -tp 1's: each rank sums its
    share first)."""
    llm = LLM("ladle-demo", **BASE, tensor_parallel_size=2)
    reqs = requests(llm.engine.vocab_size)[:6]
    ref = run_alone(llm, reqs)
    got = run_with_arrivals(llm, reqs, seed=11, vocab=llm.engine.vocab_size)
    llm.close()
    assert differences(ref, got) == []


@pytest.fixture(scope="module")
def hybrid_reference(tmp_path_factory):
    """A random Qwen3-Next (Gated DeltaNet layers beside gated attention; experts with a shared
    expert beside a dense MLP), its requests run alone."""
    from test_hybrid import make_hybrid_checkpoint

    path = tmp_path_factory.mktemp("qwen3_next")
    make_hybrid_checkpoint("qwen3_next", path)
    llm = LLM(str(path), **BASE)
    reqs = requests(llm.engine.vocab_size)
    # Each prompt followed by its own continuation and itself again: ngram drafts copied from
    # the first continuation are then accepted (a random model's text repeats nothing else).
    reqs = [(p + tokens + p, s) for (p, s), (tokens, _) in zip(reqs, run_alone(llm, reqs),
                                                               strict=True)]
    ref = run_alone(llm, reqs)
    llm.close()
    return path, reqs, ref


@pytest.mark.parametrize("case", CASES)
def test_a_hybrid_request_is_the_same_in_every_case(hybrid_reference, case):
    """The hybrid's linear layers in batch-invariant mode: a prefill chunk runs a token at a
    time through the decode step (whose C++ kernel treats each sequence and head alone), so a
    token's numbers depend neither on the chunking nor on the batch; prefix-cache hits restore
    the state snapshot of their last block, speculative rows settle on the state after their
    last accepted token."""
    path, reqs, ref = hybrid_reference
    assert_case_matches(str(path), reqs, ref, case)
