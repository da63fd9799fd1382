"""Warp-level tensor-core MMA (``mma.sync.aligned``), one warp computes D = A·B + C.

Every function here is called by all 32 lanes of a warp together, each with its own registers
of the fragments; the fragment maps (which lane holds which element) are in
:mod:`tilepy.ptx.fragments` and in each docstring below. Operands are 32-bit registers: A and
B packed (two f16/bf16, one tf32, four 8-bit values per uint32), accumulators as float32 /
int32 scalars, or as packed f16x2 uint32 for f16 accumulation. The accumulator inputs are tied
to the outputs (one register each, no copies): write ``c0, c1, c2, c3 = mma(..., c0, c1, c2, c3)``.

Names: ``mma_m16n8k{K}_{inputs}_{accumulator}``.
"""

from __future__ import annotations

import functools

import numpy as np

from . import _sim
from .asm import instruction
from .fragments import WARP, a_map, b_map, c_map, index_arrays

# ---- element decoders for the twins (uint32 registers → float64 / int64 values) -------------


def _dec_f16(regs):
    return regs.view(np.float16).astype(np.float64)


def _dec_bf16(regs):
    bits = regs.view(np.uint16).astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32).astype(np.float64)


def _dec_tf32(regs):
    # tf32 operands use the sign, exponent and top 10 mantissa bits; the low 13 are ignored.
    return (regs & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def _dec_s8(regs):
    return regs.view(np.int8).astype(np.int64)


def _fp8_table(exp_bits: int) -> np.ndarray:
    return _sim.fp8_values(exp_bits)


def _dec_e4m3(regs):
    return _fp8_table(4)[regs.view(np.uint8)]


def _dec_e5m2(regs):
    return _fp8_table(5)[regs.view(np.uint8)]


_DECODERS = {"f16": (_dec_f16, 2), "bf16": (_dec_bf16, 2), "tf32": (_dec_tf32, 1),
             "s8": (_dec_s8, 4), "e4m3": (_dec_e4m3, 4), "e5m2": (_dec_e5m2, 4)}


def _gather(fmap, per, values, shape, dtype):
    flat, rows, cols = index_arrays(fmap, per)
    m = np.zeros(shape, dtype=dtype)
    m[rows, cols] = values.reshape(-1)[flat]
    return m


def _scatter(fmap, per, matrix, lane):
    flat, rows, cols = index_arrays(fmap, per)
    n = len(flat) // WARP
    mine = flat[lane * n:(lane + 1) * n] - lane * n  # this lane's elements, in register order
    out = np.empty(n, dtype=matrix.dtype)
    out[mine] = matrix[rows[lane * n:(lane + 1) * n], cols[lane * n:(lane + 1) * n]]
    return out


def make_warp_model(k, ab, acc):
    """Pure NumPy model of one mma variant over a whole warp.

    ``model(regs)`` takes a (32, n_args) array-like — row ``lane`` holds that lane's arguments
    in call order (A registers, B registers, accumulators) — and returns a list of 32 tuples,
    the outputs of each lane. The twin is this model fed through a warp exchange; the GPU
    tests compare hardware with this same model.
    """
    decode, per = _DECODERS[ab]
    amap, bmap = a_map(k, per), b_map(k, per)
    n_a = 16 * k // WARP // per
    n_b = k * 8 // WARP // per
    n_c = 2 if acc == "f16" else 4
    cmap = c_map(2 if acc == "f16" else 1)
    kind = np.int64 if ab == "s8" else np.float64

    def u32_regs(lanes, lo, hi):
        return np.array([[int(v) & 0xFFFFFFFF for v in r[lo:hi]] for r in lanes], np.uint32)

    def model(lanes):
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf inputs are legitimate
            return _model(lanes)

    def _model(lanes):
        if any(len(r) != n_a + n_b + n_c for r in lanes) or len(lanes) != WARP:
            raise TypeError(f"mma m16n8k{k} {ab}->{acc} takes {n_a + n_b + n_c} registers "
                            "per lane from 32 lanes")
        a = _gather(amap, per, decode(u32_regs(lanes, 0, n_a)), (16, k), kind)
        b = _gather(bmap, per, decode(u32_regs(lanes, n_a, n_a + n_b)), (k, 8), kind)
        if acc == "f32":
            c = np.array([r[n_a + n_b:] for r in lanes], dtype=np.float32).astype(np.float64)
            d = (a @ b + _gather(cmap, 1, c, (16, 8), np.float64)).astype(np.float32)
            return [tuple(np.float32(x) for x in _scatter(cmap, 1, d, ln)) for ln in range(WARP)]
        if acc == "s32":
            c = np.array([[int(v) for v in r[n_a + n_b:]] for r in lanes], dtype=np.int64)
            d = a @ b + _gather(cmap, 1, c, (16, 8), np.int64)
            d = ((d + 2**31) % 2**32 - 2**31).astype(np.int32)  # s32 adds wrap
            return [tuple(np.int32(x) for x in _scatter(cmap, 1, d, ln)) for ln in range(WARP)]
        c = _gather(cmap, 2, _dec_f16(u32_regs(lanes, n_a + n_b, n_a + n_b + n_c)), (16, 8),
                    np.float64)
        d = (a @ b + c).astype(np.float16)
        out = []
        for ln in range(WARP):
            mine = _scatter(cmap, 2, d, ln).view(np.uint16)
            out.append(tuple(_sim.join_halves(mine[2 * i], mine[2 * i + 1]) for i in range(2)))
        return out

    return model


def _make_twin(name, model):
    def twin(*regs):
        return _sim.warp_collective(regs, model)

    twin.__name__ = name + "_twin"
    twin.warp_model = model
    return twin


_PTX_TYPE = {"f16": "f16", "bf16": "bf16", "tf32": "tf32", "s8": "s8", "e4m3": "e4m3",
             "e5m2": "e5m2", "f32": "f32", "s32": "s32"}


def _declare(k, ab, acc, min_cc, doc):
    per = _DECODERS[ab][1]
    n_a = 16 * k // WARP // per
    n_b = k * 8 // WARP // per
    n_c = 2 if acc == "f16" else 4
    name = f"mma_m16n8k{k}_{ab}_{acc}"
    d = ",".join(f"${i}" for i in range(n_c))
    a = ",".join(f"${n_c + i}" for i in range(n_a))
    b = ",".join(f"${n_c + n_a + i}" for i in range(n_b))
    template = (f"mma.sync.aligned.m16n8k{k}.row.col.{_PTX_TYPE[acc]}.{_PTX_TYPE[ab]}."
                f"{_PTX_TYPE[ab]}.{_PTX_TYPE[acc]} {{{d}}}, {{{a}}}, {{{b}}}, {{{d}}};")
    acc_kind = {"f32": "f32", "s32": "i32", "f16": "u32"}[acc]
    fn = instruction(
        name, template,
        outs=(acc_kind,) * n_c,
        ins=("u32",) * (n_a + n_b) + (acc_kind,) * n_c,
        tie=tuple(range(n_c)),
        convergent=True, min_cc=min_cc,
        twin=_make_twin(name, make_warp_model(k, ab, acc)),
        doc=doc,
    )
    return fn


_F16_DOC = """{what}, one warp.

Arguments per lane: A {a} uint32 (two {t} each), B {b} uint32, then the accumulator.
A (16×{k}): reg r, half j → row g + 8·(r % 2), col 2t + j + {h}·(r // 2).
B ({k}×8):  reg r, half j → row 2t + j + {h}·r, col g.
C/D: {c}.
(g = lane // 4, t = lane % 4; the lower half of a register holds the lower index.)"""

_C32 = "four {0} → (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)"
_C16 = ("two uint32, each two f16: reg r, half j → (g + 8r, 2t + j)")

mma_m16n8k16_f16_f32 = _declare(16, "f16", "f32", (8, 0), _F16_DOC.format(
    what="D[16×8] f32 = A f16 · B f16 + C f32", a=4, b=2, t="f16", k=16, h=8,
    c=_C32.format("float32")))
mma_m16n8k16_bf16_f32 = _declare(16, "bf16", "f32", (8, 0), _F16_DOC.format(
    what="D[16×8] f32 = A bf16 · B bf16 + C f32", a=4, b=2, t="bf16", k=16, h=8,
    c=_C32.format("float32")))
mma_m16n8k16_f16_f16 = _declare(16, "f16", "f16", (8, 0), _F16_DOC.format(
    what="D[16×8] f16 = A f16 · B f16 + C f16 (f16 accumulation)", a=4, b=2, t="f16", k=16,
    h=8, c=_C16))
mma_m16n8k8_f16_f32 = _declare(8, "f16", "f32", (8, 0), _F16_DOC.format(
    what="D[16×8] f32 = A f16 · B f16 + C f32 (k = 8)", a=2, b=1, t="f16", k=8, h=4,
    c=_C32.format("float32")))
mma_m16n8k8_bf16_f32 = _declare(8, "bf16", "f32", (8, 0), _F16_DOC.format(
    what="D[16×8] f32 = A bf16 · B bf16 + C f32 (k = 8)", a=2, b=1, t="bf16", k=8, h=4,
    c=_C32.format("float32")))
mma_m16n8k8_tf32_f32 = _declare(8, "tf32", "f32", (8, 0), """\
D[16×8] f32 = A tf32 · B tf32 + C f32, one warp.

Arguments per lane: A 4 uint32, B 2 uint32 (each the bits of one float32, of which tf32 uses
the top 19: see ``cvt_tf32``), then four float32 accumulators.
A (16×8): reg r → row g + 8·(r % 2), col t + 4·(r // 2).
B (8×8):  reg r → row t + 4r, col g.
C/D: four float32 → (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).""")

_I8_DOC = """D[16×8] {acc} = A {t} · B {t} + C {acc}, one warp.

Arguments per lane: A 4 uint32 (four {t} bytes each), B 2 uint32, then four {acc} accumulators.
A (16×32): reg r, byte j → row g + 8·(r % 2), col 4t + j + 16·(r // 2).
B (32×8):  reg r, byte j → row 4t + j + 16r, col g.
C/D: four {acc} → (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).{extra}"""

mma_m16n8k32_s8_s32 = _declare(32, "s8", "s32", (8, 0), _I8_DOC.format(
    acc="int32", t="int8", extra=" Sums wrap modulo 2**32."))
mma_m16n8k32_e4m3_f32 = _declare(32, "e4m3", "f32", (8, 9), _I8_DOC.format(
    acc="float32", t="e4m3", extra="\nNeeds compute capability 8.9+."))
mma_m16n8k32_e5m2_f32 = _declare(32, "e5m2", "f32", (8, 9), _I8_DOC.format(
    acc="float32", t="e5m2", extra="\nNeeds compute capability 8.9+."))

ALL = {f.spec.name: f for f in (
    mma_m16n8k16_f16_f32, mma_m16n8k16_bf16_f32, mma_m16n8k16_f16_f16, mma_m16n8k8_f16_f32,
    mma_m16n8k8_bf16_f32, mma_m16n8k8_tf32_f32, mma_m16n8k32_s8_s32, mma_m16n8k32_e4m3_f32,
    mma_m16n8k32_e5m2_f32)}

__all__ = sorted(ALL)
