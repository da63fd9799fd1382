"""The online-softmax update (tilepy.tile.online_softmax) streamed over key blocks.

A one-warp kernel loads each key block of a score matrix S (mi·16 rows × nb·ni·8 keys) into
an accumulator fragment (m16n8 layout, written out here), runs the update, rescales an output
accumulator by alpha and drops the block's p into it — an output accumulator with "V = the
identity" — and finalizes. The result must be the full softmax of ``S`` along the keys,
computed independently in float64 as ``exp2(c·(s - max)) / sum``; the running max, sum and
alpha after each block are checked against their float64 definitions too.

Tolerances follow the error analysis in the module docstring: ex2.approx is within 2**-22,
and the exponent ``s·c - m·c`` carries a rounding error of a few ulp of ``|s·c|``, so the
relative tolerance grows with the largest ``|s·c|`` (2e-6, plus 3.6e-7 per unit of it, plus
the summation's bound: see :func:`tolerance`). It holds for the simulator's twins and for
hardware (where ptxas may fuse the exponent into one FMA, which is more accurate).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from numba import cuda

from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.tile.online_softmax import exp2_fma, online_softmax_finalize, online_softmax_update

TARGETS = [pytest.param("sim", marks=pytest.mark.sim, id="sim"),
           pytest.param("gpu", marks=pytest.mark.gpu, id="gpu")]

U = 2.0 ** -24
LOG2E = 1.4426950408889634
C_HEAD64 = np.float32(LOG2E / 8.0)  # softmax scale 1/sqrt(64), in log2 units


@functools.cache
def stream_kernel(mi, ni, nb, quad_sum, threshold=None, shift=0, every=0):
    """kernel(S, scale_log2[1], out, stats): out = finalized softmax of S (mi·16 × nb·ni·8);
    stats[kb, (m, l, alpha), lane, i, h] after block kb, stats[nb, 1] = l after finalize."""
    update = online_softmax_update(mi, ni, quad_sum, rescale_threshold=threshold,
                                   p_scale_log2=shift, fma_exp_every=every)
    finalize = online_softmax_finalize(mi, nb * ni, quad_sum)
    no = nb * ni
    neg_inf = np.float32(-np.inf)
    zero = np.float32(0)

    @cuda.jit
    def k(s, scale, out, stats):
        lane = cuda.threadIdx.x & 31
        g = lane >> 2
        t = lane & 3
        acc = cuda.local.array((mi, no, 4), np.float32)
        sc = cuda.local.array((mi, ni, 4), np.float32)
        m = cuda.local.array((mi, 2), np.float32)
        lsum = cuda.local.array((mi, 2), np.float32)
        alpha = cuda.local.array((mi, 2), np.float32)
        for i in range(mi):
            for h in range(2):
                m[i, h] = neg_inf
                lsum[i, h] = zero
            for j in range(no):
                for e in range(4):
                    acc[i, j, e] = zero
        for kb in range(nb):
            for i in range(mi):
                for j in range(ni):
                    for e in range(4):
                        col = 8 * (kb * ni + j) + 2 * t + e % 2
                        sc[i, j, e] = s[16 * i + g + 8 * (e // 2), col]
            update(sc, m, lsum, alpha, scale[0])
            for i in range(mi):
                for j in range(no):
                    for e in range(4):
                        acc[i, j, e] = acc[i, j, e] * alpha[i, e // 2]
                for j in range(ni):
                    for e in range(4):
                        acc[i, kb * ni + j, e] = sc[i, j, e]
                for h in range(2):
                    stats[kb, 0, lane, i, h] = m[i, h]
                    stats[kb, 1, lane, i, h] = lsum[i, h]
                    stats[kb, 2, lane, i, h] = alpha[i, h]
        finalize(acc, lsum)
        for i in range(mi):
            for h in range(2):
                stats[nb, 1, lane, i, h] = lsum[i, h]
            for j in range(no):
                for e in range(4):
                    out[16 * i + g + 8 * (e // 2), 8 * j + 2 * t + e % 2] = acc[i, j, e]

    return k


def run_stream(s, c, mi, ni, nb, quad_sum, threshold=None, shift=0, every=0):
    kern = stream_kernel(mi, ni, nb, quad_sum, threshold, shift, every)
    args = [s, np.array([c], np.float32), np.full(s.shape, 7.0, np.float32),
            np.full((nb + 1, 3, 32, mi, 2), 7.0, np.float32)]
    dev = [cuda.to_device(np.ascontiguousarray(a)) for a in args]
    kern[1, 32](*dev)
    cuda.synchronize()
    return dev[2].copy_to_host(), dev[3].copy_to_host()


# ---- float64 reference ----------------------------------------------------------------------

def reference(s, c, nb):
    """(softmax, [(m, l, alpha) after each block]) in float64; masked rows give 0 and alpha 1."""
    s64 = s.astype(np.float64)
    c = float(np.float32(c))
    n = s.shape[1] // nb
    steps = []
    m_prev = np.full(s.shape[0], -np.inf)
    with np.errstate(invalid="ignore"):
        for kb in range(nb):
            seen = s64[:, :(kb + 1) * n]
            m = seen.max(axis=1)  # NaN propagates
            masked = m == -np.inf
            e = np.exp2((seen - m[:, None]) * c)
            lsum = np.where(masked, 0.0, e.sum(axis=1))
            alpha = np.where(masked, 1.0, np.exp2((m_prev - m) * c))
            steps.append((m, lsum, alpha))
            m_prev = m
        m, lsum, _ = steps[-1]
        p = np.exp2((s64 - m[:, None]) * c)
        soft = np.where((m == -np.inf)[:, None], 0.0, p / lsum[:, None])
    return soft, steps


def tolerance(s, c, nb, ni):
    """Relative tolerance of p, l, alpha and the softmax.

    * 2e-6 for ex2.approx (2**-22 each) on p, on alpha and, averaged, in the sum;
    * the exponent ``s·c - m·c`` is off by at most ``(|s·c| + |m·c| + |x|)·u`` <= ``3·big·u``
      (``big`` = the largest ``|s·c|``), ``ln 2`` times that in p, about twice that in p / l:
      ``6·big·u``;
    * float32 summation of a lane's ``2·ni`` terms per block and the quad's two levels.

    For ordinary attention scores (``big`` ~ 3) this is ~3e-6; the simulator's results sit
    10-20x inside it.
    """
    finite = s[np.isfinite(s)]
    big = float(np.abs(finite).max()) * float(c) if finite.size else 0.0
    return 2e-6 + 6 * big * U + (2 * ni * nb + 2) * U


def lane_rows(per_row, mi):
    g = np.arange(32) // 4
    rows = 16 * np.arange(mi)[None, :, None] + g[:, None, None] + 8 * np.arange(2)[None, None, :]
    return np.asarray(per_row)[..., rows]


def assert_close(got, want, rtol, what):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), f"{what}: NaN pattern differs"
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want)
    bad = ~nan & ~(err <= rtol * np.abs(want) + 1e-36)
    assert not bad.any(), (f"{what}: {bad.sum()} elements off; worst relative error "
                           f"{np.max(err[bad] / np.maximum(np.abs(want[bad]), 1e-300)):.3g}, "
                           f"tolerance {rtol:.3g}")


def check_stream(s, c, mi, ni, nb, quad_sum, out, stats, extra=0.0):
    soft, steps = reference(s, c, nb)
    rtol = tolerance(s, c, nb, ni) + extra
    assert_close(out, soft, rtol, "softmax")
    for kb, (m, lsum, alpha) in enumerate(steps):
        got_m, got_l, got_a = stats[kb]
        want_m = lane_rows(m.astype(np.float32), mi)
        assert ((got_m == want_m) | (np.isnan(got_m) & np.isnan(want_m))).all(), f"max {kb}"
        if not quad_sum:  # each lane holds its partial sum: add the quad's four
            got_l = np.repeat(got_l.reshape(8, 4, mi, 2).sum(axis=1, dtype=np.float64), 4, 0)
        assert_close(got_l, lane_rows(lsum, mi), rtol, f"row sum after block {kb}")
        assert_close(got_a, lane_rows(alpha, mi), rtol, f"alpha after block {kb}")
    assert_close(stats[nb, 1], lane_rows(steps[-1][1], mi), rtol, "row sum after finalize")
    return soft


# ---- cases --------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mi,ni,nb,quad_sum", [(1, 2, 3, True), (2, 1, 2, False)])
def test_streaming_equals_full_softmax(target, mi, ni, nb, quad_sum):
    rng = np.random.default_rng(100 * mi + 10 * ni + nb)
    s = (rng.standard_normal((16 * mi, 8 * ni * nb)) * 4).astype(np.float32)
    # Make the running max move: later blocks hold larger scores in some rows.
    s[::3, -8 * ni:] += 6
    out, stats = run_stream(s, C_HEAD64, mi, ni, nb, quad_sum)
    soft = check_stream(s, C_HEAD64, mi, ni, nb, quad_sum, out, stats)
    assert np.isfinite(out).all() and np.isfinite(stats).all()
    assert np.allclose(soft.sum(axis=1), 1.0)
    assert (stats[1:nb, 2] < 1).any(), "alpha never rescaled: the case is too easy"


def masked_scores(mi, ni, nb, seed=5):
    rng = np.random.default_rng(seed)
    n = 8 * ni
    s = (rng.standard_normal((16 * mi, n * nb)) * 3).astype(np.float32)
    s[0, :] = -np.inf  # fully masked: output 0, l 0, alpha 1, no NaN
    s[1, :n] = -np.inf  # first block masked: alpha 1, then 0 on the first unmasked block
    s[5, n:2 * n] = -np.inf  # a masked block in the middle
    cols = np.arange(n * nb)
    s[10, cols > 10] = -np.inf  # causal-like
    s[12, :] = -np.inf
    s[12, -1] = 2.5  # a single key in the last block
    s[9, :-n] = -np.inf  # masked until the last block (row g + 8 of quad 1)
    return s


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("quad_sum", [True, False], ids=["quad_sum", "deferred_sum"])
def test_masked_rows_stay_clean(target, quad_sum):
    mi, ni, nb = 1, 2, 3
    s = masked_scores(mi, ni, nb)
    out, stats = run_stream(s, C_HEAD64, mi, ni, nb, quad_sum)
    check_stream(s, C_HEAD64, mi, ni, nb, quad_sum, out, stats)
    assert not np.isnan(out).any() and not np.isnan(stats).any()
    assert (out[0] == 0).all() and (out[12, :-1] == 0).all()
    assert abs(out[12, -1] - 1) <= 1e-6
    # Row 0 (lanes 0-3, h 0): max -inf, alpha 1, sum 0 after every block.
    assert (stats[:nb, 0, 0:4, 0, 0] == -np.inf).all()
    assert (stats[:nb, 2, 0:4, 0, 0] == 1).all() and (stats[:, 1, 0:4, 0, 0] == 0).all()
    # Row 1 (lanes 4-7, h 0): alpha 1 on the masked block, exactly 0 on the first open one.
    assert (stats[0, 2, 4:8, 0, 0] == 1).all() and (stats[1, 2, 4:8, 0, 0] == 0).all()
    # Row 9 (lanes 4-7, h 1) opens only in the last block.
    assert (stats[nb - 1, 2, 4:8, 0, 1] == 0).all() and (stats[nb - 2, 2, 4:8, 0, 1] == 1).all()


@pytest.mark.parametrize("target", TARGETS)
def test_nan_score_poisons_only_its_row(target):
    mi, ni, nb = 1, 2, 3
    rng = np.random.default_rng(7)
    s = rng.standard_normal((16, 8 * ni * nb)).astype(np.float32)
    s[3, 8 * ni + 5] = np.nan  # row 3 (lanes 12-15, h 0), block 1
    out, stats = run_stream(s, C_HEAD64, mi, ni, nb, True)
    check_stream(s, C_HEAD64, mi, ni, nb, True, out, stats)
    assert np.isnan(out[3]).all()
    assert np.isfinite(np.delete(out, 3, axis=0)).all()
    assert not np.isnan(stats[0, :, 12:16, 0, 0]).any()  # before the NaN's block
    assert np.isnan(stats[1:nb, 0, 12:16, 0, 0]).all()  # running max NaN from then on


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("c", [C_HEAD64, np.float32(LOG2E)], ids=["scale_1_over_8", "scale_1"])
def test_large_scores_stay_finite(target, c):
    mi, ni, nb = 1, 2, 3
    rng = np.random.default_rng(11)
    s = rng.uniform(-1e4, 1e4, (16, 8 * ni * nb)).astype(np.float32)
    s[2, :] = np.float32(1e4)  # ties at the top: every p is exactly 1
    s[4, :8] = -1e4  # a block far below the rest: alpha stays 1, then p ≈ 0
    s[4, 8:] = 1e4 - rng.uniform(0, 2, 8 * ni * nb - 8).astype(np.float32)
    out, stats = run_stream(s, c, mi, ni, nb, True)
    assert np.isfinite(out).all() and np.isfinite(stats).all()
    check_stream(s, c, mi, ni, nb, True, out, stats)
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.exp(s.astype(np.float32) * np.float32(c / LOG2E))).all()
    assert np.allclose(out.sum(axis=1, dtype=np.float64), 1.0, rtol=1e-5)
    assert np.allclose(out[2], 1 / s.shape[1], rtol=1e-6)


@functools.cache
def exp2_fma_kernel():
    @cuda.jit
    def k(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = exp2_fma(x[i])

    return k


@pytest.mark.parametrize("target", TARGETS)
def test_exp2_fma_against_float64(target):
    """:func:`exp2_fma` (2**x without the MUFU): relative error at most 8e-5 from -125 to 127,
    +0 below -125 and at -inf, NaN for NaN."""
    x = np.concatenate([np.linspace(-125, 40, 4001),
                        np.random.default_rng(3).uniform(-30, 16, 2000),
                        [0.0, -0.5, 0.5, -124.999, -125.0, 127.0, -125.5, -126.0, -200.0,
                         -np.inf, np.nan]]).astype(np.float32)
    y = np.full(x.shape, 7.0, np.float32)
    dev = [cuda.to_device(a) for a in (x, y)]
    exp2_fma_kernel()[(x.size + 127) // 128, 128](*dev)
    got = dev[1].copy_to_host().astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    inside = x >= -125
    assert (np.abs(got[inside] / want[inside] - 1) <= 8e-5).all()
    low = (x < -125) & ~np.isnan(x)
    assert (got[low] == 0).all() and np.isnan(got[np.isnan(x)]).all()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("masked", [False, True], ids=["scores", "masked"])
def test_fma_exponentials_stream(target, masked):
    """``fma_exp_every=2``: every other 8-key tile's exponentials by :func:`exp2_fma` — the same
    softmax, max and alpha within the cubic's error (p, the sums and the quotient: 3 · 8e-5
    more); masked rows still exactly 0, never NaN."""
    mi, ni, nb = 1, 2, 3
    if masked:
        s = masked_scores(mi, ni, nb)
    else:
        s = (np.random.default_rng(12).standard_normal((16, 8 * ni * nb)) * 4).astype(np.float32)
        s[::3, -8 * ni:] += 6
    out, stats = run_stream(s, C_HEAD64, mi, ni, nb, True, every=2)
    check_stream(s, C_HEAD64, mi, ni, nb, True, out, stats, extra=2.4e-4)
    assert not np.isnan(out).any() and not np.isnan(stats).any()
    if masked:
        assert (out[0] == 0).all() and (out[12, :-1] == 0).all()


def test_generator_arguments():
    assert online_softmax_update(2, 8) is online_softmax_update(2, 8)
    with pytest.raises(ValueError, match="online_softmax_update: ni must be an integer >= 1"):
        online_softmax_update(2, 0)
    with pytest.raises(ValueError, match="online_softmax_finalize: mi"):
        online_softmax_finalize(-1, 8)


# ---- offline compile ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reports():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    return run_in_subprocess("tilepy.tile.online_softmax:compile_reports")


@pytest.mark.compile
@pytest.mark.xdist_group("online_softmax_reports")
@pytest.mark.parametrize("quad_sum", [True, False], ids=["quad_sum", "deferred_sum"])
def test_update_2x8_compiles_to_registers_only(reports, quad_sum):
    """mi=2, ni=8 streamed over key blocks, head dim 64: no local memory, every loop unrolled."""
    rep = reports[f"online_softmax_2x8_{'quad_sum' if quad_sum else 'deferred_sum'}"]
    assert "error" not in rep, rep["error"]
    assert rep["stack_frame"] == 0 and rep["local_bytes"] == 0
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0
    c = rep["counts"]
    assert c["ld.local"] == 0 and c["st.local"] == 0
    # Per block: 2·(8·4 + 2) = 68 ex2 and 2·2·2 quad shuffles for the max, as many for the sum
    # unless deferred to the finalize (2·2·2 there). A multiple k: the block loop may be
    # unrolled by LLVM, the counts must agree.
    k, rest = divmod(rep["ex2"], 68)
    assert k >= 1 and rest == 0, rep["ex2"]
    want_shfl = 16 * k if quad_sum else 8 * k + 8
    assert c["shfl"] == want_shfl, (c["shfl"], want_shfl)
    assert rep["registers"] <= 168, rep["registers"]
    print(f"online_softmax 2x8 {'quad' if quad_sum else 'deferred'} sum: "
          f"{rep['registers']} registers, {rep['ex2']} ex2, {c['shfl']} shfl")


@pytest.mark.compile
@pytest.mark.xdist_group("online_softmax_reports")
def test_fma_exponentials_compile_to_registers_only(reports):
    """``fma_exp_every=2``: half the scores' ex2 gone (2·(4·4 + 2) = 36 a block, against 68),
    no local memory, no spill."""
    rep = reports["online_softmax_2x8_deferred_sum_fma_exp_2"]
    assert "error" not in rep, rep["error"]
    assert rep["stack_frame"] == 0 and rep["local_bytes"] == 0
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0
    k, rest = divmod(rep["ex2"], 36)
    assert k >= 1 and rest == 0, rep["ex2"]
    print(f"online_softmax 2x8 fma_exp_every=2: {rep['registers']} registers, "
          f"{rep['ex2']} ex2")


# ---- lazy rescaling -----------------------------------------------------------------------------

def lazy_steps(s, c, nb, threshold):
    """[(max in use, l, alpha, moved)] after each block under lazy rescaling, the decisions
    taken in float32 as the kernel takes them (float64 sums)."""
    c32 = np.float32(c)
    n = s.shape[1] // nb
    m = np.full(s.shape[0], -np.inf, np.float32)
    steps = []
    with np.errstate(invalid="ignore"):
        for kb in range(nb):
            cand = np.maximum(m, s[:, kb * n:(kb + 1) * n].max(axis=1))
            moved = (cand - m) * c32 > np.float32(threshold)
            alpha = np.where(moved, np.exp2((m.astype(np.float64) - cand) * float(c32)), 1.0)
            m = np.where(moved, cand, m)
            seen = s[:, :(kb + 1) * n].astype(np.float64)
            lsum = np.where(m == -np.inf, 0.0,
                            np.exp2((seen - m[:, None].astype(np.float64)) * float(c32)).sum(1))
            steps.append((m.copy(), lsum, np.where(m == -np.inf, 1.0, alpha), moved))
    return steps


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("quad_sum", [True, False], ids=["quad_sum", "deferred_sum"])
def test_lazy_rescaling_equals_full_softmax(target, quad_sum):
    """rescale_threshold=8: a row's max moves only when a block raises it by more than 2**8 in
    p; alpha is exactly 1 otherwise, p stays below 256, and the finalized result is the full
    softmax all the same (masked rows as before)."""
    mi, ni, nb, threshold = 1, 2, 4, 8.0
    s = masked_scores(mi, ni, nb, seed=13) * np.float32(4 / 3)
    n = 8 * ni
    s[2, 2 * n:] += 30      # grows by less than the threshold (30·c ≈ 5.4): the max stays
    s[3, 3 * n:] += 80      # grows past it (80·c ≈ 14.4): moved, alpha < 1
    s[6, n:] += 60          # moved in block 1, then stays
    out, stats = run_stream(s, C_HEAD64, mi, ni, nb, quad_sum, threshold)
    soft, _ = reference(s, C_HEAD64, nb)
    rtol = tolerance(s, C_HEAD64, nb, ni) + 8 * U   # p up to 2**8: a few more ulp in the sum
    assert_close(out, soft, rtol, "softmax")
    assert not np.isnan(out).any() and not np.isnan(stats).any()
    steps = lazy_steps(s, C_HEAD64, nb, threshold)
    for kb, (m, lsum, alpha, moved) in enumerate(steps):
        got_m, got_l, got_a = stats[kb]
        assert (got_m == lane_rows(m, mi)).all(), f"max in use after block {kb}"
        if not quad_sum:
            got_l = np.repeat(got_l.reshape(8, 4, mi, 2).sum(axis=1, dtype=np.float64), 4, 0)
        assert_close(got_l, lane_rows(lsum, mi), rtol, f"row sum after block {kb}")
        stay = lane_rows(~moved, mi)
        assert (got_a[stay] == 1).all(), f"alpha not exactly 1 where the max stayed ({kb})"
        assert_close(got_a, lane_rows(alpha, mi), rtol, f"alpha after block {kb}")
    moved = np.array([st[3] for st in steps])
    assert moved[2:, 2].sum() == 0 and moved[3, 3] and moved[1, 6] and not moved[2:, 6].any()
    assert stats[:nb, 2].max() == 1 and (stats[1:nb, 2] < 1).any()


@pytest.mark.parametrize("target", TARGETS)
def test_p_scaled_in_the_exponent(target):
    """p_scale_log2=8 (the FP8 attention's P scale): the sums come out 2**8 times the plain
    ones, block by block, and the finalized softmax is the same (masked rows too), with the
    lazy rescaling of the FP8 kernels."""
    mi, ni, nb = 1, 2, 3
    s = masked_scores(mi, ni, nb, seed=21)
    out, stats = run_stream(s, C_HEAD64, mi, ni, nb, False, 0.5, shift=8)
    plain_out, plain = run_stream(s, C_HEAD64, mi, ni, nb, False, 0.5)
    rtol = tolerance(s, C_HEAD64, nb, ni)
    assert_close(out, plain_out, rtol, "softmax")
    assert_close(stats[:, 1], 256 * plain[:, 1].astype(np.float64), rtol, "row sums")
    np.testing.assert_array_equal(stats[:nb, 0], plain[:nb, 0])      # the max in use
    with pytest.raises(ValueError, match="p_scale_log2 must be an int"):
        online_softmax_update(1, 2, p_scale_log2=0.5)
    with pytest.raises(ValueError, match="fma_exp_every must be 0 or an int in 2"):
        online_softmax_update(1, 2, fma_exp_every=3)


def test_lazy_threshold_is_checked():
    with pytest.raises(ValueError, match="rescale_threshold must be in"):
        online_softmax_update(1, 2, rescale_threshold=0)
    with pytest.raises(ValueError, match="rescale_threshold must be in"):
        online_softmax_update(1, 2, rescale_threshold=16)   # p up to 65536: inf in float16
