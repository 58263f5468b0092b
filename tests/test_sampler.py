"""Exact semantics of every sampling parameter, each row against a plain per-row reference
computed here; sampling frequencies against softmax probabilities (chi-square)."""

from __future__ import annotations

import math

import pytest
import torch
from sampler_harness import Harness

from ladle.sampling_params import SamplingParams

V = 32
NEG = float("-inf")


def P(**kw):
    """Params that report the full processed logits of every row."""
    kw.setdefault("logprobs", V)
    kw.setdefault("logprobs_mode", "processed_logits")
    kw.setdefault("max_tokens", 100)
    return SamplingParams(**kw)


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 2


# ---- plain per-row references --------------------------------------------------------------
def ref_penalties(row, prompt, output, rep=1.0, freq=0.0, pres=0.0):
    row = row.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float()
    for t in range(V):
        if t in prompt or counts[t] > 0:
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    return row - freq * counts - pres * (counts > 0).float()


def ref_top_k_top_p(row, k, p):
    row = row.clone()
    order = torch.argsort(row, descending=True)
    if k:
        row[order[k:]] = NEG
    probs = torch.softmax(row, -1)
    kept, mass = [], 0.0
    for t in order.tolist():
        if mass >= p and p < 1:
            break
        if row[t] == NEG:
            break
        kept.append(t)
        mass += probs[t].item()
    out = torch.full_like(row, NEG)
    out[kept] = row[kept]
    return out


def ref_min_p(row, min_p):
    probs = torch.softmax(row, -1)
    return torch.where(probs < min_p * probs.max(), torch.full_like(row, NEG), row)


# ---- exact semantics ------------------------------------------------------------------------
def test_penalties_match_reference():
    h = Harness(V)
    prompt, output = [1, 2, 3, 3], [3, 5, 5, 5, 9, 30]
    specs = [
        (P(temperature=0, repetition_penalty=1.3), prompt, output),
        (P(temperature=0, frequency_penalty=0.7), prompt, output),
        (P(temperature=0, presence_penalty=1.1), prompt, output),
        (P(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.3),
         prompt, output),
        (P(temperature=0), prompt, output),  # unpenalized row in the same batch: untouched
    ]
    h.set_requests(specs)
    logits = logits_for(len(specs))
    got = h.processed_logits(logits)
    refs = [
        ref_penalties(logits[0], prompt, output, rep=1.3),
        ref_penalties(logits[1], prompt, output, freq=0.7),
        ref_penalties(logits[2], prompt, output, pres=1.1),
        ref_penalties(logits[3], prompt, output, rep=0.8, freq=-0.5, pres=0.3),
        logits[4],
    ]
    for g, r in zip(got, refs, strict=True):
        torch.testing.assert_close(g, r)


def test_penalty_counts_follow_sampled_tokens_incrementally():
    """Counts after several steps equal counts rebuilt from the whole history."""
    h = Harness(V)
    h.set_requests([(P(temperature=0, frequency_penalty=1.0, presence_penalty=0.5), [4], [])])
    base = torch.zeros(1, V)
    base[0, :4] = torch.tensor([3.0, 2.9, 2.8, 2.7])  # greedy picks, penalties rotate them
    for _ in range(12):
        h.step(base)
    out = h.requests[0].output_token_ids
    assert len(set(out)) > 1  # the penalties really changed the argmax over time
    got = h.processed_logits(base)[0]
    torch.testing.assert_close(got, ref_penalties(base[0], [4], out, freq=1.0, pres=0.5))


def test_logit_bias_allowed_ids_and_bad_words():
    h = Harness(V)
    prompt = [1]
    specs = [
        (P(temperature=0, logit_bias={3: 5.0, 7: -100.0, 9: 250.0}), prompt, []),
        (P(temperature=0, allowed_token_ids=[2, 4, 6]), prompt, []),
        # [10] always banned; [11, 12] bans 12 only after 11; [13, 14, 15] bans 15 after 13 14.
        (P(temperature=0, bad_words=["x"]), prompt, [13, 14]),
        (P(temperature=0, bad_words=["x"]), prompt, [11]),
        (P(temperature=0, bad_words=["x"]), prompt, [14, 13]),
    ]
    for _, (params, _, _) in enumerate(specs[2:]):
        params.bad_words_token_ids = [[10], [11, 12], [13, 14, 15]]
    h.set_requests(specs)
    logits = logits_for(len(specs), seed=1)
    got = h.processed_logits(logits)
    r0 = logits[0].clone()
    r0[3] += 5.0
    r0[7] -= 100.0
    r0[9] += 100.0  # clamped to [-100, 100]
    torch.testing.assert_close(got[0], r0)
    r1 = torch.full((V,), NEG)
    r1[[2, 4, 6]] = logits[1, [2, 4, 6]]
    torch.testing.assert_close(got[1], r1)
    banned = {2: [10, 15], 3: [10, 12], 4: [10]}
    for row, toks in banned.items():
        r = logits[row].clone()
        r[toks] = NEG
        torch.testing.assert_close(got[row], r)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    h = Harness(V)
    specs = [
        (P(temperature=0, min_tokens=3, stop_token_ids=[5]), [1], [2, 2]),  # 2 < 3: banned
        (P(temperature=0, min_tokens=2, stop_token_ids=[5]), [1], [2, 2]),  # reached
        (P(temperature=0, min_tokens=3, ignore_eos=True), [1], [2]),  # EOS not a stop here
    ]
    h.set_requests(specs, eos=(0,))
    logits = logits_for(3)
    got = h.processed_logits(logits)
    r0 = logits[0].clone()
    r0[[5, 0]] = NEG
    torch.testing.assert_close(got[0], r0)
    torch.testing.assert_close(got[1], logits[1])
    torch.testing.assert_close(got[2], logits[2])


def test_temperature_top_k_top_p_min_p_match_reference():
    h = Harness(V)
    cases = [
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.3, top_p=0.6),
        dict(temperature=0.9, top_k=8, top_p=0.5),  # top-p on the mass top-k left
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=2.0, min_p=0.05, top_k=10, top_p=0.9),
    ]
    h.set_requests([(P(seed=i, **c), [1], []) for i, c in enumerate(cases)])
    logits = logits_for(len(cases), seed=3)
    got = h.processed_logits(logits)
    for i, c in enumerate(cases):
        r = logits[i] / c["temperature"]
        if c.get("min_p"):
            r = ref_min_p(r, c["min_p"])
        r = ref_top_k_top_p(r, c.get("top_k", 0), c.get("top_p", 1.0))
        torch.testing.assert_close(got[i], r, msg=str(c))


def test_greedy_rows_take_the_argmax_after_processing():
    h = Harness(V)
    h.set_requests([(SamplingParams(temperature=0, logit_bias={7: 100.0}), [1], []),
                    (SamplingParams(temperature=1e-6), [1], []),  # below 1e-5: greedy
                    (SamplingParams(temperature=1.0, seed=3), [1], [])])
    logits = logits_for(3, seed=5)
    out = h.step(logits, accept=False).sampled_token_ids
    assert out[0].item() == 7
    assert out[1].item() == logits[1].argmax().item()


def test_bfloat16_logits_give_the_tokens_of_their_float32_copy():
    """A step whose rows are all greedy with nothing to apply takes the argmax of the model's
    bfloat16 logits without the float32 copy; one with logit_bias, penalties, min_tokens or a
    plug-in processor applies it as before. The tokens are those of the float32 logits (ties:
    the first index), and the processors still act."""
    from ladle.sample.logits_processors.interface import LogitsProcessor

    class FavourFive(LogitsProcessor):  # a plug-in without per-row state: acts on every row
        def is_argmax_invariant(self):
            return False

        def update_state(self, update):
            pass

        def apply(self, logits):
            logits[:, 5] = 1e4
            return logits

    logits = logits_for(4, seed=9).bfloat16()
    logits[1, 3] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index wins
    greedy = SamplingParams(temperature=0)
    cases = [  # (params of row 0, plug-in, row 0's token where a processor decides it, copied)
        (greedy, (), None, False),
        (SamplingParams(temperature=0, logit_bias={7: 100.0}), (), 7, True),
        (SamplingParams(temperature=0, repetition_penalty=1.5), (), None, True),
        (SamplingParams(temperature=0, min_tokens=2), (), None, True),
        (greedy, (FavourFive,), 5, True),
    ]
    for params, custom, forced, copied in cases:
        h = Harness(V, custom=custom)
        h.set_requests([(params, [1], [])] + [(greedy, [1], [])] * 3)
        got = h.step(logits, accept=False).sampled_token_ids
        assert ("logits" in h.sampler.workspaces) == copied, params
        want = h.step(logits.float(), accept=False).sampled_token_ids
        assert got.tolist() == want.tolist(), params
        assert got[1].item() == (5 if custom else 3)
        if forced is not None:
            assert got[0].item() == forced
    assert got.tolist() == [5] * 4


def test_thinking_budget_forces_end_of_thinking():
    from ladle.reasoning import ReasoningConfig

    think, end = 20, 21
    h = Harness(V, reasoning=ReasoningConfig("qwen3", think, end))
    h.set_requests([
        (SamplingParams(temperature=0, thinking_token_budget=3), [1, think], [4, 5]),  # 2 spent
        (SamplingParams(temperature=0, thinking_token_budget=3), [1, think], [4, 5, 6]),  # 3
        (SamplingParams(temperature=0, thinking_token_budget=3), [1], [think, 4, 5, 6]),
        (SamplingParams(temperature=0, thinking_token_budget=3), [1], [think, 4, end, 5, 6, 7]),
    ])
    logits = logits_for(4)
    logits[:, end] = -50  # the model itself would never end thinking
    out = h.step(logits, accept=False).sampled_token_ids.tolist()
    assert out[0] != end and out[1] == end and out[2] == end and out[3] != end


# ---- logprobs ---------------------------------------------------------------------------------
def test_logprobs_modes_and_sampled_rank():
    h = Harness(V)
    h.set_requests([
        (SamplingParams(temperature=0.5, top_k=4, seed=1, logprobs=3), [1], []),
        (SamplingParams(temperature=0.5, top_k=4, seed=1, logprobs=3,
                        logprobs_mode="processed_logprobs"), [1], []),
        (SamplingParams(temperature=0, logprobs=0, logprobs_mode="raw_logits"), [1], []),
        (SamplingParams(temperature=0.5), [1], []),  # no logprobs
    ])
    logits = logits_for(4, seed=9)
    logits[1] = logits[0]
    out = h.step(logits, accept=False)
    lp = out.logprobs
    assert lp.token_ids.shape == (3, 3)
    raw = torch.log_softmax(logits[0], -1)
    torch.testing.assert_close(lp.values[0], raw.topk(3).values)
    s0 = out.sampled_token_ids[0]
    torch.testing.assert_close(lp.sampled_values[0], raw[s0])
    assert lp.sampled_ranks[0] == (raw > raw[s0]).sum() + 1
    # processed: the distribution after temperature and top-k, renormalised over 4 tokens.
    proc = torch.log_softmax(ref_top_k_top_p(logits[1] / 0.5, 4, 1.0), -1)
    torch.testing.assert_close(lp.values[1], proc.topk(3).values)
    assert torch.exp(proc).sum().item() == pytest.approx(1.0)
    assert out.sampled_token_ids[1] == out.sampled_token_ids[0]  # same seed, same draw
    torch.testing.assert_close(lp.sampled_values[2], logits[2].max())
    assert lp.sampled_ranks[2] == 1


# ---- distributions --------------------------------------------------------------------------
def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson chi-square against `probs` at significance 1e-4 (Wilson-Hilferty critical
    value), over the tokens with non-zero probability; tokens with zero probability must
    never appear."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return False
    n = counts.sum()
    expected = probs[support] * n
    stat = (((counts[support] - expected) ** 2) / expected).sum().item()
    df = int(support.sum()) - 1
    z = 3.719  # one-sided 1e-4
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("case", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=6),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.0, min_p=0.15),
])
def test_sampling_frequencies_match_softmax(case, seeded):
    vocab, rows, steps = 12, 256, 40  # 10240 draws
    h = Harness(vocab, max_rows=rows, seed=7)
    g = torch.Generator().manual_seed(11)
    base = torch.randn(vocab, generator=g)
    specs = [(SamplingParams(seed=(1000 + i) if seeded else None, max_tokens=100, **case),
              [1], []) for i in range(rows)]
    h.set_requests(specs)
    counts = torch.zeros(vocab)
    for _ in range(steps):
        toks = h.step(base.expand(rows, vocab).clone()).sampled_token_ids
        counts += torch.bincount(toks, minlength=vocab).float()
    r = base / case["temperature"]
    if case.get("min_p"):
        r = ref_min_p(r, case["min_p"])
    r = ref_top_k_top_p(r, case.get("top_k", 0), case.get("top_p", 1.0))
    assert chi_square_ok(counts, torch.softmax(r, -1)), counts


# ---- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field, accepted", [
    (dict(temperature=-0.1), "temperature", ">= 0"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(top_k=-2), "top_k", "-1 or 0"),
    (dict(n=0), "n", ">= 1"),
    (dict(n=3, best_of=2), "best_of", ">= n"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens", "<= max_tokens"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "non-empty"),
    (dict(min_p=1.5), "min_p", "[0, 1]"),
    (dict(presence_penalty=3.0), "presence_penalty", "[-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (dict(logprobs_mode="weird"), "logprobs_mode", "raw_logprobs"),
])
def test_invalid_values_name_the_field(kwargs, field, accepted):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field + ":") and accepted in str(e.value)


def test_model_dependent_validation():
    from ladle.sampling_params import RequestLimits

    lim = RequestLimits(vocab_size=32, max_logprobs=20, max_n=4)
    with pytest.raises(ValueError, match=r"logit_bias: token id\(s\) \[40\] outside the vocab"):
        SamplingParams(logit_bias={40: 1.0}).verify_for_model(lim)
    with pytest.raises(ValueError, match=r"logprobs: 21 is out of range; accepted: 0 to 20"):
        SamplingParams(logprobs=21).verify_for_model(lim)
    with pytest.raises(ValueError, match="allowed_token_ids: token id"):
        SamplingParams(allowed_token_ids=[1, 99]).verify_for_model(lim)
    with pytest.raises(ValueError, match=r"n: 5 is invalid; accepted: an integer in \[1, 4\]"):
        SamplingParams(n=5).verify_for_model(lim)
    with pytest.raises(ValueError, match=r"best_of: 5 is invalid; accepted: an integer in \[1, 4\]"):
        SamplingParams(n=2, best_of=5).verify_for_model(lim)
    # max_logprobs -1: no cap but the vocabulary (vLLM's meaning).
    SamplingParams(logprobs=32).verify_for_model(RequestLimits(32, max_logprobs=-1))
    with pytest.raises(ValueError, match="prompt_logprobs: 33 is out of range; accepted: 0 to 32"):
        SamplingParams(prompt_logprobs=33).verify_for_model(RequestLimits(32, max_logprobs=-1))
    # top_k at or above the vocabulary means no top-k (it used to overflow int32 in the engine).
    for top_k, want in ((3_000_000_000, 0), (32, 0), (31, 31)):
        p = SamplingParams(top_k=top_k)
        p.verify_for_model(lim)
        assert p.top_k == want
    with pytest.raises(ValueError, match=r"allowed_token_ids: 33 given; accepted: at most 32 entries"):
        SamplingParams(allowed_token_ids=[1] * 33).verify_for_model(lim)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(stop=["x"] * 65), "stop"),
    (dict(stop=["x" * 1025]), "stop"),
    (dict(stop_token_ids=[1] * 1025), "stop_token_ids"),
    (dict(bad_words=["w"] * 1025), "bad_words"),
    (dict(bad_words=["w" * 1025]), "bad_words"),
    (dict(thinking_token_budget=2**31), "thinking_token_budget"),
])
def test_bounds_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: .*accepted: "):
        SamplingParams(**kwargs)


def test_adapter_wraps_per_request_callables():
    """The slow path for old-style processors: f(output_ids, logits_row) per request."""
    from ladle.sample.logits_processors.custom import AdapterLogitsProcessor

    seen_outputs = []

    class EvenOnly(AdapterLogitsProcessor):
        def new_req_logits_processor(self, params):
            if not (params.extra_args or {}).get("even_only"):
                return None

            def fn(output_ids, row):
                seen_outputs.append(list(output_ids))
                row[1::2] = NEG
                return row
            return fn

    h = Harness(V, custom=[EvenOnly])
    h.set_requests([(P(temperature=0, extra_args={"even_only": True}), [1], [4, 6]),
                    (P(temperature=0), [1], [])])
    logits = logits_for(2, seed=4)
    got = h.processed_logits(logits)
    r0 = logits[0].clone()
    r0[1::2] = NEG
    torch.testing.assert_close(got[0], r0)
    torch.testing.assert_close(got[1], logits[1])  # a row that did not ask is untouched
    assert seen_outputs[-1] == [4, 6]  # the callable sees the request's live output ids


@pytest.mark.parametrize("scale", [0.5, 8.0])  # flat rows: a full sort; peaked: the candidates
def test_mask_top_k_top_p_keeps_the_reference_sets(scale):
    """The full-row mask keeps, per row, exactly the tokens of the per-row reference (sort,
    top-k, then top-p on what is left), for rows with neither, either or both, in one batch
    with a vocabulary larger than the first candidate level."""
    from ladle.sample.ops import TOP_P_LEVELS, mask_top_k_top_p

    vocab = 3 * TOP_P_LEVELS[1]
    g = torch.Generator().manual_seed(21)
    cases = [(0, 1.0), (0, 0.9), (0, 0.5), (0, 0.999), (40, 1.0), (40, 0.7), (5000, 0.95),
             (0, 0.2), (1, 1.0), (0, 1e-6)]
    logits = torch.randn(len(cases), vocab, generator=g) * scale
    top_k = torch.tensor([k for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases], dtype=torch.float32)
    want = [ref_top_k_top_p(row, k, p) for row, (k, p) in zip(logits, cases, strict=True)]
    got = mask_top_k_top_p(logits.clone(), top_k, top_p)
    for i, (row, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(torch.isfinite(row), torch.isfinite(w)), cases[i]
        assert torch.equal(row[torch.isfinite(row)], w[torch.isfinite(w)]), cases[i]
    # Only some rows restricted: the others are left as they were, in place.
    x = logits.clone()
    mask_top_k_top_p(x, torch.tensor([0] * 9 + [3]), torch.ones(len(cases)))
    assert torch.equal(x[:9], logits[:9]) and int(torch.isfinite(x[9]).sum()) == 3
