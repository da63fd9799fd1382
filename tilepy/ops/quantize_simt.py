"""The FP8 quantisers' kernels (CUDA cores): absolute maxima, scales, and the rounding of
``x · (1 / scale)`` to e4m3 / e5m2 codes.

The rule every kernel here follows, per group of elements that shares one scale:

* ``scale = amax · fl(1 / FP8_MAX[fmt])`` in float32 (``amax`` the largest |element| of the
  group), at least 2**-126; 1.0 when every element is zero (whose codes are then zeros);
* ``inv = fl(1 / scale)``, the correctly rounded float32 reciprocal, once per group;
* each code is ``cvt.rn.satfinite(fl(x · inv))`` (:func:`tilepy.ptx.math.cvt_e4m3x2_f32`):
  the float32 product rounded to the format to nearest even, never past the largest finite
  value. A NaN element gives the NaN code; a non-finite element makes its group's scale
  non-finite (+inf makes ``inv`` 0 and every code of the group 0, or NaN for the inf itself).

Two kernels, each generated once per argument set, each in the modes of :data:`MODES`:

* ``"group"``: every group's amax, its scale (written to ``scales``) and its codes;
* ``"amax"`` / ``"apply"``: one scale over the tensor in two launches. ``"amax"``: every block
  of the grid writes the largest |element| it saw (a NaN wins) to ``partials[b]`` (``b`` the
  block's linear index, ``blockIdx.y · gridDim.x + blockIdx.x``; ``partials`` holds one entry
  per block of the grid). ``"apply"``: every block reduces ``partials`` (all of its entries)
  to the tensor's amax, writes the codes of its share of ``x``, and block 0's thread 0 writes
  ``scales[0, 0]``. No buffer needs zeroing between calls: each ``"amax"`` block writes its
  own entry. (The vector kernel's ``"apply"`` visits the tiles along M in the reverse order
  of its ``"amax"``, so that it starts on the part of ``x`` still in L2.)

:func:`vector_kernel` (the fast one): ``kernel(x, codes, scales, partials, segs)`` over a 2-D
``x`` (M, K) — uint16 bits of float16 / bfloat16, or float32 — with a unit element stride,
data pointer and row stride multiples of 16 bytes and K a multiple of 8; ``codes`` is the
(M, K) uint8 result, contiguous and 8-byte aligned. A thread moves *chunks* of 8
consecutive elements of a row: one 16-byte load (16-bit sources) or two (float32), and one
8-byte store of their 8 codes. Threads form *teams* that cover a *tile* of ``x`` as the
:class:`Tiling` says, each thread holding its chunks of the tile in registers between the
amax and the conversion (one read of ``x``). In ``"group"`` mode a group is a tile, or —
the ``segmented`` variant, rows longer than a tile — ``segs`` consecutive tiles along a row,
read once for the amax and again (from L2) for the codes; the grid is (groups along K, blocks
along M), each block's teams taking consecutive groups along M and the blocks striding over
the rest; ``scales`` is (groups along M, groups along K). In ``"amax"`` / ``"apply"`` mode
the tiles are the tensor's shares, ``segs`` is not read.

:func:`quantize_kernel` (the fallback for any strides, alignment and K):
``kernel(x, values, scales, partials, gr, gc)`` with ``values`` (M, K) uint8, one element per
thread per step. ``"group"``: block ``(i, j)`` of the grid (ceil(M / gr), ceil(K / gc)) owns
the group of rows ``i·gr …`` and columns ``j·gc …``; in ``"amax"`` / ``"apply"`` the blocks
stride over the rows, the threads over the columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..inline import inline_device
from ..kcache import cached_jit
from ..ptx.asm import SIMULATOR
from ..ptx.global_vector import ld_global_v4, st_global_v2
from ..ptx.math import cvt_e4m3x2_f32, cvt_e5m2x2_f32, fmax_nan, unpack_bf16x2_f32, unpack_f16x2_f32
from ..ptx.shuffle import shfl_xor

#: The largest finite value of each 8-bit format.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
SOURCES = ("float16", "bfloat16", "float32")
MODES = ("group", "amax", "apply")
#: Elements of a chunk: what one thread loads (16 or 32 bytes) and stores (8 codes) at once.
CHUNK = 8
WARP = 32
#: The most chunks a thread of :func:`vector_kernel` holds per tile, by source: 32 registers
#: of data either way (four words a 16-bit chunk, eight a float32 one).
MAX_HELD = {"float16": 8, "bfloat16": 8, "float32": 4}


def _check(src, fmt, mode):
    if src not in SOURCES or fmt not in FP8_MAX or mode not in MODES:
        raise ValueError(f"quantize kernels: src {src!r} of {SOURCES}, fmt {fmt!r} of "
                         f"{tuple(FP8_MAX)}, mode {mode!r} of {MODES}")


def _scale_of(fmt):
    """``(scale, inv) = f(top)``: the group's scale and its reciprocal from its amax."""
    INV_MAX = np.float32(1.0 / FP8_MAX[fmt])
    ONE = np.float32(1.0)
    ZERO = np.float32(0.0)
    TINY = np.float32(2.0 ** -126)

    @inline_device
    def scale_of(top):
        scale = top * INV_MAX if top != ZERO else ONE
        if scale < TINY:
            scale = TINY    # a subnormal amax: the smallest normal scale, never 0
        return scale, ONE / scale

    return scale_of


# ---- the vector kernel ----------------------------------------------------------------------

@dataclass(frozen=True)
class Tiling:
    """How the threads of :func:`vector_kernel` cover ``x``.

    A *team* of ``lanes · rows`` threads covers a tile of ``rows · steps`` rows by ``lanes ·
    chunks`` chunks (× 8 columns): thread ``(l, q)`` of the team (``l = i % lanes``, ``q = i //
    lanes``) holds chunk columns ``l + lanes · j`` (j < ``chunks``) of tile rows ``q + rows ·
    s`` (s < ``steps``), so that consecutive threads read consecutive 16 bytes. A block is
    ``teams`` teams (consecutive tiles along M). A team is a power of two, at most a warp
    and dividing it, or whole warps; a block is whole warps, at most 1024 threads."""

    lanes: int
    rows: int = 1
    chunks: int = 1
    steps: int = 1
    teams: int = 1

    def __post_init__(self):
        for name in ("lanes", "rows", "chunks", "steps", "teams"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Tiling.{name} must be a positive int, got {v!r}")
        team = self.team
        if team & (team - 1) or (team > WARP and team % WARP):
            raise ValueError(f"Tiling: a team of {team} threads is not a power of two that "
                             f"divides a warp or is whole warps")
        if self.threads % WARP or self.threads > 1024:
            raise ValueError(f"Tiling: a block of {self.threads} threads is not whole warps "
                             f"of at most 1024 threads")

    @property
    def team(self) -> int:
        return self.lanes * self.rows

    @property
    def threads(self) -> int:
        return self.team * self.teams

    @property
    def tile_rows(self) -> int:
        return self.rows * self.steps

    @property
    def tile_cols(self) -> int:
        return self.lanes * self.chunks * CHUNK

    @property
    def held(self) -> int:
        """Chunks a thread holds."""
        return self.chunks * self.steps


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def choose_tiling(gran, src: str, k: int, simulator: bool = False) -> Tiling:
    """The tiling of ``granularity`` ``gran`` (``"tensor"``, ``"row"``, ``(1, 128)``,
    ``(128, 128)``) for a ``src`` matrix of ``k`` columns (a multiple of 8). On a GPU each
    thread keeps 32 to 128 bytes of ``x`` in flight per tile, blocks are at least 256
    threads, a row's team at most 1024 threads of at most :data:`MAX_HELD` chunks; in the
    simulator (every thread a Python thread) blocks are one or two warps and rows longer than
    256 columns are cut into tiles (``segs`` > 1)."""
    f32 = src == "float32"
    if gran == (1, 128):      # a team per group: 16 chunks
        if simulator:
            return Tiling(lanes=4, chunks=4, teams=8)
        return Tiling(lanes=16, teams=16) if f32 else Tiling(lanes=4, chunks=4, teams=64)
    if gran == (128, 128):    # a block per group: 128 rows of 16 chunks
        if simulator:
            return Tiling(lanes=16, rows=4, steps=32)
        return Tiling(lanes=16, rows=32, steps=4) if f32 else Tiling(lanes=16, rows=16, steps=8)
    # a row: a team per row (a row longer than the widest tile: segments of it); one scale:
    # the same, in blocks of at most 256 threads (more tiles along K instead)
    kc = -(-int(k) // CHUNK)
    per = 2 if f32 else 4     # 64 bytes a thread
    if simulator:
        cap, most, block = 16, 2, 32
    elif gran == "row":
        cap, most, block = 1024, MAX_HELD[src], 256
    else:
        cap, most, block = 256, per, 256
    lanes = min(cap, _pow2_at_least(-(-kc // per)))
    chunks = max(1, min(most, -(-kc // lanes)))
    return Tiling(lanes=lanes, chunks=chunks, teams=max(1, block // lanes))


def blocks_per_sm(tiling: Tiling, src: str) -> int:
    """The blocks of :func:`vector_kernel` per SM its launch bounds promise to fit (registers):
    a thread keeps at most 32 registers when its chunks take at most 8 (32 bytes of ``x``),
    48 when at most 16 (64 bytes), else 64 — a GPU's 64 K registers per SM over the block's
    threads. Enough blocks to keep 40 KB or more of ``x`` in flight per SM, and no spills
    (the offline reports, :func:`compile_reports`)."""
    words = tiling.held * (8 if src == "float32" else 4)
    regs = 32 if words <= 8 else 48 if words <= 16 else 64
    return max(1, 65536 // (tiling.threads * regs))


@functools.cache
def _chunk_io(src: str, fmt: str):
    """``(load, clear, top, store)`` of one chunk held in ``regs[o …]`` (four uint32 words
    of 16-bit pairs, or eight float32): ``load(x, r, c, regs, o)`` the 8 elements at ``x[r,
    c …]``; ``clear(regs, o)`` zeros (a chunk outside ``x``); ``top(regs, o) -> float32`` the
    largest |element| (NaN wins); ``store(codes, r, c, regs, o, inv)`` the 8 codes of ``x ·
    inv`` at ``codes[r, c …]`` (one 8-byte store)."""
    cvt = cvt_e4m3x2_f32 if fmt == "e4m3" else cvt_e5m2x2_f32
    S16 = np.uint32(16)
    F32 = src == "float32"
    WORDS = 8 if F32 else 4
    ZERO = np.float32(0.0) if F32 else np.uint32(0)

    @inline_device
    def join(lo, hi):
        return np.uint32(lo) | (np.uint32(hi) << S16)

    @inline_device
    def load16(x, r, c, regs, o):
        # 16 bytes: four float32, or four words of 16-bit pairs
        w0, w1, w2, w3 = ld_global_v4(x, r, c)
        regs[o] = w0
        regs[o + 1] = w1
        regs[o + 2] = w2
        regs[o + 3] = w3

    @inline_device
    def clear(regs, o):
        for q in range(WORDS):
            regs[o + q] = ZERO

    if F32:
        @inline_device
        def load(x, r, c, regs, o):
            load16(x, r, c, regs, o)
            load16(x, r, c + 4, regs, o + 4)

        @inline_device
        def pair(regs, o, q):
            # elements 2q, 2q + 1 of the chunk as float32
            return regs[o + 2 * q], regs[o + 2 * q + 1]
    else:
        load = load16
        unpack = unpack_bf16x2_f32 if src == "bfloat16" else unpack_f16x2_f32

        @inline_device
        def pair(regs, o, q):
            return unpack(regs[o + q])

    @inline_device
    def pair_top(regs, o, q):
        lo, hi = pair(regs, o, q)
        return fmax_nan(abs(lo), abs(hi))

    @inline_device
    def top(regs, o):
        return fmax_nan(fmax_nan(pair_top(regs, o, 0), pair_top(regs, o, 1)),
                        fmax_nan(pair_top(regs, o, 2), pair_top(regs, o, 3)))

    @inline_device
    def pair_codes(regs, o, q, inv):
        lo, hi = pair(regs, o, q)
        return cvt(lo * inv, hi * inv)

    @inline_device
    def store(codes, r, c, regs, o, inv):
        st_global_v2(codes, r, c,
                     join(pair_codes(regs, o, 0, inv), pair_codes(regs, o, 1, inv)),
                     join(pair_codes(regs, o, 2, inv), pair_codes(regs, o, 3, inv)))

    return load, clear, top, store


@functools.cache
def _team_max(team: int, threads: int):
    """``reduce(v, scratch) -> float32``: the largest ``v`` (NaN wins) over the ``team``
    threads ``team·t … team·t + team - 1`` of a block of ``threads``; every thread of the
    block calls it together. Teams up to a warp: butterfly shuffles inside the team; larger
    teams: then one value per warp through ``scratch`` (float32, one entry per warp of the
    block) between two barriers (so ``scratch`` is free again on return)."""
    lanes = min(team, WARP)
    LOG = lanes.bit_length() - 1
    HALF = lanes // 2
    TW = team // WARP   # warps per team (0: a team inside a warp)

    @inline_device
    def in_warp(v):
        for s in range(LOG):
            v = fmax_nan(v, shfl_xor(v, HALF >> s))
        return v

    if TW <= 1:
        @inline_device
        def reduce_in_warp(v, scratch):
            return in_warp(v)

        return reduce_in_warp

    @inline_device
    def reduce(v, scratch):
        tid = cuda.threadIdx.x
        v = in_warp(v)
        if (tid & (WARP - 1)) == 0:
            scratch[tid // WARP] = v
        cuda.syncthreads()
        first = (tid // team) * TW
        r = scratch[first]
        for w in range(1, TW):
            r = fmax_nan(r, scratch[first + w])
        cuda.syncthreads()   # every read is done: the next call may write scratch
        return r

    return reduce


@functools.cache
def vector_kernel(src: str, fmt: str, mode: str, tiling: Tiling, segmented: bool = False):
    """The fast kernel of the module docstring for ``tiling``, generated once per argument
    set; launch it with ``tiling.threads`` threads a block. ``segmented`` (``"group"`` mode
    only): groups of ``segs`` tiles (rows longer than a tile); otherwise a group is one tile
    and ``segs`` is not read."""
    _check(src, fmt, mode)
    if segmented and mode != "group":
        raise ValueError("vector_kernel: segmented groups are a \"group\" mode variant")
    CL, RL, HC = tiling.lanes, tiling.rows, tiling.chunks
    TEAM, TEAMS, THREADS = tiling.team, tiling.teams, tiling.threads
    WARPS = THREADS // WARP
    TILE_R = tiling.tile_rows
    TILE_KC = CL * HC                       # chunks across a tile
    HELD = tiling.held
    F32 = src == "float32"
    WORDS = 8 if F32 else 4                 # registers a chunk takes
    REG_T = np.float32 if F32 else np.uint32
    NREGS = HELD * WORDS
    AMAX, APPLY = mode == "amax", mode == "apply"
    SEGMENTED = bool(segmented)
    load, clear, chunk_top, store = _chunk_io(src, fmt)
    team_max = _team_max(TEAM, THREADS)
    block_max = _team_max(THREADS, THREADS)
    scale_of = _scale_of(fmt)
    ZERO = np.float32(0.0)
    jit = cuda.jit if SIMULATOR else cached_jit(
        launch_bounds=(THREADS, blocks_per_sm(tiling, src)))

    @inline_device
    def load_tile(x, r0, cc0, m, kc, regs):
        # chunk h = (s, j) of the thread: row r0 + RL·s, chunk column cc0 + CL·j
        for h in range(HELD):
            r = r0 + RL * (h // HC)
            cc = cc0 + CL * (h % HC)
            if r < m and cc < kc:
                load(x, r, cc * CHUNK, regs, h * WORDS)
            else:
                clear(regs, h * WORDS)

    @inline_device
    def tile_top(regs, top):
        for h in range(HELD):
            top = fmax_nan(top, chunk_top(regs, h * WORDS))
        return top

    @inline_device
    def store_tile(codes, r0, cc0, m, kc, regs, inv):
        for h in range(HELD):
            r = r0 + RL * (h // HC)
            cc = cc0 + CL * (h % HC)
            if r < m and cc < kc:
                store(codes, r, cc * CHUNK, regs, h * WORDS, inv)

    @jit
    def kernel(x, codes, scales, partials, segs):
        tid = cuda.threadIdx.x
        team = tid // TEAM
        member = tid % TEAM
        regs = cuda.local.array(NREGS, REG_T)
        scratch = cuda.shared.array(WARPS, np.float32)
        m = x.shape[0]
        kc = x.shape[1] // CHUNK
        gx = cuda.blockIdx.x
        span = segs * TILE_KC if SEGMENTED else TILE_KC
        cc0 = gx * span + member % CL
        tiles_m = (m + (TILE_R - 1)) // TILE_R
        top = ZERO
        inv = ZERO
        if APPLY:
            for i in range(tid, partials.shape[0], THREADS):
                top = fmax_nan(top, partials[i])
            top = block_max(top, scratch)
            scale, inv = scale_of(top)
            if tid == 0 and gx == 0 and cuda.blockIdx.y == 0:
                scales[0, 0] = scale
        # the block's tiles along M: teams side by side, the grid striding (uniform per
        # block: every thread reaches the same barriers)
        gy = cuda.blockIdx.y * TEAMS + team
        step = cuda.gridDim.y * TEAMS
        while gy - team < tiles_m:
            r0 = gy * TILE_R + member // CL
            if APPLY:
                # the tiles in the reverse of the "amax" launch's order: the first ones this
                # launch reads are the last that one read, still in L2
                r0 = (tiles_m - 1 - gy) * TILE_R + member // CL if gy < tiles_m else m
            load_tile(x, r0, cc0, m, kc, regs)
            if APPLY:
                store_tile(codes, r0, cc0, m, kc, regs, inv)
            elif AMAX:
                top = tile_top(regs, top)
            else:
                g = tile_top(regs, ZERO)
                if SEGMENTED:
                    for s in range(1, segs):
                        load_tile(x, r0, cc0 + s * TILE_KC, m, kc, regs)
                        g = tile_top(regs, g)
                g = team_max(g, scratch)
                scale, inv = scale_of(g)
                if member == 0 and gy < tiles_m:
                    scales[gy, gx] = scale
                if SEGMENTED:   # the registers hold the last tile: read each again (L2)
                    for s in range(segs):
                        load_tile(x, r0, cc0 + s * TILE_KC, m, kc, regs)
                        store_tile(codes, r0, cc0 + s * TILE_KC, m, kc, regs, inv)
                else:
                    store_tile(codes, r0, cc0, m, kc, regs, inv)
            gy += step
        if AMAX:
            top = block_max(top, scratch)
            if tid == 0:
                partials[cuda.blockIdx.y * cuda.gridDim.x + gx] = top

    return kernel


def vector_argtypes(src: str, x_layout: str = "C"):
    """Numba argument types of :func:`vector_kernel`'s kernel (offline compilation)."""
    from numba import types

    x = types.Array(types.float32 if src == "float32" else types.uint16, 2, x_layout)
    return (x, types.Array(types.uint8, 2, "C"), types.Array(types.float32, 2, "A"),
            types.Array(types.float32, 1, "C"), types.int64)


# ---- the scalar fallback ----------------------------------------------------------------------

@functools.cache
def quantize_kernel(src: str, fmt: str, mode: str, warps: int = 4):
    """The fallback kernel of the module docstring, generated once per argument set;
    ``warps`` warps a block (1 … 32)."""
    _check(src, fmt, mode)
    THREADS = 32 * warps
    ZERO = np.float32(0.0)
    cvt = cvt_e4m3x2_f32 if fmt == "e4m3" else cvt_e5m2x2_f32
    block_max = _team_max(THREADS, THREADS)
    scale_of = _scale_of(fmt)
    F16, BF16 = src == "float16", src == "bfloat16"
    GROUP, AMAX = mode == "group", mode == "amax"
    jit = cuda.jit if SIMULATOR else cached_jit

    @inline_device
    def load(x, r, c):
        # element (r, c) as float32
        w = x[r, c]
        if F16:
            return unpack_f16x2_f32(np.uint32(w))[0]
        if BF16:
            return unpack_bf16x2_f32(np.uint32(w))[0]
        return w

    @jit
    def kernel(x, values, scales, partials, gr, gc):
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array(32, np.float32)
        m = x.shape[0]
        k = x.shape[1]
        if GROUP:   # this block's group: rows r0 … r1 - 1, columns c0 … c1 - 1
            r0 = np.int64(cuda.blockIdx.x) * gr
            c0 = np.int64(cuda.blockIdx.y) * gc
            r1 = min(r0 + gr, m)
            c1 = min(c0 + gc, k)
            rstep = np.int64(1)
        else:       # every block-th row of x, all its columns
            r0 = np.int64(cuda.blockIdx.x)
            c0 = np.int64(0)
            r1 = np.int64(m)
            c1 = np.int64(k)
            rstep = np.int64(cuda.gridDim.x)
        top = ZERO
        if GROUP or AMAX:
            for r in range(r0, r1, rstep):
                for c in range(c0 + tid, c1, THREADS):
                    top = fmax_nan(top, abs(load(x, r, c)))
            top = block_max(top, scratch)
            if AMAX:
                if tid == 0:
                    partials[cuda.blockIdx.x] = top
                return
        else:
            for i in range(tid, partials.shape[0], THREADS):
                top = fmax_nan(top, partials[i])
            top = block_max(top, scratch)
        scale, inv = scale_of(top)
        if tid == 0:
            if GROUP:
                scales[cuda.blockIdx.x, cuda.blockIdx.y] = scale
            elif cuda.blockIdx.x == 0:
                scales[0, 0] = scale
        for r in range(r0, r1, rstep):
            for c in range(c0 + tid, c1, THREADS):
                values[r, c] = np.uint8(cvt(load(x, r, c) * inv, ZERO) & 0xFF)

    return kernel


def argtypes(src: str, layout: str = "A"):
    """Numba argument types of :func:`quantize_kernel`'s kernel (offline compilation)."""
    from numba import types

    x = types.Array(types.float32 if src == "float32" else types.uint16, 2, layout)
    return (x, types.Array(types.uint8, 2, layout), types.Array(types.float32, 2, layout),
            types.Array(types.float32, 1, layout), types.int64, types.int64)


#: The vector kernels the offline reports compile: (name, granularity, mode), each at the
#: tiling a GPU chooses for K = 8192.
REPORT_TILINGS = (
    ("1x128", (1, 128), "group"), ("128x128", (128, 128), "group"),
    ("row", "row", "group"), ("tensor", "tensor", "amax"), ("tensor", "tensor", "apply"))


def compile_reports():
    """Offline sm_90 reports: the vector kernels (bfloat16 → e4m3 at each granularity's
    tiling for K = 8192; the widest row tiling cut into tiles, K = 2**20; float32 at 128 ×
    128, the most registers) and the fallback kernels in each mode."""
    from ..offline import report_entry

    def vec(name, src, mode, tiling, segmented=False):
        bounds = (tiling.threads, blocks_per_sm(tiling, src))
        return report_entry(f"quantize_vec_{name}",
                            lambda: vector_kernel(src, "e4m3", mode, tiling, segmented),
                            vector_argtypes(src), (9, 0), threads=tiling.threads,
                            launch_bounds=bounds, tiling=str(tiling))

    out = [vec(f"bf16_e4m3_{name}_{mode}", "bfloat16", mode,
               choose_tiling(gran, "bfloat16", 8192))
           for name, gran, mode in REPORT_TILINGS]
    out += [vec("bf16_e4m3_row_segmented_group", "bfloat16", "group",
                choose_tiling("row", "bfloat16", 1 << 20), True),
            vec("f32_e4m3_128x128_group", "float32", "group",
                choose_tiling((128, 128), "float32", 8192))]
    out += [report_entry(f"quantize_bf16_e4m3_{mode}",
                         lambda mode=mode: quantize_kernel("bfloat16", "e4m3", mode),
                         argtypes("bfloat16"), (9, 0), threads=128)
            for mode in MODES]
    return out
