"""mma.sync twins against NumPy (simulator) and hardware against the twins' model (GPU).

The register packing here is written out from the PTX ISA's fragment tables independently of
``tilepy.ptx.fragments``, so a wrong map in the library cannot agree with a wrong test.
"""

import numpy as np
import pytest
from numba import cuda

from tilepy.ptx import asm, fragments, mma
from tilepy.ptx import _sim

# (name, k, input type, accumulator, min_cc)
VARIANTS = [
    ("mma_m16n8k16_f16_f32", 16, "f16", "f32"),
    ("mma_m16n8k16_bf16_f32", 16, "bf16", "f32"),
    ("mma_m16n8k16_f16_f16", 16, "f16", "f16"),
    ("mma_m16n8k8_f16_f32", 8, "f16", "f32"),
    ("mma_m16n8k8_bf16_f32", 8, "bf16", "f32"),
    ("mma_m16n8k8_tf32_f32", 8, "tf32", "f32"),
    ("mma_m16n8k32_s8_s32", 32, "s8", "s32"),
    ("mma_m16n8k32_e4m3_f32", 32, "e4m3", "f32"),
    ("mma_m16n8k32_e5m2_f32", 32, "e5m2", "f32"),
]

PER = {"f16": 2, "bf16": 2, "tf32": 1, "s8": 4, "e4m3": 4, "e5m2": 4}


def test_every_declared_mma_is_tested():
    assert {v[0] for v in VARIANTS} == set(mma.ALL)


# ---- the fragment tables, from the PTX ISA text -------------------------------------------

def a_position(k, per, lane, r, j):
    g, t = lane // 4, lane % 4
    row = g + 8 * (r % 2)
    col = {2: 2 * t + j + (8 if k == 16 else 0) * (r // 2),
           1: t + 4 * (r // 2),
           4: 4 * t + j + 16 * (r // 2)}[per]
    return row, col


def b_position(k, per, lane, r, j):
    g, t = lane // 4, lane % 4
    row = {2: 2 * t + j + 8 * r, 1: t + 4 * r, 4: 4 * t + j + 16 * r}[per]
    return row, g


def c_position(acc, lane, r, j=0):
    g, t = lane // 4, lane % 4
    if acc == "f16":
        return g + 8 * r, 2 * t + j
    return g + 8 * (r // 2), 2 * t + r % 2


# ---- random operands as element bit patterns ----------------------------------------------

def _fp8_encode_table(exp_bits):
    from tilepy.ptx.mma import _fp8_table

    return _fp8_table(exp_bits)


def random_operand(rng, ab, shape, specials):
    """(bit patterns as unsigned ints of the element width, float64/int64 values)."""
    if ab == "f16":
        x = (rng.standard_normal(shape) * 2).astype(np.float16)
        if specials:
            flat = x.reshape(-1)
            flat[:5] = [np.float16(-0.0), np.float16(6e-8), np.float16(-3e-6),
                        np.float16(np.inf), np.float16(np.nan)]
        return x.view(np.uint16), x.astype(np.float64)
    if ab == "bf16":
        f = (rng.standard_normal(shape) * 2).astype(np.float32)
        if specials:
            f.reshape(-1)[:4] = [-0.0, 1e-39, np.inf, np.nan]
        bits = np.vectorize(_sim.f32_to_bf16_bits, otypes=[np.uint16])(f)
        vals = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return bits, vals
    if ab == "tf32":
        f = rng.standard_normal(shape).astype(np.float32)
        bits = f.view(np.uint32) & np.uint32(0xFFFFE000)  # exact tf32 values
        if specials:
            bits.reshape(-1)[:3] = [0x80000000, 0x7F800000, 0x7FC00000]
        return bits, bits.view(np.float32).astype(np.float64)
    if ab == "s8":
        v = rng.integers(-128, 128, size=shape).astype(np.int8)
        return v.view(np.uint8), v.astype(np.int64)
    table = _fp8_encode_table(4 if ab == "e4m3" else 5)
    bits = rng.integers(0, 256, size=shape).astype(np.uint8)
    if not specials:  # avoid NaN / inf codes
        bits = np.where(np.isfinite(table[bits]), bits, np.uint8(0x38))
    return bits, table[bits]


def pack(bits, k, per, position, nregs):
    """(32, nregs) uint32 registers from an element-bit matrix using a position table."""
    width = 32 // per
    regs = np.zeros((32, nregs), dtype=np.uint64)
    for lane in range(32):
        for r in range(nregs):
            for j in range(per):
                row, col = position(k, per, lane, r, j)
                regs[lane, r] |= np.uint64(int(bits[row, col])) << np.uint64(width * j)
    return regs.astype(np.uint32)


def make_case(name, k, ab, acc, seed, specials=False):
    """(A·B registers, accumulator registers, float64 reference, magnitude of the terms)."""
    rng = np.random.default_rng(seed)
    per = PER[ab]
    a_bits, a = random_operand(rng, ab, (16, k), specials)
    b_bits, b = random_operand(rng, ab, (k, 8), specials)
    a_regs = pack(a_bits, k, per, a_position, 16 * k // 32 // per)
    b_regs = pack(b_bits, k, per, b_position, k * 8 // 32 // per)
    if acc == "f32":
        c = rng.standard_normal((16, 8)).astype(np.float32)
        accs = np.zeros((32, 4), np.float32)
        for lane in range(32):
            for r in range(4):
                accs[lane, r] = c[c_position(acc, lane, r)]
        ref = a @ b + c.astype(np.float64)
        mag = np.abs(a) @ np.abs(b) + np.abs(c.astype(np.float64))
    elif acc == "s32":
        c = rng.integers(-2**20, 2**20, size=(16, 8)).astype(np.int32)
        accs = np.zeros((32, 4), np.int32)
        for lane in range(32):
            for r in range(4):
                accs[lane, r] = c[c_position(acc, lane, r)]
        ref = a @ b + c.astype(np.int64)
        mag = None
    else:
        c = rng.standard_normal((16, 8)).astype(np.float16)
        accs = np.zeros((32, 2), np.uint32)
        for lane in range(32):
            for r in range(2):
                lo = int(c[c_position(acc, lane, r, 0)].view(np.uint16))
                hi = int(c[c_position(acc, lane, r, 1)].view(np.uint16))
                accs[lane, r] = lo | (hi << 16)
        ref = a @ b + c.astype(np.float64)
        mag = np.abs(a) @ np.abs(b) + np.abs(c.astype(np.float64))
    return np.concatenate([a_regs, b_regs], axis=1), accs, ref, mag


def unpack_d(acc, out):
    d = np.zeros((16, 8), dtype=np.float64 if acc != "s32" else np.int64)
    for lane in range(32):
        if acc == "f16":
            halves = out[lane].astype(np.uint32).view(np.uint16).view(np.float16)
            for r in range(2):
                for j in range(2):
                    d[c_position(acc, lane, r, j)] = halves[2 * r + j]
        else:
            for r in range(4):
                d[c_position(acc, lane, r)] = out[lane, r]
    return d


_KERNELS = {}


def kernel_for(name):
    """A one-warp kernel: out[lane] = mma(regs[lane], accs[lane]) (generated for the arity)."""
    if name in _KERNELS:
        return _KERNELS[name]
    fn, spec = asm.REGISTRY[name]
    n_ab = len(spec.ins) - len(spec.tie)
    n_c = len(spec.tie)
    args = [f"regs[l, {i}]" for i in range(n_ab)] + [f"accs[l, {i}]" for i in range(n_c)]
    src = ["def k(regs, accs, out):", "    l = cuda.threadIdx.x",
           f"    r = fn({', '.join(args)})"]
    src += [f"    out[l, {i}] = r[{i}]" for i in range(n_c)]
    ns = {"fn": fn, "cuda": cuda}
    exec(compile("\n".join(src) + "\n", f"<mma test {name}>", "exec"), ns)
    _KERNELS[name] = cuda.jit(ns["k"])
    return _KERNELS[name]


def run_mma(name, acc, regs, accs):
    out = np.full(accs.shape, 0x7FC0DEAD if acc == "f16" else -12345, dtype=accs.dtype)
    kernel_for(name)[1, 32](regs, accs, out)
    return out


def check_close(acc, d, ref, rtol, mag=None):
    if acc == "s32":
        assert np.array_equal(d, ((ref + 2**31) % 2**32 - 2**31))
        return
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(d), nan), "NaN positions differ"
    fin = ~nan
    scale = np.maximum(np.abs(ref[fin]) if mag is None else mag[fin], 1e-30)
    inf = np.isinf(ref[fin])
    assert np.array_equal(d[fin][inf], ref[fin][inf])
    err = np.abs(d[fin][~inf] - ref[fin][~inf]) / scale[~inf]
    assert err.max(initial=0) <= rtol, err.max()


@pytest.mark.sim
@pytest.mark.parametrize("specials", [False, True], ids=["random", "specials"])
@pytest.mark.parametrize("name,k,ab,acc", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_twin_matches_numpy(name, k, ab, acc, specials):
    seed = np.random.SeedSequence().entropy % 2**32
    regs, accs, ref, _ = make_case(name, k, ab, acc, seed, specials)
    d = unpack_d(acc, run_mma(name, acc, regs, accs))
    rtol = 2e-3 if acc == "f16" else 1e-6
    check_close(acc, d, ref, rtol)


@pytest.mark.parametrize("per,k", [(2, 16), (2, 8), (1, 8), (4, 32)])
def test_fragment_maps_are_bijections_and_match_the_isa(per, k):
    for fmap, shape, pos in ((fragments.a_map(k, per), (16, k), a_position),
                             (fragments.b_map(k, per), (k, 8), b_position)):
        cells = {(row, col) for _, _, _, row, col in fmap}
        assert len(fmap) == shape[0] * shape[1] == len(cells)
        assert all(0 <= r < shape[0] and 0 <= c < shape[1] for r, c in cells)
        for lane, r, j, row, col in fmap:
            assert pos(k, per, lane, r, j) == (row, col)
    for per_c, acc in ((1, "f32"), (2, "f16")):
        fmap = fragments.c_map(per_c)
        assert len({(row, col) for *_, row, col in fmap}) == 128 == len(fmap)
        for lane, r, j, row, col in fmap:
            assert c_position(acc, lane, r, j) == (row, col)


@pytest.mark.gpu
@pytest.mark.parametrize("name,k,ab,acc", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_hardware_matches_twin_model(name, k, ab, acc):
    fn, spec = asm.REGISTRY[name]
    if spec.min_cc and cuda.get_current_device().compute_capability < spec.min_cc:
        pytest.skip(f"{name} needs compute capability {spec.min_cc}")
    seed = np.random.SeedSequence().entropy % 2**32
    regs, accs, ref, mag = make_case(name, k, ab, acc, seed, specials=False)
    out = run_mma(name, acc, regs, accs)
    lanes = [tuple(regs[ln]) + tuple(accs[ln]) for ln in range(32)]
    model = np.array(fn.twin.warp_model(lanes), dtype=accs.dtype)
    d_hw, d_model = unpack_d(acc, out), unpack_d(acc, model)
    if acc == "s32":
        assert np.array_equal(d_hw, d_model)
    else:
        # Hardware accumulates with its own internal rounding: equal up to a few fp32 ulps of
        # the magnitude of the summed terms, sum |a·b| + |c| (f16 accumulation: f16 ulps).
        scale = np.maximum(mag, 1e-30)
        tol = 1e-2 if acc == "f16" else 1e-5
        assert (np.abs(d_hw - d_model) / scale).max() <= tol
        check_close(acc, d_hw, ref, tol, mag)
