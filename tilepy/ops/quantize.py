"""``tilepy.quantize_fp8``: a float16 / bfloat16 / float32 matrix as 8-bit float codes and the
float32 scales that bring them back, in the shapes the FP8 GEMMs take.

Validation on the host, then the CUDA-core kernels of :mod:`tilepy.ops.quantize_simt`: one
launch per group granularity (rows, 1 × 128, 128 × 128 blocks), two for one scale over the
tensor (the absolute maximum first, then the codes).
"""

from __future__ import annotations

import numpy as np

from .. import arrays, launch
from ..arrays import describe
from ..launch import LaunchPlan, sm_count
from . import quantize_simt as qs

#: The formats by name, as PyTorch and ml_dtypes name them.
FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
GRANULARITIES = ("tensor", "row", (1, 128), (128, 128))
#: Warps a block (one in the simulator, where every thread is a Python thread).
WARPS = 1 if arrays.SIMULATOR else 4


def output_spec(x, *, granularity="tensor", dtype="e4m3"):
    """``(values shape, scales shape)`` after the checks that read only metadata (the
    registered operator's fake implementation)."""
    X, gran = check_arguments(x, granularity, dtype)
    return X.shape, scales_shape(X.shape, gran)


def scales_shape(shape, gran) -> tuple:
    m, k = shape
    if gran == "tensor":
        return ()
    if gran == "row":
        return (m,)
    return (-(-m // gran[0]), -(-k // gran[1]))


def check_arguments(x, granularity, dtype):
    """``(X, granularity as a str or a tuple)``; errors name the argument."""
    X = describe(x, "x")
    if dtype not in FORMATS:
        raise ValueError(f"dtype must be one of {tuple(FORMATS)}, got {dtype!r}")
    if X.ndim != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {X.shape}")
    gran = granularity if isinstance(granularity, str) else tuple(granularity)
    if gran not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if isinstance(gran, tuple) and -(-X.shape[1] // gran[1]) > 65535:
        raise NotImplementedError(f"quantize_fp8: at most 65535 groups along K (K = "
                                  f"{X.shape[1]}, groups of {gran[1]})")
    return X, gran


def quantize_fp8(x, *, granularity="tensor", dtype="e4m3"):
    """``(values, scales)`` with ``values · scales ≈ x`` for a 2-D ``x`` (M, K), float16,
    bfloat16 or float32.

    * ``dtype``: ``"e4m3"`` (``float8_e4m3fn``, largest finite 448) or ``"e5m2"``
      (``float8_e5m2``, 57344). ``values`` (M, K) is of that dtype for PyTorch tensors and
      NumPy arrays (ml_dtypes), of ``uint8`` codes for CuPy and Numba arrays (neither has
      the type).
    * ``granularity`` — what one scale covers, and the shape of ``scales`` (float32):
      ``"tensor"``: everything, a 0-d array; ``"row"``: each row, (M,); ``(1, 128)``: each
      1 × 128 block of a row, (M, ceil(K / 128)) (``scale_a`` of a block-scaled GEMM);
      ``(128, 128)``: each 128 × 128 block, (ceil(M / 128), ceil(K / 128)) (``scale_b``).
    * Each scale is ``amax · (1 / largest finite value)`` (float32; at least 2**-126) of the
      elements it covers, so the largest of them becomes ± that value; ``values = round(x /
      scale)`` to nearest even (never past the largest finite value). A group of zeros gets
      scale 1.0 and zero codes. A NaN element gives the NaN code; a non-finite element makes its
      group's scale non-finite.

    The absolute maxima are fused with the rounding: one pass over ``x`` per granularity, two
    for ``"tensor"``. CuPy arrays, PyTorch tensors, Numba device arrays (NumPy arrays in the
    simulator); errors are raised before anything is launched.
    """
    X, gran = check_arguments(x, granularity, dtype)
    if not arrays.SIMULATOR and launch.compute_capability() < (8, 9):
        raise NotImplementedError(f"quantize_fp8 needs compute capability 8.9 or newer (the "
                                  f"float8 conversions), this GPU is "
                                  f"{'.'.join(map(str, launch.compute_capability()))}")
    m, k = X.shape
    values = _empty_codes(X, dtype)
    if gran == "tensor":
        scales = arrays.zeros(X, (), "float32")
    else:
        scales = arrays.empty(X, scales_shape(X.shape, gran), "float32")
    if m == 0 or k == 0:
        # nothing to scale: every scale (a row's of no column too) is 1.0
        return values, arrays.ones(X, scales_shape(X.shape, gran))
    src = X.dtype
    with arrays.on_device(X.device):
        stream = arrays.stream_handle(X)
        xv = arrays.kernel_view(X)
        vv = _codes_view(values)
        S = describe(scales, "scales")
        sv = arrays.raw_view(S)
        threads = 32 * WARPS
        if gran == "tensor":
            sv2 = arrays.restride(sv, (1, 1), (4, 4))
            amax = arrays.zeros(X, (1,), "int32")
            av = arrays.raw_view(describe(amax, "amax", dtypes=("int32",)))
            blocks = max(1, min(-(-(m * k) // (threads * 8)), 4 * sm_count(4)))
            for mode in ("amax", "apply"):
                kern = qs.quantize_kernel(src, dtype, mode, WARPS)
                args = (xv, vv, arrays.device_view(sv2), arrays.device_view(av), np.int64(m), np.int64(k))
                LaunchPlan(kern, args, (blocks, 1, 1), threads).launch(stream, args)
        else:
            gr, gc = (1, k) if gran == "row" else gran
            sv2 = sv.reshape(m, 1) if gran == "row" else sv
            kern = qs.quantize_kernel(src, dtype, "group", WARPS)
            args = (xv, vv, arrays.device_view(sv2), arrays.device_view(arrays.placeholder(1)), np.int64(gr),
                    np.int64(gc))
            grid = (-(-m // gr), -(-k // gc), 1)
            LaunchPlan(kern, args, grid, threads).launch(stream, args)
    return values, scales



def _empty_codes(X, fmt: str):
    """An (M, K) array for the codes: the format's dtype where the family has it."""
    if X.family == "torch":
        import torch

        return torch.empty(X.shape, dtype=getattr(torch, FORMATS[fmt]), device=X.raw.device)
    if X.family == "numpy":
        import ml_dtypes

        return np.empty(X.shape, dtype=getattr(ml_dtypes, FORMATS[fmt]))
    return arrays.empty(X, X.shape, "uint8")


def _codes_view(values):
    """The codes array as a uint8 kernel argument, no copy."""
    if type(values).__module__.split(".")[0] == "torch":
        import torch

        v = values.view(torch.uint8)
        return arrays.device_view(v.numpy()) if arrays.SIMULATOR else arrays.import_device_array(v)
    if isinstance(values, np.ndarray):
        return arrays.device_view(values.view(np.uint8))
    if type(values).__module__.split(".")[0] == "cupy":
        return arrays.import_device_array(values)
    return values

