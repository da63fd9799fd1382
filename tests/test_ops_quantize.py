"""``tilepy.quantize_fp8``: codes and scales against a NumPy reference (ml_dtypes' rounding
after saturation, the scale ``amax / largest finite value`` in float32) for every granularity,
both formats and the three source dtypes, edges that are not multiples of a group; a zero
group, NaN, bad input; the kernels' offline compile; the GPU at full size."""

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
    the blocks of x padded with zeros to whole groups."""
    x32 = np.asarray(x).astype(np.float32)
    m, k = x32.shape
    gr, gc = {"tensor": (m, k), "row": (1, k)}.get(gran, gran)
    gm, gk = -(-m // gr), -(-k // gc)
    padded = np.zeros((gm * gr, gk * gc), np.float32)
    padded[:m, :k] = x32
    top = np.abs(padded.reshape(gm, gr, gk, gc)).max(axis=(1, 3))
    scales = np.where(top != 0, np.maximum((top * np.float32(1.0 / TOP[fmt])).astype(
        np.float32), np.float32(2.0 ** -126)), np.float32(1.0)).astype(np.float32)
    full = np.repeat(np.repeat(scales, gr, 0), gc, 1)[:m, :k]
    codes = np.clip(x32 / full, -TOP[fmt], TOP[fmt]).astype(NP8[fmt])
    shaped = scales.reshape(()) if gran == "tensor" else scales[:, 0] if gran == "row" \
        else scales
    return codes.view(np.uint8), shaped


@pytest.mark.sim
@pytest.mark.parametrize("gran,src,fmt", [
    ("tensor", "bfloat16", "e4m3"),
    ("row", "float16", "e5m2"),
    ((1, 128), "float32", "e4m3"),
    ((128, 128), "bfloat16", "e5m2"),
])
def test_codes_and_scales_against_the_reference(gran, src, fmt):
    rng = np.random.default_rng()
    x = (rng.standard_normal((130, 260)) * 10.0 ** rng.uniform(-3, 3)).astype(SRC[src])
    x[3] = 0                                      # a zero row: scale 1.0, zero codes
    values, scales = tilepy.quantize_fp8(x, granularity=gran, dtype=fmt)
    assert values.dtype == NP8[fmt] and values.shape == x.shape
    want_codes, want_scales = reference(x, gran, fmt)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(values.view(np.uint8), want_codes)
    back = values.astype(np.float64) * (np.asarray(scales).reshape(-1, 1) if gran == "row"
                                        else np.asarray(scales) if gran == "tensor"
                                        else np.kron(np.asarray(scales), np.ones(gran))[:130,
                                                                                        :260])
    rel = 2.0 ** -4 if fmt == "e4m3" else 2.0 ** -3   # half a code's spacing, and some
    assert np.abs(back - x.astype(np.float64)).max() <= rel * np.abs(x.astype(np.float64)).max()


@pytest.mark.sim
def test_nan_gives_the_nan_code_and_a_nan_scale():
    x = np.ones((2, 40), np.float16)
    x[1, 7] = np.nan
    values, scales = tilepy.quantize_fp8(x, granularity="row")
    assert np.isnan(values.astype(np.float32)[1, 7]) and np.isnan(scales[1])
    assert scales[0] == np.float32(1.0 / 448.0) and (values[0].astype(np.float32) == 448).all()
    _, scale = tilepy.quantize_fp8(x)        # one scale: the atomic max keeps the NaN
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
    with pytest.raises(ValueError, match="granularity must be one of"):
        tilepy.quantize_fp8(x, granularity=(1, 64))
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
    assert len(reports) == 3
    for name, rep in reports.items():
        assert "error" not in rep, rep.get("error")
        assert rep["spill_stores"] == 0 and rep["f64"] == 0, rep
        assert rep["counts"]["ld.local"] == 0, (name, rep["counts"])


@pytest.mark.gpu
@pytest.mark.parametrize("gran", ["tensor", "row", (1, 128), (128, 128)], ids=str)
def test_gpu_full_size_against_torch(gran):
    """4096 × 7168 bf16 (not a multiple of 128 in M: 4000 rows) against PyTorch's float8 casts
    after the same scaling in float32."""
    torch = pytest.importorskip("torch")
    x = (torch.randn(4000, 7168, device="cuda") * 5).bfloat16()
    values, scales = tilepy.quantize_fp8(x, granularity=gran)
    codes, want = reference(x.float().cpu().numpy(), gran, "e4m3")
    np.testing.assert_array_equal(scales.cpu().numpy(), want)
    got = values.view(torch.uint8).cpu().numpy()
    assert (got != codes).mean() == 0, (got != codes).sum()
