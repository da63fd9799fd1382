"""Row reductions (max, sum) of float32 values: across a quad, a warp, the warps of a block,
and over the rows of an mma accumulator fragment.

Every function here is a generator, cached on its arguments, that returns a
``@inline_device`` function whose sizes are closure constants.

=======================================  ==========================================  ==========
generator                                device function                             who calls
=======================================  ==========================================  ==========
``combine(op)``                          ``f(a, b) -> op(a, b)``                     any thread
``quad_row_reduce(op)``                  ``reduce(v) -> op over lanes 4g .. 4g+3``   one warp
``warp_reduce(op)``                      ``reduce(v) -> op over lanes 0 .. 31``      one warp
``block_row_reduce(op, warps)``          ``reduce(v, scratch) -> op over the block`` the block
``fragment_row_reduce(op, mi, ni, …)``   ``reduce(acc, rows)``                       one warp
=======================================  ==========================================  ==========

``op`` is ``"max"`` or ``"sum"``; values are float32 (a float64 would be refused by the
shuffles). Every lane gets the result, and for a given set of inputs all lanes get the same
bits (the butterfly adds in the same pairs on every lane; max is exact).

NaN propagates: ``max`` of a NaN and anything is NaN, wherever the NaN sits (Python's ``max``,
``fmax`` and PTX ``max.f32`` all return the other operand instead). The identities are
:data:`IDENTITY`: -inf for max, 0 for sum (a max over nothing but -inf is -inf).

"One warp" means all 32 lanes of a warp call the function together (the shuffles are
``shfl.sync`` with the full member mask); in the simulator every thread of the block must
reach each shuffle (see :mod:`tilepy.ptx._sim`).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..inline import inline_device
from ..ptx.math import fmax_nan
from ..ptx.shuffle import shfl_xor

WARP = 32
OPS = ("max", "sum")
#: The identity of each op, as float32 (a Python float would make float64 arithmetic).
IDENTITY = {"max": np.float32(-np.inf), "sum": np.float32(0.0)}


def _check_op(who: str, op) -> None:
    if op not in OPS:
        raise ValueError(f"{who}: op must be one of {OPS}, got {op!r}")


def _check_count(who: str, name: str, value, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1 or (
            hi is not None and value > hi):
        bound = f"1 … {hi}" if hi is not None else ">= 1"
        raise ValueError(f"{who}: {name} must be an integer {bound}, got {value!r}")


@functools.cache
def combine(op: str, fast: bool = False):
    """``f(a, b)``: ``a + b`` for "sum"; for "max" the larger, NaN if either is NaN.
    ``fast``: max as one ``max.NaN.f32`` (compute capability 8.0+, the mma fragments'
    reductions) instead of compares and a select (any device)."""
    _check_op("combine", op)
    if op == "max" and fast:
        return fmax_nan
    if op == "max":
        @inline_device
        def f(a, b):
            # Ordered comparisons are false with a NaN: a NaN ``a`` is kept by ``a != a``, a NaN
            # ``b`` is returned because ``a > b`` fails.
            return a if (a > b or a != a) else b
    else:
        @inline_device
        def f(a, b):
            return a + b
    return f


@functools.cache
def quad_row_reduce(op: str, fast: bool = True):
    """``reduce(v) -> float32``: ``op`` over the 4 lanes ``4g … 4g+3`` of each quad; one warp.

    In the m16n8 accumulator layout the four lanes of quad ``g`` hold the columns of the same
    rows (``g`` and ``g + 8``), so this turns a lane's partial row result into the row's. Two
    ``shfl.sync.bfly`` (masks 1, 2); every lane of the quad gets the result.
    """
    _check_op("quad_row_reduce", op)
    f = combine(op, fast=fast)   # fast: mma fragments, compute capability 8.0+

    @inline_device
    def reduce(v):
        v = f(v, shfl_xor(v, 1))
        return f(v, shfl_xor(v, 2))

    return reduce


@functools.cache
def warp_reduce(op: str):
    """``reduce(v) -> float32``: ``op`` over all 32 lanes of the warp; one warp.

    Five ``shfl.sync.bfly`` (masks 16, 8, 4, 2, 1); every lane gets the result.
    """
    _check_op("warp_reduce", op)
    f = combine(op)

    @inline_device
    def reduce(v):
        v = f(v, shfl_xor(v, 16))
        v = f(v, shfl_xor(v, 8))
        v = f(v, shfl_xor(v, 4))
        v = f(v, shfl_xor(v, 2))
        return f(v, shfl_xor(v, 1))

    return reduce


@functools.cache
def block_row_reduce(op: str, warps: int):
    """``reduce(v, scratch) -> float32``: ``op`` over every thread of a block of ``warps`` warps.

    For a row spread over a whole block (one value per thread, e.g. a softmax row). The block
    is one-dimensional with exactly ``warps * 32`` threads (warp = ``threadIdx.x // 32``).
    ``scratch`` is a float32 shared array of at least ``warps`` entries, owned by this call
    while it runs. Each warp reduces with :func:`warp_reduce`, lane 0 of warp ``w`` writes
    ``scratch[w]``, and after a barrier every thread combines ``scratch[0 … warps-1]`` in that
    order (so all threads get the same bits).

    Barrier contract: every thread of the block calls it, the same number of times, never from
    a branch only some threads take. It executes two ``syncthreads`` — one after the writes,
    one after the reads, so ``scratch`` is free again on return and back-to-back calls may
    reuse it. It does not sync on entry: if the caller itself used ``scratch`` just before,
    the caller syncs first. With ``warps == 1`` it is :func:`warp_reduce`, with no barrier
    and ``scratch`` unused.
    """
    _check_op("block_row_reduce", op)
    _check_count("block_row_reduce", "warps", warps, 32)
    f = combine(op)
    in_warp = warp_reduce(op)

    if warps == 1:
        @inline_device
        def reduce(v, scratch):
            return in_warp(v)
        return reduce

    @inline_device
    def reduce(v, scratch):
        tid = cuda.threadIdx.x
        v = in_warp(v)
        if (tid & 31) == 0:
            scratch[tid >> 5] = v
        cuda.syncthreads()
        r = scratch[0]
        for w in range(1, warps):
            r = f(r, scratch[w])
        cuda.syncthreads()  # every read is done: the next call may write scratch
        return r

    return reduce


@functools.cache
def fragment_row_reduce(op: str, mi: int, ni: int, *, accumulate: bool = False,
                        quad: bool = True, chains: int = 1, fast: bool = True):
    """``reduce(acc, rows)``: per-row ``op`` of an accumulator fragment; one warp.

    ``acc`` is a (mi, ni, 4) float32 local array in the m16n8 accumulator layout of
    :mod:`tilepy.ptx.fragments` (a warp tile of ``mi*16`` rows by ``ni*8`` columns): lane
    ``4g + t`` holds, of m16 tile ``i`` and n8 tile ``j``, ``acc[i, j, 0..1]`` = row ``g``,
    columns ``2t, 2t+1`` and ``acc[i, j, 2..3]`` = row ``g + 8``, the same columns.

    ``rows`` is a (mi, 2) float32 local array: ``rows[i, h]`` receives the result for row
    ``16 i + g + 8 h`` of the warp tile — over the ``2 * ni`` values the lane holds, then (with
    ``quad``) across its quad, so over all ``ni * 8`` columns, the same on the quad's 4 lanes.

    * ``accumulate``: ``rows[i, h] = op(rows[i, h], result)`` instead of overwriting: a
      running max, or a running sum. The old value is combined once, after the shuffles, so
      a sum counts it once (with ``quad``, ``rows`` holds the same value on the 4 lanes of a
      quad, as it does after a previous call).
    * ``quad=False``: no shuffle; ``rows`` gets the lane's partial result (over its 2 * ni
      columns, plus its old partial with ``accumulate``). Combine the partials later with
      :func:`quad_row_reduce` — e.g. a running sum whose quad reduction is deferred to the
      end, as FlashAttention-2 does.

    * ``chains=2`` (max only): two dependent chains over the pairs of n8 tiles instead of one
      (half the dependent steps, a max being exact in any order), for kernels with registers
      to spare (the Hopper attention kernel); the extra live values made the GEMM-softmax
      kernel spill. A sum always adds left to right.

    Costs ``mi * 2 * 2`` shuffles (none with ``quad=False``). Each max is one ``max.NaN.f32``
    (compute capability 8.0+: the mma fragments' devices), or with ``fast=False`` compares and
    a select (:func:`combine`), which compiles differently: the GEMM-softmax kernel keeps it
    (with max.NaN.f32 it reaches the 255-register limit and spills, offline sm_90;
    bench/NOTES.md: CI mend, max.NaN.f32 in its row max).
    """
    if chains not in (1, 2):
        raise ValueError(f"fragment_row_reduce: chains must be 1 or 2, got {chains!r}")
    _check_op("fragment_row_reduce", op)
    _check_count("fragment_row_reduce", "mi", mi)
    _check_count("fragment_row_reduce", "ni", ni)
    f = combine(op, fast=fast)
    across = quad_row_reduce(op, fast)
    accumulate = bool(accumulate)
    quad = bool(quad)
    TWO_CHAINS = op == "max" and ni > 1 and chains == 2

    @inline_device
    def reduce(acc, rows):
        for i in range(mi):
            for h in range(2):
                v = f(acc[i, 0, 2 * h], acc[i, 0, 2 * h + 1])
                if TWO_CHAINS:
                    w = f(acc[i, 1, 2 * h], acc[i, 1, 2 * h + 1])
                    for j in range(2, ni):
                        if j % 2 == 0:
                            v = f(v, f(acc[i, j, 2 * h], acc[i, j, 2 * h + 1]))
                        else:
                            w = f(w, f(acc[i, j, 2 * h], acc[i, j, 2 * h + 1]))
                    v = f(v, w)
                else:
                    for j in range(1, ni):
                        v = f(v, acc[i, j, 2 * h])
                        v = f(v, acc[i, j, 2 * h + 1])
                if quad:
                    v = across(v)
                if accumulate:
                    v = f(rows[i, h], v)
                rows[i, h] = v

    return reduce


__all__ = ["IDENTITY", "OPS", "block_row_reduce", "combine", "fragment_row_reduce",
           "quad_row_reduce", "warp_reduce"]
