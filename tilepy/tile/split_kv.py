"""Flash-decoding's merge of split partials inside the splitting kernel: the warp whose split
of a row tile finishes last merges the tile's partials, so no second kernel runs.

A kernel that cuts a tile of ``R = 16`` query rows' keys into ``n`` runs (splits), each run a
warp anywhere in the grid, has each warp write its run's float32 partials — the output rows
normalised over the run, and the run's natural-log LSE (-inf and a zero row for a run that
saw no key) — then call, with every lane of the warp:

* ``last = arrive(counters, slot, n, lane) -> bool`` — each lane fences its writes
  (``membar.gl``), the warp meets, lane 0 adds one to ``counters[slot]`` (int32, zero before
  the tile's first arrival) and the warp learns whether it brought the count to ``n``. That
  warp — the tile's last — sets the counter back to zero (the next launch finds it so) and
  fences again before it reads the others' partials (the classic release / acquire order).
* ``total = merge(parts, plse, pfirst, pstride, lcol, valid, n, w_addr, lane, x)`` — by the
  last warp only: ``parts`` a 2-D float32 array whose row ``pfirst + s · pstride + i`` holds
  row ``i`` of run ``s`` (``head_dim`` columns, 16-byte aligned rows), ``plse`` a 2-D float32
  array whose ``[s, lcol]`` is the LSE of run ``s`` for the row of this lane (row ``lane %
  16``; ``lcol`` is read only for rows below ``valid``). Into ``x`` (a local float32 array
  (16, :func:`columns` of ``head_dim``)) go the merged rows ``i < valid``: lane ``lane`` holds
  columns ``4 · (lane + 32 j) … + 3`` at ``x[i, 4 j …]``, ``Σ_s exp(lse_s - lse) · part_s``
  with ``lse = log Σ_s exp(lse_s)``; the return value is that LSE of row ``lane % 16`` (-inf
  where no run saw a key, whose row is then zero; NaN, and a NaN row, where a run's LSE is
  NaN). Each row's LSE is reduced by its two
  lanes (runs of one parity each), the weights go to shared memory at ``w_addr`` (``64 · n``
  bytes the warp owns), and the rows are summed over the runs in run order: the same float32
  operations whichever warp is last, so the same bits every run of the kernel.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ..inline import device_namespace, inline_device
from ..ptx.barrier import warp_sync
from ..ptx.global_vector import ld_global_v4
from ..ptx.math import f32_as_u32, fmax_nan
from ..ptx.shuffle import shfl_idx, shfl_xor
from ..ptx.vector import ld_shared_f32, st_shared_b32

#: Rows of the tile a merging warp handles (an mma.sync m16 tile).
ROWS = 16

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)


def columns(head_dim: int) -> int:
    """The float32 columns of one row a lane holds after :func:`split_merge`'s ``merge``: four
    for every 128 columns of ``head_dim`` (a 16-byte vector per lane)."""
    return 4 * -(-head_dim // 128)


def weight_bytes(splits: int) -> int:
    """Shared memory the merge's weights take for ``splits`` runs."""
    return 4 * ROWS * splits


@functools.cache
def split_merge(head_dim: int):
    """``arrive`` and ``merge`` of the module docstring for rows of ``head_dim`` columns (a
    multiple of 4)."""
    if head_dim % 4 or head_dim <= 0:
        raise ValueError(f"split_merge: head_dim must be a positive multiple of 4, got "
                         f"{head_dim!r}")
    D = head_dim
    NV = -(-head_dim // 128)      # 16-byte vectors a lane loads per row
    R = ROWS

    @inline_device
    def arrive(counters, slot, n, lane):
        cuda.threadfence()
        warp_sync()
        old = np.int32(0)
        if lane == 0:
            old = cuda.atomic.add(counters, slot, np.int32(1))
        old = shfl_idx(old, 0)
        last = np.int64(old) == n - 1
        if last:
            if lane == 0:
                counters[slot] = 0
            cuda.threadfence()
        return last

    @inline_device
    def merge(parts, plse, pfirst, pstride, lcol, valid, n, w_addr, lane, x):
        r = lane % R
        h = lane // R             # this lane's runs: those of parity h
        live = r < valid
        top = _NEG_INF
        if live:
            for s in range(h, n, 2):
                top = fmax_nan(top, plse[s, lcol])     # (a NaN LSE is kept)
        top = fmax_nan(top, shfl_xor(top, R))
        acc = _ZERO
        if live and top != _NEG_INF:
            for s in range(h, n, 2):
                acc += math.exp(plse[s, lcol] - top)
        acc += shfl_xor(acc, R)
        total = top + math.log(acc) if top != _NEG_INF else _NEG_INF
        if live:
            for s in range(h, n, 2):
                w = math.exp(plse[s, lcol] - total) if total != _NEG_INF else _ZERO
                st_shared_b32(w_addr + 4 * (s * R + r), f32_as_u32(w))
        warp_sync()
        for i in range(R):
            for k in range(4 * NV):
                x[i, k] = _ZERO
        for s in range(n):
            row = pfirst + s * pstride
            for i in range(R):
                if i < valid:
                    w = ld_shared_f32(w_addr + 4 * (s * R + i))
                    for j in range(NV):
                        c = 4 * (lane + 32 * j)
                        if c < D:
                            v0, v1, v2, v3 = ld_global_v4(parts, row + i, c)
                            x[i, 4 * j] += w * v0
                            x[i, 4 * j + 1] += w * v1
                            x[i, 4 * j + 2] += w * v2
                            x[i, 4 * j + 3] += w * v3
        return total

    return device_namespace(f"split_merge({head_dim})", arrive=arrive, merge=merge)
