"""``tilepy.gemm`` on float8 inputs (the scaled FP8 GEMM): against float64 of the codes' values
times the scales (per tensor, per row of a, per column of b), both formats, edges that are not
multiples of the tile and K not a multiple of 128; out bfloat16 / float16 / float32; bad input
refused before launch; the kernel's sm_90a compile; the GPU against ``torch._scaled_mm``."""

from __future__ import annotations

import numpy as np
import pytest

import tilepy

ml_dtypes = pytest.importorskip("ml_dtypes")


def codes(rng, shape, fmt):
    return (rng.standard_normal(shape) * 3).astype(getattr(ml_dtypes, fmt))


@pytest.mark.sim
@pytest.mark.parametrize("fmt,rows,cols,out_dtype", [
    ("float8_e4m3fn", True, False, "bfloat16"),
    ("float8_e5m2", False, True, "float32"),
    ("float8_e4m3fn", False, False, "float16"),
])
def test_scaled_product_against_float64(fmt, rows, cols, out_dtype):
    """(The first case twice, on fresh arrays: the second call launches the first one's plan
    with new pointers and new tensor maps. The last on 64-column tiles: 6 tiles over the
    simulator's 4 SMs, so a persistent block takes two, its ring running on; and with b
    row-major (K, N), transposed into a K-major copy first.)"""
    from tilepy.ops.gemm_kmajor_wgmma import KMajorConfig

    rng = np.random.default_rng()
    m, n, k = 130, 72, 208                  # 3 row tiles (one partial), K = 128 + 80
    for _ in range(2 if rows else 1):
        a = codes(rng, (m, k), fmt)
        w = codes(rng, (n, k), fmt)             # b = wᵀ: K-major
        sa = rng.uniform(0.5, 2, m).astype(np.float32) if rows else np.float32(0.75)
        sb = rng.uniform(0.5, 2, n).astype(np.float32) if cols else np.float32(1.5)
        out = np.full((m, n), np.nan, {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
                                       "float32": np.float32}[out_dtype])
        b = np.ascontiguousarray(w.T) if out_dtype == "float16" else w.T
        got = tilepy.gemm(a, b, scale_a=np.asarray(sa), scale_b=np.asarray(sb), out=out,
                          out_dtype=out_dtype,
                          config=KMajorConfig(block_n=64) if out_dtype == "float16" else None)
        assert got is out
        ref = (a.astype(np.float64) * np.reshape(sa, (-1, 1))) @ (
            w.astype(np.float64).T * np.reshape(sb, (1, -1)))
        tol = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-5}[out_dtype]
        got64 = got.astype(np.float64)
        assert not np.isnan(got64).any()
        assert np.abs(got64 - ref).max() <= tol * np.abs(ref).max()


@pytest.mark.sim
def test_tma_store_epilogue_writes_the_register_epilogues_bits(monkeypatch):
    """The TMA-store epilogue (per-row and per-column scales, a bfloat16 bias and GELU; 130 x
    200: a partial row tile and a partial second pass of columns), as the built-in choice
    (``gemm_fp8.TMA_STORE``), against the register epilogue (``KMajorConfig(tma_store=False)``):
    the same operations in the same order, so the same bits; and an output whose rows TMA
    cannot store (a 202-column view: 404-byte rows) falls back to the register epilogue,
    equal on its columns. Block scales likewise."""
    from tilepy.ops import gemm_fp8
    from tilepy.ops.gemm_kmajor_wgmma import KMajorConfig

    monkeypatch.setattr(gemm_fp8, "TMA_STORE", True)
    gemm_fp8._PLANS.clear()

    rng = np.random.default_rng()
    m, n, k = 130, 200, 96
    a = codes(rng, (m, k), "float8_e4m3fn")
    w = codes(rng, (n, k), "float8_e5m2")
    sa = rng.uniform(0.5, 2, m).astype(np.float32)
    sb = rng.uniform(0.5, 2, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    kw = dict(scale_a=sa, scale_b=sb, bias=bias, activation="gelu")
    bf = ml_dtypes.bfloat16
    got = tilepy.gemm(a, w.T, out=np.full((m, n), np.nan, bf), **kw)
    want = tilepy.gemm(a, w.T, out=np.full((m, n), np.nan, bf),
                       config=KMajorConfig(tma_store=False), **kw)
    assert not np.isnan(want.astype(np.float32)).any()
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    wide = np.full((m, n + 2), np.nan, bf)
    tilepy.gemm(a, w.T, out=wide[:, :n], **kw)
    np.testing.assert_array_equal(wide[:, :n].view(np.uint16), want.view(np.uint16))
    assert np.isnan(wide[:, n:].astype(np.float32)).all()
    again = tilepy.gemm(a, w.T, out=np.full((m, n), np.nan, bf),
                        config=KMajorConfig(tma_store=True), **kw)   # asked for by config
    np.testing.assert_array_equal(again.view(np.uint16), want.view(np.uint16))
    # block scales (one k block, two column blocks) take it too
    blk = dict(scale_a=rng.uniform(0.5, 2, (m, 1)).astype(np.float32),
               scale_b=rng.uniform(0.5, 2, (2, 1)).astype(np.float32).T)
    got = tilepy.gemm(a, w.T, out=np.full((m, n), np.nan, bf), **blk)
    want = tilepy.gemm(a, w.T, out=np.full((m, n), np.nan, bf),
                       config=KMajorConfig(block_n=128, tma_store=False), **blk)
    assert not np.isnan(want.astype(np.float32)).any()
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    gemm_fp8._PLANS.clear()     # (plans of the patched choice not left to later tests)


def test_errors_are_raised_before_launch():
    a = np.zeros((4, 32), ml_dtypes.float8_e4m3fn)
    w = np.zeros((8, 32), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match="K must be a multiple of 16"):
        tilepy.gemm(a[:, :24], w[:, :24].T)
    with pytest.raises(TypeError, match="b: dtype float16 is not supported"):
        tilepy.gemm(a, w.astype(np.float16).T)
    with pytest.raises(ValueError, match="or a block scale"):
        tilepy.gemm(a, w.T, scale_a=np.ones((4, 2), np.float32))
    with pytest.raises(TypeError, match="scale_a must be a float32 array .* got the number"):
        tilepy.gemm(a, w.T, scale_a=np.float32(2.0))
    a2, w2 = np.zeros((4, 256), a.dtype), np.zeros((8, 256), w.dtype)
    with pytest.raises(ValueError, match="block scales come in pairs"):
        tilepy.gemm(a2, w2.T, scale_a=np.ones((4, 2), np.float32),
                    scale_b=np.ones((1, 8), np.float32))
    from tilepy.ops.gemm_kmajor_wgmma import KMajorConfig
    with pytest.raises(ValueError, match="block scales need config.block_n <= 128"):
        tilepy.gemm(a2, w2.T, scale_a=np.ones((4, 2), np.float32),
                    scale_b=np.ones((2, 1), np.float32), config=KMajorConfig(block_n=256))
    with pytest.raises(ValueError, match=r"scale_b must be 0-d .*, \(8,\) \(per column\)"):
        tilepy.gemm(a, w.T, scale_b=np.ones(5, np.float32))
    with pytest.raises(TypeError, match="scale_a must be float32, got float64"):
        tilepy.gemm(a, w.T, scale_a=np.ones(4, np.float64))
    with pytest.raises(ValueError, match="activation must be one of"):
        tilepy.gemm(a, w.T, activation="tanh")
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        tilepy.gemm(a, w.T, bias=np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="bias: dtype float64 is not supported"):
        tilepy.gemm(a, w.T, bias=np.zeros(8, np.float64))
    with pytest.raises(NotImplementedError, match="alpha, beta and c"):
        tilepy.gemm(a, w.T, alpha=2.0)


@pytest.mark.sim
@pytest.mark.parametrize("fmt_a,fmt_b,bias_dtype,activation,block", [
    ("float8_e4m3fn", "float8_e5m2", "bfloat16", "gelu", False),
    ("float8_e5m2", "float8_e4m3fn", "float32", "silu", True),
    ("float8_e4m3fn", "float8_e4m3fn", "float16", None, False),
])
def test_mixed_formats_bias_and_activation(fmt_a, fmt_b, bias_dtype, activation, block):
    """``act((a · scale_a) @ (b · scale_b) + bias)`` against float64: e4m3 · e5m2 and the
    reverse, bias float32 / float16 / bfloat16 (added after the scales), an activation, with
    row and column scales or block scales (K = 208: two k blocks, the second partial); M = 70,
    N = 72 (edges inside a 64-column tile, on one consumer)."""
    from tilepy.ops.gemm_kmajor_wgmma import KMajorConfig
    from tilepy.testing.reference import reference_activation

    rng = np.random.default_rng()
    m, n, k = 70, 72, 208
    a = codes(rng, (m, k), fmt_a)
    w = codes(rng, (n, k), fmt_b)
    if block:
        sa = rng.uniform(0.25, 4, (m, 2)).astype(np.float32)
        sw = rng.uniform(0.25, 4, (1, 2)).astype(np.float32)
        scale_a, scale_b = sa, sw.T
        a64 = a.astype(np.float64) * np.repeat(sa, 128, axis=1)[:, :k]
        w64 = w.astype(np.float64) * np.repeat(sw, 128, axis=1)[:, :k]
    else:
        scale_a = rng.uniform(0.5, 2, m).astype(np.float32)
        scale_b = rng.uniform(0.5, 2, n).astype(np.float32)
        a64 = a.astype(np.float64) * scale_a[:, None]
        w64 = w.astype(np.float64) * scale_b[:, None]
    bias = (rng.standard_normal(n) * 50).astype(getattr(ml_dtypes, bias_dtype, bias_dtype))
    out = np.full((m, n), np.nan, np.float32)
    got = tilepy.gemm(a, w.T, scale_a=scale_a, scale_b=scale_b, bias=bias,
                      activation=activation, out=out,
                      config=KMajorConfig(block_n=64, consumers=1))
    ref = reference_activation(a64 @ w64.T + bias.astype(np.float64), activation)
    assert not np.isnan(got).any()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.sim
@pytest.mark.parametrize("k", [336, 464])
def test_block_scales_against_float64(k):
    """DeepGEMM's recipe: scale_a per 1 x 128 block of a, scale_b per 128 x 128 block of b
    (given as the transposed view of (N blocks, K blocks), as quantize_fp8 of w (N, K) makes
    it); K = 336 or 464 (three or four k blocks, the last partial: the main loop's odd and
    even ends), N = 200 (two column blocks, the second partial), M = 130."""
    rng = np.random.default_rng()
    m, n = 130, 200
    kb, nb = -(-k // 128), 2
    a = codes(rng, (m, k), "float8_e4m3fn")
    w = codes(rng, (n, k), "float8_e4m3fn")
    sa = rng.uniform(0.25, 4, (m, kb)).astype(np.float32)
    sw = rng.uniform(0.25, 4, (nb, kb)).astype(np.float32)     # per (N block, K block)
    out = np.full((m, n), np.nan, np.float32)
    got = tilepy.gemm(a, w.T, scale_a=sa, scale_b=sw.T, out=out, out_dtype="float32")
    a64 = a.astype(np.float64) * np.repeat(sa, 128, axis=1)[:, :k]
    w64 = w.astype(np.float64) * np.repeat(np.repeat(sw, 128, axis=0), 128, axis=1)[:n, :k]
    ref = a64 @ w64.T
    assert not np.isnan(got).any()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.sim
def test_one_row_one_scale_shapes_and_empty_k():
    """M = 1 (its row stride never used), torch._scaled_mm's scale shapes ((M, 1), (1, N),
    (1,)) and K = 0 (zeros)."""
    rng = np.random.default_rng()
    a = codes(rng, (1, 32), "float8_e4m3fn")
    w = codes(rng, (8, 32), "float8_e4m3fn")
    got = tilepy.gemm(a, w.T, scale_a=np.full((1, 1), 2, np.float32),
                      scale_b=np.full((1, 8), 0.5, np.float32), out_dtype="float32")
    np.testing.assert_allclose(got, a.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5)
    one = tilepy.gemm(a, w.T, scale_a=np.full(1, 3, np.float32), out_dtype="float32")
    np.testing.assert_allclose(one, 3 * got, rtol=1e-5)
    out = np.full((1, 8), np.nan, np.float32)
    tilepy.gemm(a[:, :0], w[:, :0].T, out=out)
    assert (out == 0).all()
    bias = np.linspace(-2, 2, 8).astype(np.float32)     # K = 0 with a bias: relu(bias)
    tilepy.gemm(a[:, :0], w[:, :0].T, bias=bias, activation="relu", out=out)
    np.testing.assert_array_equal(out[0], np.maximum(bias, 0))


@pytest.mark.sim
def test_operands_of_any_layout_or_alignment_are_copied():
    """a and b that the kernel cannot read in place — a misaligned slice, a transposed a, a
    broadcast (stride 0), a row-major b — are copied into its layouts first: the product
    against float64, as with in-place operands."""
    rng = np.random.default_rng()
    a = codes(rng, (6, 48), "float8_e4m3fn")
    w = codes(rng, (9, 48), "float8_e4m3fn")
    cases = {
        "misaligned a": (a[:, 8:40], w[:, :32].T),
        "transposed a": (np.ascontiguousarray(a[:, :32].T).T, w[:, :32].T),
        "broadcast a": (np.broadcast_to(a[:1, :32], (6, 32)), w[:, :32].T),
        "broadcast b": (a[:, :32], np.broadcast_to(w[:1, :32].T, (32, 9))),
        "row-major b": (a[:, :32], np.ascontiguousarray(w[:, :32].T)),
        "misaligned b": (a[:, :32], w[:, 8:40].T),
    }
    for name, (x, y) in cases.items():
        want = x.astype(np.float64) @ y.astype(np.float64)
        got = tilepy.gemm(x, y, out_dtype="float32")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.sim
@pytest.mark.parametrize("layout", ["transposed", "every-other-column"])
def test_outputs_of_any_layout(layout):
    """A 16-bit ``out`` whose columns are not adjacent (a transposed view, a column step):
    the epilogue's paired stores (two columns in one 4-byte word) only where a row's columns
    are adjacent, element stores elsewhere; the skipped elements untouched."""
    rng = np.random.default_rng()
    a = codes(rng, (6, 32), "float8_e4m3fn")
    w = codes(rng, (9, 32), "float8_e4m3fn")
    want = a.astype(np.float64) @ w.astype(np.float64).T
    if layout == "transposed":
        base = np.full((9, 6), np.nan, ml_dtypes.bfloat16)
        out, rest = base.T, None
    else:
        base = np.full((6, 18), np.nan, ml_dtypes.bfloat16)
        out, rest = base[:, ::2], base[:, 1::2]
    assert tilepy.gemm(a, w.T, out=out) is out
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=1e-2,
                               atol=1e-2 * abs(want).max())
    assert rest is None or np.isnan(rest.astype(np.float64)).all()


@pytest.mark.compile
def test_fp8_kernel_compiles_for_sm90a():
    """k32 wgmmas on e4m3, no spill, no serialised-wgmma note."""
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reps = run_in_subprocess("tilepy.ops.gemm_kmajor_wgmma:compile_reports")
    # 128 x 256 (setmaxnreg split), 128 x 128, block scales, e4m3 · e5m2 with bias + GELU,
    # grouped; the TMA-store epilogue (per-row scales, bias + GELU, grouped: with the
    # register store of rows past a group's end beside it; grouped with b row-major: MN-major
    # B tiles, four 64-column boxes a stage)
    assert len(reps) == 9
    assert reps["grouped_gemm_bf16_brow_tmastore"]["counts"]["cp.async.bulk.tensor"] >= 5
    for name, rep in reps.items():
        assert "error" not in rep, rep.get("error")
        if name.endswith("tmastore"):     # 256 columns: two passes of 8 stmatrix.x4 each
            assert rep["counts"]["stmatrix"] == 16, rep["counts"]
        assert rep["counts"]["wgmma.mma_async"] >= 4 and \
            rep["counts"]["cp.async.bulk.tensor"] >= 2
        assert rep["spill_stores"] == 0 and rep["f64"] == 0 and rep["stack_frame"] == 0 and \
            not rep["ptxas_wgmma_notes"], rep
        # no 64-bit division by a run-time value: a call, which serialises every wgmma where
        # the kernel is linked without LTO (tilepy.tile.schedule.udiv)
        assert rep["counts"]["div64"] == 0, (name, rep["counts"])


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,tma_store,shape", [
    (128, False, (4096, 4096, 4096)), (256, False, (4096, 4096, 4096)),
    (256, True, (4096, 4096, 4096)), (256, True, (1000, 1424, 4160))])
def test_gpu_against_torch_scaled_mm(block_n, tma_store, shape):
    """e4m3 with row- and column-wise scales, bf16 out, against ``torch._scaled_mm``
    (cuBLASLt) in the same process; both tile widths, and the TMA-store epilogue (also at
    edges: partial row and column tiles, a partial 64-column box; N a multiple of 16, as
    ``_scaled_mm`` requires), out poisoned first."""
    torch = pytest.importorskip("torch")
    from tilepy.ops.gemm_kmajor_wgmma import KMajorConfig

    m, n, k = shape
    a = (torch.randn(m, k, device="cuda") * 3).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda") * 3).to(torch.float8_e4m3fn)
    sa = torch.rand(m, 1, device="cuda") + 0.5
    sb = torch.rand(1, n, device="cuda") + 0.5
    got = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    tilepy.gemm(a, w.t(), scale_a=sa, scale_b=sb, out=got,     # torch._scaled_mm's shapes
                config=KMajorConfig(block_n=block_n, tma_store=tma_store))
    want = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    assert not got.isnan().any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2e-2 * want.float().abs().max().item(), err


@pytest.mark.gpu
def test_gpu_block_scales_against_float32():
    """Block scales at 1000 × 1400 × 4160 (partial k, row and column blocks) against float32
    products of the dequantised operands (no TF32) on the GPU: within float32 summation noise
    (a misapplied scale is off by its whole size)."""
    torch = pytest.importorskip("torch")
    m, n, k = 1000, 1400, 4160
    kb, nb = -(-k // 128), -(-n // 128)
    a = (torch.randn(m, k, device="cuda") * 3).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda") * 3).to(torch.float8_e4m3fn)
    sa = torch.rand(m, kb, device="cuda") + 0.25
    sw = torch.rand(nb, kb, device="cuda") + 0.25
    got = tilepy.gemm(a, w.t(), scale_a=sa, scale_b=sw.t(), out_dtype="float32")
    a32 = a.float() * sa.repeat_interleave(128, 1)[:, :k]
    w32 = w.float() * sw.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = a32 @ w32.t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    assert not torch.isnan(got).any()
    err = (got - want).abs().max().item()
    assert err <= 1e-3 * want.abs().max().item(), err


@pytest.mark.gpu
def test_gpu_transposed_out():
    """A transposed bfloat16 ``out`` (columns a row apart): element stores where the
    epilogue's paired stores would write the wrong elements, against float32."""
    torch = pytest.importorskip("torch")
    m, n, k = 300, 200, 256
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    base = torch.full((n, m), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = tilepy.gemm(a, w.t(), out=base.t())
    want = a.float() @ w.float().t()
    assert not torch.isnan(got).any()
    err = (got.float() - want).abs().max().item()
    assert err <= 1e-2 * want.abs().max().item(), err


@pytest.mark.gpu
def test_gpu_mixed_formats_bias_gelu_against_float32():
    """e4m3 · e5m2 with row / column scales, a bfloat16 bias and GELU at 2000 × 3000 × 4096
    (partial tiles) against float32 products of the dequantised operands (no TF32), the
    bias and ``F.gelu`` applied after; outputs poisoned with NaN first."""
    torch = pytest.importorskip("torch")
    m, n, k = 2000, 3000, 4096
    a = (torch.randn(m, k, device="cuda") * 3).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda") * 3).to(torch.float8_e5m2)
    sa = torch.rand(m, 1, device="cuda") * 0.01 + 0.005
    sb = torch.rand(1, n, device="cuda") + 0.5
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = tilepy.gemm(a, w.t(), scale_a=sa, scale_b=sb, bias=bias, activation="gelu", out=out)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = torch.nn.functional.gelu((a.float() * sa) @ (w.float() * sb.t()).t()
                                        + bias.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    assert got is out and not torch.isnan(got).any()
    err = (got.float() - want).abs().max().item()
    assert err <= 1e-2 * want.abs().max().item(), err
