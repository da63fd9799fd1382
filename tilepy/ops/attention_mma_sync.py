"""The FlashAttention-2 forward kernel on mma.sync: Q in registers, K/V streamed, P never stored.

``attention_kernel(cfg, causal, has_lse, window=None, score_mod=None)`` returns a ``@cuda.jit``
kernel (a sliding ``window`` and a ``score_mod`` such as a soft cap are generator parameters:
see :func:`attention_kernel`)

    kernel(q, k, v, o, lse, scale, scale_log2, hargs)

for 4-D arrays in (batch, heads, seq, head_dim) order — any element strides, as long as the
head_dim axis has unit stride and every other stride and the base are 16-byte aligned (the op
wrapper :mod:`tilepy.ops.attention` checks that and copies otherwise; a (batch, seq, heads,
head_dim) tensor is passed as a strided view, without a copy):

* ``q`` (B, Hq, Sq, D), ``k`` and ``v`` (B, Hkv, Sk, D): uint16 bits of float16 / bfloat16
  (``cfg.dtype``); head ``h`` of ``q`` reads head ``h // (Hq // Hkv)`` of ``k`` and ``v``.
* ``o`` (B, Hq, Sq, D) uint16 bits of the same dtype: ``softmax(scale · q kᵀ + mask) v``.
* ``lse`` (B, Hq, Sq) float32, written only with ``has_lse``: the natural-log row
  log-sum-exp ``log Σ_j exp(scale · s_j)`` over the visible keys; -inf for a row that sees no
  key (its output row is 0).
* ``scale`` float32 > 0 and ``scale_log2 = scale · log2(e)``.
* ``hargs``: the score hook's run-time arguments, a tuple of device arrays and scalars passed
  to ``score_mod`` as its ``args`` (:func:`tilepy.tile.attention.score_hook`: ``mod_args``,
  ALiBi's slopes); ``()`` for a kernel without one, or one that reads none.

Causal masking (``causal=True``) is aligned to the bottom-right corner: query row ``i`` sees
keys ``j <= i + Sk - Sq`` (the FlashAttention-2 convention; for Sq == Sk the usual lower
triangle). Launch with grid :func:`grid` = (ceil(Sq / BM), Hq, B), ``cfg.threads`` threads and
``cfg.smem_bytes`` of dynamic shared memory (:func:`launch`).

One block computes BM = ``cfg.block_m`` query rows of one (batch, head); warp ``w`` owns rows
``w·warp_rows …`` (``warp_rows`` = 16 · mi). Per block:

1. Q tile (BM × D) global → shared with 16-byte cp.async (zero-filled past Sq), then
   ldmatrix.x4 into A fragments for every k16 step of D, kept in registers for the whole loop.
2. Key blocks of BN = ``cfg.block_n`` keys; K and V tiles (BN × D, row-major = the n-major B
   operand of Q·Kᵀ and the k-major B operand of P·V) stream through a two-stage cp.async
   pipeline: at the top of iteration ``kb`` one wait + one barrier make stage ``kb % 2``
   visible and free the other stage, into which block ``kb + 1`` is issued at once, so its
   copy overlaps the whole of iteration ``kb``. Keys past Sk are zero-filled.
3. S = Q·Kᵀ (mma m16n8k16, f32 accumulate; K fragments by ldmatrix.x4 from the K tile).
   Keys >= Sk and (causal) keys above the diagonal are set to -inf, only in the blocks that
   have any (a block-uniform test; :func:`tilepy.tile.attention.mask_scores`); blocks wholly
   above the diagonal are never visited.
4. :func:`tilepy.tile.online_softmax.online_softmax_update` on the S fragments (exp2 with the
   scale folded in); the O accumulator rows are rescaled by its alpha.
5. P is rounded to f16/bf16 in registers: the accumulator tiles 2·kk and 2·kk+1 of S (keys
   16·kk … 16·kk+15) are exactly the A fragment of k16 step kk (a0 = tile 2kk (c0, c1),
   a1 = tile 2kk (c2, c3), a2 = tile 2kk+1 (c0, c1), a3 = tile 2kk+1 (c2, c3); see
   :mod:`tilepy.ptx.fragments`), so O += P·V runs with V fragments by ldmatrix.x4.trans and no
   trip of P through shared memory.
6. After the last key block, O rows are divided by their sums
   (:func:`~tilepy.tile.online_softmax.online_softmax_finalize`), rounded to 16 bits and
   stored straight from registers (rows past Sq skipped); lane 0 of each quad writes the LSE.

Every warp of a block runs the same number of key blocks (the loop bounds are per block), as
the warp-collective instructions — and their simulator twins — require.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..launch import GridSplit, LaunchPlan
from ..ptx import global_addr, shared_addr
from ..ptx.asm import SIMULATOR
from ..ptx.cp_async import cp_async_commit_group, cp_async_wait_group
from ..ptx.math import cvt_bf16x2_f32, cvt_f16x2_f32
from ..tile.attention import (block_mask_row, check_mask_block, key_block_at, key_block_partial, key_blocks, key_window,
                              limits_shape, mask_key_block, mask_scores, modify_scores,
                              packed_sequence, row_limits, store_rows)
from ..tile.config import DTYPES, SMEM_LIMIT
from ..tile.copy import copy_rows_to_shared, load_a_fragments, load_b_fragments
from ..tile.mma import _MMA
from ..tile.online_softmax import online_softmax_finalize, online_softmax_update
from ..tile.smem import allow_dynamic_shared, dynamic_shared
from ..kcache import cached_jit

#: Head dimensions the kernel supports: multiples of 8 up to 256 (Q's fragments stay in
#: registers next to O's accumulators: D/4 + D/2 registers per thread for 16 rows a warp, so
#: past 128 a GPU compile spills: there the Hopper TMA kernels are the fast path and this
#: kernel the portable fallback).
#: The shared tiles are :attr:`AttentionConfig.tile_dim` wide — the next multiple of 16, for
#: the k16 steps of Q·Kᵀ and the pairs of n8 tiles of P·V — with the columns past head_dim
#: zero-filled by the copies (no padded copy of the inputs).
HEAD_DIMS = tuple(range(8, 257, 8))

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
LOG2E = 1.4426950408889634


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class KeyTiles:
    """The shared tiles of a config with ``head_dim`` and ``block_n`` (the forward and the
    decoding kernels' configs)."""

    @property
    def tile_dim(self) -> int:
        """The shared tiles' row length: ``head_dim`` rounded up to a multiple of 16 (the
        columns past ``head_dim`` are zeros)."""
        return -(-self.head_dim // 16) * 16

    @property
    def swizzle(self) -> bool:
        """XOR swizzle of the shared tiles where the row length allows it (tile_dim = 16, 32,
        64, 128); other head dims use plain rows (correct; some bank conflicts)."""
        chunks = self.tile_dim // 8
        return chunks in (1, 2, 4) or chunks % 8 == 0

    @property
    def tile_bytes(self) -> int:
        return self.block_n * self.tile_dim * 2


@dataclass(frozen=True)
class AttentionConfig(KeyTiles):
    """One FlashAttention forward kernel: BM query rows per block, BN keys per step.

    ``warp_rows`` (16 or 32) query rows per warp, so ``block_m / warp_rows`` warps per block.
    Shared memory: the Q tile plus two stages of a K and a V tile,
    ``(block_m + 4 · block_n) · tile_dim · 2`` bytes (:attr:`tile_dim`: head_dim rounded up
    to 16).
    """

    head_dim: int
    block_m: int = 128
    block_n: int = 64
    warp_rows: int = 16
    dtype: str = "float16"
    cc: tuple = (9, 0)

    def __post_init__(self):
        _require(self.dtype in DTYPES, f"AttentionConfig.dtype must be one of {DTYPES}, got "
                 f"{self.dtype!r}")
        _require(self.head_dim in HEAD_DIMS, f"AttentionConfig.head_dim must be one of "
                 f"{HEAD_DIMS}, got {self.head_dim!r}")
        _require(self.warp_rows in (16, 32), f"AttentionConfig.warp_rows must be 16 or 32, got "
                 f"{self.warp_rows!r}")
        _require(isinstance(self.block_m, int) and self.block_m > 0
                 and self.block_m % self.warp_rows == 0,
                 f"AttentionConfig.block_m={self.block_m!r} is not a positive multiple of "
                 f"warp_rows={self.warp_rows}")
        _require(1 <= self.warps <= 32, f"AttentionConfig: {self.warps} warps per block; a "
                 "block holds 1 … 32")
        _require(isinstance(self.block_n, int) and self.block_n > 0 and self.block_n % 16 == 0,
                 f"AttentionConfig.block_n={self.block_n!r} is not a positive multiple of 16 "
                 "(P·V runs k16 steps over the keys)")
        limit = SMEM_LIMIT.get(tuple(self.cc[:2]), 99 * 1024)
        _require(self.smem_bytes <= limit, f"AttentionConfig: {self.smem_bytes} B of shared "
                 f"memory exceeds the {limit} B a block may use on sm_{self.cc[0]}{self.cc[1]}")

    @property
    def warps(self) -> int:
        return self.block_m // self.warp_rows

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def q_bytes(self) -> int:
        return self.block_m * self.tile_dim * 2

    @property
    def smem_bytes(self) -> int:
        return self.q_bytes + 2 * 2 * self.tile_bytes

    @property
    def registers_estimate(self) -> int:
        mi = self.warp_rows // 16
        d = self.tile_dim
        return mi * (d // 2 + d // 4 + self.block_n // 2) + d // 4 + 40

    def describe(self) -> str:
        return (f"BM={self.block_m} BN={self.block_n} D={self.head_dim}, {self.warps} warps x "
                f"{self.warp_rows} rows, 2 stages, {self.dtype}, {self.smem_bytes // 1024} KB "
                f"smem, swizzle={'on' if self.swizzle else 'off'}")


# ---- the kernel ----------------------------------------------------------------------------------

def _kernel_jit(threads: int, disk_cache: bool = True):
    if SIMULATOR:
        return cuda.jit
    if not disk_cache:
        return cuda.jit(launch_bounds=int(threads))
    return cached_jit(launch_bounds=int(threads))


def attention_kernel(cfg: AttentionConfig, causal: bool = False, has_lse: bool = False,
                     window=None, score_mod=None, varlen: bool = False, cache=None,
                     mask_block=None, full_score_mod=None):
    """The kernel for ``cfg`` (see the module docstring), generated once per argument set.

    Variants, generator parameters of one kernel (:mod:`tilepy.tile.attention`'s pieces):

    * ``window``: FlashAttention's ``window_size`` ``(left, right)`` relative to the
      bottom-right diagonal, ``-1`` unbounded (``causal=True`` is ``right = 0``): row ``i``
      sees keys ``i + sk - sq - left <= j <= i + sk - sq + right``. Key blocks no row of a
      query block sees are skipped on both sides.
    * ``score_mod(score, q_row, k_col, batch, head, args) -> float32``: a device function
      applied to every scaled score before the mask (``args``: the kernel's ``hargs``;
      :func:`tilepy.tile.attention.modify_scores`;
      :func:`tilepy.tile.attention.softcap_score` is Gemma 2's soft cap). The LSE is that of
      the modified scores. A kernel with a ``score_mod`` is not kept in the disk cache (its
      closure holds the caller's function).
    * ``varlen``: packed sequences of different lengths (FlashAttention's varlen layout).
      ``q`` (1, Hq, total_q, D), ``k`` / ``v`` (1, Hkv, total_k, D) and ``o`` hold the
      sequences one after another along the sequence axis, ``lse`` (1, Hq, total_q);
      ``hargs`` is ``((cu_seqlens_q, cu_seqlens_k), hook_args)`` with the int32 cumulative
      lengths: sequence ``z = blockIdx.z`` is rows ``cu_seqlens_q[z] …
      cu_seqlens_q[z + 1] - 1`` of q and o, keys ``cu_seqlens_k[z] … cu_seqlens_k[z + 1] -
      1``. Every mask, window and score function is relative to the sequence (its own
      ``Sq``, ``Sk``, bottom-right diagonal; the hook's batch is ``z`` and its positions are
      within the sequence) and the hook gets ``hook_args + (Sk - Sq,)`` (ALiBi's shift per
      sequence). Grid (ceil(max_seqlen_q / BM), Hq, sequences): blocks past a sequence's rows
      return at once.
    * ``cache``: keys and values from a KV cache (FlashAttention's ``flash_attn_with_kvcache``)
      — ``"contiguous"``: ``k`` / ``v`` (B, Hkv, capacity, D); ``"paged"``: ``k`` / ``v``
      (pages, Hkv, page_size, D) with ``page_size`` a multiple of BN. ``hargs`` is ``((seqlens,
      added[, block_table]), hook_args)``: batch ``b`` sees its first ``min(seqlens[b] + added,
      capacity)`` keys (int32 ``seqlens``, int64 ``added``; a paged cache's capacity is
      ``block_table.shape[1] · page_size``), key ``j`` of a paged cache at row ``j %
      page_size`` of page ``block_table[b, j // page_size]`` (int32; an entry outside ``0 …
      pages - 1`` is clamped into that range, never read out of bounds). ``q`` / ``o``
      (B, Hq, Sq, D) and ``lse`` as usual; masks and windows align to each batch's own
      bottom-right diagonal. Not with ``varlen``.
    * ``mask_block=(block_q, block_k)``: block-sparse, over a block mask of that block size
      (multiples of ``block_m`` / ``block_n``; :class:`tilepy.ops.attention_block_mask.
      BlockMask`): ``hargs`` is ``(hook_args, (num, idx, full_num, full_idx))``, the mask's
      arrays as (B, Hq, …) views; a block of query rows visits the key blocks of its mask
      query block's partial, then full lists (:func:`tilepy.tile.attention.block_mask_row`),
      in that order, and no other. With a ``score_mod`` (the mask function in it) and no
      window, ``varlen`` or ``cache``; the full blocks' scores take ``full_score_mod``
      instead (the same hook without the mask function; None: nothing).

    Without any of them the generated code is the plain causal / full kernel's."""
    left, right = key_window(causal, window)
    if cache not in (None, "contiguous", "paged"):
        raise ValueError(f"cache must be None, 'contiguous' or 'paged', got {cache!r}")
    if cache is not None and varlen:
        raise ValueError("a kernel reads keys either packed (varlen) or from a cache")
    if mask_block is not None:
        mask_block = check_mask_block(mask_block, cfg.block_m, cfg.block_n)
        if varlen or cache is not None or (left, right) != (-1, -1) or score_mod is None:
            raise ValueError("a block-sparse kernel (mask_block) takes a score_mod and no "
                             "window, varlen or cache")
    # a plain Python score_mod is wrapped (once per function) by modify_scores
    else:
        full_score_mod = None
    return _attention_kernel(cfg, bool(has_lse), left, right, score_mod, bool(varlen), cache,
                             mask_block, full_score_mod)


@functools.cache
def _attention_kernel(cfg: AttentionConfig, has_lse: bool, left: int, right: int,
                      score_mod, varlen: bool = False, cache=None, mask_block=None,
                      full_score_mod=None):
    # D: the shared tiles' width (head_dim rounded up to 16, zero columns past it)
    BM, BN, D = cfg.block_m, cfg.block_n, cfg.tile_dim
    VALID = None if cfg.head_dim == D else cfg.head_dim   # copies zero-fill past it
    WARP_ROWS = cfg.warp_rows
    MI = WARP_ROWS // 16
    THREADS = cfg.threads
    KD = D // 16        # k16 steps of Q·Kᵀ
    NS = BN // 8        # n8 tiles of S
    KN = BN // 16       # k16 steps of P·V
    NO = D // 8         # n8 tiles of O (those past head_dim are computed, not stored)
    SW = cfg.swizzle
    Q_BYTES = cfg.q_bytes
    TILE = cfg.tile_bytes
    STAGE = 2 * TILE    # K then V
    # a window other than plain causal / full, or a score function: the pieces' key ranges
    VARIANT = (left, right) not in ((-1, -1), (-1, 0)) or score_mod is not None
    CAUSAL = right == 0 and not VARIANT
    VARLEN = varlen
    CACHE = cache is not None
    PAGED = cache == "paged"
    WIN = (left, right)
    LIMITS = limits_shape(cfg.warp_rows // 16, False, WIN)
    v_bounds = key_blocks(BM, BN, False, WIN)
    v_rows = row_limits(cfg.warp_rows // 16, False, WIN)
    v_mask = mask_key_block(cfg.warp_rows // 16, BN // 8, BN, WIN)
    v_modify = modify_scores(cfg.warp_rows // 16, BN // 8, score_mod)
    # block-sparse (a block mask): the key loop's step j visits key block at(blocks, j)
    SPARSE = mask_block is not None
    at = key_block_at(SPARSE, mask_block[1] // BN if SPARSE else 1)
    mask_row = block_mask_row(BM, mask_block[0], mask_block[1] // BN) if SPARSE else None
    partial = key_block_partial(SPARSE)
    v_modify_full = modify_scores(cfg.warp_rows // 16, BN // 8, full_score_mod)

    mma = _MMA[cfg.dtype]
    pack = cvt_f16x2_f32 if cfg.dtype == "float16" else cvt_bf16x2_f32
    smem = dynamic_shared()
    setup_q, issue_q = copy_rows_to_shared(BM, D, THREADS, SW, VALID)
    setup_kv, issue_kv = copy_rows_to_shared(BN, D, THREADS, SW, VALID)
    setup_fq, load_q = load_a_fragments(MI, D, SW)
    setup_fk, load_k = load_b_fragments(NS, D, False, SW)
    setup_fv, load_v = load_b_fragments(NO, D, True, SW)
    update = online_softmax_update(MI, NS)
    finalize = online_softmax_finalize(MI, NO)
    mask = mask_scores(MI, NS)
    store = store_rows(MI, cfg.head_dim // 8, cfg.dtype, has_lse)

    @_kernel_jit(THREADS, score_mod is None)
    def kernel(q, k, v, o, lse, scale, scale_log2, hargs):
        # block_coords written out, as the key blocks below: through it ptxas allocates 211
        # registers instead of 209 at head_dim 128 (offline sm_90)
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        if VARLEN:
            # sequence b: rows q_start … of the packed q / o, keys k_start … of k / v
            q_start, k_start, sq, sk = packed_sequence(hargs[0], b)
            hook = hargs[1] + (sk - sq,)
            vb = 0
            kvb = 0
        elif CACHE:
            # batch b sees its cache's first seqlens[b] + added keys (at most the capacity)
            sq = q.shape[2]
            if PAGED:
                table = hargs[0][2]
                cap = np.int64(table.shape[1]) * k.shape[2]
            else:
                cap = np.int64(k.shape[2])
            sk = min(max(np.int64(hargs[0][0][b]) + hargs[0][1], np.int64(0)), cap)
            q_start = 0
            k_start = 0
            hook = hargs[1]
            vb = b
            kvb = 0 if PAGED else b
        else:
            sq = q.shape[2]
            sk = k.shape[2]
            q_start = 0
            k_start = 0
            hook = hargs[0] if SPARSE else hargs
            vb = b
            kvb = b
        hk = h // (q.shape[1] // k.shape[1])
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        wrow = warp * WARP_ROWS
        acc = cuda.local.array((MI, NO, 4), np.float32)
        row_max = cuda.local.array((MI, 2), np.float32)
        row_sum = cuda.local.array((MI, 2), np.float32)
        alpha = cuda.local.array((MI, 2), np.float32)
        if VARIANT:
            # key blocks kb_first … n_kb - 1, per-row first / last keys: the pieces
            if SPARSE:   # the block mask's lists of this query block
                row0, kb_first, _, all_first, all_see = v_bounds(sq, sk)
                n_kb, blocks = mask_row(hargs[1], cuda.blockIdx.x, b, h)
            else:        # step j visits key block j
                row0, kb_first, n_kb, all_first, all_see = v_bounds(sq, sk)
                blocks = 0
            limits = cuda.local.array(LIMITS, np.int64)
            v_rows(limits, row_max, row_sum, row0 + wrow, g, sq, sk)
        else:
            kb_first = 0
            blocks = 0
            if CAUSAL:
                # Heavier blocks (more keys below the diagonal) first.
                row0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BM
            else:
                row0 = cuda.blockIdx.x * BM
            shift = sk - sq  # bottom-right alignment: row i sees keys j <= i + shift

            # Key blocks this query block visits, and the last key every one of its rows sees
            # (blocks ending after it need the mask). Written out here rather than through
            # tilepy.tile.attention's key_blocks / row_limits (the variants use them): with
            # those, ptxas allocates 128 registers and spills 16 B at head_dim 64, causal with
            # LSE (offline, sm_90).
            if CAUSAL:
                last = min(sk, min(row0 + BM, sq) + shift) - 1
                n_kb = last // BN + 1 if last >= 0 else 0
                all_see = min(sk, row0 + shift + 1) - 1
            else:
                n_kb = (sk + BN - 1) // BN
                all_see = sk - 1
            limit = cuda.local.array((MI, 2), np.int64)  # last key each of the lane's rows sees
            for i in range(MI):
                for hh in range(2):
                    row_max[i, hh] = _NEG_INF
                    row_sum[i, hh] = _ZERO
                    if CAUSAL:
                        limit[i, hh] = min(sk, row0 + wrow + 16 * i + g + 8 * hh + shift + 1) - 1
                    else:
                        limit[i, hh] = sk - 1
        if VARLEN and row0 >= sq:
            return      # past this sequence's rows (the grid fits the longest)
        for i in range(MI):
            for j in range(NO):
                for e in range(4):
                    acc[i, j, e] = _ZERO

        if n_kb > kb_first:
            base = shared_addr(smem(), 0)
            kv_base = base + Q_BYTES
            qs = q.strides[2]
            ks = k.strides[2]
            vs = v.strides[2]
            q0, qsh, qr, qc = setup_q(np.int64(global_addr(q, (vb, h, q_start + row0, 0))), qs,
                                      tid)
            k0, ksh, kr, kc = setup_kv(np.int64(global_addr(k, (kvb, hk, k_start, 0))), ks,
                                       tid)
            v0, vsh, vr, vc = setup_kv(np.int64(global_addr(v, (kvb, hk, k_start, 0))), vs,
                                       tid)
            k_step = BN * ks
            v_step = BN * vs
            if PAGED:   # byte shifts of key block kb: its page (clamped), its rows in it
                page = k.shape[2]
                last_page = np.int64(k.shape[0] - 1)
                kp = k.strides[0]
                vp = v.strides[0]

            issue_q(base, 0, q0, qsh, qr, qc, qs, sq - row0)
            cp_async_commit_group()
            first = kv_base + (kb_first % 2) * STAGE
            kb0 = at(blocks, kb_first)
            if PAGED:
                pos = np.int64(kb0) * BN
                pg = min(max(np.int64(table[b, pos // page]), np.int64(0)), last_page)
                k_shift = pg * kp + (pos % page) * ks
                v_shift = pg * vp + (pos % page) * vs
            else:
                k_shift = kb0 * k_step
                v_shift = kb0 * v_step
            issue_kv(first, k_shift, k0, ksh, kr, kc, ks, sk - kb0 * BN)
            issue_kv(first + TILE, v_shift, v0, vsh, vr, vc, vs, sk - kb0 * BN)
            cp_async_commit_group()

            fq_off, fq_x = setup_fq(wrow, lane)
            fk_off, fk_x, fk_u = setup_fk(0, lane)
            fv_off, fv_c, fv_x = setup_fv(0, lane)

            q_frag = cuda.local.array((KD, MI, 4), np.uint32)
            k_frag = cuda.local.array((1, NS, 2), np.uint32)
            v_frag = cuda.local.array((1, NO, 2), np.uint32)
            s = cuda.local.array((MI, NS, 4), np.float32)

            cp_async_wait_group(1)  # the Q tile (K/V block 0 may still be in flight)
            cuda.syncthreads()
            for kk in range(KD):
                load_q(q_frag, kk, base, kk, fq_off, fq_x)

            for jb in range(kb_first, n_kb):   # step jb: key block kb (jb but block-sparse)
                kb = at(blocks, jb)
                cp_async_wait_group(0)  # K, V of block kb have landed ...
                cuda.syncthreads()      # ... for every thread, and stage (jb+1)%2 is free
                if jb + 1 < n_kb:
                    nxt = kv_base + ((jb + 1) % 2) * STAGE
                    kn = at(blocks, jb + 1)
                    left = sk - kn * BN
                    if PAGED:
                        pos = np.int64(kn) * BN
                        pg = min(max(np.int64(table[b, pos // page]), np.int64(0)), last_page)
                        k_shift = pg * kp + (pos % page) * ks
                        v_shift = pg * vp + (pos % page) * vs
                    else:
                        k_shift = kn * k_step
                        v_shift = kn * v_step
                    issue_kv(nxt, k_shift, k0, ksh, kr, kc, ks, left)
                    issue_kv(nxt + TILE, v_shift, v0, vsh, vr, vc, vs, left)
                cp_async_commit_group()
                k_addr = kv_base + (jb % 2) * STAGE
                v_addr = k_addr + TILE

                # S = Q · Kᵀ
                for i in range(MI):
                    for j in range(NS):
                        for e in range(4):
                            s[i, j, e] = _ZERO
                for kk in range(KD):
                    load_k(k_frag, 0, k_addr, kk, fk_off, fk_x, fk_u)
                    for i in range(MI):
                        for j in range(NS):
                            s[i, j, 0], s[i, j, 1], s[i, j, 2], s[i, j, 3] = mma(
                                q_frag[kk, i, 0], q_frag[kk, i, 1], q_frag[kk, i, 2],
                                q_frag[kk, i, 3], k_frag[0, j, 0], k_frag[0, j, 1],
                                s[i, j, 0], s[i, j, 1], s[i, j, 2], s[i, j, 3])

                # Mask keys past Sk and above the diagonal, in the blocks that have any.
                if VARIANT:
                    if SPARSE and not partial(blocks, jb):   # a full block: no mask function
                        v_modify_full(s, row0 + wrow + g, kb * BN + 2 * t, b, h, scale, hook)
                    else:
                        v_modify(s, row0 + wrow + g, kb * BN + 2 * t, b, h, scale, hook)
                    v_mask(s, limits, kb, t, all_first, all_see)
                elif (kb + 1) * BN - 1 > all_see:
                    mask(s, limit, kb * BN + 2 * t)

                update(s, row_max, row_sum, alpha, scale_log2)
                for i in range(MI):
                    for j in range(NO):
                        for e in range(4):
                            acc[i, j, e] = acc[i, j, e] * alpha[i, e // 2]

                # O += P · V, P straight from the S accumulators.
                for kk in range(KN):
                    load_v(v_frag, 0, v_addr, kk, fv_off, fv_c, fv_x)
                    for i in range(MI):
                        p0 = pack(s[i, 2 * kk, 0], s[i, 2 * kk, 1])
                        p1 = pack(s[i, 2 * kk, 2], s[i, 2 * kk, 3])
                        p2 = pack(s[i, 2 * kk + 1, 0], s[i, 2 * kk + 1, 1])
                        p3 = pack(s[i, 2 * kk + 1, 2], s[i, 2 * kk + 1, 3])
                        for j in range(NO):
                            acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma(
                                p0, p1, p2, p3, v_frag[0, j, 0], v_frag[0, j, 1],
                                acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])

        finalize(acc, row_sum)
        # (varlen: rows counted from the packed start, bounded by the sequence's end)
        store(acc, row_max, row_sum, o[vb, h], lse, vb, h, q_start + row0 + wrow,
              q_start + sq, scale, g, t)

    return kernel


def grid(cfg: AttentionConfig, seq_q: int, heads_q: int, batch: int):
    return (-(-seq_q // cfg.block_m), heads_q, batch)


def grid_split(q, k) -> tuple:
    """How a grid kernel's blocks index q, k, v, o and lse (arguments 0-4): query heads along
    grid y (k and v by the K/V head, ``group = heads_q // heads_kv`` query heads to one),
    batch along grid z — so that more heads or batches than the grid's y / z limit launch in
    chunks (:class:`tilepy.launch.GridSplit`)."""
    group = q.shape[1] // max(k.shape[1], 1)
    heads = tuple(GridSplit(1, arg, 1, group=group if arg in (1, 2) else 1)
                  for arg in range(5))
    return heads + tuple(GridSplit(2, arg, 0) for arg in range(5))


def kernel_args(q, k, v, o, lse, scale: float) -> tuple:
    """The attention kernels' arguments: the views, then the scale and the scale · log2(e)
    the softmax's exp2 takes (the wgmma kernels' TMA variant adds its tensor maps)."""
    return (q, k, v, o, lse, np.float32(scale), np.float32(scale * LOG2E))


def plan(kernel, cfg: AttentionConfig, q, k, v, o, lse, scale: float, *, stream=0,
         hargs=(), chunks=True, varlen=None):
    """``(launch plan, arguments)`` for 4-D (B, H, S, D) kernel views: the config's grid,
    block and dynamic shared memory (allowed above 48 KB); more heads or batches than the
    grid's y / z limit launch in chunks (:func:`grid_split`). ``chunks=False`` (a score hook
    that reads the batch or head: user functions, ALiBi — a chunk's blocks would see them
    shifted) refuses such a grid instead (``ValueError``). ``hargs``: the score hook's
    arguments (the kernel's last). ``stream``: accepted so that every attention kernel's plan
    takes the same call (this one copies nothing to the device). ``varlen``: ``(sequences,
    max_seqlen_q)`` for a varlen kernel (:func:`attention_kernel`; views of batch 1, ``hargs``
    its ``((cu_seqlens_q, cu_seqlens_k), hook_args)``): the grid's z is the sequences, x fits
    the longest; never in chunks (``ValueError`` past the grid's limit)."""
    args = kernel_args(q, k, v, o, lse, scale) + (tuple(hargs),)
    allow_dynamic_shared(kernel, args, cfg.smem_bytes)
    if varlen is None:
        g = grid(cfg, q.shape[2], q.shape[1], q.shape[0])
    else:
        g = grid(cfg, varlen[1], q.shape[1], varlen[0])
    return LaunchPlan(kernel, args, g, cfg.threads, cfg.smem_bytes,
                      split=grid_split(q, k) if chunks and varlen is None else ()), args


def launch(kernel, cfg: AttentionConfig, q, k, v, o, lse, scale: float, stream=0):
    """Launch on 4-D (B, H, S, D) kernel views with the config's grid, block and shared memory."""
    p, args = plan(kernel, cfg, q, k, v, o, lse, scale)
    p.launch(stream, args)


def argtypes(layout: str = "A", varlen: bool = False, cache=None):
    """Numba argument types of :func:`attention_kernel`'s kernel (for offline compilation),
    with no hook arguments (``varlen``: the cumulative lengths' int32 arrays before them;
    ``cache``: the lengths, the appended count and, paged, the block table)."""
    from numba import types

    u16 = types.Array(types.uint16, 4, layout)
    hargs = types.Tuple(())
    if varlen:
        cu = types.Array(types.int32, 1, layout)
        hargs = types.Tuple((types.Tuple((cu, cu)), hargs))
    elif cache is not None:
        keys = (types.Array(types.int32, 1, layout), types.int64)
        if cache == "paged":
            keys += (types.Array(types.int32, 2, layout),)
        hargs = types.Tuple((types.Tuple(keys), hargs))
    return (u16, u16, u16, u16, types.Array(types.float32, 3, layout), types.float32,
            types.float32, hargs)


#: The kernels the compile layer reports on: (name, config, causal, has_lse, window, softcap);
#: names ending ``_varlen`` are the packed-sequence kernels, ``_paged`` a paged KV cache's.
COMPILED = (
    ("attention_d64_f16", AttentionConfig(64, 128, 64, 16, "float16"), False, False, None, 0),
    ("attention_d64_f16_causal_lse", AttentionConfig(64, 128, 64, 16, "float16"), True, True,
     None, 0),
    ("attention_d128_f16", AttentionConfig(128, 128, 64, 16, "float16"), False, False, None, 0),
    ("attention_d128_bf16_causal", AttentionConfig(128, 128, 64, 16, "bfloat16"), True, False,
     None, 0),
    # a variant: a sliding window under causal (Mistral's) and a soft cap (Gemma 2's)
    ("attention_d128_f16_window_softcap_lse", AttentionConfig(128, 128, 64, 16, "float16"),
     True, True, (4095, 0), 50.0),
    # head_dim 40 in 48-column tiles (the copies zero-fill the last 8 columns), the built-in
    # config of head_dim <= 64 (32 rows a warp)
    ("attention_d40_f16_causal_lse", AttentionConfig(40, 128, 64, 32, "float16"), True, True,
     None, 0),
    # packed sequences (the bounds and offsets read from the cumulative lengths)
    ("attention_d128_f16_causal_lse_varlen", AttentionConfig(128, 64, 64, 16, "float16"), True,
     True, None, 0),
    # a decoding step over a paged KV cache (one warp of query rows; lengths, pages read on
    # the device)
    ("attention_d128_f16_causal_lse_paged", AttentionConfig(128, 16, 64, 16, "float16"), True,
     True, None, 0),
)


def compile_reports(only=None):
    """Offline sm_90 reports (registers, spills, instruction counts) of :data:`COMPILED`.

    Run with the simulator off: ``tilepy.offline.run_in_subprocess(
    "tilepy.ops.attention_mma_sync:compile_reports")``.
    """
    from ..offline import report_entry
    from ..tile.attention import softcap_score

    def make(cfg, causal, has_lse, window, cap, varlen, cache):
        return lambda: attention_kernel(cfg, causal, has_lse, window,
                                        softcap_score(cap) if cap else None, varlen, cache)

    return [report_entry(name, make(cfg, causal, has_lse, window, cap, name.endswith("varlen"),
                                    "paged" if name.endswith("paged") else None),
                         argtypes(varlen=name.endswith("varlen"),
                                  cache="paged" if name.endswith("paged") else None), (9, 0),
                         threads=cfg.threads, config=cfg.describe(), causal=causal,
                         lse=has_lse, smem_bytes=cfg.smem_bytes)
            for name, cfg, causal, has_lse, window, cap in COMPILED
            if only is None or name in only]
