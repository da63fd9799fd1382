"""gemm_softmax's Hopper kernel: ``out = softmax(alpha · a @ b, axis=-1)`` on the warp-specialised
TMA + wgmma GEMM (:mod:`tilepy.ops.gemm_wgmma_ws`), whose producer and consumer main loop it
reuses (:func:`~tilepy.ops.gemm_wgmma_ws.tma_producer`,
:func:`~tilepy.ops.gemm_wgmma_ws.consumer_mainloop`): a block owns 128 rows and walks their
columns in chunks through the same stage ring; the online softmax runs on the accumulators.
Launched through :func:`tilepy.ops.gemm_wgmma_ws.plan` (the kernel carries its grid, shared
memory and operand checks).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
from numba import cuda, types

from ..inline import device_namespace, inline_device
from ..ptx import barrier as BAR
from ..ptx import mbarrier as MB
from ..ptx import shared_addr
from ..ptx import tma as T
from ..ptx import vector as VEC
from ..ptx import wgmma as W
from ..ptx.math import ex2_approx, unpack_bf16x2_f32, unpack_f16x2_f32
from ..tile.config import SMEM_LIMIT
from ..tile.epilogue import (
    SWIZZLED_BOX_BYTES,
    _pair_io,
    store_accumulators_smem,
    swizzled_pair_offset,
)
from ..tile.roles import warpgroup_roles
from ..tile.schedule import udiv
from ..tile.smem import dynamic_shared
from ..tile.warpgroup_mma import SmemOperand, warpgroup_mma
from .gemm_wgmma_ws import (
    BK,
    MAP_OUT,
    WARPGROUP,
    WsConfig,
    consumer_mainloop,
    kernel_jit,
    stage_ring,
    tma_producer,
)

#: softmax mode: at most this many chunks of ``block_n`` columns per row (N ≤ 16 · block_n)
SOFTMAX_CHUNKS = 16
#: softmax mode: the parked values are ``p · 2**15`` (p ≤ 1), which keeps float16 out of its
#: subnormals; the rescale divides it out
SOFTMAX_PARK = 32768.0
# softmax mode, shared bytes per consumer warpgroup (64 rows: 32 pairs of rows g, g + 8):
_STATS_WG = SOFTMAX_CHUNKS * 32 * 8   # each row pair's running max after every chunk
_FINAL_WG = 32 * 16                   # each row pair's final max and sum
_RED_WG = 128 * 8                     # every thread's partial result for its row pair
_FBAR_WG = 3 * 8                      # tma_out: the final rescale's three load mbarriers


def softmax_stats_bytes(cfg: WsConfig) -> int:
    """Shared memory the softmax mode adds after :attr:`WsConfig.smem_bytes`: per consumer
    warpgroup, each row's running max after every chunk (with ``tma_out``, overwritten by the
    chunk's rescale factor at the end), its final max and sum, the quads' partial results,
    and three mbarriers."""
    return cfg.consumers * (_STATS_WG + _FINAL_WG + _RED_WG + _FBAR_WG)


def check_softmax_config(cfg: WsConfig, out_kind, activation=None, has_bias=False,
                         has_c=False):
    """Raise ValueError unless ``cfg`` (and a 16-bit output, no epilogue extras) suits the
    softmax mode."""
    if not (cfg.persistent and cfg.smem_epilogue and cfg.consumers == 2
            and cfg.rows_per_consumer == 64 and not cfg.tma_store and cfg.cluster == 1
            and cfg.splits == 1 and not cfg.pingpong):
        raise ValueError("softmax mode needs WsConfig(128, block_n, persistent=True, "
                         f"smem_epilogue=True) with two consumers of 64 rows (no clusters, no "
                         f"split-K, no ping-pong), got {cfg}")
    if out_kind not in ("float16", "bfloat16") or activation or has_bias or has_c:
        raise ValueError("softmax mode: 16-bit output, no activation, bias or c")
    if cfg.smem_bytes + softmax_stats_bytes(cfg) > SMEM_LIMIT[(9, 0)]:
        raise ValueError(f"softmax mode: {cfg.smem_bytes} + {softmax_stats_bytes(cfg)} B of "
                         "shared memory do not fit; use fewer stages")


@functools.cache
def gemm_softmax_wgmma_kernel(cfg: WsConfig, b_row_major: bool, out_kind: str,
                              tma_out: bool = False, overlap: bool = False):
    """The kernel ``kernel(a, b, out, c, bias, alpha, beta, maps)`` — the GEMM kernel's
    arguments (``c``, ``bias`` and ``beta`` unused) — computing ``out = softmax(alpha · a @ b,
    axis=-1)`` for one matrix (no batch).

    A block owns 128 rows and walks their N in chunks of
    ``block_n`` columns through the same pipeline (a persistent loop over the chunks, so the
    producer streams on across them); after each chunk the consumers run the online softmax
    on their accumulators in registers (running row max and sum, ``p = exp(s − running
    max)``, as :func:`tilepy.tile.online_softmax.online_softmax_update` does), park
    ``p · 2**15`` in ``out`` through the staged epilogue and note each row's running max. After
    the last chunk each consumer rescales its 64 rows in place (still in L2) by
    ``exp(m_chunk − m_row) / sum``. The four lanes holding a row combine their partial max
    and sum through shared memory and the warpgroup's named barrier, not shuffles: the
    simulator's shuffles need every live thread of the block, and the producer is meanwhile
    waiting on an mbarrier. Launch through :func:`plan` (grid: one block per 128 rows;
    N ≤ :data:`SOFTMAX_CHUNKS` · block_n).

    ``tma_out`` (softmax mode; ``out`` must suit a tensor map: unit column stride, 16-byte
    rows and base, which :func:`plan` checks): the parked chunks leave through TMA stores from
    128-byte-swizzled staging (boxes of 64 rows × 64 columns) that run on while the next
    chunk's main loop does, instead of 16-byte stores by every thread; the last chunk is
    stored final (``p / sum``: its running max is the row's) and never rescaled; and the
    rescale streams each earlier chunk through shared memory — TMA load into one of three
    buffers per warpgroup (two freed stage buffers, loaded as soon as the last main loop is
    over, and the staging), multiply by a per-(row, chunk) factor computed once into shared
    memory, TMA store. L2 hints: parked chunks evict-last, final stores evict-first.
    (What each piece costs: bench/NOTES.md.)

    ``overlap`` (softmax mode with ``tma_out``; block_n 128, at least 3 stages, and K of at
    least ``stages − 1`` k-steps, which :func:`plan` checks): each
    consumer keeps two accumulators and, FlashAttention-3 style, issues the first
    ``stages − 1`` k-steps of chunk j + 1 into one before it runs chunk j's softmax and park
    on the other, so the tensor cores work through the epilogue instead of waiting for it;
    the rest of chunk j + 1 follows as usual.
    """
    c = _softmax_parts(cfg, b_row_major, out_kind, tma_out, overlap)
    return _softmax_kernel(cfg, c, _consumer_parts(cfg, c, _finish_parts(cfg, c)))


def _softmax_parts(cfg: WsConfig, b_row_major: bool, out_kind: str, tma_out: bool,
                   overlap: bool):
    """The softmax mode's shared pieces (a namespace): its sizes and shared-memory offsets,
    the warpgroup MMA and roles, the stage ring, the online softmax of a chunk's accumulators
    (the four lanes of a row combined through shared memory), and a chunk's park through the
    TMA-store staging."""
    if overlap and not (tma_out and cfg.block_n == 128 and cfg.stages >= 3):
        raise ValueError("overlap: softmax mode with tma_out, block_n 128 and >= 3 stages")
    check_softmax_config(cfg, out_kind)
    BM, BN, ST, NC = cfg.block_m, cfg.block_n, cfg.stages, cfg.consumers
    NACC = BN // 2
    NI = BN // 8
    A_BYTES = BM * BK * 2
    STAGE_BYTES = cfg.stage_bytes
    lay = cfg.layout
    STAGES, BARS = lay.offset("stages"), lay.offset("barriers")
    ROW_OFF = 64                   # a consumer's first row in the tile
    EPI_OFF = lay.offset("staging")
    EPI_WG = cfg.epilogue_bytes // NC         # staging bytes per consumer warpgroup
    CONSUMERS = NC * WARPGROUP
    bars_ids = cfg.named_barriers
    BAR_CONSUMERS = bars_ids.ids["consumers"]
    BAR_WG0 = bars_ids.ids["warpgroup"]
    wmma = warpgroup_mma(BN, SmemOperand(BN, BK, "mn" if b_row_major else "k"),
                         SmemOperand(BM, BK, "k"), cfg.dtype)
    store_smem = store_accumulators_smem(1, NI, out_kind)
    dynamic_shared_buffer = dynamic_shared(lay.align)
    f32 = types.float32
    TMA_OUT = tma_out
    OVERLAP = overlap
    PRE = cfg.stages - 1                # overlap: k-steps of the next chunk issued ahead
    STATS_OFF = cfg.smem_bytes          # see softmax_stats_bytes
    FINAL_OFF = STATS_OFF + NC * _STATS_WG
    RED_OFF = FINAL_OFF + NC * _FINAL_WG
    FBAR_OFF = RED_OFF + NC * _RED_WG
    NB = BN // 64                       # TMA stores: boxes of 64 rows × 64 columns per tile
    CT = 64 * BN * 2                    # TMA stores: bytes of a warpgroup's 64-row tile
    if tma_out and (EPI_OFF % 1024 or EPI_WG % 1024 or EPI_WG < CT
                    or 2 * NC * CT > ST * STAGE_BYTES):
        raise ValueError(f"tma_out: {cfg} leaves no room for the swizzled staging and the "
                         "rescale's buffers")
    get_pair, put_pair, pack2 = _pair_io(out_kind)
    unpack2 = unpack_bf16x2_f32 if out_kind == "bfloat16" else unpack_f16x2_f32
    NEG_INF = np.float32(-np.inf)
    LOG2E = np.float32(1.4426950408889634)
    PARK = np.float32(SOFTMAX_PARK)
    UNPARK = np.float32(1.0 / SOFTMAX_PARK)
    roles = warpgroup_roles(NC, producer=True, producer_first=True,
                            producer_regs=cfg.producer_regs if cfg.setmaxnreg else 0,
                            consumer_regs=cfg.consumer_regs if cfg.setmaxnreg else 0)
    ring = stage_ring(cfg)

    @inline_device
    def quad_combine(red, warp, lane, cw, x0, x1, take_max):
        """(x0, x1) — a lane's partial result for its rows g and g + 8 — combined over the
        four lanes of its quad (max or sum), through shared memory."""
        q = (warp * 8 + lane // 4) * 4
        VEC.st_shared_v2_f32(red + (q + lane % 4) * 8, x0, x1)
        BAR.bar_sync(BAR_WG0 + cw, WARPGROUP)
        a0, a1, b0, b1 = VEC.ld_shared_v4_f32(red + q * 8)
        c0, c1, d0, d1 = VEC.ld_shared_v4_f32(red + q * 8 + 16)
        if take_max:
            return max(max(a0, b0), max(c0, d0)), max(max(a1, b1), max(c1, d1))
        return (a0 + b0) + (c0 + d0), (a1 + b1) + (c1 + d1)

    @inline_device
    def chunk_softmax(sc, rmax, rsum, red, warp, lane, cw):
        """The online-softmax step of one chunk on its scores (a flat m64n{BN} accumulator:
        ``sc[4·jj + q]``): the running max and the lane's partial running sum of its two
        rows; ``sc`` becomes ``p = exp(s − running max)``."""
        mx0 = NEG_INF
        mx1 = NEG_INF
        for jj in range(NI):
            mx0 = max(mx0, max(sc[4 * jj], sc[4 * jj + 1]))
            mx1 = max(mx1, max(sc[4 * jj + 2], sc[4 * jj + 3]))
        mx0, mx1 = quad_combine(red, warp, lane, cw, mx0, mx1, True)
        for h in range(2):
            m_old = rmax[0, h]
            m_new = max(m_old, mx1 if h else mx0)
            if m_new == NEG_INF:      # nothing finite yet: keep p = 0, no inf − inf
                ms = f32(0)
                scale_old = f32(1)
            else:
                ms = m_new * LOG2E
                scale_old = ex2_approx(m_old * LOG2E - ms)
            acc = rsum[0, h] * scale_old
            for jj in range(NI):
                p0 = ex2_approx(sc[4 * jj + 2 * h] * LOG2E - ms)
                p1 = ex2_approx(sc[4 * jj + 2 * h + 1] * LOG2E - ms)
                sc[4 * jj + 2 * h] = p0
                sc[4 * jj + 2 * h + 1] = p1
                acc += p0 + p1
            rsum[0, h] = acc
            rmax[0, h] = m_new

    @inline_device
    def park_tma(sc, base, omap, row0, col0, n, last, cw, warp, lane, rmax, rsum, keep, drop):
        """tma_out: a chunk's ``p · 2**15`` (the last chunk's ``p / sum``, final) into the
        warpgroup's 128-byte-swizzled staging, stored by one thread with TMA; the last chunk
        also leaves each row pair's final max and sum for :func:`finish_tma`."""
        tw = cuda.threadIdx.x % WARPGROUP
        if tw == 0:
            T.bulk_wait_group_read(0)   # the previous chunk's store has read the staging
        # ... for every thread, and every lane is past its quad's last reads of red
        BAR.bar_sync(BAR_WG0 + cw, WARPGROUP)
        f0 = PARK
        f1 = PARK
        if last:
            l0, l1 = quad_combine(base + RED_OFF + cw * _RED_WG, warp, lane, cw, rsum[0, 0],
                                  rsum[0, 1], False)
            f0 = f32(1) / l0
            f1 = f32(1) / l1
            if lane % 4 == 0:
                fin = base + FINAL_OFF + cw * _FINAL_WG + (warp * 8 + lane // 4) * 16
                VEC.st_shared_v2_f32(fin, rmax[0, 0], rmax[0, 1])
                VEC.st_shared_v2_f32(fin + 8, l0, l1)
        stg = base + EPI_OFF + cw * EPI_WG
        g = lane // 4                  # row % 8 of both of the lane's rows: their swizzle
        for jj in range(NI):
            for h in range(2):
                f = f1 if h else f0
                VEC.st_shared_b32(stg + swizzled_pair_offset(jj, warp * 16 + g + 8 * h, g,
                                                             lane % 4),
                                  pack2(sc[4 * jj + 2 * h] * f, sc[4 * jj + 2 * h + 1] * f))
        W.fence_proxy_async_shared()
        BAR.bar_sync(BAR_WG0 + cw, WARPGROUP)
        if tw == 0:
            # parked chunks are read back at the end: kept in L2 before the operands' lines
            policy = drop if last else keep
            for bx in range(NB):
                if col0 + 64 * bx < n:
                    T.tma_store_2d_hint(omap, stg + bx * SWIZZLED_BOX_BYTES, col0 + 64 * bx,
                                        row0, policy)
            T.bulk_commit_group()

    @inline_device
    def scores_softmax(acc, col0, n, alpha, rmax, rsum, base, warp, lane, cw):
        """A chunk's accumulator (columns col0 …) in place: scaled by alpha (any sign), −inf
        past column n, then the online-softmax step (chunk_softmax)."""
        col = col0 + 2 * (lane % 4)
        for jj in range(NI):
            for q in range(4):
                v = acc[4 * jj + q] * alpha
                if col + 8 * jj + q % 2 >= n:
                    v = NEG_INF
                acc[4 * jj + q] = v
        chunk_softmax(acc, rmax, rsum, base + RED_OFF + cw * _RED_WG, warp, lane, cw)

    @inline_device
    def park_tma_chunk(acc, base, omap, row0, chunk, n_tiles, n, cw, warp, lane, rmax, rsum,
                       keep, drop):
        """tma_out: park_tma of chunk ``chunk``, then (all but the last) the rows' running max
        after it, for the rescale's factors."""
        last = chunk == n_tiles - 1
        park_tma(acc, base, omap, row0, chunk * BN, n, last, cw, warp, lane, rmax, rsum, keep,
                 drop)
        if lane % 4 == 0 and not last:
            VEC.st_shared_v2_f32(base + STATS_OFF + cw * _STATS_WG
                                 + ((chunk * 4 + warp) * 8 + lane // 4) * 8,
                                 rmax[0, 0], rmax[0, 1])

    return SimpleNamespace(**locals())


def _finish_parts(cfg: WsConfig, c):
    """The rescale after the last chunk over the pieces ``c`` (:func:`_softmax_parts`): each
    parked chunk back through shared memory times its per-(row, chunk) factor (``finish_tma``,
    with TMA out) or in place from the fragments' rows (``finish_softmax``)."""
    BAR_CONSUMERS, BAR_WG0, BM, BN, CONSUMERS = c.BAR_CONSUMERS, c.BAR_WG0, c.BM, c.BN, c.CONSUMERS
    CT, EPI_OFF, EPI_WG, FBAR_OFF, FINAL_OFF = c.CT, c.EPI_OFF, c.EPI_WG, c.FBAR_OFF, c.FINAL_OFF
    LOG2E, NB, RED_OFF, STATS_OFF, UNPARK = c.LOG2E, c.NB, c.RED_OFF, c.STATS_OFF, c.UNPARK
    get_pair, pack2, put_pair, quad_combine = c.get_pair, c.pack2, c.put_pair, c.quad_combine
    unpack2 = c.unpack2

    @inline_device
    def load_chunk(bar, buf, omap, chunk, row0, n, drop):
        """tma_out: the parked chunk's boxes (those inside n) into buf, completing on bar."""
        boxes = 0
        for bx in range(NB):
            if chunk * BN + 64 * bx < n:
                boxes += 1
        MB.mbarrier_arrive_expect_tx(bar, boxes * SWIZZLED_BOX_BYTES)
        for bx in range(NB):
            if chunk * BN + 64 * bx < n:
                T.tma_load_2d_hint(buf + bx * SWIZZLED_BOX_BYTES, omap, bar, chunk * BN + 64 * bx,
                                   row0, drop)

    @inline_device
    def prefetch_finish(base, omap, row0, n, nfin, cw, drop):
        """tma_out, after the last chunk's main loop: once every consumer's wgmmas are done
        (the stage buffers are free), load the first two parked chunks for finish_tma."""
        BAR.bar_sync(BAR_CONSUMERS, CONSUMERS)
        if cuda.threadIdx.x % WARPGROUP == 0:
            T.bulk_wait_group(0)        # the parked chunks are in global memory
            for ch in range(min(2, nfin)):
                load_chunk(base + FBAR_OFF + cw * _FBAR_WG + 8 * ch, base + (2 * cw + ch) * CT,
                           omap, ch, row0, n, drop)

    @inline_device
    def finish_tma(base, omap, row0, n, nfin, cw, drop):
        """tma_out, after the last chunk: multiply chunks 0 … nfin − 1 of the warpgroup's 64
        rows by ``exp(m_chunk − m_row) / (sum · 2**15)``, each chunk through shared memory:
        TMA load into one of three buffers (two freed stage buffers, whose first loads
        prefetch_finish issued, and the staging once the last chunk's store has read it),
        scale, TMA store."""
        tw = cuda.threadIdx.x % WARPGROUP
        stats = base + STATS_OFF + cw * _STATS_WG
        # fin and the running maxima were written before the last chunk's staging barrier
        chunk_factors(stats, base + FINAL_OFF + cw * _FINAL_WG, nfin, tw)
        fb = base + FBAR_OFF + cw * _FBAR_WG
        buf0 = base + 2 * cw * CT
        stg = base + EPI_OFF + cw * EPI_WG
        if tw == 0 and nfin > 2:
            T.bulk_wait_group_read(0)   # the last chunk's store has read the staging
            load_chunk(fb + 16, stg, omap, 2, row0, n, drop)
        BAR.bar_sync(BAR_WG0 + cw, WARPGROUP)   # the warpgroup's factors are in
        for ch in range(nfin):
            bsel = ch % 3
            buf = stg if bsel == 2 else buf0 + bsel * CT
            MB.mbarrier_wait_parity(fb + 8 * bsel, (ch // 3) % 2)
            for i in range(CT // (16 * WARPGROUP)):
                off = (tw + WARPGROUP * i) * 16
                f = chunk_factor(stats, ch, (off % SWIZZLED_BOX_BYTES) // 128)
                w0, w1, w2, w3 = VEC.ld_shared_v4_b32(buf + off)
                VEC.st_shared_v4_b32(buf + off, scale_word(w0, f), scale_word(w1, f),
                                     scale_word(w2, f), scale_word(w3, f))
            W.fence_proxy_async_shared()
            BAR.bar_sync(BAR_WG0 + cw, WARPGROUP)
            if tw == 0:
                for bx in range(NB):
                    if ch * BN + 64 * bx < n:
                        T.tma_store_2d_hint(omap, buf + bx * SWIZZLED_BOX_BYTES,
                                            ch * BN + 64 * bx, row0, drop)
                T.bulk_commit_group()
                if ch + 3 < nfin:
                    T.bulk_wait_group_read(0)
                    load_chunk(fb + 8 * bsel, buf, omap, ch + 3, row0, n, drop)
        if tw == 0:
            T.bulk_wait_group_read(0)   # no store still reads shared memory at exit

    @inline_device
    def chunk_factors(stats, fin, nchunks, tw):
        """The rescale's factors, computed once: each (chunk < nchunks, row pair g)'s running
        max in ``stats`` becomes ``exp(m_chunk − m_row) / (sum · 2**15)`` in place (``fin``:
        the pairs' final max and sum); the caller's barrier publishes them."""
        for e in range(tw, nchunks * 32, WARPGROUP):
            g = e % 32
            mf0, mf1 = VEC.ld_shared_v2_f32(fin + g * 16)
            l0, l1 = VEC.ld_shared_v2_f32(fin + g * 16 + 8)
            mj0, mj1 = VEC.ld_shared_v2_f32(stats + e * 8)
            VEC.st_shared_v2_f32(stats + e * 8, ex2_approx((mj0 - mf0) * LOG2E) * (UNPARK / l0),
                                 ex2_approx((mj1 - mf1) * LOG2E) * (UNPARK / l1))

    @inline_device
    def chunk_factor(stats, chunk, rl):
        """The factor (chunk_factors) of local row rl (0 … 63) in a chunk."""
        return VEC.ld_shared_f32(stats + (chunk * 32 + (rl // 16) * 8 + rl % 8) * 8
                                 + 4 * ((rl % 16) // 8))

    @inline_device
    def scale_word(w, f):
        x0, x1 = unpack2(w)
        return pack2(x0 * f, x1 * f)

    @inline_device
    def finish_softmax(base, o, m, n, w0, cw, warp, lane, rmax, rsum):
        """Softmax mode, after the last chunk: the consumer's 64 rows of ``o`` hold
        ``p · 2**15`` per chunk; multiply each by ``exp(m_chunk − m_row) / (sum · 2**15)``."""
        l0, l1 = quad_combine(base + RED_OFF + cw * _RED_WG, warp, lane, cw, rsum[0, 0],
                              rsum[0, 1], False)
        fin = base + FINAL_OFF + cw * _FINAL_WG
        if lane % 4 == 0:
            g = warp * 8 + lane // 4
            VEC.st_shared_v2_f32(fin + g * 16, rmax[0, 0], rmax[0, 1])
            VEC.st_shared_v2_f32(fin + g * 16 + 8, l0, l1)
        # every thread's parked stores (global) and statistics (shared) are done
        BAR.bar_sync(BAR_WG0 + cw, WARPGROUP)
        t = cuda.threadIdx.x % WARPGROUP
        stats = base + STATS_OFF + cw * _STATS_WG
        chunk_factors(stats, fin, (n + BN - 1) // BN, t)
        BAR.bar_sync(BAR_WG0 + cw, WARPGROUP)
        row_base = (cuda.blockIdx.x) * BM + cw * 64
        pairs = (n + 1) // 2
        for rl in range(64):
            r = row_base + rl
            if r < m:
                for cp in range(t, pairs, WARPGROUP):
                    cc = 2 * cp
                    fac = chunk_factor(stats, cc // BN, rl)
                    v0, v1 = get_pair(o, r, cc, n)
                    put_pair(o, r, cc, n, v0 * fac, v1 * fac)

    return SimpleNamespace(**locals())


def _consumer_parts(cfg: WsConfig, c, f):
    """The producer and the consumers' chunk loops over ``c`` and the rescale ``f``
    (:func:`_finish_parts`): ``consume`` one accumulator per chunk, ``consume_overlap`` two,
    the next chunk's first k-steps issued under this chunk's softmax and park."""
    A_BYTES, BARS, BAR_WG0, BM, BN, EPI_OFF = c.A_BYTES, c.BARS, c.BAR_WG0, c.BM, c.BN, c.EPI_OFF
    EPI_WG, NACC, NEG_INF, NI, PARK, PRE = c.EPI_WG, c.NACC, c.NEG_INF, c.NI, c.PARK, c.PRE
    ROW_OFF, ST, STAGES, STAGE_BYTES = c.ROW_OFF, c.ST, c.STAGES, c.STAGE_BYTES
    STATS_OFF, TMA_OUT, b_row_major, f32 = c.STATS_OFF, c.TMA_OUT, c.b_row_major, c.f32
    park_tma_chunk, ring, scores_softmax = c.park_tma_chunk, c.ring, c.scores_softmax
    store_smem, wmma = c.store_smem, c.wmma
    finish_softmax, finish_tma, prefetch_finish = f.finish_softmax, f.finish_tma, f.prefetch_finish

    @inline_device
    def chunk_origin(w, tiles_m, tiles_n):
        """Work item w: chunk ``w % tiles_n`` of the block's rows (``w // tiles_n``)."""
        row = udiv(w, tiles_n)     # (32-bit: schedule.udiv)
        return 0, row * BM, (w - row * tiles_n) * BN

    produce = tma_producer(cfg, b_row_major, device_namespace("softmax chunks",
                                                                tile_origin=chunk_origin))
    mainloop = consumer_mainloop(cfg, b_row_major)

    @inline_device
    def consume(base, a, b, out, c, bias, alpha, cw, n_tiles, ktiles, w0, maps):
        """The consumer of chunks w0 … w0 + n_tiles − 1 (the block's rows), then the
        rescale (finish_tma, or finish_softmax without tma_out)."""
        m = a.shape[1]
        n = b.shape[2] if b_row_major else b.shape[1]
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = (tid % WARPGROUP) // 32
        acc0 = cuda.local.array(NACC, f32)
        acc1 = cuda.local.array(1, f32)
        rmax = cuda.local.array((1, 2), f32)
        rsum = cuda.local.array((1, 2), f32)
        for h in range(2):
            rmax[0, h] = NEG_INF
            rsum[0, h] = f32(0)
        omap = T.tensor_map_address(maps) + MAP_OUT
        keep = T.l2_evict_last_policy() if TMA_OUT else np.uint64(0)
        drop = T.l2_evict_first_policy() if TMA_OUT else np.uint64(0)
        if TMA_OUT and tid % WARPGROUP == 0:
            T.fence_proxy_tensormap_acquire(omap)
        s = 0
        ph = 0
        for w in range(w0, w0 + n_tiles):
            row = udiv(w, n_tiles)
            bm0 = row * BM
            bn0 = (w - row * n_tiles) * BN
            for i in range(NACC):
                acc0[i] = f32(0)
            s, ph = mainloop(acc0, acc1, base, s, ph, cw, ktiles, lane, 0)
            if TMA_OUT and w - w0 == n_tiles - 1:
                # after the last main loop the stage buffers are free: the rescale's first
                # loads run under this chunk's softmax
                prefetch_finish(base, omap, bm0 + cw * ROW_OFF, n, n_tiles - 1, cw, drop)
            scores_softmax(acc0, bn0, n, alpha, rmax, rsum, base, warp, lane, cw)
            if TMA_OUT:
                park_tma_chunk(acc0, base, omap, bm0 + cw * ROW_OFF, w - w0, n_tiles, n,
                               cw, warp, lane, rmax, rsum, keep, drop)
                continue
            for jj in range(NI):
                for q in range(4):
                    acc0[4 * jj + q] *= PARK
            store_smem(acc0, acc1, base + EPI_OFF + cw * EPI_WG, out[0], bm0 + cw * ROW_OFF,
                       bn0, m, n, f32(1), bias, c[0], f32(0), tid % WARPGROUP, BAR_WG0 + cw)
            if lane % 4 == 0:   # the rows' running max after this chunk
                VEC.st_shared_v2_f32(base + STATS_OFF + cw * _STATS_WG
                                     + (((w - w0) * 4 + warp) * 8 + lane // 4) * 8,
                                     rmax[0, 0], rmax[0, 1])
        if TMA_OUT:
            finish_tma(base, omap, udiv(w0, n_tiles) * BM + cw * ROW_OFF, n, n_tiles - 1, cw,
                       drop)
        else:
            finish_softmax(base, out[0], m, n, w0, cw, warp, lane, rmax, rsum)

    # ---- overlap: two accumulators, the next chunk's first k-steps under this chunk's epilogue

    @inline_device
    def issue_kstep(acc, base, bars, s, ph, cw, first):
        """Wait for stage s (parity ph) and issue its k-step's wgmmas into acc, one group;
        ``first``: the chunk's first k-step, whose first wgmma ignores acc (scale-d 0) — no
        instruction but a wgmma may write an accumulator while others are in flight, or
        ptxas serialises every wgmma of the kernel (C7515)."""
        ring.wait(bars, s, ph)
        stage = base + STAGES + s * STAGE_BYTES
        wmma.fence()
        wmma.mma(acc, stage + cw * (ROW_OFF * 128), stage + A_BYTES, 0 if first else 1)
        wmma.commit()
        s, ph = ring.advance(s, ph)
        return s, ph

    @inline_device
    def release_stages(bars, r, pending, keep_n, lane):
        """Free the oldest issued stages (in order, from r) until keep_n stay pending."""
        while pending > keep_n:
            ring.release(bars, r, lane)
            r += 1
            if r == ST:
                r = 0
            pending -= 1
        return r, pending

    @inline_device
    def overlap_step(cur, nxt, j, n_tiles, ktiles, base, bars, s, ph, r, pending, omap, row0,
                     n, alpha, rmax, rsum, cw, warp, lane, keep, drop):
        """Chunk j (not the last) on ``cur``, whose last k-step is the newest group still
        pending: its epilogue under the first k-steps of chunk j + 1 into ``nxt``, then the
        rest of chunk j + 1. Every path leaves the same wgmma state (only ``nxt`` in flight),
        which is what lets ptxas keep the wgmmas asynchronous."""
        for kt in range(PRE):                      # (K >= PRE k-steps: plan() checks)
            s, ph = issue_kstep(nxt, base, bars, s, ph, cw, kt == 0)
        W.wgmma_wait_group(PRE)                    # chunk j's last group is done
        r, pending = release_stages(bars, r, pending + PRE, PRE, lane)
        W.wgmma_fence_operand(cur, NACC)
        scores_softmax(cur, j * BN, n, alpha, rmax, rsum, base, warp, lane, cw)
        park_tma_chunk(cur, base, omap, row0, j, n_tiles, n, cw, warp, lane, rmax, rsum, keep,
                       drop)
        for kt in range(PRE, ktiles):
            s, ph = issue_kstep(nxt, base, bars, s, ph, cw, False)
            W.wgmma_wait_group(1)
            r, pending = release_stages(bars, r, pending + 1, 1, lane)
        return s, ph, r, pending

    @inline_device
    def overlap_last(cur, j, n_tiles, base, bars, r, pending, omap, row0, n, alpha, rmax, rsum,
                     cw, warp, lane, keep, drop):
        """The last chunk on ``cur``: wait for it, start the rescale's loads, its epilogue."""
        W.wgmma_wait_group(0)
        r, pending = release_stages(bars, r, pending, 0, lane)
        W.wgmma_fence_operand(cur, NACC)
        prefetch_finish(base, omap, row0, n, n_tiles - 1, cw, drop)
        scores_softmax(cur, j * BN, n, alpha, rmax, rsum, base, warp, lane, cw)
        park_tma_chunk(cur, base, omap, row0, j, n_tiles, n, cw, warp, lane, rmax, rsum, keep,
                       drop)

    @inline_device
    def consume_overlap(base, a, b, out, alpha, cw, n_tiles, ktiles, w0, maps):
        """The softmax mode's consumer with ``overlap``: chunks alternate between two
        accumulators (overlap_step), then the rescale (finish_tma)."""
        n = b.shape[2] if b_row_major else b.shape[1]
        bars = base + BARS
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = (tid % WARPGROUP) // 32
        accx = cuda.local.array(NACC, f32)
        accy = cuda.local.array(NACC, f32)
        rmax = cuda.local.array((1, 2), f32)
        rsum = cuda.local.array((1, 2), f32)
        for h in range(2):
            rmax[0, h] = NEG_INF
            rsum[0, h] = f32(0)
        omap = T.tensor_map_address(maps) + MAP_OUT
        keep = T.l2_evict_last_policy()
        drop = T.l2_evict_first_policy()
        if tid % WARPGROUP == 0:
            T.fence_proxy_tensormap_acquire(omap)
        row0 = udiv(w0, n_tiles) * BM + cw * ROW_OFF
        s = 0
        ph = 0
        r = 0
        pending = 0
        for kt in range(ktiles):                   # chunk 0, as the plain main loop
            s, ph = issue_kstep(accx, base, bars, s, ph, cw, kt == 0)
            W.wgmma_wait_group(1)
            r, pending = release_stages(bars, r, pending + 1, 1, lane)
        # chunk pairs (x then y) while both have a successor; then the tail, x's last or
        # x's step and y's last (fixed accumulators per position: no runtime choice of one)
        j = 0
        while j + 2 < n_tiles:
            s, ph, r, pending = overlap_step(accx, accy, j, n_tiles, ktiles, base, bars, s, ph,
                                             r, pending, omap, row0, n, alpha, rmax, rsum, cw,
                                             warp, lane, keep, drop)
            s, ph, r, pending = overlap_step(accy, accx, j + 1, n_tiles, ktiles, base, bars, s,
                                             ph, r, pending, omap, row0, n, alpha, rmax, rsum,
                                             cw, warp, lane, keep, drop)
            j += 2
        if j + 2 == n_tiles:
            s, ph, r, pending = overlap_step(accx, accy, j, n_tiles, ktiles, base, bars, s, ph,
                                             r, pending, omap, row0, n, alpha, rmax, rsum, cw,
                                             warp, lane, keep, drop)
            overlap_last(accy, j + 1, n_tiles, base, bars, r, pending, omap, row0, n, alpha,
                         rmax, rsum, cw, warp, lane, keep, drop)
        else:
            overlap_last(accx, j, n_tiles, base, bars, r, pending, omap, row0, n, alpha, rmax,
                         rsum, cw, warp, lane, keep, drop)
        finish_tma(base, omap, row0, n, n_tiles - 1, cw, drop)

    return SimpleNamespace(**locals())


def _softmax_kernel(cfg: WsConfig, c, k):
    """The kernel of :func:`gemm_softmax_wgmma_kernel` from the pieces ``c`` and the chunk
    loops ``k`` (:func:`_consumer_parts`), with the attributes the plan reads."""
    BARS, BM, BN, FBAR_OFF, NC, OVERLAP, ST = c.BARS, c.BM, c.BN, c.FBAR_OFF, c.NC, c.OVERLAP, c.ST
    TMA_OUT, b_row_major, dynamic_shared_buffer = c.TMA_OUT, c.b_row_major, c.dynamic_shared_buffer
    overlap, ring, roles, tma_out = c.overlap, c.ring, c.roles, c.tma_out
    consume, consume_overlap, produce = k.consume, k.consume_overlap, k.produce

    @kernel_jit(cfg)
    def kernel(a, b, out, c, bias, alpha, beta, maps):
        n = b.shape[2] if b_row_major else b.shape[1]
        n_tiles = (n + BN - 1) // BN
        ktiles = (a.shape[2] + BK - 1) // BK
        w0 = cuda.blockIdx.x * n_tiles   # block x: chunks w0 … w0 + n_tiles - 1, rows 128·x …
        base = shared_addr(dynamic_shared_buffer(), 0)
        tid = cuda.threadIdx.x
        wg = roles.warpgroup(tid)
        if tid == 0:
            ring.init(base + BARS)
            if TMA_OUT:
                for i in range(3 * NC):                           # the rescale's loads
                    MB.mbarrier_init(base + FBAR_OFF + 8 * i, 1)
            MB.fence_mbarrier_init()
        cuda.syncthreads()
        if wg == 0:
            roles.enter_producer()
            if tid == 0:
                produce(base, maps, 1, 1, 0, n_tiles, w0 + n_tiles, ktiles, w0, 1)
        else:
            roles.enter_consumer()
            if OVERLAP:
                consume_overlap(base, a, b, out, alpha, roles.consumer(wg), n_tiles, ktiles,
                                w0, maps)
            else:
                consume(base, a, b, out, c, bias, alpha, roles.consumer(wg), n_tiles, ktiles,
                        w0, maps)

    def check_operands(a, b, out):
        if out.shape[0] != 1 or a.shape[0] != 1 or b.shape[0] != 1:
            raise ValueError("softmax mode computes one matrix (no batch)")
        if -(-out.shape[2] // BN) > SOFTMAX_CHUNKS:
            raise ValueError(f"softmax mode: at most {SOFTMAX_CHUNKS * BN} columns")
        if OVERLAP and -(-a.shape[2] // BK) < ST - 1:
            raise ValueError(f"softmax overlap: K of at least {(ST - 1) * BK} (the "
                             f"k-steps issued ahead), got {a.shape[2]}")

    kernel.config = cfg
    kernel.b_row_major = b_row_major
    kernel.tma_out = tma_out   # the maps end with the output's
    kernel.overlap = overlap
    kernel.check_operands = check_operands
    kernel.smem_bytes = cfg.smem_bytes + softmax_stats_bytes(cfg)
    kernel.grid = lambda a, b, out: (-(-a.shape[1] // BM), 1)
    return kernel


def compile_reports():
    """Offline sm_90a reports of the softmax mode's kernels: 256-column chunks staged through
    shared memory, with TMA out, and 128-column chunks with overlap."""
    from .gemm_wgmma_ws import kernel_report

    entries = (("ws_128x256_brow_smemepi_softmax",
                WsConfig(stages=3, persistent=True, smem_epilogue=True), {}),
               ("ws_128x256_brow_smemepi_softmax_tmaout",
                WsConfig(stages=3, persistent=True, smem_epilogue=True), {"tma_out": True}),
               ("ws_128x128_brow_smemepi_softmax_overlap",
                WsConfig(128, 128, 4, persistent=True, smem_epilogue=True),
                {"tma_out": True, "overlap": True}))
    return [kernel_report(name, gemm_softmax_wgmma_kernel(cfg, True, "float16", **kw), cfg,
                          "float16") for name, cfg, kw in entries]
