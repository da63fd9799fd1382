"""``softmax_backward`` and ``log_softmax_backward``: the gradient of ``tilepy.softmax`` /
``tilepy.log_softmax`` along one axis from the forward's output, float32 arithmetic inside.

With ``dy`` the gradient of the output and ``y`` the forward's output, per row:

* softmax:      ``dx = y · (dy - s)``,       ``s = Σ dy·y``
* log_softmax:  ``dx = dy - exp(y) · s``,    ``s = Σ dy``   (``exp`` as ``ex2.approx`` of
  ``y·log2 e``; ``y <= 0`` for a log_softmax output, and ``y = -inf`` gives ``dx = dy``)

— the formulas of PyTorch's ``torch._softmax_backward_data`` /
``torch._log_softmax_backward_data``. Each row is read once (``dy`` and ``y``) and written once
(``dx``) when it fits in registers; longer rows are read twice. Host wrapper here; the callers
are users and :mod:`tilepy.integrations.pytorch` (the autograd formulas of the forward ops).

Kernels (every one on 2-D kernel views ``(rows, n)`` of ``dy``, ``y`` and ``out`` — unit
element stride, any positive row stride — and named by the forward's :class:`Plan` paths;
rows of any length, the same thresholds for every dtype):

=========  =====================  ==============================================================
path       rows (:func:`plan`)    how
=========  =====================  ==============================================================
``warp``   ``n <= SHORT_MAX``     one warp per row, SHORT_WARPS rows per block; both rows in
           (512)                  registers (at most 16 columns per lane); the sum by warp
                                  shuffles only. One read of each row, one write.
``block``  ``n <= MEDIUM_MAX``    one block per row, both rows in registers (8 or 16 columns
           (16384)                per thread, :func:`tilepy.ops.softmax.block_plan`; 512-thread
                                  blocks two per SM); the sum through a few words of shared
                                  memory. One read of each row, one write.
``online`` longer                 one block per row, two passes: the sum over the row in steps,
                                  then each step read again and written. (No running max: the
                                  path keeps the forward's name for its two-read kernel.)
=========  =====================  ==============================================================

Registers: a thread of the warp and block paths keeps its values of ``dy`` and of ``y``, so
the plans give it half the columns of the forward's float32 plans (the forward's budget of
:data:`MAX_BYTES_PER_THREAD` bytes per thread, for both rows). 16-bit rows with 16-byte
accesses are loaded and kept packed, two values per register, but are planned as float32
(:data:`REGISTER_BYTES_PER_COLUMN`); so a 16-bit thread moves half the bytes of a float32
one.

Memory access, layouts and copies are the forward's (:mod:`tilepy.ops.softmax`,
:func:`tilepy.ops.softmax.run_rows`): 16 bytes per access when the data pointers and row
strides of ``dy``, ``y`` and ``out`` are all 16-byte multiples (:func:`tilepy.tile.rows.
vector_width`), else one element per access; the reduced axis read in place when it has
unit stride and the other axes collapse into one row stride, else through a contiguous copy
in the caller's library; columns past a row's end load as 0 (they add nothing to the sum) and
are never stored.

Numerics: float32 inside; the sum adds each thread's values in order, then across threads
(warp butterfly, then the warps in order). A NaN in ``dy`` (either op) or in ``y`` (softmax)
makes ``s`` NaN and with it the whole row; a NaN in ``y`` of log_softmax makes its own
element NaN (``exp(NaN)``), as in PyTorch. Results are rounded once to the dtype.

``out`` may be ``dy`` or ``y`` itself (every element is read before it is written, by the
thread that writes it), but not a different view that overlaps them.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .. import arrays
from ..arrays import describe
from ..inline import inline_device
from ..launch import LaunchPlan, PlanCache
from ..ptx.math import ex2_approx
from ..tile.reduce import block_row_reduce, warp_reduce
from ..tile.rows import (
    groups,
    natural_width,
    packs_registers,
    register_row,
    register_row_writer,
    register_rows_sum,
    slot_function,
    vector_width,
)
from ..kcache import cached_jit
from . import softmax as _forward
from .softmax import Plan, block_plan, check_plan, normalize_axis, run_rows

WARP = 32
#: Bytes of registers per column that a thread of the warp or block path gives its values: a
#: float32 of ``dy`` and one of ``y``. 16-bit rows too, although the vector kernels load them
#: packed (two values per register): ptxas keeps the widened values of both rows from the sum
#: to the write — a packed float16 block kernel of 32 columns per thread needed 116 registers
#: for softmax (offline sm_90), where 64 are what two 512-thread blocks per SM allow.
REGISTER_BYTES_PER_COLUMN = 8
#: Register bytes of values a thread of the warp or block path keeps at most: the forward's
#: budget (32 registers, half of what a thread of a 1024-thread block or of two 512-thread
#: blocks per SM may use), here for both rows.
MAX_BYTES_PER_THREAD = _forward.MAX_BYTES_PER_THREAD
#: Longest rows of each path (every dtype): 16 columns per lane, then 16 per thread of a
#: 1024-thread block.
SHORT_MAX = WARP * MAX_BYTES_PER_THREAD // REGISTER_BYTES_PER_COLUMN
MEDIUM_MAX = _forward.MEDIUM_MAX_THREADS * MAX_BYTES_PER_THREAD // REGISTER_BYTES_PER_COLUMN
#: Most columns per thread and step of the scalar (one element per access) two-pass kernel,
#: whatever its plan says: each column there has its own address in each of the three
#: arrays, and 16 of them took 128 registers and spilled (offline sm_90, 512 threads).
SCALAR_MAX_UNROLL = 8

_LOG2E = np.float32(1.4426950408889634)
_ZERO = np.float32(0.0)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def plan(n: int, *, simulator: bool | None = None, itemsize: int = 4) -> Plan:
    """The kernel and its sizes for rows of ``n`` values (``n >= 1``; the same plan for every
    ``itemsize``, see :data:`REGISTER_BYTES_PER_COLUMN`): the warp path up to
    :data:`SHORT_MAX`, the block path (:func:`~tilepy.ops.softmax.block_plan` with
    :data:`REGISTER_BYTES_PER_COLUMN` bytes per column: up to 512 threads — two blocks per
    SM — then twice the columns per thread, then 1024 threads) up to :data:`MEDIUM_MAX`,
    else the two-pass kernel (the forward's ONLINE sizes; SIM_ONLINE in the simulator)."""
    sim = arrays.SIMULATOR if simulator is None else simulator
    if n <= SHORT_MAX:
        return Plan("warp", _forward.SHORT_WARPS, max(WARP, _pow2_at_least(n)) // WARP)
    if n <= MEDIUM_MAX:
        return block_plan(n, itemsize=REGISTER_BYTES_PER_COLUMN, simulator=sim)
    warps, unroll = _forward.SIM_ONLINE if sim else _forward.ONLINE
    return Plan("online", warps, unroll)


def check_config(p, n: int, *, simulator: bool | None = None) -> None:
    """:func:`tilepy.ops.softmax.check_plan` for the backward kernels: ``p`` must cover rows
    of ``n`` values and (on a GPU) keep at most :data:`MAX_BYTES_PER_THREAD` bytes of values
    per thread, :data:`REGISTER_BYTES_PER_COLUMN` per column; ``ValueError`` / ``TypeError``
    saying which constraint fails."""
    check_plan(p, n, REGISTER_BYTES_PER_COLUMN, simulator=simulator)


def register_bytes(p: Plan, vec: int) -> int:
    """Register bytes of the values a thread of the warp or block kernel of ``p`` holds with
    ``vec`` values per access (its columns rounded up to whole groups)."""
    return groups(p.per_thread, vec) * int(vec) * REGISTER_BYTES_PER_COLUMN


# ---- the arithmetic ---------------------------------------------------------------------------

@functools.cache
def _term(log: bool):
    """``t(dy, y) -> float32``: a column's part of the row sum ``s``."""
    if log:
        @inline_device
        def t(dy, y):
            return dy
    else:
        @inline_device
        def t(dy, y):
            return dy * y
    return t


@functools.cache
def _grad(log: bool):
    """``g(dy, y, s, unused) -> float32``: a column's ``dx`` given the row sum ``s``."""
    if log:
        @inline_device
        def g(dy, y, s, unused):
            return dy - ex2_approx(y * _LOG2E) * s
    else:
        @inline_device
        def g(dy, y, s, unused):
            return y * (dy - s)
    return g


@functools.cache
def _rows(kind: str, log: bool, per_thread: int, vec: int, stride: int, packed: bool):
    """``(row, total, writer)``: the register row of ``dy`` and of ``y`` (columns past the row
    read as 0), ``total(a, b)`` = the thread's part of ``s``, and the writer of ``dx``."""
    row = register_row(kind, per_thread, vec, stride, 0.0, packed)
    total = register_rows_sum(kind, row.values, packed, _term(log))
    writer = register_row_writer(kind, per_thread, vec, stride, packed,
                                 slot_function(kind, packed, _grad(log)))
    return row, total, writer


# ---- kernels ------------------------------------------------------------------------------------

def _kernel_jit(bounds):
    """``cuda.jit`` with ``launch_bounds=bounds`` on the GPU (see :func:`launch_bounds`); the
    simulator's jit takes none."""
    if arrays.SIMULATOR:
        return cuda.jit
    return cached_jit(launch_bounds=bounds)


def launch_bounds(p: Plan, vec: int):
    """The launch bounds of the kernel of plan ``p``: its threads, plus a minimum of two
    blocks per SM (64 registers a thread) for the forward's MEDIUM_WIDE_THREADS-thread blocks
    of the block path whose values take at most :data:`MAX_BYTES_PER_THREAD` bytes of
    registers (so that one block's loads overlap the other's sum)."""
    wide = p.path == "block" and p.threads == _forward.MEDIUM_WIDE_THREADS
    if wide and register_bytes(p, vec) <= MAX_BYTES_PER_THREAD:
        return (p.threads, 2)
    return p.threads


@functools.cache
def warp_rows_kernel(kind: str, log: bool, per_lane: int, warps: int, vec: int = 1):
    """``kernel(dy, y, out)``: rows of ``n <= 32 * per_lane`` values, one warp per row.

    Launch with ``ceil(rows / warps)`` blocks of ``warps * 32`` threads. Lane ``l`` holds the
    groups ``l, l + 32, …`` of ``vec`` values of both rows (coalesced across the warp).
    Warps past the last row take part in the shuffles (the simulator needs every thread of a
    block at each one) but load and store nothing."""
    packed = packs_registers(kind, vec)
    row, total, writer = _rows(kind, log, per_lane, vec, WARP, packed)
    S, DT, load, write = row.slots, row.dtype, row.load, writer.write
    row_sum = warp_reduce("sum")
    W = int(warps)

    @_kernel_jit(W * WARP)
    def kernel(dy, y, out):
        rows = dy.shape[0]
        tid = cuda.threadIdx.x
        lane = tid & 31
        r = cuda.blockIdx.x * W + (tid >> 5)
        valid = r < rows
        n = dy.shape[1] if valid else 0
        a = cuda.local.array(S, DT)
        b = cuda.local.array(S, DT)
        load(dy, r, 0, lane, n, a)
        load(y, r, 0, lane, n, b)
        s = row_sum(total(a, b))
        if valid:
            write(out, r, 0, lane, n, a, b, s, _ZERO)

    return kernel


@functools.cache
def block_row_kernel(kind: str, log: bool, per_thread: int, warps: int, vec: int = 1):
    """``kernel(dy, y, out)``: rows of ``n <= 32 * warps * per_thread`` values, one block per
    row.

    Launch with ``rows`` blocks of ``warps * 32`` threads. Thread ``t`` holds the groups ``t,
    t + T, …`` of both rows (T threads; coalesced); ``s`` goes through
    :func:`tilepy.tile.reduce.block_row_reduce` (``warps`` floats of shared memory, two
    barriers). One read of each row, one write."""
    W = int(warps)
    T = W * WARP
    packed = packs_registers(kind, vec)
    row, total, writer = _rows(kind, log, per_thread, vec, T, packed)
    S, DT, load, write = row.slots, row.dtype, row.load, writer.write
    row_sum = block_row_reduce("sum", W)

    @_kernel_jit(launch_bounds(Plan("block", W, int(per_thread)), vec))
    def kernel(dy, y, out):
        n = dy.shape[1]
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array(W, np.float32)
        a = cuda.local.array(S, DT)
        b = cuda.local.array(S, DT)
        load(dy, r, 0, tid, n, a)
        load(y, r, 0, tid, n, b)
        s = row_sum(total(a, b), scratch)
        write(out, r, 0, tid, n, a, b, s, _ZERO)

    return kernel


@functools.cache
def online_row_kernel(kind: str, log: bool, unroll: int, warps: int, vec: int = 1):
    """``kernel(dy, y, out)``: rows of any length, one block per row, two reads of each row.

    Launch with ``rows`` blocks of ``warps * 32`` threads. Pass 1 walks the row in steps of
    ``T * U`` columns (T threads, U = ``unroll`` rounded up to groups of ``vec``, at most
    :data:`SCALAR_MAX_UNROLL` with ``vec == 1``; thread ``t`` takes the groups ``t + T·u`` of
    each step, coalesced) and adds up the thread's part of ``s``; the block sums the parts;
    pass 2 reads each step again and writes it."""
    W = int(warps)
    T = W * WARP
    if int(vec) == 1:
        unroll = min(int(unroll), SCALAR_MAX_UNROLL)
    row, total, writer = _rows(kind, log, unroll, vec, T, False)
    U = row.values
    STEP = T * U
    load, inside = row.load, row.inside
    load_inside, load_edge = row.load_inside, row.load_edge
    write_inside, write_edge = writer.write_inside, writer.write_edge
    row_sum = block_row_reduce("sum", W)

    @_kernel_jit(T)
    def kernel(dy, y, out):
        n = dy.shape[1]
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array(W, np.float32)
        a = cuda.local.array(U, np.float32)
        b = cuda.local.array(U, np.float32)
        t = _ZERO
        for base in range(0, n, STEP):
            load(dy, r, base, tid, n, a)
            load(y, r, base, tid, n, b)
            t += total(a, b)
        s = row_sum(t, scratch)
        for base in range(0, n, STEP):
            if inside(base, tid, n):
                load_inside(dy, r, base, tid, a)
                load_inside(y, r, base, tid, b)
                write_inside(out, r, base, tid, a, b, s, _ZERO)
            else:
                load_edge(dy, r, base, tid, n, a)
                load_edge(y, r, base, tid, n, b)
                write_edge(out, r, base, tid, n, a, b, s, _ZERO)

    return kernel


def kernel_for(p: Plan, kind: str, log: bool, vec: int | None = None):
    """The compiled-on-first-call kernel of a plan; ``vec`` values per access (default: the
    16-byte :func:`~tilepy.tile.rows.natural_width` of ``kind``; 1 for the scalar kernels)."""
    vec = natural_width(kind) if vec is None else int(vec)
    if p.path == "warp":
        return warp_rows_kernel(kind, log, p.per_thread, p.warps, vec)
    if p.path == "block":
        return block_row_kernel(kind, log, p.per_thread, p.warps, vec)
    if p.path == "online":
        return online_row_kernel(kind, log, p.per_thread, p.warps, vec)
    raise ValueError(f"path must be one of {_forward.PATHS}, got {p.path!r}")


def launch_plan(dy2, y2, out2, kind: str, log: bool, p: Plan | None = None):
    """``(launch plan, arguments)`` of the kernel for 2-D kernel views ``dy2``, ``y2``,
    ``out2`` (rows, n; ``out2`` may be ``dy2`` or ``y2``): 16-byte vector kernels when all
    three views allow them (:func:`~tilepy.tile.rows.vector_width`), else the scalar ones;
    plan ``p``, default :func:`plan`."""
    rows, n = dy2.shape
    vec = vector_width(kind, dy2, y2, out2)
    p = p or plan(n, itemsize=dy2.dtype.itemsize)
    kern = kernel_for(p, kind, log, vec)
    blocks = -(-rows // p.warps) if p.path == "warp" else rows
    return LaunchPlan(kern, (dy2, y2, out2), blocks, p.threads), (dy2, y2, out2)


# ---- host wrapper -------------------------------------------------------------------------------

def softmax_backward(dy, y, axis=-1, *, out=None, config=None):
    """``dx = y · (dy - Σ dy·y)`` along ``axis``: the gradient of ``tilepy.softmax`` (like
    ``torch._softmax_backward_data(dy, y, axis, y.dtype)``).

    * ``dy``: the gradient of the softmax output; ``y``: the softmax output. CuPy arrays,
      PyTorch tensors or Numba device arrays (NumPy arrays in the CUDA simulator), both of one
      kind, shape and dtype — float32, float16 or bfloat16 — any rank (0-d included), any
      strides. The result has that dtype; the arithmetic is float32.
    * ``axis``: an integer in ``[-ndim, ndim)`` (``-1`` or ``0`` for a 0-d input).
    * ``out``: optional array of the same kind, shape and dtype; it may be ``dy`` or ``y``
      itself. Returned.
    * ``config``: a :class:`tilepy.ops.softmax.Plan` to run instead of :func:`plan`'s;
      ``ValueError`` when it cannot run rows of this length (:func:`check_config`).
    * A NaN in a row of ``dy`` or ``y`` makes that row NaN. Zero-size inputs give an empty
      result. Computed on the inputs' device and the caller's current stream; every user
      error is raised (``TypeError`` / ``ValueError`` naming the argument) before anything is
      launched. A repeated call with the same signature reuses its launch plan.
    """
    return _backward(dy, y, axis, out, False, config)


def log_softmax_backward(dy, y, axis=-1, *, out=None, config=None):
    """``dx = dy - exp(y) · Σ dy`` along ``axis``: the gradient of ``tilepy.log_softmax``
    (like ``torch._log_softmax_backward_data(dy, y, axis, y.dtype)``), ``y`` being the
    log_softmax output.

    Same arguments, layouts, dtypes and rules as :func:`softmax_backward`, except for NaN: a
    NaN in ``dy`` makes its row NaN, a NaN in ``y`` its own element (``exp(NaN)``).
    """
    return _backward(dy, y, axis, out, True, config)


def output_spec(dy, y, axis=-1, *, out=None, config=None):
    """``(shape, dtype name)`` of ``softmax_backward`` / ``log_softmax_backward``'s result,
    after every check they make before launching (the same errors); reads only metadata, so
    it also takes PyTorch fake tensors (the registered operators' meta functions)."""
    DY = _check(dy, y, axis, out, config)[0]
    return DY.shape, DY.dtype


_PLANS = PlanCache()


def _backward(dy, y, axis, out, log: bool, config=None):
    """Reuse the launch plan of an earlier call with the same signature (kinds, dtypes,
    shapes, strides, device, alignment, axis), else validate, launch and remember."""
    fd, pd = arrays.fingerprint(dy)
    fy, py = arrays.fingerprint(y)
    fo, po = arrays.fingerprint(out)
    # the axis's type too: 1.0 and True compare equal to 1 but are refused
    cached, key = _PLANS.lookup((fd, fy, fo, type(axis), axis, log, config))
    if cached is not None:
        bound, stream, alloc = cached
        if out is None:
            out, po = alloc()
        bound(stream(), (pd, py, po))
        return out
    return _checked_backward(dy, y, axis, out, log, key, config)


def _check(dy, y, axis, out, config):
    """Validate the arguments: ``(dy, y, out (or None), axis, device, n)``, the arrays as
    operands, the axis normalised."""
    DY = describe(dy, "dy")
    Y = describe(y, "y")
    Out = describe(out, "out") if out is not None else None
    device = arrays.same_device(DY, Y, Out)
    ax = normalize_axis(axis, DY.ndim, "dy")
    if Y.shape != DY.shape:
        raise ValueError(f"y must have shape {DY.shape} (that of dy), got {Y.shape}")
    if Y.dtype != DY.dtype:
        raise ValueError(f"y must have dtype {DY.dtype} (that of dy), got {Y.dtype}")
    if Out is not None:
        if Out.shape != DY.shape:
            raise ValueError(f"out must have shape {DY.shape} (that of dy), got {Out.shape}")
        if Out.dtype != DY.dtype:
            raise ValueError(f"out must have dtype {DY.dtype} (that of dy), got {Out.dtype}")
        arrays.check_distinct(Out)
    n = DY.shape[ax] if DY.ndim else 1
    if config is not None:
        check_config(config, n)
    return DY, Y, Out, ax, device, n


def _checked_backward(dy, y, axis, out, log: bool, key, config=None):
    DY, Y, Out, ax, device, n = _check(dy, y, axis, out, config)
    caller_out = out is not None
    if out is None:
        out = arrays.empty(DY, DY.shape, DY.dtype)
        Out = describe(out, "out")
    if any(s == 0 for s in DY.shape):
        return out
    kind = DY.dtype
    p = config or plan(n, itemsize=arrays.ITEMSIZE[kind])
    with arrays.on_device(device):
        bound = run_rows((DY, Y), Out, ax,
                         lambda v, out2: launch_plan(v[0], v[1], out2, kind, log, p)[0])
    if bound is not None:
        alloc = None if caller_out else arrays.allocator(DY, DY.shape, DY.dtype)
        _PLANS.put(key, (bound, arrays.stream_getter(DY), alloc))
    return out


# ---- offline compile check ----------------------------------------------------------------------

def argtypes(kind: str, layout: str = "A"):
    """Numba argument types of every kernel here: (dy, y, out) 2-D arrays of ``kind``."""
    from numba import types

    el = types.float32 if kind == "float32" else types.uint16
    arr = types.Array(el, 2, layout)
    return (arr, arr, arr)


def compile_plans():
    """(name, plan, kind, log, vec) of the kernels the offline report compiles — the plans
    :func:`launch_plan` runs on the GPU: every warp and block bucket and the two-pass kernel
    in float32 and float16 with 16-byte accesses, bfloat16 and log_softmax at a few lengths,
    and scalar (misaligned-row) kernels."""
    from ..arrays import ITEMSIZE

    items = []

    def add(prefix, kind, n, log, vec):
        p = plan(n, simulator=False, itemsize=ITEMSIZE[kind])
        items.append((f"{prefix}_{kind}_n{n}_v{vec}_{p.path}_{p.warps}w_x{p.per_thread}", p,
                      kind, log, vec))

    for kind in ("float32", "float16"):
        for n in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 16385):
            add("softmax_backward", kind, n, False, natural_width(kind))
    for n in (512, 8192, 16384, 16385):
        add("softmax_backward", "bfloat16", n, False, 8)
        add("log_softmax_backward", "float16", n, True, 8)
        add("log_softmax_backward", "float32", n, True, 4)
    for n in (512, 8192, 16384, 16385):
        add("softmax_backward", "float16", n, False, 1)
        add("log_softmax_backward", "bfloat16", n, True, 1)
    add("softmax_backward", "float32", 16384, False, 1)
    add("softmax_backward", "float32", 16385, False, 1)
    return items


def compile_reports(only=None, layouts=("A",)):
    """Offline sm_90 reports of :func:`compile_plans` (registers, spills, local memory,
    instruction counts), or of those whose name is in ``only``, for each array layout in
    ``layouts`` ("A": strided rows, "C": contiguous); entries are named ``"{name}:{layout}"``
    and compiled with the launch bounds the real kernels carry.

    Run without the simulator: ``tilepy.offline.run_in_subprocess(
    "tilepy.ops.softmax_backward:compile_reports")``.
    """
    import re

    from ..offline import compile_kernel

    out = []
    for name, p, kind, log, vec in compile_plans():
        if only is not None and name not in only:
            continue
        for layout in layouts:
            bounds = launch_bounds(p, vec)
            entry = {"name": f"{name}:{layout}", "layout": layout, "path": p.path,
                     "warps": p.warps, "per_thread": p.per_thread, "threads": p.threads,
                     "kind": kind, "log": log, "vec": vec, "launch_bounds": bounds,
                     "register_bytes": register_bytes(p, vec)}
            try:
                rep = compile_kernel(name, kernel_for(p, kind, log, vec).py_func,
                                     argtypes(kind, layout), (9, 0), launch_bounds=bounds)
            except Exception as e:  # noqa: BLE001  (reported per kernel)
                entry["error"] = f"{type(e).__name__}: {e}"
            else:
                entry.update(_forward.report_fields(rep, p.threads),
                             vector_loads=len(re.findall(r"^\s*ld\.global(\.\w+)*\.v4",
                                                         rep.ptx, re.M)))
            out.append(entry)
    return out


__all__ = ["MEDIUM_MAX", "SHORT_MAX", "log_softmax_backward", "output_spec", "plan",
           "softmax_backward"]
