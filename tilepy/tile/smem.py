"""Shared memory for tile kernels: the dynamic buffer, and permission to use more than 48 KB.

* :func:`dynamic_shared` — a device function returning the block's dynamic shared buffer as
  uint16 elements, 128-byte aligned on the GPU by default (cp.async / ldmatrix want 16; TMA
  and the 128-byte swizzle want 1024). The simulator rejects ``alignment=``, so it is left
  out there.
* :func:`allow_dynamic_shared` — a kernel may use more than 48 KB of dynamic shared memory only
  after ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` is raised on its compiled code.
  Numba has no public API for this (upstream issue); this is the one place that reaches into
  its internals (``overloads``, ``_codelibrary.get_cufunc()``) — tested on the GPU.
"""

from __future__ import annotations

import functools

from numba import cuda, types

from .. import devices
from ..inline import inline_device
from ..ptx.asm import SIMULATOR

STATIC_LIMIT = 48 * 1024


@functools.cache
def dynamic_shared(align: int = 128):
    """A device function returning the block's dynamic shared buffer as uint16 elements,
    ``align``-byte aligned on the GPU (1024 for 128-byte-swizzled TMA / wgmma tiles: a
    :class:`~tilepy.tile.smem_layout.SmemLayout`'s ``align``). The simulator takes no
    alignment (its buffers are treated as 1024-byte aligned by the twins)."""
    if SIMULATOR:
        @inline_device(ir=True)   # returns the array it makes
        def buffer():
            return cuda.shared.array(0, types.uint16)
    else:
        @inline_device(ir=True)   # returns the array it makes
        def buffer():
            return cuda.shared.array(0, types.uint16, alignment=align)
    return buffer


_raised: dict = {}


def compiled_overload(kernel, args):
    """The compiled overload of a Numba-CUDA ``kernel`` for ``args`` (compiled if needed):
    what its registers, attributes and function handle are read from."""
    sig = tuple(kernel.typeof_pyval(a) for a in args)
    return kernel.overloads.get(sig) or kernel.compile(sig)


def allow_dynamic_shared(kernel, args, nbytes: int) -> None:
    """Compile ``kernel`` for ``args`` (if needed) and let it use ``nbytes`` of dynamic smem."""
    if SIMULATOR or nbytes <= STATIC_LIMIT:
        return
    overload = compiled_overload(kernel, args)
    dev = devices.current_id()
    key = (id(overload), dev)
    if _raised.get(key, 0) >= nbytes:
        return
    from cuda.bindings import driver

    handle = overload._codelibrary.get_cufunc().handle
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuKernelSetAttribute(attr, int(nbytes), handle, dev)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"could not allow {nbytes} B of dynamic shared memory: {err}")
    _raised[key] = nbytes
