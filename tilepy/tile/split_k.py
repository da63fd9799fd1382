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

Or, with the splits of a tile launched as one thread-block cluster (``cluster = splits``
blocks along x, split ``r`` the block of rank ``r``), :func:`split_k_cluster_reduce`'s
``leader = reduce(acc0, acc1, region, split, t)`` adds them in distributed shared memory, no
global workspace and no semaphore: every thread of every block of the cluster meets at the
cluster barrier (the producer warpgroup too: :func:`split_k_cluster_reduce`'s ``meet``), so
every split's main loop is done and the leader's (split 0's) stage buffers are free; the
other splits store their accumulators into ``region`` of the leader's shared memory (slot
``split - 1``; :func:`cluster_region_bytes`), meet again (release / acquire: the stores
landed), and the leader adds ``p_0 + p_1 + … + p_{splits-1}`` left to right, its own registers
as ``p_0`` — the same bits every run — then its group meets at named barrier ``barrier_id``
(so no thread's epilogue overwrites the region while another still reads it). Returns whether
this block is the leader (it alone runs the epilogue).

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
from ..ptx import cluster as CLU
from ..ptx import vector as VEC
from ..ptx.global_vector import ld_global_v4, st_global_v4


def _parts(n0: int, n1: int) -> list:
    """``(accumulator array, vector index, partial row)`` of each 4-float vector a thread
    holds: ``acc0``'s ``n0`` then ``acc1``'s ``n1``."""
    return [("acc0", j, j) for j in range(n0)] + [("acc1", j, n0 + j) for j in range(n1)]


def _sum_lines(parts, splits: int, first, load) -> list:
    """Written-out lines that set each vector ``(a, j, r)`` of ``parts`` to ``first(a, j, r)``
    plus ``load(sp, r)`` for ``sp`` = 1 … ``splits - 1``, added left to right (one order:
    the same bits every run)."""
    body = []
    for a, j, r in parts:
        body.append(f"x0, x1, x2, x3 = {first(a, j, r)}")
        for sp in range(1, splits):
            body += [f"y0, y1, y2, y3 = {load(sp, r)}",
                     "x0, x1, x2, x3 = x0 + y0, x1 + y1, x2 + y2, x3 + y3"]
        body += [f"{a}[{4 * j + q}] = x{q}" for q in range(4)]
    return body or ["pass"]


@functools.cache
def split_k_reduce(splits: int, n0: int, n1: int, threads: int, barrier_id: int):
    """The ``reduce`` of the module docstring for ``splits`` items per tile, ``n0`` / ``n1``
    vectors of 4 floats per thread in ``acc0`` / ``acc1``, a group of ``threads`` threads
    meeting at named barrier ``barrier_id``. The moves are written out (every register
    index a constant, :func:`tilepy.inline.written_out`: a loop NVVM kept would leave the
    accumulators in local memory)."""
    S, NV = splits, n0 + n1
    parts = _parts(n0, n1)
    ns = {"st": st_global_v4, "ld": ld_global_v4}
    store = written_out(
        "store(acc0, acc1, partials, row, col)",
        [f"st(partials, row + {r}, col, {a}[{4 * j}], {a}[{4 * j + 1}], {a}[{4 * j + 2}], "
         f"{a}[{4 * j + 3}])" for a, j, r in parts] or ["pass"], ns, "split_k store")
    # this item's own partial is read back too: the same bits as its registers, and the
    # same operations whichever item is last
    body = _sum_lines(parts, S, lambda a, j, r: f"ld(partials, first + {r}, col)",
                      lambda sp, r: f"ld(partials, first + {sp * NV + r}, col)")
    add_up = written_out("add_up(acc0, acc1, partials, first, col)", body, ns,
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


def cluster_region_bytes(splits: int, n0: int, n1: int, threads: int) -> int:
    """Bytes of the leader's shared memory that :func:`split_k_cluster_reduce` fills: a slot of
    ``(n0 + n1) · 16 · threads`` bytes for each split but the first."""
    return (splits - 1) * (n0 + n1) * 16 * threads


@functools.cache
def split_k_cluster_reduce(splits: int, n0: int, n1: int, threads: int, barrier_id: int):
    """The cluster form of the module docstring: ``reduce(acc0, acc1, region, split, t) ->
    bool`` for a group of ``threads`` threads (``t`` the thread's index in it) holding ``n0``
    / ``n1`` vectors of 4 floats in ``acc0`` / ``acc1``, ``region`` a 16-byte-aligned shared
    address (:func:`cluster_region_bytes` free bytes in the leader once every split's main
    loop is done); and ``meet()``: the two cluster barriers alone, for the cluster's other
    threads (each calls it once per reduction). ``splits`` in 2 … 8 (a portable cluster).
    Vector ``j`` of every thread is contiguous (16 bytes a thread): the stores of a warp are
    512 contiguous bytes."""
    if not 2 <= splits <= 8:
        raise ValueError(f"split_k_cluster_reduce: splits {splits} must be 2 … 8 (the blocks "
                         f"of a portable cluster)")
    S, NV = splits, n0 + n1
    ROW = 16 * threads                       # one vector of every thread
    parts = _parts(n0, n1)
    ns = {"st": CLU.st_shared_cluster_v4_f32, "ld": VEC.ld_shared_v4_f32}
    push = written_out(
        "push(acc0, acc1, dst)",
        [f"st(dst + {r * ROW}, {a}[{4 * j}], {a}[{4 * j + 1}], {a}[{4 * j + 2}], "
         f"{a}[{4 * j + 3}])" for a, j, r in parts] or ["pass"], ns, "split_k push")
    body = _sum_lines(parts, S, lambda a, j, r: ", ".join(f"{a}[{4 * j + q}]"
                                                          for q in range(4)),
                      lambda sp, r: f"ld(src + {((sp - 1) * NV + r) * ROW})")
    add_up = written_out("add_up(acc0, acc1, src)", body, ns, "split_k cluster add_up")

    @inline_device
    def meet():
        CLU.cluster_arrive()
        CLU.cluster_wait()
        CLU.cluster_arrive()
        CLU.cluster_wait()

    @inline_device
    def reduce(acc0, acc1, region, split, t):
        CLU.cluster_arrive()                 # every split's main loop done
        CLU.cluster_wait()
        if split != 0:
            push(acc0, acc1, CLU.mapa_shared(region + ((split - 1) * NV * ROW + 16 * t), 0))
        CLU.cluster_arrive()                 # (release) the partials stored …
        CLU.cluster_wait()                   # (acquire) … and seen by the leader
        if split == 0:
            add_up(acc0, acc1, region + 16 * t)
            BAR.bar_sync(barrier_id, threads)
        return split == 0

    return device_namespace(
        f"split_k_cluster_reduce({splits}, {n0}, {n1}, {threads}, {barrier_id})",
        reduce=reduce, meet=meet)
