"""Epilogue: scale, bias, activation, cast, and store of a warp's accumulators to global memory.

``store_accumulators(...)`` returns
``store(acc, out, row0, col0, m, n, alpha, bias, c, beta, lane)`` for one warp:
``out[r, j] = act(alpha · acc + beta · c[r, j] + bias[j])`` for each element of the warp's
(mi·16 × ni·8) accumulator tile at (row0, col0), skipping elements outside (m, n). ``out`` is
a 2-D float32 array, or a uint16 array holding float16 / bfloat16 bits (bfloat16 has no NumPy
dtype; 16-bit results are converted with ``cvt.rn.{f16,bf16}x2.f32``); ``c`` is an array of
the same kind as ``out`` (read only with ``has_c``), ``bias`` float32 (read only with
``has_bias``). Stores go straight from registers (each lane writes pairs of adjacent columns).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ..ptx.math import cvt_bf16x2_f32, cvt_f16x2_f32, unpack_bf16x2_f32, unpack_f16x2_f32

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
OUT_KINDS = ("float32", "float16", "bfloat16")

# float32 constants: a Python float would promote the arithmetic to float64.
_ZERO = np.float32(0.0)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_SQRT_HALF = np.float32(0.7071067811865476)
_SQRT_2_OVER_PI = np.float32(0.7978845608028654)
_GELU_C = np.float32(0.044715)


@functools.cache
def activation_fn(name):
    """Device function float32 -> float32 for an activation name (None: identity)."""
    if name is None:
        @cuda.jit(device=True, inline="always")
        def act(v):
            return v
    elif name == "relu":
        @cuda.jit(device=True, inline="always")
        def act(v):
            return v if v > _ZERO else v * _ZERO  # keeps NaN
    elif name == "gelu":
        @cuda.jit(device=True, inline="always")
        def act(v):
            return _HALF * v * (_ONE + math.erf(v * _SQRT_HALF))
    elif name == "gelu_tanh":
        @cuda.jit(device=True, inline="always")
        def act(v):
            return _HALF * v * (_ONE + math.tanh(_SQRT_2_OVER_PI * (v + _GELU_C * v * v * v)))
    elif name == "silu":
        @cuda.jit(device=True, inline="always")
        def act(v):
            return v / (_ONE + math.exp(-v))
    else:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
    return act


@functools.cache
def store_accumulators(mi: int, ni: int, out_kind: str, activation=None, has_bias=False,
                       has_c=False):
    if out_kind not in OUT_KINDS:
        raise ValueError(f"out_kind must be one of {OUT_KINDS}, got {out_kind!r}")
    act = activation_fn(activation)
    if out_kind == "float16":
        pack, unpack = cvt_f16x2_f32, unpack_f16x2_f32
    elif out_kind == "bfloat16":
        pack, unpack = cvt_bf16x2_f32, unpack_bf16x2_f32
    else:
        pack = unpack = None

    if pack is None:
        @cuda.jit(device=True, inline="always")
        def put_pair(out, r, c, n, v0, v1):
            out[r, c] = v0
            if c + 1 < n:
                out[r, c + 1] = v1

        @cuda.jit(device=True, inline="always")
        def get_pair(src, r, c, n):
            v1 = src[r, c + 1] if c + 1 < n else _ZERO
            return src[r, c], v1
    else:
        @cuda.jit(device=True, inline="always")
        def get_pair(src, r, c, n):
            word = np.uint32(src[r, c])
            if c + 1 < n:
                word = word | (np.uint32(src[r, c + 1]) << np.uint32(16))
            return unpack(word)

        @cuda.jit(device=True, inline="always")
        def put_pair(out, r, c, n, v0, v1):
            word = pack(v0, v1)
            out[r, c] = word & 0xFFFF
            if c + 1 < n:
                out[r, c + 1] = word >> 16

    @cuda.jit(device=True, inline="always")
    def store(acc, out, row0, col0, m, n, alpha, bias, c_in, beta, lane):
        g = lane // 4
        t = lane % 4
        for i in range(mi):
            for j in range(ni):
                c = col0 + j * 8 + 2 * t
                if c < n:
                    b0 = _ZERO
                    b1 = _ZERO
                    if has_bias:
                        b0 = bias[c]
                        if c + 1 < n:
                            b1 = bias[c + 1]
                    for h in range(2):
                        r = row0 + i * 16 + g + 8 * h
                        if r < m:
                            v0 = alpha * acc[i, j, 2 * h] + b0
                            v1 = alpha * acc[i, j, 2 * h + 1] + b1
                            if has_c:
                                c0, c1 = get_pair(c_in, r, c, n)
                                v0 += beta * c0
                                v1 += beta * c1
                            v0 = act(v0)
                            v1 = act(v1)
                            put_pair(out, r, c, n, v0, v1)

    return store
