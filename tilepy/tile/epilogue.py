"""Epilogue: scale, bias, activation, cast, and store of a warp's accumulators to global memory.

``store_accumulators(...)`` returns
``store(acc, out, row0, col0, m, n, alpha, bias, c, beta, lane)`` for one warp:
``out[r, j] = act(alpha · acc + beta · c[r, j] + bias[j])`` for each element of the warp's
(mi·16 × ni·8) accumulator tile at (row0, col0), skipping elements outside (m, n). ``out`` is
a 2-D float32 array, or a uint16 array holding float16 / bfloat16 bits (bfloat16 has no NumPy
dtype; 16-bit results are converted with ``cvt.rn.{f16,bf16}x2.f32``); ``c`` is an array of
the same kind as ``out`` (read only with ``has_c``), ``bias`` float32 (read only with
``has_bias``). Stores go straight from registers (each lane writes pairs of adjacent columns).
``transposed=True``: the accumulator tile is of ``outᵀ`` (a GEMM computed with its operands
swapped): element (r, j) of the tile goes to ``out[j, r]``, with ``c[j, r]`` and ``bias[r]``
(the bias runs along the tile's rows, ``out``'s columns); (m, n) still bound the tile's rows
and columns.

``store_accumulators_smem(...)`` is the same epilogue for one wgmma warpgroup's accumulators,
staged through shared memory: the results are written to a padded shared tile, the warpgroup
syncs on a named barrier, and each thread stores 16-byte vectors of consecutive columns (whole
32-byte sectors per row instead of 8 rows × 16 bytes per warp store); element stores at the
right / bottom edge and where the output's rows are not 16-byte aligned.

``stage_accumulators_swizzled(...)`` finishes a warpgroup's accumulators with the same math
into 16-bit values in shared memory laid out as a TMA store with the 128-byte swizzle reads
them (``stmatrix.x4``); the caller issues the stores. The activations are
:data:`ACTIVATIONS` (:func:`activation_fn`; ``"gelu"`` is the erf form, :func:`gelu_erf`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..inline import inline_device, written_out
from ..ptx import barrier as BAR
from ..ptx import global_vector as GV
from ..ptx import tma as T
from ..ptx import wgmma as FN
from ..ptx import vector as VEC
from ..ptx.address import global_addr
from ..ptx.ldmatrix import stmatrix_x4
from ..ptx.math import (
    cvt_bf16x2_f32,
    cvt_f16x2_f32,
    ex2_approx,
    rcp_approx,
    unpack_bf16x2_f32,
    unpack_f16x2_f32,
)

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
OUT_KINDS = ("float32", "float16", "bfloat16")

# float32 constants: a Python float would promote the arithmetic to float64.
_ZERO = np.float32(0.0)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_SQRT_HALF = np.float32(0.7071067811865476)
_SQRT_2_OVER_PI = np.float32(0.7978845608028654)
_GELU_C = np.float32(0.044715)
_LOG2E = np.float32(1.4426950408889634)
# erfc(z) ≈ t · exp(-z² + P(t)), t = 1 / (1 + z/2), z ≥ 0: the Chebyshev fit of Numerical
# Recipes' erfcc, fractional error below 1.2e-7 everywhere. P's coefficients, t⁰ first:
_ERFC_P = tuple(np.float32(x) for x in (
    -1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
    1.48851587, -0.82215223, 0.17087277))
_P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7, _P8, _P9 = _ERFC_P


@inline_device
def erfc_nonneg(z):
    """erfc(z) for float32 z ≥ 0 (relative error ~1e-7 plus float32 rounding, ~13 instructions
    against libdevice erff's ~30 with both of its branches): ``t · 2^(log2e · (P(t) − z²))``
    with ``rcp.approx`` and ``ex2.approx``."""
    t = rcp_approx(_ONE + _HALF * z)
    p = _P9
    p = p * t + _P8
    p = p * t + _P7
    p = p * t + _P6
    p = p * t + _P5
    p = p * t + _P4
    p = p * t + _P3
    p = p * t + _P2
    p = p * t + _P1
    p = p * t + _P0
    return t * ex2_approx((p - z * z) * _LOG2E)


@inline_device
def gelu_erf(v):
    """``v · Φ(v) = v/2 · erfc(−v/√2)`` from :func:`erfc_nonneg` of ``|v|/√2``: for v ≥ 0
    ``v · (1 − erfc/2)``, else ``v · erfc/2`` — the negative side keeps its relative accuracy
    where Φ(v) is tiny. NaN stays NaN; +inf gives +inf."""
    e = erfc_nonneg(abs(v) * _SQRT_HALF)
    f = _HALF * e
    if v >= _ZERO:
        f = _ONE - f
    return v * f


@functools.cache
def activation_fn(name):
    """Device function float32 -> float32 for an activation name (None: identity)."""
    if name is None:
        @inline_device
        def act(v):
            return v
    elif name == "relu":
        @inline_device
        def act(v):
            return v if v > _ZERO else v * _ZERO  # keeps NaN
    elif name == "gelu":
        act = gelu_erf
    elif name == "gelu_tanh":
        @inline_device
        def act(v):
            return _HALF * v * (_ONE + math.tanh(_SQRT_2_OVER_PI * (v + _GELU_C * v * v * v)))
    elif name == "silu":
        @inline_device
        def act(v):
            # exp of -|v| only: no overflow to inf (which the simulator's math.exp raises on)
            e = math.exp(-abs(v))
            return v / (_ONE + e) if v >= _ZERO else v * e / (_ONE + e)
    else:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
    return act


@functools.cache
def _pair_io(out_kind: str, pair_stores: bool = False, transposed: bool = False):
    """``(get_pair, put_pair, pack)`` for an output kind: read / write two adjacent elements
    of a 2-D array (the second only when its column is below ``n``), and the packing of two
    float32 into one uint32 of 16-bit bits (None for float32). ``pair_stores``: a 16-bit pair
    whose address is 4-byte aligned goes in one store (a branch per pair: for epilogues
    written out with constant indices — in a loop it made LLVM stop unrolling the 128 × 256
    kernel's, sending its accumulators to local memory). ``transposed``: the pair (r, c),
    (r, c + 1) is the array's ``[c, r]`` and ``[c + 1, r]`` (two element accesses)."""
    if out_kind not in OUT_KINDS:
        raise ValueError(f"out_kind must be one of {OUT_KINDS}, got {out_kind!r}")
    if out_kind == "float16":
        pack, unpack = cvt_f16x2_f32, unpack_f16x2_f32
    elif out_kind == "bfloat16":
        pack, unpack = cvt_bf16x2_f32, unpack_bf16x2_f32
    else:
        pack = unpack = None

    if transposed:   # the plain element accesses on the transposed view
        get_pair, put_pair, _ = _pair_io(out_kind)

        @inline_device
        def get_pair_t(src, r, c, n):
            return get_pair(src.T, r, c, n)

        @inline_device
        def put_pair_t(out, r, c, n, v0, v1):
            put_pair(out.T, r, c, n, v0, v1)

        return get_pair_t, put_pair_t, pack

    if pack is None:
        @inline_device
        def put_pair(out, r, c, n, v0, v1):
            out[r, c] = v0
            if c + 1 < n:
                out[r, c + 1] = v1

        @inline_device
        def get_pair(src, r, c, n):
            v1 = src[r, c + 1] if c + 1 < n else _ZERO
            return src[r, c], v1
    else:
        @inline_device
        def get_pair(src, r, c, n):
            word = np.uint32(src[r, c])
            if c + 1 < n:
                word = word | (np.uint32(src[r, c + 1]) << np.uint32(16))
            return unpack(word)

        @inline_device
        def put_pair(out, r, c, n, v0, v1):
            word = pack(v0, v1)
            if pair_stores and c + 1 < n and GV.pair_aligned(out, r, c):
                GV.st_global_pair(out, r, c, word)      # both halves in one 4-byte store
            else:
                out[r, c] = word & 0xFFFF
                if c + 1 < n:
                    out[r, c + 1] = word >> 16

    return get_pair, put_pair, pack


@functools.cache
def _pair_math(out_kind: str, activation, has_bias: bool, has_c: bool, transposed=False):
    """``(load_bias, finish)``: ``load_bias(bias, c, n) -> (b0, b1)`` (zeros without a bias;
    ``c < n``), and ``finish(a0, a1, b0, b1, r, c, n, alpha, c_in, beta) -> (v0, v1)``, the
    epilogue of two adjacent accumulators at (r, c), (r, c + 1) before the cast:
    ``act(alpha · a + b + beta · c_in[r, c])`` (``c_in`` read only with ``has_c``; r < m,
    c < n; ``transposed``: ``c_in[c, r]`` and ``[c + 1, r]``)."""
    act = activation_fn(activation)
    get_pair = _pair_io(out_kind, transposed=transposed)[0]

    @inline_device
    def load_bias(bias, c, n):
        b0 = _ZERO
        b1 = _ZERO
        if has_bias:
            b0 = bias[c]
            if c + 1 < n:
                b1 = bias[c + 1]
        return b0, b1

    @inline_device
    def finish(a0, a1, b0, b1, r, c, n, alpha, c_in, beta):
        v0 = alpha * a0 + b0
        v1 = alpha * a1 + b1
        if has_c:
            c0, c1 = get_pair(c_in, r, c, n)
            v0 += beta * c0
            v1 += beta * c1
        return act(v0), act(v1)

    return load_bias, finish


@functools.cache
def store_accumulators(mi: int, ni: int, out_kind: str, activation=None, has_bias=False,
                       has_c=False, transposed=False):
    """The register epilogue of the module docstring (``transposed``: of a tile of
    ``outᵀ``)."""
    put_pair = _pair_io(out_kind, transposed=transposed)[1]
    load_bias, finish = _pair_math(out_kind, activation, has_bias, has_c, transposed)

    if transposed:
        @inline_device
        def store_n8(a0, a1, a2, a3, out, r, c, m, n, alpha, bias, c_in, beta):
            """One n8 block of a lane: tile columns (c, c + 1) of tile rows r and r + 8, the
            bias of each row."""
            if c < n:
                if r < m:
                    b = bias[r] if has_bias else _ZERO
                    v0, v1 = finish(a0, a1, b, b, r, c, n, alpha, c_in, beta)
                    put_pair(out, r, c, n, v0, v1)
                if r + 8 < m:
                    b = bias[r + 8] if has_bias else _ZERO
                    v0, v1 = finish(a2, a3, b, b, r + 8, c, n, alpha, c_in, beta)
                    put_pair(out, r + 8, c, n, v0, v1)
    else:
        @inline_device
        def store_n8(a0, a1, a2, a3, out, r, c, m, n, alpha, bias, c_in, beta):
            """One n8 block of a lane: columns (c, c + 1) of rows r and r + 8."""
            if c < n:
                b0, b1 = load_bias(bias, c, n)
                if r < m:
                    v0, v1 = finish(a0, a1, b0, b1, r, c, n, alpha, c_in, beta)
                    put_pair(out, r, c, n, v0, v1)
                if r + 8 < m:
                    v0, v1 = finish(a2, a3, b0, b1, r + 8, c, n, alpha, c_in, beta)
                    put_pair(out, r + 8, c, n, v0, v1)

    if _plain(activation, has_bias, has_c):
        @inline_device
        def store(acc, out, row0, col0, m, n, alpha, bias, c_in, beta, lane):
            r0 = row0 + lane // 4
            c0 = col0 + 2 * (lane % 4)
            for i in range(mi):
                for j in range(ni):
                    store_n8(acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3], out,
                             r0 + 16 * i, c0 + 8 * j, m, n, alpha, bias, c_in, beta)

        return store
    return written_out(
        "store(acc, out, row0, col0, m, n, alpha, bias, c_in, beta, lane)",
        ["r0 = row0 + lane // 4", "c0 = col0 + 2 * (lane % 4)"] +
        [f"store_n8(acc[{i}, {j}, 0], acc[{i}, {j}, 1], acc[{i}, {j}, 2], acc[{i}, {j}, 3], "
         f"out, r0 + {16 * i}, c0 + {8 * j}, m, n, alpha, bias, c_in, beta)"
         for i in range(mi) for j in range(ni)],
        {"store_n8": store_n8}, f"store_accumulators {mi}x{ni}"
        + (" transposed" if transposed else ""))


@functools.cache
def store_scaled_accumulators(ni: int, out_kind: str, row_scale: bool, col_scale: bool,
                              scaled: bool = True, activation=None, bias_kind=None):
    """The epilogue of one warp's share of an m64 × (8·``ni``) wgmma accumulator with the
    scales of a scaled (FP8) GEMM: ``store(acc, out, scale_a, scale_b, bias, row0, col0, m, n,
    lane, warp)`` writes ``act(acc[i] · scale_a[r] · scale_b[c] + bias[c])`` for the warp's
    rows ``row0 + 16 · warp …`` (``acc`` float32[4·ni] in the wgmma fragment order: per n8
    block ``j``, columns ``(c, c + 1)`` of rows ``r`` and ``r + 8``); ``scale_a`` float32, one
    per row with ``row_scale`` (else ``scale_a[0]``), ``scale_b`` one per column with
    ``col_scale`` (else ``scale_b[0]``); ``out`` (M, N) float32 or uint16 bits of ``out_kind``;
    rows past ``m`` and columns past ``n`` are skipped (their scales and bias never read).
    ``scaled=False``: the accumulators as they are (scales applied already, e.g. per k block;
    the scale arguments are not read). ``activation``: one of :data:`ACTIVATIONS`;
    ``bias_kind``: None (``bias`` not read) or the kind of the (N,) ``bias`` — float32, or
    uint16 bits of float16 / bfloat16 — added after the scales, before the activation, in
    float32 (``torch._scaled_mm``'s order). Written out with constant accumulator indices, so
    the accumulators stay in registers (a loop that does not unroll puts them in local
    memory, and ptxas then serialises the wgmmas that write them). A 16-bit pair whose address
    is 4-byte aligned is stored at once."""
    put_pair = _pair_io(out_kind, True)[1]
    if bias_kind is not None and bias_kind not in OUT_KINDS:
        raise ValueError(f"bias_kind must be None or one of {OUT_KINDS}, got {bias_kind!r}")
    get_bias = _bias_pair(bias_kind)
    act = activation_fn(activation)
    HAS_BIAS = bias_kind is not None

    @inline_device
    def biased(v, d):
        return v + d if HAS_BIAS else v     # (no + 0.0 without a bias: -0 stays -0)
    COLS = bool(col_scale) and scaled
    first_scale, row_scale_at = _scale_readers(scaled, row_scale)

    @inline_device
    def store_n8(a0, a1, a2, a3, out, r, c, sa0, sa1, scale_b, sb, bias, m, n):
        if c < n:
            b0 = scale_b[c] if COLS else sb
            b1 = (scale_b[c + 1] if c + 1 < n else sb) if COLS else sb
            d0, d1 = get_bias(bias, c, n)
            if r < m:
                put_pair(out, r, c, n, act(biased(a0 * sa0 * b0, d0)),
                         act(biased(a1 * sa0 * b1, d1)))
            if r + 8 < m:
                put_pair(out, r + 8, c, n, act(biased(a2 * sa1 * b0, d0)),
                         act(biased(a3 * sa1 * b1, d1)))

    return written_out(
        "store(acc, out, scale_a, scale_b, bias, row0, col0, m, n, lane, warp)",
        ["r0 = row0 + 16 * warp + lane // 4", "c0 = col0 + 2 * (lane % 4)",
         "sa0 = row_scale_at(scale_a, r0, m)", "sa1 = row_scale_at(scale_a, r0 + 8, m)",
         "sb = first_scale(scale_b)"] +
        [f"store_n8(acc[{4 * j}], acc[{4 * j + 1}], acc[{4 * j + 2}], acc[{4 * j + 3}], out, "
         f"r0, c0 + {8 * j}, sa0, sa1, scale_b, sb, bias, m, n)" for j in range(ni)],
        {"store_n8": store_n8, "row_scale_at": row_scale_at, "first_scale": first_scale},
        f"store_scaled_accumulators {ni}")


@functools.cache
def _scale_readers(scaled: bool, row_scale: bool):
    """``(first_scale(scale), row_scale_at(scale_a, r, m))`` of a scaled GEMM's epilogue:
    ``scale[0]`` (1.0 unless ``scaled``: the scales are not read), and row ``r``'s scale
    (clamped below ``m``; ``scale_a[0]`` without ``row_scale``)."""
    SCALED = bool(scaled)
    ROWS = bool(row_scale) and SCALED

    @inline_device
    def first_scale(scale):
        return scale[0] if SCALED else _ONE

    @inline_device
    def row_scale_at(scale_a, r, m):
        return scale_a[min(r, m - 1)] if ROWS else first_scale(scale_a)

    return first_scale, row_scale_at


@functools.cache
def _bias_pair(bias_kind):
    """``get(bias, c, n) -> (b0, b1)``: float32 values of a 1-D bias at columns ``c`` and
    ``c + 1`` (the second zero past ``n``) — float32, or uint16 bits of float16 / bfloat16;
    zeros without a bias (``bias_kind`` None: not read)."""
    if bias_kind is None:
        @inline_device
        def get(bias, c, n):
            return _ZERO, _ZERO
    elif bias_kind == "float32":
        @inline_device
        def get(bias, c, n):
            b1 = bias[c + 1] if c + 1 < n else _ZERO
            return bias[c], b1
    else:
        unpack = unpack_f16x2_f32 if bias_kind == "float16" else unpack_bf16x2_f32

        @inline_device
        def get(bias, c, n):
            word = np.uint32(bias[c])
            if c + 1 < n:
                word = word | (np.uint32(bias[c + 1]) << np.uint32(16))
            return unpack(word)
    return get


@functools.cache
def accumulate_scaled(ni: int):
    """``add(acc, part, f0, f1)``: ``acc[i] += part[i] · f`` over one warp's share of an m64 ×
    (8·``ni``) wgmma accumulator (both float32[4·ni], the wgmma fragment order), ``f0`` for the
    lane's rows ``r`` and ``f1`` for ``r + 8`` — the promotion of a block-scaled GEMM's partial
    product (one k block, its scales ``f``) into the float32 sum. Written out with constant
    indices (the arrays stay in registers)."""
    return written_out(
        "add(acc, part, f0, f1)",
        [f"acc[{4 * j + q}] += part[{4 * j + q}] * f{q // 2}"
         for j in range(ni) for q in range(4)], {}, f"accumulate_scaled {ni}")


def _plain(activation, has_bias: bool, has_c: bool) -> bool:
    """Whether an epilogue is small enough to stay a loop. With a bias, ``c`` or an
    activation, the loop body over the (mi × ni) n8 blocks is large enough that LLVM stops
    unrolling it, and the accumulators, indexed by loop counters, then live in local memory
    (the TMA GEMM with bias + GELU, offline sm_90a; bench/NOTES.md: epilogue accumulators in
    local memory), so those epilogues are written out with constant indices
    (:func:`_written_out`). A plain epilogue unrolls by itself, and writing it out made ptxas
    spill in the staged epilogue at the 168-register bound, so it stays a loop."""
    return activation is None and not has_bias and not has_c


# ---- the shared-memory-staged epilogue of a wgmma warpgroup ------------------------------------

_U15 = np.uint64(15)
_U0 = np.uint64(0)
STAGED_THREADS = 128   # a warpgroup


def _staging_geometry(ni: int, out_kind: str):
    """(passes, n8 blocks per pass, bytes per element, row pitch in bytes) of the staged tile.

    16-bit outputs stage all ``ni·8`` columns at once, rows padded by 16 bytes (a row's pitch is
    4 banks off a multiple of 128 bytes: the 8 rows × 4 lanes of one 4-byte fragment store hit
    32 different banks). float32 stages half the columns per pass (the same bytes per row),
    rows padded by 32 bytes (8 banks: the 8-byte stores of a half-warp hit 32 banks). That
    bank arithmetic holds for ``ni`` a multiple of 8; other even ``ni`` (e.g. an attention
    head dim of 96) stage correctly with some bank conflicts."""
    if out_kind not in OUT_KINDS:
        raise ValueError(f"out_kind must be one of {OUT_KINDS}, got {out_kind!r}")
    if ni % 2 or ni <= 0:
        raise ValueError(f"the staged epilogue needs ni (n8 blocks) even and positive, got "
                         f"{ni}")
    if out_kind == "float32":
        return 2, ni // 2, 4, ni * 16 + 32
    return 1, ni, 2, ni * 16 + 16


def staged_bytes(mw: int, ni: int) -> int:
    """Shared-memory bytes :func:`store_accumulators_smem` stages through for one warpgroup of
    ``mw`` m64 accumulators × ``ni`` n8 blocks, for every output kind (16-byte multiple)."""
    return 64 * mw * max(_staging_geometry(ni, k)[3] for k in OUT_KINDS)


@functools.cache
def store_accumulators_smem(mw: int, ni: int, out_kind: str, activation=None, has_bias=False,
                            has_c=False, bias_in_smem=False):
    """The epilogue of one warpgroup's wgmma accumulators, staged through shared memory.

    Returns ``store(acc0, acc1, stage, out, row0, col0, m, n, alpha, bias, c_in, beta, thread,
    bar)``, called by all 128 threads of a warpgroup. ``acc0`` (and, with ``mw == 2``,
    ``acc1``: rows 64 … 127; ignored otherwise) is an ``m64n{8·ni}`` wgmma accumulator, flat:
    ``acc[4j + q]`` is register q of n8 block j of the mma.sync C fragment of the thread's warp
    (rows 16·warp … +15; see :mod:`tilepy.ptx.wgmma_layout`). The result tile is
    ``out[row0 : row0 + 64·mw, col0 : col0 + 8·ni]``, elements outside (m, n) skipped, with the
    same math as :func:`store_accumulators` (its helpers).

    ``bias_in_smem``: ``bias`` is not the float32 array but the tile's bias already in shared
    memory: ``bias`` is the shared address of the float32 bias of column ``col0`` (8-byte
    aligned: columns are read in pairs; those past ``n`` are never used) — a shared load
    instead of a global one on the epilogue's critical path.

    ``stage`` is the uint32 shared address of :func:`staged_bytes` bytes (16-byte aligned) that
    only this warpgroup uses during the call; ``thread`` the caller's index in the warpgroup
    (0 … 127); ``bar`` a named barrier id (1 … 15) reserved for this warpgroup's 128 threads.

    Per pass: a named barrier (the buffer's readers of the previous pass or call are done), each
    thread writes its fragments' results, cast, to the padded shared tile (4-byte stores of
    16-bit pairs, 8-byte stores of float32 pairs), a named barrier, then each thread copies
    16-byte vectors of consecutive columns (8 halves / 4 floats), consecutive threads along a
    row, to global memory — whole 32-byte sectors per row. A vector that reaches past ``n``, or
    whose global address is not 16-byte aligned (row stride or base pointer), is written
    element by element. 16-bit outputs take one pass; float32 two (half the columns each).
    """
    passes, jp, eb, pitch = _staging_geometry(ni, out_kind)
    wide = out_kind == "float32"
    rows = 64 * mw
    per = 16 // eb                  # elements per 16-byte vector
    vpr = jp * 8 // per             # vectors per staged row
    iters = rows * vpr // STAGED_THREADS
    two = mw == 2
    pack = _pair_io(out_kind)[2]
    load_bias, finish = _pair_math(out_kind, activation, has_bias, has_c)
    if bias_in_smem and has_bias:
        @inline_device
        def load_bias(bias, c, n):  # noqa: F811 - the shared-memory variant
            return VEC.ld_shared_v2_f32(bias)   # write() passes the pair's own address

    @inline_device
    def write_pair(a0, a1, b0, b1, rl, c, jj, stage, row0, m, n, alpha, c_in, beta, t):
        r = row0 + rl
        v0 = _ZERO
        v1 = _ZERO
        if r < m and c < n:
            v0, v1 = finish(a0, a1, b0, b1, r, c, n, alpha, c_in, beta)
        addr = stage + rl * pitch + (jj * 8 + 2 * t) * eb
        if wide:
            VEC.st_shared_v2_f32(addr, v0, v1)
        else:
            VEC.st_shared_b32(addr, pack(v0, v1))

    @inline_device
    def write_n8(a0, a1, a2, a3, jj, c, rl, stage, row0, m, n, alpha, bias, c_in, beta, t):
        b0 = _ZERO
        b1 = _ZERO
        if c < n:
            b0, b1 = load_bias(bias, c, n)
        write_pair(a0, a1, b0, b1, rl, c, jj, stage, row0, m, n, alpha, c_in, beta, t)
        write_pair(a2, a3, b0, b1, rl + 8, c, jj, stage, row0, m, n, alpha, c_in, beta, t)

    def make_write(j0):
        if _plain(activation, has_bias, has_c):
            # a plain loop: it unrolls by itself, and restructured through write_n8 it made
            # ptxas spill at the 168-register bound
            @inline_device
            def write(acc, r_base, stage, row0, col0, m, n, alpha, bias, c_in, beta, g, t):
                for jj in range(jp):
                    j = j0 + jj
                    c = col0 + j * 8 + 2 * t
                    b0 = _ZERO
                    b1 = _ZERO
                    if c < n:
                        b0, b1 = load_bias(bias, c, n)
                    for h in range(2):
                        rl = r_base + g + 8 * h
                        r = row0 + rl
                        v0 = _ZERO
                        v1 = _ZERO
                        if r < m and c < n:
                            v0, v1 = finish(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1], b0, b1,
                                            r, c, n, alpha, c_in, beta)
                        addr = stage + rl * pitch + (jj * 8 + 2 * t) * eb
                        if wide:
                            VEC.st_shared_v2_f32(addr, v0, v1)
                        else:
                            VEC.st_shared_b32(addr, pack(v0, v1))

            return write
        # written out with constant accumulator indices (see _plain)
        return written_out(
            "write(acc, r_base, stage, row0, col0, m, n, alpha, bias, c_in, beta, g, t)",
            ["rl = r_base + g", "c0 = col0 + 2 * t"]
            + (["bt = bias + 8 * t"] if bias_in_smem and has_bias else ["bt = bias"]) +
            [f"write_n8(acc[{4 * j}], acc[{4 * j + 1}], acc[{4 * j + 2}], acc[{4 * j + 3}], "
             f"{j - j0}, c0 + {8 * j}, rl, stage, row0, m, n, alpha, "
             + (f"bt + {32 * j}" if bias_in_smem and has_bias else "bt")
             + ", c_in, beta, t)"
             for j in range(j0, j0 + jp)],
            {"write_n8": write_n8}, f"store_accumulators_smem write {j0}")

    @inline_device
    def put_word(out, r, e, n, w):
        if wide:
            if e < n:
                out[r, e] = w
        else:
            if e < n:
                out[r, e] = w & 0xFFFF
            if e + 1 < n:
                out[r, e + 1] = w >> 16

    def make_copy(c_off):
        step = 1 if wide else 2     # columns per 4-byte word

        @inline_device
        def copy(stage, out, row0, col0, m, n, thread, vec_ok):
            for it in range(iters):
                idx = it * STAGED_THREADS + thread
                rl = idx // vpr
                v = idx - rl * vpr
                r = row0 + rl
                c = col0 + c_off + v * per
                if r < m and c < n:
                    addr = stage + rl * pitch + v * 16
                    if wide:
                        w0, w1, w2, w3 = VEC.ld_shared_v4_f32(addr)
                    else:
                        w0, w1, w2, w3 = VEC.ld_shared_v4_b32(addr)
                    whole = vec_ok and c + per <= n
                    ga = _U0
                    if whole:
                        ga = global_addr(out, (r, c))
                        whole = (ga & _U15) == _U0
                    if whole:
                        if wide:
                            VEC.st_global_v4_f32(ga, w0, w1, w2, w3)
                        else:
                            VEC.st_global_v4_b32(ga, w0, w1, w2, w3)
                    else:
                        put_word(out, r, c, n, w0)
                        put_word(out, r, c + step, n, w1)
                        put_word(out, r, c + 2 * step, n, w2)
                        put_word(out, r, c + 3 * step, n, w3)

        return copy

    write0, copy0 = make_write(0), make_copy(0)
    write1, copy1 = make_write(jp), make_copy(jp * 8)

    @inline_device
    def store(acc0, acc1, stage, out, row0, col0, m, n, alpha, bias, c_in, beta, thread, bar):
        warp = thread // 32
        lane = thread % 32
        g = lane // 4
        t = lane % 4
        vec_ok = out.strides[1] == eb
        BAR.bar_sync(bar, STAGED_THREADS)
        write0(acc0, warp * 16, stage, row0, col0, m, n, alpha, bias, c_in, beta, g, t)
        if two:
            write0(acc1, 64 + warp * 16, stage, row0, col0, m, n, alpha, bias, c_in, beta, g, t)
        BAR.bar_sync(bar, STAGED_THREADS)
        copy0(stage, out, row0, col0, m, n, thread, vec_ok)
        if passes == 2:
            BAR.bar_sync(bar, STAGED_THREADS)
            write1(acc0, warp * 16, stage, row0, col0, m, n, alpha, bias, c_in, beta, g, t)
            if two:
                write1(acc1, 64 + warp * 16, stage, row0, col0, m, n, alpha, bias, c_in, beta,
                       g, t)
            BAR.bar_sync(bar, STAGED_THREADS)
            copy1(stage, out, row0, col0, m, n, thread, vec_ok)

    return store


# ---- the epilogue staged for TMA stores --------------------------------------------------------

#: bytes of one box of the swizzled staging: 64 rows × 64 16-bit columns (128-byte rows)
SWIZZLED_BOX_BYTES = 8192


@inline_device
def swizzled_pair_offset(jj, rl, g, t):
    """Byte offset, in the swizzled staging of :func:`stage_accumulators_swizzled`, of the
    16-bit column pair ``t`` (0 … 3) of n8 block ``jj`` in local row ``rl``; ``g`` is
    ``rl % 8`` (a fragment's ``lane // 4``), the row's swizzle."""
    return (jj // 8) * SWIZZLED_BOX_BYTES + rl * 128 + (((jj % 8) ^ g) * 16) + 4 * t


#: The written-out stagings' per-thread values: ``t`` (the lane's column pair), ``r`` (its
#: first row), and for its ``stmatrix.x4`` address the matrix ``q = lane // 8`` (bit 0: rows
#: 8–15, bit 1: the second n8 block), its row ``rs`` (whose 128-byte swizzle is ``rs``), the
#: local row ``rl`` and ``second``.
_SWIZZLED_LANES = ("lane = thread % 32", "g = lane // 4", "t = lane % 4",
                   "r = row0 + (thread // 32) * 16 + g", "q = lane // 8", "rs = lane % 8",
                   "rl = (thread // 32) * 16 + rs + 8 * (q % 2)", "second = q // 2")


def _swizzled_pass(ni: int, out_kind: str, first: int, count) -> int:
    """The n8 blocks a swizzled staging pass takes (``count``, default all from ``first``),
    checked: 16-bit outputs, whole boxes of 8 n8 blocks within ``ni``."""
    if out_kind not in ("float16", "bfloat16"):
        raise ValueError(f"the swizzled staging holds 16-bit outputs, got {out_kind!r}")
    if ni % 8:
        raise ValueError(f"ni (n8 blocks) must be a multiple of 8 (whole boxes), got {ni}")
    count = ni - first if count is None else count
    if first % 8 or count % 8 or count <= 0 or first + count > ni:
        raise ValueError(f"first {first} and count {count}: whole boxes of 8 n8 blocks "
                         f"within {ni}")
    return count


@functools.cache
def stage_accumulators_swizzled(ni: int, out_kind: str, activation=None, has_bias=False,
                                has_c=False, first: int = 0, count: int | None = None):
    """One warpgroup's m64n{8·ni} wgmma accumulator, finished (``act(alpha · acc + bias +
    beta · c)``, the math of :func:`store_accumulators`) and cast to 16 bits, into shared
    memory laid out as TMA stores read it with the 128-byte swizzle.

    Returns ``write(acc, stage, row0, col0, m, n, alpha, bias, c_in, beta, thread)``, called by
    all 128 threads of the warpgroup (``thread`` 0 … 127). ``acc`` is flat as in
    :func:`store_accumulators_smem`; the tile is ``out[row0 : row0 + 64, col0 : col0 + 8·ni]``.
    ``stage`` (uint32 shared address, 1024-byte aligned) receives ``ni / 8`` boxes of 64 rows ×
    64 columns, box ``b`` (columns ``64·b …``) at ``stage + 8192·b``, row ``r`` of a box at
    ``+ 128·r`` with its 16-byte granules permuted by ``granule ^ (r % 8)`` — what
    ``cp.async.bulk.tensor`` stores from under a map with the 128-byte swizzle and a
    64 × 64 box. Elements outside (m, n) are not finished (a TMA store drops them); ``c``
    and the bias are read only inside. Each warp writes two n8 blocks of its 16 rows per
    ``stmatrix.x4`` (the accumulator's n8 block is the mma fragment layout stmatrix takes):
    16 instructions for 256 columns where 4-byte stores took 64, and each 16-byte row lands
    in its own granule (the swizzle spreads a matrix's 8 rows over 8 granules: no bank
    conflicts). cuBLAS's epilogue does the same (STSM in Nsight Compute; bench/NOTES.md:
    Nsight Compute against cuBLAS).

    ``first``, ``count``: only n8 blocks ``first … first + count − 1`` (default: all from
    ``first``; ``first`` a multiple of 8), staged from ``stage`` on as boxes ``0, 1, …`` — one
    pass of a tile staged in parts.

    The caller brackets it: the previous TMA store from ``stage`` has read it
    (``bulk_wait_group_read``) and a barrier before; ``fence_proxy_async_shared`` and a barrier
    after, then one thread issues the stores. 16-bit outputs only.
    """
    count = _swizzled_pass(ni, out_kind, first, count)
    pack = _pair_io(out_kind)[2]
    load_bias, finish = _pair_math(out_kind, activation, has_bias, has_c)
    plain = _plain(activation, has_bias, has_c)

    @inline_device
    def pair_value(a0, a1, b0, b1, r, c, m, n, alpha, c_in, beta):
        """The packed 16-bit pair of accumulators (a0, a1) at (r, c): finished where it lies
        inside (m, n), zeros outside (a TMA store drops them; c_in is read only inside). A
        plain epilogue (alpha · acc) needs no test: outside, TMA's zero-filled operands made
        the accumulators zero, and the store drops them anyway."""
        if plain:
            return pack(alpha * a0, alpha * a1)
        v0 = _ZERO
        v1 = _ZERO
        if r < m and c < n:
            v0, v1 = finish(a0, a1, b0, b1, r, c, n, alpha, c_in, beta)
        return pack(v0, v1)

    @inline_device
    def n8_values(a0, a1, a2, a3, c, r, m, n, alpha, bias, c_in, beta):
        """The packed rows r and r + 8 of one n8 block (columns c, c + 1 of this lane)."""
        b0 = _ZERO
        b1 = _ZERO
        if has_bias and c < n:
            b0, b1 = load_bias(bias, c, n)
        return (pair_value(a0, a1, b0, b1, r, c, m, n, alpha, c_in, beta),
                pair_value(a2, a3, b0, b1, r + 8, c, m, n, alpha, c_in, beta))

    @inline_device
    def write(acc, stage, row0, col0, m, n, alpha, bias, c_in, beta, thread):
        lane = thread % 32
        g = lane // 4
        t = lane % 4
        r = row0 + (thread // 32) * 16 + g
        # the row this lane addresses: matrix q = lane // 8 (bit 0: rows 8–15, bit 1: the
        # second n8 block), row lane % 8 of it, whose 128-byte swizzle is lane % 8
        q = lane // 8
        rs = lane % 8
        rl = (thread // 32) * 16 + rs + 8 * (q % 2)
        second = q // 2
        for jj in range(0, count, 2):
            j = first + jj
            addr = swizzled_pair_offset(jj + second, rl, rs, 0)
            r0, r1 = n8_values(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3],
                               col0 + 8 * j + 2 * t, r, m, n, alpha, bias, c_in, beta)
            r2, r3 = n8_values(acc[4 * j + 4], acc[4 * j + 5], acc[4 * j + 6], acc[4 * j + 7],
                               col0 + 8 * j + 8 + 2 * t, r, m, n, alpha, bias, c_in, beta)
            stmatrix_x4(stage + addr, r0, r1, r2, r3)

    if plain:
        return write
    # written out with constant accumulator indices (see _plain)
    body = list(_SWIZZLED_LANES)
    for jj in range(0, count, 2):
        j = first + jj
        body += [f"addr = swizzled_pair_offset({jj} + second, rl, rs, 0)",
                 f"r0, r1 = n8_values(acc[{4 * j}], acc[{4 * j + 1}], acc[{4 * j + 2}], "
                 f"acc[{4 * j + 3}], col0 + {8 * j} + 2 * t, r, m, n, alpha, bias, c_in, beta)",
                 f"r2, r3 = n8_values(acc[{4 * j + 4}], acc[{4 * j + 5}], acc[{4 * j + 6}], "
                 f"acc[{4 * j + 7}], col0 + {8 * j + 8} + 2 * t, r, m, n, alpha, bias, c_in, "
                 "beta)",
                 "stmatrix_x4(stage + addr, r0, r1, r2, r3)"]
    return written_out(
        "write(acc, stage, row0, col0, m, n, alpha, bias, c_in, beta, thread)", body,
        {"n8_values": n8_values, "stmatrix_x4": stmatrix_x4,
         "swizzled_pair_offset": swizzled_pair_offset},
        "stage_accumulators_swizzled write")


@functools.cache
def stage_scaled_accumulators_swizzled(ni: int, out_kind: str, row_scale: bool,
                                       col_scale: bool, scaled: bool = True, activation=None,
                                       bias_kind=None, first: int = 0,
                                       count: int | None = None):
    """The scaled GEMM's epilogue math (:func:`store_scaled_accumulators`:
    ``act(acc · scale_a[r] · scale_b[c] + bias[c])``, the same arguments and reads) on one
    warpgroup's m64n{8·ni} accumulator, cast to 16 bits and staged as
    :func:`stage_accumulators_swizzled` stages (128-byte-swizzled boxes of 64 × 64 for a TMA
    store, ``stmatrix.x4``, the same ``first`` / ``count`` passes and the same bracketing by
    the caller).

    Returns ``write(acc, stage, row0, col0, m, n, scale_a, scale_b, bias, thread)`` for the
    warpgroup's 128 threads (``thread`` 0 … 127), tile ``out[row0 : row0 + 64, col0 : col0 +
    8·ni]``. Each 64-column box's column scales and bias are loaded before its first
    ``stmatrix`` (whose inline assembly orders memory: loads between them would each wait
    their latency out); scales and bias are read only inside (m, n), elements outside are
    staged unscaled (TMA drops them). Written out with constant accumulator indices."""
    count = _swizzled_pass(ni, out_kind, first, count)
    if bias_kind is not None and bias_kind not in OUT_KINDS:
        raise ValueError(f"bias_kind must be None or one of {OUT_KINDS}, got {bias_kind!r}")
    pack = _pair_io(out_kind)[2]
    get_bias = _bias_pair(bias_kind)
    act = activation_fn(activation)
    HAS_BIAS = bias_kind is not None
    COLS = bool(col_scale) and scaled
    first_scale, row_scale_at = _scale_readers(scaled, row_scale)

    @inline_device
    def column_factors(scale_b, bias, c, n, sb):
        """(scale, scale, bias, bias) of columns c and c + 1 (sb / zeros past n)."""
        b0 = sb
        b1 = sb
        d0 = _ZERO
        d1 = _ZERO
        if c < n:
            if COLS:
                b0 = scale_b[c]
                if c + 1 < n:
                    b1 = scale_b[c + 1]
            if HAS_BIAS:
                d0, d1 = get_bias(bias, c, n)
        return b0, b1, d0, d1

    @inline_device
    def value(a, sa, sb, d):
        # store_scaled_accumulators' order of operations (the same bits)
        return act(a * sa * sb + d) if HAS_BIAS else act(a * sa * sb)   # (-0 stays -0)

    body = list(_SWIZZLED_LANES) + ["sa0 = row_scale_at(scale_a, r, m)",
                                    "sa1 = row_scale_at(scale_a, r + 8, m)",
                                    "sb = first_scale(scale_b)"]
    for jj in range(0, count, 2):
        if (COLS or HAS_BIAS) and jj % 8 == 0:
            # a 64-column box's factors at a time: fewer live registers than the pass's
            for j in range(first + jj, first + jj + 8):
                body.append(f"b{j}_0, b{j}_1, d{j}_0, d{j}_1 = column_factors(scale_b, bias, "
                            f"col0 + {8 * j} + 2 * t, n, sb)")
        words = []
        for j in (first + jj, first + jj + 1):
            s0, s1 = (f"b{j}_0", f"b{j}_1") if COLS or HAS_BIAS else ("sb", "sb")
            d0, d1 = (f"d{j}_0", f"d{j}_1") if COLS or HAS_BIAS else ("_ZERO", "_ZERO")
            for rq, sa in ((0, "sa0"), (2, "sa1")):
                words.append(f"pack(value(acc[{4 * j + rq}], {sa}, {s0}, {d0}), "
                             f"value(acc[{4 * j + rq + 1}], {sa}, {s1}, {d1}))")
        body += [f"addr = swizzled_pair_offset({jj} + second, rl, rs, 0)",
                 f"stmatrix_x4(stage + addr, {', '.join(words)})"]
    return written_out(
        "write(acc, stage, row0, col0, m, n, scale_a, scale_b, bias, thread)", body,
        {"row_scale_at": row_scale_at, "first_scale": first_scale,
         "column_factors": column_factors, "value": value, "pack": pack,
         "stmatrix_x4": stmatrix_x4, "swizzled_pair_offset": swizzled_pair_offset,
         "_ZERO": _ZERO}, f"stage_scaled_accumulators_swizzled {ni} {first}")


@inline_device
def staging_acquire(tw, bar):
    """Before a warpgroup writes its TMA-store staging (:func:`stage_accumulators_swizzled`):
    its thread ``tw == 0``, which issued the previous stores from it, waits until they have
    read it, then the warpgroup meets at named barrier ``bar`` (128 threads)."""
    if tw == 0:
        T.bulk_wait_group_read(0)
    BAR.bar_sync(bar, 128)


@inline_device
def staging_store(omap, stg, x0, row0, z, n, boxes, tw, bar, batched):
    """After a warpgroup staged ``boxes`` 64 × 64 boxes at ``stg`` (8192 bytes apart) for
    ``out[z, row0 : row0 + 64, x0 : x0 + 64·boxes]``: every thread's shared-memory writes are
    made visible to the async proxy and the warpgroup meets at ``bar``; then thread ``tw ==
    0`` stores the boxes that start below column ``n`` with TMA through the map at ``omap``
    (2-D, or 3-D with the batch ``z`` outermost where ``batched``) as one bulk group, which
    drains while the warpgroup goes on. Before its block exits, that thread waits for the
    group's reads (``T.bulk_wait_group_read(0)``)."""
    FN.fence_proxy_async_shared()
    BAR.bar_sync(bar, 128)
    if tw == 0:
        for bx in range(boxes):
            x = x0 + 64 * bx
            if x < n:
                if batched:
                    T.tma_store_3d(omap, stg + bx * SWIZZLED_BOX_BYTES, x, row0, z)
                else:
                    T.tma_store_2d(omap, stg + bx * SWIZZLED_BOX_BYTES, x, row0)
        T.bulk_commit_group()
