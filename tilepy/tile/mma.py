"""Warp-tile MMA: acc[MI, NI] += A[MI] · B[NI] over register fragments, one warp."""

from __future__ import annotations

import functools

from ..inline import inline_device
from ..ptx.mma import mma_m16n8k16_bf16_f32, mma_m16n8k16_f16_f32

_MMA = {"float16": mma_m16n8k16_f16_f32, "bfloat16": mma_m16n8k16_bf16_f32}


@functools.cache
def warp_mma(mi: int, ni: int, dtype: str = "float16"):
    """``run(acc, a_frag, b_frag, buf)``: acc[i, j, 0..3] += A_i · B_j for all i < mi, j < ni.

    ``acc`` is a (mi, ni, 4) float32 local array (the m16n8 accumulator layout of
    :mod:`tilepy.ptx.fragments`), ``a_frag[buf]`` (mi, 4) and ``b_frag[buf]`` (ni, 2) uint32 as
    filled by :func:`tilepy.tile.copy.load_a_fragments` / ``load_b_fragments``. All sizes are
    closure constants: the loops unroll and everything stays in registers.
    """
    try:
        mma = _MMA[dtype]
    except KeyError:
        raise ValueError(f"warp_mma: dtype must be one of {sorted(_MMA)}, got {dtype!r}") from None

    @inline_device
    def run(acc, a_frag, b_frag, buf):
        for i in range(mi):
            for j in range(ni):
                acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma(
                    a_frag[buf, i, 0], a_frag[buf, i, 1], a_frag[buf, i, 2], a_frag[buf, i, 3],
                    b_frag[buf, j, 0], b_frag[buf, j, 1],
                    acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])

    return run
