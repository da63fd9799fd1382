"""A fix for a race in Numba-CUDA's simulator that gave wrong answers in CI.

The simulator runs every CUDA thread of a block as a Python thread, and its
``cuda.shared.array`` (``FakeCUDAShared.array`` in numba-cuda 0.30) finds a static shared array
by its call site with a check-then-create on a plain dict::

    res = self._allocations.get(caller)
    if res is None:
        res = np.empty(shape, dtype)
        self._allocations[caller] = res

With a thread switch between the two lines (it walks the whole stack with
``traceback.extract_stack`` in between, and ``tilepy`` shortens the switch interval to make the
simulator's barriers cheap), two threads of one block each create an array and one of them
computes on a private, uninitialised "shared" tile. The float32 GEMM test then failed about
once in a few hundred runs on a loaded 2-core machine (an element off by 10^12, or an
``OverflowError`` in ``math.exp`` of garbage).

:func:`install` replaces the method with one that creates under a lock, and finds the call
site from the caller's frame instead of an extracted stack (same key: file name and line; the
simulator's documented aliasing of two arrays made on one line is unchanged). It patches only
when the method is the one it knows (the dynamic-shared-memory and ``alignment`` cases are
passed to the original), and does nothing when the simulator is not in use.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()


def static_array(allocations: dict, caller, shape, dtype):
    """The static shared array made at ``caller``'s line (a frame), created under the lock if
    ``allocations`` (a ``FakeCUDAShared``'s, keyed by file name and line) has none yet."""
    key = (caller.f_code.co_filename, caller.f_lineno)
    res = allocations.get(key)
    if res is None:
        with _lock:
            res = allocations.get(key)
            if res is None:
                import numpy as np
                from numba.core import types
                from numba.np import numpy_support

                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                res = allocations[key] = np.empty(shape, dtype)
    return res


def install() -> bool:
    """Make the simulator's static shared-array creation atomic; True if the patch is on."""
    try:
        from numba.cuda.simulator import kernelapi
    except ImportError:
        return False
    cls = getattr(kernelapi, "FakeCUDAShared", None)
    original = getattr(cls, "array", None)
    if original is None:
        return False
    if getattr(original, "_tilepy_atomic", False):
        return True

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return original(self, shape, dtype, alignment)
        return static_array(self._allocations, sys._getframe(1), shape, dtype)

    array._tilepy_atomic = True
    array.__doc__ = original.__doc__
    cls.array = array
    return True
