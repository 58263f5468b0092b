"""Gated DeltaNet (ladle/models/gated_deltanet.py) against transformers' Qwen3-Next and Qwen3.5
layers with random weights, in float32: whole prompts, prompts fed in chunks and then decoded a
token at a time through the slot state, several sequences in one flat stream, and the states
themselves against transformers' cache."""

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3NextConfig
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from ladle.models.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetConfig,
    GatedDeltaNetState,
    Segment,
    chunked_gated_delta_rule,
    l2_normalize,
    state_bytes_per_slot,
)
from ladle.runner.cpu_kernels import gated_delta_step, gated_delta_step_torch, load_cpu_kernels

# Tiny, with grouped heads (2 key heads, 4 value heads) so the per-key-head regrouping of
# Qwen3-Next's fused projections and the head repetition are both exercised.
SIZES = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             vocab_size=100, intermediate_size=32)
HF_LAYERS = {
    "qwen3_next": (lambda: Qwen3NextConfig(**SIZES, moe_intermediate_size=32, num_experts=2,
                                           num_experts_per_tok=1), Qwen3NextGatedDeltaNet),
    "qwen3_5": (lambda: Qwen3_5TextConfig(**SIZES), Qwen3_5GatedDeltaNet),
}
NUM_SLOTS = 6
ATOL = 1e-5
ZERO, ONE = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool)


@pytest.fixture(scope="module", params=sorted(HF_LAYERS))
def layers(request):
    """(transformers' config, its layer, ours with the same weights loaded by name)."""
    make_config, hf_class = HF_LAYERS[request.param]
    torch.manual_seed(0)
    hf_config = make_config()
    ref = hf_class(hf_config, layer_idx=0).eval()
    # decays slow enough that the carried state matters; a norm weight that is not all ones
    with torch.no_grad():
        ref.A_log.copy_(torch.empty(4).uniform_(0.01, 1.0).log())
        ref.dt_bias.copy_(torch.randn(4) * 0.5)
        ref.norm.weight.copy_(1 + 0.2 * torch.randn(16))
    ours = GatedDeltaNet(GatedDeltaNetConfig.from_hf(hf_config.to_dict())).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return hf_config, ref, ours


def new_state(ours: GatedDeltaNet) -> GatedDeltaNetState:
    return GatedDeltaNetState.allocate(ours.cfg, NUM_SLOTS)


def hf_full(ref, x: torch.Tensor) -> torch.Tensor:
    """transformers' output for one whole sequence x (L, hidden), no cache."""
    with torch.no_grad():
        return ref(x.unsqueeze(0))[0]


def run_chunks(ours, state, x, chunk_lens, slot) -> torch.Tensor:
    """Feed x to our layer as consecutive runs of one sequence, the first one fresh."""
    outs, start = [], 0
    with torch.no_grad():
        for n in chunk_lens:
            outs.append(ours(x[start:start + n], [Segment(0, n, slot, start == 0)], state))
            start += n
    return torch.cat(outs)


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130])
def test_whole_prompt_matches_transformers(layers, length):
    _, ref, ours = layers
    torch.manual_seed(length)
    x = torch.randn(length, 64)
    state = new_state(ours)
    state.recurrent.normal_()  # a fresh segment must ignore whatever its slot held before
    state.conv.normal_()
    with torch.no_grad():
        out = ours(x, [Segment(0, length, 2, True)], state)
    torch.testing.assert_close(out, hf_full(ref, x), atol=ATOL, rtol=1e-4)


def test_chunked_prompt_then_decode_matches_full_sequence(layers):
    _, ref, ours = layers
    torch.manual_seed(1)
    x = torch.randn(102, 64)
    chunks = [32, 32, 32] + [1] * 6  # three prefill chunks (the first one fresh), six decodes
    out = run_chunks(ours, new_state(ours), x, chunks, slot=4)
    torch.testing.assert_close(out, hf_full(ref, x), atol=ATOL, rtol=1e-4)


def test_states_match_transformers_cache(layers):
    """After a prefill, a continuing chunk and decode steps, our slot holds what transformers'
    cache holds: the conv window (transformers keeps one older input than the next step reads)
    and the float32 recurrent state."""
    hf_config, ref, ours = layers
    torch.manual_seed(2)
    x = torch.randn(45, 64)
    chunks = [37, 5, 1, 1, 1]
    cache = DynamicCache(config=hf_config)
    state = new_state(ours)
    start = 0
    for n in chunks:
        with torch.no_grad():
            expected = ref(x[None, start:start + n], cache=cache)[0]
            out = ours(x[start:start + n], [Segment(0, n, 3, start == 0)], state)
        start += n
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=1e-4)
        hf_layer = cache.layers[0]
        assert hf_layer.recurrent_states[0].dtype == torch.float32
        torch.testing.assert_close(state.conv[3], hf_layer.conv_states[0][0, :, 1:],
                                   atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(state.recurrent[3], hf_layer.recurrent_states[0][0],
                                   atol=ATOL, rtol=1e-4)


def test_mixed_stream_matches_each_sequence_alone(layers):
    """One step holding a fresh prefill, a continuing chunk, three decodes and a fresh
    one-token prompt, in slots holding stale or earlier state, equals each sequence run alone."""
    _, _, ours = layers
    torch.manual_seed(3)
    # slot: (tokens before this step, tokens in this step); 0 before = fresh in this step
    plan = {0: (0, 20), 3: (10, 7), 1: (6, 1), 4: (9, 1), 5: (1, 1), 2: (0, 1)}
    xs = {slot: torch.randn(before + now, 64) for slot, (before, now) in plan.items()}

    alone_out, alone_state = {}, {}
    for slot, (before, now) in plan.items():
        state = new_state(ours)
        out = run_chunks(ours, state, xs[slot], [n for n in (before, now) if n], slot)
        alone_out[slot], alone_state[slot] = out[before:], state

    shared = new_state(ours)
    shared.recurrent.normal_()  # stale state of finished sequences in the fresh ones' slots
    shared.conv.normal_()
    for slot, (before, _) in plan.items():
        if before:
            run_chunks(ours, shared, xs[slot][:before], [before], slot)
    order = [1, 0, 4, 3, 2, 5]  # decodes and prefills interleaved in the stream
    segments, rows, start = [], [], 0
    for slot in order:
        before, now = plan[slot]
        segments.append(Segment(start, now, slot, before == 0))
        rows.append(xs[slot][before:])
        start += now
    with torch.no_grad():
        out = ours(torch.cat(rows), segments, shared)

    for seg in segments:
        torch.testing.assert_close(out[seg.start:seg.start + seg.length], alone_out[seg.slot],
                                   atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(shared.conv[seg.slot], alone_state[seg.slot].conv[seg.slot])
        torch.testing.assert_close(shared.recurrent[seg.slot],
                                   alone_state[seg.slot].recurrent[seg.slot],
                                   atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("length", [1, 7, 64, 100])
def test_chunked_rule_with_initial_state_equals_recurrent(length):
    torch.manual_seed(4)
    heads, dk, dv = 3, 8, 4
    q = l2_normalize(torch.randn(length, heads, dk)) * dk**-0.5
    k = l2_normalize(torch.randn(length, heads, dk))
    v = torch.randn(length, heads, dv)
    g = -torch.rand(length, heads) * 0.2
    beta = torch.rand(length, heads)
    initial = torch.randn(heads, dk, dv)

    out, final = chunked_gated_delta_rule(q, k, v, g, beta, initial, chunk_size=32)
    state, steps = initial.unsqueeze(0), []
    for t in range(length):
        o, state = gated_delta_step_torch(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                          beta[t:t + 1], state, ZERO, ONE)
        steps.append(o)
    torch.testing.assert_close(out, torch.cat(steps), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(final, state[0], atol=ATOL, rtol=1e-4)


def test_config_from_hf_both_families():
    nxt = GatedDeltaNetConfig.from_hf(HF_LAYERS["qwen3_next"][0]().to_dict())
    assert (nxt.layout, nxt.num_k_heads, nxt.num_v_heads, nxt.head_k_dim, nxt.head_v_dim,
            nxt.conv_kernel, nxt.conv_dim) == ("qwen3_next", 2, 4, 16, 16, 4, 128)
    # a multimodal Qwen3.5 config.json keeps the text model's fields under text_config
    text = {k: v for k, v in SIZES.items() if k != "linear_conv_kernel_dim"}
    multimodal = Qwen3_5Config(text_config=dict(text, linear_conv_kernel_dim=3)).to_dict()
    q35 = GatedDeltaNetConfig.from_hf(multimodal)
    assert (q35.layout, q35.conv_kernel, q35.eps) == ("qwen3_5", 3, 1e-6)

    state = GatedDeltaNetState.allocate(q35, num_slots=3)
    assert state.conv.shape == (3, q35.conv_dim, 2)
    assert state.recurrent.shape == (3, 4, 16, 16)
    assert state_bytes_per_slot(q35) * 3 == state.conv.nbytes + state.recurrent.nbytes


@pytest.mark.parametrize("change, field", [
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"linear_attn_layout": "fused"}, "linear_attn_layout"),
])
def test_config_errors_name_the_field(change, field):
    hf = {**SIZES, "model_type": "qwen3_next", **change}
    with pytest.raises(ValueError, match=field):
        GatedDeltaNetConfig.from_hf(hf)


@pytest.mark.parametrize("segments, message", [
    ([Segment(0, 3, 0, True), Segment(4, 2, 1, True)], "continue the stream at token 3"),
    ([Segment(0, 3, 0, True), Segment(2, 4, 1, True)], "continue the stream at token 3"),
    ([Segment(0, 0, 0, True), Segment(0, 6, 1, True)], "at least one token"),
    ([Segment(0, 6, NUM_SLOTS, True)], "slots are 0"),
    ([Segment(0, 5, 0, True)], "cover 5 tokens of the step's 6"),
    ([Segment(0, 5, 1, True), Segment(5, 1, 1, False)], "share a slot"),
])
def test_segments_are_checked(layers, segments, message):
    _, _, ours = layers
    with pytest.raises(ValueError, match=message):
        ours(torch.zeros(6, 64), segments, new_state(ours))


@pytest.mark.parametrize("dk,dv", [(16, 8), (128, 128)])
def test_the_recurrent_step_kernel_equals_its_twin(dk, dv):
    """The C++ step (each state read once, written once, the output from q^T S and q.k) against
    the rule as transformers writes it: sequences reading states at given rows, one of them
    fresh (zeros), the states themselves left unwritten."""
    assert load_cpu_kernels() is not None, "the CPU kernels did not build"
    torch.manual_seed(7)
    D, H, N = 5, 4, 9
    q = l2_normalize(torch.randn(D, H, dk)) * dk**-0.5
    k = l2_normalize(torch.randn(D, H, dk))
    v, g, beta = torch.randn(D, H, dv), -torch.rand(D, H), torch.rand(D, H)
    state = torch.randn(N, H, dk, dv)
    before = state.clone()
    rows = torch.tensor([3, 0, 8, 5, 2])
    keep = torch.tensor([True, True, False, True, True])
    out, new = gated_delta_step(q, k, v, g, beta, state, rows, keep)
    want_out, want_new = gated_delta_step_torch(q, k, v, g, beta, state, rows, keep)
    torch.testing.assert_close(out, want_out, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(new, want_new, atol=ATOL, rtol=1e-5)
    assert torch.equal(state, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nk,nv,dk,dv", [(2, 4, 16, 32), (4, 4, 32, 16)])
def test_the_decode_step_kernel_equals_its_twin(dtype, nk, nv, dk, dv):
    """A decode token between the layer's projections in one C++ call (gates, conv, SiLU, q/k
    norms, the recurrent step, the gated norm) against the layer's torch ops (_step_torch):
    value heads sharing a key head, a fresh sequence, the model's dtype. The new windows are
    equal; the rest within float32 rounding, in bfloat16 within one ulp (2^-8) of it."""
    assert load_cpu_kernels() is not None, "the CPU kernels did not build"
    cfg = GatedDeltaNetConfig(hidden_size=64, num_k_heads=nk, num_v_heads=nv, head_k_dim=dk,
                              head_v_dim=dv, conv_kernel=4, eps=1e-6, layout="qwen3_5")
    torch.manual_seed(3)
    layer = GatedDeltaNet(cfg).to(dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.5)
    D, N = 3, 5
    conv, state = torch.randn(D, cfg.conv_dim, 3), torch.randn(N, nv, dk, dv)
    before = state.clone()
    rows, keep = torch.tensor([4, 0, 2]), torch.tensor([True, False, True])
    qkv, z = torch.randn(D, cfg.conv_dim).to(dtype), torch.randn(D, cfg.value_dim).to(dtype)
    b, a = torch.randn(D, nv).to(dtype), torch.randn(D, nv).to(dtype)
    got = layer._step(conv, state, rows, keep, qkv, z, b, a)
    want = layer._step_torch(conv, state, rows, keep, qkv, z, b, a)
    tol = dict(rtol=1e-5, atol=ATOL) if dtype == torch.float32 else dict(rtol=4e-3, atol=1e-3)
    assert got[0].dtype == dtype
    torch.testing.assert_close(got[0].float(), want[0].float(), **tol)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], **tol)
    assert torch.equal(state, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_in_one_call_equals_the_layers_ops(layers, dtype, monkeypatch):
    """A step of decodes runs the layer between its projections in one call
    (gated_delta_decode: beta, g, the conv, the step and the gated norm). Against the layer's
    torch ops (the kernel refused): outputs and the states written within float32 rounding
    (bfloat16: within the roundings the model's dtype makes, one ulp of it); and a decode row's
    output and state are the same bits whether its step holds only decodes or a prompt too."""
    assert load_cpu_kernels() is not None, "the CPU kernels did not build"
    import ladle.models.gated_deltanet as gdn

    _, _, ours = layers
    layer = GatedDeltaNet(ours.cfg).to(dtype).eval()
    layer.load_state_dict(ours.state_dict())
    torch.manual_seed(5)
    prompt = torch.randn(7, 64).to(dtype)
    x = torch.randn(3, 64).to(dtype)
    decodes = [Segment(0, 1, 1, False), Segment(1, 1, 2, True), Segment(2, 1, 3, False)]

    start = GatedDeltaNetState.allocate(layer.cfg, NUM_SLOTS)
    start.conv.normal_()
    start.recurrent.normal_(0, 0.1)

    def run(segments, tokens, fused=True):
        state = GatedDeltaNetState(start.conv.clone(), start.recurrent.clone())
        with torch.no_grad(), monkeypatch.context() as m:
            if not fused:
                m.setattr(gdn, "kernels_for", lambda *t: None)
            out = layer(tokens, segments, state)
        return out.float(), state

    got, got_state = run(decodes, x)
    want, want_state = run(decodes, x, fused=False)
    # (bfloat16: 2^-8, one ulp, relative; measured equal)
    tol = dict(rtol=1e-5, atol=ATOL) if dtype == torch.float32 else dict(rtol=4e-3, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_state.recurrent, want_state.recurrent, **tol)
    assert torch.equal(got_state.conv, want_state.conv)
    # the same decodes behind a prompt of another slot, in one step
    mixed = [Segment(0, 7, 0, True)] + [s._replace(start=7 + s.start) for s in decodes]
    out, state = run(mixed, torch.cat([prompt, x]))
    assert torch.equal(out[7:], got)
    assert torch.equal(state.recurrent[1:4], got_state.recurrent[1:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 3, 70])
def test_the_prompt_conv_kernel_equals_its_twin(dtype, length):
    """A prompt's conv part in one C++ call (the causal conv over the kept window and the new
    inputs, SiLU, the round trip through the model's dtype, q/k norms) against the layer's
    torch ops: q, k, v within float32 rounding (bfloat16: one ulp of a conv output), the
    window after the last token equal, prompts shorter than the window included."""
    assert load_cpu_kernels() is not None, "the CPU kernels did not build"
    cfg = GatedDeltaNetConfig(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16,
                              head_v_dim=32, conv_kernel=4, eps=1e-6, layout="qwen3_5")
    torch.manual_seed(4)
    layer = GatedDeltaNet(cfg).to(dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.5)
    conv_state = torch.randn(cfg.conv_dim, 3)
    x = torch.randn(length, cfg.conv_dim + 8).to(dtype)[:, 4:cfg.conv_dim + 4]  # strided rows
    got = layer._conv_prompt(conv_state, x)
    want = layer._conv_prompt_torch(conv_state, x)
    tol = dict(rtol=1e-5, atol=ATOL) if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)
    for g, w in zip(got[:3], want[:3], strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, **tol)
    assert torch.equal(got[3], want[3])


def test_states_are_written_into_their_slots_by_rows():
    """A step's new states land in their slots (copy_rows: a memcpy per row where the kernels
    run) exactly as torch's indexed assignment puts them, a slot out of range refused, and a
    failed step's writes dropped."""
    assert load_cpu_kernels() is not None, "the CPU kernels did not build"
    cfg = GatedDeltaNetConfig(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16,
                              head_v_dim=32, conv_kernel=4, eps=1e-6, layout="qwen3_5")
    state = GatedDeltaNetState.allocate(cfg, NUM_SLOTS, deferred=True)
    want = GatedDeltaNetState.allocate(cfg, NUM_SLOTS)
    slots = torch.tensor([4, 0, 2])
    conv, rec = torch.randn(3, cfg.conv_dim, 3), torch.randn(3, 4, 16, 32)
    state.write(slots, conv, rec)
    state.discard()
    assert not state.recurrent.any() and not state.conv.any()
    state.write(slots, conv, rec)
    state.write(5, conv[0], rec[0])
    state.commit()
    want.conv[slots], want.recurrent[slots] = conv, rec
    want.conv[5], want.recurrent[5] = conv[0], rec[0]
    assert torch.equal(state.conv, want.conv) and torch.equal(state.recurrent, want.recurrent)
    with pytest.raises(RuntimeError, match="out of 0..5"):
        load_cpu_kernels().copy_rows(state.recurrent, torch.tensor([6]), rec[:1].contiguous())
