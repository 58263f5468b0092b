"""The incremental detokenizer with real tokenizers: Llama-2's SentencePiece (byte fallback) and
Qwen's byte-level BPE (the demo model's). Streamed deltas must add up to a one-shot decode, never
show half a character, and never show a stop string or the start of one."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ladle.frontend.detokenizer import IncrementalDetokenizer, token_to_bytes, token_to_str
from ladle.models.demo import ensure_demo_model
from ladle.sampling_params import SamplingParams

LLAMA2_DIR = "/work/shared/data/tokenizers/llama2"
# Chinese, multi-codepoint emoji (ZWJ family, flag, skin tone), a 4-byte CJK character,
# accents (precomposed and combining), and every kind of space.
HARD_TEXT = (
    "  Leading spaces, then 中文字符测试：鹦鹉学舌。\tTab\there,\n\nnew  lines  and double  spaces "
    "👨\u200d👩\u200d👧\u200d👦 family, 🇫🇷🇯🇵 flags, 👍🏽 thumbs, 🦜 parrot, 𠀀 rare, "
    "café naïve Ångström e\u0301 crème brûlée, Ελληνικά, русский, العربية, 日本語のテキスト。 \n end"
)
ASCII_TEXT = "The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxes."


@pytest.fixture(scope="module")
def llama():
    return AutoTokenizer.from_pretrained(LLAMA2_DIR)


@pytest.fixture(scope="module")
def qwen():
    return AutoTokenizer.from_pretrained(ensure_demo_model())


@pytest.fixture(params=["llama", "qwen"])
def tok(request):
    return request.getfixturevalue(request.param)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, prompt=(), chunk=1, **opts):
    """Feeds ids `chunk` at a time; returns (detokenizer, deltas before the finish, final delta,
    index of the token at which update() reported a stop string or None)."""
    detok = IncrementalDetokenizer(tok, list(prompt), **opts)
    deltas, stop_at = [], None
    for i in range(0, len(ids), chunk):
        if detok.update(ids[i : i + chunk]) is not None:
            stop_at = i + chunk - 1
            break
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    return detok, deltas, detok.get_next_output_text(finished=True, delta=True), stop_at


def char_bounds(tok, ids) -> list[int]:
    """bounds[i]: characters in the decode of ids[:i] (for text where every token is whole)."""
    return [len(tok.decode(ids[:i])) for i in range(len(ids) + 1)]


# 1. Deltas add up to the full decode and never split a character.


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_full_decode(tok, chunk):
    ids = encode(tok, HARD_TEXT)
    # The text really splits characters across tokens, so holding them back is exercised.
    split = [i for i in ids if "bytes:" in token_to_str(tok, i)]
    assert len(split) >= 10
    _, deltas, last, _ = stream(tok, ids, chunk=chunk)
    assert "".join(deltas) + last == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in [*deltas, last])
    assert sum(1 for d in deltas if d) > len(ids) // (2 * chunk)  # text flows while streaming


def split_at_prompt(tok, prompt_text: str, reply: str) -> tuple[list[int], list[int], str]:
    """Prompt ids, output ids and the output's expected text, from one tokenization of
    prompt_text + reply (as if a model had generated the reply)."""
    prompt = tok.encode(prompt_text)  # with BOS for Llama
    ids = tok.encode(prompt_text + reply)
    assert ids[: len(prompt)] == prompt
    full = tok.decode(ids, skip_special_tokens=True)
    before = tok.decode(prompt, skip_special_tokens=True)
    return prompt, ids[len(prompt) :], full[len(before) :]


def test_output_continues_the_prompt(tok):
    """With a prompt, the output's first word keeps its leading space (SentencePiece drops it
    when decoding the output alone), and cumulative output equals the deltas."""
    prompt, ids, expected = split_at_prompt(
        tok, "Translate to French:\n\nThe capital of France is", " Paris, 中文 🇫🇷 and more."
    )
    assert expected == " Paris, 中文 🇫🇷 and more."
    detok, deltas, last, _ = stream(tok, ids, prompt=prompt)
    assert deltas[0] == " Paris"
    assert "".join(deltas) + last == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected
    assert detok.output_token_ids == ids


def test_prompt_ending_inside_a_character(llama):
    """The last 5 prompt tokens start inside a parrot (4 byte tokens each), so the decoding
    context is widened to a character boundary; the output is still exact."""
    prompt, ids, expected = split_at_prompt(llama, "emoji 🦜🦜", "鹦鹉 tail")
    assert llama.convert_ids_to_tokens(prompt[-5]) == "<0x9C>"
    _, deltas, last, _ = stream(llama, ids, prompt=prompt)
    assert "".join(deltas) + last == expected == "鹦鹉 tail"


def test_incomplete_character_is_released_at_finish(llama):
    """Bytes that never complete a character (a random-weight model) show as U+FFFD once the
    request finishes, as a one-shot decode does; a long run of them does not stall output."""
    e4, b8, cont = (llama.convert_tokens_to_ids(f"<0x{b}>") for b in ("E4", "B8", "80"))
    ids = encode(llama, "ab") + [e4] + encode(llama, "cd") + [cont] * 40 + [e4, b8]
    detok, deltas, last, _ = stream(llama, ids)
    full = llama.decode(ids)
    assert "".join(deltas) + last == full
    assert last.endswith("\ufffd\ufffd")
    assert len("".join(deltas)) > len(full) - 20  # the long invalid run was released early


def test_non_streaming_text_matches(tok):
    ids = encode(tok, HARD_TEXT)
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        detok.update([i])
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(ids)


def test_long_output_and_skipped_steps(tok):
    """A long output (the working tail is trimmed), deltas fetched only every 100 tokens, and a
    stop string near the end."""
    text = (HARD_TEXT + " ") * 12 + "FINAL STOP here"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas, stop = [], None
    for n, i in enumerate(ids):
        stop = detok.update([i])
        if stop or n % 100 == 99:
            deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop:
            break
    expected = tok.decode(ids)[: tok.decode(ids).index("STOP")]
    assert stop == "STOP" and "".join(deltas) == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected


# 2. Stop strings split across 1, 2 and 3 tokens.


def stop_across(tok, ids, num_tokens: int) -> tuple[str, int]:
    """A stop string that occurs once and overlaps exactly num_tokens tokens: a whole word for
    one token, else from the 2nd character of a token into the last token; and that last token."""
    bounds = char_bounds(tok, ids)
    text = tok.decode(ids)
    for first in range(1, len(ids) - num_tokens):
        last = first + num_tokens - 1
        if num_tokens == 1:
            stop = text[bounds[first] : bounds[first + 1]].strip()
        else:
            stop = text[bounds[first] + 1 : bounds[last] + 2]
        if len(stop) < 2 or text.count(stop) != 1:
            continue
        start = text.index(stop)
        end = start + len(stop)
        overlapped = [i for i in range(len(ids)) if bounds[i] < end and bounds[i + 1] > start]
        if overlapped == list(range(first, last + 1)):
            return stop, last
    raise AssertionError(f"no stop string across {num_tokens} tokens in {text!r}")


@pytest.mark.parametrize("num_tokens", [1, 2, 3])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(tok, num_tokens, include):
    ids = encode(tok, ASCII_TEXT)
    text = tok.decode(ids)
    stop, last = stop_across(tok, ids, num_tokens)
    detok, deltas, final, stop_at = stream(
        tok, ids, stop=[stop], include_stop_str_in_output=include
    )
    assert stop_at == last  # reported by the update with the token that completes it
    assert detok.matched_stop == stop
    start = text.index(stop)
    expected = text[: start + len(stop)] if include else text[:start]
    streamed = "".join(deltas)
    assert streamed + final == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected
    if not include:
        # Nothing of the stop string was ever sent: not even its first character.
        assert len(streamed) <= start


def test_stop_string_inside_multibyte_text(tok):
    text = "前面的文字。停止词🦜在这里，后面的不要。"
    ids = encode(tok, text)
    _, deltas, final, stop_at = stream(tok, ids, stop=["止词🦜在"])
    assert stop_at is not None
    assert "".join(deltas) + final == tok.decode(ids)[: tok.decode(ids).index("止词🦜在")]
    assert not any("\ufffd" in d for d in deltas)


def test_holdback_releases_all_but_the_longest_stop_prefix(tok):
    ids = encode(tok, ASCII_TEXT)
    detok = IncrementalDetokenizer(tok, [], stop=["xyz", "never-matches"])  # longest: 13 chars
    sent = ""
    for i in ids:
        assert detok.update([i]) is None
        sent += detok.get_next_output_text(finished=False, delta=True)
        assert sent == detok.output_text[: max(len(detok.output_text) - 12, 0)]
    assert sent + detok.get_next_output_text(finished=True, delta=True) == tok.decode(ids)


# 3. Several stop strings, a stop at the very start, near misses, EOS and min_tokens.


def test_earliest_of_several_stop_strings_wins(tok):
    ids = encode(tok, ASCII_TEXT)
    for chunk in (1, len(ids)):  # token by token, and all tokens in one step
        detok, deltas, final, _ = stream(tok, ids, chunk=chunk, stop=["lazy", "brown", "fox"])
        assert detok.matched_stop == "brown"
        assert "".join(deltas) + final == "The quick "


def test_stop_string_at_the_very_start(tok):
    ids = encode(tok, "Stop right there.")
    detok, deltas, final, stop_at = stream(tok, ids, stop=["Stop"])
    assert stop_at == 0 and detok.matched_stop == "Stop"
    assert deltas == [] and final == ""
    detok, deltas, final, _ = stream(tok, ids, stop=["Stop"], include_stop_str_in_output=True)
    assert final == "Stop"


def test_near_misses_are_released(tok):
    """"fox jumps" starts twice without completing; all of that text reaches the client."""
    text = "a fox jumped, a fox jumbled, the end"
    ids = encode(tok, text)
    detok, deltas, final, stop_at = stream(tok, ids, stop=["fox jumps"])
    assert stop_at is None and detok.matched_stop is None
    assert "".join(deltas) + final == tok.decode(ids)
    assert "".join(deltas) == tok.decode(ids)[: -len("fox jumps") + 1]  # held until finished


def test_stop_found_after_near_miss(tok):
    text = "abc ab abd abcd"
    ids = encode(tok, text)
    _, deltas, final, _ = stream(tok, ids, stop=["abcd"])
    assert "".join(deltas) + final == tok.decode(ids)[: tok.decode(ids).rindex("abcd")]


def test_eos_finishing_the_request(qwen):
    ids = encode(qwen, "Done.<|im_end|>")
    for include, expected in ((False, "Done."), (True, "Done.<|im_end|>")):
        detok = IncrementalDetokenizer(
            qwen, [], skip_special_tokens=False, include_stop_str_in_output=include
        )
        assert detok.update(ids, stop_terminated=True) is None
        assert detok.get_next_output_text(finished=True, delta=False) == expected
        assert detok.output_token_ids == ids


def test_min_tokens_defers_stop_strings(tok):
    ids = encode(tok, "one two one two one")
    first_two = len(encode(tok, "one two"))
    for chunk in (1, len(ids)):  # token by token, and all tokens in one step
        detok, deltas, final, stop_at = stream(
            tok, ids, chunk=chunk, stop=["one"], min_tokens=first_two
        )
        assert stop_at is not None and stop_at >= first_two
        assert "".join(deltas) + final == tok.decode(ids)[: tok.decode(ids).index("one", 2)]


def test_from_sampling_params(qwen):
    params = SamplingParams(stop="STOP", include_stop_str_in_output=True, skip_special_tokens=False)
    detok = IncrementalDetokenizer.from_sampling_params(qwen, [], params)
    assert detok.update(encode(qwen, "<|im_start|>go STOP now")) == "STOP"
    assert detok.get_next_output_text(finished=True, delta=False) == "<|im_start|>go STOP"


# 4. Special and added tokens.

QWEN_REPLY = "<think>\n想一想 🤔\n</think>\n\nAnswer: <tool_call>x</tool_call><|im_end|><|endoftext|>"


@pytest.mark.parametrize("spaces", [True, False])
def test_qwen_special_and_added_tokens(qwen, spaces):
    ids = encode(qwen, QWEN_REPLY)
    assert qwen.convert_tokens_to_ids("<think>") in ids and qwen.eos_token_id in ids
    # skip_special_tokens drops <|im_end|> and <|endoftext|> but keeps the non-special <think>
    # and <tool_call>, unspaced: a reasoning parser sees exactly "<think>\n".
    for skip, expected in (
        (True, QWEN_REPLY.removesuffix("<|im_end|><|endoftext|>")),
        (False, QWEN_REPLY),
    ):
        assert qwen.decode(ids, skip_special_tokens=skip) == expected
        for chunk in (1, 2):
            _, deltas, final, _ = stream(
                qwen, ids, chunk=chunk, skip_special_tokens=skip,
                spaces_between_special_tokens=spaces,
            )
            assert "".join(deltas) + final == expected


def test_qwen_chat_prompt_context(qwen):
    prompt = encode(qwen, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = encode(qwen, "Hello 👋 there<|im_end|>")
    _, deltas, final, _ = stream(qwen, ids, prompt=prompt)
    assert "".join(deltas) + final == "Hello 👋 there"


def test_llama_special_tokens(llama):
    specials = [llama.eos_token_id, llama.bos_token_id]
    ids = encode(llama, "Hi there") + specials + encode(llama, "again")
    for skip, expected in ((True, "Hi there again"), (False, "Hi there</s><s> again")):
        assert llama.decode(ids, skip_special_tokens=skip) == expected
        _, deltas, final, _ = stream(llama, ids, skip_special_tokens=skip)
        assert "".join(deltas) + final == expected


def test_spaces_between_special_tokens_with_a_spacing_decoder():
    """A WordPiece decoder puts a space between every two tokens; with
    spaces_between_special_tokens=False two adjacent added tokens are written together."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["[SEP]", "[CLS]"]})
    ids = encode(tok, "hellos [SEP] [CLS] world")
    assert tok.decode(ids) == "hellos [SEP] [CLS] world"
    for spaces, expected in (
        (True, "hellos [SEP] [CLS] world"),
        (False, "hellos [SEP][CLS] world"),
    ):
        _, deltas, final, _ = stream(
            tok, ids, skip_special_tokens=False, spaces_between_special_tokens=spaces
        )
        assert "".join(deltas) + final == expected


# Single tokens for logprobs.


def test_token_to_str_and_bytes(tok):
    ids = encode(tok, HARD_TEXT)
    data = b"".join(token_to_bytes(tok, i) for i in ids)
    # Llama's encoder adds a "▁" at the start of the text; its decoder drops it again.
    lead = " " if tok.name_or_path == LLAMA2_DIR else ""
    assert data.decode() == lead + tok.decode(ids)
    for i in ids:
        piece = token_to_str(tok, i)
        raw = token_to_bytes(tok, i)
        if piece.startswith("bytes:"):
            assert piece == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            assert piece.encode() == raw
    hello = encode(tok, "Hello world")[-1]
    assert token_to_str(tok, hello) == " world"
    assert token_to_str(tok, tok.eos_token_id) == tok.eos_token
    assert token_to_str(tok, 10**7) == ""
