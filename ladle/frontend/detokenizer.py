"""Incremental detokenization for one request, run in the API process (never in the engine):
turns the engine's token ids into text deltas that never split a character, finds stop strings,
and holds back the text that could still turn out to be the start of a stop string."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ladle.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"  # what a decoder gives for bytes that are not (yet) valid UTF-8
# SentencePiece decoders drop the leading space of a sequence's first token, so the first output
# token is decoded after a few prompt tokens (more if those start inside a character).
_MIN_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 12
# Valid text reaches a token boundary that is also a character boundary within a few tokens, so
# text still ending in an incomplete character after this many tokens is invalid bytes (a
# random-weight model emits such runs): it is released as U+FFFD rather than re-decoding an ever
# longer window.
_MAX_HELD_TOKENS = 16
# The text is a list of final chunks plus a short working tail where stop strings are searched
# and cut; the tail is trimmed back to this many characters, keeping each step O(1).
_TAIL_CHARS = 1024


class IncrementalDetokenizer:
    """Decodes one request's output tokens as they arrive, with vLLM's semantics.

    Decoding uses the prefix/read window of vLLM: each new token is decoded together with the
    tokens of the previous step (`ids[prefix_offset:]`) and the delta is what that window's text
    adds to the text of `ids[prefix_offset:read_offset]`, so each token costs two decodes of a
    few tokens, whatever the output's length. Text ending in U+FFFD (a character split across
    tokens) is held until the character is complete. The concatenated text equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)`, except that the output's first token
    keeps a leading space a SentencePiece decoder would drop at the start of a sequence (the
    output continues the prompt), and a token in `stop_token_ids` or EOS that finishes the
    request is left out unless `include_stop_str_in_output` (as in vLLM). For bytes that are
    not valid UTF-8 the number of U+FFFD may differ from a one-shot decode.

    skip_special_tokens: added tokens marked special (`<|im_end|>`, `</s>`) leave no text;
    added tokens that are not special (Qwen3's `<think>`) always stay.
    spaces_between_special_tokens: the text is what the tokenizer's own (fast) decoder writes,
    as in vLLM with fast tokenizers. Byte-level BPE and SentencePiece decoders put no space
    around added tokens (`"Hi<|im_end|><|endoftext|>"`), so both values give the same text with
    them; with False, a space the decoder puts between two adjacent added tokens (WordPiece
    writes `"[SEP] [CLS]"`) is removed. Slow-tokenizer spacing (`"Hi <|im_end|>"`) is not
    reproduced: it would also rewrite `"<think>\\n"` as `"<think> \\n"`.

    Stop strings: after `update()` the text is searched only where a stop string could newly
    end (the new text plus len(stop) - 1 characters before it). The earliest match wins (ties:
    the one that starts first); the text is cut before it, or after it with
    `include_stop_str_in_output`. Until the request finishes, `get_next_output_text()` holds
    back the last max(len(stop)) - 1 characters, so a client never sees the start of a stop
    string that later completes. With `include_stop_str_in_output` nothing is held back: the
    text before a match's end is output either way.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        """tokenizer: a transformers tokenizer (fast ones are decoded by their Rust backend,
        others through `tokenizer.decode`). prompt_token_ids: the request's prompt, whose last
        few tokens are decoding context. min_tokens: stop strings that end within the first
        min_tokens output tokens are ignored, as in vLLM."""
        self.stop = list(stop or ())
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty strings")
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.matched_stop: str | None = None  # the stop string that ended the text, once found
        self._holdback = (
            max(map(len, self.stop)) - 1 if self.stop and not include_stop_str_in_output else 0
        )
        self._keep_chars = max(_TAIL_CHARS, max(map(len, self.stop), default=0))

        self._decode = _make_decode(tokenizer, skip_special_tokens)
        added = tokenizer.added_tokens_decoder  # id -> AddedToken
        # Skipped tokens leave no text, so they stay out of the decode window (else a long run
        # of them, e.g. EOS repeated under ignore_eos, would grow the window without bound).
        self._skipped_ids = frozenset(
            i for i, t in added.items() if skip_special_tokens and t.special
        )
        self._added_text: dict[int, str] = {}  # visible added tokens, only for the spacing rule
        if not spaces_between_special_tokens:
            self._added_text = {
                i: t.content for i, t in added.items() if i not in self._skipped_ids
            }
        self._last_was_added = False

        context = _prompt_context(self._decode, list(prompt_token_ids or ()))
        self._ids = context  # decode window source: prompt context, then decoded output tokens
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self._output_ids: list[int] = []

        self._head: list[str] = []  # final text chunks before the tail
        self._num_head_chars = 0
        self._tail = ""  # the text's end: stop strings are searched and cut here
        self._num_sent_chars = 0  # characters already returned as deltas

    @classmethod
    def from_sampling_params(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int] | None,
        params: SamplingParams,
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    @property
    def output_token_ids(self) -> list[int]:
        """Every output token id received, including a finishing EOS/stop token and tokens after
        a stop string in the same step (they were generated). Do not mutate."""
        return self._output_ids

    @property
    def output_text(self) -> str:
        """The text so far, including held-back characters (not a character still incomplete)."""
        if len(self._head) > 1:
            self._head = ["".join(self._head)]
        return (self._head[0] if self._head else "") + self._tail

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Appends the step's new tokens; returns the stop string if the text now contains one
        (the caller then finishes the request with finish_reason "stop", stop_reason = it).
        stop_terminated: the last token is EOS or in stop_token_ids and finishes the request;
        its text is then left out unless include_stop_str_in_output. Tokens that arrive after
        a stop string was found are ignored."""
        if self.matched_stop is not None or not new_token_ids:
            return None
        num_to_decode = len(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            num_to_decode -= 1
        new_text = ""
        num_unchecked = 0  # leading chars of new_text made within the first min_tokens tokens
        for i, token_id in enumerate(new_token_ids):
            self._output_ids.append(token_id)
            if i < num_to_decode:
                new_text += self._decode_next(token_id)
            if len(self._output_ids) <= self.min_tokens:
                num_unchecked = len(new_text)
        self._tail += new_text

        matched = None
        if self.stop and len(self._output_ids) > self.min_tokens:
            search_from = len(self._tail) - len(new_text) + num_unchecked
            match = _find_stop(self._tail, search_from, self.stop)
            if match is not None:
                matched, start = match
                end = start + len(matched) if self.include_stop_str_in_output else start
                self._tail = self._tail[:end]
                self.matched_stop = matched
        self._trim_tail()
        return matched

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """delta: the text since the last delta call; else the whole text so far. Until
        finished, the last max(len(stop)) - 1 characters are held back; once finished, all the
        text is released, with an incomplete character at the end as U+FFFD."""
        if finished and self.matched_stop is None:
            self._tail += self._flush()
        num_chars = self._num_head_chars + len(self._tail)
        end = num_chars if finished else max(num_chars - self._holdback, 0)
        if not delta:
            return self.output_text[:end]
        start = self._num_sent_chars
        if end <= start:
            return ""
        self._num_sent_chars = end
        if start >= self._num_head_chars:
            return self._tail[start - self._num_head_chars : end - self._num_head_chars]
        return self.output_text[start:end]  # the caller skipped steps: rare, O(length)

    def _decode_next(self, token_id: int) -> str:
        """The text that token_id completes; "" while a character is incomplete."""
        if token_id in self._skipped_ids:
            return ""
        ids = self._ids
        ids.append(token_id)
        follows_added = self._last_was_added
        self._last_was_added = token_id in self._added_text
        text = self._decode(ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or (
            text.endswith(_REPLACEMENT_CHAR) and len(ids) - self._read_offset < _MAX_HELD_TOKENS
        ):
            return ""
        delta = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._prefix_text = self._decode(ids[self._prefix_offset :])
        if follows_added and self._last_was_added:
            # spaces_between_special_tokens=False: no space between two adjacent added tokens
            # (vLLM's rule), whatever the decoder writes.
            content = self._added_text[token_id]
            if delta == " " + content:
                delta = content
        return delta

    def _flush(self) -> str:
        """Releases held tokens (an incomplete character) as the text a full decode gives."""
        if self._read_offset == len(self._ids):
            return ""
        delta = self._decode(self._ids[self._prefix_offset :])[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        return delta

    def _trim_tail(self) -> None:
        """Moves all but the last `_keep_chars` characters of the tail into the final head (no
        stop string can start there any more: a new match ends in new text)."""
        if len(self._tail) > 2 * self._keep_chars:
            cut = len(self._tail) - self._keep_chars
            self._head.append(self._tail[:cut])
            self._num_head_chars += cut
            self._tail = self._tail[cut:]


def _make_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """ids -> text. Fast tokenizers go straight to Rust (about 2 us for a few tokens); the
    transformers wrapper would add overhead and clean_up_tokenization_spaces, which rewrites
    text in ways that are not incremental (vLLM skips it too)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _prompt_context(decode: Callable[[list[int]], str], prompt_ids: list[int]) -> list[int]:
    """The last few prompt tokens, starting on a character boundary; [] if there is none (the
    output then decodes as if alone)."""
    num_prompt = len(prompt_ids)
    for n in range(min(num_prompt, _MIN_CONTEXT_TOKENS), min(num_prompt, _MAX_CONTEXT_TOKENS) + 1):
        context = prompt_ids[num_prompt - n :]
        text = decode(context)
        if not text.startswith(_REPLACEMENT_CHAR) and not text.endswith(_REPLACEMENT_CHAR):
            return context
    return []


def _find_stop(text: str, search_from: int, stop: list[str]) -> tuple[str, int] | None:
    """The stop string that ends first in text[search_from:] (ties: the one starting first), and
    its start. A match may start up to len(s) - 1 characters before search_from."""
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        start = text.find(s, max(search_from - len(s) + 1, 0))
        if start != -1 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    return None if best is None else (best[2], best[1])


# Logprobs show each token on its own. The text a token adds to the output is a byte string
# that need not be valid UTF-8 on its own (a third of a Chinese character, half an emoji);
# token_to_str renders such a token as OpenAI does: "bytes:" and each byte as \xNN.


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2, Qwen, Llama-3) writes each byte as one printable character:
    printable Latin-1 bytes as themselves, the other 68 as U+0100 onwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    others = sorted(set(range(256)) - set(printable))
    alphabet.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return alphabet


_BYTE_OF_CHAR = MappingProxyType(_byte_level_alphabet())
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()


def token_to_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes:
    """The bytes token_id adds to the text, including a leading space ("▁Hello" -> b" Hello");
    b"" for an id outside the vocabulary. Added tokens give their content."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    if _is_byte_level(tokenizer):
        if all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return piece.encode()  # an added token written outside the byte alphabet
    byte = _BYTE_TOKEN.fullmatch(piece)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    return piece.replace("\u2581", " ").encode()


def token_to_str(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """The text of one token for logprobs (leading space kept: " Hello"). A token whose bytes
    are not valid UTF-8 on their own is written as OpenAI does, e.g. "bytes:\\xe4\\xb8"
    (a backslash, x, two hex digits per byte); its true bytes come from token_to_bytes."""
    data = token_to_bytes(tokenizer, token_id)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
