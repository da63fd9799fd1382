"""tilepy.ptx.math: conversions bit-exact, approximations within the PTX ISA's error bounds.

The references here are written independently of the twins: rounding to bf16 / tf32 picks the
nearer of the two neighbouring bit patterns in float64 arithmetic, f16 goes through NumPy's
float64 → float16 cast, f16 bits are decoded by hand, and ex2 / rcp are compared with float64.
Simulator tests run the kernels with the twins; GPU tests run the same kernels on hardware and
compare them with the twins (bit-exact) and with the same references.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from tilepy.ptx.math import (
    cvt_bf16x2_f32,
    cvt_e4m3x2_f32,
    cvt_e5m2x2_f32,
    cvt_f16x2_e4m3x2,
    cvt_f16x2_e5m2x2,
    cvt_f16x2_f32,
    cvt_tf32,
    ex2_approx,
    fmax_nan,
    pack_f16x2,
    rcp_approx,
    tanh_approx,
    unpack_bf16x2_f32,
    unpack_f16x2,
    unpack_f16x2_f32,
)

NTHREADS = 64  # two warps; the kernels stride over the data

F16_NAN = 0x7FFF
BF16_NAN = 0x7FFF
F32_NAN = 0x7FFFFFFF  # what cvt.f32.f16 writes for a NaN

EX2_REL_ERR = 2.0 ** -22  # PTX ISA: ex2.approx.f32, maximum relative error
RCP_ULP = 1.0  # PTX ISA: rcp.approx.f32, maximum error in ulp


def f32(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def bits32(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# float32 bit patterns with the special cases of every conversion.
SPECIAL_BITS = np.array([
    0x00000000, 0x80000000,              # ±0
    0x7F800000, 0xFF800000,              # ±inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA5A5A5, 0x7FFFFFFF, 0x7FBFFFFF,  # NaNs
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00400000, 0x80012345,  # subnormals
    0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF,  # min normal, max finite
    0x3F800000, 0xBF800000, 0x40490FDB, 0xC02DF854, 0x3EAAAAAB,
    0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000, 0x47800000,  # around f16 max 65504
    0x33800000, 0x33000000, 0x33000001, 0xB3C00000, 0x387FC000,  # f16 subnormal range
    0x38800000, 0x387FFFFF,                                       # f16 min normal
    0x7F7F8000, 0x7F7F7FFF, 0x3F808000, 0x3F818000, 0xBF808000,  # bf16 ties / overflow
    0x3F801000, 0x3F803000, 0xBF801000, 0x3F800FFF, 0x7F7FF000,  # tf32 ties / overflow
], dtype=np.uint32)


def random_f32(n, seed):
    """Random float32 over all exponents (incl. subnormals), both signs."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    return f32(b[(b & 0x7F800000) != 0x7F800000])  # finite; specials come separately


def f16_ties(n, seed):
    """float32 values exactly half-way between two neighbouring finite float16 values."""
    rng = np.random.default_rng(seed)
    h = rng.integers(0, 0x7BFF, size=n).astype(np.uint16)  # below max, so h+1 is finite
    h[:4] = [0, 1, 2, 0x03FF]  # ties among subnormals and at the subnormal/normal border
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).astype(np.uint16).view(np.float16).astype(np.float64)
    sign = np.where(rng.integers(0, 2, n) == 1, -1.0, 1.0)
    mid = ((lo + hi) / 2 * sign).astype(np.float32)
    assert (mid.astype(np.float64) == (lo + hi) / 2 * sign).all()  # exact in float32
    return mid


def ties_at(low_bits, n, seed):
    """float32 patterns whose dropped low bits are exactly half: ``low_bits`` = 16 or 13."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    b = (b & ~np.uint32((1 << low_bits) - 1)) | np.uint32(1 << (low_bits - 1))
    return f32(b[(b & 0x7F800000) != 0x7F800000])


def conversion_inputs(seed=0, n=300):
    return np.concatenate([f32(SPECIAL_BITS), random_f32(n, seed), f16_ties(n // 5, seed + 1),
                           ties_at(16, n // 5, seed + 2), ties_at(13, n // 5, seed + 3)])


# ---- independent references -------------------------------------------------------------------

def _round_bits(x, drop, ties_even):
    """float32 → top (32 - drop) bits, nearest; ties to even or away from zero. Finite x."""
    b = int(f32_bits1(x))
    step = 1 << drop
    down = b & ~(step - 1) & 0xFFFFFFFF
    up = down + step

    def value(bits):
        e = (bits >> 23) & 0xFF
        if e == 0xFF:  # rounding past the largest finite value: the value "2**128"
            return np.copysign(2.0 ** 128, float(x))
        return float(f32(np.uint32(bits)))

    dx, du = abs(float(x) - value(down)), abs(value(up) - float(x))
    if dx < du:
        r = down
    elif du < dx:
        r = up
    else:
        r = (down if (down >> drop) & 1 == 0 else up) if ties_even else up
    return r


def f32_bits1(x):
    return np.float32(x).view(np.uint32)


def ref_bf16(x):
    x = np.float32(x)
    if np.isnan(x):
        return BF16_NAN
    if np.isinf(x):
        return int(f32_bits1(x)) >> 16
    return _round_bits(x, 16, ties_even=True) >> 16


def ref_tf32(x):
    x = np.float32(x)
    if not np.isfinite(x):  # ±inf kept; NaN: low 13 bits cleared, no rounding (seen on sm_90)
        return int(f32_bits1(x)) & 0xFFFFE000
    return _round_bits(x, 13, ties_even=False)


def ref_f16(x):
    x = np.float32(x)
    if np.isnan(x):
        return F16_NAN
    with np.errstate(over="ignore"):
        return int(np.float64(x).astype(np.float16).view(np.uint16))


def ref_f16_to_f64(h):
    """Decode float16 bits by hand (NaN → None)."""
    h = int(h)
    s = -1.0 if h & 0x8000 else 1.0
    e, m = (h >> 10) & 0x1F, h & 0x3FF
    if e == 0x1F:
        return None if m else s * np.inf
    if e == 0:
        return s * m * 2.0 ** -24
    return s * (1 + m / 1024) * 2.0 ** (e - 15)


def ref_unpack_f16_f32_bits(h):
    v = ref_f16_to_f64(h)
    return F32_NAN if v is None else int(f32_bits1(np.float32(v)))


# ---- kernels --------------------------------------------------------------------------------

@cuda.jit
def k_ex2(x, out):
    for j in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        out[j] = ex2_approx(x[j])


@cuda.jit
def k_rcp(x, out):
    for j in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        out[j] = rcp_approx(x[j])


@cuda.jit
def k_tanh(x, out):
    for j in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        out[j] = tanh_approx(x[j])


@cuda.jit
def k_fmax(a, b, out):
    for j in range(cuda.threadIdx.x, a.shape[0], cuda.blockDim.x):
        out[j] = fmax_nan(a[j], b[j])


def fmax_inputs(seed=0, n=600):
    """Pairs of float32: the special values against each other (both orders), then random
    bit patterns (NaNs with payloads, subnormals, infinities among them)."""
    sp = SPECIAL_BITS.view(np.float32)
    a, b = np.meshgrid(sp, sp)
    rng = np.random.default_rng(seed)
    ra, rb = (rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
              for _ in range(2))
    return (np.concatenate([a.ravel(), ra, ra]).astype(np.float32),
            np.concatenate([b.ravel(), rb, ra[::-1]]).astype(np.float32))


def ref_fmax_bits(a, b):
    """max.NaN.f32: canonical NaN if either is NaN, +0 above -0, else the larger."""
    if np.isnan(a) or np.isnan(b):
        return F32_NAN
    if a == b == 0:
        return 0 if not (np.signbit(a) and np.signbit(b)) else 0x80000000
    return int(bits32(np.float32(max(a, b)))[0])


def check_fmax(a, b, out):
    assert_bits_equal(bits32(out), [ref_fmax_bits(x, y) for x, y in zip(a, b)], bits32(a),
                      "fmax_nan vs reference")


@cuda.jit
def k_cvt_pairs(lo, hi, f16_out, bf16_out):
    for j in range(cuda.threadIdx.x, lo.shape[0], cuda.blockDim.x):
        f16_out[j] = cvt_f16x2_f32(lo[j], hi[j])
        bf16_out[j] = cvt_bf16x2_f32(lo[j], hi[j])


@cuda.jit
def k_tf32(x, out):
    for j in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        out[j] = cvt_tf32(x[j])


@cuda.jit
def k_unpack(words, h_lo, h_hi, f_lo, f_hi, b_lo, b_hi, repacked):
    for j in range(cuda.threadIdx.x, words.shape[0], cuda.blockDim.x):
        w = words[j]
        lo, hi = unpack_f16x2(w)
        h_lo[j] = lo
        h_hi[j] = hi
        repacked[j] = pack_f16x2(lo, hi)
        a, b = unpack_f16x2_f32(w)
        f_lo[j] = a
        f_hi[j] = b
        c, d = unpack_bf16x2_f32(w)
        b_lo[j] = c
        b_hi[j] = d


@cuda.jit
def k_pack(lo, hi, out):
    for j in range(cuda.threadIdx.x, lo.shape[0], cuda.blockDim.x):
        out[j] = pack_f16x2(lo[j], hi[j])


def run_unary(kernel, x, out_dtype):
    out = np.zeros(len(x), dtype=out_dtype)
    kernel[1, NTHREADS](x, out)
    return out


def run_pairs(lo, hi):
    f16_out = np.zeros(len(lo), np.uint32)
    bf16_out = np.zeros(len(lo), np.uint32)
    k_cvt_pairs[1, NTHREADS](lo, hi, f16_out, bf16_out)
    return f16_out, bf16_out


def run_unpack(words):
    n = len(words)
    outs = [np.zeros(n, np.float16), np.zeros(n, np.float16), np.zeros(n, np.float32),
            np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32),
            np.zeros(n, np.uint32)]
    k_unpack[1, NTHREADS](words, *outs)
    return outs


def pair_inputs(seed=0, n=300):
    x = conversion_inputs(seed, n)
    rng = np.random.default_rng(seed + 10)
    return x, x[rng.permutation(len(x))]  # every special value as lo and as hi


def test_words(seed=0, n=300):
    rng = np.random.default_rng(seed)
    halves = np.array([0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x7DFF, 0x0001,
                       0x83FF, 0x0400, 0x7BFF, 0x3C00, 0xBC00,  # f16 specials
                       0x7F80, 0xFF80, 0x7FC1, 0x0080, 0x007F, 0x8001, 0x3F80],  # bf16 specials
                      dtype=np.uint32)
    special = (halves[:, None] | (halves[None, :] << 16)).ravel()
    rand = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([special, rand]).astype(np.uint32)


test_words.__test__ = False  # a helper, not a test


def _hex(a):
    return [hex(int(v)) for v in np.asarray(a).ravel()[:6]]


def assert_bits_equal(got, want, inputs, what):
    got, want = np.asarray(got, np.uint64), np.asarray(want, np.uint64)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (f"{what}: {bad.size} mismatches; inputs {_hex(inputs[bad])} got "
                           f"{_hex(got[bad])} want {_hex(want[bad])}")


# ---- checks shared by the simulator and the GPU ---------------------------------------------

def check_pairs(lo, hi, f16_out, bf16_out):
    want_f16 = [ref_f16(a) | (ref_f16(b) << 16) for a, b in zip(lo, hi)]
    want_bf16 = [ref_bf16(a) | (ref_bf16(b) << 16) for a, b in zip(lo, hi)]
    assert_bits_equal(f16_out & 0xFFFF, np.array(want_f16) & 0xFFFF, bits32(lo), "f16x2 lo")
    assert_bits_equal(f16_out >> 16, np.array(want_f16) >> 16, bits32(hi), "f16x2 hi")
    assert_bits_equal(bf16_out & 0xFFFF, np.array(want_bf16) & 0xFFFF, bits32(lo), "bf16x2 lo")
    assert_bits_equal(bf16_out >> 16, np.array(want_bf16) >> 16, bits32(hi), "bf16x2 hi")


def check_tf32(x, out):
    assert_bits_equal(out, [ref_tf32(v) for v in x], bits32(x), "tf32")


def check_unpack(words, outs):
    h_lo, h_hi, f_lo, f_hi, b_lo, b_hi, repacked = outs
    lo16, hi16 = words & 0xFFFF, words >> 16
    assert_bits_equal(h_lo.view(np.uint16), lo16, words, "unpack_f16x2 lo")
    assert_bits_equal(h_hi.view(np.uint16), hi16, words, "unpack_f16x2 hi")
    assert_bits_equal(repacked, words, words, "pack(unpack(w))")
    assert_bits_equal(bits32(f_lo), [ref_unpack_f16_f32_bits(h) for h in lo16], words,
                      "unpack_f16x2_f32 lo")
    assert_bits_equal(bits32(f_hi), [ref_unpack_f16_f32_bits(h) for h in hi16], words,
                      "unpack_f16x2_f32 hi")
    assert_bits_equal(bits32(b_lo), (words << 16) & 0xFFFFFFFF, words, "unpack_bf16x2_f32 lo")
    assert_bits_equal(bits32(b_hi), words & 0xFFFF0000, words, "unpack_bf16x2_f32 hi")


EX2_SPECIAL = [  # (input, exact expected output)
    (-np.inf, 0.0), (np.inf, np.inf), (0.0, 1.0), (-0.0, 1.0),
    (f32(1)[()], 1.0), (f32(0x80000001)[()], 1.0), (f32(0x007FFFFF)[()], 1.0),  # ftz in
    (1.0, 2.0), (-1.0, 0.5), (10.0, 1024.0), (-20.0, 2.0 ** -20), (127.0, 2.0 ** 127),
    (-126.5, 0.0), (-149.0, 0.0), (-1000.0, 0.0),  # results below 2**-126: flushed to +0
    (128.0, np.inf), (1000.0, np.inf),
]

RCP_SPECIAL = [
    (0.0, np.inf), (-0.0, -np.inf), (np.inf, 0.0), (-np.inf, -0.0),
    (f32(1)[()], np.inf), (f32(0x807FFFFF)[()], -np.inf),  # subnormal in: read as ±0
    (1.0, 1.0), (-2.0, -0.5), (4.0, 0.25), (2.0 ** 126, 2.0 ** -126), (-(2.0 ** -126), -(2.0 ** 126)),
    (3.0e38, 0.0), (-3.0e38, -0.0), (2.0 ** 127, 0.0),  # results below 2**-126: flushed
]


def ex2_inputs(seed=0, n=400):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.uniform(-125.9, 127.9, n), rng.uniform(-1, 1, n // 4),
                        rng.uniform(-1e-3, 1e-3, n // 10)]).astype(np.float32)
    return np.concatenate([np.array([s for s, _ in EX2_SPECIAL], np.float32), [np.nan], x])


def rcp_inputs(seed=0, n=500):
    rng = np.random.default_rng(seed)
    mant = rng.uniform(1, 2, n)
    exp = rng.integers(-125, 126, n)
    sign = np.where(rng.integers(0, 2, n) == 1, -1.0, 1.0)
    x = (sign * mant * 2.0 ** exp).astype(np.float32)
    return np.concatenate([np.array([s for s, _ in RCP_SPECIAL], np.float32), [np.nan], x])


def check_special(x, out, table, what):
    for i, (_, want) in enumerate(table):
        got = out[i]
        assert bits32(got) == bits32(np.float32(want)), (
            f"{what}({x[i]!r} = {hex(bits32(x[i])[()])}) gave {got!r} ({hex(bits32(got)[()])}), "
            f"want {want!r}")
    assert np.isnan(out[len(table)]), f"{what}(NaN) gave {out[len(table)]!r}"


def check_ex2(x, out):
    check_special(x, out, EX2_SPECIAL, "ex2_approx")
    start = len(EX2_SPECIAL) + 1
    xs, got = x[start:].astype(np.float64), out[start:].astype(np.float64)
    exact = np.exp2(xs)
    assert (exact >= 2.0 ** -126).all()  # the random inputs stay in the normal range
    rel = np.abs(got - exact) / exact
    worst = int(np.argmax(rel))
    assert rel.max() <= EX2_REL_ERR, (
        f"ex2_approx({xs[worst]!r}): {got[worst]!r} vs {exact[worst]!r}, relative error "
        f"2**{np.log2(rel.max()):.2f}")
    return rel.max()


def check_rcp(x, out):
    check_special(x, out, RCP_SPECIAL, "rcp_approx")
    start = len(RCP_SPECIAL) + 1
    xs, got = x[start:].astype(np.float64), out[start:]
    exact = 1.0 / xs
    ulp = np.spacing(np.abs(exact.astype(np.float32))).astype(np.float64)
    err = np.abs(got.astype(np.float64) - exact) / ulp
    worst = int(np.argmax(err))
    assert err.max() <= RCP_ULP, (
        f"rcp_approx({xs[worst]!r}): {got[worst]!r} vs {exact[worst]!r}, {err.max():.3f} ulp")
    return err.max()


TANH_SPECIAL = [(np.inf, 1.0), (-np.inf, -1.0), (0.0, 0.0), (30.0, 1.0), (-30.0, -1.0)]
TANH_REL_ERR = 2.0 ** -14   # MUFU.TANH: about 1e-5 (2**-16.6) seen; the bound tested


def tanh_inputs(seed=1, n=4000):
    """The specials, NaN, then values spread over ±20 (where a soft cap's argument lives) and
    small magnitudes down to 2**-20."""
    rng = np.random.default_rng(seed)
    wide = rng.uniform(-20, 20, n)
    small = np.sign(rng.uniform(-1, 1, n)) * 2.0 ** rng.uniform(-20, 0, n)
    return np.concatenate([np.array([v for v, _ in TANH_SPECIAL], np.float32), [np.nan],
                           wide.astype(np.float32), small.astype(np.float32)])


def check_tanh(x, out):
    check_special(x, out, TANH_SPECIAL, "tanh_approx")
    start = len(TANH_SPECIAL) + 1
    xs, got = x[start:].astype(np.float64), out[start:].astype(np.float64)
    exact = np.tanh(xs)
    rel = np.abs(got - exact) / np.abs(exact)
    worst = int(np.argmax(rel))
    assert rel.max() <= TANH_REL_ERR, (
        f"tanh_approx({xs[worst]!r}): {got[worst]!r} vs {exact[worst]!r}, relative error "
        f"2**{np.log2(rel.max()):.2f}")
    return rel.max()


# ---- the references themselves, and the twins as pure functions ----------------------------

def test_references_agree_with_known_cases():
    assert ref_bf16(np.float32(1.0)) == 0x3F80
    assert ref_bf16(f32(0x3F808000)[()]) == 0x3F80  # tie, 0x3F80 even: down
    assert ref_bf16(f32(0x3F818000)[()]) == 0x3F82  # tie, 0x3F81 odd: up
    assert ref_bf16(f32(0x7F7FFFFF)[()]) == 0x7F80  # max finite rounds to inf
    assert ref_tf32(f32(0x3F801000)[()]) == 0x3F802000  # tie: away from zero
    assert ref_tf32(f32(0xBF801000)[()]) == 0xBF802000
    assert ref_tf32(f32(0x3F800FFF)[()]) == 0x3F800000
    assert ref_tf32(f32(0x7FBFFFFF)[()]) == 0x7FBFE000  # NaN: truncated, not rounded
    assert ref_tf32(f32(0x7F800001)[()]) == 0x7F800000  # ... even into the bits of inf
    assert ref_f16(np.float32(65520.0)) == 0x7C00  # tie between 65504 and 2**16: even → inf
    assert ref_f16(np.float32(2.0 ** -25)) == 0x0000  # tie between 0 and 2**-24: even → 0
    assert ref_f16(np.float32(3 * 2.0 ** -25)) == 0x0002
    assert ref_f16_to_f64(0x0001) == 2.0 ** -24 and ref_f16_to_f64(0x7C01) is None


def test_twins_match_the_references_on_many_bit_patterns():
    rng = np.random.default_rng(7)
    b = rng.integers(0, 2**32, size=4000, dtype=np.uint64).astype(np.uint32)
    xs = np.concatenate([f32(b), f32(SPECIAL_BITS), f16_ties(200, 8), ties_at(16, 200, 9),
                         ties_at(13, 200, 10)])
    for x in xs:
        want = ref_f16(x) | (ref_f16(-x) << 16)
        assert int(cvt_f16x2_f32.twin(x, -x)) == want, hex(bits32(x)[()])
        want = ref_bf16(x) | (ref_bf16(-x) << 16)
        assert int(cvt_bf16x2_f32.twin(x, -x)) == want, hex(bits32(x)[()])
        assert int(cvt_tf32.twin(x)) == ref_tf32(x), hex(bits32(x)[()])


def test_unpack_twins_on_every_f16_pattern():
    h = np.arange(0, 65536, 2, dtype=np.uint32)
    words = h | ((h + 1) << 16)
    for w in words:
        lo, hi = unpack_f16x2_f32.twin(w)
        assert bits32(lo) == ref_unpack_f16_f32_bits(int(w) & 0xFFFF), hex(w)
        assert bits32(hi) == ref_unpack_f16_f32_bits(int(w) >> 16), hex(w)
        a, b = unpack_f16x2.twin(w)
        assert type(a) is np.float16 and int(pack_f16x2.twin(a, b)) == int(w)


def test_fmax_nan_twin_against_the_reference():
    a, b = fmax_inputs()
    check_fmax(a, b, np.array([fmax_nan.twin(x, y) for x, y in zip(a, b)], np.float32))
    assert fmax_nan.spec.min_cc == (8, 0) and fmax_nan.spec.template.startswith("max.NaN.f32")


@pytest.mark.sim
def test_sim_fmax_nan():
    a, b = fmax_inputs(seed=1)
    out = np.zeros(len(a), np.float32)
    k_fmax[1, NTHREADS](a, b, out)
    check_fmax(a, b, out)


@pytest.mark.gpu
def test_gpu_fmax_nan_matches_the_twin():
    a, b = fmax_inputs(seed=3, n=20000)
    out = np.zeros(len(a), np.float32)
    k_fmax[1, NTHREADS](a, b, out)
    check_fmax(a, b, out)


def test_twins_return_the_declared_types():
    assert type(ex2_approx.twin(np.float32(1))) is np.float32
    assert type(rcp_approx.twin(np.float32(3))) is np.float32
    assert type(tanh_approx.twin(np.float32(0.5))) is np.float32
    assert type(cvt_f16x2_f32.twin(np.float32(1), np.float32(2))) is np.uint32
    assert type(cvt_bf16x2_f32.twin(np.float32(1), np.float32(2))) is np.uint32
    assert type(cvt_tf32.twin(np.float32(1))) is np.uint32
    assert type(pack_f16x2.twin(np.float16(1), np.float16(2))) is np.uint32
    assert all(type(v) is np.float32 for v in unpack_f16x2_f32.twin(np.uint32(0x3C00BC00)))
    assert all(type(v) is np.float32 for v in unpack_bf16x2_f32.twin(np.uint32(0x3F80BF80)))


def test_lo_is_the_lower_half():
    w = cvt_f16x2_f32.twin(np.float32(1.0), np.float32(-2.0))
    assert int(w) == 0x3C00 | (0xC000 << 16)
    w = cvt_bf16x2_f32.twin(np.float32(1.0), np.float32(-2.0))
    assert int(w) == 0x3F80 | (0xC000 << 16)
    assert int(pack_f16x2.twin(np.float16(1.0), np.float16(-2.0))) == 0x3C00 | (0xC000 << 16)
    assert unpack_bf16x2_f32.twin(np.uint32(0xC0003F80)) == (np.float32(1.0), np.float32(-2.0))


def test_templates_put_hi_in_the_upper_half():
    # cvt.rn.{f16,bf16}x2.f32 d, a, b puts a in the upper half: a must be hi ($2).
    assert cvt_f16x2_f32.spec.template == "cvt.rn.f16x2.f32 $0, $2, $1;"
    assert cvt_bf16x2_f32.spec.template == "cvt.rn.bf16x2.f32 $0, $2, $1;"
    assert pack_f16x2.spec.template == "mov.b32 $0, {$1, $2};"
    for fn in (cvt_f16x2_f32, cvt_bf16x2_f32, cvt_tf32):
        assert fn.spec.min_cc == (8, 0)


@pytest.mark.parametrize("fn,args", [
    (ex2_approx, (np.int32(1),)), (rcp_approx, ("1",)), (cvt_tf32, (1,)),
    (pack_f16x2, (np.float32(1), np.float16(1))), (unpack_f16x2, (np.float32(1),)),
    (unpack_bf16x2_f32, (1.5,)),
])
def test_twins_refuse_wrong_types(fn, args):
    with pytest.raises(TypeError, match=fn.spec.name):
        fn.twin(*args)


# ---- simulator ------------------------------------------------------------------------------

@pytest.mark.sim
def test_sim_cvt_f16x2_and_bf16x2_round_to_nearest_even():
    lo, hi = pair_inputs()
    check_pairs(lo, hi, *run_pairs(lo, hi))


@pytest.mark.sim
def test_sim_cvt_tf32_rounds_ties_away():
    x = conversion_inputs(seed=3)
    check_tf32(x, run_unary(k_tf32, x, np.uint32))


@pytest.mark.sim
def test_sim_pack_unpack_keep_every_bit():
    words = test_words()
    check_unpack(words, run_unpack(words))
    lo = (words & 0xFFFF).astype(np.uint16).view(np.float16)
    hi = (words >> 16).astype(np.uint16).view(np.float16)
    out = np.zeros(len(words), np.uint32)
    k_pack[1, NTHREADS](lo, hi, out)
    assert_bits_equal(out, words, words, "pack_f16x2")


@pytest.mark.sim
def test_sim_ex2_approx():
    x = ex2_inputs()
    err = check_ex2(x, run_unary(k_ex2, x, np.float32))
    assert err <= 2.0 ** -24  # the twin rounds correctly: half an ulp


@pytest.mark.sim
def test_sim_tanh_approx():
    x = tanh_inputs()
    err = check_tanh(x, run_unary(k_tanh, x, np.float32))
    assert err <= 2.0 ** -24  # the twin rounds correctly: half an ulp


@pytest.mark.sim
def test_sim_rcp_approx():
    x = rcp_inputs()
    err = check_rcp(x, run_unary(k_rcp, x, np.float32))
    assert err <= 0.5


# ---- GPU: the same kernels on hardware, against the twins and the references --------------

@pytest.mark.gpu
def test_gpu_cvt_pairs_match_the_twins():
    lo, hi = pair_inputs(seed=5, n=5000)
    f16_out, bf16_out = run_pairs(lo, hi)
    assert_bits_equal(f16_out, [cvt_f16x2_f32.twin(a, b) for a, b in zip(lo, hi)], bits32(lo),
                      "cvt_f16x2_f32 vs twin")
    assert_bits_equal(bf16_out, [cvt_bf16x2_f32.twin(a, b) for a, b in zip(lo, hi)],
                      bits32(lo), "cvt_bf16x2_f32 vs twin")
    check_pairs(lo, hi, f16_out, bf16_out)


@pytest.mark.gpu
def test_gpu_cvt_tf32_matches_the_twin():
    x = conversion_inputs(seed=6, n=20000)
    out = run_unary(k_tf32, x, np.uint32)
    assert_bits_equal(out, [cvt_tf32.twin(v) for v in x], bits32(x), "cvt_tf32 vs twin")
    check_tf32(x, out)


@pytest.mark.gpu
def test_gpu_pack_unpack_match_the_twins():
    h = np.arange(0, 65536, 2, dtype=np.uint32)  # every f16 pattern, as lo and as hi
    words = np.concatenate([test_words(seed=4, n=2000), h | ((h + 1) << 16),
                            (h + 1) | (h << 16)]).astype(np.uint32)
    outs = run_unpack(words)
    twin_f = np.array([unpack_f16x2_f32.twin(w) for w in words], np.float32)
    assert_bits_equal(bits32(outs[2]), bits32(twin_f[:, 0]), words, "unpack_f16x2_f32 lo vs twin")
    assert_bits_equal(bits32(outs[3]), bits32(twin_f[:, 1]), words, "unpack_f16x2_f32 hi vs twin")
    check_unpack(words, outs)


@pytest.mark.gpu
def test_gpu_ex2_approx_within_the_documented_error():
    x = ex2_inputs(seed=2, n=200_000)
    err = check_ex2(x, run_unary(k_ex2, x, np.float32))
    print(f"ex2.approx.ftz.f32 on this GPU: max relative error 2**{np.log2(err):.2f} "
          f"over {len(x)} inputs")


@pytest.mark.gpu
def test_gpu_rcp_approx_within_the_documented_error():
    x = rcp_inputs(seed=2, n=200_000)
    err = check_rcp(x, run_unary(k_rcp, x, np.float32))
    print(f"rcp.approx.ftz.f32 on this GPU: max error {err:.3f} ulp over {len(x)} inputs")


@pytest.mark.gpu
def test_gpu_tanh_approx_within_the_tested_error():
    x = tanh_inputs(seed=2, n=100_000)
    err = check_tanh(x, run_unary(k_tanh, x, np.float32))
    print(f"tanh.approx.f32 on this GPU: max relative error 2**{np.log2(err):.2f} over "
          f"{len(x)} inputs")


@pytest.mark.gpu
def test_gpu_approx_results_are_never_subnormal():
    """ftz at the edges: around 2**-126 a result is either ±0 or normal, never subnormal."""
    x = np.linspace(-126.05, -125.95, 4001, dtype=np.float32)
    out = run_unary(k_ex2, x, np.float32)
    assert ((out == 0) | (out >= 2.0 ** -126)).all()
    nz = out != 0
    exact = np.exp2(x[nz].astype(np.float64))
    assert (np.abs(out[nz] - exact) / exact <= EX2_REL_ERR).all()
    print(f"ex2 near -126: {int((~nz).sum())} of {len(x)} flushed, smallest input kept "
          f"{x[nz].min()!r}")
    x = np.concatenate([np.linspace(2.0 ** 125.9, 2.0 ** 126.1, 2001),
                        -np.linspace(2.0 ** 125.9, 2.0 ** 126.1, 2001)]).astype(np.float32)
    out = run_unary(k_rcp, x, np.float32)
    assert ((out == 0) | (np.abs(out) >= 2.0 ** -126)).all()
    assert (np.signbit(out) == np.signbit(x)).all()


# ---- 8-bit floats: e4m3 / e5m2 pairs ---------------------------------------------------------

@cuda.jit
def k_fp8(lo, hi, e4m3, e5m2, up4, up5):
    for j in range(cuda.threadIdx.x, lo.shape[0], cuda.blockDim.x):
        e4m3[j] = cvt_e4m3x2_f32(lo[j], hi[j])
        e5m2[j] = cvt_e5m2x2_f32(lo[j], hi[j])
        up4[j] = cvt_f16x2_e4m3x2(np.uint16(j & 0xFFFF))
        up5[j] = cvt_f16x2_e5m2x2(np.uint16(j & 0xFFFF))


def fp8_inputs(seed=0, n=4000):
    """float32 pairs: the specials and the saturation edges of both formats, ties between
    neighbouring codes, then random magnitudes over both ranges."""
    rng = np.random.default_rng(seed)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 449.0, 464.0, 465.0, 480.0,
                      -500.0, 57344.0, 61440.0, 61441.0, 1e30, 2.0 ** -9, 2.0 ** -10,
                      3 * 2.0 ** -11, 2.0 ** -16, 2.0 ** -17, 1.0625, 1.1875, 1e-30],
                     np.float32)
    rand = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 5, n)).astype(np.float32)
    x = np.concatenate([edges, -edges, rand])
    return x, np.roll(x, 7)


def run_fp8(lo, hi):
    outs = [np.zeros(len(lo), np.uint16), np.zeros(len(lo), np.uint16),
            np.zeros(len(lo), np.uint32), np.zeros(len(lo), np.uint32)]
    k_fp8[1, NTHREADS](lo, hi, *outs)
    return outs


def check_fp8(lo, hi, e4m3, e5m2, up4, up5):
    """Against ml_dtypes (round to nearest even) after saturating to the largest finite value;
    NaN → 0x7f; the f16 pairs of every code exact (NaN → 0x7fff)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    codes = np.arange(len(lo)) & 0xFFFF
    for got, up, (top, name) in ((e4m3, up4, (448.0, "float8_e4m3fn")),
                                 (e5m2, up5, (57344.0, "float8_e5m2"))):
        dt = getattr(ml_dtypes, name)
        for half, x in ((got & 0xFF, lo), (got >> 8, hi)):
            want = np.clip(x, -top, top).astype(dt).view(np.uint8).astype(np.uint16)
            want = np.where(np.isnan(x), 0x7F, want)
            bad = np.nonzero(half != want)[0]
            assert not len(bad), (name, [(x[i], hex(half[i]), hex(want[i])) for i in bad[:5]])
        for shift, part in ((0, up & 0xFFFF), (16, up >> 16)):
            vals = ((codes >> (shift // 2)) & 0xFF).astype(np.uint8).view(dt).astype(np.float16)
            want = np.where(np.isnan(vals), 0x7FFF, vals.view(np.uint16))
            bad = np.nonzero(part != want)[0]
            assert not len(bad), (name, "up", [(hex(codes[i]), hex(part[i])) for i in bad[:5]])


def test_fp8_pairs_put_lo_in_the_low_byte():
    assert int(cvt_e4m3x2_f32.twin(np.float32(1.0), np.float32(-2.0))) == 0x38 | (0xC0 << 8)
    assert int(cvt_e5m2x2_f32.twin(np.float32(1.0), np.float32(-2.0))) == 0x3C | (0xC0 << 8)
    assert int(cvt_f16x2_e4m3x2.twin(np.uint16(0xC038))) == 0x3C00 | (0xC000 << 16)
    # cvt.rn.satfinite.{e4m3,e5m2}x2.f32 d, a, b puts a in the upper byte: a must be hi ($2)
    for fn in (cvt_e4m3x2_f32, cvt_e5m2x2_f32):
        assert fn.spec.template.endswith("$0, $2, $1;") and fn.spec.min_cc == (8, 9)


@pytest.mark.sim
def test_sim_fp8_conversions_round_saturate_and_widen_exactly():
    lo, hi = fp8_inputs(n=1500)
    check_fp8(lo, hi, *run_fp8(lo, hi))


@pytest.mark.gpu
def test_gpu_fp8_conversions_match_the_twins():
    lo, hi = fp8_inputs(seed=9, n=60000)
    outs = run_fp8(lo, hi)
    check_fp8(lo, hi, *outs)
