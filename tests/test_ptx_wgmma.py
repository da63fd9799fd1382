"""wgmma: descriptors and swizzles on the CPU, the warpgroup twin against NumPy in the simulator,
the sm_90a compile check, and the hardware against NumPy (GPU).

The shared-memory images and the register maps are written out here from the PTX ISA's
row / 16-byte-chunk description (the swizzle of a row as a chunk XOR, the core matrices of the
unswizzled layout) rather than with tilepy.ptx.wgmma's own functions, so a wrong layout in the
library cannot agree with a wrong test. On the GPU the same kernels run on the real instruction.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32, uint8, uint16, uint32

from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ptx import wgmma as W
from tilepy.ptx.address import shared_addr
from tilepy.ptx.asm import SIMULATOR

ALIGN = None if SIMULATOR else 1024  # swizzled tiles start where the pattern repeats
THREADS = 128


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**63)
    return np.random.default_rng(seed), seed


# ---- the ISA's tables, written out independently ----------------------------------------------

def acc_position(t, i):
    """Accumulator register i of warpgroup thread t (ISA figure "WGMMA .m64nNk16 D")."""
    warp, lane = divmod(t, 32)
    row = 16 * warp + lane // 4 + (8 if i % 4 >= 2 else 0)
    col = (lane % 4) * 2 + (i & 1) + 8 * (i >> 2)
    return row, col


def a_position(t, r, h):
    """Half h of A register r (rs form): the m16n8k16 A fragment of each warp, rows + 16·warp."""
    warp, lane = divmod(t, 32)
    row = 16 * warp + lane // 4 + (8 if r in (1, 3) else 0)
    col = (lane % 4) * 2 + h + (8 if r >= 2 else 0)
    return row, col


def chunk_xor(row_in_atom, swizzle):
    """The 16-byte chunk XOR of row r of an 8-row swizzle atom (rows `swizzle` bytes apart)."""
    return {0: 0, 32: row_in_atom // 4, 64: row_in_atom // 2, 128: row_in_atom}[swizzle]


class KMajor:
    """An MN×K operand, K-major, in one of the canonical layouts; byte images and descriptors.

    Swizzled (S bytes): atoms of 8 rows × S bytes; atoms along MN ``sbo`` apart, atom columns
    along K ``kcol`` apart; the k16 steps move the descriptor's start (by 32 bytes inside an
    atom row). Unswizzled: 8×16-byte core matrices, ``lbo`` apart along K, ``sbo`` along MN.
    """

    def __init__(self, rows, k, swizzle, lbo=None, sbo=None):
        self.rows, self.k, self.swizzle = rows, k, swizzle
        if swizzle:
            per_row = swizzle // 2
            self.sbo = sbo or 8 * swizzle
            self.kcol = (rows // 8) * self.sbo
            self.lbo = 16  # unused for swizzled K-major
            self.nbytes = -(-k // per_row) * self.kcol
        else:
            self.lbo = lbo or 128
            self.sbo = sbo or (k // 8) * 128
            self.nbytes = max((rows // 8 - 1) * self.sbo + (k // 8 - 1) * self.lbo + 128,
                              rows * k * 2)

    def byte(self, mn, k):
        if not self.swizzle:
            return (mn // 8) * self.sbo + (k // 8) * self.lbo + (mn % 8) * 16 + (k % 8) * 2
        per_row = self.swizzle // 2
        base = (mn // 8) * self.sbo + (k // per_row) * self.kcol + (mn % 8) * self.swizzle
        chunk = ((k % per_row) // 8) ^ chunk_xor(mn % 8, self.swizzle)
        return base + chunk * 16 + (k % 8) * 2

    def step(self, s):
        k0 = 16 * s
        if not self.swizzle:
            return (k0 // 8) * self.lbo
        per_row = self.swizzle // 2
        return (k0 // per_row) * self.kcol + (k0 % per_row) * 2

    def image(self, bits):
        img = np.zeros(self.nbytes // 2, np.uint16)
        for mn in range(self.rows):
            for k in range(self.k):
                img[self.byte(mn, k) // 2] = bits[mn, k]
        return img


class MNMajor(KMajor):
    """An MN×K operand stored MN-major (imm-trans 1). Swizzled: rows along K are S bytes of MN
    (S/2 elements), 8 K-rows form an atom; atoms along MN ``lbo`` apart, along K ``sbo``.
    Unswizzled: 8(K)×8(MN) core matrices (MN contiguous), ``sbo`` apart along MN, ``lbo``
    along K (CUTLASS's canonical GMMA MN-major layouts)."""

    def __init__(self, rows, k, swizzle, lbo=None, sbo=None):
        self.rows, self.k, self.swizzle = rows, k, swizzle
        if swizzle:
            per_row = swizzle // 2
            self.sbo = sbo or 8 * swizzle                       # next 8 K-rows
            self.lbo = lbo or (k // 8) * 8 * swizzle            # next S bytes of MN
            self.nbytes = (-(-rows // per_row)) * self.lbo
        else:
            self.sbo = sbo or 128                               # next 8 MN
            self.lbo = lbo or (rows // 8) * 128                 # next 8 K
            self.nbytes = (k // 8) * self.lbo

    def byte(self, mn, k):
        if not self.swizzle:
            return (mn // 8) * self.sbo + (k // 8) * self.lbo + (k % 8) * 16 + (mn % 8) * 2
        per_row = self.swizzle // 2
        base = (mn // per_row) * self.lbo + (k // 8) * self.sbo + (k % 8) * self.swizzle
        chunk = ((mn % per_row) // 8) ^ chunk_xor(k % 8, self.swizzle)
        return base + chunk * 16 + (mn % 8) * 2

    def step(self, s):
        return (16 * s // 8) * (self.sbo if self.swizzle else self.lbo)


def random_bits(rng, ab, shape):
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    if ab == "f16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation gives exact bf16 values
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---- CPU: descriptors, swizzle, layouts -------------------------------------------------------

def test_descriptor_bit_positions_follow_the_isa_table():
    d = W.encode_descriptor(0x3FFF0, lbo=0x20, sbo=0x400, swizzle=128, base_offset=5)
    assert d & 0x3FFF == 0x3FFF0 >> 4
    assert (d >> 16) & 0x3FFF == 0x2
    assert (d >> 32) & 0x3FFF == 0x40
    assert (d >> 49) & 0x7 == 5
    assert d >> 62 == 1
    for swz, code in ((0, 0), (128, 1), (64, 2), (32, 3)):
        assert W.encode_descriptor(1024, 16, 1024, swz) >> 62 == code
    # reserved bits stay zero
    assert d & ~((0x3FFF) | (0x3FFF << 16) | (0x3FFF << 32) | (7 << 49) | (3 << 62)) == 0


@pytest.mark.parametrize("swz", [0, 32, 64, 128])
def test_descriptor_round_trip(swz):
    rng = np.random.default_rng(7)
    for _ in range(200):
        start, lbo, sbo = (int(v) * 16 for v in rng.integers(0, 2**14, size=3))
        base = int(rng.integers(0, 8))
        d = W.encode_descriptor(start, lbo, sbo, swz, base)
        assert W.decode_descriptor(d) == W.Descriptor(start, lbo, sbo, base, swz)
    d = W.encode_descriptor(2048, 16, 1024, swz)
    assert W.decode_descriptor(d + (32 >> 4)).start == 2048 + 32  # advancing the start


@pytest.mark.parametrize("kwargs,match", [
    ({"start": 8, "lbo": 16, "sbo": 16}, "start address is 8; it must be a multiple of 16"),
    ({"start": 2**18, "lbo": 16, "sbo": 16}, r"start address is 262144; it must lie in"),
    ({"start": 0, "lbo": 24, "sbo": 16}, "leading byte offset is 24"),
    ({"start": 0, "lbo": 16, "sbo": -16}, "stride byte offset is -16"),
    ({"start": 0, "lbo": 16, "sbo": 16, "swizzle": 16}, r"swizzle is 16; it must be one of"),
    ({"start": 0, "lbo": 16, "sbo": 16, "base_offset": 8}, "base_offset is 8"),
])
def test_descriptor_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        W.encode_descriptor(**kwargs)


@pytest.mark.parametrize("swz", [32, 64, 128])
def test_swizzle_is_the_row_chunk_xor_and_a_bijection_per_atom(swz):
    atom = 8 * swz
    addrs = np.arange(4 * atom)
    out = W.swizzle(addrs, swz)
    for a in range(0, 4 * atom, 2):
        row, col = divmod(a % atom, swz)
        chunk, byte = divmod(col, 16)
        want = (a // atom) * atom + row * swz + 16 * (chunk ^ chunk_xor(row, swz)) + byte
        assert out[a] == want == W.swizzle(a, swz)
    for blk in range(4):
        assert sorted(out[blk * atom:(blk + 1) * atom]) == list(range(blk * atom, (blk + 1) * atom))
    assert W.swizzle(12345, 0) == 12345


@pytest.mark.parametrize("mn_major", [False, True], ids=["K-major", "MN-major"])
@pytest.mark.parametrize("swz", [0, 32, 64, 128])
def test_canonical_offsets_match_the_staging_layouts(swz, mn_major):
    rows = 64
    lay = (MNMajor if mn_major else KMajor)(rows, 16, swz)
    mn, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
    lib = W.swizzle(W.canonical_offset(mn, k, swizzle=swz, lbo=lay.lbo, sbo=lay.sbo,
                                       mn_major=mn_major), swz)
    ref = np.vectorize(lay.byte)(mn, k)
    np.testing.assert_array_equal(lib, ref)
    assert len(np.unique(ref)) == rows * 16  # no two elements share a place


def test_register_maps_are_bijections_and_match_the_isa():
    cells8 = {W.a_fragment_position(t, r, j, 1) for t in range(128) for r in range(4)
              for j in range(4)}
    assert cells8 == {(r, c) for r in range(64) for c in range(32)}
    assert all(W.a_fragment_position(t, r, j, 1) == a_position8(t, r, j)
               for t in range(128) for r in range(4) for j in range(4))
    for n in (8, 64, 256):
        cells = {W.accumulator_position(t, i) for t in range(128) for i in range(n // 2)}
        assert cells == {(r, c) for r in range(64) for c in range(n)}
    for t in range(128):
        for i in range(128):
            assert W.accumulator_position(t, i) == acc_position(t, i)
        for r in range(4):
            for h in range(2):
                assert W.a_fragment_position(t, r, h) == a_position(t, r, h)
    # a 64×16 slice of the accumulator converts to the A fragment register by register
    for t in range(128):
        for j in range(2):
            for r in range(4):
                for h in range(2):
                    assert acc_position(t, 8 * j + 2 * r + h) == \
                        (a_position(t, r, h)[0], a_position(t, r, h)[1] + 16 * j)


@pytest.mark.parametrize("swz", [0, 128])
def test_model_on_the_cpu_reads_the_canonical_layouts(swz):
    """The warpgroup model alone, with shared memory a NumPy byte buffer (no simulator)."""
    rng = np.random.default_rng(3)
    n = 32
    la, lb = KMajor(64, 16, swz), KMajor(n, 16, swz)
    a_bits, a = random_bits(rng, "f16", (64, 16))
    b_bits, b = random_bits(rng, "f16", (n, 16))
    mem = np.zeros(65536, np.uint16)
    a0, b0 = 4096, 16384
    mem[a0 // 2:a0 // 2 + la.nbytes // 2] = la.image(a_bits)
    mem[b0 // 2:b0 // 2 + lb.nbytes // 2] = lb.image(b_bits)
    model = W.make_warpgroup_model(n, "f16")
    da = W.encode_descriptor(a0, la.lbo, la.sbo, swz)
    db = W.encode_descriptor(b0, lb.lbo, lb.sbo, swz)
    c = rng.standard_normal((64, n)).astype(np.float32)
    threads = [(tuple(c[acc_position(t, i)] for i in range(n // 2)), None, da, db, 1)
               for t in range(128)]
    out = model(threads, lambda addrs: mem[addrs // 2])
    d = np.zeros((64, n))
    for t in range(128):
        for i in range(n // 2):
            d[acc_position(t, i)] = out[t][i]
    ref = a @ b.T + c
    assert np.abs(d - ref).max() <= 1e-5 * np.abs(ref).max()


# ---- kernels (simulator and GPU) --------------------------------------------------------------

_KERNELS: dict = {}


def make_kernel(n, ab, la, lb, ksteps, rs=False, trans_b=False):
    """One warpgroup: copy the A / B images into shared memory, then ksteps wgmmas."""
    key = (n, ab, type(la), la.swizzle, la.lbo, la.sbo, lb.swizzle, lb.lbo, lb.sbo, ksteps, rs,
           trans_b)
    if key in _KERNELS:
        return _KERNELS[key]
    fn = W.wgmma(n, ab, a_in_registers=rs, trans_b=trans_b)
    nacc = n // 2
    a_words, b_words = max(la.nbytes // 2, 8), lb.nbytes // 2
    swz_a, swz_b = la.swizzle, lb.swizzle
    lbo_a, sbo_a, lbo_b, sbo_b = la.lbo, la.sbo, lb.lbo, lb.sbo
    steps_a = tuple(la.step(s) for s in range(ksteps))
    steps_b = tuple(lb.step(s) for s in range(ksteps))

    n_regs = 4 * ksteps

    @cuda.jit
    def kernel(a_img, b_img, a_regs, c_in, out, scale_d):
        tid = cuda.threadIdx.x
        sa = cuda.shared.array(a_words, uint16, alignment=ALIGN)
        sb = cuda.shared.array(b_words, uint16, alignment=ALIGN)
        for i in range(tid, a_words, THREADS):
            sa[i] = a_img[i]
        for i in range(tid, b_words, THREADS):
            sb[i] = b_img[i]
        W.fence_proxy_async_shared()  # each writer, before the barrier the wgmmas come after
        cuda.syncthreads()
        da = W.matrix_descriptor(shared_addr(sa, 0), lbo_a, sbo_a, swz_a)
        db = W.matrix_descriptor(shared_addr(sb, 0), lbo_b, sbo_b, swz_b)
        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = c_in[tid, i]
        areg = cuda.local.array(n_regs, uint32)  # A fragments: written before the fence
        for i in range(n_regs):
            areg[i] = a_regs[i // 4, tid, i % 4] if rs else 0
        W.wgmma_fence()
        for s in range(ksteps):
            d_b = W.descriptor_advance(db, steps_b[s])
            sd = scale_d if s == 0 else 1
            if rs:
                fn(acc, areg[4 * s], areg[4 * s + 1], areg[4 * s + 2], areg[4 * s + 3], d_b, sd)
            else:
                fn(acc, W.descriptor_advance(da, steps_a[s]), d_b, sd)
        W.wgmma_commit_group()
        W.wgmma_wait_group(0)
        W.wgmma_fence_operand(acc, nacc)
        for i in range(nacc):
            out[tid, i] = acc[i]

    _KERNELS[key] = kernel
    return kernel


def run_case(n, ab, swz, *, ksteps=1, rs=False, trans_b=False, scale_d=1, seed=None,
             lbo=None, sbo=None):
    """Run one warpgroup tile; return (D from the kernel, float64 reference, scale)."""
    rng = np.random.default_rng(seed)
    k = 16 * ksteps
    la = KMajor(64, k, swz, lbo, sbo)
    lb = (MNMajor if trans_b else KMajor)(n, k, swz)
    a_bits, a = random_bits(rng, ab, (64, k))
    b_bits, b = random_bits(rng, ab, (n, k))  # B stored as its transpose, N × K
    c = rng.standard_normal((64, n)).astype(np.float32)
    c_in = np.zeros((THREADS, n // 2), np.float32)
    for t in range(THREADS):
        for i in range(n // 2):
            c_in[t, i] = c[acc_position(t, i)]
    a_regs = np.zeros((ksteps, THREADS, 4), np.uint32)
    for s in range(ksteps):
        for t in range(THREADS):
            for r in range(4):
                lo, hi = (int(a_bits[a_position(t, r, h)[0], 16 * s + a_position(t, r, h)[1]])
                          for h in range(2))
                a_regs[s, t, r] = lo | (hi << 16)
    out = np.full((THREADS, n // 2), np.nan, np.float32)
    kernel = make_kernel(n, ab, la, lb, ksteps, rs, trans_b)
    kernel[1, THREADS](la.image(a_bits), lb.image(b_bits), a_regs, c_in, out, scale_d)
    d = np.zeros((64, n))
    for t in range(THREADS):
        for i in range(n // 2):
            d[acc_position(t, i)] = out[t, i]
    ref = a @ b.T + (c.astype(np.float64) if scale_d else 0)
    mag = np.abs(a) @ np.abs(b.T) + (np.abs(c) if scale_d else 0)
    return d, ref, mag


def check(d, ref, mag, tol):
    assert not np.isnan(d).any(), "some accumulators were never written"
    err = (np.abs(d - ref) / np.maximum(mag, 1e-30)).max()
    assert err <= tol, err


# ---- simulator ---------------------------------------------------------------------------------

SIM_CASES = [  # (n, ab, swizzle, ksteps, rs, trans_b, scale_d)
    (64, "f16", 0, 1, False, False, 1),
    (64, "f16", 32, 1, False, False, 1),
    (64, "bf16", 64, 1, False, False, 1),
    (64, "f16", 128, 2, False, False, 0),
    (256, "bf16", 128, 1, False, False, 1),
    (64, "f16", 128, 1, True, False, 1),
    (64, "f16", 128, 1, False, True, 1),
    (64, "bf16", 0, 2, False, True, 1),
]


def _case_id(c):
    n, ab, swz, ks, rs, tb, sd = c
    return f"n{n}-{ab}-swz{swz}-k{16 * ks}" + ("-rs" if rs else "") + ("-tb" if tb else "") + \
        ("" if sd else "-scale_d0")


@pytest.mark.sim
@pytest.mark.parametrize("case", SIM_CASES, ids=[_case_id(c) for c in SIM_CASES])
def test_twin_matches_numpy(case):
    n, ab, swz, ksteps, rs, trans_b, scale_d = case
    _, seed = fresh_rng()
    d, ref, mag = run_case(n, ab, swz, ksteps=ksteps, rs=rs, trans_b=trans_b, scale_d=scale_d,
                           seed=seed)
    check(d, ref, mag, 1e-6)


@pytest.mark.sim
def test_unswizzled_lbo_and_sbo_are_read_from_the_descriptor():
    """Core matrices stored 'M-first' (LBO = 8 row groups × 128 B, SBO = 128 B), not K-first."""
    _, seed = fresh_rng()
    d, ref, mag = run_case(64, "f16", 0, ksteps=2, lbo=1024, sbo=128, seed=seed)
    check(d, ref, mag, 1e-6)


def _bad_kernel(case):
    @cuda.jit
    def kernel(out):
        tid = cuda.threadIdx.x
        sa = cuda.shared.array(1024, uint16)
        acc = cuda.local.array(4, float32)
        da = W.matrix_descriptor(shared_addr(sa, 0), 16, 128, 0)
        if case == "no_fence":
            W.wgmma(8, "f16")(acc, da, da, 0)
        elif case == "non_uniform":
            W.wgmma_fence()
            W.wgmma(8, "f16")(acc, W.descriptor_advance(da, 16 * (tid // 64)), da, 0)
        elif case == "outside":
            W.wgmma_fence()
            W.wgmma(8, "f16")(acc, W.descriptor_advance(da, 2048 - 256), da, 0)
        out[tid] = acc[0]

    return kernel


@pytest.mark.sim
@pytest.mark.parametrize("case,error,match", [
    ("no_fence", RuntimeError, "no wgmma_fence"),
    ("non_uniform", ValueError, "must be the same in every thread"),
    ("outside", IndexError, "outside the shared array"),
])
def test_misuse_is_a_clear_error(case, error, match):
    with pytest.raises(error, match=match):
        _bad_kernel(case)[1, THREADS](np.zeros(THREADS, np.float32))


@pytest.mark.sim
def test_group_bookkeeping():
    @cuda.jit
    def kernel(out):
        tid = cuda.threadIdx.x
        W.wgmma_commit_group()
        W.wgmma_commit_group()
        if tid == 0:
            out[0] = W.pending_groups()
        W.wgmma_wait_group(1)
        if tid == 0:
            out[1] = W.pending_groups()
        W.wgmma_wait_group(0)
        if tid == 0:
            out[2] = W.pending_groups()
        W.setmaxnreg_dec(40)
        W.setmaxnreg_inc(232)

    out = np.zeros(3, np.int64)
    kernel[1, THREADS](out)
    assert out.tolist() == [2, 1, 0]


# ---- offline compile for sm_90a ----------------------------------------------------------------

COMPILE_CASES = {
    "m64n64_f16_swz128": (64, "f16", 128, 1, False, False),
    "m64n128_f16_swz128_k64": (128, "f16", 128, 4, False, False),
    "m64n192_bf16_swz64": (192, "bf16", 64, 1, False, False),
    "m64n256_f16_swz128": (256, "f16", 128, 1, False, False),
    "m64n128_bf16_rs": (128, "bf16", 0, 1, True, False),
    "m64n128_f16_tb": (128, "f16", 128, 1, False, True),
}


def compile_reports():
    """Offline sm_90a compiles of COMPILE_CASES (``python -m tilepy.offline``)."""
    from numba import types

    from tilepy.offline import compile_kernel
    from tilepy.ptx import asm

    u16, u32, f32 = types.uint16, types.uint32, types.float32
    sig = (u16[:], u16[:], u32[:, :, :], f32[:, :], f32[:, :], types.int32)
    reports = []
    for name, (n, ab, swz, ks, rs, tb) in COMPILE_CASES.items():
        la = KMajor(64, 16 * ks, swz)
        lb = (MNMajor if tb else KMajor)(n, 16 * ks, swz)
        kernel = make_kernel(n, ab, la, lb, ks, rs, tb).py_func
        rep = compile_kernel(name, kernel, sig, (9, 0, "a"))
        lines = [ln.strip() for ln in rep.ptx.splitlines()]
        entry = {"name": name, "registers": rep.registers,
                 "spill": rep.spill_stores + rep.spill_loads, "log": rep.ptxas_log,
                 "target": [ln for ln in lines if ln.startswith(".target")],
                 "mma": [ln.split()[0] for ln in lines if ln.startswith("wgmma.mma_async")],
                 "ops": sorted({ln.split()[0].rstrip(";") for ln in lines
                                if ln.startswith(("wgmma.", "fence.proxy"))})}
        try:
            compile_kernel(name, kernel, sig, (8, 0))
        except asm.UnsupportedTarget as e:
            entry["sm80"] = str(e)
        reports.append(entry)
    return reports


@pytest.fixture(scope="module")
def compiled():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    return run_in_subprocess("tests.test_ptx_wgmma:compile_reports")


@pytest.mark.compile
@pytest.mark.xdist_group("ptx_wgmma_compiled")
@pytest.mark.parametrize("name", sorted(COMPILE_CASES))
def test_sm90a_compile_has_the_wgmma_and_ptxas_accepts_it(compiled, name):
    n, ab, _, ks, _, _ = COMPILE_CASES[name]
    rep = compiled[name]
    assert rep["target"] == [".target sm_90a"], rep["target"]
    assert rep["mma"] == [f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab}"] * ks
    assert {"wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned",
            "wgmma.wait_group.sync.aligned", "fence.proxy.async.shared::cta"} <= set(rep["ops"])
    assert rep["spill"] == 0, rep["log"]
    assert "C7510" not in rep["log"] and "C7511" not in rep["log"], rep["log"]  # serialised
    assert rep["registers"] <= n // 2 + 64, rep["registers"]
    assert "needs compute capability 9.0" in rep.get("sm80", ""), rep


# ---- hardware ----------------------------------------------------------------------------------

GPU_CASES = [  # (n, ab, swizzle, ksteps, rs, trans_b)
    (128, "f16", 0, 2, False, False),
    (128, "f16", 32, 2, False, False),
    (128, "f16", 64, 2, False, False),
    (128, "f16", 128, 4, False, False),
    (128, "bf16", 128, 4, False, False),
    (64, "f16", 128, 1, False, False),
    (192, "f16", 128, 1, False, False),
    (256, "bf16", 128, 2, False, False),
    (128, "f16", 128, 2, True, False),
    (128, "f16", 128, 2, False, True),
    (128, "f16", 0, 2, False, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("scale_d", [1, 0])
@pytest.mark.parametrize("case", GPU_CASES, ids=[_case_id(c + (1,)) for c in GPU_CASES])
def test_gpu_wgmma_matches_numpy(case, scale_d):
    n, ab, swz, ksteps, rs, trans_b = case
    _, seed = fresh_rng()
    d, ref, mag = run_case(n, ab, swz, ksteps=ksteps, rs=rs, trans_b=trans_b, scale_d=scale_d,
                           seed=seed)
    check(d, ref, mag, 1e-5)


# ---- 8-bit floats (e4m3 / e5m2): m64nNk32, both operands K-major ------------------------------

def a_position8(t, r, j):
    """Byte j of A register r (8-bit rs form): the m16n8k32 A fragment of each warp (four
    consecutive k a register), rows + 16·warp."""
    warp, lane = divmod(t, 32)
    return 16 * warp + lane // 4 + 8 * (r % 2), 4 * (lane % 4) + j + 16 * (r // 2)


class KMajor8(KMajor):
    """An MN×K operand of 1-byte elements, K-major: the same 16-byte core-matrix rows (16
    elements each), the same atoms and chunk XOR; a k32 step moves the start by 32 bytes."""

    def __init__(self, rows, k, swizzle):
        self.rows, self.k, self.swizzle = rows, k, swizzle
        if swizzle:
            self.sbo = 8 * swizzle
            self.kcol = (rows // 8) * self.sbo
            self.lbo = 16
            self.nbytes = -(-k // swizzle) * self.kcol
        else:
            self.lbo = 128
            self.sbo = (k // 16) * 128
            self.nbytes = max((rows // 8 - 1) * self.sbo + (k // 16 - 1) * self.lbo + 128, rows * k)

    def byte(self, mn, k):
        if not self.swizzle:
            return (mn // 8) * self.sbo + (k // 16) * self.lbo + (mn % 8) * 16 + k % 16
        base = (mn // 8) * self.sbo + (k // self.swizzle) * self.kcol + (mn % 8) * self.swizzle
        chunk = ((k % self.swizzle) // 16) ^ chunk_xor(mn % 8, self.swizzle)
        return base + chunk * 16 + k % 16

    def step(self, s):
        k0 = 32 * s
        if not self.swizzle:
            return (k0 // 16) * self.lbo
        return (k0 // self.swizzle) * self.kcol + k0 % self.swizzle

    def image(self, bits):
        img = np.zeros(self.nbytes, np.uint8)
        for mn in range(self.rows):
            for k in range(self.k):
                img[self.byte(mn, k)] = bits[mn, k]
        return img


def fp8_bits(rng, kind, shape):
    """Random finite codes of ``kind`` (bits and their values, from the formats' definition)."""
    exp_bits = 4 if kind == "e4m3" else 5
    man = 7 - exp_bits
    bias = (1 << (exp_bits - 1)) - 1
    top = (1 << exp_bits) - 1
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    e = (codes >> man) & top
    m = codes & ((1 << man) - 1)
    bad = (e == top) & ((m == (1 << man) - 1) if kind == "e4m3" else True)  # NaN / inf codes
    codes = np.where(bad, codes & 0x80, codes).astype(np.uint8)
    e = ((codes >> man) & top).astype(np.int64)
    m = (codes & ((1 << man) - 1)).astype(np.int64)
    mag = np.where(e == 0, m * 2.0 ** (1 - bias - man), (1 + m / (1 << man)) * 2.0 ** (e - bias))
    return codes, np.where(codes & 0x80, -mag, mag)


_KERNELS8: dict = {}


def make_kernel8(n, ab, bt, la, lb, ksteps, rs=False):
    key = (n, ab, bt, la.swizzle, lb.swizzle, ksteps, rs)
    if key in _KERNELS8:
        return _KERNELS8[key]
    fn = W.wgmma(n, ab, b_type=bt, a_in_registers=rs)
    n_regs = 4 * ksteps
    nacc = n // 2
    a_bytes, b_bytes = la.nbytes, lb.nbytes
    swz_a, swz_b = la.swizzle, lb.swizzle
    lbo_a, sbo_a, lbo_b, sbo_b = la.lbo, la.sbo, lb.lbo, lb.sbo
    steps_a = tuple(la.step(s) for s in range(ksteps))
    steps_b = tuple(lb.step(s) for s in range(ksteps))

    @cuda.jit
    def kernel(a_img, b_img, a_regs, c_in, out):
        tid = cuda.threadIdx.x
        sa = cuda.shared.array(a_bytes, uint8, alignment=ALIGN)
        sb = cuda.shared.array(b_bytes, uint8, alignment=ALIGN)
        for i in range(tid, a_bytes, THREADS):
            sa[i] = a_img[i]
        for i in range(tid, b_bytes, THREADS):
            sb[i] = b_img[i]
        W.fence_proxy_async_shared()
        cuda.syncthreads()
        da = W.matrix_descriptor(shared_addr(sa, 0), lbo_a, sbo_a, swz_a)
        db = W.matrix_descriptor(shared_addr(sb, 0), lbo_b, sbo_b, swz_b)
        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = c_in[tid, i]
        areg = cuda.local.array(n_regs, uint32)  # A fragments: written before the fence
        for i in range(n_regs):
            areg[i] = a_regs[i // 4, tid, i % 4] if rs else 0
        W.wgmma_fence()
        for s in range(ksteps):
            if rs:
                fn(acc, areg[4 * s], areg[4 * s + 1], areg[4 * s + 2], areg[4 * s + 3],
                   W.descriptor_advance(db, steps_b[s]), 1)
            else:
                fn(acc, W.descriptor_advance(da, steps_a[s]), W.descriptor_advance(db, steps_b[s]),
                   1)
        W.wgmma_commit_group()
        W.wgmma_wait_group(0)
        W.wgmma_fence_operand(acc, nacc)
        for i in range(nacc):
            out[tid, i] = acc[i]

    _KERNELS8[key] = kernel
    return kernel


def run_case8(n, ab, bt, swz, ksteps, rs=False, seed=None):
    rng = np.random.default_rng(seed)
    k = 32 * ksteps
    la, lb = KMajor8(64, k, swz), KMajor8(n, k, swz)
    a_bits, a = fp8_bits(rng, ab, (64, k))
    b_bits, b = fp8_bits(rng, bt, (n, k))
    c = rng.standard_normal((64, n)).astype(np.float32)
    c_in = np.zeros((THREADS, n // 2), np.float32)
    for t in range(THREADS):
        for i in range(n // 2):
            c_in[t, i] = c[acc_position(t, i)]
    a_regs = np.zeros((ksteps, THREADS, 4), np.uint32)
    for s in range(ksteps):
        for t in range(THREADS):
            for r in range(4):
                a_regs[s, t, r] = sum(int(a_bits[a_position8(t, r, j)[0],
                                                 32 * s + a_position8(t, r, j)[1]]) << (8 * j)
                                      for j in range(4))
    out = np.full((THREADS, n // 2), np.nan, np.float32)
    make_kernel8(n, ab, bt, la, lb, ksteps, rs)[1, THREADS](
        la.image(a_bits), lb.image(b_bits), a_regs, c_in, out)
    d = np.zeros((64, n))
    for t in range(THREADS):
        for i in range(n // 2):
            d[acc_position(t, i)] = out[t, i]
    return d, a @ b.T + c, np.abs(a) @ np.abs(b.T) + np.abs(c)


FP8_CASES = [(64, "e4m3", "e4m3", 128, 2), (32, "e5m2", "e5m2", 0, 1),
             (64, "e4m3", "e5m2", 64, 1),
             # A from registers (the attention's P · V): two k32 steps in one swizzle row
             (128, "e4m3", "e4m3", 128, 2, True), (64, "e4m3", "e5m2", 128, 1, True)]


def _fp8_id(c):
    return f"n{c[0]}-{c[1]}.{c[2]}-swz{c[3]}-k{32 * c[4]}" + ("-rs" if c[5:] else "")


@pytest.mark.sim
@pytest.mark.parametrize("case", FP8_CASES, ids=_fp8_id)
def test_fp8_twin_matches_numpy(case):
    _, seed = fresh_rng()
    check(*run_case8(*case, seed=seed), 1e-6)


def test_fp8_forms_refuse_what_the_isa_does_not_have():
    with pytest.raises(ValueError, match="K-major"):
        W.wgmma(64, "e4m3", trans_b=True)
    with pytest.raises(ValueError, match="B must be e4m3 or e5m2"):
        W.wgmma(64, "e4m3", b_type="f16")
    with pytest.raises(ValueError, match="B of the same type"):
        W.wgmma(64, "f16", b_type="bf16")
    assert W.wgmma(64, "e4m3", b_type="e5m2").opcode == \
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e5m2"


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_CASES, ids=_fp8_id)
def test_gpu_fp8_wgmma_matches_numpy(case):
    """The hardware's 8-bit wgmma against float64: products exact, the sums within the
    tensor cores' FP8 accumulation (narrower than float32: DeepGEMM's reason to promote every
    128 of K)."""
    _, seed = fresh_rng()
    check(*run_case8(*case, seed=seed), 1e-3)
