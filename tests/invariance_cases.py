"""The cases of the batch-invariance promise (README "Same request, same tokens"; issue 22): the
same seeded requests run through engines configured in different ways, each result compared with
the request run alone. Used by tests/test_batch_invariance.py (a few dozen requests) and by
benchmarks/batch_invariance.py (the full acceptance run, 200 per case).

A request is a prompt of token ids (so any model's vocabulary works) and SamplingParams; a result
is its token ids and, per position, the logprobs of the sampled and top-2 tokens."""

from __future__ import annotations

import random
from collections.abc import Callable

from ladle import LLM, SamplingParams

Result = tuple[list[int], list[list[tuple[int, float, int]]]]


def make_requests(n: int, seed: int, vocab: int, max_tokens: int = 64,
                  greedy: bool = False, max_prompt: int = 80) -> list[tuple[list[int], SamplingParams]]:
    """n requests with prompts of 1..max_prompt tokens. Each prompt repeats a few phrases drawn
    from a small pool of ids, so ngram speculation finds drafts; seeded sampling at temperature
    0.8, top_p 0.95 (or greedy), logprobs of the top 2 at every position."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pool = [rng.randrange(10, min(vocab, 20000)) for _ in range(rng.randint(3, 12))]
        phrases = [[rng.choice(pool) for _ in range(rng.randint(2, 6))] for _ in range(3)]
        length = rng.randint(1, max_prompt)
        prompt: list[int] = []
        while len(prompt) < length:
            prompt += rng.choice(phrases)
        params = dict(max_tokens=max_tokens, logprobs=2, ignore_eos=True)
        if greedy:
            params.update(temperature=0.0)
        else:
            params.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
        out.append((prompt[:length], SamplingParams(**params)))
    return out


def _other_request(rng: random.Random, vocab: int) -> tuple[list[int], SamplingParams]:
    """A request of another kind arriving mid-decode: greedy, top-k, penalties, several
    choices, short or long, with or without a seed."""
    prompt = [rng.randrange(10, min(vocab, 20000)) for _ in range(rng.randint(1, 120))]
    kind = rng.randrange(5)
    params: dict = dict(max_tokens=rng.randint(1, 48), ignore_eos=True)
    if kind == 0:
        params.update(temperature=0.0)
    elif kind == 1:
        params.update(temperature=1.0, top_k=rng.randint(1, 50))
    elif kind == 2:
        params.update(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2,
                      seed=rng.randrange(100))
    elif kind == 3:
        params.update(temperature=1.2, min_p=0.05, n=rng.randint(2, 3), logprobs=3)
    else:
        params.update(temperature=0.9, top_p=0.5, frequency_penalty=0.3)
    return prompt, SamplingParams(**params)


def result_of(output) -> Result:
    """(token ids, [(token, logprob, rank) of every logprob entry] per position)."""
    lps = [sorted((tok, lp.logprob, lp.rank) for tok, lp in pos.items())
           for pos in (output.logprobs or [])]
    return list(output.token_ids), lps


def run_alone(llm: LLM, requests) -> list[Result]:
    return [result_of(llm.generate([p], [s], use_tqdm=False)[0].outputs[0]) for p, s in requests]


def run_together(llm: LLM, requests) -> list[Result]:
    return [result_of(o.outputs[0]) for o in
            llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)]


def run_with_arrivals(llm: LLM, requests, seed: int, width: int = 32,
                      vocab: int = 1000) -> list[Result]:
    """The requests kept `width` at a time in the batch, while requests of other kinds arrive
    at random steps (about one every third step) and leave when done."""
    rng = random.Random(seed)
    vocab = min(vocab, llm.engine.vocab_size)
    pending = list(enumerate(requests))
    targets: dict[str, int] = {}  # request id -> index
    results: list[Result | None] = [None] * len(requests)
    while pending or llm.engine.has_unfinished_requests():
        while pending and len(targets) < width:
            i, (p, s) = pending.pop(0)
            targets[llm._add(p, s)] = i
        if targets and rng.random() < 0.35:
            llm._add(*_other_request(rng, vocab))
        changed, to_abort = llm.output_processor.process(llm.engine.step())
        for rid in to_abort:
            llm.engine.abort_request(rid)
        for state in changed:
            if state.finished and state.request_id in targets:
                results[targets.pop(state.request_id)] = result_of(state.to_output().outputs[0])
    return results  # type: ignore[return-value]


# name -> (LLM keyword arguments, how the requests run). The reference is "alone".
Case = tuple[dict, Callable]


def cases(seed: int) -> dict[str, Case]:
    def prefix_hit(llm, requests, chunk: int = 16):
        # Each chunk runs twice: the first fills the cache and the second hits it. (Twice over
        # all 200 at once, the first requests' blocks are evicted before their second run:
        # least-recently-used order against a scan larger than the cache, no hits at all.)
        out: list[Result] = []
        for i in range(0, len(requests), chunk):
            run_together(llm, requests[i:i + chunk])
            out += run_together(llm, requests[i:i + chunk])
        return out

    return {
        "batch of 32, others arriving": ({}, lambda llm, r: run_with_arrivals(llm, r, seed)),
        "prefix-cache hit": ({}, prefix_hit),
        "prefix caching off": ({"enable_prefix_caching": False}, run_together),
        "max_num_batched_tokens 16": ({"max_num_batched_tokens": 16}, run_together),
        "max_num_batched_tokens 2048": ({"max_num_batched_tokens": 2048}, run_together),
        "preemption": ({"num_kv_blocks": 24, "max_model_len": 256}, run_together),
        "ngram k=2": ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                      run_together),
        "ngram k=4": ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
                      run_together),
    }


# What each case must show it did, beyond equal outputs: evidence() key that must be > 0.
EXERCISED = {"prefix-cache hit": "prefix_hit_tokens", "preemption": "preemptions",
             "ngram k=2": "accepted_drafts", "ngram k=4": "accepted_drafts"}


def evidence(llm: LLM) -> dict[str, int]:
    """What the case really exercised: preemptions, prefix-cache hit tokens, accepted drafts."""
    eng = llm.engine
    return {"preemptions": eng.scheduler.num_preemptions,
            "prefix_hit_tokens": eng.kv_cache.num_prefix_hits,
            "draft_tokens": eng.num_draft_tokens, "accepted_drafts": eng.num_accepted_tokens}


def differences(reference: list[Result], got: list[Result]) -> list[str]:
    """One line per request whose tokens or logprobs differ from the reference."""
    out = []
    for i, (a, b) in enumerate(zip(reference, got, strict=True)):
        if a[0] != b[0]:
            at = next((j for j, (x, y) in enumerate(zip(a[0], b[0], strict=False)) if x != y),
                      min(len(a[0]), len(b[0])))
            out.append(f"request {i}: tokens differ from position {at}")
        elif a[1] != b[1]:
            at = next(j for j, (x, y) in enumerate(zip(a[1], b[1], strict=False)) if x != y)
            out.append(f"request {i}: logprobs differ at position {at}: {a[1][at]} vs "
                       f"{b[1][at]}")
    return out


def completions_over_http(url: str, api_key: str, requests, width: int = 32) -> list[dict]:
    """The requests as /v1/completions calls (prompt token ids), `width` in flight at a time;
    per request its choice's text and logprobs (tokens, token_logprobs, top_logprobs)."""
    import concurrent.futures

    import httpx

    headers = {"Authorization": f"Bearer {api_key}"}
    model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]

    def one(req):
        prompt, p = req
        body = {"model": model, "prompt": prompt, "max_tokens": p.max_tokens, "logprobs": 2,
                "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed,
                "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=600, headers=headers)
        r.raise_for_status()
        c = r.json()["choices"][0]
        return {"text": c["text"], "logprobs": c["logprobs"]}

    with concurrent.futures.ThreadPoolExecutor(width) as pool:
        return list(pool.map(one, requests))
