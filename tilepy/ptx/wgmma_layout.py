"""The layouts wgmma reads, in plain Python: matrix descriptors, swizzles, canonical shared-memory
layouts, the register maps, and a NumPy model of one warpgroup MMA.

No Numba here: the same functions serve the simulator twins in :mod:`tilepy.ptx.wgmma`, the
TMA twin (the swizzle), the CPU tests, and kernel writers who stage operands.

Register maps (``w = thread // 32``, ``l = thread % 32``, thread = index within the warpgroup):

* accumulator (:func:`accumulator_position`): ``acc[i]`` holds
  D[16w + l//4 + 8·((i//2) % 2), 8·(i//4) + 2·(l%4) + i%2];
* A in registers (:func:`a_fragment_position`): register r, half h (low half first) holds
  A[16w + l//4 + 8·(r%2), 2·(l%4) + h + 8·(r//2)] — the mma.m16n8k16 A fragment per warp, so
  a 64×16 slice of an accumulator converts to an A fragment with no shuffles.

Shared memory (2-byte elements — 1-byte e4m3 / e5m2 ones are K-major only, k 0 … 31, 16 to a
core-matrix row: ``elem_bytes=1`` in :func:`canonical_offset`; offsets in bytes from the descriptor's start address before the
swizzle, :func:`canonical_offset`; LBO / SBO the descriptor's leading / stride byte offsets;
``mn`` the row of A or the column of B, ``k`` 0 … 15):

================  ==========================================================================
K-major, none     (mn%8)·16 + (mn//8)·SBO + (k%8)·2 + (k//8)·LBO   (8×16-byte core matrices)
K-major, S bytes  (mn%8)·S + (mn//8)·SBO + 2k                       (LBO unused)
MN-major, none    (mn%8)·2 + (mn//8)·SBO + (k%8)·16 + (k//8)·LBO
MN-major, S       (mn % (S/2))·2 + (mn // (S/2))·LBO + (k%8)·S + (k//8)·SBO
================  ==========================================================================

then the swizzle (:func:`swizzle`): byte address bits [4, 4+b) ^= bits [7, 7+b) with
b = 1, 2, 3 for 32, 64, 128 bytes — the pattern TMA writes.

Provenance: K-major with no swizzle and with the 128-byte swizzle matched an H200 in an
experiment outside this code base (shared/numba-cuda-notes.md); the 32 / 64-byte swizzles and
the MN-major rows follow the PTX ISA and CUTLASS's canonical GMMA layouts, and are checked on
the hardware only by the GPU tests of tests/test_ptx_wgmma.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

WARPGROUP = 128
M = 64
K = 16
SWIZZLES = (0, 32, 64, 128)
_MODE = {0: 0, 128: 1, 64: 2, 32: 3}  # swizzle bytes -> the descriptor's 2-bit field
_BYTES = {v: k for k, v in _MODE.items()}
_ELEM_BYTES = 2


# ---- plain Python: descriptors, swizzles, layouts -----------------------------------------------

class Descriptor(NamedTuple):
    """A decoded matrix descriptor; addresses and offsets in bytes."""

    start: int
    lbo: int
    sbo: int
    base_offset: int
    swizzle: int


def _check_field(name, value):
    value = int(value)
    if value < 0 or value >= 1 << 18:
        raise ValueError(f"{name} is {value}; it must lie in [0, 2**18) (14 bits of 16-byte units)")
    if value % 16:
        raise ValueError(f"{name} is {value}; it must be a multiple of 16 bytes")
    return value


def encode_descriptor(start: int, lbo: int, sbo: int, swizzle: int = 0,
                      base_offset: int = 0) -> int:
    """The 64-bit wgmma matrix descriptor (PTX ISA "Matrix Descriptor Format").

    bits 0–13: start address >> 4; 16–29: leading-dimension byte offset >> 4; 32–45: stride
    byte offset >> 4; 49–51: base offset; 62–63: swizzle (0 none, 1 128B, 2 64B, 3 32B).
    ``start`` is a shared-state-space byte address (< 2**18), ``lbo`` / ``sbo`` byte offsets;
    all three multiples of 16. ``swizzle`` in bytes: 0, 32, 64 or 128.
    """
    if swizzle not in _MODE:
        raise ValueError(f"swizzle is {swizzle!r}; it must be one of {SWIZZLES} (bytes)")
    if not 0 <= int(base_offset) < 8:
        raise ValueError(f"base_offset is {base_offset}; it must be 0 … 7")
    start = _check_field("start address", start)
    lbo = _check_field("leading byte offset", lbo)
    sbo = _check_field("stride byte offset", sbo)
    return ((start >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32)
            | (int(base_offset) << 49) | (_MODE[swizzle] << 62))


def decode_descriptor(desc: int) -> Descriptor:
    d = int(desc) & (2**64 - 1)
    return Descriptor(start=(d & 0x3FFF) << 4, lbo=((d >> 16) & 0x3FFF) << 4,
                      sbo=((d >> 32) & 0x3FFF) << 4, base_offset=(d >> 49) & 7,
                      swizzle=_BYTES[(d >> 62) & 3])


def swizzle(addr, swizzle_bytes: int):
    """The swizzled byte address: bits [4, 4+b) ^= bits [7, 7+b), b = log2(swizzle_bytes / 16).

    Works on ints and on NumPy integer arrays. ``swizzle_bytes`` 0 is the identity. Within one
    atom of 8 rows × S bytes (rows S bytes apart, atom S·8-byte aligned) this is: the 16-byte
    chunk c of row r moves to chunk c ^ (r % 8) (128B), c ^ ((r // 2) % 4) (64B),
    c ^ ((r // 4) % 2) (32B).
    """
    if swizzle_bytes == 0:
        return addr
    if swizzle_bytes not in _MODE:
        raise ValueError(f"swizzle is {swizzle_bytes!r}; it must be one of {SWIZZLES} (bytes)")
    mask = swizzle_bytes // 16 - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def canonical_offset(mn, k, *, swizzle: int, lbo: int, sbo: int, mn_major: bool = False,
                     elem_bytes: int = 2):
    """Byte offset (before the swizzle) of element (mn, k) of an operand from the
    descriptor's start address, in the canonical layout the descriptor describes.

    ``mn`` is the row of A (0 … 63) or the column of B (0 … N-1); ``k`` is 0 … 15 for 2-byte
    elements, 0 … 31 for 1-byte ones (``elem_bytes=1``: e4m3 / e5m2, K-major only — the same
    16-byte core-matrix rows, 16 elements each). Works on ints and NumPy arrays. See the module
    docstring for the table.
    """
    if swizzle not in _MODE:
        raise ValueError(f"swizzle is {swizzle!r}; it must be one of {SWIZZLES} (bytes)")
    per_chunk = 16 // elem_bytes        # elements in a 16-byte core-matrix row
    if not mn_major:
        if swizzle == 0:
            return (mn % 8) * 16 + (mn // 8) * sbo + (k % per_chunk) * elem_bytes + \
                (k // per_chunk) * lbo
        return (mn % 8) * swizzle + (mn // 8) * sbo + k * elem_bytes
    if elem_bytes != 2:
        raise ValueError("MN-major operands are 16-bit only (wgmma has no transpose for 8-bit "
                         "types)")
    if swizzle == 0:
        return (mn % 8) * 2 + (mn // 8) * sbo + (k % 8) * 16 + (k // 8) * lbo
    per_row = swizzle // _ELEM_BYTES
    return (mn % per_row) * 2 + (mn // per_row) * lbo + (k % 8) * swizzle + (k // 8) * sbo


def accumulator_position(thread: int, i: int) -> tuple[int, int]:
    """(row, col) in the 64×N tile of accumulator register ``i`` of warpgroup thread ``thread``."""
    w, lane = divmod(thread, 32)
    return 16 * w + lane // 4 + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2


def a_fragment_position(thread: int, reg: int, half: int, elem_bytes: int = 2) -> tuple[int, int]:
    """(row, col) in the 64×16 A tile of half ``half`` of A register ``reg`` (rs form); with
    ``elem_bytes=1`` (e4m3 / e5m2) in the 64×32 A tile of byte ``half`` (0 … 3, bits 8·half …)
    of register ``reg``: each register holds four consecutive k of one row (mma.sync
    m16n8k32's A layout per warp)."""
    w, lane = divmod(thread, 32)
    if elem_bytes == 1:
        return 16 * w + lane // 4 + 8 * (reg % 2), 4 * (lane % 4) + half + 16 * (reg // 2)
    return 16 * w + lane // 4 + 8 * (reg % 2), 2 * (lane % 4) + half + 8 * (reg // 2)


@functools.cache
def _acc_index(n: int):
    rows = np.empty((WARPGROUP, n // 2), np.int64)
    cols = np.empty((WARPGROUP, n // 2), np.int64)
    for t in range(WARPGROUP):
        for i in range(n // 2):
            rows[t, i], cols[t, i] = accumulator_position(t, i)
    return rows, cols


@functools.cache
def _a_index(elem_bytes: int = 2):
    per = 4 // elem_bytes           # elements a register
    rows = np.empty((WARPGROUP, 4, per), np.int64)
    cols = np.empty((WARPGROUP, 4, per), np.int64)
    for t in range(WARPGROUP):
        for r in range(4):
            for h in range(per):
                rows[t, r, h], cols[t, r, h] = a_fragment_position(t, r, h, elem_bytes)
    return rows, cols


#: Element types of wgmma operands: 16-bit (K = 16 an instruction) and 8-bit (K = 32).
TYPES_16 = ("f16", "bf16")
TYPES_8 = ("e4m3", "e5m2")


def k_of(ab: str) -> int:
    """The K of one wgmma instruction for element type ``ab``: 16, or 32 for 8-bit types."""
    return 32 if ab in TYPES_8 else K


def _decode_elements(bits: np.ndarray, ab: str) -> np.ndarray:
    if ab in TYPES_8:
        from ._sim import fp8_values

        return fp8_values(4 if ab == "e4m3" else 5)[bits.astype(np.uint8)]
    bits = bits.astype(np.uint16)
    if ab == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def operand_addresses(desc: int, rows: int, mn_major: bool, elem_bytes: int = 2) -> np.ndarray:
    """(rows, K) int64 shared addresses of the elements an operand descriptor addresses (K =
    16 for 2-byte elements, 32 for 1-byte ones)."""
    d = decode_descriptor(desc)
    if d.base_offset and d.swizzle:
        raise ValueError(f"descriptor base offset {d.base_offset}: the simulator models base "
                         "offset 0 only (tiles that start where the swizzle pattern repeats)")
    mn = np.arange(rows, dtype=np.int64)[:, None]
    k = np.arange(32 if elem_bytes == 1 else K, dtype=np.int64)[None, :]
    off = canonical_offset(mn, k, swizzle=d.swizzle, lbo=d.lbo, sbo=d.sbo, mn_major=mn_major,
                           elem_bytes=elem_bytes)
    return swizzle(d.start + off, d.swizzle)


def make_warpgroup_model(n: int, ab: str, a_in_registers: bool = False,
                         trans_a: bool = False, trans_b: bool = False, b_type: str | None = None):
    """Pure NumPy model of one ``wgmma.mma_async m64n{n}k{K}.f32.{ab}.{b_type}`` over a
    warpgroup (K = 16 for f16 / bf16, 32 for e4m3 / e5m2; ``b_type`` defaults to ``ab``; the
    8-bit types mix, the 16-bit ones do not).

    ``model(threads, fetch)``: ``threads`` is the 128 threads' argument tuples
    ``(acc_values, a_regs or None, desc_a, desc_b, scale_d)``; ``fetch(addresses)`` returns the
    elements (uint16, or uint8 for 8-bit types) at an int64 array of shared addresses. Returns
    the 128 threads' new accumulator arrays (float32, n/2 each).
    """
    b_type = ab if b_type is None else b_type
    if ab in TYPES_16:
        if b_type != ab:
            raise ValueError(f"wgmma {ab} takes B of the same type, got {b_type!r}")
    elif ab in TYPES_8:
        if b_type not in TYPES_8:
            raise ValueError(f"wgmma {ab}: B must be e4m3 or e5m2, got {b_type!r}")
        if trans_a or trans_b:
            raise ValueError("8-bit wgmma takes its operands K-major (no transpose)")
    else:
        raise ValueError(f"wgmma element type {ab!r}: f16, bf16, e4m3 or e5m2")
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma N is {n}; it must be a multiple of 8 in 8 … 256")
    rows, cols = _acc_index(n)
    eb = 1 if ab in TYPES_8 else 2

    def model(threads, fetch):
        if len(threads) != WARPGROUP or any(v is None for v in threads):
            missing = [i for i, v in enumerate(threads) if v is None]
            raise RuntimeError(f"wgmma: warpgroup threads {missing} did not take part")
        first = threads[0]
        for i, v in enumerate(threads):
            if v[2:] != first[2:]:
                raise ValueError(f"wgmma: thread {i} of the warpgroup passed descriptors / "
                                 f"scale_d {v[2:]} but thread 0 passed {first[2:]}; they must "
                                 "be the same in every thread")
        _, _, desc_a, desc_b, scale_d = first
        with np.errstate(invalid="ignore", over="ignore"):
            if a_in_registers:
                regs = np.array([v[1] for v in threads], dtype=np.uint32)  # (128, 4)
                width = 8 * eb                                            # bits an element
                mask = np.uint32((1 << width) - 1)
                parts = np.stack([(regs >> np.uint32(width * j)) & mask
                                  for j in range(4 // eb)], axis=-1)
                ar, ac = _a_index(eb)
                a_bits = np.zeros((M, k_of(ab)), np.uint16)
                a_bits[ar, ac] = parts.astype(np.uint16)
                a = _decode_elements(a_bits, ab)
            else:
                a = _decode_elements(fetch(operand_addresses(desc_a, M, trans_a, eb)), ab)
            b = _decode_elements(fetch(operand_addresses(desc_b, n, trans_b, eb)),
                                 b_type).T  # (K, n)
            d = a @ b
            if scale_d:
                c = np.zeros((M, n), np.float64)
                c[rows, cols] = np.array([v[0] for v in threads], dtype=np.float32)
                d = d + c
            return list(d.astype(np.float32)[rows, cols])

    return model
