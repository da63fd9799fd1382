"""Phase marks: timestamps a kernel writes at points of its work, so that a GPU run can say where
a launch's time goes (blocks starting late, the prologue, waiting for the first stage, the main
loop, a reduction, the epilogue, the tail) — what a profiler's per-kernel totals cannot.

A kernel generated with tracing takes one more argument, ``trace``: a uint64 array of
(blocks, :data:`WIDTH`), a row per block (:func:`block_row`: the block's linear index in a 1-D
or 2-D grid). ``mark(trace, row, slot)`` writes the global nanosecond timer
(:func:`tilepy.ptx.timer.globaltimer`, one time base for every SM) to column ``slot`` and the
SM's cycle counter to column ``SLOTS + slot`` (``slot < SLOTS``); ``put(trace, row, i,
value)`` writes a number (an SM id, a count of work items) to column ``2 · SLOTS + i`` (``i <
VALUES``). Columns a kernel never writes keep what the caller put there (zeros, say). One
thread calls them for each slot (the kernel's choice, stated with its slot names). A thread
short of registers notes its row in shared memory instead and writes it out at its end
(``start`` / ``note`` / ``note_value`` / ``flush``: :func:`phase_marks`).

``phase_marks(False)`` gives the same functions as no-ops that never touch ``trace``: a kernel
generated without tracing compiles to what it would be without the calls. :func:`summary`
turns a filled array into per-phase statistics on the host (NumPy only).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from ..inline import device_namespace, inline_device
from ..ptx import timer as TM
from ..ptx import vector as VEC

#: Timestamp slots (each a global-timer column and a clock column) and value columns of a row.
SLOTS = 16
VALUES = 8
WIDTH = 2 * SLOTS + VALUES
#: Shared memory of a row kept by :func:`phase_marks`'s ``start`` / ``note`` / ``flush``.
SCRATCH_BYTES = 8 * WIDTH


@functools.cache
def phase_marks(enabled: bool):
    """The marking functions (one calling thread each):

    * ``row()`` — the calling block's :func:`block_row`; ``smid()`` — its SM;
    * ``mark(trace, row, slot)`` / ``put(trace, row, i, value)`` — a timestamp / a value
      straight into ``trace`` (global stores: for a thread with registers to spare);
    * ``start(scratch)`` — zero a block's row kept in shared memory (:data:`SCRATCH_BYTES` at
      the 8-byte aligned shared address ``scratch``), then ``note(scratch, slot)`` /
      ``note_value(scratch, i, value)`` into it (two 4-byte shared stores: no global address
      live in a thread short of registers) and ``flush(trace, row, scratch)`` at the end —
      the row's nonzero words into ``trace`` (so a slot written with ``mark`` by another
      thread is kept). The thread that flushes must see the notes (its own, or after a
      barrier).

    With ``enabled`` False every function but ``row`` does nothing (``smid`` is 0) and none
    touches ``trace`` or shared memory."""
    u64, u32 = types.uint64, types.uint32

    @inline_device
    def row():
        return cuda.blockIdx.x + cuda.gridDim.x * cuda.blockIdx.y

    if enabled:
        @inline_device
        def mark(trace, r, slot):
            trace[r, slot] = TM.globaltimer()
            trace[r, SLOTS + slot] = TM.clock64()

        @inline_device
        def put(trace, r, i, value):
            trace[r, 2 * SLOTS + i] = u64(value)

        @inline_device
        def smid():
            return TM.smid()

        @inline_device
        def store64(addr, v):
            VEC.st_shared_b32(addr, u32(v & u64(0xFFFFFFFF)))
            VEC.st_shared_b32(addr + 4, u32(v >> u64(32)))

        @inline_device
        def start(scratch):
            for i in range(WIDTH):
                store64(scratch + 8 * i, u64(0))

        @inline_device
        def note(scratch, slot):
            store64(scratch + 8 * slot, TM.globaltimer())
            store64(scratch + 8 * (SLOTS + slot), TM.clock64())

        @inline_device
        def note_value(scratch, i, value):
            store64(scratch + 8 * (2 * SLOTS + i), u64(value))

        @inline_device
        def flush(trace, r, scratch):
            for i in range(WIDTH):
                v = u64(VEC.ld_shared_b32(scratch + 8 * i)) | (
                    u64(VEC.ld_shared_b32(scratch + 8 * i + 4)) << u64(32))
                if v != 0:
                    trace[r, i] = v
    else:
        @inline_device
        def mark(trace, r, slot):
            pass

        @inline_device
        def put(trace, r, i, value):
            pass

        @inline_device
        def smid():
            return 0

        @inline_device
        def start(scratch):
            pass

        @inline_device
        def note(scratch, slot):
            pass

        @inline_device
        def note_value(scratch, i, value):
            pass

        @inline_device
        def flush(trace, r, scratch):
            pass

    return device_namespace(f"phase_marks({enabled})", mark=mark, put=put, row=row, smid=smid,
                            start=start, note=note, note_value=note_value, flush=flush,
                            enabled=enabled)


def block_row(bx: int, by: int, grid_x: int) -> int:
    """The row of block (``bx``, ``by``) of a grid ``grid_x`` blocks wide."""
    return bx + grid_x * by


def summary(trace, marks: dict, phases, values: dict | None = None) -> dict:
    """Per-phase statistics of a filled trace (NumPy, host side).

    ``marks``: slot name -> slot; ``phases``: ``(name, from_slot_name, to_slot_name)`` — each
    phase's duration per block is the global-timer difference of its two marks (rows where
    either is 0, e.g. a block with no such step, are left out); ``values``: value name ->
    value column. Returns ``{"blocks", "span_us" (first mark of any block to the last mark of
    any), "timer_step_ns" (the smallest nonzero difference between two marks of one row: how
    finely the timer advanced), "phases": {name: {"mean_us", "min_us", "max_us", "blocks"}},
    "start_spread_us" (the latest block's first mark after the earliest's), "values": {name:
    sorted distinct values}}``."""
    t = np.asarray(trace, dtype=np.uint64)[:, :SLOTS].astype(np.int64)
    live = t[(t > 0).any(axis=1)]
    out = {"blocks": int(len(live)), "phases": {}, "values": {}}
    if not len(live):
        return out
    first = np.where(live > 0, live, np.iinfo(np.int64).max).min(axis=1)
    out["span_us"] = float((live.max() - first.min()) / 1e3)
    out["start_spread_us"] = float((first.max() - first.min()) / 1e3)
    steps = np.diff(np.sort(np.where(live > 0, live, 0), axis=1), axis=1)
    steps = steps[steps > 0]
    out["timer_step_ns"] = int(steps.min()) if steps.size else None
    for name, a, b in phases:
        x, y = live[:, marks[a]], live[:, marks[b]]
        ok = (x > 0) & (y > 0)
        d = (y[ok] - x[ok]) / 1e3
        out["phases"][name] = ({"mean_us": float(d.mean()), "min_us": float(d.min()),
                                "max_us": float(d.max()), "blocks": int(ok.sum())}
                               if ok.any() else {"blocks": 0})
    for name, col in (values or {}).items():
        v = np.asarray(trace, dtype=np.uint64)[:, 2 * SLOTS + col]
        out["values"][name] = sorted({int(x) for x in v})
    return out
