"""ldmatrix / stmatrix: every variant, against NumPy expectations built from the PTX lane table.

Sim tests run small kernels (two warps, one block) through the twins. GPU tests run the same
kernels on hardware and compare bit-exactly with each instruction's ``warp_model`` and with the
same NumPy expectation. The compile test checks the GPU path offline, in a subprocess without
the simulator.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import cuda

from tilepy.ptx import ldmatrix as L
from tilepy.ptx.address import shared_addr
from tilepy.ptx.asm import SIMULATOR

# On the GPU, ldmatrix / stmatrix rows must be 16-byte aligned, so the shared arrays are; the
# simulator refuses alignment= (None passes).
ALIGN = None if SIMULATOR else 16
ROWS = 64  # shared tile rows (8 b16 each); two warps use 32 row addresses each
THREADS = 64  # two warps
SENTINEL = 0xBEEF

LD = [(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)]
IDS = [f"x{n}{'_trans' if t else ''}" for n, t in LD]
F16_SPECIALS = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x7BFF,
                         0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7DFF, 0xFFFF, 0x3C00],
                        dtype=np.uint16)


def ld_fn(n, trans):
    return L.LDMATRIX[f"ldmatrix_x{n}{'_trans' if trans else ''}"]


def st_fn(n, trans):
    return L.STMATRIX[f"stmatrix_x{n}{'_trans' if trans else ''}"]


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**63)
    return np.random.default_rng(seed), seed


# ---- kernels (one factory per kind; n and the function are closure constants) -------------

def make_ld_kernel(fn, n, dtype):
    @cuda.jit
    def kernel(src, perm, regs, addrs):
        tid = cuda.threadIdx.x
        sm = cuda.shared.array((ROWS, 8), dtype, alignment=ALIGN)
        for e in range(tid, ROWS * 8, cuda.blockDim.x):
            sm[e // 8, e % 8] = src[e // 8, e % 8]
        cuda.syncthreads()
        a = shared_addr(sm, (perm[tid], 0))
        if tid % 32 >= 8 * n:
            a = a + 2  # a lane whose address the instruction ignores: misaligned on purpose
        addrs[tid] = a
        if tid == 0:
            addrs[cuda.blockDim.x] = shared_addr(sm, (0, 0))
        if n == 1:
            regs[tid, 0] = fn(a)
        elif n == 2:
            r0, r1 = fn(a)
            regs[tid, 0] = r0
            regs[tid, 1] = r1
        else:
            r0, r1, r2, r3 = fn(a)
            regs[tid, 0] = r0
            regs[tid, 1] = r1
            regs[tid, 2] = r2
            regs[tid, 3] = r3

    return kernel


def make_st_kernel(fn, n):
    @cuda.jit
    def kernel(regs, perm, dst, addrs):
        tid = cuda.threadIdx.x
        sm = cuda.shared.array((ROWS, 8), np.uint16, alignment=ALIGN)
        for e in range(tid, ROWS * 8, cuda.blockDim.x):
            sm[e // 8, e % 8] = SENTINEL
        cuda.syncthreads()
        a = shared_addr(sm, (perm[tid], 0))
        if tid % 32 >= 8 * n:
            a = a + 2
        addrs[tid] = a
        if tid == 0:
            addrs[cuda.blockDim.x] = shared_addr(sm, (0, 0))
        if n == 1:
            fn(a, regs[tid, 0])
        elif n == 2:
            fn(a, regs[tid, 0], regs[tid, 1])
        else:
            fn(a, regs[tid, 0], regs[tid, 1], regs[tid, 2], regs[tid, 3])
        cuda.syncthreads()
        for e in range(tid, ROWS * 8, cuda.blockDim.x):
            dst[e // 8, e % 8] = sm[e // 8, e % 8]

    return kernel


def make_roundtrip_kernel(ld, st, n):
    @cuda.jit
    def kernel(src, perm_src, perm_dst, dst):
        tid = cuda.threadIdx.x
        sm_src = cuda.shared.array((ROWS, 8), np.uint16, alignment=ALIGN)
        sm_dst = cuda.shared.array((ROWS, 8), np.uint16, alignment=ALIGN)
        for e in range(tid, ROWS * 8, cuda.blockDim.x):
            sm_src[e // 8, e % 8] = src[e // 8, e % 8]
            sm_dst[e // 8, e % 8] = SENTINEL
        cuda.syncthreads()
        a = shared_addr(sm_src, (perm_src[tid], 0))
        b = shared_addr(sm_dst, (perm_dst[tid], 0))
        if n == 1:
            r0 = ld(a)
            st(b, r0)
        elif n == 2:
            r0, r1 = ld(a)
            st(b, r0, r1)
        else:
            r0, r1, r2, r3 = ld(a)
            st(b, r0, r1, r2, r3)
        cuda.syncthreads()
        for e in range(tid, ROWS * 8, cuda.blockDim.x):
            dst[e // 8, e % 8] = sm_dst[e // 8, e % 8]

    return kernel


_KERNELS: dict = {}


def kernel_for(kind, *key):
    if (kind, *key) not in _KERNELS:
        make = {"ld": make_ld_kernel, "st": make_st_kernel, "rt": make_roundtrip_kernel}[kind]
        _KERNELS[(kind, *key)] = make(*key)
    return _KERNELS[(kind, *key)]


# ---- independent NumPy expectations (from the PTX lane table) ------------------------------

def matrix(tile_u16, rows):
    """The 8×8 matrix whose row r is tile row rows[r] (uint32 for shifting)."""
    return tile_u16[np.asarray(rows)].astype(np.uint32)


def expect_ld(tile_u16, perm, n, trans):
    """(THREADS, n) registers: lane 4g+t holds M[g,2t] | M[g,2t+1] << 16 (of M.T if trans)."""
    out = np.zeros((THREADS, n), np.uint32)
    for w in range(THREADS // 32):
        for i in range(n):
            m = matrix(tile_u16, perm[32 * w + 8 * i: 32 * w + 8 * i + 8])
            if trans:
                m = m.T
            out[32 * w: 32 * w + 32, i] = (m[:, 0::2] | (m[:, 1::2] << 16)).reshape(32)
    return out


def expect_st(regs, perm, n, trans):
    """The shared tile after stmatrix: the inverse of expect_ld, SENTINEL where unwritten."""
    tile = np.full((ROWS, 8), SENTINEL, np.uint16)
    for w in range(THREADS // 32):
        for i in range(n):
            r = regs[32 * w: 32 * w + 32, i].reshape(8, 4)
            m = np.empty((8, 8), np.uint16)
            m[:, 0::2] = r & 0xFFFF
            m[:, 1::2] = r >> 16
            tile[perm[32 * w + 8 * i: 32 * w + 8 * i + 8]] = m.T if trans else m
    return tile


def bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


# ---- runners (shared by the sim and the GPU tests) -----------------------------------------

def run_ld(n, trans, tile, perm):
    regs = np.zeros((THREADS, 4), np.uint32)
    addrs = np.zeros(THREADS + 1, np.uint64)
    kernel_for("ld", ld_fn(n, trans), n, tile.dtype.type)[1, THREADS](tile, perm, regs, addrs)
    return regs[:, :n], addrs


def run_st(n, trans, regs, perm):
    dst = np.zeros((ROWS, 8), np.uint16)
    addrs = np.zeros(THREADS + 1, np.uint64)
    full = np.zeros((THREADS, 4), np.uint32)
    full[:, :n] = regs
    kernel_for("st", st_fn(n, trans), n)[1, THREADS](full, perm, dst, addrs)
    return dst, addrs


def reader(smem_u16, base):
    data = np.ascontiguousarray(smem_u16).tobytes()

    def read(addr, nbytes):
        off = int(addr) - int(base)
        assert 0 <= off and off + nbytes <= len(data), (hex(int(addr)), nbytes)
        return data[off: off + nbytes]

    return read


def check_ld_model(n, trans, tile, regs, addrs):
    model = ld_fn(n, trans).twin.warp_model
    read = reader(tile, addrs[THREADS])
    for w in range(THREADS // 32):
        got = model([int(a) for a in addrs[32 * w: 32 * w + 32]], read)
        np.testing.assert_array_equal(np.array(got, np.uint32), regs[32 * w: 32 * w + 32])


def check_st_model(n, trans, regs, dst, addrs):
    model = st_fn(n, trans).twin.warp_model
    base = int(addrs[THREADS])
    mem = bytearray(np.full((ROWS, 8), SENTINEL, np.uint16).tobytes())
    for w in range(THREADS // 32):
        lanes = [tuple(int(x) for x in r) for r in regs[32 * w: 32 * w + 32]]
        writes = model([int(a) for a in addrs[32 * w: 32 * w + 32]], lanes)
        assert len(writes) == 8 * n
        for addr, data in writes:
            assert len(data) == 16 and (addr - base) % 16 == 0
            mem[addr - base: addr - base + 16] = data
    np.testing.assert_array_equal(np.frombuffer(bytes(mem), np.uint16).reshape(ROWS, 8), dst)


def random_tile(rng, f16_specials=False):
    tile = rng.integers(0, 2**16, size=(ROWS, 8), dtype=np.uint16)
    if f16_specials:
        where = rng.permutation(ROWS * 8)[: 4 * len(F16_SPECIALS)]
        tile.reshape(-1)[where] = np.resize(F16_SPECIALS, len(where))
        return tile.view(np.float16)
    return tile


def random_perm(rng):
    return rng.permutation(ROWS).astype(np.int32)


# ---- simulator tests -------------------------------------------------------------------------

@pytest.mark.sim
@pytest.mark.parametrize("n,trans", LD, ids=IDS)
def test_ldmatrix_lanes_match_ptx_table(n, trans):
    rng, seed = fresh_rng()
    tile, perm = random_tile(rng), random_perm(rng)
    regs, addrs = run_ld(n, trans, tile, perm)
    np.testing.assert_array_equal(regs, expect_ld(tile, perm, n, trans), err_msg=f"seed {seed}")
    check_ld_model(n, trans, tile, regs, addrs)


@pytest.mark.sim
@pytest.mark.parametrize("n,trans", [(4, False), (4, True), (2, True)], ids=["x4", "x4_trans",
                                                                           "x2_trans"])
def test_ldmatrix_float16_specials_bit_exact(n, trans):
    rng, seed = fresh_rng()
    tile, perm = random_tile(rng, f16_specials=True), random_perm(rng)
    bits(tile)[perm[:2]] = rng.permutation(F16_SPECIALS).reshape(2, 8)  # all in matrix 0
    assert tile.dtype == np.float16
    regs, addrs = run_ld(n, trans, tile, perm)
    expect = expect_ld(bits(tile), perm, n, trans)
    np.testing.assert_array_equal(regs, expect, err_msg=f"seed {seed}")
    # every special value (-0, subnormals, ±inf, NaNs with payloads) came through bit for bit
    halves = np.concatenate([regs & 0xFFFF, regs >> 16]).astype(np.uint16)
    assert set(F16_SPECIALS.tolist()) <= set(halves.reshape(-1).tolist())
    check_ld_model(n, trans, bits(tile), regs, addrs)


@pytest.mark.sim
@pytest.mark.parametrize("n,trans", LD, ids=IDS)
def test_stmatrix_lanes_match_ptx_table(n, trans):
    rng, seed = fresh_rng()
    regs = rng.integers(0, 2**32, size=(THREADS, n), dtype=np.uint32)
    perm = random_perm(rng)
    dst, addrs = run_st(n, trans, regs, perm)
    np.testing.assert_array_equal(dst, expect_st(regs, perm, n, trans), err_msg=f"seed {seed}")
    check_st_model(n, trans, regs, dst, addrs)


def expect_roundtrip(tile, perm_src, perm_dst, n, transpose):
    out = np.full((ROWS, 8), SENTINEL, np.uint16)
    for w in range(THREADS // 32):
        for i in range(n):
            k = slice(32 * w + 8 * i, 32 * w + 8 * i + 8)
            m = tile[perm_src[k]]
            out[perm_dst[k]] = m.T if transpose else m
    return out


def run_roundtrip(ld, st, n, tile, perm_src, perm_dst):
    dst = np.zeros((ROWS, 8), np.uint16)
    kernel_for("rt", ld, st, n)[1, THREADS](tile, perm_src, perm_dst, dst)
    return dst


@pytest.mark.sim
@pytest.mark.parametrize("n,trans", LD, ids=IDS)
def test_ldmatrix_then_stmatrix_gives_back_the_tile(n, trans):
    rng, seed = fresh_rng()
    tile = bits(random_tile(rng, f16_specials=True))
    perm_src, perm_dst = random_perm(rng), random_perm(rng)
    dst = run_roundtrip(ld_fn(n, trans), st_fn(n, trans), n, tile, perm_src, perm_dst)
    np.testing.assert_array_equal(dst, expect_roundtrip(tile, perm_src, perm_dst, n, False),
                                  err_msg=f"seed {seed}")


@pytest.mark.sim
def test_ldmatrix_then_stmatrix_trans_transposes_each_matrix():
    rng, seed = fresh_rng()
    tile = random_tile(rng)
    perm_src, perm_dst = random_perm(rng), random_perm(rng)
    dst = run_roundtrip(L.ldmatrix_x4, L.stmatrix_x4_trans, 4, tile, perm_src, perm_dst)
    np.testing.assert_array_equal(dst, expect_roundtrip(tile, perm_src, perm_dst, 4, True),
                                  err_msg=f"seed {seed}")


# -- errors: one warp, a bad row address on one lane -----------------------------------------

def make_bad_address_kernel(fn, n, load, bad_lane, how):
    @cuda.jit
    def kernel(out):
        tid = cuda.threadIdx.x
        sm = cuda.shared.array((32, 8), np.uint16)
        a = shared_addr(sm, (tid, 0))
        if tid == bad_lane:
            if how == 0:
                a = a + 2  # misaligned
            else:
                a = shared_addr(sm, (31, 0)) + 16  # one row past the end of the array
        if load:
            if n == 1:
                out[tid] = fn(a)
            else:
                r0, r1, r2, r3 = fn(a)
                out[tid] = r0
        else:
            if n == 1:
                fn(a, tid)
            else:
                fn(a, tid, tid, tid, tid)

    return kernel


@pytest.mark.sim
@pytest.mark.parametrize("fn,n,load", [(L.ldmatrix_x4, 4, True), (L.ldmatrix_x1_trans, 1, True),
                                       (L.stmatrix_x4_trans, 4, False), (L.stmatrix_x1, 1, False)],
                         ids=["ldmatrix_x4", "ldmatrix_x1_trans", "stmatrix_x4_trans",
                              "stmatrix_x1"])
@pytest.mark.parametrize("how,error,match", [(0, ValueError, "alignment"),
                                             (1, IndexError, "outside every shared array")],
                         ids=["misaligned", "out_of_range"])
def test_bad_row_address_is_a_clear_error(fn, n, load, how, error, match):
    bad_lane = 8 * n - 3
    kernel = make_bad_address_kernel(fn, n, load, bad_lane, how)
    with pytest.raises(error, match=match) as info:
        kernel[1, 32](np.zeros(32, np.uint32))
    msg = str(info.value)
    assert fn.spec.name in msg and f"lane {bad_lane}:" in msg, msg


@pytest.mark.sim
def test_ignored_lanes_may_hold_any_address():
    # x1 uses lanes 0-7 only: a wild address on lane 20 is not an error (and is not read)
    kernel = make_bad_address_kernel(L.ldmatrix_x1, 1, True, 20, 1)
    kernel[1, 32](np.zeros(32, np.uint32))


@pytest.mark.sim
def test_docstrings_state_the_contract():
    for name, fn in L.ALL.items():
        doc = fn.__doc__
        assert name in doc and "lane" in doc.lower() and "16-byte" in doc, name
    assert "g = lane // 4" in L.__doc__ and "M[2t, g]" in L.__doc__


@pytest.mark.sim
def test_warp_models_are_pure():
    # a tiny check of the models alone, on synthetic addresses: x1, row r at address 16*r
    mem = bytes(range(256))

    def read(addr, nbytes):
        return mem[addr: addr + nbytes]

    addrs = [16 * ln for ln in range(32)]
    regs = L.ldmatrix_x1.twin.warp_model(addrs, read)
    assert regs[5] == (int.from_bytes(mem[16 * 1 + 4: 16 * 1 + 8], "little"),)
    writes = L.stmatrix_x1.twin.warp_model(addrs, [r[0] for r in regs])
    assert writes == [(16 * r, mem[16 * r: 16 * r + 16]) for r in range(8)]
    regs_t = L.ldmatrix_x1_trans.twin.warp_model(addrs, read)
    writes_t = L.stmatrix_x1_trans.twin.warp_model(addrs, regs_t)
    assert writes_t == writes


# ---- offline compile check (GPU path, no simulator) -----------------------------------------

_COMPILE_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, tempfile
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import numpy as np
    from numba import cuda, types
    from tilepy.ptx import asm
    import test_ptx_ldmatrix as T
    assert not T.SIMULATOR
    u16, u32, u64, i32 = types.uint16, types.uint32, types.uint64, types.int32
    ptxs = []
    for (n, trans) in T.LD:
        ld, st = T.ld_fn(n, trans), T.st_fn(n, trans)
        k = T.make_ld_kernel(ld, n, np.uint16).py_func
        ptx, _ = cuda.compile_ptx(k, (u16[:, :], i32[:], u32[:, :], u64[:]), cc=(9, 0))
        op = "ldmatrix.sync.aligned.m8n8.x%d%s.shared.b16" % (n, ".trans" if trans else "")
        assert op in ptx, op
        k = T.make_st_kernel(st, n).py_func
        ptx2, _ = cuda.compile_ptx(k, (u32[:, :], i32[:], u16[:, :], u64[:]), cc=(9, 0))
        op = "stmatrix.sync.aligned.m8n8.x%d%s.shared.b16" % (n, ".trans" if trans else "")
        assert op in ptx2, op
        try:
            cuda.compile_ptx(k, (u32[:, :], i32[:], u16[:, :], u64[:]), cc=(8, 0))
        except asm.UnsupportedTarget as e:
            assert "9.0" in str(e), e
        else:
            raise AssertionError("stmatrix compiled for cc 8.0")
        ptxs += [ptx, ptx2]
    k = T.make_ld_kernel(T.L.ldmatrix_x4, 4, np.float16).py_func
    ptx, _ = cuda.compile_ptx(k, (types.float16[:, :], i32[:], u32[:, :], u64[:]), cc=(8, 0))
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
    k = T.make_roundtrip_kernel(T.L.ldmatrix_x4, T.L.stmatrix_x4_trans, 4).py_func
    ptxs.append(cuda.compile_ptx(k, (u16[:, :], i32[:], i32[:], u16[:, :]), cc=(9, 0))[0])
    from tilepy.offline import find_ptxas
    ptxas = find_ptxas()
    if ptxas:
        with tempfile.TemporaryDirectory() as d:
            for i, p in enumerate(ptxs):
                f = os.path.join(d, "k%d.ptx" % i)
                open(f, "w").write(p)
                r = subprocess.run([ptxas, "-arch=sm_90", f, "-o", os.devnull],
                                   capture_output=True, text=True)
                assert r.returncode == 0, r.stderr
        print("ptxas ok")
    else:
        print("no ptxas")
    print("ok")
""")


@pytest.mark.compile
def test_gpu_path_compiles_and_emits_the_instructions():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    res = subprocess.run([sys.executable, "-c", f"ROOT = {root!r}\n" + _COMPILE_SCRIPT],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr


# ---- hardware: the same kernels, compared bit-exactly with the warp models ------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n,trans", LD, ids=IDS)
def test_gpu_ldmatrix_matches_model(n, trans):
    rng, seed = fresh_rng()
    tile, perm = random_tile(rng, f16_specials=True), random_perm(rng)
    regs, addrs = run_ld(n, trans, tile, perm)
    check_ld_model(n, trans, bits(tile), regs, addrs)
    np.testing.assert_array_equal(regs, expect_ld(bits(tile), perm, n, trans),
                                  err_msg=f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,trans", LD, ids=IDS)
def test_gpu_stmatrix_matches_model(n, trans):
    if cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("stmatrix needs compute capability 9.0")
    rng, seed = fresh_rng()
    regs = rng.integers(0, 2**32, size=(THREADS, n), dtype=np.uint32)
    perm = random_perm(rng)
    dst, addrs = run_st(n, trans, regs, perm)
    check_st_model(n, trans, regs, dst, addrs)
    np.testing.assert_array_equal(dst, expect_st(regs, perm, n, trans), err_msg=f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,trans", LD, ids=IDS)
def test_gpu_ldmatrix_then_stmatrix_gives_back_the_tile(n, trans):
    if cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("stmatrix needs compute capability 9.0")
    rng, seed = fresh_rng()
    tile = bits(random_tile(rng, f16_specials=True))
    perm_src, perm_dst = random_perm(rng), random_perm(rng)
    dst = run_roundtrip(ld_fn(n, trans), st_fn(n, trans), n, tile, perm_src, perm_dst)
    np.testing.assert_array_equal(dst, expect_roundtrip(tile, perm_src, perm_dst, n, False),
                                  err_msg=f"seed {seed}")
