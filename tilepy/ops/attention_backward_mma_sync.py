"""FlashAttention-2's backward on mma.sync: a rows pre-pass, a dK / dV kernel, and dQ by a
kernel of its own (no atomics: deterministic) or by atomics from the dK / dV kernel.

All arrays are kernel views in (batch, heads, seq, head_dim) order (any strides; the 16-bit
inputs with a unit-stride head_dim axis and 16-byte aligned rows, which the op checks):
``q``, ``do_`` (B, Hq, Sq, D), ``k``, ``v`` (B, Hkv, Sk, D), uint16 bits of float16 /
bfloat16; query head ``h`` uses key/value head ``h // (Hq // Hkv)``. The per-row float32
arrays ``lse2`` and ``delta`` (B, Hq, SqP) are contiguous, ``SqP`` = Sq rounded up to
:meth:`BackwardConfig.row_pad` (so the kernels read whole blocks of them with no bound).

1. :func:`rows_prepass` — ``delta[i] = Σ_d dO_id · O_id`` and ``lse2[i] = lse_i · log2(e)``
   (``+inf`` where ``lse = -inf``, a row that saw no key, and in the padding rows: their
   probabilities come out 0); with ``zero_dq`` it also zeroes the float32 dQ accumulator.
2. :func:`dkdv_kernel` — one block per (key block of ``block_n`` keys, key/value head, batch);
   warp ``w`` owns keys ``16 w …``. K and V stay in shared memory; the block walks every
   query block (``block_m`` rows) of every query head of its group that sees any of its keys
   (causal: from the diagonal down), Q, dO, lse2 and delta streaming through a two-stage
   cp.async pipeline. Per query block, in registers: ``Sᵀ = K Qᵀ``, ``Pᵀ``, ``dV += Pᵀ dO``,
   ``dPᵀ = V dOᵀ``, ``dSᵀ``, ``dK += dSᵀ Q`` (the :mod:`tilepy.tile.attention_backward`
   pieces). With ``atomic_dq``: ``dSᵀ`` to shared memory, then the warps split the block's
   ``dQ += dS K`` by rows and columns and add it to the float32 accumulator with atomics. The
   group's sums of dK and dV stay in registers: no atomics for them, whatever the GQA ratio.
3. :func:`dq_kernel` (the default) — one block per (query block of ``dq_block_m`` rows,
   query head, batch), warp ``w`` owning rows ``16 w …``, K and V streaming: ``S``, ``P``,
   ``dP = dO Vᵀ``, ``dS``, ``dQ += dS K`` in registers, one store. The same bits every run.
4. :func:`dq_convert` (after the atomic path) — the accumulator times ``scale`` to 16 bits.

Causal masking is aligned to the bottom-right corner (query ``i`` sees keys
``j <= i + Sk - Sq``), as in the forward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..inline import inline_device
from ..kcache import cached_jit
from ..launch import GridSplit, LaunchPlan
from ..ptx import global_addr, shared_addr
from ..ptx.asm import SIMULATOR
from ..ptx.cp_async import cp_async_commit_group, cp_async_wait_group
from ..ptx.global_vector import ld_global_v4, st_global_v4
from ..ptx.shuffle import shfl_xor
from ..ptx.math import cvt_bf16x2_f32, cvt_f16x2_f32, unpack_bf16x2_f32, unpack_f16x2_f32
from ..tile.attention import block_coords, limits_shape, packed_sequence
from ..tile.attention_backward import (
    LOG2E,
    kernel_variant,
    key_block_scores,
    key_steps,
    query_block_scores,
    counted_steps,
    query_steps,
    reads_hook,
    variant_mods,
    a_fragment,
    atomic_add_accumulators,
    blocked_row,
    key_block_coords,
    query_blocks,
    row_state,
    softmax_gradient,
    store_accumulators,
)
from ..tile.config import DTYPES, SMEM_LIMIT
from ..tile.rows import vectors_fit, words_store
from ..tile.copy import (
    copy_rows_to_shared,
    load_a_fragments,
    load_a_fragments_k_major,
    load_b_fragments,
    store_accumulators_to_shared,
)
from ..tile.mma import _MMA
from ..tile.smem import allow_dynamic_shared, dynamic_shared
from ..tile.smem_layout import SmemLayout
from .attention_mma_sync import HEAD_DIMS

_ZERO = np.float32(0.0)
_INF = np.float32(np.inf)
_NEG_INF = np.float32(-np.inf)
_ONE = np.float32(1.0)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _swizzles(cols: int) -> bool:
    chunks = cols // 8
    return chunks in (1, 2, 4) or chunks % 8 == 0


@dataclass(frozen=True)
class BackwardConfig:
    """The backward kernels' tiles.

    * dK / dV kernel: ``block_n`` keys per block (16 per warp: ``block_n / 16`` warps),
      ``block_m`` query rows per step. Shared memory: K and V (``block_n × D`` each), two
      stages of Q and dO (``block_m × D``) with their lse2 / delta, and with atomic dQ the dS
      tile (``block_n × block_m``) — :meth:`dkdv_layout`.
    * dQ kernel: ``dq_block_m`` query rows per block (16 per warp), ``dq_block_n`` keys per
      step; Q, dO and two stages of K and V.
    * ``dq_atomic``: dQ by float32 atomics from the dK / dV kernel (then converted) instead of
      the dQ kernel, where ``deterministic`` is not asked for. Off by default: on the H200 the
      atomics cost more than the dQ kernel's recomputation (bench/NOTES.md: attention
      backward).
    * ``head_dim_v``: v's (and out's, dout's) head dim where it differs from q's and k's
      ``head_dim`` (None: the same). The tiles are as wide as the wider of the two; each
      operand's columns past its own head dim are zero-filled in shared memory and never
      stored.
    """

    head_dim: int
    block_m: int = 64
    block_n: int = 64
    dq_block_m: int = 64
    dq_block_n: int = 64
    dtype: str = "float16"
    cc: tuple = (9, 0)
    dq_atomic: bool = False
    head_dim_v: int | None = None

    def __post_init__(self):
        _require(isinstance(self.dq_atomic, bool), f"BackwardConfig.dq_atomic must be a bool, "
                 f"got {self.dq_atomic!r}")
        _require(self.dtype in DTYPES, f"BackwardConfig.dtype must be one of {DTYPES}, got "
                 f"{self.dtype!r}")
        _require(self.head_dim in HEAD_DIMS, f"BackwardConfig.head_dim must be one of "
                 f"{HEAD_DIMS}, got {self.head_dim!r}")
        _require(self.head_dim_v is None or self.head_dim_v in HEAD_DIMS,
                 f"BackwardConfig.head_dim_v must be None or one of {HEAD_DIMS}, got "
                 f"{self.head_dim_v!r}")
        for name in ("block_m", "block_n", "dq_block_m", "dq_block_n"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0 and value % 16 == 0,
                     f"BackwardConfig.{name}={value!r} is not a positive multiple of 16")
        _require(self.block_n <= 512 and self.dq_block_m <= 512,
                 "BackwardConfig: block_n and dq_block_m are 16 rows per warp, at most 32 warps")
        _require(_swizzles(self.block_m), f"BackwardConfig.block_m={self.block_m}: the dS tile's "
                 "rows must be 1, 2, 4 or a multiple of 8 chunks of 8 elements")
        _require(self.warps % self.dq_row_warps == 0,
                 f"BackwardConfig: block_m={self.block_m} does not split the dQ rows evenly "
                 f"over {self.warps} warps (block_m / 16 must divide or be a multiple of them)")
        _require((self.tile_dim // 8) % (2 * self.dq_col_warps) == 0,
                 f"BackwardConfig: block_m={self.block_m}, block_n={self.block_n} split dQ over "
                 f"{self.dq_col_warps} column groups of warps; head_dim {self.head_dim} does not "
                 "give each an even number of 8-column tiles")
        limit = SMEM_LIMIT.get(tuple(self.cc[:2]), 99 * 1024)
        for name, nbytes in (("dK/dV", self.dkdv_layout(True).nbytes),
                             ("dQ", self.dq_smem_bytes)):
            _require(nbytes <= limit, f"BackwardConfig: the {name} kernel's {nbytes} B of "
                     f"shared memory exceed the {limit} B a block may use on "
                     f"sm_{self.cc[0]}{self.cc[1]}")

    @property
    def warps(self) -> int:
        """Warps of the dK / dV kernel."""
        return self.block_n // 16

    @property
    def dq_warps(self) -> int:
        return self.dq_block_m // 16

    @property
    def dq_row_warps(self) -> int:
        """How the dK / dV kernel's warps split a block's dQ: groups along the rows …"""
        return min(self.warps, self.block_m // 16)

    @property
    def dq_col_warps(self) -> int:
        """… and along head_dim (the rest)."""
        return max(1, self.warps // self.dq_row_warps)

    @property
    def dv(self) -> int:
        """v's head dim (``head_dim_v``, else ``head_dim``)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def tile_dim(self) -> int:
        """The shared tiles' row length: the wider of head_dim and :attr:`dv` rounded up to a
        multiple of 16 (the copies zero-fill each operand's columns past its own head dim;
        what is computed there is never stored)."""
        return -(-max(self.head_dim, self.dv) // 16) * 16

    @property
    def swizzle(self) -> bool:
        """XOR swizzle of the tile_dim-wide shared tiles where the row length allows it."""
        return _swizzles(self.tile_dim)

    @property
    def row_pad(self) -> int:
        """``lse2`` / ``delta`` / the dQ accumulator have Sq rounded up to this many rows."""
        return math.lcm(self.block_m, self.dq_block_m)

    def dkdv_layout(self, atomic_dq: bool) -> SmemLayout:
        D, BM, BN = self.tile_dim, self.block_m, self.block_n
        regions = [("k", BN * D * 2, 128), ("v", BN * D * 2, 128),
                   ("q", 2 * BM * D * 2, 128), ("do", 2 * BM * D * 2, 128),
                   ("lse2", 2 * BM * 4, 16), ("delta", 2 * BM * 4, 16)]
        if atomic_dq:
            regions.append(("ds", BN * BM * 2, 128))
        regions.append(("count", 16, 16))   # block-sparse: the block's step count
        return SmemLayout.of(*regions)

    @property
    def dq_smem_bytes(self) -> int:
        D = self.tile_dim
        return 2 * self.dq_block_m * D * 2 + 2 * 2 * self.dq_block_n * D * 2

    def describe(self) -> str:
        dq = "atomics" if self.dq_atomic else f"{self.dq_block_m} x {self.dq_block_n} " \
            f"({self.dq_warps} warps)"
        return (f"dK/dV {self.block_n} keys x {self.block_m} queries ({self.warps} warps), "
                f"dQ {dq}, D={self.head_dim}"
                + (f", Dv={self.dv}" if self.dv != self.head_dim else "") + f" {self.dtype}")


def kernel_jit(threads: int, blocks_per_sm: int | None = None, disk_cache: bool = True):
    """The backward kernels' decorator: ``cuda.jit`` in the simulator, else the disk-cached
    jit with ``threads`` as the launch bound (and ``blocks_per_sm`` its minimum blocks per
    SM when given: ``setmaxnreg`` kernels pass 1). ``disk_cache=False`` (a kernel whose
    closure holds a user's function): plain ``cuda.jit`` with the same bounds."""
    if SIMULATOR:
        return cuda.jit
    if not disk_cache:
        return cuda.jit(launch_bounds=int(threads) if blocks_per_sm is None
                        else (int(threads), int(blocks_per_sm)))
    if blocks_per_sm is None:
        return cached_jit(launch_bounds=int(threads))
    return cached_jit(launch_bounds=(int(threads), int(blocks_per_sm)))


# ---- 1. the rows pre-pass -------------------------------------------------------------------

#: Pre-pass and convert kernels: 8 lanes per row, 16 rows per block of 128 threads.
ROW_LANES = 8
ROWS_PER_BLOCK = 16
ROW_THREADS = ROW_LANES * ROWS_PER_BLOCK


@functools.cache
def _row_dot(head_dim: int, dtype: str):
    """``dot(o2, d2, row, lane, valid) -> float32``: ``Σ_c o2[row, c] · d2[row, c]`` over
    head_dim by the :data:`ROW_LANES` lanes of the row (16-byte loads, a butterfly sum; every
    lane gets the total; 0 where not ``valid``, whose lanes load nothing). All lanes call."""
    D = head_dim
    unpack = unpack_f16x2_f32 if dtype == "float16" else unpack_bf16x2_f32

    @inline_device
    def dot(o2, d2, row, lane, valid):
        acc = _ZERO
        if valid:
            for c in range(8 * lane, D, 8 * ROW_LANES):
                w = ld_global_v4(o2, row, c)
                x = ld_global_v4(d2, row, c)
                for e in range(4):
                    o0, o1 = unpack(w[e])
                    x0, x1 = unpack(x[e])
                    acc += o0 * x0 + o1 * x1
        acc += shfl_xor(acc, 4)
        acc += shfl_xor(acc, 2)
        acc += shfl_xor(acc, 1)
        return acc

    return dot


def varlen_pad(cfg) -> int:
    """Packed sequences: the rows of ``lse2`` / ``delta`` after each sequence's that hold the
    padding (lse2 +inf, delta 0) — a block of query rows of either kernel reads that far past
    the sequence's end."""
    return max(cfg.block_m, cfg.dq_block_m)


def varlen_row_start(pad: int):
    """``start(q_start, z) -> int64``: where packed sequence ``z`` (first query row
    ``q_start``) begins in the varlen ``lse2`` / ``delta``: 16-byte aligned (the dK / dV
    kernel copies them with cp.async), each sequence followed by at least ``pad`` rows of
    padding: ``4 · (q_start // 4) + z · (pad + 4)``."""
    STEP = pad + 4

    @inline_device
    def start(q_start, z):
        return (q_start // 4) * 4 + np.int64(z) * STEP

    return start


@functools.cache
def dq_sequence(varlen: bool, sparse: bool, pad: int):
    """``locate(hargs, b, sq, sk, lse2, delta) -> (q_start, k_start, sq, sk, hook, vb,
    lse2_rows, delta_rows)``: a dQ kernel's block of batch (or, ``varlen``, packed sequence)
    ``b`` — its first query row and key in the views, its lengths, the score hook's arguments
    (``varlen``: with the sequence's ``sk - sq`` appended; ``sparse``: the first of
    ``hargs``), the views' batch index and the ``lse2`` / ``delta`` rows from the sequence's
    (:func:`varlen_row_start` of ``pad``). ``sq`` / ``sk``: the views' lengths, returned as
    they are without ``varlen``. The dQ kernels of both backward families call it."""
    start_of = varlen_row_start(pad)

    if varlen:
        @inline_device
        def locate(hargs, b, sq, sk, lse2, delta):
            q_start, k_start, sq, sk = packed_sequence(hargs[0], b)
            # the sequence's rows of lse2 / delta (row_state reads them by sequence row)
            r_start = start_of(q_start, b)
            return (q_start, k_start, sq, sk, hargs[1] + (sk - sq,), 0, lse2[:, :, r_start:],
                    delta[:, :, r_start:])
    else:
        @inline_device
        def locate(hargs, b, sq, sk, lse2, delta):
            return 0, 0, sq, sk, hargs[0] if sparse else hargs, b, lse2, delta

    return locate


@functools.cache
def key_sequence(varlen: bool, sparse: bool, pad: int):
    """``locate(hargs, b, sq, sk) -> (q_start, k_start, sq, sk, hook, qmask, vb, r_start)``: a
    dK / dV kernel's block of batch (or, ``varlen``, packed sequence) ``b`` — its first query
    row and key in the views, its lengths, the score hook's arguments (``varlen``: with the
    sequence's ``sk - sq`` appended; ``sparse``: the first of ``hargs``), the block mask's
    transposed lists (``sparse``: the second of ``hargs``; else 0), the views' batch index
    and the sequence's first row of ``lse2`` / ``delta`` (:func:`varlen_row_start` of
    ``pad``). ``sq`` / ``sk``: the views' lengths, returned as they are without ``varlen``.
    The dK / dV kernels of both backward families call it (a packed block past its
    sequence's keys, ``key0 >= sk``, returns at once)."""
    start_of = varlen_row_start(pad)

    if varlen:
        @inline_device
        def locate(hargs, b, sq, sk):
            q_start, k_start, sq, sk = packed_sequence(hargs[0], b)
            return (q_start, k_start, sq, sk, hargs[1] + (sk - sq,), 0, 0,
                    start_of(q_start, b))
    else:
        @inline_device
        def locate(hargs, b, sq, sk):
            return (0, 0, sq, sk, hargs[0] if sparse else hargs, hargs[1] if sparse else 0, b,
                    0)

    return locate


def varlen_rows(total_q: int, sequences: int, pad: int) -> int:
    """The rows of the varlen ``lse2`` / ``delta`` (:func:`varlen_row_start`'s layout)."""
    return (total_q // 4) * 4 + sequences * (pad + 4) + pad + 16


def varlen_prepass_plan(cfg, views, heads: int, varlen, cu_seqlens_q, dq_slices: int = 0):
    """``(plan, args)`` of packed sequences' rows pre-pass (:func:`varlen_rows_prepass`) for a
    backward config ``cfg`` (its :func:`varlen_pad`), ``varlen`` = ``(sequences,
    max_seqlen_q, max_seqlen_k)``, the views of :func:`plans`; ``dq_slices`` > 0: it also
    zeroes the sequences' rows of ``views["dq_acc"]``, the blocked accumulator of that many
    64-column slices in :func:`varlen_acc_row`'s rows; ``views["dlse"]``, where present, the
    LSE's gradient."""
    batch, sq_blocks, _ = varlen
    pad = varlen_pad(cfg)
    dlse = views.get("dlse")
    pre = varlen_rows_prepass(views["o"].shape[3], cfg.dtype, pad, dq_slices, dlse is not None)
    args = (views["o"], views["do"], views["lse"],
            views["placeholder3"] if dlse is None else dlse, views["delta"], views["lse2"],
            cu_seqlens_q, views["dq_acc"] if dq_slices else views["placeholder4"])
    return (LaunchPlan(pre, args, (-(-(sq_blocks + pad) // ROWS_PER_BLOCK), heads, batch),
                       ROW_THREADS), args)


@inline_device
def varlen_acc_row(q_start, z):
    """Packed sequences' dQ accumulator (the wgmma kernels' blocked one): the virtual row where
    sequence ``z`` (first query row ``q_start``) begins — ``64 · (q_start // 64 + z)``, a
    64-row block of its own, so that no block holds rows of two sequences (the sequences
    before ``z`` fill at most ``q_start // 64 + z`` blocks)."""
    return (q_start // 64 + np.int64(z)) * 64


def varlen_acc_rows(total_q: int, sequences: int) -> int:
    """The virtual rows of packed sequences' dQ accumulator (:func:`varlen_acc_row`)."""
    return (total_q // 64 + sequences + 1) * 64


@inline_device
def _zero_row(a2, r, lane):
    """Row ``r`` of the 2-D float32 view ``a2`` (columns a multiple of 4) set to zero, lane
    ``lane`` of :data:`ROW_LANES` storing every ``ROW_LANES``-th 16-byte chunk."""
    for c in range(4 * lane, a2.shape[1], 4 * ROW_LANES):
        st_global_v4(a2, r, c, _ZERO, _ZERO, _ZERO, _ZERO)


@functools.cache
def varlen_rows_prepass(head_dim: int, dtype: str, pad: int, dq_slices: int = 0,
                        has_dlse: bool = False):
    """Packed sequences' pre-pass: ``kernel(o, do_, lse, dlse, delta, lse2, cu_seqlens_q,
    dq_acc)``;
    grid ``(ceil((max_seqlen_q + pad) / 16), Hq, sequences)``, :data:`ROW_THREADS` threads.
    ``o``, ``do_`` (1, Hq, total_q, D), ``lse`` (1, Hq, total_q) float32; ``delta`` /
    ``lse2`` (1, Hq, :func:`varlen_rows`) written in :func:`varlen_row_start`'s layout: row
    ``r`` of sequence ``z`` at ``start + r``, and the ``pad`` rows after its end as padding
    (lse2 +inf, delta 0). ``dq_slices`` > 0: ``dq_acc`` (1, Hq, rows · dq_slices, C) float32
    is the blocked accumulator (virtual row ``v``'s slice ``c`` at
    :func:`tilepy.tile.attention_backward.blocked_row`) and each sequence row's virtual row
    (:func:`varlen_acc_row` + ``r``) is zeroed in every slice; else a placeholder.
    ``has_dlse``: ``dlse`` (1, Hq, total_q) float32, the loss's gradient in the LSE, enters
    as ``delta - dlse`` (:func:`rows_prepass`'s); else a placeholder, not read."""
    dot = _row_dot(head_dim, dtype)
    start_of = varlen_row_start(pad)
    PAD = pad
    SL = dq_slices
    HAS_DLSE = bool(has_dlse)
    L2E = np.float32(LOG2E)

    @kernel_jit(ROW_THREADS)
    def kernel(o, do_, lse, dlse, delta, lse2, cu_q, dq_acc):
        z = cuda.blockIdx.z
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % ROW_LANES
        row = cuda.blockIdx.x * ROWS_PER_BLOCK + tid // ROW_LANES
        q_start = np.int64(cu_q[z])
        sq = np.int64(cu_q[z + 1]) - q_start
        acc = dot(o[0, h], do_[0, h], q_start + row, lane, row < sq)
        if lane == 0 and row < sq + PAD:
            at = start_of(q_start, z) + row
            if row < sq:
                value = lse[0, h, q_start + row]
                if HAS_DLSE:
                    acc -= dlse[0, h, q_start + row]
                delta[0, h, at] = acc
                lse2[0, h, at] = _INF if value == _NEG_INF else value * L2E
            else:
                delta[0, h, at] = _ZERO
                lse2[0, h, at] = _INF
        if SL and row < sq:     # the row's slices of the accumulator (the rows read back)
            vrow = varlen_acc_row(q_start, z) + row
            z2 = dq_acc[0, h]
            for sl in range(SL):
                _zero_row(z2, blocked_row(vrow, SL, sl), lane)

    return kernel


@functools.cache
def rows_prepass(head_dim: int, dtype: str, zero_dq: bool, has_dlse: bool = False):
    """``kernel(o, do_, lse, dlse, delta, lse2, dq_acc)``; grid ``(SqP / 16, Hq, B)``,
    :data:`ROW_THREADS` threads. ``lse`` (B, Hq, Sq) float32, any strides; ``dq_acc``
    (B, Hq, R · SqP, C) float32 (contiguous, C a multiple of 4) zeroed when ``zero_dq`` (else
    not read: a placeholder). With
    ``has_dlse``, ``dlse`` (B, Hq, Sq) float32 is the loss's gradient in the LSE (when the
    forward's LSE is used downstream): since ``∂lse_i/∂s_ij = P_ij``, it enters as
    ``delta_i - dlse_i`` (else a placeholder, not read)."""
    dot = _row_dot(head_dim, dtype)
    ZERO_DQ, HAS_DLSE = bool(zero_dq), bool(has_dlse)
    L2E = np.float32(LOG2E)

    @kernel_jit(ROW_THREADS)
    def kernel(o, do_, lse, dlse, delta, lse2, dq_acc):
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % ROW_LANES
        row = cuda.blockIdx.x * ROWS_PER_BLOCK + tid // ROW_LANES
        sq = o.shape[2]
        acc = dot(o[b, h], do_[b, h], row, lane, row < sq)
        if row < delta.shape[2]:
            if lane == 0:
                if row < sq:
                    value = lse[b, h, row]
                    if HAS_DLSE:
                        acc -= dlse[b, h, row]
                    delta[b, h, row] = acc
                    lse2[b, h, row] = _INF if value == _NEG_INF else value * L2E
                else:
                    delta[b, h, row] = _ZERO
                    lse2[b, h, row] = _INF
            if ZERO_DQ:   # rows row·R … row·R + R - 1 of the accumulator (R = its rows / SqP)
                z2 = dq_acc[b, h]
                per = dq_acc.shape[2] // delta.shape[2]
                for rr in range(row * per, row * per + per):
                    _zero_row(z2, rr, lane)

    return kernel


@functools.cache
def dq_convert(head_dim: int, dtype: str, vector: bool = True):
    """``kernel(dq_acc, dq, scale)``: ``dq = scale · dq_acc`` rounded to ``dtype``; grid
    ``(ceil(Sq / 16), Hq, B)``, :data:`ROW_THREADS` threads. ``vector``: ``dq`` takes 16-byte
    stores (:func:`tilepy.tile.rows.vectors_fit`), else element stores."""
    D = head_dim
    pack = cvt_f16x2_f32 if dtype == "float16" else cvt_bf16x2_f32
    store8 = words_store(vector)

    @kernel_jit(ROW_THREADS)
    def kernel(dq_acc, dq, scale):
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % ROW_LANES
        row = cuda.blockIdx.x * ROWS_PER_BLOCK + tid // ROW_LANES
        if row < dq.shape[2]:
            a2 = dq_acc[b, h]
            o2 = dq[b, h]
            for c in range(8 * lane, D, 8 * ROW_LANES):
                x = ld_global_v4(a2, row, c)
                y = ld_global_v4(a2, row, c + 4)
                store8(o2, row, c, pack(x[0] * scale, x[1] * scale),
                       pack(x[2] * scale, x[3] * scale), pack(y[0] * scale, y[1] * scale),
                       pack(y[2] * scale, y[3] * scale))

    return kernel


# ---- 2. dK / dV (and dQ by atomics) ----------------------------------------------------------

def dkdv_kernel(cfg: BackwardConfig, causal: bool, atomic_dq: bool, window=None,
                softcap: float = 0.0, mods=(None, None, None), varlen: bool = False,
                mask_block=None):
    """``kernel(q, k, v, do_, lse2, delta, dk, dv, dq_acc, scale, scale_log2, hargs)``; grid
    ``(ceil(Sk / block_n), Hkv, B)``, ``32 · cfg.warps`` threads, ``cfg.dkdv_layout(atomic_dq)
    .nbytes`` of dynamic shared memory. ``dk``, ``dv`` (B, Hkv, Sk, D) 16-bit (any strides);
    ``dq_acc`` (B, Hq, SqP, D) float32, added to with ``atomic_dq`` (else a placeholder).

    Variants (generator parameters, as the forward's :func:`~tilepy.ops.attention_mma_sync.
    attention_kernel`): ``window`` ``(left, right)`` (:func:`tilepy.tile.attention.
    key_window`; only the query blocks that see the key block are visited) and ``softcap``
    (> 0: Gemma 2's soft cap, its derivative chained into dS), ``mods`` ``(score_mod,
    score_mod_grad, mask_mod[, n_args, alibi[, bits]])``: the forward's user functions, the
    derivative of its ``score_mod``, the number of ``mod_args`` they take, ALiBi and whether a
    block mask's bitmaps replace ``mask_mod`` (:func:`tilepy.tile.attention_backward.
    score_functions`), whose run-time arguments are ``hargs`` (the forward's, then the
    bitmaps; ``()`` without). ``varlen``: packed sequences, as the forward's
    (:func:`~tilepy.ops.attention_mma_sync.attention_kernel`): views of batch 1 holding the
    sequences along the sequence axis (``lse2`` / ``delta`` padded past the last row by at
    least ``block_m``), ``hargs`` ``((cu_seqlens_q, cu_seqlens_k), hook_args)``, grid z the
    sequences and x the key blocks of the longest. ``mask_block=(block_q, block_k)``
    (multiples of ``block_m`` / ``block_n``): block-sparse over a block mask's transposed lists
    — ``hargs`` ``(hook_args, (q_num, q_idx, full_q_num, full_q_idx))`` (views over (batch,
    query heads, mask key blocks[, mask query blocks])); each query head of the group visits
    the query blocks its lists name for this key block (``block_q / block_m`` steps a mask
    block, :func:`tilepy.tile.attention.key_block_at`), the mask function on every visited
    score; not with ``varlen`` or a window. Without them the code is the plain kernel's."""
    left, right, cap, mods, mask_block = kernel_variant(causal, window, softcap, mods,
                                                        mask_block, cfg.block_m, cfg.block_n,
                                                        varlen)
    return _dkdv_kernel(cfg, bool(atomic_dq), left, right, cap, mods, bool(varlen), mask_block)


_mods = variant_mods
_reads_hook = reads_hook


@functools.cache
def _dkdv_kernel(cfg: BackwardConfig, atomic_dq: bool, left: int, right: int, cap: float,
                 mods: tuple, varlen: bool = False, mask_block=None):
    # D: the shared tiles' width (head_dim rounded up to 16; the copies zero-fill past it)
    BM, BN, D = cfg.block_m, cfg.block_n, cfg.tile_dim
    # the columns each operand holds: q, k (and dq, dk) head_dim; v, do (and dv) dv
    VALID = None if cfg.head_dim == D else cfg.head_dim
    VALID_V = None if cfg.dv == D else cfg.dv
    W = cfg.warps
    THREADS = 32 * W
    NQ = BM // 8        # n8 tiles of Sᵀ (query columns)
    KQ = BM // 16       # k16 steps over queries (dV, dK)
    KD = D // 16        # k16 steps over head_dim (Sᵀ, dPᵀ)
    NO = D // 8         # n8 tiles of dK, dV
    KN = BN // 16       # k16 steps over keys (dQ)
    WR, WC = cfg.dq_row_warps, cfg.dq_col_warps
    MIQ = BM // (16 * WR)
    # each warp's dQ columns in passes of at most 32 (bounds the registers the atomic part
    # holds beside dK and dV)
    NOQ_ALL = NO // WC
    NOQ = 4 if NOQ_ALL % 4 == 0 else 2
    PASSES = NOQ_ALL // NOQ
    SW = cfg.swizzle
    USER = reads_hook(mods)      # user functions or ALiBi: no disk cache, no grid chunks
    ATOMIC = bool(atomic_dq)
    VARLEN = varlen
    locate = key_sequence(VARLEN, mask_block is not None, varlen_pad(cfg))
    WIN = (left, right)
    lay = cfg.dkdv_layout(atomic_dq)
    K_OFF, V_OFF, Q_OFF, DO_OFF = (lay.offset(n) for n in ("k", "v", "q", "do"))
    L_OFF, DL_OFF = lay.offset("lse2"), lay.offset("delta")
    DS_OFF = lay.offset("ds") if atomic_dq else 0
    COUNT_OFF = lay.offset("count")
    Q_TILE = BM * D * 2
    ROW_BYTES = BM * 4

    mma = _MMA[cfg.dtype]
    smem = dynamic_shared()
    setup_kv, issue_kv = copy_rows_to_shared(BN, D, THREADS, SW, VALID)
    setup_v, issue_v = copy_rows_to_shared(BN, D, THREADS, SW, VALID_V)
    setup_q, issue_q = copy_rows_to_shared(BM, D, THREADS, SW, VALID)
    setup_do, issue_do = copy_rows_to_shared(BM, D, THREADS, SW, VALID_V)
    setup_r, issue_r = copy_rows_to_shared(1, 2 * BM, THREADS, False)  # BM float32 as 16-bit
    setup_ka, load_ka = load_a_fragments(1, D, SW)            # K, V rows of the warp
    setup_qn, load_qn = load_b_fragments(NQ, D, False, SW)    # Q, dO as n = query, k = d
    setup_qk, load_qk = load_b_fragments(NO, D, True, SW)     # Q, dO as k = query, n = d
    setup_dsa, load_dsa = load_a_fragments_k_major(MIQ, BM, True)   # dS from the dSᵀ tile
    setup_kk, load_kk = load_b_fragments(NOQ, D, True, SW)    # K as k = key, n = d
    grad = softmax_gradient(1, NQ, "cols")
    key_scores, chain, (DF_SHAPE, DF_TYPE) = key_block_scores(NQ, BN, False, WIN, cap, mods,
                                                              mask_block is not None)
    qblocks = query_blocks(BM, False, WIN, BN)
    # block-sparse: each head's query blocks from the transposed lists of this key block
    SPARSE = mask_block is not None
    _, step_of, first_step, _ = query_steps(BM, BN, mask_block)
    count_steps = counted_steps(BM, BN, mask_block)

    afrag = a_fragment(cfg.dtype)
    store_ds = store_accumulators_to_shared(1, NQ, BM, cfg.dtype, True)
    store = store_accumulators(1, cfg.head_dim // 8, cfg.dtype)   # head_dim's columns only
    store_v = store_accumulators(1, cfg.dv // 8, cfg.dtype)        # dv's
    add_dq = atomic_add_accumulators(MIQ, NOQ)

    @kernel_jit(THREADS, disk_cache=not USER)
    def kernel(q, k, v, do_, lse2, delta, dk, dv, dq_acc, scale, scale_log2, hargs):
        sq, sk, b, hk, group, key0 = key_block_coords(q, k, BN)
        # packed sequence b: query rows q_start … of the views, keys k_start …
        q_start, k_start, sq, sk, hook, _, vb, r_start = locate(hargs, b, sq, sk)
        if VARLEN and key0 >= sk:
            return      # past this sequence's keys (the grid fits the longest)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        shift = sk - sq

        # query blocks that see any key of this block: causal, from the diagonal down (or,
        # block-sparse, those the mask lists for each head of the group)
        qb0, per_head = qblocks(key0, sq, sk)
        hq0 = hk * group
        kbx = cuda.blockIdx.x
        if SPARSE:
            qmask = hargs[1]
        else:
            qmask = 0
        steps = count_steps(shared_addr(smem(), 0) + COUNT_OFF, tid, qmask, kbx, b, hq0, group,
                            per_head)

        dk_acc = cuda.local.array((1, NO, 4), np.float32)
        dv_acc = cuda.local.array((1, NO, 4), np.float32)
        for j in range(NO):
            for e in range(4):
                dk_acc[0, j, e] = _ZERO
                dv_acc[0, j, e] = _ZERO

        if steps > 0:
            base = shared_addr(smem(), 0)
            k_tile = base + K_OFF
            v_tile = base + V_OFF
            ks = k.strides[2]
            vs = v.strides[2]
            qs = q.strides[2]
            ds_ = do_.strides[2]
            k0, ksh, kr, kc = setup_kv(np.int64(global_addr(k, (vb, hk, k_start + key0, 0))),
                                       ks, tid)
            v0, vsh, vr, vc = setup_v(np.int64(global_addr(v, (vb, hk, k_start + key0, 0))),
                                      vs, tid)
            issue_kv(k_tile, 0, k0, ksh, kr, kc, ks, sk - key0)
            issue_v(v_tile, 0, v0, vsh, vr, vc, vs, sk - key0)
            q0, qsh, qr, qc = setup_q(np.int64(global_addr(q, (vb, hq0, q_start, 0))), qs, tid)
            d0, dsh, dr, dc = setup_do(np.int64(global_addr(do_, (vb, hq0, q_start, 0))), ds_,
                                       tid)
            l0, lsh, lr, lc = setup_r(np.int64(global_addr(lse2, (vb, hq0, r_start))), 0, tid)
            e0, esh, er, ec = setup_r(np.int64(global_addr(delta, (vb, hq0, r_start))), 0, tid)
            hstep_q = q.strides[1]
            hstep_d = do_.strides[1]
            hstep_r = lse2.strides[1]

            # step 0's Q, dO, lse2, delta in the same group as K and V
            nh, qbn, _, _, _ = first_step(qb0, per_head, qmask, kbx, b, hq0, group)
            row = qbn * BM
            issue_q(base + Q_OFF, nh * hstep_q + row * qs, q0, qsh, qr, qc, qs, sq - row)
            issue_do(base + DO_OFF, nh * hstep_d + row * ds_, d0, dsh, dr, dc, ds_, sq - row)
            issue_r(base + L_OFF, nh * hstep_r + row * 4, l0, lsh, lr, lc, 0, 1)
            issue_r(base + DL_OFF, nh * hstep_r + row * 4, e0, esh, er, ec, 0, 1)
            cp_async_commit_group()

            ka_off, ka_x = setup_ka(warp * 16, lane)
            qn_off, qn_x, qn_u = setup_qn(0, lane)
            qk_off, qk_c, qk_x = setup_qk(0, lane)
            ka_frag = cuda.local.array((1, 1, 4), np.uint32)
            qn_frag = cuda.local.array((1, NQ, 2), np.uint32)
            qk_frag = cuda.local.array((1, NO, 2), np.uint32)
            st = cuda.local.array((1, NQ, 4), np.float32)
            dpt = cuda.local.array((1, NQ, 4), np.float32)
            dfac = cuda.local.array(DF_SHAPE, DF_TYPE)   # (read by variants only)
            if ATOMIC:
                wr = warp % WR
                wc = warp // WR
                dsa_off, dsa_c, dsa_x = setup_dsa(wr * 16 * MIQ, lane)
                kk_off, kk_c, kk_x = setup_kk(wc * 8 * NOQ_ALL, lane)
                dsa_frag = cuda.local.array((1, MIQ, 4), np.uint32)
                kk_frag = cuda.local.array((1, NOQ, 2), np.uint32)
                dq_part = cuda.local.array((MIQ, NOQ, 4), np.float32)
            my_key = key0 + warp * 16 + g
            edge = key0 + BN > sk     # the block holds zero-filled keys past sk

            for n in range(steps):
                cp_async_wait_group(0)   # step n's tiles (and K, V) have landed …
                cuda.syncthreads()       # … for all; the other stage and dS are free
                ch, cqb, cpart = step_of(n, qb0, per_head, qmask, kbx, b, hq0, group)
                hq = hq0 + ch
                row = cqb * BM
                if n + 1 < steps:
                    nh, qbn, _ = step_of(n + 1, qb0, per_head, qmask, kbx, b, hq0, group)
                    nrow = qbn * BM
                    so = ((n + 1) % 2)
                    issue_q(base + Q_OFF + so * Q_TILE, nh * hstep_q + nrow * qs,
                            q0, qsh, qr, qc, qs, sq - nrow)
                    issue_do(base + DO_OFF + so * Q_TILE, nh * hstep_d + nrow * ds_,
                             d0, dsh, dr, dc, ds_, sq - nrow)
                    issue_r(base + L_OFF + so * ROW_BYTES, nh * hstep_r + nrow * 4,
                            l0, lsh, lr, lc, 0, 1)
                    issue_r(base + DL_OFF + so * ROW_BYTES, nh * hstep_r + nrow * 4,
                            e0, esh, er, ec, 0, 1)
                cp_async_commit_group()
                sgo = n % 2
                q_tile = base + Q_OFF + sgo * Q_TILE
                do_tile = base + DO_OFF + sgo * Q_TILE
                l_addr = base + L_OFF + sgo * ROW_BYTES
                d_addr = base + DL_OFF + sgo * ROW_BYTES

                # Sᵀ = K · Qᵀ (this warp's 16 keys × BM queries)
                for j in range(NQ):
                    for e in range(4):
                        st[0, j, e] = _ZERO
                        dpt[0, j, e] = _ZERO
                for kk in range(KD):
                    load_ka(ka_frag, 0, k_tile, kk, ka_off, ka_x)
                    load_qn(qn_frag, 0, q_tile, kk, qn_off, qn_x, qn_u)
                    for j in range(NQ):
                        st[0, j, 0], st[0, j, 1], st[0, j, 2], st[0, j, 3] = mma(
                            ka_frag[0, 0, 0], ka_frag[0, 0, 1], ka_frag[0, 0, 2],
                            ka_frag[0, 0, 3], qn_frag[0, j, 0], qn_frag[0, j, 1],
                            st[0, j, 0], st[0, j, 1], st[0, j, 2], st[0, j, 3])
                # the variant's modifications, the causal / window mask where a bound
                # crosses the block, the keys past sk
                key_scores(st, dfac, scale, my_key, row + 2 * t, b, hq, hook, cpart,
                           row + shift - key0, my_key - shift - (row + 2 * t), edge, sk)
                grad.probabilities(st, l_addr, scale_log2, t)

                # dV += Pᵀ · dO
                for kk in range(KQ):
                    p0, p1, p2, p3 = afrag(st, 0, kk)
                    load_qk(qk_frag, 0, do_tile, kk, qk_off, qk_c, qk_x)
                    for j in range(NO):
                        dv_acc[0, j, 0], dv_acc[0, j, 1], dv_acc[0, j, 2], dv_acc[0, j, 3] = mma(
                            p0, p1, p2, p3, qk_frag[0, j, 0], qk_frag[0, j, 1],
                            dv_acc[0, j, 0], dv_acc[0, j, 1], dv_acc[0, j, 2], dv_acc[0, j, 3])

                # dPᵀ = V · dOᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ - delta)
                for kk in range(KD):
                    load_ka(ka_frag, 0, v_tile, kk, ka_off, ka_x)
                    load_qn(qn_frag, 0, do_tile, kk, qn_off, qn_x, qn_u)
                    for j in range(NQ):
                        dpt[0, j, 0], dpt[0, j, 1], dpt[0, j, 2], dpt[0, j, 3] = mma(
                            ka_frag[0, 0, 0], ka_frag[0, 0, 1], ka_frag[0, 0, 2],
                            ka_frag[0, 0, 3], qn_frag[0, j, 0], qn_frag[0, j, 1],
                            dpt[0, j, 0], dpt[0, j, 1], dpt[0, j, 2], dpt[0, j, 3])
                grad.gradients(dpt, st, d_addr, t)
                chain(dpt, dfac)

                # dK += dSᵀ · Q
                for kk in range(KQ):
                    p0, p1, p2, p3 = afrag(dpt, 0, kk)
                    load_qk(qk_frag, 0, q_tile, kk, qk_off, qk_c, qk_x)
                    for j in range(NO):
                        dk_acc[0, j, 0], dk_acc[0, j, 1], dk_acc[0, j, 2], dk_acc[0, j, 3] = mma(
                            p0, p1, p2, p3, qk_frag[0, j, 0], qk_frag[0, j, 1],
                            dk_acc[0, j, 0], dk_acc[0, j, 1], dk_acc[0, j, 2], dk_acc[0, j, 3])

                if ATOMIC:
                    # dQ += dS · K: dSᵀ through shared memory, the warps split (rows, cols)
                    store_ds(dpt, base + DS_OFF, warp * 16, lane)
                    cuda.syncthreads()
                    for cp in range(PASSES):
                        for i in range(MIQ):
                            for j in range(NOQ):
                                for e in range(4):
                                    dq_part[i, j, e] = _ZERO
                        for kk in range(KN):
                            load_dsa(dsa_frag, 0, base + DS_OFF, kk, dsa_off, dsa_c, dsa_x)
                            load_kk(kk_frag, 0, k_tile, kk, kk_off, kk_c + cp * NOQ, kk_x)
                            for i in range(MIQ):
                                for j in range(NOQ):
                                    (dq_part[i, j, 0], dq_part[i, j, 1], dq_part[i, j, 2],
                                     dq_part[i, j, 3]) = mma(
                                        dsa_frag[0, i, 0], dsa_frag[0, i, 1],
                                        dsa_frag[0, i, 2], dsa_frag[0, i, 3],
                                        kk_frag[0, j, 0], kk_frag[0, j, 1],
                                        dq_part[i, j, 0], dq_part[i, j, 1], dq_part[i, j, 2],
                                        dq_part[i, j, 3])
                        add_dq(dq_part, dq_acc[vb, hq], q_start + row + wr * 16 * MIQ,
                               (wc * NOQ_ALL + cp * NOQ) * 8, q_start + sq, g, t)

        store(dk_acc, dk[vb, hk], k_start + key0 + warp * 16, k_start + sk, scale, g, t)
        store_v(dv_acc, dv[vb, hk], k_start + key0 + warp * 16, k_start + sk, _ONE, g, t)

    return kernel


# ---- 3. dQ alone (no atomics) --------------------------------------------------------------

def dq_kernel(cfg: BackwardConfig, causal: bool, window=None, softcap: float = 0.0,
              mods=(None, None, None), varlen: bool = False, mask_block=None):
    """``kernel(q, k, v, do_, lse2, delta, dq, scale, scale_log2, hargs)``; grid
    ``(ceil(Sq / dq_block_m), Hq, B)``, ``32 · cfg.dq_warps`` threads, ``cfg.dq_smem_bytes``
    of dynamic shared memory. ``dq`` (B, Hq, Sq, D) 16-bit, any strides. ``window`` and
    ``softcap``, ``mods`` as :func:`dkdv_kernel`'s (key blocks outside the window are
    skipped), ``varlen`` as :func:`dkdv_kernel`'s (grid x the query blocks of the longest
    sequence). ``mask_block``: block-sparse as the forward's key loop — ``hargs``
    ``(hook_args, (num, idx, full_num, full_idx))``, the block mask's own lists
    (:func:`tilepy.tile.attention.block_mask_row`); a multiple of ``dq_block_m`` /
    ``dq_block_n``."""
    left, right, cap, mods, mask_block = kernel_variant(causal, window, softcap, mods,
                                                        mask_block, cfg.dq_block_m,
                                                        cfg.dq_block_n, varlen)
    return _dq_kernel(cfg, left, right, cap, mods, bool(varlen), mask_block)


@functools.cache
def _dq_kernel(cfg: BackwardConfig, left: int, right: int, cap: float, mods: tuple,
               varlen: bool = False, mask_block=None):
    BM, BN, D = cfg.dq_block_m, cfg.dq_block_n, cfg.tile_dim    # as the dK / dV kernel's
    VALID = None if cfg.head_dim == D else cfg.head_dim            # q, k, dq
    VALID_V = None if cfg.dv == D else cfg.dv                      # v, do
    THREADS = 32 * cfg.dq_warps
    KD = D // 16
    NS = BN // 8
    KN = BN // 16
    NO = D // 8
    SW = cfg.swizzle
    Q_TILE = BM * D * 2
    KV_TILE = BN * D * 2
    KV_OFF = 2 * Q_TILE
    STAGE = 2 * KV_TILE

    mma = _MMA[cfg.dtype]
    smem = dynamic_shared()
    setup_q, issue_q = copy_rows_to_shared(BM, D, THREADS, SW, VALID)
    setup_do, issue_do = copy_rows_to_shared(BM, D, THREADS, SW, VALID_V)
    setup_kv, issue_kv = copy_rows_to_shared(BN, D, THREADS, SW, VALID)
    setup_v, issue_v = copy_rows_to_shared(BN, D, THREADS, SW, VALID_V)
    setup_a, load_a = load_a_fragments(1, D, SW)              # Q, dO rows of the warp
    setup_kn, load_kn = load_b_fragments(NS, D, False, SW)    # K, V as n = key, k = d
    setup_kk, load_kk = load_b_fragments(NO, D, True, SW)     # K as k = key, n = d
    grad = softmax_gradient(1, NS, "rows")
    WIN = (left, right)
    USER = reads_hook(mods)
    VARLEN = varlen
    SPARSE = mask_block is not None
    locate = dq_sequence(VARLEN, SPARSE, varlen_pad(cfg))
    row_scores, chain, (DF_SHAPE, DF_TYPE) = query_block_scores(NS, BN, False, WIN, cap, mods,
                                                                SPARSE)
    key_bounds, at, partial = key_steps(BM, BN, False, WIN, mask_block)
    rows = row_state(False, WIN)
    LIMITS = limits_shape(1, False, WIN)
    afrag = a_fragment(cfg.dtype)
    store = store_accumulators(1, cfg.head_dim // 8, cfg.dtype)   # head_dim's columns only

    @kernel_jit(THREADS, disk_cache=not USER)
    def kernel(q, k, v, do_, lse2, delta, dq, scale, scale_log2, hargs):
        sq, sk, b, h, hk = block_coords(q, k)
        q_start, k_start, sq, sk, hook, vb, lse2_rows, delta_rows = locate(
            hargs, b, sq, sk, lse2, delta)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        # steps kb_first … n_kb - 1: key block at(blocks, j) (j but block-sparse)
        row0, kb_first, n_kb, all_first, all_see, blocks = key_bounds(
            sq, sk, hargs[1] if SPARSE else 0, b, h)
        wrow = row0 + warp * 16
        if VARLEN and row0 >= sq:
            return      # past this sequence's rows (the grid fits the longest)

        acc = cuda.local.array((1, NO, 4), np.float32)
        for j in range(NO):
            for e in range(4):
                acc[0, j, e] = _ZERO
        l2 = cuda.local.array((1, 2), np.float32)
        dl = cuda.local.array((1, 2), np.float32)
        limit = cuda.local.array(LIMITS, np.int64)
        rows(lse2_rows, delta_rows, l2, dl, limit, vb, h, wrow, g, sq, sk)

        if n_kb > kb_first:
            base = shared_addr(smem(), 0)
            kv_base = base + KV_OFF
            qs = q.strides[2]
            ds_ = do_.strides[2]
            ks = k.strides[2]
            vs = v.strides[2]
            q0, qsh, qr, qc = setup_q(np.int64(global_addr(q, (vb, h, q_start + row0, 0))), qs,
                                      tid)
            d0, dsh, dr, dc = setup_do(np.int64(global_addr(do_, (vb, h, q_start + row0, 0))),
                                       ds_, tid)
            k0, ksh, kr, kc = setup_kv(np.int64(global_addr(k, (vb, hk, k_start, 0))), ks, tid)
            v0, vsh, vr, vc = setup_v(np.int64(global_addr(v, (vb, hk, k_start, 0))), vs, tid)
            issue_q(base, 0, q0, qsh, qr, qc, qs, sq - row0)
            issue_do(base + Q_TILE, 0, d0, dsh, dr, dc, ds_, sq - row0)
            first = kv_base + (kb_first % 2) * STAGE
            kb0 = at(blocks, kb_first)
            issue_kv(first, kb0 * BN * ks, k0, ksh, kr, kc, ks, sk - kb0 * BN)
            issue_v(first + KV_TILE, kb0 * BN * vs, v0, vsh, vr, vc, vs, sk - kb0 * BN)
            cp_async_commit_group()

            a_off, a_x = setup_a(warp * 16, lane)
            kn_off, kn_x, kn_u = setup_kn(0, lane)
            kk_off, kk_c, kk_x = setup_kk(0, lane)
            a_frag = cuda.local.array((1, 1, 4), np.uint32)
            kn_frag = cuda.local.array((1, NS, 2), np.uint32)
            kk_frag = cuda.local.array((1, NO, 2), np.uint32)
            s = cuda.local.array((1, NS, 4), np.float32)
            dp = cuda.local.array((1, NS, 4), np.float32)
            dfac = cuda.local.array(DF_SHAPE, DF_TYPE)   # (read by variants only)

            for jb in range(kb_first, n_kb):   # step jb: key block kb (jb but block-sparse)
                kb = at(blocks, jb)
                cp_async_wait_group(0)
                cuda.syncthreads()
                if jb + 1 < n_kb:
                    nxt = kv_base + ((jb + 1) % 2) * STAGE
                    kn = at(blocks, jb + 1)
                    left = sk - kn * BN
                    issue_kv(nxt, kn * BN * ks, k0, ksh, kr, kc, ks, left)
                    issue_v(nxt + KV_TILE, kn * BN * vs, v0, vsh, vr, vc, vs, left)
                cp_async_commit_group()
                k_tile = kv_base + (jb % 2) * STAGE
                v_tile = k_tile + KV_TILE

                for j in range(NS):
                    for e in range(4):
                        s[0, j, e] = _ZERO
                        dp[0, j, e] = _ZERO
                for kk in range(KD):
                    load_a(a_frag, 0, base, kk, a_off, a_x)
                    load_kn(kn_frag, 0, k_tile, kk, kn_off, kn_x, kn_u)
                    for j in range(NS):
                        s[0, j, 0], s[0, j, 1], s[0, j, 2], s[0, j, 3] = mma(
                            a_frag[0, 0, 0], a_frag[0, 0, 1], a_frag[0, 0, 2], a_frag[0, 0, 3],
                            kn_frag[0, j, 0], kn_frag[0, j, 1],
                            s[0, j, 0], s[0, j, 1], s[0, j, 2], s[0, j, 3])
                # the variant's modifications; keys past a row's last (or sk), or (a
                # window) before its first
                row_scores(s, dfac, scale, wrow + g, kb, t, b, h, hook, partial(blocks, jb),
                           limit, all_first, all_see)
                grad.probabilities(s, l2, scale_log2)
                for kk in range(KD):
                    load_a(a_frag, 0, base + Q_TILE, kk, a_off, a_x)
                    load_kn(kn_frag, 0, v_tile, kk, kn_off, kn_x, kn_u)
                    for j in range(NS):
                        dp[0, j, 0], dp[0, j, 1], dp[0, j, 2], dp[0, j, 3] = mma(
                            a_frag[0, 0, 0], a_frag[0, 0, 1], a_frag[0, 0, 2], a_frag[0, 0, 3],
                            kn_frag[0, j, 0], kn_frag[0, j, 1],
                            dp[0, j, 0], dp[0, j, 1], dp[0, j, 2], dp[0, j, 3])
                grad.gradients(dp, s, dl)
                chain(dp, dfac)
                for kk in range(KN):
                    p0, p1, p2, p3 = afrag(dp, 0, kk)
                    load_kk(kk_frag, 0, k_tile, kk, kk_off, kk_c, kk_x)
                    for j in range(NO):
                        acc[0, j, 0], acc[0, j, 1], acc[0, j, 2], acc[0, j, 3] = mma(
                            p0, p1, p2, p3, kk_frag[0, j, 0], kk_frag[0, j, 1],
                            acc[0, j, 0], acc[0, j, 1], acc[0, j, 2], acc[0, j, 3])

        store(acc, dq[vb, h], q_start + wrow, q_start + sq, scale, g, t)

    return kernel


# ---- plans ---------------------------------------------------------------------------------

def row_pad(cfg: BackwardConfig, seq_q: int) -> int:
    """Sq rounded up to the config's :attr:`~BackwardConfig.row_pad`."""
    p = cfg.row_pad
    return -(-seq_q // p) * p


def heads_split(q_like, k_like, group: int, by_kv: bool):
    """GridSplit entries for a grid over heads (y) and batch (z): ``q_like`` / ``k_like``
    the argument positions indexed by query / key-value head; ``by_kv``: one block per
    key/value head (the dK / dV kernel), else per query head."""
    out = []
    for arg in q_like:
        out.append(GridSplit(1, arg, 1, per_block=group) if by_kv else GridSplit(1, arg, 1))
    for arg in k_like:
        out.append(GridSplit(1, arg, 1) if by_kv else GridSplit(1, arg, 1, group=group))
    return tuple(out) + tuple(GridSplit(2, arg, 0) for arg in (*q_like, *k_like))


def dq_acc_shape(cfg: BackwardConfig, batch: int, heads: int, sqp: int) -> tuple:
    """The float32 dQ accumulator a call with atomics needs: (B, Hq, SqP, tile_dim) (the
    columns past head_dim take the padded columns' sums, never read)."""
    return (batch, heads, sqp, cfg.tile_dim)


def uses_atomics(cfg, deterministic: bool) -> bool:
    """Whether a call takes dQ through atomics (and needs the float32 accumulator)."""
    return getattr(cfg, "dq_atomic", False) and not deterministic


def prepass_plan(dtype: str, views: dict, sqp: int, atomic: bool):
    """``(plan, args)`` of the rows pre-pass for :func:`plans`' ``views`` (``atomic``: it
    also zeroes ``dq_acc``)."""
    batch, hq, _, _ = views["q"].shape
    dv = views["o"].shape[3]            # D = rowsum(dO ∘ O) over v's head dim
    dlse = views.get("dlse")
    pre = rows_prepass(dv, dtype, atomic, dlse is not None)
    args = (views["o"], views["do"], views["lse"],
            views["placeholder3"] if dlse is None else dlse, views["delta"], views["lse2"],
            views["dq_acc"] if atomic else views["placeholder4"])
    return (LaunchPlan(pre, args, (sqp // ROWS_PER_BLOCK, hq, batch), ROW_THREADS,
                       split=heads_split(range(7), (), 1, False)), args)


def plans(cfg: BackwardConfig, causal: bool, deterministic: bool, views: dict, scale: float,
          window=None, softcap: float = 0.0, mods=(None, None, None), hargs=(), varlen=None,
          sparse=None):
    """The launch plans of one backward call, in order, as ``[(plan, args)]`` (a kernel with
    nothing to do — no query rows, or no keys — left out). ``views``: the
    kernel views ``q k v o do lse delta lse2 dq dk dv``, ``placeholder3`` / ``placeholder4``
    (arguments a kernel does not read), optionally ``dlse`` and, when
    :func:`uses_atomics`, ``dq_acc`` (float32 (B, Hq, SqP, D)). ``window``, ``softcap``: the
    forward's variant, ``mods`` its user functions with ``score_mod``'s derivative and
    ``hargs`` their run-time arguments (:func:`dkdv_kernel`). A hook that reads the batch or
    head (user functions, ALiBi) does not run in grid chunks (they would shift both): past
    the grid's limit the plans refuse (``ValueError``). ``varlen``: ``(sequences, max_seqlen_q,
    max_seqlen_k)`` of packed sequences (:func:`dkdv_kernel`; the views of batch 1, ``hargs``
    ``((cu_seqlens_q, cu_seqlens_k), hook_args)``, ``delta`` / ``lse2`` of
    :func:`varlen_rows` rows): every grid runs over the sequences, dQ by its own kernel (no
    atomics: they would need the float32 accumulator's rows outside every sequence
    cleared); never in chunks. ``sparse``: ``(mask_block, kv_views, q_views)`` of a block
    mask (:func:`tilepy.ops.attention_block_mask.mask_views` of its lists and of its
    transposed lists): the dK / dV kernel walks the transposed lists, the dQ kernel the
    lists (``delta`` / ``lse2`` / ``dq_acc`` padded to whole mask query blocks: a mask block
    may reach past the last row)."""
    q, k, v = views["q"], views["k"], views["v"]
    batch, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if varlen is not None:
        batch, sq_blocks, sk_blocks = varlen
    else:
        sq_blocks, sk_blocks = sq, sk
    group = hq // hk
    sqp = views["delta"].shape[2]
    atomic = uses_atomics(cfg, deterministic) and varlen is None
    scale32, slog2 = np.float32(scale), np.float32(scale * LOG2E)
    dq_acc = views["dq_acc"] if atomic else views["placeholder4"]
    out = []

    if varlen is None:
        out.append(prepass_plan(cfg.dtype, views, sqp, atomic))
    else:
        out.append(varlen_prepass_plan(cfg, views, hq, varlen, hargs[0][0]))

    mods = _mods(mods)
    chunks = not _reads_hook(mods) and varlen is None
    hargs = tuple(hargs)
    mask_block, kv_mask, q_mask = sparse if sparse is not None else (None, None, None)
    kern = dkdv_kernel(cfg, causal, atomic, window, softcap, mods, varlen is not None,
                       mask_block)
    args = (q, k, v, views["do"], views["lse2"], views["delta"], views["dk"], views["dv"],
            dq_acc, scale32, slog2, hargs if sparse is None else (hargs, q_mask))
    smem = cfg.dkdv_layout(atomic).nbytes
    allow_dynamic_shared(kern, args, smem)
    out.append((LaunchPlan(kern, args, (-(-sk_blocks // cfg.block_n), hk, batch), 32 * cfg.warps,
                           smem,
                           split=heads_split((0, 3, 4, 5, 8), (1, 2, 6, 7), group, True)
                           if chunks else ()), args))

    if atomic:
        conv = dq_convert(d, cfg.dtype, vectors_fit(views["dq"]))
        args = (dq_acc, views["dq"], scale32)
        out.append((LaunchPlan(conv, args, (-(-sq // ROWS_PER_BLOCK), hq, q.shape[0]),
                               ROW_THREADS, split=heads_split((0, 1), (), 1, False)), args))
    else:
        kern = dq_kernel(cfg, causal, window, softcap, mods, varlen is not None, mask_block)
        args = (q, k, v, views["do"], views["lse2"], views["delta"], views["dq"], scale32, slog2,
                hargs if sparse is None else (hargs, kv_mask))
        allow_dynamic_shared(kern, args, cfg.dq_smem_bytes)
        out.append((LaunchPlan(kern, args, (-(-sq_blocks // cfg.dq_block_m), hq, batch),
                               32 * cfg.dq_warps, cfg.dq_smem_bytes,
                               split=heads_split((0, 3, 4, 5, 6), (1, 2), group, False)
                               if chunks else ()), args))
    return [(p, a) for p, a in out if p.grid[0] > 0]   # no rows or no keys: nothing to do


def argtypes(kind: str, varlen: bool = False):
    """Numba argument types of a backward kernel (offline compilation): ``kind`` one of
    ``dkdv``, ``dq``, ``prepass``, ``convert``; the first two end with the (empty) hook
    arguments, as the wgmma kernels of the same contract do (``varlen``: the cumulative
    lengths' int32 arrays before them)."""
    from numba import types

    if varlen:
        cu = types.Array(types.int32, 1, "A")
        *head, _ = argtypes(kind)
        return (*head, types.Tuple((types.Tuple((cu, cu)), types.Tuple(()))))

    u16 = types.Array(types.uint16, 4, "A")
    f4 = types.Array(types.float32, 4, "A")
    f3 = types.Array(types.float32, 3, "A")
    f32 = types.float32
    none = types.Tuple(())   # no hook arguments
    return {"dkdv": (u16, u16, u16, u16, f3, f3, u16, u16, f4, f32, f32, none),
            "dq": (u16, u16, u16, u16, f3, f3, u16, f32, f32, none),
            "prepass": (u16, u16, f3, f3, f3, f3, f4),
            "convert": (f4, u16, f32)}[kind]


#: The kernels the compile layer reports on: (name, kind, config, causal, atomic[, window,
#: softcap]); names ending ``_varlen`` are the packed-sequence kernels.
COMPILED = (
    ("bwd_dkdv_d64_f16", "dkdv", BackwardConfig(64), False, False),
    ("bwd_dkdv_d64_f16_causal_atomic", "dkdv", BackwardConfig(64), True, True),
    ("bwd_dkdv_d128_f16", "dkdv", BackwardConfig(128, block_m=32), False, False),
    ("bwd_dkdv_d128_bf16_causal_det", "dkdv", BackwardConfig(128, block_m=32,
                                                             dtype="bfloat16"), True, False),
    ("bwd_dq_d128_f16_causal", "dq", BackwardConfig(128), True, False),
    ("bwd_dq_d64_f16", "dq", BackwardConfig(64), False, False),
    # the variants: a sliding window under causal with a soft cap (Gemma 2's layers)
    ("bwd_dkdv_d128_f16_window_softcap", "dkdv", BackwardConfig(128, block_m=32), True, False,
     (4095, 0), 50.0),
    ("bwd_dq_d128_f16_window_softcap", "dq", BackwardConfig(128), True, False, (4095, 0),
     50.0),
    # packed sequences (bounds and offsets from the cumulative lengths)
    ("bwd_dkdv_d128_f16_causal_varlen", "dkdv", BackwardConfig(128, block_m=32), True, False),
    ("bwd_dq_d128_f16_causal_varlen", "dq", BackwardConfig(128), True, False),
)


def compile_reports(only=None):
    """Offline sm_90 reports (registers, spills, instruction counts) of :data:`COMPILED`.

    Run with the simulator off: ``tilepy.offline.run_in_subprocess(
    "tilepy.ops.attention_backward_mma_sync:compile_reports")``."""
    from ..offline import report_entry

    def build(kind, cfg, causal, atomic, window=None, cap=0.0, varlen=False):
        mods = (None, None, None)
        return (dkdv_kernel(cfg, causal, atomic, window, cap, mods, varlen) if kind == "dkdv"
                else dq_kernel(cfg, causal, window, cap, mods, varlen))

    out = []
    for name, kind, cfg, causal, atomic, *variant in COMPILED:
        if only is not None and name not in only:
            continue
        threads = 32 * (cfg.warps if kind == "dkdv" else cfg.dq_warps)
        smem = cfg.dkdv_layout(atomic).nbytes if kind == "dkdv" else cfg.dq_smem_bytes
        varlen = name.endswith("_varlen")
        out.append(report_entry(name, lambda kind=kind, cfg=cfg, causal=causal, atomic=atomic,
                                variant=tuple(variant), varlen=varlen:
                                build(kind, cfg, causal, atomic, *variant, varlen=varlen),
                                argtypes(kind, varlen),
                                (9, 0),
                                threads=threads, config=cfg.describe(), causal=causal,
                                smem_bytes=smem))
    return out
