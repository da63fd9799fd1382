"""The Hopper tile pieces: the shared-memory carve-out, named-barrier allocation and roles on the
CPU; a warp-specialised kernel composed from the stage ring, TMA tile loads and the warpgroup
MMA (both B layouts, A from shared memory or registers) against NumPy in the simulator; the
schedulers' orders; and the same kernel's sm_90a compile."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32, types, uint16

from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ptx import mbarrier as MB
from tilepy.ptx import tma as T
from tilepy.ptx.address import shared_addr
from tilepy.ptx.asm import SIMULATOR
from tilepy.ptx.wgmma_layout import a_fragment_position, accumulator_position
from tilepy.tile import tma as host
from tilepy.tile.pipeline import tma_pipeline
from tilepy.tile.roles import NamedBarriers, warpgroup_roles
from tilepy.tile.schedule import L2_GROUP_BYTES, grouped_raster, heavy_first, ticket_scheduler
from tilepy.tile.smem_layout import SmemLayout
from tilepy.tile.tma_copy import tma_tile
from tilepy.tile.warpgroup_mma import SmemOperand, warpgroup_mma

ALIGN = None if SIMULATOR else 1024
BK = 64


# ---- CPU: layouts, barriers, roles -------------------------------------------------------------

def test_smem_layout_places_aligned_regions_and_overlays():
    lay = SmemLayout.of(("stages", 3 * 40960, 1024), ("staging", 16384, 1024, "stages"),
                        ("bars", 48, 8), ("bias", 1024), ("empty", 0, 1024))
    assert lay.offset("stages") == 0 and lay.offset("staging") == 0
    assert lay.offset("bars") == 3 * 40960 and lay.offset("bias") == 3 * 40960 + 48
    assert lay.offset("empty") == -(-(3 * 40960 + 48 + 1024) // 1024) * 1024
    assert lay.nbytes == 3 * 40960 + 48 + 1024 and lay.align == 1024
    assert "bars 48 B @ 122880" in lay.describe()
    unaligned = SmemLayout.of(("bars", 24, 8), ("tile", 8192, 1024))
    assert unaligned.offset("tile") == 1024 and unaligned.nbytes == 1024 + 8192


@pytest.mark.parametrize("specs,match", [
    ((("a", 8), ("a", 8)), "already used"),
    ((("a", 8, 3),), "power of two"),
    ((("a", -1),), "of -1 bytes"),
    ((("a", 64), ("b", 128, 16, "a")), "does not fit"),
    ((("b", 64, 16, "a"),), "not placed before"),
])
def test_smem_layout_errors(specs, match):
    with pytest.raises(ValueError, match=match):
        SmemLayout.of(*specs)
    with pytest.raises(KeyError, match="no region 'x'"):
        SmemLayout.of(("a", 8))["x"]


def test_named_barriers_are_handed_out_once_and_run_out_at_fifteen():
    bars = NamedBarriers()
    assert bars.take("consumers", 256) == 1
    assert bars.take("warpgroup", 128, count=2) == 2
    assert bars.take("turn", 256) == 4 and bars.threads["turn"] == 256
    with pytest.raises(ValueError, match="taken twice"):
        bars.take("turn", 256)
    with pytest.raises(ValueError, match="multiple of 32"):
        bars.take("odd", 100)
    with pytest.raises(ValueError, match="all taken"):
        bars.take("many", 128, count=12)
    assert bars.take("last", 128, count=11) == 5


def test_roles_constants_and_register_budget():
    roles = warpgroup_roles(2, producer_regs=40, consumer_regs=232)
    assert roles.THREADS == 384 and roles.CONSUMER_THREADS == 256 and roles.PRODUCER_WG == 0
    assert roles.SETMAXNREG
    last = warpgroup_roles(3, producer_first=False)
    assert last.PRODUCER_WG == 3 and not last.SETMAXNREG
    with pytest.raises(ValueError, match="exceed the register file"):
        warpgroup_roles(2, producer_regs=64, consumer_regs=240)
    with pytest.raises(ValueError, match="multiples of 8"):
        warpgroup_roles(2, producer_regs=41, consumer_regs=232)


def test_operand_layouts_give_the_descriptor_constants():
    k_major = SmemOperand(128, 128, "k")            # two 64-k boxes of 128 rows
    assert (k_major.lbo, k_major.sbo) == (16, 1024)
    assert [k_major.step(kk) for kk in range(8)] == [0, 32, 64, 96, 16384, 16416, 16448, 16480]
    mn_major = SmemOperand(128, 64, "mn")           # two 64-n boxes of 64 k rows
    assert (mn_major.lbo, mn_major.sbo) == (8192, 1024)
    assert [mn_major.step(kk) for kk in range(4)] == [0, 2048, 4096, 6144]
    with pytest.raises(ValueError, match="multiple of 16"):
        SmemOperand(64, 40, "k")
    with pytest.raises(ValueError, match="major"):
        SmemOperand(64, 64, "row")
    with pytest.raises(ValueError, match="n must be a multiple of 8"):
        warpgroup_mma(96, SmemOperand(64, 64, "k"))


def test_pipeline_refuses_one_stage():
    with pytest.raises(ValueError, match="at least 2 stages"):
        tma_pipeline(1, 4)
    ring = tma_pipeline(3, 4)
    assert ring.STAGES == 3 and ring.nbytes == 48
    one = tma_pipeline(1, 8, producers=128, single=True)   # tiles too large to double
    assert one.STAGES == 1 and one.nbytes == 16
    with pytest.raises(ValueError, match="at least 2 stages"):
        tma_pipeline(0, 4, single=True)


# ---- simulator: a warp-specialised kernel from the pieces ---------------------------------------

def make_kernel(n: int, k_steps: int, b_major: str, a_in_registers: bool,
                dtype: str = "float16"):
    """Warpgroup 0's thread 0 loads A (64 × 64 k, K-major) and B (K-major: n × 64 k; MN-major:
    n / 64 boxes of 64 k × 64 n) per k step into a 2-stage ring; warpgroup 1 multiplies with
    the warpgroup MMA (A from the stage, or from ``a_regs``) and frees each stage. out[t, i] is
    consumer thread t's accumulator register i. An 8-bit ``dtype`` has the same bytes: k steps
    of 128 elements (one 128-byte box row)."""
    eb = 1 if dtype.startswith("float8") else 2
    BKE = BK * 2 // eb      # elements of a k step (128 bytes a row)
    lay = SmemLayout.of(("stages", 2 * (64 + n) * BK * 2, 1024), ("bars", 32, 8))
    STAGE = (64 + n) * BK * 2
    A_BYTES = 64 * BK * 2
    STAGES_OFF, BARS = lay.offset("stages"), lay.offset("bars")
    ring = tma_pipeline(2, 4)
    roles = warpgroup_roles(1)
    load_a = tma_tile(1, A_BYTES)
    load_b = tma_tile(1, n * 128) if b_major == "k" else tma_tile(n // 64, 8192)
    b_op = SmemOperand(n, BKE, b_major, eb)
    wmma = warpgroup_mma(n, b_op, None if a_in_registers else SmemOperand(64, BKE, "k", eb),
                         dtype)
    NACC = wmma.NACC
    RS = a_in_registers
    words = lay.nbytes // 2
    KMAJOR = b_major == "k"
    NREG = 4 * (BK // 16)   # rs-form A registers per k step

    @cuda.jit
    def kernel(maps_a, maps_b, a_regs, out):
        smem = cuda.shared.array(words, uint16, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(words, uint16)
        base = shared_addr(smem, 0)
        bars = base + BARS
        tid = cuda.threadIdx.x
        wg = roles.warpgroup(tid)
        if tid == 0:
            ring.init(bars)
            MB.fence_mbarrier_init()
        cuda.syncthreads()
        if wg == 0:
            roles.enter_producer()
            if tid == 0:
                ta = T.tensor_map_address(maps_a)
                tb = T.tensor_map_address(maps_b)
                T.fence_proxy_tensormap_acquire(ta)
                T.fence_proxy_tensormap_acquire(tb)
                s = 0
                ph = 0
                for kt in range(k_steps):
                    ring.acquire(bars, s, ph)
                    full = ring.commit(bars, s, STAGE)
                    stage = base + STAGES_OFF + s * STAGE
                    load_a.load_2d(stage, ta, full, kt * BKE, 0)
                    if KMAJOR:
                        load_b.load_2d(stage + A_BYTES, tb, full, kt * BKE, 0)
                    else:
                        load_b.load_2d(stage + A_BYTES, tb, full, 0, kt * BK)
                    s, ph = ring.advance(s, ph)
        else:
            roles.enter_consumer()
            t = tid - 128
            acc = cuda.local.array(NACC, float32)
            regs = cuda.local.array(NREG, types.uint32)
            for kt in range(k_steps):
                s, ph = ring.at(kt)
                ring.wait(bars, s, ph)
                stage = base + STAGES_OFF + s * STAGE
                if RS:
                    for r in range(NREG):
                        regs[r] = a_regs[kt, t, r]
                wmma.fence()
                if RS:
                    wmma.mma_rs(acc, regs, stage + A_BYTES, 0 if kt == 0 else 1)
                else:
                    wmma.mma(acc, stage, stage + A_BYTES, 0 if kt == 0 else 1)
                wmma.commit()
                wmma.wait(0)
                wmma.fence_operand(acc)
                ring.release(bars, s, t % 32)
            for i in range(NACC):
                out[t, i] = acc[i]

    return kernel


def device_tensor(x):
    """(owner, pointer) of ``x`` where the TMA twins read it."""
    if SIMULATOR:
        return x, x.ctypes.data
    d = cuda.to_device(x)
    return d, d.device_ctypes_pointer.value


def pack_a_registers(a, k_steps):
    """The rs-form A registers of every consumer thread, per k step: uint32 of two halves."""
    half = a.view(np.uint16)
    regs = np.zeros((k_steps, 128, 4 * (BK // 16)), np.uint32)
    for kt in range(k_steps):
        for t in range(128):
            for kk in range(BK // 16):
                for r in range(4):
                    lo, hi = (a_fragment_position(t, r, h) for h in (0, 1))
                    col0 = kt * BK + kk * 16
                    regs[kt, t, 4 * kk + r] = (int(half[lo[0], col0 + lo[1]])
                                               | int(half[hi[0], col0 + hi[1]]) << 16)
    return regs


@pytest.mark.sim
@pytest.mark.parametrize("n,b_major,rs", [(64, "k", False), (128, "mn", False), (64, "mn", True)],
                         ids=["b-k-major", "b-mn-major-two-boxes", "a-from-registers"])
def test_pieces_compose_a_warp_specialised_product(n, b_major, rs):
    """Three k steps through a two-stage ring (it wraps; both parities), k of 192; the first
    step overwrites the accumulators (scale-d 0), the others add."""
    rng = np.random.default_rng()
    k_steps = 3
    k = k_steps * BK
    a = rng.standard_normal((64, k)).astype(np.float16)
    b = rng.standard_normal((k, n)).astype(np.float16)          # B[k, n]
    keep_a, pa = device_tensor(a)
    tma_a = host.encode_tiled(pa, "float16", a.shape, a.strides, (64, BK), 128)
    if b_major == "k":
        bt = np.ascontiguousarray(b.T)
        keep_b, pb = device_tensor(bt)
        tma_b = host.encode_tiled(pb, "float16", bt.shape, bt.strides, (n, BK), 128)
    else:
        keep_b, pb = device_tensor(b)
        tma_b = host.encode_tiled(pb, "float16", b.shape, b.strides, (BK, 64), 128)
    regs = pack_a_registers(a, k_steps) if rs else np.zeros((1, 1, 1), np.uint32)
    out = np.full((128, n // 2), np.nan, np.float32)
    make_kernel(n, k_steps, b_major, rs)[1, 256](tma_a.to_device(), tma_b.to_device(), regs, out)
    del keep_a, keep_b
    d = np.full((64, n), np.nan)
    for t in range(128):
        for i in range(n // 2):
            d[accumulator_position(t, i)] = out[t, i]
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert not np.isnan(d).any()
    assert np.abs(d - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.sim
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_pieces_compose_an_fp8_product(fmt):
    """The same composition on 8-bit floats: k32 wgmmas over 128-element (128-byte) boxes,
    tensor maps of bytes; two k steps (k 256) against float64 of the codes' values."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng()
    n, k_steps = 64, 2
    k = k_steps * 128
    dt = getattr(ml_dtypes, fmt)
    a = (rng.standard_normal((64, k)) * 4).astype(dt)
    bt = (rng.standard_normal((n, k)) * 4).astype(dt)              # B stored as Bᵀ: K-major
    keep_a, pa = device_tensor(a.view(np.uint8))
    keep_b, pb = device_tensor(bt.view(np.uint8))
    tma_a = host.encode_tiled(pa, "uint8", a.shape, a.strides, (64, 128), 128)
    tma_b = host.encode_tiled(pb, "uint8", bt.shape, bt.strides, (n, 128), 128)
    out = np.full((128, n // 2), np.nan, np.float32)
    make_kernel(n, k_steps, "k", False, fmt)[1, 256](tma_a.to_device(), tma_b.to_device(),
                                                     np.zeros((1, 1, 1), np.uint32), out)
    del keep_a, keep_b
    d = np.full((64, n), np.nan)
    for t in range(128):
        for i in range(n // 2):
            d[accumulator_position(t, i)] = out[t, i]
    ref = a.astype(np.float64) @ bt.astype(np.float64).T
    assert not np.isnan(d).any()
    assert np.abs(d - ref).max() <= 1e-5 * np.abs(ref).max()


def test_fp8_operands_are_k_major():
    assert SmemOperand(64, 256, "k", 1).step(5) == 64 * 128 + 32   # box 2 (of 128), step 1
    with pytest.raises(ValueError, match="K-major only"):
        SmemOperand(64, 128, "mn", 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        SmemOperand(64, 48, "k", 1)
    with pytest.raises(ValueError, match="1-byte elements; the SmemOperands say 2-byte"):
        warpgroup_mma(64, SmemOperand(64, 128, "k"), SmemOperand(64, 128, "k"),
                      "float8_e4m3fn")
    rs = warpgroup_mma(64, SmemOperand(64, 128, "k", 1), None, "float8_e4m3fn")  # A in regs
    assert rs.mma is None and rs.mma_rs is not None and rs.K_STEPS == 4
    with pytest.raises(ValueError, match="differ only between the 8-bit formats"):
        warpgroup_mma(64, SmemOperand(64, 128, "k"), SmemOperand(64, 128, "k"), "float16",
                      b_dtype="bfloat16")


# ---- simulator: schedulers ---------------------------------------------------------------------

def test_grouped_raster_visits_every_tile_once():
    order = grouped_raster(64, 32, group_m=3)

    @cuda.jit
    def kernel(tiles_m, tiles_n, out):
        w = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x
        if w < out.shape[0]:
            z, r, c = order.tile_origin(w, tiles_m, tiles_n)
            out[w, 0] = z
            out[w, 1] = r
            out[w, 2] = c

    tiles_m, tiles_n, batch = 7, 5, 2
    out = np.full((tiles_m * tiles_n * batch, 3), -1, np.int64)
    kernel[3, 32](tiles_m, tiles_n, out)
    seen = {tuple(x) for x in out}
    assert seen == {(z, 64 * i, 32 * j) for z in range(batch) for i in range(tiles_m)
                    for j in range(tiles_n)}
    # within a group of 3 block rows the rows run fastest
    assert [tuple(x) for x in out[:4]] == [(0, 0, 0), (0, 64, 0), (0, 128, 0), (0, 0, 32)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,heads,n_qb,sk", [(1, 3, 5, 16384), (2, 3, 4, 100),
                                                 (3, 1, 1, 40000)])
def test_heavy_first_order(batch, heads, n_qb, sk, causal):
    """The persistent tile order is a permutation of (batch, head, query block); causal:
    within each L2 group of heads the query blocks go from the heaviest (last) down, and the
    group holds as many heads as fit L2_GROUP_BYTES (2 at head_dim 128 and 16 K keys)."""
    at = heavy_first(128, causal).at
    order = [at(t, n_qb, heads, batch, sk) for t in range(batch * heads * n_qb)]
    assert sorted(order) == [(b, h, q) for b in range(batch) for h in range(heads)
                             for q in range(n_qb)]
    if not causal:
        assert order[:n_qb] == [(0, 0, q) for q in range(n_qb)]
        return
    per = max(1, L2_GROUP_BYTES // (4 * 128 * sk))
    bh = [b * heads + h for b, h, _ in order]
    for i in range(1, len(order)):
        if bh[i] // per == bh[i - 1] // per:     # same group: query blocks never go up
            assert order[i][2] <= order[i - 1][2]
        else:                                   # groups in order, each from the heaviest
            assert bh[i] // per == bh[i - 1] // per + 1 and order[i][2] == n_qb - 1


@pytest.mark.sim
@pytest.mark.parametrize("heavy", [False, True])
def test_key_block_order_visits_every_block_once(heavy):
    """A dK / dV kernel's blocks (grid: key blocks × K/V heads × batch): each (batch, head, key
    block) once, with its first key and group size; heavy (causal), the grid's linear order
    takes every head's first key block (the heaviest), then every head's second, … (all heads
    fit one L2 group here)."""
    from tilepy.tile.attention_backward import key_block_order

    coords = key_block_order(64, 128, heavy)
    n_kb, hk, batch = 4, 3, 2

    @cuda.jit
    def kernel(q, k, out):
        sq, sk, b, h, group, key0, kb = coords(q, k)
        i = cuda.blockIdx.x + cuda.gridDim.x * (cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z)
        for j, x in enumerate((sq, sk, b, h, group, key0, kb)):
            out[i, j] = x

    q = np.zeros((batch, 2 * hk, 70, 8), np.float16)
    k = np.zeros((batch, hk, 200, 8), np.float16)
    out = np.full((n_kb * hk * batch, 7), -1, np.int64)
    kernel[(n_kb, hk, batch), 1](q, k, out)
    assert (out[:, :2] == [70, 200]).all() and (out[:, 4] == 2).all()
    assert (out[:, 5] == 64 * out[:, 6]).all()
    assert sorted(map(tuple, out[:, [2, 3, 6]])) == [
        (b, h, kb) for b in range(batch) for h in range(hk) for kb in range(n_kb)]
    kbs = list(out[:, 6])
    assert kbs == (sorted(kbs) if heavy else [i % n_kb for i in range(len(kbs))])


@pytest.mark.sim
def test_ticket_scheduler_hands_out_each_item_once_and_resets():
    sched = ticket_scheduler()

    @cuda.jit
    def kernel(counter, total, owner):
        if cuda.threadIdx.x == 0:
            w = sched.first()
            while w < total:
                owner[w] = cuda.blockIdx.x
                w = sched.draw(counter)
            sched.finish(counter)

    counter = np.zeros(2, np.int32)
    owner = np.full(11, -1, np.int32)
    kernel[3, 32](counter, 11, owner)
    assert (owner >= 0).all() and list(owner[:3]) == [0, 1, 2]
    assert list(counter) == [0, 0]


def make_copy_ring_kernel(rounds: int, waited: bool = False):
    """cp.async producers through the ring: warpgroup 0's 128 threads each copy 16 bytes of
    round r's 2 KiB of ``src`` into slot r % 2 and arrive (cp.async.mbarrier.arrive.noinc, or
    with ``waited`` ``arrive_copied``: the copies waited for and fenced, then an arrival);
    warpgroup 1's 128 threads wait for the slot, each copies 16 bytes of it out — 16 words
    past the ones its own producer thread wrote, so the whole slot must have landed — meet
    (warp_sync), and release it. ``out`` gets every round."""
    from tilepy.ptx import barrier as BAR
    from tilepy.ptx import cp_async as CP
    from tilepy.ptx.address import global_addr

    SLOT = 128 * 16
    lay = SmemLayout.of(("slots", 2 * SLOT, 128), ("bars", 32, 8))
    SLOTS, BARS = lay.offset("slots"), lay.offset("bars")
    ring = tma_pipeline(2, 4, producers=128)
    roles = warpgroup_roles(1)
    words = lay.nbytes // 2
    WAITED = waited

    @cuda.jit
    def kernel(src, out):
        smem = cuda.shared.array(words, uint16)
        base = shared_addr(smem, 0)
        bars = base + BARS
        tid = cuda.threadIdx.x
        if tid == 0:
            ring.init(bars)
            MB.fence_mbarrier_init()
        cuda.syncthreads()
        if tid < 128:
            roles.enter_producer()
            s, ph = 0, 0
            for r in range(rounds):
                ring.acquire(bars, s, ph)
                CP.cp_async_cg_16(base + SLOTS + s * SLOT + 16 * tid,
                                  global_addr(src, (r * SLOT // 4 + 4 * tid,)), 16)
                if WAITED:
                    ring.arrive_copied(bars, s)
                else:
                    ring.arrive_copies(bars, s)
                s, ph = ring.advance(s, ph)
            CP.cp_async_wait_all()
        else:
            roles.enter_consumer()
            t = tid - 128
            for r in range(rounds):
                s, ph = ring.at(r)
                ring.wait(bars, s, ph)
                for i in range(4):     # lane t of warp w reads 16 words past the others'
                    j = (t * 4 + i + 64) % (SLOT // 4)
                    out[r * SLOT // 4 + j] = smem.view(np.uint32)[(SLOTS + s * SLOT) // 4 + j]
                BAR.warp_sync()
                ring.release(bars, s, t % 32)

    return kernel


@pytest.mark.sim
@pytest.mark.parametrize("waited", [False, True])
def test_cp_async_producers_fill_the_ring(waited):
    rounds = 5
    rng = np.random.default_rng()
    src = rng.integers(0, 2**32, rounds * 512, dtype=np.uint32)
    out = np.zeros_like(src)
    make_copy_ring_kernel(rounds, waited)[1, 256](src, out)
    np.testing.assert_array_equal(out, src)


def make_rows_copy_kernel(rows, cols, threads, valid_cols):
    """One block of ``threads`` threads: shared memory poisoned, then
    :func:`tilepy.tile.copy.copy_rows_to_shared_128b`'s copies of ``src`` (rows × valid
    columns, uint16) for ``rows_left`` rows, waited for, and shared memory copied to ``out``."""
    from tilepy.ptx import cp_async as CP
    from tilepy.ptx.address import global_addr
    from tilepy.tile.copy import copy_rows_to_shared_128b

    issue = copy_rows_to_shared_128b(rows, cols, threads, valid_cols)
    words = rows * cols
    T_ = threads

    @cuda.jit
    def kernel(src, out, rows_left):
        smem = cuda.shared.array(words, uint16)
        tid = cuda.threadIdx.x
        for i in range(tid, words, T_):
            smem[i] = 0xFFFF
        cuda.syncthreads()
        issue(shared_addr(smem, 0), np.int64(global_addr(src, (0, 0))), src.strides[0],
              rows_left, tid)
        CP.cp_async_wait_all()
        cuda.syncthreads()
        for i in range(tid, words, T_):
            out[i] = smem[i]

    return kernel


@pytest.mark.sim
@pytest.mark.parametrize("rows, cols, threads, valid, rows_left", [
    (64, 128, 128, None, 64),     # one chunk a thread per pass (rows 8 apart)
    (64, 256, 128, None, 64),     # two chunk groups a thread (the 256-column tiles)
    (64, 256, 128, 200, 37),      # padded columns and rows past the end zero-filled
])
def test_rows_copy_writes_the_swizzled_boxes(rows, cols, threads, valid, rows_left):
    """Every 16-byte chunk of the (rows × cols) tile lands once, at ``(c // 8) · rows · 128 +
    r · 128 + ((c % 8) ^ (r % 8)) · 16`` — the source's chunk, or zeros past ``rows_left`` and
    the valid columns; nothing of the poison is left."""
    rng = np.random.default_rng()
    vc = cols if valid is None else valid
    src = rng.integers(0, 2**15, (rows, vc), dtype=np.uint16)
    out = np.zeros(rows * cols, np.uint16)
    make_rows_copy_kernel(rows, cols, threads, valid)[1, threads](src, out, rows_left)
    want = np.zeros_like(out)
    for r in range(rows):
        for c in range(cols // 8):
            at = ((c // 8) * rows * 128 + r * 128 + ((c % 8) ^ (r % 8)) * 16) // 2
            if r < rows_left and 8 * c < vc:
                want[at:at + 8] = src[r, 8 * c:8 * c + 8]
    np.testing.assert_array_equal(out, want)


# ---- offline compile for sm_90a ----------------------------------------------------------------

def compile_reports():
    """sm_90a compiles of the composed kernel (``python -m tilepy.offline``)."""
    from tilepy.offline import compile_kernel

    u8 = types.uint8[::1]
    sig = (u8, u8, types.uint32[:, :, ::1], types.float32[:, ::1])
    out = []
    for name, args in (("pieces_kmajor", (64, 4, "k", False)),
                       ("pieces_mnmajor", (128, 4, "mn", False)),
                       ("pieces_rs", (64, 4, "mn", True))):
        rep = compile_kernel(name, make_kernel(*args).py_func, sig, (9, 0, "a"))
        out.append({"name": name, "registers": rep.registers,
                    "spill": rep.spill_stores + rep.spill_loads, "local": rep.local_bytes,
                    "counts": rep.counts})
    rep = compile_kernel("copy_ring", make_copy_ring_kernel(3).py_func,
                         (types.uint32[::1], types.uint32[::1]), (9, 0, "a"))
    out.append({"name": "copy_ring", "registers": rep.registers,
                "spill": rep.spill_stores + rep.spill_loads, "local": rep.local_bytes,
                "counts": rep.counts, "noinc": "cp.async.mbarrier.arrive.noinc" in rep.ptx,
                "warp_sync": "bar.warp.sync" in rep.ptx})
    return out


@pytest.mark.compile
def test_pieces_compile_for_sm90a_without_spills():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reps = run_in_subprocess("tests.test_tile_hopper:compile_reports")
    assert set(reps) == {"pieces_kmajor", "pieces_mnmajor", "pieces_rs", "copy_ring"}
    ring = reps.pop("copy_ring")
    assert ring["noinc"] and ring["warp_sync"] and ring["spill"] == 0, ring
    for name, rep in reps.items():
        assert rep["spill"] == 0 and rep["local"] == 0, (name, rep)
        c = rep["counts"]
        assert c["wgmma.mma_async"] >= 4 and c["cp.async.bulk.tensor"] >= 2, (name, c)
        assert c["mbarrier"] >= 4 and c["ld.local"] == 0 and c["st.local"] == 0, (name, c)
