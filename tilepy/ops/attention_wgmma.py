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

By default each wgmma batch is waited for (S, wait, softmax, P·V, wait: the tensor cores idle
during the softmax). ``WgmmaAttentionConfig(..., overlap=True)`` pipelines inside each
warpgroup as FlashAttention-3 does: step j issues S(j+1) = Q·K(j+1)ᵀ and O += P(j)·V(j) as two
commit groups, waits with ``wgmma.wait_group 1`` (S retired), runs the masking and online
softmax of block j+1 while P·V is still in flight, then ``wait_group 0``, rescales O and
writes P(j+1). One S accumulator set suffices (S(j) is consumed into P(j) before S(j+1) is
issued); the extra live registers are P's (block_n / 4). The two-stage cp.async ring holds:
step j reads K(j+1) and V(j) and refills V(j+1) and K(j+2) into the slots step j-1 retired,
after the block barrier. From the sm_90a SASS: a bare ``wait_group 0`` after the softmax is
hoisted above it by ptxas's scheduler (no overlap left), so it is issued together with a store
of the row sums to a scratch word (:data:`wait_after_store`); ptxas leaves the P registers that
the in-flight rs-form wgmma reads alone by itself (else it would inject a wait and say so,
C7517 — the compile test refuses any C75xx note). :func:`softmax_overlap` checks the machine
code: the softmax's ex2 and shuffles sit between the two waits. It fits without spills for
(head_dim, block_n) in :data:`OVERLAP_FITS`. No ping-pong between warpgroups, no TMA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from ..inline import inline_device
from ..ptx import global_addr, shared_addr
from ..ptx import wgmma as W
from ..ptx.asm import SIMULATOR, pick
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
#: (head_dim, block_n) whose overlap kernel compiles for sm_90a without spills (offline ptxas).
OVERLAP_FITS = frozenset({(64, 64), (64, 128), (128, 64)})
OVERLAP_WHY = ("at head_dim 128 with 128-key blocks the S (64), O (64) and P (32) registers "
               "are live together: 254-255 registers, and the causal kernel spills 16 B "
               "(offline sm_90a compile, 2026-11-30)")
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)


@dataclass(frozen=True)
class WgmmaAttentionConfig:
    """``block_m`` query rows (64 or 128: one warpgroup per 64), ``block_n`` keys per step
    (64 or 128), ``head_dim`` (64 or 128), ``dtype``; ``overlap``: pipeline the softmax of
    key block j+1 with the P·V wgmmas of block j inside each warpgroup (FlashAttention-3's
    intra-warpgroup overlap; only where it compiles without spills, see :data:`OVERLAP_FITS`)."""

    head_dim: int
    block_m: int = 128
    block_n: int = 128
    dtype: str = "float16"
    overlap: bool = False

    def __post_init__(self):
        def need(ok, what):
            if not ok:
                raise ValueError(f"WgmmaAttentionConfig({self.head_dim}, {self.block_m}, "
                                 f"{self.block_n}, {self.dtype!r}, overlap={self.overlap!r}): "
                                 f"{what}")

        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}")
        need(self.head_dim in HEAD_DIMS, f"head_dim must be one of {HEAD_DIMS}")
        need(self.block_m in (64, 128), "block_m must be 64 or 128")
        need(self.block_n in (64, 128), "block_n must be 64 or 128")
        need(isinstance(self.overlap, bool), "overlap must be a bool")
        if self.overlap:
            need((self.head_dim, self.block_n) in OVERLAP_FITS,
                 f"overlap needs (head_dim, block_n) in {sorted(OVERLAP_FITS)}: "
                 f"{OVERLAP_WHY}")
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
        # Q, then two stages of K and V; overlap: a 16-byte scratch word (wait_after_store)
        return self.q_bytes + 4 * self.tile_bytes + (16 if self.overlap else 0)

    def describe(self) -> str:
        return (f"wgmma attention d{self.head_dim} {self.block_m}x{self.block_n}, "
                f"{self.block_m // 64} warpgroups, {self.smem_bytes // 1024} KB smem"
                + (", softmax overlapped with P·V" if self.overlap else ""))


@functools.cache
def _copy_rows(rows: int, d: int, threads: int):
    """``issue(tile, src, row_stride, rows_left, tid)``: one thread's cp.async copies of a
    (rows × d) tile into 64-column sub-tiles of ``rows × 128`` bytes, 128-byte swizzled;
    rows at or past ``rows_left`` are zero-filled."""
    chunks = d // 8                       # 16-byte chunks per row
    per_thread = rows * chunks // threads
    sub_bytes = rows * 128

    @inline_device
    def issue(tile, src, row_stride, rows_left, tid):
        for p in range(per_thread):
            q = tid + p * threads
            r = q // chunks
            c = q % chunks
            dst = (c // 8) * sub_bytes + r * 128 + (((c % 8) ^ (r % 8)) * 16)
            cp_async_cg_16(tile + dst, src + r * row_stride + c * 16,
                           16 if r < rows_left else 0)

    return issue


def _wait_after_store_twin(addr, x, y):
    W.wgmma_wait_group(0)


def _make_wait_after_store():
    from numba.core.extending import intrinsic

    from ..ptx.asm import call_asm
    from ..ptx.wgmma import require_sm90a

    @intrinsic
    def wait_after_store(typingctx, addr, x, y):
        def lower(context, builder, sig, args):
            require_sm90a("wait_after_store")
            ops = [context.cast(builder, args[0], sig.args[0], types.uint32)] + [
                context.cast(builder, v, t, types.float32) for v, t in zip(args[1:], sig.args[1:])]
            call_asm(builder, "st.shared.v2.f32 [$0], {$1, $2};\n"
                     "wgmma.wait_group.sync.aligned 0;", "r,f,f,~{memory}", (),
                     ("u32", "f32", "f32"), ops, side_effect=True, convergent=True)
            return context.get_dummy_value()

        return types.void(addr, x, y), lower

    return wait_after_store


#: ``wait_after_store(addr, x, y)``: ``st.shared.v2.f32 [addr], {x, y}`` then
#: ``wgmma.wait_group 0``. With a bare ``wgmma_wait_group(0)`` after the softmax, ptxas's
#: scheduler hoists the wait (an instruction with no operands) to the top of the softmax's
#: basic block, so the softmax runs after the P·V wgmmas instead of beside them (seen in the
#: sm_90a SASS). The store of two values that end the softmax (the row sums) to a scratch word
#: anchors it: the wait is not moved above the store, and the store not above its operands.
#: Every thread writes the same 8 bytes, which nobody reads.
wait_after_store = pick(None if SIMULATOR else _make_wait_after_store(), _wait_after_store_twin)


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
    SCRATCH = Q_BYTES + 2 * STAGE
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

    @inline_device
    def issue_s(s, q_rows, k_addr):
        """S = Q · Kᵀ: the k16 wgmmas (not committed)."""
        for kk in range(KD):
            da = W.matrix_descriptor(q_rows + (kk // 4) * (BM * 128) + (kk % 4) * 32,
                                     16, 1024, 128)
            db = W.matrix_descriptor(k_addr + (kk // 4) * (BN * 128) + (kk % 4) * 32,
                                     16, 1024, 128)
            mma_s(s, da, db, 0 if kk == 0 else 1)

    @inline_device
    def issue_o(acc_o, p, v_addr):
        """O += P · V, P from registers: the k16 wgmmas (not committed)."""
        for st in range(KN):
            dv = W.matrix_descriptor(v_addr + st * 2048, BN * 128, 1024, 128)
            mma_o(acc_o, p[4 * st], p[4 * st + 1], p[4 * st + 2], p[4 * st + 3], dv, 1)

    @inline_device
    def softmax(s, s3, limit, row_max, row_sum, alpha, kb, all_see, t, scale_log2):
        """Key block ``kb``'s scores (retired S accumulators) → p in ``s3``; alpha."""
        for j in range(NS):
            for e in range(4):
                s3[0, j, e] = s[4 * j + e]
        if (kb + 1) * BN - 1 > all_see:
            mask(s3, limit, kb * BN + 2 * t)
        update(s3, row_max, row_sum, alpha, scale_log2)

    @inline_device
    def rescale(acc_o, alpha):
        for i in range(NACC_O):
            acc_o[i] = acc_o[i] * alpha[0, (i // 2) % 2]

    @inline_device
    def to_p(p, s3):
        """p rounded to 16 bits: the A registers of the P·V wgmmas."""
        for st in range(KN):
            p[4 * st] = pack(s3[0, 2 * st, 0], s3[0, 2 * st, 1])
            p[4 * st + 1] = pack(s3[0, 2 * st, 2], s3[0, 2 * st, 3])
            p[4 * st + 2] = pack(s3[0, 2 * st + 1, 0], s3[0, 2 * st + 1, 1])
            p[4 * st + 3] = pack(s3[0, 2 * st + 1, 2], s3[0, 2 * st + 1, 3])

    @inline_device
    def main_loop(acc_o, s, s3, p, limit, row_max, row_sum, alpha, base, k0, ks, v0, vs,
                  q_rows, sk, n_kb, all_see, t, tid, scale_log2):
        """One wgmma batch at a time: S, wait, softmax, P·V, wait."""
        kv_base = base + Q_BYTES
        copy_kv(kv_base, k0, ks, sk, tid)
        copy_kv(kv_base + TILE, v0, vs, sk, tid)
        cp_async_commit_group()
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

            W.wgmma_fence()
            issue_s(s, q_rows, k_addr)
            W.wgmma_commit_group()
            W.wgmma_wait_group(0)
            W.wgmma_fence_operand(s, NACC_S)
            softmax(s, s3, limit, row_max, row_sum, alpha, kb, all_see, t, scale_log2)
            rescale(acc_o, alpha)
            to_p(p, s3)

            W.wgmma_fence()
            issue_o(acc_o, p, k_addr + TILE)
            W.wgmma_commit_group()
            W.wgmma_wait_group(0)
            W.wgmma_fence_operand(acc_o, NACC_O)

    @inline_device
    def overlap_loop(acc_o, s, s3, p, limit, row_max, row_sum, alpha, base, k0, ks, v0, vs,
                     q_rows, sk, n_kb, all_see, t, tid, scale_log2):
        """FlashAttention-3's intra-warpgroup pipeline: in step kb, S(kb+1) = Q·K(kb+1)ᵀ and
        O += P(kb)·V(kb) are issued as two groups; the softmax of kb+1 runs after
        wait_group(1) (S retired) while P·V is still in flight; O is rescaled after
        wait_group(0). Ring (two stages, stage = block % 2): step kb reads K(kb+1) and
        V(kb), and loads V(kb+1) and K(kb+2) into the slots that step kb-1 retired."""
        kv_base = base + Q_BYTES
        copy_kv(kv_base, k0, ks, sk, tid)                 # K(0)
        cp_async_commit_group()
        copy_kv(kv_base + TILE, v0, vs, sk, tid)          # V(0)
        cp_async_commit_group()
        cp_async_wait_group(1)
        W.fence_proxy_async_shared()
        cuda.syncthreads()
        if n_kb > 1:                                      # K(1)
            copy_kv(kv_base + STAGE, k0 + BN * ks, ks, sk - BN, tid)
        cp_async_commit_group()
        W.wgmma_fence()
        issue_s(s, q_rows, kv_base)
        W.wgmma_commit_group()
        W.wgmma_wait_group(0)
        W.wgmma_fence_operand(s, NACC_S)
        softmax(s, s3, limit, row_max, row_sum, alpha, 0, all_see, t, scale_log2)
        to_p(p, s3)                                       # O is 0: no rescale
        for kb in range(n_kb - 1):
            cp_async_wait_group(0)                        # V(kb), K(kb+1)
            W.fence_proxy_async_shared()
            cuda.syncthreads()
            left = sk - (kb + 1) * BN
            copy_kv(kv_base + ((kb + 1) % 2) * STAGE + TILE, v0 + (kb + 1) * BN * vs, vs,
                    left, tid)
            if kb + 2 < n_kb:
                copy_kv(kv_base + (kb % 2) * STAGE, k0 + (kb + 2) * BN * ks, ks,
                        left - BN, tid)
            cp_async_commit_group()

            W.wgmma_fence()
            issue_s(s, q_rows, kv_base + ((kb + 1) % 2) * STAGE)
            W.wgmma_commit_group()
            issue_o(acc_o, p, kv_base + (kb % 2) * STAGE + TILE)
            W.wgmma_commit_group()
            W.wgmma_wait_group(1)                         # S(kb+1) retired, P·V in flight
            W.wgmma_fence_operand(s, NACC_S)
            softmax(s, s3, limit, row_max, row_sum, alpha, kb + 1, all_see, t, scale_log2)
            wait_after_store(base + SCRATCH, row_sum[0, 0], row_sum[0, 1])
            W.wgmma_fence_operand(acc_o, NACC_O)
            rescale(acc_o, alpha)
            to_p(p, s3)
        cp_async_wait_group(0)                            # V(n_kb - 1)
        W.fence_proxy_async_shared()
        cuda.syncthreads()
        W.wgmma_fence()
        issue_o(acc_o, p, kv_base + ((n_kb - 1) % 2) * STAGE + TILE)
        W.wgmma_commit_group()
        W.wgmma_wait_group(0)
        W.wgmma_fence_operand(acc_o, NACC_O)

    loop = overlap_loop if cfg.overlap else main_loop

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
            qs = i64(q.strides[2])
            q0 = i64(global_addr(q, (b, h, row0, 0)))
            k0 = i64(global_addr(k, (b, hk, 0, 0)))
            v0 = i64(global_addr(v, (b, hk, 0, 0)))
            copy_q(base, q0, qs, sq - row0, tid)
            cp_async_commit_group()
            q_rows = base + wg * (64 * 128)   # this warpgroup's 64 rows of each sub-tile
            loop(acc_o, s, s3, p, limit, row_max, row_sum, alpha, base, k0, i64(k.strides[2]),
                 v0, i64(v.strides[2]), q_rows, sk, n_kb, all_see, t, tid, scale_log2)

        for j in range(NO):
            for e in range(4):
                o3[0, j, e] = acc_o[4 * j + e]
        finalize(o3, row_sum)
        store(o3, row_max, row_sum, o[b, h], lse, b, h, row0 + wrow, sq, scale, g, t)

    return kernel


def softmax_overlap(cubin_path: str) -> dict:
    """What the sm_90a machine code of a kernel does between the partial wgmma wait and the
    full one (``nvdisasm`` from the nvidia-cuda-nvcc wheel): per ``WARPGROUP.DEPBAR.LE gsb0,
    0x1``, the ex2 (MUFU.EX2) and shuffle instructions before the next ``… 0x0``. The overlap
    kernel's softmax should be there (ex2 >= block_n / 2); empty if nvdisasm is missing."""
    import os
    import subprocess

    from ..offline import find_ptxas

    exe = os.path.join(os.path.dirname(find_ptxas() or ""), "nvdisasm")
    if not os.path.isfile(exe):
        return {}
    sass = subprocess.run([exe, "-c", cubin_path], capture_output=True, text=True,
                          check=True).stdout
    ex2, shfl, inside = [], [], False
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            inside = True
            ex2.append(0)
            shfl.append(0)
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            inside = False
        elif inside and "MUFU.EX2" in line:
            ex2[-1] += 1
        elif inside and "SHFL." in line:
            shfl[-1] += 1
    return {"ex2_in_flight": ex2, "shfl_in_flight": shfl}


def _overlap_entry(name, cfg, causal, has_lse):
    """:func:`tilepy.offline.report_entry`'s fields for an overlap kernel, plus the ptxas notes
    on wgmma (C75xx: serialised wgmmas, injected waits) and :func:`softmax_overlap`."""
    import os
    import re
    import subprocess
    import tempfile
    import time

    from ..offline import compile_kernel, find_ptxas, parse_ptxas
    from .attention_kernel import argtypes

    entry = {"name": name, "threads": cfg.threads, "config": cfg.describe(),
             "smem_bytes": cfg.smem_bytes}
    t0 = time.perf_counter()
    try:
        rep = compile_kernel(name, wgmma_attention_kernel(cfg, causal, has_lse).py_func,
                             argtypes(), (9, 0, "a"), assemble=False, launch_bounds=cfg.threads)
        with tempfile.TemporaryDirectory() as tmp:
            src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            with open(src, "w") as f:
                f.write(rep.ptx)
            proc = subprocess.run([find_ptxas(), "-arch=sm_90a", "-v", src, "-o", cubin],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"ptxas failed:\n{proc.stderr}")
            parse_ptxas(proc.stderr + proc.stdout, rep)
            entry.update(softmax_overlap(cubin))
    except Exception as e:  # noqa: BLE001  (reported per kernel; the tests fail on it)
        entry["error"] = f"{type(e).__name__}: {e}"
        return entry
    fields = ("registers", "spill_stores", "spill_loads", "stack_frame", "local_bytes", "counts")
    entry.update({f: getattr(rep, f) for f in fields})
    entry["ex2"] = len(re.findall(r"^\s*ex2\.approx", rep.ptx, re.MULTILINE))
    entry["ptxas_wgmma_notes"] = re.findall(r"\(C75\d\d\)[^\n]*", proc.stderr)
    entry["compile_seconds"] = time.perf_counter() - t0
    return entry


#: The overlap kernels of :func:`compile_reports`: (head_dim, block_n, dtype, causal with LSE).
OVERLAP_REPORTS = ((64, 64, "float16", False), (64, 128, "float16", True),
                   (128, 64, "float16", False), (128, 64, "bfloat16", True))


def compile_reports():
    """Offline sm_90a reports of the d64 and d128 kernels (causal with LSE, and not), and of
    the overlap kernels (:data:`OVERLAP_REPORTS`, with :func:`softmax_overlap`)."""
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
    for d, bn, dtype, causal in OVERLAP_REPORTS:
        cfg = WgmmaAttentionConfig(d, 128, bn, dtype, overlap=True)
        name = (f"attention_wgmma_overlap_d{d}_{cfg.block_m}x{bn}_{dtype}"
                f"{'_causal_lse' if causal else ''}")
        out.append(_overlap_entry(name, cfg, causal, causal))
    return out
