"""A warp-specialised TMA + wgmma GEMM for Hopper (sm_90a) from tilepy.tile's pieces: the code
of docs/custom-kernels-hopper.md, which explains it step by step."""

import functools

import numpy as np
from numba import cuda, types

from tilepy import arrays, launch
from tilepy.inline import inline_device
from tilepy.ptx import mbarrier, shared_addr, tma, wgmma
from tilepy.tile import epilogue, pipeline, roles, schedule, smem, smem_layout, tma_copy
from tilepy.tile import tma as host_tma, tma_plan
from tilepy.tile.warpgroup_mma import SmemOperand, warpgroup_mma

BM, BK = 128, 64          # block rows (two consumers of 64 rows); k per stage (a swizzle row)
BOX = 64 * 64 * 2         # bytes of a 64 × 64 box of 16-bit elements (128-byte rows)
PASS = 128                # output columns a consumer stages per TMA-store pass
MAP_B, MAP_OUT = np.uint64(128), np.uint64(256)   # byte offsets of B's and out's maps
ONE = np.float32(1)


@functools.cache
def hopper_gemm(dtype="float16", block_n=256, stages=4, group_m=8):
    """``kernel(a, b, out, maps)``: out = a @ b for 2-D uint16 views of 16-bit matrices;
    ``maps``: the tensor maps of a, b and out (384 bytes). Tiles of 128 × ``block_n``."""
    BN, PN = block_n, min(block_n, PASS)
    if BN not in (64, 128, 256):
        raise ValueError(f"block_n must be 64, 128 or 256, got {BN}")
    A_BYTES, STAGE = BM * BK * 2, (BM + BN) * BK * 2
    ring = pipeline.tma_pipeline(stages, 8)        # 8 releases: lane 0 of each consumer warp
    lay = smem_layout.SmemLayout.of(("stages", stages * STAGE, 1024),
                                    ("staging", 2 * 64 * PN * 2, 1024),
                                    ("barriers", ring.nbytes, 8))
    STAGES, STAGING, BARS = (lay.offset(r) for r in ("stages", "staging", "barriers"))
    role = roles.warpgroup_roles(2, producer_regs=40, consumer_regs=232)
    load_a = tma_copy.tma_tile(1, A_BYTES)             # 128 rows × 64 k
    load_b = tma_copy.tma_tile(BN // 64, BOX)          # BN / 64 boxes of 64 k × 64 n
    mma = warpgroup_mma(BN, SmemOperand(BN, BK, "mn"), SmemOperand(BM, BK, "k"), dtype)
    stage0, stage1 = (epilogue.stage_accumulators_swizzled(BN // 8, dtype, first=f,
                                                           count=PN // 8)
                      for f in (0, (BN - PN) // 8))
    order, sched = schedule.grouped_raster(BM, BN, group_m), schedule.static_persistent()
    WG0 = roles.NamedBarriers().take("consumer", 128, count=2)   # one per consumer
    NACC, ALIGN = mma.NACC, None if arrays.SIMULATOR else lay.align   # closure constants

    @inline_device
    def produce(base, maps, m_tiles, n_tiles, ktiles, w0, step):
        ta = tma.tensor_map_address(maps)
        tma.fence_proxy_tensormap_acquire(ta)
        tma.fence_proxy_tensormap_acquire(ta + MAP_B)
        s, ph = 0, 0
        for w in range(w0, m_tiles * n_tiles, step):
            _, row0, col0 = order.tile_origin(w, m_tiles, n_tiles)
            for kt in range(ktiles):
                ring.acquire(base + BARS, s, ph)           # the consumers freed slot s
                full = ring.commit(base + BARS, s, STAGE)  # expect its bytes
                dst = base + STAGES + s * STAGE
                load_a.load_2d(dst, ta, full, kt * BK, row0)
                load_b.load_2d(dst + A_BYTES, ta + MAP_B, full, col0, kt * BK)
                s, ph = ring.advance(s, ph)

    @inline_device
    def mainloop(acc, base, s, ph, cw, ktiles, lane):
        prev = 0
        for kt in range(ktiles):
            ring.wait(base + BARS, s, ph)                  # slot s has landed
            stage = base + STAGES + s * STAGE
            mma.fence()
            mma.mma(acc, stage + cw * 64 * 128, stage + A_BYTES, min(kt, 1))  # 0: acc = A·B
            mma.commit()
            mma.wait(1)                                    # step kt - 1 has retired ...
            if kt > 0:
                ring.release(base + BARS, prev, lane)      # ... so its slot is free
            prev = s
            s, ph = ring.advance(s, ph)
        mma.wait(0)
        mma.fence_operand(acc)
        ring.release(base + BARS, prev, lane)
        return s, ph

    @inline_device
    def store(acc, stg, omap, row0, col0, m, n, cw, tw):
        for p in range(BN // PN):
            if tw == 0:
                tma.bulk_wait_group_read(0)                # the last store has read stg
            role.bar_sync(WG0 + cw, 128)
            if p == 0:
                stage0(acc, stg, row0, col0, m, n, ONE, ONE, 0, ONE, tw)
            else:
                stage1(acc, stg, row0, col0, m, n, ONE, ONE, 0, ONE, tw)
            wgmma.fence_proxy_async_shared()               # st.shared before TMA reads
            role.bar_sync(WG0 + cw, 128)
            if tw == 0:
                for bx in range(PN // 64):
                    if col0 + p * PN + 64 * bx < n:
                        tma.tma_store_2d(omap, stg + BOX * bx, col0 + p * PN + 64 * bx, row0)
                tma.bulk_commit_group()

    @inline_device
    def consume(base, maps, cw, m, n, m_tiles, n_tiles, ktiles, w0, step, tid):
        acc = cuda.local.array(NACC, types.float32)   # the 64 × BN tile: BN / 2 per thread
        tw, stg = tid % 128, base + STAGING + cw * (64 * PN * 2)
        omap = tma.tensor_map_address(maps) + MAP_OUT
        if tw == 0:
            tma.fence_proxy_tensormap_acquire(omap)
        s, ph = 0, 0
        for w in range(w0, m_tiles * n_tiles, step):
            _, row0, col0 = order.tile_origin(w, m_tiles, n_tiles)
            s, ph = mainloop(acc, base, s, ph, cw, ktiles, tid % 32)
            store(acc, stg, omap, row0 + 64 * cw, col0, m, n, cw, tw)
        if tw == 0:
            tma.bulk_wait_group_read(0)      # no store still reads shared memory at exit

    @(cuda.jit if arrays.SIMULATOR else cuda.jit(launch_bounds=(role.THREADS, 1)))
    def kernel(a, b, out, maps):
        (m, k), n = a.shape, b.shape[1]
        m_tiles, n_tiles, ktiles = (m + BM - 1) // BM, (n + BN - 1) // BN, (k + BK - 1) // BK
        w0, step = sched.first_and_step()
        base = shared_addr(cuda.shared.array(0, types.uint16, alignment=ALIGN) if ALIGN
                           else cuda.shared.array(0, types.uint16), 0)
        tid = cuda.threadIdx.x
        wg = role.warpgroup(tid)
        if tid == 0:
            ring.init(base + BARS)
            mbarrier.fence_mbarrier_init()
        cuda.syncthreads()                   # the barriers exist before anyone waits
        if wg == role.PRODUCER_WG:
            role.enter_producer()
            if tid == 0:
                produce(base, maps, m_tiles, n_tiles, ktiles, w0, step)
        else:
            role.enter_consumer()
            consume(base, maps, role.consumer(wg), m, n, m_tiles, n_tiles, ktiles, w0, step,
                    tid)

    kernel.block_n, kernel.threads, kernel.smem_bytes = BN, role.THREADS, lay.nbytes
    return kernel


_bound = {}   # launch plans by call signature


def matmul(a, b, out=None, *, block_n=256, stages=4):
    """``a @ b`` (M × K, K × N; row-major float16 or bfloat16, K and N multiples of 8) into
    ``out`` (default: a new array), as CuPy / PyTorch / Numba (simulator: NumPy) arrays."""
    A, B = (arrays.describe(x, name, allow_float32=False) for x, name in ((a, "a"), (b, "b")))
    out = arrays.empty(A, (A.shape[0], B.shape[1]), A.dtype) if out is None else out
    O = arrays.describe(out, "out", allow_float32=False)
    if A.shape[1] != B.shape[0] or O.shape != (A.shape[0], B.shape[1]) or \
            not A.dtype == B.dtype == O.dtype:
        raise ValueError(f"a {A.shape} {A.dtype} @ b {B.shape} {B.dtype} -> out {O.shape} "
                         f"{O.dtype}: expected (M, K) @ (K, N) -> (M, N), one dtype")
    key = (A.family, A.device, A.dtype, A.shape, A.strides, B.shape, B.strides, O.strides,
           block_n, stages)
    if key not in _bound:
        _bound[key] = _plan(hopper_gemm(A.dtype, block_n, stages), A, B, O)
    _bound[key](arrays.stream_handle(A), [x.byte_pointer() for x in (A, B, O)])
    return out


def _plan(kernel, A, B, O):
    """A launch plan of ``kernel`` for operands shaped like A, B, O, bound to their pointers
    (the plan encodes the tensor maps of each call's pointers, and caches them)."""
    views = [arrays.kernel_view(x) for x in (A, B, O)]
    (m, k), n = views[0].shape, views[1].shape[1]
    boxes = (((m, k), (BM, BK)), ((k, n), (BK, 64)), ((m, n), (64, 64)))

    def encode(*ptrs):   # A, B, out: 128-byte-swizzled boxes of 64 16-bit columns
        return np.concatenate([host_tma.encode_tiled(p, A.dtype, shape, v.strides, box).data
                               for p, v, (shape, box) in zip(ptrs, views, boxes)])

    alloc, stream = arrays.byte_allocator(A), arrays.stream_handle(A)
    maps = host_tma.maps_to_device(encode(*(x.byte_pointer() for x in (A, B, O))), stream,
                                   alloc)
    args = (*views, maps.view((maps.nbytes,), np.uint8))
    smem.allow_dynamic_shared(kernel, args, kernel.smem_bytes)
    grid = min(launch.sm_count(132), -(-m // BM) * -(-n // kernel.block_n))
    plan = tma_plan.TmaLaunchPlan(kernel, args, max(grid, 1), kernel.threads,
                                  kernel.smem_bytes, encode, (0, 1, 2), 3, alloc=alloc)
    return plan.bind([(i, x.byte_pointer()) for i, x in enumerate((A, B, O))])
