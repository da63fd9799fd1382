"""Decoding attention on mma.sync: a few query rows per sequence against a long KV cache,
split along the keys (flash-decoding), the query heads of one KV head packed into one tile.

``decode_kernel(cfg, left, right, has_lse, split, softcap, paged)`` returns a ``@cuda.jit``
kernel

    kernel(q, k, v, o, lse, scale, scale_log2, keys)

of ``cfg.warps`` warps per block, grid :func:`grid` = (row tiles · splits / warps, Hkv, B):

* ``q`` (B, Hkv, Sq, G, D) uint16 bits of float16 / bfloat16 (``cfg.dtype``): query row ``i``
  of query head ``hk · G + g`` at ``q[b, hk, i, g]`` — a strided view of the user's (B, Sq,
  Hq, D) tensor (:func:`packed_view`), ``G = Hq / Hkv``. The block's tile holds 16 *packed
  rows* ``r = i · G + g`` (row tile ``rt``: packed rows ``16 rt …``), so K and V are read once
  for the G query heads of their KV head.
* ``k`` / ``v``: the cache, as :func:`tilepy.ops.attention_mma_sync.attention_kernel`'s
  ``cache`` parameter reads it — contiguous (B, Hkv, capacity, D), or ``paged`` (pages, Hkv,
  page_size, D) with ``page_size`` a multiple of ``cfg.block_n``, or with ``page_rows`` (a
  generator parameter) pages of ``page_rows`` keys, a divisor of ``cfg.block_n``: a key block
  then gathers ``block_n / page_rows`` pages.
* ``keys`` = ``(seqlens, added[, block_table])``: batch ``b`` sees its first ``min(max(
  seqlens[b] + added, 0), capacity)`` keys (int32 ``seqlens``, int64 ``added``); paged, key
  ``j`` at row ``j % page_size`` of page ``block_table[b, j // page_size]``, an entry outside
  ``0 … pages - 1`` clamped into range (never read out of bounds).
* The key window ``(left, right)`` (-1 unbounded; causal is ``right = 0``) aligns to each
  batch's bottom-right diagonal: query row ``i`` sits at position ``sk - Sq + i``.
  ``softcap > 0``: ``softcap · tanh(score / softcap)`` on the scaled scores.
* Without ``split``: ``o`` (B, Hkv, Sq, G, D) uint16, the normalised output rows, and with
  ``has_lse`` ``lse`` (B, Hkv, G, Sq) float32, the natural-log LSE (-inf for a row that sees
  no key, whose output row is 0).
* With ``split``: warp ``w`` of block ``x = rt · (splits / warps) + j`` takes split ``s = j ·
  warps + w``, the ``s``-th of ``splits`` runs of the key blocks its rows see, as even as whole
  blocks allow (key blocks ``[s·n // splits, (s+1)·n // splits)`` of the ``n``; several
  warps: each its own run, Q tile and ring, meeting only itself), and writes float32
  partials —
  ``o`` (splits, B, Hkv, Sq, G, D) normalised over its run, ``lse`` (splits, B, Hkv, G, Sq)
  its run's LSE (-inf and a zero row for an empty run) — which :func:`combine_kernel`
  merges. ``has_lse`` is then ignored (the partial LSE is always written).

Per warp: the Q tile (16 × D) by cp.async (:func:`tilepy.tile.copy.
copy_grouped_rows_to_shared`), ldmatrix into A fragments kept in registers; key blocks of
``block_n`` keys stream through a ``cfg.stages``-deep cp.async ring; S = Q·Kᵀ, mask,
online softmax and O += P·V as in the forward kernel (the same :mod:`tilepy.tile` pieces).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..launch import LaunchPlan
from ..tile import device_write
from ..tile.stream_counter import CountedLaunchPlan
from ..ptx import global_addr, shared_addr
from ..ptx.asm import SIMULATOR
from ..ptx.barrier import mark_warp_specialised, warp_sync
from ..ptx.cp_async import cp_async_commit_group, cp_async_wait_group
from ..ptx.griddep import griddepcontrol_launch_dependents, griddepcontrol_wait
from ..ptx.math import cvt_bf16x2_f32, cvt_f16x2_f32, fmax_nan
from ..tile.attention import limits_shape, mask_key_block, modify_scores, softcap_score
from ..tile.config import DTYPES, SMEM_LIMIT
from ..tile.copy import (copy_grouped_rows_to_shared, copy_rows_to_shared, load_a_fragments,
                         load_b_fragments)
from ..tile.mma import _MMA
from ..tile.online_softmax import online_softmax_finalize, online_softmax_update
from ..tile.reduce import warp_reduce
from ..tile.smem import allow_dynamic_shared, dynamic_shared
from ..tile.split_kv import columns, split_merge, weight_bytes
from ..tile.trace import SCRATCH_BYTES
from ..tile.trace import WIDTH as TRACE_WIDTH
from ..tile.trace import phase_marks
from ..inline import device_namespace, inline_device
from ..kcache import cached_jit
from .attention_mma_sync import HEAD_DIMS, LOG2E, KeyTiles

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)

#: Packed rows of one tile (one warp, one m16 tile).
ROWS = 16


@dataclass(frozen=True)
class DecodeConfig(KeyTiles):
    """One decoding kernel: 16 packed query rows a warp, ``block_n`` keys a step, ``stages``
    key blocks in flight; ``warps`` warps a block, each on its own run of the keys (its own
    split) with its own Q tile and ring. Shared memory: per warp the Q tile plus ``stages`` K
    and V tiles, ``(16 + 2 · stages · block_n) · tile_dim · 2`` bytes."""

    head_dim: int
    block_n: int = 64
    stages: int = 2
    dtype: str = "float16"
    cc: tuple = (9, 0)
    warps: int = 1

    def __post_init__(self):
        def need(ok, message):
            if not ok:
                raise ValueError(f"DecodeConfig: {message}")

        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.head_dim in HEAD_DIMS, f"head_dim must be one of {HEAD_DIMS}, got "
             f"{self.head_dim!r}")
        need(isinstance(self.block_n, int) and self.block_n > 0 and self.block_n % 16 == 0,
             f"block_n={self.block_n!r} is not a positive multiple of 16")
        need(isinstance(self.stages, int) and 2 <= self.stages <= 8,
             f"stages={self.stages!r} must be 2 … 8")
        need(self.warps in (1, 2, 4, 8), f"warps={self.warps!r} must be 1, 2, 4 or 8")
        limit = SMEM_LIMIT.get(tuple(self.cc[:2]), 99 * 1024)
        need(self.smem_bytes <= limit, f"{self.smem_bytes} B of shared memory exceeds the "
             f"{limit} B a block may use on sm_{self.cc[0]}{self.cc[1]}")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def q_bytes(self) -> int:
        return ROWS * self.tile_dim * 2

    @property
    def warp_bytes(self) -> int:
        """Shared memory of one warp: its Q tile and its ring."""
        return self.q_bytes + self.stages * 2 * self.tile_bytes

    @property
    def smem_bytes(self) -> int:
        return self.warps * self.warp_bytes

    def describe(self) -> str:
        return (f"decode BN={self.block_n} D={self.head_dim}, {self.warps} warp(s) x 16 packed "
                f"rows, {self.stages} stages, {self.dtype}, {self.smem_bytes // 1024} KB smem")


def _kernel_jit(disk_cache: bool, threads: int = 32):
    """The jit decorator of a kernel launched with ``threads`` threads (its launch bound)."""
    if SIMULATOR:
        return cuda.jit
    return cached_jit(launch_bounds=threads) if disk_cache else \
        cuda.jit(launch_bounds=threads)


#: The phase marks of a traced decoding kernel (``decode_kernel(..., trace=True)``; columns
#: of :mod:`tilepy.tile.trace`, a row per warp: block row · warps + warp), noted by each warp's
#: lane 0 in a shared-memory row of its own (the kernel's ``smem_bytes`` grow by
#: ``warps · SCRATCH_BYTES``) and written out at its end: ``entry``, ``q_landed`` (its Q tile in shared memory), ``first_kv`` (its first key block
#: landed), ``loop_end`` (its last key block done), ``stored`` (its rows / partials written);
#: values ``smid``, ``key_blocks`` (of its run) and ``split``.
TRACE_MARKS = {"entry": 0, "q_landed": 1, "first_kv": 2, "loop_end": 3, "stored": 4,
               "smid": 0, "key_blocks": 1, "split": 2}


@functools.cache
def decode_kernel(cfg: DecodeConfig, left: int = -1, right: int = 0, has_lse: bool = False,
                  split: bool = False, softcap: float = 0.0, paged: bool = False,
                  trace: bool = False, trigger: bool = False, fused: bool = False,
                  page_rows: int = 0):
    """The kernel of the module docstring for ``cfg``, generated once per argument set.
    ``trace``: the kernel takes a last argument, a uint64 array of :mod:`tilepy.tile.trace`
    rows (one per warp of the grid), and marks :data:`TRACE_MARKS` in it. ``trigger``
    (sm_90): each warp, its key loop done, lets a dependent launch (the combine kernel
    launched with ``LaunchPlan(..., dependent=True)``) begin
    (:func:`tilepy.ptx.griddep.griddepcontrol_launch_dependents`).

    ``page_rows`` (paged only; 0: pages of at least ``block_n`` keys): the cache's pages hold
    that many keys, a multiple of 16 dividing ``block_n`` (16 for 32-key blocks): each key
    block is copied as ``block_n / page_rows`` pieces, each from its own page (so small pages
    keep the key blocks of a large one).

    ``fused`` (with ``split``): the splits merge themselves, no combine kernel — the kernel
    takes ``fin = (parts, plse, out, out_lse, counters)`` after ``keys``: ``parts`` / ``plse``
    2-D views of its own partials ``o`` (S · B · Hkv · Sq · G, D) and ``lse`` (S, B · Hkv · G
    · Sq), ``out`` / ``out_lse`` the merged results as the unsplit kernel writes them (``o`` /
    ``lse`` there; ``out_lse`` written with ``has_lse``), ``counters`` int32 (B · Hkv · row
    tiles,), zero before the launch and left at zero. Each warp, its partials written,
    counts itself in its row tile's counter; the tile's last warp merges the tile
    (:func:`tilepy.tile.split_kv.split_merge`: the same bits whichever warp is last), its
    weights in its own shared memory (``64 · splits`` bytes: :func:`fused_fits`)."""
    BN, D, STAGES = cfg.block_n, cfg.tile_dim, cfg.stages
    VALID = None if cfg.head_dim == D else cfg.head_dim
    KD, NS, KN, NO = D // 16, BN // 8, BN // 16, D // 8
    NO_STORE = cfg.head_dim // 8     # n8 tiles of O that are stored
    SW = cfg.swizzle
    Q_BYTES, TILE = cfg.q_bytes, cfg.tile_bytes
    STAGE = 2 * TILE
    WAIT_Q, WAIT_KV = STAGES - 1, STAGES - 2     # cp.async groups left in flight
    UPPER, LOWER = right >= 0, left >= 0
    R, L = right, left
    WIN = (left, right)
    LIMITS = limits_shape(1, False, WIN)
    SPLIT, PAGED = bool(split), bool(paged)
    SEGS = 1
    if page_rows:
        if not PAGED or page_rows % 16 or BN % page_rows:
            raise ValueError(f"page_rows={page_rows!r}: a paged cache's pages of a multiple of "
                             f"16 keys dividing block_n={BN}")
        SEGS = BN // page_rows
    SEG_ROWS = BN // SEGS
    SEG_BYTES = SEG_ROWS * D * 2        # a piece's rows in the shared tile (row pitch D · 2)
    TRIGGER = bool(trigger)
    HAS_LSE = bool(has_lse) or SPLIT
    CAP = float(softcap) > 0
    WARPS, PER_WARP = cfg.warps, cfg.warp_bytes
    if WARPS > 1 and not SPLIT:
        raise ValueError("a decoding kernel of several warps writes split partials (split=True)")
    FUSED = bool(fused)
    FINAL_LSE = bool(has_lse)
    if FUSED and not SPLIT:
        raise ValueError("a decoding kernel that merges its splits (fused=True) splits them "
                         "(split=True)")
    if FUSED and TRIGGER:
        raise ValueError("a decoding kernel that merges its splits (fused=True) has no "
                         "dependent launch to trigger")
    sm = split_merge(cfg.head_dim)
    MCOLS = columns(cfg.head_dim)
    HEAD = cfg.head_dim

    mma = _MMA[cfg.dtype]
    pack = cvt_f16x2_f32 if cfg.dtype == "float16" else cvt_bf16x2_f32
    smem = dynamic_shared()
    issue_q = copy_grouped_rows_to_shared(ROWS, D, 32, SW, VALID)
    setup_kv, issue_kv = copy_rows_to_shared(BN, D, 32, SW, VALID)
    # (a piece's rows start a multiple of 8 rows into the tile: the same swizzle phases)
    issue_seg = copy_rows_to_shared(SEG_ROWS, D, 32, SW, VALID)[1]
    setup_fq, load_q = load_a_fragments(1, D, SW)
    setup_fk, load_k = load_b_fragments(NS, D, False, SW)
    setup_fv, load_v = load_b_fragments(NO, D, True, SW)
    update = online_softmax_update(1, NS)
    finalize = online_softmax_finalize(1, NO)
    mask = mask_key_block(1, NS, BN, WIN)
    modify = modify_scores(1, NS, softcap_score(softcap) if CAP else None)

    @inline_device
    def issue_block(kb, lo, hi, kv_base, k, v, keys, b, sk, kp0, vp0):
        # key block kb (if before hi) into its ring slot, then one commit either way; paged:
        # its page from the block table, clamped into the pool
        if kb < hi:
            ks = k.strides[2]
            vs = v.strides[2]
            pos = kb * BN
            at = kv_base + ((kb - lo) % STAGES) * STAGE
            k_shift = np.int64(0)
            v_shift = np.int64(0)
            if PAGED and SEGS > 1:
                # pages of SEG_ROWS keys: the block's pieces, each from its own page (an entry
                # past the table's end only for a piece past the capacity: zero-filled)
                last = np.int64(keys[2].shape[1] - 1)
                for j in range(SEGS):
                    ent = min(pos // SEG_ROWS + j, last)
                    pg = min(max(np.int64(keys[2][b, ent]), np.int64(0)),
                             np.int64(k.shape[0] - 1))
                    left = sk - pos - j * SEG_ROWS
                    issue_seg(at + j * SEG_BYTES, pg * k.strides[0], kp0[0], kp0[1], kp0[2],
                              kp0[3], ks, left)
                    issue_seg(at + TILE + j * SEG_BYTES, pg * v.strides[0], vp0[0], vp0[1],
                              vp0[2], vp0[3], vs, left)
            elif PAGED:
                page = np.int64(k.shape[2])
                pg = min(max(np.int64(keys[2][b, pos // page]), np.int64(0)),
                         np.int64(k.shape[0] - 1))
                k_shift = pg * k.strides[0] + (pos % page) * ks
                v_shift = pg * v.strides[0] + (pos % page) * vs
            else:
                k_shift = pos * ks
                v_shift = pos * vs
            if SEGS == 1:
                issue_kv(at, k_shift, kp0[0], kp0[1], kp0[2], kp0[3], ks, sk - pos)
                issue_kv(at + TILE, v_shift, vp0[0], vp0[1], vp0[2], vp0[3], vs, sk - pos)
        cp_async_commit_group()

    if WARPS == 1:
        @inline_device
        def sync():
            cuda.syncthreads()
    else:   # the warps run runs of different lengths: each meets only itself
        @inline_device
        def sync():
            warp_sync()

    if SIMULATOR and WARPS > 1:
        @inline_device
        def per_warp():
            mark_warp_specialised()     # the simulator's collectives then meet per warp
    else:
        @inline_device
        def per_warp():
            return None

    TR = phase_marks(trace)
    MK = device_namespace("decode trace marks", **TRACE_MARKS)

    @inline_device
    def body(q, k, v, o, lse, scale, scale_log2, keys, fin, tr):
        b = cuda.blockIdx.z
        hk = cuda.blockIdx.y
        per_warp()
        if WARPS == 1:
            lane = cuda.threadIdx.x
            warp = 0
        else:
            lane = cuda.threadIdx.x % 32
            warp = cuda.threadIdx.x // 32
        # a traced warp notes its marks in its shared-memory row (past every warp's tiles)
        scratch = shared_addr(smem(), 0) + WARPS * PER_WARP + warp * SCRATCH_BYTES
        if lane == 0:
            TR.start(scratch)
            TR.note(scratch, MK.entry)
            TR.note_value(scratch, MK.smid, TR.smid())
        g = lane // 4
        t = lane % 4
        sq = np.int64(q.shape[2])
        grp = np.int64(q.shape[3])
        rows = sq * grp
        tiles = (rows + ROWS - 1) // ROWS
        blocks = np.int64(cuda.gridDim.x) // tiles      # blocks of WARPS splits a row tile
        rt = np.int64(cuda.blockIdx.x) // blocks
        sp = (np.int64(cuda.blockIdx.x) % blocks) * WARPS + warp
        nsplit = blocks * WARPS
        row0 = rt * ROWS
        if PAGED:
            cap = np.int64(keys[2].shape[1]) * k.shape[2]
            kvb = 0
        else:
            cap = np.int64(k.shape[2])
            kvb = b
        sk = min(max(np.int64(keys[0][b]) + keys[1], np.int64(0)), cap)
        shift = sk - sq    # query row i sits at key position i + shift
        i_lo = row0 // grp
        i_hi = (min(row0 + ROWS, rows) - 1) // grp

        # the key blocks any row of the tile sees, the keys every row sees
        if UPPER:
            last = min(sk, i_hi + shift + R + 1) - 1
            kb_end = last // BN + 1 if last >= 0 else np.int64(0)
            all_see = min(sk, i_lo + shift + R + 1) - 1
        else:
            kb_end = (sk + BN - 1) // BN
            all_see = sk - 1
        if LOWER:
            kb_first = max(np.int64(0), i_lo + shift - L) // BN
            all_first = max(np.int64(0), i_hi + shift - L)
        else:
            kb_first = np.int64(0)
            all_first = np.int64(0)
        # this block's run of them: runs as even as whole blocks allow (lengths differ by at
        # most one; none empty unless there are fewer blocks than splits)
        n = max(kb_end - kb_first, np.int64(0))
        lo = kb_first + sp * n // nsplit
        hi = kb_first + (sp + 1) * n // nsplit
        if lane == 0:
            TR.note_value(scratch, MK.key_blocks, hi - lo)
            TR.note_value(scratch, MK.split, sp)

        row_max = cuda.local.array((1, 2), np.float32)
        row_sum = cuda.local.array((1, 2), np.float32)
        alpha = cuda.local.array((1, 2), np.float32)
        limits = cuda.local.array(LIMITS, np.int64)
        for hh in range(2):
            row_max[0, hh] = _NEG_INF
            row_sum[0, hh] = _ZERO
            pos = (row0 + g + 8 * hh) // grp + shift
            if UPPER:
                end = min(sk, pos + R + 1) - 1
            else:
                end = sk - 1
            if LOWER:
                limits[0, hh, 0] = max(np.int64(0), pos - L)
                limits[0, hh, 1] = end
            else:
                limits[0, hh] = end
        acc = cuda.local.array((1, NO, 4), np.float32)
        for j in range(NO):
            for e in range(4):
                acc[0, j, e] = _ZERO

        if hi > lo:
            base = shared_addr(smem(), 0) + warp * PER_WARP
            kv_base = base + Q_BYTES
            issue_q(base, np.int64(global_addr(q, (b, hk, 0, 0, 0))), row0, grp,
                    q.strides[2], q.strides[3], rows - row0, lane)
            cp_async_commit_group()
            kp0 = setup_kv(np.int64(global_addr(k, (kvb, hk, 0, 0))), k.strides[2], lane)
            vp0 = setup_kv(np.int64(global_addr(v, (kvb, hk, 0, 0))), v.strides[2], lane)
            # the ring's first STAGES - 1 key blocks (empty groups past hi keep the count)
            for st in range(STAGES - 1):
                issue_block(lo + st, lo, hi, kv_base, k, v, keys, b, sk, kp0, vp0)

            fq_off, fq_x = setup_fq(0, lane)
            fk_off, fk_x, fk_u = setup_fk(0, lane)
            fv_off, fv_c, fv_x = setup_fv(0, lane)
            q_frag = cuda.local.array((KD, 1, 4), np.uint32)
            k_frag = cuda.local.array((1, NS, 2), np.uint32)
            v_frag = cuda.local.array((1, NO, 2), np.uint32)
            s = cuda.local.array((1, NS, 4), np.float32)

            cp_async_wait_group(WAIT_Q)     # the Q tile
            sync()
            if lane == 0:
                TR.note(scratch, MK.q_landed)
            for kk in range(KD):
                load_q(q_frag, kk, base, kk, fq_off, fq_x)

            for kb in range(lo, hi):
                cp_async_wait_group(WAIT_KV)        # key block kb has landed ...
                sync()                              # ... and its ring slot's last reader is done
                if lane == 0 and kb == lo:
                    TR.note(scratch, MK.first_kv)
                issue_block(kb + STAGES - 1, lo, hi, kv_base, k, v, keys, b, sk, kp0, vp0)
                k_addr = kv_base + ((kb - lo) % STAGES) * STAGE
                v_addr = k_addr + TILE

                for j in range(NS):
                    for e in range(4):
                        s[0, j, e] = _ZERO
                for kk in range(KD):
                    load_k(k_frag, 0, k_addr, kk, fk_off, fk_x, fk_u)
                    for j in range(NS):
                        s[0, j, 0], s[0, j, 1], s[0, j, 2], s[0, j, 3] = mma(
                            q_frag[kk, 0, 0], q_frag[kk, 0, 1], q_frag[kk, 0, 2],
                            q_frag[kk, 0, 3], k_frag[0, j, 0], k_frag[0, j, 1],
                            s[0, j, 0], s[0, j, 1], s[0, j, 2], s[0, j, 3])
                # the soft cap reads the score alone (its row / head arguments are unused)
                modify(s, row0 + g, kb * BN + 2 * t, b, hk, scale, ())
                mask(s, limits, kb, t, all_first, all_see)
                update(s, row_max, row_sum, alpha, scale_log2)
                for j in range(NO):
                    for e in range(4):
                        acc[0, j, e] = acc[0, j, e] * alpha[0, e // 2]
                for kk in range(KN):
                    load_v(v_frag, 0, v_addr, kk, fv_off, fv_c, fv_x)
                    p0 = pack(s[0, 2 * kk, 0], s[0, 2 * kk, 1])
                    p1 = pack(s[0, 2 * kk, 2], s[0, 2 * kk, 3])
                    p2 = pack(s[0, 2 * kk + 1, 0], s[0, 2 * kk + 1, 1])
                    p3 = pack(s[0, 2 * kk + 1, 2], s[0, 2 * kk + 1, 3])
                    for j in range(NO):
                        acc[0, j, 0], acc[0, j, 1], acc[0, j, 2], acc[0, j, 3] = mma(
                            p0, p1, p2, p3, v_frag[0, j, 0], v_frag[0, j, 1],
                            acc[0, j, 0], acc[0, j, 1], acc[0, j, 2], acc[0, j, 3])
            cp_async_wait_group(0)
            if lane == 0:
                TR.note(scratch, MK.loop_end)

        if TRIGGER:
            griddepcontrol_launch_dependents()
        finalize(acc, row_sum)
        for hh in range(2):
            r = row0 + g + 8 * hh
            if r < rows:
                i = r // grp
                gg = r % grp
                for j in range(NO_STORE):
                    c = 8 * j + 2 * t
                    if SPLIT:
                        o[sp, b, hk, i, gg, c] = acc[0, j, 2 * hh]
                        o[sp, b, hk, i, gg, c + 1] = acc[0, j, 2 * hh + 1]
                    else:
                        word = pack(acc[0, j, 2 * hh], acc[0, j, 2 * hh + 1])
                        o[b, hk, i, gg, c] = word & 0xFFFF
                        o[b, hk, i, gg, c + 1] = word >> 16
                if HAS_LSE and t == 0:
                    total = row_sum[0, hh]
                    # no key: -inf; a NaN score's row: NaN (never "no key")
                    if total == _ZERO:
                        val = _NEG_INF
                    else:
                        val = row_max[0, hh] * scale + math.log(total)
                    if SPLIT:
                        lse[sp, b, hk, gg, i] = val
                    else:
                        lse[b, hk, gg, i] = val
        if FUSED:
            # the row tile's last split merges its partials (every split's, its own too)
            valid = min(np.int64(ROWS), rows - row0)
            slot = (b * np.int64(cuda.gridDim.y) + hk) * tiles + rt
            if sm.arrive(fin[4], slot, nsplit, lane):
                bh = b * np.int64(cuda.gridDim.y) + hk
                lr = row0 + lane % ROWS           # this lane's row in phase one
                lcol = (bh * grp + lr % grp) * sq + lr // grp
                x = cuda.local.array((ROWS, MCOLS), np.float32)
                total = sm.merge(fin[0], fin[1], bh * rows + row0,
                                 np.int64(cuda.gridDim.y) * np.int64(cuda.gridDim.z) * rows,
                                 lcol, valid, nsplit, shared_addr(smem(), 0) + warp * PER_WARP,
                                 lane, x)
                for ii in range(ROWS):
                    if ii < valid:
                        i = (row0 + ii) // grp
                        gg = (row0 + ii) % grp
                        for j in range(MCOLS // 4):
                            c = 4 * (lane + 32 * j)
                            if c < HEAD:
                                w0 = pack(x[ii, 4 * j], x[ii, 4 * j + 1])
                                w1 = pack(x[ii, 4 * j + 2], x[ii, 4 * j + 3])
                                fin[2][b, hk, i, gg, c] = w0 & 0xFFFF
                                fin[2][b, hk, i, gg, c + 1] = w0 >> 16
                                fin[2][b, hk, i, gg, c + 2] = w1 & 0xFFFF
                                fin[2][b, hk, i, gg, c + 3] = w1 >> 16
                if FINAL_LSE and lane < valid:
                    fin[3][b, hk, lr % grp, lr // grp] = total
        if lane == 0:
            TR.note(scratch, MK.stored)
            TR.flush(tr, (cuda.blockIdx.x + cuda.gridDim.x * (hk + cuda.gridDim.y * b))
                     * WARPS + warp, scratch)

    if trace and FUSED:
        @_kernel_jit(not CAP, cfg.threads)
        def kernel(q, k, v, o, lse, scale, scale_log2, keys, fin, tr):
            body(q, k, v, o, lse, scale, scale_log2, keys, fin, tr)
    elif trace:
        @_kernel_jit(not CAP, cfg.threads)
        def kernel(q, k, v, o, lse, scale, scale_log2, keys, tr):
            body(q, k, v, o, lse, scale, scale_log2, keys, 0, tr)
    elif FUSED:
        @_kernel_jit(not CAP, cfg.threads)
        def kernel(q, k, v, o, lse, scale, scale_log2, keys, fin):
            body(q, k, v, o, lse, scale, scale_log2, keys, fin, 0)
    else:
        @_kernel_jit(not CAP, cfg.threads)
        def kernel(q, k, v, o, lse, scale, scale_log2, keys):
            body(q, k, v, o, lse, scale, scale_log2, keys, 0, 0)

    kernel.trace = trace
    kernel.fused = FUSED
    if trace:
        kernel.smem_bytes = cfg.smem_bytes + WARPS * SCRATCH_BYTES
    return kernel


#: The most splits the combine kernel merges (its weights sit in shared memory).
MAX_COMBINE_SPLITS = 1024


def combine_kernel(head_dim: int, dtype: str, has_lse: bool, wait: bool = False,
                   ways: int = 1, warps: int = 0):
    """:func:`_combine_kernel` with ``warps`` 0 resolved to :data:`COMBINE_WARPS` now (the
    generated kernels are cached by the resolved count, so a later change of the default
    never hands out a kernel whose block disagrees with :func:`combine_grid`)."""
    return _combine_kernel(head_dim, dtype, has_lse, bool(wait), ways, warps or COMBINE_WARPS)


@functools.cache
def _combine_kernel(head_dim: int, dtype: str, has_lse: bool, wait: bool, ways: int,
                    warps: int):
    """``kernel(parts, part_lse, o, lse)``: merge a split kernel's partials
    (:func:`decode_kernel` with ``split``) — ``parts`` (S, B, Hkv, Sq, G, D) float32,
    ``part_lse`` (S, B, Hkv, G, Sq) float32, S at most :data:`MAX_COMBINE_SPLITS` — into ``o``
    (B, Hkv, Sq, G, D) uint16 bits of ``dtype``: ``o = Σ_s exp(lse_s - lse) · parts_s`` with
    ``lse = log Σ_s exp(lse_s)`` (float32), and with ``has_lse`` ``lse`` (B, Hkv, G, Sq) float32
    (-inf, and a zero row, where no split saw a key).

    Grid :func:`combine_grid`, ``warps`` warps a block: ``ways`` warps a packed row (``r = i ·
    G + g``; ``warps / ways`` rows a block). Each warp of a row reduces the row's LSE over the
    splits (lanes over the splits, warp shuffles), the row's first warp puts the weights in
    shared memory; then each warp sums every ``ways``-th split (four splits a step: their
    loads in flight together), each lane two columns of every 64, and the row's other warps'
    sums are added to the first's in shared memory in a fixed order (the same bits every
    run). :func:`combine_ways` picks ``ways`` from the split count: one warp a row keeps many
    rows in flight where splits are few, several share a long split list.
    ``wait``: the kernel first waits for the kernel ahead of it in the stream
    (:func:`tilepy.ptx.griddep.griddepcontrol_wait`) — for a launch with programmatic stream
    serialisation (``LaunchPlan(..., dependent=True)``), which may begin before the split
    kernel has finished."""
    if dtype not in DTYPES:
        raise ValueError(f"combine_kernel: dtype must be one of {DTYPES}, got {dtype!r}")
    if warps not in (2, 4, 8) or ways not in (1, 2, 4, 8) or ways > warps:
        raise ValueError(f"combine_kernel: warps must be 2, 4 or 8 and ways 1, 2, 4 or 8, at "
                         f"most warps; got warps={warps!r}, ways={ways!r}")
    pack = cvt_f16x2_f32 if dtype == "float16" else cvt_bf16x2_f32
    D = head_dim
    NP = -(-(head_dim // 2) // 32)      # column pairs per lane
    NX = 2 * NP
    WAYS = ways
    ROWS_PB = warps // WAYS
    OTHERS = max(WAYS - 1, 1)
    HAS_LSE = bool(has_lse)
    WAIT = bool(wait)
    MAXS = MAX_COMBINE_SPLITS
    red_max = warp_reduce("max")
    red_sum = warp_reduce("sum")
    f32 = np.float32

    @_kernel_jit(True, warps * 32)
    def kernel(parts, part_lse, o, lse):
        if WAIT:
            griddepcontrol_wait()
        b = cuda.blockIdx.z
        hk = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        rw = warp // WAYS
        way = warp % WAYS
        grp = np.int64(o.shape[3])
        r = np.int64(cuda.blockIdx.x) * ROWS_PB + rw
        live = r < np.int64(o.shape[2]) * grp
        if not live:
            r = np.int64(0)     # (a row past the last reads row 0 and stores nothing)
        i = r // grp
        gg = r % grp
        n = part_lse.shape[0]
        weights = cuda.shared.array((ROWS_PB, MAXS), f32)
        sums = cuda.shared.array((ROWS_PB, OTHERS, D), f32)
        top = _NEG_INF
        for s in range(lane, n, 32):
            top = fmax_nan(top, part_lse[s, b, hk, gg, i])     # (a NaN LSE is kept)
        top = red_max(top)
        acc = _ZERO
        if top != _NEG_INF:
            for s in range(lane, n, 32):
                acc += math.exp(part_lse[s, b, hk, gg, i] - top)
        acc = red_sum(acc)
        total = top + math.log(acc) if top != _NEG_INF else _NEG_INF
        if way == 0:
            for s in range(lane, n, 32):
                weights[rw, s] = math.exp(part_lse[s, b, hk, gg, i] - total) \
                    if total != _NEG_INF else _ZERO
        cuda.syncthreads()
        x = cuda.local.array(NX, f32)
        for k in range(NX):
            x[k] = _ZERO
        s = way
        while s + 3 * WAYS < n:     # four splits a step, their loads in flight together
            w0 = weights[rw, s]
            w1 = weights[rw, s + WAYS]
            w2 = weights[rw, s + 2 * WAYS]
            w3 = weights[rw, s + 3 * WAYS]
            for k in range(NP):
                c = 2 * (lane + 32 * k)
                if c < D:
                    a0 = parts[s, b, hk, i, gg, c]
                    a1 = parts[s, b, hk, i, gg, c + 1]
                    b0 = parts[s + WAYS, b, hk, i, gg, c]
                    b1 = parts[s + WAYS, b, hk, i, gg, c + 1]
                    c0 = parts[s + 2 * WAYS, b, hk, i, gg, c]
                    c1 = parts[s + 2 * WAYS, b, hk, i, gg, c + 1]
                    d0 = parts[s + 3 * WAYS, b, hk, i, gg, c]
                    d1 = parts[s + 3 * WAYS, b, hk, i, gg, c + 1]
                    x[2 * k] += (w0 * a0 + w1 * b0) + (w2 * c0 + w3 * d0)
                    x[2 * k + 1] += (w0 * a1 + w1 * b1) + (w2 * c1 + w3 * d1)
            s += 4 * WAYS
        while s < n:
            w0 = weights[rw, s]
            for k in range(NP):
                c = 2 * (lane + 32 * k)
                if c < D:
                    x[2 * k] += w0 * parts[s, b, hk, i, gg, c]
                    x[2 * k + 1] += w0 * parts[s, b, hk, i, gg, c + 1]
            s += WAYS
        if WAYS > 1:
            if way > 0:
                for k in range(NP):
                    c = 2 * (lane + 32 * k)
                    if c < D:
                        sums[rw, way - 1, c] = x[2 * k]
                        sums[rw, way - 1, c + 1] = x[2 * k + 1]
            cuda.syncthreads()
            if way == 0:
                for w_ in range(WAYS - 1):
                    for k in range(NP):
                        c = 2 * (lane + 32 * k)
                        if c < D:
                            x[2 * k] += sums[rw, w_, c]
                            x[2 * k + 1] += sums[rw, w_, c + 1]
        if way == 0 and live:
            for k in range(NP):
                c = 2 * (lane + 32 * k)
                if c < D:
                    word = pack(x[2 * k], x[2 * k + 1])
                    o[b, hk, i, gg, c] = word & 0xFFFF
                    o[b, hk, i, gg, c + 1] = word >> 16
            if HAS_LSE and lane == 0:
                lse[b, hk, gg, i] = total

    return kernel


#: Warps of a :func:`combine_kernel` block by default: eight (measured on an H100: 1.01–1.06×
#: four at one sequence's 32–64 splits, the same elsewhere), two in the simulator, where every
#: thread is a Python thread; :data:`tilepy.ops.attention_kvcache.COMBINE_WARPS` chooses for
#: the op.
COMBINE_WARPS = 2 if SIMULATOR else 8


def combine_ways(splits: int, warps: int = 0) -> int:
    """The warps that share a packed row in :func:`combine_kernel` for ``splits`` partials, in
    blocks of ``warps`` (0: :data:`COMBINE_WARPS`): with four warps one up to 8 splits, two up
    to 32, else four (the measured choice); with eight one up to 8, two up to 16, four up to 32,
    else eight (at most two four-split steps a warp up to 64 splits: B1's 64-split caches)."""
    warps = warps or COMBINE_WARPS
    if warps >= 8:
        ways = 1 if splits <= 8 else 2 if splits <= 16 else 4 if splits <= 32 else 8
    else:
        ways = 1 if splits <= 8 else 2 if splits <= 32 else 4
    return min(warps, ways)


def combine_threads(warps: int = 0) -> int:
    """Threads of a :func:`combine_kernel` block of ``warps`` warps (0: :data:`COMBINE_WARPS`)."""
    return (warps or COMBINE_WARPS) * 32


def combine_grid(seq_q: int, group: int, heads_kv: int, batch: int, ways: int,
                 warps: int = 0) -> tuple:
    """:func:`combine_kernel`'s grid for ``ways`` warps a packed row in blocks of ``warps``
    (0: :data:`COMBINE_WARPS`): (row groups, Hkv, B)."""
    per = (warps or COMBINE_WARPS) // ways
    return (-(-(seq_q * group) // per), heads_kv, batch)


def grid(seq_q: int, group: int, heads_kv: int, batch: int, splits: int = 1,
         warps: int = 1) -> tuple:
    """The decoding kernel's grid: (row tiles · splits / warps, Hkv, B); ``splits`` a multiple
    of ``warps`` (``ValueError`` otherwise: a warp would run a split nobody merges, or none)."""
    if splits < warps or splits % warps:
        raise ValueError(f"{splits} splits over blocks of {warps} warps: splits must be a "
                         f"positive multiple of the warps")
    return (-(-(seq_q * group) // ROWS) * (splits // warps), heads_kv, batch)


def packed_view(view, heads_kv: int):
    """A (B, S, Hq, D) array (NumPy or Numba device) as the kernels' (B, Hkv, S, G, D) strided
    view, ``G = Hq / Hkv``; no copy."""
    from .. import arrays

    bs, s, hq, d = view.shape
    sb, ss, sh, sd = view.strides
    grp = hq // heads_kv
    return arrays.restride(view, (bs, heads_kv, s, grp, d), (sb, grp * sh, ss, sh, sd))


def lse_view(view, heads_kv: int):
    """A (B, Hq, S) float32 LSE array as the kernels' (B, Hkv, G, S) view; no copy."""
    from .. import arrays

    bs, hq, s = view.shape
    sb, sh, ss = view.strides
    grp = hq // heads_kv
    return arrays.restride(view, (bs, heads_kv, grp, s), (sb, grp * sh, sh, ss))


#: Shared memory an SM offers its blocks, and what the driver reserves per block (sm_90).
SM_SHARED_BYTES = 228 * 1024
BLOCK_RESERVED_BYTES = 1024


def resident_splits(cfg: DecodeConfig) -> int:
    """The splits of the keys an SM runs at once on ``cfg``'s kernel: the blocks its shared
    memory holds (at most 32) times the warps of a block, each warp on its own split."""
    blocks = SM_SHARED_BYTES // (cfg.smem_bytes + BLOCK_RESERVED_BYTES)
    return max(1, min(blocks, 32)) * cfg.warps


def choose_splits(batch: int, heads_kv: int, tiles: int, key_blocks: int, sms: int,
                  resident: int, step: int = 1) -> int:
    """Splits of the keys (flash-decoding) for ``batch · heads_kv · tiles`` (sequence, KV head,
    row tile) pairs over ``key_blocks`` blocks of keys, a multiple of ``step`` (the warps of a
    block, each on its own split). The blocks run in waves of ``sms · resident`` slots
    (``resident``: the splits an SM holds at once), a wave as long as its longest run of key
    blocks (runs of one sequence differ by at most one block). Modelled time is waves × (the
    longest run + 2 blocks of fixed cost per run: its start); the count is the fewest splits
    within 2% of the least time (more splits add partials to merge), each split at least 4
    key blocks long, at most 128 splits (at least ``step``). So a last wave that is partly
    empty, or a run one block longer than the rest, counts."""
    pairs = max(batch * heads_kv * tiles, 1)
    slots = max(sms * max(resident, 1), 1)
    step = max(int(step), 1)
    top = max(step, min(key_blocks // 4, 128) // step * step)
    costs = [(-(-(pairs * s) // slots) * (-(-key_blocks // s) + 2), s)
             for s in range(step, top + 1, step)]
    least = min(costs)[0]
    return min(s for cost, s in costs if cost <= 1.02 * least)


def fused_fits(cfg: DecodeConfig, splits: int) -> bool:
    """Whether :func:`decode_kernel` with ``fused=True`` can merge ``splits`` runs: each warp's
    shared memory holds their weights (:func:`tilepy.tile.split_kv.weight_bytes`), and rows of
    at most 128 columns (a lane's merged row then fits its registers)."""
    return cfg.head_dim <= 128 and weight_bytes(splits) <= cfg.warp_bytes


def plan(kernel, cfg: DecodeConfig, q, k, v, o, lse, scale: float, keys, splits: int,
         trace=None, fin=None, counter=None, alloc=None):
    """``(launch plan, arguments)`` of :func:`decode_kernel`'s kernel on its views.
    ``trace``: the uint64 array of :mod:`tilepy.tile.trace` rows (a row per warp of the grid)
    of a kernel generated with ``trace=True`` (ValueError otherwise, or when it is too
    short). ``fin``: the ``(parts, plse, out, out_lse, counters)`` of a kernel generated with
    ``fused=True`` (:func:`fused_views`), ``counters`` a view of ``counter`` (a
    :class:`~tilepy.tile.device_write.DeviceBuffer` from ``alloc``): the plan is then a
    :class:`~tilepy.tile.stream_counter.CountedLaunchPlan` (a zeroed counter per stream)."""
    args = (q, k, v, o, lse, np.float32(scale), np.float32(scale * LOG2E), tuple(keys))
    if getattr(kernel, "trace", False) != (trace is not None):
        raise ValueError("plan: a trace array goes with a kernel generated with trace=True, "
                         "and only with one")
    if getattr(kernel, "fused", False) != (fin is not None):
        raise ValueError("plan: the merged results (fin) go with a kernel generated with "
                         "fused=True, and only with one")
    if fin is not None:
        if not fused_fits(cfg, splits):
            raise ValueError(f"plan: {splits} splits do not fit the fused merge of {cfg}")
        args += (tuple(fin),)
    smem_bytes = getattr(kernel, "smem_bytes", cfg.smem_bytes)
    g = grid(q.shape[2], q.shape[3], q.shape[1], q.shape[0], splits, cfg.warps)
    if trace is not None:
        warps = g[0] * g[1] * g[2] * cfg.warps
        if len(trace.shape) != 2 or trace.shape[0] < warps or trace.shape[1] != TRACE_WIDTH:
            raise ValueError(f"plan: the trace needs ({warps}, {TRACE_WIDTH}) rows and "
                             f"columns at least (a row per warp); got {tuple(trace.shape)}")
        args += (trace,)
    allow_dynamic_shared(kernel, args, smem_bytes)
    if fin is not None:
        return CountedLaunchPlan(kernel, args, g, cfg.threads, smem_bytes,
                                 counter_arg=(8, 4), counter=counter, alloc=alloc), args
    return LaunchPlan(kernel, args, g, cfg.threads, smem_bytes), args


def fused_views(parts, part_lse, alloc):
    """``(parts 2-D, part_lse 2-D, counters, counter)`` for the ``fin`` of a fused kernel's
    :func:`plan`: 2-D views of the split partials ``parts`` (S, B, Hkv, Sq, G, D) and
    ``part_lse`` (S, B, Hkv, G, Sq) (contiguous raw arrays), and a counter buffer of B · Hkv ·
    row-tiles int32 from ``alloc`` (zeroed by the plan) with its int32 view."""
    from .. import arrays

    s, b, hk, sq, grp, d = parts.shape
    rows = sq * grp
    p2 = arrays.restride(parts, (s * b * hk * rows, d), (d * 4, 4))
    l2 = arrays.restride(part_lse, (s, b * hk * rows), (b * hk * rows * 4, 4))
    slots = b * hk * -(-rows // ROWS)
    counter = device_write.allocate(alloc, 4 * slots + (-4 * slots) % 8, 256)
    return p2, l2, counter.view((slots,), np.int32), counter


def argtypes(split: bool, paged: bool, layout: str = "A", fused: bool = False):
    """Numba argument types of :func:`decode_kernel`'s kernel (offline compilation);
    ``fused``: with the merged results' ``fin`` (:func:`fused_views`)."""
    from numba import types

    keys = (types.Array(types.int32, 1, layout), types.int64)
    if paged:
        keys += (types.Array(types.int32, 2, layout),)
    if split:
        o = types.Array(types.float32, 6, layout)
        lse = types.Array(types.float32, 5, layout)
    else:
        o = types.Array(types.uint16, 5, layout)
        lse = types.Array(types.float32, 4, layout)
    u16_4 = types.Array(types.uint16, 4, layout)
    fin = ()
    if fused:
        f32_2 = types.Array(types.float32, 2, layout)
        fin = (types.Tuple((f32_2, f32_2, types.Array(types.uint16, 5, layout),
                            types.Array(types.float32, 4, layout),
                            types.Array(types.int32, 1, "C"))),)
    return (types.Array(types.uint16, 5, layout), u16_4, u16_4, o, lse, types.float32,
            types.float32, types.Tuple(keys)) + fin


#: The decoding kernels the compile layer reports on: (name, config, (left, right), split,
#: paged).
COMPILED = (
    # the default config (32-key blocks, four stages), split, paged
    ("decode_d128_bf16_causal_split_paged", DecodeConfig(128, 32, 4, "bfloat16"), (-1, 0),
     True, True),
    # four warps a block, each on its own run of the keys
    ("decode_d128_bf16_causal_split_4warps", DecodeConfig(128, 32, 3, "bfloat16", warps=4),
     (-1, 0), True, False),
    ("decode_d128_f16_causal", DecodeConfig(128, 64, 2, "float16"), (-1, 0), False, False),
)


def compile_reports(only=None):
    """Offline sm_90 reports of :data:`COMPILED` and of the combine kernel
    (``decode_combine_d128_bf16_lse``; run with the simulator off:
    ``tilepy.offline.run_in_subprocess(
    "tilepy.ops.attention_decode_mma_sync:compile_reports")``)."""
    from numba import types

    from ..offline import report_entry

    out = [report_entry(name, (lambda c=cfg, w=win, s=split, p=paged:
                               decode_kernel(c, w[0], w[1], True, s, 0.0, p)),
                        argtypes(split, paged), (9, 0), threads=cfg.threads,
                        config=cfg.describe(),
                        smem_bytes=cfg.smem_bytes)
           for name, cfg, win, split, paged in COMPILED if only is None or name in only]
    name = "decode_d128_bf16_causal_split_4warps_trace"     # the phase marks compiled in
    if only is None or name in only:
        cfg = DecodeConfig(128, 32, 3, "bfloat16", warps=4)
        out.append(report_entry(name, lambda: decode_kernel(cfg, -1, 0, True, True, 0.0, False,
                                                            trace=True),
                                argtypes(True, False) + (types.Array(types.uint64, 2, "C"),),
                                (9, 0), threads=cfg.threads, config=cfg.describe(),
                                smem_bytes=cfg.smem_bytes))
    # programmatic dependent launch: the split kernel lets the combine begin, which waits
    name = "decode_d128_bf16_causal_split_paged_trigger"
    if only is None or name in only:
        cfg = DecodeConfig(128, 32, 4, "bfloat16")
        out.append(report_entry(name, lambda: decode_kernel(cfg, -1, 0, True, True, 0.0, True,
                                                            trigger=True),
                                argtypes(True, True), (9, 0), threads=cfg.threads,
                                config=cfg.describe(), smem_bytes=cfg.smem_bytes))
    # the splits merged by their last warp (no combine kernel); pages of 16 keys, two a
    # key block (the op's default for such a cache)
    name = "decode_d128_bf16_causal_split_page16_fused"
    if only is None or name in only:
        cfg = DecodeConfig(128, 32, 3, "bfloat16")
        out.append(report_entry(name, lambda: decode_kernel(cfg, -1, 0, True, True, 0.0, True,
                                                            fused=True, page_rows=16),
                                argtypes(True, True, fused=True), (9, 0), threads=cfg.threads,
                                config=cfg.describe(), smem_bytes=cfg.smem_bytes))
    f32 = types.float32
    for name, wait, ways, warps in (("decode_combine_d128_bf16_lse", False, 1, 4),
                                    ("decode_combine_d128_bf16_lse_wait", True, 1, 4),
                                    ("decode_combine_4ways_d128_bf16_lse_wait", True, 4, 4),
                                    ("decode_combine_8ways_d128_bf16_lse_wait", True, 8, 8)):
        if only is None or name in only:
            out.append(report_entry(name, lambda w=wait, y=ways, n=warps: combine_kernel(
                                        128, "bfloat16", True, wait=w, ways=y, warps=n),
                                    (types.Array(f32, 6, "A"), types.Array(f32, 5, "A"),
                                     types.Array(types.uint16, 5, "A"),
                                     types.Array(f32, 4, "A")),
                                    (9, 0), threads=combine_threads(warps),
                                    config="combine d128", smem_bytes=0))
    return out
