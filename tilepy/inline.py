"""``inline_device``: how tilepy makes a device function that is inlined into its callers.

Every tile building block and kernel helper is a small device function called from a kernel
whose sizes are closure constants; it must be inlined, so that fragments stay in registers and
loops over them unroll. Numba offers two ways:

* ``cuda.jit(device=True, inline="always")`` inlines at the level of Numba's IR: every call
  site receives a deep copy of the callee's IR, typed again. The TMA GEMM with a bias + GELU
  epilogue has hundreds of such call sites and took ~100 s to compile (offline, sm_90a).
* ``cuda.jit(device=True, forceinline=True)`` compiles the callee once and marks it
  ``alwaysinline`` for NVVM, which inlines it in LLVM. The same kernel: 6.3 s, and the same PTX
  (7053 instructions, the same multiset), 168 registers, no spills, no local memory
  (bench/NOTES.md, 2026-11-30).

``inline_device`` is the second, and a plain ``cuda.jit(device=True)`` in the CUDA simulator
(whose jit takes no ``forceinline``; it runs the Python function). ``TILEPY_IR_INLINE=1`` (read
at import) switches back to Numba's IR inlining, for comparison.

A device function that is not IR-inlined is compiled for the *current* device's compute
capability; :func:`tilepy.offline.compile_kernel` supplies a stand-in device when there is no
GPU, so offline compile checks keep working.
"""

from __future__ import annotations

import os

from numba import config, cuda

IR_INLINE = os.environ.get("TILEPY_IR_INLINE", "0").strip() not in ("", "0", "false", "no")


def inline_device(fn=None, *, ir: bool = False):
    """``fn`` as a device function inlined into every caller (see the module docstring).

    ``ir=True`` (``@inline_device(ir=True)``) keeps Numba's IR inlining for a function that
    must be part of its caller to type: one that returns an array it creates
    (``cuda.shared.array`` / ``cuda.local.array``) — Numba refuses that of a compiled function.
    """
    if fn is None:
        return lambda f: inline_device(f, ir=ir)
    if config.ENABLE_CUDASIM:
        return cuda.jit(device=True)(fn)
    if IR_INLINE or ir:
        return cuda.jit(device=True, inline="always")(fn)
    return cuda.jit(device=True, forceinline=True)(fn)
