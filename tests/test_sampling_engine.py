"""Sampling through the whole engine: a mixed batch equals each request run alone, seeds survive
batching, preemption and restarts, logprobs match the model's logits, and custom logits
processors (flag and entry point) touch only the rows that asked for them."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from checkpoints import make_checkpoint

from ladle.config import EngineConfig
from ladle.engine.core import EngineCore
from ladle.messages import EngineCoreRequest
from ladle.sampling_params import SamplingParams

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3s")
    make_checkpoint("qwen3", path, torch.float32)
    return path


def engine(path, **kw):
    kw.setdefault("kv_cache_memory", "16MB")
    return EngineCore(EngineConfig(model=str(path), dtype="float32", **kw), keep_logits=True)


def run(eng, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        eng.add_request(EngineCoreRequest(rid, prompt, params, [], 0.0))
    toks: dict[str, list[int]] = {rid: [] for rid in requests}
    outs: dict[str, list] = {rid: [] for rid in requests}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks[o.req_id] += o.new_token_ids
            outs[o.req_id].append(o)
    return toks, outs


MIXED = {
    "greedy": (PROMPT, SamplingParams(temperature=0, max_tokens=20)),
    "random": (PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=20)),
    "penalized": (PROMPT, SamplingParams(temperature=0.8, seed=2, max_tokens=20,
                                         repetition_penalty=1.5, frequency_penalty=0.5,
                                         presence_penalty=0.5)),
    "biased": ([3, 4], SamplingParams(temperature=0, max_tokens=20, logit_bias={7: 4.0})),
    "min_p": (PROMPT[:2], SamplingParams(temperature=1.5, seed=4, min_p=0.1, max_tokens=20)),
    "top_kp": (PROMPT[1:], SamplingParams(temperature=1.2, seed=5, top_k=20, top_p=0.8,
                                          max_tokens=20)),
    "greedy_pen": (PROMPT, SamplingParams(temperature=0, repetition_penalty=2.0, max_tokens=20)),
}


def test_mixed_batch_equals_each_request_alone(ckpt):
    together, _ = run(engine(ckpt), MIXED)
    for rid, req in MIXED.items():
        alone, _ = run(engine(ckpt), {rid: req})
        assert together[rid] == alone[rid], rid
    # The parameters did something: penalised and plain greedy differ, bias shows up.
    assert together["greedy"] != together["greedy_pen"]
    assert 7 in together["biased"]


def test_seeded_output_alone_batched_preempted_restarted(ckpt):
    req = (PROMPT, SamplingParams(temperature=1.0, seed=77, top_k=50, max_tokens=24,
                                  ignore_eos=True))
    alone, _ = run(engine(ckpt), {"s": req})
    others = {f"o{i}": (list(range(30, 40 + 3 * i)), SamplingParams(temperature=0.9,
                                                                    max_tokens=30))
              for i in range(6)}
    compositions = [
        {**dict(list(others.items())[:1]), "s": req},
        {**others, "s": req},
        {"s": req, **dict(list(others.items())[2:5]), "g": (PROMPT, SamplingParams(temperature=0))},
    ]
    for comp in compositions:
        assert run(engine(ckpt), comp)[0]["s"] == alone["s"]
    small = engine(ckpt, num_kv_blocks=8, max_model_len=100)
    got, _ = run(small, {**others, "s": req})
    assert small.scheduler.num_preemptions > 0
    assert got["s"] == alone["s"]
    # A restarted engine (a new process would do the same: nothing depends on process state).
    assert run(engine(ckpt, seed=123), {"s": req})[0]["s"] == alone["s"]


def test_n_children_use_derived_seeds(ckpt):
    params = SamplingParams(temperature=1.0, seed=10, n=3, max_tokens=12)
    reqs = {f"c{i}": (PROMPT, params.child(i)) for i in range(3)}
    got, _ = run(engine(ckpt), reqs)
    assert len({tuple(v) for v in got.values()}) == 3
    single, _ = run(engine(ckpt), {"x": (PROMPT, SamplingParams(temperature=1.0, seed=12,
                                                                   max_tokens=12))})
    assert got["c2"] == single["x"]


def test_raw_and_processed_logprobs(ckpt):
    eng = engine(ckpt)
    reqs = {
        "raw": (PROMPT, SamplingParams(temperature=0.7, seed=3, top_k=10, logprobs=5,
                                       max_tokens=6)),
        "proc": (PROMPT, SamplingParams(temperature=0.7, seed=3, top_k=10, logprobs=5,
                                        max_tokens=6, logprobs_mode="processed_logprobs")),
    }
    for rid, (p, sp) in reqs.items():
        eng.add_request(EngineCoreRequest(rid, p, sp, [], 0.0))
    while eng.has_unfinished_requests():
        outs = {o.req_id: o for o in eng.step()}
        for row, rid in enumerate(eng.last_req_ids):
            o = outs[rid]
            lp = o.logprobs
            logits = eng.last_logits[row]
            if rid == "raw":
                ref = torch.log_softmax(logits, -1)
            else:  # what the token was drawn from: temperature, then top-k renormalised
                scaled = logits / 0.7
                kth = scaled.topk(10).values[-1]
                ref = torch.log_softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1)
            vals, ids = ref.topk(5)
            assert lp.token_ids[0] == ids.tolist()
            torch.testing.assert_close(torch.tensor(lp.values[0]), vals, atol=1e-5, rtol=1e-5)
            tok = o.new_token_ids[0]
            assert lp.sampled_values[0] == pytest.approx(ref[tok].item(), abs=1e-5)
            assert lp.sampled_ranks[0] == int((ref > ref[tok]).sum()) + 1


def test_prompt_logprobs_through_chunks(ckpt):
    eng = engine(ckpt, max_num_batched_tokens=8)
    prompt = list(range(40, 61))
    _, outs = run(eng, {"p": (prompt, SamplingParams(temperature=0, prompt_logprobs=2,
                                                     max_tokens=2))})
    plp = outs["p"][0].prompt_logprobs
    assert len(plp.sampled_values) == len(prompt) - 1
    import transformers as tf

    ref_model = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([prompt])).logits[0], -1)
    for i in range(len(prompt) - 1):
        assert plp.sampled_values[i] == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-4)
        assert plp.token_ids[i] == ref[i].topk(2).indices.tolist()


PROC_SOURCE = textwrap.dedent('''
    import torch
    from ladle.sample.logits_processors.interface import RowStateProcessor

    class BanProcessor(RowStateProcessor):
        """extra_args={"ban": token}: that token is never produced by the row."""
        def is_argmax_invariant(self):
            return False
        def new_state(self, a):
            return (a.params.extra_args or {}).get("ban")
        def apply(self, logits):
            for row, tok in self.states.items():
                logits[row, tok] = float("-inf")
            return logits

    class ForceProcessor(RowStateProcessor):
        """extra_args={"force": token}: the row always produces that token."""
        def is_argmax_invariant(self):
            return False
        @classmethod
        def validate_params(cls, params):
            force = (params.extra_args or {}).get("force")
            if force is not None and not isinstance(force, int):
                raise ValueError("extra_args.force: must be a token id (int)")
        def new_state(self, a):
            return (a.params.extra_args or {}).get("force")
        def apply(self, logits):
            for row, tok in self.states.items():
                logits[row] = float("-inf")
                logits[row, tok] = 0.0
            return logits
''')


def test_custom_processors_by_flag_and_entry_point(ckpt, tmp_path, monkeypatch):
    (tmp_path / "ladle_test_procs.py").write_text(PROC_SOURCE)
    dist = tmp_path / "ladle_test_procs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ladle-test-procs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[ladle.logits_processors]\nforce = ladle_test_procs:ForceProcessor\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = {f"p{i}": (PROMPT[i:], SamplingParams(temperature=0, max_tokens=10))
             for i in range(3)}
    baseline, _ = run(engine(ckpt), plain)
    ban_tok = baseline["p0"][0]
    eng = engine(ckpt, logits_processors=["ladle_test_procs:BanProcessor"])
    assert {type(p).__name__ for p in eng.runner.custom_processors} == {"BanProcessor",
                                                                        "ForceProcessor"}
    asked = {
        "ban": (PROMPT, SamplingParams(temperature=0, max_tokens=10,
                                       extra_args={"ban": ban_tok})),
        "force": (PROMPT, SamplingParams(temperature=0, max_tokens=10,
                                         extra_args={"force": 5})),
    }
    got, _ = run(eng, {**plain, **asked})
    for rid in plain:
        assert got[rid] == baseline[rid]  # rows that did not ask are untouched
    assert ban_tok not in got["ban"] and got["ban"] != baseline["p0"]
    assert got["force"] == [5] * 10
    with pytest.raises(ValueError, match="extra_args.force"):
        eng.add_request(EngineCoreRequest("bad", PROMPT, SamplingParams(
            extra_args={"force": "x"}), [], 0.0))
    sys.modules.pop("ladle_test_procs", None)
