"""Byte transposes through shared memory: ``dst[b, h, c, r] = src[b, h, row(r), c]``.

``transpose_bytes_kernel(key_order)`` returns a kernel ``kernel(src, dst)`` for ``src`` (B, H,
R, C) and ``dst`` (B, H, C, R') uint8 arrays of any strides (R' ≥ R; positions whose row is
past R are written as zeros). ``row(r)`` is ``r``, or with ``key_order`` the FP8 attention's
key order inside each 16 (:data:`KEY_ORDER`: position ``j`` of a 16 holds row
``KEY_ORDER[j]``), which makes the rounded S accumulators of a thread the A registers of the
8-bit P·V wgmma as they stand (:mod:`tilepy.ops.attention_wgmma`).

Grid :func:`grid` (tiles of :data:`ROWS` rows × :data:`COLS` columns, H, B), block
:data:`BLOCK`: a tile is read row by row (a warp reads 32 consecutive bytes of a row) into
shared memory, then written as COLS rows of ``dst`` (a warp writes 32 consecutive bytes): every
global access a whole 32-byte sector. Bytes only, so the 1-byte formats (e4m3, e5m2) and any
alignment go through it.

``transpose_words_kernel(key_order)`` does the same on the arrays read as uint32 words
(``src`` (B, H, R, C/4), ``dst`` (B, H, C, R'/4): C and R' multiples of 4, the last axes
contiguous, every other stride and both data pointers multiples of 4 bytes): tiles of
:data:`WROWS` × :data:`WCOLS` bytes, block :data:`WBLOCK`, each thread loading and storing
whole words and moving their bytes in registers (a quarter of the byte kernel's global
accesses and index arithmetic). :func:`launch_plan` takes it wherever the views allow.
"""

from __future__ import annotations

import functools

from numba import cuda, types

from .. import arrays
from ..kcache import cached_jit
from ..launch import LaunchPlan

#: Rows (of ``src``) × columns of a block's tile, and its threads (TX = COLS).
ROWS, COLS = 64, 32
TX, TY = 32, 8
BLOCK = (TX, TY)
PITCH = COLS + 1    # shared tile row bytes (+1: fewer bank conflicts)
#: The FP8 attention's key order inside each 16 keys (``key_order=True``).
KEY_ORDER = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


@cuda.jit(device=True, inline=True)
def tile_origin(cols, tile_rows, tile_cols):
    """``(r0, c0)``: the first ``src`` row and column of this block's tile (blockIdx.x row
    tile-major over ``cols`` columns)."""
    col_tiles = (cols + tile_cols - 1) // tile_cols
    return (cuda.blockIdx.x // col_tiles) * tile_rows, (cuda.blockIdx.x % col_tiles) * tile_cols


@functools.cache
def transpose_bytes_kernel(key_order: bool = False):
    """The kernel of the module docstring, generated once per ``key_order``."""
    ORDER = bool(key_order)

    @cached_jit
    def kernel(src, dst):
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        rows = src.shape[2]
        cols = dst.shape[2]
        out_rows = dst.shape[3]
        r0, c0 = tile_origin(cols, ROWS, COLS)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tile = cuda.shared.array((ROWS, PITCH), types.uint8)
        for r in range(ty, ROWS, TY):
            row = r0 + r
            inside = row < rows and c0 + tx < cols
            tile[r, tx] = src[b, h, row, c0 + tx] if inside else types.uint8(0)
        cuda.syncthreads()
        for cc in range(ty, COLS, TY):
            if c0 + cc < cols:
                for half in range(ROWS // TX):
                    j = half * TX + tx
                    if r0 + j < out_rows:
                        r = j
                        if ORDER:
                            # KEY_ORDER[j % 16]: 0, 1, 8, 9, 2, 3, 10, 11, ...
                            jj = j % 16
                            r = j - jj + 8 * ((jj % 4) // 2) + 2 * (jj // 4) + jj % 2
                        dst[b, h, c0 + cc, r0 + j] = tile[r, cc]

    return kernel


#: The word kernel: a tile of WROWS rows of ``src`` × WCOLS bytes, threads (WTX, WTY) with WTX
#: the words of a tile row (WTX · 4 = WCOLS = WROWS).
WROWS = WCOLS = 64
WTX, WTY = 16, 16
WBLOCK = (WTX, WTY)
WPITCH = WTX + 1    # shared tile row words (+1: fewer bank conflicts)


@functools.cache
def transpose_words_kernel(key_order: bool = False):
    """The word kernel of the module docstring, generated once per ``key_order``."""
    ORDER = bool(key_order)

    @cached_jit
    def kernel(src, dst):
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        rows = src.shape[2]
        wcols = src.shape[3]
        cols = dst.shape[2]
        out_words = dst.shape[3]
        r0, c0 = tile_origin(cols, WROWS, WCOLS)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tile = cuda.shared.array((WROWS, WPITCH), types.uint32)
        w = c0 // 4 + tx
        for r in range(ty, WROWS, WTY):
            row = r0 + r
            tile[r, tx] = src[b, h, row, w] if row < rows and w < wcols else types.uint32(0)
        cuda.syncthreads()
        # the output word tx of a tile row holds src rows base + (0, 1, 2, 3), or in the key
        # order (KEY_ORDER) base + (0, 1, 8, 9) with base 16 (tx // 4) + 2 (tx % 4)
        if ORDER:
            base = 16 * (tx // 4) + 2 * (tx % 4)
            ra, rb, rc, rd = base, base + 1, base + 8, base + 9
        else:
            ra, rb, rc, rd = 4 * tx, 4 * tx + 1, 4 * tx + 2, 4 * tx + 3
        ow = r0 // 4 + tx
        for cc in range(ty, WCOLS, WTY):
            if c0 + cc < cols and ow < out_words:
                sw = cc // 4
                sh = types.uint32(8 * (cc % 4))
                m = types.uint32(0xFF)
                dst[b, h, c0 + cc, ow] = ((tile[ra, sw] >> sh) & m) | \
                    (((tile[rb, sw] >> sh) & m) << types.uint32(8)) | \
                    (((tile[rc, sw] >> sh) & m) << types.uint32(16)) | \
                    (((tile[rd, sw] >> sh) & m) << types.uint32(24))

    return kernel


def grid(dst_shape) -> tuple:
    """The launch grid for ``dst`` of shape (B, H, C, R')."""
    bsz, heads, cols, out_rows = dst_shape
    return (-(-out_rows // ROWS) * -(-cols // COLS), heads, bsz)


def words_grid(dst_shape) -> tuple:
    """The word kernel's launch grid for ``dst`` of byte shape (B, H, C, R')."""
    bsz, heads, cols, out_rows = dst_shape
    return (-(-out_rows // WROWS) * -(-cols // WCOLS), heads, bsz)


def launch_plan(src, dst, key_order: bool = False):
    """``(plan, args)`` of :func:`transpose_words_kernel` from ``src`` into ``dst`` (views as
    the module docstring says) where both read as words (:func:`tilepy.arrays.word_view`),
    else of :func:`transpose_bytes_kernel`; ``(None, None)`` when ``dst`` is empty."""
    if not all(dst.shape):
        return None, None
    ws, wd = arrays.word_view(src), arrays.word_view(dst)
    if ws is not None and wd is not None:
        args = (ws, wd)
        return LaunchPlan(transpose_words_kernel(key_order), args, words_grid(dst.shape),
                          WBLOCK, 0), args
    args = (src, dst)
    return LaunchPlan(transpose_bytes_kernel(key_order), args, grid(dst.shape), BLOCK,
                      0), args


def reference_rows(out_rows: int, rows: int, key_order: bool = True):
    """For tests: the ``src`` row each of ``dst``'s ``out_rows`` positions holds (-1: zero)."""
    import numpy as np

    r = np.arange(out_rows)
    if key_order:
        r = (r // 16) * 16 + np.array(KEY_ORDER)[r % 16]
    return np.where(r < rows, r, -1)
