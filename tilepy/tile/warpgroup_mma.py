"""Warpgroup MMA: the wgmma counterpart of :func:`tilepy.tile.mma.warp_mma`.

One warpgroup (128 threads, four consecutive warps from a warp index divisible by four)
accumulates ``acc[64 × n] (+)= A[64 × k] · B[k × n]`` in float32 registers: ``k / 16`` (8-bit
types: ``k / 32``) ``wgmma.mma_async`` instructions (:mod:`tilepy.ptx.wgmma`), B from shared
memory, A from shared memory or from registers. Everything about the operands' layout — the
matrix descriptors' strides and the byte offset of each k step — is derived here from
:class:`SmemOperand`, the layout TMA writes with 64-element boxes and the 128-byte swizzle (and
:mod:`tilepy.tile.copy`'s swizzled cp.async copies write the same):

* **K-major** (the operand's K is the contiguous dimension: A of a row-major A, B of a
  column-major B, K of ``Q·Kᵀ``): ``k / 64`` boxes, each ``rows`` rows × 64 k (128 bytes a
  row), one after the other. Step ``kk`` is ``(kk // 4) · rows · 128 + (kk % 4) · 32`` bytes
  in; LBO 16 (unused with the swizzle), SBO 1024 (eight rows).
* **MN-major** (M or N contiguous: B of a row-major B, V of ``P·V``, A of a column-major A —
  16-bit operands only): ``rows / 64`` boxes,
  each ``k`` rows (of K) × 64 columns; LBO = ``k · 128`` (the next 64 columns), SBO 1024
  (eight k rows), step ``kk`` at ``kk · 2048``.

The operand's shared address must be 1024-byte aligned (the swizzle is a function of the
address). ``rows`` is the box's row count, which may exceed the 64 rows one warpgroup reads:
a warpgroup's A rows ``64·g …`` start at ``addr + 64·g·128`` and keep the box stride of the
whole tile.

Accumulators: ``acc`` is a ``cuda.local.array(n // 2, float32)``; thread ``t``'s register
``i`` holds (row, col) :func:`accumulator_position` ``(t, i)`` of the 64 × n tile — per warp,
the mma.sync C layout of a 16 × n strip (register ``4·j + e`` is element ``e`` of n8 block
``j``), so the mma.sync row pieces (:mod:`tilepy.tile.online_softmax`,
:mod:`tilepy.tile.epilogue`) apply to a warp's view ``acc3[0, j, e] = acc[4·j + e]``.

The issuing discipline is the caller's (the piece issues, it does not fence or wait):
``fence()`` before a batch whose accumulators or A registers other instructions touched,
``commit()`` after it, ``wait(n)`` (n a literal) before reading, then ``fence_operand(acc)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..inline import device_namespace, inline_device
from ..ptx import wgmma as W
from ..ptx.wgmma_layout import accumulator_position  # noqa: F401  (re-exported: the view)

SWIZZLE = 128            # bytes: the only swizzle the pieces use (64 16-bit elements a row)
BOX = 64                 # 16-bit elements of a box's inner dimension under that swizzle
_AB = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
#: Bytes per element of each dtype the piece takes.
ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class SmemOperand:
    """An operand tile in shared memory as 128-byte-swizzled boxes (module docstring):
    ``rows`` along M (A) or N (B), ``k`` along K (in elements), ``major`` ``"k"`` or
    ``"mn"``; ``elem_bytes`` 2 (float16 / bfloat16: 64 elements a box row, k16 steps) or 1
    (e4m3 / e5m2: 128 elements a box row, k32 steps — the same bytes; K-major only)."""

    rows: int
    k: int
    major: str = "k"
    elem_bytes: int = 2

    def __post_init__(self):
        if self.major not in ("k", "mn"):
            raise ValueError(f"SmemOperand: major must be 'k' or 'mn', got {self.major!r}")
        if self.elem_bytes not in (1, 2):
            raise ValueError(f"SmemOperand: elem_bytes must be 1 or 2, got {self.elem_bytes}")
        if self.elem_bytes == 1 and self.major != "k":
            raise ValueError("SmemOperand: 8-bit operands are K-major only (wgmma has no "
                             "transpose for them)")
        ks, box = self.k_step, self.box
        if self.k % ks or self.k <= 0:
            raise ValueError(f"SmemOperand: k must be a positive multiple of {ks}, got {self.k}")
        inner = self.k if self.major == "k" else self.rows
        if inner % box and inner > box or inner % 16:
            raise ValueError(f"SmemOperand: the contiguous extent ({inner}) must be a multiple "
                             f"of {box} (whole 128-byte boxes)")
        if self.rows % 8:
            raise ValueError(f"SmemOperand: rows must be a multiple of 8, got {self.rows}")

    @property
    def box(self) -> int:
        """Elements of a box row (128 bytes)."""
        return SWIZZLE // self.elem_bytes

    @property
    def k_step(self) -> int:
        """K of one wgmma: 16, or 32 for 8-bit elements (32 bytes of a row either way)."""
        return 32 // self.elem_bytes

    @property
    def lbo(self) -> int:
        return 16 if self.major == "k" else self.k * 2 * BOX

    @property
    def sbo(self) -> int:
        return 8 * SWIZZLE

    @property
    def steps(self) -> tuple[int, int]:
        """``(per_box, per_step)``: k step ``kk`` (k16, or k32 for 8-bit elements) is ``(kk //
        4) · per_box + (kk % 4) · per_step`` bytes from the operand's start (four steps per
        128-byte box row). A box row is 128 bytes even when ``k`` is less than a box."""
        if self.major == "k":
            return self.rows * SWIZZLE, 32
        return 4 * 16 * SWIZZLE, 16 * SWIZZLE

    def step(self, kk: int) -> int:
        """Byte offset of k step ``kk`` from the operand's start."""
        per_box, per_k16 = self.steps
        return (kk // 4) * per_box + (kk % 4) * per_k16

    @property
    def nbytes(self) -> int:
        return self.rows * self.k * self.elem_bytes

    @property
    def row_block_bytes(self) -> int:
        """Bytes from the operand's start to its rows 64 … (an A tile of more than 64 rows,
        one warpgroup's m64 block at a time): 64 rows of a K-major box, or the next box of an
        MN-major one."""
        return 64 * SWIZZLE if self.major == "k" else self.lbo


@functools.cache
def warpgroup_mma(n: int, b: SmemOperand, a: SmemOperand | None = None,
                  dtype: str = "float16", k: int | None = None, b_dtype: str | None = None):
    """Device functions of one warpgroup's ``acc[64 × n] (+)= A · B`` over ``k`` (default
    ``b.k``) in k16 steps (k32 for the 8-bit ``dtype`` s ``"float8_e4m3fn"`` /
    ``"float8_e5m2"``, whose operands are :class:`SmemOperand` s of ``elem_bytes=1``), B as
    ``b`` describes (``b.rows >= n``), A from shared memory as ``a`` describes or, ``a=None``,
    from registers. ``b_dtype``: B's dtype where it differs from A's (only between the 8-bit
    formats: e4m3 · e5m2 and the reverse); default ``dtype``.

    * ``mma(acc, a_addr, b_addr, scale_d)`` (``a`` given): the ``k / k_step`` wgmmas, A's 64 rows
      at shared address ``a_addr``, B at ``b_addr``. ``scale_d`` applies to the first step
      (0: overwrite the accumulators, 1: add to them); the others add.
    * ``mma_pair(acc0, a0, b0, acc1, a1, b1)`` (``a`` given): two products that overwrite
      their accumulators, each its own commit group, both in flight; returns once the first
      has retired (``acc0`` readable), the second still running (``wait(0)`` and
      ``fence_operand(acc1)`` before reading ``acc1``).
    * ``mma2(acc0, acc1, a_addr, b_addr, scale_d)``: two m64 row blocks (A rows 64 … 127 at
      ``a_addr + a.row_block_bytes``) sharing each B step, issued in turn (a 128-row warpgroup
      tile).
    * ``mma_rs(acc, a_regs, b_addr, scale_d)`` (``a=None``): A from ``a_regs``, a uint32
      array of four registers per k step (k16, or k32 for 8-bit types: ``k / 4`` or ``k / 8``
      registers; the rs-form fragment layout of
      :func:`tilepy.ptx.wgmma_layout.a_fragment_position`).
    * ``fence()``, ``commit()``, ``wait(n)``, ``fence_operand(acc)``: the ptx discipline.

    Constants: ``NACC`` (accumulator floats per thread), ``K_STEPS``.
    """
    if dtype not in _AB:
        raise ValueError(f"warpgroup_mma: dtype must be one of {tuple(_AB)}, got {dtype!r}")
    eb = ELEM_BYTES[dtype]
    b_dtype = dtype if b_dtype is None else b_dtype
    if b_dtype != dtype and not (eb == 1 and ELEM_BYTES.get(b_dtype) == 1):
        raise ValueError(f"warpgroup_mma: A and B may differ only between the 8-bit formats, "
                         f"got {dtype!r} and {b_dtype!r}")
    if b.elem_bytes != eb or (a is not None and a.elem_bytes != eb):
        got = f"{b.elem_bytes}-byte" + (f" and {a.elem_bytes}-byte" if a is not None else "")
        raise ValueError(f"warpgroup_mma: {dtype} operands have {eb}-byte elements; the "
                         f"SmemOperands say {got}")
    KSTEP = b.k_step
    if n % 8 or not 8 <= n <= 256 or b.rows < n:
        raise ValueError(f"warpgroup_mma: n must be a multiple of 8 in 8 … 256 within B's "
                         f"{b.rows} rows, got {n}")
    K = b.k if k is None else k
    if K % KSTEP or K > b.k or (a is not None and K > a.k):
        raise ValueError(f"warpgroup_mma: k = {K} must be a multiple of {KSTEP} within the "
                         f"operands")
    KS = K // KSTEP
    NACC = n // 2
    op = W.wgmma(n, _AB[dtype], a_in_registers=a is None,
                 trans_a=a is not None and a.major == "mn", trans_b=b.major == "mn",
                 b_type=_AB[b_dtype] if b_dtype != dtype else None)
    LBO_B, SBO_B = b.lbo, b.sbo
    BOX_B, K16_B = b.steps
    if a is not None:
        LBO_A, SBO_A = a.lbo, a.sbo
        BOX_A, K16_A = a.steps
        M2 = a.row_block_bytes   # the second m64 row block of a 128-row A tile

        @inline_device
        def mma(acc, a_addr, b_addr, scale_d):
            da = W.matrix_descriptor(a_addr, LBO_A, SBO_A, SWIZZLE)
            db = W.matrix_descriptor(b_addr, LBO_B, SBO_B, SWIZZLE)
            for kk in range(KS):
                sa = (kk // 4) * BOX_A + (kk % 4) * K16_A
                sb = (kk // 4) * BOX_B + (kk % 4) * K16_B
                op(acc, W.descriptor_advance(da, sa), W.descriptor_advance(db, sb),
                   scale_d if kk == 0 else 1)

        @inline_device
        def mma_pair(acc0, a0, b0, acc1, a1, b1):
            W.wgmma_fence()
            mma(acc0, a0, b0, 0)
            W.wgmma_commit_group()
            mma(acc1, a1, b1, 0)
            W.wgmma_commit_group()
            W.wgmma_wait_group(1)
            W.wgmma_fence_operand(acc0, NACC)

        @inline_device
        def mma2(acc0, acc1, a_addr, b_addr, scale_d):
            da = W.matrix_descriptor(a_addr, LBO_A, SBO_A, SWIZZLE)
            db = W.matrix_descriptor(b_addr, LBO_B, SBO_B, SWIZZLE)
            for kk in range(KS):
                sa = (kk // 4) * BOX_A + (kk % 4) * K16_A
                dbk = W.descriptor_advance(db, (kk // 4) * BOX_B + (kk % 4) * K16_B)
                op(acc0, W.descriptor_advance(da, sa), dbk, scale_d if kk == 0 else 1)
                op(acc1, W.descriptor_advance(da, M2 + sa), dbk, scale_d if kk == 0 else 1)

        mma_rs = None
    else:
        mma = mma2 = mma_pair = None

        @inline_device
        def mma_rs(acc, a_regs, b_addr, scale_d):
            db = W.matrix_descriptor(b_addr, LBO_B, SBO_B, SWIZZLE)
            for kk in range(KS):
                sb = (kk // 4) * BOX_B + (kk % 4) * K16_B
                op(acc, a_regs[4 * kk], a_regs[4 * kk + 1], a_regs[4 * kk + 2],
                   a_regs[4 * kk + 3], W.descriptor_advance(db, sb), scale_d if kk == 0 else 1)

    @inline_device
    def fence_operand(acc):
        W.wgmma_fence_operand(acc, NACC)

    return device_namespace(
        f"warpgroup_mma({n}, {b}, {a}, {dtype!r}, {K}, {b_dtype!r})", mma=mma, mma2=mma2, mma_pair=mma_pair,
        mma_rs=mma_rs,
        fence=W.wgmma_fence, commit=W.wgmma_commit_group, wait=W.wgmma_wait_group,
        fence_operand=fence_operand, NACC=NACC, K_STEPS=KS)
