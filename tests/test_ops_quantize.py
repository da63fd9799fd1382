"""``tilepy.quantize_fp8``: codes and scales against a NumPy reference (the scale ``amax ·
fl(1 / largest finite value)`` in float32, the codes ml_dtypes' rounding of ``x · fl(1 /
scale)`` after saturation) for every granularity, both formats and the three source dtypes,
on the vector kernel (edges that are not multiples of a group, rows longer than a tile) and
the scalar fallback (strided rows, K not a multiple of 8); a repeated call replayed from its
record; a zero group, NaN, bad input; the kernels' offline compile; the GPU at full size."""

from __future__ import annotations

import numpy as np
import pytest

import tilepy

ml_dtypes = pytest.importorskip("ml_dtypes")

TOP = {"e4m3": 448.0, "e5m2": 57344.0}
NP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
SRC = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def reference(x, gran, fmt):
    """(codes (M, K) uint8, scales in the op's shape), per group in float32: the groups are
    the blocks of x padded with zeros to whole groups; each code rounds the float32 product
    of x and the scale's float32 reciprocal."""
    x32 = np.asarray(x).astype(np.float32)
    m, k = x32.shape
    gr, gc = {"tensor": (m, k), "row": (1, k)}.get(gran, gran)
    gm, gk = -(-m // gr), -(-k // gc)
    padded = np.zeros((gm * gr, gk * gc), np.float32)
    padded[:m, :k] = x32
    top = np.abs(padded.reshape(gm, gr, gk, gc)).max(axis=(1, 3))
    scales = np.where(top != 0, np.maximum((top * np.float32(1.0 / TOP[fmt])).astype(
        np.float32), np.float32(2.0 ** -126)), np.float32(1.0)).astype(np.float32)
    inv = (np.float32(1.0) / scales).astype(np.float32)
    full = np.repeat(np.repeat(inv, gr, 0), gc, 1)[:m, :k]
    codes = np.clip(x32 * full, -TOP[fmt], TOP[fmt]).astype(NP8[fmt])
    shaped = scales.reshape(()) if gran == "tensor" else scales[:, 0] if gran == "row" \
        else scales
    return codes.view(np.uint8), shaped


def aligned(a):
    """``a`` copied to a 16-byte aligned buffer (what the vector kernel reads)."""
    buf = np.empty(a.nbytes + 16, np.uint8)
    off = -buf.ctypes.data % 16
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _check(x, gran, fmt, values, scales):
    m, k = x.shape
    assert values.dtype == NP8[fmt] and values.shape == x.shape
    want_codes, want_scales = reference(x, gran, fmt)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(values.view(np.uint8), want_codes)
    back = values.astype(np.float64) * (np.asarray(scales).reshape(-1, 1) if gran == "row"
                                        else np.asarray(scales) if gran == "tensor"
                                        else np.kron(np.asarray(scales), np.ones(gran))[:m, :k])
    rel = 2.0 ** -4 if fmt == "e4m3" else 2.0 ** -3   # half a code's spacing, and some
    assert np.abs(back - x.astype(np.float64)).max() <= rel * np.abs(x.astype(np.float64)).max()


@pytest.mark.sim
@pytest.mark.parametrize("gran,src,fmt,layout", [
    ("tensor", "bfloat16", "e4m3", "vector"),
    ("row", "float16", "e5m2", "vector"),        # K = 272: a row of two tiles (simulator)
    ((1, 128), "float32", "e4m3", "vector"),     # K a multiple of 16, not of 128
    ((128, 128), "bfloat16", "e5m2", "vector"),  # M, K not multiples of 128; two warps a team
    ("tensor", "float32", "e5m2", "strided"),    # the scalar kernel: every other column
    ((1, 128), "float16", "e4m3", "odd"),        # the scalar kernel: K = 260
], ids=str)
def test_codes_and_scales_against_the_reference(gran, src, fmt, layout):
    from tilepy.ops import quantize

    rng = np.random.default_rng()
    # few blocks (the simulator's time): 130 rows for a 128-row edge, 8 for the scalar groups
    m = 130 if gran == (128, 128) else 8 if layout == "odd" else 34
    k = 260 if layout == "odd" else 272
    x = aligned((rng.standard_normal((m, 2 * k if layout == "strided" else k))
                 * 10.0 ** rng.uniform(-3, 3)).astype(SRC[src]))
    x = x[:, ::2] if layout == "strided" else x
    x[3] = 0                                      # a zero row: scale 1.0, zero codes
    assert quantize.vectorizable(tilepy.arrays.describe(x, "x")) == (layout == "vector")
    values, scales = tilepy.quantize_fp8(x, granularity=gran, dtype=fmt)
    _check(x, gran, fmt, values, scales)


@pytest.mark.sim
@pytest.mark.parametrize("gran", ["tensor", (1, 128)], ids=str)
def test_a_repeated_call_replays_its_record(gran, monkeypatch):
    """The second call of a signature builds nothing (no checks, views or launch plans) and
    gives fresh results on fresh data: one scale over the tensor comes from this call's
    maxima, not the first call's larger ones; the first call's results stay as they were."""
    from tilepy import launch
    from tilepy.ops import quantize

    rng = np.random.default_rng()
    x = aligned((rng.standard_normal((24, 264)) * 100).astype(ml_dtypes.bfloat16))
    first, first_scales = tilepy.quantize_fp8(x, granularity=gran)
    kept = (first.view(np.uint8).copy(), np.array(first_scales))

    def refuse(*args, **kwargs):
        raise AssertionError("a repeated call built something")

    monkeypatch.setattr(quantize, "check_arguments", refuse)
    monkeypatch.setattr(tilepy.arrays, "kernel_view", refuse)
    monkeypatch.setattr(launch.LaunchPlan, "__init__", refuse)
    y = aligned((rng.standard_normal((24, 264)) * 0.01).astype(ml_dtypes.bfloat16))
    assert quantize.vectorizable(tilepy.arrays.describe(y, "y"))
    values, scales = tilepy.quantize_fp8(y, granularity=gran)
    _check(y, gran, "e4m3", values, scales)
    np.testing.assert_array_equal(first.view(np.uint8), kept[0])
    np.testing.assert_array_equal(np.asarray(first_scales), kept[1])


@pytest.mark.sim
def test_nan_gives_the_nan_code_and_a_nan_scale():
    x = np.ones((2, 40), np.float16)
    x[1, 7] = np.nan
    values, scales = tilepy.quantize_fp8(x, granularity="row")
    assert np.isnan(values.astype(np.float32)[1, 7]) and np.isnan(scales[1])
    assert scales[0] == np.float32(1.0 / 448.0) and (values[0].astype(np.float32) == 448).all()
    _, scale = tilepy.quantize_fp8(x)        # one scale: the blocks' maxima keep the NaN
    assert np.isnan(scale)


@pytest.mark.sim
def test_tiny_and_empty_inputs():
    """A subnormal amax gets the smallest normal scale (never 0, which would make 0/0); an x
    with no columns has scales of 1.0."""
    x = np.full((1, 8), 1e-42, np.float32)
    values, scales = tilepy.quantize_fp8(x, granularity="row")
    assert scales[0] == np.float32(2.0 ** -126) and not np.isnan(values.astype(np.float32)).any()
    values, scales = tilepy.quantize_fp8(np.zeros((3, 0), np.float16), granularity="row")
    assert values.shape == (3, 0) and (scales == 1.0).all() and scales.shape == (3,)


def test_errors_are_raised_before_launch():
    x = np.zeros((4, 8), np.float16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        tilepy.quantize_fp8(x, dtype="e3m4")
    for bad in ((1, 64), 128, None):
        with pytest.raises(ValueError, match="granularity must be one of"):
            tilepy.quantize_fp8(x, granularity=bad)
    with pytest.raises(ValueError, match="x must be 2-D"):
        tilepy.quantize_fp8(x[0])
    with pytest.raises(TypeError, match="x: dtype int32 is not supported"):
        tilepy.quantize_fp8(x.astype(np.int32))


@pytest.mark.compile
def test_quantize_kernels_compile_without_spills():
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reports = run_in_subprocess("tilepy.ops.quantize_simt:compile_reports")
    assert len(reports) == 10
    for name, rep in reports.items():
        assert "error" not in rep, rep.get("error")
        assert rep["spill_stores"] == 0 and rep["stack_frame"] == 0 and rep["f64"] == 0, rep
        assert rep["counts"]["ld.local"] == 0, (name, rep["counts"])


@pytest.mark.gpu
@pytest.mark.parametrize("gran", ["tensor", "row", (1, 128), (128, 128)], ids=str)
def test_gpu_full_size_against_torch(gran):
    """4000 × 7168 bf16 (not a multiple of 128 in M) against the reference (ml_dtypes' casts
    after the same scaling in float32), twice: the second call, on a smaller x of the same
    signature, replays the first one's record."""
    torch = pytest.importorskip("torch")
    for spread in (5.0, 0.01):
        x = (torch.randn(4000, 7168, device="cuda") * spread).bfloat16()
        values, scales = tilepy.quantize_fp8(x, granularity=gran)
        codes, want = reference(x.float().cpu().numpy(), gran, "e4m3")
        np.testing.assert_array_equal(scales.cpu().numpy(), want)
        got = values.view(torch.uint8).cpu().numpy()
        assert (got != codes).mean() == 0, (got != codes).sum()
