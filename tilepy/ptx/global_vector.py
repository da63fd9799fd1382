"""16-byte and 8-byte global accesses of a 2-D array's elements: ``ld.global.v4`` /
``st.global.v4`` / ``st.global.v2`` at ``a[r, c]``.

Per thread (no warp exchange), for a 2-D float32 or uint16 array (a kernel view: unit element
stride, any row stride; :func:`tilepy.arrays.kernel_view`):

* ``ld_global_v4(a, r, c)`` — the 16 bytes at ``a[r, c]``: four float32 (float32 arrays) or
  four uint32 words each holding two 16-bit values, ``lo`` = the lower column (uint16 arrays);
* ``st_global_v4(a, r, c, w0, w1, w2, w3)`` — the reverse (``w0`` first);
* ``st_global_v2(a, r, c, w0, w1)`` — the 8 bytes at ``a[r, c]`` (``w0`` first), for a 2-D
  float32 (two float32), uint16 or uint8 array (two uint32 words, the lowest byte the lowest
  column: eight 8-bit codes, say);
* ``st_global_pair(a, r, c, w)`` — the 4 bytes at ``a[r, c]`` of a 2-D uint16 array: one
  uint32 word, ``a[r, c]`` its low half (two adjacent 16-bit results in one store);
* ``pair_aligned(a, r, c) -> bool`` — whether ``a[r, c]`` and ``a[r, c + 1]`` of a 2-D uint16
  array are one 4-byte aligned word: a unit element stride and ``a[r, c]`` 4-byte aligned
  (what ``st_global_pair`` needs, decided per access where the host cannot vouch; any other
  view — a transposed ``out``, say — takes element stores).

The address is ``data + r·strides[0] + c·itemsize`` (a unit element stride is assumed) and
must be aligned to the bytes moved: the caller checks the base pointer and row stride on the
host. These are LLVM IR vector loads and stores in the global address space, not inline PTX
(unlike the address-taking moves of :mod:`tilepy.ptx.vector`): the optimiser sees them, so it
may schedule the loads of independent groups together and fold constant column offsets into
the address. The twins read and write the array's bytes after checking the bounds, the unit
element stride and the alignment (``IndexError`` / ``ValueError`` instead of a wild access).
"""

from __future__ import annotations

import numpy as np

from .asm import SIMULATOR, pick

#: Bytes one access moves (``ld_global_v4`` / ``st_global_v4``; ``st_global_v2`` moves half).
VECTOR_BYTES = 16


# ---- simulator ------------------------------------------------------------------------------

def _sim_ndarray(a) -> np.ndarray:
    inner = getattr(a, "_item", a)   # FakeWithinKernelCUDAArray -> FakeCUDAArray
    return getattr(inner, "_ary", inner)


def _sim_vector_slice(a, r, c, nbytes=VECTOR_BYTES):
    arr = _sim_ndarray(a)
    r, c = int(r), int(c)
    nel = nbytes // arr.itemsize
    if not (0 <= r < arr.shape[0] and 0 <= c and c + nel <= arr.shape[1]):
        raise IndexError(f"vector access at ({r}, {c}) out of bounds for shape {arr.shape}")
    if arr.strides[1] != arr.itemsize:
        raise ValueError("vector access needs a unit element stride")
    seg = arr[r, c:c + nel]
    if seg.ctypes.data % nbytes:
        raise ValueError(f"vector access at ({r}, {c}) is {seg.ctypes.data % nbytes} "
                         f"bytes off the {nbytes}-byte alignment it needs")
    return seg


def _ld_global_v4_twin(a, r, c):
    seg = _sim_vector_slice(a, r, c)
    if seg.dtype == np.float32:
        return tuple(np.float32(v) for v in seg)
    return tuple(np.uint32(v) for v in seg.view(np.uint32))


def _st_global_v4_twin(a, r, c, w0, w1, w2, w3):
    seg = _sim_vector_slice(a, r, c)
    if seg.dtype == np.float32:
        seg[:] = np.array([w0, w1, w2, w3], np.float32)
    else:
        seg.view(np.uint32)[:] = np.array([int(w) & 0xFFFFFFFF for w in (w0, w1, w2, w3)],
                                          np.uint32)


def _st_global_v2_twin(a, r, c, w0, w1):
    seg = _sim_vector_slice(a, r, c, VECTOR_BYTES // 2)
    if seg.dtype == np.float32:
        seg[:] = np.array([w0, w1], np.float32)
    else:
        seg.view(np.uint32)[:] = np.array([int(w) & 0xFFFFFFFF for w in (w0, w1)], np.uint32)


def _st_global_pair_twin(a, r, c, w):
    seg = _sim_vector_slice(a, r, c, 4)
    seg.view(np.uint32)[0] = np.uint32(int(w) & 0xFFFFFFFF)


def _pair_aligned_twin(a, r, c):
    arr = _sim_ndarray(a)
    r, c = int(r), int(c)
    addr = arr.ctypes.data + r * arr.strides[0] + c * arr.strides[1]
    return arr.strides[1] == arr.itemsize and addr % 4 == 0


# ---- GPU ------------------------------------------------------------------------------------

def _make_intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    def element(name, arr, kinds=(types.float32, types.uint16)):
        if not (isinstance(arr, types.Array) and arr.ndim == 2 and arr.dtype in kinds):
            raise TypingError(f"tilepy.ptx.{name}: expected a 2-D "
                              f"{' or '.join(map(str, kinds))} array, got {arr}")
        return types.float32 if arr.dtype == types.float32 else types.uint32

    def address(context, builder, aryty, ary_val, r, rty, c, cty, lanety, lanes=4):
        ary = context.make_array(aryty)(context, builder, ary_val)
        i64 = ir.IntType(64)
        r = context.cast(builder, r, rty, types.intp)
        c = context.cast(builder, c, cty, types.intp)
        s0 = cgutils.unpack_tuple(builder, ary.strides, 2)[0]
        off = builder.add(builder.mul(r, s0),
                          builder.mul(c, ir.Constant(i64, aryty.dtype.bitwidth // 8)))
        i8p = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        p = builder.gep(i8p, [off])
        g = builder.addrspacecast(p, ir.IntType(8).as_pointer(1))
        return builder.bitcast(g, ir.VectorType(lanety, lanes).as_pointer(1))

    @intrinsic
    def ld_global_v4(typingctx, arr, r, c):
        el = element("ld_global_v4", arr)

        def codegen(context, builder, sig, args):
            lanety = context.get_value_type(el)
            ptr = address(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                          args[2], sig.args[2], lanety)
            vec = builder.load(ptr, align=VECTOR_BYTES)
            parts = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i))
                     for i in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return types.UniTuple(el, 4)(arr, r, c), codegen

    @intrinsic
    def st_global_v4(typingctx, arr, r, c, w0, w1, w2, w3):
        el = element("st_global_v4", arr)

        def codegen(context, builder, sig, args):
            lanety = context.get_value_type(el)
            ptr = address(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                          args[2], sig.args[2], lanety)
            vec = ir.Constant(ir.VectorType(lanety, 4), ir.Undefined)
            for i in range(4):
                v = context.cast(builder, args[3 + i], sig.args[3 + i], el)
                vec = builder.insert_element(vec, v, ir.Constant(ir.IntType(32), i))
            builder.store(vec, ptr, align=VECTOR_BYTES)
            return context.get_dummy_value()

        return types.none(arr, r, c, w0, w1, w2, w3), codegen

    @intrinsic
    def st_global_v2(typingctx, arr, r, c, w0, w1):
        el = element("st_global_v2", arr, (types.float32, types.uint16, types.uint8))

        def codegen(context, builder, sig, args):
            lanety = context.get_value_type(el)
            ptr = address(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                          args[2], sig.args[2], lanety, 2)
            vec = ir.Constant(ir.VectorType(lanety, 2), ir.Undefined)
            for i in range(2):
                v = context.cast(builder, args[3 + i], sig.args[3 + i], el)
                vec = builder.insert_element(vec, v, ir.Constant(ir.IntType(32), i))
            builder.store(vec, ptr, align=VECTOR_BYTES // 2)
            return context.get_dummy_value()

        return types.none(arr, r, c, w0, w1), codegen

    @intrinsic
    def st_global_pair(typingctx, arr, r, c, w):
        element("st_global_pair", arr, (types.uint16,))

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            ptr = address(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                          args[2], sig.args[2], i32, 1)
            v = context.cast(builder, args[3], sig.args[3], types.uint32)
            vec = builder.insert_element(ir.Constant(ir.VectorType(i32, 1), ir.Undefined), v,
                                         ir.Constant(i32, 0))
            builder.store(vec, ptr, align=4)
            return context.get_dummy_value()

        return types.none(arr, r, c, w), codegen

    @intrinsic
    def pair_aligned(typingctx, arr, r, c):
        element("pair_aligned", arr, (types.uint16,))

        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            ptr = address(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                          args[2], sig.args[2], ir.IntType(32), 1)
            low = builder.and_(builder.ptrtoint(ptr, i64), ir.Constant(i64, 3))
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            s1 = cgutils.unpack_tuple(builder, ary.strides, 2)[1]
            unit = builder.icmp_signed("==", s1, ir.Constant(s1.type, 2))
            aligned = builder.icmp_unsigned("==", low, ir.Constant(i64, 0))
            return builder.and_(unit, aligned)

        return types.boolean(arr, r, c), codegen

    return ld_global_v4, st_global_v4, st_global_v2, st_global_pair, pair_aligned


if SIMULATOR:
    ld_global_v4 = pick(None, _ld_global_v4_twin)
    st_global_v4 = pick(None, _st_global_v4_twin)
    st_global_v2 = pick(None, _st_global_v2_twin)
    st_global_pair = pick(None, _st_global_pair_twin)
    pair_aligned = pick(None, _pair_aligned_twin)
else:
    _ld, _st, _st2, _stp, _pa = _make_intrinsics()
    ld_global_v4 = pick(_ld, _ld_global_v4_twin)
    st_global_v4 = pick(_st, _st_global_v4_twin)
    st_global_v2 = pick(_st2, _st_global_v2_twin)
    st_global_pair = pick(_stp, _st_global_pair_twin)
    pair_aligned = pick(_pa, _pair_aligned_twin)

__all__ = ["VECTOR_BYTES", "ld_global_v4", "pair_aligned", "st_global_pair", "st_global_v2",
           "st_global_v4"]
