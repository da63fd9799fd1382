"""``tilepy.softmax`` and ``tilepy.log_softmax`` along one axis, float32 arithmetic inside.

Host wrapper (validation, layout, choice of kernel) and three row kernels. Every kernel works
on a 2-D view ``(rows, n)`` of the data — unit element stride, any positive row stride — and
computes, per row, with ``m = max(row)`` and ``s = Σ exp(x - m)``:

* softmax:      ``exp(x - m) / s``     (as ``ex2((x - m)·log2 e) · (1/s)``)
* log_softmax:  ``(x - m) - log(s)``

Kernels (picked by the row length ``n``; thresholds :data:`SHORT_MAX`, :data:`MEDIUM_MAX`):

=========  ======================  =============================================================
path       rows                    how
=========  ======================  =============================================================
``warp``   ``n <= SHORT_MAX``      one warp per row, :data:`SHORT_WARPS` rows per block; each
                                   lane holds ``bucket/32`` values in registers (bucket = the
                                   next power of two ≥ max(n, 32)); warp shuffles only.
``block``  ``n <= MEDIUM_MAX``     one block per row; each thread holds ``per_thread`` values in
                                   registers (64 bytes: 16 float32 / 32 16-bit values; long
                                   rows 512 threads, two blocks per SM); block reductions
                                   through a few words of shared memory. One read, one write.
``online`` longer                  one block per row; pass 1 keeps a running max and running sum
                                   per thread (rescaled when the max grows), the block combines
                                   them; pass 2 reads the row again and writes it. Two reads.
=========  ======================  =============================================================

Memory access: when the data pointers and row strides of ``x`` and ``out`` are multiples of 16
bytes (:func:`vector_width`, decided on the host; the launch-plan key holds the pointers'
alignment), every kernel moves 16 bytes per lane and access (``ld/st.global.v4``: 4 float32 or
8 16-bit values), thread ``t`` owning the groups ``t, t + T, …`` so that a warp covers 512
contiguous bytes; the row's last partial group is read and written one element at a time
(the loads and stores: :mod:`tilepy.tile.rows`). Otherwise (a misaligned base or row stride,
rows shorter than a vector) the same kernels are built with one element per access.

All sizes inside a kernel are closure constants (elements per thread, warps, unroll), so the
value loops unroll and the values stay in registers; kernels are cached per
(path, dtype, log, sizes): at most ~6 warp buckets and ~5 block buckets per dtype.

Numerics (float32 inside, whatever the dtype in and out):

* ``exp`` is ``ex2.approx.ftz.f32`` of ``(x - m) · log2(e)`` (:func:`tilepy.ptx.math.ex2_approx`):
  the subtraction comes first, so large inputs (±1e4) lose nothing — folding log2(e) into an
  FMA ``x·c - m·c`` would cost ~1e-3 relative error there. Results below 2**-126 flush to 0.
* A NaN anywhere in a row makes the whole row NaN (max propagates NaN,
  :mod:`tilepy.tile.reduce`); a row that is all -inf gives NaN (``-inf - -inf``), and a +inf
  gives NaN for its row — as PyTorch does.
* With 16-byte accesses the warp and block kernels keep 16-bit rows as loaded, two values
  per uint32 register, and widen them where needed (softmax computes the exponential again
  for the output: same instruction, same argument, same result).
* 16-bit data travel as uint16 bits (:func:`tilepy.arrays.kernel_view`); float16 is widened
  with ``cvt.f32.f16``, bfloat16 by a 16-bit shift, and the result is rounded to nearest even
  with ``cvt.rn.{f16,bf16}x2.f32``.

Layouts: the reduced axis is read in place when it has unit stride and the other axes collapse
into one row index with a positive stride (the last axis of any C-contiguous array, a row
slice ``x[:, :n]``, a strided row selection ``x[::2]``, ``axis=0`` of a transposed matrix…).
Anything else (``axis=0`` of a row-major matrix, a transposed or broadcast input along its
last axis) is first copied into a new contiguous buffer with the axis last, through the
caller's array library on the caller's stream (PyTorch ``movedim(ax, -1).clone()``, CuPy /
NumPy ``array(moveaxis(x, ax, -1), copy=True)``, Numba device-array assignment); the kernel
runs in place on that buffer, and the result is copied into ``out`` (through the moved view of
``out``). When only ``out`` has such a layout, the kernel writes a new buffer that is then
copied into ``out``. Each copy is one more read and write of the tensor; the copies of a
transpose are PyTorch's / CuPy's strided copy kernels (Numba's generic assignment kernel for
Numba arrays, much slower).

``out`` may be ``x`` itself (every element is read before it, or by the thread that writes
it), but not a different view that overlaps ``x``.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np
from numba import cuda

from .. import arrays
from ..arrays import describe
from ..inline import inline_device
from ..launch import LaunchPlan, PlanCache
from ..ptx.math import (
    cvt_bf16x2_f32,
    cvt_f16x2_f32,
    ex2_approx,
    unpack_bf16x2_f32,
    unpack_f16x2_f32,
)
from ..tile.reduce import block_row_reduce, combine, warp_reduce
from ..tile.rows import (  # noqa: F401  (natural_width, vector_width: part of this op's API)
    VECTOR_BYTES,
    natural_width,
    packs_registers,
    register_row,
    register_row_writer,
    vector_width,
)
from ..cache import StoredChoices, autotune_enabled, current_gpu_name, make_key, tilepy_version
from ..kcache import cached_jit

# ---- thresholds and configs (module level, so that tests can force a path) ----------------

#: Rows up to this length take the warp-per-row kernel.
SHORT_MAX = 1024
#: Rows up to this length (and longer than SHORT_MAX) take the block-per-row register kernel
#: (32768: 1024 threads × 32 values, within the 64 registers a 1024-thread block may use).
MEDIUM_MAX = 32768
#: Rows (warps) per block of the warp path.
SHORT_WARPS = 4
#: Bytes per thread the block path aims at (16 float32 / 32 16-bit values: four 16-byte
#: loads in flight per thread); threads = bucket bytes / this, within [32, MEDIUM_WIDE_THREADS].
MEDIUM_BYTES_PER_THREAD = 64
#: Threads of the block path for long rows: blocks of this size get launch bounds for two
#: blocks per SM (at most 64 registers), so one block's loads overlap the other's reductions.
#: A row of more than MEDIUM_WIDE_THREADS × 2 × MEDIUM_BYTES_PER_THREAD bytes takes
#: MEDIUM_MAX_THREADS threads (float32 32768: 1024 × 32 values, one block per SM).
MEDIUM_WIDE_THREADS = 512
#: Largest block of the block path (GPU / simulator, where every thread is a Python thread).
MEDIUM_MAX_THREADS = 1024
SIM_MEDIUM_MAX_THREADS = 128
#: (warps, values per thread per step) of the online path, GPU / simulator.
ONLINE = (16, 16)
SIM_ONLINE = (2, 2)

PATHS = ("warp", "block", "online")
WARP = 32

_LOG2E = np.float32(1.4426950408889634)
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


@dataclass(frozen=True)
class Plan:
    """Which kernel runs a row of ``n`` values: ``path``, ``warps`` per block, and
    ``per_thread`` values per thread (online path: per thread and per step)."""

    path: str
    warps: int
    per_thread: int

    @property
    def threads(self) -> int:
        return self.warps * WARP

    def describe(self) -> str:
        what = "values per thread per step" if self.path == "online" else "values per thread"
        return f"{self.path} {self.warps} warps x {self.per_thread} {what}"


#: Most bytes of row a thread of the warp or block path keeps in registers (the heuristic's
#: largest: float32 rows of 32768 at 1024 threads, 16-bit rows of 32768 at 512 threads).
MAX_BYTES_PER_THREAD = 128
#: Most values per thread and step of the online path.
MAX_ONLINE_UNROLL = 32


def check_plan(p, n: int, itemsize: int = 4, *, simulator: bool | None = None) -> None:
    """Raise ``ValueError`` (``TypeError`` for a non-Plan) saying which constraint ``p`` breaks
    for rows of ``n`` values of ``itemsize`` bytes; return None when it can run them. The
    register limit is a GPU's (the simulator, whose blocks are kept small, has none)."""
    if not isinstance(p, Plan):
        raise TypeError(f"config must be a tilepy.ops.softmax.Plan, got {type(p).__name__}")
    if p.path not in PATHS:
        raise ValueError(f"plan path must be one of {PATHS}, got {p.path!r}")
    if not isinstance(p.warps, int) or not 1 <= p.warps <= MEDIUM_MAX_THREADS // WARP:
        raise ValueError(f"plan warps must be an int in 1 … {MEDIUM_MAX_THREADS // WARP} "
                         f"(at most {MEDIUM_MAX_THREADS} threads per block), got {p.warps!r}")
    if not isinstance(p.per_thread, int) or p.per_thread < 1:
        raise ValueError(f"plan per_thread must be a positive int, got {p.per_thread!r}")
    if p.path == "online":
        if p.per_thread > MAX_ONLINE_UNROLL:
            raise ValueError(f"an online plan takes at most {MAX_ONLINE_UNROLL} values per "
                             f"thread per step, got {p.per_thread}")
        return
    cover = p.per_thread * (WARP if p.path == "warp" else p.threads)
    if cover < n:
        raise ValueError(f"{p.describe()} covers rows of {cover} values, {n - cover} short of "
                         f"n = {n}")
    held = p.per_thread * int(itemsize)
    sim = arrays.SIMULATOR if simulator is None else simulator
    if held > MAX_BYTES_PER_THREAD and not sim:
        raise ValueError(f"{p.describe()} keeps {held} bytes per thread in registers, "
                         f"{held - MAX_BYTES_PER_THREAD} over the {MAX_BYTES_PER_THREAD} that "
                         "fit without spilling")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def plan(n: int, *, simulator: bool | None = None, itemsize: int = 4) -> Plan:
    """The kernel and its sizes for rows of ``n`` values (``n >= 1``) of ``itemsize`` bytes.

    Block path: the same bytes per thread for every dtype (:data:`MEDIUM_BYTES_PER_THREAD`;
    16-bit rows are kept two values per register, :func:`packs_registers`), so a float16
    thread has as many bytes in flight as a float32 one; up to MEDIUM_WIDE_THREADS threads
    (two blocks per SM), then twice the bytes per thread, then MEDIUM_MAX_THREADS threads."""
    sim = arrays.SIMULATOR if simulator is None else simulator
    if n <= SHORT_MAX:
        bucket = max(WARP, _pow2_at_least(n))
        return Plan("warp", SHORT_WARPS, bucket // WARP)
    if n <= MEDIUM_MAX:
        return block_plan(n, itemsize=itemsize, simulator=sim)
    warps, unroll = SIM_ONLINE if sim else ONLINE
    return Plan("online", warps, unroll)


def block_plan(n: int, *, itemsize: int = 4, simulator: bool | None = None) -> Plan:
    """The block path's plan for rows of ``n`` values, a thread holding ``itemsize`` bytes per
    value (the dtype's size here; an op that holds more per value says so): threads for
    :data:`MEDIUM_BYTES_PER_THREAD` bytes each, up to MEDIUM_WIDE_THREADS (two blocks per SM),
    then twice the bytes per thread, then MEDIUM_MAX_THREADS threads (in the simulator at
    most SIM_MEDIUM_MAX_THREADS). The row (rounded up to a power of two) is covered; whether
    the registers suffice is :func:`check_plan`'s question."""
    sim = arrays.SIMULATOR if simulator is None else simulator
    bucket = _pow2_at_least(n)
    per = max(1, MEDIUM_BYTES_PER_THREAD // int(itemsize))
    if sim:
        threads = min(SIM_MEDIUM_MAX_THREADS, max(WARP, bucket // per))
    else:
        threads = max(WARP, bucket // per)
        if threads > MEDIUM_WIDE_THREADS:
            threads = MEDIUM_WIDE_THREADS if bucket // MEDIUM_WIDE_THREADS <= 2 * per \
                else MEDIUM_MAX_THREADS
    return Plan("block", threads // WARP, bucket // threads)


# ---- the plan a tuning run persisted ----------------------------------------------------------
# ``python -m tilepy tune softmax`` (tilepy.tune.softmax_space) writes the winner under
# softmax_key as plan_fields; the ops read it back here (one choice serves both ops).

TUNED_OP = "softmax"
_stored = StoredChoices(TUNED_OP)


def softmax_key(rows: int, n: int, dtype: str, gpu: str) -> str:
    """The tuning-cache key of a softmax problem (rows and n bucketed to powers of two)."""
    return make_key(TUNED_OP, (rows, n), dtype, gpu, tilepy_version())


def plan_fields(p) -> dict:
    """What a persisted choice stores to rebuild plan ``p``."""
    return {"path": p.path, "warps": p.warps, "per_thread": p.per_thread}


def plan_from_fields(fields, n: int, dtype: str):
    """The plan a persisted choice names, or None when it is malformed or cannot run rows of
    ``n`` values of ``dtype`` (:func:`check_plan`)."""
    if not isinstance(fields, dict):
        return None
    try:
        p = Plan(str(fields["path"]), fields["warps"], fields["per_thread"])
        check_plan(p, n, arrays.ITEMSIZE[dtype])
    except (KeyError, TypeError, ValueError):
        return None
    return p


def tuned_softmax_plan(rows: int, n: int, dtype: str, device=None):
    """The persisted tuned plan for ``rows`` rows of ``n`` values of ``dtype``, or None (none
    stored, or ``TILEPY_AUTOTUNE=0``). ``device``: the operands' CUDA device id (None: the
    current one). Never tunes."""
    if not autotune_enabled():
        return None
    return _stored.lookup((rows, n, dtype, device), lambda: current_gpu_name(device),
                          lambda gpu: softmax_key(rows, n, dtype, gpu),
                          lambda entry: plan_from_fields(entry.get("fields"), n, dtype))


def forget_choices() -> None:
    """Drop this process's memory of the tuning file (after it changed)."""
    _stored.forget()


@functools.cache
def _finish(log: bool):
    """``f(v, m, k) -> float32``: the output of input value ``v`` given the row max ``m`` and
    ``k`` = 1/sum (softmax) or log(sum) (log_softmax)."""
    if log:
        @inline_device
        def f(v, m, k):
            return (v - m) - k
    else:
        @inline_device
        def f(v, m, k):
            return ex2_approx((v - m) * _LOG2E) * k
    return f


@functools.cache
def _exp_and_sum(K: int, log: bool):
    """``sum_exp(vals, m) -> float32``: ``Σ_k 2^((vals[k] - m)·log2 e)`` over a K-value
    register array. For softmax it also replaces ``vals[k]`` by its exponential (the kernel
    then only scales it: one ex2 per element); log_softmax keeps the inputs."""
    keep = bool(log)

    @inline_device
    def sum_exp(vals, m):
        s = _ZERO
        for k in range(K):
            e = ex2_approx((vals[k] - m) * _LOG2E)
            s += e
            if not keep:
                vals[k] = e
        return s

    return sum_exp


@functools.cache
def _from_registers(log: bool):
    """``f(r, m, k) -> float32``: the output from what :func:`_exp_and_sum` left in a
    register: ``r · (1/sum)`` for softmax, ``(r - m) - log(sum)`` for log_softmax."""
    if log:
        @inline_device
        def f(r, m, k):
            return (r - m) - k
    else:
        @inline_device
        def f(r, m, k):
            return r * k
    return f


@functools.cache
def _row_constant(log: bool):
    """``g(s) -> float32``: 1/s for softmax, log(s) for log_softmax."""
    if log:
        @inline_device
        def g(s):
            return np.float32(math.log(s))
    else:
        @inline_device
        def g(s):
            return _ONE / s
    return g


# ---- kernels --------------------------------------------------------------------------------

def _kernel_jit(bounds):
    """``cuda.jit`` with ``launch_bounds=bounds`` (threads, or (threads, min blocks per SM))
    on the GPU: ptxas then keeps the registers within what a block of that size may use (64
    per thread at 1024 threads, or at 512 threads and two blocks), instead of failing the
    launch. The simulator's jit takes no launch bounds."""
    if arrays.SIMULATOR:
        return cuda.jit
    return cached_jit(launch_bounds=bounds)


def launch_bounds(p: Plan, kind: str, vec: int, log: bool = False):
    """The launch bounds of the kernel of plan ``p``: its threads, plus a minimum of two
    blocks per SM for MEDIUM_WIDE_THREADS-thread blocks of the block path, except when the
    values would not fit in 64 registers: scalar 16-bit kernels keep a float32 register per
    value (more than 32 values per thread), and the packed log_softmax kernel of 64 values per
    thread spilled (212 spill stores at 64 registers, offline sm_90), so it keeps one."""
    wide = p.path == "block" and p.threads == MEDIUM_WIDE_THREADS
    if wide and (p.per_thread <= 32 or (packs_registers(kind, vec) and not log)):
        return (p.threads, 2)
    return p.threads


@functools.cache
def _register_row(kind: str, log: bool, per_thread: int, vec: int, stride: int):
    """``(slots, dtype, load, sum_exp, write)`` for a row held in registers, ``K`` values per
    thread in groups of ``vec`` (:func:`tilepy.tile.rows.register_row`: group ``g`` of the
    thread whose first group is ``first`` is group ``first + stride·g`` of the row; columns
    past the row read as -inf). The kernel holds them in ``cuda.local.array(slots, dtype)``:
    K float32 values, or (:func:`packs_registers`) K/2 uint32 words of two 16-bit values.
    ``load(x, row, first, n, vals)`` fills ``vals`` and returns the thread's max;
    ``sum_exp(vals, m)`` its part of the row sum; ``write(out, row, first, n, vals, m, s)``
    turns the values into the result and stores them. Shared by the warp-per-row and
    block-per-row kernels, which differ only in how they reduce."""
    if packs_registers(kind, vec):
        return _packed_register_row(kind, log, per_thread, stride)
    regs = register_row(kind, per_thread, vec, stride, -np.inf)
    K = regs.values
    load_row, store_row = regs.load, regs.store
    mx = combine("max")
    finish = _from_registers(log)
    constant = _row_constant(log)

    @inline_device
    def load(x, row, first, n, vals):
        load_row(x, row, 0, first, n, vals)
        m = vals[0]
        for k in range(1, K):
            m = mx(m, vals[k])
        return m

    @inline_device
    def write(out, row, first, n, vals, m, s):
        kk = constant(s)
        for k in range(K):
            vals[k] = finish(vals[k], m, kk)
        store_row(out, row, 0, first, n, vals)

    return K, np.float32, load, _exp_and_sum(K, log), write


@functools.cache
def _packed_register_row(kind: str, log: bool, per_thread: int, stride: int):
    """:func:`_register_row` for 16-bit data with 16-byte accesses: the thread keeps the
    words it loaded (two values each, ``lo`` = the lower column), K/2 registers for K values
    instead of K, and widens a word whenever it needs the values: for the max, for the sum of
    exponentials, and again for the output (softmax computes ``2^((v - m)·log2 e)`` a second
    time there instead of keeping K float32 exponentials: the same ex2.approx of the same
    argument, so the same result). With the registers halved a thread can hold as many bytes
    as a float32 one (64 values in the 64 registers of a 1024-thread or 2-blocks-of-512 launch).
    Columns past ``n`` load as -inf bits and are never stored."""
    regs = register_row(kind, per_thread, VECTOR_BYTES // 2, stride, -np.inf, packed=True)
    KW = regs.slots
    load_row = regs.load
    unpack = unpack_f16x2_f32 if kind == "float16" else unpack_bf16x2_f32
    pack = cvt_f16x2_f32 if kind == "float16" else cvt_bf16x2_f32
    mx = combine("max")
    finish = _finish(log)
    constant = _row_constant(log)

    @inline_device
    def load(x, row, first, n, words):
        load_row(x, row, 0, first, n, words)
        m, hi = unpack(words[0])
        m = mx(m, hi)
        for j in range(1, KW):
            lo, hi = unpack(words[j])
            m = mx(mx(m, lo), hi)
        return m

    @inline_device
    def sum_exp(words, m):
        s = _ZERO
        for j in range(KW):
            lo, hi = unpack(words[j])
            s += ex2_approx((lo - m) * _LOG2E)
            s += ex2_approx((hi - m) * _LOG2E)
        return s

    @inline_device
    def result(w, m, kk):
        lo, hi = unpack(w)
        return pack(finish(lo, m, kk), finish(hi, m, kk))

    @inline_device
    def result_of(w, _, m, kk):
        return result(w, m, kk)

    # group by group (a group's words die as soon as it is stored: fewer live registers)
    write_row = register_row_writer(kind, per_thread, VECTOR_BYTES // 2, stride, True,
                                    result_of).write

    @inline_device
    def write(out, row, first, n, words, m, s):
        write_row(out, row, 0, first, n, words, words, m, constant(s))

    return KW, np.uint32, load, sum_exp, write


@functools.cache
def warp_rows_kernel(kind: str, log: bool, per_lane: int, warps: int, vec: int = 1):
    """``kernel(x, out)``: rows of ``n <= 32 * per_lane`` values, one warp per row.

    Launch with ``ceil(rows / warps)`` blocks of ``warps * 32`` threads. With ``vec`` values
    per access, lane ``l`` holds the groups ``g = l, l + 32, …`` (columns ``vec·g … vec·g +
    vec - 1``; one 16-byte access per group when ``vec > 1``, coalesced across the warp), at
    least ``per_lane`` values. Warps past the last row still take part in the shuffles (the
    simulator needs every thread of a block at each one) but load and store nothing.
    """
    K, DT, load, sum_exp, write = _register_row(kind, log, per_lane, vec, WARP)
    row_max = warp_reduce("max")
    row_sum = warp_reduce("sum")
    W = int(warps)

    @_kernel_jit(W * WARP)
    def kernel(x, out):
        rows = x.shape[0]
        tid = cuda.threadIdx.x
        lane = tid & 31
        row = cuda.blockIdx.x * W + (tid >> 5)
        valid = row < rows
        n = x.shape[1] if valid else 0
        vals = cuda.local.array(K, DT)
        m = row_max(load(x, row, lane, n, vals))
        s = row_sum(sum_exp(vals, m))
        if valid:
            write(out, row, lane, n, vals, m, s)

    return kernel


@functools.cache
def block_row_kernel(kind: str, log: bool, per_thread: int, warps: int, vec: int = 1):
    """``kernel(x, out)``: rows of ``n <= 32 * warps * per_thread`` values, one block per row.

    Launch with ``rows`` blocks of ``warps * 32`` threads. Thread ``t`` holds the groups
    ``g = t, t + T, …`` of ``vec`` values (T threads; coalesced) in registers; the row max and
    sum go through :func:`tilepy.tile.reduce.block_row_reduce` (``warps`` floats of shared
    memory, 4 barriers). One read, one write.
    """
    W = int(warps)
    T = W * WARP
    K, DT, load, sum_exp, write = _register_row(kind, log, per_thread, vec, T)
    row_max = block_row_reduce("max", W)
    row_sum = block_row_reduce("sum", W)

    @_kernel_jit(launch_bounds(Plan("block", W, int(per_thread)), kind, vec, log))
    def kernel(x, out):
        n = x.shape[1]
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array(W, np.float32)
        vals = cuda.local.array(K, DT)
        m = row_max(load(x, row, tid, n, vals), scratch)
        s = row_sum(sum_exp(vals, m), scratch)
        write(out, row, tid, n, vals, m, s)

    return kernel


@functools.cache
def online_row_kernel(kind: str, log: bool, unroll: int, warps: int, vec: int = 1):
    """``kernel(x, out)``: rows of any length, one block per row, two reads of the row.

    Launch with ``rows`` blocks of ``warps * 32`` threads. Pass 1 walks the row in steps of
    ``T * U`` values (T threads, U = ``unroll`` rounded up to groups of ``vec``; thread ``t``
    takes the groups ``t + T·u`` of each step, coalesced); per step a thread takes the max
    ``m'`` of its ``U`` values and updates its running sum ``s = s·2^((m - m')·log2 e) +
    Σ 2^((v - m')·log2 e)``. While ``m'`` is still -inf nothing is added (``-inf - -inf``
    would be NaN and poison a row that has finite values later). Then the block takes ``M =
    max m`` and ``S = Σ s·2^((m - M)·log2 e)``; a thread that saw only -inf adds 0, unless the
    whole row is -inf, which gives NaN as it should. Pass 2 reads the row again and writes it.
    """
    V = int(vec)
    W = int(warps)
    T = W * WARP
    regs = register_row(kind, unroll, V, T, -np.inf)
    U = regs.values
    load_row, inside = regs.load, regs.inside
    load_inside, load_edge = regs.load_inside, regs.load_edge
    store_inside, store_edge = regs.store_inside, regs.store_edge
    mx = combine("max")
    STEP = T * U
    row_max = block_row_reduce("max", W)
    row_sum = block_row_reduce("sum", W)
    finish = _finish(log)
    constant = _row_constant(log)

    @_kernel_jit(T)
    def kernel(x, out):
        n = x.shape[1]
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        scratch = cuda.shared.array(W, np.float32)
        vals = cuda.local.array(U, np.float32)
        m = _NEG_INF
        s = _ZERO
        for base in range(0, n, STEP):
            load_row(x, row, base, tid, n, vals)
            step_max = vals[0]
            for u in range(1, U):
                step_max = mx(step_max, vals[u])
            m_new = mx(m, step_max)
            if m_new != _NEG_INF:  # NaN passes too, and poisons s as it should
                t = _ZERO
                for u in range(U):
                    t += ex2_approx((vals[u] - m_new) * _LOG2E)
                s = s * ex2_approx((m - m_new) * _LOG2E) + t
                m = m_new
        big_m = row_max(m, scratch)
        s = s * ex2_approx((m - big_m) * _LOG2E)
        total = row_sum(s, scratch)
        kk = constant(total)
        for base in range(0, n, STEP):
            if inside(base, tid, n):
                load_inside(x, row, base, tid, vals)
                for u in range(U):
                    vals[u] = finish(vals[u], big_m, kk)
                store_inside(out, row, base, tid, vals)
            else:
                load_edge(x, row, base, tid, n, vals)
                for u in range(U):
                    vals[u] = finish(vals[u], big_m, kk)
                store_edge(out, row, base, tid, n, vals)

    return kernel


def kernel_for(p: Plan, kind: str, log: bool, vec: int | None = None):
    """The compiled-on-first-call kernel of a plan; ``vec`` values per access (default: the
    16-byte :func:`natural_width` of ``kind``; 1 for the scalar kernels)."""
    vec = natural_width(kind) if vec is None else int(vec)
    if p.path == "warp":
        return warp_rows_kernel(kind, log, p.per_thread, p.warps, vec)
    if p.path == "block":
        return block_row_kernel(kind, log, p.per_thread, p.warps, vec)
    if p.path == "online":
        return online_row_kernel(kind, log, p.per_thread, p.warps, vec)
    raise ValueError(f"path must be one of {PATHS}, got {p.path!r}")


def launch_plan(x2, out2, kind: str, log: bool, p: Plan | None = None):
    """``(launch plan, arguments)`` of the kernel for 2-D kernel views ``x2``, ``out2``
    (rows, n); ``out2`` may be ``x2`` itself (in place). 16-byte vector kernels when both
    views allow them (:func:`vector_width`), else the scalar ones."""
    rows, n = x2.shape
    p = p or plan(n, itemsize=x2.dtype.itemsize)
    kern = kernel_for(p, kind, log, vector_width(kind, x2, out2))
    blocks = -(-rows // p.warps) if p.path == "warp" else rows
    return LaunchPlan(kern, (x2, out2), blocks, p.threads), (x2, out2)


def launch(x2, out2, kind: str, log: bool, stream=0, p: Plan | None = None) -> Plan:
    """Run the kernel for 2-D kernel views ``x2``, ``out2`` (rows, n) on ``stream``.
    ``out2`` may be ``x2`` itself (in place). Returns the plan used."""
    p = p or plan(x2.shape[1], itemsize=x2.dtype.itemsize)
    lp, args = launch_plan(x2, out2, kind, log, p)
    lp.launch(stream, args)
    return p


# ---- host wrapper ---------------------------------------------------------------------------

def softmax(x, axis=-1, *, out=None, config=None):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis``, like ``torch.softmax(x, axis)``.

    * ``x``: a CuPy array, PyTorch tensor or Numba device array (a NumPy array in the CUDA
      simulator) of float32, float16 or bfloat16, any rank (0-d included) and any strides.
      The result has the dtype of ``x``; the arithmetic is float32.
    * ``axis``: an integer in ``[-ndim, ndim)`` (``-1`` or ``0`` for a 0-d input).
    * ``out``: optional array of the same kind, shape and dtype; it may be ``x`` itself
      (in place). Returned.
    * The last axis of a row-major array (any row stride, unit element stride) is read in
      place; other axes and layouts go through a contiguous copy (see the module docstring).
    * A row that contains NaN or +inf, or is all -inf, comes out NaN. Zero-size inputs give
      an empty result. Computed on the inputs' device and the caller's current stream; every
      user error is raised before anything is launched.
    * ``config``: a :class:`Plan` (kernel path, warps, values per thread) to run instead of
      the choice persisted by ``python -m tilepy tune softmax`` for this shape, or else the
      built-in :func:`plan`; ``ValueError`` when it cannot run rows of this length
      (:func:`check_plan`).
    """
    return _softmax(x, axis, out, False, config)


def log_softmax(x, axis=-1, *, out=None, config=None):
    """``(x - max) - log(sum(exp(x - max)))`` along ``axis``, like ``torch.log_softmax``.

    Same arguments, layouts, dtypes and rules as :func:`softmax`.
    """
    return _softmax(x, axis, out, True, config)


def normalize_axis(axis, ndim: int, name: str = "x") -> int:
    """``axis`` of an array ``name`` of ``ndim`` dimensions as an index in ``[0, ndim)`` (0 for
    a 0-d array, which takes -1 and 0); ``TypeError`` / ``ValueError`` when it is not one."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an integer, got {type(axis).__name__} {axis!r}")
    top = max(ndim, 1)
    if not -top <= axis < top:
        raise ValueError(f"axis {int(axis)} is out of range for {name} with {ndim} dimension"
                         f"{'' if ndim == 1 else 's'} (expected {-top} … {top - 1})")
    return int(axis) % top


def _rows_layout(shape, strides):
    """``(rows, n, row_stride)`` when the last axis of an array can be read in place as
    rows of ``n`` with a unit element stride and one positive row stride; else None."""
    if len(shape) == 0:
        return 1, 1, 1
    n = shape[-1]
    if n > 1 and strides[-1] != 1:
        return None
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    lead = [(s, st) for s, st in zip(shape[:-1], strides[:-1]) if s != 1]
    if not lead:
        return rows, n, max(n, 1)
    for (_, st0), (s1, st1) in zip(lead, lead[1:]):
        if st0 != st1 * s1:
            return None
    row_stride = lead[-1][1]
    if row_stride <= 0:
        return None
    return rows, n, row_stride


_PLANS = PlanCache()


def _softmax(x, axis, out, log: bool, config=None):
    """Reuse the launch plan of an earlier call with the same signature (kinds, dtypes,
    shapes, strides, device, alignment, axis), else validate, launch and remember."""
    fx, px = arrays.fingerprint(x)
    fo, po = arrays.fingerprint(out)
    cached, key = _PLANS.lookup((fx, fo, axis, log, config))
    if cached is not None:
        bound, stream, alloc = cached
        if out is None:
            out, po = alloc()
        bound(stream(), (px, po))
        return out
    return _checked_softmax(x, axis, out, log, key, config)


def output_spec(x, axis=-1, *, out=None, config=None):
    """``(shape, dtype name)`` of ``softmax`` / ``log_softmax``'s result, after every check
    they make before launching (the same errors); reads only metadata, so it also takes
    PyTorch fake tensors (the registered operators' meta functions)."""
    X = _check(x, axis, out, config)[0]
    return X.shape, X.dtype


def _check(x, axis, out, config):
    """Validate softmax's arguments: ``(x, axis, out (or None), device, n)`` as operands and
    the normalised axis."""
    X = describe(x, "x")
    ax = normalize_axis(axis, X.ndim)
    Out = describe(out, "out") if out is not None else None
    if Out is not None:
        if Out.shape != X.shape:
            raise ValueError(f"out must have shape {X.shape} (that of x), got {Out.shape}")
        if Out.dtype != X.dtype:
            raise ValueError(f"out must have dtype {X.dtype} (that of x), got {Out.dtype}")
        arrays.check_distinct(Out)
    device = arrays.same_device(X, Out)
    n = X.shape[ax] if X.ndim else 1
    if config is not None:
        check_plan(config, n, arrays.ITEMSIZE[X.dtype])
    return X, ax, Out, device, n


def _checked_softmax(x, axis, out, log: bool, key, config=None):
    X, ax, Out, device, n = _check(x, axis, out, config)
    itemsize = arrays.ITEMSIZE[X.dtype]
    caller_out = out is not None
    if out is None:
        out = arrays.empty(X, X.shape, X.dtype)
        Out = describe(out, "out")
    if any(s == 0 for s in X.shape):
        return out
    # the caller's plan, else one persisted by `python -m tilepy tune softmax`, else plan()
    p = config or tuned_softmax_plan(int(np.prod(X.shape, dtype=np.int64)) // n, n, X.dtype,
                                     device) or plan(n, itemsize=itemsize)
    with arrays.on_device(device):
        bound = _run(X, Out, ax, log, p)
    if bound is not None:
        alloc = None if caller_out else arrays.allocator(X, X.shape, X.dtype)
        _PLANS.put(key, (bound, arrays.stream_getter(X), alloc))
    return out


def _moved_layout(op, ax: int):
    """``_rows_layout`` of ``op`` seen with axis ``ax`` moved last (None: not in place)."""
    if op.ndim == 0:
        return _rows_layout((), ())
    return _rows_layout(_moved_shape(op.shape, ax), _moved_shape(op.strides, ax))


def _run(X, Out, ax: int, log: bool, p: Plan):
    """Launch; return the plan bound to (x, out) when both are read in place (a later call
    with the same signature can reuse it), else None."""
    return run_rows((X,), Out, ax,
                    lambda views, out2: launch_plan(views[0], out2, X.dtype, log, p)[0])


def run_rows(inputs, Out, ax: int, make_plan):
    """Run a row kernel along axis ``ax`` of the operands ``inputs`` (one shape and dtype,
    validated) into the operand ``Out`` (the same shape and dtype), on the first input's
    device stream; for the ops whose kernels take ``(*inputs, out)`` as 2-D kernel views
    (rows, n) and may write ``out`` over any of the inputs (every element is read before it
    is written, by the thread that writes it).

    ``make_plan(views, out2) -> LaunchPlan`` builds the launch for the views (the plan is
    launched here with ``(*views, out2)``). Each input is read in place when its axis ``ax``
    has unit stride and the other axes collapse into one row stride, else through a
    contiguous copy with the axis last (:func:`_contiguous_moved`); ``Out`` likewise is
    written in place, else the kernel writes into the first input's copy (or, with none, a
    new buffer) and that is copied into ``Out``. Returns the plan bound to ``(*inputs,
    Out)`` when nothing was copied (a later call with the same signature can reuse it),
    else None."""
    first = inputs[0]
    stream = arrays.stream_of(first)
    views, copies = [], []
    for op in inputs:
        rows = _moved_layout(op, ax)
        if rows is not None:
            views.append(_view2d(op, *rows))
        else:
            tmp = describe(_contiguous_moved(op, ax, stream), op.name)
            views.append(_view2d(tmp, *_rows_layout(tmp.shape, tmp.strides)))
            copies.append((tmp, views[-1]))
    out_rows = _moved_layout(Out, ax)
    if out_rows is not None:
        out2 = _view2d(Out, *out_rows)
        result = None
    elif copies:
        result, out2 = copies[0]        # in place in a copy
    else:
        result = describe(arrays.empty(first, _moved_shape(first.shape, ax), first.dtype),
                          "out")
        out2 = _view2d(result, *_rows_layout(result.shape, result.strides))
    lp = make_plan(views, out2)
    lp.launch(arrays.stream_handle(first), (*views, out2))
    if result is not None:
        _assign(_moved(Out, ax), result.raw, Out.family, stream)
    if copies or result is not None:
        return None
    return lp.bind([(i, op.byte_pointer()) for i, op in enumerate((*inputs, Out))])



# ---- views and copies in the caller's array library ----------------------------------------

def _view2d(op, rows: int, n: int, row_stride: int):
    """``op``'s data as a (rows, n) kernel argument with element strides (row_stride, 1)."""
    raw = arrays.raw_view(op)  # NumPy array (simulator) or Numba device array; no copy
    item = raw.dtype.itemsize
    return arrays.device_view(arrays.restride(raw, (rows, n), (row_stride * item, item)))


def _moved_shape(shape, ax):
    shape = tuple(shape)
    return shape[:ax] + shape[ax + 1:] + shape[ax:ax + 1]


def _moved(op, ax: int):
    """A view of ``op``'s array with axis ``ax`` moved last (no copy)."""
    x = op.raw
    if op.family == "torch":
        return x.movedim(ax, -1)
    if op.family == "cupy":
        import cupy

        return cupy.moveaxis(x, ax, -1)
    if op.family == "numpy":
        return np.moveaxis(x, ax, -1)
    d = x  # a Numba device array already
    order = [i for i in range(d.ndim) if i != ax] + [ax]
    return arrays.restride(d, tuple(d.shape[i] for i in order),
                            tuple(d.strides[i] for i in order))


def _contiguous_moved(op, ax: int, stream):
    """A C-contiguous copy of ``op`` with axis ``ax`` last, made on ``stream``."""
    # Always a new buffer (the kernel then runs in place on it): ``contiguous()`` and
    # ``ascontiguousarray`` would return the input itself when it already is contiguous.
    view = _moved(op, ax)
    if op.family == "torch":
        import torch

        return view.clone(memory_format=torch.contiguous_format)
    if op.family == "cupy":
        import cupy

        with cupy.cuda.Device(op.device):
            return cupy.array(view, copy=True, order="C")
    if op.family == "numpy":
        return np.array(view, copy=True, order="C")
    dst = cuda.device_array(view.shape, dtype=view.dtype, stream=stream)
    _assign(dst, view, "numba", stream)
    return dst


def _assign(dst, src, family: str, stream) -> None:
    """``dst[...] = src`` (same shape) in the caller's library, on ``stream``."""
    if family == "torch":
        dst.copy_(src)
    elif family == "cupy":
        import cupy

        with cupy.cuda.Device(dst.device.id):
            dst[...] = src
    elif family == "numpy":
        dst[...] = src
    else:
        dst.setitem((slice(None),) * dst.ndim, src, stream=stream)


# ---- offline compile check -------------------------------------------------------------------

def argtypes(kind: str, layout: str = "A"):
    """Numba argument types of every kernel here: (x, out) 2-D arrays of ``kind``."""
    from numba import types

    el = types.float32 if kind == "float32" else types.uint16
    arr = types.Array(el, 2, layout)
    return (arr, arr)


def compile_plans():
    """(name, plan, kind, log) of the kernels the offline report compiles: every warp and
    block bucket in float32 and float16, the online kernel, and a few bf16 / log variants."""
    items = []
    for kind in ("float32", "float16"):
        for n in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 32769):
            p = plan(n, simulator=False, itemsize=arrays.ITEMSIZE[kind])
            items.append((f"softmax_{kind}_n{n}_{p.path}_{p.warps}w_x{p.per_thread}", p, kind,
                          False))
    for n in (1024, 16384, 32768, 32769):
        p = plan(n, simulator=False, itemsize=2)
        items.append((f"softmax_bfloat16_n{n}_{p.path}", p, "bfloat16", False))
        items.append((f"log_softmax_float16_n{n}_{p.path}", p, "float16", True))
        p = plan(n, simulator=False)
        items.append((f"log_softmax_float32_n{n}_{p.path}", p, "float32", True))
    return items


def compile_reports(only=None, layouts=("A",)):
    """Offline sm_90 reports of :func:`compile_plans` (registers, spills, local memory), or of
    those whose name is in ``only``, for each array layout in ``layouts`` ("A": strided rows,
    "C": contiguous — the two types the kernels get compiled for). Entries are named
    ``"{name}:{layout}"``; compiled with the launch bounds the real kernels carry.

    Run without the simulator: ``tilepy.offline.run_in_subprocess(
    "tilepy.ops.softmax:compile_reports")`` (all, ~20 s), or
    ``"tilepy.ops.softmax:compile_reports_one_per_path"`` (three kernels, both layouts).
    """
    from ..offline import compile_kernel

    out = []
    for name, p, kind, log in compile_plans():
        if only is not None and name not in only:
            continue
        for layout in layouts:
            entry = {"name": f"{name}:{layout}", "layout": layout, "path": p.path,
                     "warps": p.warps, "per_thread": p.per_thread, "threads": p.threads,
                     "kind": kind, "log": log}
            bounds = launch_bounds(p, kind, natural_width(kind), log)
            entry["launch_bounds"] = bounds
            try:
                rep = compile_kernel(name, kernel_for(p, kind, log).py_func,
                                     argtypes(kind, layout), (9, 0), launch_bounds=bounds)
            except Exception as e:  # noqa: BLE001  (reported per kernel)
                entry["error"] = f"{type(e).__name__}: {e}"
            else:
                entry.update(report_fields(rep, p.threads))
            out.append(entry)
    return out


def report_fields(rep, threads: int) -> dict:
    """What the offline checks of a row kernel read from its compile report ``rep``
    (:func:`tilepy.offline.compile_kernel`): registers, spills, memory, instruction counts,
    the ``ex2.approx`` count, and whether ``.maxntid`` is the block's ``threads``."""
    return dict(registers=rep.registers, spill_stores=rep.spill_stores,
                spill_loads=rep.spill_loads, stack_frame=rep.stack_frame,
                local_bytes=rep.local_bytes, shared_bytes=rep.shared_bytes, counts=rep.counts,
                ex2=len(re.findall(r"^\s*ex2\.approx", rep.ptx, re.M)),
                maxntid=bool(re.search(r"\.maxntid\s+%d," % threads, rep.ptx)))


#: One kernel of each path, for the quick check in the test suite.
ONE_PER_PATH = ("softmax_float16_n1024_warp_4w_x32", "softmax_float32_n16384_block_16w_x32",
                "softmax_bfloat16_n32769_online")

#: The kernels of the benchmarks' long 16-bit rows (16384×4096, 4096×32768, the 16384-column
#: point of the row-length sweep), float16 and bfloat16, softmax and log_softmax.
LONG_16_BIT = ("softmax_float16_n4096_block_4w_x32", "softmax_float16_n16384_block_16w_x32",
               "softmax_float16_n32768_block_16w_x64", "softmax_bfloat16_n16384_block",
               "softmax_bfloat16_n32768_block", "log_softmax_float16_n16384_block",
               "log_softmax_float16_n32768_block")


def compile_reports_one_per_path():
    return compile_reports(ONE_PER_PATH, layouts=("A", "C"))


def compile_reports_long_16_bit():
    return compile_reports(LONG_16_BIT, layouts=("A",))


__all__ = ["MEDIUM_MAX", "SHORT_MAX", "Plan", "log_softmax", "plan", "softmax"]
