"""The Hopper GEMM kernel (sm_90a): warpgroup MMA (``wgmma``) over cp.async-fed shared tiles.

One block computes a ``block_m × block_n`` tile of ``out`` with ``block_m / 64`` warpgroups,
each owning 64 rows (``m64n{block_n}k16`` wgmmas, ``block_n / 2`` float32 accumulators per
thread). K advances in steps of 64 through a ``stages``-deep ring of shared-memory stages,
filled by 16-byte ``cp.async`` copies from every thread (zero-filled at the matrix edges, as
in :mod:`tilepy.tile.copy`), in the canonical 128-byte-swizzled layouts wgmma reads
(:mod:`tilepy.ptx.wgmma_layout`):

* A (row-major, K contiguous): K-major, one 128-byte row per m row, 8-row atoms of 1024 bytes
  (descriptor SBO 1024; +32 bytes per k16 step).
* B row-major (K, N) (N contiguous): MN-major, ``block_n / 64`` atom columns of 64 n × 64 k
  (8192 bytes apart: LBO), 8-k atoms 1024 bytes apart (SBO); +2048 bytes per k16 step.
* B column-major (a transposed (N, K) array, K contiguous): K-major like A.

Per k step: wait for the stage's copies, ``fence.proxy.async`` (cp.async writes are generic
proxy writes, wgmma reads through the async proxy), a block barrier, the copy of step
``kt + stages - 1`` into the stage step ``kt - 1`` used (free: every warpgroup waited for its
wgmmas before the barrier), then four wgmmas, commit and wait. The tensor cores idle between
steps only for that barrier; the copies of the next ``stages - 1`` steps are in flight
throughout. With ``overlap=True`` the wait leaves one wgmma group in flight and the copies
run ``stages - 2`` steps ahead into the stage of step ``kt - 2``. The epilogue is :func:`tilepy.tile.epilogue.store_accumulators` (the wgmma
accumulator layout per warp is the mma.sync C layout of a 16 × block_n strip).

The sm_90 GEMM for operands whose rows TMA cannot describe and for mid-size problems whose
128 × 256 tiles would leave SMs idle (:func:`tilepy.ops.gemm.hopper_config`); the TMA,
warp-specialised kernel is :mod:`tilepy.ops.gemm_wgmma_ws`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from ..inline import inline_device
from ..launch import LaunchPlan
from ..ptx import global_addr, shared_addr
from ..ptx import wgmma as W
from ..ptx.asm import SIMULATOR
from ..ptx.cp_async import cp_async_commit_group, cp_async_wait_group
from ..tile.config import SMEM_LIMIT
from ..tile.copy import copy_k_major_to_shared_128b, copy_mn_major_to_shared_128b
from ..tile.epilogue import store_accumulators
from ..tile.smem import allow_dynamic_shared
from .gemm_mma_sync import BATCH_SPLIT, batched_kernel

BK = 64           # k elements per stage: one 128-byte swizzle row of 16-bit data
WARPGROUP = 128
GROUP_M = 8       # block rows walked together (L2 reuse of B panels)


@dataclass(frozen=True)
class WgmmaConfig:
    """One Hopper GEMM kernel: ``block_m`` (64, 128, 192 or 256: one warpgroup per 64 rows),
    ``block_n`` (64, 128, 192 or 256: the wgmma N), ``stages`` of K = 64 in shared memory."""

    block_m: int = 128
    block_n: int = 256
    stages: int = 4
    dtype: str = "float16"
    #: keep one wgmma group in flight across k steps (wait(1); the stage two steps back is
    #: refilled) so the barrier and copies of step k+1 overlap the MMAs of step k. Needs 3+
    #: stages. Off by default (bench/NOTES.md: the cp.async wgmma kernel).
    overlap: bool = False

    def __post_init__(self):
        def need(ok, what):
            if not ok:
                raise ValueError(f"WgmmaConfig({self.block_m}, {self.block_n}, "
                                 f"{self.stages}, {self.dtype!r}): {what}")

        need(self.dtype in ("float16", "bfloat16"), "dtype must be float16 or bfloat16")
        need(self.block_m in (64, 128, 192, 256), "block_m must be 64, 128, 192 or 256")
        need(self.block_n in (64, 128, 192, 256), "block_n must be 64, 128, 192 or 256")
        need(isinstance(self.stages, int) and self.stages >= 2, "stages must be >= 2")
        need(not self.overlap or self.stages >= 3, "overlap needs 3 or more stages")
        limit = SMEM_LIMIT[(9, 0)]
        need(self.smem_bytes <= limit, f"{self.smem_bytes} B of shared memory exceeds the "
             f"{limit} B of sm_90 by {self.smem_bytes - limit} B")
        need(self.block_n // 2 + 40 <= 255, "the accumulators alone exceed 255 registers")

    @property
    def warpgroups(self) -> int:
        return self.block_m // 64

    @property
    def threads(self) -> int:
        return WARPGROUP * self.warpgroups

    @property
    def stage_bytes(self) -> int:
        return (self.block_m + self.block_n) * BK * 2

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.stage_bytes

    def describe(self) -> str:
        return (f"wgmma {self.block_m}x{self.block_n}x{BK}, {self.warpgroups} warpgroups, "
                f"{self.stages} stages, {self.smem_bytes // 1024} KB smem"
                + (", 1 wgmma group in flight" if self.overlap else ""))


def _copy_functions(cfg: WgmmaConfig, b_row_major: bool):
    """(issue_a, issue_b) device functions: one thread's cp.async copies of one stage
    (:mod:`tilepy.tile.copy`): A as a K-major slab of block_m rows; B row-major as an MN-major
    slab of BK k rows, column-major as a K-major slab of block_n rows (issued at the stage's
    B part, A_BYTES on)."""
    issue_a = copy_k_major_to_shared_128b(cfg.block_m, cfg.threads)
    if b_row_major:
        issue_b = copy_mn_major_to_shared_128b(BK, cfg.block_n, cfg.threads)
    else:
        issue_b = copy_k_major_to_shared_128b(cfg.block_n, cfg.threads)
    return issue_a, issue_b


@functools.cache
def wgmma_gemm_kernel(cfg: WgmmaConfig, b_row_major: bool, out_kind: str, activation=None,
                      has_bias: bool = False, has_c: bool = False):
    """The kernel ``kernel(a, b, out, c, bias, alpha, beta)`` on 3-D uint16 views (batch
    first; a batch of 1 broadcasts), like :func:`tilepy.ops.gemm_mma_sync.gemm_kernel`'s. With
    ``b_row_major=False`` ``b`` is the (Z, N, K) row-major view of a column-major B."""
    BM, BN, ST = cfg.block_m, cfg.block_n, cfg.stages
    OVERLAP = cfg.overlap
    AHEAD = ST - 2 if OVERLAP else ST - 1   # k steps whose copies are issued ahead
    WAIT = AHEAD - 1  # cp.async groups left in flight when a stage is consumed
    MMA_WAIT = 1 if OVERLAP else 0
    NACC = BN // 2
    NI = BN // 8
    NJ = BN // 64
    A_BYTES = BM * BK * 2
    STAGE_BYTES = cfg.stage_bytes
    ab = "f16" if cfg.dtype == "float16" else "bf16"
    mma = W.wgmma(BN, ab, trans_b=b_row_major)
    LBO_B, SBO_B, STEP_B = (8192, 1024, 2048) if b_row_major else (16, 1024, 32)
    store = store_accumulators(1, NI, out_kind, activation, has_bias, has_c)
    issue_a, issue_b = _copy_functions(cfg, b_row_major)
    align = None if SIMULATOR else 1024
    f32, i64 = types.float32, types.int64

    @inline_device
    def gemm_block(A, B, O, C, bias, alpha, beta):
        m = A.shape[0]
        kdim = A.shape[1]
        n = B.shape[1] if b_row_major else B.shape[0]
        tiles_m = (m + BM - 1) // BM
        tiles_n = (n + BN - 1) // BN
        pid = cuda.blockIdx.x
        width = GROUP_M * tiles_n
        first = (pid // width) * GROUP_M
        rows = min(tiles_m - first, GROUP_M)
        tm = first + (pid % width) % rows
        tn = (pid % width) // rows
        bm0 = tm * BM
        bn0 = tn * BN

        smem = cuda.shared.array(0, types.uint16, alignment=align) if align else \
            cuda.shared.array(0, types.uint16)
        base = shared_addr(smem, 0)
        tid = cuda.threadIdx.x
        wg = tid // WARPGROUP
        r = tid // 8
        ch = tid % 8
        dst0 = r * 128 + ((ch ^ (r % 8)) * 16)
        sa_row = i64(A.strides[0])
        a_src = i64(global_addr(A, (0, 0))) + (bm0 + r) * sa_row + ch * 16
        rows_left = m - bm0 - r
        sb_row = i64(B.strides[0])
        nbytes_j = cuda.local.array(NJ, types.int32)
        if b_row_major:
            b_src = i64(global_addr(B, (0, 0))) + r * sb_row + (bn0 + ch * 8) * 2
            for j in range(NJ):
                nbytes_j[j] = max(0, min(16, (n - bn0 - j * 64 - ch * 8) * 2))
        else:
            b_src = i64(global_addr(B, (0, 0))) + (bn0 + r) * sb_row + ch * 16
            nbytes_j[0] = n - bn0 - r            # n rows left for this thread
        ktiles = (kdim + BK - 1) // BK

        acc = cuda.local.array(NACC, f32)
        for i in range(NACC):
            acc[i] = f32(0)

        for s in range(AHEAD):
            if s < ktiles:
                stage = base + s * STAGE_BYTES
                issue_a(stage, dst0, a_src, sa_row, rows_left, s, kdim - s * BK - ch * 8)
                if b_row_major:
                    issue_b(stage + A_BYTES, dst0, b_src, sb_row, nbytes_j, s, kdim - s * BK - r)
                else:
                    issue_b(stage + A_BYTES, dst0, b_src, sb_row, nbytes_j[0], s,
                            kdim - s * BK - ch * 8)
            cp_async_commit_group()

        for kt in range(ktiles):
            cp_async_wait_group(WAIT)
            W.fence_proxy_async_shared()
            cuda.syncthreads()
            nxt = kt + AHEAD
            if nxt < ktiles:
                stage = base + (nxt % ST) * STAGE_BYTES
                issue_a(stage, dst0, a_src, sa_row, rows_left, nxt, kdim - nxt * BK - ch * 8)
                if b_row_major:
                    issue_b(stage + A_BYTES, dst0, b_src, sb_row, nbytes_j, nxt,
                            kdim - nxt * BK - r)
                else:
                    issue_b(stage + A_BYTES, dst0, b_src, sb_row, nbytes_j[0], nxt,
                            kdim - nxt * BK - ch * 8)
            cp_async_commit_group()
            stage = base + (kt % ST) * STAGE_BYTES
            da = W.matrix_descriptor(stage + wg * (64 * 128), 16, 1024, 128)
            db = W.matrix_descriptor(stage + A_BYTES, LBO_B, SBO_B, 128)
            W.wgmma_fence()
            for kk in range(BK // 16):
                mma(acc, W.descriptor_advance(da, kk * 32), W.descriptor_advance(db, kk * STEP_B),
                    1)
            W.wgmma_commit_group()
            W.wgmma_wait_group(MMA_WAIT)
        W.wgmma_wait_group(0)
        W.wgmma_fence_operand(acc, NACC)

        acc3 = cuda.local.array((1, NI, 4), f32)
        for j in range(NI):
            for q in range(4):
                acc3[0, j, q] = acc[4 * j + q]
        warp = (tid % WARPGROUP) // 32
        store(acc3, O, bm0 + wg * 64 + warp * 16, bn0, m, n, alpha, bias, C, beta, tid % 32)

    return batched_kernel(gemm_block)


def grid(cfg: WgmmaConfig, m: int, n: int, batch: int = 1):
    return (-(-m // cfg.block_m) * -(-n // cfg.block_n), batch)


def plan(kernel, cfg: WgmmaConfig, a, b, out, c, bias, alpha=1.0, beta=0.0):
    """``(launch plan, arguments)`` for 3-D operands (see :func:`wgmma_gemm_kernel`); a batch
    past the grid's y limit launches in chunks (:data:`tilepy.ops.gemm_mma_sync.BATCH_SPLIT`)."""
    args = (a, b, out, c, bias, np.float32(alpha), np.float32(beta))
    allow_dynamic_shared(kernel, args, cfg.smem_bytes)
    g = grid(cfg, a.shape[1], out.shape[2], out.shape[0])
    return LaunchPlan(kernel, args, g, cfg.threads, cfg.smem_bytes, split=BATCH_SPLIT), args


def argtypes(out_kind: str):
    """Numba argument types (for offline compilation)."""
    u16 = types.Array(types.uint16, 3, "C")
    out = types.Array(types.float32 if out_kind == "float32" else types.uint16, 3, "C")
    return (u16, u16, out, out, types.float32[::1], types.float32, types.float32)


def compile_reports():
    """Offline sm_90a reports of the default Hopper kernel (128×256, 4 stages), both B layouts."""
    from ..offline import compile_kernel

    out = []
    for b_row, overlap in ((True, False), (False, False), (True, True)):
        cfg = WgmmaConfig(overlap=overlap)
        kern = wgmma_gemm_kernel(cfg, b_row, "float16")
        rep = compile_kernel(f"gemm_wgmma_b{'row' if b_row else 'col'}"
                             f"{'_overlap' if overlap else ''}", kern.py_func,
                             argtypes("float16"), (9, 0, "a"))
        d = dict(rep.__dict__)
        d["config"] = cfg.describe()
        d.pop("ptx")
        out.append(d)
    return out
