"""The K-major TMA GEMM on Hopper (sm_90a): both operands K-major (``a`` (M, K) row-major,
``b`` given as Bᵀ (N, K) row-major, as ``torch._scaled_mm`` and ``torch._grouped_mm`` take
it) through TMA into an mbarrier ring, wgmmas into float32 accumulators — composed from
:mod:`tilepy.tile` pieces (roles, the TMA ring and tile loads, the warpgroup MMA, the
schedules, the scaled epilogue). Two uses, as generator parameters: the scaled FP8 GEMM
(e4m3 / e5m2, k32 wgmmas on 1-byte operands, scales per tensor, row, column or block) and the
grouped 16-bit GEMM (float16 / bfloat16, one ``b`` per group of rows, the groups' row ends read
on the device; there ``b`` may also be row-major, ``b_row_major``: MN-major B tiles, which
wgmma transposes for 16-bit operands).

``kmajor_gemm_kernel(cfg, fmt, out_kind, row_scale, col_scale, block_scale, grouped, b_fmt,
activation, bias_kind, b_row_major)`` returns a kernel

    kernel(a, b, out, scale_a, scale_b, offsets, bias, k, maps)

computing ``out[i, j] = act(scale_a[i or 0] · scale_b[j or 0] · Σ_k a[i, k] · b[j, k] +
bias[j])`` for ``a`` (M, K) and ``b`` (N, K) (``b`` of format ``b_fmt``, by default ``fmt``;
``bias`` (N,) of ``bias_kind``, or a placeholder without one) — or, ``grouped``, ``out[i, j] = Σ_k a[i, k] · b[g, j, k]`` for the
rows ``i`` of group ``g`` (``offsets`` (E,) int32: the groups' cumulative row ends, clamped
into ``previous end … M``; ``b`` (E, N, K), or (E, K, N) with ``b_row_major``) — read
through their tensor maps in ``maps``
(uint8: A's map at byte 0, B's at :data:`MAP_B`; 128-byte swizzle, boxes of ``block_m`` /
``block_n`` rows × 128 bytes of k — a row-major B's of 64 k rows × 128 bytes of n; grouped,
B's map is 3-D with the group outermost). ``a``
and ``b`` themselves (uint8 / uint16 views) are not read: their pointers tell a launch plan
which maps to pass (:func:`plan`). ``out`` (M, N) float32, or uint16 bits of ``out_kind``
(float16 / bfloat16); ``scale_a`` float32 (M,) with ``row_scale`` else (1,), ``scale_b``
(N,) with ``col_scale`` else (1,), or both 2-D with ``block_scale`` (see
:func:`kmajor_gemm_kernel`); ``offsets`` a placeholder unless ``grouped``; ``bias`` float32 or
uint16 bits of ``bias_kind``. Grid :func:`grid`
(a block per output tile, or persistent: at most one per SM, each striding over the tiles —
in grouped raster order; grouped, group by group and in that order within each),
:attr:`KMajorConfig.threads` threads, :attr:`KMajorConfig.smem_bytes` of dynamic shared
memory. K need not be a multiple of the stage's k (TMA zero-fills).

Warpgroup 0's thread 0 loads each k step's A box and B box into the next ring slot, running on
across the block's tiles (the next tile's loads overlap this one's epilogue); warpgroups
1 … ``consumers`` each take 64 rows of the tile: per k step their wgmmas over the slot as
one group (the first with scale-d 0: no zeroing of the accumulators), ``wait_group 1``, the
previous step's slot released — one group stays in flight across the wait. The epilogue
(:func:`tilepy.tile.epilogue.store_scaled_accumulators`, constant accumulator indices: the
accumulators stay in registers) scales each accumulator and stores it (rows past M — a
group's end — and columns past N skipped).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from ..inline import inline_device
from ..kcache import cached_jit
from ..launch import sm_count
from ..ptx import mbarrier as MB
from ..ptx import shared_addr
from ..ptx import tma as T
from ..ptx import wgmma as W
from ..ptx.asm import SIMULATOR
from ..tile.config import SMEM_LIMIT
from ..tile.epilogue import (
    SWIZZLED_BOX_BYTES,
    accumulate_scaled,
    stage_scaled_accumulators_swizzled,
    staging_acquire,
    staging_store,
    store_scaled_accumulators,
)
from ..tile.pipeline import tma_pipeline
from ..tile.roles import NamedBarriers, warpgroup_roles
from ..tile.schedule import group_end, grouped_raster, static_persistent
from ..tile.smem import dynamic_shared
from ..tile.smem_layout import SmemLayout
from ..tile.tma_copy import tma_tile
from ..tile.warpgroup_mma import SmemOperand, warpgroup_mma
from .gemm_wgmma_ws import out_layout

BK = 128            # k bytes a stage: one 128-byte swizzle row
MAP_B = 128         # B's tensor map's byte offset in the maps argument
MAP_OUT = 256       # tma_store: the output's tensor map's byte offset
STAGING_BYTES = 2 * SWIZZLED_BOX_BYTES   # tma_store: a consumer's staging (64 × 128 columns)
PASS_NI = 16        # tma_store: n8 blocks a staging pass (128 columns)
BLOCK_SCALE = 128   # the side of a block scale's block (1 x 128 of a, 128 x 128 of b)
FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "float16": "float16",
           "bfloat16": "bfloat16"}
#: The 8-bit formats (the scaled GEMM); the 16-bit ones run grouped.
FP8_FORMATS = ("e4m3", "e5m2")


def k_elements(fmt: str) -> int:
    """Elements of k in one stage (128 bytes) for operands of ``fmt``."""
    return BK if fmt in FP8_FORMATS else BK // 2
OUT_KINDS = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class KMajorConfig:
    """``block_m`` (64 · ``consumers``) × ``block_n`` output tile, ``stages`` k steps of 128
    in flight. ``block_n`` 256 (128 accumulators a consumer thread) needs two consumers and
    the ``setmaxnreg`` split: the producer warpgroup lowers its register limit to
    ``producer_regs`` and the consumers raise theirs to ``consumer_regs``. ``persistent``: a
    block per SM striding over the tiles (in grouped order), else a block per tile."""

    block_n: int = 256
    stages: int = 4
    consumers: int = 2
    cc: tuple = (9, 0)
    producer_regs: int = 40
    consumer_regs: int = 232
    persistent: bool = True
    tma_store: bool = False

    def __post_init__(self):
        if self.consumers not in (1, 2) or self.block_n not in (64, 128, 256) or \
                not 2 <= self.stages <= 8:
            raise ValueError(f"KMajorConfig: consumers 1 or 2, block_n 64, 128 or 256, stages "
                             f"2 … 8; got {self}")
        if self.block_n == 256 and self.consumers != 2:
            raise ValueError(f"KMajorConfig: block_n 256 needs two consumers (the setmaxnreg "
                             f"split); got {self}")
        limit = SMEM_LIMIT.get(tuple(self.cc[:2]), 99 * 1024)
        if self.smem_bytes > limit:
            raise ValueError(f"KMajorConfig: {self.smem_bytes} B of shared memory exceeds {limit}")

    @property
    def setmaxnreg(self) -> bool:
        """Whether the roles move registers with ``setmaxnreg`` (two consumers: needed by
        ``block_n`` 256 and by block scales' two partial accumulators)."""
        return self.consumers == 2

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def stage_bytes(self) -> int:
        return (self.block_m + self.block_n) * BK

    @property
    def layout(self):
        parts = [("stages", self.stages * self.stage_bytes, 1024)]
        if self.tma_store:
            parts.append(("staging", self.consumers * STAGING_BYTES, 1024))
        return SmemLayout.of(*parts, ("bars", 16 * self.stages, 8))

    @property
    def smem_bytes(self) -> int:
        return self.layout.nbytes

    def describe(self) -> str:
        return (f"k-major {self.block_m}x{self.block_n}, 128-byte k steps, {self.stages} stages, "
                f"{self.consumers} consumer warpgroup(s)"
                + (", persistent" if self.persistent else "")
                + (", TMA-store epilogue" if self.tma_store else "")
                + (f", setmaxnreg {self.producer_regs}/{self.consumer_regs}"
                   if self.setmaxnreg else ""))


def _jit(threads: int):
    # one block an SM: setmaxnreg redistributes the registers the block was allocated
    return cuda.jit if SIMULATOR else cached_jit(launch_bounds=(threads, 1))


@functools.cache
def kmajor_gemm_kernel(cfg: KMajorConfig, fmt: str = "e4m3", out_kind: str = "bfloat16",
                       row_scale: bool = False, col_scale: bool = False,
                       block_scale: bool = False, grouped: bool = False, b_fmt: str | None = None,
                       activation=None, bias_kind: str | None = None, b_row_major: bool = False):
    """The kernel of the module docstring, generated once per argument set; ``fmt`` the
    operands' format (one of :data:`FORMATS`: the 8-bit ones scaled, the 16-bit ones
    ``grouped``, without scales); ``b_fmt`` B's, another 8-bit format with 8-bit ``fmt``
    (mixed e4m3 / e5m2), else ``fmt``. ``activation`` (of
    :data:`tilepy.tile.epilogue.ACTIVATIONS`) and ``bias_kind`` (None, or the bias's
    ``"float32"`` / ``"float16"`` / ``"bfloat16"``): the epilogue's, scaled GEMM only. ``block_scale``: ``scale_a`` (M, ceil(K / 128)) per 1 × 128
    block of ``a`` and ``scale_b`` (ceil(K / 128), ceil(N / 128)) per 128 × 128 block of Bᵀ
    (2-D float32), DeepGEMM's recipe: each k step (128 of K, one scale block) is a separate
    wgmma product (scale-d 0), waited for and added to the float32 sum times its two scales
    (:func:`tilepy.tile.epilogue.accumulate_scaled`); ``block_n`` at most 128 (a tile's
    columns in one scale block). ``grouped``: the work items are the tiles of each group's
    rows (group by group, each group's in grouped raster order; every thread counts them from
    ``offsets``), B's map 3-D. ``b_row_major`` (grouped only): B row-major (E, K, N), each
    stage's B ``block_n / 64`` boxes of 64 k × 64 n (MN-major), else K-major (E, N, K)."""
    if fmt not in FORMATS or out_kind not in OUT_KINDS:
        raise ValueError(f"kmajor_gemm_kernel: format of {tuple(FORMATS)}, out of "
                         f"{OUT_KINDS}; got {fmt!r}, {out_kind!r}")
    FP8 = fmt in FP8_FORMATS
    b_fmt = fmt if b_fmt is None else b_fmt
    if b_fmt != fmt and not (FP8 and b_fmt in FP8_FORMATS):
        raise ValueError(f"kmajor_gemm_kernel: B's format may differ from A's only between "
                         f"the 8-bit formats; got {fmt!r} and {b_fmt!r}")
    if not FP8 and (activation is not None or bias_kind is not None):
        raise NotImplementedError("kmajor_gemm_kernel: bias and activation are the scaled "
                                  "GEMM's only")
    BLOCK, GROUPED = bool(block_scale), bool(grouped)
    if GROUPED == FP8 or (not FP8 and (row_scale or col_scale or BLOCK)):
        raise NotImplementedError(f"kmajor_gemm_kernel: the 8-bit formats run scaled and "
                                  f"not grouped, the 16-bit ones grouped without scales; got "
                                  f"{fmt!r}, grouped={grouped}")
    B_ROW = bool(b_row_major)
    if B_ROW and not GROUPED:
        raise NotImplementedError("kmajor_gemm_kernel: a row-major b is the grouped 16-bit "
                                  "GEMM's only (wgmma reads 8-bit operands K-major)")
    if BLOCK and (row_scale or col_scale or cfg.block_n > BLOCK_SCALE):
        raise ValueError(f"kmajor_gemm_kernel: block scales take no row / column scales and "
                         f"block_n <= {BLOCK_SCALE}; got {cfg}")
    TMA_OUT = bool(cfg.tma_store)
    if TMA_OUT and out_kind not in ("float16", "bfloat16"):
        raise ValueError(f"kmajor_gemm_kernel: tma_store takes 16-bit outputs; got "
                         f"{out_kind!r}")
    BM, BN, NC, ST = cfg.block_m, cfg.block_n, cfg.consumers, cfg.stages
    EB = 1 if FP8 else 2            # bytes an element
    BKE = BK // EB                  # k elements a stage
    A_BYTES = BM * BK
    STAGE = cfg.stage_bytes
    lay = cfg.layout
    STAGES, BARS = lay.offset("stages"), lay.offset("bars")
    ring = tma_pipeline(ST, 4 * NC)
    order = grouped_raster(BM, BN, GROUP_M)
    sched = static_persistent()
    roles = warpgroup_roles(NC, producer_regs=cfg.producer_regs if cfg.setmaxnreg else 0,
                            consumer_regs=cfg.consumer_regs if cfg.setmaxnreg else 0)
    load_a = tma_tile(1, A_BYTES)
    # B's stage: block_n rows of BK bytes of k (K-major), or block_n / 64 boxes of BKE k rows
    # × 64 n (row-major: 128 bytes of n a box row) — the same bytes
    load_b = tma_tile(BN // 64, 64 * BK) if B_ROW else tma_tile(1, BN * BK)
    wmma = warpgroup_mma(BN, SmemOperand(BN, BKE, "mn" if B_ROW else "k", EB),
                         SmemOperand(64, BKE, "k", EB),
                         FORMATS[fmt], b_dtype=FORMATS[b_fmt])
    NACC = wmma.NACC
    store = store_scaled_accumulators(BN // 8, out_kind, row_scale, col_scale,
                                      scaled=FP8 and not BLOCK, activation=activation,
                                      bias_kind=bias_kind)
    promote = accumulate_scaled(BN // 8)
    NI = BN // 8
    PASSES = -(-NI // PASS_NI)
    if TMA_OUT:
        stage_pass = [stage_scaled_accumulators_swizzled(
            NI, out_kind, row_scale, col_scale, scaled=FP8 and not BLOCK,
            activation=activation, bias_kind=bias_kind, first=PASS_NI * p, count=min(PASS_NI, NI - PASS_NI * p))
            for p in range(PASSES)]
        stage0, stage1 = stage_pass[0], stage_pass[-1]
        STAGING = lay.offset("staging")
    # tma_store: a named barrier per consumer warpgroup (its staging's writes and reads)
    WG_BAR = NamedBarriers().take("warpgroup", 128, count=NC)
    smem = dynamic_shared(lay.align)
    f32 = types.float32

    @inline_device
    def count_tiles(offsets, tiles_n, m):
        # the groups' tiles; group g's rows run from the previous group's end to its own,
        # clamped into that end … m (so groups never overlap)
        total = np.int64(0)
        start = np.int64(0)
        for g in range(offsets.shape[0]):
            end = group_end(offsets, g, start, m)
            total += (end - start + BM - 1) // BM * tiles_n
            start = end
        return total

    @inline_device
    def locate(w, offsets, tiles_m, tiles_n, m):
        # work item w -> (group, first row, first column, the rows' end)
        if not GROUPED:
            _, bm0, bn0 = order.tile_origin(w, tiles_m, tiles_n)
            return 0, bm0, bn0, m
        seen = np.int64(0)
        g = 0
        start = np.int64(0)
        end = np.int64(0)
        for gi in range(offsets.shape[0]):
            end = group_end(offsets, gi, start, m)
            t = (end - start + BM - 1) // BM * tiles_n
            g = gi
            if w < seen + t:
                break
            seen += t
            start = end
        # within the group, the grouped raster (GROUP_M row blocks walked together, so the
        # blocks running at once share B's column panels in L2 — a group's B is one expert's
        # whole weight, larger than L2 for a model's MLP)
        _, bm0, bn0 = order.tile_origin(w - seen, (end - start + BM - 1) // BM, tiles_n)
        return g, start + bm0, bn0, end

    @inline_device
    def issue(part, bars, base, s, ph, cw):
        # a k step's product alone (scale-d 0) from ring slot s, as one group
        ring.wait(bars, s, ph)
        stage = base + STAGES + s * STAGE
        wmma.fence()
        wmma.mma(part, stage + cw * 64 * BK, stage + A_BYTES, 0)
        wmma.commit()

    @inline_device
    def epilogue(acc, base, maps, out, scale_a, scale_b, bias, row0, col0, m, n, t, lane, cw):
        # the consumer's 64 rows of the tile: staged and stored with TMA, or from registers;
        # grouped, ``m`` is the group's end: 64 rows that reach past it (the next group's
        # rows, which that group's own tile writes) go from registers, clipped there — a TMA
        # store clips only at the output's end
        if TMA_OUT and (not GROUPED or row0 + 64 <= m):
            omap = T.tensor_map_address(maps) + MAP_OUT
            stg = base + STAGING + cw * STAGING_BYTES
            staging_acquire(t, WG_BAR + cw)
            stage0(acc, stg, row0, col0, m, n, scale_a, scale_b, bias, t)
            staging_store(omap, stg, col0, row0, 0, n, min(PASS_NI, NI) // 8, t, WG_BAR + cw,
                          False)
            if PASSES > 1:
                staging_acquire(t, WG_BAR + cw)
                stage1(acc, stg, row0, col0, m, n, scale_a, scale_b, bias, t)
                staging_store(omap, stg, col0 + 8 * PASS_NI, row0, 0, n,
                              (NI - PASS_NI) // 8, t, WG_BAR + cw, False)
        else:
            store(acc, out, scale_a, scale_b, bias, row0, col0, m, n, lane, t // 32)

    @_jit(cfg.threads)
    def kernel(a, b, out, scale_a, scale_b, offsets, bias, k, maps):
        m = out.shape[0]
        n = out.shape[1]
        tiles_m = (m + BM - 1) // BM
        tiles_n = (n + BN - 1) // BN
        total = count_tiles(offsets, tiles_n, m) if GROUPED else tiles_m * tiles_n
        ktiles = (k + BKE - 1) // BKE
        w0, step = sched.first_and_step()
        base = shared_addr(smem(), 0)
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
                ta = T.tensor_map_address(maps)
                tb = ta + MAP_B
                T.fence_proxy_tensormap_acquire(ta)
                T.fence_proxy_tensormap_acquire(tb)
                s = 0
                ph = 0
                # the ring runs on across the block's tiles: the next tile's first k steps
                # load while the consumers run this one's epilogue
                # (a while loop: a range with a run-time step divides by it — schedule.udiv)
                w = w0
                while w < total:
                    g, bm0, bn0, _ = locate(w, offsets, tiles_m, tiles_n, m)
                    for kt in range(ktiles):
                        ring.acquire(bars, s, ph)
                        full = ring.commit(bars, s, STAGE)
                        stage = base + STAGES + s * STAGE
                        load_a.load_2d(stage, ta, full, kt * BKE, bm0)
                        # B's box origin (x along the contiguous axis): n, k row-major
                        bx, by = (bn0, kt * BKE) if B_ROW else (kt * BKE, bn0)
                        if GROUPED:
                            load_b.load_3d(stage + A_BYTES, tb, full, bx, by, g)
                        else:
                            load_b.load_2d(stage + A_BYTES, tb, full, bx, by)
                        s, ph = ring.advance(s, ph)
                    w += step
        else:
            roles.enter_consumer()
            cw = wg - 1
            t = tid - 128 * wg
            if TMA_OUT and t == 0:
                T.fence_proxy_tensormap_acquire(T.tensor_map_address(maps) + MAP_OUT)
            acc = cuda.local.array(NACC, f32)
            part = cuda.local.array(NACC if BLOCK else 1, f32)
            part2 = cuda.local.array(NACC if BLOCK else 1, f32)
            lane = t % 32
            s = 0
            ph = 0
            w = w0
            while w < total:
                _, bm0, bn0, rows_end = locate(w, offsets, tiles_m, tiles_n, m)
                if BLOCK:
                    # per k step (one scale block) a product of its own (scale-d 0) into one of
                    # two partial accumulators: two steps issued back to back, then the first
                    # waited for (wait_group 1) and added to the sum times its scales while the
                    # second's wgmmas run, then the second (wait_group 0). Nothing is in flight
                    # across the loop's back edge or a merge of paths: where a group stays in
                    # flight there, the copies of loop-carried accumulator registers make ptxas
                    # serialise every wgmma of the kernel (C7514 / C7517; seen with the
                    # contiguous argument layouts launches specialise on).
                    for i in range(NACC):
                        acc[i] = f32(0)
                    r0 = min(bm0 + 64 * cw + 16 * (t // 32) + lane // 4, m - 1)
                    r1 = min(r0 + 8, m - 1)
                    nb = min(bn0 // BLOCK_SCALE, scale_b.shape[1] - 1)
                    for q in range(ktiles // 2):
                        j = 2 * q
                        sb = scale_b[j, nb]
                        g0 = scale_a[r0, j] * sb
                        g1 = scale_a[r1, j] * sb
                        sb = scale_b[j + 1, nb]
                        h0 = scale_a[r0, j + 1] * sb
                        h1 = scale_a[r1, j + 1] * sb
                        issue(part, bars, base, s, ph, cw)
                        s_p = s
                        s, ph = ring.advance(s, ph)
                        issue(part2, bars, base, s, ph, cw)
                        s_q = s
                        s, ph = ring.advance(s, ph)
                        wmma.wait(1)
                        wmma.fence_operand(part)
                        ring.release(bars, s_p, lane)
                        promote(acc, part, g0, g1)
                        wmma.wait(0)
                        W.wgmma_fence_operand(part2, NACC)
                        ring.release(bars, s_q, lane)
                        promote(acc, part2, h0, h1)
                    if ktiles % 2 == 1:
                        # the last step alone
                        j = ktiles - 1
                        sb = scale_b[j, nb]
                        g0 = scale_a[r0, j] * sb
                        g1 = scale_a[r1, j] * sb
                        issue(part, bars, base, s, ph, cw)
                        s_p = s
                        s, ph = ring.advance(s, ph)
                        wmma.wait(0)
                        wmma.fence_operand(part)
                        ring.release(bars, s_p, lane)
                        promote(acc, part, g0, g1)
                else:
                    # the first k step writes the accumulators (scale-d 0: no zeroing
                    # instructions while wgmmas are in flight, which would make ptxas
                    # serialise them, C7515); each later step: wait for its slot, its wgmmas
                    # as one group, wait_group 1 (the previous step's group has retired) and
                    # free the previous slot (K >= 16: at least one step)
                    ring.wait(bars, s, ph)
                    stage = base + STAGES + s * STAGE
                    wmma.fence()
                    wmma.mma(acc, stage + cw * 64 * BK, stage + A_BYTES, 0)
                    wmma.commit()
                    prev = s
                    s, ph = ring.advance(s, ph)
                    for kt in range(1, ktiles):
                        ring.wait(bars, s, ph)
                        stage = base + STAGES + s * STAGE
                        wmma.fence()
                        wmma.mma(acc, stage + cw * 64 * BK, stage + A_BYTES, 1)
                        wmma.commit()
                        wmma.wait(1)
                        ring.release(bars, prev, lane)
                        prev = s
                        s, ph = ring.advance(s, ph)
                    wmma.wait(0)
                    wmma.fence_operand(acc)
                    ring.release(bars, prev, lane)
                epilogue(acc, base, maps, out, scale_a, scale_b, bias, bm0 + 64 * cw, bn0,
                         rows_end, n, t, lane, cw)
                w += step
            if TMA_OUT and t == 0:
                T.bulk_wait_group_read(0)   # no store still reads the staging at exit

    kernel.tma_out = TMA_OUT      # the maps end with the output's (plan)
    kernel.b_row_major = B_ROW    # B's map: (E, K, N) in boxes of 64 k × 64 n (plan)
    return kernel


#: Block rows walked together by the grouped raster (their blocks share B's panels in L2).
GROUP_M = 8


def grid(cfg: KMajorConfig, m: int, n: int, sms: int | None = None, groups: int = 0) -> tuple:
    """One block per output tile, or with ``persistent`` at most ``sms`` blocks (default: the
    device's SMs) that stride over the tiles. ``groups`` > 0 (grouped): the tiles are counted
    on the device, so a persistent grid (one block per SM) always; at most
    ``tiles of M + groups`` row tiles (each group may end inside one)."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    if groups:
        tiles = (-(-m // cfg.block_m) + groups) * -(-n // cfg.block_n)
    if cfg.persistent or groups:
        tiles = min(tiles, sms if sms is not None else sm_count(132))
    return (max(tiles, 1), 1, 1)


def argtypes(out_kind: str, block_scale: bool = False, grouped: bool = False,
             bias_kind: str | None = None):
    """Numba argument types of :func:`kmajor_gemm_kernel`'s kernel (offline compilation):
    contiguous arrays, the types a launch on contiguous operands specialises on (the code
    differs from that of strided ``"A"`` arrays: once, only the contiguous form made ptxas
    serialise the block-scaled kernel's wgmmas)."""
    u8 = types.Array(types.uint8, 1, "C")
    ops = (types.Array(types.uint16, 2, "C"), types.Array(types.uint16, 3, "C")) if grouped \
        else (types.Array(types.uint8, 2, "C"),) * 2
    out = types.Array(types.float32 if out_kind == "float32" else types.uint16, 2, "C")
    f32 = types.Array(types.float32, 2 if block_scale else 1, "C")
    offs = types.Array(types.int32 if grouped else types.float32, 1, "C")
    bias = types.Array(types.uint16 if bias_kind in ("float16", "bfloat16") else types.float32,
                       1, "C")
    return (*ops, out, f32, f32, offs, bias, types.int64, u8)


#: The tensor maps' place in the kernel's arguments.
MAPS_ARG = 8


def plan(kernel, cfg: KMajorConfig, a, b, out, scale_a, scale_b, offsets, bias, k: int,
         fmt: str, alloc=None):
    """``(launch plan, arguments)`` of :func:`kmajor_gemm_kernel`'s kernel on views ``a``
    (M, K) and ``b`` (N, K), or grouped (E, N, K) — (E, K, N) for a kernel generated with
    ``b_row_major`` — uint8 codes (8-bit formats) or uint16 bits,
    rows of a multiple of 16 bytes (or a single row) — ``out``, the scale views and
    ``offsets`` (int32 (E,) grouped, else a placeholder), ``bias`` (its view, or a
    placeholder): a
    :class:`tilepy.tile.tma_plan.TmaLaunchPlan` whose maps follow the pointers of ``a`` and
    ``b`` (encoded on the host, written on the launch stream into memory from ``alloc(nbytes)
    -> (owner, pointer)``; a bound plan called with other pointers makes theirs,
    capture-safe)."""
    from ..tile import device_write
    from ..tile import tma as host_tma
    from ..tile.smem import allow_dynamic_shared
    from ..tile.tma_plan import TmaLaunchPlan
    from ..launch import pointer

    eb = 1 if fmt in FP8_FORMATS else 2
    kind, bke = ("uint8" if eb == 1 else "uint16"), BK // eb
    grouped = len(b.shape) == 3
    b_row = getattr(kernel, "b_row_major", False)
    (m, kk), n = a.shape, b.shape[len(b.shape) - (1 if b_row else 2)]
    # B's map: rows of its contiguous dimension (k, or n when row-major) in boxes of
    # block_n rows × 128 bytes of k, or row-major 64 k rows × 64 n (128 bytes)
    rows, inner = (kk, n) if b_row else (n, kk)
    # a single row's stride is never used: its row length stands in (TMA wants multiples of
    # 16 bytes)
    sa = (a.strides[0] if m > 1 else kk * eb, eb)
    sb = (b.strides[len(b.shape) - 2] if rows > 1 else -(-inner * eb // 16) * 16, eb)
    box = (bke, 64) if b_row else (cfg.block_n, bke)
    if grouped:
        e = b.shape[0]
        b_shape = (e, rows, inner)
        b_strides = (b.strides[0] if e > 1 else rows * sb[0],) + sb
        b_box = (1,) + box
    else:
        b_shape, b_strides, b_box = (rows, inner), sb, box

    def ab_maps(a_ptr, b_ptr):
        ma = host_tma.encode_tiled(a_ptr, kind, (m, kk), sa, (cfg.block_m, bke), 128)
        mb = host_tma.encode_tiled(b_ptr, kind, b_shape, b_strides, b_box, 128)
        return [ma.data, mb.data]

    if getattr(kernel, "tma_out", False):
        o_layout = out_layout(out)   # (the bf16 kernel's checks and 64 x 64 boxes)
        map_args = (0, 1, 2)

        def encoder(a_ptr, b_ptr, o_ptr):
            om = host_tma.encode_tiled(o_ptr, "uint16", *o_layout, 128)
            return np.concatenate(ab_maps(a_ptr, b_ptr) + [om.data])
    else:
        map_args = (0, 1)

        def encoder(a_ptr, b_ptr):
            return np.concatenate(ab_maps(a_ptr, b_ptr))

    raw = encoder(*(pointer(x) for x in (a, b, out)[:len(map_args)]))
    buf = device_write.allocate(alloc, raw.size, host_tma.MAP_ALIGN)
    args = (a, b, out, scale_a, scale_b, offsets, bias, np.int64(k),
            buf.view((raw.size,), np.uint8))
    allow_dynamic_shared(kernel, args, cfg.smem_bytes)
    g = grid(cfg, m, n, groups=b.shape[0] if grouped else 0)
    p = TmaLaunchPlan(kernel, args, g, cfg.threads, cfg.smem_bytes, encoder, map_args,
                      MAPS_ARG, alloc=alloc, initial=(buf, raw))
    return p, args


#: The kernels the compile layer reports on: (name, config, format, scales, grouped, B's
#: format, activation, bias kind, B row-major) — scales "rowcol" or "block".
COMPILED = (("gemm_fp8_e4m3_bf16_rowcol", KMajorConfig(), "e4m3", "rowcol", False, None, None,
             None, False),
            ("gemm_fp8_e4m3_bf16_rowcol_n128", KMajorConfig(block_n=128), "e4m3", "rowcol",
             False, None, None, None, False),
            ("gemm_fp8_e4m3_bf16_block", KMajorConfig(block_n=128), "e4m3", "block", False,
             None, None, None, False),
            ("gemm_fp8_e4m3_e5m2_bias_gelu", KMajorConfig(), "e4m3", "rowcol", False, "e5m2",
             "gelu", "bfloat16", False),
            ("grouped_gemm_bf16", KMajorConfig(), "bfloat16", None, True, None, None, None,
             False),
            ("grouped_gemm_bf16_tmastore", KMajorConfig(tma_store=True), "bfloat16", None,
             True, None, None, None, False),
            ("grouped_gemm_bf16_brow_tmastore", KMajorConfig(tma_store=True), "bfloat16", None,
             True, None, None, None, True),
            ("gemm_fp8_e4m3_bf16_rowcol_tmastore", KMajorConfig(tma_store=True), "e4m3",
             "rowcol", False, None, None, None, False),
            ("gemm_fp8_e4m3_e5m2_bias_gelu_tmastore", KMajorConfig(tma_store=True), "e4m3",
             "rowcol", False, "e5m2", "gelu", "bfloat16", False))


def compile_reports():
    """Offline sm_90a reports of :data:`COMPILED` (bf16 out)."""
    from ..offline import report_entry

    return [report_entry(name,
                         lambda cfg=cfg, fmt=fmt, sc=sc, gr=gr, bf=bf, act=act, bk=bk, br=br:
                         kmajor_gemm_kernel(cfg, fmt, "bfloat16", sc == "rowcol",
                                            sc == "rowcol", sc == "block", gr, bf, act, bk,
                                            br),
                         argtypes("bfloat16", sc == "block", gr, bk), (9, 0, "a"),
                         threads=cfg.threads, launch_bounds=(cfg.threads, 1),
                         config=cfg.describe(), smem_bytes=cfg.smem_bytes)
            for name, cfg, fmt, sc, gr, bf, act, bk, br in COMPILED]
