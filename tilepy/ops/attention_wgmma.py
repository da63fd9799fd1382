"""A FlashAttention forward kernel on Hopper's warpgroup MMA (``wgmma``, sm_90a).

Same contract as :func:`tilepy.ops.attention_kernel.attention_kernel` —
``kernel(q, k, v, o, lse, scale, scale_log2)`` on (B, H, S, D) uint16 views, GQA by head
index, bottom-right causal alignment, keys past ``Sk`` masked, rows that see no key → 0 and
LSE -inf — so the op wrapper can run either by the type of its config.

One block: ``block_m / 64`` warpgroups, each owning 64 query rows. Per key block of
``block_n`` keys:

1. K and V tiles (block_n × D) arrive by 16-byte cp.async in a two-stage ring, in the
   128-byte-swizzled layout wgmma reads: 64-column sub-tiles of ``rows × 128`` bytes (so the
   same bytes are a K-major operand for K and an MN-major one for V).
2. S = Q·Kᵀ: ``D / 16`` wgmmas m64n{block_n}k16, Q (A, K-major) and K (B, K-major) from
   shared memory; the first with scale-d 0, so S needs no zeroing.
3. Masking and the online softmax run on the S accumulators, whose per-warp layout is the
   mma.sync C layout of a 16 × block_n strip (:mod:`tilepy.ptx.wgmma_layout`), with the same
   generators as the mma.sync kernel (:mod:`tilepy.tile.online_softmax`).
4. P is rounded to 16 bits in registers and is directly the A operand of the register form
   of wgmma (the S accumulators of keys 16s … 16s+15 are the four A registers of k16 step
   s), so O += P·V is ``block_n / 16`` wgmmas m64n{D}k16 with V (B, MN-major) from shared
   memory — P never goes through shared memory (the FlashAttention-3 arrangement).

This first version waits for each wgmma batch (no ping-pong between warpgroups, no overlap of
the softmax with the next block's MMAs, no TMA); it is opt-in through
:class:`WgmmaAttentionConfig` until measured on the GPU (``bench/NOTES.md``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from ..ptx import global_addr, shared_addr
from ..ptx import wgmma as W
from ..ptx.asm import SIMULATOR
from ..ptx.cp_async import cp_async_cg_16, cp_async_commit_group, cp_async_wait_group
from ..ptx.math import cvt_bf16x2_f32, cvt_f16x2_f32
from ..tile.config import SMEM_LIMIT
from ..tile.online_softmax import online_softmax_finalize, online_softmax_update
from ..tune.kcache import cached_jit
from .attention_kernel import (
    DTYPES,
    key_blocks,
    mask_scores,
    row_limits,
    store_rows,
)

WARPGROUP = 128
HEAD_DIMS = (64, 128)   # 64-column sub-tiles of the 128-byte swizzle; N of the P·V wgmma
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)


@dataclass(frozen=True)
class WgmmaAttentionConfig:
    """``block_m`` query rows (64 or 128: one warpgroup per 64), ``block_n`` keys per step
    (64 or 128), ``head_dim`` (64 or 128), ``dtype``."""

    head_dim: int
    block_m: int = 128
    block_n: int = 128
    dtype: str = "float16"

    def __post_init__(self):
        def need(ok, what):
            if not ok:
                raise ValueError(f"WgmmaAttentionConfig({self.head_dim}, {self.block_m}, "
                                 f"{self.block_n}, {self.dtype!r}): {what}")

        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}")
        need(self.head_dim in HEAD_DIMS, f"head_dim must be one of {HEAD_DIMS}")
        need(self.block_m in (64, 128), "block_m must be 64 or 128")
        need(self.block_n in (64, 128), "block_n must be 64 or 128")
        limit = SMEM_LIMIT[(9, 0)]
        need(self.smem_bytes <= limit, f"{self.smem_bytes} B of shared memory exceeds the "
             f"{limit} B of sm_90")

    @property
    def threads(self) -> int:
        return WARPGROUP * (self.block_m // 64)

    @property
    def q_bytes(self) -> int:
        return self.block_m * self.head_dim * 2

    @property
    def tile_bytes(self) -> int:
        return self.block_n * self.head_dim * 2

    @property
    def smem_bytes(self) -> int:
        return self.q_bytes + 4 * self.tile_bytes   # Q, then two stages of K and V

    def describe(self) -> str:
        return (f"wgmma attention d{self.head_dim} {self.block_m}x{self.block_n}, "
                f"{self.block_m // 64} warpgroups, {self.smem_bytes // 1024} KB smem")


@functools.cache
def _copy_rows(rows: int, d: int, threads: int):
    """``issue(tile, src, row_stride, rows_left, tid)``: one thread's cp.async copies of a
    (rows × d) tile into 64-column sub-tiles of ``rows × 128`` bytes, 128-byte swizzled;
    rows at or past ``rows_left`` are zero-filled."""
    chunks = d // 8                       # 16-byte chunks per row
    per_thread = rows * chunks // threads
    sub_bytes = rows * 128

    @cuda.jit(device=True, inline="always")
    def issue(tile, src, row_stride, rows_left, tid):
        for p in range(per_thread):
            q = tid + p * threads
            r = q // chunks
            c = q % chunks
            dst = (c // 8) * sub_bytes + r * 128 + (((c % 8) ^ (r % 8)) * 16)
            cp_async_cg_16(tile + dst, src + r * row_stride + c * 16,
                           16 if r < rows_left else 0)

    return issue


@functools.cache
def wgmma_attention_kernel(cfg: WgmmaAttentionConfig, causal: bool = False,
                           has_lse: bool = False):
    BM, BN, D = cfg.block_m, cfg.block_n, cfg.head_dim
    THREADS = cfg.threads
    KD = D // 16          # k16 steps of Q·Kᵀ
    KN = BN // 16         # k16 steps of P·V
    NS = BN // 8          # n8 tiles of S per warp
    NO = D // 8           # n8 tiles of O per warp
    NACC_S, NACC_O = BN // 2, D // 2
    P_REGS = 4 * KN       # P as the A registers of the P·V wgmmas
    Q_BYTES, TILE = cfg.q_bytes, cfg.tile_bytes
    STAGE = 2 * TILE
    ab = "f16" if cfg.dtype == "float16" else "bf16"
    mma_s = W.wgmma(BN, ab)                                  # S = Q Kᵀ (B K-major)
    mma_o = W.wgmma(D, ab, a_in_registers=True, trans_b=True)  # O += P V (B MN-major)
    pack = cvt_f16x2_f32 if cfg.dtype == "float16" else cvt_bf16x2_f32
    copy_q = _copy_rows(BM, D, THREADS)
    copy_kv = _copy_rows(BN, D, THREADS)
    update = online_softmax_update(1, NS)
    finalize = online_softmax_finalize(1, NO)
    bounds = key_blocks(BM, BN, causal)
    init_rows = row_limits(1, causal)
    mask = mask_scores(1, NS)
    store = store_rows(1, NO, cfg.dtype, has_lse)
    align = None if SIMULATOR else 1024
    f32, i64 = types.float32, types.int64

    @cached_jit
    def kernel(q, k, v, o, lse, scale, scale_log2):
        sq = q.shape[2]
        sk = k.shape[2]
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        hk = h // (q.shape[1] // k.shape[1])
        tid = cuda.threadIdx.x
        wg = tid // WARPGROUP
        lane = tid % 32
        warp = (tid % WARPGROUP) // 32
        g = lane // 4
        t = lane % 4
        row0, n_kb, all_see = bounds(sq, sk)
        wrow = wg * 64 + warp * 16      # this warp's first row in the block

        acc_o = cuda.local.array(NACC_O, f32)
        s = cuda.local.array(NACC_S, f32)
        s3 = cuda.local.array((1, NS, 4), f32)
        o3 = cuda.local.array((1, NO, 4), f32)
        p = cuda.local.array(P_REGS, types.uint32)
        row_max = cuda.local.array((1, 2), f32)
        row_sum = cuda.local.array((1, 2), f32)
        alpha = cuda.local.array((1, 2), f32)
        limit = cuda.local.array((1, 2), i64)
        init_rows(limit, row_max, row_sum, row0 + wrow, g, sq, sk)
        for i in range(NACC_O):
            acc_o[i] = _ZERO

        if n_kb > 0:
            smem = cuda.shared.array(0, types.uint16, alignment=align) if align else \
                cuda.shared.array(0, types.uint16)
            base = shared_addr(smem, 0)
            kv_base = base + Q_BYTES
            qs = i64(q.strides[2])
            ks = i64(k.strides[2])
            vs = i64(v.strides[2])
            q0 = i64(global_addr(q, (b, h, row0, 0)))
            k0 = i64(global_addr(k, (b, hk, 0, 0)))
            v0 = i64(global_addr(v, (b, hk, 0, 0)))
            copy_q(base, q0, qs, sq - row0, tid)
            cp_async_commit_group()
            copy_kv(kv_base, k0, ks, sk, tid)
            copy_kv(kv_base + TILE, v0, vs, sk, tid)
            cp_async_commit_group()
            q_rows = base + wg * (64 * 128)   # this warpgroup's 64 rows of each sub-tile

            for kb in range(n_kb):
                cp_async_wait_group(0)
                W.fence_proxy_async_shared()
                cuda.syncthreads()
                if kb + 1 < n_kb:
                    nxt = kv_base + ((kb + 1) % 2) * STAGE
                    left = sk - (kb + 1) * BN
                    copy_kv(nxt, k0 + (kb + 1) * BN * ks, ks, left, tid)
                    copy_kv(nxt + TILE, v0 + (kb + 1) * BN * vs, vs, left, tid)
                cp_async_commit_group()
                k_addr = kv_base + (kb % 2) * STAGE
                v_addr = k_addr + TILE

                # S = Q · Kᵀ
                W.wgmma_fence()
                for kk in range(KD):
                    da = W.matrix_descriptor(q_rows + (kk // 4) * (BM * 128) + (kk % 4) * 32,
                                             16, 1024, 128)
                    db = W.matrix_descriptor(k_addr + (kk // 4) * (BN * 128) + (kk % 4) * 32,
                                             16, 1024, 128)
                    mma_s(s, da, db, 0 if kk == 0 else 1)
                W.wgmma_commit_group()
                W.wgmma_wait_group(0)
                W.wgmma_fence_operand(s, NACC_S)
                for j in range(NS):
                    for e in range(4):
                        s3[0, j, e] = s[4 * j + e]

                if (kb + 1) * BN - 1 > all_see:
                    mask(s3, limit, kb * BN + 2 * t)

                update(s3, row_max, row_sum, alpha, scale_log2)
                for i in range(NACC_O):
                    acc_o[i] = acc_o[i] * alpha[0, (i // 2) % 2]
                for st in range(KN):
                    p[4 * st] = pack(s3[0, 2 * st, 0], s3[0, 2 * st, 1])
                    p[4 * st + 1] = pack(s3[0, 2 * st, 2], s3[0, 2 * st, 3])
                    p[4 * st + 2] = pack(s3[0, 2 * st + 1, 0], s3[0, 2 * st + 1, 1])
                    p[4 * st + 3] = pack(s3[0, 2 * st + 1, 2], s3[0, 2 * st + 1, 3])

                # O += P · V, P from registers
                W.wgmma_fence()
                for st in range(KN):
                    dv = W.matrix_descriptor(v_addr + st * 2048, BN * 128, 1024, 128)
                    mma_o(acc_o, p[4 * st], p[4 * st + 1], p[4 * st + 2], p[4 * st + 3], dv, 1)
                W.wgmma_commit_group()
                W.wgmma_wait_group(0)
                W.wgmma_fence_operand(acc_o, NACC_O)

        for j in range(NO):
            for e in range(4):
                o3[0, j, e] = acc_o[4 * j + e]
        finalize(o3, row_sum)
        store(o3, row_max, row_sum, o[b, h], lse, b, h, row0 + wrow, sq, scale, g, t)

    return kernel


def compile_reports():
    """Offline sm_90a reports of the d64 and d128 kernels (causal with LSE, and not)."""
    from ..offline import report_entry
    from .attention_kernel import argtypes

    out = []
    for d, causal in ((64, False), (128, False), (128, True)):
        cfg = WgmmaAttentionConfig(d)
        out.append(report_entry(f"attention_wgmma_d{d}{'_causal_lse' if causal else ''}",
                                lambda cfg=cfg, causal=causal:
                                wgmma_attention_kernel(cfg, causal, causal),
                                argtypes(), (9, 0, "a"), threads=cfg.threads,
                                config=cfg.describe(), smem_bytes=cfg.smem_bytes))
    return out
