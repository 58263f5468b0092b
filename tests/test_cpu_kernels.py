"""Each CPU kernel against its pure-torch twin, on the shapes and layouts the model passes it.

The kernels are built into a test cache under the system temp directory (never the shared
~/.cache/ladle; reused by later runs on the same machine, its key follows the source), so this
also checks that the build works on the machine running the tests."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ladle.runner import cpu_kernels
from ladle.runner.attention import DecodeBatch, decode_attention

DTYPES = [torch.float32, torch.bfloat16]
# Tolerances: the kernels sum in a different order than torch (and bf16 products are summed in
# float32 pairs by vdpbf16ps), so results agree to rounding of the output dtype.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def kernels():
    mp = pytest.MonkeyPatch()
    mp.setenv("LADLE_KERNEL_CACHE_DIR", str(Path(tempfile.gettempdir()) / "ladle-test-kernels"))
    mp.delenv("LADLE_DISABLE_CPU_KERNELS", raising=False)
    cpu_kernels._loaded.clear()
    module = cpu_kernels.load_cpu_kernels()
    if module is None:
        pytest.fail("the CPU kernels did not build on this machine (see the warning above)")
    yield module
    cpu_kernels._loaded.clear()
    mp.undo()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 32])
@pytest.mark.parametrize("k_dim,n_dim", [(64, 128), (256, 768), (1024, 4096), (100, 37), (200, 40)])
def test_linear_matches_torch(kernels, dtype, rows, k_dim, n_dim):
    torch.manual_seed(rows * 1000 + k_dim + n_dim)
    x = torch.randn(rows, k_dim).to(dtype)
    w = (torch.randn(n_dim, k_dim) / k_dim**0.5).to(dtype)
    b = torch.randn(n_dim).to(dtype)
    torch.testing.assert_close(kernels.linear(x, w, None), F.linear(x, w), **TOL[dtype])
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), **TOL[dtype])
    # A row-strided view (a slice of a wider activation) is read in place.
    wide = torch.randn(rows, k_dim + 16).to(dtype)
    torch.testing.assert_close(kernels.linear(wide[:, 8 : 8 + k_dim], w, None),
                               F.linear(wide[:, 8 : 8 + k_dim], w), **TOL[dtype])


def cpu_has_amx_bf16() -> bool:
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    return "amx_bf16" in flags.split()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_dim,n_dim", [(1024, 3072), (64, 48), (32, 16), (96, 1040),
                                         (100, 48), (64, 40), (48, 20), (16, 12)])
def test_invariant_linear_is_the_same_for_every_row_count(kernels, dtype, k_dim, n_dim):
    """Batch-invariant mode's linear: each row's result does not depend on the rows beside it
    (1 to 70 rows, any offset, a strided view, with and without bias), and matches the float64
    product within the output's rounding. One and two rows take the sequential path where the
    CPU prefers it (AMD's), more rows the four-row blocks; K's tails (100, 48, 16) and shapes
    that are not tile shapes (100 x 48, 64 x 40 on) included. On a CPU with AMX-BF16 the tile
    program serves every bfloat16 row count of the tile shapes (N % 16, K % 32) and must be in
    use; elsewhere (and for other shapes) the dense kernel does."""
    on = kernels.set_linear_amx(True)
    assert on == cpu_has_amx_bf16(), f"AMX-BF16 in /proc/cpuinfo: {cpu_has_amx_bf16()}, in use: {on}"
    torch.manual_seed(k_dim + n_dim)
    w = (torch.randn(n_dim, k_dim) / k_dim**0.5).to(dtype)
    b = torch.randn(n_dim).to(dtype)
    wide = torch.randn(70, k_dim + 32).to(dtype)
    x = wide[:, 16:16 + k_dim]  # rows k_dim + 32 apart
    rel = 2**-7 if dtype == torch.bfloat16 else 1e-5
    for bias in (None, b):
        full = kernels.linear(x, w, bias, True)
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        assert ((full.double() - want).abs() <= rel * want.abs() + rel).all()
        for rows in (1, 2, 15, 16, 17, 33, 48):
            for start in (0, 5, 22):
                part = kernels.linear(x[start:start + rows].contiguous(), w, bias, True)
                assert torch.equal(part, full[start:start + rows]), (rows, start)
    if on and dtype == torch.bfloat16:  # and the dense kernel, the other path: both right
        kernels.set_linear_amx(False)
        try:
            dense = kernels.linear(x, w, b, True)
        finally:
            kernels.set_linear_amx(True)
        torch.testing.assert_close(dense, kernels.linear(x, w, b, True), **TOL[torch.bfloat16])


def test_linear_dispatch_uses_torch_for_many_rows(kernels):
    """Above MAX_LINEAR_ROWS the model's float32 linear is torch's GEMM, exactly. In bfloat16
    an AVX2 build (no bfloat16 GEMM in torch worth the name) keeps the kernel for every row
    count; a build whose bfloat16 linears run on AMX tiles keeps it up to AMX_LINEAR_ROWS;
    other builds switch to torch above MAX_LINEAR_ROWS too."""
    x = torch.randn(cpu_kernels.MAX_LINEAR_ROWS + 1, 64)
    w = torch.randn(32, 64)
    assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))
    wb = torch.randn(32, 64).bfloat16()
    if kernels.isa() == "avx2":
        limit = 1 << 62
    elif kernels.linear_amx_available():
        limit = cpu_kernels.AMX_LINEAR_ROWS
    else:
        limit = cpu_kernels.MAX_LINEAR_ROWS
    assert cpu_kernels.max_linear_rows(torch.bfloat16) == limit
    xb = torch.randn(min(limit, 1000), 64).bfloat16()  # at the limit: the kernel
    assert torch.equal(cpu_kernels.linear(xb, wb), kernels.linear(xb, wb, None, False))
    if limit < 1000:  # above it: torch
        xb = torch.randn(limit + 1, 64).bfloat16()
        assert torch.equal(cpu_kernels.linear(xb, wb), F.linear(xb, wb))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [256, 200, 8])  # 16-lane chunks, chunks + a tail, a tail only
def test_rms_norm_matches_torch(kernels, dtype, dim):
    torch.manual_seed(0)
    x = torch.randn(7, dim).to(dtype)
    w = torch.randn(dim).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(x, None, w, 1e-6),
                               cpu_kernels.rms_norm_torch(x, w, 1e-6), **TOL[dtype])
    # Heads of q inside the qkv output: (T, H, D) with a row stride wider than H * D.
    qkv = torch.randn(5, 4 * 32 + 64).to(dtype)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    wq = torch.randn(32).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(q, None, wq, 1e-6),
                               cpu_kernels.rms_norm_torch(q, wq, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [128, 1000])
def test_add_rms_norm_matches_torch(kernels, dtype, dim):
    torch.manual_seed(1)
    x, res = torch.randn(6, dim).to(dtype), torch.randn(6, dim).to(dtype)
    w = torch.randn(dim).to(dtype)
    want_out, want_sum = cpu_kernels.rms_norm_torch(res + x, w, 1e-6), res + x
    res_k = res.clone()
    out = kernels.rms_norm(x, res_k, w, 1e-6)
    assert torch.equal(res_k, want_sum)  # the sum is rounded exactly like torch's add
    torch.testing.assert_close(out, want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [640, 200])
def test_gemma_rms_norm_matches_its_twin(kernels, dtype, dim):
    """Gemma's (1 + w) scale goes to the kernel as a float32 weight: normalised and scaled in
    float32, rounded once, as HF's Gemma RMSNorm and the twin do; with a residual the sum is
    rounded to the dtype first, exactly like torch's add."""
    torch.manual_seed(3)
    x, res = torch.randn(5, dim).to(dtype), torch.randn(5, dim).to(dtype)
    w = (torch.randn(dim) * 0.5).to(dtype)
    torch.testing.assert_close(cpu_kernels.gemma_rms_norm(x, w, 1e-6),
                               cpu_kernels.gemma_rms_norm_torch(x, w, 1e-6), **TOL[dtype])
    out, total = cpu_kernels.gemma_rms_norm(x, w, 1e-6, residual=res.clone())
    assert torch.equal(total, res + x)
    torch.testing.assert_close(out, cpu_kernels.gemma_rms_norm_torch(res + x, w, 1e-6),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_torch(kernels, dtype):
    torch.manual_seed(2)
    T, H, KVH, D, P = 5, 4, 2, 32, 64
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(P).float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    pos = torch.tensor([0, 3, 17, 63, 1])
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
    want_q, want_k = cpu_kernels.rotary_torch(pos, q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (H + KVH) * D :].clone()
    kernels.rotary(q, k, pos, cos, sin)  # in place, inside the qkv buffer
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (H + KVH) * D :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
# Head dims take each register-tiling of the value sum (128, 64, 32, 16-wide chunks) and the
# scalar path (40); query groups of 4, 2 (Qwen3-0.6B), 7 (odd: a single-head tail) and 1.
@pytest.mark.parametrize("H,KVH,D", [(8, 2, 64), (16, 8, 128), (14, 2, 32), (4, 4, 48),
                                     (6, 2, 40)])
def test_paged_decode_attention_matches_torch(kernels, dtype, H, KVH, D, monkeypatch):
    torch.manual_seed(3)
    B, bs, nblocks = 3, 16, 12
    k_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    v_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    q = torch.randn(B, H, D).to(dtype)
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [11, 10, 9, 8]])
    batch = DecodeBatch(rows=torch.arange(B), block_table=table,
                        ctx_lens=torch.tensor([40, 17, 64]))
    got = decode_attention(q, k_cache, v_cache, batch, D**-0.5)
    monkeypatch.setitem(cpu_kernels._loaded, "module", None)  # the torch path
    want = decode_attention(q, k_cache, v_cache, batch, D**-0.5)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,D", [(8, 2, 64), (6, 2, 40)])  # vector and scalar paths
# Windows of one token, inside a block, across blocks (not a multiple of 16) and wider than
# every context; soft-caps that bite hard (2) and barely (50), and none.
@pytest.mark.parametrize("window", [None, 1, 7, 23, 40, 1000])
@pytest.mark.parametrize("softcap", [None, 2.0, 50.0])
def test_windowed_softcapped_decode_attention_matches_torch(kernels, dtype, H, KVH, D, window,
                                                            softcap, monkeypatch):
    torch.manual_seed(5)
    B, bs, nblocks = 4, 16, 12
    k_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    v_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    q = (torch.randn(B, H, D) * 2).to(dtype)  # scores of several units, so the cap changes them
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [11, 10, 9, 8], [4, 0, 0, 0]])
    batch = DecodeBatch(rows=torch.arange(B), block_table=table,
                        ctx_lens=torch.tensor([40, 17, 64, 1]))
    got = decode_attention(q, k_cache, v_cache, batch, D**-0.5, window, softcap)
    monkeypatch.setitem(cpu_kernels._loaded, "module", None)  # the torch path
    want = decode_attention(q, k_cache, v_cache, batch, D**-0.5, window, softcap)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,D", [(8, 2, 64), (6, 2, 40)])  # vector and scalar paths
@pytest.mark.parametrize("window", [None, 7])
def test_decode_attention_with_sinks_matches_torch(kernels, dtype, H, KVH, D, window,
                                                   monkeypatch):
    """gpt-oss's sink logits (one per head, in the softmax's denominator only) in the kernel
    against the twin; sinks from far below to far above the scores, so they take from none to
    nearly all of a head's probability, and a context of one token."""
    torch.manual_seed(7)
    B, bs, nblocks = 4, 16, 12
    k_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    v_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    q = (torch.randn(B, H, D) * 2).to(dtype)
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [11, 10, 9, 8], [4, 0, 0, 0]])
    batch = DecodeBatch(rows=torch.arange(B), block_table=table,
                        ctx_lens=torch.tensor([40, 17, 64, 1]))
    sinks = torch.linspace(-30, 12, H).to(dtype)
    got = decode_attention(q, k_cache, v_cache, batch, D**-0.5, window, None, sinks)
    plain = decode_attention(q, k_cache, v_cache, batch, D**-0.5, window)
    monkeypatch.setitem(cpu_kernels._loaded, "module", None)  # the torch path
    want = decode_attention(q, k_cache, v_cache, batch, D**-0.5, window, None, sinks)
    torch.testing.assert_close(got, want, **TOL[dtype])
    # The sinks change the output (a kernel that dropped them would not pass): the head with
    # the largest sink keeps almost nothing of its attention.
    assert (got[:, -1].float().abs().amax() < 0.1 * plain[:, -1].float().abs().amax())


@pytest.mark.parametrize("dtype", DTYPES)
# Query groups of 1, 2 (four rows share keys), 4 and 16 (no sharing), and the scalar path (40).
@pytest.mark.parametrize("H,KVH,D", [(4, 4, 64), (16, 8, 128), (8, 2, 64), (16, 1, 32),
                                     (6, 2, 40)])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (7, None, False),
                                                  (50, 30.0, True), (None, 20.0, True)])
def test_decode_attention_rows_of_one_sequence_equal_rows_alone(kernels, invariant, dtype, H,
                                                                KVH, D, window, softcap, sinks,
                                                                monkeypatch):
    """Batch-invariant mode sends each token of a prefill chunk as a decode row (the query at
    position p over positions 0..p); the kernel groups consecutive rows of one sequence to load
    their keys and values once. Every row must equal the same row attended alone, bit for bit,
    and the twin within rounding: chunks of 1 to 37 rows from several starts, a decode row of
    another sequence between them, windows that cut some rows' contexts and not others'."""
    torch.manual_seed(11)
    bs, nblocks = 16, 24
    k_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    v_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    tables = [torch.randperm(nblocks)[:8] for _ in range(3)]
    ctx, table = [], []
    for seq, (start, rows) in enumerate([(0, 37), (63, 1), (5, 1), (20, 9), (90, 6)]):
        for r in range(rows):
            ctx.append(start + r + 1)
            table.append(tables[seq % 3])
    q = (torch.randn(len(ctx), H, D) * 2).to(dtype)
    batch = DecodeBatch(rows=torch.arange(len(ctx)), block_table=torch.stack(table),
                        ctx_lens=torch.tensor(ctx))
    sink = torch.linspace(-3, 3, H) if sinks else None
    assert_rows_alone_equal_batch(q, k_cache, v_cache, batch, range(len(ctx)), dtype,
                                  monkeypatch, D**-0.5, window, softcap, sink)


def assert_rows_alone_equal_batch(q, k_cache, v_cache, batch, rows, dtype, monkeypatch, *args):
    """Each of `rows` attended alone equals the same row of the batch bit for bit, and the
    batch matches the torch twin within rounding. args: decode_attention's after the batch."""
    got = decode_attention(q, k_cache, v_cache, batch, *args)
    for b in rows:
        alone = DecodeBatch(rows=torch.arange(1), block_table=batch.block_table[b:b + 1],
                            ctx_lens=batch.ctx_lens[b:b + 1])
        one = decode_attention(q[b:b + 1], k_cache, v_cache, alone, *args)
        assert torch.equal(one[0], got[b]), \
            f"row {b} (context {int(batch.ctx_lens[b])}) alone differs from its batch"
    monkeypatch.setitem(cpu_kernels._loaded, "module", None)  # the torch path
    want = decode_attention(q, k_cache, v_cache, batch, *args)
    torch.testing.assert_close(got, want, **TOL[dtype])


# Heads of Qwen3-0.6B (query groups of 2, D 128), Gemma 3 270M (one KV head, 4 query heads, D
# 256), D 64 with groups of 4, and no grouping at D 32.
@pytest.mark.parametrize("H,KVH,D", [(16, 8, 128), (4, 1, 256), (8, 2, 64), (4, 4, 32)])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("unit", ["amx", "avx512-bf16"])
def test_prefill_runs_on_tiles_match_torch(kernels, H, KVH, D, bs, unit, monkeypatch):
    """Outside batch-invariant mode, on AVX512-BF16 CPUs, a prefill chunk's run of 16 or more
    rows attends in tiles, on the tile unit (AMX-BF16) or the vector unit (vdpbf16ps, what a
    Zen 4 runs; here also an AMX CPU with set_attention_amx(False)): within bfloat16 rounding of
    the twin, for fresh prompts and chunks with cached context, beside a decode row, a run of
    15 (rows) and a window that cuts a run (rows); the rows that stay on the row kernel keep
    its bits (batch-invariant mode's), and exactly the runs' rows took the tiles (the kernel's
    count; on the vector unit at D 32 their bfloat16 results can equal the rows' bits: the
    pairs' products sum exactly and the values are summed in the rows' order)."""
    if not kernels.attention_tiles_available():
        pytest.skip("no AVX512-BF16 tiles in this build or CPU")
    kernels.set_attention_amx(unit == "amx")
    try:
        if kernels.attention_tiles_unit() != unit:
            pytest.skip(f"no {unit} unit on this CPU")
        _prefill_runs_on_tiles_match_torch(kernels, H, KVH, D, bs, unit, monkeypatch)
    finally:
        kernels.set_attention_amx(True)


def _prefill_runs_on_tiles_match_torch(kernels, H, KVH, D, bs, unit, monkeypatch):
    torch.manual_seed(17)
    nblocks = 4096 // bs + 8
    dtype = torch.bfloat16
    k_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    v_cache = torch.randn(nblocks, KVH, bs, D).to(dtype)
    perm = torch.randperm(nblocks)
    ctx, table, runs = [], [], []
    # (first position, rows): a 37-row fresh prompt, a decode row, 16 rows after 20 cached, a
    # run of 15, 130 rows after 95 cached (several query blocks, a partial last one)
    for seq, (start, rows) in enumerate([(0, 37), (63, 1), (20, 16), (5, 15), (95, 130)]):
        blocks = perm[seq * 24:(seq + 1) * 24]
        if rows >= 16:
            runs.extend(range(len(ctx), len(ctx) + rows))
        for r in range(rows):
            ctx.append(start + r + 1)
            table.append(blocks)
    q = (torch.randn(len(ctx), H, D) * 2).to(dtype)
    batch = DecodeBatch(rows=torch.arange(len(ctx)), block_table=torch.stack(table),
                        ctx_lens=torch.tensor(ctx))
    for window in (None, 100):  # 100 cuts the last run's contexts: it stays on the rows
        before = kernels.attention_tile_rows()
        got = decode_attention(q, k_cache, v_cache, batch, D**-0.5, window)
        tile_rows = kernels.attention_tile_rows() - before
        was = cpu_kernels.batch_invariant()
        cpu_kernels.set_batch_invariant(True)
        try:
            rows = decode_attention(q, k_cache, v_cache, batch, D**-0.5, window)
        finally:
            cpu_kernels.set_batch_invariant(was)
        tiled = runs if window is None else runs[:53]
        kept = [b for b in range(len(ctx)) if b not in tiled]
        assert torch.equal(got[kept], rows[kept])
        assert tile_rows == len(tiled)
        if unit == "amx" or D > 32:
            assert not torch.equal(got[tiled], rows[tiled])
        with monkeypatch.context() as m:
            m.setitem(cpu_kernels._loaded, "module", None)  # the torch path
            want = decode_attention(q, k_cache, v_cache, batch, D**-0.5, window)
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.fixture
def invariant():
    """Batch-invariant mode for the test (where a prefill chunk's rows each attend alone), as
    before after."""
    was = cpu_kernels.batch_invariant()
    cpu_kernels.set_batch_invariant(True)
    yield
    cpu_kernels.set_batch_invariant(was)


@pytest.fixture
def two_threads():
    """At least two torch threads for the test (the suite may run with one), as before after."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
# Gemma 3's one KV head (4 query heads, D 256: one head block, the value sum in passes of 64
# dims split in two), 16 heads of 64 (two head blocks) and the scalar path (40).
@pytest.mark.parametrize("H,D", [(4, 256), (16, 64), (4, 40)])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (300, 30.0, True)])
def test_long_decode_of_one_kv_head_split_between_threads_equals_batched(kernels, two_threads,
                                                                          dtype, H, D, window,
                                                                          softcap, sinks,
                                                                          monkeypatch):
    """One sequence of a one-KV-head model at a long context is a single attention job, which
    the kernel splits between the threads (its key scores and value sums); in a batch each
    sequence is a job of its own on one thread. The row must be the same bit for bit both ways
    (a request's tokens do not depend on its batch), and match the twin."""
    torch.manual_seed(13)
    bs, nblocks = 16, 96
    k_cache = torch.randn(nblocks, 1, bs, D).to(dtype)
    v_cache = torch.randn(nblocks, 1, bs, D).to(dtype)
    tables = torch.stack([torch.randperm(nblocks)[:40] for _ in range(3)])
    ctx = torch.tensor([613, 250, 640])  # 613 x 4 heads x 256 dims: past the split's threshold
    q = (torch.randn(3, H, D) * 2).to(dtype)
    sink = torch.linspace(-3, 3, H) if sinks else None
    batch = DecodeBatch(rows=torch.arange(3), block_table=tables, ctx_lens=ctx)
    assert_rows_alone_equal_batch(q, k_cache, v_cache, batch, (0, 2), dtype, monkeypatch,
                                  D**-0.5, window, softcap, sink)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_window_wider_than_context_is_bit_identical(kernels, dtype):
    """A window that reaches every cached token reads exactly what full attention reads."""
    torch.manual_seed(6)
    k_cache = torch.randn(12, 2, 16, 64).to(dtype)
    v_cache = torch.randn(12, 2, 16, 64).to(dtype)
    q = torch.randn(3, 8, 64).to(dtype)
    batch = DecodeBatch(rows=torch.arange(3), block_table=torch.tensor([[3, 7, 1], [5, 2, 0],
                                                                        [11, 10, 9]]),
                        ctx_lens=torch.tensor([40, 17, 48]))
    full = decode_attention(q, k_cache, v_cache, batch, 0.125)
    assert torch.equal(decode_attention(q, k_cache, v_cache, batch, 0.125, 48), full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_bitmask_matches_torch(kernels, dtype):
    """Rows of a larger batch, a vocabulary that is not a multiple of 32, words all set."""
    from ladle.structured_output.manager import apply_bitmask, apply_bitmask_torch

    torch.manual_seed(4)
    V, rows = 1000, [0, 2, 3]
    mask = torch.randint(-(2**31), 2**31 - 1, (len(rows), -(-V // 32)), dtype=torch.int32)
    mask[1, 5:10] = -1  # every token of those words allowed
    mask[0, 3:6] = 0  # every token of those words blocked
    logits = torch.randn(5, V).to(dtype)
    want = logits.clone()
    apply_bitmask_torch(want, rows, mask)
    apply_bitmask(logits, rows, mask)  # the kernel path
    assert torch.equal(logits, want)
    assert torch.isinf(logits[2]).any() and torch.isfinite(logits[1]).all()


def _rope_tables(D, P=64):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(P).float(), inv)
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [32, 40, 128])  # rotary halves of 16, 16 + a tail of 4, 4 x 16
def test_qk_norm_rotary_matches_torch(kernels, dtype, D):
    torch.manual_seed(5)
    T, H, KVH = 4, 4, 2
    cos, sin = _rope_tables(D)
    pos = torch.tensor([0, 9, 33, 2])
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
    wq, wk = torch.randn(D).to(dtype), torch.randn(D).to(dtype)
    got_q, got_k = kernels.qk_norm_rotary(q, k, wq, wk, 1e-6, pos, cos, sin)
    want_q, want_k = cpu_kernels.rotary_torch(pos, cpu_kernels.rms_norm_torch(q, wq, 1e-6),
                                              cpu_kernels.rms_norm_torch(k, wk, 1e-6), cos, sin)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])


def test_qk_norm_rotary_rounds_the_norm_as_the_layers_store_it(kernels):
    """In bfloat16 the fused kernel rounds each head's norm output (w * bf16(x * inv)) to
    bfloat16 before rotating it, as the unfused layers (rms_norm, then rotary) store it: its
    values are the unfused kernels' but where the rotary's product and sum fused into one fma
    (under 0.1%; 29% differed when only the vector body's tail rounded)."""
    torch.manual_seed(5)
    T, H, KVH, D = 64, 16, 8, 128
    cos, sin = _rope_tables(D, 512)
    pos = torch.arange(T) * 3
    qkv = torch.randn(T, (H + 2 * KVH) * D).bfloat16()
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
    wq, wk = torch.randn(D).bfloat16(), torch.randn(D).bfloat16()
    got = torch.cat([x.flatten() for x in kernels.qk_norm_rotary(q, k, wq, wk, 1e-6, pos, cos,
                                                                  sin)])
    want = torch.cat([x.flatten() for x in cpu_kernels.rotary_torch(
        pos, kernels.rms_norm(q, None, wq, 1e-6), kernels.rms_norm(k, None, wk, 1e-6), cos, sin)])
    assert (got != want).float().mean().item() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_matches_index_put(kernels, dtype):
    torch.manual_seed(6)
    T, KVH, D, bs, nb = 5, 2, 16, 4, 6
    kv = torch.randn(T, 3 * KVH * D).to(dtype)  # k and v as views of a wider qkv row
    k = kv[:, KVH * D : 2 * KVH * D].view(T, KVH, D)
    v = kv[:, 2 * KVH * D :].view(T, KVH, D)
    blocks, offsets = torch.tensor([0, 0, 5, 3, 3]), torch.tensor([0, 1, 3, 2, 0])
    caches = [torch.zeros(nb, KVH, bs, D).to(dtype) for _ in range(4)]
    kernels.write_kv_cache(k, v, caches[0], caches[1], blocks, offsets)
    caches[2][blocks, :, offsets] = k
    caches[3][blocks, :, offsets] = v
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [96, 100])  # 16-wide vector chunks, then a scalar tail
def test_silu_mul_matches_torch(kernels, dtype, inner):
    torch.manual_seed(7)
    x = (3 * torch.randn(3, 2 * inner)).to(dtype)
    # The gate's extremes: exp overflows and underflows, infinities and NaN pass through.
    x[0, :8] = torch.tensor([100.0, -100.0, 88.0, -88.0, float("inf"), float("-inf"),
                             float("nan"), 0.0]).to(dtype)
    got, want = kernels.silu_mul(x), cpu_kernels.silu_mul_torch(x)
    torch.testing.assert_close(got, want, equal_nan=True, atol=1e-6, rtol=1e-6)
    if dtype == torch.bfloat16:
        # The vector exp is within an ulp of torch's: after rounding to bfloat16 nearly every
        # element is bit-identical.
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_mul_matches_torch_and_does_not_depend_on_the_batch(kernels, dtype, approximate):
    torch.manual_seed(8)
    x = (3 * torch.randn(67, 2 * 100)).to(dtype)
    x[0, :6] = torch.tensor([30.0, -30.0, float("inf"), float("-inf"), float("nan"),
                             0.0]).to(dtype)
    got = kernels.gelu_mul(x, approximate == "tanh")
    want = cpu_kernels.gelu_mul_torch(x, approximate)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # std::erf vs torch: a few ulp
    torch.testing.assert_close(got, want, equal_nan=True, atol=tol, rtol=tol)
    # Each row's bits are the ones it gets alone.
    alone = torch.cat([kernels.gelu_mul(x[i:i + 1], approximate == "tanh") for i in range(67)])
    assert torch.equal(got.nan_to_num(), alone.nan_to_num())


def test_penalties_match_torch(kernels):
    from ladle.sample.penalties import PenaltyState

    torch.manual_seed(8)
    R, V = 3, 1000
    state = PenaltyState(4, V, torch.device("cpu"))
    state._allocate()
    state.counts[:R] = torch.randint(0, 3, (R, V)).float()
    state.seen[:R] = torch.rand(R, V) < 0.3
    rep, freq, pres = torch.tensor([1.3, 1.0, 0.7]), torch.tensor([0.2, 0.0, 0.5]), \
        torch.tensor([0.0, 0.4, 0.1])
    logits = torch.randn(R, V)
    want = state.apply_torch(logits.clone(), pres, freq, rep, (True, True, True))
    got = state.apply(logits.clone(), pres, freq, rep, (True, True, True))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_logprob_stats_match_torch(kernels):
    from ladle.sample.sampler import logprob_stats, logprob_stats_torch

    torch.manual_seed(9)
    src = torch.randn(4, 5003) * 3  # 16-lane chunks and a scalar tail
    src[1, ::2] = float("-inf")  # masked tokens
    src[3, :4000] = float("-inf")  # a row masked down to its tail
    src[2, 7] = src[2, 9]  # a tie with the chosen token does not count as better
    chosen = torch.tensor([0, 4, 9, 5001])
    for got, want in zip(logprob_stats(src, chosen), logprob_stats_torch(src, chosen),
                         strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_logsumexp_matches_torch(kernels):
    torch.manual_seed(13)
    x = torch.randn(4, 5003) * 3
    x[1, ::2] = float("-inf")
    x[2] = float("-inf")  # an all -inf row: -inf
    x[3, 4990:] += 50  # the maximum in the scalar tail
    torch.testing.assert_close(cpu_kernels.logsumexp(x), torch.logsumexp(x, dim=-1),
                               atol=1e-5, rtol=1e-5)


def test_min_p_matches_torch(kernels):
    torch.manual_seed(10)
    logits = torch.randn(3, 2003) * 2  # 16-lane chunks and a tail
    logits[2, 2001] = 9.0  # the row maximum in the tail
    log_min_p = torch.tensor([float("-inf"), -1.0, -0.1])  # row 0 has no min_p
    want = logits.clone()
    cutoff = want.max(dim=-1, keepdim=True).values + log_min_p[:, None]
    want.masked_fill_(want < cutoff, float("-inf"))
    kernels.min_p(logits, log_min_p)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("k", [1, 5, 50])
def test_topk_matches_torch(kernels, k):
    torch.manual_seed(11)
    x = torch.randn(4, 3000)
    x[1, 100:] = float("-inf")  # fewer finite values than some k
    vals, ids = kernels.topk_rows(x, k)
    want_vals, _ = x.topk(k, dim=-1)
    assert torch.equal(vals, want_vals)
    assert torch.equal(x.gather(1, ids), vals)  # ids point at their values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (5, 1000), (33, 37)])
def test_argmax_matches_torch(kernels, dtype, rows, vocab):
    """First index of the maximum per row, exactly torch's: ties (bf16 rounds many values to
    the same one), a row of -inf, a row holding NaN (NaN counts as the largest)."""
    torch.manual_seed(rows + vocab)
    x = torch.randn(rows, vocab).to(dtype)
    x[0, vocab // 3] = x[0, vocab // 2] = x[0].max() + 1  # a tie: the lower index wins
    if rows > 2:
        x[1] = float("-inf")
        x[2, vocab - 1] = float("nan")
        x[2, vocab // 4] = float("nan")
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("gathered", [False, True])
def test_noise_uniform_is_bit_identical_to_torch(kernels, gathered):
    """Seeded noise through the kernel equals the torch hash bit for bit (seeded samples do not
    change with the machine), over the whole vocabulary and over gathered candidate ids."""
    from ladle.sample.noise import SeededNoise

    torch.manual_seed(9)
    V, R = 1003, 5
    noise = SeededNoise(V, torch.device("cpu"))
    seeds = torch.tensor([0, 1, 2**40 + 7, -5, 123456789], dtype=torch.int64)
    positions = torch.tensor([0, 3, 17, 1, 1000], dtype=torch.int64)
    ids = torch.randint(0, V, (R, 37)) if gathered else None
    got = noise.exponential(seeds, positions, ids).clone()
    cpu_kernels._loaded["module"] = None  # the torch twin
    try:
        want = noise.exponential(seeds, positions, ids).clone()
    finally:
        cpu_kernels._loaded["module"] = kernels
    assert torch.equal(got, want)
    assert (got > 0).all() and torch.isfinite(got).all()


@pytest.mark.parametrize("vocab", [1003, 4096])  # 16-lane chunks with and without a tail
def test_seeded_race_matches_its_twin(kernels, vocab):
    """The fused seeded race picks the token the twin (softmax, the seeded Exp(1) noise, the
    quotient's argmax) picks, on rows that are dense, masked to a few tokens, masked to one,
    all -inf, or hold a NaN or +inf (both give 0, like the twin's argmax over NaN)."""
    from ladle.sample.noise import SeededNoise

    torch.manual_seed(10)
    R = 64
    noise = SeededNoise(vocab, torch.device("cpu"))
    x = torch.randn(R, vocab) * 4
    x[1, 40:] = float("-inf")
    x[2] = float("-inf")
    x[2, vocab - 1] = 0.25  # the only token left, in the tail
    x[3, ::3] = float("-inf")
    x[4] = float("-inf")
    x[5, 17] = float("nan")
    x[6, 900] = float("inf")
    x[7] = x[7] * 1e-3  # nearly uniform: the noise decides
    seeds = torch.randint(-(2**62), 2**62, (R,))
    positions = torch.randint(0, 5000, (R,))
    got = kernels.seeded_race(x, noise.token_key, *(k.contiguous() for k in
                                                     noise.row_keys(seeds, positions)))
    want = noise.race_torch(x, seeds, positions)
    assert torch.equal(got, want)
    assert got[2] == vocab - 1 and got[4] == 0 and got[5] == 0 and got[6] == 0
    assert torch.equal(noise.race(x, seeds, positions), want)  # the dispatcher takes the kernel


def test_seeded_race_frequencies_match_softmax(kernels):
    """Over many output positions the fused race draws each token with its softmax probability
    (within 5 standard errors), also when most of the row is masked."""
    from ladle.sample.noise import SeededNoise

    V, N = 300, 20000
    noise = SeededNoise(V, torch.device("cpu"))
    g = torch.Generator().manual_seed(12)
    row = torch.randn(V, generator=g) * 1.5
    row[::2] = float("-inf")
    probs = torch.softmax(row, dim=-1)
    x = row.expand(N, V).contiguous()
    seeds = torch.full((N,), 77, dtype=torch.int64)
    counts = torch.bincount(kernels.seeded_race(x, noise.token_key, *(
        k.contiguous() for k in noise.row_keys(seeds, torch.arange(N)))), minlength=V)
    freq = counts.double() / N
    se = (probs.double() * (1 - probs.double()) / N).sqrt()
    assert (counts[::2] == 0).all()
    assert ((freq - probs.double()).abs() <= 5 * se + 1e-9).all()


@pytest.mark.parametrize("quantized", [False, True])  # bf16-rounded logits: many exact ties
def test_top_p_mask_keeps_the_smallest_nucleus(kernels, quantized):
    """The radix-select top-p keeps, per row, the smallest set of the largest tokens whose
    probability reaches top_p (checked in float64), ties at the boundary in index order, and
    agrees with the sorted twin except where top_p falls within float32 rounding of its
    cumulative sum; rows with top_p = 1 and -inf tokens are left alone."""
    from ladle.sample.ops import mask_top_k_top_p

    torch.manual_seed(14)
    R, V = 12, 20011  # 16-lane chunks and a tail
    x = torch.randn(R, V) * torch.linspace(0.5, 4.0, R)[:, None]
    if quantized:
        x = x.bfloat16().float()
    x[3, ::5] = float("-inf")
    top_p = torch.rand(R) * 0.9 + 0.05
    top_p[4] = 1.0
    top_p[5] = 1e-7  # the single largest token
    lse = torch.logsumexp(x, dim=-1)
    got = x.clone()
    assert cpu_kernels.top_p_mask(got, lse, top_p)
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], x[kept])  # kept tokens keep their value
    assert torch.equal(got[4], x[4])
    assert int(kept[5].sum()) == 1 and kept[5, x[5].argmax()]
    p64 = torch.softmax(x.double(), dim=-1)
    for r in range(R):
        if top_p[r] >= 1:
            continue
        mass = float(p64[r][kept[r]].sum())
        smallest = float(p64[r][kept[r]].min())
        assert mass >= top_p[r] - 1e-6 and mass - smallest < top_p[r] + 1e-6, r
        # every dropped token is no larger than every kept one
        assert x[r][kept[r]].min() >= x[r][~kept[r] & torch.isfinite(x[r])].max(), r
        if quantized:  # ties at the boundary value are kept in index order
            tau = x[r][kept[r]].min()
            tied = (x[r] == tau).nonzero().squeeze(1)
            n_kept = int(kept[r][tied].sum())
            assert kept[r][tied[:n_kept]].all() and not kept[r][tied[n_kept:]].any(), r
    # The sorted twin (ops.mask_top_k_top_p without the kernel): the same sets but for at most
    # a token or two at a boundary that float32 rounding places differently (with ties, the
    # same number kept: the sort picks among tied tokens in its own order).
    cpu_kernels._loaded["module"] = None
    try:
        want = torch.isfinite(mask_top_k_top_p(x.clone(), torch.zeros(R, dtype=torch.long),
                                               top_p))
    finally:
        cpu_kernels._loaded["module"] = kernels
    assert int((want.sum(dim=-1) - kept.sum(dim=-1)).abs().max()) <= 2
    if not quantized:
        assert int((want != kept).sum(dim=-1).max()) <= 2
