"""FlashAttention-2's backward on Hopper warpgroup MMA (sm_90): the dK / dV and dQ kernels of
:mod:`tilepy.ops.attention_backward_mma_sync` with every product on wgmma.

The same algorithm, arrays and launch order as the mma.sync kernels (the rows pre-pass is
shared); what changes is who multiplies:

* :func:`dkdv_kernel` — ``key_groups`` consumer warpgroups of 64 keys each (``block_n = 64 ·
  key_groups`` keys per block). Per query block of ``block_m`` rows, each warpgroup issues
  ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` (A = its K / V rows from shared memory, B = the Q / dO
  tile read K-major), then ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` with A from registers (``Pᵀ``
  and ``dSᵀ`` rounded to 16 bits straight from the accumulators) and B the same Q / dO tiles
  read MN-major. Q, dO, lse2 and delta stream through two cp.async stages; one block barrier
  per query block.
* :func:`dq_kernel` — ``dq_groups`` warpgroups of 64 query rows each; per key block of
  ``dq_block_n`` keys ``S = Q Kᵀ``, ``dP = dO Vᵀ`` (A from shared memory), then ``dQ += dS K``
  with A = ``dS`` from registers and B the K tile read MN-major. K and V stream through two
  cp.async stages.
* :func:`dkdv_ws_kernel` (a ``producer`` config) — the dK / dV products of :func:`dkdv_kernel`
  (:func:`key_block_products`) in two consumer warpgroups beside a producer warpgroup that
  streams Q, dO, lse2 and delta through an mbarrier ring, plus dQ's partial ``dS K`` from
  ``dS`` in shared memory, added into dQ's float32 accumulator by bulk reductions: no dQ
  kernel (FlashAttention-3's design; 5 products per block pair instead of 7). Past head_dim
  128 (``split_columns``) its two consumers share the block's 64 keys and split the columns
  of dK, dV and dQ.

Shared tiles are 128-byte-swizzled 64-column boxes (:func:`tilepy.tile.copy.
copy_rows_to_shared_128b`): a (rows × D) tile is at once the K-major operand with K = D and the
MN-major one with N = D (:class:`tilepy.tile.warpgroup_mma.SmemOperand`), so one copy of Q, dO
and K serves both kinds of product. Tiles are 64, 128 or 256 columns wide (:func:`tile_width`);
a head dim between (any multiple of 8 up to 256) is zero-filled to its tile's width by the
copies, and the stores write its own columns only.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..inline import inline_device
from ..launch import LaunchPlan
from ..ptx import global_addr, shared_addr
from ..ptx.barrier import bar_sync, warp_sync
from ..ptx.cp_async import cp_async_commit_group, cp_async_wait_group
from ..ptx.global_vector import ld_global_v4
from ..ptx.math import cvt_bf16x2_f32, cvt_f16x2_f32
from ..ptx.vector import ld_shared_b32, st_shared_b32
from ..ptx.mbarrier import (fence_mbarrier_init, mbarrier_arrive, mbarrier_init,
                            mbarrier_wait_parity)
from ..ptx.tma import bulk_commit_group, bulk_reduce_add_f32, bulk_wait_group, bulk_wait_group_read
from ..ptx.wgmma import fence_proxy_async_shared
from ..tile.attention import block_coords, limits_shape, packed_sequence
from ..tile.attention_backward import (
    LOG2E,
    a_fragment,
    blocked_row,
    counted_steps,
    kernel_variant,
    heavy_keys,
    key_block_order,
    key_block_scores,
    key_steps,
    query_block_scores,
    query_blocks,
    query_steps,
    reads_hook,
    row_state,
    softmax_gradient,
    stage_float32,
    swizzled_chunk,
    store_accumulators,
    transpose_to_shared,
    variant_mods,
)
from ..tile.config import DTYPES, SMEM_LIMIT
from ..tile.copy import copy_rows_to_shared, copy_rows_to_shared_128b
from ..tile.online_softmax import accumulator_fragment
from ..tile.pipeline import tma_pipeline
from ..tile.roles import NamedBarriers, warpgroup_roles
from ..tile.rows import vectors_fit, words_store
from ..tile.smem import allow_dynamic_shared, dynamic_shared
from ..tile.smem_layout import SmemLayout
from ..tile.warpgroup_mma import SmemOperand, warpgroup_mma
from . import attention_backward_mma_sync as bk

#: Head dims of the wgmma kernels: multiples of 8 up to 256, each in a tile of whole
#: 64-element boxes of the 128-byte swizzle (:func:`tile_width`); past 128 only the
#: warp-specialised kernel with its columns split between the consumers
#: (``WgmmaBackwardConfig.split_columns``).
HEAD_DIMS = tuple(range(8, 257, 8))


def tile_width(head_dim: int) -> int:
    """The shared tiles' width of a head dim: 64 up to 64, 128 up to 128, else 256
    (zero-filled past the head dim)."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)

#: The atomic path's dQ partial tiles: 64 query rows × 64 columns of float32, rows padded by
#: 4 floats (so a warp's stores of 8 rows land in distinct banks); the float32 accumulator in
#: global memory has the same padded rows, block by block (:func:`dq_blocked_shape`). The
#: 256-column tiles' (:func:`dq_row_floats`) are not padded but swizzled
#: (:func:`tilepy.tile.attention_backward.stage_float32`): they are staged in the Q / dO ring
#: slot the step has finished with, 64 floats a row.
DQ_PAD = 4
DQ_ROW = 64 + DQ_PAD
DQ_TILE_BYTES = 64 * DQ_ROW * 4


def dq_swizzled(width: int) -> bool:
    """Whether the dQ partial tiles and accumulator of tiles ``width`` columns wide have
    swizzled rows of 64 floats (the 256-column tiles: staged in the ring slot,
    :func:`tilepy.tile.attention_backward.stage_float32` with ``swizzled``) rather than padded
    ones."""
    return width == 256


def dq_row_floats(width: int) -> int:
    """The floats of a row of the dQ partial tiles and accumulator for tiles ``width``
    columns wide: :data:`DQ_ROW` (padded), 64 where :func:`dq_swizzled`."""
    return 64 if dq_swizzled(width) else DQ_ROW


def dq_blocked_shape(batch: int, heads: int, sqp: int, width: int) -> tuple:
    """The atomic path's float32 dQ accumulator of tiles ``width`` columns wide: (B, Hq, SqP ·
    slices, :func:`dq_row_floats`), query block ``qb``'s slice ``c`` (columns ``64 c …``) at
    rows ``(qb · slices + c) · 64 …``: one contiguous tile per bulk reduction."""
    return (batch, heads, sqp * (width // 64), dq_row_floats(width))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class WgmmaBackwardConfig:
    """The wgmma backward kernels' tiles: the dK / dV kernel has ``key_groups`` warpgroups of
    64 keys and steps of ``block_m`` query rows; the dQ kernel ``dq_groups`` warpgroups of 64
    query rows and steps of ``dq_block_n`` keys.

    ``dq_atomic``: dQ's partial sums from the dK / dV kernel, bulk-reduced into a float32
    accumulator (no dQ kernel) unless the call is deterministic. ``producer`` (with
    ``dq_atomic``, ``block_m`` 64, 2 key warpgroups): the warp-specialised kernel
    :func:`dkdv_ws_kernel` instead; ``dq_own_keys`` (its choice): each consumer's dQ partial
    over its own keys and every column rather than over all the block's keys and its own
    64 columns (always so at head_dim 64). A deterministic call with a ``dq_atomic`` config
    runs the same dK / dV blocks without the dQ part, then the dQ kernel.

    ``split_columns`` (head dims past 128, the 256-column tiles: a ``producer`` config with
    ``dq_atomic``, ``block_m`` 64 and one key group): two consumer warpgroups over the same 64
    keys, consumer ``c`` accumulating columns ``128 c …`` of dK and dV (what one warpgroup's
    registers hold of a 128-column tile) and of dQ's partial; each computes the block's whole
    ``Sᵀ`` and ``dPᵀ`` (over every column), so the score products run twice. dQ's partial
    sums are staged in the step's Q / dO ring slot once both consumers' dV / dK products
    retired (no staging of its own: two slots then fit). Not deterministic: the
    deterministic path runs the mma.sync kernels past 128.
    ``query_halves`` (with ``split_columns``): consumer ``c`` computes ``Sᵀ`` and ``dPᵀ``
    for queries ``32 c …`` of the step only, and both write their rows of ``P`` and ``dS``
    into shared boxes that the dV / dK products then read (A from shared memory): no
    product runs twice, one barrier of both consumers per step.

    ``heavy_first`` (the dK / dV kernels under causal, one length for every batch): the
    grid's blocks take the key blocks heaviest first
    (:func:`tilepy.tile.attention_backward.key_block_order`), so that the last blocks started
    are the shortest; False: the grid's plain order.

    ``head_dim_v``: v's (and out's, dout's) head dim where it differs from q's and k's
    ``head_dim`` (None: the same; e.g. 128 beside 192). The tiles are those of the wider of
    the two (:attr:`width`); the copies zero-fill each operand's columns past its own head
    dim, and dK / dQ store ``head_dim`` columns, dV ``head_dim_v``."""

    head_dim: int
    block_m: int = 64
    key_groups: int = 2
    dq_groups: int = 2
    dq_block_n: int = 64
    dtype: str = "float16"
    cc: tuple = (9, 0)
    dq_atomic: bool = False
    producer: bool = False
    dq_own_keys: bool = False
    split_columns: bool = False
    query_halves: bool = False
    heavy_first: bool = True
    head_dim_v: int | None = None

    def __post_init__(self):
        for name in ("dq_atomic", "producer", "dq_own_keys", "split_columns", "query_halves",
                     "heavy_first"):
            _require(isinstance(getattr(self, name), bool), f"WgmmaBackwardConfig.{name} must "
                     f"be a bool, got {getattr(self, name)!r}")
        if self.producer:
            _require(self.dq_atomic and self.block_m == 64 and
                     self.key_groups == (1 if self.split_columns else 2),
                     "WgmmaBackwardConfig: producer (the warp-specialised dK / dV / dQ kernel) "
                     "takes dq_atomic=True, block_m 64 and 2 key warpgroups (1 with "
                     "split_columns)")
        _require(self.head_dim_v is None or self.head_dim_v in HEAD_DIMS,
                 f"WgmmaBackwardConfig.head_dim_v must be None or a multiple of 8 in 8 … 256, "
                 f"got {self.head_dim_v!r}")
        _require(self.split_columns == (self.width > 128),
                 f"WgmmaBackwardConfig: head dims past 128 (and only those; q's or v's) take "
                 f"split_columns=True, producer=True, dq_atomic=True, key_groups=1; got "
                 f"head_dim {self.head_dim}, head_dim_v {self.dv}, "
                 f"split_columns={self.split_columns}")
        _require(not self.split_columns or self.producer, "WgmmaBackwardConfig: "
                 "split_columns is a form of the producer kernel (producer=True, "
                 "dq_atomic=True, key_groups=1)")
        _require(not self.query_halves or self.split_columns, "WgmmaBackwardConfig: "
                 "query_halves is a form of split_columns")
        _require(not self.dq_own_keys or self.producer, "WgmmaBackwardConfig: dq_own_keys is "
                 "a choice of the producer kernel")
        if self.dq_atomic:
            _require(self.block_m == 64 and self.key_groups in (1, 2),
                     "WgmmaBackwardConfig: dq_atomic takes block_m 64 (one m64 dQ product) "
                     "and 1 or 2 key warpgroups")
            _require(self.key_groups == 1 or self.slices in (1, self.key_groups),
                     "WgmmaBackwardConfig: dq_atomic with 2 key warpgroups splits dQ's "
                     "64-column slices between them")
        _require(self.dtype in DTYPES, f"WgmmaBackwardConfig.dtype must be one of {DTYPES}, "
                 f"got {self.dtype!r}")
        _require(self.head_dim in HEAD_DIMS, f"WgmmaBackwardConfig.head_dim must be a multiple "
                 f"of 8 in 8 … 256, got {self.head_dim!r}")
        for name in ("block_m", "dq_block_n"):
            value = getattr(self, name)
            _require(isinstance(value, int) and 16 <= value <= 256 and value % 16 == 0,
                     f"WgmmaBackwardConfig.{name}={value!r} is not a multiple of 16 in 16 … 256")
        for name in ("key_groups", "dq_groups"):
            _require(getattr(self, name) in (1, 2, 3), f"WgmmaBackwardConfig.{name} must be "
                     f"1, 2 or 3 warpgroups, got {getattr(self, name)!r}")
        copiers = 128 if self.producer else self.threads
        for rows, threads, what in ((self.block_m, copiers, "block_m"),
                                    (self.dq_block_n, self.dq_threads, "dq_block_n")):
            step = threads // (self.width // 8)
            _require(rows % step == 0, f"WgmmaBackwardConfig.{what}={rows}: the tile copy "
                     f"takes {step} rows per pass")
        limit = SMEM_LIMIT.get(tuple(self.cc[:2]), 99 * 1024)
        layouts = (("dK/dV", self.dkdv_layout.nbytes),) + (
            () if self.split_columns else (("dQ", self.dq_layout.nbytes),))
        for name, nbytes in layouts:
            _require(nbytes <= limit, f"WgmmaBackwardConfig: the {name} kernel's {nbytes} B of "
                     f"shared memory exceed the {limit} B a block may use")

    @property
    def block_n(self) -> int:
        return 64 * self.key_groups

    @property
    def dv(self) -> int:
        """v's head dim (``head_dim_v``, else ``head_dim``)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def width(self) -> int:
        """The shared tiles' and accumulators' columns: :func:`tile_width` of the wider of
        ``head_dim`` and :attr:`dv`."""
        return tile_width(max(self.head_dim, self.dv))

    @property
    def slices(self) -> int:
        """dQ's 64-column slices (the atomic path's unit of reduction)."""
        return self.width // 64

    @property
    def own_keys(self) -> bool:
        """The producer kernel: each consumer warpgroup's dQ partial is over its own 64 keys
        and every column (``dq_own_keys``, and always at head_dim 64), else over all the
        block's keys and its own 64-column slice (:attr:`split_columns`: over the block's 64
        keys and its own two slices)."""
        return self.producer and not self.split_columns and (self.dq_own_keys or
                                                             self.slices == 1)

    @property
    def dq_jobs(self) -> int:
        """dQ partial products (64-column slices staged) per warpgroup and query block (atomic
        path): every slice with one key warpgroup or :attr:`own_keys`, half of them with
        :attr:`split_columns`, else one."""
        if self.split_columns:
            return self.slices // 2
        return self.slices if self.key_groups == 1 or self.own_keys else 1

    @property
    def consumers(self) -> int:
        """The dK / dV kernel's consumer (MMA) warpgroups."""
        return 2 if self.split_columns else self.key_groups

    @property
    def stages(self) -> int:
        """Slots of the Q / dO stream."""
        return 2

    @property
    def dq_block_m(self) -> int:
        return 64 * self.dq_groups

    @property
    def threads(self) -> int:
        """The dK / dV kernel's block: its key warpgroups, and the producer's."""
        return 128 * (self.consumers + (1 if self.producer else 0))

    @property
    def dq_threads(self) -> int:
        return 128 * self.dq_groups

    @property
    def row_pad(self) -> int:
        import math

        return math.lcm(self.block_m, self.dq_block_m)

    @property
    def dkdv_layout(self) -> SmemLayout:
        D, BM, BN, ST = self.width, self.block_m, self.block_n, self.stages
        regions = [("k", BN * D * 2, 1024), ("v", BN * D * 2, 1024),
                   ("q", ST * BM * D * 2, 1024), ("do", ST * BM * D * 2, 1024),
                   ("lse2", ST * BM * 4, 16), ("delta", ST * BM * 4, 16)]
        if self.dq_atomic:
            # the producer kernel's consumers share dS (split slices): two buffers; with
            # split_columns each consumer its own box of the block's 64 keys
            buffers = 2 if self.producer and not self.own_keys else 1
            regions.append(("ds", buffers * BM * BN * 2, 1024))
            if not self.split_columns:   # (split_columns: staged in the ring slot)
                regions.append(("dq", self.consumers * self.dq_jobs * DQ_TILE_BYTES, 16))
            if self.query_halves:   # P (both consumers' rows); dS's two boxes: two steps
                regions.append(("p", BM * BN * 2, 1024))
        if self.producer:
            # the Q / dO ring's and K / V's mbarriers, the step and sequence words
            regions.append(("bars", 96, 8))
        else:
            regions.append(("count", 16, 16))  # block-sparse: the block's step count
        return SmemLayout.of(*regions)

    @property
    def dq_layout(self) -> SmemLayout:
        D, BM, BN = self.width, self.dq_block_m, self.dq_block_n
        return SmemLayout.of(("q", BM * D * 2, 1024), ("do", BM * D * 2, 1024),
                             ("kv", 2 * 2 * BN * D * 2, 1024))

    def describe(self) -> str:
        dq = ("dQ by bulk reductions from the dK/dV kernel" + (
            ", producer warpgroup" if self.producer else "") + (
            ", dQ over each warpgroup's own keys" if self.dq_own_keys else "") + (
            ", dK / dV / dQ columns split between them" if self.split_columns else "") + (
            ", Sᵀ / dPᵀ by query halves" if self.query_halves else "")
            if self.dq_atomic else
              f"dQ {self.dq_block_m} x {self.dq_block_n} ({self.dq_groups} warpgroups)")
        return (f"wgmma dK/dV {self.block_n} keys x {self.block_m} queries "
                f"({self.consumers} warpgroups), {dq}, D={self.head_dim}"
                + ("" if self.dv == self.head_dim else f" Dv={self.dv}") + f" {self.dtype}"
                + ("" if self.heavy_first else ", key blocks in the grid's order"))


def _jit(threads: int):
    return bk.kernel_jit(threads)


def key_block_products(cfg: WgmmaBackwardConfig, causal: bool = False, window=None,
                       softcap: float = 0.0, mods=(None, None, None), sparse: bool = False,
                       columns=None):
    """``(products, g_mma, (shape, dtype))``: one query block's work for a warpgroup's 64
    keys, issued up to
    the dK product (still in flight on return: ``g_mma.wait(0)`` then
    ``g_mma.fence_operand(dk_acc)`` before reading ``dk_acc``, or a later wait that covers
    its group).

    ``products(st, dpt, st3, dpt3, dfac, a_p, a_ds, dk_acc, dv_acc, k_wg, v_wg, q_tile,
    do_tile, g_off, l_addr, d_addr, block_diag, key_shift, edge, my_key, sk, ds_box, lane, warp4,
    t, scale_log2, scale, col0, b, hq, hook, part)``: ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` (A:
    the warpgroup's K / V rows at ``k_wg`` / ``v_wg``, B: the block's Q / dO tiles,
    ``cfg.block_m`` rows); the variant's score modifications and masks
    (:func:`tilepy.tile.attention_backward.key_block_scores`: key ``my_key`` of the lane's row
    against query ``col0 = row0 + 2t``, ``key_shift = my_key - (sk - sq) - col0``; the masks
    only where a bound crosses the block, ``block_diag = row0 + (sk - sq) - key0``; ``edge``:
    the keys at or past ``sk``; ``scale``, ``b``, ``hq``, ``hook``, ``part`` and ``dfac`` — a
    local array of the returned ``(shape, dtype)`` — read by the variants that modify
    scores), ``P = exp2(scale_log2 · Sᵀ - lse2)`` (``l_addr``: the block's lse2 in shared
    memory), ``dV += Pᵀ dO``, ``dSᵀ = Pᵀ ∘ (dPᵀ -
    delta)`` (``d_addr``) times the variant's derivative, with ``cfg.dq_atomic`` written
    transposed into the dS box at ``ds_box`` (stmatrix by lane ``lane`` of the warpgroup's
    warp ``warp4``; the caller fences and synchronises before a wgmma reads it), then ``dK +=
    dSᵀ Q`` issued. ``st`` / ``dpt``: (block_m / 2) float32 accumulators, ``st3`` / ``dpt3``
    their (1, block_m / 8, 4) fragments; ``a_p`` / ``a_ds`` (block_m / 4) uint32: ``Pᵀ`` and
    ``dSᵀ`` rounded to 16 bits as A operands (two arrays, so dK's is written while dV's
    product still reads the other; registers an issued wgmma reads are not touched until a
    wait retires it). On return ``st``, ``dpt`` and their fragments are free. A product still
    reading ``a_p`` or ``a_ds`` from the step before must have retired.

    ``causal``, ``window``, ``softcap``, ``mods`` (``(score_mod, score_mod_grad, mask_mod[,
    n_args, alibi[, bits]])``), ``sparse``: the variant, as
    :func:`tilepy.tile.attention_backward.key_block_scores` takes it.

    ``columns``: the columns of dK and dV the warpgroup accumulates (default the tile's
    width; ``dk_acc`` / ``dv_acc`` hold ``columns / 2`` floats), from byte ``g_off`` of the
    Q / dO tiles (a multiple of one 64-column box: :attr:`WgmmaBackwardConfig.split_columns`'
    second consumer reads from its half); ``Sᵀ`` and ``dPᵀ`` are always over every column."""
    left, right, cap, mods, _ = kernel_variant(causal, window, softcap, mods)
    return _key_block_products(cfg, left, right, cap, mods, bool(sparse),
                               cfg.width if columns is None else int(columns))


@functools.cache
def _key_block_products(cfg: WgmmaBackwardConfig, left: int, right: int, cap: float,
                        mods: tuple, sparse: bool, columns: int):
    BM, BN, D = cfg.block_m, cfg.block_n, cfg.width
    NQ = BM // 8
    s_mma = warpgroup_mma(BM, SmemOperand(BM, D, "k"), SmemOperand(BN, D, "k"), cfg.dtype)
    # dV, dK (A in registers) over the warpgroup's columns
    g_mma = warpgroup_mma(columns, SmemOperand(D, BM, "mn"), None, cfg.dtype)
    to_frag_s, _ = accumulator_fragment(BM)
    grad = softmax_gradient(1, NQ, "cols")
    key_scores, chain, dfac_layout = key_block_scores(NQ, BN, False, (left, right), cap, mods,
                                                      sparse)
    afrag = a_fragment(cfg.dtype)
    STORE_DS = cfg.dq_atomic
    to_ds = transpose_to_shared(NQ)

    @inline_device
    def products(st, dpt, st3, dpt3, dfac, a_p, a_ds, dk_acc, dv_acc, k_wg, v_wg, q_tile,
                 do_tile, g_off, l_addr, d_addr, block_diag, key_shift, edge, my_key, sk,
                 ds_box, lane, warp4, t, scale_log2, scale, col0, b, hq, hook, part):
        s_mma.mma_pair(st, k_wg, q_tile, dpt, v_wg, do_tile)   # Sᵀ = K Qᵀ, dPᵀ = V dOᵀ
        to_frag_s(st3, st)
        key_scores(st3, dfac, scale, my_key, col0, b, hq, hook, part, block_diag, key_shift,
                   edge, sk)
        grad.probabilities(st3, l_addr, scale_log2, t)

        # dV += Pᵀ dO (A = Pᵀ from registers)
        for kk in range(BM // 16):
            a_p[4 * kk], a_p[4 * kk + 1], a_p[4 * kk + 2], a_p[4 * kk + 3] = afrag(st3, 0, kk)
        g_mma.fence()
        g_mma.mma_rs(dv_acc, a_p, do_tile + g_off, 1)
        g_mma.commit()
        g_mma.wait(1)            # dPᵀ has landed (dV may still run)
        s_mma.fence_operand(dpt)
        to_frag_s(dpt3, dpt)
        grad.gradients(dpt3, st3, d_addr, t)
        chain(dpt3, dfac)
        # dK += dSᵀ Q, issued behind dV
        for kk in range(BM // 16):
            a_ds[4 * kk], a_ds[4 * kk + 1], a_ds[4 * kk + 2], a_ds[4 * kk + 3] = \
                afrag(dpt3, 0, kk)
        if STORE_DS:   # dS (queries × keys, K-major) for dQ, before dK's wgmma reads a_ds
            to_ds(ds_box, a_ds, lane, warp4)
        g_mma.fence()
        g_mma.mma_rs(dk_acc, a_ds, q_tile + g_off, 1)
        g_mma.commit()

    return products, g_mma, dfac_layout


def dkdv_kernel(cfg: WgmmaBackwardConfig, causal: bool, window=None, softcap: float = 0.0,
                mods=(None, None, None), mask_block=None, varlen: bool = False):
    """``kernel(q, k, v, do_, lse2, delta, dk, dv, dq_acc, scale, scale_log2, hargs)``
    (``dq_acc`` read with ``cfg.dq_atomic``) —
    :func:`tilepy.ops.attention_backward_mma_sync.dkdv_kernel`'s contract and variants
    (``window``, ``softcap``, ``mods``, ``mask_block``, and ``varlen``: packed sequences,
    without ``dq_atomic``); grid ``(ceil(Sk / block_n), Hkv, B)`` (``varlen``: the longest
    sequence's keys and the sequences), ``cfg.threads`` threads, ``cfg.dkdv_layout.nbytes``
    of dynamic shared memory (1024-byte aligned)."""
    if varlen and cfg.dq_atomic:
        raise NotImplementedError("dkdv_kernel: packed sequences take dQ's own kernel (no "
                                  "dq_atomic: the accumulator's rows outside every sequence "
                                  "would need clearing)")
    return _dkdv_kernel(cfg, *kernel_variant(causal, window, softcap, mods, mask_block,
                                             cfg.block_m, cfg.block_n, varlen), bool(varlen))


def _key_blocks(cfg: WgmmaBackwardConfig, left: int, right: int, mask_block, varlen: bool):
    """``(locate, coords)`` of a dK / dV kernel: its block's batch or packed sequence
    (:func:`~tilepy.ops.attention_backward_mma_sync.key_sequence`) and its key block in the
    grid's order (:func:`tilepy.tile.attention_backward.key_block_order`, heaviest first
    where :attr:`WgmmaBackwardConfig.heavy_first` and the blocks' work falls with their
    index)."""
    sparse = mask_block is not None
    heavy = cfg.heavy_first and heavy_keys(left, right, sparse, varlen)
    return (bk.key_sequence(varlen, sparse, bk.varlen_pad(cfg)),
            key_block_order(cfg.block_n, cfg.width, heavy))


@functools.cache
def _dkdv_kernel(cfg: WgmmaBackwardConfig, left: int, right: int, cap: float, mods: tuple,
                 mask_block, varlen: bool = False):
    BM, BN, D = cfg.block_m, cfg.block_n, cfg.width
    VARLEN = varlen
    locate, coords = _key_blocks(cfg, left, right, mask_block, varlen)
    WIN = (left, right)
    SPARSE = mask_block is not None
    THREADS = cfg.threads
    NQ = BM // 8
    NO = cfg.head_dim // 8   # the n8 column blocks stored (of the tile's NW): dK's
    NO_V = cfg.dv // 8       # and dV's
    NW = D // 8
    lay = cfg.dkdv_layout
    K_OFF, V_OFF, Q_OFF, DO_OFF = (lay.offset(n) for n in ("k", "v", "q", "do"))
    L_OFF, DL_OFF = lay.offset("lse2"), lay.offset("delta")
    Q_TILE = BM * D * 2
    ROW_BYTES = BM * 4
    WG_ROWS = 64 * 128       # bytes from one warpgroup's 64 K / V rows to the next's
    ACC_O, ACC_S, A_REGS = D // 2, BM // 2, BM // 4   # registers per thread (local arrays)
    ATOMIC = cfg.dq_atomic
    KG, SL, JOBS = cfg.key_groups, cfg.slices, cfg.dq_jobs
    DS_OFF = lay.offset("ds") if ATOMIC else 0
    DQ_OFF = lay.offset("dq") if ATOMIC else 0
    COUNT_OFF = lay.offset("count")
    # per warpgroup: which slice, from which key box, over how many keys (see dq_jobs)
    KDQ = BN if (KG > 1 and SL == KG) else 64
    SPLIT = KG > 1 and SL == KG      # warpgroup w: slice w over every key
    OWN = KG > 1 and SL == 1         # warpgroup w: slice 0 over its own keys

    @inline_device
    def job_slice(job, wg):
        """The 64-column dQ slice of a warpgroup's job (one key warpgroup: job j, slice j)."""
        if SPLIT:
            return wg
        if OWN:
            return 0
        return job

    smem = dynamic_shared(1024)
    issue_kv = copy_rows_to_shared_128b(BN, D, THREADS, cfg.head_dim)
    issue_q = copy_rows_to_shared_128b(BM, D, THREADS, cfg.head_dim)
    # v and dout: v's head dim (the same copies where it is q's)
    issue_v = copy_rows_to_shared_128b(BN, D, THREADS, cfg.dv)
    issue_do = copy_rows_to_shared_128b(BM, D, THREADS, cfg.dv)
    dq_mma = warpgroup_mma(64, SmemOperand(D, BN, "mn"), SmemOperand(BM, BN, "k"), cfg.dtype,
                           k=KDQ) if ATOMIC else None
    setup_r, issue_r = copy_rows_to_shared(1, 2 * BM, THREADS, False)
    products, g_mma, (DF_SHAPE, DF_TYPE) = key_block_products(cfg, False, WIN, cap, mods,
                                                                    SPARSE)
    to_frag_o, _ = accumulator_fragment(D)
    qblocks = query_blocks(BM, False, WIN, BN)
    _, step_of, first_step, _ = query_steps(BM, BN, mask_block)
    count_steps = counted_steps(BM, BN, mask_block)
    store = store_accumulators(1, NO, cfg.dtype)
    store_v = store_accumulators(1, NO_V, cfg.dtype)
    stage_dq = stage_float32(64, DQ_ROW)

    @bk.kernel_jit(THREADS, disk_cache=not reads_hook(mods))
    def kernel(q, k, v, do_, lse2, delta, dk, dv, dq_acc, scale, scale_log2, hargs):
        sq, sk, b, hk, group, key0, kbx = coords(q, k)
        # packed sequence b: query rows q_start … of the (batch 1) views, keys k_start …
        q_start, k_start, sq, sk, hook, qmask, vb, r_start = locate(hargs, b, sq, sk)
        if VARLEN and key0 >= sk:
            return      # past this sequence's keys (the grid fits the longest)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        wg = warp // 4
        g = lane // 4
        t = lane % 4
        issuer = tid % 128 == 0      # thread 0 of each warpgroup issues its bulk reductions
        shift = sk - sq
        qb0, per_head = qblocks(key0, sq, sk)
        hq0 = hk * group
        steps = count_steps(shared_addr(smem(), 0) + COUNT_OFF, tid, qmask, kbx, b, hq0, group,
                            per_head)
        dk_acc = cuda.local.array(ACC_O, np.float32)
        dv_acc = cuda.local.array(ACC_O, np.float32)
        for i in range(ACC_O):
            dk_acc[i] = _ZERO
            dv_acc[i] = _ZERO

        if steps > 0:
            base = shared_addr(smem(), 0)
            ks = k.strides[2]
            vs = v.strides[2]
            qs = q.strides[2]
            ds_ = do_.strides[2]
            issue_kv(base + K_OFF, np.int64(global_addr(k, (vb, hk, k_start + key0, 0))), ks,
                     sk - key0, tid)
            issue_v(base + V_OFF, np.int64(global_addr(v, (vb, hk, k_start + key0, 0))), vs,
                    sk - key0, tid)
            l0, lsh, lr, lc = setup_r(np.int64(global_addr(lse2, (vb, hq0, r_start))), 0, tid)
            e0, esh, er, ec = setup_r(np.int64(global_addr(delta, (vb, hq0, r_start))), 0, tid)
            hstep_r = lse2.strides[1]
            fh, fqb, _, _, _ = first_step(qb0, per_head, qmask, kbx, b, hq0, group)
            row = fqb * BM
            issue_q(base + Q_OFF, np.int64(global_addr(q, (vb, hq0 + fh, q_start + row, 0))),
                    qs, sq - row, tid)
            issue_do(base + DO_OFF, np.int64(global_addr(do_, (vb, hq0 + fh, q_start + row,
                                                               0))), ds_, sq - row, tid)
            issue_r(base + L_OFF, fh * hstep_r + row * 4, l0, lsh, lr, lc, 0, 1)
            issue_r(base + DL_OFF, fh * hstep_r + row * 4, e0, esh, er, ec, 0, 1)
            cp_async_commit_group()

            st = cuda.local.array(ACC_S, np.float32)
            dpt = cuda.local.array(ACC_S, np.float32)
            st3 = cuda.local.array((1, NQ, 4), np.float32)
            dpt3 = cuda.local.array((1, NQ, 4), np.float32)
            dfac = cuda.local.array(DF_SHAPE, DF_TYPE)   # (read by variants only)
            a_p = cuda.local.array(A_REGS, np.uint32)
            a_ds = cuda.local.array(A_REGS, np.uint32)
            k_wg = base + K_OFF + wg * WG_ROWS
            v_wg = base + V_OFF + wg * WG_ROWS
            my_key = key0 + warp * 16 + g
            edge = key0 + BN > sk     # the block holds zero-filled keys past sk
            ds_wg = base + DS_OFF + wg * (BM * 128)   # this warpgroup's 64-key box of dS
            if ATOMIC:
                dq_stage = base + DQ_OFF + wg * (JOBS * DQ_TILE_BYTES)
                dq_part = cuda.local.array(32, np.float32)

            for n in range(steps):
                cp_async_wait_group(0)
                fence_proxy_async_shared()   # the copies (generic proxy) before wgmma reads
                cuda.syncthreads()
                ch, cqb, cpart = step_of(n, qb0, per_head, qmask, kbx, b, hq0, group)
                row = cqb * BM
                hq = hq0 + ch
                if n + 1 < steps:
                    nh, nqb, _ = step_of(n + 1, qb0, per_head, qmask, kbx, b, hq0, group)
                    nh += hq0
                    nrow = nqb * BM
                    so = (n + 1) % 2
                    issue_q(base + Q_OFF + so * Q_TILE,
                            np.int64(global_addr(q, (vb, nh, q_start + nrow, 0))), qs,
                            sq - nrow, tid)
                    issue_do(base + DO_OFF + so * Q_TILE,
                             np.int64(global_addr(do_, (vb, nh, q_start + nrow, 0))), ds_,
                             sq - nrow, tid)
                    issue_r(base + L_OFF + so * ROW_BYTES, (nh - hq0) * hstep_r + nrow * 4,
                            l0, lsh, lr, lc, 0, 1)
                    issue_r(base + DL_OFF + so * ROW_BYTES, (nh - hq0) * hstep_r + nrow * 4,
                            e0, esh, er, ec, 0, 1)
                cp_async_commit_group()
                sgo = n % 2
                q_tile = base + Q_OFF + sgo * Q_TILE
                do_tile = base + DO_OFF + sgo * Q_TILE
                l_addr = base + L_OFF + sgo * ROW_BYTES
                d_addr = base + DL_OFF + sgo * ROW_BYTES

                products(st, dpt, st3, dpt3, dfac, a_p, a_ds, dk_acc, dv_acc, k_wg, v_wg,
                         q_tile, do_tile, 0, l_addr, d_addr, row + shift - key0,
                         my_key - shift - (row + 2 * t), edge, my_key, sk, ds_wg, lane,
                         warp % 4, t, scale_log2, scale, row + 2 * t, b, hq, hook, cpart)

                if ATOMIC:   # dS is in this warpgroup's box (products)
                    fence_proxy_async_shared()
                    if issuer:
                        bulk_wait_group_read(0)   # last step's partials have been read
                    cuda.syncthreads()
                    for job in range(JOBS):
                        sl = job_slice(job, wg)
                        box = wg if OWN else 0
                        dq_mma.fence()
                        dq_mma.mma(dq_part, base + DS_OFF + box * 8192,
                                   base + K_OFF + sl * (BN * 128) + box * 8192, 0)
                        dq_mma.commit()
                        dq_mma.wait(0)
                        dq_mma.fence_operand(dq_part)
                        stage_dq(dq_stage + job * DQ_TILE_BYTES, dq_part, 0, warp % 4, g, t)
                    fence_proxy_async_shared()
                    cuda.syncthreads()
                    if issuer:
                        for job in range(JOBS):
                            bulk_reduce_add_f32(
                                global_addr(dq_acc, (b, hq, blocked_row(
                                    row, SL, job_slice(job, wg)), 0)),
                                dq_stage + job * DQ_TILE_BYTES, DQ_TILE_BYTES)
                        bulk_commit_group()
                g_mma.wait(0)
                g_mma.fence_operand(dk_acc)
                g_mma.fence_operand(dv_acc)

        if ATOMIC:
            if issuer and steps > 0:
                bulk_wait_group(0)
        out3 = cuda.local.array((1, NW, 4), np.float32)
        if VARLEN:   # (read again: nothing held across the loop for the stores)
            k_start = np.int64(hargs[0][1][b])
        to_frag_o(out3, dk_acc)
        store(out3, dk[vb, hk, k_start:], key0 + warp * 16, sk, scale, g, t)
        to_frag_o(out3, dv_acc)
        store_v(out3, dv[vb, hk, k_start:], key0 + warp * 16, sk, _ONE, g, t)

    return kernel


#: The warp-specialised dK / dV kernel's register split (``setmaxnreg``): producer, then each
#: of the two consumer warpgroups; 24 + 2 · 240 = 504 = 3 · 168, what a block of 384 threads
#: is allocated (FlashAttention-3's backward takes the same split).
WS_REGISTERS = (24, 240)
#: The split where the producer needs more than 24 registers: under a block mask (its walk
#: over the mask's lists), with packed sequences (the lengths come from per-thread loads, so
#: its addresses and row counts are per-thread registers where the fixed-length kernel keeps
#: them in uniform ones) and by query halves (its 256-column copies; the consumers' 32-query
#: score fragments fit 232, where the whole-scores form's do not and keep 24 / 240). The
#: offline spill figures behind each choice are in bench/NOTES.md.
WS_REGISTERS_SPARSE = (40, 232)


def dkdv_ws_kernel(cfg: WgmmaBackwardConfig, causal: bool, window=None, softcap: float = 0.0,
                   mods=(None, None, None), mask_block=None, varlen: bool = False):
    """``kernel(q, k, v, do_, lse2, delta, dk, dv, dq_acc, scale, scale_log2, hargs)`` — the
    warp-specialised dK / dV / dQ kernel of a ``producer`` config (FlashAttention-3's backward
    design): :func:`dkdv_kernel`'s contract with dQ always reduced into ``dq_acc``
    (:func:`dq_blocked_shape`); grid ``(ceil(Sk / 128), Hkv, B)``, ``cfg.threads`` (384)
    threads, ``cfg.dkdv_layout.nbytes`` of dynamic shared memory.

    * Warpgroup 0 produces: its 128 threads cp.async the block's K and V once, then each query
      block's Q, dO, lse2 and delta into a 2-slot ring (:func:`tilepy.tile.pipeline.
      tma_pipeline` with cp.async producers), each slot once the consumers released it. Each
      producer thread waits for its copies and fences them into the async proxy before it
      arrives (``arrive_copied``; with the first slot's arrival also on the ``kv`` mbarrier),
      so the consumers' wgmmas read the slots with no fence of their own.
    * Consumer warpgroups 1, 2 own 64 keys each and run :func:`key_block_products` per query
      block, then write ``dS`` transposed into one of two shared buffers; ``dQ``'s partial
      ``dS K`` over the block's keys is a 64 × 64 product per consumer — with head_dim 128
      consumer ``c`` takes columns ``64 c …`` over all 128 keys (after a barrier of both
      consumers: it reads the other's ``dS``), with head_dim 64 each takes all columns over
      its own keys — staged in float32 and added into ``dq_acc`` by bulk reductions, one per
      warp for its 16 rows, issued by the warp's lane 0 after a warp_sync. Lane 0 waits for
      a reduction's reads one step later, before the dS barrier, which every lane passes
      before it rewrites the staging.

    * ``split_columns`` (head dims past 128, 256-column tiles): the block's 64 keys are both
      consumers'; consumer ``c`` accumulates columns ``128 c …`` of dK and dV and reduces dQ's
      slices ``2 c``, ``2 c + 1`` over the block's keys from a dS box (a head dim of three
      64-column slices, 136 … 192: consumer 0 slice 0, consumer 1 slices 1 and 2, since its
      dV / dK span 64 columns to consumer 0's 128). Both consumers
      meet at a barrier once their dV and dK retired; consumer 0 then stages its slices in
      the step's Q tile, consumer 1 in its dO tile (swizzled float32 rows,
      :func:`dq_row_floats`), and each warp releases the slot a step later, once its bulk
      reductions have read it. With ``query_halves`` each consumer
      computes ``Sᵀ`` / ``dPᵀ`` for its 32 of the step's queries and stores its rows of P and
      dS into shared boxes (dS in two, alternating by step: the other consumer's dQ products
      may still read the last); after one barrier of both consumers, dV and dK read them as
      MN-major A operands and dQ reads dS as a K-major one.

    ``varlen``: packed sequences (:func:`dkdv_kernel`'s views, grid and ``hargs``); dQ goes
    into the accumulator's virtual rows from
    :func:`~tilepy.ops.attention_backward_mma_sync.varlen_acc_row` on (each sequence in
    64-row blocks of its own: no bulk reduction reaches another sequence's rows); the producer
    takes each step from the sequence's words (no walk held across steps) in
    :data:`WS_REGISTERS_SPARSE`'s 40 registers (as under a block mask and by query halves).

    Variants (``window``, ``softcap``, ``mods``, ``mask_block``) as :func:`dkdv_kernel`'s: the
    producer and the consumers walk the same steps one after the other
    (:func:`tilepy.tile.attention_backward.query_steps`' ``first`` / ``advance``: a few
    integers and scalar loads a step, within the producer's 24 registers). Under a block mask
    thread 0 counts the block's steps into shared memory before the first barrier, only the
    producer walks the mask's lists (in :data:`WS_REGISTERS_SPARSE`'s 40 registers) and it
    writes each step's query block and (head, partial) beside the step's ring slot, which the
    consumers read once the slot is full.
    """
    variant = kernel_variant(causal, window, softcap, mods, mask_block, cfg.block_m,
                             cfg.block_n, varlen)
    few = variant[-1] is None and not varlen and not cfg.query_halves  # the producer's
    return _dkdv_ws_kernel(cfg, *variant, WS_REGISTERS if few else WS_REGISTERS_SPARSE,
                           bool(varlen))


@functools.cache
def _dkdv_ws_kernel(cfg: WgmmaBackwardConfig, left: int, right: int, cap: float, mods: tuple,
                    mask_block, registers=WS_REGISTERS, varlen: bool = False):
    BM, BN, D = cfg.block_m, cfg.block_n, cfg.width
    VARLEN = varlen
    locate, coords = _key_blocks(cfg, left, right, mask_block, varlen)
    WIN = (left, right)
    SPARSE = mask_block is not None
    KG, SL = cfg.key_groups, cfg.slices
    CONS = cfg.consumers
    # split_columns: both consumers over the block's 64 keys, consumer c's dK / dV / dQ
    # columns HALF · c … (HALF_B bytes into the MN-major Q / dO tiles)
    COLS = cfg.split_columns
    HALF = D // 2 if COLS else D
    HALF_B = (HALF // 64) * BM * 128
    THREADS = cfg.threads
    PT = 128                 # producer threads
    NQ = BM // 8
    NO = cfg.head_dim // 8   # the n8 column blocks stored (of the tile's NW): dK's
    NO_V = cfg.dv // 8       # and dV's
    NW = HALF // 8           # a consumer's accumulator columns in n8 blocks
    lay = cfg.dkdv_layout
    K_OFF, V_OFF, Q_OFF, DO_OFF = (lay.offset(n) for n in ("k", "v", "q", "do"))
    L_OFF, DL_OFF = lay.offset("lse2"), lay.offset("delta")
    DS_OFF, BAR_OFF = lay.offset("ds"), lay.offset("bars")
    DQ_OFF = 0 if COLS else lay.offset("dq")
    Q_TILE = BM * D * 2
    DS_BYTES = BM * BN * 2
    ROW_BYTES = BM * 4
    WG_ROWS = 64 * 128
    ACC_O, ACC_S, A_REGS = HALF // 2, BM // 2, BM // 4
    # split columns, head dims narrower than the tile (136 … 248): the second consumer's
    # dV / dK products span only the 64-column sub-tiles that hold valid columns of either
    # (N_HI), and dQ's valid slices only are reduced; the score products run over the valid
    # columns rounded to k16 (KV: the copies zero-fill up to the tile's end, and nothing
    # stored reads a column past them)

    def hi_columns(valid):
        """The second consumer's 64-column sub-tiles that hold any of ``valid`` columns."""
        return min(HALF, max(0, -(-(valid - HALF) // 64) * 64))

    N_HI = max(hi_columns(cfg.head_dim), hi_columns(cfg.dv)) if COLS else HALF
    KV = -(-max(cfg.head_dim, cfg.dv) // 16) * 16
    # consumer c: columns 64 c … over every key; else (own keys, split columns) its own box
    SPLIT = not cfg.own_keys and not COLS
    KDQ = BN if SPLIT else 64
    JOBS = cfg.dq_jobs        # a consumer's 64-column dQ slices, one product each
    # split columns: dQ's valid slices, the first consumer's JOBS_LO of them and the second's
    # the rest — any consumer can take any slice (dS is in the shared box), so where the
    # second consumer's dV / dK are narrower (N_HI < HALF) it takes the odd slice and the
    # consumers' steps, which meet at barriers, stay even (at 192: 1 and 2 slices)
    VALID_SLICES = max(2, (HALF + hi_columns(cfg.head_dim)) // 64) if COLS else 2 * JOBS
    JOBS_LO = VALID_SLICES // 2 if COLS else JOBS
    JOBS_HI = VALID_SLICES - JOBS_LO if COLS else JOBS
    SLICE_B = BN * 128        # bytes from one 64-column box of K to the next
    # two dS buffers where both consumers read one (a step's dQ products may still read the
    # last one while the other consumer writes the next)
    DS_BUFFERS = 2 if SPLIT or cfg.query_halves else 1
    STAGES = cfg.stages
    ring = tma_pipeline(STAGES, 4 * CONS, 1, producers=PT)
    KV_BAR = ring.nbytes     # after the ring's barriers
    # block-sparse: the producer writes each step's query block and (head offset, part) into
    # its ring slot's two step words (after the K / V barrier) before it arrives, and the
    # consumers read them once the slot is full: they keep no list
    STEP = KV_BAR + 8
    COUNT = STEP + 2 * 8     # and the block's step count, thread 0's
    # packed sequences (never block-sparse): the block's sequence words — q_start, k_start,
    # sq, sk — written by thread 0 before the first barrier and read where they are used,
    # and the steps passed in the step words as under a block mask: the lengths come from
    # per-thread loads, so what derives from them (the walk) lives in per-thread registers
    # where the fixed-length kernel keeps it in uniform ones, from the kernel parameters
    # (offline sm_90a, d128: the walk and lengths held in the consumers spilled 304 B)
    SEQ = COUNT + 8
    STEP_WORDS = SPARSE or VARLEN
    if STEP_WORDS and SEQ + 16 > lay["bars"].nbytes:
        raise ValueError(f"dkdv_ws_kernel: no room for the step words in {lay['bars'].nbytes} "
                         f"bytes of barriers")

    @inline_device
    def sequence(bars, i, value):
        """Word ``i`` of the block's packed sequence (int64), or ``value`` without
        packed sequences."""
        if VARLEN:
            return np.int64(ld_shared_b32(bars + SEQ + 4 * i))
        return value

    roles = warpgroup_roles(CONS, True, True, *registers)
    named = NamedBarriers()
    DS_BAR = named.take("ds", 128 * CONS)          # both consumers' dS written
    WG_BAR = named.take("warpgroup", 128, count=CONS)  # one consumer's dS written (own box)
    ROWF = dq_row_floats(D)
    STAGE_TILE = 64 * ROWF * 4                     # a staged 64 × 64 dQ partial
    WARP_STAGE = 16 * ROWF * 4                     # a warp's rows of it
    # split columns: staged in the slot's Q (consumer 0) or dO tile (1), once both retired
    # their dV / dK products (the other consumer's read both tiles)
    STAGE_BAR = named.take("stage", 128 * CONS) if COLS else 0
    if COLS and JOBS_HI * STAGE_TILE > Q_TILE:
        raise ValueError(f"dkdv_ws_kernel: {JOBS_HI} staged dQ slices do not fit a Q tile")

    smem = dynamic_shared(1024)
    issue_kv = copy_rows_to_shared_128b(BN, D, PT, cfg.head_dim)
    issue_q = copy_rows_to_shared_128b(BM, D, PT, cfg.head_dim)
    # v and dout: v's head dim (the same copies where it is q's)
    issue_v = copy_rows_to_shared_128b(BN, D, PT, cfg.dv)
    issue_do = copy_rows_to_shared_128b(BM, D, PT, cfg.dv)
    setup_r, issue_r = copy_rows_to_shared(1, 2 * BM, PT, False)
    products, g_mma, (DF_SHAPE, DF_TYPE) = key_block_products(cfg, False, WIN, cap, mods,
                                                              SPARSE, HALF)
    dq_mma = warpgroup_mma(64, SmemOperand(D, BN, "mn"), SmemOperand(BM, BN, "k"),
                           cfg.dtype, k=KDQ)
    to_frag_o, _ = accumulator_fragment(HALF)
    qblocks = query_blocks(BM, False, WIN, BN)
    _, step_at, first_step, advance = query_steps(BM, BN, mask_block)
    count_steps = counted_steps(BM, BN, mask_block)
    # the stores: every column, or (split columns) each consumer's stored n8 blocks
    # (split columns: the second consumer stores dK's / dV's columns past HALF, if any)
    store = store_accumulators(1, min(NO, HALF // 8), cfg.dtype)
    store_hi = store_accumulators(1, max(1, NO - HALF // 8), cfg.dtype) if COLS else store
    store_v = store_accumulators(1, min(NO_V, HALF // 8), cfg.dtype)
    store_v_hi = store_accumulators(1, max(1, NO_V - HALF // 8), cfg.dtype) if COLS else \
        store_v
    K_HI, V_HI = NO > HALF // 8, NO_V > HALF // 8
    stage_dq = stage_float32(64, ROWF, dq_swizzled(D))
    QH = cfg.query_halves
    P_OFF = lay.offset("p") if QH else 0
    if QH:
        # each consumer's Sᵀ / dPᵀ over its 32 of the step's queries (A: K / V, B: its rows
        # of the K-major Q / dO tiles); P and dS through shared boxes (queries × 64 keys),
        # read by dV / dK as MN-major A (M = keys) and by dQ as K-major A
        HQ = BM // 2
        NQH = HQ // 8
        h_mma = warpgroup_mma(HQ, SmemOperand(BM, D, "k"), SmemOperand(BN, D, "k"), cfg.dtype,
                              k=KV)
        gs_mma = warpgroup_mma(HALF, SmemOperand(D, BM, "mn"), SmemOperand(BN, BM, "mn"),
                               cfg.dtype)
        gs_hi = warpgroup_mma(N_HI, SmemOperand(D, BM, "mn"), SmemOperand(BN, BM, "mn"),
                              cfg.dtype)
        NARROW = N_HI < HALF
        to_frag_h, _ = accumulator_fragment(HQ)
        grad_h = softmax_gradient(1, NQH, "cols")
        key_scores_h, chain_h, (DF_SHAPE, DF_TYPE) = key_block_scores(
            NQH, BN, False, WIN, cap, mods, SPARSE)
        # the consumer's fragments are of its 32 queries
        NQ, ACC_S, A_REGS = NQH, HQ // 2, HQ // 4
        afrag = a_fragment(cfg.dtype)
        to_box = transpose_to_shared(NQH)
        PDS_BAR = named.take("p_ds", 128 * CONS)   # both consumers' rows of P and dS written

        @inline_device
        def products_halves(st, dpt, st3, dpt3, dfac, a_p, a_ds, dk_acc, dv_acc, k_tile,
                            v_tile, q_tile, do_tile, g_off, l_addr, d_addr, block_diag,
                            key_shift, edge, my_key, sk, ds_box, p_box, c, lane, warp4, t,
                            scale_log2, scale, col0, b, hq, hook, part):
            qo = c * (HQ * 128)          # this consumer's query rows in the K-major boxes
            h_mma.mma_pair(st, k_tile, q_tile + qo, dpt, v_tile, do_tile + qo)
            to_frag_h(st3, st)
            key_scores_h(st3, dfac, scale, my_key, col0 + c * HQ, b, hq, hook, part,
                         block_diag + c * HQ, key_shift - c * HQ, edge, sk)
            grad_h.probabilities(st3, l_addr + c * (HQ * 4), scale_log2, t)
            for kk in range(HQ // 16):
                a_p[4 * kk], a_p[4 * kk + 1], a_p[4 * kk + 2], a_p[4 * kk + 3] = \
                    afrag(st3, 0, kk)
            to_box(p_box + qo, a_p, lane, warp4)
            h_mma.wait(0)                # dPᵀ has landed
            h_mma.fence_operand(dpt)
            to_frag_h(dpt3, dpt)
            grad_h.gradients(dpt3, st3, d_addr + c * (HQ * 4), t)
            chain_h(dpt3, dfac)
            for kk in range(HQ // 16):
                a_ds[4 * kk], a_ds[4 * kk + 1], a_ds[4 * kk + 2], a_ds[4 * kk + 3] = \
                    afrag(dpt3, 0, kk)
            to_box(ds_box + qo, a_ds, lane, warp4)
            fence_proxy_async_shared()   # (generic-proxy stores before wgmma reads)
            bar_sync(PDS_BAR, 128 * CONS)
            if NARROW and c == 1:   # (warpgroup-uniform) the valid sub-tiles only
                gs_hi.fence()
                gs_hi.mma(dv_acc, p_box, do_tile + g_off, 1)
                gs_hi.mma(dk_acc, ds_box, q_tile + g_off, 1)
                gs_hi.commit()
            else:
                gs_mma.fence()
                gs_mma.mma(dv_acc, p_box, do_tile + g_off, 1)    # dV += Pᵀ dO (its columns)
                gs_mma.mma(dk_acc, ds_box, q_tile + g_off, 1)    # dK += dSᵀ Q
                gs_mma.commit()
    else:
        products_halves = None

    @inline_device
    def produce(base, q, k, v, do_, lse2, delta, b, hk, key0, qb0, per_head, steps, group,
                sq, sk, tid, qmask, kb, vb, q_start, k_start, r_start):
        bars = base + BAR_OFF
        issue_kv(base + K_OFF, np.int64(global_addr(k, (vb, hk, k_start + key0, 0))),
                 k.strides[2], sk - key0, tid)
        issue_v(base + V_OFF, np.int64(global_addr(v, (vb, hk, k_start + key0, 0))),
                v.strides[2], sk - key0, tid)
        hq0 = hk * group
        l0, lsh, lr, lc = setup_r(np.int64(global_addr(lse2, (vb, hq0, r_start))), 0, tid)
        e0, esh, er, ec = setup_r(np.int64(global_addr(delta, (vb, hq0, r_start))), 0, tid)
        s, ph = 0, 0
        if not VARLEN:
            walk = first_step(qb0, per_head, qmask, kb, b, hq0, group)   # step n's
        for n in range(steps):
            if VARLEN:   # step n from the sequence words (no walk held across steps)
                qb0, per_head = qblocks(key0, sequence(bars, 2, sq), sequence(bars, 3, sk))
                walk = step_at(n, qb0, per_head, qmask, kb, b, hq0, group)
            hq = hq0 + walk[0]
            row = walk[1] * BM
            qs = sequence(bars, 0, q_start)
            left = sequence(bars, 2, sq) - row      # query rows left in the sequence
            ring.acquire(bars, s, ph)
            issue_q(base + Q_OFF + s * Q_TILE,
                    np.int64(global_addr(q, (vb, hq, qs + row, 0))), q.strides[2], left, tid)
            issue_do(base + DO_OFF + s * Q_TILE,
                     np.int64(global_addr(do_, (vb, hq, qs + row, 0))), do_.strides[2], left,
                     tid)
            shift_r = (hq - hq0) * lse2.strides[1] + row * 4
            issue_r(base + L_OFF + s * ROW_BYTES, shift_r, l0, lsh, lr, lc, 0, 1)
            issue_r(base + DL_OFF + s * ROW_BYTES, shift_r, e0, esh, er, ec, 0, 1)
            if STEP_WORDS and tid == 0:   # (released by the arrival below)
                st_shared_b32(bars + STEP + 8 * s, np.uint32(walk[1]))
                st_shared_b32(bars + STEP + 8 * s + 4,
                              np.uint32(2 * walk[0] + (1 if walk[2] else 0)))
            ring.arrive_copied(bars, s)   # K / V's copies (n = 0) waited for with the slot's
            if n == 0:
                mbarrier_arrive(bars + KV_BAR)
            s, ph = ring.advance(s, ph)
            if not VARLEN:
                walk = advance(walk, qb0, per_head, qmask, kb, b, hq0, group)

    @inline_device
    def consume(base, dk_acc, dv_acc, dq_acc, b, hk, key0, qb0, per_head, steps, group, sq,
                sk, c, tid, scale_log2, scale, hook, qmask, kb, vb):
        bars = base + BAR_OFF
        lane = tid % 32
        cw = tid // 32 - 4       # the consumer warp, 0 … 4 KG - 1
        warp4 = cw % 4
        g = lane // 4
        t = lane % 4
        issuer = lane == 0       # issues the warp's bulk reductions
        shift = sk - sq
        my_key = key0 + (warp4 if COLS else cw) * 16 + g
        edge = key0 + BN > sk    # the block holds zero-filled keys past sk
        k_wg = base + K_OFF + (0 if COLS else c * WG_ROWS)
        v_wg = base + V_OFF + (0 if COLS else c * WG_ROWS)
        g_off = c * HALF_B if COLS else 0
        dq_a = base + DS_OFF + (0 if SPLIT or QH else c * (BM * 128))
        # + job · SLICE_B: the K box of the job's slice
        dq_b = base + K_OFF + (c * SLICE_B if SPLIT else c * JOBS_LO * SLICE_B if COLS
                               else c * WG_ROWS)
        # the first slice this consumer reduces
        sl0 = c if SPLIT else c * JOBS_LO if COLS else 0
        stage = base + DQ_OFF + c * (JOBS * STAGE_TILE)      # (split columns: per step)
        jobs = JOBS_HI if c == 1 else JOBS_LO
        dqp = cuda.local.array(32, np.float32)
        st = cuda.local.array(ACC_S, np.float32)
        dpt = cuda.local.array(ACC_S, np.float32)
        st3 = cuda.local.array((1, NQ, 4), np.float32)
        dpt3 = cuda.local.array((1, NQ, 4), np.float32)
        dfac = cuda.local.array(DF_SHAPE, DF_TYPE)   # (read by variants only)
        a_p = cuda.local.array(A_REGS, np.uint32)
        a_ds = cuda.local.array(A_REGS, np.uint32)
        mbarrier_wait_parity(bars + KV_BAR, 0)
        s, ph = 0, 0
        hq0 = hk * group
        if not STEP_WORDS:
            walk = first_step(qb0, per_head, qmask, kb, b, hq0, group)   # the producer's
        for n in range(steps):
            ring.wait(bars, s, ph)
            if VARLEN:   # (read each step: see SEQ)
                sk = sequence(bars, 3, sk)
                shift = sk - sequence(bars, 2, sq)
                edge = key0 + BN > sk
            if STEP_WORDS:   # the step the producer wrote into the slot
                hp = ld_shared_b32(bars + STEP + 8 * s + 4)
                hq = hq0 + np.int64(hp >> np.uint32(1))
                row = np.int64(ld_shared_b32(bars + STEP + 8 * s)) * BM
                part = (hp & np.uint32(1)) != np.uint32(0)
            else:
                hq = hq0 + walk[0]
                row = walk[1] * BM
                part = walk[2]
            buf = (n % DS_BUFFERS) * DS_BYTES
            if QH:
                products_halves(st, dpt, st3, dpt3, dfac, a_p, a_ds, dk_acc, dv_acc, k_wg,
                                v_wg, base + Q_OFF + s * Q_TILE, base + DO_OFF + s * Q_TILE,
                                g_off, base + L_OFF + s * ROW_BYTES,
                                base + DL_OFF + s * ROW_BYTES, row + shift - key0,
                                my_key - shift - (row + 2 * t), edge, my_key, sk,
                                base + DS_OFF + buf, base + P_OFF, c, lane, warp4, t,
                                scale_log2, scale, row + 2 * t, b, hq, hook, part)
            else:
                products(st, dpt, st3, dpt3, dfac, a_p, a_ds, dk_acc, dv_acc, k_wg, v_wg,
                         base + Q_OFF + s * Q_TILE, base + DO_OFF + s * Q_TILE, g_off,
                         base + L_OFF + s * ROW_BYTES, base + DL_OFF + s * ROW_BYTES,
                         row + shift - key0, my_key - shift - (row + 2 * t), edge, my_key,
                         sk, base + DS_OFF + buf + c * (BM * 128), lane, warp4, t, scale_log2,
                         scale, row + 2 * t, b, hq, hook, part)
            fence_proxy_async_shared()
            if issuer:   # the warp's last partial has been read; the barrier below tells
                bulk_wait_group_read(0)   # the other lanes before they rewrite the staging
            if COLS:
                if n > 0:   # (lane 0, after its wait) the last step's slot: staging read
                    ring.release(bars, s - 1 if s > 0 else STAGES - 1, lane)
                stage = base + (DO_OFF if c else Q_OFF) + s * Q_TILE
            if SPLIT:
                bar_sync(DS_BAR, 128 * KG)
            else:
                bar_sync(WG_BAR + c, 128)
            for job in range(jobs):  # 64 columns each, one after the other (32 registers)
                dq_mma.fence()
                dq_mma.mma(dqp, dq_a + buf, dq_b + job * SLICE_B, 0)
                dq_mma.commit()
                dq_mma.wait(0)                      # (dV, dK and) the slice retired
                dq_mma.fence_operand(dqp)
                if job == 0:
                    g_mma.fence_operand(dk_acc)
                    g_mma.fence_operand(dv_acc)
                    if COLS:   # both consumers' dV / dK retired: the slot is the staging's
                        bar_sync(STAGE_BAR, 128 * CONS)
                    else:
                        ring.release(bars, s, lane)
                stage_dq(stage + job * STAGE_TILE, dqp, 0, warp4, g, t)
            fence_proxy_async_shared()
            warp_sync()
            if issuer:     # the warp's 16 rows: one contiguous range of the blocked layout
                acc0 = 0
                if VARLEN:   # the sequence's first (virtual) row of the accumulator
                    acc0 = bk.varlen_acc_row(sequence(bars, 0, 0), b)
                for job in range(jobs):
                    bulk_reduce_add_f32(global_addr(dq_acc, (
                        vb, hq, blocked_row(acc0 + row + 16 * warp4, SL, sl0 + job), 0)),
                        stage + job * STAGE_TILE + warp4 * WARP_STAGE, WARP_STAGE)
                bulk_commit_group()
            s, ph = ring.advance(s, ph)
            if not STEP_WORDS:
                walk = advance(walk, qb0, per_head, qmask, kb, b, hq0, group)
        if issuer:
            bulk_wait_group(0)

    @bk.kernel_jit(THREADS, 1, disk_cache=not reads_hook(mods))
    def kernel(q, k, v, do_, lse2, delta, dk, dv, dq_acc, scale, scale_log2, hargs):
        sq, sk, b, hk, group, key0, kb = coords(q, k)
        # packed sequence b: query rows q_start … of the (batch 1) views, keys k_start …
        q_start, k_start, sq, sk, hook, qmask, vb, r_start = locate(hargs, b, sq, sk)
        if VARLEN and key0 >= sk:
            return      # past this sequence's keys (the grid fits the longest)
        tid = cuda.threadIdx.x
        c = roles.consumer(roles.warpgroup(tid))
        qb0, per_head = qblocks(key0, sq, sk)
        base = shared_addr(smem(), 0)
        if tid == 0:
            ring.init(base + BAR_OFF)
            mbarrier_init(base + BAR_OFF + KV_BAR, PT)
            fence_mbarrier_init()
            if VARLEN:
                for i, word in enumerate((q_start, k_start, sq, sk)):
                    st_shared_b32(base + BAR_OFF + SEQ + 4 * i, np.uint32(word))
        cuda.syncthreads()
        steps = count_steps(base + BAR_OFF + COUNT, tid, qmask, kb, b, hk * group, group,
                            per_head)
        if c < 0:
            roles.enter_producer()
            if steps > 0:
                produce(base, q, k, v, do_, lse2, delta, b, hk, key0, qb0, per_head, steps,
                        group, sq, sk, tid, qmask, kb, vb, q_start, k_start, r_start)
        else:
            roles.enter_consumer()
            dk_acc = cuda.local.array(ACC_O, np.float32)
            dv_acc = cuda.local.array(ACC_O, np.float32)
            for i in range(ACC_O):
                dk_acc[i] = _ZERO
                dv_acc[i] = _ZERO
            if steps > 0:
                consume(base, dk_acc, dv_acc, dq_acc, b, hk, key0, qb0, per_head, steps,
                        group, sq, sk, c, tid, scale_log2, scale, hook, qmask, kb, vb)
            lane = tid % 32
            cw = tid // 32 - 4
            out3 = cuda.local.array((1, NW, 4), np.float32)
            if VARLEN:   # (read again: nothing held across the loop for the stores)
                k_start = sequence(base + BAR_OFF, 1, k_start)
                sk = sequence(base + BAR_OFF, 3, sk)
            dk2 = dk[vb, hk, k_start:]
            dv2 = dv[vb, hk, k_start:]
            if COLS:   # consumer c: its columns HALF · c … of the block's 64 keys
                r0 = key0 + (cw % 4) * 16
                to_frag_o(out3, dk_acc)
                if c == 0:
                    store(out3, dk2, r0, sk, scale, lane // 4, lane % 4)
                elif K_HI:
                    store_hi(out3, dk2[:, HALF:], r0, sk, scale, lane // 4, lane % 4)
                to_frag_o(out3, dv_acc)
                if c == 0:
                    store_v(out3, dv2, r0, sk, _ONE, lane // 4, lane % 4)
                elif V_HI:
                    store_v_hi(out3, dv2[:, HALF:], r0, sk, _ONE, lane // 4, lane % 4)
            else:
                to_frag_o(out3, dk_acc)
                store(out3, dk2, key0 + cw * 16, sk, scale, lane // 4, lane % 4)
                to_frag_o(out3, dv_acc)
                store_v(out3, dv2, key0 + cw * 16, sk, _ONE, lane // 4, lane % 4)

    return kernel


def dq_kernel(cfg: WgmmaBackwardConfig, causal: bool, window=None, softcap: float = 0.0,
              mods=(None, None, None), mask_block=None, varlen: bool = False):
    """``kernel(q, k, v, do_, lse2, delta, dq, scale, scale_log2, hargs)`` —
    :func:`tilepy.ops.attention_backward_mma_sync.dq_kernel`'s contract and variants
    (``varlen``: packed sequences, as :func:`dkdv_kernel`'s); grid ``(ceil(Sq /
    dq_block_m), Hq, B)`` (``varlen``: the longest sequence's rows and the sequences),
    ``cfg.dq_threads`` threads, ``cfg.dq_layout.nbytes`` of dynamic shared memory
    (1024-byte aligned)."""
    return _dq_kernel(cfg, *kernel_variant(causal, window, softcap, mods, mask_block,
                                           cfg.dq_block_m, cfg.dq_block_n, varlen),
                      bool(varlen))


@functools.cache
def _dq_kernel(cfg: WgmmaBackwardConfig, left: int, right: int, cap: float, mods: tuple,
               mask_block, varlen: bool = False):
    BM, BN, D = cfg.dq_block_m, cfg.dq_block_n, cfg.width
    VARLEN = varlen
    locate = bk.dq_sequence(varlen, mask_block is not None, bk.varlen_pad(cfg))
    WIN = (left, right)
    SPARSE = mask_block is not None
    THREADS = cfg.dq_threads
    NS = BN // 8
    NO = cfg.head_dim // 8   # the n8 column blocks stored (of the tile's NW)
    NW = D // 8
    lay = cfg.dq_layout
    Q_OFF, DO_OFF, KV_OFF = (lay.offset(n) for n in ("q", "do", "kv"))
    KV_TILE = BN * D * 2
    STAGE = 2 * KV_TILE
    WG_ROWS = 64 * 128
    ACC_O, ACC_S, A_REGS = D // 2, BN // 2, BN // 4   # registers per thread (local arrays)

    smem = dynamic_shared(1024)
    issue_q = copy_rows_to_shared_128b(BM, D, THREADS, cfg.head_dim)
    issue_kv = copy_rows_to_shared_128b(BN, D, THREADS, cfg.head_dim)
    # v and dout: v's head dim (the same copies where it is q's)
    issue_do = copy_rows_to_shared_128b(BM, D, THREADS, cfg.dv)
    issue_v = copy_rows_to_shared_128b(BN, D, THREADS, cfg.dv)
    s_mma = warpgroup_mma(BN, SmemOperand(BN, D, "k"), SmemOperand(BM, D, "k"), cfg.dtype)
    q_mma = warpgroup_mma(D, SmemOperand(D, BN, "mn"), None, cfg.dtype)
    to_frag_s, _ = accumulator_fragment(BN)
    to_frag_o, _ = accumulator_fragment(D)
    grad = softmax_gradient(1, NS, "rows")
    row_scores, chain, (DF_SHAPE, DF_TYPE) = query_block_scores(NS, BN, False, WIN, cap, mods,
                                                                SPARSE)
    key_bounds, at, partial = key_steps(BM, BN, False, WIN, mask_block)
    rows = row_state(False, WIN)
    LIMITS = limits_shape(1, False, WIN)
    afrag = a_fragment(cfg.dtype)
    store = store_accumulators(1, NO, cfg.dtype)

    @bk.kernel_jit(THREADS, disk_cache=not reads_hook(mods))
    def kernel(q, k, v, do_, lse2, delta, dq, scale, scale_log2, hargs):
        sq, sk, b, h, hk = block_coords(q, k)
        q_start, k_start, sq, sk, hook, vb, lse2_rows, delta_rows = locate(
            hargs, b, sq, sk, lse2, delta)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        wg = warp // 4
        g = lane // 4
        t = lane % 4
        # steps kb_first … n_kb - 1: key block at(blocks, j) (j but block-sparse)
        row0, kb_first, n_kb, all_first, all_see, blocks = key_bounds(
            sq, sk, hargs[1] if SPARSE else 0, b, h)
        wrow = row0 + warp * 16
        if VARLEN and row0 >= sq:
            return      # past this sequence's rows (the grid fits the longest)

        acc = cuda.local.array(ACC_O, np.float32)
        for i in range(ACC_O):
            acc[i] = _ZERO
        l2 = cuda.local.array((1, 2), np.float32)
        dl = cuda.local.array((1, 2), np.float32)
        limit = cuda.local.array(LIMITS, np.int64)
        rows(lse2_rows, delta_rows, l2, dl, limit, vb, h, wrow, g, sq, sk)

        if n_kb > kb_first:
            base = shared_addr(smem(), 0)
            kv_base = base + KV_OFF
            ks = k.strides[2]
            vs = v.strides[2]
            issue_q(base + Q_OFF, np.int64(global_addr(q, (vb, h, q_start + row0, 0))),
                    q.strides[2], sq - row0, tid)
            issue_do(base + DO_OFF, np.int64(global_addr(do_, (vb, h, q_start + row0, 0))),
                     do_.strides[2], sq - row0, tid)
            k0 = np.int64(global_addr(k, (vb, hk, k_start, 0)))
            v0 = np.int64(global_addr(v, (vb, hk, k_start, 0)))
            first = kv_base + (kb_first % 2) * STAGE
            kbf = at(blocks, kb_first)
            issue_kv(first, k0 + kbf * BN * ks, ks, sk - kbf * BN, tid)
            issue_v(first + KV_TILE, v0 + kbf * BN * vs, vs, sk - kbf * BN, tid)
            cp_async_commit_group()

            s = cuda.local.array(ACC_S, np.float32)
            dp = cuda.local.array(ACC_S, np.float32)
            s3 = cuda.local.array((1, NS, 4), np.float32)
            dp3 = cuda.local.array((1, NS, 4), np.float32)
            dfac = cuda.local.array(DF_SHAPE, DF_TYPE)   # (read by variants only)
            a_regs = cuda.local.array(A_REGS, np.uint32)
            q_wg = base + Q_OFF + wg * WG_ROWS
            do_wg = base + DO_OFF + wg * WG_ROWS

            for jb in range(kb_first, n_kb):   # step jb: key block kb (jb but block-sparse)
                kb = at(blocks, jb)
                cp_async_wait_group(0)
                fence_proxy_async_shared()
                cuda.syncthreads()
                if jb + 1 < n_kb:
                    nxt = kv_base + ((jb + 1) % 2) * STAGE
                    kn = at(blocks, jb + 1)
                    left = sk - kn * BN
                    issue_kv(nxt, k0 + kn * BN * ks, ks, left, tid)
                    issue_v(nxt + KV_TILE, v0 + kn * BN * vs, vs, left, tid)
                cp_async_commit_group()
                k_tile = kv_base + (jb % 2) * STAGE
                v_tile = k_tile + KV_TILE

                s_mma.mma_pair(s, q_wg, k_tile, dp, do_wg, v_tile)   # S = Q Kᵀ, dP = dO Vᵀ
                to_frag_s(s3, s)
                # the variant's modifications; keys past a row's last (or sk), or (a
                # window) before its first
                row_scores(s3, dfac, scale, wrow + g, kb, t, b, h, hook, partial(blocks, jb),
                           limit, all_first, all_see)
                grad.probabilities(s3, l2, scale_log2)
                s_mma.wait(0)
                s_mma.fence_operand(dp)
                to_frag_s(dp3, dp)
                grad.gradients(dp3, s3, dl)
                chain(dp3, dfac)
                for kk in range(BN // 16):
                    a_regs[4 * kk], a_regs[4 * kk + 1], a_regs[4 * kk + 2], \
                        a_regs[4 * kk + 3] = afrag(dp3, 0, kk)
                q_mma.fence()
                q_mma.mma_rs(acc, a_regs, k_tile, 1)
                q_mma.commit()
                q_mma.wait(0)
                q_mma.fence_operand(acc)

        out3 = cuda.local.array((1, NW, 4), np.float32)
        to_frag_o(out3, acc)
        store(out3, dq[vb, h, q_start:], wrow, sq, scale, g, t)

    return kernel


@functools.cache
def dq_convert_blocked(head_dim: int, dtype: str, varlen: bool = False, width=None,
                       vector: bool = True):
    """``kernel(dq_acc, dq, scale, cu_seqlens_q)``: ``dq = scale · dq_acc`` rounded to
    ``dtype``, from the blocked accumulator of :func:`dq_blocked_shape` (tiles ``width``
    wide — the config's :attr:`WgmmaBackwardConfig.width`, by default :func:`tile_width` of
    ``head_dim``; the columns past ``head_dim`` are not stored); grid ``(ceil(Sq /
    16), Hq, B)``, :data:`~tilepy.ops.attention_backward_mma_sync.ROW_THREADS` threads;
    ``cu_seqlens_q`` not read. ``varlen``: packed sequences — grid ``(ceil(max_seqlen_q /
    16), Hq, sequences)``, sequence ``z``'s row ``r`` from the accumulator's virtual row
    :func:`~tilepy.ops.attention_backward_mma_sync.varlen_acc_row` + ``r`` into ``dq``'s
    packed row ``cu_seqlens_q[z] + r`` (batch 1); rows outside every sequence untouched."""
    W = tile_width(head_dim) if width is None else int(width)
    store8 = words_store(vector)
    SL = W // 64
    DH = head_dim
    VARLEN = varlen
    SWZ = dq_swizzled(W)
    pack = cvt_f16x2_f32 if dtype == "float16" else cvt_bf16x2_f32
    LANES, ROWS = bk.ROW_LANES, bk.ROWS_PER_BLOCK

    @_jit(bk.ROW_THREADS)
    def kernel(dq_acc, dq, scale, cu_q):
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % LANES
        row = cuda.blockIdx.x * ROWS + tid // LANES
        if VARLEN:
            q_start = np.int64(cu_q[b])
            sq = np.int64(cu_q[b + 1]) - q_start
            vrow = bk.varlen_acc_row(q_start, b) + row
            a2 = dq_acc[0, h]
            o2 = dq[0, h, q_start:]
        else:
            sq = dq.shape[2]
            vrow = row
            a2 = dq_acc[b, h]
            o2 = dq[b, h]
        if row < sq:
            for sl in range(SL):
                src = blocked_row(vrow, SL, sl)
                c = 8 * lane
                if 64 * sl + c >= DH:
                    continue
                if SWZ:   # chunks 2 lane, 2 lane + 1 of the row, where the staging put them
                    x = ld_global_v4(a2, src, swizzled_chunk(src, 2 * lane) * 4)
                    y = ld_global_v4(a2, src, swizzled_chunk(src, 2 * lane + 1) * 4)
                else:
                    x = ld_global_v4(a2, src, c)
                    y = ld_global_v4(a2, src, c + 4)
                store8(o2, row, 64 * sl + c, pack(x[0] * scale, x[1] * scale),
                       pack(x[2] * scale, x[3] * scale), pack(y[0] * scale, y[1] * scale),
                       pack(y[2] * scale, y[3] * scale))

    return kernel


def dq_acc_shape(cfg: WgmmaBackwardConfig, batch: int, heads: int, sqp: int) -> tuple:
    """The float32 dQ accumulator a call with atomics needs."""
    return dq_blocked_shape(batch, heads, sqp, cfg.width)


def varlen_atomic(cfg, deterministic: bool) -> bool:
    """Whether a packed-sequence call takes dQ by bulk reductions: the warp-specialised
    kernel's configs (``producer``) without ``deterministic``; the others take dQ's own
    kernel."""
    return isinstance(cfg, WgmmaBackwardConfig) and cfg.producer and \
        bk.uses_atomics(cfg, deterministic)


def varlen_dq_acc_shape(cfg: WgmmaBackwardConfig, heads: int, total_q: int,
                        sequences: int) -> tuple:
    """The float32 dQ accumulator of a packed-sequence call with :func:`varlen_atomic`:
    :func:`dq_blocked_shape` over :func:`~tilepy.ops.attention_backward_mma_sync.
    varlen_acc_rows` virtual rows, batch 1."""
    return dq_blocked_shape(1, heads, bk.varlen_acc_rows(total_q, sequences), cfg.width)


def plans(cfg: WgmmaBackwardConfig, causal: bool, deterministic: bool, views: dict,
          scale: float, window=None, softcap: float = 0.0, mods=(None, None, None), hargs=(),
          varlen=None, sparse=None):
    """The launch plans of one backward call (the rows pre-pass, then the dK / dV and dQ
    kernels): :func:`tilepy.ops.attention_backward_mma_sync.plans`'s contract, variants,
    block masks and packed sequences included. ``varlen``: with :func:`varlen_atomic` the
    warp-specialised kernel's dQ by bulk reductions into ``views["dq_acc"]``
    (:func:`varlen_dq_acc_shape`; the pre-pass zeroes the sequences' rows), else the dK / dV
    kernel without dQ's part, then dQ's own kernel."""
    q, k = views["q"], views["k"]
    batch, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group = hq // hk
    sqp = views["delta"].shape[2]
    scale32, slog2 = np.float32(scale), np.float32(scale * LOG2E)
    atomic = bk.uses_atomics(cfg, deterministic) if varlen is None else \
        varlen_atomic(cfg, deterministic)
    if varlen is None:
        out = [bk.prepass_plan(cfg.dtype, views, sqp, atomic)]
    else:
        batch, sq, sk = varlen      # the grids: the sequences, the longest's rows and keys
        out = [bk.varlen_prepass_plan(cfg, views, hq, varlen, hargs[0][0],
                                      cfg.slices if atomic else 0)]
    mods = variant_mods(mods)
    # a hook reads b and h (and packed sequences the grid's z): no grid chunks (they shift)
    chunks = not reads_hook(mods) and varlen is None
    vl = varlen is not None
    hargs = tuple(hargs)
    mask_block, kv_mask, q_mask = sparse if sparse is not None else (None, None, None)
    variant = (window, softcap, mods, mask_block)

    if cfg.split_columns and not atomic:
        raise NotImplementedError(
            f"{cfg.describe()}: past head_dim 128 the wgmma backward takes dQ by atomics only; "
            f"deterministic calls run the mma.sync kernels there (leave config=None)")
    # without atomics (deterministic): the dK / dV kernel without its dQ part
    kcfg = cfg if atomic else dataclasses.replace(cfg, dq_atomic=False, producer=False)
    kern = dkdv_ws_kernel(kcfg, causal, *variant, varlen=vl) if kcfg.producer else \
        dkdv_kernel(kcfg, causal, *variant, varlen=vl)
    args = (q, k, views["v"], views["do"], views["lse2"], views["delta"], views["dk"],
            views["dv"], views["dq_acc"] if atomic else views["placeholder4"], scale32, slog2,
            hargs if sparse is None else (hargs, q_mask))
    smem = kcfg.dkdv_layout.nbytes
    allow_dynamic_shared(kern, args, smem)
    out.append((LaunchPlan(kern, args, (-(-sk // cfg.block_n), hk, batch), kcfg.threads, smem,
                           split=bk.heads_split((0, 3, 4, 5, 8), (1, 2, 6, 7), group, True)
                           if chunks else ()), args))
    if atomic:
        conv = dq_convert_blocked(d, cfg.dtype, vl, cfg.width, vectors_fit(views["dq"]))
        args = (views["dq_acc"], views["dq"], scale32,
                hargs[0][0] if vl else views["placeholder3"])
        out.append((LaunchPlan(conv, args, (-(-sq // bk.ROWS_PER_BLOCK), hq, batch),
                               bk.ROW_THREADS, split=bk.heads_split((0, 1), (), 1, False)), args))
        return [(p, a) for p, a in out if p.grid[0] > 0]
    kern = dq_kernel(cfg, causal, *variant, varlen=vl)
    args = (q, k, views["v"], views["do"], views["lse2"], views["delta"], views["dq"], scale32,
            slog2, hargs if sparse is None else (hargs, kv_mask))
    smem = cfg.dq_layout.nbytes
    allow_dynamic_shared(kern, args, smem)
    out.append((LaunchPlan(kern, args, (-(-sq // cfg.dq_block_m), hq, batch), cfg.dq_threads,
                           smem, split=bk.heads_split((0, 3, 4, 5, 6), (1, 2), group, False)
                           if chunks else ()), args))
    return [(p, a) for p, a in out if p.grid[0] > 0]


#: The kernels the compile layer reports on: (name, kind, config, causal[, window, softcap]);
#: names ending ``_varlen`` are the packed-sequence kernels.
COMPILED = (
    ("bwd_wgmma_dkdv_d128_f16", "dkdv", WgmmaBackwardConfig(128), False),
    ("bwd_wgmma_dkdv_d128_bf16_causal", "dkdv", WgmmaBackwardConfig(128, dtype="bfloat16"),
     True),
    ("bwd_wgmma_dkdv_d64_f16", "dkdv", WgmmaBackwardConfig(64), False),
    ("bwd_wgmma_dkdv_d128_f16_atomic", "dkdv", WgmmaBackwardConfig(128, dq_atomic=True),
     False),
    ("bwd_wgmma_dkdv_d128_f16_atomic_1wg", "dkdv",
     WgmmaBackwardConfig(128, key_groups=1, dq_atomic=True), True),
    ("bwd_wgmma_dkdv_d64_f16_atomic", "dkdv", WgmmaBackwardConfig(64, dq_atomic=True), True),
    ("bwd_wgmma_dkdv_d64_f16_atomic_1wg", "dkdv",
     WgmmaBackwardConfig(64, key_groups=1, dq_atomic=True), False),
    ("bwd_wgmma_ws_d128_f16", "ws", WgmmaBackwardConfig(128, dq_atomic=True, producer=True),
     False),
    ("bwd_wgmma_ws_d128_bf16_causal", "ws", WgmmaBackwardConfig(
        128, dtype="bfloat16", dq_atomic=True, producer=True), True),
    ("bwd_wgmma_ws_d64_f16_causal", "ws", WgmmaBackwardConfig(64, dq_atomic=True,
                                                               producer=True), True),
    ("bwd_wgmma_ws_d128_f16_own_keys", "ws", WgmmaBackwardConfig(
        128, dq_atomic=True, producer=True, dq_own_keys=True), False),
    ("bwd_wgmma_dq_d128_f16_causal", "dq", WgmmaBackwardConfig(128), True),
    # past 128: the columns split between the consumers (256, and 192 zero-filled to it)
    ("bwd_wgmma_ws_d256_bf16_causal", "ws", WgmmaBackwardConfig(
        256, dtype="bfloat16", key_groups=1, dq_atomic=True, producer=True,
        split_columns=True), True),
    ("bwd_wgmma_ws_d192_f16", "ws", WgmmaBackwardConfig(
        192, key_groups=1, dq_atomic=True, producer=True, split_columns=True), False),
    ("bwd_wgmma_ws_d256_bf16_causal_halves", "ws", WgmmaBackwardConfig(
        256, dtype="bfloat16", key_groups=1, dq_atomic=True, producer=True,
        split_columns=True, query_halves=True), True),
    ("bwd_wgmma_ws_d192_f16_halves", "ws", WgmmaBackwardConfig(
        192, key_groups=1, dq_atomic=True, producer=True, split_columns=True,
        query_halves=True), False),
    # v's head dim other than q's: DeepSeek's 192 / 128
    ("bwd_wgmma_ws_d192v128_bf16_causal_halves", "ws", WgmmaBackwardConfig(
        192, dtype="bfloat16", key_groups=1, dq_atomic=True, producer=True,
        split_columns=True, query_halves=True, head_dim_v=128), True),
    # a head dim between the widths (96: the 128-column tiles, zero-filled; the built-in
    # choice's warp-specialised kernel and the deterministic dQ kernel)
    ("bwd_wgmma_ws_d96_bf16_causal", "ws", WgmmaBackwardConfig(
        96, dtype="bfloat16", dq_atomic=True, producer=True), True),
    ("bwd_wgmma_dq_d96_f16", "dq", WgmmaBackwardConfig(96), False),
    # packed sequences (names ending _varlen): the pair packed sequences run with on sm_90
    ("bwd_wgmma_dkdv_d128_bf16_causal_varlen", "dkdv",
     WgmmaBackwardConfig(128, dtype="bfloat16"), True),
    ("bwd_wgmma_dq_d128_bf16_causal_varlen", "dq", WgmmaBackwardConfig(128, dtype="bfloat16"),
     True),
    # and past 128 (without deterministic) the warp-specialised kernel, dQ by bulk reductions
    ("bwd_wgmma_ws_d256_bf16_causal_halves_varlen", "ws", WgmmaBackwardConfig(
        256, dtype="bfloat16", key_groups=1, dq_atomic=True, producer=True,
        split_columns=True, query_halves=True), True),
    ("bwd_wgmma_dq_d64_f16", "dq", WgmmaBackwardConfig(64), False),
    # the variants: a sliding window under causal with a soft cap (Gemma 2's layers) on the
    # built-in choices — the warp-specialised kernel, and the deterministic pair
    ("bwd_wgmma_ws_d128_bf16_window_softcap", "ws", WgmmaBackwardConfig(
        128, dtype="bfloat16", dq_atomic=True, producer=True), True, (4095, 0), 50.0),
    ("bwd_wgmma_dkdv_d128_f16_window_softcap", "dkdv", WgmmaBackwardConfig(128, key_groups=1,
                                                                           dq_groups=1), True,
     (4095, 0), 50.0),
    ("bwd_wgmma_dq_d128_f16_window_softcap", "dq", WgmmaBackwardConfig(128, key_groups=1,
                                                                       dq_groups=1), True,
     (4095, 0), 50.0),
)


#: The :data:`COMPILED` kernels of the built-in choices' shapes (the others: further tile
#: shapes and dQ paths that ``config=`` reaches).
CORE_COMPILED = ("bwd_wgmma_dkdv_d128_bf16_causal", "bwd_wgmma_dkdv_d64_f16",
                 "bwd_wgmma_ws_d128_f16", "bwd_wgmma_ws_d128_bf16_causal",
                 "bwd_wgmma_dq_d128_f16_causal", "bwd_wgmma_dq_d64_f16",
                 "bwd_wgmma_ws_d128_bf16_window_softcap", "bwd_wgmma_ws_d96_bf16_causal")


#: The :data:`COMPILED` kernels only ``config=`` reaches and no built-in choice: the
#: deterministic pair's dK / dV kernel with atomic dQ, dQ by each consumer's own keys, the
#: fused kernel at head_dim 64, the wide kernels' whole-scores form.
EXTENDED_COMPILED = ("bwd_wgmma_dkdv_d128_f16_atomic", "bwd_wgmma_dkdv_d128_f16_atomic_1wg",
                     "bwd_wgmma_dkdv_d64_f16_atomic", "bwd_wgmma_dkdv_d64_f16_atomic_1wg",
                     "bwd_wgmma_ws_d64_f16_causal", "bwd_wgmma_ws_d128_f16_own_keys",
                     "bwd_wgmma_ws_d256_bf16_causal", "bwd_wgmma_ws_d192_f16")


def compile_reports_core():
    """:func:`compile_reports` of :data:`CORE_COMPILED` (a target for ``run_in_subprocess``)."""
    return compile_reports(CORE_COMPILED)


def compile_reports_rest():
    """:func:`compile_reports` of the rest of :data:`COMPILED` but :data:`EXTENDED_COMPILED`."""
    return compile_reports([c[0] for c in COMPILED
                            if c[0] not in CORE_COMPILED + EXTENDED_COMPILED])


def compile_reports_extended():
    """:func:`compile_reports` of :data:`EXTENDED_COMPILED`."""
    return compile_reports(EXTENDED_COMPILED)


def compile_reports(only=None):
    """Offline sm_90a reports (registers, spills, instruction counts) of :data:`COMPILED`.

    Run with the simulator off: ``tilepy.offline.run_in_subprocess(
    "tilepy.ops.attention_backward_wgmma:compile_reports")``."""
    from ..offline import report_entry

    out = []
    for name, kind, cfg, causal, *variant in COMPILED:
        if only is not None and name not in only:
            continue
        build = {"dkdv": dkdv_kernel, "ws": dkdv_ws_kernel, "dq": dq_kernel}[kind]
        threads = cfg.dq_threads if kind == "dq" else cfg.threads
        smem = (cfg.dq_layout if kind == "dq" else cfg.dkdv_layout).nbytes
        packed = name.endswith("_varlen")
        extra = {"varlen": True} if packed else {}
        out.append(report_entry(name, lambda build=build, cfg=cfg, causal=causal,
                                variant=tuple(variant), extra=extra: build(cfg, causal,
                                                                           *variant, **extra),
                                bk.argtypes(
                                    "dq" if kind == "dq" else "dkdv", packed), (9, 0, "a"),
                                launch_bounds=(threads, 1) if kind == "ws" else None,
                                threads=threads, config=cfg.describe(), causal=causal,
                                smem_bytes=smem))
    return out
