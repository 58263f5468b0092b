"""Gemma 2 and Gemma 3 (text) against transformers, on random-weight checkpoints whose prompts
are longer than the sliding window: greedy tokens equal to `generate` and logits within float32
rounding, plain, in chunks, through prefix-cache hits, preemption and ngram speculation;
bfloat16 no further from the float32 reference than transformers' own bfloat16. Paged attention
with windows and soft-caps against a dense float64 reference; both config.json styles;
tensor parallelism."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from checkpoints import make_gemma_checkpoint
from test_engine_numerics import reference_logits, run

from ladle.config import EngineConfig
from ladle.engine.core import EngineCore
from ladle.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, read_config
from ladle.runner.attention import AttentionMetadata, DecodeBatch, build_prefill, paged_attention

# Gemma 3: a window of one block, linear rope scaling on the global layers, and an attention
# soft-cap in the config that transformers ignores for Gemma 3 (so must ladle); seed 1 gives
# greedy outputs of 6-10 distinct tokens. Gemma 2: a window that is not a multiple of the block
# size, both soft-caps on.
CHECKPOINTS = {
    "gemma3": dict(sliding_window=16, rope_scaling={"rope_type": "linear", "factor": 2.0},
                   attn_logit_softcapping=20.0, seed=1),
    "gemma2": dict(sliding_window=19),
}
_gen = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (40, 63, 88, 120)]
NUM_DECODE = 24
FP32_TOL = 2e-4  # as tests/test_engine_numerics.py: float32 agrees to rounding
BF16_SLACK = 1.5


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = make_gemma_checkpoint(request.param, path, **CHECKPOINTS[request.param])
    return path, ref


def generate(ref, prompt) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=NUM_DECODE, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(checkpoint):
    """transformers' greedy continuation of each prompt."""
    _, ref = checkpoint
    return [generate(ref, p) for p in PROMPTS]


def engine(path, dtype="float32", **kw) -> EngineCore:
    kw.setdefault("kv_cache_memory", "16MB")
    return EngineCore(EngineConfig(model=str(path), dtype=dtype, **kw), keep_logits=True)


def assert_matches(ref, prompts, toks, logs, want_toks):
    for p, t, ours, want in zip(prompts, toks, logs, want_toks, strict=True):
        assert t == want
        err = (ours - reference_logits(ref, p, t)).abs().max().item()
        assert err <= FP32_TOL, err


def test_greedy_and_logits_match_transformers(checkpoint, expected):
    path, ref = checkpoint
    eng = engine(path)
    toks, logs = run(eng, PROMPTS, max_tokens=NUM_DECODE)
    assert_matches(ref, PROMPTS, toks, logs, expected)
    assert all(len(set(t)) > 4 for t in toks)  # tokens vary, so equality means something


def test_chunked_prefill(checkpoint, expected):
    """Chunks of 16 tokens: every chunk after the first attends cached context through the
    window's blocks and band mask."""
    path, ref = checkpoint
    eng = engine(path, max_num_batched_tokens=16)
    toks, logs = run(eng, PROMPTS, max_tokens=NUM_DECODE)
    # Unchunked, the prompts take one step; in 16-token chunks the 407 tokens take 26 or more.
    assert eng.num_steps >= 26
    assert_matches(ref, PROMPTS, toks, logs, expected)


def test_prefix_cache_hits(checkpoint, expected):
    path, ref = checkpoint
    eng = engine(path)
    run(eng, PROMPTS, max_tokens=NUM_DECODE)
    hits_before = eng.kv_cache.num_prefix_hits
    # The same prompts again, and one sharing 70 tokens (4 blocks) with the longest.
    shared = PROMPTS[3][:70] + [11, 12, 13, 14, 15]
    toks, logs = run(eng, PROMPTS + [shared], max_tokens=NUM_DECODE, start=100)
    assert eng.kv_cache.num_prefix_hits - hits_before >= 16 * (2 + 3 + 5 + 7 + 4)
    assert_matches(ref, PROMPTS + [shared], toks, logs, expected + [generate(ref, shared)])


def test_preemption(checkpoint, expected):
    path, ref = checkpoint
    # 12 blocks of 16 tokens cannot hold the four requests at once (they need 26 at the end).
    eng = engine(path, num_kv_blocks=12, max_model_len=160)
    toks, logs = run(eng, PROMPTS, max_tokens=NUM_DECODE)
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv_cache.num_used_blocks == 0
    assert_matches(ref, PROMPTS, toks, logs, expected)


def test_ngram_speculation(checkpoint, expected):
    """Draft tokens are verified through the prefill path (several queries per row, windowed);
    the tokens are those of plain greedy decoding."""
    path, ref = checkpoint
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    eng = engine(path, speculative_config=spec)
    toks, _ = run(eng, PROMPTS, max_tokens=NUM_DECODE)
    assert toks == expected
    assert eng.num_accepted_tokens > 0  # some verification rows went past their first token


def test_bfloat16_no_further_than_transformers_bfloat16(checkpoint):
    path, ref = checkpoint
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    toks, logs = run(engine(path, "bfloat16"), PROMPTS[:2], max_tokens=8)
    for p, t, ours in zip(PROMPTS[:2], toks, logs, strict=True):
        theirs = reference_logits(ref, p, t)
        hf_err = (reference_logits(ref_bf16, p, t) - theirs).abs().max().item()
        err = (ours - theirs).abs().max().item()
        assert err <= BF16_SLACK * hf_err, (err, hf_err)


# --- paged attention with windows and soft-caps, against a dense reference ---------------------

def dense_attention(q, k, v, q_pos, scale, window, softcap):
    """float64 reference: q (Q, H, D) at positions q_pos attends k, v (L, KVH, D) at 0..L-1."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale  # (H, Q, L)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    kv_pos = torch.arange(k.shape[0])[None, :]
    allowed = kv_pos <= q_pos[:, None]
    if window is not None:
        allowed &= kv_pos > q_pos[:, None] - window
    probs = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


@pytest.mark.parametrize("window", [None, 1, 5, 16, 19, 100])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_paged_attention_windows_and_softcap_match_dense(window, softcap):
    """One step with a decode row, a chunk with cached context and a fresh prompt, each
    checked against dense attention over its whole sequence."""
    torch.manual_seed(11)
    H, KVH, D, bs, num_blocks = 4, 2, 16, 16, 24
    scale = 0.3  # large scores, so the cap bites
    k_cache = torch.zeros(num_blocks, KVH, bs, D)
    v_cache = torch.zeros(num_blocks, KVH, bs, D)
    # (tokens cached before the step, tokens this step, blocks)
    seqs = [(57, 1, [5, 9, 2, 14]), (45, 22, [1, 3, 7, 11, 20]), (0, 37, [4, 6, 8])]
    full = [(torch.randn(c + n, H, D), torch.randn(c + n, KVH, D), torch.randn(c + n, KVH, D))
            for c, n, _ in seqs]
    for (c, _, blocks), (_, k, v) in zip(seqs, full, strict=True):  # the cached context
        for t in range(c):
            k_cache[blocks[t // bs], :, t % bs] = k[t]
            v_cache[blocks[t // bs], :, t % bs] = v[t]
    q = torch.cat([f[0][c:] for (c, _, _), f in zip(seqs, full, strict=True)])  # (T, H, D)
    k = torch.cat([f[1][c:] for (c, _, _), f in zip(seqs, full, strict=True)])
    v = torch.cat([f[2][c:] for (c, _, _), f in zip(seqs, full, strict=True)])
    pos = torch.cat([torch.arange(c, c + n) for c, n, _ in seqs])
    slot_blocks = torch.cat([torch.tensor(b)[torch.arange(c, c + n) // bs] for c, n, b in seqs])
    tables = [torch.tensor(b) for _, _, b in seqs]
    meta = AttentionMetadata(
        slot_blocks=slot_blocks, slot_offsets=pos % bs,
        decode=DecodeBatch(rows=torch.tensor([0]), block_table=tables[0][None],
                           ctx_lens=torch.tensor([58])),
        prefills=[build_prefill(1, 22, 67, tables[1], bs, "cpu"),
                  build_prefill(23, 37, 37, tables[2], bs, "cpu")])
    out = paged_attention(q, k, v, (k_cache, v_cache), meta, scale, window, softcap)
    start = 0
    for (c, n, _), (fq, fk, fv) in zip(seqs, full, strict=True):
        want = dense_attention(fq[c:], fk, fv, torch.arange(c, c + n), scale, window, softcap)
        torch.testing.assert_close(out[start:start + n].double(), want, atol=1e-5, rtol=1e-5)
        start += n


def test_window_masks_are_built_once_per_step():
    chunk = build_prefill(0, 22, 67, torch.tensor([1, 3, 7, 11, 20]), 16, "cpu")
    blocks, mask = chunk.keys_for(19, "cpu")
    assert blocks.tolist() == [3, 7, 11, 20]  # keys from position 45 - 18 = 27: block 1 on
    assert chunk.keys_for(19, "cpu")[1] is mask
    assert all(a is b for a, b in zip(chunk.keys_for(None, "cpu"),
                                      (chunk.block_table, chunk.mask), strict=True))
    assert chunk.keys_for(67, "cpu")[1] is chunk.mask  # a window spanning the context: no band


# --- config.json styles -----------------------------------------------------------------------

def test_flat_and_transformers5_configs_read_the_same():
    """Google's published files are flat (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern); transformers 5 writes rope_parameters by layer type and
    layer_types. Both give the same model; a Gemma 2 file without layer_types alternates."""
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
    modern = json.loads(tf.Gemma3TextConfig(
        **common, rope_scaling={"rope_type": "linear", "factor": 8.0}).to_json_string())
    flat = {**common, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256}
    a, b = read_config(modern, Gemma3ForCausalLM), read_config(flat, Gemma3ForCausalLM)
    assert a == b
    assert a.windows == (8, 8, 8, 8, 8, None, 8)
    assert (a.rope_full.theta, a.rope_full.scaling["factor"]) == (1e6, 8.0)
    assert (a.rope_sliding.theta, a.rope_sliding.scaling) == (1e4, None)
    assert a.attn_softcap is None and a.final_softcap is None and a.qk_norm

    g2 = read_config({**common, "rope_theta": 10000.0}, Gemma2ForCausalLM)
    assert g2.windows == (8, None, 8, None, 8, None, 8)
    assert (g2.attn_softcap, g2.final_softcap) == (50.0, 30.0)  # transformers' defaults
    assert g2.rope_sliding == g2.rope_full and not g2.qk_norm
    assert g2 == read_config(json.loads(tf.Gemma2Config(**common).to_json_string()),
                             Gemma2ForCausalLM)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        read_config({**flat, "use_bidirectional_attention": True}, Gemma3ForCausalLM)


# --- tensor parallelism ------------------------------------------------------------------------

def test_tp2_equals_tp1(checkpoint):
    """Llama's split (heads, MLP, vocabulary) with Gemma's norms, windows and caps: -tp 2 gives
    the tokens and logits of -tp 1."""
    path, _ = checkpoint
    results = []
    for tp in (1, 2):
        eng = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                      max_model_len=256, tensor_parallel_size=tp),
                         keep_logits=True)
        try:
            results.append(run(eng, PROMPTS[:2], max_tokens=8))
        finally:
            eng.close()
    (tok1, log1), (tok2, log2) = results
    assert tok2 == tok1
    for a, b in zip(log1, log2, strict=True):
        # The all-reduce sums in another order: float32 rounding, relative to logits that
        # reach ~10 here.
        assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item(), \
            ((a - b).abs().max().item(), a.abs().max().item())
