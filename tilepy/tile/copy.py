"""Tile copies: global → shared with cp.async, shared → registers with ldmatrix.

Generators, each cached on its arguments and returning a device function inlined into its
callers (:func:`tilepy.inline.inline_device`):

* :func:`copy_global_to_shared` — one block copies a (rows × cols) 16-bit tile of a 2-D global
  array into a (swizzled) shared tile with 16-byte ``cp.async.cg``; rows and columns outside
  the matrix are zero-filled through cp.async's src-size operand, so edge tiles need no other
  predication. Needs 16-byte aligned rows (leading dimension a multiple of 8 elements and an
  aligned base); the op wrappers check that and take another path otherwise.
* :func:`copy_rows_to_shared` (whole rows, bounded by a row count; any thread count) and
  :func:`copy_tile_to_shared` (bounded in rows and columns; whole passes,
  :func:`copy_tile_splits`) — the same tiles as :func:`copy_global_to_shared`, with a
  handful of integers per thread instead of a table per chunk (mma.sync kernels).
* :func:`copy_grouped_rows_to_shared` — the same tile from rows that are two nested axes (the
  query heads of one KV head at each query position: grouped-query packing).
* :func:`copy_rows_to_shared_128b`, :func:`copy_k_major_to_shared_128b`,
  :func:`copy_mn_major_to_shared_128b` — tiles in the 128-byte-swizzled canonical layouts
  that wgmma reads (:mod:`tilepy.ptx.wgmma_layout`): K-major rows of 64-column sub-tiles, a
  64-wide K slab, and an MN-major slab of K rows.
* :func:`load_a_fragments` / :func:`load_b_fragments` — one warp loads its mma.sync operand
  fragments for one k16 step from a shared tile with ``ldmatrix.x4`` (``.trans`` for a B tile
  stored k-major); :func:`load_a_fragments_k_major` an A operand stored transposed.
* :func:`store_accumulators_to_shared` — the reverse trip: a warp's accumulator fragment
  rounded to 16 bits into a shared tile those loaders read (attention's backward passes dS
  between warps this way).

Shared tiles are addressed by their 32-bit shared address (``tilepy.ptx.shared_addr``) plus
byte offsets from :mod:`tilepy.tile.layout`'s swizzle (or the 128-byte one of wgmma). The
cp.async copiers issue only: commit and wait (:mod:`tilepy.ptx.cp_async`) are the caller's,
which is what makes multi-stage pipelines. Global addresses are int64 byte addresses
(``tilepy.ptx.global_addr``), rows 16-byte aligned.
"""

from __future__ import annotations

import functools

from ..inline import inline_device
from ..ptx import global_addr
from ..ptx.cp_async import cp_async_cg_16
from ..ptx.ldmatrix import ldmatrix_x4, ldmatrix_x4_trans
from ..ptx.math import cvt_bf16x2_f32, cvt_f16x2_f32
from ..ptx.vector import st_shared_b32
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


def _row_chunks(name: str, cols: int, swizzle: bool, valid_cols):
    """``(chunks, valid, swz)`` of a row copier: 16-byte chunks per tile row, those the
    matrix rows hold (``valid_cols / 8``), the swizzle function; ``ValueError`` naming
    ``name`` for rows that are not whole chunks or a bad ``valid_cols``."""
    chunks = cols // 8
    if cols % 8:
        raise ValueError(f"{name}: rows of {cols} elements are not whole 16-byte chunks")
    if valid_cols is not None and (valid_cols % 8 or not 0 < valid_cols <= cols):
        raise ValueError(f"{name}: valid_cols={valid_cols!r} must be a positive multiple of 8 "
                         f"up to cols={cols}")
    layout.check_swizzle(chunks, swizzle)
    return chunks, chunks if valid_cols is None else valid_cols // 8, swizzle_fn(chunks,
                                                                                 swizzle)


@functools.cache
def copy_rows_to_shared(rows: int, cols: int, threads: int, swizzle: bool = True,
                        valid_cols: int | None = None):
    """``(setup, issue)``: a block copies ``rows × cols`` 16-bit elements (a tile of whole rows
    of a matrix with unit column stride) into a (swizzled) shared tile with 16-byte cp.async.
    ``valid_cols`` (a multiple of 8, at most ``cols``; default ``cols``): the matrix rows hold
    that many elements; the tile's columns past them are zero-filled and never read (a
    head_dim of 40 in a 48-column tile).

    * ``setup(src, row_stride, tid) -> plan`` (a 4-tuple) once per block; ``src`` the global
      byte address (int64) of the first row of the first tile, ``row_stride`` in bytes.
    * ``issue(tile_addr, src_shift, *plan, row_stride, rows_left)`` copies the tile whose first
      row is ``src_shift`` bytes after ``src`` (whole tiles, to stream along the rows): tile
      rows ``>= rows_left`` are zero-filled (cp.async src-size 0), nothing is read there.

    When the threads split evenly over the 16-byte chunks of a row (``threads % (cols/8) ==
    0``), thread ``tid`` always copies chunk ``tid % (cols/8)`` of rows ``tid // (cols/8) +
    p·R`` (``R`` rows per pass): the plan is its source and shared offsets, and each pass adds
    constants. Otherwise (e.g. 48, 80, 96, 112 columns over 128 threads) a pass divides
    ``tid + p·threads`` by the (constant) chunks per row.

    Every thread of the block calls both. Same swizzle as :func:`load_a_fragments` /
    :func:`load_b_fragments` of ``cols``.
    """
    chunks, valid, swz = _row_chunks("copy_rows_to_shared", cols, swizzle, valid_cols)
    PART = valid < chunks     # chunks past `valid` zero-filled
    row_bytes = chunks * 16

    if threads % chunks == 0:
        per_pass = threads // chunks
        passes = -(-rows // per_pass)
        exact = rows % per_pass == 0
        # The swizzle XOR depends on the row mod 8 only: with a multiple of 8 rows per pass it
        # is the same in every pass, and the shared offset of pass p is sh0 plus a constant.
        const_swz = per_pass % 8 == 0 or not swizzle

        @inline_device
        def setup(src, row_stride, tid):
            r0 = tid // chunks
            c = tid % chunks
            return src + r0 * row_stride + c * 16, (r0 * chunks + swz(r0, c)) * 16, r0, c

        @inline_device
        def issue(tile_addr, src_shift, src0, sh0, r0, c, row_stride, rows_left):
            src = src0 + src_shift
            for p in range(passes):
                r = r0 + p * per_pass
                if exact or r < rows:
                    nbytes = 16 if r < rows_left else 0
                    if PART and c >= valid:
                        nbytes = 0
                    if const_swz:
                        sh = sh0 + p * per_pass * row_bytes
                    else:
                        sh = (r * chunks + swz(r, c)) * 16
                    cp_async_cg_16(tile_addr + sh, src + p * per_pass * row_stride, nbytes)
    else:
        total = rows * chunks
        passes = -(-total // threads)
        exact = total % threads == 0

        @inline_device
        def setup(src, row_stride, tid):
            return src, 0, tid, 0

        @inline_device
        def issue(tile_addr, src_shift, src0, unused0, tid, unused1, row_stride, rows_left):
            src = src0 + src_shift
            for p in range(passes):
                idx = tid + p * threads
                if exact or idx < total:
                    r = idx // chunks
                    c = idx % chunks
                    nbytes = 16 if r < rows_left else 0
                    if PART and c >= valid:
                        nbytes = 0
                    cp_async_cg_16(tile_addr + (r * chunks + swz(r, c)) * 16,
                                   src + r * row_stride + c * 16, nbytes)

    return setup, issue


@functools.cache
def copy_grouped_rows_to_shared(rows: int, cols: int, threads: int, swizzle: bool = True,
                                valid_cols: int | None = None):
    """``issue(tile_addr, src, first, inner, outer_stride, row_stride, rows_left, tid)``: a
    block copies ``rows × cols`` 16-bit elements into the (swizzled) shared tile of
    :func:`copy_rows_to_shared` (same layout, same ``valid_cols`` zero-fill), where tile row
    ``r`` is matrix row ``m = first + r``, at byte ``src + (m // inner) · outer_stride + (m %
    inner) · row_stride`` — rows that are two nested axes, e.g. the query heads of one KV
    head (inner, ``inner`` of them) at each query position (outer): attention's grouped-query
    packing. Tile
    rows ``>= rows_left`` are zero-filled, nothing is read there. ``inner >= 1`` is a run-time
    value (one integer division per chunk: meant for a tile loaded once, not streamed).
    Every thread of the block calls it; the caller commits and waits."""
    chunks, valid, swz = _row_chunks("copy_grouped_rows_to_shared", cols, swizzle, valid_cols)
    PART = valid < chunks
    total = rows * chunks
    passes = -(-total // threads)
    exact = total % threads == 0

    @inline_device
    def issue(tile_addr, src, first, inner, outer_stride, row_stride, rows_left, tid):
        for p in range(passes):
            idx = tid + p * threads
            if exact or idx < total:
                r = idx // chunks
                c = idx % chunks
                nbytes = 16 if r < rows_left else 0
                if PART and c >= valid:
                    nbytes = 0
                m = first + r
                at = src + (m // inner) * outer_stride + (m % inner) * row_stride + c * 16
                if nbytes == 0:
                    at = src    # nothing is read: keep the address in bounds
                cp_async_cg_16(tile_addr + (r * chunks + swz(r, c)) * 16, at, nbytes)

    return issue


def copy_tile_splits(rows: int, cols: int, threads: int) -> bool:
    """Whether :func:`copy_tile_to_shared` can copy a ``rows × cols`` tile with ``threads``
    threads: whole 16-byte chunks per row, the threads an even split of a row's chunks, and
    the rows whole passes of them."""
    chunks = cols // 8
    return cols % 8 == 0 and threads % chunks == 0 and rows % (threads // chunks) == 0


@functools.cache
def copy_tile_to_shared(rows: int, cols: int, threads: int, swizzle: bool = True):
    """``(setup, issue)``: a block copies a ``rows × cols`` tile of 16-bit elements into a
    (swizzled) shared tile with 16-byte cp.async, predicated on both a row and a column bound.

    Thread ``tid`` always copies logical chunk ``c = tid % (cols/8)`` of rows ``r0 + p·R``
    (``r0 = tid // (cols/8)``, ``R = threads / (cols/8)`` rows per pass), so what it keeps
    across the main loop is a handful of integers — not a table per chunk — and each pass adds
    compile-time constants (the swizzle of row ``r0 + p·R`` differs from row ``r0``'s by a
    constant XOR, as the swizzle repeats every 8 rows and ``r0 < R``).

    * ``setup(tid) -> (r0, c, sh0)``: this thread's first row, chunk and shared byte offset.
    * ``issue(tile_addr, src, r0, c, sh0, row_stride, rows_left, cols_left)``: ``src`` is the
      global byte address of this thread's first chunk (row ``r0``, chunk ``c``) of the tile
      to copy; rows ``>= rows_left`` and columns ``>= cols_left`` (tile-relative) are
      zero-filled through cp.async's src-size, and nothing is read there.

    Every thread of the block calls both; the rows must be whole passes
    (:func:`copy_tile_splits`, else ``ValueError``). The shared tile matches
    :func:`load_a_fragments` / :func:`load_b_fragments` of ``cols`` columns.
    """
    if not copy_tile_splits(rows, cols, threads):
        raise ValueError(f"copy_tile_to_shared: a {rows}x{cols} tile does not split into whole "
                         f"passes of {threads} threads over its 16-byte chunks")
    chunks = cols // 8
    layout.check_swizzle(chunks, swizzle)
    per_pass = threads // chunks
    passes = rows // per_pass
    row_bytes = chunks * 16
    swz = swizzle_fn(chunks, swizzle)
    # XOR on the physical chunk of pass p relative to pass 0 (see the docstring).
    if not swizzle or per_pass % 8 == 0:
        flips = (0,) * passes
    elif 8 % per_pass == 0 and chunks >= 8:
        flips = tuple((p * per_pass) % 8 for p in range(passes))
    else:
        flips = None

    @inline_device
    def setup(tid):
        r0 = tid // chunks
        c = tid % chunks
        return r0, c, r0 * row_bytes + swz(r0, c) * 16

    @inline_device
    def issue(tile_addr, src, r0, c, sh0, row_stride, rows_left, cols_left):
        col_bytes = max(0, min(16, (cols_left - c * 8) * 2))
        for p in range(passes):
            r = r0 + p * per_pass
            nbytes = col_bytes if r < rows_left else 0
            if flips is None:
                sh = r * row_bytes + swz(r, c) * 16
            else:
                sh = (sh0 ^ (flips[p] * 16)) + p * per_pass * row_bytes
            cp_async_cg_16(tile_addr + sh, src + p * per_pass * row_stride, nbytes)

    return setup, issue


# ---- the 128-byte-swizzled layouts wgmma reads ------------------------------------------------
# A row of 128 bytes (64 16-bit elements) per 8-row atom line; chunk c of row r lands at byte
# r·128 + ((c ^ r % 8)·16) of its atom column (tilepy.ptx.wgmma_layout.swizzle, the pattern TMA
# writes). Each thread copies one 16-byte column (chunk) of rows 8 or more apart, so its swizzle
# phase is the same in every pass and its offsets are one base plus constants.


@functools.cache
def copy_rows_to_shared_128b(rows: int, cols: int, threads: int, valid_cols=None):
    """``issue(tile, src, row_stride, rows_left, tid)``: one thread's cp.async copies of a
    (rows × cols) 16-bit tile into 64-column sub-tiles of ``rows × 128`` bytes (sub-tile ``c //
    8`` at ``tile + (c // 8)·rows·128``), 128-byte swizzled — the K-major operand layout of
    wgmma for K = cols (Q, K), and the MN-major one for N = cols (V); rows at or past
    ``rows_left`` are zero-filled, and so are the columns at or past ``valid_cols`` (a
    multiple of 8; default ``cols``: a head dim narrower than its tile, whose source rows
    end there — those chunks read nothing). ``src``: int64 global byte address of the
    tile's row 0, ``row_stride`` in bytes; ``tile``: its shared address, 1024-byte aligned.

    Thread ``tid`` copies 16-byte chunk ``tid % chunks`` of rows ``tid // chunks + p ·
    (threads / chunks)`` (``chunks = cols / 8``): one column and one swizzle phase per thread
    (the row step is a multiple of 8), so its shared offsets are one base plus constants and
    its global ones a base plus multiples of the row stride. Where ``threads / chunks`` is
    4, 2 or 1 (a 256-column tile of 128 threads), the row's chunks are taken in
    ``8 / (threads / chunks)`` groups, each thread one chunk of every group, so that its rows
    stay 8 apart. Every one of the ``threads`` threads calls it; the rows a pass covers
    (``threads / chunks`` times the groups) must divide ``rows``."""
    chunks = cols // 8                    # 16-byte chunks per row
    step = threads // chunks if chunks and threads % chunks == 0 else 0
    groups = 8 // step if step in (1, 2, 4) else 1   # the row's chunks in groups
    per = chunks // groups                # chunks a pass covers per row (of one group)
    step = step * groups                  # rows per pass (a multiple of 8)
    sub_bytes = rows * 128
    valid = chunks if valid_cols is None else valid_cols // 8
    if not (cols % 64 == 0 and step and step % 8 == 0 and rows % step == 0):
        raise ValueError(f"copy_rows_to_shared_128b: a {rows}x{cols} tile (64-column sub-tiles) "
                         f"does not split into passes of {threads} threads with rows a multiple "
                         "of 8 apart")
    if valid_cols is not None and not (0 < valid_cols <= cols and valid_cols % 8 == 0):
        raise ValueError(f"copy_rows_to_shared_128b: valid_cols {valid_cols} must be a "
                         f"multiple of 8 in 8 … {cols}")
    passes = rows // step

    PADDED = valid < chunks

    if groups == 1:
        @inline_device
        def issue(tile, src, row_stride, rows_left, tid):
            c = tid % chunks
            r = tid // chunks
            dst = tile + (c // 8) * sub_bytes + r * 128 + (((c % 8) ^ (r % 8)) * 16)
            a = src + r * row_stride + c * 16
            left = rows_left - r
            if PADDED and c >= valid:
                # a chunk past the valid columns reads nothing: its source is the row's first
                a = src + r * row_stride
                left = 0
            for p in range(passes):
                cp_async_cg_16(dst + p * (step * 128), a + p * step * row_stride,
                               16 if p * step < left else 0)

        return issue

    GB = per * 16               # bytes from a chunk to its twin in the next group
    GSUB = (per // 8) * sub_bytes

    @inline_device
    def issue_groups(tile, src, row_stride, rows_left, tid):
        # the groups' chunks of one row pass after another, the source advanced a pass at a
        # time (one 64-bit add a pass rather than an address per copy held at once)
        c = tid % per
        r = tid // per
        dst = tile + (c // 8) * sub_bytes + r * 128 + (((c % 8) ^ (r % 8)) * 16)
        a = src + r * row_stride + c * 16
        left = rows_left - r
        pass_bytes = step * row_stride
        for p in range(passes):
            n = 16 if p * step < left else 0
            for j in range(groups):
                # past the valid columns: zero-filled from the row's first chunk (selects,
                # not branches)
                ok = not PADDED or c + j * per < valid
                cp_async_cg_16(dst + p * (step * 128) + j * GSUB,
                               a + (j * GB if ok else -c * 16), n if ok else 0)
            a += pass_bytes

    return issue_groups


@functools.cache
def copy_k_major_to_shared_128b(rows: int, threads: int):
    """``issue(dst, dst0, src, row_stride, rows_left, kt, k_left)``: one thread's cp.async
    copies of K step ``kt`` of a (rows × 64) K-major slab — one 128-byte row per m (or n) row,
    128-byte swizzled (wgmma's K-major operand: descriptor SBO 1024, +32 bytes per k16 step).

    Thread ``tid`` copies chunk ``ch = tid % 8`` of rows ``r = tid // 8`` + multiples of
    ``threads / 8``; the caller holds its offsets: ``dst0 = r·128 + ((ch ^ r % 8)·16)`` (bytes
    into the slab at shared address ``dst``), ``src`` the int64 global byte address of its
    chunk at K step 0, ``row_stride`` in bytes. Zero-filled: rows at or past ``rows_left``
    (counted from row ``r``) and, of the chunk, the elements past ``k_left`` (counted from the
    chunk's first column of step ``kt``). Every one of the ``threads`` threads calls it;
    ``rows`` a multiple of ``threads / 8``."""
    RP = threads // 8                # rows per pass: 8 threads cover one 128-byte row
    if threads % 8 or rows % RP:
        raise ValueError(f"copy_k_major_to_shared_128b: {rows} rows are not whole passes of "
                         f"{threads} threads (8 per row)")
    PASSES = rows // RP
    K_BYTES = 128                    # one step of K: 64 16-bit elements

    @inline_device
    def issue(dst, dst0, src, row_stride, rows_left, kt, k_left):
        nb = max(0, min(16, k_left * 2))
        for i in range(PASSES):
            cp_async_cg_16(dst + dst0 + i * RP * 128,
                           src + i * RP * row_stride + kt * K_BYTES,
                           nb if i * RP < rows_left else 0)

    return issue


@functools.cache
def copy_mn_major_to_shared_128b(k_rows: int, cols: int, threads: int):
    """``issue(dst, dst0, src, row_stride, nbytes_j, kt, krows_left)``: one thread's cp.async
    copies of K step ``kt`` (``k_rows`` rows of K) of a row-major (K, N) matrix's ``cols``
    columns, as wgmma's MN-major operand with the 128-byte swizzle: ``cols / 64`` atom columns
    of 64 n × ``k_rows`` k, ``k_rows·128`` bytes apart (descriptor LBO), 8-k atoms 1024 bytes
    apart (SBO); +2048 bytes per k16 step.

    Thread ``tid`` copies chunk ``ch = tid % 8`` (of every atom column) of k rows ``r = tid //
    8`` + multiples of ``threads / 8``; the caller holds ``dst0 = r·128 + ((ch ^ r % 8)·16)``,
    ``src`` (int64 global byte address of its chunk of atom column 0 at K step 0), and
    ``nbytes_j`` (int32 local array of ``cols / 64``: the bytes of its chunk in atom column
    ``j`` inside the matrix, 0 … 16). Rows at or past ``krows_left`` (counted from row ``r``)
    are zero-filled. Every one of the ``threads`` threads calls it; ``k_rows`` a multiple of
    ``threads / 8``."""
    RP = threads // 8
    if threads % 8 or k_rows % RP or cols % 64:
        raise ValueError(f"copy_mn_major_to_shared_128b: {k_rows} k rows x {cols} columns are "
                         f"not whole passes of {threads} threads (8 per row, 64-column atoms)")
    PASSES = k_rows // RP
    NJ = cols // 64
    SUB = k_rows * 128               # bytes of one atom column
    K_ROWS = k_rows

    @inline_device
    def issue(dst, dst0, src, row_stride, nbytes_j, kt, krows_left):
        for i in range(PASSES):
            ok = i * RP < krows_left
            for j in range(NJ):
                cp_async_cg_16(dst + j * SUB + dst0 + i * RP * 128,
                               src + (kt * K_ROWS + i * RP) * row_stride + j * 128,
                               nbytes_j[j] if ok else 0)

    return issue


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


@functools.cache
def load_a_fragments_k_major(mi: int, tile_cols: int, swizzle: bool = True):
    """``(setup, load)`` for one warp's A fragments of one k16 step from a k-major shared tile:
    (k rows × ``tile_cols`` m-columns), A stored transposed — e.g. ``dSᵀ`` written row-major
    when the product needs ``dS`` — loaded with ``ldmatrix.x4.trans``. ``setup(row0, lane)``
    returns this lane's ``(offset, chunk0, xor)`` for the warp's m rows ``row0 …`` (a multiple
    of 16); ``load(frag, buf, tile_addr, kk, offset, chunk0, xor)`` fills ``frag[buf, i,
    0..3]`` for the m16 tiles ``i < mi``, k rows ``16·kk … 16·kk+15``: the same fragments
    :func:`load_a_fragments` gives from the row-major tile."""
    chunks = tile_cols // 8
    layout.check_swizzle(chunks, swizzle)
    mask = _mask_fn(chunks, swizzle)
    step16 = 16 * chunks * 16

    @inline_device
    def setup(row0, lane):
        q = lane // 8
        krow = (q // 2) * 8 + lane % 8
        return krow * chunks * 16, row0 // 8 + q % 2, mask(krow)

    @inline_device
    def load(frag, buf, tile_addr, kk, offset, chunk0, xor):
        addr = tile_addr + offset + kk * step16
        for i in range(mi):
            a0, a1, a2, a3 = ldmatrix_x4_trans(addr + (((chunk0 + 2 * i) ^ xor) << 4))
            frag[buf, i, 0] = a0
            frag[buf, i, 1] = a1
            frag[buf, i, 2] = a2
            frag[buf, i, 3] = a3

    return setup, load


@functools.cache
def store_accumulators_to_shared(mi: int, ni: int, tile_cols: int, dtype: str,
                                 swizzle: bool = True):
    """``store(acc, tile_addr, row0, lane)``: one warp writes its (mi, ni, 4) float32
    accumulator fragment (m16n8 layout, rows ``row0 + 16 i …``, columns ``8 j …``) rounded to
    ``dtype`` (float16 / bfloat16) into a row-major shared tile of ``tile_cols`` 16-bit
    columns, swizzled as :func:`load_a_fragments` / :func:`load_a_fragments_k_major` /
    :func:`load_b_fragments` of ``tile_cols`` read it. ``row0`` a multiple of 16. Each lane
    stores its column pairs as 32-bit words; the caller synchronises before others read."""
    chunks = tile_cols // 8
    layout.check_swizzle(chunks, swizzle)
    mask = _mask_fn(chunks, swizzle)
    row_bytes = chunks * 16
    pack = cvt_f16x2_f32 if dtype == "float16" else cvt_bf16x2_f32

    @inline_device
    def store(acc, tile_addr, row0, lane):
        g = lane // 4
        t = lane % 4
        xor = mask(g)    # rows g and g + 8 (+ 16 i) share it: the swizzle has period 8
        for i in range(mi):
            for hh in range(2):
                base = tile_addr + (row0 + 16 * i + g + 8 * hh) * row_bytes + 4 * t
                for j in range(ni):
                    st_shared_b32(base + ((j ^ xor) << 4),
                                  pack(acc[i, j, 2 * hh], acc[i, j, 2 * hh + 1]))

    return store
