"""Per-thread PTX math and conversions: fast ex2 / rcp / tanh, packing to and from 16-bit pairs,
and 8-bit floats (e4m3 / e5m2) to and from pairs.

Each function is one inline-PTX instruction (or a small braces block) declared through
:func:`tilepy.ptx.asm.instruction`; under ``NUMBA_ENABLE_CUDASIM=1`` its Python twin runs
instead. The twins are per-thread (no warp exchange) and are exact models of the instruction
except for the three ``.approx`` functions, whose twins return the correctly rounded result
(hardware is within the error bound stated in each docstring).

Packed pairs: a ``uint32`` holding two 16-bit values keeps ``lo`` in bits 0–15 and ``hi`` in
bits 16–31 — the order in which mma.sync fragments hold the lower and the higher column.
Every ``*x2`` function here takes and returns its halves in the order ``(lo, hi)``.

Special values (PTX ISA):

* ``.ftz``: subnormal inputs are read as zero of the same sign, subnormal results are flushed
  to zero of the same sign.
* NaN in gives NaN out. The conversions to f16/bf16 write the canonical NaN ``0x7fff`` in
  that half (:data:`CANONICAL_NAN`) and ``cvt.f32.f16`` writes ``0x7fffffff``, whatever the
  payload. ``cvt_tf32`` is the exception: it clears the low 13 bits of a NaN like those of any
  other value (no rounding), so a NaN whose payload lies only in those bits comes out as the
  bits of ±inf — which is what a tf32 mma would read from that NaN anyway. All of this was
  seen on an H200 (sm_90).
* The conversions round to nearest, ties to even (``.rn``) except ``cvt_tf32`` (``.rna``:
  ties away from zero); they keep subnormal results and overflow to ±inf.
"""

from __future__ import annotations

import numpy as np

from . import _sim
from .asm import instruction

#: The NaN bit patterns the conversions to 16-bit halves and cvt.f32.f16 write.
CANONICAL_NAN = {"f16": 0x7FFF, "bf16": 0x7FFF, "f32": 0x7FFFFFFF}

_F32_MIN_NORMAL = np.float32(2.0 ** -126)


#: The smallest float32 magnitude that cvt.rn.f16.f32 rounds to infinity (65504 + half an ulp).
_F16_TO_INF = np.float32(65520.0)


# ---- twin helpers -------------------------------------------------------------------------

def _f32(x, who) -> np.float32:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (float, np.floating)):
        raise TypeError(f"tilepy.ptx.{who}: expected a float (float32), got {type(x).__name__}")
    return np.float32(x)


def _f16(x, who) -> np.float16:
    if not isinstance(x, np.float16):
        raise TypeError(f"tilepy.ptx.{who}: expected a float16, got {type(x).__name__}")
    return x


def _u32(x, who) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"tilepy.ptx.{who}: expected an integer (uint32), got {type(x).__name__}")
    return int(x) & 0xFFFFFFFF


def _is_subnormal(x: np.float32) -> bool:
    return x != 0 and abs(x) < _F32_MIN_NORMAL


def _ftz(x: np.float32) -> np.float32:
    """Flush a float32 subnormal to zero of the same sign (``.ftz``)."""
    if _is_subnormal(x):
        return np.float32(np.copysign(np.float32(0), x))
    return x


def f32_to_f16_bits(x) -> int:
    """cvt.rn.f16.f32 as bits: round to nearest even, subnormal results kept, NaN → 0x7fff."""
    x = np.float32(x)
    if np.isnan(x):
        return CANONICAL_NAN["f16"]
    if abs(x) >= _F16_TO_INF:    # rounds to ±inf (decided here: no overflow warning to hush)
        return 0xFC00 if x < 0 else 0x7C00
    return int(x.astype(np.float16).view(np.uint16))


def f32_to_bf16_bits(x) -> int:
    """cvt.rn.bf16.f32 as bits: round to nearest even, NaN → 0x7fff."""
    x = np.float32(x)
    if np.isnan(x):
        return CANONICAL_NAN["bf16"]
    return _sim.f32_to_bf16_bits(x)


def f32_to_tf32_bits(x) -> int:
    """cvt.rna.tf32.f32 as bits: keep 10 mantissa bits, ties away from zero, low 13 bits 0.

    ±inf stay; a NaN has its low 13 bits cleared without rounding (seen on sm_90: 0x7fbfffff →
    0x7fbfe000, 0x7f800001 → 0x7f800000).
    """
    b = _sim.f32_bits(x)
    if (b & 0x7F800000) == 0x7F800000:
        return b & 0xFFFFE000  # ±inf unchanged; NaN truncated
    # Adding half of the dropped range to the magnitude rounds ties away from zero; a carry
    # out of the mantissa bumps the exponent (the largest finite values round to inf).
    return (b + 0x1000) & 0xFFFFE000


# ---- twins ------------------------------------------------------------------------------

def _ex2_twin(x):
    x = _ftz(_f32(x, "ex2_approx"))
    if np.isnan(x):
        return np.float32(np.nan)
    if x >= 128:                 # past float32's range (decided here: no warning to hush)
        return np.float32(np.inf)
    return _ftz(np.float32(np.exp2(np.float64(x))))


def _fmax_nan_twin(a, b):
    a, b = _f32(a, "fmax_nan"), _f32(b, "fmax_nan")
    if np.isnan(a) or np.isnan(b):
        return np.array([CANONICAL_NAN["f32"]], np.uint32).view(np.float32)[0]
    if a == b:   # +0 is larger than -0
        return a if not np.signbit(a) else b
    return a if a > b else b


def _rcp_twin(x):
    x = _ftz(_f32(x, "rcp_approx"))
    if np.isnan(x):
        return np.float32(np.nan)
    if x == 0:
        return np.float32(np.copysign(np.inf, x))
    with np.errstate(over="ignore", under="ignore"):
        r = np.float32(1.0 / np.float64(x))
    return _ftz(r)


def _tanh_twin(x):
    x = _f32(x, "tanh_approx")
    if np.isnan(x):
        return np.float32(np.nan)
    return np.float32(np.tanh(np.float64(x)))


def _cvt_f16x2_twin(lo, hi):
    lo, hi = _f32(lo, "cvt_f16x2_f32"), _f32(hi, "cvt_f16x2_f32")
    return _sim.join_halves(f32_to_f16_bits(lo), f32_to_f16_bits(hi))


def _cvt_bf16x2_twin(lo, hi):
    lo, hi = _f32(lo, "cvt_bf16x2_f32"), _f32(hi, "cvt_bf16x2_f32")
    return _sim.join_halves(f32_to_bf16_bits(lo), f32_to_bf16_bits(hi))


def _pack_f16x2_twin(lo, hi):
    lo, hi = _f16(lo, "pack_f16x2"), _f16(hi, "pack_f16x2")
    return _sim.join_halves(_sim.f16_bits(lo), _sim.f16_bits(hi))


def _unpack_f16x2_twin(word):
    lo, hi = _sim.halves(_u32(word, "unpack_f16x2"))
    return _sim.bits_f16(lo), _sim.bits_f16(hi)


def _f16_bits_to_f32(b: int) -> np.float32:
    """cvt.f32.f16: exact; NaN → canonical 0x7fffffff (what the hardware writes)."""
    h = _sim.bits_f16(b)
    if np.isnan(h):
        return _sim.bits_f32(CANONICAL_NAN["f32"])
    return np.float32(h)


def _unpack_f16x2_f32_twin(word):
    lo, hi = _sim.halves(_u32(word, "unpack_f16x2_f32"))
    return _f16_bits_to_f32(lo), _f16_bits_to_f32(hi)


def _unpack_bf16x2_f32_twin(word):
    lo, hi = _sim.halves(_u32(word, "unpack_bf16x2_f32"))
    return _sim.bf16_bits_to_f32(lo), _sim.bf16_bits_to_f32(hi)


def _u16(x, who) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"tilepy.ptx.{who}: expected an integer (uint16), got {type(x).__name__}")
    return int(x) & 0xFFFF


def _fp8x2_twin(exp_bits, who):
    def twin(lo, hi):
        lo, hi = _f32(lo, who), _f32(hi, who)
        return np.uint16(_sim.f32_to_fp8_bits(lo, exp_bits)
                         | (_sim.f32_to_fp8_bits(hi, exp_bits) << 8))

    twin.__name__ = f"_{who}_twin"
    return twin


def _f16x2_of_fp8x2_twin(exp_bits, who):
    def twin(pair):
        b = _u16(pair, who)
        vals = _sim.fp8_values(exp_bits)
        halves = []
        for code in (b & 0xFF, b >> 8):
            v = vals[code]
            halves.append(CANONICAL_NAN["f16"] if v != v else _sim.f16_bits(np.float16(v)))
        return _sim.join_halves(*halves)

    twin.__name__ = f"_{who}_twin"
    return twin


def _f32_as_u32_twin(x):
    return np.uint32(_sim.f32_bits(_f32(x, "f32_as_u32")))


def _u32_as_f32_twin(w):
    return _sim.bits_f32(_u32(w, "u32_as_f32"))


def _cvt_tf32_twin(x):
    return np.uint32(f32_to_tf32_bits(_f32(x, "cvt_tf32")))


# ---- declarations -----------------------------------------------------------------------

ex2_approx = instruction(
    "ex2_approx", "ex2.approx.ftz.f32 $0, $1;", outs=("f32",), ins=("f32",),
    twin=_ex2_twin, doc="""ex2_approx(x: float32) -> float32 ≈ 2**x  (ex2.approx.ftz.f32)

Maximum relative error 2**-22 (about 2 ulp) over the whole range (PTX ISA). Subnormal x counts
as 0 (result 1.0); results below 2**-126 are flushed to +0; ex2(-inf) = +0, ex2(+inf) = +inf,
NaN → NaN. The simulator twin returns the correctly rounded value.""")

fmax_nan = instruction(
    "fmax_nan", "max.NaN.f32 $0, $1, $2;", outs=("f32",), ins=("f32", "f32"), min_cc=(8, 0),
    twin=_fmax_nan_twin, doc="""fmax_nan(a: float32, b: float32) -> float32  (max.NaN.f32)

The larger of a and b, the canonical NaN 0x7fffffff if either is NaN; +0 is larger than -0.
One FMNMX instruction, where ``a if (a > b or a != a) else b`` compiles to two compares and a
select.
Compute capability 8.0+.""")

rcp_approx = instruction(
    "rcp_approx", "rcp.approx.ftz.f32 $0, $1;", outs=("f32",), ins=("f32",),
    twin=_rcp_twin, doc="""rcp_approx(x: float32) -> float32 ≈ 1/x  (rcp.approx.ftz.f32)

Maximum error 1 ulp (PTX ISA). Subnormal x counts as zero of its sign: rcp(±0) = rcp(±subnormal)
= ±inf; rcp(±inf) = ±0; results below 2**-126 in magnitude (|x| > 2**126) are flushed to zero
of x's sign; NaN → NaN. The simulator twin returns the correctly rounded value.""")

tanh_approx = instruction(
    "tanh_approx", "tanh.approx.f32 $0, $1;", outs=("f32",), ins=("f32",), min_cc=(7, 5),
    twin=_tanh_twin, doc="""tanh_approx(x: float32) -> float32 ≈ tanh(x)  (tanh.approx.f32)

One MUFU instruction where the library's ``math.tanh`` compiles to a sequence of exponentials,
reciprocals and a polynomial branch. Relative error about 1e-5 (the GPU test checks below
2**-14 over ±20 and at the specials); tanh(±inf) = ±1, tanh(±0) = ±0, NaN → NaN. Compute
capability 7.5+. The simulator twin returns the correctly rounded value.""")

cvt_f16x2_f32 = instruction(
    # PTX puts operand a in the UPPER half: pass hi ($2) first.
    "cvt_f16x2_f32", "cvt.rn.f16x2.f32 $0, $2, $1;", outs=("u32",), ins=("f32", "f32"),
    min_cc=(8, 0), twin=_cvt_f16x2_twin,
    doc="""cvt_f16x2_f32(lo: float32, hi: float32) -> uint32  (cvt.rn.f16x2.f32)

Rounds both to float16 (nearest, ties to even; overflow → ±inf; f16 subnormals kept; NaN →
0x7fff) and packs them: ``lo`` in bits 0–15, ``hi`` in bits 16–31. Compute capability 8.0+.""")

cvt_bf16x2_f32 = instruction(
    "cvt_bf16x2_f32", "cvt.rn.bf16x2.f32 $0, $2, $1;", outs=("u32",), ins=("f32", "f32"),
    min_cc=(8, 0), twin=_cvt_bf16x2_twin,
    doc="""cvt_bf16x2_f32(lo: float32, hi: float32) -> uint32  (cvt.rn.bf16x2.f32)

Rounds both to bfloat16 (nearest, ties to even; overflow → ±inf; subnormals kept; NaN →
0x7fff) and packs them: ``lo`` in bits 0–15, ``hi`` in bits 16–31. Compute capability 8.0+.""")

pack_f16x2 = instruction(
    "pack_f16x2", "mov.b32 $0, {$1, $2};", outs=("u32",), ins=("f16", "f16"),
    twin=_pack_f16x2_twin,
    doc="""pack_f16x2(lo: float16, hi: float16) -> uint32  (mov.b32 d, {lo, hi})

The bits of ``lo`` in bits 0–15 and of ``hi`` in bits 16–31; no conversion, every bit kept.""")

unpack_f16x2 = instruction(
    "unpack_f16x2", "mov.b32 {$0, $1}, $2;", outs=("f16", "f16"), ins=("u32",),
    twin=_unpack_f16x2_twin,
    doc="""unpack_f16x2(word: uint32) -> (lo: float16, hi: float16)  (mov.b32 {lo, hi}, d)

``lo`` from bits 0–15, ``hi`` from bits 16–31; every bit kept. Inverse of pack_f16x2.""")

unpack_f16x2_f32 = instruction(
    "unpack_f16x2_f32",
    # One instruction a line, so that the PTX (and the offline probe's line count) reads well.
    "{\n\t.reg .b16 tp_lo, tp_hi;\n\tmov.b32 {tp_lo, tp_hi}, $2;\n"
    "\tcvt.f32.f16 $0, tp_lo;\n\tcvt.f32.f16 $1, tp_hi;\n\t}",
    outs=("f32", "f32"), ins=("u32",), twin=_unpack_f16x2_f32_twin,
    doc="""unpack_f16x2_f32(word: uint32) -> (lo: float32, hi: float32)  (cvt.f32.f16 ×2)

The float16 in bits 0–15 (``lo``) and bits 16–31 (``hi``) widened to float32: exact, f16
subnormals become normal float32, ±0 and ±inf kept, NaN → canonical 0x7fffffff.""")

unpack_bf16x2_f32 = instruction(
    "unpack_bf16x2_f32", "shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000;",
    outs=("f32", "f32"), ins=("u32",), twin=_unpack_bf16x2_f32_twin,
    doc="""unpack_bf16x2_f32(word: uint32) -> (lo: float32, hi: float32)  (shl / and)

The bfloat16 in bits 0–15 (``lo``) and bits 16–31 (``hi``) as float32: bfloat16 is the top
half of a float32, so this is exact and keeps every bit (NaN payloads, subnormals, -0).""")

cvt_tf32 = instruction(
    "cvt_tf32", "cvt.rna.tf32.f32 $0, $1;", outs=("u32",), ins=("f32",),
    min_cc=(8, 0), twin=_cvt_tf32_twin,
    doc="""cvt_tf32(x: float32) -> uint32  (cvt.rna.tf32.f32)

The bits of ``x`` rounded to tf32 (10 mantissa bits: nearest, ties away from zero; the low 13
bits are 0; the largest finite values round to ±inf; subnormals kept; ±inf kept; a NaN has
its low 13 bits cleared, so a payload only there gives the bits of ±inf), the operand format of
the tf32 mma. Compute capability 8.0+.""")

_FP8_DOC = """{name}(lo: float32, hi: float32) -> uint16  (cvt.rn.satfinite.{t}x2.f32)

Rounds both to {t} (nearest, ties to even; a magnitude past the largest finite value, ±inf
included, saturates to ±{top}; NaN → 0x7f; the sign kept, −0 included) and packs them: ``lo``
in bits 0–7, ``hi`` in bits 8–15 (the order of consecutive bytes in memory). Compute
capability 8.9+. The NaN code is the simulator's model (0x7f), not yet seen on a GPU."""

cvt_e4m3x2_f32 = instruction(
    # PTX puts operand a in the UPPER byte: pass hi ($2) first.
    "cvt_e4m3x2_f32", "cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", outs=("u16",),
    ins=("f32", "f32"), min_cc=(8, 9), twin=_fp8x2_twin(4, "cvt_e4m3x2_f32"),
    doc=_FP8_DOC.format(name="cvt_e4m3x2_f32", t="e4m3", top=448))

cvt_e5m2x2_f32 = instruction(
    "cvt_e5m2x2_f32", "cvt.rn.satfinite.e5m2x2.f32 $0, $2, $1;", outs=("u16",),
    ins=("f32", "f32"), min_cc=(8, 9), twin=_fp8x2_twin(5, "cvt_e5m2x2_f32"),
    doc=_FP8_DOC.format(name="cvt_e5m2x2_f32", t="e5m2", top=57344))

_FP8_UP_DOC = """{name}(pair: uint16) -> uint32  (cvt.rn.f16x2.{t}x2)

The two {t} codes of ``pair`` (bits 0–7 → bits 0–15, bits 8–15 → bits 16–31) as float16:
exact (every {t} value is a float16), ±0 and ±inf kept, NaN → 0x7fff (the simulator's model;
the hardware may keep a NaN's sign or payload: the GPU test says). Compute capability
8.9+."""

cvt_f16x2_e4m3x2 = instruction(
    "cvt_f16x2_e4m3x2", "cvt.rn.f16x2.e4m3x2 $0, $1;", outs=("u32",), ins=("u16",),
    min_cc=(8, 9), twin=_f16x2_of_fp8x2_twin(4, "cvt_f16x2_e4m3x2"),
    doc=_FP8_UP_DOC.format(name="cvt_f16x2_e4m3x2", t="e4m3"))

cvt_f16x2_e5m2x2 = instruction(
    "cvt_f16x2_e5m2x2", "cvt.rn.f16x2.e5m2x2 $0, $1;", outs=("u32",), ins=("u16",),
    min_cc=(8, 9), twin=_f16x2_of_fp8x2_twin(5, "cvt_f16x2_e5m2x2"),
    doc=_FP8_UP_DOC.format(name="cvt_f16x2_e5m2x2", t="e5m2"))

f32_as_u32 = instruction(
    "f32_as_u32", "mov.b32 $0, $1;", outs=("u32",), ins=("f32",), twin=_f32_as_u32_twin,
    doc="""f32_as_u32(x: float32) -> uint32  (mov.b32)

The bits of ``x``, every bit kept (NaN payloads, -0). For non-negative floats the integer
order is the float order, and a positive NaN sorts above +inf: an integer ``atomic.max`` of
these bits is a float max that keeps NaN.""")

u32_as_f32 = instruction(
    "u32_as_f32", "mov.b32 $0, $1;", outs=("f32",), ins=("u32",), twin=_u32_as_f32_twin,
    doc="""u32_as_f32(bits: uint32) -> float32  (mov.b32)

The float32 whose bits are ``bits``, every bit kept. Inverse of f32_as_u32.""")

ALL = {f.spec.name: f for f in (
    ex2_approx, rcp_approx, tanh_approx, cvt_f16x2_f32, cvt_bf16x2_f32, pack_f16x2, unpack_f16x2,
    unpack_f16x2_f32, unpack_bf16x2_f32, cvt_tf32, cvt_e4m3x2_f32, cvt_e5m2x2_f32,
    cvt_f16x2_e4m3x2, cvt_f16x2_e5m2x2, f32_as_u32, u32_as_f32)}
