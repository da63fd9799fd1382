"""The shared-memory-staged epilogue (:func:`tilepy.tile.epilogue.store_accumulators_smem`)
against the register epilogue (:func:`~tilepy.tile.epilogue.store_accumulators`) on the same
accumulators, in the simulator: bit-identical outputs (the same math, the same cast; only the
way to global memory differs) for every output kind, one and two m64 accumulators, tiles cut
by the right and bottom edges, output rows 16-byte aligned or not, with bias, beta·c and an
activation."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from numba import cuda

from tilepy.ptx.address import shared_addr
from tilepy.ptx.wgmma_layout import accumulator_position
from tilepy.tile import epilogue as E

pytestmark = pytest.mark.sim
ml_dtypes = pytest.importorskip("ml_dtypes")
NI = 8          # 64 columns: the smallest n the staged epilogue takes
POISON = {"float32": np.uint32(0x7FC00123), "float16": np.uint16(0x7E01),
          "bfloat16": np.uint16(0x7FC1)}


@functools.cache
def kernel(mw, kind, activation, has_bias, has_c):
    staged = E.store_accumulators_smem(mw, NI, kind, activation, has_bias, has_c)
    direct = E.store_accumulators(1, NI, kind, activation, has_bias, has_c)
    nacc = NI * 4
    words = E.staged_bytes(mw, NI) // 4
    f32 = np.float32

    @cuda.jit
    def k(d, base_s, base_r, off, n, c_in, bias, row0, col0, alpha, beta):
        out_s = base_s[:, off:off + n]
        out_r = base_r[:, off:off + n]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        acc0 = cuda.local.array(nacc, f32)
        acc1 = cuda.local.array(nacc, f32)
        for i in range(nacc):
            r = 16 * warp + lane // 4 + 8 * ((i // 2) % 2)
            c = 8 * (i // 4) + 2 * (lane % 4) + i % 2
            acc0[i] = d[r, c]
            acc1[i] = d[64 + r, c] if mw == 2 else f32(0)
        sm = cuda.shared.array(words, np.uint32)
        m = out_s.shape[0]
        staged(acc0, acc1, shared_addr(sm, 0), out_s, row0, col0, m, n, alpha, bias, c_in,
               beta, tid, 3)
        acc3 = cuda.local.array((1, NI, 4), f32)
        for half in range(mw):
            for j in range(NI):
                for q in range(4):
                    acc3[0, j, q] = acc1[4 * j + q] if half else acc0[4 * j + q]
            direct(acc3, out_r, row0 + 64 * half + 16 * warp, col0, m, n, alpha, bias, c_in,
                   beta, lane)

    return k


def test_fragment_positions_match_the_wgmma_layout():
    for t in (0, 5, 37, 127):
        for i in range(NI * 4):
            r, c = accumulator_position(t, i)
            assert (r, c) == (16 * (t // 32) + (t % 32) // 4 + 8 * ((i // 2) % 2),
                              8 * (i // 4) + 2 * (t % 4) + i % 2)


def _storage(kind, m, n, layout):
    """(storage, column offset) of a poisoned (m, n) output (the kernel takes the view: the
    simulator copies only contiguous arrays): 'rows16' rows of 16-byte multiples, 'tight' n
    elements per row, 'offset' rows of 16-byte multiples starting one element past an aligned
    address (so no 16-byte vector store is possible)."""
    bits = np.uint32 if kind == "float32" else np.uint16
    per = 16 // np.dtype(bits).itemsize
    if layout == "tight":
        return np.full((m, n), POISON[kind], bits), 0
    width = -(-(n + 1) // per) * per + per
    return np.full((m, width), POISON[kind], bits), int(layout == "offset")


@pytest.mark.parametrize("kind,mw,layout,activation,has_bias,has_c", [
    ("float16", 1, "rows16", "gelu", True, True),
    ("bfloat16", 2, "tight", "relu", True, False),
    ("float32", 1, "offset", None, False, True),
    ("float32", 2, "rows16", "silu", True, True),
    ("float16", 2, "offset", None, False, False)])
def test_staged_equals_register_epilogue(kind, mw, layout, activation, has_bias, has_c):
    rng = np.random.default_rng()
    m, n = 40 + 64 * (mw - 1), 77           # tile rows 8 … 8 + 64·mw and cols 16 … 79: both edges cut
    d = rng.standard_normal((128, 64)).astype(np.float32)
    (base_s, off), (base_r, _) = _storage(kind, m, n, layout), _storage(kind, m, n, layout)
    if kind == "float32":
        c_in = rng.standard_normal((m, n)).astype(np.float32)
    else:
        c_in = rng.standard_normal((m, n)).astype(
            np.float16 if kind == "float16" else ml_dtypes.bfloat16).view(np.uint16)
    bias = rng.standard_normal(n).astype(np.float32)
    if kind == "float32":
        base_s, base_r = base_s.view(np.float32), base_r.view(np.float32)
    kernel(mw, kind, activation, has_bias, has_c)[1, 128](
        d, base_s, base_r, off, n, c_in, bias, 8, 16, np.float32(1.5), np.float32(-0.5))
    bits = np.uint32 if kind == "float32" else np.uint16
    assert (base_s.view(bits) == base_r.view(bits)).all(), \
        np.argwhere(base_s.view(bits) != base_r.view(bits))[:5]
    assert (base_r.view(bits)[:, :off] == POISON[kind]).all()
    assert (base_r.view(bits)[:, off + n:] == POISON[kind]).all()
    written = base_r.view(bits)[:, off:off + n] != POISON[kind]
    assert written[8:, 16:].all() and not written[:8].any() and not written[:, :16].any()
