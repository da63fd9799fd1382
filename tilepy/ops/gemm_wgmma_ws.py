"""The warp-specialised Hopper GEMM (sm_90a): a TMA producer warpgroup, wgmma consumer warpgroups
and an mbarrier stage ring, composed from :mod:`tilepy.tile` pieces.

Kernel contract — the one of :mod:`tilepy.ops.gemm_wgmma`: ``kernel(a, b, out, c, bias, alpha,
beta, maps, counters, partials)`` on 3-D uint16 views (batch first, a batch of 1 broadcasts;
``b`` is the (Z, K, N) view of a row-major B or the (Z, N, K) view of a column-major one),
``out = act(alpha · a @ b + bias + beta · c)`` (:func:`tilepy.tile.epilogue.store_accumulators`' math) — plus ``maps``,
a device buffer of the TMA tensor maps of A (bytes 0–127), B (128–255) and, with the
TMA-store epilogue, ``out`` (256–383), which :func:`plan` encodes from the operands'
pointers, shapes and strides; ``counters`` (int32) and ``partials`` (float32, 2-D): split-K's
tile semaphores and partial sums (:attr:`WsConfig.splits`; placeholders without it).

The pieces (each documented where it lives):

* roles (:func:`tilepy.tile.roles.warpgroup_roles`): warpgroup 0 produces and lowers its
  register limit with ``setmaxnreg``; warpgroups 1 … ``consumers`` compute and raise theirs;
* the producer (:func:`tma_producer`): one thread loads each k step's A box (``block_m`` × 64,
  K-major) and B boxes (row-major B: ``block_n / 64`` boxes of 64 k × 64 n, MN-major;
  column-major B: one ``block_n`` × 64 box, K-major), 128-byte swizzled, into the next slot of
  the ring (:func:`tilepy.tile.pipeline.tma_pipeline`, :func:`tilepy.tile.tma_copy.tma_tile`).
  TMA zero-fills what lies outside the tensor, so only the epilogue's stores are predicated;
* each consumer's main loop (:func:`consumer_mainloop`): per k step, wait for the slot, its
  k16 wgmmas (:func:`tilepy.tile.warpgroup_mma.warpgroup_mma`) as one group, ``wait_group 1``
  and free the previous slot — one group stays in flight across the wait;
* the schedule (:mod:`tilepy.tile.schedule`): work items — tiles, or with ``splits`` a tile's
  k ranges (:func:`split_range`) — in grouped raster order; a block per item (grid (items,
  batch)), or ``persistent=True``: ``min(SMs, items)`` blocks striding over the items, the
  ring running on across them so the producer loads the next item while the consumers run
  the epilogue;
* with ``splits``, the reduction (:func:`tilepy.tile.split_k.split_k_reduce`): the tile's last
  item adds every item's partials in split order and alone runs the epilogue;
* the epilogue (:func:`_epilogue`): from registers, staged through shared memory, or staged
  swizzled and stored with TMA.

The two roles meet only at the mbarriers: no block barrier after the set-up. An operand with
one matrix (``shape[0] == 1``) gets a 2-D tensor map, a batched one a 3-D map (batch
outermost, box depth 1), chosen per operand at run time. Tensor maps hold the operand
pointers: :class:`tilepy.tile.tma_plan.TmaLaunchPlan` re-encodes them when a bound plan is
called with other pointers, on the launch stream, capture-safe.

The sm_90 default of :func:`tilepy.gemm` (``gemm.hopper_config``). gemm_softmax's kernel
(:mod:`tilepy.ops.gemm_softmax_wgmma`) reuses the producer and the main loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from .. import arrays
from ..inline import device_namespace, inline_device
from ..launch import pointer, sm_count
from ..ptx import barrier as BAR
from ..ptx import cluster as CLU
from ..ptx import mbarrier as MB
from ..ptx import shared_addr
from ..ptx import tma as T
from ..ptx import vector as VEC
from ..ptx import wgmma as W
from ..ptx.asm import SIMULATOR
from ..tile import device_write
from ..tile import tma as host_tma
from ..tile.config import SMEM_LIMIT
from ..tile.dependent import dependent_launch
from ..tile.epilogue import (
    SWIZZLED_BOX_BYTES,
    stage_accumulators_swizzled,
    staged_bytes,
    staging_acquire,
    staging_store,
    store_accumulators,
    store_accumulators_smem,
)
from ..tile.pipeline import tma_pipeline
from ..tile.roles import NamedBarriers, warpgroup_roles
from ..tile.schedule import grouped_raster, static_persistent, udiv
from ..tile.smem import allow_dynamic_shared, dynamic_shared
from ..tile.smem_layout import SmemLayout
from ..tile.split_k import cluster_region_bytes, split_k_cluster_reduce, split_k_reduce
from ..tile.tma_copy import tma_tile
from ..tile.tma_plan import ScheduledTmaPlan, TmaLaunchPlan
from ..tile.trace import SCRATCH_BYTES
from ..tile.trace import WIDTH as TRACE_WIDTH
from ..tile.trace import phase_marks
from ..tile.warpgroup_mma import SmemOperand, warpgroup_mma
from ..kcache import cached_jit

BK = 64           # k elements per stage: one 128-byte swizzle row of 16-bit data
WARPGROUP = 128
GROUP_M = 8       # block rows walked together (L2 reuse of B panels)
SMS = 132         # H200; the persistent grid's default when the device is not asked
#: byte offsets of B's and the output's tensor maps (TMA stores) in the maps buffer
MAP_B = np.uint64(128)
MAP_OUT = np.uint64(256)
_REG_FILE = 65536
#: ``WsConfig(swap_ab=True)``'s tile widths over the output's rows
SWAP_BLOCK_N = (16, 32, 64)
TMA_PASS_COLUMNS = 128  # tma_store: columns staged per pass (two 64 × 64 boxes)


@dataclass(frozen=True)
class WsConfig:
    """One warp-specialised Hopper GEMM kernel.

    ``block_m`` × ``block_n`` per block (tile), ``stages`` of K = 64 in shared memory,
    ``consumers`` warpgroups (1 or 2) of ``block_m / consumers`` rows each (64 or 128),
    ``persistent`` grid, and the ``setmaxnreg`` register limits of the producer and of each
    consumer (``producer_regs=0``: leave the limits alone).

    ``smem_epilogue``: store the results through shared memory
    (:func:`tilepy.tile.epilogue.store_accumulators_smem`: 16-byte vector stores of whole rows)
    instead of straight from the registers. Without ``persistent`` the consumers reuse the
    stage buffers (after a named barrier among them: every consumer's last wgmma has read its
    stage; the producer has nothing left to load); with it the producer is already loading
    the next tile, so the staging gets a buffer of its own (:attr:`epilogue_bytes`), which
    must fit beside the stages (128×256: at most 3 stages).

    ``tma_store`` (with ``persistent``, ``smem_epilogue`` and two consumers of 64 rows; 16-bit
    outputs whose rows TMA can store): the staging is 128-byte swizzled (boxes of 64 rows ×
    64 columns, :func:`tilepy.tile.epilogue.stage_accumulators_swizzled`) and one thread per
    consumer stores it with TMA, which drains while the consumer's next main loop runs
    instead of every thread copying it out first. The staging holds 128 columns per consumer
    (16 KB), a wider tile goes in two passes, so 128 × 256 keeps 4 stages.

    ``cluster=2`` (not in gemm_softmax's mode, :mod:`tilepy.ops.gemm_softmax_wgmma`): blocks
    run in clusters of two
    (:mod:`tilepy.ptx.cluster`) that compute the tiles of two neighbouring row blocks in the
    same columns, so they share B: each block's producer loads its own A box and half of the
    stage's B boxes, multicast into both blocks' shared memory, and a stage is free again only
    when the consumers of both blocks have released it (each consumer warp arrives on the
    stage's "empty" barrier in both blocks). Each SM then reads 32 KB per k-step from L2
    instead of 48 (128 × 256), as cuBLAS's Hopper kernels do with their 2-block clusters.
    ``block_n`` a multiple of 128. In the simulator the blocks of a cluster run at the same
    time (:mod:`tilepy.ptx._simcluster`).

    ``splits`` (split-K; not with clusters): each tile's K steps are cut into ``splits``
    balanced ranges, each a work item of its own (so a problem of few tiles still fills the
    SMs). Every item writes its float32 partial sums to a workspace and counts itself in the
    tile's semaphore; the item that arrives last adds the tile's partials in split order —
    the same order whoever arrives last, so the result is the same bits on every run — and
    runs the epilogue. No block waits on another. The workspace and semaphores are the
    plan's (:func:`plan`): one per stream, the semaphores left at zero by every launch.

    ``split_cluster`` (with ``splits`` 2 … 8, not persistent, no B multicast): a tile's splits
    are launched as one cluster of ``splits`` blocks and reduced in distributed shared memory
    instead (:func:`tilepy.tile.split_k.split_k_cluster_reduce`): the other splits store their
    accumulators into the first's freed stage buffers, which adds them in split order (the
    same bits every run) and runs the epilogue — no workspace, semaphore or global round
    trip; the splits of a tile wait for each other at the cluster barrier.

    ``swap_ab`` (for few rows: M at most ``block_n``): the kernel computes ``outᵀ = bᵀ · aᵀ``
    — the wgmma's 64-row side runs over the output's columns (B's n) and its n side, only
    ``block_n`` (16, 32 or 64) wide, over the output's rows, so a 16-row problem is not a
    64-row tile of which three quarters is padding. A stage is B's ``block_m`` × 64 k (a
    row-major B: ``block_m / 64`` boxes of 64 k × 64 n, the MN-major A operand; a
    column-major one: one K-major box) then A's ``block_n`` rows × 64 k (K-major); a tile is
    ``block_m`` of the output's columns × ``block_n`` of its rows, and the register epilogue
    writes it transposed (bias along the tile's rows). One block per work item or
    persistent, with ``splits`` or without; 64 rows a consumer, no cluster, no staged or TMA
    epilogue.

    ``pingpong`` (two consumers, ``persistent``, no split-K): the consumers take turns over
    the block's work items — consumer 0 the block's 1st, 3rd, … item, consumer 1 its 2nd,
    4th, … — each computing a whole ``block_m`` × ``block_n`` tile (``block_m`` 64 or 128
    rows a consumer), so one consumer's epilogue runs while the other's wgmmas keep the
    tensor cores busy. A stage holds one tile's A and B; the producer loads the items in
    order, and a consumer starts an item's main loop only when the other has issued its
    previous item's last wgmmas (a named barrier each way, the "turn"): the main loops
    alternate, and no consumer waits on a stage more than one ring round ahead (an
    mbarrier's parity cannot tell round r from r − 2). Each consumer's epilogue is its own
    (the TMA-store staging is per consumer already).
    """

    block_m: int = 128
    block_n: int = 256
    stages: int = 4
    dtype: str = "float16"
    consumers: int = 2
    persistent: bool = False
    producer_regs: int = 40
    consumer_regs: int = 232
    smem_epilogue: bool = False
    tma_store: bool = False
    cluster: int = 1
    splits: int = 1
    split_cluster: bool = False
    swap_ab: bool = False
    pingpong: bool = False

    def __post_init__(self):
        def need(ok, what):
            if not ok:
                raise ValueError(f"WsConfig({self.block_m}, {self.block_n}, {self.stages}, "
                                 f"{self.dtype!r}, consumers={self.consumers}): {what}")

        need(self.dtype in ("float16", "bfloat16"), "dtype must be float16 or bfloat16")
        need(self.cluster in (1, 2), "cluster must be 1 or 2")
        need(isinstance(self.splits, int) and not isinstance(self.splits, bool)
             and 1 <= self.splits <= 64,
             "splits must be an int in 1 … 64")
        need(self.splits == 1 or self.cluster == 1, "splits > 1 needs cluster=1")
        if self.split_cluster:
            need(2 <= self.splits <= 8 and not self.persistent,
                 "split_cluster needs splits in 2 … 8 (a portable cluster of the tile's "
                 "splits) and a grid of one item per block (persistent=False)")
            need(self.split_region_bytes <= self.stages * self.stage_bytes,
                 f"split_cluster: the other splits' {self.split_region_bytes} B of "
                 f"accumulators do not fit in the {self.stages * self.stage_bytes} B of stage "
                 f"buffers they are stored into")
        need(self.swap_ab or self.block_n % (64 * self.cluster) == 0, f"cluster="
             f"{self.cluster}: block_n must be a multiple of {64 * self.cluster} (each block "
             "loads an equal share of B's 64-column boxes)")
        need(self.consumers in (1, 2), "consumers must be 1 or 2")
        if self.pingpong:
            need(self.consumers == 2 and self.persistent and self.splits == 1
                 and not self.swap_ab,
                 "pingpong needs two consumers, persistent=True, no split-K and no swap_ab")
            need(self.block_m in (64, 128),
                 "pingpong: block_m (one consumer's tile rows) must be 64 or 128")
        else:
            need(self.block_m in (64, 128, 256) and self.block_m % self.consumers == 0
                 and self.block_m // self.consumers in (64, 128),
                 "block_m / consumers (rows per consumer warpgroup) must be 64 or 128")
        if self.swap_ab:
            need(self.block_n in SWAP_BLOCK_N, f"swap_ab: block_n (the output rows of a tile) "
                 f"must be one of {SWAP_BLOCK_N}")
            need(self.rows_per_consumer == 64 and self.cluster == 1 and not self.smem_epilogue
                 and not self.split_cluster,
                 "swap_ab: 64 rows a consumer, no cluster, the register epilogue, split-K "
                 "through the workspace")
        else:
            need(self.block_n in (64, 128, 192, 256), "block_n must be 64, 128, 192 or 256")
        need(self.rows_per_consumer // 64 * self.block_n <= 256,
             "a consumer's accumulators exceed 128 registers per thread (rows per consumer "
             "× block_n must be at most 64 × 256)")
        need(isinstance(self.stages, int) and self.stages >= 2, "stages must be >= 2")
        if self.smem_epilogue and not self.persistent:
            need(self.epilogue_bytes <= self.stages * self.stage_bytes,
                 f"the smem epilogue's {self.epilogue_bytes} B of staging do not fit in the "
                 f"{self.stages * self.stage_bytes} B of stage buffers it reuses")
        limit = SMEM_LIMIT[(9, 0)]
        need(self.smem_bytes <= limit, f"{self.smem_bytes} B of shared memory exceeds the "
             f"{limit} B of sm_90 by {self.smem_bytes - limit} B"
             + (f" (the persistent smem epilogue needs its own {self.epilogue_bytes} B "
                "staging buffer beside the stages: use fewer stages)"
                if self.smem_epilogue and self.persistent else ""))
        if self.tma_store:
            need(self.persistent and self.smem_epilogue and self.consumers == 2
                 and self.rows_per_consumer == 64,
                 "tma_store needs persistent=True, smem_epilogue=True and two consumers of 64 "
                 "rows")
        if self.producer_regs or self.consumer_regs:
            for r in (self.producer_regs, self.consumer_regs):
                need(24 <= r <= 256 and r % 8 == 0,
                     "setmaxnreg limits must be multiples of 8 in 24 … 256")
            need(WARPGROUP * (self.producer_regs + self.consumers * self.consumer_regs)
                 <= _REG_FILE, "producer_regs + consumers × consumer_regs exceed the "
                 "65536-register file (per 128 threads)")

    @property
    def launch_cluster(self) -> int:
        """Blocks per cluster of the launch: ``splits`` with ``split_cluster``, else
        ``cluster``."""
        return self.splits if self.split_cluster else self.cluster

    @property
    def split_region_bytes(self) -> int:
        """Shared memory the other splits' accumulators fill in the first's (``split_cluster``;
        :func:`tilepy.tile.split_k.cluster_region_bytes`)."""
        n = self.block_m * self.block_n // (4 * WARPGROUP * self.consumers)   # float4s a thread
        return cluster_region_bytes(self.splits, n, 0, WARPGROUP * self.consumers)

    def tile_count(self, m: int, n: int, batch: int = 1) -> int:
        """The tiles of ``batch`` (m, n) outputs (with a cluster, of a cluster's rows; with
        ``swap_ab``, over the output's columns × its rows)."""
        if self.swap_ab:
            m, n = n, m
        return -(-m // (self.block_m * self.cluster)) * -(-n // self.block_n) * batch

    @property
    def rows_per_consumer(self) -> int:
        """Rows of a tile one consumer computes (``pingpong``: the whole tile's)."""
        return self.block_m if self.pingpong else self.block_m // self.consumers

    @property
    def stage_releasers(self) -> int:
        """Consumer warpgroups that release each stage (``pingpong``: the one whose item it
        holds)."""
        return 1 if self.pingpong else self.consumers

    @property
    def threads(self) -> int:
        return WARPGROUP * (1 + self.consumers)

    @property
    def stage_bytes(self) -> int:
        return (self.block_m + self.block_n) * BK * 2

    @property
    def barrier_bytes(self) -> int:
        """The stage ring's mbarriers (a "full" and an "empty" one per stage)."""
        return 16 * self.stages

    @property
    def epilogue_bytes(self) -> int:
        """Shared-memory staging of the smem epilogue (0 without it): one buffer per consumer
        warpgroup, sized for every output kind."""
        if not self.smem_epilogue:
            return 0
        if self.tma_store:   # the swizzled staging of up to 128 columns, the tile in passes
            return self.consumers * 64 * min(self.block_n, TMA_PASS_COLUMNS) * 2
        return self.consumers * staged_bytes(self.rows_per_consumer // 64, self.block_n // 8)

    @property
    def layout(self) -> SmemLayout:
        """The dynamic shared memory: the stage buffers; the epilogue's staging (in the stage
        buffers without ``persistent``, a buffer after them with it); the ring's mbarriers;
        the tile's bias columns (:attr:`bias_in_smem`); with ``splits``, the word that tells
        the consumers whether their item is its tile's last."""
        return SmemLayout.of(
            ("stages", self.stages * self.stage_bytes, 1024),
            ("staging", self.epilogue_bytes, 1024, None if self.persistent else "stages"),
            ("barriers", self.barrier_bytes, 8),
            ("bias", 4 * self.block_n if self.bias_in_smem else 0, 16),
            ("split_flag", 16 if self.splits > 1 and not self.split_cluster else 0, 16))

    @property
    def named_barriers(self) -> NamedBarriers:
        """The epilogue's named barriers: all consumer threads, and one per consumer
        warpgroup (``ids["warpgroup"] + i``)."""
        bars = NamedBarriers()
        bars.take("consumers", self.consumers * WARPGROUP)
        bars.take("warpgroup", WARPGROUP, count=self.consumers)
        if self.pingpong:   # consumer i waits on turn + i; the other arrives on it
            bars.take("turn", 2 * WARPGROUP, count=2)
        return bars


    @property
    def bias_in_smem(self) -> bool:
        """Whether a kernel with a bias has the consumers put their tile's bias columns in
        shared memory as the tile starts (the loads' latency hidden by the pipeline filling
        up) instead of reading them from global memory in the epilogue: the smem epilogue of
        a non-persistent grid, whose barrier of all consumers before the epilogue publishes
        them."""
        return self.smem_epilogue and not self.persistent

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block (:attr:`layout`)."""
        return self.layout.nbytes

    @property
    def setmaxnreg(self) -> bool:
        """Whether the kernel shifts registers: only with two consumers (with one, a 256-thread
        block may use 255 registers per thread anyway)."""
        return bool(self.producer_regs) and self.consumers == 2

    def describe(self) -> str:
        return (f"wgmma-ws {self.block_m}x{self.block_n}x{BK}, 1 TMA producer + "
                f"{self.consumers} consumer warpgroups, {self.stages} stages, "
                f"{self.smem_bytes // 1024} KB smem"
                + (f", setmaxnreg {self.producer_regs}/{self.consumer_regs}"
                   if self.setmaxnreg else "")
                + (", persistent" if self.persistent else "")
                + (", consumers in ping-pong (a tile each)" if self.pingpong else "")
                + (", TMA-store epilogue" if self.tma_store else "")
                + (f", clusters of {self.cluster} (B multicast)" if self.cluster > 1 else "")
                + (f", split-K {self.splits}" if self.splits > 1 else "")
                + (" reduced in a cluster" if self.split_cluster else "")
                + (", operands swapped (the tile's rows are out's columns)"
                   if self.swap_ab else "")
                + (f", smem epilogue ({self.epilogue_bytes // 1024} KB"
                   + (" own buffer)" if self.persistent else " in the stages)")
                   if self.smem_epilogue else ""))


def kernel_jit(cfg: WsConfig):
    """The jit decorator of a :class:`WsConfig` kernel: launch bounds of its threads (setmaxnreg
    redistributes what the kernel was allocated with); plain ``cuda.jit`` in the simulator."""
    if SIMULATOR:
        return cuda.jit
    return cached_jit(launch_bounds=(cfg.threads, 1))


@functools.cache
def tma_producer(cfg: WsConfig, b_row_major: bool, order):
    """The producer thread of a :class:`WsConfig` kernel: ``produce(base, maps, za, zb,
    m_tiles, n_tiles, total, ktiles, w0, step)`` loads every k step of work items ``w0, w0 +
    step, … < total`` into the stage ring (``ring`` of :func:`stage_ring`) — with
    ``cfg.splits`` an item is a tile's k range (:func:`split_range`) — each item's
    origin from ``order.tile_origin(tile, m_tiles, n_tiles) -> (z, row0, col0)`` (a
    :mod:`tilepy.tile.schedule` namespace). ``za`` / ``zb``: the operands' batch extents (1:
    a 2-D map, broadcast). A stage is the A box (``block_m`` × 64 k, K-major) then B's
    (row-major B: ``block_n / 64`` boxes of 64 k × 64 n; column-major: ``block_n`` × 64 k),
    all 128-byte swizzled; with a cluster each block loads its share of B, multicast. With
    ``cfg.swap_ab`` the maps hold B's map first and A's second, and a stage is B's ``block_m``
    columns × 64 k (row-major B: ``block_m / 64`` boxes of 64 k × 64 n; column-major: one
    K-major box) then A's ``block_n`` rows × 64 k."""
    BM, BN, CL = cfg.block_m, cfg.block_n, cfg.cluster
    SWAP = cfg.swap_ab
    A_BYTES = BM * BK * 2
    STAGE_BYTES = cfg.stage_bytes
    CL_MASK = (1 << CL) - 1        # multicast to every block of the cluster
    NJ_CL = BN // 64 // CL         # row-major B: the 64-column boxes of each block's share
    B_SHARE = (NJ_CL * 8192) if b_row_major else (BN * BK * 2 // CL)
    B_X = 64 * NJ_CL if b_row_major else 0           # the share's offset in x (n) …
    B_Y = 0 if b_row_major else BN // CL             # … or in y (n rows)
    lay = cfg.layout
    STAGES, BARS = lay.offset("stages"), lay.offset("barriers")
    ring = stage_ring(cfg)
    if SWAP:   # the 64-row side from B, the n side from A (both maps in the order loaded)
        load_a = tma_tile(BM // 64, 8192) if b_row_major else tma_tile(1, A_BYTES)
        load_b = tma_tile(1, BN * BK * 2)
    else:
        load_a = tma_tile(1, A_BYTES)
        load_b = tma_tile(NJ_CL, 8192) if b_row_major else tma_tile(1, B_SHARE)
    item = split_range(cfg.splits)

    @inline_device
    def produce(base, maps, za, zb, m_tiles, n_tiles, total, ktiles, w0, step):
        bars = base + BARS
        ta = T.tensor_map_address(maps)
        tb = ta + MAP_B
        T.fence_proxy_tensormap_acquire(ta)
        T.fence_proxy_tensormap_acquire(tb)
        rank = int(CLU.cluster_ctarank()) if CL > 1 else 0
        s = 0
        ph = 0
        w = w0
        while w < total:   # (not a range with a run-time step: schedule.udiv)
            tile, _, k_begin, k_end = item(w, ktiles)
            z, bm0, bn0 = order.tile_origin(tile, m_tiles, n_tiles)
            z_a = min(z, za - 1)
            z_b = min(z, zb - 1)
            for kt in range(k_begin, k_end):
                ring.acquire(bars, s, ph)
                full = ring.commit(bars, s, STAGE_BYTES)
                stage = base + STAGES + s * STAGE_BYTES
                k0 = kt * BK
                if SWAP:   # B's block_m columns (ta: B's map), then A's block_n rows
                    if b_row_major:
                        load_a.load(stage, ta, full, bm0, k0, z_b, zb != 1)
                    else:
                        load_a.load(stage, ta, full, k0, bm0, z_b, zb != 1)
                    load_b.load(stage + A_BYTES, tb, full, k0, bn0, z_a, za != 1)
                else:
                    load_a.load(stage, ta, full, k0, bm0, z_a, za != 1)
                    dst = stage + A_BYTES + rank * B_SHARE
                    bx = bn0 + rank * B_X if b_row_major else k0
                    by = k0 if b_row_major else bn0 + rank * B_Y
                    if CL > 1:
                        load_b.load_multicast(dst, tb, full, bx, by, z_b, zb != 1, CL_MASK)
                    else:
                        load_b.load(dst, tb, full, bx, by, z_b, zb != 1)
                s, ph = ring.advance(s, ph)
            w += step

    return produce


@functools.cache
def split_range(splits: int):
    """``item(w, ktiles) -> (tile, split, k_begin, k_end)``: work item ``w`` of a kernel of
    ``splits`` items per tile (split-K) is split ``w % splits`` of tile ``w // splits``, the
    k steps ``k_begin … k_end - 1`` of its ``ktiles`` — balanced ranges, empty ones only where
    ``ktiles < splits``. With ``splits == 1`` the item is the tile, every k step."""
    S = splits

    @inline_device
    def item(w, ktiles):
        if S == 1:
            return w, 0, 0, ktiles
        tile = w // S
        split = w - tile * S
        return tile, split, (split * ktiles) // S, ((split + 1) * ktiles) // S

    return item


def stage_ring(cfg: WsConfig):
    """The stage ring of a :class:`WsConfig` kernel: released by lane 0 of each consumer warp
    (with ``pingpong``, of the consumer whose item the stage holds), of every block of a
    cluster."""
    return tma_pipeline(cfg.stages, 4 * cfg.stage_releasers * cfg.cluster, cfg.cluster)


@functools.cache
def consumer_mainloop(cfg: WsConfig, b_row_major: bool):
    """One consumer warpgroup's main loop over a work item's k steps: ``run(acc0, acc1, base,
    s, ph, cw, ktiles, lane, turn) -> (s, ph)`` accumulates (into the zeroed or running
    ``acc0`` and, with 128 rows per consumer, ``acc1``) rows ``cw · rows_per_consumer …`` of
    the A boxes (``pingpong``: every row) times B from ring uses ``(s, ph)`` on; returns the
    ring position after them. Each step: wait for the stage, its k16 wgmmas as one group,
    ``wait_group 1`` (the previous step's group has retired) and free the previous step's
    stage; the last stage is freed after ``wait_group 0``, which also leaves the
    accumulators readable. ``turn`` (``pingpong``; 0 for none): the named barrier on which
    the warpgroup arrives (with the other consumer's 128 threads waiting) once it has
    waited for its last stage and issued that stage's wgmmas."""
    BM, BN = cfg.block_m, cfg.block_n
    CM = cfg.rows_per_consumer
    A_ROWS = 0 if cfg.pingpong else CM * 128   # a consumer's A rows in the stage, bytes
    MW = CM // 64
    NACC1 = BN // 2 if MW == 2 else 1
    A_BYTES = BM * BK * 2
    STAGE_BYTES = cfg.stage_bytes
    lay = cfg.layout
    STAGES, BARS = lay.offset("stages"), lay.offset("barriers")
    ring = stage_ring(cfg)
    if cfg.swap_ab:   # B's columns the 64-row side (MN-major from a row-major B), A's rows n
        wmma = warpgroup_mma(BN, SmemOperand(BN, BK, "k"),
                             SmemOperand(BM, BK, "mn" if b_row_major else "k"), cfg.dtype)
    else:
        wmma = warpgroup_mma(BN, SmemOperand(BN, BK, "mn" if b_row_major else "k"),
                             SmemOperand(BM, BK, "k"), cfg.dtype)

    PINGPONG = cfg.pingpong

    @inline_device
    def run(acc0, acc1, base, s, ph, cw, ktiles, lane, turn):
        bars = base + BARS
        prev = 0
        for kt in range(ktiles):
            ring.wait(bars, s, ph)
            stage = base + STAGES + s * STAGE_BYTES
            wmma.fence()
            if MW == 2:
                wmma.mma2(acc0, acc1, stage + cw * A_ROWS, stage + A_BYTES, 1)
            else:
                wmma.mma(acc0, stage + cw * A_ROWS, stage + A_BYTES, 1)
            wmma.commit()
            if PINGPONG and turn != 0 and kt == ktiles - 1:
                BAR.bar_arrive(turn, 2 * WARPGROUP)   # the other consumer's turn
            wmma.wait(1)
            if kt > 0:
                ring.release(bars, prev, lane)
            prev = s
            s, ph = ring.advance(s, ph)
        wmma.wait(0)
        wmma.fence_operand(acc0)
        if MW == 2:
            W.wgmma_fence_operand(acc1, NACC1)
        ring.release(bars, prev, lane)
        return s, ph

    return run


#: The phase marks of a traced kernel (``wgmma_ws_gemm_kernel(..., trace=True)``; columns of
#: :mod:`tilepy.tile.trace`): timestamps by the first consumer thread — ``entry``, ``ready``
#: (barriers initialised, the block met), ``first_stage`` (the first work item's first stage
#: has landed), ``first_loop_end`` / ``first_reduced`` (split-K's step done: the item's
#: partial stored and counted, and for a tile's last item the sum; without splits the loop's
#: end) / ``first_item_end`` (its epilogue issued, if it stores), ``last_loop_start``
#: / ``last_loop_end`` / ``last_item_end`` (the block's last item), ``consumer_end`` (after the
#: epilogue's last wait) — and by the producer thread ``producer_end`` (its last load issued);
#: values ``smid`` and ``items`` (work items the block ran).
TRACE_MARKS = {"entry": 0, "ready": 1, "first_stage": 2, "first_loop_end": 3,
               "first_reduced": 4, "first_item_end": 5, "last_loop_start": 6,
               "last_loop_end": 7, "last_item_end": 8, "consumer_end": 9, "producer_end": 10,
               "smid": 0, "items": 1}


@functools.cache
def wgmma_ws_gemm_kernel(cfg: WsConfig, b_row_major: bool, out_kind: str, activation=None,
                         has_bias: bool = False, has_c: bool = False, trace: bool = False,
                         pdl=False, prefetch_maps: bool = False):
    """The kernel ``kernel(a, b, out, c, bias, alpha, beta, maps, counters, partials)`` (see
    the module docstring; ``counters`` / ``partials``: split-K's tile semaphores and partial
    sums, placeholders without ``splits``); launch it through :func:`plan`. ``trace``: the
    kernel takes a last argument, a uint64 array of :mod:`tilepy.tile.trace` rows (one per
    block), and marks the phases of :data:`TRACE_MARKS` in it (``plan(..., trace=array)``);
    nothing else changes. ``pdl`` (``False``, ``"early"`` or ``"late"``; ``True`` is
    ``"early"``): launched as a programmatic dependent launch (:func:`plan` gives its plan
    ``dependent=True``): the blocks set up their shared memory while the kernel ahead in the
    stream finishes, and touch global memory only after it has
    (:func:`tilepy.tile.dependent.dependent_launch`); the kernel behind may launch from this
    one's start (``"early"``) or once every block's producer has issued its last load and its
    consumers have finished their last main loop (``"late"``). ``prefetch_maps`` (not with
    ``pdl``, whose blocks may start before the kernel that wrote the maps has finished):
    thread 0 acquires A's and B's tensor maps and prefetches them at entry, before the
    barriers are set up, so the first TMA loads need not fetch them. A composition:
    the roles (:func:`~tilepy.tile.roles.warpgroup_roles`), the producer
    (:func:`tma_producer`: the stage ring and TMA tile loads), the grouped raster and static
    persistent schedule (:mod:`tilepy.tile.schedule`), each consumer's main loop
    (:func:`consumer_mainloop`: the warpgroup MMA), with ``splits`` the reduction of
    :func:`tilepy.tile.split_k.split_k_reduce`, and one of three epilogues
    (:func:`_epilogue`)."""
    BM, BN, NC, CL = cfg.block_m, cfg.block_n, cfg.consumers, cfg.cluster
    CM = cfg.rows_per_consumer
    NACC = BN // 2
    NACC1 = NACC if CM == 128 else 1
    lay = cfg.layout
    BARS = lay.offset("barriers")
    roles = warpgroup_roles(NC, producer=True, producer_first=True,
                            producer_regs=cfg.producer_regs if cfg.setmaxnreg else 0,
                            consumer_regs=cfg.consumer_regs if cfg.setmaxnreg else 0)
    ring = stage_ring(cfg)
    order = grouped_raster(BM, BN, GROUP_M, CL)
    sched = static_persistent(CL)
    produce = tma_producer(cfg, b_row_major, order)
    mainloop = consumer_mainloop(cfg, b_row_major)
    epilogue = _epilogue(cfg, out_kind, activation, has_bias, has_c)
    BIAS_SMEM = has_bias and cfg.bias_in_smem
    BIAS = lay.offset("bias") if BIAS_SMEM else 0
    CONSUMER_THREADS = roles.CONSUMER_THREADS
    S = cfg.splits
    item = split_range(S)
    SPLIT_CLUSTER = cfg.split_cluster
    SWAP = cfg.swap_ab
    PINGPONG = cfg.pingpong
    TURN = cfg.named_barriers.ids["turn"] if PINGPONG else 0
    STAGES = cfg.stages
    ROW_STEP = 0 if PINGPONG else CM    # a consumer's rows in the tile
    if prefetch_maps and pdl:
        raise ValueError("wgmma_ws_gemm_kernel: prefetch_maps reads the maps before a pdl "
                         "kernel may read global memory; one or the other")
    PREFETCH = bool(prefetch_maps)
    if S > 1 and SPLIT_CLUSTER:   # the tile's splits a cluster; partials into split 0's stages
        split_k = split_k_cluster_reduce(S, NACC // 4, NACC1 // 4 if CM == 128 else 0,
                                         CONSUMER_THREADS, cfg.named_barriers.ids["consumers"])
        REGION = lay.offset("stages")
    elif S > 1:
        split_k = split_k_reduce(S, NACC // 4, NACC1 // 4 if CM == 128 else 0,
                                 CONSUMER_THREADS, cfg.named_barriers.ids["consumers"])
        FLAG = lay.offset("split_flag")
    dynamic_shared_buffer = dynamic_shared(lay.align)
    f32 = types.float32
    TR = phase_marks(trace)
    MK = device_namespace("ws trace marks", **TRACE_MARKS)
    after = dependent_launch(bool(pdl), "late" if pdl == "late" else "early")   # (no-ops
    # without pdl)
    TRACE_OFF = -(-cfg.smem_bytes // 16) * 16    # the traced kernel's row, after the layout

    if trace:
        @inline_device
        def first_stage(bars, s, ph, scratch):
            ring.wait(bars, s, ph)      # the stage the main loop waits for first
            TR.note(scratch, MK.first_stage)
    else:
        @inline_device
        def first_stage(bars, s, ph, scratch):
            pass

    @inline_device
    def extent(a, b):
        # the tiles' rows and columns: out's (m, n), or with swap_ab (n, m)
        m = a.shape[1]
        n = b.shape[2] if b_row_major else b.shape[1]
        if SWAP:
            return n, m
        return m, n

    @inline_device
    def consume(base, a, b, out, c, bias, alpha, beta, cw, m_tiles, n_tiles, total, ktiles,
                w0, step, maps, counters, partials, tr):
        """Consumer warpgroup ``cw``: rows ``cw · CM …`` of every work item of the block."""
        m, n = extent(a, b)
        tid = cuda.threadIdx.x
        lane = tid % 32
        scratch = base + TRACE_OFF
        leader = tid == WARPGROUP      # the first consumer thread notes the block's phases
        acc0 = cuda.local.array(NACC, f32)
        acc1 = cuda.local.array(NACC1, f32)
        epilogue.begin(maps, tid)
        s = 0
        ph = 0
        items = 0
        # pingpong: this consumer's items are every other one of the block's, from its cw-th
        first = w0 + cw * step if PINGPONG else w0
        stride = 2 * step if PINGPONG else step
        block_items = udiv(total - w0 + step - 1, step)
        own = cw   # (pingpong) the item's index among the block's
        turn = 0
        w = first
        while w < total:   # (not a range with a run-time step: schedule.udiv)
            tile, split, k_begin, k_end = item(w, ktiles)
            last_item = w + stride >= total
            z, bm0, bn0 = order.tile_origin(tile, m_tiles, n_tiles)
            if PINGPONG:
                # the other consumer has waited for its last stage before this item's first
                pos = own * ktiles
                s = pos % STAGES
                ph = (pos // STAGES) % 2
                if own > 0:
                    BAR.bar_sync(TURN + cw, 2 * WARPGROUP)
                turn = TURN + 1 - cw if own + 1 < block_items else 0
                own += 2
            for i in range(NACC):
                acc0[i] = f32(0)
            if CM == 128:
                for i in range(NACC1):
                    acc1[i] = f32(0)
            if BIAS_SMEM:
                # the tile's bias columns (zeros past n), published by the epilogue's barrier
                # of all consumers
                for i in range(2 * (tid - WARPGROUP), BN, 2 * CONSUMER_THREADS):
                    col = bn0 + i
                    b0 = bias[col] if col < n else f32(0)
                    b1 = bias[col + 1] if col + 1 < n else f32(0)
                    VEC.st_shared_v2_f32(base + BIAS + 4 * i, b0, b1)
            if leader:
                if items == 0 and k_end > k_begin:
                    first_stage(base + BARS, s, ph, scratch)
                if last_item:
                    TR.note(scratch, MK.last_loop_start)
            if S == 1 or k_end > k_begin:
                s, ph = mainloop(acc0, acc1, base, s, ph, cw, k_end - k_begin, lane, turn)
            if last_item:
                after.release()     # pdl "late": the kernel behind may launch
            if leader:
                if items == 0:
                    TR.note(scratch, MK.first_loop_end)
                if last_item:
                    TR.note(scratch, MK.last_loop_end)
            # split-K: only the tile's last item (its partials summed) stores it; in a cluster,
            # its first split
            if S == 1:
                stores = True
            elif SPLIT_CLUSTER:
                stores = split_k.reduce(acc0, acc1, base + REGION, split, tid - WARPGROUP)
            else:
                stores = split_k.reduce(acc0, acc1, partials, counters, tile, split,
                                        tid - WARPGROUP, base + FLAG)
            if leader and items == 0:
                TR.note(scratch, MK.first_reduced)
            if stores:
                epilogue.store(acc0, acc1, base, maps, out, c, bias, z, bm0 + cw * ROW_STEP,
                               bn0, m, n, alpha, beta, cw, tid)
            if leader:
                if items == 0:
                    TR.note(scratch, MK.first_item_end)
                if last_item:
                    TR.note(scratch, MK.last_item_end)
            items += 1
            w += stride
        epilogue.end(tid)
        if leader:
            TR.note(scratch, MK.consumer_end)
            TR.note_value(scratch, MK.items, items)
            TR.flush(tr, TR.row(), scratch)

    @inline_device
    def body(a, b, out, c, bias, alpha, beta, maps, counters, partials, tr):
        m, n = extent(a, b)
        m_tiles = (m + BM * CL - 1) // (BM * CL)   # (blocks of a cluster's rows)
        n_tiles = (n + BN - 1) // BN
        total = m_tiles * n_tiles * out.shape[0] * S
        ktiles = (a.shape[2] + BK - 1) // BK
        w0, step = sched.first_and_step()
        base = shared_addr(dynamic_shared_buffer(), 0)
        tid = cuda.threadIdx.x
        wg = roles.warpgroup(tid)
        if tid == WARPGROUP:
            TR.start(base + TRACE_OFF)
            TR.note(base + TRACE_OFF, MK.entry)
            TR.note_value(base + TRACE_OFF, MK.smid, TR.smid())
        if tid == 0:
            if PREFETCH:   # the maps on their way while the barriers are set up
                tmaps = T.tensor_map_address(maps)
                T.fence_proxy_tensormap_acquire(tmaps)
                T.prefetch_tensormap(tmaps)
                T.fence_proxy_tensormap_acquire(tmaps + MAP_B)
                T.prefetch_tensormap(tmaps + MAP_B)
            ring.init(base + BARS)
            MB.fence_mbarrier_init()
        if CL > 1:   # every block's barriers exist before any block signals them
            CLU.cluster_arrive()
            CLU.cluster_wait()
        else:
            cuda.syncthreads()
        after.begin()   # pdl: the kernel ahead done; nothing global before this
        if tid == WARPGROUP:
            TR.note(base + TRACE_OFF, MK.ready)
        if wg == 0:
            roles.enter_producer()
            if tid == 0:
                produce(base, maps, a.shape[0], b.shape[0], m_tiles, n_tiles, total, ktiles,
                        w0, step)
                TR.mark(tr, TR.row(), MK.producer_end)
            after.release()
            if S > 1 and SPLIT_CLUSTER:   # the cluster barriers of the block's one item
                split_k.meet()
        else:
            roles.enter_consumer()
            consume(base, a, b, out, c, bias, alpha, beta, roles.consumer(wg), m_tiles,
                    n_tiles, total, ktiles, w0, step, maps, counters, partials, tr)
        if CL > 1:
            # no block leaves while another of its cluster may still arrive on its barriers
            CLU.cluster_arrive()
            CLU.cluster_wait()

    if trace:
        @kernel_jit(cfg)
        def kernel(a, b, out, c, bias, alpha, beta, maps, counters, partials, tr):
            body(a, b, out, c, bias, alpha, beta, maps, counters, partials, tr)
    else:
        @kernel_jit(cfg)
        def kernel(a, b, out, c, bias, alpha, beta, maps, counters, partials):
            body(a, b, out, c, bias, alpha, beta, maps, counters, partials, 0)

    kernel.config = cfg
    kernel.trace = trace
    kernel.pdl = bool(pdl)
    kernel.prefetch_maps = PREFETCH
    if trace:
        kernel.smem_bytes = TRACE_OFF + SCRATCH_BYTES
    kernel.b_row_major = b_row_major
    kernel.tma_out = cfg.tma_store     # the maps end with the output's
    kernel.split_scratch = True        # counters and partials follow the maps (plan)
    return kernel


@functools.cache
def _epilogue(cfg: WsConfig, out_kind: str, activation, has_bias: bool, has_c: bool):
    """One consumer warpgroup's epilogue of its ``rows_per_consumer`` × ``block_n`` tile
    (``act(alpha · acc + bias + beta · c)``, cast, stored into ``out[z]``):

    * ``store(acc0, acc1, base, maps, out, c, bias, z, row0, col0, m, n, alpha, beta, cw,
      tid)`` — the tile at ``(row0, col0)`` from the accumulators (``acc1``: rows 64 … 127
      of a 128-row consumer); ``begin(maps, tid)`` before the first tile and ``end(tid)``
      after the last.

    Which one, by the config: straight from the registers (:func:`~tilepy.tile.epilogue.
    store_accumulators`; with ``swap_ab`` transposed, the tile being of ``outᵀ``);
    ``smem_epilogue``: staged through shared memory, 16-byte stores of
    whole rows (:func:`~tilepy.tile.epilogue.store_accumulators_smem`; without ``persistent``
    in the stage buffers, after a named barrier of all consumers, and with the bias in shared
    memory); ``tma_store``: staged 128-byte-swizzled, in passes of up to 128 columns, and
    stored by one thread with TMA, the store draining under the next tile's main loop."""
    BN, NC = cfg.block_n, cfg.consumers
    NI = BN // 8
    MW = cfg.rows_per_consumer // 64
    lay = cfg.layout
    EPI = cfg.smem_epilogue
    TMA = cfg.tma_store
    EPI_OFF = lay.offset("staging") if EPI else 0
    EPI_WG = cfg.epilogue_bytes // NC
    BIAS_SMEM = has_bias and cfg.bias_in_smem
    BIAS_OFF = lay.offset("bias") if BIAS_SMEM else 0
    SHARED_STAGING = EPI and not cfg.persistent
    bars = cfg.named_barriers
    ALL = bars.ids["consumers"]
    WG0 = bars.ids["warpgroup"]
    CONSUMER_THREADS = NC * WARPGROUP
    f32 = types.float32
    store = store_accumulators(1, NI, out_kind, activation, has_bias, has_c, cfg.swap_ab)
    store_smem = store_accumulators_smem(MW, NI, out_kind, activation, has_bias, has_c,
                                         bias_in_smem=BIAS_SMEM)
    PASS_NI = min(NI, TMA_PASS_COLUMNS // 8)      # tma_store: n8 blocks per staging pass
    if TMA:
        if out_kind not in ("float16", "bfloat16") or BN % 64:
            raise ValueError(f"tma_store: 16-bit outputs and whole 64-column boxes, got "
                             f"{out_kind} and block_n {BN}")
        stage0 = stage_accumulators_swizzled(NI, out_kind, activation, has_bias, has_c, 0,
                                             PASS_NI)
        stage1 = stage_accumulators_swizzled(NI, out_kind, activation, has_bias, has_c,
                                             PASS_NI) if NI > PASS_NI else stage0

    @inline_device
    def begin(maps, tid):
        if TMA and tid % WARPGROUP == 0:
            T.fence_proxy_tensormap_acquire(T.tensor_map_address(maps) + MAP_OUT)

    @inline_device
    def tma_pass(acc, stg, omap, z, row0, col0, m, n, alpha, bias, c_in, beta, tw, cw, part,
                 batched):
        """One staging pass — columns ``col0 + 128·part …`` — swizzled into ``stg`` and
        stored by the warpgroup's thread 0 with TMA (2-D map, or 3-D ``batched``)."""
        staging_acquire(tw, WG0 + cw)
        if part == 0:
            stage0(acc, stg, row0, col0, m, n, alpha, bias, c_in, beta, tw)
        else:
            stage1(acc, stg, row0, col0, m, n, alpha, bias, c_in, beta, tw)
        staging_store(omap, stg, col0 + 8 * PASS_NI * part, row0, z, n,
                      min(PASS_NI, NI - PASS_NI * part) // 8, tw, WG0 + cw, batched)

    @inline_device
    def store_tile(acc0, acc1, base, maps, out, c, bias, z, row0, col0, m, n, alpha, beta, cw,
                   tid):
        cz = c[min(z, c.shape[0] - 1)]
        tw = tid % WARPGROUP
        if TMA:
            omap = T.tensor_map_address(maps) + MAP_OUT
            stg = base + EPI_OFF + cw * EPI_WG
            batched = out.shape[0] != 1
            tma_pass(acc0, stg, omap, z, row0, col0, m, n, alpha, bias, cz, beta, tw, cw, 0,
                     batched)
            if NI > PASS_NI:
                tma_pass(acc0, stg, omap, z, row0, col0, m, n, alpha, bias, cz, beta, tw, cw,
                         1, batched)
        elif EPI:
            if SHARED_STAGING:
                # every consumer's wgmmas have read their stages before any is overwritten
                BAR.bar_sync(ALL, CONSUMER_THREADS)
            src = base + BIAS_OFF if BIAS_SMEM else bias
            store_smem(acc0, acc1, base + EPI_OFF + cw * EPI_WG, out[z], row0, col0, m, n,
                       alpha, src, cz, beta, tw, WG0 + cw)
        else:
            acc3 = cuda.local.array((1, NI, 4), f32)
            lane = tid % 32
            r0 = row0 + ((tid % WARPGROUP) // 32) * 16
            for j in range(NI):
                for q in range(4):
                    acc3[0, j, q] = acc0[4 * j + q]
            store(acc3, out[z], r0, col0, m, n, alpha, bias, cz, beta, lane)
            if MW == 2:
                for j in range(NI):
                    for q in range(4):
                        acc3[0, j, q] = acc1[4 * j + q]
                store(acc3, out[z], r0 + 64, col0, m, n, alpha, bias, cz, beta, lane)

    @inline_device
    def end(tid):
        if TMA and tid % WARPGROUP == 0:
            T.bulk_wait_group_read(0)   # no store still reads shared memory at exit

    return device_namespace("gemm epilogue", begin=begin, store=store_tile, end=end)


# ---- host side: tensor maps, grid, launch plans ------------------------------------------------

def _map_layout(view, box_rows: int):
    """(shape, byte strides, box) of the tensor map of a 3-D uint16 kernel view (or a 2-D one:
    one matrix): 2-D when the view holds one matrix, else 3-D with the batch outermost.
    Strides of length-1 dimensions are free; they are set to what the encoder accepts."""
    if len(view.shape) == 2:
        z, sz = 1, 0
        rows, cols = (int(d) for d in view.shape)
        srow, scol = (int(s) for s in view.strides)
    else:
        z, rows, cols = (int(d) for d in view.shape)
        sz, srow, scol = (int(s) for s in view.strides)
    if cols == 1:
        scol = 2
    if rows == 1:
        srow = max(16, -(-cols * 2 // 16) * 16)
    if scol != 2:
        raise ValueError(f"a TMA-fed operand needs its last dimension contiguous, got byte "
                         f"strides {tuple(view.strides)} for shape {tuple(view.shape)}")
    if z == 1:
        return (rows, cols), (srow, 2), (box_rows, BK)
    return (z, rows, cols), (sz, srow, 2), (1, box_rows, BK)


def encode_maps(cfg: WsConfig, b_row_major: bool, a_ptr: int, a_layout, b_ptr: int, b_layout):
    """The 256 bytes (uint8) of the A and B tensor maps for operands at ``a_ptr`` / ``b_ptr``
    with the ``_map_layout`` layouts (shape, strides, box) — B's first with ``swap_ab``."""
    dt = cfg.dtype
    ma = host_tma.encode_tiled(a_ptr, dt, *a_layout, swizzle=128)
    mb = host_tma.encode_tiled(b_ptr, dt, *b_layout, swizzle=128)
    return np.concatenate([mb.data, ma.data] if cfg.swap_ab else [ma.data, mb.data])


def layouts(cfg: WsConfig, b_row_major: bool, a, b):
    """The (shape, strides, box) of the A and B tensor maps of 3-D kernel views ``a``, ``b``;
    raises ValueError for operands TMA cannot describe (the op then has to copy them)."""
    # (swap_ab: A's rows on the tile's n side, B's columns on its 64-row side)
    a_layout = _map_layout(a, cfg.block_n if cfg.swap_ab else cfg.block_m)
    # row-major B: boxes of 64 k rows × 64 n (MN-major atoms); column-major: block_n × 64 k
    # (with a cluster, each block loads its share of the block_n rows; swap_ab: block_m)
    b_layout = _map_layout(b, BK if b_row_major else cfg.block_m if cfg.swap_ab else
                           cfg.block_n // cfg.cluster)
    for name, (shape, strides, _) in (("a", a_layout), ("b", b_layout)):
        for s in strides[:-1]:
            if s % 16 or s <= 0:
                raise ValueError(f"{name}: byte strides {strides} are not multiples of 16; TMA "
                                 "needs 16-byte-aligned rows (and batches)")
    return a_layout, b_layout


def out_layout(out):
    """(shape, strides, box) of the tensor map of a 3-D (or 2-D) uint16 output view that TMA
    stores go through (the softmax mode's ``tma_out``, :attr:`WsConfig.tma_store`, the FP8
    GEMM's :attr:`~tilepy.ops.gemm_kmajor_wgmma.KMajorConfig.tma_store`; boxes of 64 rows × 64
    columns); ValueError if TMA cannot describe it."""
    if out.dtype.itemsize != 2:
        raise ValueError(f"out: TMA stores take 16-bit outputs, got {out.dtype}")
    shape, strides, box = _map_layout(out, 64)
    if any(s % 16 or s <= 0 for s in strides[:-1]) or pointer(out) % 16:
        raise ValueError(f"out: 16-byte-aligned rows (and batches) and start needed for TMA "
                         f"stores, got byte strides {strides}")
    return shape, strides, box


def tma_storable(out) -> bool:
    """Whether TMA stores can write the kernel view ``out`` as it is (:func:`out_layout`)."""
    try:
        out_layout(out)
    except ValueError:
        return False
    return True


def tma_ready(cfg: WsConfig, b_row_major: bool, a, b) -> bool:
    """Whether TMA can describe the 3-D kernel views ``a`` and ``b`` as they are (16-byte rows
    and batches, contiguous last dimension): the op's test before choosing this kernel."""
    try:
        layouts(cfg, b_row_major, a, b)
    except ValueError:
        return False
    return pointer(a) % 16 == 0 and pointer(b) % 16 == 0


def grid(cfg: WsConfig, m: int, n: int, batch: int = 1, sms: int | None = None,
         clusters: int | None = None):
    """The launch grid: a block per work item (x: a tile, or with ``splits`` a tile's k range)
    and batch (y), or a persistent grid of ``sms`` blocks (at most one per item). With
    clusters, x counts whole clusters' blocks, and a persistent grid is at most ``clusters``
    clusters (those the device runs at once)."""
    cl = cfg.cluster
    tiles = cfg.tile_count(m, n) * cfg.splits  # per cluster
    if not cfg.persistent:
        return (tiles * cl, batch)
    n_cl = min((sms or SMS) // cl, tiles * batch)
    if clusters is not None:
        n_cl = min(n_cl, clusters)
    return (max(1, n_cl) * cl, 1)


def plan(kernel, cfg: WsConfig, a, b, out, c, bias, alpha=1.0, beta=0.0, *,
         sms: int | None = None, stream=0, alloc=None, trace=None):
    """``(launch plan, arguments)`` for 3-D operands (see :func:`wgmma_ws_gemm_kernel`), the
    same call as :func:`tilepy.ops.gemm_wgmma.plan`.

    The arguments end with the tensor maps of ``a`` and ``b`` (and ``out`` where TMA stores
    it): encoded here, for the B layout the kernel was generated for, into a buffer from
    ``alloc(nbytes) -> (owner, pointer)`` (default a Numba device array; ops pass
    :func:`tilepy.arrays.byte_allocator`), and written by the plan's first launch on its
    stream (:class:`TmaLaunchPlan`, which also makes the maps of other pointers) — so building
    a plan neither waits for the GPU nor copies from host memory, and may run during a
    CUDA-graph capture. ``sms``: the persistent grid's block count (default: the device's
    SMs). ``stream``: accepted for the callers' sake (nothing is enqueued here). ``trace``:
    for a kernel generated with ``trace=True``, the uint64 array of
    :mod:`tilepy.tile.trace` rows it marks (at least one row per block of the plan's grid,
    :func:`grid`); ValueError when it is given to a kernel without tracing or missing.
    Raises ValueError for operands whose strides TMA cannot describe."""
    check = getattr(kernel, "check_operands", None)
    if check is not None:   # refused before any map is encoded or copied
        check(a, b, out)
    b_row_major = kernel.b_row_major
    a_layout, b_layout = layouts(cfg, b_row_major, a, b)
    tma_out = kernel.tma_out
    map_args = (0, 1, 2) if tma_out else (0, 1)
    if tma_out:
        o_layout = out_layout(out)

        def encoder(a_ptr, b_ptr, o_ptr):
            om = host_tma.encode_tiled(o_ptr, cfg.dtype, *o_layout, swizzle=128)
            return np.concatenate([encode_maps(cfg, b_row_major, a_ptr, a_layout, b_ptr,
                                               b_layout), om.data])
    else:
        def encoder(a_ptr, b_ptr):
            return encode_maps(cfg, b_row_major, a_ptr, a_layout, b_ptr, b_layout)

    ops = (a, b, out)
    raw = encoder(*(pointer(ops[i]) for i in map_args))
    buf = device_write.allocate(alloc, raw.size, host_tma.MAP_ALIGN)
    args = (a, b, out, c, bias, np.float32(alpha), np.float32(beta),
            buf.view((raw.size,), np.uint8))
    kind, extra = TmaLaunchPlan, {}
    if getattr(kernel, "split_scratch", False):
        scratch = split_scratch(cfg, a.shape[1], out.shape[2], out.shape[0], alloc)
        if scratch is None:
            args += (arrays.placeholder(1, "int32"), arrays.placeholder(2))
        else:
            kind = ScheduledTmaPlan
            extra, views = scratch
            args += views
    if getattr(kernel, "trace", False) != (trace is not None):
        raise ValueError("plan: a trace array goes with a kernel generated with trace=True, "
                         "and only with one")
    if trace is not None:
        args += (trace,)
    smem = getattr(kernel, "smem_bytes", cfg.smem_bytes)
    allow_dynamic_shared(kernel, args, smem)
    g = getattr(kernel, "grid", None)
    if g is not None:   # a kernel of its own grid (the softmax mode: a block per 128 rows)
        g = g(a, b, out)
    else:
        g = grid(cfg, a.shape[1], out.shape[2], out.shape[0],
                 sms if sms is not None else (sm_count(SMS) if cfg.persistent else None))
    p = kind(kernel, args, g, cfg.threads, smem, encoder, map_args, MAPS_ARG,
             cfg.launch_cluster, alloc=alloc, initial=(buf, raw),
             dependent=getattr(kernel, "pdl", False), **extra)
    if cfg.split_cluster and p.max_active_clusters() < 1:
        raise ValueError(f"plan: this device cannot run a cluster of {cfg.splits} blocks of "
                         f"{cfg.describe()} (split_cluster needs them on SMs of one GPC at "
                         "once)")
    if trace is not None and (len(trace.shape) != 2 or trace.shape[0] < g[0] * g[1]
                              or trace.shape[1] != TRACE_WIDTH):
        raise ValueError(f"plan: the trace needs ({g[0] * g[1]}, {TRACE_WIDTH}) rows and "
                         f"columns at least (a row per block); got {tuple(trace.shape)}")
    if cfg.persistent and cfg.cluster > 1:
        # a persistent grid of more clusters than run at once would leave the last ones for
        # a second wave (SMs per GPC need not be even)
        fits = p.max_active_clusters()
        if fits < 1:
            raise ValueError(f"{cfg.describe()}: the device cannot run a cluster of "
                             f"{cfg.cluster} of these blocks at once (cuOccupancyMaxActive"
                             "Clusters is 0); use cluster=1")
        fit = grid(cfg, a.shape[1], out.shape[2], out.shape[0], g[0], fits)
        if fit != g:
            p = TmaLaunchPlan(kernel, args, fit, cfg.threads, smem, encoder, map_args,
                              MAPS_ARG, cfg.cluster, alloc=alloc, initial=(buf, raw))
    return p, args


#: The tensor maps' place in the kernel's arguments (after a … beta).
MAPS_ARG = 7


def split_scratch(cfg: WsConfig, m: int, n: int, batch: int, alloc=None):
    """None without ``cfg.splits`` (or with ``split_cluster``: no workspace); else
    ``(ScheduledTmaPlan keywords, (counters, partials))``: one buffer from ``alloc`` holding
    the tiles' int32 semaphores (zeroed by the plan on each stream before its first launch,
    left at zero by every launch) and then the float32 partial sums
    (:func:`tilepy.tile.split_k.split_k_reduce`: 4 bytes per element of every item's tile)."""
    if cfg.splits == 1 or cfg.split_cluster:
        return None
    tiles = cfg.tile_count(m, n, batch)   # (splits > 1: no cluster)
    counter_bytes = -(-4 * tiles // 256) * 256
    row = 4 * WARPGROUP * cfg.consumers            # floats per partials row
    rows = tiles * cfg.splits * cfg.block_m * cfg.block_n // row
    buf = device_write.allocate(alloc, counter_bytes + 4 * row * rows, 256)
    counters = buf.view((counter_bytes // 4,), np.int32)
    partials = device_write.DeviceBuffer(buf, buf.ptr + counter_bytes, 4 * row * rows).view(
        (rows, row), np.float32)
    return ({"counter": buf, "counter_bytes": counter_bytes,
             "workspace_offset": counter_bytes}, (counters, partials))


def argtypes(out_kind: str, split_scratch: bool = True):
    """Numba argument types (for offline compilation); ``split_scratch=False``: without the
    split-K counters and partials (gemm_softmax's kernel)."""
    u16 = types.Array(types.uint16, 3, "C")
    out = types.Array(types.float32 if out_kind == "float32" else types.uint16, 3, "C")
    base = (u16, u16, out, out, types.float32[::1], types.float32, types.float32,
            types.uint8[::1])
    if not split_scratch:
        return base
    return base + (types.int32[::1], types.Array(types.float32, 2, "C"))


#: The TMA-store epilogue's config in the reports and sweeps: persistent 128 × 256, 3 stages.
TMA_STORE = WsConfig(128, 256, 4, persistent=True, smem_epilogue=True, tma_store=True)

#: Clusters of two sharing B (TMA multicast), the staged epilogue of the default: the producer
#: needs 56 registers (at 40 it spills 48 bytes: the multicast's shares of B and the cluster
#: rank are live across its loop), so consumers get 224 (no spills either).
CLUSTER = WsConfig(128, 256, 4, smem_epilogue=True, cluster=2, producer_regs=56,
                   consumer_regs=224)

#: ... with the persistent TMA-store epilogue.
CLUSTER_TMA_STORE = WsConfig(128, 256, 4, persistent=True, smem_epilogue=True, tma_store=True,
                             cluster=2, producer_regs=56, consumer_regs=224)

def _report_kernels():
    """(name, config, B row-major, output kind, activation, has_bias) of the offline reports,
    by group: the main-loop variants, the epilogues, the register epilogue of the unswapped
    tiles (``config=`` only: every built-in unswapped config stages its epilogue), clusters."""
    smem = WsConfig(smem_epilogue=True)
    main = (  # split-K: partials to the workspace, the last item's ordered sum
            ("ws_64x256_bcol_splitk3",
             WsConfig(64, 256, 5, consumers=1, smem_epilogue=True, splits=3), False,
             "float16"),)
    register = (("ws_128x256_brow", WsConfig(), True, "float16"),
                ("ws_128x256_bcol", WsConfig(), False, "float16"),
                ("ws_256x128_brow", WsConfig(256, 128), True, "float16"),
                ("ws_128x256_brow_persistent", WsConfig(persistent=True), True, "float16"),
                ("ws_128x256_brow_noreg", WsConfig(producer_regs=0, consumer_regs=0), True,
                 "float16"),
                # a bias and an activation make the epilogue big enough that LLVM may stop
                # unrolling it and send the accumulators to local memory: the compile test
                # refuses a stack
                ("ws_128x256_brow_bias_gelu", WsConfig(), True, "float16", "gelu", True))
    epilogues = (
        ("ws_128x256_brow_smemepi_bias_gelu", smem, True, "float16", "gelu", True),
        ("ws_128x256_brow_smemepi", smem, True, "float16"),
        ("ws_128x256_bcol_smemepi_f32out", smem, False, "float32"),
        ("ws_256x128_brow_smemepi", WsConfig(256, 128, smem_epilogue=True), True, "float16"),
        ("ws_128x256_brow_persistent_smemepi",
         WsConfig(stages=3, persistent=True, smem_epilogue=True), True, "float16"),
        # the TMA-store epilogue (swizzled staging, stores drain under the next main loop)
        ("ws_128x256_brow_persistent_tmastore", TMA_STORE, True, "float16"),
        ("ws_128x256_brow_persistent_tmastore_bias_gelu", TMA_STORE, True, "float16", "gelu",
         True))
    cluster = (("ws_128x256_brow_smemepi_cluster2", CLUSTER, True, "float16"),
               ("ws_128x256_bcol_smemepi_cluster2", CLUSTER, False, "float16"),
               ("ws_128x256_brow_persistent_tmastore_cluster2", CLUSTER_TMA_STORE, True,
                "float16"))
    return {"main": main, "epilogues": epilogues, "register": register, "cluster": cluster}


def compile_reports(group: str = "main"):
    """Offline sm_90a reports. ``group="main"``: split-K (64×256, 3 splits);
    ``"epilogues"``: bias + GELU (staged epilogue) and the shared-memory epilogue
    (``smem_epilogue``: 128×256 f16 and float32 out, 256×128, persistent with 3 stages), the
    TMA-store epilogue; ``"register"``: the register epilogue — 128×256 (2 consumers × 64
    rows) both B layouts, 256×128 (2 consumers × 128 rows), the persistent variant, 128×256
    without setmaxnreg, bias + GELU; ``"cluster"``: clusters of two. Each kernel takes 2–6 s
    on one CPU core."""
    return [kernel_report(name, wgmma_ws_gemm_kernel(cfg, b_row, kind, *epi), cfg, kind)
            for name, cfg, b_row, kind, *epi in _report_kernels()[group]]


def kernel_report(name: str, kern, cfg: WsConfig, out_kind: str, order=None) -> dict:
    """The offline sm_90a report (:func:`tilepy.offline.compile_kernel`) of a kernel with this
    module's arguments, as a dict with the config and the synchronisation / memory
    instructions it uses (``ops``). ``order``: ``{key: instruction prefix}``, whose PTX line
    numbers the report adds — ``first`` (each key's first line, None where absent) and
    ``last`` (its last)."""
    from ..offline import compile_kernel

    types_ = argtypes(out_kind, getattr(kern, "split_scratch", False))
    if getattr(kern, "trace", False):
        types_ += (types.Array(types.uint64, 2, "C"),)
    rep = compile_kernel(f"gemm_{name}", kern.py_func, types_, (9, 0, "a"),
                         launch_bounds=(cfg.threads, 1))
    d = dict(rep.__dict__)
    d["config"] = cfg.describe()
    d["ops"] = sorted({ln.split()[0].rstrip(";") for ln in
                       (x.strip() for x in rep.ptx.splitlines())
                       if ln.startswith(("wgmma.", "mbarrier.", "cp.async.bulk", "setmaxnreg",
                                         "fence.", "bar.", "st.global", "ld.shared",
                                         "st.shared", "barrier.cluster", "mapa.",
                                         "stmatrix", "griddepcontrol.", "atom."))})
    d["timer_reads"] = rep.ptx.count("%globaltimer")   # a traced kernel's marks only
    # each wgmma's shape and types with its last four immediates (ss form: scale-a, scale-b,
    # trans-a, trans-b)
    d["wgmma_forms"] = sorted({ln.split()[0] + " " + ",".join(
        x.strip() for x in ln.rstrip(";").split(",")[-4:])
        for ln in (x.strip() for x in rep.ptx.splitlines()) if ln.startswith("wgmma.mma_async")})
    if order:
        lines = [ln.strip() for ln in d.pop("ptx").splitlines()]
        at = {k: [i for i, ln in enumerate(lines) if ln.startswith(v)] for k, v in order.items()}
        d["first"] = {k: (v[0] if v else None) for k, v in at.items()}
        d["last"] = {k: (v[-1] if v else None) for k, v in at.items()}
    else:
        d.pop("ptx")
    return d


def compile_reports_trace():
    """Offline reports of traced kernels (``trace=True``): the persistent TMA-store config and
    split-K's 64 × 256 one."""
    split = WsConfig(64, 256, 5, consumers=1, smem_epilogue=True, splits=3)
    return [kernel_report("ws_128x256_brow_persistent_tmastore_trace",
                          wgmma_ws_gemm_kernel(TMA_STORE, True, "float16", trace=True),
                          TMA_STORE, "float16"),
            kernel_report("ws_64x256_bcol_splitk3_trace",
                          wgmma_ws_gemm_kernel(split, False, "float16", trace=True), split,
                          "float16")]


def compile_reports_small():
    """Offline reports of the small-problem variants of split-K's 64 × 256 config: as a
    programmatic dependent launch (``pdl`` early and late), with the order of its first
    instructions of each kind in the PTX (``first``: the line numbers of the first
    ``griddepcontrol.*``, tensor-map fence, TMA load, global store and atomic; ``last``:
    their last, :func:`kernel_report`'s ``order``); and with its splits reduced in a
    cluster (``split_cluster``, 4 splits, 64 × 128 over 8 stages)."""
    split = WsConfig(64, 256, 5, consumers=1, smem_epilogue=True, splits=3)
    marks = {"wait": "griddepcontrol.wait", "trigger": "griddepcontrol.launch_dependents",
             "tensormap_fence": "fence.proxy.tensormap", "tma_load": "cp.async.bulk.tensor",
             "st_global": "st.global", "atom": "atom."}
    reps = [kernel_report(f"ws_64x256_bcol_splitk3_pdl_{pdl}",
                          wgmma_ws_gemm_kernel(split, False, "float16", pdl=pdl), split,
                          "float16", order=marks)
            for pdl in ("early", "late")]
    cl = WsConfig(64, 128, 8, consumers=1, smem_epilogue=True, splits=4, split_cluster=True)
    reps.append(kernel_report("ws_64x128_bcol_splitk4_cluster",
                              wgmma_ws_gemm_kernel(cl, False, "float16"), cl, "float16"))
    # the swapped operands of few rows (swap_ab): B's columns the wgmma's 64-row side — MN-major
    # from a row-major B — and 16 / 32 rows its n side, split-K; two consumers of 64 columns,
    # and one with a bias + GELU
    swap16 = WsConfig(128, 16, 6, "bfloat16", splits=4, swap_ab=True)   # (the op's rule)
    swap32 = WsConfig(64, 32, 8, "bfloat16", consumers=1, splits=2, swap_ab=True)
    for name, cfg, b_row, epi in (("ws_128x16_brow_swap_splitk4", swap16, True, ()),
                                  ("ws_64x32_bcol_swap_splitk2_bias_gelu", swap32, False,
                                   ("gelu", True))):
        reps.append(kernel_report(name, wgmma_ws_gemm_kernel(cfg, b_row, "bfloat16", *epi), cfg,
                                  "bfloat16"))
    # the tensor maps prefetched at entry (the op's default without pdl): the first
    # instructions' order
    reps.append(kernel_report(
        "ws_128x16_brow_swap_splitk4_prefetch",
        wgmma_ws_gemm_kernel(swap16, True, "bfloat16", prefetch_maps=True), swap16, "bfloat16",
        order={"prefetch": "prefetch.tensormap", "fence": "fence.proxy.tensormap",
               "mbarrier_init": "mbarrier.init", "tma_load": "cp.async.bulk.tensor"}))
    return reps


#: The ping-pong schedule's candidates (``WsConfig(pingpong=True)``): 64 × 256 a consumer
#: with the TMA-store epilogue (4 stages of 40 KB beside the two 16 KB stagings), and with the
#: register epilogue (5 stages: no staging); 128 × 128 a consumer (two m64 halves), the
#: register epilogue.
PINGPONG_TMA_STORE = WsConfig(64, 256, 4, persistent=True, smem_epilogue=True, tma_store=True,
                              pingpong=True)
PINGPONG_REGISTERS = WsConfig(64, 256, 5, persistent=True, pingpong=True)
PINGPONG_128 = WsConfig(128, 128, 6, persistent=True, pingpong=True)


def compile_reports_pingpong():
    """Offline sm_90a reports of the ping-pong candidates (row-major B, float16 out; the
    TMA-store one also column-major B and bias + GELU)."""
    kernels = (("ws_pp_64x256_brow_tmastore", PINGPONG_TMA_STORE, True, ()),
               ("ws_pp_64x256_bcol_tmastore_bias_gelu", PINGPONG_TMA_STORE, False,
                ("gelu", True)),
               ("ws_pp_64x256_brow_registers", PINGPONG_REGISTERS, True, ()),
               ("ws_pp_128x128_brow_registers", PINGPONG_128, True, ()))
    return [kernel_report(name, wgmma_ws_gemm_kernel(cfg, b_row, "float16", *epi), cfg,
                          "float16") for name, cfg, b_row, epi in kernels]


def compile_reports_epilogues():
    """:func:`compile_reports` of the epilogue group (a target for ``run_in_subprocess``)."""
    return compile_reports("epilogues")


def compile_reports_register():
    """:func:`compile_reports` of the register-epilogue group."""
    return compile_reports("register")


def compile_reports_cluster():
    """:func:`compile_reports` of the cluster group (clusters of two, B multicast)."""
    return compile_reports("cluster")
