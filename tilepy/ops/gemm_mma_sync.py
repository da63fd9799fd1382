"""The mma.sync GEMM kernel: a multi-stage cp.async pipeline feeding ldmatrix + mma.sync.

``gemm_kernel(cfg, b_k_major, out_kind, activation, has_bias, has_c)`` returns a ``@cuda.jit``
kernel

    kernel(a, b, out, c, bias, alpha, beta)

computing ``out[z] = act(alpha · a[z] @ b[z'] + beta · c[z'] + bias)`` for batches of 16-bit
matrices (uint16 views of float16 / bfloat16 data): ``a`` (Z, M, K) with row-major matrices;
``b`` (Zb, K, N) row-major when ``b_k_major`` else (Zb, N, K) row-major (B column-major);
``out`` (Z, M, N) — float32, or uint16 bits of ``out_kind``; ``c`` (Zc, M, N) of the same kind
as ``out`` (read only if ``has_c``); ``bias`` (N,) float32 (read only if ``has_bias``).
A batch of 1 in ``a``, ``b`` or ``c`` is broadcast (``z' = min(z, Zb - 1)``).
Launch with grid (ceil(M / BM) · ceil(N / BN), Z) (:func:`grid`), ``cfg.threads`` threads and
``cfg.smem_bytes`` of dynamic shared memory (see :func:`launch`). Rows must be 16-byte aligned
(row strides multiples of 8 elements, aligned bases); edges of any size are zero-filled by
cp.async.

Pipeline: the prologue issues ``stages - 1`` k-tiles; iteration ``kt`` waits until tile ``kt``
has landed (``cp.async.wait_group stages-2``), one barrier, issues tile ``kt + stages - 1``
into the slot every warp has finished with, then runs the k16 steps of tile ``kt``.
Switches for experiments (``bench/sweep_gemm.py --variants``): ``group_m`` (grouped block
order), ``double_buffer`` (ldmatrix of step kk+1 before the mma of step kk), ``late_issue``
(issue the next tile's copies after the first k16 step's ldmatrix instead of before).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..inline import inline_device
from ..launch import GridSplit, LaunchPlan
from ..ptx import shared_addr
from ..ptx.cp_async import cp_async_commit_group, cp_async_wait_group
from ..tile.config import GemmConfig
from ..tile.copy import (copy_global_to_shared, load_a_fragments, load_a_fragments_k_major,
                         load_b_fragments)
from ..tile.epilogue import store_accumulators
from ..tile.mma import warp_mma
from ..tile.smem import allow_dynamic_shared, dynamic_shared
from ..tile.schedule import group_end
from ..kcache import cached_jit


@functools.cache
def gemm_kernel(cfg: GemmConfig, b_k_major: bool = True, out_kind: str = "float16",
                activation=None, has_bias: bool = False, has_c: bool = False, group_m: int = 8,
                double_buffer: bool = True, late_issue: bool = False, a_k_major: bool = False):
    """The kernel of the module docstring; ``a_k_major``: ``a`` holds Aᵀ, (Z, K, M) row-major
    matrices (A stored k-major, e.g. the rows of a product's left factor read as columns),
    its tiles copied along rows and loaded with ``ldmatrix.trans``."""
    BM, BN, BK = cfg.block.m, cfg.block.n, cfg.block.k
    A_KM = bool(a_k_major)
    STAGES = cfg.pipeline.stages
    GROUP_M = group_m
    NBUF = 2 if double_buffer else 1
    WAIT = STAGES - 2
    THREADS = cfg.threads
    WARPS_N = cfg.warps.n
    WM, WN = cfg.warp_m, cfg.warp_n
    MI, NI, KI = cfg.mi, cfg.ni, cfg.ki
    A_BYTES = BM * BK * 2
    B_BYTES = BK * BN * 2
    STAGE_BYTES = A_BYTES + B_BYTES

    smem = dynamic_shared()
    if A_KM:
        setup_a, copy_a = copy_global_to_shared(BK, BM, THREADS, cfg.swizzle, True)
        setup_fa, load_a = load_a_fragments_k_major(MI, BM, cfg.swizzle)
    else:
        setup_a, copy_a = copy_global_to_shared(BM, BK, THREADS, cfg.swizzle)
        setup_fa2, load_a2 = load_a_fragments(MI, BK, cfg.swizzle)

        @inline_device
        def setup_fa(row0, lane):      # (the k-major loader's three values)
            off, x = setup_fa2(row0, lane)
            return off, x, 0

        @inline_device
        def load_a(frag, buf, tile_addr, kk, off, x, unused):
            load_a2(frag, buf, tile_addr, kk, off, x)
    if b_k_major:
        setup_b, copy_b = copy_global_to_shared(BK, BN, THREADS, cfg.swizzle, True)
        setup_fb, load_b = load_b_fragments(NI, BN, True, cfg.swizzle)
    else:
        setup_b, copy_b = copy_global_to_shared(BN, BK, THREADS, cfg.swizzle)
        setup_fb, load_b = load_b_fragments(NI, BK, False, cfg.swizzle)
    PER_A = BM * BK // 8 // THREADS
    PER_B = BK * BN // 8 // THREADS
    mma = warp_mma(MI, NI, cfg.dtype)
    store = store_accumulators(MI, NI, out_kind, activation, has_bias, has_c)

    @inline_device
    def issue_tile(plan_a, plan_b, base, slot, kt, k, kstep_a, kstep_b):
        a_addr = base + slot * STAGE_BYTES
        k_left = k - kt * BK
        copy_a(plan_a, a_addr, kt, k_left, kstep_a)
        copy_b(plan_b, a_addr + A_BYTES, kt, k_left, kstep_b)

    @inline_device
    def gemm_block(a, b, out, c, bias, alpha, beta):
        m = out.shape[0]
        n = out.shape[1]
        # Grouped order: consecutive blocks sweep GROUP_M block-rows before moving right, so
        # the A panels and B panels they read stay in L2 together.
        tiles_m = (m + BM - 1) // BM
        tiles_n = (n + BN - 1) // BN
        pid = cuda.blockIdx.x
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        rows_here = min(tiles_m - first_m, GROUP_M)
        row0 = (first_m + (pid % per_group) % rows_here) * BM
        col0 = ((pid % per_group) // rows_here) * BN
        gemm_tile(a, b, out, c, bias, alpha, beta, row0, col0)

    @inline_device
    def gemm_tile(a, b, out, c, bias, alpha, beta, row0, col0):
        m = out.shape[0]
        k = a.shape[0] if A_KM else a.shape[1]
        n = out.shape[1]
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        wrow = (warp // WARPS_N) * WM
        wcol = (warp % WARPS_N) * WN
        base = shared_addr(smem(), 0)

        acc = cuda.local.array((MI, NI, 4), np.float32)
        a_frag = cuda.local.array((NBUF, MI, 4), np.uint32)  # two register buffers: the
        b_frag = cuda.local.array((NBUF, NI, 2), np.uint32)  # next k16 step loads under the mma
        for i in range(MI):
            for j in range(NI):
                for e in range(4):
                    acc[i, j, e] = 0

        plan_a = cuda.local.array((4, PER_A), np.int64)
        plan_b = cuda.local.array((4, PER_B), np.int64)
        if A_KM:
            setup_a(plan_a, a, 0, row0, k, m, tid)
            kstep_a = BK * a.strides[0]
        else:
            setup_a(plan_a, a, row0, 0, m, k, tid)
            kstep_a = BK * 2
        if b_k_major:
            setup_b(plan_b, b, 0, col0, k, n, tid)
            kstep_b = BK * b.strides[0]
        else:
            setup_b(plan_b, b, col0, 0, n, k, tid)
            kstep_b = BK * 2

        fa_off, fa_c, fa_x = setup_fa(wrow, lane)
        fb_off, fb_u, fb_v = setup_fb(wcol, lane)

        ktiles = (k + BK - 1) // BK
        for s in range(STAGES - 1):
            if s < ktiles:
                issue_tile(plan_a, plan_b, base, s, s, k, kstep_a, kstep_b)
            cp_async_commit_group()

        for kt in range(ktiles):
            cp_async_wait_group(WAIT)
            cuda.syncthreads()
            nxt = kt + STAGES - 1
            a_addr = base + (kt % STAGES) * STAGE_BYTES
            b_addr = a_addr + A_BYTES
            if not late_issue:
                if nxt < ktiles:
                    issue_tile(plan_a, plan_b, base, nxt % STAGES, nxt, k, kstep_a, kstep_b)
                cp_async_commit_group()
            if double_buffer:
                load_a(a_frag, 0, a_addr, 0, fa_off, fa_c, fa_x)
                load_b(b_frag, 0, b_addr, 0, fb_off, fb_u, fb_v)
                if late_issue:  # the first fragments' ldmatrix go out before the copies
                    if nxt < ktiles:
                        issue_tile(plan_a, plan_b, base, nxt % STAGES, nxt, k, kstep_a, kstep_b)
                    cp_async_commit_group()
                for kk in range(KI):
                    if kk + 1 < KI:
                        load_a(a_frag, (kk + 1) % 2, a_addr, kk + 1, fa_off, fa_c, fa_x)
                        load_b(b_frag, (kk + 1) % 2, b_addr, kk + 1, fb_off, fb_u, fb_v)
                    mma(acc, a_frag, b_frag, kk % 2)
            else:
                for kk in range(KI):
                    load_a(a_frag, 0, a_addr, kk, fa_off, fa_c, fa_x)
                    load_b(b_frag, 0, b_addr, kk, fb_off, fb_u, fb_v)
                    if late_issue and kk == 0:
                        if nxt < ktiles:
                            issue_tile(plan_a, plan_b, base, nxt % STAGES, nxt, k, kstep_a, kstep_b)
                        cp_async_commit_group()
                    mma(acc, a_frag, b_frag, 0)

        store(acc, out, row0 + wrow, col0 + wcol, m, n, alpha, bias, c, beta, lane)

    kernel = batched_kernel(gemm_block)
    kernel.gemm_tile = gemm_tile
    return kernel


@functools.cache
def grouped_kernel(cfg: GemmConfig, b_k_major: bool = True, out_kind: str = "float16"):
    """The grouped GEMM kernel (a mixture of experts' layers): ``kernel(a, b, out, offsets,
    bias, alpha)`` computes ``out[rows of g] = alpha · a[rows of g] @ b[g]`` for every group
    ``g`` in one launch — ``a`` (total_M, K) row-major and ``out`` (total_M, N) (``out_kind``;
    16-bit as uint16 bits), ``b`` (E, K, N) row-major when ``b_k_major`` else (E, N, K)
    row-major, ``offsets`` (E,) int32 cumulative row ends (``torch._grouped_mm``'s ``offs``):
    group ``g`` is rows ``offsets[g - 1] … offsets[g] - 1`` (from 0 for the first). On the
    device each end is clamped into ``previous end … total_M``, so decreasing or out-of-range
    offsets never read or write out of bounds (rows past the last end are not written).
    ``bias``: any float32 1-D array (unused). Grid :func:`grouped_grid`: block ``x`` is column
    tile ``x % tiles_n`` of the ``x // tiles_n``-th row tile counted over the groups (each
    group's rows in tiles of ``BM``); the blocks past the last group's tiles return at once.
    Each block runs the plain kernel's main loop and epilogue on its group's rows
    (:func:`gemm_kernel`'s ``gemm_tile``)."""
    BM, BN = cfg.block.m, cfg.block.n
    gemm_tile = gemm_kernel(cfg, b_k_major, out_kind).gemm_tile

    @cached_jit
    def kernel(a, b, out, offsets, bias, alpha):
        total = np.int64(a.shape[0])
        tiles_n = (out.shape[1] + BN - 1) // BN
        pid = np.int64(cuda.blockIdx.x)
        mt = pid // tiles_n
        start = np.int64(0)
        end = np.int64(0)
        t0 = np.int64(0)
        g = -1
        for e in range(offsets.shape[0]):
            end = group_end(offsets, e, start, total)
            count = (end - start + BM - 1) // BM
            if mt < t0 + count:
                g = e
                break
            t0 += count
            start = end
        if g >= 0:
            rows = out[start:end]
            gemm_tile(a[start:end], b[g], rows, rows, bias, alpha, np.float32(0.0),
                      (mt - t0) * BM, (pid % tiles_n) * BN)

    return kernel


@functools.cache
def grouped_weight_grad_kernel(cfg: GemmConfig, out_kind: str = "float16"):
    """The grouped GEMM's gradient in ``b`` in one launch: ``kernel(a, dout, out, offsets,
    bias, alpha)`` computes ``out[g] = alpha · a[rows of g]ᵀ @ dout[rows of g]`` for every group
    ``g`` — ``a`` (total_M, K) and ``dout`` (total_M, N) row-major, ``out`` (E, K, N)
    (``out_kind``; 16-bit as uint16 bits), ``offsets`` as :func:`grouped_kernel`'s (clamped the
    same way on the device); an empty group's matrix is written as zeros. The reduction runs
    over the group's rows: ``a``'s rows are read as Aᵀ (:func:`gemm_kernel` with
    ``a_k_major``), ``dout``'s as a row-major B. Grid :func:`grouped_weight_grad_grid`: block
    ``x`` is tile ``(x // tiles_n, x % tiles_n)`` of the (K, N) matrix of group ``y``."""
    BM, BN = cfg.block.m, cfg.block.n
    THREADS = cfg.threads
    gemm_tile = gemm_kernel(cfg, True, out_kind, a_k_major=True).gemm_tile

    @cached_jit
    def kernel(a, dout, out, offsets, bias, alpha):
        total = np.int64(a.shape[0])
        g = cuda.blockIdx.y
        start = np.int64(0)
        end = np.int64(0)
        for e in range(g + 1):
            start = end
            end = group_end(offsets, e, start, total)
        tiles_n = (out.shape[2] + BN - 1) // BN
        pid = np.int64(cuda.blockIdx.x)
        row0 = (pid // tiles_n) * BM
        col0 = (pid % tiles_n) * BN
        mat = out[g]
        if end > start:
            gemm_tile(a[start:end], dout[start:end], mat, mat, bias, alpha, np.float32(0.0),
                      row0, col0)
        else:       # an empty group: its tile of zeros
            for idx in range(cuda.threadIdx.x, BM * BN, THREADS):
                r = row0 + idx // BN
                c = col0 + idx % BN
                if r < mat.shape[0] and c < mat.shape[1]:
                    mat[r, c] = 0

    return kernel


def grouped_weight_grad_grid(cfg: GemmConfig, k: int, n: int, groups: int) -> tuple:
    """:func:`grouped_weight_grad_kernel`'s grid: the (K, N) tiles of a matrix, the groups."""
    return (-(-k // cfg.block.m) * -(-n // cfg.block.n), groups)


def grouped_grid(cfg: GemmConfig, total_m: int, n: int, groups: int) -> tuple:
    """:func:`grouped_kernel`'s grid: every group's row tiles at most (``ceil(total_m / BM) +
    groups``, each group adding at most one partial tile) times the column tiles."""
    return ((-(-total_m // cfg.block.m) + groups) * -(-n // cfg.block.n), 1)


#: How :func:`batched_kernel`'s blocks along grid y index its arguments: a, b, out and c by
#: their batch axis (a batch of one broadcasts), so a batch past the grid's y limit launches
#: in chunks of matrices (:class:`tilepy.launch.GridSplit`).
BATCH_SPLIT = tuple(GridSplit(1, arg, 0) for arg in range(4))


def batched_kernel(gemm_block):
    """The kernel ``kernel(a, b, out, c, bias, alpha, beta)`` over 3-D operands: batch ``z =
    blockIdx.y`` runs ``gemm_block`` on matrix ``z`` of each (a batch of one broadcasts).
    Shared by the mma.sync and wgmma GEMMs; ``kernel.gemm_block`` is the block function.
    Its plans split the batch with :data:`BATCH_SPLIT`."""

    @cached_jit
    def kernel(a, b, out, c, bias, alpha, beta):
        z = cuda.blockIdx.y
        gemm_block(a[min(z, a.shape[0] - 1)], b[min(z, b.shape[0] - 1)], out[z],
                   c[min(z, c.shape[0] - 1)], bias, alpha, beta)

    kernel.gemm_block = gemm_block
    return kernel


def grid(cfg: GemmConfig, m: int, n: int, batch: int = 1):
    """(tiles of the output, batch): the kernel orders the tiles of one matrix itself."""
    return (((n + cfg.block.n - 1) // cfg.block.n) * ((m + cfg.block.m - 1) // cfg.block.m),
            batch)


def plan(kernel, cfg: GemmConfig, a, b, out, c, bias, alpha=1.0, beta=0.0):
    """``(launch plan, arguments)`` for 3-D operands: the config's grid, block and dynamic
    shared memory (allowed above 48 KB), the kernel compiled for these argument types; a
    batch past the grid's y limit launches in chunks (:data:`BATCH_SPLIT`)."""
    args = (a, b, out, c, bias, np.float32(alpha), np.float32(beta))
    allow_dynamic_shared(kernel, args, cfg.smem_bytes)
    g = grid(cfg, out.shape[1], out.shape[2], out.shape[0])   # (M from out: a may be k-major)
    return LaunchPlan(kernel, args, g, cfg.threads, cfg.smem_bytes, split=BATCH_SPLIT), args


def launch(kernel, cfg: GemmConfig, a, b, out, c, bias, alpha=1.0, beta=0.0, stream=0):
    """Launch on 3-D operands with the config's grid, block and dynamic shared memory."""
    p, args = plan(kernel, cfg, a, b, out, c, bias, alpha, beta)
    p.launch(stream, args)


def argtypes(out_kind: str, layout: str = "C"):
    """Numba argument types of :func:`gemm_kernel`'s kernel (for offline compilation)."""
    from numba import types

    u16 = types.Array(types.uint16, 3, layout)
    out = types.Array(types.float32 if out_kind == "float32" else types.uint16, 3, "C")
    return (u16, u16, out, out, types.float32[::1], types.float32, types.float32)


def compile_reports():
    """Offline reports of the default main loop (128×128×32, 3 stages, 8 warps) for sm_90."""
    import time

    from ..offline import compile_kernel

    out = []
    for dtype in ("float16", "bfloat16"):
        cfg = GemmConfig(dtype=dtype)
        t0 = time.perf_counter()
        kern = gemm_kernel(cfg, True, dtype)
        rep = compile_kernel(f"gemm_{dtype}", kern.py_func, argtypes(dtype), (9, 0))
        d = rep.__dict__.copy()
        d["compile_seconds"] = time.perf_counter() - t0
        d["config"] = cfg.describe()
        d.pop("ptx")
        out.append(d)
    return out


def grouped_compile_reports():
    """Offline sm_90 reports of :func:`grouped_kernel` with the default 128×128×32 tile, ``b``
    row-major and (E, N, K) row-major, and of :func:`grouped_weight_grad_kernel`."""
    from numba import types

    from ..offline import report_entry

    u16 = types.uint16
    cfg = GemmConfig(dtype="bfloat16")
    out = []
    for b_k_major in (True, False):
        argtypes = (types.Array(u16, 2, "A"), types.Array(u16, 3, "A"),
                    types.Array(u16, 2, "A"), types.Array(types.int32, 1, "A"),
                    types.float32[::1], types.float32)
        out.append(report_entry(f"grouped_gemm_bf16_{'kn' if b_k_major else 'nk'}",
                                lambda bkm=b_k_major: grouped_kernel(cfg, bkm, "bfloat16"),
                                argtypes, (9, 0), threads=cfg.threads,
                                config=cfg.describe()))
    argtypes = (types.Array(u16, 2, "A"), types.Array(u16, 2, "A"), types.Array(u16, 3, "A"),
                types.Array(types.int32, 1, "A"), types.float32[::1], types.float32)
    out.append(report_entry("grouped_weight_grad_bf16",
                            lambda: grouped_weight_grad_kernel(cfg, "bfloat16"), argtypes,
                            (9, 0), threads=cfg.threads, config=cfg.describe()))
    return out
