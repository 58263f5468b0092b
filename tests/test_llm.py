"""The offline API as a user meets it, on the built-in ladle-demo model."""

from __future__ import annotations

import pytest

from ladle import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("ladle-demo")


def test_generate_strings_and_token_ids(llm):
    out = llm.generate(["Hello", [9707, 11, 1879]], SamplingParams(temperature=0, max_tokens=8))
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode("Hello")
    assert out[1].prompt_token_ids == [9707, 11, 1879]
    for o in out:
        c = o.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length" and c.text
        assert c.text == llm.get_tokenizer().decode(c.token_ids)


def test_bad_words_are_never_generated(llm):
    """bad_words given as text are tokenised by the frontend and banned by the sampler."""
    tok = llm.get_tokenizer()
    free = llm.generate(["Tell me"], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    word = next(w for w in free.text.split() if w.isalpha() and len(w) > 2)
    banned = llm.generate(["Tell me"], SamplingParams(temperature=0, max_tokens=24,
                                                      bad_words=[word]))[0].outputs[0]
    assert word in free.text and word not in banned.text
    ids = tok.encode(" " + word, add_special_tokens=False)
    assert all(banned.token_ids[i:i + len(ids)] != ids for i in range(len(banned.token_ids)))


def test_chat_and_n_with_seeds(llm):
    msgs = [{"role": "user", "content": "Hi"}]
    out = llm.chat(msgs, SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=10))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.text for c in out.outputs}) == 3
    again = llm.chat(msgs, SamplingParams(seed=7, temperature=1.0, max_tokens=10))[0]
    assert again.outputs[0].token_ids == out.outputs[2].token_ids  # choice i uses seed + i


def test_bad_prompt_rejects_the_call_and_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["ok", list(range(5000))], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.num_used_blocks == 0
