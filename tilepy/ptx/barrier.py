"""Named CTA barriers: ``bar.sync id, count`` and ``bar.arrive id, count``.

A block has 16 hardware barriers; ``cuda.syncthreads()`` is barrier 0 with every thread of the
block. A *named* barrier (ids 1 … 15) synchronises a subset: the first ``count`` threads to
arrive on barrier ``id`` complete it (``count`` a multiple of the warp size, 32 … the block's
threads), and the barrier is ready for the next round. Warp-specialised kernels use them where
syncthreads would wait for warps that are busy elsewhere (the producer warpgroup of a TMA GEMM,
say): the consumer warpgroups sync among themselves without it.

* ``bar_sync(id, count)`` — arrive and wait until ``count`` threads have arrived on ``id``
  (``bar.sync``; memory ordering like syncthreads among the participants: shared and global
  writes before it are visible to the participants after it).
* ``bar_arrive(id, count)`` — arrive without waiting (``bar.arrive``): a producer signals
  consumers that wait with ``bar_sync(id, count)``, ``count`` counting both sides.
* ``warp_sync()`` — the lanes of one warp meet (``bar.warp.sync``, ``__syncwarp``).

Both are ``.aligned``: every thread of a warp must execute the same call (the hardware counts
whole warps). ``id`` and ``count`` may be run-time values (registers); the same ``count`` must
be used by every participant of one round.

In the simulator each thread is a Python thread and arrives on its own: the twins keep, per
block and id, a generation-counted barrier that completes when ``count`` threads called it
(same-warp alignment is not checked). ``bar_sync`` really blocks; one waiting longer than
``tilepy.ptx._sim.WAIT_TIMEOUT`` seconds raises (a deadlock on the GPU), and so does a block
aborted by another thread's error. Not modelled: barrier 0 (the twins refuse id 0: use
``cuda.syncthreads()``), and mixing a named barrier with a pending ``syncthreads`` of the same
threads (the simulator's syncthreads waits for *every* live thread of the block, so a thread
parked in a named barrier blocks it — as tile kernels never do).
"""

from __future__ import annotations

import threading
import time

from . import _sim
from .asm import instruction

NAMED_BARRIERS = 16


class _NamedBarrier:
    """One hardware barrier of one simulated block: arrivals of the current round, the round's
    thread count, and a generation number that advances when a round completes."""

    def __init__(self):
        self.count = 0
        self.expected = None
        self.generation = 0


def _state(t):
    return _sim.block_state("named_barriers",
                            lambda m: {"cond": threading.Condition(),
                                       "bars": [_NamedBarrier() for _ in range(NAMED_BARRIERS)]},
                            t)


def _arrive(who, bar_id, count, wait):
    t = _sim.this_thread()
    bar_id, count = int(bar_id), int(count)
    if not 0 < bar_id < NAMED_BARRIERS:
        raise ValueError(f"{who}: barrier id {bar_id}; named barriers are 1 … "
                         f"{NAMED_BARRIERS - 1} (0 is syncthreads': call cuda.syncthreads())")
    threads = _sim.block_threads(t)
    if count <= 0 or count % _sim.WARP or count > threads:
        raise ValueError(f"{who}: thread count {count}; it must be a multiple of "
                         f"{_sim.WARP} in {_sim.WARP} … {threads} (the block's threads)")
    state = _state(t)
    cond = state["cond"]
    with cond:
        b = state["bars"][bar_id]
        if b.count == 0:
            b.expected = count
        elif b.expected != count:
            raise RuntimeError(f"{who}: barrier {bar_id} called with count {count} while its "
                               f"current round expects {b.expected} threads")
        gen = b.generation
        b.count += 1
        if b.count == b.expected:
            b.count = 0
            b.expected = None
            b.generation += 1
            cond.notify_all()
            return
        if not wait:
            return
        deadline = time.monotonic() + _sim.WAIT_TIMEOUT
        while b.generation == gen:
            cond.wait(0.05)
            _sim.check_abort(t, who)
            if b.generation == gen and time.monotonic() > deadline:
                raise RuntimeError(
                    f"{who}: only {b.count} of the {b.expected} threads arrived on barrier "
                    f"{bar_id} within {_sim.WAIT_TIMEOUT:.0f} s (a deadlock on the GPU)")


def _bar_sync_twin(bar_id, count):
    """Arrive on named barrier ``bar_id`` and wait until ``count`` threads have arrived."""
    _arrive("bar_sync", bar_id, count, True)


def _bar_arrive_twin(bar_id, count):
    """Arrive on named barrier ``bar_id`` (a round of ``count`` threads) without waiting."""
    _arrive("bar_arrive", bar_id, count, False)


bar_sync = instruction(
    "bar_sync", "bar.sync $0, $1;", ins=("u32", "u32"), side_effect=True, convergent=True,
    clobber_memory=True, twin=_bar_sync_twin,
    doc="``bar_sync(id, count)``: arrive on named barrier id (1 … 15) and wait until count "
        "threads (a multiple of 32) have arrived; orders the participants' memory accesses "
        "like syncthreads. Every thread of a warp makes the same call.")

bar_arrive = instruction(
    "bar_arrive", "bar.arrive $0, $1;", ins=("u32", "u32"), side_effect=True, convergent=True,
    clobber_memory=True, twin=_bar_arrive_twin,
    doc="``bar_arrive(id, count)``: arrive on named barrier id without waiting (a producer's "
        "signal to threads waiting in bar_sync(id, count); count counts both sides).")

def _warp_sync_twin():
    """The warp's lanes meet (at a barrier of the warp once warp-specialised, else at the
    block's syncthreads, as every warp collective of the simulator)."""
    _sim.warp_exchange(None)


warp_sync = instruction(
    "warp_sync", "bar.warp.sync 0xffffffff;", side_effect=True, convergent=True,
    clobber_memory=True, min_cc=(7, 0), twin=_warp_sync_twin,
    doc="``warp_sync()``: the 32 lanes of the warp meet, ordering their memory accesses "
        "(``__syncwarp()``); e.g. lanes' shared-memory writes before lane 0 issues a bulk "
        "copy of them. Every lane of the warp makes the call.")


def mark_warp_specialised() -> None:
    """Simulator only: the calling thread's warp collectives meet per warp from now on (what
    ``setmaxnreg``'s twins do) — for a warp-specialised kernel that shifts no registers,
    whose roles must still not meet at the block's ``syncthreads``. Call it from every thread
    at its role's entry (:func:`tilepy.tile.roles.warpgroup_roles` does); nothing on the GPU
    needs it."""
    _sim.set_warp_specialised()


__all__ = ["NAMED_BARRIERS", "bar_arrive", "bar_sync", "mark_warp_specialised", "warp_sync"]
