"""Tile copies: global → shared with cp.async, shared → registers with ldmatrix.

Generators, each cached on its arguments and returning a device function inlined into its
callers (:func:`tilepy.inline.inline_device`):

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

from ..inline import inline_device
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
        @inline_device
        def swz(row, chunk):
            return chunk ^ ((row // rows_per_line) % modulo)
    else:
        @inline_device
        def swz(row, chunk):
            return chunk
    return swz


@functools.cache
def copy_global_to_shared(rows: int, cols: int, threads: int, swizzle: bool = True,
                          k_along_rows: bool = False):
    """A block-wide pipelined tile copy: ``(setup, issue)`` device functions.

    The tile is ``rows × cols`` 16-bit elements of a 2-D global array ``g`` (logical size
    ``nrows × ncols``), copied into a (swizzled) shared tile with 16-byte ``cp.async.cg``.
    The tile walks along K from one k-step to the next: along columns (an A tile, or a B tile
    stored n-major) or, with ``k_along_rows``, along rows (a B tile stored k-major).

    * ``setup(plan, g, row0, col0, nrows, ncols, tid)`` — once per block, before the loop:
      fills ``plan``, a ``cuda.local.array((4, per_thread), int64)``, with this thread's chunk
      offsets, so the loop only adds compile-time constants.
    * ``issue(plan, tile_addr, kt, k_left, kstep)`` — issue the copies of k-step ``kt``:
      ``k_left`` is K minus the k index where step ``kt`` starts, ``kstep`` the bytes one step
      moves in ``g`` (``cols*2`` along columns, ``rows*row_stride`` along rows). Elements outside
      the matrix are zero-filled through cp.async's src-size operand; nothing is read there.
      Issue only: commit and wait are the caller's, which is what makes multi-stage pipelines.

    Needs 16-byte aligned rows (a row stride that is a multiple of 16 bytes and an aligned
    base); the op wrappers check that and take another path otherwise.
    """
    chunks = cols // 8
    if cols % 8 or (rows * chunks) % threads:
        raise ValueError(f"a {rows}x{cols} tile does not split into 16-byte chunks over "
                         f"{threads} threads")
    per_thread = rows * chunks // threads
    swz = swizzle_fn(chunks, swizzle)
    BIG = 1 << 30

    @inline_device
    def setup(plan, g, row0, col0, nrows, ncols, tid):
        base = global_addr(g, (0, 0))
        stride = g.strides[0]
        for p in range(per_thread):
            q = tid + p * threads
            r = q // chunks
            c = q % chunks
            grow = row0 + r
            gcol = col0 + c * 8
            plan[0, p] = base + grow * stride + gcol * 2          # source at k-step 0
            plan[1, p] = (r * chunks + swz(r, c)) * 16              # shared offset
            if k_along_rows:
                plan[2, p] = r                                       # k index in the step
                plan[3, p] = max(0, min(16, (ncols - gcol) * 2))     # bytes this column has
            else:
                plan[2, p] = c * 8 if grow < nrows else BIG
                plan[3, p] = 16

    @inline_device
    def issue(plan, tile_addr, kt, k_left, kstep):
        for p in range(per_thread):
            if k_along_rows:
                nbytes = plan[3, p] if plan[2, p] < k_left else 0
            else:
                nbytes = max(0, min(16, (k_left - plan[2, p]) * 2))
            cp_async_cg_16(tile_addr + plan[1, p], plan[0, p] + kt * kstep, nbytes)

    return setup, issue


def _mask_fn(chunks: int, enabled: bool):
    rows_per_line = max(1, layout.BANK_GROUPS // chunks)
    modulo = min(chunks, layout.BANK_GROUPS)

    if enabled:
        @inline_device
        def mask(row):
            return (row // rows_per_line) % modulo
    else:
        @inline_device
        def mask(row):
            return 0
    return mask


# The swizzle mask of a row depends on row mod 8 only (rows_per_line × modulo = 8), so it is
# the same for rows 16 apart: each warp computes it once, and the loops below only add
# compile-time constants and XOR a per-thread value — no division in the main loop.


@functools.cache
def load_a_fragments(mi: int, tile_cols: int, swizzle: bool = True):
    """``(setup, load)`` for one warp's A fragments of one k16 step, from a shared tile.

    The tile is row-major (m rows × ``tile_cols`` k-columns). ``setup(row0, lane)`` returns
    this lane's ``(offset, xor)`` for the warp's rows ``row0 …``; then
    ``load(frag, buf, tile_addr, kk, offset, xor)`` fills ``frag[buf, i, 0..3]`` (uint32; ``buf``
    selects one of the register buffers, for double-buffering) for the m16 tiles ``i < mi``, k columns ``16·kk … 16·kk+15`` — the A operand of ``mma_m16n8k16``.
    """
    chunks = tile_cols // 8
    layout.check_swizzle(chunks, swizzle)
    mask = _mask_fn(chunks, swizzle)
    row_step = 16 * chunks * 16

    @inline_device
    def setup(row0, lane):
        r = row0 + lane % 16
        return r * chunks * 16, (lane // 16) ^ mask(r)

    @inline_device
    def load(frag, buf, tile_addr, kk, offset, xor):
        addr = tile_addr + offset + (((2 * kk) ^ xor) << 4)
        for i in range(mi):
            a0, a1, a2, a3 = ldmatrix_x4(addr + i * row_step)
            frag[buf, i, 0] = a0
            frag[buf, i, 1] = a1
            frag[buf, i, 2] = a2
            frag[buf, i, 3] = a3

    return setup, load


@functools.cache
def load_b_fragments(ni: int, tile_cols: int, k_major: bool, swizzle: bool = True):
    """``(setup, load)`` for one warp's B fragments of one k16 step, from a shared tile.

    ``k_major=True``: the tile is (k rows × ``tile_cols`` n-columns), B as stored by a
    row-major (K, N) matrix; loaded with ldmatrix.x4.trans. ``k_major=False``: the tile is
    (n rows × ``tile_cols`` k-columns), from a column-major B (a transposed (N, K) array);
    loaded with ldmatrix.x4. ``setup(col0, lane)`` returns this lane's ``(offset, a, b)``;
    ``load(frag, buf, tile_addr, kk, offset, a, b)`` fills ``frag[buf, j, 0..1]`` for the n8 tiles
    ``j < ni`` starting at column ``col0`` — the B operand of ``mma_m16n8k16``. ``ni`` even.
    """
    if ni % 2:
        raise ValueError(f"load_b_fragments loads n8 tiles in pairs; ni={ni} is odd")
    chunks = tile_cols // 8
    layout.check_swizzle(chunks, swizzle)
    mask = _mask_fn(chunks, swizzle)
    pairs = ni // 2
    step16 = 16 * chunks * 16  # bytes of 16 tile rows

    if k_major:
        @inline_device
        def setup(col0, lane):
            q = lane // 8
            krow = (q % 2) * 8 + lane % 8
            return krow * chunks * 16, col0 // 8 + q // 2, mask(krow)

        @inline_device
        def load(frag, buf, tile_addr, kk, offset, chunk0, xor):
            addr = tile_addr + offset + kk * step16
            for jj in range(pairs):
                b0, b1, b2, b3 = ldmatrix_x4_trans(addr + (((chunk0 + 2 * jj) ^ xor) << 4))
                frag[buf, 2 * jj, 0] = b0
                frag[buf, 2 * jj, 1] = b1
                frag[buf, 2 * jj + 1, 0] = b2
                frag[buf, 2 * jj + 1, 1] = b3
    else:
        @inline_device
        def setup(col0, lane):
            q = lane // 8
            n = col0 + (q // 2) * 8 + lane % 8
            return n * chunks * 16, (q % 2) ^ mask(n), 0

        @inline_device
        def load(frag, buf, tile_addr, kk, offset, xor, unused):
            addr = tile_addr + offset + (((2 * kk) ^ xor) << 4)
            for jj in range(pairs):
                b0, b1, b2, b3 = ldmatrix_x4(addr + jj * step16)
                frag[buf, 2 * jj, 0] = b0
                frag[buf, 2 * jj, 1] = b1
                frag[buf, 2 * jj + 1, 0] = b2
                frag[buf, 2 * jj + 1, 1] = b3

    return setup, load
