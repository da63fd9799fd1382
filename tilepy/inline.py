"""``inline_device``: how tilepy makes a device function that is inlined into its callers.

Every tile building block and kernel helper is a small device function called from a kernel
whose sizes are closure constants; it must be inlined, so that fragments stay in registers and
loops over them unroll. Numba offers two ways:

* ``cuda.jit(device=True, inline="always")`` inlines at the level of Numba's IR: every call
  site receives a deep copy of the callee's IR, typed again. A kernel with hundreds of such
  call sites (the TMA GEMM with a bias + GELU epilogue) spends most of its compile time there.
* ``cuda.jit(device=True, forceinline=True)`` compiles the callee once and marks it
  ``alwaysinline`` for NVVM, which inlines it in LLVM: the same kernel compiles an order of
  magnitude faster, to the same PTX with the same registers (bench/NOTES.md: compile time,
  LLVM-level inlining).

``inline_device`` is the second, and a plain ``cuda.jit(device=True)`` in the CUDA simulator
(whose jit takes no ``forceinline``; it runs the Python function). ``TILEPY_IR_INLINE=1`` (read
at import) switches back to Numba's IR inlining, for comparison.

A device function that is not IR-inlined is compiled when its caller is typed, for the
*current device's* compute capability, which needs a CUDA driver. So that kernels built from
tilepy's pieces still compile offline (``cuda.compile_ptx``, ``tilepy.offline``) where there
is no driver, importing this module (outside the simulator) wraps Numba-CUDA's
``get_current_device`` lookup: when it fails for want of a driver or device while a kernel is
being compiled, it answers with a stand-in device of the compute capability that kernel is
compiled for. With a GPU, and outside a compile, nothing changes.
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


def written_out(signature: str, body: list, namespace: dict, name: str):
    """An inlined device function ``def <signature>:`` with the given body lines, made from
    source. For loops over a thread's register arrays (accumulators, fragments) with
    constant indices: NVVM unrolls a loop fully only below a size threshold (about 80
    iterations of a multiply and an index), and an array indexed by a loop it keeps stays in
    local memory until ptxas promotes it — the copies between it and a wgmma's registers
    then serialise the wgmmas (ptxas note C7514). Written out, every index is a constant."""
    src = "\n".join([f"def {signature}:"] + ["    " + line for line in body])
    exec(compile(src, f"<{name}>", "exec"), namespace)  # noqa: S102 - our own generated source
    return inline_device(namespace[signature.split("(")[0]])


def device_namespace(name: str, **members):
    """A module object holding a piece's device functions and constants, so that kernels call
    them as attributes (``ring.wait(bars, s, ph)``, ``ring.STAGES``): Numba resolves an
    attribute of a module at compile time, as it does ``math.exp``, so the call is a direct
    call of that device function and a constant a closure constant. (A plain object or a
    named tuple of device functions is not typable inside a kernel.)"""
    import types

    ns = types.ModuleType(name)
    for key, value in members.items():
        setattr(ns, key, value)
    return ns


class _StandInDevice:
    """What Numba-CUDA's device-function compile asks of the current device: its compute
    capability (here: that of the kernel being compiled)."""

    def __init__(self, cc):
        self.compute_capability = tuple(cc)[:2]


def _with_stand_in(real):
    from numba.cuda.cudadrv.error import CudaSupportError

    from .ptx.asm import current_cc

    def get_current_device():
        try:
            return real()
        except CudaSupportError:
            cc = current_cc()   # the kernel being compiled, if any
            if cc is None:
                raise
            return _StandInDevice(cc)

    get_current_device._tilepy_stand_in = True
    return get_current_device


def install_stand_in_device() -> bool:
    """Install the fallback described in the module docstring (idempotent); False in the
    simulator or when Numba-CUDA's internals moved."""
    if config.ENABLE_CUDASIM:
        return False
    try:
        from numba.cuda import dispatcher
        current = dispatcher.get_current_device
    except (ImportError, AttributeError):
        return False
    if not getattr(current, "_tilepy_stand_in", False):
        dispatcher.get_current_device = _with_stand_in(current)
    return True


install_stand_in_device()
