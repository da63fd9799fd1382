"""The fused GEMM + softmax kernel: ``softmax(scale · a @ b, axis=-1)`` in one launch.

``gemm_softmax_kernel(cfg, b_k_major, out_pairs)`` returns a ``@cuda.jit`` kernel

    kernel(a, b, out, seg_max, sign, c)

* ``a`` (M, K) uint16 bits of float16 / bfloat16 (``cfg.gemm.dtype``), row-major;
* ``b`` (K, N) row-major when ``b_k_major``, else (N, K) row-major (B column-major);
* ``out`` (M, N) uint16 bits of the same dtype, any strides; or, with ``out_pairs``, the
  same memory as (M, N/2) uint32 words — a column pair each — for even N, rows 4-byte
  aligned (half the stores);
* ``seg_max`` float32 (grid_m · BM, segments(N)) scratch for ``park="global"``, read and
  written by the kernel; any float32 2-D array (unused) for ``park="smem"``;
* ``sign`` = ±1 and ``c = |scale| · log2(e)`` (float32): ``scale · s = sign · |scale| · s``.

Rows must be 16-byte aligned (row strides multiples of 8 elements, aligned bases: the op
wrapper copies otherwise); edges of any size are zero-filled by cp.async and masked.
Launch with :func:`grid` blocks of ``cfg.threads`` threads and ``cfg.smem_bytes(N)`` of dynamic
shared memory (:func:`launch`).

How one block computes its BM rows
----------------------------------

The block sweeps the N tiles of BN columns one after the other, with **one flat pipelined
loop over (N tile, k-step)**: the cp.async pipeline of the plain GEMM (``stages - 1`` k-tiles
in flight, one barrier per k-step, ldmatrix fragments double-buffered in registers,
mma.sync m16n8k16 with float32 accumulation) runs on across N-tile boundaries, so the copies
of the next tile's first k-steps are in flight while the current tile finishes — the main loop
never drains. After the last k-step of N tile ``j`` each warp, on its accumulator fragments
(its ``WM`` rows × ``WN`` columns of the tile):

1. multiplies by ``sign`` and masks columns past N to -inf (only in a partial last tile);
2. online softmax per row (:func:`tilepy.tile.reduce.fragment_row_reduce`): running max ``m``
   over this warp's columns so far (quad shuffles), running sum ``l`` rescaled by
   ``2^((m_old - m)·c)`` (lane-partial; quad-reduced once at the end), and
   ``p = 2^((s - m)·c + 15)`` in place — the subtraction comes first, so large scores lose
   nothing; the factor 2^15 (:data:`PARK_BIAS`; it cancels in ``p / l``) keeps small ``p``
   out of float16's subnormal range;
3. remembers ``m_j`` = the running max it used for this tile, per (row, segment) — a segment
   is one warp's columns of one N tile, ``j · warps_n + wn`` = column // WN;
4. parks ``p`` rounded to float16 / bfloat16 (``cvt.rn``; all ``p <= 2^15``), then zeroes the
   accumulators for the next tile.

``park="smem"`` keeps ``p`` (BM × ``park_cols(N)`` × 2 bytes, rows padded by 16 bytes so
the fragment stores are free of bank conflicts) and ``m_j`` in shared memory: **the rows
never leave the chip** until they are final. ``park="global"`` (rows too long for shared
memory) stages each tile's ``p`` in shared memory only, and after one barrier the block copies
it to ``out`` in whole rows (coalesced), unnormalised; ``m_j`` go to ``seg_max``. The fix-up
below then reads the rows back from global memory (mostly L2): one more read and write of the
block's rows, still one launch. With the same block config both give the same bits.

After the sweep: the warps' row statistics meet in shared memory; the block combines them
per row (``m = max_w m_w``, ``l = Σ_w l_w · 2^((m_w - m)·c)``), turns every ``m_j`` into the
factor ``2^((m_j - m)·c) / l``, and then each warp rescales whole rows of parked values by
their segment's factor and writes them to ``out`` — consecutive lanes, consecutive columns
(coalesced), rows past M skipped.

Numerics: float32 accumulation and softmax; ``exp`` is ``ex2.approx``; the parked value is
rounded once to 16 bits before the rescale, and the result once more: at most about one
unit in the last place of float16 / bfloat16 more than a single rounding. A row with a NaN
score is NaN (as ``torch.softmax``). Any ``scale`` (negative and 0 included).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from ..inline import inline_device
from ..launch import LaunchPlan
from ..ptx import global_addr, shared_addr
from ..ptx.asm import SIMULATOR
from ..ptx.cp_async import cp_async_commit_group, cp_async_wait_group
from ..ptx.math import (
    cvt_bf16x2_f32,
    cvt_f16x2_f32,
    ex2_approx,
    unpack_bf16x2_f32,
    unpack_f16x2_f32,
)
from ..tile.config import SMEM_LIMIT, GemmConfig
from ..tile.copy import (
    copy_tile_splits as copy_plan_ok,
    copy_tile_to_shared as tile_copy,
    load_a_fragments,
    load_b_fragments,
)
from ..tile.mma import warp_mma
from ..tile.reduce import combine, fragment_row_reduce, quad_row_reduce
from ..tile.smem import allow_dynamic_shared, dynamic_shared

PARKS = ("smem", "global")
LOG2E = 1.4426950408889634

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)

#: Unsigned array indices (int64 → uint64 is free): Numba skips the negative-index wraparound
#: for them. With signed indices every access carries a compare-and-select, address offsets do
#: not fold into the instruction, and LLVM hoists the loop-invariant addresses of the staged
#: tile (park="global") out of the main loop one by one — enough to make ptxas spill.
_u = np.uint64
_ONE_U = np.uint64(1)  # uint64 + int64 would be float64 in Numba

#: log2 of the factor the parked values carry: ``p · 2^15 <= 32768`` stays below float16's
#: largest value (65504), and float16 keeps its full relative precision down to
#: ``p = 2^-29`` instead of 2^-14 (below that the final value rounds to 0 anyway). The row sums
#: carry the same factor, so ``p / l`` needs no correction.
PARK_BIAS = 15
_BIAS = np.float32(PARK_BIAS)

#: Bytes each parked row is padded by. A parked row holds :func:`park_cols` values (a multiple
#: of 16), so a row is an odd number of 16-byte bank groups long, and the 8 rows a warp's
#: fragment store touches at once hit 8 different groups: no bank conflicts.
ROW_PAD = 16


def park_cols(n: int) -> int:
    """Columns a parked row holds: N rounded up to 16 (not to the N tile: the last tile's
    columns past that are never stored)."""
    return -(-n // 16) * 16


@dataclass(frozen=True)
class GemmSoftmaxConfig:
    """The main loop (a :class:`~tilepy.tile.config.GemmConfig`: BM × BN × BK block, warps,
    stages, dtype) and where the unnormalised rows wait (``park``: "smem" or "global")."""

    gemm: GemmConfig
    park: str = "smem"

    def __post_init__(self):
        if not isinstance(self.gemm, GemmConfig):
            raise TypeError(f"GemmSoftmaxConfig.gemm must be a GemmConfig, got "
                            f"{type(self.gemm).__name__}")
        if self.park not in PARKS:
            raise ValueError(f"GemmSoftmaxConfig.park must be one of {PARKS}, got {self.park!r}")
        b, t = self.gemm.block, self.gemm.threads
        for rows, cols, what in ((b.m, b.k, "A"), (b.k, b.n, "B"), (b.n, b.k, "B (column-major)")):
            if not copy_plan_ok(rows, cols, t):
                raise ValueError(f"GemmSoftmaxConfig: the {what} tile ({rows}x{cols}) does not "
                                 f"split into whole copy passes of {t} threads (tile_copy)")

    @property
    def threads(self) -> int:
        return self.gemm.threads

    def tiles_n(self, n: int) -> int:
        return -(-n // self.gemm.block.n)

    def segments(self, n: int) -> int:
        """(N tile, warp column) pairs of a row: the granularity of the remembered maxima."""
        return self.tiles_n(n) * self.gemm.warps.n

    def row_stats_bytes(self) -> int:
        """Per-warp (max, sum) of every row, then the block's (max, 1/sum): float32."""
        return self.gemm.block.m * (self.gemm.warps.n + 1) * 2 * 4

    def park_bytes(self, n: int) -> int:
        """Shared memory for the parked rows and their segment maxima (``park="smem"``), or
        for one staged N tile (``park="global"``)."""
        bm = self.gemm.block.m
        if self.park != "smem":
            return bm * (self.gemm.block.n * 2 + ROW_PAD)
        return bm * (park_cols(n) * 2 + ROW_PAD) + bm * self.segments(n) * 4

    def smem_bytes(self, n: int) -> int:
        return self.gemm.smem_bytes + self.row_stats_bytes() + self.park_bytes(n)

    def fits(self, n: int) -> bool:
        cc = tuple(self.gemm.cc[:2])
        return self.smem_bytes(n) <= SMEM_LIMIT.get(cc, 99 * 1024)

    def describe(self, n: int | None = None) -> str:
        text = f"{self.gemm.describe()}, park={self.park}"
        if n is not None:
            text += f", {self.smem_bytes(n)} B smem at N={n}"
        return text


def _kernel_jit(threads: int):
    if SIMULATOR:  # the simulator's jit takes no launch bounds
        return cuda.jit
    return cuda.jit(launch_bounds=int(threads))


@functools.cache
def _shared_views():
    """The dynamic shared buffer as float32 and as uint32 (all dynamic arrays alias)."""
    @inline_device
    def views():
        return cuda.shared.array(0, types.float32), cuda.shared.array(0, types.uint32)
    return views


@functools.cache
def softmax_tile(mi: int, ni: int, wn: int):
    """``update(acc, row_max, row_sum, old, c, cols_left, t)`` for one warp's N tile.

    ``acc`` (mi, ni, 4) raw scores (already multiplied by the sign) become
    ``p = 2^((s - m)·c + PARK_BIAS)`` with ``m`` the new running max of each row (over this
    warp's columns so far); ``row_sum`` (lane partials) is rescaled and gets the lane's ``p``.
    Columns ``>= cols_left`` (relative to the warp's first column) are masked: they take no
    part in the max and their ``p`` is 0. A row segment with nothing unmasked yet keeps max -inf,
    sum 0. ``old`` is (mi, 2) scratch.
    """
    # compare-and-select max: with max.NaN.f32 the smem f16 kernel spills (reduce.py)
    max_into = fragment_row_reduce("max", mi, ni, accumulate=True, fast=False)
    sum_into = fragment_row_reduce("sum", mi, ni, accumulate=True, quad=False)

    @inline_device
    def update(acc, row_max, row_sum, old, c, cols_left, t):
        masked = cols_left < wn
        if masked:
            for i in range(mi):
                for j in range(ni):
                    for e in range(4):
                        if 8 * j + 2 * t + (e % 2) >= cols_left:
                            acc[i, j, e] = _NEG_INF
        for i in range(mi):
            for h in range(2):
                old[i, h] = row_max[i, h]
        max_into(acc, row_max)
        for i in range(mi):
            for h in range(2):
                m_new = row_max[i, h]
                if old[i, h] != _NEG_INF:
                    row_sum[i, h] = row_sum[i, h] * ex2_approx((old[i, h] - m_new) * c)
                m_use = m_new if m_new != _NEG_INF else _ZERO
                for j in range(ni):
                    for e in range(2):
                        acc[i, j, 2 * h + e] = ex2_approx((acc[i, j, 2 * h + e] - m_use) * c
                                                          + _BIAS)
        if masked:  # 2^(-inf · 0) would be NaN with scale 0: masked columns are 0, always
            for i in range(mi):
                for j in range(ni):
                    for e in range(4):
                        if 8 * j + 2 * t + (e % 2) >= cols_left:
                            acc[i, j, e] = _ZERO
        sum_into(acc, row_sum)

    return update


def _epilogue_parts(cfg: GemmSoftmaxConfig, out_pairs: bool):
    """The kernel's sizes and its softmax epilogue (a namespace): ``park_tile`` after an N
    tile's last k-step (the online softmax on the accumulators, the tile parked unnormalised:
    in shared memory with park="smem", else staged and copied to ``out``), then after the last
    tile ``row_stats`` (the warps' statistics -> one max and 1 / sum per row), ``factors``
    (each segment's rescale factor) and ``final_rows`` (every row rescaled into ``out``)."""
    g = cfg.gemm
    BM, BN = g.block.m, g.block.n
    THREADS = g.threads
    WARPS = g.warps.count
    WARPS_N = g.warps.n
    WN = g.warp_n
    MI, NI = g.mi, g.ni
    PIPE_BYTES = g.pipeline.stages * (BM * g.block.k * 2 + g.block.k * BN * 2)
    # float32 indices into the dynamic buffer: per-warp row stats, then the block's row stats
    WARP_STATS = PIPE_BYTES // 4
    ROW_STATS = WARP_STATS + BM * WARPS_N * 2
    SEGS = ROW_STATS + BM * 2  # segment maxima / factors (park="smem"), then the parked rows
    STAGED_WORDS = (BN * 2 + ROW_PAD) // 4  # park="global": u32 words per row of a staged tile
    SEG_WORDS = WN // 2                     # u32 words (column pairs) of a segment
    SEG_PASSES = -(-SEG_WORDS // 32)
    _SEG_WORDS_U = np.uint64(SEG_WORDS)
    ROWS_PER_WARP = -(-BM // WARPS)
    ON_CHIP = cfg.park == "smem"
    update = softmax_tile(MI, NI, WN)
    quad_sum = quad_row_reduce("sum")
    fmax = combine("max")
    if g.dtype == "float16":
        pack, unpack = cvt_f16x2_f32, unpack_f16x2_f32
    else:
        pack, unpack = cvt_bf16x2_f32, unpack_bf16x2_f32

    # Column pairs of one row of out (``orow = out[r]``): a uint32 word each with out_pairs
    # (N even), else two uint16 elements, the second one only if ``col + 1 < n``.
    if out_pairs:
        @inline_device
        def put_pair(orow, col, n, word):
            orow[_u(col >> 1)] = word

        @inline_device
        def get_pair(orow, col, n):
            return orow[_u(col >> 1)]
    else:
        @inline_device
        def put_pair(orow, col, n, word):
            orow[_u(col)] = word & 0xFFFF
            if col + 1 < n:
                orow[_u(col) + _ONE_U] = word >> 16

        @inline_device
        def get_pair(orow, col, n):
            word = np.uint32(orow[_u(col)])
            if col + 1 < n:
                word = word | (np.uint32(orow[_u(col) + _ONE_U]) << np.uint32(16))
            return word

    @inline_device
    def copy_out(u32, out, row0, m, n, col0, warp, lane):
        """park="global": the staged tile (unnormalised) to ``out[row0:, col0:]``, one warp
        per row, lane q taking columns 2q, 2q+1 (coalesced)."""
        for rl in range(warp, BM, WARPS):
            r = row0 + rl
            if r < m:
                orow = out[_u(r)]
                for s in range(-(-BN // 64)):
                    q = lane + 32 * s
                    col = col0 + 2 * q
                    if 2 * q < BN and col < n:
                        put_pair(orow, col, n, u32[_u(SEGS + rl * STAGED_WORDS + q)])

    @inline_device
    def finish_segment(u32, orow, fac, pw, col, n, lane, tail):
        """Rescale one segment (WN columns from ``col``) of a row by ``fac`` and store it: lane
        l takes the column pairs l, l + 32, ... (``pw``: the segment's first parked word, for
        park="smem"). Columns past N are checked only in the ``tail`` segment."""
        for s in range(SEG_PASSES):
            w = lane + 32 * s
            cc = col + 2 * w
            if (SEG_WORDS % 32 == 0 or w < SEG_WORDS) and (not tail or cc < n):
                if ON_CHIP:
                    word = u32[pw + _u(w)]
                else:
                    word = get_pair(orow, cc, n)
                lo, hi = unpack(word)
                put_pair(orow, cc, n, pack(lo * fac, hi * fac))

    @inline_device
    def park_tile(acc, row_max, row_sum, old, f32, u32, out, seg_max, sign, c, row0, m, n, j,
                  nseg, park0, park_words, wrow, wcol, wn, warp, lane, g4, t):
        """N tile j's epilogue on this warp's WM x WN fragment (``g4``, ``t``: the lane's
        fragment row and column pair): scale by ``sign``, the online softmax update, each
        row's running max noted per segment, the tile parked; the accumulators zeroed for the
        next tile."""
        for i in range(MI):
            for jj in range(NI):
                for e in range(4):
                    acc[i, jj, e] = acc[i, jj, e] * sign
        update(acc, row_max, row_sum, old, c, n - j * BN - wcol, t)
        seg = j * WARPS_N + wn
        if ON_CHIP:  # the whole row is parked: this tile at its columns
            pcol = j * BN + wcol
            park_left = ((n + 15) // 16) * 16 - pcol - 2 * t
        else:        # one tile is staged
            pcol = wcol
            park_left = BN
        for i in range(MI):
            for h in range(2):
                rl = wrow + 16 * i + g4 + 8 * h
                if t == 0:
                    if ON_CHIP:
                        f32[_u(SEGS + rl * nseg + seg)] = row_max[i, h]
                    else:
                        seg_max[_u(row0 + rl), _u(seg)] = row_max[i, h]
                w0 = park0 + rl * park_words + pcol // 2 + t
                for jj in range(NI):
                    if 8 * jj < park_left:
                        u32[_u(w0 + 4 * jj)] = pack(acc[i, jj, 2 * h], acc[i, jj, 2 * h + 1])
        for i in range(MI):
            for jj in range(NI):
                for e in range(4):
                    acc[i, jj, e] = _ZERO
        if not ON_CHIP:
            # The staged tile to global memory once every warp has written its part. The
            # next tile is staged after the next step's barrier: the reads here are done by
            # then.
            cuda.syncthreads()
            copy_out(u32, out, row0, m, n, j * BN, warp, lane)

    @inline_device
    def row_stats(f32, row_max, row_sum, c, wrow, wn, tid, g4, t):
        """The warps' row statistics -> one (max, 1/sum) per row, in shared memory."""
        for i in range(MI):
            for h in range(2):
                total_l = quad_sum(row_sum[i, h])
                if t == 0:
                    rl = wrow + 16 * i + g4 + 8 * h
                    f32[_u(WARP_STATS + (rl * WARPS_N + wn) * 2)] = row_max[i, h]
                    f32[_u(WARP_STATS + (rl * WARPS_N + wn) * 2 + 1)] = total_l
        cuda.syncthreads()
        for rl in range(tid, BM, THREADS):
            mx = f32[_u(WARP_STATS + rl * WARPS_N * 2)]
            for w in range(1, WARPS_N):
                mx = fmax(mx, f32[_u(WARP_STATS + (rl * WARPS_N + w) * 2)])
            total_l = _ZERO
            for w in range(WARPS_N):
                mw = f32[_u(WARP_STATS + (rl * WARPS_N + w) * 2)]
                if mw != _NEG_INF:
                    total_l += f32[_u(WARP_STATS + (rl * WARPS_N + w) * 2 + 1)] * \
                        ex2_approx((mw - mx) * c)
            f32[_u(ROW_STATS + 2 * rl)] = mx
            f32[_u(ROW_STATS + 2 * rl + 1)] = _ONE / total_l
        cuda.syncthreads()

    @inline_device
    def factors(f32, seg_max, c, row0, nseg, tid):
        """Segment maxima -> rescale factors 2^((m_j - m)·c) / l, in place."""
        for idx in range(tid, BM * nseg, THREADS):
            rl = idx // nseg
            seg = idx - rl * nseg
            mj = f32[_u(SEGS + idx)] if ON_CHIP else seg_max[_u(row0 + rl), _u(seg)]
            fac = _ZERO
            if mj != _NEG_INF:
                fac = ex2_approx((mj - f32[_u(ROW_STATS + 2 * rl)]) * c) * \
                    f32[_u(ROW_STATS + 2 * rl + 1)]
            if ON_CHIP:
                f32[_u(SEGS + idx)] = fac
            else:
                seg_max[_u(row0 + rl), _u(seg)] = fac
        cuda.syncthreads()

    @inline_device
    def final_rows(f32, u32, out, seg_max, row0, m, n, nseg, park0, park_words, warp, lane):
        """The final rows: one warp per row, segment by segment (one factor each), columns
        past N checked in the last segment only; consecutive lanes, consecutive words."""
        full = n // WN
        for i in range(ROWS_PER_WARP):
            rl = warp + WARPS * i
            r = row0 + rl
            if (BM % WARPS == 0 or rl < BM) and r < m:
                orow = out[_u(r)]
                pw = _u(park0 + rl * park_words)
                fi = _u(SEGS + rl * nseg)
                col = 0
                for seg in range(full):
                    if ON_CHIP:
                        fac = f32[fi]
                    else:
                        fac = seg_max[_u(r), _u(seg)]
                    finish_segment(u32, orow, fac, pw, col, n, lane, False)
                    fi += _ONE_U
                    pw += _SEG_WORDS_U
                    col += WN
                if col < n:
                    if ON_CHIP:
                        fac = f32[fi]
                    else:
                        fac = seg_max[_u(r), _u(full)]
                    finish_segment(u32, orow, fac, pw, col, n, lane, True)

    return SimpleNamespace(SEGS=SEGS, STAGED_WORDS=STAGED_WORDS, ON_CHIP=ON_CHIP,
                           park_tile=park_tile, row_stats=row_stats, factors=factors,
                           final_rows=final_rows)


@functools.cache
def gemm_softmax_kernel(cfg: GemmSoftmaxConfig, b_k_major: bool = True, out_pairs: bool = False):
    """The kernel ``kernel(a, b, out, seg_max, sign, c)``: a block owns BM rows of ``out`` and
    sweeps every N tile of them (the cp.async pipeline runs on across tiles), the softmax
    epilogue (:func:`_epilogue_parts`) after each tile's last k-step, then the rows' final
    rescale. ``out_pairs``: N even, ``out`` viewed as uint32 column pairs."""
    g = cfg.gemm
    BM, BN, BK = g.block.m, g.block.n, g.block.k
    STAGES = g.pipeline.stages
    WAIT = STAGES - 2
    THREADS = g.threads
    WARPS_N = g.warps.n
    WM, WN = g.warp_m, g.warp_n
    MI, NI, KI = g.mi, g.ni, g.ki
    A_BYTES = BM * BK * 2
    STAGE_BYTES = A_BYTES + BK * BN * 2
    ep = _epilogue_parts(cfg, out_pairs)
    SEGS, STAGED_WORDS, ON_CHIP = ep.SEGS, ep.STAGED_WORDS, ep.ON_CHIP
    park_tile, row_stats, factors, final_rows = ep.park_tile, ep.row_stats, ep.factors, \
        ep.final_rows

    smem = dynamic_shared()
    views = _shared_views()
    setup_a, copy_a = tile_copy(BM, BK, THREADS, g.swizzle)
    if b_k_major:
        setup_b, copy_b = tile_copy(BK, BN, THREADS, g.swizzle)
        setup_fb, load_b = load_b_fragments(NI, BN, True, g.swizzle)
    else:
        setup_b, copy_b = tile_copy(BN, BK, THREADS, g.swizzle)
        setup_fb, load_b = load_b_fragments(NI, BK, False, g.swizzle)
    setup_fa, load_a = load_a_fragments(MI, BK, g.swizzle)
    mma = warp_mma(MI, NI, g.dtype)

    @inline_device
    def issue(cp, base, slot, j, kt, m_left, k, n, sa, sb, live):
        """Copies of (N tile j, k-step kt) into pipeline slot ``slot`` (all zero-fill unless
        ``live``). ``cp`` holds this thread's (source of A, source of B, r0 / chunk / shared
        offset of A, of B) for step (0, 0)."""
        a_addr = base + slot * STAGE_BYTES
        k_left = k - kt * BK
        copy_a(a_addr, cp[0] + kt * (BK * 2), cp[2], cp[3], cp[4], sa, m_left if live else 0,
               k_left)
        if b_k_major:  # rows = k, columns = n
            copy_b(a_addr + A_BYTES, cp[1] + kt * BK * sb + j * (BN * 2), cp[5], cp[6], cp[7],
                   sb, k_left if live else 0, n - j * BN)
        else:          # rows = n, columns = k
            copy_b(a_addr + A_BYTES, cp[1] + j * BN * sb + kt * (BK * 2), cp[5], cp[6], cp[7],
                   sb, n - j * BN if live else 0, k_left)

    @_kernel_jit(THREADS)
    def kernel(a, b, out, seg_max, sign, c):
        m = a.shape[0]
        k = a.shape[1]
        n = b.shape[1] if b_k_major else b.shape[0]
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        g4 = lane // 4
        t = lane % 4
        row0 = cuda.blockIdx.x * BM
        wn = warp % WARPS_N
        wrow = (warp // WARPS_N) * WM
        wcol = wn * WN
        base = shared_addr(smem(), 0)
        f32, u32 = views()

        tiles_n = (n + BN - 1) // BN
        nseg = tiles_n * WARPS_N
        ktiles = (k + BK - 1) // BK
        total = tiles_n * ktiles
        if ON_CHIP:
            park_words = (((n + 15) // 16) * 32 + ROW_PAD) // 4  # u32 words per parked row
            park0 = SEGS + BM * nseg                             # its first word
        else:
            park_words = STAGED_WORDS
            park0 = SEGS

        acc = cuda.local.array((MI, NI, 4), np.float32)
        a_frag = cuda.local.array((2, MI, 4), np.uint32)
        b_frag = cuda.local.array((2, NI, 2), np.uint32)
        row_max = cuda.local.array((MI, 2), np.float32)
        row_sum = cuda.local.array((MI, 2), np.float32)
        old = cuda.local.array((MI, 2), np.float32)
        for i in range(MI):
            for h in range(2):
                row_max[i, h] = _NEG_INF
                row_sum[i, h] = _ZERO
            for j in range(NI):
                for e in range(4):
                    acc[i, j, e] = _ZERO

        sa = a.strides[0]  # row strides, in bytes
        sb = b.strides[0]
        ar0, ac, ash = setup_a(tid)
        br0, bc, bsh = setup_b(tid)
        cp = (np.int64(global_addr(a, (0, 0))) + (row0 + ar0) * sa + ac * 16,
              np.int64(global_addr(b, (0, 0))) + br0 * sb + bc * 16,
              ar0, ac, ash, br0, bc, bsh)
        m_left = m - row0
        fa_off, fa_x = setup_fa(wrow, lane)
        fb_off, fb_u, fb_v = setup_fb(wcol, lane)

        # The copy side runs STAGES - 1 steps ahead of the math: (next_j, next_kt).
        next_j = 0
        next_kt = 0
        for s in range(STAGES - 1):
            if s < total:
                issue(cp, base, s, next_j, next_kt, m_left, k, n, sa, sb, True)
                next_kt += 1
                if next_kt == ktiles:
                    next_kt = 0
                    next_j += 1
            cp_async_commit_group()

        j = 0
        kt = 0
        for step in range(total):
            cp_async_wait_group(WAIT)
            cuda.syncthreads()
            a_addr = base + (step % STAGES) * STAGE_BYTES
            b_addr = a_addr + A_BYTES
            load_a(a_frag, 0, a_addr, 0, fa_off, fa_x)
            load_b(b_frag, 0, b_addr, 0, fb_off, fb_u, fb_v)
            # The copies of step + STAGES - 1, into the slot every warp is done with (the
            # barrier above), while the first fragments load. No branch: past the last step
            # everything is zero-filled and nothing is read, so the copies stay in the mma's
            # basic block, where ptxas can interleave them with the mma.
            issue(cp, base, (step + STAGES - 1) % STAGES, next_j, next_kt, m_left, k, n, sa, sb,
                  step + STAGES - 1 < total)
            cp_async_commit_group()
            next_kt += 1
            if next_kt == ktiles:
                next_kt = 0
                next_j += 1
            for kk in range(KI):
                if kk + 1 < KI:
                    load_a(a_frag, (kk + 1) % 2, a_addr, kk + 1, fa_off, fa_x)
                    load_b(b_frag, (kk + 1) % 2, b_addr, kk + 1, fb_off, fb_u, fb_v)
                mma(acc, a_frag, b_frag, kk % 2)

            kt += 1
            if kt == ktiles:
                park_tile(acc, row_max, row_sum, old, f32, u32, out, seg_max, sign, c, row0, m,
                          n, j, nseg, park0, park_words, wrow, wcol, wn, warp, lane, g4, t)
                kt = 0
                j += 1

        row_stats(f32, row_max, row_sum, c, wrow, wn, tid, g4, t)
        factors(f32, seg_max, c, row0, nseg, tid)
        final_rows(f32, u32, out, seg_max, row0, m, n, nseg, park0, park_words, warp, lane)

    return kernel


def grid(cfg: GemmSoftmaxConfig, m: int) -> int:
    return -(-m // cfg.gemm.block.m)


def scalars(scale: float) -> tuple:
    """The kernel's scalar arguments for ``scale``: its sign and |scale| · log2(e)."""
    return (np.float32(-1.0 if scale < 0 else 1.0), np.float32(abs(scale) * LOG2E))


def plan(kernel, cfg: GemmSoftmaxConfig, a, b, out, seg_max, scale: float, n: int):
    """``(launch plan, arguments)`` on 2-D kernel views (``n`` = N): :func:`grid` blocks, the
    config's threads and dynamic shared memory (allowed above 48 KB)."""
    args = (a, b, out, seg_max, *scalars(scale))
    nbytes = cfg.smem_bytes(n)
    allow_dynamic_shared(kernel, args, nbytes)
    return LaunchPlan(kernel, args, grid(cfg, a.shape[0]), cfg.threads, nbytes), args


def argtypes(layout: str = "C", out_pairs: bool = False):
    """Numba argument types of the kernel (for offline compilation)."""
    u16 = types.Array(types.uint16, 2, layout)
    out = types.Array(types.uint32, 2, layout) if out_pairs else u16
    return (u16, u16, out, types.Array(types.float32, 2, "C"), types.float32, types.float32)


def compiled_configs():
    """(name, config, b_k_major, out_pairs, N for the smem figure) of the kernels the compile
    layer checks: the built-in GPU choices of :mod:`tilepy.ops.gemm_softmax` (rows on chip at
    4 and 3 stages, and the long-row path), float16 and bfloat16, B row- and column-major,
    ``out`` written in pairs (even N) and one element at a time."""
    from .gemm_softmax import _GLOBAL_GPU, _ON_CHIP_GPU, _with_dtype

    four, three = _ON_CHIP_GPU[0], _ON_CHIP_GPU[1]
    return [
        ("gemm_softmax_smem_f16", GemmSoftmaxConfig(four, "smem"), True, True, 1024),
        ("gemm_softmax_smem_bf16_bcol_odd_n",
         GemmSoftmaxConfig(_with_dtype(four, "bfloat16"), "smem"), False, False, 1023),
        ("gemm_softmax_smem_f16_3_stages", GemmSoftmaxConfig(three, "smem"), True, True, 1264),
        ("gemm_softmax_global_f16", GemmSoftmaxConfig(_GLOBAL_GPU, "global"), True, True, 4096),
    ]


def compile_reports(only=None):
    """Offline sm_90 reports (registers, spills, instruction counts, shared memory) of
    :func:`compiled_configs`. Run with the simulator off: ``tilepy.offline.run_in_subprocess(
    "tilepy.ops.gemm_softmax_mma_sync:compile_reports")``."""
    from ..offline import report_entry

    return [report_entry(name, lambda cfg=cfg, b_k_major=b_k_major, out_pairs=out_pairs:
                         gemm_softmax_kernel(cfg, b_k_major, out_pairs),
                         argtypes("C", out_pairs), (9, 0), threads=cfg.threads,
                         config=cfg.describe(), n=n, smem_bytes=cfg.smem_bytes(n),
                         fits=cfg.fits(n))
            for name, cfg, b_k_major, out_pairs, n in compiled_configs()
            if only is None or name in only]
