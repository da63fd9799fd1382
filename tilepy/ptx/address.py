"""Addresses of array elements as the registers that ldmatrix, stmatrix and cp.async take.

* ``shared_addr(arr, idx)`` — the 32-bit shared-state-space address of ``arr[idx]``, for an
  array made by ``cuda.shared.array`` (static or dynamic). ``idx`` is an integer for a 1-D
  array or a tuple with one integer per dimension. Type: uint32.
* ``global_addr(arr, idx)`` — the 64-bit global-state-space address of ``arr[idx]`` for a
  kernel argument (device array). Type: uint64.

Address arithmetic on the results (adding byte offsets) is the intended use: compute a
per-thread base once, then add compile-time byte offsets in the loop. Apply swizzles to
offsets, not to absolute addresses.

In the simulator both return the host address of the element (a Python int) and remember the
array's extent for the running block, so that twins can refuse an address outside every array
the block named — with a Python error instead of a wild read. The record lives on the block
(the simulator's BlockManager), so nothing stale from earlier launches can vouch for an address.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from .asm import SIMULATOR, pick

# ---- simulator ------------------------------------------------------------------------------

_extent_lock = threading.Lock()


def _block_extents(t=None) -> dict:
    """{"shared": {start: end}, "global": {...}} of the calling simulated thread's block (of
    ``t``'s: another block of a cluster, :func:`tilepy.ptx._simcluster.owner`)."""
    from ._sim import block_state

    return block_state("extents", lambda m: {"shared": {}, "global": {}}, t)


def _ndarray(a) -> np.ndarray:
    inner = getattr(a, "_item", a)  # FakeWithinKernelCUDAArray -> FakeCUDAArray
    inner = getattr(inner, "_ary", inner)  # FakeCUDAArray -> ndarray
    if not isinstance(inner, np.ndarray):
        raise TypeError(f"expected an array, got {type(a).__name__}")
    return inner


def _element_address(space: str, a, idx) -> int:
    arr = _ndarray(a)
    if not isinstance(idx, tuple):
        idx = (idx,)
    if len(idx) != arr.ndim:
        raise IndexError(f"{space}_addr: {arr.ndim}-D array indexed with {len(idx)} indices")
    offset = 0
    for i, n, s in zip(idx, arr.shape, arr.strides):
        i = int(i)
        if not 0 <= i < n:
            raise IndexError(f"{space}_addr: index {idx} out of bounds for shape {arr.shape}")
        offset += i * s
    base = arr.ctypes.data
    lo = base + min(0, sum((n - 1) * s for n, s in zip(arr.shape, arr.strides) if s < 0))
    hi = base + sum((n - 1) * s for n, s in zip(arr.shape, arr.strides) if s > 0) + arr.itemsize
    extents = _block_extents()[space]
    with _extent_lock:
        extents[lo] = hi
    return base + offset


def check_range(space: str, who: str, addr: int, nbytes: int, align: int, t=None) -> None:
    """Raise if [addr, addr+nbytes) is not inside one array named by ``space``_addr, or misaligned
    (the arrays of ``t``'s block: default the caller's)."""
    extents = _block_extents(t)[space]
    with _extent_lock:
        ranges = list(extents.items())
    for lo, hi in ranges:
        if lo <= addr and addr + nbytes <= hi:
            if (addr - lo) % align:
                raise ValueError(f"{who}: address is {(addr - lo) % align} bytes off the "
                                 f"{align}-byte alignment the instruction needs")
            return
    raise IndexError(f"{who}: {nbytes} bytes at {addr:#x} lie outside every {space} array "
                     f"whose address this kernel took")


def read_bytes(addr: int, nbytes: int) -> bytes:
    return ctypes.string_at(addr, nbytes)


def write_bytes(addr: int, data: bytes) -> None:
    ctypes.memmove(addr, data, len(data))


def _shared_addr_twin(arr, idx):
    return _element_address("shared", arr, idx)


def _global_addr_twin(arr, idx):
    return _element_address("global", arr, idx)


# ---- GPU ------------------------------------------------------------------------------------

def _make_intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    def index_types(name, arr, idx):
        if not isinstance(arr, types.Array):
            raise TypingError(f"tilepy.ptx.{name}(array, index): first argument is {arr}, "
                              "not an array")
        if isinstance(idx, types.Integer):
            idx_list = [idx]
        elif isinstance(idx, types.BaseTuple) and all(isinstance(t, types.Integer) for t in idx):
            idx_list = list(idx)
        else:
            raise TypingError(f"tilepy.ptx.{name}(array, index): index is {idx}, "
                              "not an integer or a tuple of integers")
        if len(idx_list) != arr.ndim:
            raise TypingError(f"tilepy.ptx.{name}: {arr.ndim}-D array indexed with "
                              f"{len(idx_list)} indices")
        return idx_list

    def pointer(context, builder, sig, args):
        aryty, idxty = sig.args
        ary = context.make_array(aryty)(context, builder, args[0])
        if isinstance(idxty, types.Integer):
            raw = [(args[1], idxty)]
        else:
            raw = list(zip(cgutils.unpack_tuple(builder, args[1], len(idxty)), idxty))
        inds = [context.cast(builder, v, t, types.intp) for v, t in raw]
        return cgutils.get_item_pointer(context, builder, aryty, ary, inds)

    @intrinsic
    def shared_addr(typingctx, arr, idx):
        index_types("shared_addr", arr, idx)

        def codegen(context, builder, sig, args):
            ptr = pointer(context, builder, sig, args)
            i8 = ir.IntType(8)
            shared = builder.addrspacecast(builder.bitcast(ptr, i8.as_pointer()),
                                           i8.as_pointer(3))
            return builder.ptrtoint(shared, ir.IntType(32))

        return types.uint32(arr, idx), codegen

    @intrinsic
    def global_addr(typingctx, arr, idx):
        index_types("global_addr", arr, idx)

        def codegen(context, builder, sig, args):
            ptr = pointer(context, builder, sig, args)
            i8 = ir.IntType(8)
            glob = builder.addrspacecast(builder.bitcast(ptr, i8.as_pointer()),
                                         i8.as_pointer(1))
            return builder.ptrtoint(glob, ir.IntType(64))

        return types.uint64(arr, idx), codegen

    return shared_addr, global_addr


if SIMULATOR:
    shared_addr = pick(None, _shared_addr_twin)
    global_addr = pick(None, _global_addr_twin)
else:
    _s, _g = _make_intrinsics()
    shared_addr = pick(_s, _shared_addr_twin)
    global_addr = pick(_g, _global_addr_twin)
