"""A FlashAttention forward kernel on Hopper's warpgroup MMA (``wgmma``, sm_90a).

Same contract as :func:`tilepy.ops.attention_mma_sync.attention_kernel` —
``kernel(q, k, v, o, lse, scale, scale_log2, hargs)`` on (B, H, S, D) uint16 views, GQA by head
index, bottom-right causal alignment, keys past ``Sk`` masked, rows that see no key → 0 and
LSE -inf — so the op wrapper can run either by the type of its config.

One block: ``block_m / 64`` warpgroups, each owning 64 query rows (plus, with ``producer``, a
warpgroup that only loads). Per key block of
``block_n`` keys:

1. K and V tiles (block_n × D) arrive by 16-byte cp.async in a two-stage ring, in the
   128-byte-swizzled layout wgmma reads: 64-column sub-tiles of ``rows × 128`` bytes (so the
   same bytes are a K-major operand for K and an MN-major one for V).
2. S = Q·Kᵀ: ``D / 16`` wgmmas m64n{block_n}k16, Q (A, K-major) and K (B, K-major) from
   shared memory; the first with scale-d 0, so S needs no zeroing.
3. Masking and the online softmax run on the S accumulators, whose per-warp layout is the
   mma.sync C layout of a 16 × block_n strip (:mod:`tilepy.ptx.wgmma_layout`; viewed as a
   fragment by :func:`tilepy.tile.online_softmax.accumulator_fragment`), with the same
   generators as the mma.sync kernel (:mod:`tilepy.tile.attention`,
   :mod:`tilepy.tile.online_softmax`).
4. P is rounded to 16 bits in registers and is directly the A operand of the register form
   of wgmma (the S accumulators of keys 16s … 16s+15 are the four A registers of k16 step
   s), so O += P·V is ``block_n / 16`` wgmmas m64n{Dv}k16 with V (B, MN-major) from shared
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
of the row sums to a scratch word (:data:`tilepy.ptx.wgmma.wgmma_wait_after_store`); ptxas
leaves the P registers that the in-flight rs-form wgmma reads alone by itself (else it would
inject a wait and say so, C7517 — the compile test refuses any C75xx note).
:func:`softmax_overlap` checks the machine code: the softmax's ex2 and shuffles sit between
the two waits. It fits without spills for (head_dim, block_n) in :data:`OVERLAP_FITS`.

The epilogue stages each warpgroup's O rows in the stage of the last key block and writes
them with 16-byte stores (:func:`tilepy.tile.epilogue.store_accumulators_smem`).
``persistent=True`` launches one block per SM slot that walks the tiles
(:func:`tilepy.tile.schedule.heavy_first`),
loading the next tile's Q (into a second Q buffer) and first K/V block during the current
tile's last key block, with loops of its own (the grid kernel keeps its own loops: through
the persistent ones it was slower, bench/NOTES.md: persistent attention).

``tma=True`` (with ``overlap``; the Hopper default of :mod:`tilepy.ops.attention`): thread 0
loads Q, K and V with TMA (4-D tensor maps over (batch, head, seq, head_dim), 64-column boxes,
128-byte swizzle: the same slots) and the warpgroups synchronise through mbarriers — per slot
a full barrier (the copy's bytes) and an empty one (every thread arrives once its wgmmas have
read the slot) — instead of a block barrier per key block, so the two warpgroups drift and
one's softmax runs beside the other's wgmmas. ``producer=True`` moves the loads to a
warpgroup of their own (setmaxnreg gives its registers to the consumers); ``pingpong=True``
makes the consumer warpgroups take turns issuing their wgmmas (named barriers), so one's
softmax runs while the others' wgmmas do (FlashAttention-3's inter-warpgroup schedule). With
``producer``, ``block_m=192`` (head_dim 64) runs three consumer warpgroups
(FlashAttention-3's head_dim-64 tile), with or without ping-pong. ``tma=True,
producer=True, persistent=True`` is the persistent TMA kernel (the Hopper default at head_dim
64 and causal at 128): one block per SM slot; each block's first tile is its index, the next
ones tickets the producer draws from a global counter (an int32[2] argument after the tensor
maps, one per stream in :class:`ScheduledTmaPlan`, zeroed again by the last block out), so
causal tiles of unequal work balance as with the hardware's block scheduler. The producer
passes each tile's number to the consumers with its Q (two Q buffers), runs ahead through the
K/V ring counted on across tiles, so a tile's first loads are in flight under the previous
tile, and the consumers keep a tile's last K/V stage until its O is staged there and
stored.

Causal with several consumer warpgroups: each warpgroup computes only up to its own last key
block (and masks only its own diagonal block), then releases the later blocks' slots as they
land. A sliding window and a score modification (``window=``, ``score_mod=`` of
:func:`wgmma_attention_kernel`, TMA kernels only) are generator parameters: a tile runs its key
blocks from the first one any of its rows sees (the producer loads only those), an upper
bound behaves as causal does above, and the score hook runs on each key block's retired S
before the mask. Lazy rescaling (:data:`RESCALE_THRESHOLD`): O is rescaled only when a row's
max grows by more than 2**8 in p.

8-bit inputs (``WgmmaAttentionConfig(dtype="float8_e4m3fn")``, the grid TMA kernel with a
producer warpgroup): Q and K e4m3 in 128-column sub-tiles (the same 128-byte rows), S by k32
wgmmas; V arrives transposed (Vᵀ: head_dim_v rows × keys, :mod:`tilepy.ops.attention_fp8`
makes it) with each 16 keys in :data:`FP8_KEY_ORDER`, so that P — times
:data:`FP8_P_SCALE` (in the softmax's exponent), rounded to e4m3 four to a register — is the
A operand of the k32 P·V wgmmas (B = Vᵀ, K-major) without shuffles. ``hargs`` is then
``(descales, hook arguments)``, the descales three float32 (batch, heads_kv) views (q, k, v);
the producer writes the tile's descale_q · descale_k and descale_v into shared memory before
its Q load and the consumers fold them into the softmax's scale per key block and into O at
the end. O is bfloat16.

How the generators compose (each one short enough to read alone): :func:`_common_parts` makes
the pieces every kernel shares (sizes, the S and O wgmmas, the softmax with mask and score
hook, P's packing, the epilogue, the persistent tile space); the cp.async kernels add
:func:`_cp_async_loops` and are :func:`_cp_async_grid_kernel` /
:func:`_cp_async_persistent_kernel`; the TMA kernels add :func:`_tma_parts` (the mbarrier
ring, the producer, the turns, the consumer loop) and are :func:`_tma_grid_kernel` /
:func:`_tma_persistent_kernel`. A generator takes the namespaces of those before it and names
what it uses from them at its top.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from numba import cuda, types

from ..inline import inline_device, written_out
from ..launch import pointer
from ..ptx import barrier as BAR
from ..ptx import global_addr, shared_addr
from ..ptx import mbarrier as MB
from ..ptx import tma as T
from ..ptx import vector as VEC
from ..ptx import wgmma as W
from ..ptx.asm import SIMULATOR
from ..ptx.cp_async import cp_async_commit_group, cp_async_wait_group
from ..ptx.math import cvt_bf16x2_f32, cvt_e4m3x2_f32, cvt_f16x2_f32
from ..ptx.shuffle import shfl_idx
from ..ptx.tma import MAP_BYTES
from ..tile import device_write
from ..tile.attention import (
    block_bounds,
    block_coords,
    block_mask_row,
    check_mask_block,
    key_block_at,
    key_block_partial,
    key_blocks,
    key_window,
    limits_shape,
    mask_key_block,
    modify_scores,
    row_limits,
    store_rows,
)
from ..tile.config import DTYPES, SMEM_LIMIT
from ..tile.copy import copy_rows_to_shared_128b
from ..tile.schedule import heavy_first, udiv
from ..tile.tma_plan import COUNTER_BYTES, ScheduledTmaPlan, TmaLaunchPlan
from ..tile.epilogue import staged_bytes, store_accumulators_smem
from ..tile.online_softmax import (
    accumulator_fragment,
    online_softmax_finalize,
    online_softmax_update,
)
from ..tile.tma import MAP_ALIGN
from ..tile.transpose import KEY_ORDER
from ..kcache import cached_jit

WARPGROUP = 128
HEAD_DIMS = (64, 128)   # 64-column sub-tiles of the 128-byte swizzle; N of the P·V wgmma
#: Head dims of the TMA kernels (``tma=True``): every multiple of 8 up to 256. The shared
#: tiles are :attr:`WgmmaAttentionConfig.tile_dim` wide (64-column sub-tiles); TMA fills the
#: columns past head_dim with zeros (its out-of-bounds fill), Q·Kᵀ runs ceil(head_dim / 16)
#: k16 steps and P·V is m64n{head_dim}: no padded copy of the inputs, no padded output.
TMA_HEAD_DIMS = tuple(range(8, 257, 8))


def tile_width(head_dim: int, cols: int = 64) -> int:
    """A TMA kernel's shared tile row length for ``head_dim``: whole sub-tiles of ``cols``
    columns (128 bytes: 64 16-bit or 128 8-bit elements)."""
    return -(-head_dim // cols) * cols


#: The 8-bit input dtype of the FP8 TMA kernels (bfloat16 out).
FP8_DTYPES = ("float8_e4m3fn",)
#: Block-sparse TMA kernels: the bit of a ring slot's step word (its K tile's key block, written
#: by the producer into shared memory with the load) that marks a full block of the mask.
FULL_STEP = np.uint32(1 << 31)

#: Lazy rescaling of the FP8 kernels (log2 units): P is scaled by :data:`FP8_P_SCALE` before
#: its e4m3 rounding, so that small probabilities keep e4m3's normal range (its smallest
#: normal is 2**-6); p stays below 2**0.5 with this threshold, 256 · 2**0.5 = 362 below
#: e4m3's largest finite 448. The scale is folded into the softmax's exponent
#: (``online_softmax_update(p_scale_log2=8)``), so the row sums carry it too: O needs no
#: compensation, the LSE divides it out.
FP8_RESCALE_THRESHOLD = 0.5
FP8_P_SCALE_LOG2 = 8
FP8_P_SCALE = np.float32(2.0 ** FP8_P_SCALE_LOG2)
#: Vᵀ's key order inside each 16 keys for the FP8 kernels: position ``j`` holds key
#: ``FP8_KEY_ORDER[j]``. The S accumulators give a thread keys (2t, 2t + 1, 8 + 2t, 9 + 2t) of
#: each 16 (t = lane % 4) and an 8-bit A register is four consecutive k (4t … 4t + 3): with
#: Vᵀ's keys in this order, those four accumulators, rounded, are the register as they are.
FP8_KEY_ORDER = KEY_ORDER    # (tilepy.tile.transpose's, which makes Vᵀ)


#: block_n of the TMA kernels (the cp.async kernels: 64 or 128): multiples of 16 (the P·V
#: k16 steps) from 64 to 128, so that a head dim past 128 finds a key block whose two K/V
#: stages fit beside Q.
TMA_BLOCK_NS = (64, 80, 96, 112, 128)
#: (tile_dim, block_n) whose overlap kernel compiles for sm_90a without spills (offline ptxas).
#: Up to 128 every block_n fits (the registers grow with block_n; 128 fits); past 128, the
#: key blocks whose stages fit in shared memory.
OVERLAP_FITS = frozenset({(d, n) for d in (64, 128) for n in TMA_BLOCK_NS}
                         | {(192, 64), (192, 80), (192, 96), (192, 112), (256, 64), (256, 80)})
OVERLAP_WHY = ("at head_dim 128 with 128-key blocks the S (64), O (64) and P (32) registers "
               "are live together; it fits (216-218 registers) since the copies address one "
               "column per thread (offline sm_90a compile)")
#: (head_dim, block_n) whose persistent overlap kernel compiles without spills: at head_dim 128
#: with 64-key blocks the tile loop's extra live values push it past 255 registers (spills 20 B;
#: 128 x 128 fits in 225-238 since O is staged through shared memory; offline sm_90a
#: compile).
PERSISTENT_OVERLAP_FITS = frozenset({(64, 64), (64, 128), (128, 128)})
#: mbarriers of the TMA kernel: Q's, then per stage K full, V full, K empty, V empty (2 stages).
TMA_BARRIERS = 9
#: setmaxnreg (producer, each consumer) of the TMA kernel with a producer warpgroup, by block
#: threads: 384 (two consumers) launch with 168 registers each, 128 × 56 + 256 × 224 = 64,512;
#: 512 (three) with 128, 128 × 32 + 384 × 160 = 65,536. The producer spills below 56 at 384
#: threads (one thread issues the loads; offline sm_90a compile).
REGISTER_SPLIT = {384: (56, 224), 512: (32, 160)}
#: Named barriers (1 … 3 are store_accumulators_smem's, one per warpgroup): the ping-pong
#: turn of consumer warpgroup i is BAR_TURN + i; BAR_CONSUMERS syncs the consumers alone
#: where a producer warpgroup does not take part (the epilogue)
BAR_TURN, BAR_CONSUMERS = 4, 7
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


@dataclass(frozen=True)
class WgmmaAttentionConfig:
    """``block_m`` query rows (64, 128, or with ``producer`` 192: one warpgroup per 64),
    ``block_n`` keys per step (64 or 128; the TMA kernels :data:`TMA_BLOCK_NS`),
    ``head_dim`` (64 or 128; the TMA kernels every multiple of 8 up to 256, in shared tiles
    :attr:`tile_dim` wide), ``dtype``; ``head_dim_v`` (TMA kernels): V's and O's head dim
    when it differs from Q's and K's (None: the same; V's tiles :attr:`tile_dim_v` wide);
    ``overlap``: pipeline the softmax of
    key block j+1 with the P·V wgmmas of block j inside each warpgroup (FlashAttention-3's
    intra-warpgroup overlap; only where it compiles without spills, see :data:`OVERLAP_FITS`).
    ``fma_exp_every`` (0: off; 2 … block_n / 8): every ``k``-th 8-key tile's exponentials
    computed on the FMA pipe (:func:`tilepy.tile.online_softmax.exp2_fma`, relative error
    8e-5) instead of the MUFU's ``ex2``, which the 8-bit kernels' softmax keeps busy (measured
    slower than 0 in the FP8 kernel: the FMA pipe is not idle there either).

    ``dtype="float8_e4m3fn"`` (:data:`FP8_DTYPES`): the FP8 kernel (``tma=True`` with
    ``producer=True``, 64- or 128-key blocks, head dims multiples of 16): Q and K as e4m3 (128-column sub-tiles, k32 wgmmas),
    V given transposed — Vᵀ (batch, heads, head_dim_v, keys rounded up to 16), each 16 keys
    in the order of :data:`FP8_KEY_ORDER` — so that P, rounded to e4m3 in registers, is the
    A operand of the P·V wgmmas as it stands; the descales arrive in ``hargs`` (see
    :func:`wgmma_attention_kernel`); O and the LSE as bfloat16 / float32."""

    head_dim: int
    block_m: int = 128
    block_n: int = 128
    dtype: str = "float16"
    overlap: bool = False
    persistent: bool = False
    tma: bool = False
    pingpong: bool = False
    producer: bool = False
    head_dim_v: int | None = None
    fma_exp_every: int = 0

    def __post_init__(self):
        def need(ok, what):
            if not ok:
                raise ValueError(f"WgmmaAttentionConfig({self.head_dim}, {self.block_m}, "
                                 f"{self.block_n}, {self.dtype!r}, overlap={self.overlap!r}, "
                                 f"persistent={self.persistent!r}, tma={self.tma!r}, "
                                 f"pingpong={self.pingpong!r}, producer={self.producer!r}"
                                 + (f", head_dim_v={self.head_dim_v!r}"
                                    if self.head_dim_v is not None else "") + f"): {what}")

        need(self.dtype in DTYPES + FP8_DTYPES, f"dtype must be one of {DTYPES + FP8_DTYPES}")
        if self.fp8:
            need(self.tma and self.producer, "an 8-bit dtype needs tma=True and producer=True "
                 "(the TMA kernels with a producer warpgroup)")
            need(self.block_n in (64, 128), "an 8-bit dtype needs block_n 64 or 128 (Vᵀ's tile "
                 "rows are block_n bytes, a 64- or 128-byte swizzle's row)")
            need(not self.persistent, "an 8-bit dtype runs the grid TMA kernel (the persistent "
                 "one's producer spills with the descales; not built)")
            need(self.head_dim % 16 == 0 and self.dv % 16 == 0,
                 "an 8-bit dtype needs head dims that are multiples of 16 (rows of whole "
                 "16-byte units for TMA)")
        if self.head_dim_v is not None:
            need(self.tma, "head_dim_v needs tma=True (the TMA kernels)")
            need(self.head_dim_v in TMA_HEAD_DIMS, "head_dim_v must be a multiple of 8 from 8 "
                 "to 256")
        if self.tma:
            need(self.head_dim in TMA_HEAD_DIMS, "head_dim must be a multiple of 8 from 8 to "
                 "256 (TMA kernels)")
        else:
            need(self.head_dim in HEAD_DIMS, f"head_dim must be one of {HEAD_DIMS} (the "
                 f"cp.async kernels; tma=True takes every multiple of 8 up to 256)")
        need(self.block_m in (64, 128, 192), "block_m must be 64, 128 or 192")
        need(self.block_m >= 128 or not self.producer,
             "producer needs block_m of 128 or 192 (two or three consumer warpgroups)")
        need(self.block_m != 192 or self.fit_dim == 64,
             "block_m=192 needs tile_dim 64, head_dim (and head_dim_v) up to 64 (at 512 "
             "threads a consumer gets 160 registers; head_dim 128 needs about 220)")
        need(self.block_m != 192 or self.producer,
             "block_m=192 needs producer=True (three consumer warpgroups and a producer: "
             "setmaxnreg shares the registers)")
        if self.tma:
            need(self.block_n in TMA_BLOCK_NS, f"block_n must be one of {TMA_BLOCK_NS}")
        else:
            need(self.block_n in (64, 128), "block_n must be 64 or 128 (cp.async kernels)")
        need(isinstance(self.overlap, bool), "overlap must be a bool")
        need(isinstance(self.persistent, bool), "persistent must be a bool")
        need(isinstance(self.tma, bool), "tma must be a bool")
        need(isinstance(self.pingpong, bool), "pingpong must be a bool")
        need(isinstance(self.producer, bool), "producer must be a bool")
        need(isinstance(self.fma_exp_every, (int, np.integer))
             and not isinstance(self.fma_exp_every, bool)
             and (self.fma_exp_every == 0 or 2 <= self.fma_exp_every <= self.block_n // 8),
             f"fma_exp_every must be 0 or an int in 2 … {self.block_n // 8} (block_n / 8)")
        need(self.tma or not (self.pingpong or self.producer),
             "pingpong and producer need tma=True (they schedule the TMA-fed kernel)")
        need(self.block_m >= 128 or not self.pingpong,
             "pingpong needs block_m of 128 or 192 (it alternates consumer warpgroups)")
        if self.tma:
            need(self.overlap, "tma needs overlap=True (the TMA loads feed the overlapped "
                 "loop)")
            need(self.producer or not self.persistent,
                 "persistent with tma needs producer=True (its warpgroup walks the tiles "
                 "ahead of the consumers)")
        if self.overlap and self.fp8:
            # (P takes a quarter of block_n registers where 16-bit P takes half: the 16-bit
            # fits at 128 hold; past 128, O's registers leave room for 64-key blocks)
            need(self.fit_dim <= 128 or self.block_n == 64,
                 "an 8-bit dtype past head_dim 128 needs block_n=64 (the registers: offline "
                 "sm_90a compile)")
        elif self.overlap:
            need((self.fit_dim, self.block_n) in OVERLAP_FITS,
                 f"overlap needs (the wider of tile_dim and tile_dim_v, block_n) in "
                 f"{sorted(OVERLAP_FITS)}: "
                 f"{OVERLAP_WHY}")
        if self.overlap and self.persistent and not self.fp8:
            need((self.fit_dim, self.block_n) in PERSISTENT_OVERLAP_FITS,
                 f"persistent with overlap needs (tile width, block_n) in "
                 f"{sorted(PERSISTENT_OVERLAP_FITS)}: at head_dim 128 with 64-key blocks it "
                 f"spills")
        limit = SMEM_LIMIT[(9, 0)]
        need(self.smem_bytes <= limit, f"{self.smem_bytes} B of shared memory exceeds the "
             f"{limit} B of sm_90")

    @property
    def threads(self) -> int:
        return self.consumers + (WARPGROUP if self.producer else 0)

    @property
    def registers(self) -> tuple[int, int] | None:
        """setmaxnreg of the producer warpgroup and of each consumer (None without
        ``producer``): the launch allows 65,536 / threads each (168 at 384 threads, 128 at
        512)."""
        return REGISTER_SPLIT[self.threads] if self.producer else None

    @property
    def consumers(self) -> int:
        """Threads that compute: one warpgroup per 64 query rows (the producer's excluded)."""
        return WARPGROUP * (self.block_m // 64)

    @property
    def fp8(self) -> bool:
        """Whether the inputs are 8-bit (:data:`FP8_DTYPES`)."""
        return self.dtype in FP8_DTYPES

    @property
    def elem_bytes(self) -> int:
        return 1 if self.fp8 else 2

    @property
    def box_cols(self) -> int:
        """Elements in a 128-byte sub-tile row (a TMA box's width): 64, or 128 for 8-bit."""
        return 128 // self.elem_bytes

    @property
    def out_dtype(self) -> str:
        """O's dtype: the inputs', bfloat16 for 8-bit ones."""
        return "bfloat16" if self.fp8 else self.dtype

    @property
    def tile_dim(self) -> int:
        """The shared tiles' row length: head_dim rounded up to whole 128-byte sub-tiles (the
        columns past head_dim are TMA's zero fill)."""
        return tile_width(self.head_dim, self.box_cols)

    @property
    def dv(self) -> int:
        """V's and O's head dim: ``head_dim_v``, or ``head_dim`` when it is None."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def tile_dim_v(self) -> int:
        """The V tile's row length: dv rounded up to whole 64-column sub-tiles; 8-bit: Vᵀ's
        rows, dv (each 128 keys of 128 bytes)."""
        return self.dv if self.fp8 else tile_width(self.dv)

    @property
    def fit_dim(self) -> int:
        """The wider tile, the key of :data:`OVERLAP_FITS`."""
        return max(self.tile_dim, self.tile_dim_v)

    @property
    def q_bytes(self) -> int:
        return self.block_m * self.tile_dim * self.elem_bytes

    @property
    def tile_bytes(self) -> int:
        """Bytes of a K tile (block_n × tile_dim); V's follows it in its stage."""
        return self.block_n * self.tile_dim * self.elem_bytes

    @property
    def v_bytes(self) -> int:
        """Bytes of a V tile (block_n × tile_dim_v)."""
        return self.block_n * self.tile_dim_v * self.elem_bytes

    @property
    def smem_bytes(self) -> int:
        # Q, then two stages of K and V; overlap: a 16-byte scratch word (wgmma_wait_after_store)
        # persistent: a second Q buffer, which the next tile's Q is loaded into
        q = self.q_bytes * (2 if self.persistent else 1)
        # persistent TMA: after the barriers, the two Q buffers' tile numbers (int32 each)
        # FP8: after them, the descale factors (two float32 per Q buffer)
        return (q + 2 * (self.tile_bytes + self.v_bytes) + (16 if self.overlap else 0)
                + (self.tma_barriers * 8 + (8 if self.persistent else 0) if self.tma else 0)
                + (16 if self.fp8 else 0))

    @property
    def descale_offset(self) -> int:
        """Byte offset of the FP8 kernel's descale factors (8 bytes per Q buffer), after the
        barriers and the persistent kernel's tile numbers."""
        return (self.scratch_offset + 16 + 8 * self.tma_barriers
                + (8 if self.persistent else 0))

    @property
    def tma_barriers(self) -> int:
        """mbarriers of the TMA kernel: Q full, four per K/V stage; persistent: a second Q
        full and the two Q buffers' empty barriers."""
        return TMA_BARRIERS + (3 if self.persistent else 0)

    @property
    def kv_offset(self) -> int:
        """Byte offset of the K/V stages (after the Q buffer or buffers)."""
        return self.q_bytes * (2 if self.persistent else 1)

    @property
    def scratch_offset(self) -> int:
        """Byte offset of the overlap kernel's scratch word (after the K/V stages)."""
        return self.kv_offset + 2 * (self.tile_bytes + self.v_bytes)

    def describe(self) -> str:
        return (f"wgmma attention d{self.head_dim}"
                + (f" {self.dtype}" if self.fp8 else "")
                + (f"/v{self.head_dim_v}" if self.head_dim_v is not None else "")
                + f" {self.block_m}x{self.block_n}, "
                f"{self.block_m // 64} warpgroups, {self.smem_bytes // 1024} KB smem"
                + (", softmax overlapped with P·V" if self.overlap else "")
                + (", persistent (next tile's Q, K, V loaded ahead)" if self.persistent
                   else "")
                + (", K/V/Q by TMA (mbarrier ring, no block barrier per key block)"
                   if self.tma else "")
                + (", wgmma issue alternating between the warpgroups (ping-pong)"
                   if self.pingpong else "")
                + (", a producer warpgroup (setmaxnreg {}/{})".format(*self.registers)
                   if self.producer else "")
                + (f", every {self.fma_exp_every}th 8-key tile's exponentials on the FMA pipe"
                   if self.fma_exp_every else ""))


def wgmma_attention_kernel(cfg: WgmmaAttentionConfig, causal: bool = False,
                           has_lse: bool = False, window=None, score_mod=None,
                           mask_block=None, full_score_mod=None, varlen: bool = False):
    """The kernel for ``cfg`` (see the module docstring), generated once per argument set.

    Variants, generator parameters as in :func:`tilepy.ops.attention_mma_sync.attention_kernel`
    (the same :mod:`tilepy.tile.attention` pieces), on the TMA kernels (``cfg.tma``, grid or
    persistent) only — any other config with one raises ``NotImplementedError``:

    * ``window``: FlashAttention's ``window_size`` ``(left, right)`` relative to the
      bottom-right diagonal, ``-1`` unbounded (``causal=True`` is ``right = 0``). A tile's
      key blocks run from the first any of its rows sees to the last; the producer never
      loads the others. Several consumer warpgroups with an upper bound stop at their own
      last key block (as causal ones do) and start at the tile's first (their rows' keys
      before their own first are masked).
    * ``score_mod(score, q_row, k_col, batch, head, args) -> float32``: a device function
      applied to every scaled score before the mask (``args``: the kernel's ``hargs``;
      :func:`tilepy.tile.attention.modify_scores`). A kernel with one is not kept in the disk
      cache.

    * ``mask_block=(block_q, block_k)``: block-sparse over a block mask of that block size
      (multiples of ``block_m`` / ``block_n``), on the grid or persistent TMA kernel of a
      16-bit config, with a ``score_mod`` (the mask function in it) and no window: ``hargs``
      is ``(hook_args, (num, idx, full_num, full_idx))``, the mask's arrays as (B, Hq, …)
      views; a tile's producer loads, and its consumers compute, the key blocks of its mask
      query block's partial then full lists (:func:`tilepy.tile.attention.block_mask_row`),
      no other; the full blocks' scores take ``full_score_mod`` (the hook without the mask
      function; None: nothing). The persistent kernel walks its tiles in plain order (no
      causal heaviest-first order: the lists say nothing of it).
    * ``varlen``: packed sequences of different lengths, on the grid TMA kernel of a 16-bit
      config (not with ``mask_block``) — :func:`tilepy.ops.attention_mma_sync.
      attention_kernel`'s contract: views of batch 1, ``hargs`` ``((cu_seqlens_q,
      cu_seqlens_k), hook_args)``, grid z over the sequences, every mask, window and hook
      relative to the sequence (the hook's batch is its index; ALiBi's shift its own). TMA
      loads a sequence's tiles at its packed offsets; rows and keys past its end (the next
      sequence's, or TMA's zeros past the tensor) are masked or not stored.

    Without either the generated code is the plain causal / full kernel's. An 8-bit config
    (``cfg.fp8``) takes ``hargs = (descales, hook arguments)`` (module docstring)."""
    left, right = key_window(causal, window)
    if ((left, right) not in ((-1, -1), (-1, 0)) or score_mod is not None) and not cfg.tma:
        raise NotImplementedError(
            f"wgmma attention: a window or score_mod runs on the TMA kernels only "
            f"(WgmmaAttentionConfig(..., tma=True)); got {cfg.describe()}")
    if varlen and (not cfg.tma or cfg.persistent or cfg.fp8 or mask_block is not None):
        raise NotImplementedError(
            f"wgmma attention: packed sequences (varlen) run on the grid TMA kernel of a "
            f"16-bit config without a block mask; got {cfg.describe()}")
    if mask_block is not None:
        mask_block = check_mask_block(mask_block, cfg.block_m, cfg.block_n)
        if not cfg.tma or cfg.fp8 or (left, right) != (-1, -1) or score_mod is None:
            raise NotImplementedError(
                f"wgmma attention: a block-sparse kernel (mask_block) is a TMA kernel "
                f"of a 16-bit config with a score_mod and no window; got {cfg.describe()}")
    else:
        full_score_mod = None
    return _wgmma_attention_kernel(cfg, bool(has_lse), left, right, score_mod, mask_block,
                                   full_score_mod, bool(varlen))


@functools.cache
def _wgmma_attention_kernel(cfg: WgmmaAttentionConfig, has_lse: bool, left: int, right: int,
                            score_mod, mask_block=None, full_score_mod=None,
                            varlen: bool = False):
    """The kernel of :func:`wgmma_attention_kernel`'s arguments: the shared pieces, then the
    TMA pieces and the grid or persistent TMA kernel, or the cp.async loops and kernel."""
    c = _common_parts(cfg, has_lse, left, right, score_mod, mask_block, full_score_mod)
    c.VARLEN = varlen
    if cfg.tma:
        t = _tma_parts(cfg, c)
        return (_tma_persistent_kernel if cfg.persistent else _tma_grid_kernel)(cfg, c, t)
    loops = _cp_async_loops(cfg, c)
    kernel = _cp_async_persistent_kernel if cfg.persistent else _cp_async_grid_kernel
    return kernel(cfg, c, loops)


def _common_parts(cfg: WgmmaAttentionConfig, has_lse: bool, left: int, right: int,
                  score_mod, mask_block=None, full_score_mod=None):
    """The pieces every wgmma attention kernel of ``cfg`` shares, as a namespace of its sizes
    and device functions: the S and O wgmmas, the online softmax on S's accumulators with the
    window's mask and the score hook, P packed for the P·V wgmmas, the O epilogue (staged
    through a freed K/V stage where it fits) and the persistent kernels' tile space (causal
    tiles heaviest first). The kernel generators below compose them."""
    BM, BN, D, DV = cfg.block_m, cfg.block_n, cfg.head_dim, cfg.dv
    WIN = (left, right)           # the key window (tilepy.tile.attention.key_window's)
    UPPER = right >= 0            # a last visible key per row (causal is right = 0)
    THREADS = cfg.threads
    CONSUMERS = cfg.consumers   # the computing threads (THREADS less a producer warpgroup)
    PRODUCER, PINGPONG = cfg.producer, cfg.pingpong
    FP8 = cfg.fp8
    KSTEP = 32 if FP8 else 16   # k a wgmma
    KD = -(-D // KSTEP)   # k steps of Q·Kᵀ (the columns past D are zeros in shared memory)
    KN = BN // KSTEP      # k steps of P·V
    NS = BN // 8          # n8 tiles of S per warp
    NO = DV // 8          # n8 tiles of O per warp
    NACC_S, NACC_O = BN // 2, DV // 2
    P_REGS = 4 * KN       # P as the A registers of the P·V wgmmas
    Q_BYTES, TILE, VTILE = cfg.q_bytes, cfg.tile_bytes, cfg.v_bytes
    STAGE = TILE + VTILE  # a stage: K's tile, then V's
    SCRATCH = cfg.scratch_offset
    KV = cfg.kv_offset
    ab = "e4m3" if FP8 else "f16" if cfg.dtype == "float16" else "bf16"
    mma_s = W.wgmma(BN, ab)                                  # S = Q Kᵀ (B K-major)
    # O += P V: B MN-major (V as stored), or 8-bit K-major (Vᵀ)
    mma_o = W.wgmma(DV, ab, a_in_registers=True, trans_b=not FP8)
    pack = cvt_f16x2_f32 if cfg.dtype == "float16" else cvt_bf16x2_f32
    OUT = cfg.out_dtype
    # the cp.async kernels' copies (the TMA kernel, possibly of three warpgroups, has none)
    copy_q = None if cfg.tma else copy_rows_to_shared_128b(BM, D, CONSUMERS)
    copy_kv = None if cfg.tma else copy_rows_to_shared_128b(BN, D, CONSUMERS)
    # row sums quad-reduced at the end; the row max in two chains (registers to spare); lazy
    # rescaling: a row's max moves only when a block raises it by more than 2**8, so O is
    # rescaled on few blocks (the rest skip rescale's NACC_O multiplies)
    # FP8: P (and the row sums) come out times FP8_P_SCALE, folded into the exponent
    update = online_softmax_update(
        1, NS, quad_sum=False, max_chains=2,
        rescale_threshold=FP8_RESCALE_THRESHOLD if FP8 else RESCALE_THRESHOLD,
        p_scale_log2=FP8_P_SCALE_LOG2 if FP8 else 0, fma_exp_every=cfg.fma_exp_every)
    finalize = online_softmax_finalize(1, NO, quad_sum=False)
    # without a lower bound (window left -1) kb_first and all_first are the constant 0
    bounds = key_blocks(BM, BN, False, WIN)
    init_rows = row_limits(1, False, WIN)
    LIMITS = limits_shape(1, False, WIN)
    mask = mask_key_block(1, NS, BN, WIN)
    modify = modify_scores(1, NS, score_mod)
    # block-sparse (a block mask): a tile's step j visits key block at(blocks, j)
    SPARSE = mask_block is not None
    at = key_block_at(SPARSE, mask_block[1] // BN if SPARSE else 1)
    mask_row = block_mask_row(BM, mask_block[0], mask_block[1] // BN) if SPARSE else None
    partial = key_block_partial(SPARSE)
    modify_full = modify_scores(1, NS, full_score_mod)   # a full block's: no mask function
    to_fragment = accumulator_fragment(BN)[0]              # S as the (1, NS, 4) fragment
    o_fragment, o_accumulators = accumulator_fragment(DV)  # O as the (1, NO, 4) fragment
    store = store_rows(1, NO, OUT, has_lse)
    align = None if SIMULATOR else 1024
    f32, i64 = types.float32, types.int64

    # O's loops written out (tilepy.inline.written_out): past head_dim 160 NVVM keeps them
    # as loops, O stays a local array and ptxas serialises the P·V wgmmas
    zero_o = written_out("zero_o(acc_o)", [f"acc_o[{i}] = _ZERO" for i in range(NACC_O)],
                         {"_ZERO": _ZERO}, "attention zero_o")
    scale_o = written_out("scale_o(acc_o, a0, a1)",
                          [f"acc_o[{i}] = acc_o[{i}] * a{(i // 2) % 2}" for i in range(NACC_O)],
                          {}, "attention scale_o")

    @inline_device
    def thread_rows(tid):
        """``(wg, g, t, wrow)``: the thread's warpgroup, its row g and column pair t in the
        accumulator layout, and its warp's first row in the block. The warpgroup is read
        from lane 0 so that ptxas knows it is warp-uniform: what derives from it (the Q
        operand's wgmma descriptors) then lives in uniform registers."""
        wg = i64(shfl_idx(np.int32(tid // WARPGROUP), 0))
        lane = tid % 32
        warp = (tid % WARPGROUP) // 32
        g = lane // 4
        t = lane % 4
        return wg, g, t, wg * 64 + warp * 16

    @inline_device
    def start_rows(acc_o, limit, row_max, row_sum, rows0, g, sq, sk):
        """A tile's start: its rows' key limits and softmax state, O zeroed."""
        init_rows(limit, row_max, row_sum, rows0, g, sq, sk)
        zero_o(acc_o)

    @inline_device
    def issue_s(s, q_rows, k_addr):
        """S = Q · Kᵀ: the k16 wgmmas (not committed). One descriptor per operand, advanced
        per k16 step (one add each, where encoding each step's took four)."""
        dq = W.matrix_descriptor(q_rows, 16, 1024, 128)
        dk = W.matrix_descriptor(k_addr, 16, 1024, 128)
        for kk in range(KD):
            da = W.descriptor_advance(dq, (kk // 4) * (BM * 128) + (kk % 4) * 32)
            db = W.descriptor_advance(dk, (kk // 4) * (BN * 128) + (kk % 4) * 32)
            mma_s(s, da, db, 0 if kk == 0 else 1)

    if FP8:
        VSW = BN   # Vᵀ's rows: BN bytes, swizzled by as many (64 or 128)

        @inline_device
        def issue_o(acc_o, p, v_addr):
            """O += P · V, P from registers, Vᵀ K-major (BN keys a row, BN-byte swizzle): the
            k32 wgmmas (not committed)."""
            dv0 = W.matrix_descriptor(v_addr, 16, 8 * VSW, VSW)
            for st in range(KN):
                dv = W.descriptor_advance(dv0, st * 32)
                mma_o(acc_o, p[4 * st], p[4 * st + 1], p[4 * st + 2], p[4 * st + 3], dv, 1)
    else:
        @inline_device
        def issue_o(acc_o, p, v_addr):
            """O += P · V, P from registers: the k16 wgmmas (not committed)."""
            dv0 = W.matrix_descriptor(v_addr, BN * 128, 1024, 128)
            for st in range(KN):
                dv = W.descriptor_advance(dv0, st * 2048)
                mma_o(acc_o, p[4 * st], p[4 * st + 1], p[4 * st + 2], p[4 * st + 3], dv, 1)

    # ---- the descales of the FP8 kernels (the 16-bit ones: identities) --------------------
    # The thread that loads a tile's Q writes the tile's two factors — descale_q · descale_k
    # and descale_v — into shared memory (DSC, 8 bytes per Q buffer) before
    # its Q load, so the consumers read them after Q full like the tile number; the key loop
    # reads the first per key block (a factor kept in a register across the loop spills at
    # head_dim 128, offline sm_90a compile).
    DSC = cfg.descale_offset
    if FP8:
        @inline_device
        def split_hargs(hargs):
            """``(descales, hook arguments)``: an FP8 kernel's hargs are both."""
            return hargs[0], hargs[1]

        @inline_device
        def put_descales(addr, dsc, b, hk):
            f = dsc[0][b, hk] * dsc[1][b, hk]
            # the row max is taken over the raw scores: a factor that is not positive would
            # flip it; NaN then, never a silently wrong result
            if not (f > _ZERO and f < np.float32(np.inf)):
                f = np.float32(np.nan)
            VEC.st_shared_v2_f32(addr, f, dsc[2][b, hk])

        @inline_device
        def scale_source(addr, scale):
            """What the key loop takes for ``scale`` (or scale · log2 e): the factors'
            shared address with it (:func:`resolve`)."""
            return addr, scale

        @inline_device
        def resolve(src):
            return src[1] * VEC.ld_shared_f32(src[0])

        @inline_device
        def o_factor(addr):
            return VEC.ld_shared_f32(addr + 4)
    else:
        @inline_device
        def split_hargs(hargs):
            return (), hargs

        @inline_device
        def put_descales(addr, dsc, b, hk):
            pass

        @inline_device
        def scale_source(addr, scale):
            return scale

        @inline_device
        def resolve(src):
            return src

        @inline_device
        def o_factor(addr):
            return _ONE

    @inline_device
    def softmax(s, s3, limit, row_max, row_sum, alpha, kb, all_see, t, scale_log2):
        """Key block ``kb``'s scores (retired S accumulators) → p in ``s3``; alpha."""
        to_fragment(s3, s)
        mask(s3, limit, kb, t, 0, all_see)
        update(s3, row_max, row_sum, alpha, scale_log2)

    @inline_device
    def softmax_at(s, s3, limit, row_max, row_sum, alpha, step, all_first, all_see, t,
                   scale_log2, rows, b, h, scale, hargs):
        """:func:`softmax` of a step's key block with the score hook (``rows``: the lane's
        first row; ``hargs`` its run-time arguments) and the window's first key every row sees
        (``all_first``): the TMA kernels'. ``step``: the key block, or block-sparse the step
        word of :func:`tilepy.ops.attention_wgmma._tma_parts` (the block, and
        :data:`FULL_STEP` for a full one: the hook without the mask function).
        ``scale_log2`` / ``scale``: as :func:`scale_source` gives them."""
        if SPARSE:
            kb = i64(step & ~FULL_STEP)
        else:
            kb = step
        if SPARSE and (step & FULL_STEP) != 0:
            to_fragment(s3, s)
            modify_full(s3, rows, kb * BN + 2 * t, b, h, resolve(scale), hargs)
            mask(s3, limit, kb, t, all_first, all_see)
            update(s3, row_max, row_sum, alpha, resolve(scale_log2))
        else:
            to_fragment(s3, s)
            modify(s3, rows, kb * BN + 2 * t, b, h, resolve(scale), hargs)
            mask(s3, limit, kb, t, all_first, all_see)
            update(s3, row_max, row_sum, alpha, resolve(scale_log2))

    @inline_device
    def rescale(acc_o, alpha):
        """O's rows times alpha; skipped where both of the thread's rows keep their max
        (alpha exactly 1, see RESCALE_THRESHOLD)."""
        if alpha[0, 0] != _ONE or alpha[0, 1] != _ONE:
            scale_o(acc_o, alpha[0, 0], alpha[0, 1])

    if FP8:
        @inline_device
        def e4m3x4(a, b, c, d):
            """Four p (already times FP8_P_SCALE) rounded to e4m3, a in the low byte."""
            lo = np.uint32(cvt_e4m3x2_f32(a, b))
            hi = np.uint32(cvt_e4m3x2_f32(c, d))
            return lo | (hi << np.uint32(16))

        @inline_device
        def to_p(p, s3):
            """p (times 256 by the update) rounded to e4m3: the A registers of the k32 P·V wgmmas (n8 tiles 4st,
            4st + 1 of a row are register 4st (row g) / 4st + 1 (row g + 8); 4st + 2, 4st + 3
            the next two: Vᵀ's key order, FP8_KEY_ORDER, matches)."""
            for st in range(KN):
                p[4 * st] = e4m3x4(s3[0, 4 * st, 0], s3[0, 4 * st, 1],
                                   s3[0, 4 * st + 1, 0], s3[0, 4 * st + 1, 1])
                p[4 * st + 1] = e4m3x4(s3[0, 4 * st, 2], s3[0, 4 * st, 3],
                                       s3[0, 4 * st + 1, 2], s3[0, 4 * st + 1, 3])
                p[4 * st + 2] = e4m3x4(s3[0, 4 * st + 2, 0], s3[0, 4 * st + 2, 1],
                                       s3[0, 4 * st + 3, 0], s3[0, 4 * st + 3, 1])
                p[4 * st + 3] = e4m3x4(s3[0, 4 * st + 2, 2], s3[0, 4 * st + 2, 3],
                                       s3[0, 4 * st + 3, 2], s3[0, 4 * st + 3, 3])

    else:
        @inline_device
        def to_p(p, s3):
            """p rounded to 16 bits: the A registers of the P·V wgmmas."""
            for st in range(KN):
                p[4 * st] = pack(s3[0, 2 * st, 0], s3[0, 2 * st, 1])
                p[4 * st + 1] = pack(s3[0, 2 * st, 2], s3[0, 2 * st, 3])
                p[4 * st + 2] = pack(s3[0, 2 * st + 1, 0], s3[0, 2 * st + 1, 1])
                p[4 * st + 3] = pack(s3[0, 2 * st + 1, 2], s3[0, 2 * st + 1, 3])



    # ---- the epilogue: O staged through a freed K/V stage, 16-byte stores ------------------
    # Each warpgroup stages its 64 × DV rows (padded, store_accumulators_smem) in its own part
    # of the stage the tile's last key block used, after a barrier of the consumer threads
    # (the other warpgroups may still read that block's K and V); a persistent kernel's next
    # tile loads into the other stage. Where the warpgroups' staged parts do not fit (a
    # persistent kernel has one stage: 16 KB at head_dim 64 with 64-key blocks; a grid kernel
    # may use both stages), 16-bit stores from the fragments as before.
    # (an odd count of n8 tiles — head dims 8, 24, … — stores from the fragments)
    STAGED = staged_bytes(1, NO) if NO % 2 == 0 else 0
    ROOM = STAGE if cfg.persistent else 2 * STAGE
    STAGE_O = 0 < (BM // 64) * STAGED <= ROOM
    store_o = store_accumulators_smem(1, NO, OUT) if STAGE_O else None
    store_lse = store_rows(1, 0, OUT, has_lse)

    @inline_device
    def consumers_sync():
        """A barrier of the computing threads: syncthreads, or, with a producer warpgroup
        (which never reaches the epilogue), a named barrier of the consumers."""
        if PRODUCER:
            BAR.bar_sync(BAR_CONSUMERS, CONSUMERS)
        else:
            cuda.syncthreads()

    @inline_device
    def epilogue(acc_o, o3, row_max, row_sum, o2, lse, b, h, row0, wrow, sq, scale, g, t, tid,
                 wg, free_stage, o_scale):
        if FP8:
            scale_o(acc_o, o_scale, o_scale)
        o_fragment(o3, acc_o)
        finalize(o3, row_sum)
        if FP8:
            # the sums carry FP8_P_SCALE (the update's exponent): the LSE wants the true ones
            for hh in range(2):
                row_sum[0, hh] = row_sum[0, hh] * (_ONE / FP8_P_SCALE)
        if STAGE_O:
            o_accumulators(acc_o, o3)
            consumers_sync()            # the last block's K and V are read by every warpgroup
            store_o(acc_o, acc_o, free_stage + wg * STAGED, o2, row0 + wg * 64, 0, sq, DV,
                    _ONE, o2, o2, _ZERO, tid % WARPGROUP, 1 + wg)
            store_lse(o3, row_max, row_sum, o2, lse, b, h, row0 + wrow, sq, scale, g, t)
        else:
            store(o3, row_max, row_sum, o2, lse, b, h, row0 + wrow, sq, scale, g, t)

    @inline_device
    def no_keys(acc_o, o3, row_max, row_sum, o2, lse, b, h, rows0, sq, scale, g, t):
        """A block that visits no key block: zeros, LSE -inf, from the fragments."""
        o_fragment(o3, acc_o)
        finalize(o3, row_sum)
        store(o3, row_max, row_sum, o2, lse, b, h, rows0, sq, scale, g, t)

    # ---- persistent: one block per SM slot walks tiles (batch, head, query block) ----------
    tile_at = heavy_first((D + DV) // 2, UPPER).at
    block_at = block_bounds(BM, BN, False, WIN)

    @inline_device
    def tile_space(q, k):
        """``(sq, sk, heads, batch, group, n_qb, n_tiles)``: the persistent kernels' tiles
        (query blocks × heads × batch) and the GQA group size."""
        sq = q.shape[2]
        sk = k.shape[2]
        heads = q.shape[1]
        batch = q.shape[0]
        group = udiv(heads, k.shape[1])   # (32-bit: schedule.udiv)
        n_qb = (sq + BM - 1) // BM
        return sq, sk, heads, batch, group, n_qb, n_qb * heads * batch

    @inline_device
    def tile_coords(tile, n_qb, heads, batch, group, sq, sk):
        """``(b, h, hk, row0, kb0, n_kb, all_first, all_see)`` of persistent tile ``tile``:
        its batch, query head, K/V head (GQA), first query row, first key block and number
        of key blocks, and the keys all its rows see (:func:`block_bounds`)."""
        b, h, qb = tile_at(tile, n_qb, heads, batch, sk)
        row0, kb0, kb_end, all_first, all_see = block_at(qb, sq, sk)
        return b, h, udiv(h, group), row0, kb0, kb_end - kb0, all_first, all_see

    return SimpleNamespace(**locals())


def _cp_async_loops(cfg: WgmmaAttentionConfig, c):
    """The cp.async kernels' key-block loops over the pieces ``c`` (:func:`_common_parts`):
    ``loop`` the grid kernel's (``main_loop``, or ``overlap_loop`` with the next block's S
    issued before this block's softmax when ``cfg.overlap``) and ``ploop`` the persistent
    kernel's (the same with stages counted across tiles and the next tile's first loads
    folded in)."""
    BN, KV, NACC_O, NACC_S, SCRATCH, STAGE = c.BN, c.KV, c.NACC_O, c.NACC_S, c.SCRATCH, c.STAGE
    TILE, copy_kv, copy_q, issue_o, issue_s = c.TILE, c.copy_kv, c.copy_q, c.issue_o, c.issue_s
    left, rescale, softmax, to_p = c.left, c.rescale, c.softmax, c.to_p

    @inline_device
    def main_loop(acc_o, s, s3, p, limit, row_max, row_sum, alpha, base, k0, ks, v0, vs,
                  q_rows, sk, n_kb, all_see, t, tid, scale_log2):
        """One wgmma batch at a time: S, wait, softmax, P·V, wait."""
        kv_base = base + KV
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
        kv_base = base + KV
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
            W.wgmma_wait_after_store(base + SCRATCH, row_sum[0, 0], row_sum[0, 1])
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

    # These loops mirror main_loop / overlap_loop with stages counted from st0 and the next
    # tile's loads folded in. The grid kernel keeps main_loop / overlap_loop: through these
    # loops (st0 = 0, nothing ahead) it ran slower (bench/NOTES.md: persistent attention).
    # Key block j of a tile lives in stage (st0 + j) % 2, st0 counting on across tiles; the
    # tile's Q in buffer qbuf. ``pre``: the next tile's Q and first K/V block are loaded
    # during this tile's last key block, into the other Q buffer and the stage after it.

    @inline_device
    def compute_block(acc_o, s, s3, p, limit, row_max, row_sum, alpha, q_rows, k_addr, kb,
                      all_see, t, scale_log2):
        """S, wait, softmax, P·V, wait: one key block (stage at ``k_addr``)."""
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
    def persistent_main(acc_o, s, s3, p, limit, row_max, row_sum, alpha, kv_base, k0, ks, v0,
                        vs, qbuf, sk, n_kb, all_see, t, tid, wg, scale_log2, st0, pre,
                        nq_buf, nq_src, qs, nq_left, nk0, nv0):
        q_rows = qbuf + wg * (64 * 128)
        for kb in range(n_kb):
            cur = (st0 + kb) % 2
            cp_async_wait_group(0)
            W.fence_proxy_async_shared()
            cuda.syncthreads()
            nxt = kv_base + (1 - cur) * STAGE
            if kb + 1 < n_kb:
                left = sk - (kb + 1) * BN
                copy_kv(nxt, k0 + (kb + 1) * BN * ks, ks, left, tid)
                copy_kv(nxt + TILE, v0 + (kb + 1) * BN * vs, vs, left, tid)
            elif pre:
                copy_q(nq_buf, nq_src, qs, nq_left, tid)
                copy_kv(nxt, nk0, ks, sk, tid)
                copy_kv(nxt + TILE, nv0, vs, sk, tid)
            cp_async_commit_group()
            compute_block(acc_o, s, s3, p, limit, row_max, row_sum, alpha, q_rows,
                          kv_base + cur * STAGE, kb, all_see, t, scale_log2)

    @inline_device
    def persistent_overlap(acc_o, s, s3, p, limit, row_max, row_sum, alpha, kv_base, k0, ks,
                           v0, vs, qbuf, sk, n_kb, all_see, t, tid, wg, scale_log2, st0, pre,
                           nq_buf, nq_src, qs, nq_left, nk0, nv0):
        """:func:`overlap_loop`'s pipeline with the stages counted from st0. Entry: Q and
        K(0) retired or in the older group, V(0) in the newest. The next tile's Q and K(0)
        go out with V(n-1) (in the tail when n_kb is 1), its V(0) in the tail."""
        q_rows = qbuf + wg * (64 * 128)
        cp_async_wait_group(1)                            # Q, K(0)
        W.fence_proxy_async_shared()
        cuda.syncthreads()
        if n_kb > 1:                                      # K(1)
            copy_kv(kv_base + ((st0 + 1) % 2) * STAGE, k0 + BN * ks, ks, sk - BN, tid)
        cp_async_commit_group()
        W.wgmma_fence()
        issue_s(s, q_rows, kv_base + st0 * STAGE)
        W.wgmma_commit_group()
        W.wgmma_wait_group(0)
        W.wgmma_fence_operand(s, NACC_S)
        softmax(s, s3, limit, row_max, row_sum, alpha, 0, all_see, t, scale_log2)
        to_p(p, s3)                                       # O is 0: no rescale
        for kb in range(n_kb - 1):
            cur = (st0 + kb) % 2
            nxt = kv_base + (1 - cur) * STAGE
            cp_async_wait_group(0)                        # V(kb), K(kb+1)
            W.fence_proxy_async_shared()
            cuda.syncthreads()
            left = sk - (kb + 1) * BN
            copy_kv(nxt + TILE, v0 + (kb + 1) * BN * vs, vs, left, tid)
            if kb + 2 < n_kb:
                copy_kv(kv_base + cur * STAGE, k0 + (kb + 2) * BN * ks, ks, left - BN, tid)
            elif pre:                                     # the next tile's Q and K(0)
                copy_q(nq_buf, nq_src, qs, nq_left, tid)
                copy_kv(kv_base + cur * STAGE, nk0, ks, sk, tid)
            cp_async_commit_group()

            W.wgmma_fence()
            issue_s(s, q_rows, nxt)
            W.wgmma_commit_group()
            issue_o(acc_o, p, kv_base + cur * STAGE + TILE)
            W.wgmma_commit_group()
            W.wgmma_wait_group(1)                         # S(kb+1) retired, P·V in flight
            W.wgmma_fence_operand(s, NACC_S)
            softmax(s, s3, limit, row_max, row_sum, alpha, kb + 1, all_see, t, scale_log2)
            W.wgmma_wait_after_store(kv_base - KV + SCRATCH, row_sum[0, 0], row_sum[0, 1])
            W.wgmma_fence_operand(acc_o, NACC_O)
            rescale(acc_o, alpha)
            to_p(p, s3)
        last = (st0 + n_kb - 1) % 2
        after = kv_base + (1 - last) * STAGE              # the next tile's first stage
        cp_async_wait_group(0)                            # V(n_kb - 1)
        W.fence_proxy_async_shared()
        cuda.syncthreads()
        if pre:
            if n_kb == 1:
                copy_q(nq_buf, nq_src, qs, nq_left, tid)
                copy_kv(after, nk0, ks, sk, tid)
                cp_async_commit_group()
            copy_kv(after + TILE, nv0, vs, sk, tid)
            cp_async_commit_group()
        W.wgmma_fence()
        issue_o(acc_o, p, kv_base + last * STAGE + TILE)
        W.wgmma_commit_group()
        W.wgmma_wait_group(0)
        W.wgmma_fence_operand(acc_o, NACC_O)

    ploop = persistent_overlap if cfg.overlap else persistent_main

    return SimpleNamespace(**locals())


def _cp_async_persistent_kernel(cfg: WgmmaAttentionConfig, c, loops):
    """The persistent cp.async kernel ``pkernel(q, k, v, o, lse, scale, scale_log2, hargs)``:
    one block per SM slot walks the (batch, head, query block) tiles with ``loops.ploop``;
    ``hargs`` is unread (no variants on this kernel)."""
    BM, KV, LIMITS, NACC_O, NACC_S, NO, NS = c.BM, c.KV, c.LIMITS, c.NACC_O, c.NACC_S, c.NO, c.NS
    P_REGS, Q_BYTES, STAGE, TILE, align = c.P_REGS, c.Q_BYTES, c.STAGE, c.TILE, c.align
    copy_kv, copy_q, epilogue, f32, i64 = c.copy_kv, c.copy_q, c.epilogue, c.f32, c.i64
    start_rows, thread_rows, tile_coords = c.start_rows, c.thread_rows, c.tile_coords
    ploop = loops.ploop

    OVERLAP = bool(cfg.overlap)

    @cached_jit
    def pkernel(q, k, v, o, lse, scale, scale_log2, hargs):
        # tile_space written out: through it ptxas gives this kernel 2-15 more registers
        # (offline sm_90a); the persistent TMA kernel takes it (fewer spills there)
        sq = q.shape[2]
        sk = k.shape[2]
        heads = q.shape[1]
        batch = q.shape[0]
        group = udiv(heads, k.shape[1])   # (32-bit: schedule.udiv)
        n_qb = (sq + BM - 1) // BM
        n_tiles = n_qb * heads * batch
        tid = cuda.threadIdx.x
        wg, g, t, wrow = thread_rows(tid)

        acc_o = cuda.local.array(NACC_O, f32)
        s = cuda.local.array(NACC_S, f32)
        s3 = cuda.local.array((1, NS, 4), f32)
        o3 = cuda.local.array((1, NO, 4), f32)
        p = cuda.local.array(P_REGS, types.uint32)
        row_max = cuda.local.array((1, 2), f32)
        row_sum = cuda.local.array((1, 2), f32)
        alpha = cuda.local.array((1, 2), f32)
        limit = cuda.local.array(LIMITS, i64)
        smem = cuda.shared.array(0, types.uint16, alignment=align) if align else \
            cuda.shared.array(0, types.uint16)
        base = shared_addr(smem, 0)
        kv_base = base + KV
        qs = i64(q.strides[2])
        ks = i64(k.strides[2])
        vs = i64(v.strides[2])

        tile = cuda.blockIdx.x
        st0 = 0           # the stage of this tile's first key block
        qi = 0            # the Q buffer of this tile
        pending = False   # this tile's Q and first K/V block already loaded (in flight)
        while tile < n_tiles:
            b, h, hk, row0, _, n_kb, _, all_see = tile_coords(tile, n_qb, heads, batch, group,
                                                              sq, sk)
            start_rows(acc_o, limit, row_max, row_sum, row0 + wrow, g, sq, sk)
            nxt_tile = tile + cuda.gridDim.x
            if n_kb > 0:
                qbuf = base + qi * Q_BYTES
                k0 = i64(global_addr(k, (b, hk, 0, 0)))
                v0 = i64(global_addr(v, (b, hk, 0, 0)))
                if not pending:
                    cuda.syncthreads()      # every warpgroup is done with the buffers
                    copy_q(qbuf, i64(global_addr(q, (b, h, row0, 0))), qs, sq - row0, tid)
                    copy_kv(kv_base + st0 * STAGE, k0, ks, sk, tid)
                    if OVERLAP:             # V(0) in a group of its own (see the loop)
                        cp_async_commit_group()
                    copy_kv(kv_base + st0 * STAGE + TILE, v0, vs, sk, tid)
                    cp_async_commit_group()
                pre = False
                nq_src = i64(0)
                nk0 = i64(0)
                nv0 = i64(0)
                nq_left = 0
                if nxt_tile < n_tiles:
                    nb, nh, nhk, nrow0, _, nn_kb, _, _ = tile_coords(nxt_tile, n_qb, heads,
                                                                     batch, group, sq, sk)
                    if nn_kb > 0:
                        pre = True
                        nq_src = i64(global_addr(q, (nb, nh, nrow0, 0)))
                        nk0 = i64(global_addr(k, (nb, nhk, 0, 0)))
                        nv0 = i64(global_addr(v, (nb, nhk, 0, 0)))
                        nq_left = sq - nrow0
                ploop(acc_o, s, s3, p, limit, row_max, row_sum, alpha, kv_base, k0, ks, v0,
                      vs, qbuf, sk, n_kb, all_see, t, tid, wg, scale_log2, st0, pre,
                      base + (1 - qi) * Q_BYTES, nq_src, qs, nq_left, nk0, nv0)
                st0 = (st0 + n_kb) % 2
                pending = pre
                if pre:
                    qi = 1 - qi
            # the stage of the last key block (free once every warpgroup is done with it;
            # st0 has moved on to the next tile's first); any stage when nothing was visited
            epilogue(acc_o, o3, row_max, row_sum, o[b, h], lse, b, h, row0, wrow, sq, scale,
                     g, t, tid, wg, kv_base + (1 - st0) * STAGE, _ONE)
            tile = nxt_tile

    return pkernel


def _cp_async_grid_kernel(cfg: WgmmaAttentionConfig, c, loops):
    """The grid cp.async kernel ``kernel(q, k, v, o, lse, scale, scale_log2, hargs)``: one
    block per (query block, head, batch) with ``loops.loop``; ``hargs`` is unread (no
    variants on this kernel)."""
    KV, LIMITS, NACC_O, NACC_S, NO, NS = c.KV, c.LIMITS, c.NACC_O, c.NACC_S, c.NO, c.NS
    P_REGS, align, bounds, copy_q, epilogue = c.P_REGS, c.align, c.bounds, c.copy_q, c.epilogue
    f32, i64, no_keys, start_rows = c.f32, c.i64, c.no_keys, c.start_rows
    thread_rows = c.thread_rows
    loop = loops.loop

    @cached_jit
    def kernel(q, k, v, o, lse, scale, scale_log2, hargs):
        sq, sk, b, h, hk = block_coords(q, k)
        tid = cuda.threadIdx.x
        wg, g, t, wrow = thread_rows(tid)
        row0, _, n_kb, _, all_see = bounds(sq, sk)

        acc_o = cuda.local.array(NACC_O, f32)
        s = cuda.local.array(NACC_S, f32)
        s3 = cuda.local.array((1, NS, 4), f32)
        o3 = cuda.local.array((1, NO, 4), f32)
        p = cuda.local.array(P_REGS, types.uint32)
        row_max = cuda.local.array((1, 2), f32)
        row_sum = cuda.local.array((1, 2), f32)
        alpha = cuda.local.array((1, 2), f32)
        limit = cuda.local.array(LIMITS, i64)
        start_rows(acc_o, limit, row_max, row_sum, row0 + wrow, g, sq, sk)

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
            epilogue(acc_o, o3, row_max, row_sum, o[b, h], lse, b, h, row0, wrow, sq, scale,
                     g, t, tid, wg, base + KV, _ONE)
        else:
            no_keys(acc_o, o3, row_max, row_sum, o[b, h], lse, b, h, row0 + wrow, sq, scale, g,
                    t)

    return kernel


def _tma_parts(cfg: WgmmaAttentionConfig, c):
    """The TMA kernels' pieces over ``c`` (:func:`_common_parts`), as a namespace: the
    mbarrier ring (barriers, the Q / K / V loads with expect-tx), the producer's first loads
    and its step, the consumer warpgroups' wgmma turns (ping-pong), a warpgroup's own key
    span under an upper bound and its drain, the consumer loop ``tma_loop`` (score hook and
    window), the register split of a producer warpgroup and the jit (``tjit``: not
    disk-cached with a score hook)."""
    BM, BN, CONSUMERS, D, KV, NACC_O = c.BM, c.BN, c.CONSUMERS, c.D, c.KV, c.NACC_O
    NACC_S, PINGPONG, PRODUCER, Q_BYTES = c.NACC_S, c.PINGPONG, c.PRODUCER, c.Q_BYTES
    SCRATCH, STAGE, THREADS, TILE, UPPER = c.SCRATCH, c.STAGE, c.THREADS, c.TILE, c.UPPER
    WIN, issue_o, issue_s, rescale, score_mod = c.WIN, c.issue_o, c.issue_s, c.rescale, c.score_mod
    at, partial = c.at, c.partial
    softmax_at, to_p = c.softmax_at, c.to_p

    # ---- TMA: one thread loads Q, K and V with TMA into the same swizzled layout ----------
    # mbarriers (after the scratch word): Q full; per stage st: K full, V full (the producer's
    # expect_tx), K empty, V empty (every consumer thread arrives once the wgmmas that read
    # the slot have retired). Key block j's K and V live in slot j % 2, use j // 2: consumers
    # wait for full phase (j // 2) & 1; the producer reloads a slot once phase
    # ((j - 2) // 2) & 1 of its empty barrier has completed. Loads as in overlap_loop: Q, K(0),
    # V(0), K(1) up front; step kb loads V(kb+1) and K(kb+2). No block barrier per key block:
    # a warpgroup only waits for data, and the producer for the consumers to be done with a
    # slot. The producer is thread 0 of the first consumer warpgroup, or with ``producer`` a
    # warpgroup of its own (the last; setmaxnreg moves its registers to the consumers) whose
    # first thread issues every load while the rest of it idles.
    # ``pingpong``: each consumer warpgroup issues a step's wgmmas in its turn (named barrier
    # BAR_TURN + wg, passed on to the next warpgroup once they are issued), so the consumer
    # warpgroups' wgmma batches take turns on the tensor cores and one's softmax runs beside
    # the others' wgmmas (FlashAttention-3's inter-warpgroup ping-pong). The last warpgroup
    # gives warpgroup 0 the first turn and does not pass on its last: n_kb turns each, and
    # every turn barrier completes with 256 threads (its owner and the one before it).
    BARS = SCRATCH + 16
    BOXC = cfg.box_cols                # elements a 128-byte box row
    KV_BOXES = cfg.tile_dim // BOXC    # boxes (128-byte rows) per K tile …
    V_BOXES = cfg.tile_dim_v // BOXC   # … and per V tile (16-bit)
    VTILE = c.VTILE
    Q_BOX = BM * 128
    KV_BOX = BN * 128
    CWG = CONSUMERS // WARPGROUP       # consumer warpgroups; a producer warpgroup is CWG
    PERSIST = bool(cfg.persistent)     # the persistent TMA kernel (producer warpgroup)
    QF1, QE0 = 72, 80                  # persistent: Q buffer 1's full, buffers' empty barriers
    # causal (an upper bound), several consumer warpgroups: each one's own last key block
    # and mask (see drain)
    WG_BOUNDS = UPPER and CWG > 1
    wg_bounds = block_bounds(64, BN, False, WIN)
    PREGS, CREGS = cfg.registers if PRODUCER else (0, 0)

    VARLEN = c.VARLEN   # packed sequences: views of batch 1, every load at batch 0

    def tile_load(nbytes, boxes, box_bytes):
        """``load(dst, tm, bar, row, head, b)``: one tile of ``boxes`` 128-byte-wide boxes of
        ``box_bytes`` each into ``dst``, its ``nbytes`` expected on ``bar``."""
        @inline_device
        def load(dst, tm, bar, row, head, b):
            MB.mbarrier_arrive_expect_tx(bar, nbytes)
            for c in range(boxes):
                T.tma_load_4d(dst + c * box_bytes, tm, bar, c * BOXC, row, head,
                              0 if VARLEN else b)

        return load

    load_q = tile_load(Q_BYTES, KV_BOXES, Q_BOX)
    load_kv = tile_load(TILE, KV_BOXES, KV_BOX)     # a K tile
    if cfg.fp8:
        @inline_device
        def load_v(dst, tm, bar, key, head, b):
            """Vᵀ's (dv rows × 128 keys) box of the key block at ``key``."""
            MB.mbarrier_arrive_expect_tx(bar, VTILE)
            T.tma_load_4d(dst, tm, bar, key, 0, head, 0 if VARLEN else b)
    else:
        load_v = tile_load(VTILE, V_BOXES, KV_BOX)  # a V tile, tile_dim_v wide

    # Block-sparse: the producer writes each K tile's key block (FULL_STEP set for a full block
    # of the mask) into its ring slot's step word (STEPS, after the config's shared memory: the
    # kernel's ``tilepy_smem_bytes``) before that load, and the consumers read it once the K
    # tile has landed, before they release the slot: they keep no block list in registers.
    STEPS = cfg.smem_bytes
    if VARLEN:   # ``blocks`` is (first key block, the sequence's first key in the packed k)
        @inline_device
        def key_of(blocks, j):
            return (blocks[0] + j) * BN + blocks[1]
    else:
        @inline_device
        def key_of(blocks, j):
            return at(blocks, j) * BN

    if c.SPARSE:
        @inline_device
        def put_step(base, slot, blocks, j):
            w = np.uint32(at(blocks, j))
            if not partial(blocks, j):
                w = w | FULL_STEP
            VEC.st_shared_b32(base + STEPS + 4 * slot, w)

        @inline_device
        def get_step(base, slot, blocks, j):
            return VEC.ld_shared_b32(base + STEPS + 4 * slot)
    else:
        @inline_device
        def put_step(base, slot, blocks, j):
            pass

        @inline_device
        def get_step(base, slot, blocks, j):
            if VARLEN:
                return blocks[0] + j
            return blocks + j

    @inline_device
    def init_ring(bars):
        """Q full (buffer 0) and the K/V ring's barriers; the caller fences the init."""
        MB.mbarrier_init(bars, 1)
        for st in range(2):
            MB.mbarrier_init(bars + 32 * st + 8, 1)            # K full
            MB.mbarrier_init(bars + 32 * st + 16, 1)           # V full
            MB.mbarrier_init(bars + 32 * st + 24, CONSUMERS)   # K empty
            MB.mbarrier_init(bars + 32 * st + 32, CONSUMERS)   # V empty

    @inline_device
    def warpgroup_span(row0, wg, kb0, n_kb, all_first, all_see, sq, sk):
        """``(n_wg, first, see)``: how many of the tile's key blocks (from ``kb0``) this
        warpgroup computes, and the first and last key all its rows see; causal (an upper
        bound) with several consumer warpgroups, its own (see drain)."""
        if WG_BOUNDS:
            _, _, end, first, see = wg_bounds(row0 // 64 + wg, sq, sk)
            # at least one block: rows that see no key are masked, as in a 1-WG tile
            return max(end - kb0, 1), first, see
        return n_kb, all_first, all_see

    @inline_device
    def produce_first(base, tq, tk, tv, b, h, hk, row0, n_kb, blocks):
        """Q, K(0), V(0) and K(1): the loads before the first step (step j of the tile loads
        key block ``at(blocks, j)``: :func:`tilepy.tile.attention.key_block_at`). The tensor
        maps are fenced first by the thread that issues the loads (as :mod:`tilepy.ptx.tma`
        asks)."""
        kv_base = base + KV
        bars = base + BARS
        T.fence_proxy_tensormap_acquire(tq)
        T.fence_proxy_tensormap_acquire(tk)
        T.fence_proxy_tensormap_acquire(tv)
        load_q(base, tq, bars, row0, h, b)
        key0 = key_of(blocks, 0)
        put_step(base, 0, blocks, 0)
        load_kv(kv_base, tk, bars + 8, key0, hk, b)                       # K(0)
        load_v(kv_base + TILE, tv, bars + 16, key0, hk, b)                # V(0)
        if n_kb > 1:
            put_step(base, 1, blocks, 1)
            load_kv(kv_base + STAGE, tk, bars + 8 + 32, key_of(blocks, 1), hk, b)  # K(1)

    @inline_device
    def produce_step(base, tk, tv, b, hk, kb, n_kb, blocks):
        """Step kb's loads: V(kb+1) and K(kb+2), each once its slot is released."""
        kv_base = base + KV
        bars = base + BARS
        cur = kb & 1
        nxt = 1 - cur
        if kb >= 1:   # V(kb+1) into the slot of V(kb-1)
            MB.mbarrier_wait_parity(bars + 32 * nxt + 32, ((kb - 1) >> 1) & 1)
        load_v(kv_base + nxt * STAGE + TILE, tv, bars + 32 * nxt + 16, key_of(blocks, kb + 1),
               hk, b)
        if kb + 2 < n_kb:   # K(kb+2) into the slot of K(kb)
            MB.mbarrier_wait_parity(bars + 32 * cur + 24, (kb >> 1) & 1)
            put_step(base, cur, blocks, kb + 2)
            load_kv(kv_base + cur * STAGE, tk, bars + 32 * cur + 8, key_of(blocks, kb + 2), hk,
                    b)

    @inline_device
    def take_turn(wg):
        if PINGPONG:
            BAR.bar_sync(BAR_TURN + wg, 2 * WARPGROUP)

    @inline_device
    def pass_turn(wg, last):
        if PINGPONG and not (wg == CWG - 1 and last):
            BAR.bar_arrive(BAR_TURN + (wg + 1) % CWG, 2 * WARPGROUP)

    @inline_device
    def drain(base, tk, tv, b, hk, tid, wg, n_wg, n_kb, g0, blocks):
        """Causal: the key blocks past this warpgroup's last key (``n_wg`` … ``n_kb - 1``,
        fully masked for its rows) are not computed. Their slots are still released, each
        once its load has landed (so no release runs ahead of the other warpgroups' releases
        of the block two back), and ping-pong turns and a thread-0 producer's loads go on.
        Persistent: the tile's last block is released after the epilogue, as its stage holds
        O (see tpkernel)."""
        bars = base + BARS
        if n_wg < n_kb:
            last = (g0 + n_wg - 1) & 1                    # V(n_wg - 1), read by the last P·V
            MB.mbarrier_arrive(bars + 32 * last + 32)
        for kb in range(n_wg, n_kb):
            gk = g0 + kb
            st = gk & 1
            if not PRODUCER and tid == 0:
                produce_step(base, tk, tv, b, hk, kb - 1, n_kb, blocks)
            take_turn(wg)
            pass_turn(wg, kb == n_kb - 1)
            hold = PERSIST and kb == n_kb - 1
            MB.mbarrier_wait_parity(bars + 32 * st + 8, (gk >> 1) & 1)     # K(kb) landed
            if not hold:
                MB.mbarrier_arrive(bars + 32 * st + 24)
            MB.mbarrier_wait_parity(bars + 32 * st + 16, (gk >> 1) & 1)    # V(kb) landed
            if not hold:
                MB.mbarrier_arrive(bars + 32 * st + 32)

    @inline_device
    def tma_loop(acc_o, s, s3, p, limit, row_max, row_sum, alpha, base, tq, tk, tv, b, h,
                 hk, row0, q_rows, blocks, n_kb, n_wg, all_first, all_see, t, tid, wg,
                 scale_log2, g0, q_bar, q_phase, rows, scale, hargs):
        """The consumer warpgroup's key blocks of steps 0 … ``n_wg - 1``, step j's
        ``at(blocks, j)`` (dense: ``blocks`` is the first key block, step j the block
        ``blocks + j``; block-sparse: the block mask's row) (``n_wg`` ≤ ``n_kb``, the tile's
        count: less for a causal warpgroup whose rows end before the tile's last key block,
        see :func:`drain`); ping-pong turns count the tile's ``n_kb``.
        The tile's j-th key block is the ring's block ``g0 + j`` (slot ``& 1``, use ``>> 1``;
        g0 = 0 in the grid kernel); Q is complete at phase ``q_phase`` of ``q_bar``.
        Persistent: the tile's last K slot is not released here (its stage holds O in the
        epilogue). ``rows``, ``b``, ``h``, ``scale``, ``hargs``: the score hook's
        (:func:`softmax_at`)."""
        kv_base = base + KV
        bars = base + BARS
        if not PRODUCER and tid == 0:
            produce_first(base, tq, tk, tv, b, h, hk, row0, n_kb, blocks)
        if PINGPONG and wg == CWG - 1:
            BAR.bar_arrive(BAR_TURN, 2 * WARPGROUP)                      # warpgroup 0 first
        s0 = g0 & 1
        MB.mbarrier_wait_parity(q_bar, q_phase)
        MB.mbarrier_wait_parity(bars + 32 * s0 + 8, (g0 >> 1) & 1)
        step = get_step(base, s0, blocks, 0)             # (read before K(0) is released)
        take_turn(wg)
        W.wgmma_fence()
        issue_s(s, q_rows, kv_base + s0 * STAGE)
        W.wgmma_commit_group()
        pass_turn(wg, n_kb == 1)
        W.wgmma_wait_group(0)
        W.wgmma_fence_operand(s, NACC_S)
        if not (PERSIST and n_kb == 1):
            MB.mbarrier_arrive(bars + 32 * s0 + 24)                      # K(0) read
        softmax_at(s, s3, limit, row_max, row_sum, alpha, step, all_first, all_see, t,
                   scale_log2, rows, b, h, scale, hargs)
        to_p(p, s3)                                       # O is 0: no rescale
        for kb in range(n_wg - 1):
            gk = g0 + kb
            cur = gk & 1
            nxt = 1 - cur
            if not PRODUCER and tid == 0:
                produce_step(base, tk, tv, b, hk, kb, n_kb, blocks)
            MB.mbarrier_wait_parity(bars + 32 * nxt + 8, ((gk + 1) >> 1) & 1)  # K(kb+1)
            step = get_step(base, nxt, blocks, kb + 1)
            MB.mbarrier_wait_parity(bars + 32 * cur + 16, (gk >> 1) & 1)         # V(kb)
            take_turn(wg)
            W.wgmma_fence()
            issue_s(s, q_rows, kv_base + nxt * STAGE)
            W.wgmma_commit_group()
            issue_o(acc_o, p, kv_base + cur * STAGE + TILE)
            W.wgmma_commit_group()
            pass_turn(wg, kb == n_kb - 2)
            W.wgmma_wait_group(1)                         # S(kb+1) retired, P·V in flight
            W.wgmma_fence_operand(s, NACC_S)
            if not (PERSIST and kb + 2 == n_kb):
                MB.mbarrier_arrive(bars + 32 * nxt + 24)  # K(kb+1) read
            softmax_at(s, s3, limit, row_max, row_sum, alpha, step, all_first, all_see, t,
                       scale_log2, rows, b, h, scale, hargs)
            W.wgmma_wait_after_store(base + SCRATCH, row_sum[0, 0], row_sum[0, 1])
            W.wgmma_fence_operand(acc_o, NACC_O)
            MB.mbarrier_arrive(bars + 32 * cur + 32)      # V(kb) read
            rescale(acc_o, alpha)
            to_p(p, s3)
        last = (g0 + n_wg - 1) & 1
        MB.mbarrier_wait_parity(bars + 32 * last + 16, ((g0 + n_wg - 1) >> 1) & 1)
        W.wgmma_fence()
        issue_o(acc_o, p, kv_base + last * STAGE + TILE)
        W.wgmma_commit_group()
        W.wgmma_wait_group(0)
        W.wgmma_fence_operand(acc_o, NACC_O)
        if WG_BOUNDS:
            drain(base, tk, tv, b, hk, tid, wg, n_wg, n_kb, g0, blocks)

    if score_mod is not None and not SIMULATOR:   # its closure holds the caller's function
        tjit = cuda.jit(launch_bounds=(THREADS, 1)) if PRODUCER else cuda.jit   # no disk cache
    else:
        tjit = cached_jit(launch_bounds=(THREADS, 1)) if PRODUCER and not SIMULATOR else cached_jit

    return SimpleNamespace(**locals())


def _tma_grid_kernel(cfg: WgmmaAttentionConfig, c, t):
    """The grid TMA kernel ``tkernel(q, k, v, o, lse, scale, scale_log2, maps, hargs)``: one
    block per (query block, head, batch), its key blocks from the first any row sees (the
    window's), loaded by thread 0 or a producer warpgroup into the ring of ``t``;
    ``hargs``: the score hook's run-time arguments."""
    BN, CONSUMERS, KV, LIMITS, NACC_O = c.BN, c.CONSUMERS, c.KV, c.LIMITS, c.NACC_O
    NACC_S, NO, NS, PRODUCER, P_REGS, align = c.NACC_S, c.NO, c.NS, c.PRODUCER, c.P_REGS, c.align
    bounds, epilogue, f32, i64, no_keys = c.bounds, c.epilogue, c.f32, c.i64, c.no_keys
    start_rows, thread_rows = c.start_rows, c.thread_rows
    DSC, o_factor, put_descales = c.DSC, c.o_factor, c.put_descales
    resolve, scale_source, split_hargs = c.resolve, c.scale_source, c.split_hargs
    SPARSE, mask_row, VARLEN = c.SPARSE, c.mask_row, c.VARLEN
    BARS, CREGS, CWG, PREGS, init_ring = t.BARS, t.CREGS, t.CWG, t.PREGS, t.init_ring
    produce_first, produce_step, tjit = t.produce_first, t.produce_step, t.tjit
    tma_loop, warpgroup_span = t.tma_loop, t.warpgroup_span

    @tjit
    def tkernel(q, k, v, o, lse, scale, scale_log2, maps, hargs):
        sq, sk, b, h, hk = block_coords(q, k)
        dsc, both = split_hargs(hargs)
        if VARLEN:     # sequence b: rows q_start … of the packed q / o, keys k_start …
            cu_q, cu_k = both[0]
            q_start = i64(cu_q[b])
            k_start = i64(cu_k[b])
            sq = i64(cu_q[b + 1]) - q_start
            sk = i64(cu_k[b + 1]) - k_start
            vb = 0
        else:
            q_start = 0
            vb = b
        tid = cuda.threadIdx.x
        wg, g, t, wrow = thread_rows(tid)
        row0, kb0, kb_end, all_first, all_see = bounds(sq, sk)
        if VARLEN:
            if row0 >= sq:
                return  # past this sequence's rows (the grid fits the longest): the block
            hook = both[1] + (sk - sq,)
            n_kb = kb_end - kb0
            blocks = (kb0, k_start)
        elif SPARSE:   # hargs (hook arguments, the block mask): the mask's lists
            hook = both[0]
            n_kb, blocks = mask_row(both[1], cuda.blockIdx.x, b, h)
        else:          # step j visits key block kb0 + j
            hook = both
            n_kb = kb_end - kb0
            blocks = kb0

        acc_o = cuda.local.array(NACC_O, f32)
        s = cuda.local.array(NACC_S, f32)
        s3 = cuda.local.array((1, NS, 4), f32)
        o3 = cuda.local.array((1, NO, 4), f32)
        p = cuda.local.array(P_REGS, types.uint32)
        row_max = cuda.local.array((1, 2), f32)
        row_sum = cuda.local.array((1, 2), f32)
        alpha = cuda.local.array((1, 2), f32)
        limit = cuda.local.array(LIMITS, i64)

        if n_kb > 0:
            smem = cuda.shared.array(0, types.uint16, alignment=align) if align else \
                cuda.shared.array(0, types.uint16)
            base = shared_addr(smem, 0)
            tq = T.tensor_map_address(maps)
            tk = tq + MAP_BYTES
            tv = tk + MAP_BYTES
            if tid == 0:
                init_ring(base + BARS)
                MB.fence_mbarrier_init()
            cuda.syncthreads()
            if PRODUCER and wg == CWG:
                W.setmaxnreg_dec(PREGS)
                if tid == CONSUMERS:
                    put_descales(base + DSC, dsc, b, hk)   # before Q full can complete
                    produce_first(base, tq, tk, tv, b, h, hk, q_start + row0, n_kb, blocks)
                    for kb in range(n_kb - 1):
                        produce_step(base, tk, tv, b, hk, kb, n_kb, blocks)
            else:
                if PRODUCER:
                    W.setmaxnreg_inc(CREGS)
                start_rows(acc_o, limit, row_max, row_sum, row0 + wrow, g, sq, sk)
                q_rows = base + wg * (64 * 128)   # this warpgroup's 64 rows of each sub-tile
                n_wg, first, see = warpgroup_span(row0, wg, kb0, n_kb, all_first, all_see, sq,
                                                  sk)
                tma_loop(acc_o, s, s3, p, limit, row_max, row_sum, alpha, base, tq, tk, tv, b,
                         h, hk, q_start + row0, q_rows, blocks, n_kb, n_wg, first, see, t, tid,
                         wg, scale_source(base + DSC, scale_log2), 0, base + BARS, 0,
                         row0 + wrow + g, scale_source(base + DSC, scale), hook)
                # (varlen: rows counted from the packed start, bounded by the sequence's end;
                # the bounds read again rather than kept in registers across the key loop)
                if VARLEN:
                    o_start = i64(both[0][0][b])
                    o_end = i64(both[0][0][b + 1])
                else:
                    o_start = 0
                    o_end = sq
                epilogue(acc_o, o3, row_max, row_sum, o[vb, h], lse, vb, h, o_start + row0,
                         wrow, o_end, resolve(scale_source(base + DSC, scale)), g, t, tid, wg,
                         base + KV, o_factor(base + DSC))
        elif wg < CWG:
            start_rows(acc_o, limit, row_max, row_sum, row0 + wrow, g, sq, sk)
            # (no key: zeros and LSE -inf, whatever the scale)
            no_keys(acc_o, o3, row_max, row_sum, o[vb, h], lse, vb, h, q_start + row0 + wrow,
                    q_start + sq, scale, g, t)

    if SPARSE:   # the ring slots' step words after the config's shared memory (_tma_parts)
        tkernel.tilepy_smem_bytes = cfg.smem_bytes + 8
    return tkernel


def smem_bytes_of(kernel, cfg: WgmmaAttentionConfig) -> int:
    """The dynamic shared memory ``kernel`` (of ``cfg``) launches with: the config's, or what
    its generator recorded as ``tilepy_smem_bytes`` (a block-sparse kernel's step words)."""
    return getattr(kernel, "tilepy_smem_bytes", cfg.smem_bytes)


def _tma_persistent_kernel(cfg: WgmmaAttentionConfig, c, t):
    """The persistent TMA kernel ``tpkernel(q, k, v, o, lse, scale, scale_log2, maps, sched,
    hargs)``: one block per SM slot; its producer warpgroup draws tiles from the ticket
    counter ``sched`` and loads each tile's Q and key blocks into the ring of ``t`` while the
    consumers compute the previous one; ``hargs``: the score hook's run-time arguments
    (block-sparse: with the block mask's, as the grid kernel's)."""
    BM, CONSUMERS, KV, LIMITS, NACC_O = c.BM, c.CONSUMERS, c.KV, c.LIMITS, c.NACC_O
    NACC_S, NO, NS, P_REGS, Q_BYTES, STAGE = c.NACC_S, c.NO, c.NS, c.P_REGS, c.Q_BYTES, c.STAGE
    TILE, align, epilogue, f32, i64, no_keys = c.TILE, c.align, c.epilogue, c.f32, c.i64, c.no_keys
    start_rows, thread_rows, tile_coords = c.start_rows, c.thread_rows, c.tile_coords
    tile_space, DSC, o_factor, put_descales = c.tile_space, c.DSC, c.o_factor, c.put_descales
    resolve, scale_source, split_hargs = c.resolve, c.scale_source, c.split_hargs
    BARS, CREGS, CWG, PREGS, QE0, QF1 = t.BARS, t.CREGS, t.CWG, t.PREGS, t.QE0, t.QF1
    init_ring, load_kv, load_q, tjit = t.init_ring, t.load_kv, t.load_q, t.tjit
    load_v, key_of, put_step = t.load_v, t.key_of, t.put_step
    tma_loop, warpgroup_span = t.tma_loop, t.warpgroup_span
    SPARSE, mask_row = c.SPARSE, c.mask_row

    # ---- persistent TMA: one block per SM slot takes tiles until none is left ------------
    # Tiles are handed out at run time: each block's first is its block index, every further
    # one a ticket from the global counter ``sched[0]`` (+ the grid size), drawn by the
    # producer thread (FlashAttention-3's dynamic scheduler: causal tiles differ in work, and
    # a static stride left blocks up to 1.37x the mean tile load at S1024, 1.15x at the d64
    # shape; see bench/NOTES.md). The producer writes tile j's number into slot j & 1 (TILE_NO)
    # before its Q load (or a plain arrive on Q full when the tile has no key, or no tile is
    # left), so the consumers learn the tile from Q full (QF(j & 1)); they release the buffer
    # (QE) once Q and the number are read. The tile's key blocks follow in ring order K(G),
    # V(G), K(G+1), … with G counting on across tiles, each into slot G & 1 once the slot's
    # previous use (G - 2) is released: the next tile's Q and first blocks load while the
    # current tile computes. The consumers release a tile's last key block's slots after the
    # epilogue, which stages O in that block's stage. The producer of the last block to run
    # out of tiles sets the counter back to zero for the next launch.
    # Block-sparse: a tile visits its mask row's key blocks (tilepy.tile.attention.
    # block_mask_row), each K load's step word written as in the grid kernel (t.put_step:
    # after the slot's release, before its load); the producer writes the tile's number of
    # steps beside the step words (N_STEPS + qi, int32) before its Q load, as the tile
    # number, so the consumers read both after Q full and need no list of their own.
    TILE_NO = (BARS + 8 * cfg.tma_barriers) // 4      # int32 index of the tile-number slots
    N_STEPS = t.STEPS // 4 + 2                        # (after the two step words)

    @inline_device
    def tile_blocks(mask, row0, b, h, kb0, n_kb):
        """``(n_kb, blocks)`` of a tile: its mask row's (block-sparse), else ``kb0`` on."""
        if SPARSE:
            return mask_row(mask, row0 // BM, b, h)
        return n_kb, kb0

    @inline_device
    def split_mask(hook):
        """``(hook arguments, block mask)``: block-sparse hargs carry both."""
        if SPARSE:
            return hook[0], hook[1]
        return hook, ()

    @inline_device
    def q_full(bars, qi):
        return bars + (QF1 if qi else 0)

    @inline_device
    def produce_tiles(base, tiles, sched, tq, tk, tv, sq, sk, n_qb, heads, batch, group,
                      n_tiles, dsc, mask):
        kv_base = base + KV
        bars = base + BARS
        T.fence_proxy_tensormap_acquire(tq)
        T.fence_proxy_tensormap_acquire(tk)
        T.fence_proxy_tensormap_acquire(tv)
        j = 0
        gk = 0
        tile = cuda.blockIdx.x
        while True:
            qi = j & 1
            if j >= 2:            # buffer qi's previous tile (j - 2) released
                MB.mbarrier_wait_parity(bars + QE0 + 8 * qi, ((j >> 1) - 1) & 1)
            tiles[TILE_NO + qi] = tile
            if tile >= n_tiles:
                MB.mbarrier_arrive(q_full(bars, qi))         # no tile left
                break
            nxt = cuda.atomic.add(sched, 0, 1) + cuda.gridDim.x
            b, h, hk, row0, kb0, n_kb, _, _ = tile_coords(tile, n_qb, heads, batch, group, sq,
                                                          sk)
            n_kb, blocks = tile_blocks(mask, row0, b, h, kb0, n_kb)
            if SPARSE:
                tiles[N_STEPS + qi] = np.int32(n_kb)
            if n_kb > 0:
                put_descales(base + DSC + 8 * qi, dsc, b, hk)   # read after Q full
                load_q(base + qi * Q_BYTES, tq, q_full(bars, qi), row0, h, b)
            else:
                MB.mbarrier_arrive(q_full(bars, qi))
            for kb in range(n_kb):
                st = gk & 1
                if gk >= 2:       # the slot's previous use, gk - 2, released
                    MB.mbarrier_wait_parity(bars + 32 * st + 24, ((gk >> 1) - 1) & 1)
                key = key_of(blocks, kb)
                put_step(base, st, blocks, kb)
                load_kv(kv_base + st * STAGE, tk, bars + 32 * st + 8, key, hk, b)
                if gk >= 2:
                    MB.mbarrier_wait_parity(bars + 32 * st + 32, ((gk >> 1) - 1) & 1)
                load_v(kv_base + st * STAGE + TILE, tv, bars + 32 * st + 16, key, hk, b)
                gk += 1
            j += 1
            tile = nxt
        # every block draws until it gets no tile, then counts itself out; the last one out
        # (all tickets drawn) zeroes the counter for the next launch in this stream
        cuda.threadfence()
        if cuda.atomic.add(sched, 1, 1) == cuda.gridDim.x - 1:
            cuda.threadfence()        # every other block's last draw before the reset
            sched[0] = 0
            sched[1] = 0

    @tjit
    def tpkernel(q, k, v, o, lse, scale, scale_log2, maps, sched, hargs):
        sq, sk, heads, batch, group, n_qb, n_tiles = tile_space(q, k)
        dsc, both = split_hargs(hargs)
        hook, mask = split_mask(both)
        tid = cuda.threadIdx.x
        wg, g, t, wrow = thread_rows(tid)

        acc_o = cuda.local.array(NACC_O, f32)
        s = cuda.local.array(NACC_S, f32)
        s3 = cuda.local.array((1, NS, 4), f32)
        o3 = cuda.local.array((1, NO, 4), f32)
        p = cuda.local.array(P_REGS, types.uint32)
        row_max = cuda.local.array((1, 2), f32)
        row_sum = cuda.local.array((1, 2), f32)
        alpha = cuda.local.array((1, 2), f32)
        limit = cuda.local.array(LIMITS, i64)

        smem = cuda.shared.array(0, types.uint16, alignment=align) if align else \
            cuda.shared.array(0, types.uint16)
        tiles = cuda.shared.array(0, types.int32)     # the same bytes: the tile numbers
        base = shared_addr(smem, 0)
        kv_base = base + KV
        bars = base + BARS
        tq = T.tensor_map_address(maps)
        tk = tq + MAP_BYTES
        tv = tk + MAP_BYTES
        if tid == 0:
            init_ring(bars)
            MB.mbarrier_init(bars + QF1, 1)                            # Q full, buffer 1
            MB.mbarrier_init(bars + QE0, CONSUMERS)                    # Q empty, buffer 0
            MB.mbarrier_init(bars + QE0 + 8, CONSUMERS)                # Q empty, buffer 1
            MB.fence_mbarrier_init()
        cuda.syncthreads()
        if wg == CWG:
            W.setmaxnreg_dec(PREGS)
            if tid == CONSUMERS:
                produce_tiles(base, tiles, sched, tq, tk, tv, sq, sk, n_qb, heads, batch,
                              group, n_tiles, dsc, mask)
        else:
            W.setmaxnreg_inc(CREGS)
            j = 0
            gk = 0
            while True:
                qi = j & 1
                MB.mbarrier_wait_parity(q_full(bars, qi), (j >> 1) & 1)
                tile = int(tiles[TILE_NO + qi])    # (a NumPy int32 in the simulator)
                if tile >= n_tiles:
                    break
                b, h, hk, row0, kb0, n_kb, all_first, all_see = tile_coords(
                    tile, n_qb, heads, batch, group, sq, sk)
                # block-sparse: the count the producer wrote; the steps' key blocks come with
                # their K tiles (t.get_step: ``blocks`` only gives the loop its types)
                _, blocks = tile_blocks(mask, row0, b, h, kb0, n_kb)
                if SPARSE:
                    n_kb = i64(tiles[N_STEPS + qi])
                start_rows(acc_o, limit, row_max, row_sum, row0 + wrow, g, sq, sk)
                if n_kb > 0:
                    n_wg, first, see = warpgroup_span(row0, wg, kb0, n_kb, all_first, all_see,
                                                      sq, sk)
                    q_rows = base + qi * Q_BYTES + wg * (64 * 128)
                    tma_loop(acc_o, s, s3, p, limit, row_max, row_sum, alpha, base, tq, tk,
                             tv, b, h, hk, row0, q_rows, blocks, n_kb, n_wg, first, see, t, tid,
                             wg, scale_source(base + DSC + 8 * qi, scale_log2), gk,
                             q_full(bars, qi), (j >> 1) & 1, row0 + wrow + g,
                             scale_source(base + DSC + 8 * qi, scale), hook)
                    # the tile's factors, read before Q's buffer (and theirs) is released
                    scale_t = resolve(scale_source(base + DSC + 8 * qi, scale))
                    o_scale = o_factor(base + DSC + 8 * qi)
                    MB.mbarrier_arrive(bars + QE0 + 8 * qi)              # Q read
                    last = (gk + n_kb - 1) & 1
                    epilogue(acc_o, o3, row_max, row_sum, o[b, h], lse, b, h, row0, wrow, sq,
                             scale_t, g, t, tid, wg, kv_base + last * STAGE, o_scale)
                    W.fence_proxy_async_shared()   # O's smem traffic before the TMA reloads
                    MB.mbarrier_arrive(bars + 32 * last + 24)             # the last K, V
                    MB.mbarrier_arrive(bars + 32 * last + 32)
                    gk += n_kb
                else:
                    MB.mbarrier_arrive(bars + QE0 + 8 * qi)              # the number read
                    no_keys(acc_o, o3, row_max, row_sum, o[b, h], lse, b, h, row0 + wrow, sq,
                            scale, g, t)
                j += 1

    if SPARSE:   # the step words, then the tiles' step counts (_tma_parts, above)
        tpkernel.tilepy_smem_bytes = cfg.smem_bytes + 16
    return tpkernel


#: Lazy rescaling (log2 units): a row's running max is replaced only when a key block raises
#: it by more than this, so ``p = exp2(s·c - m·c)`` is at most about 2**8 (in range for float16
#: and bfloat16 P, no float32 overflow) and O is rescaled on few blocks.
RESCALE_THRESHOLD = 8.0

#: The H200's SM count: the persistent grid's size when the device does not say.
SMS = 132
#: Shared memory of one SM and what the hardware keeps of it per block (sm_90).
SM_SMEM, BLOCK_SMEM_RESERVED = 228 * 1024, 1024


def blocks_per_sm(kernel, args, cfg: WgmmaAttentionConfig) -> int:
    """How many blocks of the compiled kernel fit on one SM: by registers (allocated per
    thread in multiples of 8, 64 K per SM), shared memory and threads (2048). 1 in the
    simulator."""
    if SIMULATOR:
        return 1
    from ..tile.smem import compiled_overload

    regs = -(-int(compiled_overload(kernel, args).regs_per_thread) // 8) * 8
    by_regs = 65536 // (max(regs, 8) * cfg.threads)
    by_smem = SM_SMEM // (smem_bytes_of(kernel, cfg) + BLOCK_SMEM_RESERVED)
    return max(1, min(by_regs, by_smem, 2048 // cfg.threads))


def plan(kernel, cfg: WgmmaAttentionConfig, q, k, v, o, lse, scale: float, *,
         sms: int | None = None, stream=0, alloc=None, hargs=(), varlen=None):
    """``(launch plan, arguments)`` as :func:`tilepy.ops.attention_mma_sync.plan`. A persistent
    config launches ``min(tiles, blocks_per_sm × sms)`` blocks (``sms``: default the device's
    SM count). A TMA config's arguments end with the tensor maps of q, k and v, and a
    persistent one's then with its tile counter (:class:`ScheduledTmaPlan`): buffers from
    ``alloc(nbytes) -> (owner, pointer)`` (default a Numba device array; the op passes
    :func:`tilepy.arrays.byte_allocator`), the maps encoded here and both written by the
    plan's first launch on its stream (as the TMA GEMM's :class:`~tilepy.tile.tma_plan.
    TmaLaunchPlan`, which also makes the maps of other pointers). ``stream``: accepted for
    the callers' sake (nothing is enqueued here). ``hargs``: the score hook's arguments, every
    kernel's last (read by the TMA kernels' hook only; the others take ``()``). ``varlen``:
    ``(sequences, max_seqlen_q)`` for the grid TMA kernel's packed sequences (views of batch
    1): grid z the sequences, x the longest's query blocks."""
    from ..launch import LaunchPlan, sm_count
    from ..tile.smem import allow_dynamic_shared
    from .attention_mma_sync import grid, kernel_args
    from .attention_mma_sync import plan as grid_plan

    if not (cfg.persistent or cfg.tma):
        return grid_plan(kernel, cfg, q, k, v, o, lse, scale, hargs=hargs)
    args = kernel_args(q, k, v, o, lse, scale)
    if cfg.tma:
        encoder = _tma_encoder(cfg, q, k, v)
        raw = encoder(pointer(q), pointer(k), pointer(v))
        maps = device_write.allocate(alloc, raw.size, MAP_ALIGN)
        args += (maps.view((raw.size,), np.uint8),)
        extra = {"alloc": alloc, "initial": (maps, raw)}
        if cfg.persistent:
            counter = device_write.allocate(alloc, COUNTER_BYTES)
            args += (counter.view((2,), np.int32),)
            extra["counter"] = counter
    args += (tuple(hargs),)
    smem = smem_bytes_of(kernel, cfg)
    allow_dynamic_shared(kernel, args, smem)
    if cfg.persistent:
        tiles = -(-q.shape[2] // cfg.block_m) * q.shape[1] * q.shape[0]
        slots = blocks_per_sm(kernel, args, cfg) * (sms if sms is not None else sm_count(SMS))
        blocks = (max(1, min(tiles, slots)), 1, 1)
    elif varlen is not None:
        blocks = grid(cfg, varlen[1], q.shape[1], varlen[0])
    else:
        blocks = grid(cfg, q.shape[2], q.shape[1], q.shape[0])
    if cfg.tma:
        kind = ScheduledTmaPlan if cfg.persistent else TmaLaunchPlan
        return kind(kernel, args, blocks, cfg.threads, smem, encoder,
                    (0, 1, 2), MAPS_ARG, **extra), args
    return LaunchPlan(kernel, args, blocks, cfg.threads, smem), args


#: The tensor maps' place in the TMA kernels' arguments (after q … scale·log2e).
MAPS_ARG = 7


def kernel_argtypes(cfg: WgmmaAttentionConfig, varlen: bool = False) -> tuple:
    """Numba argument types of the config's kernel (offline compilation): the attention
    kernels' (:func:`tilepy.ops.attention_mma_sync.argtypes`; ``varlen``: the cumulative
    lengths first in the hook arguments), with TMA the tensor maps and, persistent, the tile
    counter before the (empty) hook arguments."""
    from .attention_mma_sync import argtypes

    base = argtypes(varlen=varlen)
    hargs = base[-1]
    if cfg.fp8:    # uint8 q, k and Vᵀ; hargs (descales (batch, heads_kv) float32, the hook's)
        u8 = types.Array(types.uint8, 4, "A")
        f32 = types.Array(types.float32, 2, "A")
        base = (u8, u8, u8) + base[3:]
        hargs = types.Tuple((types.Tuple((f32, f32, f32)), hargs))
    return (base[:-1] + ((types.uint8[::1],) if cfg.tma else ())
            + ((types.int32[::1],) if cfg.tma and cfg.persistent else ()) + (hargs,))


def _tma_encoder(cfg: WgmmaAttentionConfig, q, k, v):
    """``encoder(q_ptr, k_ptr, v_ptr)``: the three tensor maps (uint8, 3 × 128) of the TMA
    kernel for views shaped and strided as q, k and v: 4-D (batch, head, seq, head_dim),
    boxes 128 bytes wide (64 16-bit or 128 8-bit columns) of block_m (q) or block_n (k, v)
    rows, 128-byte swizzle; 8-bit, ``v`` is Vᵀ (batch, head, head_dim_v, keys): boxes of
    head_dim_v rows × block_n keys, block_n-byte swizzle."""
    from ..tile import tma as host_tma

    def strides_of(x):
        """The view's byte strides, those of length-1 axes (never stepped along, and free to
        be anything in the view) replaced by a multiple of 16 that TMA accepts."""
        st = list(x.strides)
        for i in range(len(st) - 2, -1, -1):
            if x.shape[i] == 1:
                st[i] = -(-st[i + 1] * x.shape[i + 1] // 16) * 16
        return tuple(st)

    cols = cfg.box_cols
    v_box = (cfg.dv, cfg.block_n) if cfg.fp8 else (cfg.block_n, cols)
    v_swizzle = cfg.block_n if cfg.fp8 else 128      # Vᵀ's rows: block_n bytes
    layouts = [(tuple(x.shape), strides_of(x), box, swz)
               for x, box, swz in ((q, (cfg.block_m, cols), 128), (k, (cfg.block_n, cols), 128),
                                   (v, v_box, v_swizzle))]
    kind = "uint8" if cfg.fp8 else cfg.dtype

    def encoder(q_ptr, k_ptr, v_ptr):
        return np.concatenate([
            host_tma.encode_tiled(ptr, kind, shape, strides, (1, 1) + box, swizzle=swz).data
            for ptr, (shape, strides, box, swz) in zip((q_ptr, k_ptr, v_ptr), layouts)])

    return encoder


def _overlap_entry(name, cfg, causal, has_lse):
    """:func:`tilepy.offline.report_entry` of an overlap / TMA / persistent kernel, with
    ptxas's wgmma notes and :func:`tilepy.offline.sass_in_flight` (the softmax that runs
    between the partial and the full wgmma wait)."""
    from ..offline import report_entry

    return report_entry(name, lambda: wgmma_attention_kernel(cfg, causal, has_lse),
                        kernel_argtypes(cfg), (9, 0, "a"), threads=cfg.threads,
                        launch_bounds=(cfg.threads, 1) if cfg.producer else cfg.threads,
                        sass=True, config=cfg.describe(), smem_bytes=cfg.smem_bytes)


#: The overlap kernels of :func:`compile_reports`: (head_dim, block_n, dtype, causal with LSE).
OVERLAP_REPORTS = ((64, 128, "float16", True), (128, 128, "float16", False),
                   (128, 128, "bfloat16", True))
#: The cp.async overlap kernels of the ``cp_async_schedules`` group: tiles no built-in config
#: falls back to (``config=`` only).
OVERLAP_SCHEDULE_REPORTS = ((64, 64, "float16", False), (128, 64, "float16", False),
                            (128, 64, "bfloat16", True))
#: The plain cp.async kernels (no overlap) of the ``cp_async_schedules`` group: (head_dim,
#: causal with LSE).
PLAIN_REPORTS = ((64, False), (128, False), (128, True))
#: The persistent kernels of :func:`compile_reports`: (head_dim, block_n, overlap, causal with
#: LSE).
PERSISTENT_REPORTS = ((128, 128, False, False), (128, 128, True, True),
                      (64, 64, False, True), (64, 64, True, False))


#: The TMA kernels of :func:`compile_reports`: (head_dim, block_n, causal with LSE, pingpong,
#: producer[, block_m: default 128]).
TMA_REPORTS = ((128, 128, True, True, True), (64, 128, True, True, True, 192),
               # past 128 (the built-in choices) and a head dim not a multiple of 64
               (256, 80, True, True, True), (192, 112, False, True, True),
               (96, 128, True, True, True))
#: The TMA kernels of the ``tma_schedules`` group (the same fields): schedules no built-in
#: config takes (``config=`` only) — without ping-pong or a producer warpgroup, 64-key
#: blocks at head_dim 64, 128 query rows at head_dim 64.
TMA_SCHEDULE_REPORTS = ((128, 128, False, False, False), (64, 64, True, False, False),
                        (128, 128, True, True, False), (128, 128, False, False, True),
                        (64, 128, False, True, True))
#: TMA kernels with V's head dim other than Q's and K's (the built-in choice, ping-pong and a
#: producer warpgroup): (head_dim, head_dim_v, block_n, causal with LSE).
HEAD_DIM_V_REPORTS = ((192, 128, 112, True),)
#: The persistent TMA kernels of :func:`compile_reports` (producer warpgroup, 128-key blocks):
#: (head_dim, causal with LSE, pingpong, block_m).
PERSISTENT_TMA_REPORTS = ((128, True, True, 128), (64, False, False, 192))


#: TMA kernels with a variant in :func:`compile_reports` (the built-in schedules, LSE on):
#: (head_dim, block_m, pingpong, persistent, window, softcap).
VARIANT_REPORTS = ((128, 128, True, False, (255, 0), 50.0), (64, 192, False, True, (255, 0), 0.0))


#: Packed-sequence (varlen) grid TMA kernels of :func:`compile_reports` (the built-in
#: Hopper configs, not persistent): (head_dim, causal with LSE).
VARLEN_REPORTS = ((128, True),)
#: The packed-sequence kernels of the ``tma_schedules`` group (the same fields).
VARLEN_SCHEDULE_REPORTS = ((64, False),)

#: FP8 TMA kernels of :func:`compile_reports` (ping-pong, a producer warpgroup, 128 query
#: rows): (head_dim, block_n, causal with LSE).
#: (head_dim, block_n, causal, fma_exp_every) of the FP8 kernels' reports
FP8_REPORTS = ((128, 128, True, 0), (256, 64, False, 0))
#: The FP8 kernels of the ``tma_schedules`` group (the same fields): every other tile's
#: exponentials on the FMA pipe (not the default), and further built-in shapes.
FP8_SCHEDULE_REPORTS = ((128, 128, False, 2), (128, 128, False, 0), (64, 128, True, 0))


def _variant_entry(d, bm, pingpong, persistent, window, cap):
    from ..offline import report_entry
    from ..tile.attention import softcap_score

    cfg = WgmmaAttentionConfig(d, bm, 128, overlap=True, tma=True, pingpong=pingpong,
                               producer=True, persistent=persistent)
    name = (f"attention_wgmma_tma{'_persistent' if persistent else ''}"
            f"{'_pingpong' if pingpong else ''}{'' if persistent else '_producer'}_window"
            f"{'_softcap' if cap else ''}"
            f"_d{d}_{bm}x128")
    return report_entry(name, lambda: wgmma_attention_kernel(
        cfg, False, True, window, softcap_score(cap) if cap else None),
        kernel_argtypes(cfg), (9, 0, "a"), threads=cfg.threads,
        launch_bounds=(cfg.threads, 1), sass=True, config=cfg.describe(),
        smem_bytes=cfg.smem_bytes)


#: :func:`compile_reports`' groups: the kernels a built-in config or its fallback runs, and the
#: schedules reachable through ``config=`` only (the test suite runs those with --extended).
REPORT_GROUPS = ("tma", "tma_variants", "tma_schedules", "cp_async", "cp_async_schedules")


def compile_reports(group: str = "all"):
    """Offline sm_90a reports of the wgmma attention kernels, by ``group``:

    * ``"tma"``: the TMA kernels of the built-in choices' family (:data:`TMA_REPORTS`, the
      persistent ones :data:`PERSISTENT_TMA_REPORTS`);
    * ``"tma_variants"``: the same family with a window or soft cap
      (:data:`VARIANT_REPORTS`), V's head dim other than Q's (:data:`HEAD_DIM_V_REPORTS`),
      FP8 (:data:`FP8_REPORTS`), packed sequences (:data:`VARLEN_REPORTS`);
    * ``"tma_schedules"``: TMA schedules no built-in config takes
      (:data:`TMA_SCHEDULE_REPORTS`) and further shapes of the variants
      (:data:`FP8_SCHEDULE_REPORTS`, :data:`VARLEN_SCHEDULE_REPORTS`);
    * ``"cp_async"``: the cp.async overlap kernels a TMA config falls back to
      (:data:`OVERLAP_REPORTS`, with :func:`tilepy.offline.sass_in_flight`);
    * ``"cp_async_schedules"``: the other cp.async kernels (:data:`PLAIN_REPORTS`,
      :data:`OVERLAP_SCHEDULE_REPORTS`, :data:`PERSISTENT_REPORTS`);
    * ``"all"``: every group."""
    if group == "all":
        return [rep for g in REPORT_GROUPS for rep in compile_reports(g)]
    if group not in REPORT_GROUPS:
        raise ValueError(f"compile_reports: group must be 'all' or one of {REPORT_GROUPS}, "
                         f"got {group!r}")
    if group.startswith("tma"):
        return _tma_reports(group)
    from ..offline import report_entry
    from .attention_mma_sync import argtypes

    out = []
    schedules = group == "cp_async_schedules"
    for d, causal in PLAIN_REPORTS if schedules else ():
        cfg = WgmmaAttentionConfig(d)
        out.append(report_entry(f"attention_wgmma_d{d}{'_causal_lse' if causal else ''}",
                                lambda cfg=cfg, causal=causal:
                                wgmma_attention_kernel(cfg, causal, causal),
                                argtypes(), (9, 0, "a"), threads=cfg.threads,
                                config=cfg.describe(), smem_bytes=cfg.smem_bytes))
    for d, bn, dtype, causal in OVERLAP_SCHEDULE_REPORTS if schedules else OVERLAP_REPORTS:
        cfg = WgmmaAttentionConfig(d, 128, bn, dtype, overlap=True)
        name = (f"attention_wgmma_overlap_d{d}_{cfg.block_m}x{bn}_{dtype}"
                f"{'_causal_lse' if causal else ''}")
        out.append(_overlap_entry(name, cfg, causal, causal))
    for d, bn, overlap, causal in PERSISTENT_REPORTS if schedules else ():
        cfg = WgmmaAttentionConfig(d, 128, bn, overlap=overlap, persistent=True)
        name = (f"attention_wgmma_persistent{'_overlap' if overlap else ''}_d{d}_128x{bn}"
                f"{'_causal_lse' if causal else ''}")
        out.append(_overlap_entry(name, cfg, causal, causal))
    return out


def compile_reports_tma():
    """:func:`compile_reports` of the ``tma`` group (a target for ``run_in_subprocess``)."""
    return compile_reports("tma")


def compile_reports_tma_variants():
    """:func:`compile_reports` of the ``tma_variants`` group (a ``run_in_subprocess``
    target)."""
    return compile_reports("tma_variants")


def compile_reports_tma_schedules():
    """:func:`compile_reports` of the ``tma_schedules`` group (a ``run_in_subprocess``
    target)."""
    return compile_reports("tma_schedules")


def compile_reports_cp_async():
    """:func:`compile_reports` of the ``cp_async`` group (a target for ``run_in_subprocess``)."""
    return compile_reports("cp_async")


def compile_reports_cp_async_schedules():
    """:func:`compile_reports` of the ``cp_async_schedules`` group (a ``run_in_subprocess``
    target)."""
    return compile_reports("cp_async_schedules")


def _fp8_entry(d, bn, causal, every):
    cfg = WgmmaAttentionConfig(d, 128, bn, "float8_e4m3fn", overlap=True, tma=True,
                               pingpong=True, producer=True, fma_exp_every=every)
    name = (f"attention_wgmma_tma_pingpong_producer_fp8_d{d}_128x{bn}"
            f"{'_causal_lse' if causal else ''}{f'_fma_exp_{every}' if every else ''}")
    return _overlap_entry(name, cfg, causal, causal)


def _tma_reports(group: str):
    """:func:`compile_reports`' ``tma``, ``tma_variants`` or ``tma_schedules`` group."""
    from ..offline import report_entry
    from .attention import HOPPER_CHOICE

    out = []
    if group == "tma_variants":
        out.extend(_variant_entry(*v) for v in VARIANT_REPORTS)
        for d, dv, bn, causal in HEAD_DIM_V_REPORTS:
            cfg = WgmmaAttentionConfig(d, 128, bn, overlap=True, tma=True, pingpong=True,
                                       producer=True, head_dim_v=dv)
            name = (f"attention_wgmma_tma_pingpong_producer_d{d}_v{dv}_128x{bn}"
                    f"{'_causal_lse' if causal else ''}")
            out.append(_overlap_entry(name, cfg, causal, causal))
    else:
        for d, bn, causal, pingpong, producer, *bm in (
                TMA_SCHEDULE_REPORTS if group == "tma_schedules" else TMA_REPORTS):
            cfg = WgmmaAttentionConfig(d, bm[0] if bm else 128, bn, overlap=True, tma=True,
                                       pingpong=pingpong, producer=producer)
            name = (f"attention_wgmma_tma{'_pingpong' if pingpong else ''}"
                    f"{'_producer' if producer else ''}_d{d}_{cfg.block_m}x{bn}"
                    f"{'_causal_lse' if causal else ''}")
            out.append(_overlap_entry(name, cfg, causal, causal))
    if group == "tma":
        for d, causal, pingpong, bm in PERSISTENT_TMA_REPORTS:
            cfg = WgmmaAttentionConfig(d, bm, 128, overlap=True, tma=True, pingpong=pingpong,
                                       producer=True, persistent=True)
            name = (f"attention_wgmma_tma_persistent{'_pingpong' if pingpong else ''}_d{d}_"
                    f"{bm}x128{'_causal_lse' if causal else ''}")
            out.append(_overlap_entry(name, cfg, causal, causal))
        return out
    schedules = group == "tma_schedules"
    out.extend(_fp8_entry(*e) for e in (FP8_SCHEDULE_REPORTS if schedules else FP8_REPORTS))
    for d, causal in VARLEN_SCHEDULE_REPORTS if schedules else VARLEN_REPORTS:
        cfg = WgmmaAttentionConfig(d, **dict(HOPPER_CHOICE[(d, causal)], persistent=False))
        name = (f"attention_wgmma_tma{'_pingpong' if cfg.pingpong else ''}_producer_varlen_d{d}_"
                f"{cfg.block_m}x{cfg.block_n}{'_causal_lse' if causal else ''}")
        out.append(report_entry(name, lambda cfg=cfg, causal=causal: wgmma_attention_kernel(
            cfg, causal, causal, varlen=True), kernel_argtypes(cfg, varlen=True), (9, 0, "a"),
            threads=cfg.threads, launch_bounds=(cfg.threads, 1), sass=True,
            config=cfg.describe(), smem_bytes=cfg.smem_bytes))
    return out
