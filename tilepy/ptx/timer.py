"""Clocks and the SM id: what a kernel reads to say where its time goes.

* ``globaltimer() -> uint64`` — the device's global nanosecond timer (``%globaltimer``): one
  time base for every SM, so marks of different blocks can be compared and lined up. How often
  it advances is the hardware's (bench scripts report the smallest step they saw).
* ``clock64() -> uint64`` — this SM's cycle counter (``%clock64``): fine-grained durations
  inside one block; counters of different SMs are not aligned.
* ``smid() -> uint32`` — the SM this block runs on (``%smid``; may change under preemption,
  which kernels measured here do not meet).

All three are side-effecting reads (``volatile``), so the compiler neither merges two reads
nor moves one across other inline PTX; they do not order memory. In the simulator
``globaltimer`` and ``clock64`` are the host's ``time.perf_counter_ns()`` (both in
nanoseconds) and ``smid`` is the block's linear index modulo 132 — the simulator has no SMs.
"""

from __future__ import annotations

import time

from . import _sim
from .asm import instruction


def _ns_twin():
    return time.perf_counter_ns()


def _smid_twin():
    t = _sim.this_thread()
    b, g = t.blockIdx, t._manager._grid_dim
    return (b.x + g[0] * (b.y + g[1] * b.z)) % 132


globaltimer = instruction(
    "globaltimer", "mov.u64 $0, %globaltimer;", outs=("u64",), side_effect=True,
    twin=_ns_twin,
    doc="``globaltimer() -> uint64``: the global nanosecond timer (one time base for all SMs).")

clock64 = instruction(
    "clock64", "mov.u64 $0, %clock64;", outs=("u64",), side_effect=True, twin=_ns_twin,
    doc="``clock64() -> uint64``: this SM's cycle counter.")

smid = instruction(
    "smid", "mov.u32 $0, %smid;", outs=("u32",), side_effect=True, twin=_smid_twin,
    doc="``smid() -> uint32``: the SM the calling block runs on.")
