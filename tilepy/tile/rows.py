"""Rows of a 2-D global array to and from registers: 16-byte vector accesses, groups of
columns, and a thread's share of a row held in registers — the loads and stores of the
row-wise kernels (``tilepy.softmax`` and its backward).

A *kernel view* is a 2-D array ``(rows, n)`` with a unit element stride and any row stride,
of float32 values or of the uint16 bits of float16 / bfloat16 (``kind`` names which;
:func:`tilepy.arrays.kernel_view`). In registers a value is a float32, or — a *packed*
register row of 16-bit data — half of a uint32 word that holds two 16-bit values as they
came from memory (``lo`` = the lower column).

================================================  ========================================
generator / function                              gives
================================================  ========================================
``vload(a, r, c)`` / ``vstore(a, r, c, …)``       the 16 bytes at ``a[r, c]``: one
                                                  ``ld/st.global.v4``
                                                  (:mod:`tilepy.ptx.global_vector`)
``element_io(kind)``                              ``load(x, r, c)``, ``store(out, r, c, v)``
``group_io(kind, V, fill)``                       ``V`` columns: one vector access inside
                                                  the row, scalar ones at its end
``register_row(kind, per_thread, vec, stride,     loads / stores of a thread's groups of a
fill, packed)``                                   row (:class:`RegisterRow`)
``register_row_writer(…, result)``                stores ``result`` of two register rows,
                                                  group by group (:class:`RowWriter`)
``register_rows_sum(kind, values, packed,         ``Σ term(a_k, b_k)`` over two register
term)``                                           rows
``slot_function(kind, packed, f)``                ``f`` of values as a function of slots
``words_store(vector)``                           8 packed 16-bit values of a row: one
                                                  vector store or 8 element stores
``natural_width``, ``vector_width``,              host side: elements per access, and what
``packs_registers``, ``groups``,                  a thread holds; whether a view of any
``vectors_fit``                                   rank takes vector accesses
================================================  ========================================

Every device function is per thread (no exchange between threads); sizes are closure
constants, so the loops over a thread's groups unroll and the values stay in registers.
Vector accesses need 16-byte aligned data and row strides: the caller decides that on the
host (:func:`vector_width`) and builds the kernel with ``vec = 1`` otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..inline import inline_device
from ..ptx.global_vector import VECTOR_BYTES  # bytes one thread moves per vector access
from ..ptx.global_vector import ld_global_v4 as vload
from ..ptx.global_vector import st_global_v4 as vstore
from ..ptx.math import cvt_bf16x2_f32, cvt_f16x2_f32, unpack_bf16x2_f32, unpack_f16x2_f32

KINDS = ("float32", "float16", "bfloat16")


def natural_width(kind: str) -> int:
    """Elements per 16-byte vector access for ``kind`` (4 float32, 8 16-bit values)."""
    return VECTOR_BYTES // (4 if kind == "float32" else 2)


def groups(per_thread: int, V: int) -> int:
    """Groups of ``V`` values a thread holds to cover at least ``per_thread`` values."""
    return max(1, -(-int(per_thread) // int(V)))


def packs_registers(kind: str, vec: int) -> bool:
    """True when a register row of ``kind`` read ``vec`` values per access can be kept packed
    (two 16-bit values per uint32 register, as loaded): 16-bit data with 16-byte accesses."""
    return kind in ("float16", "bfloat16") and int(vec) == VECTOR_BYTES // 2


def _pack_unpack(kind: str):
    if kind == "float16":
        return cvt_f16x2_f32, unpack_f16x2_f32
    if kind == "bfloat16":
        return cvt_bf16x2_f32, unpack_bf16x2_f32
    raise ValueError(f"kind must be float16 or bfloat16 here, got {kind!r}")


def fill_bits(kind: str, fill: float) -> np.uint32:
    """The 16 bits of ``fill`` in ``kind`` (float16 / bfloat16), as a uint32 (``fill`` must be
    exact in the type: -inf, 0, …)."""
    if kind == "float16":
        return np.uint32(np.float16(fill).view(np.uint16))
    if kind == "bfloat16":
        bits = int(np.float32(fill).view(np.uint32))
        if bits & 0xFFFF:
            raise ValueError(f"fill {fill!r} is not exact in bfloat16")
        return np.uint32(bits >> 16)
    raise ValueError(f"kind must be float16 or bfloat16 here, got {kind!r}")


# ---- element load / store (float32 in registers, the dtype in memory) ---------------------

@functools.cache
def element_io(kind: str):
    """``load(x, r, c) -> float32`` and ``store(out, r, c, v)`` for a 2-D array of ``kind``
    (float32 values, or uint16 bits of float16 / bfloat16: widened exactly, rounded to nearest
    even)."""
    if kind == "float32":
        @inline_device
        def load(x, r, c):
            return x[r, c]

        @inline_device
        def store(out, r, c, v):
            out[r, c] = v
    elif kind in ("float16", "bfloat16"):
        pack, unpack = _pack_unpack(kind)

        @inline_device
        def load(x, r, c):
            lo, _ = unpack(np.uint32(x[r, c]))
            return lo

        @inline_device
        def store(out, r, c, v):
            out[r, c] = pack(v, v) & 0xFFFF
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return load, store


@functools.cache
def words_store(vector: bool):
    """``store(out, r, c, w0, w1, w2, w3)``: four uint32 words, each two 16-bit values (``lo``
    the lower column), into columns ``c … c + 7`` of row ``r`` of a 2-D uint16 array — one
    16-byte vector store where ``vector`` (the host vouched for a unit element stride and
    16-byte alignment, :func:`vectors_fit`), else eight element stores that follow the
    array's strides (a caller's strided or misaligned output)."""
    VECTOR = bool(vector)

    @inline_device
    def put(out, r, c, w):
        out[r, c] = w & 0xFFFF
        out[r, c + 1] = w >> 16

    @inline_device
    def store(out, r, c, w0, w1, w2, w3):
        if VECTOR:
            vstore(out, r, c, w0, w1, w2, w3)
        else:
            put(out, r, c, w0)
            put(out, r, c + 2, w1)
            put(out, r, c + 4, w2)
            put(out, r, c + 6, w3)

    return store


# ---- groups of columns ------------------------------------------------------------------------

@functools.cache
def group_io(kind: str, V: int, fill: float):
    """``gload(x, r, c0, n, vals, b)``: ``vals[b … b+V-1]`` = columns ``c0 … c0+V-1`` of row
    ``r`` as float32 (``fill`` past ``n``); ``gstore(out, r, c0, n, vals, b)``: the reverse,
    only columns below ``n``. ``V == 1``: one scalar access. Otherwise one 16-byte vector
    access when the group lies wholly inside the row, else (the row's tail) scalar accesses;
    ``c0`` must be a multiple of ``V`` and rows 16-byte aligned (:func:`vector_width`).

    Returns ``(gload, gstore, fload, fstore)``: ``fload`` / ``fstore`` are the same accesses
    for a group known to lie wholly inside the row (no test, no tail code). A caller that
    knows all of a thread's groups are inside the row uses them in straight-line code, so
    that ptxas issues every load before the first use of any: with ``gload`` per group, the
    unpacking of a 16-bit vector sits inside its group's branch, which made each load wait
    for the one before (one 16-byte load in flight per thread; see :func:`register_row`)."""
    load, store = element_io(kind)
    FILL = np.float32(fill)
    if V == 1:
        @inline_device
        def gload(x, r, c0, n, vals, b):
            v = FILL
            if c0 < n:
                v = load(x, r, c0)
            vals[b] = v

        @inline_device
        def gstore(out, r, c0, n, vals, b):
            if c0 < n:
                store(out, r, c0, vals[b])

        @inline_device
        def fload(x, r, c0, vals, b):
            vals[b] = load(x, r, c0)

        @inline_device
        def fstore(out, r, c0, vals, b):
            store(out, r, c0, vals[b])

        return gload, gstore, fload, fstore

    if kind == "float32":
        assert V == 4

        @inline_device
        def vec_load(x, r, c0, vals, b):
            a0, a1, a2, a3 = vload(x, r, c0)
            vals[b] = a0
            vals[b + 1] = a1
            vals[b + 2] = a2
            vals[b + 3] = a3

        @inline_device
        def vec_store(out, r, c0, vals, b):
            vstore(out, r, c0, vals[b], vals[b + 1], vals[b + 2], vals[b + 3])
    else:
        assert V == 8
        pack, unpack = _pack_unpack(kind)

        @inline_device
        def vec_load(x, r, c0, vals, b):
            w0, w1, w2, w3 = vload(x, r, c0)
            lo, hi = unpack(w0)
            vals[b] = lo
            vals[b + 1] = hi
            lo, hi = unpack(w1)
            vals[b + 2] = lo
            vals[b + 3] = hi
            lo, hi = unpack(w2)
            vals[b + 4] = lo
            vals[b + 5] = hi
            lo, hi = unpack(w3)
            vals[b + 6] = lo
            vals[b + 7] = hi

        @inline_device
        def vec_store(out, r, c0, vals, b):
            vstore(out, r, c0, pack(vals[b], vals[b + 1]), pack(vals[b + 2], vals[b + 3]),
                   pack(vals[b + 4], vals[b + 5]), pack(vals[b + 6], vals[b + 7]))

    @inline_device
    def gload(x, r, c0, n, vals, b):
        if c0 + V <= n:
            vec_load(x, r, c0, vals, b)
        else:
            for i in range(V):
                v = FILL
                if c0 + i < n:
                    v = load(x, r, c0 + i)
                vals[b + i] = v

    @inline_device
    def gstore(out, r, c0, n, vals, b):
        if c0 + V <= n:
            vec_store(out, r, c0, vals, b)
        else:
            for i in range(V):
                if c0 + i < n:
                    store(out, r, c0 + i, vals[b + i])

    return gload, gstore, vec_load, vec_store


# ---- a thread's share of a row, in registers ----------------------------------------------------

@dataclass(frozen=True)
class RegisterRow:
    """What :func:`register_row` makes. The kernel holds the values in
    ``cuda.local.array(slots, dtype)``: ``values`` float32, or (``packed``) ``values // 2``
    uint32 words of two 16-bit values each (value ``2j`` in the low half of word ``j``).

    * ``load(x, row, base, first, n, regs)``: fill ``regs`` from row ``row`` of ``x`` —
      group ``g`` (``g = 0 … groups-1``) is columns ``base + vec·(first + stride·g)`` … ``+
      vec - 1``; columns at or past ``n`` read as ``fill``.
    * ``store(out, row, base, first, n, regs)``: the reverse; columns at or past ``n`` are
      not written.
    * ``inside(base, first, n) -> bool``: every group of the thread lies inside the row;
      then ``load_inside(x, row, base, first, regs)`` / ``store_inside(out, row, base, first,
      regs)`` do the same with no test (straight-line vector accesses), and ``load_edge`` /
      ``store_edge`` (same arguments as ``load`` / ``store``) test each group. ``load`` is
      ``load_inside`` or ``load_edge``; a caller that loads, computes and stores in one step
      may branch once on ``inside`` for all three.

    ``base`` must be a multiple of ``vec`` (0, or a step of a loop over a long row)."""

    slots: int
    dtype: type
    values: int
    packed: bool
    inside: object
    load: object
    load_inside: object
    load_edge: object
    store: object
    store_inside: object
    store_edge: object


@dataclass(frozen=True)
class RowWriter:
    """What :func:`register_row_writer` makes: ``write(out, row, base, first, n, a, b, p, q)``
    stores ``result(a[j], b[j], p, q)`` for every slot ``j`` of a thread's register row (the
    groups and columns of :class:`RegisterRow`; nothing at or past ``n``), computing each
    group's results just before its store, so that a group's registers die as it is written;
    ``write_inside`` (no ``n``) and ``write_edge`` as ``store_inside`` / ``store_edge``."""

    write: object
    write_inside: object
    write_edge: object


def _geometry(per_thread: int, vec: int, stride: int):
    V = int(vec)
    G = groups(per_thread, V)
    return V, G, int(stride), int(stride) * (G - 1)


@functools.cache
def _group_slots(kind: str, vec: int, fill: float, packed: bool):
    """Per-group accesses in slot terms: ``(slots per group, load_full(x, r, c0, regs, b),
    load(x, r, c0, n, regs, b), store_full(out, r, c0, regs, b), store(out, r, c0, n, regs,
    b))``, the group's slots being ``regs[b …]``."""
    V = int(vec)
    if not packed:
        gload, gstore, fload, fstore = group_io(kind, V, fill)
        return V, fload, gload, fstore, gstore
    if not packs_registers(kind, V):
        raise ValueError(f"a packed register row takes 16-bit data and {VECTOR_BYTES // 2} "
                         f"values per access, got {kind} and {V}")
    H = V // 2
    FILL = fill_bits(kind, fill)
    SIXTEEN = np.uint32(16)
    LOW = np.uint32(0xFFFF)

    @inline_device
    def bits(x, r, c, n):
        b = FILL
        if c < n:
            b = np.uint32(x[r, c])
        return b

    @inline_device
    def load_full(x, r, c0, words, b):
        w0, w1, w2, w3 = vload(x, r, c0)
        words[b] = w0
        words[b + 1] = w1
        words[b + 2] = w2
        words[b + 3] = w3

    @inline_device
    def load(x, r, c0, n, words, b):
        if c0 + V <= n:
            load_full(x, r, c0, words, b)
        else:
            for i in range(H):
                c = c0 + 2 * i
                words[b + i] = bits(x, r, c, n) | (bits(x, r, c + 1, n) << SIXTEEN)

    @inline_device
    def store_full(out, r, c0, words, b):
        vstore(out, r, c0, words[b], words[b + 1], words[b + 2], words[b + 3])

    @inline_device
    def store(out, r, c0, n, words, b):
        if c0 + V <= n:
            store_full(out, r, c0, words, b)
        else:
            for i in range(H):
                c = c0 + 2 * i
                if c < n:
                    w = words[b + i]
                    out[r, c] = w & LOW
                    if c + 1 < n:
                        out[r, c + 1] = w >> SIXTEEN

    return H, load_full, load, store_full, store


@functools.cache
def register_row(kind: str, per_thread: int, vec: int, stride: int, fill: float,
                 packed: bool = False) -> RegisterRow:
    """A thread's share of a row of ``kind`` in registers: at least ``per_thread`` values in
    :func:`groups` of ``vec`` (one access each), group ``g`` of the thread whose first group
    is ``first`` being group ``first + stride·g`` of the row — ``stride`` = the threads that
    share the row (32 for a warp, the block's threads), so that consecutive threads read
    consecutive groups (coalesced). ``packed`` (16-bit data with 16-byte accesses only,
    :func:`packs_registers`): keep the loaded words, half the registers.

    When every group of the thread lies inside the row, loads and stores are straight-line
    vector accesses (all loads in flight before the first use of any); otherwise each group
    is tested, and a group that reaches past ``n`` is read and written one element at a time.
    """
    V, G, STRIDE, LAST = _geometry(per_thread, vec, stride)
    SG, gl_full, gl, gs_full, gs = _group_slots(kind, V, fill, bool(packed))

    @inline_device
    def inside(base, first, n):
        return base + (first + LAST) * V + V <= n

    @inline_device
    def load_inside(x, row, base, first, regs):
        for g in range(G):
            gl_full(x, row, base + (first + STRIDE * g) * V, regs, g * SG)

    @inline_device
    def load_edge(x, row, base, first, n, regs):
        for g in range(G):
            gl(x, row, base + (first + STRIDE * g) * V, n, regs, g * SG)

    @inline_device
    def load(x, row, base, first, n, regs):
        if base + (first + LAST) * V + V <= n:     # every group inside the row: all at once
            load_inside(x, row, base, first, regs)
        else:
            load_edge(x, row, base, first, n, regs)

    @inline_device
    def store_inside(out, row, base, first, regs):
        for g in range(G):
            gs_full(out, row, base + (first + STRIDE * g) * V, regs, g * SG)

    @inline_device
    def store_edge(out, row, base, first, n, regs):
        for g in range(G):
            gs(out, row, base + (first + STRIDE * g) * V, n, regs, g * SG)

    @inline_device
    def store(out, row, base, first, n, regs):
        if base + (first + LAST) * V + V <= n:
            store_inside(out, row, base, first, regs)
        else:
            store_edge(out, row, base, first, n, regs)

    K = G * V
    slots = K // 2 if packed else K
    return RegisterRow(slots, np.uint32 if packed else np.float32, K, bool(packed), inside,
                       load, load_inside, load_edge, store, store_inside, store_edge)


@functools.cache
def register_row_writer(kind: str, per_thread: int, vec: int, stride: int, packed: bool,
                        result) -> RowWriter:
    """The :class:`RowWriter` of the register rows of :func:`register_row` with the same
    ``kind``, ``per_thread``, ``vec``, ``stride`` and ``packed``: ``result(a, b, p, q)`` is a
    device function of two slots (float32 values, or — packed — uint32 words, see
    :func:`slot_function`) and two float32 row constants, returning a slot."""
    V, G, STRIDE, LAST = _geometry(per_thread, vec, stride)
    packed = bool(packed)
    SG, _, _, gs_full, gs = _group_slots(kind, V, 0.0, packed)
    SIXTEEN = np.uint32(16)
    LOW = np.uint32(0xFFFF)

    if packed:
        @inline_device
        def group_full(out, r, c0, a, b, j, p, q):
            vstore(out, r, c0, result(a[j], b[j], p, q), result(a[j + 1], b[j + 1], p, q),
                   result(a[j + 2], b[j + 2], p, q), result(a[j + 3], b[j + 3], p, q))

        @inline_device
        def group(out, r, c0, n, a, b, j, p, q):
            if c0 + V <= n:
                group_full(out, r, c0, a, b, j, p, q)
            else:
                for i in range(SG):
                    c = c0 + 2 * i
                    if c < n:
                        w = result(a[j + i], b[j + i], p, q)
                        out[r, c] = w & LOW
                        if c + 1 < n:
                            out[r, c + 1] = w >> SIXTEEN
    else:
        @inline_device
        def results(a, b, j, p, q):
            for i in range(SG):
                a[j + i] = result(a[j + i], b[j + i], p, q)

        @inline_device
        def group_full(out, r, c0, a, b, j, p, q):
            results(a, b, j, p, q)
            gs_full(out, r, c0, a, j)

        @inline_device
        def group(out, r, c0, n, a, b, j, p, q):
            results(a, b, j, p, q)
            gs(out, r, c0, n, a, j)

    @inline_device
    def write_inside(out, row, base, first, a, b, p, q):
        for g in range(G):
            group_full(out, row, base + (first + STRIDE * g) * V, a, b, g * SG, p, q)

    @inline_device
    def write_edge(out, row, base, first, n, a, b, p, q):
        for g in range(G):
            group(out, row, base + (first + STRIDE * g) * V, n, a, b, g * SG, p, q)

    @inline_device
    def write(out, row, base, first, n, a, b, p, q):
        if base + (first + LAST) * V + V <= n:
            write_inside(out, row, base, first, a, b, p, q)
        else:
            write_edge(out, row, base, first, n, a, b, p, q)

    return RowWriter(write, write_inside, write_edge)


# ---- element-wise work on register rows ---------------------------------------------------------

@functools.cache
def slot_function(kind: str, packed: bool, f):
    """``f(u, v, p, q) -> float32`` (a device function of float32 values and two float32
    constants) as a function of register-row slots: ``f`` itself for float32 slots; for packed
    rows ``fw(a, b, p, q) -> uint32``, the word of ``f`` of the low halves and of the high
    halves, rounded to ``kind`` (to nearest even). For :func:`register_row_writer`."""
    if not packed:
        return f
    pack, unpack = _pack_unpack(kind)

    @inline_device
    def fw(a, b, p, q):
        alo, ahi = unpack(a)
        blo, bhi = unpack(b)
        return pack(f(alo, blo, p, q), f(ahi, bhi, p, q))

    return fw


@functools.cache
def register_rows_sum(kind: str, values: int, packed: bool, term):
    """``total(a, b) -> float32``: ``Σ_k term(a_k, b_k)`` over the ``values`` values of two
    register rows of the same :func:`register_row` (``kind``, ``values``, ``packed`` as it
    made them), added in order ``k = 0, 1, …``. ``term(u, v) -> float32`` is a device
    function of two float32 values."""
    if not packed:
        @inline_device
        def total(a, b):
            s = np.float32(0.0)
            for k in range(values):
                s += term(a[k], b[k])
            return s
        return total

    _, unpack = _pack_unpack(kind)
    W = values // 2

    @inline_device
    def total(a, b):
        s = np.float32(0.0)
        for j in range(W):
            alo, ahi = unpack(a[j])
            blo, bhi = unpack(b[j])
            s += term(alo, blo)
            s += term(ahi, bhi)
        return s

    return total


# ---- host side: may these views take vector accesses? -------------------------------------------

def _pointer_of(view) -> int:
    if isinstance(view, np.ndarray):
        return view.ctypes.data
    inner = getattr(view, "_ary", None)     # the simulator's FakeCUDAArray
    if isinstance(inner, np.ndarray):
        return inner.ctypes.data
    return int(view.device_ctypes_pointer.value or 0)


def vectors_fit(view) -> bool:
    """Whether 16-byte vector accesses along the last axis of the kernel view ``view`` (any
    rank) land where its elements are: a unit element stride there, every other stride (of
    an axis longer than 1) and the data pointer multiples of 16 bytes."""
    item = view.dtype.itemsize
    shape, strides = tuple(view.shape), tuple(view.strides)
    if shape[-1] > 1 and strides[-1] != item:
        return False
    if any(st % VECTOR_BYTES for n, st in zip(shape[:-1], strides[:-1]) if n > 1):
        return False
    return _pointer_of(view) % VECTOR_BYTES == 0


def vector_width(kind: str, *views) -> int:
    """Elements per access the kernels may use on the 2-D kernel views ``views`` (rows, n):
    :func:`natural_width` when every view's data pointer and row stride are multiples of 16
    bytes, its element stride is the item size and rows hold at least one vector; else 1 (the
    scalar kernels)."""
    V = natural_width(kind)
    if all(v.shape[1] >= V and vectors_fit(v) for v in views):
        return V
    return 1


__all__ = ["KINDS", "VECTOR_BYTES", "RegisterRow", "RowWriter", "element_io", "fill_bits",
           "group_io", "groups", "natural_width", "packs_registers", "register_row",
           "register_row_writer", "register_rows_sum", "slot_function", "vector_width",
           "vectors_fit", "words_store",
           "vload", "vstore"]
