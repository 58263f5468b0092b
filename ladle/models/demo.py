"""`ladle-demo`, the built-in default model: a tiny Qwen3 with random weights and Qwen's real
tokenizer and chat template, built locally on first use and cached.

Its text is meaningless. It exists so every feature (chat templates, tools, reasoning, sampling,
structured output, streaming) runs with no download, and so tests have a real checkpoint to load.
"""

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ladle.models.qwen_tokenizer import ADDED_TOKEN_IDS, FIRST_ADDED_TOKEN_ID, write_qwen_tokenizer

DEMO_MODEL_NAME = "ladle-demo"
# Bump the version when the files change, so old caches are not reused.
DEMO_MODEL_DIRNAME = "ladle-demo-v2"
CACHE_DIR_ENV = "LADLE_CACHE_DIR"
DEMO_SEED = 0
DEMO_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_cache_dir() -> Path:
    """$LADLE_CACHE_DIR if set, else ~/.cache/ladle."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "ladle"


def demo_config() -> dict[str, Any]:
    """config.json, in the layout of Qwen3's published configs.

    Hidden 256 with 4 layers keeps the transformer itself under 4M parameters; the 151,936-row
    embedding and (untied) head are most of the 81M, and are what Qwen's vocabulary costs.
    """
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ADDED_TOKEN_IDS["<|endoftext|>"],
        "eos_token_id": ADDED_TOKEN_IDS["<|im_end|>"],
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": 0.02,
        "intermediate_size": 768,
        "max_position_embeddings": 4096,
        "max_window_layers": 4,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        # Untied: with tied random embeddings the head scores the input token highest, and greedy
        # decoding just echoes it.
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def demo_generation_config() -> dict[str, Any]:
    """generation_config.json: Qwen3's stop ids and its non-thinking sampling defaults."""
    return {
        "bos_token_id": ADDED_TOKEN_IDS["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ADDED_TOKEN_IDS["<|im_end|>"], ADDED_TOKEN_IDS["<|endoftext|>"]],
        "pad_token_id": ADDED_TOKEN_IDS["<|endoftext|>"],
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    }


def demo_chat_template() -> str:
    """The Qwen3-style chat template shipped next to this module."""
    return (resources.files("ladle.models") / "demo_chat_template.jinja").read_text("utf-8")


def demo_state_dict(config: dict[str, Any], seed: int = DEMO_SEED) -> dict[str, torch.Tensor]:
    """Random bf16 weights, under Hugging Face's Qwen3 names, scaled so generation varies.

    The usual small init (std 0.02) leaves the residual stream almost equal to the current
    token's embedding, so the next token is a fixed function of the last one and greedy output
    falls into a loop of one to three tokens. Here embeddings have unit variance and every
    projection has std 1/sqrt(fan_in), so each attention and MLP block adds an update as large as
    the embedding and the logits depend on the whole context.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * std).to(torch.bfloat16)

    def linear(out_dim: int, in_dim: int) -> torch.Tensor:
        return normal(out_dim, in_dim, in_dim**-0.5)

    def ones(dim: int) -> torch.Tensor:
        return torch.ones(dim, dtype=torch.bfloat16)

    embed = normal(vocab, hidden, 1.0)
    # Dimension 0 of the residual stream carries a constant that no layer writes to, so the
    # head's column 0 acts as a per-token bias: the structural prior below.
    embed[:, 0] = PRIOR_CONSTANT
    weights = {"model.embed_tokens.weight": embed}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        weights |= {
            prefix + "input_layernorm.weight": ones(hidden),
            prefix + "self_attn.q_proj.weight": linear(q_dim, hidden),
            prefix + "self_attn.k_proj.weight": linear(kv_dim, hidden),
            prefix + "self_attn.v_proj.weight": linear(kv_dim, hidden),
            prefix + "self_attn.o_proj.weight": _no_write_to_dim0(linear(hidden, q_dim)),
            prefix + "self_attn.q_norm.weight": ones(head_dim),
            prefix + "self_attn.k_norm.weight": ones(head_dim),
            prefix + "post_attention_layernorm.weight": ones(hidden),
            prefix + "mlp.gate_proj.weight": linear(inter, hidden),
            prefix + "mlp.up_proj.weight": linear(inter, hidden),
            prefix + "mlp.down_proj.weight": _no_write_to_dim0(linear(hidden, inter)),
        }
    weights["model.norm.weight"] = ones(hidden)
    # The final norm makes the hidden state's rms 1, so logits have std 4: clear greedy winners,
    # and about 5 nats of entropy when sampling at temperature 1.
    lm_head = normal(vocab, hidden, 4.0 * hidden**-0.5)
    # Logit 0 never wins against the ordinary tokens' logits (their maximum is near 18), so the
    # model never emits an added token (EOS, <think>, <tool_call>) or a padding id by itself.
    # Column 0 reads the constant residual dimension: a per-token logit bias (see below).
    bias = torch.full((vocab,), INACTIVE_LOGIT)
    bias[active_token_ids()] = 0.0
    closers, openers = structural_token_ids()
    bias[closers] = CLOSER_LOGIT
    bias[openers] = OPENER_LOGIT
    lm_head[:, 0] = (bias / PRIOR_HIDDEN).to(torch.bfloat16)
    lm_head[FIRST_ADDED_TOKEN_ID:] = 0
    weights["lm_head.weight"] = lm_head
    return weights


# A per-token prior. With ~150k equally plausible tokens, a random model inside a JSON string
# picks a closing quote about once in thousands of tokens, so free-form JSON (and any constraint
# with open-ended strings) would never end. A trained model concentrates on a small working
# vocabulary and readily closes what it opened; the demo imitates that: it speaks from an active
# vocabulary (the most frequent 20,000 BPE tokens plus the JSON punctuation tokens), the other
# tokens sit INACTIVE_LOGIT lower (still reachable when a constraint allows nothing else), tokens
# that close strings, lists and objects get a bonus and tokens that open them a malus, so nested
# structures end rather than grow. Its text is still meaningless.
PRIOR_CONSTANT = 8.0  # value of residual dimension 0 for every token
PRIOR_HIDDEN = 3.7  # what dimension 0 becomes after the final RMSNorm (measured: 3.67 +- 0.28)
NUM_ACTIVE_TOKENS = 20000
INACTIVE_LOGIT = -30.0
CLOSER_LOGIT = 4.0
OPENER_LOGIT = -3.0
_STRUCTURAL = set('"{}[],:')


def active_token_ids() -> list[int]:
    """The NUM_ACTIVE_TOKENS lowest-ranked (most frequent) tokens that are printable text."""
    from ladle.models.qwen_tokenizer import load_qwen_ranks

    ids = []
    for token, rank in sorted(load_qwen_ranks().items(), key=lambda kv: kv[1]):
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.isprintable() or text.strip(" \n") == "":
            ids.append(rank)
            if len(ids) == NUM_ACTIVE_TOKENS:
                break
    return ids


def _no_write_to_dim0(w: torch.Tensor) -> torch.Tensor:
    w[0] = 0
    return w


def structural_token_ids() -> tuple[list[int], list[int]]:
    """Tokens made only of JSON punctuation (at least one of " { } [ ] , :) and spaces or
    newlines, at most three characters: (closers, openers), openers being those with { or [."""
    from ladle.models.qwen_tokenizer import load_qwen_ranks

    closers, openers = [], []
    for token, rank in load_qwen_ranks().items():
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if (len(text) <= 3 and any(c in _STRUCTURAL for c in text)
                and all(c in _STRUCTURAL or c in " \n" for c in text)):
            (openers if "{" in text or "[" in text else closers).append(rank)
    return closers, openers


def build_demo_model(out_dir: str | Path, seed: int = DEMO_SEED) -> None:
    """Write the complete checkpoint (see DEMO_FILES) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = demo_config()
    save_file(demo_state_dict(config, seed), out / "model.safetensors", metadata={"format": "pt"})
    for name, doc in (
        ("config.json", config),
        ("generation_config.json", demo_generation_config()),
    ):
        (out / name).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    write_qwen_tokenizer(
        out,
        model_max_length=config["max_position_embeddings"],
        chat_template=demo_chat_template(),
    )


def ensure_demo_model(cache_dir: str | None = None) -> str:
    """Return the directory of the demo checkpoint, building it on first use.

    `cache_dir` replaces $LADLE_CACHE_DIR (default ~/.cache/ladle); the checkpoint lives in its
    `ladle-demo-v1` folder. A build goes into a temporary folder beside it that is renamed into
    place, so concurrent processes never see a half-written checkpoint: one rename wins and the
    others use the winner's files.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / DEMO_MODEL_DIRNAME
    if not final.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_DIRNAME}.", dir=root))
        try:
            build_demo_model(tmp)
            # mkdtemp makes the folder private; a shared cache must be readable by everyone.
            tmp.chmod(0o755)
            for path in tmp.iterdir():
                path.chmod(0o644)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.exists():  # the rename failed for a reason other than losing the race
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    missing = [name for name in DEMO_FILES if not (final / name).is_file()]
    if missing:
        raise RuntimeError(
            f"{final} is incomplete (missing {', '.join(missing)}); delete it to rebuild"
        )
    return str(final)
