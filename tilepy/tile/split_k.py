"""Split-K's deterministic reduction: the partial accumulators of a tile's K ranges summed by
whichever block finishes the tile last, in split order, with no block waiting on another.

A kernel that cuts each output tile's K steps into ``splits`` work items (items of one tile on
any blocks, in any order) calls, after an item's main loop, with every thread of the group that
holds the tile's accumulators (``threads`` threads, each holding its part of the tile in
float32 registers):

* ``last = reduce(acc0, acc1, partials, counters, tile, split, t, flag) -> bool`` — the item's
  accumulators (``n0`` 4-float vectors of ``acc0``, then ``n1`` of ``acc1``) are written to
  its slot of ``partials``, a float32 array of (tiles · splits · (n0 + n1), 4 · threads):
  row ``(tile · splits + split) · (n0 + n1) + j``, columns ``4t … 4t + 3`` (so a warp's
  16-byte stores are contiguous). Each thread fences; the group meets at named barrier
  ``barrier_id``; thread ``t == 0`` adds one to ``counters[tile]`` (int32, zero before the
  tile's first item) and tells the group through the shared word at ``flag`` whether it
  brought the count to ``splits``. That item's threads — the tile's last — set the counter
  back to zero (the next launch finds it so), fence, and replace their accumulators by
  ``p_0 + p_1 + … + p_{splits-1}``, added left to right, every partial (their own too)
  read back from ``partials``: the same float32 operations whichever item is last, so the
  same bits every run. Returns whether this item is the tile's last (it then runs the epilogue;
  the others skip it).

The group's threads must all call ``reduce`` for the same item (the named barrier counts
``threads``); ``t`` is the thread's index in the group, ``flag`` a 4-byte-aligned shared
address the group owns. The memory order is the classic one (a release fence by every writer
before the counted arrival, an acquire fence by the last item's threads after it).
"""

from __future__ import annotations

import functools

from numba import cuda

from ..inline import device_namespace, inline_device, written_out
from ..ptx import barrier as BAR
from ..ptx import vector as VEC
from ..ptx.global_vector import ld_global_v4, st_global_v4


@functools.cache
def split_k_reduce(splits: int, n0: int, n1: int, threads: int, barrier_id: int):
    """The ``reduce`` of the module docstring for ``splits`` items per tile, ``n0`` / ``n1``
    vectors of 4 floats per thread in ``acc0`` / ``acc1``, a group of ``threads`` threads
    meeting at named barrier ``barrier_id``. The moves are written out (every register
    index a constant, :func:`tilepy.inline.written_out`: a loop NVVM kept would leave the
    accumulators in local memory)."""
    S, N0, NV = splits, n0, n0 + n1
    parts = [("acc0", j, j) for j in range(n0)] + [("acc1", j, n0 + j) for j in range(n1)]
    ns = {"st": st_global_v4, "ld": ld_global_v4}
    store = written_out(
        "store(acc0, acc1, partials, row, col)",
        [f"st(partials, row + {r}, col, {a}[{4 * j}], {a}[{4 * j + 1}], {a}[{4 * j + 2}], "
         f"{a}[{4 * j + 3}])" for a, j, r in parts] or ["pass"], ns, "split_k store")
    body = []
    for a, j, r in parts:
        # this item's own partial is read back too: the same bits as its registers, and
        # the same operations whichever item is last
        body.append(f"x0, x1, x2, x3 = ld(partials, first + {r}, col)")
        for sp in range(1, S):
            body += [f"y0, y1, y2, y3 = ld(partials, first + {sp * NV + r}, col)",
                     "x0, x1, x2, x3 = x0 + y0, x1 + y1, x2 + y2, x3 + y3"]
        body += [f"{a}[{4 * j + q}] = x{q}" for q in range(4)]
    add_up = written_out("add_up(acc0, acc1, partials, first, col)", body or ["pass"], ns,
                         "split_k add_up")

    @inline_device
    def reduce(acc0, acc1, partials, counters, tile, split, t, flag):
        store(acc0, acc1, partials, (tile * S + split) * NV, 4 * t)
        cuda.threadfence()
        BAR.bar_sync(barrier_id, threads)
        if t == 0:
            last = cuda.atomic.add(counters, tile, 1) == S - 1
            if last:
                counters[tile] = 0
            VEC.st_shared_b32(flag, 1 if last else 0)
        BAR.bar_sync(barrier_id, threads)
        is_last = VEC.ld_shared_b32(flag) != 0
        if is_last:
            cuda.threadfence()
            add_up(acc0, acc1, partials, tile * S * NV, 4 * t)
        return is_last

    return device_namespace(f"split_k_reduce({splits}, {n0}, {n1}, {threads}, {barrier_id})",
                            reduce=reduce)
