"""Warp shuffles (``shfl.sync``) over the full warp, for float32, int32 and uint32 values.

Every function here is called by all 32 lanes of a warp together (member mask
``0xffffffff``); each lane gives its own ``value`` and its own second argument, and gets back
the ``value`` of one *source lane*, of the same type (float32 stays float32 with all its bits —
-0.0, NaN payloads and subnormals included; int32 stays int32; uint32 stays uint32):

=====================================  ===========================  ======================
function                               source lane ``j``            when ``j`` is invalid
=====================================  ===========================  ======================
``shfl_xor(value, lane_mask)``         ``lane ^ b``                 never
``shfl_down(value, delta)``            ``lane + b``                 ``j > 31``
``shfl_up(value, delta)``              ``lane - b``                 ``j < 0``
``shfl_idx(value, src_lane)``          ``b``                        never
=====================================  ===========================  ======================

with ``b = argument & 31``: as the PTX ISA specifies (``bval[4:0] = b[4:0]``), only the low
five bits of the second argument count, so ``shfl_idx(v, 33)`` reads lane 1 and
``shfl_down(v, 32)`` reads the lane itself. A lane whose source lane is invalid (outside the
warp) keeps its own ``value``. The PTX emitted is ``shfl.sync.{bfly,down,up,idx}.b32 d, a, b,
c, 0xffffffff`` with clamp ``c`` = 0x1f (bfly, down, idx) or 0x0 (up).

The second argument may be any integer type (it is converted to 32 bits) and may differ from
lane to lane. Anything but float32 / int32 / uint32 as ``value`` is refused at typing time on
the GPU (a TypingError naming the function and the types it takes) and with a TypeError in the
simulator; to shuffle float16 pairs, bfloat16 pairs or float64, move their bits through
uint32 (``tilepy.ptx.math.pack_f16x2`` …).

Under ``NUMBA_ENABLE_CUDASIM=1`` each name is a Python twin that exchanges ``(value,
argument)`` among the warp's simulated lanes (:func:`tilepy.ptx._sim.warp_exchange`, one
block barrier per call) and applies the rule above. In the simulator a plain Python ``int``
(``cuda.threadIdx.x`` there, an int32 on the GPU) is accepted when it fits 32 bits, and comes
back as a Python ``int``. Every twin carries ``.warp_model(values, arg)``: the pure rule over a
whole warp (32 values, and one argument or 32), which the GPU tests compare hardware with.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import _sim
from .asm import SIMULATOR, call_asm, pick

FULL_MASK = 0xFFFFFFFF
WARP = _sim.WARP

# name -> (PTX mode, clamp value c, name of the second argument)
_MODES = {
    "shfl_xor": ("bfly", 0x1F, "lane_mask"),
    "shfl_down": ("down", 0x1F, "delta"),
    "shfl_up": ("up", 0x0, "delta"),
    "shfl_idx": ("idx", 0x1F, "src_lane"),
}

_TAKES = "float32, int32 or uint32"


def ptx_template(name: str) -> str:
    """The inline-PTX text emitted for ``name`` (for offline checks and docs)."""
    mode, clamp, _ = _MODES[name]
    return f"shfl.sync.{mode}.b32 $0, $1, $2, {clamp:#x}, {FULL_MASK:#x};"


def source_lane(name: str, lane: int, arg: int) -> int:
    """The lane whose value ``lane`` receives from ``name`` with argument ``arg`` (PTX rule)."""
    mode, clamp, _ = _MODES[name]
    b = int(arg) & 0x1F  # bval[4:0] = b[4:0]
    # Full warp, no segments: maxLane = clamp, minLane = 0 (PTX ISA, shfl.sync).
    if mode == "up":
        j = lane - b
        ok = j >= clamp
    elif mode == "down":
        j = lane + b
        ok = j <= clamp
    elif mode == "bfly":
        j = lane ^ b
        ok = j <= clamp
    else:  # idx
        j = b
        ok = j <= clamp
    return j if ok else lane


def _check_value(name: str, value):
    ok = isinstance(value, (np.float32, np.int32, np.uint32)) or (
        type(value) is int and -(2**31) <= value < 2**32)
    if not ok:
        _, _, argname = _MODES[name]
        kind = type(value).__name__
        raise TypeError(f"tilepy.ptx.{name}(value, {argname}): value must be {_TAKES}; "
                        f"got {kind}" + (" (a Python float is float64 on the GPU: use "
                                          "numpy.float32)" if kind == "float" else ""))


def _check_arg(name: str, arg):
    if isinstance(arg, (bool, np.bool_)) or not isinstance(arg, (int, np.integer)):
        _, _, argname = _MODES[name]
        raise TypeError(f"tilepy.ptx.{name}(value, {argname}): {argname} must be an integer; "
                        f"got {type(arg).__name__}")


def _make_model(name):
    def warp_model(values, arg):
        """Pure rule over one warp: ``values`` of lanes 0…31; ``arg`` one int or 32 ints."""
        vals = list(values)
        if len(vals) != WARP:
            raise ValueError(f"{name}.warp_model takes the values of {WARP} lanes, "
                             f"got {len(vals)}")
        if isinstance(arg, (Sequence, np.ndarray)):
            args = [int(a) for a in arg]
            if len(args) != WARP:
                raise ValueError(f"{name}.warp_model: {len(args)} arguments for {WARP} lanes")
        else:
            args = [int(arg)] * WARP
        return [vals[source_lane(name, lane, args[lane])] for lane in range(WARP)]

    warp_model.__name__ = name + "_warp_model"
    return warp_model


def _make_twin(name):
    mode, clamp, argname = _MODES[name]

    def twin(value, arg):
        _check_value(name, value)
        _check_arg(name, arg)
        lanes = _sim.warp_exchange((value, int(arg)))
        lane = _sim.lane_id()
        return lanes[source_lane(name, lane, lanes[lane][1])][0]

    twin.__name__ = name
    twin.__qualname__ = name
    twin.__doc__ = f"{name}(value, {argname}) -> same type as value (simulator twin)."
    twin.warp_model = _make_model(name)
    twin.ptx = ptx_template(name)
    return twin


def _make_intrinsic(name):
    from numba import types
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    _, _, argname = _MODES[name]
    template = ptx_template(name)
    kinds = {types.float32: "f32", types.int32: "i32", types.uint32: "u32"}
    letter = {"f32": "f", "i32": "r", "u32": "r"}

    def typer(typingctx, value, arg):
        kind = kinds.get(value)
        if kind is None or not isinstance(arg, types.Integer):
            raise TypingError(f"tilepy.ptx.{name}(value, {argname}) takes a {_TAKES} value "
                              f"and an integer {argname}; got ({value}, {arg})")
        constraints = f"={letter[kind]},{letter[kind]},r"

        def codegen(context, builder, signature, args):
            b = context.cast(builder, args[1], signature.args[1], types.int32)
            return call_asm(builder, template, constraints, (kind,), (kind, "i32"),
                            [args[0], b], side_effect=False, convergent=True)[0]

        return value(value, arg), codegen

    typer.__name__ = name
    typer.__qualname__ = name
    return intrinsic(typer)


def _declare(name, doc):
    twin = _make_twin(name)
    fn = pick(None if SIMULATOR else _make_intrinsic(name), twin)
    try:
        fn.__doc__ = doc
    except AttributeError:  # pragma: no cover
        pass
    return fn


shfl_xor = _declare("shfl_xor", """shfl_xor(value, lane_mask) -> value's type (float32, int32, uint32)

Butterfly: lane ``i`` gets the value of lane ``i ^ (lane_mask & 31)``. Called by the whole
warp. PTX: shfl.sync.bfly.b32 d, a, b, 0x1f, 0xffffffff.""")

shfl_down = _declare("shfl_down", """shfl_down(value, delta) -> value's type (float32, int32, uint32)

Lane ``i`` gets the value of lane ``i + (delta & 31)``; lanes for which that exceeds 31 keep
their own value. Called by the whole warp. PTX: shfl.sync.down.b32 d, a, b, 0x1f, 0xffffffff.""")

shfl_up = _declare("shfl_up", """shfl_up(value, delta) -> value's type (float32, int32, uint32)

Lane ``i`` gets the value of lane ``i - (delta & 31)``; lanes for which that is below 0 keep
their own value. Called by the whole warp. PTX: shfl.sync.up.b32 d, a, b, 0x0, 0xffffffff.""")

shfl_idx = _declare("shfl_idx", """shfl_idx(value, src_lane) -> value's type (float32, int32, uint32)

Lane ``i`` gets the value of lane ``src_lane & 31`` (``src_lane`` may differ per lane).
Called by the whole warp. PTX: shfl.sync.idx.b32 d, a, b, 0x1f, 0xffffffff.""")

ALL = {"shfl_xor": shfl_xor, "shfl_down": shfl_down, "shfl_up": shfl_up, "shfl_idx": shfl_idx}

__all__ = ["FULL_MASK", *ALL]


# ---- offline probes (tilepy.ptx.probes): one shuffle of a float32 per kernel ------------------

def _register_probes():
    from . import probes

    def argtypes():
        from numba import types

        return (types.float32[:], types.int32[:])

    for name, fn in ALL.items():
        src = (f"def probe_{name}(f32s, i32s):\n"
               f"    f32s[0] = fn(f32s[1], i32s[0])\n")
        namespace = {"fn": fn}
        exec(compile(src, f"<probe {name}>", "exec"), namespace)
        probes.EXTRA[name] = (namespace[f"probe_{name}"], argtypes,
                              f"shfl.sync.{_MODES[name][0]}.b32", None)


_register_probes()
