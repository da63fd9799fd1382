"""Warp shuffles (tilepy.ptx.shuffle): simulator twins against NumPy, hardware against models.

The expectations here are written out independently of tilepy's ``source_lane`` rule, from
the PTX ISA's pseudocode (b = argument & 31; up: lane - b, valid when >= 0; down: lane + b,
valid when <= 31; bfly: lane ^ b; idx: b; an invalid source lane means the lane keeps its
value). Values are compared as bit patterns, so -0.0, NaN payloads and subnormals count.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from tilepy.ptx import shuffle
from tilepy.ptx.shuffle import shfl_down, shfl_idx, shfl_up, shfl_xor

FNS = {"shfl_xor": shfl_xor, "shfl_down": shfl_down, "shfl_up": shfl_up, "shfl_idx": shfl_idx}

# Arguments used for every function: in range, 0, 31, and out of range (>= 32, negative,
# and a huge one whose low five bits are 3).
ARGS = {
    "shfl_xor": [0, 1, 2, 4, 8, 16, 31, 5, 32, 33, -1, 2**31 + 3],
    "shfl_down": [0, 1, 2, 7, 16, 31, 32, 33, 40, -1],
    "shfl_up": [0, 1, 3, 16, 31, 32, 33, 47, -1],
    "shfl_idx": [0, 1, 17, 31, 32, 33, 63, -1, -32],
}

# float32 bit patterns with the special cases: ±0, ±inf, quiet and signalling NaNs with
# payloads and both signs, ±subnormals (smallest, largest), ±min normal, ±max, ordinary values.
SPECIAL_F32_BITS = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
    0x7FA5A5A5, 0xFFBFFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000,
    0x80800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000, 0x40490FDB, 0x00012345,
    0x7FFFFFFF, 0xFFFFFFFF, 0x3EAAAAAB, 0xC2F6E979, 0x33800000, 0x4B000001, 0x12345678,
    0x87654321, 0x5F3759DF, 0x00400000, 0x80400000,
]


def _values(dtype, nthreads, seed):
    rng = np.random.default_rng(seed)
    if dtype == np.float32:
        bits = np.array(SPECIAL_F32_BITS * (nthreads // 32), dtype=np.uint32)
        rng.shuffle(bits)
        return bits.view(np.float32)
    if dtype == np.int32:
        v = rng.integers(-(2**31), 2**31, size=nthreads, dtype=np.int64).astype(np.int32)
        v[:4] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max, -1, 0]
        return v
    v = rng.integers(0, 2**32, size=nthreads, dtype=np.uint64).astype(np.uint32)
    v[:3] = [0xFFFFFFFF, 0x80000000, 0]
    return v


def expected(name, values, args):
    """NumPy expectation; ``args`` has one entry per thread. Warps are independent."""
    n = len(values)
    tid = np.arange(n)
    lane, base = tid % 32, tid - tid % 32
    b = np.asarray(args, dtype=np.int64) & 31
    if name == "shfl_xor":
        src = lane ^ b
    elif name == "shfl_down":
        src = np.where(lane + b <= 31, lane + b, lane)
    elif name == "shfl_up":
        src = np.where(lane - b >= 0, lane - b, lane)
    else:
        src = b
    return values[base + src]


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype.itemsize == 4 else a


# ---- kernels (shared by the simulator and the GPU tests) -----------------------------------

def _sweep_kernel(fn):
    """out[r, t] = fn(vals[t], args[r]) for every argument r (one collective per r)."""

    def k(vals, args, out):
        t = cuda.threadIdx.x
        v = vals[t]
        for r in range(args.shape[0]):
            out[r, t] = fn(v, args[r])

    return cuda.jit(k)


def _per_lane_kernel(fn):
    """out[t] = fn(vals[t], args[t]): each lane its own argument."""

    def k(vals, args, out):
        t = cuda.threadIdx.x
        out[t] = fn(vals[t], args[t])

    return cuda.jit(k)


_KERNELS = {}


def _kernel(kind, name):
    key = (kind, name)
    if key not in _KERNELS:
        _KERNELS[key] = (_sweep_kernel if kind == "sweep" else _per_lane_kernel)(FNS[name])
    return _KERNELS[key]


def run_sweep(name, dtype, nthreads=32, seed=0):
    vals = _values(dtype, nthreads, seed)
    args = np.array(ARGS[name], dtype=np.int64)
    out = np.zeros((len(args), nthreads), dtype=dtype)
    _kernel("sweep", name)[1, nthreads](vals, args, out)
    return vals, args, out


def run_per_lane(name, dtype, args, nthreads=64, seed=1):
    vals = _values(dtype, nthreads, seed)
    args = np.asarray(args, dtype=np.int32)
    out = np.zeros(nthreads, dtype=dtype)
    _kernel("lane", name)[1, nthreads](vals, args, out)
    return vals, out


def _check_sweep(name, vals, args, out):
    for r, a in enumerate(args):
        want = expected(name, vals, [a] * len(vals))
        got = out[r]
        bad = np.nonzero(_bits(got) != _bits(want))[0]
        assert bad.size == 0, (
            f"{name}(…, {a}) {vals.dtype}: threads {bad[:8].tolist()} got "
            f"{[hex(x) for x in _bits(got)[bad[:8]]]} want {[hex(x) for x in _bits(want)[bad[:8]]]}")


def _per_lane_args(name, nthreads, seed=2):
    rng = np.random.default_rng(seed)
    if name == "shfl_xor":
        return rng.integers(0, 32, nthreads)
    if name == "shfl_idx":
        return rng.integers(-40, 80, nthreads)
    return rng.integers(0, 40, nthreads)


# ---- pure models (no kernel) ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FNS))
def test_warp_model_matches_the_ptx_rule(name):
    model = FNS[name].twin.warp_model
    vals = np.arange(100, 132, dtype=np.int32)
    for a in ARGS[name]:
        got = model(list(vals), a)
        assert [int(x) for x in got] == expected(name, vals, [a] * 32).tolist(), (name, a)
    per_lane = _per_lane_args(name, 32)
    got = model(list(vals), per_lane)
    assert [int(x) for x in got] == expected(name, vals, per_lane).tolist()


def test_warp_model_keeps_the_objects():
    vals = [np.float32(i) for i in range(32)]
    out = shfl_xor.twin.warp_model(vals, 1)
    assert all(type(x) is np.float32 for x in out) and out[0] is vals[1]


def test_warp_model_refuses_a_partial_warp():
    with pytest.raises(ValueError, match="32 lanes"):
        shfl_idx.twin.warp_model([1, 2, 3], 0)
    with pytest.raises(ValueError, match="arguments"):
        shfl_idx.twin.warp_model(list(range(32)), [0] * 31)


def test_ptx_text_has_the_clamps_the_isa_wants():
    assert shuffle.ptx_template("shfl_xor") == "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;"
    assert shuffle.ptx_template("shfl_down") == "shfl.sync.down.b32 $0, $1, $2, 0x1f, 0xffffffff;"
    assert shuffle.ptx_template("shfl_up") == "shfl.sync.up.b32 $0, $1, $2, 0x0, 0xffffffff;"
    assert shuffle.ptx_template("shfl_idx") == "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;"


# ---- simulator ------------------------------------------------------------------------------

@pytest.mark.sim
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint32], ids=["f32", "i32", "u32"])
@pytest.mark.parametrize("name", sorted(FNS))
def test_sim_sweep_of_arguments_is_bit_exact(name, dtype):
    vals, args, out = run_sweep(name, dtype)
    _check_sweep(name, vals, args, out)


@pytest.mark.sim
@pytest.mark.parametrize("name", sorted(FNS))
def test_sim_per_lane_arguments_and_two_warps_do_not_mix(name):
    args = _per_lane_args(name, 64)
    vals, out = run_per_lane(name, np.float32, args)
    want = expected(name, vals, args)
    assert (_bits(out) == _bits(want)).all()
    # Warp 1 only ever sees warp 1's values.
    assert set(_bits(out[32:]).tolist()) <= set(_bits(vals[32:]).tolist())


@pytest.mark.sim
def test_sim_idx_zero_broadcasts_within_each_warp():
    vals = np.arange(64, dtype=np.int32) * 3 + 1
    out = np.zeros(64, dtype=np.int32)
    _kernel("lane", "shfl_idx")[1, 64](vals, np.zeros(64, np.int32), out)
    assert (out[:32] == vals[0]).all() and (out[32:] == vals[32]).all()


@pytest.mark.sim
def test_sim_twins_return_the_input_type():
    seen = []

    @cuda.jit
    def k(f, i, u):
        t = cuda.threadIdx.x
        a = shfl_xor(f[t], 1)
        b = shfl_down(i[t], 1)
        c = shfl_up(u[t], 1)
        d = shfl_idx(t, 3)  # a plain int in the simulator (int32 on the GPU)
        if t == 0:
            seen.extend([type(a), type(b), type(c), type(d), d])

    k[1, 32](np.ones(32, np.float32), np.ones(32, np.int32), np.ones(32, np.uint32))
    assert seen == [np.float32, np.int32, np.uint32, int, 3]


@pytest.mark.sim
@pytest.mark.parametrize("bad", [np.float64(1.0), 1.0, np.int64(1), np.float16(1.0), True])
def test_sim_refuses_other_value_types(bad):
    @cuda.jit
    def k(out):
        out[cuda.threadIdx.x] = shfl_xor(bad, 1)

    with pytest.raises(TypeError, match=r"shfl_xor\(value, lane_mask\).*float32, int32 or uint32"):
        k[1, 32](np.zeros(32, np.float32))


@pytest.mark.sim
def test_sim_refuses_a_float_lane_argument():
    @cuda.jit
    def k(out):
        out[cuda.threadIdx.x] = shfl_down(np.float32(1), 1.0)

    with pytest.raises(TypeError, match=r"shfl_down.*delta must be an integer"):
        k[1, 32](np.zeros(32, np.float32))


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint32], ids=["f32", "i32", "u32"])
@pytest.mark.parametrize("name", sorted(FNS))
def test_gpu_sweep_matches_the_model(name, dtype):
    vals, args, out = run_sweep(name, dtype, nthreads=64)
    model = FNS[name].twin.warp_model
    for r, a in enumerate(args):
        want = np.concatenate([np.array(model(list(vals[w:w + 32]), a), dtype=dtype)
                               for w in (0, 32)])
        assert (_bits(out[r]) == _bits(want)).all(), (
            name, int(a), [hex(x) for x in _bits(out[r])], [hex(x) for x in _bits(want)])
    _check_sweep(name, vals, args, out)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FNS))
def test_gpu_per_lane_arguments_match_the_model(name):
    args = _per_lane_args(name, 64)
    for dtype in (np.float32, np.int32, np.uint32):
        vals, out = run_per_lane(name, dtype, args)
        model = FNS[name].twin.warp_model
        want = np.concatenate([np.array(model(list(vals[w:w + 32]), args[w:w + 32]), dtype=dtype)
                               for w in (0, 32)])
        assert (_bits(out) == _bits(want)).all(), (name, dtype)


@pytest.mark.gpu
def test_gpu_refuses_other_value_types_at_typing():
    from numba.core.errors import TypingError

    @cuda.jit
    def k(out):
        out[0] = shfl_xor(out[0], 1)

    with pytest.raises(TypingError, match=r"shfl_xor\(value, lane_mask\).*float32, int32 or uint32"):
        k[1, 32](cuda.to_device(np.zeros(32, np.float64)))
