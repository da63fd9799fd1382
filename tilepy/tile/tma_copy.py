"""TMA tile loads: a tile of ``boxes`` 128-byte-swizzled boxes, issued by one thread, completing
on one mbarrier.

A tile operand wider than one swizzle row (64 16-bit elements) is loaded as several boxes
side by side along the tensor's contiguous dimension: box ``j`` covers elements ``x + 64·j …``
and lands at ``dst + j · box_bytes`` — the layout :class:`tilepy.tile.warpgroup_mma.SmemOperand`
describes (K-major operands: boxes along K; MN-major: boxes along M or N). The tensor map
(:func:`tilepy.tile.tma.encode_tiled`, 128-byte swizzle, box of ``box_bytes / 128`` rows × 64
elements) names the tensor; its coordinates are innermost first (x = the contiguous
dimension). TMA zero-fills what lies outside the tensor and still counts the whole box's
bytes, so edge tiles need no predication and the expect-tx count is always :data:`NBYTES`.

The issuing thread arms the barrier first (:func:`tilepy.tile.pipeline.tma_pipeline`'s
``commit``) and must have fenced the tensor map (``fence_proxy_tensormap_acquire``) once.
With ``multicast`` the loads go to the same offset in every block of the cluster named by the
mask (:mod:`tilepy.ptx.cluster`), each completing on that block's barrier at the same offset.
"""

from __future__ import annotations

import functools

from ..inline import device_namespace, inline_device
from ..ptx import cluster as CLU
from ..ptx import tma as T

BOX = 64   # elements along the contiguous dimension of a 128-byte-swizzled 16-bit box


@functools.cache
def tma_tile(boxes: int, box_bytes: int):
    """Loads of a tile of ``boxes`` boxes of ``box_bytes`` each (module docstring):

    * ``load_2d(dst, tmap, bar, x, y)``, ``load_3d(…, z)``, ``load_4d(…, z, w)``;
    * ``load(dst, tmap, bar, x, y, z, batched)``: a 3-D map's batch ``z`` when ``batched``,
      else a 2-D map (an operand with one matrix, broadcast over the batch);
    * ``load_multicast(dst, tmap, bar, x, y, z, batched, mask)``: the same into every block of
      the cluster in ``mask``.

    Constant: ``NBYTES`` (the bytes the tile delivers to each destination block)."""

    @inline_device
    def load_2d(dst, tmap, bar, x, y):
        for j in range(boxes):
            T.tma_load_2d(dst + j * box_bytes, tmap, bar, x + j * BOX, y)

    @inline_device
    def load_3d(dst, tmap, bar, x, y, z):
        for j in range(boxes):
            T.tma_load_3d(dst + j * box_bytes, tmap, bar, x + j * BOX, y, z)

    @inline_device
    def load_4d(dst, tmap, bar, x, y, z, w):
        for j in range(boxes):
            T.tma_load_4d(dst + j * box_bytes, tmap, bar, x + j * BOX, y, z, w)

    @inline_device
    def load(dst, tmap, bar, x, y, z, batched):
        if batched:
            load_3d(dst, tmap, bar, x, y, z)
        else:
            load_2d(dst, tmap, bar, x, y)

    @inline_device
    def load_multicast(dst, tmap, bar, x, y, z, batched, mask):
        for j in range(boxes):
            if batched:
                CLU.tma_load_3d_multicast(dst + j * box_bytes, tmap, bar, x + j * BOX, y, z,
                                          mask)
            else:
                CLU.tma_load_2d_multicast(dst + j * box_bytes, tmap, bar, x + j * BOX, y,
                                          mask)

    return device_namespace(f"tma_tile({boxes}, {box_bytes})", load_2d=load_2d,
                            load_3d=load_3d, load_4d=load_4d, load=load,
                            load_multicast=load_multicast, NBYTES=boxes * box_bytes)
