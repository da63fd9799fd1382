"""Which lane holds which (row, column) of each mma.sync operand — the fragment maps.

Plain Python, no Numba: the same tables are used by the mma twins, by the tests that check
them against NumPy, and by kernel writers (``tilepy.tile.layout`` re-exports them).

Notation of the PTX ISA: ``g = lane // 4`` (group), ``t = lane % 4`` (thread in group).
Registers are 32 bits wide; a register of an operand with ``per`` elements per register
(2 for f16/bf16, 1 for tf32, 4 for 8-bit types) holds them with the lowest column (for A) or
row (for B) in the lowest bits.

For an m16nNkK operand (N = 8 always here):

* A (16 × K, row-major fragment): register ``r``, element ``j`` →
  row ``g + 8 * (r % 2)``, column ``per * t + j + (K // 2) * (r // 2)``.
* B (K × 8, "col" layout): register ``r``, element ``j`` →
  row ``per * t + j + (K // 2) * r``, column ``g``.
* C / D with 32-bit elements (f32, s32): register ``r`` → row ``g + 8 * (r // 2)``,
  column ``2 * t + r % 2``.
* C / D with f16 elements (two per register): register ``r``, element ``j`` →
  row ``g + 8 * r``, column ``2 * t + j``.
"""

from __future__ import annotations

import functools

import numpy as np

WARP = 32


@functools.cache
def a_map(k: int, per: int) -> tuple:
    """((lane, reg, elem, row, col), …) for the A operand of m16n8k{k}, ``per`` elements/reg."""
    nregs = 16 * k // WARP // per
    out = []
    for lane in range(WARP):
        g, t = divmod(lane, 4)
        for r in range(nregs):
            for j in range(per):
                out.append((lane, r, j, g + 8 * (r % 2), per * t + j + (k // 2) * (r // 2)))
    return tuple(out)


@functools.cache
def b_map(k: int, per: int) -> tuple:
    """((lane, reg, elem, row, col), …) for the B operand (k × 8) of m16n8k{k}."""
    nregs = k * 8 // WARP // per
    out = []
    for lane in range(WARP):
        g, t = divmod(lane, 4)
        for r in range(nregs):
            for j in range(per):
                out.append((lane, r, j, per * t + j + (k // 2) * r, g))
    return tuple(out)


@functools.cache
def c_map(per: int) -> tuple:
    """((lane, reg, elem, row, col), …) for the 16 × 8 accumulator; ``per`` 1 (32-bit) or 2 (f16)."""
    out = []
    for lane in range(WARP):
        g, t = divmod(lane, 4)
        if per == 1:
            for r in range(4):
                out.append((lane, r, 0, g + 8 * (r // 2), 2 * t + r % 2))
        else:
            for r in range(2):
                for j in range(2):
                    out.append((lane, r, j, g + 8 * r, 2 * t + j))
    return tuple(out)


@functools.cache
def index_arrays(fmap: tuple, per: int):
    """(flat element index into a (32, nregs*per) array, rows, cols) as NumPy arrays."""
    arr = np.array(fmap, dtype=np.int64)
    lanes, regs, elems, rows, cols = arr.T
    nregs = int(regs.max()) + 1
    flat = lanes * (nregs * per) + regs * per + elems
    return flat, rows, cols


def table(fmap: tuple) -> str:
    """A readable lane table: one line per lane listing (reg.elem → row, col)."""
    lines = []
    by_lane: dict[int, list] = {}
    for lane, r, j, row, col in fmap:
        by_lane.setdefault(lane, []).append(f"r{r}.{j}->({row},{col})")
    for lane in sorted(by_lane):
        lines.append(f"lane {lane:2d}: " + " ".join(by_lane[lane]))
    return "\n".join(lines)
