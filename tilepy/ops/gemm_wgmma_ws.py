"""The warp-specialised Hopper GEMM kernel (sm_90a): TMA loads, mbarrier stages, wgmma consumers.

Same kernel contract as :mod:`tilepy.ops.gemm_wgmma` — ``kernel(a, b, out, c, bias, alpha, beta,
maps)`` on 3-D uint16 views (batch first, a batch of 1 broadcasts; ``b`` is the (Z, K, N) view of
a row-major B or the (Z, N, K) view of a column-major one), the epilogue of
:func:`tilepy.tile.epilogue.store_accumulators` — plus one argument: ``maps``, a 256-byte device
array holding the TMA tensor maps of A (bytes 0–127) and B (128–255), which :func:`plan` encodes
on the host from the operands' pointers, shapes and strides.

One block has ``1 + consumers`` warpgroups:

* **Producer** (warpgroup 0): lowers its register limit (``setmaxnreg.dec``, 40), and one thread
  walks the k steps: wait until stage ``s`` is free (its "empty" mbarrier, parity flipped each
  time round the ring), ``arrive.expect_tx`` the stage's bytes on its "full" mbarrier, issue the
  TMA loads of the A box (``block_m`` × 64, K-major) and the B boxes (row-major B: ``block_n /
  64`` boxes of 64 k × 64 n, MN-major; column-major B: one ``block_n`` × 64 box, K-major) into the
  stage, all 128-byte swizzled — the canonical layouts the wgmma descriptors read (the same
  layouts :mod:`tilepy.ops.gemm_wgmma` builds with cp.async). TMA zero-fills what lies outside
  the tensor, so M, N and K edges need no predication; only the epilogue's stores are
  predicated.
* **Consumers** (warpgroups 1 … consumers): raise their register limit (``setmaxnreg.inc``,
  232), each owns ``block_m / consumers`` rows (64: one ``m64n{block_n}k16`` per k16; 128: two)
  and all ``block_n`` columns. Per k step: wait on "full" with the stage's parity, four k16
  steps of wgmma, commit, ``wgmma.wait_group 1`` (the group of the *previous* step has retired,
  this one stays in flight), then lane 0 of each warp arrives on the previous stage's "empty"
  barrier (4 arrivals per consumer warpgroup: each warp's own wait covers its own reads).

There is no block barrier after the set-up: the two sides meet only at the mbarriers, so the
loads of up to ``stages`` steps ahead, the barrier waits and the tensor cores overlap.

Batches: an operand with one matrix (``shape[0] == 1``, broadcast) gets a 2-D tensor map (the
path proven on the H200); a batched one a 3-D map (batch outermost, box depth 1), chosen per
operand at run time in the producer. ``persistent=True`` launches ``min(SMs, tiles)`` blocks
that walk the (batch, tile) indices with a stride of the grid in the grouped order of
:mod:`tilepy.ops.gemm_wgmma`; the stage ring and its parities run on across tiles, so the
producer loads the next tile's first stages while the consumers run the epilogue. Without it
the grid is (tiles, batch) and each block computes one tile — the same code, one iteration.

Tensor maps hold the operand pointers: :class:`TmaLaunchPlan` (a :class:`tilepy.launch.
LaunchPlan`) re-encodes them when a bound plan is called with other pointers, keeping the last
:data:`MAP_CACHE` sets (a map is a pure function of pointer, shape and strides, and a plan's
shapes and strides are fixed, so a cached map is never stale). Map buffers come from the op's
allocation callback and are written by a kernel launch on the launch stream, so launches can
be captured into CUDA graphs (:mod:`tilepy.tile.device_write`).

The sm_90 default of :func:`tilepy.gemm` (``gemm.hopper_config``); GPU-tested and measured
on the H200 since session 3 (bench/NOTES.md, the GEMM tables of docs/performance.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from ..inline import inline_device
from ..launch import pointer, sm_count
from ..ptx import barrier as BAR
from ..ptx import cluster as CLU
from ..ptx import mbarrier as MB
from ..ptx import shared_addr
from ..ptx import tma as T
from ..ptx import vector as VEC
from ..ptx import wgmma as W
from ..ptx.asm import SIMULATOR
from ..ptx.math import ex2_approx, unpack_bf16x2_f32, unpack_f16x2_f32
from ..tile import device_write
from ..tile import tma as host_tma
from ..tile.config import SMEM_LIMIT
from ..tile.epilogue import (
    SWIZZLED_BOX_BYTES,
    _pair_io,
    stage_accumulators_swizzled,
    staged_bytes,
    store_accumulators,
    store_accumulators_smem,
    swizzled_pair_offset,
)
from ..tile.smem import allow_dynamic_shared
from ..tile.tma_plan import TmaLaunchPlan
from ..tune.kcache import cached_jit

BK = 64           # k elements per stage: one 128-byte swizzle row of 16-bit data
WARPGROUP = 128
GROUP_M = 8       # block rows walked together (L2 reuse of B panels)
SMS = 132         # H200; the persistent grid's default when the device is not asked
_MAP_B = np.uint64(128)
_MAP_OUT = np.uint64(256)  # softmax mode with tma_out: the output's map after A's and B's
_REG_FILE = 65536
TMA_PASS_COLUMNS = 128  # tma_store: columns staged per pass (two 64 × 64 boxes)
BAR_CONSUMERS = 1  # named barrier of all consumer threads (smem epilogue)
BAR_WG0 = 2        # named barrier of consumer warpgroup i: BAR_WG0 + i


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

    ``pingpong`` (with ``persistent`` and two consumers): each consumer warpgroup computes
    whole ``block_m`` × ``block_n`` tiles (64 or 128 rows), the two taking a block's tiles in
    turn. The producer loads the tiles' stages in order, so a consumer's next tile is loaded
    only as the other one's main loop ends: the main loops alternate, and each consumer's
    epilogue runs under the other one's MMAs (CUTLASS's "ping-pong" schedule) instead of
    stalling the tensor cores. The staging of ``smem_epilogue`` is a buffer per consumer.
    Correct on the H200 but not faster than the default there (128 × 128 tiles: 594–655
    TFLOPS against 611–704 at 4096³ / 8192³, ``2026-11-30_s5d_sweep_gemm_pingpong.json``), so
    opt-in.

    ``tma_store`` (with ``persistent``, ``smem_epilogue`` and two consumers of 64 rows; 16-bit
    outputs whose rows TMA can store): the staging is 128-byte swizzled (boxes of 64 rows ×
    64 columns, :func:`tilepy.tile.epilogue.stage_accumulators_swizzled`) and one thread per
    consumer stores it with TMA, which drains while the consumer's next main loop runs
    instead of every thread copying it out first. The staging holds 128 columns per consumer
    (16 KB), a wider tile goes in two passes, so 128 × 256 keeps 4 stages.

    ``cluster=2`` (not with ``pingpong``, nor the softmax mode): blocks run in clusters of two
    (:mod:`tilepy.ptx.cluster`) that compute the tiles of two neighbouring row blocks in the
    same columns, so they share B: each block's producer loads its own A box and half of the
    stage's B boxes, multicast into both blocks' shared memory, and a stage is free again only
    when the consumers of both blocks have released it (each consumer warp arrives on the
    stage's "empty" barrier in both blocks). Each SM then reads 32 KB per k-step from L2
    instead of 48 (128 × 256), as cuBLAS's Hopper kernels do with their 2-block clusters.
    ``block_n`` a multiple of 128. In the simulator the blocks of a cluster run at the same
    time (:mod:`tilepy.ptx._simcluster`).
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
    pingpong: bool = False
    tma_store: bool = False
    cluster: int = 1

    def __post_init__(self):
        def need(ok, what):
            if not ok:
                raise ValueError(f"WsConfig({self.block_m}, {self.block_n}, {self.stages}, "
                                 f"{self.dtype!r}, consumers={self.consumers}): {what}")

        need(self.dtype in ("float16", "bfloat16"), "dtype must be float16 or bfloat16")
        need(self.cluster in (1, 2), "cluster must be 1 or 2")
        need(self.cluster == 1 or not self.pingpong, "cluster=2 does not take pingpong")
        need(self.block_n % (64 * self.cluster) == 0, f"cluster={self.cluster}: block_n must "
             f"be a multiple of {64 * self.cluster} (each block loads an equal share of B's "
             "64-column boxes)")
        need(self.consumers in (1, 2), "consumers must be 1 or 2")
        if self.pingpong:
            need(self.consumers == 2 and self.persistent,
                 "pingpong needs persistent=True and two consumer warpgroups")
            need(self.block_m in (64, 128), "pingpong: block_m (rows of a consumer's own "
                 "tile) must be 64 or 128")
        need(self.block_m in (64, 128, 256) and self.block_m % self.consumers == 0
             and self.block_m // self.consumers in (64, 128) or self.pingpong,
             "block_m / consumers (rows per consumer warpgroup) must be 64 or 128")
        need(self.block_n in (64, 128, 192, 256), "block_n must be 64, 128, 192 or 256")
        need(self.rows_per_consumer // 64 * self.block_n <= 256,
             "a consumer's accumulators exceed 128 registers per thread (rows per consumer "
             "× block_n must be at most 64 × 256)")
        need(isinstance(self.stages, int) and self.stages >= 2, "stages must be >= 2")
        limit = SMEM_LIMIT[(9, 0)]
        need(self.smem_bytes <= limit, f"{self.smem_bytes} B of shared memory exceeds the "
             f"{limit} B of sm_90 by {self.smem_bytes - limit} B"
             + (f" (the persistent smem epilogue needs its own {self.epilogue_bytes} B "
                "staging buffer beside the stages: use fewer stages)"
                if self.smem_epilogue and self.persistent else ""))
        if self.tma_store:
            need(self.persistent and self.smem_epilogue and not self.pingpong
                 and self.consumers == 2 and self.rows_per_consumer == 64,
                 "tma_store needs persistent=True, smem_epilogue=True and two consumers of 64 "
                 "rows (no ping-pong)")
        if self.smem_epilogue and not self.persistent:
            need(self.epilogue_bytes <= self.stages * self.stage_bytes,
                 f"the smem epilogue's {self.epilogue_bytes} B of staging do not fit in the "
                 f"{self.stages * self.stage_bytes} B of stage buffers it reuses")
        if self.producer_regs or self.consumer_regs:
            for r in (self.producer_regs, self.consumer_regs):
                need(24 <= r <= 256 and r % 8 == 0,
                     "setmaxnreg limits must be multiples of 8 in 24 … 256")
            need(WARPGROUP * (self.producer_regs + self.consumers * self.consumer_regs)
                 <= _REG_FILE, "producer_regs + consumers × consumer_regs exceed the "
                 "65536-register file (per 128 threads)")

    @property
    def rows_per_consumer(self) -> int:
        return self.block_m if self.pingpong else self.block_m // self.consumers

    @property
    def threads(self) -> int:
        return WARPGROUP * (1 + self.consumers)

    @property
    def stage_bytes(self) -> int:
        return (self.block_m + self.block_n) * BK * 2

    @property
    def barrier_bytes(self) -> int:
        # a "full" and an "empty" mbarrier per stage; ping-pong: the consumers' turn barrier
        return 16 * self.stages + (8 if self.pingpong else 0)

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
    def epilogue_offset(self) -> int:
        """Byte offset of the staging: the stage buffers themselves (reused) without
        ``persistent``, else a buffer after them."""
        return self.stages * self.stage_bytes if self.persistent else 0

    @property
    def barrier_offset(self) -> int:
        """Byte offset of the mbarriers: after the stages (and a persistent staging buffer)."""
        return self.stages * self.stage_bytes + (self.epilogue_bytes if self.persistent else 0)

    @property
    def bias_in_smem(self) -> bool:
        """Whether a kernel with a bias has the consumers put their tile's bias columns in
        shared memory as the tile starts (the loads' latency hidden by the pipeline filling
        up) instead of reading them from global memory in the epilogue: the smem epilogue of
        a non-persistent grid, whose barrier of all consumers before the epilogue publishes
        them."""
        return self.smem_epilogue and not self.persistent

    @property
    def bias_offset(self) -> int:
        """Byte offset of the bias columns (:attr:`bias_in_smem`): after the mbarriers,
        16-byte aligned."""
        return -(-(self.barrier_offset + self.barrier_bytes) // 16) * 16

    @property
    def smem_bytes(self) -> int:
        if self.bias_in_smem:
            return self.bias_offset + 4 * self.block_n
        return self.barrier_offset + self.barrier_bytes

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
                + (", ping-pong" if self.pingpong else "")
                + (", TMA-store epilogue" if self.tma_store else "")
                + (f", clusters of {self.cluster} (B multicast)" if self.cluster > 1 else "")
                + (f", smem epilogue ({self.epilogue_bytes // 1024} KB"
                   + (" own buffer)" if self.persistent else " in the stages)")
                   if self.smem_epilogue else ""))


def _jit(cfg: WsConfig):
    if SIMULATOR:
        return cuda.jit
    return cached_jit(launch_bounds=(cfg.threads, 1))


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


def _check_softmax(cfg: WsConfig, out_kind, activation, has_bias, has_c):
    if not (cfg.persistent and cfg.smem_epilogue and not cfg.pingpong and cfg.consumers == 2
            and cfg.rows_per_consumer == 64 and not cfg.tma_store):
        raise ValueError("softmax mode needs WsConfig(128, block_n, persistent=True, "
                         f"smem_epilogue=True) with two consumers of 64 rows, got {cfg}")
    if out_kind not in ("float16", "bfloat16") or activation or has_bias or has_c:
        raise ValueError("softmax mode: 16-bit output, no activation, bias or c")
    if cfg.smem_bytes + softmax_stats_bytes(cfg) > SMEM_LIMIT[(9, 0)]:
        raise ValueError(f"softmax mode: {cfg.smem_bytes} + {softmax_stats_bytes(cfg)} B of "
                         "shared memory do not fit; use fewer stages")


@functools.cache
def wgmma_ws_gemm_kernel(cfg: WsConfig, b_row_major: bool, out_kind: str, activation=None,
                         has_bias: bool = False, has_c: bool = False, softmax: bool = False,
                         tma_out: bool = False, overlap: bool = False, probe: int = 0):
    """The kernel ``kernel(a, b, out, c, bias, alpha, beta, maps)`` (see the module docstring);
    launch it through :func:`plan`.

    ``softmax=True``: ``out = softmax(alpha · a @ b, axis=-1)`` instead (one matrix, no batch;
    ``c``, ``bias`` and ``beta`` unused). A block owns 128 rows and walks their N in chunks of
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
    ``bench/probe_gemm_softmax.py`` (H200, 16384 × 1024 × 1024): without ``tma_out`` the
    parked stores cost 14 µs and the rescale 22 µs of 88; with it 5 and 13 of 80.

    ``overlap`` (softmax mode with ``tma_out``; block_n 128, at least 3 stages, and K of at
    least ``stages − 1`` k-steps, which :func:`plan` checks): each
    consumer keeps two accumulators and, FlashAttention-3 style, issues the first
    ``stages − 1`` k-steps of chunk j + 1 into one before it runs chunk j's softmax and park
    on the other, so the tensor cores work through the epilogue instead of waiting for it;
    the rest of chunk j + 1 follows as usual.

    ``probe`` (softmax mode, for measuring only: the results are wrong): a bit mask of pieces
    left out — 1 the online softmax of each chunk (the scaled scores are parked as they are),
    2 the final rescale, 4 each chunk's parked store (``bench/probe_gemm_softmax.py``).
    """
    if (probe or tma_out) and not softmax:
        raise ValueError("probe and tma_out: softmax mode only")
    if overlap and not (tma_out and cfg.block_n == 128 and cfg.stages >= 3):
        raise ValueError("overlap: softmax mode with tma_out, block_n 128 and >= 3 stages")
    if softmax:
        _check_softmax(cfg, out_kind, activation, has_bias, has_c)
        if cfg.cluster > 1:
            raise ValueError("the softmax mode does not take cluster=2")
    BM, BN, ST, NC = cfg.block_m, cfg.block_n, cfg.stages, cfg.consumers
    CL = cfg.cluster               # blocks per cluster: rows BM·(CL·i + rank) of one column block
    CL_MASK = (1 << CL) - 1        # multicast to every block of the cluster
    CM = cfg.rows_per_consumer
    MW = CM // 64                  # m64 wgmmas per k16 step per consumer
    NACC = BN // 2
    NACC1 = NACC if MW == 2 else 1
    NI = BN // 8
    NJ = BN // 64
    A_BYTES = BM * BK * 2
    STAGE_BYTES = cfg.stage_bytes
    BAR0 = cfg.barrier_offset // 2  # uint16 index of the first mbarrier (after the stages)
    PP = cfg.pingpong
    # lane 0 of every warp of the stage's consumers frees it (ping-pong: one warpgroup's);
    # with a cluster, the consumers of every block of it (the stage holds B from all of them)
    ARRIVALS = 4 * (1 if PP else NC) * CL
    NJ_CL = NJ // CL               # row-major B: the 64-column boxes each block of a cluster loads
    B_CL = BN * BK * 2 // CL       # column-major B: bytes of each block's share of the rows
    GROUP = max(1, GROUP_M // CL)  # cluster row blocks walked together: GROUP_M · BM rows
    ROW_OFF = 0 if PP else CM      # a consumer's first row in the tile
    TURN = 2 * ST                  # ping-pong: its phase j completes when the main loop of
    #                                the block's tile j has passed its last "full" wait
    SETREG = cfg.setmaxnreg
    PREG, CREG = cfg.producer_regs, cfg.consumer_regs
    ab = "f16" if cfg.dtype == "float16" else "bf16"
    mma = W.wgmma(BN, ab, trans_b=b_row_major)
    LBO_B, SBO_B, STEP_B = (8192, 1024, 2048) if b_row_major else (16, 1024, 32)
    store = store_accumulators(1, NI, out_kind, activation, has_bias, has_c)
    EPI = cfg.smem_epilogue
    EPI_SHARED = EPI and not cfg.persistent   # staging in the stage buffers
    EPI_OFF = cfg.epilogue_offset
    EPI_WG = cfg.epilogue_bytes // NC         # staging bytes per consumer warpgroup
    CONSUMERS = NC * WARPGROUP
    BIAS_SMEM = has_bias and cfg.bias_in_smem
    BIAS_OFF = cfg.bias_offset
    store_smem = store_accumulators_smem(MW, NI, out_kind, activation, has_bias, has_c,
                                         bias_in_smem=BIAS_SMEM)
    align = None if SIMULATOR else 1024
    f32 = types.float32
    SOFTMAX = softmax
    PROBE = probe
    TMA_OUT = tma_out
    OVERLAP = overlap
    PRE = cfg.stages - 1                # overlap: k-steps of the next chunk issued ahead
    STATS_OFF = cfg.smem_bytes          # softmax mode: see softmax_stats_bytes
    FINAL_OFF = STATS_OFF + NC * _STATS_WG
    RED_OFF = FINAL_OFF + NC * _FINAL_WG
    FBAR_OFF = RED_OFF + NC * _RED_WG
    NB = BN // 64                       # TMA stores: boxes of 64 rows × 64 columns per tile
    CT = 64 * BN * 2                    # TMA stores: bytes of a warpgroup's 64-row tile
    TMA_EPI = cfg.tma_store and not softmax
    if tma_out and (EPI_OFF % 1024 or EPI_WG % 1024 or EPI_WG < CT
                    or 2 * NC * CT > ST * STAGE_BYTES):
        raise ValueError(f"tma_out: {cfg} leaves no room for the swizzled staging and the "
                         "rescale's buffers")
    PASS_NI = min(NI, TMA_PASS_COLUMNS // 8)      # tma_store: n8 blocks per staging pass
    if TMA_EPI:
        if out_kind not in ("float16", "bfloat16") or BN % 64:
            raise ValueError(f"tma_store: 16-bit outputs and whole 64-column boxes, got "
                             f"{out_kind} and block_n {BN}")
        if EPI_OFF % 1024 or EPI_WG % 1024 or EPI_WG < 64 * PASS_NI * 16:
            raise ValueError(f"tma_store: {cfg} leaves no 1024-byte-aligned swizzled staging")
        stage_tma0 = stage_accumulators_swizzled(NI, out_kind, activation, has_bias, has_c,
                                                 0, PASS_NI)
        stage_tma1 = stage_accumulators_swizzled(NI, out_kind, activation, has_bias, has_c,
                                                 PASS_NI) if NI > PASS_NI else stage_tma0
    else:
        @inline_device
        def stage_tma0(acc, stage, row0, col0, m, n, alpha, bias, c_in, beta, thread):
            """(no TMA-store epilogue in this kernel)"""
        stage_tma1 = stage_tma0

    @inline_device
    def tma_store_pass(acc, stg, omap, z, row0, col0, m, n, alpha, bias, c_in, beta, tw, cw,
                       part, batched):
        """tma_store: one staging pass of a consumer's tile — columns ``col0 + 128·part …`` —
        swizzled into ``stg`` and stored by thread 0 with TMA (2-D map, or 3-D ``batched``)."""
        if tw == 0:
            T.bulk_wait_group_read(0)   # the previous pass's store has read stg
        BAR.bar_sync(BAR_WG0 + cw, WARPGROUP)
        if part == 0:
            stage_tma0(acc, stg, row0, col0, m, n, alpha, bias, c_in, beta, tw)
        else:
            stage_tma1(acc, stg, row0, col0, m, n, alpha, bias, c_in, beta, tw)
        W.fence_proxy_async_shared()
        BAR.bar_sync(BAR_WG0 + cw, WARPGROUP)
        if tw == 0:
            for bx in range(PASS_NI // 8):
                x = col0 + 8 * PASS_NI * part + 64 * bx
                if x < n and 8 * PASS_NI * part + 64 * bx < BN:
                    if batched:
                        T.tma_store_3d(omap, stg + bx * SWIZZLED_BOX_BYTES, x, row0, z)
                    else:
                        T.tma_store_2d(omap, stg + bx * SWIZZLED_BOX_BYTES, x, row0)
            T.bulk_commit_group()
    get_pair, put_pair, pack2 = _pair_io(out_kind)
    unpack2 = unpack_bf16x2_f32 if out_kind == "bfloat16" else unpack_f16x2_f32
    NEG_INF = np.float32(-np.inf)
    LOG2E = np.float32(1.4426950408889634)
    PARK = np.float32(SOFTMAX_PARK)
    UNPARK = np.float32(1.0 / SOFTMAX_PARK)

    if BIAS_SMEM:
        @inline_device
        def epilogue_bias(base, bias):
            """What the staged epilogue reads the bias from: its columns in shared memory."""
            return base + BIAS_OFF
    else:
        @inline_device
        def epilogue_bias(base, bias):
            return bias

    @inline_device
    def tile_origin(w, tiles_m, tiles_n):
        """(batch, first row, first column) of work item w, grouped order within a batch
        (softmax mode: the chunks of a block's rows, in order). With clusters, ``tiles_m``
        counts blocks of CL·BM rows, a work item is a cluster's, and the block of rank r
        (blockIdx.x mod CL: clusters are CL blocks along x) takes its rows BM·r …"""
        if SOFTMAX:
            return 0, (w // tiles_n) * BM, (w % tiles_n) * BN
        tiles = tiles_m * tiles_n
        z = w // tiles
        pid = w - z * tiles
        width = GROUP * tiles_n
        first = (pid // width) * GROUP
        rows = min(tiles_m - first, GROUP)
        tm = first + (pid % width) % rows
        tn = (pid % width) // rows
        if CL == 1:
            return z, tm * BM, tn * BN
        return z, (tm * CL + cuda.blockIdx.x % CL) * BM, tn * BN

    @inline_device
    def release(bar, lane):
        """Lane 0 of a consumer warp frees a stage: arrives on its "empty" barrier — with a
        cluster, lane r on the barrier of the cluster's block r (the stage's B came from all
        of them, so each producer waits for every block's consumers)."""
        if CL == 1:
            if lane == 0:
                MB.mbarrier_arrive(bar)
        elif lane < CL:
            CLU.mbarrier_arrive_cluster(CLU.mapa_shared(bar, lane))

    @inline_device
    def produce(smem, base, maps, za, zb, m_tiles, n_tiles, total, ktiles, w0, step):
        bars = shared_addr(smem, BAR0)
        ta = T.tensor_map_address(maps)
        tb = ta + _MAP_B
        T.fence_proxy_tensormap_acquire(ta)
        T.fence_proxy_tensormap_acquire(tb)
        rank = int(CLU.cluster_ctarank()) if CL > 1 else 0
        s = 0
        ph = 0
        for w in range(w0, total, step):
            z, bm0, bn0 = tile_origin(w, m_tiles, n_tiles)
            z_a = min(z, za - 1)
            z_b = min(z, zb - 1)
            for kt in range(ktiles):
                full = bars + 8 * s
                MB.mbarrier_wait_parity(bars + 8 * (ST + s), ph ^ 1)
                MB.mbarrier_arrive_expect_tx(full, STAGE_BYTES)
                stage = base + s * STAGE_BYTES
                k0 = kt * BK
                if za == 1:
                    T.tma_load_2d(stage, ta, full, k0, bm0)
                else:
                    T.tma_load_3d(stage, ta, full, k0, bm0, z_a)
                if CL > 1:
                    # this block's share of B, into every block of the cluster
                    if b_row_major:
                        for jj in range(NJ_CL):
                            j = rank * NJ_CL + jj
                            if zb == 1:
                                CLU.tma_load_2d_multicast(stage + A_BYTES + j * 8192, tb, full,
                                                          bn0 + j * 64, k0, CL_MASK)
                            else:
                                CLU.tma_load_3d_multicast(stage + A_BYTES + j * 8192, tb, full,
                                                          bn0 + j * 64, k0, z_b, CL_MASK)
                    elif zb == 1:
                        CLU.tma_load_2d_multicast(stage + A_BYTES + rank * B_CL, tb, full, k0,
                                                  bn0 + rank * (BN // CL), CL_MASK)
                    else:
                        CLU.tma_load_3d_multicast(stage + A_BYTES + rank * B_CL, tb, full, k0,
                                                  bn0 + rank * (BN // CL), z_b, CL_MASK)
                elif b_row_major:
                    for j in range(NJ):
                        if zb == 1:
                            T.tma_load_2d(stage + A_BYTES + j * 8192, tb, full, bn0 + j * 64, k0)
                        else:
                            T.tma_load_3d(stage + A_BYTES + j * 8192, tb, full, bn0 + j * 64,
                                          k0, z_b)
                else:
                    if zb == 1:
                        T.tma_load_2d(stage + A_BYTES, tb, full, k0, bn0)
                    else:
                        T.tma_load_3d(stage + A_BYTES, tb, full, k0, bn0, z_b)
                s += 1
                if s == ST:
                    s = 0
                    ph ^= 1

    @inline_device
    def consume(smem, base, a, b, out, c, bias, alpha, beta, cw, m_tiles, n_tiles, total,
                ktiles, w0, step, maps):
        m = a.shape[1]
        n = b.shape[2] if b_row_major else b.shape[1]
        bars = shared_addr(smem, BAR0)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = (tid % WARPGROUP) // 32
        acc0 = cuda.local.array(NACC, f32)
        acc1 = cuda.local.array(NACC1, f32)
        acc3 = cuda.local.array((1, NI, 4), f32)
        rmax = cuda.local.array((1, 2), f32)
        rsum = cuda.local.array((1, 2), f32)
        if SOFTMAX:
            for h in range(2):
                rmax[0, h] = NEG_INF
                rsum[0, h] = f32(0)
        omap = T.tensor_map_address(maps) + _MAP_OUT
        keep = T.l2_evict_last_policy() if TMA_OUT else np.uint64(0)
        drop = T.l2_evict_first_policy() if TMA_OUT else np.uint64(0)
        if (TMA_OUT or TMA_EPI) and tid % WARPGROUP == 0:
            T.fence_proxy_tensormap_acquire(omap)
        s = 0
        ph = 0
        first = w0 + cw * step if PP else w0
        stride = 2 * step if PP else step
        for w in range(first, total, stride):
            z, bm0, bn0 = tile_origin(w, m_tiles, n_tiles)
            if PP:
                # the stages of the block's earlier tiles, the other consumer's included
                j = (w - w0) // step
                done = j * ktiles
                s = done % ST
                ph = (done // ST) % 2
                # Wait until the other consumer has passed every "full" wait of tile j − 1:
                # a parity wait cannot tell round r of a stage from round r − 2, so a stage
                # may be waited on only once its previous round is complete. This also makes
                # the two main loops take turns (each epilogue runs under the other's MMAs).
                if j > 0:
                    MB.mbarrier_wait_parity(bars + 8 * TURN, (j - 1) % 2)
            for i in range(NACC):
                acc0[i] = f32(0)
            if MW == 2:
                for i in range(NACC1):
                    acc1[i] = f32(0)
            if BIAS_SMEM:
                # the tile's bias columns (zeros past n) for the epilogue, published by its
                # barrier of all consumers
                for i in range(2 * (tid - WARPGROUP), BN, 2 * CONSUMERS):
                    col = bn0 + i
                    b0 = bias[col] if col < n else f32(0)
                    b1 = bias[col + 1] if col + 1 < n else f32(0)
                    VEC.st_shared_v2_f32(base + BIAS_OFF + 4 * i, b0, b1)
            prev = 0
            for kt in range(ktiles):
                MB.mbarrier_wait_parity(bars + 8 * s, ph)
                stage = base + s * STAGE_BYTES
                da = W.matrix_descriptor(stage + cw * (ROW_OFF * 128), 16, 1024, 128)
                db = W.matrix_descriptor(stage + A_BYTES, LBO_B, SBO_B, 128)
                W.wgmma_fence()
                for kk in range(BK // 16):
                    dbk = W.descriptor_advance(db, kk * STEP_B)
                    mma(acc0, W.descriptor_advance(da, kk * 32), dbk, 1)
                    if MW == 2:
                        mma(acc1, W.descriptor_advance(da, 64 * 128 + kk * 32), dbk, 1)
                W.wgmma_commit_group()
                W.wgmma_wait_group(1)
                if kt > 0:
                    release(bars + 8 * (ST + prev), lane)
                prev = s
                s += 1
                if s == ST:
                    s = 0
                    ph ^= 1
            if PP and lane == 0:
                MB.mbarrier_arrive(bars + 8 * TURN)   # every warp is past its last wait
            W.wgmma_wait_group(0)
            W.wgmma_fence_operand(acc0, NACC)
            if MW == 2:
                W.wgmma_fence_operand(acc1, NACC1)
            release(bars + 8 * (ST + prev), lane)

            o = out[z]
            cz = c[min(z, c.shape[0] - 1)]
            if TMA_OUT and w - w0 == n_tiles - 1:
                # after the last main loop the stage buffers are free: the rescale's first
                # loads run under this chunk's softmax
                prefetch_finish(base, omap, bm0 + cw * ROW_OFF, n,
                                0 if PROBE & 2 else n_tiles - 1, cw, drop)
            if SOFTMAX:
                scores_softmax(acc0, bn0, n, alpha, rmax, rsum, base, warp, lane, cw)
                if TMA_OUT:
                    park_tma_chunk(acc0, base, omap, bm0 + cw * ROW_OFF, w - w0, n_tiles, n,
                                   cw, warp, lane, rmax, rsum, keep, drop)
                    continue
                for jj in range(NI):
                    for q in range(4):
                        acc0[4 * jj + q] *= PARK
                if PROBE & 4:
                    continue
                store_smem(acc0, acc1, base + EPI_OFF + cw * EPI_WG, o, bm0 + cw * ROW_OFF,
                           bn0, m, n, f32(1), bias, cz, f32(0), tid % WARPGROUP, BAR_WG0 + cw)
                if lane % 4 == 0:   # the rows' running max after this chunk
                    VEC.st_shared_v2_f32(base + STATS_OFF + cw * _STATS_WG
                                         + (((w - w0) * 4 + warp) * 8 + lane // 4) * 8,
                                         rmax[0, 0], rmax[0, 1])
                continue
            if TMA_EPI:
                tw = tid % WARPGROUP
                stg = base + EPI_OFF + cw * EPI_WG
                row0 = bm0 + cw * ROW_OFF
                batched = out.shape[0] != 1
                tma_store_pass(acc0, stg, omap, z, row0, bn0, m, n, alpha, bias, cz, beta, tw,
                               cw, 0, batched)
                if NI > PASS_NI:
                    tma_store_pass(acc0, stg, omap, z, row0, bn0, m, n, alpha, bias, cz, beta,
                                   tw, cw, 1, batched)
                continue
            if EPI:
                if EPI_SHARED:
                    # every consumer's wgmmas have read their stages before any is overwritten
                    BAR.bar_sync(BAR_CONSUMERS, CONSUMERS)
                store_smem(acc0, acc1, base + EPI_OFF + cw * EPI_WG, o, bm0 + cw * ROW_OFF, bn0,
                           m, n, alpha, epilogue_bias(base, bias), cz, beta, tid % WARPGROUP,
                           BAR_WG0 + cw)
                continue
            row0 = bm0 + cw * ROW_OFF + warp * 16
            for j in range(NI):
                for q in range(4):
                    acc3[0, j, q] = acc0[4 * j + q]
            store(acc3, o, row0, bn0, m, n, alpha, bias, cz, beta, lane)
            if MW == 2:
                for j in range(NI):
                    for q in range(4):
                        acc3[0, j, q] = acc1[4 * j + q]
                store(acc3, o, row0 + 64, bn0, m, n, alpha, bias, cz, beta, lane)
        if TMA_EPI and tid % WARPGROUP == 0:
            T.bulk_wait_group_read(0)   # no store still reads shared memory at exit
        if TMA_OUT:
            finish_tma(base, omap, w0 // n_tiles * BM + cw * ROW_OFF, n,
                       0 if PROBE & 2 else n_tiles - 1, cw, drop)
        elif SOFTMAX and not PROBE & 2:
            finish_softmax(base, out[0], m, n, w0, cw, warp, lane, rmax, rsum)

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
        if PROBE & 4:
            return
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

    # ---- overlap: two accumulators, the next chunk's first k-steps under this chunk's epilogue

    @inline_device
    def issue_kstep(acc, base, bars, s, ph, cw, first):
        """Wait for stage s (parity ph) and issue its k-step's wgmmas into acc, one group;
        ``first``: the chunk's first k-step, whose first wgmma ignores acc (scale-d 0) — no
        instruction but a wgmma may write an accumulator while others are in flight, or
        ptxas serialises every wgmma of the kernel (C7515)."""
        MB.mbarrier_wait_parity(bars + 8 * s, ph)
        stage = base + s * STAGE_BYTES
        da = W.matrix_descriptor(stage + cw * (ROW_OFF * 128), 16, 1024, 128)
        db = W.matrix_descriptor(stage + A_BYTES, LBO_B, SBO_B, 128)
        W.wgmma_fence()
        for kk in range(BK // 16):
            mma(acc, W.descriptor_advance(da, kk * 32), W.descriptor_advance(db, kk * STEP_B),
                0 if first and kk == 0 else 1)
        W.wgmma_commit_group()
        s += 1
        if s == ST:
            s = 0
            ph ^= 1
        return s, ph

    @inline_device
    def release_stages(bars, r, pending, keep_n, lane):
        """Free the oldest issued stages (in order, from r) until keep_n stay pending."""
        while pending > keep_n:
            if lane == 0:
                MB.mbarrier_arrive(bars + 8 * (ST + r))
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
        prefetch_finish(base, omap, row0, n, 0 if PROBE & 2 else n_tiles - 1, cw, drop)
        scores_softmax(cur, j * BN, n, alpha, rmax, rsum, base, warp, lane, cw)
        park_tma_chunk(cur, base, omap, row0, j, n_tiles, n, cw, warp, lane, rmax, rsum, keep,
                       drop)

    @inline_device
    def consume_overlap(smem, base, a, b, out, alpha, cw, n_tiles, ktiles, w0, maps):
        """The softmax mode's consumer with ``overlap``: chunks alternate between two
        accumulators (overlap_step), then the rescale (finish_tma)."""
        n = b.shape[2] if b_row_major else b.shape[1]
        bars = shared_addr(smem, BAR0)
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
        omap = T.tensor_map_address(maps) + _MAP_OUT
        keep = T.l2_evict_last_policy()
        drop = T.l2_evict_first_policy()
        if tid % WARPGROUP == 0:
            T.fence_proxy_tensormap_acquire(omap)
        row0 = w0 // n_tiles * BM + cw * ROW_OFF
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
        finish_tma(base, omap, row0, n, 0 if PROBE & 2 else n_tiles - 1, cw, drop)

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
        if not PROBE & 1:
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

    @_jit(cfg)
    def kernel(a, b, out, c, bias, alpha, beta, maps):
        m = a.shape[1]
        kdim = a.shape[2]
        n = b.shape[2] if b_row_major else b.shape[1]
        m_tiles = (m + BM * CL - 1) // (BM * CL)   # (blocks of a cluster's rows)
        n_tiles = (n + BN - 1) // BN
        total = m_tiles * n_tiles * out.shape[0]
        ktiles = (kdim + BK - 1) // BK
        if CL > 1:   # work items are the clusters'
            w0 = cuda.blockIdx.x // CL + cuda.blockIdx.y * (cuda.gridDim.x // CL)
            step = (cuda.gridDim.x // CL) * cuda.gridDim.y
        else:
            w0 = cuda.blockIdx.x + cuda.blockIdx.y * cuda.gridDim.x
            step = cuda.gridDim.x * cuda.gridDim.y
        if SOFTMAX:   # block x: the chunks w0 … w0 + n_tiles - 1 of rows 128·x …
            w0 = cuda.blockIdx.x * n_tiles
            step = 1
            total = w0 + n_tiles

        smem = cuda.shared.array(0, types.uint16, alignment=align) if align else \
            cuda.shared.array(0, types.uint16)
        base = shared_addr(smem, 0)
        tid = cuda.threadIdx.x
        wg = tid // WARPGROUP
        if tid == 0:
            bars = shared_addr(smem, BAR0)
            for s in range(ST):
                MB.mbarrier_init(bars + 8 * s, 1)                 # full: the producer's expect_tx
                MB.mbarrier_init(bars + 8 * (ST + s), ARRIVALS)   # empty: every consumer warp
            if PP:
                MB.mbarrier_init(bars + 8 * TURN, 4)              # a consumer's four warps
            if TMA_OUT:
                for i in range(3 * NC):                           # the rescale's loads
                    MB.mbarrier_init(base + FBAR_OFF + 8 * i, 1)
            MB.fence_mbarrier_init()
        if CL > 1:   # every block's barriers exist before any block signals them
            CLU.cluster_arrive()
            CLU.cluster_wait()
        else:
            cuda.syncthreads()
        if wg == 0:
            if SETREG:
                W.setmaxnreg_dec(PREG)
            if tid == 0:
                produce(smem, base, maps, a.shape[0], b.shape[0], m_tiles, n_tiles, total,
                        ktiles, w0, step)
        else:
            if SETREG:
                W.setmaxnreg_inc(CREG)
            if OVERLAP:
                consume_overlap(smem, base, a, b, out, alpha, wg - 1, n_tiles, ktiles, w0, maps)
            else:
                consume(smem, base, a, b, out, c, bias, alpha, beta, wg - 1, m_tiles, n_tiles,
                        total, ktiles, w0, step, maps)
        if CL > 1:
            # no block leaves while another of its cluster may still arrive on its barriers
            CLU.cluster_arrive()
            CLU.cluster_wait()

    kernel.config = cfg
    kernel.b_row_major = b_row_major
    kernel.softmax = softmax
    kernel.tma_out = tma_out or TMA_EPI   # the maps end with the output's
    kernel.overlap = overlap
    return kernel


# ---- host side: tensor maps, grid, launch plans ------------------------------------------------

def _map_layout(view, box_rows: int):
    """(shape, byte strides, box) of the tensor map of a 3-D uint16 kernel view: 2-D when the
    view holds one matrix, else 3-D with the batch outermost. Strides of length-1 dimensions
    are free; they are set to what the encoder accepts."""
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
    with the ``_map_layout`` layouts (shape, strides, box)."""
    dt = cfg.dtype
    ma = host_tma.encode_tiled(a_ptr, dt, *a_layout, swizzle=128)
    mb = host_tma.encode_tiled(b_ptr, dt, *b_layout, swizzle=128)
    return np.concatenate([ma.data, mb.data])


def layouts(cfg: WsConfig, b_row_major: bool, a, b):
    """The (shape, strides, box) of the A and B tensor maps of 3-D kernel views ``a``, ``b``;
    raises ValueError for operands TMA cannot describe (the op then has to copy them)."""
    a_layout = _map_layout(a, cfg.block_m)
    # row-major B: boxes of 64 k rows × 64 n (MN-major atoms); column-major: block_n × 64 k
    # (with a cluster, each block loads its share of the block_n rows)
    b_layout = _map_layout(b, BK if b_row_major else cfg.block_n // cfg.cluster)
    for name, (shape, strides, _) in (("a", a_layout), ("b", b_layout)):
        for s in strides[:-1]:
            if s % 16 or s <= 0:
                raise ValueError(f"{name}: byte strides {strides} are not multiples of 16; TMA "
                                 "needs 16-byte-aligned rows (and batches)")
    return a_layout, b_layout


def out_layout(out):
    """(shape, strides, box) of the tensor map of a 3-D uint16 output view that TMA stores go
    through (the softmax mode's ``tma_out``, :attr:`WsConfig.tma_store`; boxes of 64 rows × 64
    columns); ValueError if TMA cannot describe it."""
    if out.dtype.itemsize != 2:
        raise ValueError(f"out: TMA stores take 16-bit outputs, got {out.dtype}")
    shape, strides, box = _map_layout(out, 64)
    if any(s % 16 or s <= 0 for s in strides[:-1]) or pointer(out) % 16:
        raise ValueError(f"out: 16-byte-aligned rows (and batches) and start needed for TMA "
                         f"stores, got byte strides {strides}")
    return shape, strides, box


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
    """The launch grid: a block per tile (x) and batch (y), or a persistent grid of ``sms``
    blocks (at most one per tile). With clusters, x counts whole clusters' blocks, and a
    persistent grid is at most ``clusters`` clusters (those the device runs at once)."""
    cl = cfg.cluster
    tiles = -(-m // (cfg.block_m * cl)) * -(-n // cfg.block_n)   # per cluster
    if not cfg.persistent:
        return (tiles * cl, batch)
    n_cl = min((sms or SMS) // cl, tiles * batch)
    if clusters is not None:
        n_cl = min(n_cl, clusters)
    return (max(1, n_cl) * cl, 1)


def plan(kernel, cfg: WsConfig, a, b, out, c, bias, alpha=1.0, beta=0.0, *,
         sms: int | None = None, stream=0, alloc=None):
    """``(launch plan, arguments)`` for 3-D operands (see :func:`wgmma_ws_gemm_kernel`), the
    same call as :func:`tilepy.ops.gemm_wgmma.plan`.

    The arguments end with the tensor maps of ``a`` and ``b`` (and ``out`` where TMA stores
    it): encoded here, for the B layout the kernel was generated for, into a buffer from
    ``alloc(nbytes) -> (owner, pointer)`` (default a Numba device array; ops pass
    :func:`tilepy.arrays.byte_allocator`), and written by the plan's first launch on its
    stream (:class:`TmaLaunchPlan`, which also makes the maps of other pointers) — so building
    a plan neither waits for the GPU nor copies from host memory, and may run during a
    CUDA-graph capture. ``sms``: the persistent grid's block count (default: the device's
    SMs). ``stream``: accepted for the callers' sake (nothing is enqueued here).
    Raises ValueError for operands whose strides TMA cannot describe."""
    if kernel.softmax:   # refused before any map is encoded or copied
        if out.shape[0] != 1 or a.shape[0] != 1 or b.shape[0] != 1:
            raise ValueError("softmax mode computes one matrix (no batch)")
        if -(-out.shape[2] // cfg.block_n) > SOFTMAX_CHUNKS:
            raise ValueError(f"softmax mode: at most {SOFTMAX_CHUNKS * cfg.block_n} columns")
        if kernel.overlap and -(-a.shape[2] // BK) < cfg.stages - 1:
            raise ValueError(f"softmax overlap: K of at least {(cfg.stages - 1) * BK} (the "
                             f"k-steps issued ahead), got {a.shape[2]}")
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
    smem = cfg.smem_bytes + (softmax_stats_bytes(cfg) if kernel.softmax else 0)
    allow_dynamic_shared(kernel, args, smem)
    if kernel.softmax:
        g = (-(-a.shape[1] // cfg.block_m), 1)
    else:
        g = grid(cfg, a.shape[1], out.shape[2], out.shape[0],
                 sms if sms is not None else (sm_count(SMS) if cfg.persistent else None))
    p = TmaLaunchPlan(kernel, args, g, cfg.threads, smem, encoder, map_args, MAPS_ARG,
                      cfg.cluster, alloc=alloc, initial=(buf, raw))
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


def argtypes(out_kind: str):
    """Numba argument types (for offline compilation)."""
    u16 = types.Array(types.uint16, 3, "C")
    out = types.Array(types.float32 if out_kind == "float32" else types.uint16, 3, "C")
    return (u16, u16, out, out, types.float32[::1], types.float32, types.float32,
            types.uint8[::1])


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

#: The ping-pong schedule's config in the reports (and the sweeps): 128 × 128 per consumer
#: warpgroup (two m64n128 accumulators), 5 stages of 32 KB.
PINGPONG = WsConfig(128, 128, 5, persistent=True, pingpong=True)


def _report_kernels():
    """(name, config, B row-major, output kind, activation, has_bias) of the offline reports,
    in two groups: the main-loop variants, and the epilogues."""
    smem = WsConfig(smem_epilogue=True)
    main = (("ws_128x256_brow", WsConfig(), True, "float16"),
            ("ws_128x256_bcol", WsConfig(), False, "float16"),
            ("ws_256x128_brow", WsConfig(256, 128), True, "float16"),
            ("ws_128x256_brow_persistent", WsConfig(persistent=True), True, "float16"),
            ("ws_128x256_brow_noreg", WsConfig(producer_regs=0, consumer_regs=0), True,
             "float16"),
            ("ws_128x128_brow_pingpong", PINGPONG, True, "float16"),
            ("ws_128x128_bcol_pingpong", PINGPONG, False, "float16"))
    epilogues = (
        # a bias and an activation made the epilogue big enough that LLVM stopped unrolling it
        # and the accumulators went to local memory (512-byte stack; fixed 2026-11-30)
        ("ws_128x256_brow_bias_gelu", WsConfig(), True, "float16", "gelu", True),
        ("ws_128x256_brow_smemepi_bias_gelu", smem, True, "float16", "gelu", True),
        ("ws_128x256_brow_smemepi", smem, True, "float16"),
        ("ws_128x256_bcol_smemepi_f32out", smem, False, "float32"),
        ("ws_256x128_brow_smemepi", WsConfig(256, 128, smem_epilogue=True), True, "float16"),
        ("ws_128x256_brow_persistent_smemepi",
         WsConfig(stages=3, persistent=True, smem_epilogue=True), True, "float16"),
        ("ws_128x128_brow_pingpong_smemepi",
         WsConfig(128, 128, 4, persistent=True, pingpong=True, smem_epilogue=True), True,
         "float16"),
        # the TMA-store epilogue (swizzled staging, stores drain under the next main loop)
        ("ws_128x256_brow_persistent_tmastore", TMA_STORE, True, "float16"),
        ("ws_128x256_brow_persistent_tmastore_bias_gelu", TMA_STORE, True, "float16", "gelu",
         True),
        # gemm_softmax's TMA mode: online softmax per 256-column chunk, rows rescaled at the end
        ("ws_128x256_brow_smemepi_softmax",
         WsConfig(stages=3, persistent=True, smem_epilogue=True), True, "float16", None,
         False, False, True),
        # ... with the output's tensor map: TMA-stored chunks, the rescale through shared memory
        ("ws_128x256_brow_smemepi_softmax_tmaout",
         WsConfig(stages=3, persistent=True, smem_epilogue=True), True, "float16", None,
         False, False, True, True),
        # ... 128-column chunks, each one's softmax under the next one's first k-steps
        ("ws_128x128_brow_smemepi_softmax_overlap",
         WsConfig(128, 128, 4, persistent=True, smem_epilogue=True), True, "float16", None,
         False, False, True, True, True))
    cluster = (("ws_128x256_brow_smemepi_cluster2", CLUSTER, True, "float16"),
               ("ws_128x256_bcol_smemepi_cluster2", CLUSTER, False, "float16"),
               ("ws_128x256_brow_persistent_tmastore_cluster2", CLUSTER_TMA_STORE, True,
                "float16"))
    return {"main": main, "epilogues": epilogues, "cluster": cluster}


def compile_reports(group: str = "main"):
    """Offline sm_90a reports. ``group="main"``: 128×256 (2 consumers × 64 rows) both B
    layouts, 256×128 (2 consumers × 128 rows), the persistent variant, 128×256 without
    setmaxnreg; ``"epilogues"``: bias + GELU (register and staged epilogues) and the
    shared-memory epilogue (``smem_epilogue``: 128×256 f16 and float32 out, 256×128,
    persistent with 3 stages). Each kernel takes 2–6 s on one CPU core (it took ~1 minute
    with Numba's IR-level inlining, hence the two groups, one subprocess each)."""
    from ..offline import compile_kernel

    out = []
    for name, cfg, b_row, kind, *epi in _report_kernels()[group]:
        kern = wgmma_ws_gemm_kernel(cfg, b_row, kind, *epi)
        rep = compile_kernel(f"gemm_{name}", kern.py_func, argtypes(kind), (9, 0, "a"),
                             launch_bounds=(cfg.threads, 1))
        d = dict(rep.__dict__)
        d["config"] = cfg.describe()
        d["ops"] = sorted({ln.split()[0].rstrip(";") for ln in
                           (x.strip() for x in rep.ptx.splitlines())
                           if ln.startswith(("wgmma.", "mbarrier.", "cp.async.bulk", "setmaxnreg",
                                             "fence.", "bar.", "st.global", "ld.shared",
                                             "st.shared", "barrier.cluster", "mapa.",
                                             "stmatrix"))})
        d.pop("ptx")
        out.append(d)
    return out


def compile_reports_epilogues():
    """:func:`compile_reports` of the epilogue group (a target for ``run_in_subprocess``)."""
    return compile_reports("epilogues")


def compile_reports_cluster():
    """:func:`compile_reports` of the cluster group (clusters of two, B multicast)."""
    return compile_reports("cluster")
