"""Tile copies: global → shared with cp.async, shared → registers with ldmatrix.

Generators, each cached on its arguments and returning an ``inline="always"`` device function:

* :func:`copy_global_to_shared` — one block copies a (rows × cols) 16-bit tile of a 2-D global
  array into a (swizzled) shared tile with 16-byte ``cp.async.cg``; rows and columns outside
  the matrix are zero-filled through cp.async's src-size operand, so edge tiles need no other
  predication. Needs 16-byte aligned rows (leading dimension a multiple of 8 elements and an
  aligned base); the op wrappers check that and take another path otherwise.
* :func:`load_a_fragments` / :func:`load_b_fragments` — one warp loads its mma.sync operand
  fragments for one k16 step from a shared tile with ``ldmatrix.x4`` (``.trans`` for a B tile
  stored k-major).

Shared tiles are addressed by their 32-bit shared address (``tilepy.ptx.shared_addr``) plus
byte offsets from :mod:`tilepy.tile.layout`'s swizzle.
"""

from __future__ import annotations

import functools

from numba import cuda

from ..ptx import global_addr
from ..ptx.cp_async import cp_async_cg_16
from ..ptx.ldmatrix import ldmatrix_x4, ldmatrix_x4_trans
from . import layout


@functools.cache
def swizzle_fn(chunks_per_row: int, enabled: bool = True):
    """Device function (row, chunk) -> physical chunk, for tiles of ``chunks_per_row``."""
    rows_per_line = max(1, layout.BANK_GROUPS // chunks_per_row)
    modulo = min(chunks_per_row, layout.BANK_GROUPS)

    if enabled:
        @cuda.jit(device=True, inline="always")
        def swz(row, chunk):
            return chunk ^ ((row // rows_per_line) % modulo)
    else:
        @cuda.jit(device=True, inline="always")
        def swz(row, chunk):
            return chunk
    return swz


@functools.cache
def copy_global_to_shared(rows: int, cols: int, threads: int, swizzle: bool = True):
    """``copy(tile_addr, g, row0, col0, nrows, ncols, tid)``: block-wide, issue only.

    Copies ``g[row0:row0+rows, col0:col0+cols]`` (a 2-D array of 16-bit elements, logical size
    nrows × ncols) into the shared tile at byte address ``tile_addr``; elements outside the
    matrix become 0. Every thread of the block calls it; it issues cp.async and returns —
    commit and wait are the caller's (that is what makes multi-stage pipelines possible).
    """
    chunks = cols // 8
    if cols % 8 or (rows * chunks) % threads:
        raise ValueError(f"a {rows}x{cols} tile does not split into 16-byte chunks over "
                         f"{threads} threads")
    per_thread = rows * chunks // threads
    swz = swizzle_fn(chunks, swizzle)

    @cuda.jit(device=True, inline="always")
    def copy(tile_addr, g, row0, col0, nrows, ncols, tid):
        for p in range(per_thread):
            q = tid + p * threads
            r = q // chunks
            c = q % chunks
            grow = row0 + r
            gcol = col0 + c * 8
            dst = tile_addr + (r * chunks + swz(r, c)) * 16
            if grow < nrows and gcol < ncols:
                nbytes = min(16, (ncols - gcol) * 2)
                cp_async_cg_16(dst, global_addr(g, (grow, gcol)), nbytes)
            else:
                cp_async_cg_16(dst, global_addr(g, (0, 0)), 0)  # zero-fill, reads nothing

    return copy


@functools.cache
def load_a_fragments(mi: int, tile_cols: int, swizzle: bool = True):
    """``load(frag, tile_addr, kk, row0, lane)``: one warp, A fragments of one k16 step.

    The shared tile is row-major (m rows × ``tile_cols`` k-columns). Fills
    ``frag[i, 0..3]`` (uint32) for the m16 tiles ``i < mi`` starting at tile row ``row0``,
    k columns ``16·kk … 16·kk+15`` — the A operand of ``mma_m16n8k16``.
    """
    chunks = tile_cols // 8
    swz = swizzle_fn(chunks, swizzle)

    @cuda.jit(device=True, inline="always")
    def load(frag, tile_addr, kk, row0, lane):
        chunk = kk * 2 + lane // 16
        for i in range(mi):
            r = row0 + i * 16 + lane % 16
            a0, a1, a2, a3 = ldmatrix_x4(tile_addr + (r * chunks + swz(r, chunk)) * 16)
            frag[i, 0] = a0
            frag[i, 1] = a1
            frag[i, 2] = a2
            frag[i, 3] = a3

    return load


@functools.cache
def load_b_fragments(ni: int, tile_cols: int, k_major: bool, swizzle: bool = True):
    """``load(frag, tile_addr, kk, col0, lane)``: one warp, B fragments of one k16 step.

    ``k_major=True``: the shared tile is (k rows × ``tile_cols`` n-columns), B as stored by a
    row-major (K, N) matrix; loaded with ldmatrix.x4.trans. ``k_major=False``: the tile is
    (n rows × ``tile_cols`` k-columns), from a column-major B (a transposed (N, K) array);
    loaded with ldmatrix.x4. Fills ``frag[j, 0..1]`` for the n8 tiles ``j < ni`` starting at
    column ``col0`` — the B operand of ``mma_m16n8k16``. ``ni`` must be even.
    """
    if ni % 2:
        raise ValueError(f"load_b_fragments loads n8 tiles in pairs; ni={ni} is odd")
    chunks = tile_cols // 8
    swz = swizzle_fn(chunks, swizzle)
    pairs = ni // 2

    if k_major:
        @cuda.jit(device=True, inline="always")
        def load(frag, tile_addr, kk, col0, lane):
            q = lane // 8
            k = kk * 16 + (q % 2) * 8 + lane % 8
            for jj in range(pairs):
                chunk = (col0 + jj * 16) // 8 + q // 2
                b0, b1, b2, b3 = ldmatrix_x4_trans(tile_addr + (k * chunks + swz(k, chunk)) * 16)
                frag[2 * jj, 0] = b0
                frag[2 * jj, 1] = b1
                frag[2 * jj + 1, 0] = b2
                frag[2 * jj + 1, 1] = b3
    else:
        @cuda.jit(device=True, inline="always")
        def load(frag, tile_addr, kk, col0, lane):
            q = lane // 8
            chunk = kk * 2 + q % 2
            for jj in range(pairs):
                n = col0 + jj * 16 + (q // 2) * 8 + lane % 8
                b0, b1, b2, b3 = ldmatrix_x4(tile_addr + (n * chunks + swz(n, chunk)) * 16)
                frag[2 * jj, 0] = b0
                frag[2 * jj, 1] = b1
                frag[2 * jj + 1, 0] = b2
                frag[2 * jj + 1, 1] = b3

    return load
