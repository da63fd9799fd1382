"""mbarrier phases and transaction counts, TMA tensor loads (2-D, 3-D, swizzled, edges), the host
tensor-map encoder, and one TMA → 128B-swizzled shared memory → wgmma pipeline.

The expected shared-memory images are computed here from the row / 16-byte-chunk description of
the swizzles, not with tilepy's functions. On the GPU the same kernels run on the hardware.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32, int32, uint16, uint64

from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ptx import _sim
from tilepy.ptx import mbarrier as B
from tilepy.ptx import tma as T
from tilepy.ptx import wgmma as W
from tilepy.ptx.address import shared_addr
from tilepy.ptx.asm import SIMULATOR
from tilepy.tile import tma as host

ALIGN = None if SIMULATOR else 1024


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**63)
    return np.random.default_rng(seed), seed


def chunk_xor(row, swizzle):
    """The 16-byte chunk XOR of row r of a box whose rows are exactly `swizzle` bytes long."""
    return {0: 0, 32: (row // 4) % 2, 64: (row // 2) % 4, 128: row % 8}[swizzle]


def expected_box(tensor, origin, box, swizzle):
    """The shared-memory image (uint16 words) of a box of a 2-byte tensor, NumPy order."""
    lo = [o for o in origin]
    region = np.zeros(box, tensor.dtype)
    src = tuple(slice(max(0, s), min(n, s + b)) for s, b, n in zip(lo, box, tensor.shape))
    dst = tuple(slice(a.start - s, a.stop - s) for a, s in zip(src, lo))
    if all(a.stop > a.start for a in src):
        region[dst] = tensor[src]
    rows = region.reshape(-1, box[-1]).view(np.uint16)
    if not swizzle:
        return rows.reshape(-1)
    out = np.zeros_like(rows)
    per_chunk = 8
    for r in range(rows.shape[0]):
        for c in range(rows.shape[1] // per_chunk):
            c2 = c ^ chunk_xor(r, swizzle)
            out[r, c2 * per_chunk:(c2 + 1) * per_chunk] = rows[r, c * per_chunk:(c + 1) * per_chunk]
    return out.reshape(-1)


def aligned(host_array, align=256):
    """A copy of ``host_array`` whose data starts on an ``align``-byte boundary."""
    raw = np.zeros(host_array.nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    out = raw[off:off + host_array.nbytes].view(host_array.dtype).reshape(host_array.shape)
    out[...] = host_array
    return out


def device_tensor(array):
    """(kernel-side keep-alive object, device pointer) of a tensor that a tensor map describes."""
    if SIMULATOR:
        a = aligned(array)
        return a, a.ctypes.data
    d = cuda.to_device(array)
    return d, d.device_ctypes_pointer.value


# ---- CPU: the host encoder --------------------------------------------------------------------

def test_spec_orders_dimensions_for_the_driver():
    s = host.tensor_map_spec(0x10000, "float16", (100, 96), (256, 2), (64, 64), 128)
    assert s.dims == (96, 100) and s.box_dims == (64, 64) and s.global_strides == (256,)
    assert s.box_bytes == 8192 and s.elem_bytes == 2 and s.rank == 2
    s3 = host.tensor_map_spec(0x10000, np.float32, (4, 40, 64), (40 * 256, 256, 4), (2, 16, 32),
                              128)
    assert s3.dtype == "float32" and s3.global_strides == (256, 40 * 256)
    assert s3.box_bytes == 2 * 16 * 32 * 4


@pytest.mark.parametrize("kwargs,error,match", [
    ({"address": 0x10008}, ValueError, r"address: 0x10008 must be .* aligned to 16"),
    ({"dtype": "complex64"}, TypeError, "dtype: 'complex64' has no tensor-map type"),
    ({"strides": (256, 4)}, ValueError, r"strides\[-1\] is 4 bytes; the innermost"),
    ({"strides": (200, 2)}, ValueError,
     r"strides\[0\] is 200 bytes; it must be a positive multiple of 16"),
    ({"box": (300, 64)}, ValueError, r"box\[0\] is 300; it must be 1 … 256"),
    ({"box": (64, 4)}, ValueError, r"box\[-1\] is 4 elements = 8 bytes; .* multiple of 16"),
    ({"box": (64, 128)}, ValueError,
     r"box\[-1\] is 128 elements = 256 bytes; with the 128-byte swizzle"),
    ({"swizzle": 16}, ValueError, r"swizzle: 16 must be one of"),
    ({"shape": (1, 1, 1, 1, 1, 1), "strides": (16,) * 5 + (2,), "box": (1,) * 6}, ValueError,
     "1 … 5 dimensions"),
    ({"box": (64,)}, ValueError, r"box: expected 2 values"),
])
def test_encoder_errors_name_the_argument(kwargs, error, match):
    args = {"address": 0x10000, "dtype": "float16", "shape": (100, 96), "strides": (256, 2),
                "box": (64, 64), "swizzle": 128}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        host.tensor_map_spec(**args)


def test_simulator_map_format_round_trips():
    raw = T.sim_encode(0x7F0012345600, 2, (96, 100, 3), (256, 25600), (64, 32, 2), 128)
    assert len(raw) == T.MAP_BYTES
    m = T.sim_decode(raw)
    assert m == {"address": 0x7F0012345600, "elem_bytes": 2, "rank": 3, "swizzle": 128,
                     "dims": (96, 100, 3), "strides": (2, 256, 25600), "box": (64, 32, 2)}
    with pytest.raises(ValueError, match="not a tensor map that tilepy.tile.tma encoded"):
        T.sim_decode(bytes(128))


# ---- simulator: mbarrier -----------------------------------------------------------------------

@cuda.jit
def _phases_kernel(out):
    tid = cuda.threadIdx.x
    bar_mem = cuda.shared.array(2, uint64)
    bar = shared_addr(bar_mem, 1)
    if tid == 0:
        B.mbarrier_init(bar, 2)
        B.fence_mbarrier_init()
    cuda.syncthreads()
    if tid == 0:
        out[0] = B.mbarrier_try_wait_parity(bar, 0)      # nobody arrived: 0
        out[1] = B.mbarrier_try_wait_parity(bar, 1)      # "the phase before": 1
        B.mbarrier_arrive(bar)
    cuda.syncthreads()
    if tid == 0:
        out[2] = B.mbarrier_try_wait_parity(bar, 0)      # 1 of 2: 0
    cuda.syncthreads()
    if tid == 1:
        B.mbarrier_arrive(bar)
    cuda.syncthreads()
    if tid == 0:
        out[3] = B.mbarrier_try_wait_parity(bar, 0)      # phase 0 done: 1
        out[4] = B.mbarrier_try_wait_parity(bar, 1)      # phase 1 running: 0
    cuda.syncthreads()
    if tid < 2:
        B.mbarrier_arrive(bar)
        B.mbarrier_wait_parity(bar, 1)
    cuda.syncthreads()
    if tid == 0:
        out[5] = B.mbarrier_try_wait_parity(bar, 0)      # phase 2 running: 0
        out[6] = B.mbarrier_try_wait_parity(bar, 1)
        B.mbarrier_expect_tx(bar, 0)
        B.mbarrier_inval(bar)


@pytest.mark.sim
def test_phases_and_parities():
    out = np.full(7, 9, np.int32)
    _phases_kernel[1, 32](out)
    assert out.tolist() == [0, 1, 0, 1, 0, 0, 1]


@cuda.jit
def _producer_consumer_kernel(out):
    """Warp 1 lane 0 produces 6 values through one shared slot; warp 0 consumes them."""
    tid = cuda.threadIdx.x
    bars = cuda.shared.array(2, uint64)
    slot = cuda.shared.array(1, int32)
    full = shared_addr(bars, 0)
    empty = shared_addr(bars, 1)
    if tid == 0:
        B.mbarrier_init(full, 1)
        B.mbarrier_init(empty, 32)
        B.fence_mbarrier_init()
    cuda.syncthreads()
    if tid == 32:
        for i in range(6):
            B.mbarrier_wait_parity(empty, (i & 1) ^ 1)   # the slot is free
            slot[0] = 10 * i + 7
            B.mbarrier_arrive(full)
    elif tid < 32:
        for i in range(6):
            B.mbarrier_wait_parity(full, i & 1)
            out[i, tid] = slot[0]
            B.mbarrier_arrive(empty)
    cuda.syncthreads()


@pytest.mark.sim
def test_producer_and_consumers_hand_over_through_phases():
    out = np.zeros((6, 32), np.int32)
    _producer_consumer_kernel[1, 64](out)
    np.testing.assert_array_equal(out, (10 * np.arange(6) + 7)[:, None].repeat(32, axis=1))


def _bad_barrier_kernel(case):
    @cuda.jit
    def kernel(out):
        bars = cuda.shared.array(4, uint64)
        raw = cuda.shared.array(16, uint16)
        bar = shared_addr(bars, 0)
        if case == "uninitialised":
            B.mbarrier_arrive(bar)
        elif case == "misaligned":
            B.mbarrier_init(shared_addr(raw, 2), 1)
        elif case == "too_many_arrivals":
            B.mbarrier_init(bar, 1)
            B.mbarrier_arrive(bar)
            B.mbarrier_expect_tx(bar, 4)   # phase 1 now waits for 4 bytes as well
            B.mbarrier_arrive(bar)
            B.mbarrier_arrive(bar)
        elif case == "bad_count":
            B.mbarrier_init(bar, 0)
        elif case == "never_completes":
            B.mbarrier_init(bar, 2)
            B.mbarrier_arrive(bar)
            B.mbarrier_wait_parity(bar, 0)
        out[0] = 1

    return kernel


@pytest.mark.sim
@pytest.mark.parametrize("case,error,match", [
    ("uninitialised", RuntimeError, "no initialised mbarrier"),
    ("misaligned", ValueError, "8-byte alignment"),
    ("too_many_arrivals", RuntimeError, "more arrivals than the 1"),
    ("bad_count", ValueError, "count is 0"),
    ("never_completes", RuntimeError, r"parity 0 did not complete .*1 of 2 arrivals pending"),
])
def test_barrier_misuse_is_a_clear_error(case, error, match, monkeypatch):
    monkeypatch.setattr(_sim, "WAIT_TIMEOUT", 0.5)
    with pytest.raises(error, match=match):
        _bad_barrier_kernel(case)[1, 1](np.zeros(1, np.int32))


# ---- TMA loads (simulator and GPU) ------------------------------------------------------------

def make_load_kernel(rank, box_words, nloads):
    """Thread 0 loads box after box (one per phase) into shared memory; everyone copies it out."""

    @cuda.jit
    def kernel(tmap, coords, out):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(box_words, uint16, alignment=ALIGN)
        bars = cuda.shared.array(1, uint64)
        bar = shared_addr(bars, 0)
        tm = T.tensor_map_address(tmap)
        if tid == 0:
            B.mbarrier_init(bar, 1)
            B.fence_mbarrier_init()
            T.fence_proxy_tensormap_acquire(tm)
        cuda.syncthreads()
        for i in range(nloads):
            if tid == 0:
                B.mbarrier_arrive_expect_tx(bar, box_words * 2)
                if rank == 2:
                    T.tma_load_2d(shared_addr(smem, 0), tm, bar, coords[i, 0], coords[i, 1])
                elif rank == 3:
                    T.tma_load_3d(shared_addr(smem, 0), tm, bar, coords[i, 0], coords[i, 1],
                                  coords[i, 2])
                else:
                    T.tma_load_4d(shared_addr(smem, 0), tm, bar, coords[i, 0], coords[i, 1],
                                  coords[i, 2], coords[i, 3])
            B.mbarrier_wait_parity(bar, i & 1)
            for j in range(tid, box_words, cuda.blockDim.x):
                out[i, j] = smem[j]
            cuda.syncthreads()  # everyone has read the box before the next one overwrites it

    return kernel


_LOADS: dict = {}


def run_loads(tensor, shape, strides, box, swizzle, coords):
    """Load each box (coords innermost first) of the ``shape`` / byte-``strides`` view of
    ``tensor`` through a tensor map; return the shared-memory images (uint16 words)."""
    keep, ptr = device_tensor(tensor)
    tm = host.encode_tiled(ptr, tensor.dtype, shape, strides, box, swizzle)
    words = int(np.prod(box))
    key = (len(shape), words, len(coords))
    if key not in _LOADS:
        _LOADS[key] = make_load_kernel(len(shape), words, len(coords))
    out = np.zeros((len(coords), words), np.uint16)
    _LOADS[key][1, 64](tm.to_device(), np.array(coords, np.int32), out)
    del keep
    return out


def padded_tensor(rng, shape, row_pitch):
    """A float16 tensor whose rows are row_pitch elements apart (the rest is not part of it)."""
    full = (rng.standard_normal(shape[:-1] + (row_pitch,)) * 4).astype(np.float16)
    return full, full[..., :shape[-1]]


TMA2D = [  # (swizzle, box (rows, cols))
    (128, (64, 64)),
    (64, (16, 32)),
    (32, (8, 16)),
    (0, (24, 40)),
]


def _check_2d(swizzle, box):
    rng, seed = fresh_rng()
    full, view = padded_tensor(rng, (100, 96), 128)
    # the tensor map describes the 100 × 96 view inside rows of 128 elements
    coords = [(0, 0), (64, 64), (32, 90), (96, -8), (200, 0), (-64, -box[0])]
    out = run_loads(full, view.shape, (full.shape[-1] * 2, 2), box, swizzle, coords)
    for i, (x, y) in enumerate(coords):
        want = expected_box(view, (y, x), box, swizzle)
        np.testing.assert_array_equal(out[i], want, err_msg=f"box at x={x}, y={y}; seed {seed}")


@pytest.mark.sim
@pytest.mark.parametrize("swizzle,box", TMA2D, ids=[f"swz{s}-box{b[0]}x{b[1]}" for s, b in TMA2D])
def test_tma_2d_loads_swizzled_boxes_with_zero_filled_edges(swizzle, box):
    _check_2d(swizzle, box)


def _check_3d():
    rng, seed = fresh_rng()
    tensor = (rng.standard_normal((4, 40, 64)) * 4).astype(np.float16)
    coords = [(0, 8, 1), (0, 32, 3)]
    out = run_loads(tensor, tensor.shape, tensor.strides, (2, 16, 64), 128, coords)
    for i, (x, y, z) in enumerate(coords):
        want = expected_box(tensor, (z, y, x), (2, 16, 64), 128)
        np.testing.assert_array_equal(out[i], want, err_msg=f"seed {seed}")


@pytest.mark.sim
def test_tma_3d_load():
    _check_3d()


def _check_4d():
    """An attention operand's (batch, head, seq, head_dim) view in the bshd layout (seq and
    head swapped in memory, so the four strides are not those of a contiguous array): boxes of
    one (batch, head), 16 rows × 64 columns, one hanging past the last row."""
    rng, seed = fresh_rng()
    mem = (rng.standard_normal((2, 40, 3, 64)) * 4).astype(np.float16)   # (b, s, h, d)
    view = mem.transpose(0, 2, 1, 3)                                     # (b, h, s, d)
    coords = [(0, 8, 1, 0), (0, 32, 2, 1)]
    out = run_loads(mem, view.shape, view.strides, (1, 1, 16, 64), 128, coords)
    for i, (x, y, z, w) in enumerate(coords):
        want = expected_box(view, (w, z, y, x), (1, 1, 16, 64), 128)
        np.testing.assert_array_equal(out[i], want, err_msg=f"seed {seed}")


@pytest.mark.sim
def test_tma_4d_load():
    _check_4d()


def _bad_tma_kernel(case):
    @cuda.jit
    def kernel(tmap, out):
        smem = cuda.shared.array(4096, uint16)
        bars = cuda.shared.array(1, uint64)
        bar = shared_addr(bars, 0)
        B.mbarrier_init(bar, 1)
        if case == "unaligned_x":
            T.tma_load_2d(shared_addr(smem, 0), T.tensor_map_address(tmap), bar, 4, 0)
        elif case == "dst_too_small":
            T.tma_load_2d(shared_addr(smem, 64), T.tensor_map_address(tmap), bar, 0, 0)
        elif case == "wrong_rank":
            T.tma_load_3d(shared_addr(smem, 0), T.tensor_map_address(tmap), bar, 0, 0, 0)
        elif case == "not_a_map":
            T.tma_load_2d(shared_addr(smem, 0), T.tensor_map_address(out), bar, 0, 0)
        out[0] = 1

    return kernel


@pytest.mark.sim
@pytest.mark.parametrize("case,error,match", [
    ("unaligned_x", ValueError, "x = 4, 8 bytes into a row"),
    ("dst_too_small", IndexError, "tma_load_2d destination: 8192 bytes"),
    ("wrong_rank", ValueError, "rank 2, the copy is 3-D"),
    ("not_a_map", ValueError, "not a tensor map"),
])
def test_bad_tma_load_is_a_clear_error(case, error, match):
    tensor = aligned(np.zeros((64, 64), np.float16))
    tm = host.encode_tiled(tensor.ctypes.data, "float16", (64, 64), (128, 2), (64, 64), 128)
    with pytest.raises(error, match=match):
        _bad_tma_kernel(case)[1, 1](tm.to_device(), np.zeros(128, np.uint8))


def make_store_kernel(rank, box_words):
    """Every thread copies its part of a shared-memory image into smem; thread 0 stores it."""

    @cuda.jit
    def kernel(tmap, image, coords):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(box_words, uint16, alignment=ALIGN)
        tm = T.tensor_map_address(tmap)
        for j in range(tid, box_words, cuda.blockDim.x):
            smem[j] = image[j]
        W.fence_proxy_async_shared()
        cuda.syncthreads()
        if tid == 0:
            T.fence_proxy_tensormap_acquire(tm)
            if rank == 2:
                T.tma_store_2d(tm, shared_addr(smem, 0), coords[0], coords[1])
            else:
                T.tma_store_3d(tm, shared_addr(smem, 0), coords[0], coords[1], coords[2])
            T.bulk_commit_group()
            T.bulk_wait_group_read(0)
            T.bulk_wait_group(0)

    return kernel


def read_back(keep):
    return keep if SIMULATOR else keep.copy_to_host()


STORES = [(128, (64, 64), (32, 80)), (64, (16, 32), (64, -4)), (0, (24, 40), (8, 90)),
          (128, (2, 16, 64), (0, 30, 3))]


def _check_store(swizzle, box, coords):
    rng, seed = fresh_rng()
    shape = (100, 96) if len(box) == 2 else (4, 40, 64)
    before = (rng.standard_normal(shape) * 4).astype(np.float16)
    values = (rng.standard_normal(box) * 4).astype(np.float16)
    keep, ptr = device_tensor(before)
    tm = host.encode_tiled(ptr, "float16", shape, before.strides, box, swizzle)
    # the smem image of `values` as a load would have written it (swizzle included)
    image = expected_box(values, (0,) * len(box), box, swizzle)
    make_store_kernel(len(box), image.size)[1, 64](tm.to_device(), image,
                                                  np.array(coords, np.int32))
    after = read_back(keep)
    want = before.copy()
    origin = tuple(reversed(coords))  # NumPy order
    dst = tuple(slice(max(0, o), min(n, o + b)) for o, b, n in zip(origin, box, shape))
    src = tuple(slice(d.start - o, d.stop - o) for d, o in zip(dst, origin))
    want[dst] = values[src]
    np.testing.assert_array_equal(after.view(np.uint16), want.view(np.uint16),
                                  err_msg=f"seed {seed}")


@pytest.mark.sim
@pytest.mark.parametrize("swizzle,box,coords", STORES,
                         ids=[f"swz{s}-box{'x'.join(map(str, b))}" for s, b, _ in STORES])
def test_tma_store_writes_the_box_and_drops_what_is_outside(swizzle, box, coords):
    _check_store(swizzle, box, coords)


# ---- TMA → 128B-swizzled smem → wgmma ---------------------------------------------------------

BM, BN, BK = 64, 128, 64  # one warpgroup's tile; one TMA box per operand per k-tile


def make_gemm_kernel(k_tiles):
    """D[64×128] = A[m0:m0+64, :] · Bᵀ[n0:n0+128, :]ᵀ, A row-major M×K, Bt row-major N×K (both
    K-major), k-tiles of 64 loaded by TMA (128B swizzle) and fed to 4 wgmma k16 steps each."""
    nacc = BN // 2
    a_words, b_words = BM * BK, BN * BK

    @cuda.jit
    def kernel(tmap_a, tmap_b, m0, n0, out):
        tid = cuda.threadIdx.x
        sa = cuda.shared.array(a_words, uint16, alignment=ALIGN)
        sb = cuda.shared.array(b_words, uint16, alignment=ALIGN)
        bars = cuda.shared.array(1, uint64)
        bar = shared_addr(bars, 0)
        ta = T.tensor_map_address(tmap_a)
        tb = T.tensor_map_address(tmap_b)
        if tid == 0:
            B.mbarrier_init(bar, 1)
            B.fence_mbarrier_init()
            T.fence_proxy_tensormap_acquire(ta)
            T.fence_proxy_tensormap_acquire(tb)
        cuda.syncthreads()
        da = W.matrix_descriptor(shared_addr(sa, 0), 16, 1024, 128)
        db = W.matrix_descriptor(shared_addr(sb, 0), 16, 1024, 128)
        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = 0.0
        for kt in range(k_tiles):
            if tid == 0:
                B.mbarrier_arrive_expect_tx(bar, (a_words + b_words) * 2)
                T.tma_load_2d(shared_addr(sa, 0), ta, bar, kt * BK, m0)
                T.tma_load_2d(shared_addr(sb, 0), tb, bar, kt * BK, n0)
            B.mbarrier_wait_parity(bar, kt & 1)
            W.wgmma_fence()
            for s in range(BK // 16):
                W.wgmma_m64n128k16_f32_f16(acc, W.descriptor_advance(da, 32 * s),
                                           W.descriptor_advance(db, 32 * s), 1)
            W.wgmma_commit_group()
            W.wgmma_wait_group(0)
            W.wgmma_fence_operand(acc, nacc)
            cuda.syncthreads()  # the tiles are read before the next TMA overwrites them
        for i in range(nacc):
            out[tid, i] = acc[i]

    return kernel


_GEMMS: dict = {}


def run_tma_wgmma(m, n, k, m0, n0, seed):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k))).astype(np.float16)
    bt = (rng.standard_normal((n, k))).astype(np.float16)
    keep_a, pa = device_tensor(a)
    keep_b, pb = device_tensor(bt)
    tma_a = host.encode_tiled(pa, "float16", a.shape, (k * 2, 2), (BM, BK), 128)
    tma_b = host.encode_tiled(pb, "float16", bt.shape, (k * 2, 2), (BN, BK), 128)
    k_tiles = -(-k // BK)
    if k_tiles not in _GEMMS:
        _GEMMS[k_tiles] = make_gemm_kernel(k_tiles)
    out = np.full((128, BN // 2), np.nan, np.float32)
    _GEMMS[k_tiles][1, 128](tma_a.to_device(), tma_b.to_device(), m0, n0, out)
    del keep_a, keep_b
    d = np.zeros((BM, BN))
    for t in range(128):
        for i in range(BN // 2):
            d[W.accumulator_position(t, i)] = out[t, i]
    a64 = np.zeros((BM, k_tiles * BK))
    b64 = np.zeros((BN, k_tiles * BK))
    blk_a = a[m0:m0 + BM].astype(np.float64)
    blk_b = bt[n0:n0 + BN].astype(np.float64)
    a64[:blk_a.shape[0], :k] = blk_a
    b64[:blk_b.shape[0], :k] = blk_b
    ref = a64 @ b64.T
    mag = np.abs(a64) @ np.abs(b64.T)
    return d, ref, mag


@pytest.mark.sim
def test_tma_fed_wgmma_matches_numpy():
    """Two k-tiles, the second partly past K (zeros), the M tile partly past M."""
    _, seed = fresh_rng()
    d, ref, mag = run_tma_wgmma(100, 128, 96, 64, 0, seed)
    assert not np.isnan(d).any()
    assert (np.abs(d - ref) / np.maximum(mag, 1e-30)).max() <= 1e-6, f"seed {seed}"


def make_specialised_kernel(k_tiles, bn=64, stages=2):
    """Warp-specialised: warpgroup 0 (its thread 0) produces k-tiles with TMA into a ring of
    ``stages`` buffers; warpgroup 1 consumes them with wgmma m64n{bn}k16 and frees each buffer
    through an "empty" mbarrier. No syncthreads after the split."""
    nacc = bn // 2
    a_words, b_words = BM * BK, bn * BK
    ring_a, ring_b, n_bars = stages * a_words, stages * b_words, 2 * stages  # shapes: constants
    fn = W.wgmma(bn, "f16")

    @cuda.jit
    def kernel(tmap_a, tmap_b, out):
        tid = cuda.threadIdx.x
        sa = cuda.shared.array(ring_a, uint16, alignment=ALIGN)
        sb = cuda.shared.array(ring_b, uint16, alignment=ALIGN)
        bars = cuda.shared.array(n_bars, uint64)
        if tid == 0:
            for s in range(stages):
                B.mbarrier_init(shared_addr(bars, s), 1)             # full: the producer
                B.mbarrier_init(shared_addr(bars, stages + s), 128)  # empty: every consumer
            B.fence_mbarrier_init()
        cuda.syncthreads()
        if tid < 128:
            if tid == 0:
                ta = T.tensor_map_address(tmap_a)
                tb = T.tensor_map_address(tmap_b)
                T.fence_proxy_tensormap_acquire(ta)
                T.fence_proxy_tensormap_acquire(tb)
                for kt in range(k_tiles):
                    s = kt % stages
                    phase = (kt // stages) & 1
                    B.mbarrier_wait_parity(shared_addr(bars, stages + s), phase ^ 1)
                    full = shared_addr(bars, s)
                    B.mbarrier_arrive_expect_tx(full, (a_words + b_words) * 2)
                    T.tma_load_2d(shared_addr(sa, s * a_words), ta, full, kt * BK, 0)
                    T.tma_load_2d(shared_addr(sb, s * b_words), tb, full, kt * BK, 0)
        else:
            t = tid - 128
            acc = cuda.local.array(nacc, float32)
            for i in range(nacc):
                acc[i] = 0.0
            da = W.matrix_descriptor(shared_addr(sa, 0), 16, 1024, 128)
            db = W.matrix_descriptor(shared_addr(sb, 0), 16, 1024, 128)
            for kt in range(k_tiles):
                s = kt % stages
                B.mbarrier_wait_parity(shared_addr(bars, s), (kt // stages) & 1)
                W.wgmma_fence()
                for k in range(BK // 16):
                    fn(acc, W.descriptor_advance(da, s * a_words * 2 + 32 * k),
                       W.descriptor_advance(db, s * b_words * 2 + 32 * k), 1)
                W.wgmma_commit_group()
                W.wgmma_wait_group(0)
                W.wgmma_fence_operand(acc, nacc)
                B.mbarrier_arrive(shared_addr(bars, stages + s))
            for i in range(nacc):
                out[t, i] = acc[i]

    return kernel


def _check_specialised(k, seed):
    rng = np.random.default_rng(seed)
    bn = 64
    a = rng.standard_normal((BM, k)).astype(np.float16)
    bt = rng.standard_normal((bn, k)).astype(np.float16)
    keep_a, pa = device_tensor(a)
    keep_b, pb = device_tensor(bt)
    tma_a = host.encode_tiled(pa, "float16", a.shape, a.strides, (BM, BK), 128)
    tma_b = host.encode_tiled(pb, "float16", bt.shape, bt.strides, (bn, BK), 128)
    out = np.full((128, bn // 2), np.nan, np.float32)
    make_specialised_kernel(k // BK, bn)[1, 256](tma_a.to_device(), tma_b.to_device(), out)
    del keep_a, keep_b
    d = np.zeros((BM, bn))
    for t in range(128):
        for i in range(bn // 2):
            d[W.accumulator_position(t, i)] = out[t, i]
    ref = a.astype(np.float64) @ bt.astype(np.float64).T
    mag = np.abs(a.astype(np.float64)) @ np.abs(bt.astype(np.float64)).T
    err = (np.abs(d - ref) / np.maximum(mag, 1e-30)).max()
    assert err <= 1e-5, f"seed {seed}: {err}"


@pytest.mark.sim
def test_warp_specialised_producer_and_consumer_warpgroups():
    """Five k-tiles through a two-stage ring: the ring wraps and both parities are used."""
    _check_specialised(5 * BK, fresh_rng()[1])


# ---- offline compile for sm_90a ----------------------------------------------------------------

def compile_reports():
    """Offline sm_90a compiles of this file's kernels (``python -m tilepy.offline``)."""
    from numba import types

    from tilepy.offline import compile_kernel

    u8, i32 = types.uint8, types.int32
    reports = []
    for name, kernel, sig in (
            ("tma_wgmma", make_gemm_kernel(2), (u8[:], u8[:], i32, i32, types.float32[:, :])),
            ("tma_2d", make_load_kernel(2, 4096, 3), (u8[:], i32[:, :], types.uint16[:, :])),
            ("tma_3d", make_load_kernel(3, 2048, 2), (u8[:], i32[:, :], types.uint16[:, :])),
            ("tma_4d", make_load_kernel(4, 1024, 2), (u8[:], i32[:, :], types.uint16[:, :])),
            ("tma_store_2d", make_store_kernel(2, 4096), (u8[:], types.uint16[:], i32[:])),
            ("specialised", make_specialised_kernel(4), (u8[:], u8[:], types.float32[:, :]))):
        rep = compile_kernel(name, kernel.py_func, sig, (9, 0, "a"))
        lines = [ln.strip() for ln in rep.ptx.splitlines()]
        reports.append({
            "name": name, "registers": rep.registers,
            "spill": rep.spill_stores + rep.spill_loads, "log": rep.ptxas_log,
            "ops": sorted({ln.split()[0].rstrip(";") for ln in lines
                           if ln.startswith(("wgmma.", "fence.", "mbarrier.", "cp.async.bulk"))})})
    return reports


@pytest.fixture(scope="module")
def compiled():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    return run_in_subprocess("tests.test_ptx_mbarrier_tma:compile_reports")


@pytest.mark.compile
@pytest.mark.xdist_group("ptx_mbarrier_tma_compiled")
def test_sm90a_compile_of_the_tma_wgmma_pipeline(compiled):
    rep = compiled["tma_wgmma"]
    ops = set(rep["ops"])
    assert {"cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
            "mbarrier.init.shared::cta.b64", "mbarrier.arrive.expect_tx.shared::cta.b64",
            "mbarrier.try_wait.parity.shared::cta.b64", "fence.mbarrier_init.release.cluster",
            "fence.proxy.tensormap::generic.acquire.gpu",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16"} <= ops, ops
    assert rep["spill"] == 0 and rep["registers"] <= 128, rep["log"]
    assert "C7510" not in rep["log"] and "C7511" not in rep["log"], rep["log"]


@pytest.mark.compile
@pytest.mark.xdist_group("ptx_mbarrier_tma_compiled")
def test_sm90a_compile_of_the_warp_specialised_pipeline(compiled):
    rep = compiled["specialised"]
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in rep["ops"]
    assert rep["spill"] == 0 and rep["registers"] <= 128, rep["log"]


@pytest.mark.compile
@pytest.mark.xdist_group("ptx_mbarrier_tma_compiled")
def test_sm90a_compile_of_the_tma_loads_and_stores(compiled):
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" \
        in compiled["tma_2d"]["ops"]
    assert "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" \
        in compiled["tma_3d"]["ops"]
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" \
        in compiled["tma_4d"]["ops"]
    assert {"cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group",
            "cp.async.bulk.commit_group", "cp.async.bulk.wait_group.read",
            "cp.async.bulk.wait_group", "fence.proxy.async.shared::cta"} <= \
        set(compiled["tma_store_2d"]["ops"]), compiled["tma_store_2d"]["ops"]
    for rep in (compiled["tma_2d"], compiled["tma_3d"], compiled["tma_4d"],
                compiled["tma_store_2d"]):
        assert rep["spill"] == 0 and rep["registers"] <= 64, rep["log"]


# ---- hardware ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("swizzle,box", TMA2D, ids=[f"swz{s}-box{b[0]}x{b[1]}" for s, b in TMA2D])
def test_gpu_tma_2d_loads_swizzled_boxes_with_zero_filled_edges(swizzle, box):
    _check_2d(swizzle, box)


# The 64-byte-swizzled store with a box starting above row 0 stops the H200 with
# CUDA_ERROR_ILLEGAL_INSTRUCTION (open since session 2, bench/NOTES.md); that poisons the CUDA
# context for every later test in the process, so it is not run (xfail, run=False), and no
# kernel of tilepy stores through a 64-byte-swizzled map.
GPU_STORES = [pytest.param(*c, marks=pytest.mark.xfail(
    run=False, reason="ILLEGAL_INSTRUCTION on the H200, poisons the context (open)"))
    if c[0] == 64 else c for c in STORES]


@pytest.mark.gpu
@pytest.mark.parametrize("swizzle,box,coords", GPU_STORES,
                         ids=[f"swz{s}-box{'x'.join(map(str, b))}" for s, b, _ in STORES])
def test_gpu_tma_store_writes_the_box_and_drops_what_is_outside(swizzle, box, coords):
    _check_store(swizzle, box, coords)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [BK, 5 * BK, 64 * BK])
def test_gpu_warp_specialised_producer_and_consumer_warpgroups(k):
    _check_specialised(k, fresh_rng()[1])


@pytest.mark.gpu
def test_gpu_tma_3d_load():
    _check_3d()


@pytest.mark.gpu
def test_gpu_tma_4d_load():
    _check_4d()


@pytest.mark.gpu
def test_gpu_phases_and_parities():
    out = np.full(7, 9, np.int32)
    _phases_kernel[1, 32](out)
    assert out.tolist() == [0, 1, 0, 1, 0, 0, 1]


@pytest.mark.gpu
def test_gpu_producer_and_consumers_hand_over_through_phases():
    out = np.zeros((6, 32), np.int32)
    _producer_consumer_kernel[1, 64](out)
    np.testing.assert_array_equal(out, (10 * np.arange(6) + 7)[:, None].repeat(32, axis=1))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,m0,n0", [(64, 128, 64, 0, 0), (256, 256, 512, 128, 128),
                                         (100, 200, 96, 64, 128)])
def test_gpu_tma_fed_wgmma_m64n128k16_matches_numpy(m, n, k, m0, n0):
    _, seed = fresh_rng()
    d, ref, mag = run_tma_wgmma(m, n, k, m0, n0, seed)
    assert not np.isnan(d).any()
    assert (np.abs(d - ref) / np.maximum(mag, 1e-30)).max() <= 1e-5, f"seed {seed}"
