"""Row reductions (tilepy.tile.reduce): quad, warp, block, and accumulator-fragment rows.

Kernels fill their inputs through the m16n8 accumulator layout written out here (lane 4g + t
holds rows g and g + 8, columns 2t and 2t + 1 of each n8 tile) and compare with float64 NumPy:
max bit-exact (NaN anywhere in a row makes the row NaN; -inf rows stay -inf), sums within the
rounding bound of float32 summation. Every test runs once in the simulator (``sim``) and once
on hardware (``gpu``); the layer not available here is skipped.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from numba import cuda

from tilepy.tile.reduce import (IDENTITY, block_row_reduce, combine, fragment_row_reduce,
                                quad_row_reduce, warp_reduce)

TARGETS = [pytest.param("sim", marks=pytest.mark.sim, id="sim"),
           pytest.param("gpu", marks=pytest.mark.gpu, id="gpu")]

U = 2.0 ** -24  # float32 unit roundoff


def launch(kernel, threads, *arrays):
    """Run ``kernel[1, threads]`` on device copies of ``arrays``; return them copied back."""
    dev = [cuda.to_device(np.ascontiguousarray(a)) for a in arrays]
    kernel[1, threads](*dev)
    cuda.synchronize()
    return [d.copy_to_host() for d in dev]


def bits_equal(got, want):
    """Equal as float32 values, NaN equal to NaN (any payload), -inf to -inf."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    return got.shape == want.shape and bool(
        np.all((got == want) | (np.isnan(got) & np.isnan(want))))


def assert_sum_close(got, want, abs_terms, n_terms):
    """|got - want| within float32 summation's bound n·u·Σ|x| (exact reference in float64)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), "NaN pattern differs"
    # Past float32's range the float32 sum is ±inf (the partial sums overflow first).
    want = np.where(np.abs(want) > np.finfo(np.float32).max, np.sign(want) * np.inf, want)
    inf = np.isinf(want)
    assert (got[inf] == want[inf]).all()
    ok = ~nan & ~inf
    bound = n_terms * U * np.asarray(abs_terms, np.float64) + 1e-30
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want)
    assert (err[ok] <= np.broadcast_to(bound, want.shape)[ok]).all(), err[ok].max()


# ---- combine: the NaN rule --------------------------------------------------------------------

@functools.cache
def combine_kernel():
    mx, add = combine("max"), combine("sum")

    @cuda.jit
    def k(a, b, out):
        for n in range(a.shape[0]):
            out[0, n] = mx(a[n], b[n])
            out[1, n] = add(a[n], b[n])

    return k


@pytest.mark.parametrize("target", TARGETS)
def test_max_lets_nan_win_from_either_side(target):
    nan, inf = np.nan, np.inf
    pairs = [(nan, 1.0), (1.0, nan), (nan, -inf), (-inf, nan), (nan, inf), (inf, nan),
             (nan, nan), (-inf, -inf), (1.0, 2.0), (2.0, 1.0), (-3.0, -inf), (-inf, -3.0),
             (inf, 5.0), (0.5, 0.5)]
    a = np.array([p[0] for p in pairs], np.float32)
    b = np.array([p[1] for p in pairs], np.float32)
    (_, _, out) = launch(combine_kernel(), 1, a, b, np.zeros((2, len(pairs)), np.float32))
    want_max = np.where(np.isnan(a) | np.isnan(b), np.nan, np.maximum(a, b))
    assert bits_equal(out[0], want_max), list(zip(pairs, out[0]))
    assert bits_equal(out[1], a + b)
    # Why the comparison is written out: Python's max keeps whichever NaN comes first.
    assert not np.isnan(max(np.float32(1), np.float32(nan)))


def test_identities_and_argument_errors():
    assert IDENTITY["max"] == -np.inf and IDENTITY["max"].dtype == np.float32
    assert IDENTITY["sum"] == 0 and IDENTITY["sum"].dtype == np.float32
    with pytest.raises(ValueError, match=r"quad_row_reduce: op must be one of \('max', 'sum'\)"):
        quad_row_reduce("min")
    with pytest.raises(ValueError, match="warp_reduce: op"):
        warp_reduce("prod")
    with pytest.raises(ValueError, match=r"warps must be an integer 1 … 32, got 33"):
        block_row_reduce("max", 33)
    with pytest.raises(ValueError, match="block_row_reduce: warps"):
        block_row_reduce("sum", 0)
    with pytest.raises(ValueError, match="fragment_row_reduce: ni must be an integer >= 1"):
        fragment_row_reduce("max", 1, 0)
    with pytest.raises(ValueError, match="fragment_row_reduce: mi"):
        fragment_row_reduce("sum", 1.5, 2)
    with pytest.raises(ValueError, match="chains must be 1 or 2"):
        fragment_row_reduce("max", 1, 2, chains=3)
    assert fragment_row_reduce("max", 2, 4) is fragment_row_reduce("max", 2, 4)  # cached


# ---- quad and warp ------------------------------------------------------------------------------

@functools.cache
def quad_warp_kernel():
    qmax, qsum = quad_row_reduce("max"), quad_row_reduce("sum")
    wmax, wsum = warp_reduce("max"), warp_reduce("sum")

    @cuda.jit
    def k(vals, out):
        t = cuda.threadIdx.x
        for s in range(vals.shape[0]):
            v = vals[s, t]
            out[s, 0, t] = qmax(v)
            out[s, 1, t] = qsum(v)
            out[s, 2, t] = wmax(v)
            out[s, 3, t] = wsum(v)

    return k


def quad_warp_inputs(seed=0):
    rng = np.random.default_rng(seed)
    finite = (rng.standard_normal(64) * 10).astype(np.float32)
    finite[12:16] = -np.inf  # a quad of -inf: max -inf, sum -inf
    finite[40] = -np.inf  # one -inf in a quad: max ignores it
    with_nan = (rng.standard_normal(64)).astype(np.float32)
    with_nan[5] = np.nan  # warp 0, quad 1, second lane
    with_nan[32] = np.nan  # warp 1, lane 0 (first lane of the first quad)
    with_nan[63] = np.nan  # warp 1, last lane
    with_nan[20:24] = -np.inf
    return np.stack([finite, with_nan])


@pytest.mark.parametrize("target", TARGETS)
def test_quad_and_warp_reduce_two_warps(target):
    vals = quad_warp_inputs()
    (_, out) = launch(quad_warp_kernel(), 64, vals, np.zeros((2, 4, 64), np.float32))
    v64 = vals.astype(np.float64)
    quads = v64.reshape(2, 16, 4)
    warps = v64.reshape(2, 2, 32)
    want_qmax = np.repeat(quads.max(axis=2), 4, axis=1)  # np.max propagates NaN
    want_wmax = np.repeat(warps.max(axis=2), 32, axis=1)
    assert bits_equal(out[:, 0], want_qmax)
    assert bits_equal(out[:, 2], want_wmax)
    assert_sum_close(out[:, 1], np.repeat(quads.sum(axis=2), 4, axis=1),
                     np.repeat(np.abs(quads).sum(axis=2), 4, axis=1), 2)
    assert_sum_close(out[:, 3], np.repeat(warps.sum(axis=2), 32, axis=1),
                     np.repeat(np.abs(warps).sum(axis=2), 32, axis=1), 5)
    # The NaN cases really were NaN, and every lane of a quad / warp holds the same bits.
    assert np.isnan(out[1, 0, 4:8]).all() and np.isnan(out[1, 2]).all()
    assert (out[0, 0, 12:16] == -np.inf).all() and (out[0, 1, 12:16] == -np.inf).all()
    for kind, size in ((0, 4), (1, 4), (2, 32), (3, 32)):
        groups = out[:, kind].reshape(2, -1, size).view(np.uint32)
        assert (groups == groups[:, :, :1]).all(), kind


# ---- block ---------------------------------------------------------------------------------------

@functools.cache
def block_kernel(warps):
    bmax, bsum = block_row_reduce("max", warps), block_row_reduce("sum", warps)

    @cuda.jit
    def k(vals, out):
        scratch = cuda.shared.array(warps, np.float32)
        t = cuda.threadIdx.x
        # Four calls back to back on one scratch: the barriers inside make the reuse safe.
        for s in range(vals.shape[0]):
            out[s, 0, t] = bmax(vals[s, t], scratch)
            out[s, 1, t] = bsum(vals[s, t], scratch)

    return k


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("warps", [2, 1])
def test_block_row_reduce(target, warps):
    n = 32 * warps
    rng = np.random.default_rng(warps)
    vals = (rng.standard_normal((2, n)) * 100).astype(np.float32)
    vals[0, 3] = 1e4  # the max lives in warp 0 ...
    vals[1, n - 15] = np.nan  # ... a NaN in the last warp only
    vals[1, 0] = 2e4
    (_, out) = launch(block_kernel(warps), n, vals, np.zeros((2, 2, n), np.float32))
    v64 = vals.astype(np.float64)
    assert bits_equal(out[:, 0], np.repeat(v64.max(axis=1, keepdims=True), n, axis=1))
    assert out[0, 0, 0] == np.float32(1e4) and np.isnan(out[1, 0]).all()
    assert_sum_close(out[0, 1], np.full(n, v64[0].sum()), np.abs(v64[0]).sum(), 5 + warps)
    assert np.isnan(out[1, 1]).all()
    flat = out.reshape(4, n).view(np.uint32)
    assert (flat == flat[:, :1]).all(), "threads disagree"


# ---- accumulator fragments ---------------------------------------------------------------------

@functools.cache
def fragment_kernel(mi, ni, chains=1, fast=True):
    """out[0] max rows, [1] sum rows, [2] max accumulated into ``init``, [3] sum, quad=False;
    the max with ``chains`` dependent chains, as max.NaN.f32 (``fast``) or compare + select."""
    row_max = fragment_row_reduce("max", mi, ni, chains=chains, fast=fast)
    row_sum = fragment_row_reduce("sum", mi, ni)
    row_max_into = fragment_row_reduce("max", mi, ni, accumulate=True, chains=chains,
                                       fast=fast)
    lane_sum = fragment_row_reduce("sum", mi, ni, quad=False)

    @cuda.jit
    def k(tile, init, out):
        lane = cuda.threadIdx.x & 31
        g = lane >> 2
        t = lane & 3
        acc = cuda.local.array((mi, ni, 4), np.float32)
        rows = cuda.local.array((mi, 2), np.float32)
        for i in range(mi):
            for j in range(ni):
                for e in range(4):
                    acc[i, j, e] = tile[16 * i + g + 8 * (e // 2), 8 * j + 2 * t + e % 2]
        row_max(acc, rows)
        for i in range(mi):
            for h in range(2):
                out[0, lane, i, h] = rows[i, h]
        row_sum(acc, rows)
        for i in range(mi):
            for h in range(2):
                out[1, lane, i, h] = rows[i, h]
                rows[i, h] = init[16 * i + g + 8 * h]
        row_max_into(acc, rows)
        for i in range(mi):
            for h in range(2):
                out[2, lane, i, h] = rows[i, h]
        lane_sum(acc, rows)
        for i in range(mi):
            for h in range(2):
                out[3, lane, i, h] = rows[i, h]

    return k


def row_index(mi):
    """(32, mi, 2) int array: the tile row a lane's ``rows[i, h]`` stands for, 16i + g + 8h."""
    g = np.arange(32) // 4
    return 16 * np.arange(mi)[None, :, None] + g[:, None, None] + 8 * np.arange(2)[None, None, :]


def lane_rows(per_row, mi):
    """(32, mi, 2): for each lane, ``per_row`` at the rows it holds."""
    return np.asarray(per_row)[row_index(mi)]


def run_fragment(mi, ni, tile, init, chains=1, fast=True):
    (_, _, out) = launch(fragment_kernel(mi, ni, chains, fast), 32, tile, init,
                         np.full((4, 32, mi, 2), 7.0, np.float32))
    return out


def check_fragment(mi, ni, tile, init, out):
    t64 = tile.astype(np.float64)
    assert bits_equal(out[0], lane_rows(t64.max(axis=1), mi))
    assert_sum_close(out[1], lane_rows(t64.sum(axis=1), mi),
                     lane_rows(np.abs(t64).sum(axis=1), mi), 2 * ni + 2)
    assert bits_equal(out[2], lane_rows(np.maximum(init.astype(np.float64), t64.max(axis=1)),
                                        mi))
    # quad=False: each lane sums only its own columns 8j + 2t and 8j + 2t + 1.
    t = np.arange(32) % 4
    cols = (8 * np.arange(ni)[None, :, None] + 2 * t[:, None, None]
            + np.arange(2)[None, None, :]).reshape(32, -1)
    part = np.stack([t64[:, cols[lane]].sum(axis=1) for lane in range(32)])  # (lane, row)
    part_abs = np.stack([np.abs(t64[:, cols[lane]]).sum(axis=1) for lane in range(32)])
    lanes = np.arange(32)[:, None, None]
    assert_sum_close(out[3], part[lanes, row_index(mi)], part_abs[lanes, row_index(mi)], 2 * ni)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mi,ni", [(1, 1), (2, 3)])
def test_fragment_rows_random(target, mi, ni):
    rng = np.random.default_rng(10 * mi + ni)
    tile = (rng.standard_normal((16 * mi, 8 * ni)) * 30).astype(np.float32)
    init = (rng.standard_normal(16 * mi) * 40).astype(np.float32)
    out = run_fragment(mi, ni, tile, init)
    check_fragment(mi, ni, tile, init, out)
    assert not np.isnan(out).any()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the 3e38 row
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("chains,fast", [(1, True), (2, True), (1, False)])
def test_fragment_rows_nan_inf_and_large(target, chains, fast):
    mi, ni = 2, 3
    rng = np.random.default_rng(3)
    tile = (rng.standard_normal((32, 8 * ni)) * 1e4).astype(np.float32)
    tile[0, 0] = np.nan  # lane 0's first value (the chain's start)
    tile[1, 11] = np.nan  # lane 5, second n8 tile, odd column
    tile[9, 6] = np.nan  # lane 7, row g + 8
    tile[20, :] = -np.inf  # a fully masked row
    tile[27, :5] = -np.inf  # a partly masked row
    tile[30, :] = 3e38  # near the float32 limit: max exact, sum overflows to inf
    init = np.zeros(32, np.float32)
    init[20] = -np.inf
    init[21] = np.nan
    out = run_fragment(mi, ni, tile, init, chains, fast)
    check_fragment(mi, ni, tile, init, out)
    by_row = {0: (0, 0, 0), 1: (4, 0, 0), 9: (4, 0, 1), 20: (16, 1, 0), 27: (12, 1, 1)}
    lane, i, h = by_row[0]
    assert np.isnan(out[:2, lane:lane + 4, i, h]).all()
    lane, i, h = by_row[20]
    assert (out[0, lane:lane + 4, i, h] == -np.inf).all()
    assert (out[2, lane:lane + 4, i, h] == -np.inf).all()
    assert np.isnan(out[2, 20:24, 1, 0]).all()  # row 21: NaN in the running value wins
    assert (out[1, 24:28, 1, 1] == np.inf).all()  # row 30: 24 × 3e38 overflows
    assert np.isfinite(out[0, 24:28, 1, 1]).all()
