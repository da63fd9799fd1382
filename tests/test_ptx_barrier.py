"""Named barriers (bar.sync / bar.arrive id, count) and the vector shared/global moves: their
simulator twins (they really block until ``count`` threads arrived, per id; producer → consumer
ordering through bar.arrive) and their offline sm_90a compile."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ptx import _sim
from tilepy.ptx import barrier as B
from tilepy.ptx import global_vector as GV
from tilepy.ptx import vector as V
from tilepy.ptx.address import global_addr, shared_addr

ROUNDS = 3


def two_warpgroups(counts, seen):
    """256 threads: each warpgroup counts its arrivals in its own shared counter, syncs on its
    own barrier (ids 1 and 2, 128 threads), then reads the counter — which must hold all 128
    arrivals of this round. Then warpgroup 0 publishes a value and signals warpgroup 1 with
    bar.arrive on id 3 (256 threads: 128 arrive, 128 wait), which must see it, and answers on
    id 4 the same way before the next round overwrites it. Three rounds reuse the barriers
    (generations)."""
    tid = cuda.threadIdx.x
    wg = tid // 128
    box = cuda.shared.array(4, np.int32)
    if tid == 0:
        for i in range(4):
            box[i] = 0
    cuda.syncthreads()
    for rnd in range(ROUNDS):
        cuda.atomic.add(box, wg, 1)
        B.bar_sync(1 + wg, 128)
        seen[rnd, tid, 0] = box[wg] - 128 * rnd
        B.bar_sync(1 + wg, 128)             # every read done before the next round adds
        if wg == 0:
            if tid == 0:
                box[2] = 1000 + rnd
            B.bar_sync(1, 128)              # thread 0's store before the group's arrive
            B.bar_arrive(3, 256)
            B.bar_sync(4, 256)              # warpgroup 1 has read it: next round may write
        else:
            B.bar_sync(3, 256)
            seen[rnd, tid, 1] = box[2]
            B.bar_arrive(4, 256)
    counts[tid] = box[wg]


@pytest.mark.sim
def test_two_warpgroups_on_different_ids_are_ordered():
    counts = np.zeros(256, np.int32)
    seen = np.full((ROUNDS, 256, 2), -1, np.int32)
    cuda.jit(two_warpgroups)[1, 256](counts, seen)
    assert (seen[:, :, 0] == 128).all(), np.unique(seen[:, :, 0])
    for rnd in range(ROUNDS):
        assert (seen[rnd, 128:, 1] == 1000 + rnd).all(), np.unique(seen[rnd, 128:, 1])
    assert (counts == 128 * ROUNDS).all()


def too_few(out):
    """Only warp 0 arrives on a 64-thread barrier: it must block (and time out here)."""
    if cuda.threadIdx.x < 32:
        B.bar_sync(5, 64)
        out[cuda.threadIdx.x] = 1


@pytest.mark.sim
def test_bar_sync_blocks_until_count_threads_arrived(monkeypatch):
    monkeypatch.setattr(_sim, "WAIT_TIMEOUT", 0.5)
    out = np.zeros(64, np.int32)
    with pytest.raises(RuntimeError, match="only 32 of the 64 threads arrived on barrier 5"):
        cuda.jit(too_few)[1, 64](out)
    assert not out.any()


def bad_args(which, out):
    if which[0] == 0:
        B.bar_sync(0, 64)
    elif which[0] == 1:
        B.bar_sync(1, 48)
    else:
        B.bar_sync(1, 96)
    out[0] = 1


@pytest.mark.sim
@pytest.mark.parametrize("which,match", [(0, "named barriers are 1"),
                                         (1, "multiple of 32"), (2, "32 … 64")])
def test_twin_refuses_bad_ids_and_counts(which, match):
    with pytest.raises(ValueError, match=match):
        cuda.jit(bad_args)[1, 64](np.array([which], np.int32), np.zeros(1, np.int32))


def vector_moves(src, out16, out32):
    """Stage through shared memory with the vector moves: 4- and 8-byte stores in, 16-byte loads
    out, 16-byte global stores."""
    tid = cuda.threadIdx.x
    sm = cuda.shared.array(64, np.uint32)
    base = shared_addr(sm, 0)
    V.st_shared_b32(base + 4 * tid, src[tid])
    cuda.syncthreads()
    if tid < 8:
        w0, w1, w2, w3 = V.ld_shared_v4_b32(base + 16 * tid)
        V.st_global_v4_b32(global_addr(out16, 4 * tid), w0, w1, w2, w3)
    cuda.syncthreads()
    if tid < 16:
        V.st_shared_v2_f32(base + 8 * tid, np.float32(tid), np.float32(-tid))
    cuda.syncthreads()
    if tid < 8:
        x0, x1, x2, x3 = V.ld_shared_v4_f32(base + 16 * tid)
        V.st_global_v4_f32(global_addr(out32, 4 * tid), x0, x1, x2, x3)


@pytest.mark.sim
def test_vector_moves_round_trip():
    src = np.arange(32, dtype=np.uint32) * np.uint32(0x01010101)
    out16 = np.zeros(32, np.uint32)
    out32 = np.zeros(32, np.float32)
    cuda.jit(vector_moves)[1, 32](src, out16, out32)
    assert (out16 == src).all()
    want = np.stack([np.arange(16), -np.arange(16)], 1).reshape(-1).astype(np.float32)
    assert (out32 == want).all()


def pair_moves(out):
    tid = cuda.threadIdx.x
    sm = cuda.shared.array(64, np.float32)
    base = shared_addr(sm, 0)
    V.st_shared_v2_f32(base + 8 * tid, np.float32(tid), np.float32(0.5) - tid)
    cuda.syncthreads()
    x, y = V.ld_shared_v2_f32(base + 8 * (31 - tid))   # another thread's pair
    out[tid, 0] = x
    out[tid, 1] = y


@pytest.mark.sim
def test_shared_float_pairs_round_trip():
    out = np.full((32, 2), np.nan, np.float32)
    cuda.jit(pair_moves)[1, 32](out)
    src = 31 - np.arange(32, dtype=np.float32)
    assert (out[:, 0] == src).all() and (out[:, 1] == 0.5 - src).all()


def global_vector_copy(src, dst):
    tid = cuda.threadIdx.x
    w0, w1, w2, w3 = V.ld_global_v4_b32(global_addr(src, 4 * tid))
    V.st_global_v4_b32(global_addr(dst, 4 * (7 - tid)), w3, w2, w1, w0)


@pytest.mark.sim
def test_global_vector_load_round_trip():
    src = np.arange(32, dtype=np.uint32) * np.uint32(3)
    dst = np.zeros(32, np.uint32)
    cuda.jit(global_vector_copy)[1, 8](src, dst)
    assert (dst == src[::-1]).all()


def wide_shared_moves(src, out, scalars):
    """16-byte shared stores of another thread's words, and a float32 read of each word."""
    tid = cuda.threadIdx.x
    sm = cuda.shared.array(32, np.uint32)
    base = shared_addr(sm, 0)
    j = 4 * (7 - tid)
    V.st_shared_v4_b32(base + 16 * tid, src[j], src[j + 1], src[j + 2], src[j + 3])
    cuda.syncthreads()
    for q in range(4):
        out[4 * tid + q] = sm[4 * tid + q]
        scalars[4 * tid + q] = V.ld_shared_f32(base + 4 * (31 - 4 * tid - q))


@pytest.mark.sim
def test_wide_shared_store_and_scalar_load():
    src = np.random.default_rng().integers(0, 2 ** 32, 32, dtype=np.uint32)
    out = np.zeros(32, np.uint32)
    scalars = np.full(32, np.nan, np.float32)
    cuda.jit(wide_shared_moves)[1, 8](src, out, scalars)
    want = src.reshape(8, 4)[::-1].reshape(-1)
    assert (out == want).all()
    np.testing.assert_array_equal(scalars.view(np.uint32), want[::-1])


def misaligned(out):
    sm = cuda.shared.array(16, np.uint32)
    V.ld_shared_v4_b32(shared_addr(sm, 1))
    out[0] = 1


@pytest.mark.sim
def test_vector_twin_refuses_misaligned_address():
    with pytest.raises(ValueError, match="16-byte alignment"):
        cuda.jit(misaligned)[1, 1](np.zeros(1, np.int32))


def pair_stores(out, aligned):
    """Thread t writes the pair (t, t + 1000) at column 2 · (t % 4) of row t // 4 of a uint16
    array whose rows are 9 elements wide: one 4-byte store where the pair's address is
    4-byte aligned (even rows), two 2-byte stores where not."""
    t = cuda.threadIdx.x
    r, c = t // 4, 2 * (t % 4)
    word = np.uint32(t) | (np.uint32(t + 1000) << np.uint32(16))
    ok = GV.pair_aligned(out, r, c)
    aligned[t] = 1 if ok else 0
    if ok:
        GV.st_global_pair(out, r, c, word)
    else:
        out[r, c] = t
        out[r, c + 1] = t + 1000


@pytest.mark.sim
def test_pair_store_where_aligned():
    """``pair_aligned`` tells the 4-byte aligned pairs of an odd-width uint16 array (every
    other row) and ``st_global_pair`` writes both halves, the low one at the lower column;
    its twin refuses a misaligned pair."""
    out = np.zeros((8, 9), np.uint16)
    aligned = np.zeros(32, np.int32)
    cuda.jit(pair_stores)[1, 32](out, aligned)
    t = np.arange(32)
    np.testing.assert_array_equal(aligned, (t // 4 + 1) % 2)
    np.testing.assert_array_equal(out[t // 4, 2 * (t % 4)], t)
    np.testing.assert_array_equal(out[t // 4, 2 * (t % 4) + 1], t + 1000)
    assert not out[:, 8].any()
    with pytest.raises(ValueError, match="4-byte alignment"):
        GV.st_global_pair.twin(np.zeros((2, 9), np.uint16), 1, 0, 1)


# ---- offline compile -------------------------------------------------------------------------

def compile_report():
    """sm_90a PTX of the two-warpgroup kernel and the vector-move kernel (no simulator)."""
    from numba import types

    from tilepy.offline import compile_kernel

    i32 = types.int32
    out = []
    rep = compile_kernel("named_barriers", two_warpgroups,
                         (i32[::1], types.Array(i32, 3, "C")), (9, 0, "a"))
    out.append({"name": "barrier", "ptx_lines": [ln.strip() for ln in rep.ptx.splitlines()
                                    if ln.strip().startswith("bar")],
                "spill_stores": rep.spill_stores, "registers": rep.registers})
    u32 = types.uint32
    rep = compile_kernel("vector_moves", vector_moves,
                         (u32[::1], u32[::1], types.float32[::1]), (9, 0, "a"))
    out.append({"name": "vector", "ptx_lines": [
        ln.strip() for ln in rep.ptx.splitlines()
        if ln.strip().startswith(("ld.shared", "st.shared", "st.global"))]})
    rep = compile_kernel("pair_moves", pair_moves, (types.Array(types.float32, 2, "C"),),
                         (9, 0, "a"))
    out[-1]["ptx_lines"] += [ln.strip() for ln in rep.ptx.splitlines()
                             if ln.strip().startswith("ld.shared")]
    rep = compile_kernel("global_vector_copy", global_vector_copy, (u32[::1], u32[::1]),
                         (9, 0, "a"))
    out[-1]["ptx_lines"] += [ln.strip() for ln in rep.ptx.splitlines()
                             if ln.strip().startswith("ld.global")]
    rep = compile_kernel("pair_stores", pair_stores,
                         (types.Array(types.uint16, 2, "C"), types.int32[::1]), (9, 0, "a"))
    out[-1]["ptx_lines"] += [ln.strip() for ln in rep.ptx.splitlines()
                             if ln.strip().startswith("st.global")]
    rep = compile_kernel("wide_shared_moves", wide_shared_moves,
                         (u32[::1], u32[::1], types.float32[::1]), (9, 0, "a"))
    out[-1]["ptx_lines"] += [ln.strip() for ln in rep.ptx.splitlines()
                             if ln.strip().startswith(("ld.shared", "st.shared"))]
    return out


@pytest.mark.compile
def test_compiles_to_bar_sync_and_bar_arrive():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    rep = run_in_subprocess("tests.test_ptx_barrier:compile_report")
    bars = rep["barrier"]["ptx_lines"]
    assert sum(ln.startswith("bar.sync") for ln in bars) >= 4, bars
    assert sum(ln.startswith("bar.arrive") for ln in bars) >= 1, bars
    assert rep["barrier"]["spill_stores"] == 0
    vec = " ".join(rep["vector"]["ptx_lines"])
    for op in ("st.shared.b32", "st.shared.v2.f32", "ld.shared.v2.f32", "ld.shared.v4.b32",
               "ld.shared.v4.f32", "st.global.v4.b32", "st.global.v4.f32", "ld.global.v4.b32",
               "st.shared.v4.b32", "ld.shared.f32", "st.global.u32"):
        assert op in vec, (op, vec)
