"""Tile schedulers: which output tile a block computes next.

A tile kernel numbers its work items ``w = 0 … total − 1`` (tiles of every batch / head) and
asks a scheduler for each one's coordinates and for the sequence of items a block takes:

* :func:`grouped_raster` — item ``w`` → ``(z, row0, col0)`` with ``group_m`` block rows
  walked together inside each batch (a group's blocks share B panels in L2), as Triton's
  matmul tutorial orders them; with clusters, an item is a cluster's (``cluster`` row blocks
  in the same columns, the block of cluster rank ``r`` taking the rank-``r`` rows).
* :func:`static_persistent` — the block's first item and stride: one item per block for a
  grid of one block per tile (stride: the grid), or a persistent grid of fewer blocks than
  tiles that walk the items with the grid's stride (the producer runs ahead into the next
  tile while the consumers finish one).
* :func:`ticket_scheduler` — items drawn at run time from a global counter (an int32[2] the
  host zeroes once: :class:`tilepy.tile.tma_plan.ScheduledTmaPlan`): the first item is the
  block index, each further one ``atomic_add(counter, 1) + gridDim.x``; the last block out
  sets the counter back to zero for the next launch on the stream. Balances tiles of unequal
  work (causal attention) as the hardware's block scheduler would.
* :func:`group_end` — a grouped GEMM's groups from their cumulative row ends (``offsets``,
  ``torch._grouped_mm``'s convention), clamped so that groups never overlap or leave the rows.
* :func:`heavy_first` — attention's item order: query blocks of a (batch, head) fastest, or,
  causal, groups of (batch, head) whose K and V fit an L2 budget, in each the query blocks from
  the heaviest (the last, which sees every key) down.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..inline import device_namespace, inline_device

#: heavy_first: the (batch, head) group's K and V bytes that should stay in L2 together
L2_GROUP_BYTES = 16 << 20


@inline_device
def udiv(a, b):
    """``a // b`` (int64) for ``0 <= a < 2**32`` and ``0 < b < 2**32``, as one 32-bit unsigned
    division. Index arithmetic by a value known only at run time (a tile count, a grid's
    stride) should use it, and a block's walk over its items should not be a ``range`` with a
    run-time step (whose trip count is such a division): a 64-bit division is a call to the
    division routine in the machine code (``__cuda_sm20_div_u64``), and where the kernel is
    assembled as a separate compilation unit (a linker without link-time optimisation) a
    call makes ptxas serialise every wgmma of the kernel (note C7509)."""
    return np.int64(np.uint32(a) // np.uint32(b))


@inline_device
def group_end(offsets, g, start, total):
    """The end of group ``g``'s rows (int64), whose rows start at ``start`` (the previous
    group's end; 0 for the first): ``offsets[g]`` clamped into ``start … total``, so that
    groups never overlap and never leave the ``total`` rows whatever the device holds."""
    return min(max(np.int64(offsets[g]), start), total)


@functools.cache
def grouped_raster(block_m: int, block_n: int, group_m: int = 8, cluster: int = 1):
    """``tile_origin(w, tiles_m, tiles_n) -> (z, row0, col0)``: work item ``w`` of a grid of
    ``tiles_m`` × ``tiles_n`` tiles per batch (``tiles_m`` counting a cluster's ``cluster ·
    block_m`` rows as one) in grouped order; ``group_m`` is counted in blocks (so a cluster
    walks ``group_m / cluster`` cluster rows)."""
    BM, BN, CL = block_m, block_n, cluster
    GROUP = max(1, group_m // CL)

    @inline_device
    def tile_origin(w, tiles_m, tiles_n):
        # (32-bit unsigned divisions: udiv)
        tiles = tiles_m * tiles_n
        z = udiv(w, tiles)
        pid = w - z * tiles
        width = GROUP * tiles_n
        band = udiv(pid, width)
        first = band * GROUP
        rows = min(tiles_m - first, GROUP)
        within = pid - band * width
        tn = udiv(within, rows)
        tm = first + within - tn * rows
        if CL == 1:
            return z, tm * BM, tn * BN
        return z, (tm * CL + cuda.blockIdx.x % CL) * BM, tn * BN

    return device_namespace(f"grouped_raster({block_m}, {block_n}, {group_m}, {cluster})",
                            tile_origin=tile_origin)


@functools.cache
def static_persistent(cluster: int = 1):
    """``first_and_step() -> (w0, step)``: the block's first work item and the stride to its
    next one, over a grid (x, y) of blocks in clusters of ``cluster`` along x (an item is a
    cluster's). With one block per item, the block's loop runs once."""
    CL = cluster

    @inline_device
    def first_and_step():
        if CL > 1:
            return (cuda.blockIdx.x // CL + cuda.blockIdx.y * (cuda.gridDim.x // CL),
                    (cuda.gridDim.x // CL) * cuda.gridDim.y)
        return (cuda.blockIdx.x + cuda.blockIdx.y * cuda.gridDim.x,
                cuda.gridDim.x * cuda.gridDim.y)

    return device_namespace(f"static_persistent({cluster})", first_and_step=first_and_step)


@functools.cache
def ticket_scheduler():
    """Run-time tile tickets (module docstring), called by ONE thread of the block:

    * ``first()``: the block's first item (its index);
    * ``draw(counter) -> item``: the next item (``≥ total`` once none is left);
    * ``finish(counter)``: after the last draw; the last block to finish zeroes ``counter``.
    """

    @inline_device
    def first():
        return cuda.blockIdx.x

    @inline_device
    def draw(counter):
        return cuda.atomic.add(counter, 0, 1) + cuda.gridDim.x

    @inline_device
    def finish(counter):
        cuda.threadfence()
        if cuda.atomic.add(counter, 1, 1) == cuda.gridDim.x - 1:
            cuda.threadfence()        # every other block's last draw before the reset
            counter[0] = 0
            counter[1] = 0

    return device_namespace("ticket_scheduler()", first=first, draw=draw, finish=finish)


@functools.cache
def heavy_first(head_dim: int, causal: bool):
    """``at(tile, n_qb, heads, batch, sk) -> (b, h, qb)``: attention's tile order (module
    docstring) for K and V rows of ``head_dim`` 16-bit elements each."""
    CAUSAL = bool(causal)
    KV_ROW = 4 * head_dim                  # bytes of K and V per key

    @inline_device
    def at(tile, n_qb, heads, batch, sk):
        # (32-bit unsigned divisions: udiv)
        if CAUSAL:
            total = heads * batch
            kv = KV_ROW * max(sk, 1)
            per = min(1 if kv >= L2_GROUP_BYTES else udiv(L2_GROUP_BYTES, kv), total)
            first = udiv(tile, per * n_qb) * per
            members = min(per, total - first)
            r = tile - first * n_qb
            step = udiv(r, members)
            qb = n_qb - 1 - step
            bh = first + r - step * members
        else:
            bh = udiv(tile, n_qb)
            qb = tile - bh * n_qb
        b = udiv(bh, heads)
        return b, bh - b * heads, qb

    return device_namespace(f"heavy_first({head_dim}, {causal})", at=at)
