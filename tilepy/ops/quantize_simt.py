"""The FP8 quantisers' kernels (CUDA cores): absolute maxima, scales, and the rounding of
``x / scale`` to e4m3 / e5m2 codes.

``quantize_kernel(src, fmt, mode, warps)`` returns a ``@cuda.jit`` kernel

    kernel(x, values, scales, amax, gr, gc)

over a 2-D ``x`` (M, K) — uint16 bits of float16 / bfloat16 (``src``), or float32 — writing
``values`` (M, K) uint8 codes of ``fmt`` and float32 ``scales`` such that ``values · scale ≈
x`` (``scale = amax · fl(1 / FP8_MAX[fmt])`` in float32 over the elements it covers, at least
2**-126; 1.0 where they are all zero, whose codes are then zeros). ``mode``:

* ``"group"``: block ``(i, j)`` of the grid (ceil(M / gr), ceil(K / gc)) owns the group of
  rows ``i·gr …`` and columns ``j·gc …``: its amax (a block reduction), ``scales[i, j]``,
  then its codes. Rows (``gr`` 1, ``gc`` K), 1 × 128 and 128 × 128 blocks are this mode.
* ``"amax"``: every block strides over the whole of ``x`` and raises ``amax[0]`` (int32, zero on
  entry: the bits of a non-negative float32) to the bits of the largest |element| with an
  integer atomic max (one per block; a NaN wins). * ``"apply"``: every block strides over ``x``
  writing the codes of ``x / scale`` for the one scale of the float32 whose bits are
  ``amax[0]``; thread 0 of block 0 writes ``scales[0, 0]``.

``cfg``-free: ``warps`` warps a block (1 … 32). Conversions round to nearest even and
saturate (:func:`tilepy.ptx.math.cvt_e4m3x2_f32`); a NaN element gives the NaN code, and a
non-finite element makes its group's scale non-finite.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..inline import inline_device
from ..kcache import cached_jit
from ..ptx.asm import SIMULATOR
from ..ptx.math import (cvt_e4m3x2_f32, cvt_e5m2x2_f32, f32_as_u32, u32_as_f32,
                        unpack_bf16x2_f32, unpack_f16x2_f32)
from ..tile.reduce import block_row_reduce

#: The largest finite value of each 8-bit format.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
SOURCES = ("float16", "bfloat16", "float32")
MODES = ("group", "amax", "apply")


@functools.cache
def quantize_kernel(src: str, fmt: str, mode: str, warps: int = 4):
    """The kernel of the module docstring, generated once per argument set."""
    if src not in SOURCES or fmt not in FP8_MAX or mode not in MODES:
        raise ValueError(f"quantize_kernel: src {src!r} of {SOURCES}, fmt {fmt!r} of "
                         f"{tuple(FP8_MAX)}, mode {mode!r} of {MODES}")
    THREADS = 32 * warps
    INV_MAX = np.float32(1.0 / FP8_MAX[fmt])
    ONE = np.float32(1.0)
    ZERO = np.float32(0.0)
    TINY = np.float32(2.0 ** -126)
    cvt = cvt_e4m3x2_f32 if fmt == "e4m3" else cvt_e5m2x2_f32
    block_max = block_row_reduce("max", warps)
    F16, BF16 = src == "float16", src == "bfloat16"
    GROUP, AMAX = mode == "group", mode == "amax"
    jit = cuda.jit if SIMULATOR else cached_jit

    @inline_device
    def load(x, r, c):
        # element (r, c) as float32
        w = x[r, c]
        if F16:
            return unpack_f16x2_f32(np.uint32(w))[0]
        if BF16:
            return unpack_bf16x2_f32(np.uint32(w))[0]
        return w

    @jit
    def kernel(x, values, scales, amax, gr, gc):
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array(32, np.float32)
        m = x.shape[0]
        k = x.shape[1]
        if GROUP:
            r0 = np.int64(cuda.blockIdx.x) * gr
            c0 = np.int64(cuda.blockIdx.y) * gc
            rows = min(gr, m - r0)
            cols = min(gc, k - c0)
            first = np.int64(tid)
            step = np.int64(THREADS)
        else:
            r0 = np.int64(0)
            c0 = np.int64(0)
            rows = np.int64(m)
            cols = np.int64(k)
            first = np.int64(cuda.blockIdx.x) * THREADS + tid
            step = np.int64(cuda.gridDim.x) * THREADS
        total = rows * cols
        if GROUP or AMAX:
            top = ZERO
            for e in range(first, total, step):
                a = abs(load(x, r0 + e // cols, c0 + e % cols))
                if a > top or a != a:
                    top = a
            top = block_max(top, scratch)
            if AMAX:
                if tid == 0:
                    # on the bits: a float atomic max drops NaN, the integer one keeps it
                    # (top >= 0, so the bit order is the float order, NaN above +inf)
                    # (the sign bit cleared: abs of a NaN may leave it set)
                    cuda.atomic.max(amax, 0, np.int32(f32_as_u32(top) & np.uint32(0x7FFFFFFF)))
                return
        else:
            top = u32_as_f32(np.uint32(amax[0]))
        scale = top * INV_MAX if top != ZERO else ONE
        if scale < TINY:
            scale = TINY    # a subnormal amax: the smallest normal scale, never 0
        if tid == 0:
            if GROUP:
                scales[cuda.blockIdx.x, cuda.blockIdx.y] = scale
            elif cuda.blockIdx.x == 0:
                scales[0, 0] = scale
        for e in range(first, total, step):
            r = r0 + e // cols
            c = c0 + e % cols
            values[r, c] = np.uint8(cvt(load(x, r, c) / scale, ZERO) & 0xFF)

    return kernel


def argtypes(src: str, layout: str = "A"):
    """Numba argument types of :func:`quantize_kernel`'s kernel (offline compilation)."""
    from numba import types

    x = types.Array(types.float32 if src == "float32" else types.uint16, 2, layout)
    return (x, types.Array(types.uint8, 2, layout), types.Array(types.float32, 2, layout),
            types.Array(types.int32, 1, layout), types.int64, types.int64)


def compile_reports():
    """Offline sm_90 reports of the bfloat16 → e4m3 kernels in each mode."""
    from ..offline import report_entry

    return [report_entry(f"quantize_bf16_e4m3_{mode}",
                         lambda mode=mode: quantize_kernel("bfloat16", "e4m3", mode),
                         argtypes("bfloat16"), (9, 0), threads=128)
            for mode in MODES]
