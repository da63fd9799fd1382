"""Warp-specialised roles: producer and consumer warpgroups with their register budgets, and
named barriers handed out by an allocator.

A warp-specialised block is ``consumers`` warpgroups that compute plus (usually) one producer
warpgroup that only issues TMA loads. :func:`warpgroup_roles` gives the device side: which
warpgroup a thread is in (read warp-uniformly) and the ``setmaxnreg`` hand-over on entering a
role — the producer lowers its limit so the consumers may raise theirs within the 65536
registers of the SM's register file (per 128 threads: ``producer_regs + consumers ·
consumer_regs ≤ 512``). ``setmaxnreg`` needs a kernel launched with exactly the block's thread
count as its bound (``launch_bounds=(threads, 1)``): it redistributes registers the kernel was
allocated with.

:class:`NamedBarriers` replaces barrier ids fixed by convention: a kernel generator takes the
ids it needs by name (``bars.take("consumers", 256)``), each with its participant count, and
the allocator refuses a 16th barrier (id 0 is ``syncthreads``). Ids and counts are closure
constants of the kernel: ``bar_sync(ids.consumers, CONSUMER_THREADS)``.
"""

from __future__ import annotations

import functools

from ..inline import device_namespace, inline_device
from ..ptx import barrier as BAR
from ..ptx import wgmma as W
from ..ptx.asm import SIMULATOR
from ..ptx.barrier import NAMED_BARRIERS

WARPGROUP = 128
REGISTER_FILE = 65536


class NamedBarriers:
    """An allocator of named barrier ids (1 … 15) for one kernel generator.

    ``take(name, threads)`` returns a new id for ``threads`` participants (a multiple of 32);
    ``take(name, threads, count=n)`` the first of ``n`` consecutive ids (one per warpgroup,
    say). ``ids[name]`` / ``threads[name]`` read them back; :meth:`describe` lists them."""

    def __init__(self):
        self._next = 1
        self.ids: dict[str, int] = {}
        self.threads: dict[str, int] = {}

    def take(self, name: str, threads: int, count: int = 1) -> int:
        if name in self.ids:
            raise ValueError(f"NamedBarriers: {name!r} taken twice")
        if threads % 32 or threads <= 0:
            raise ValueError(f"NamedBarriers: {name!r}: participants must be a positive "
                             f"multiple of 32 (whole warps), got {threads}")
        if self._next + count > NAMED_BARRIERS:
            raise ValueError(f"NamedBarriers: {name!r} needs {count} more ids; ids 1 … "
                             f"{NAMED_BARRIERS - 1} are all taken ({self.describe()})")
        first = self._next
        self._next += count
        self.ids[name] = first
        self.threads[name] = threads
        return first

    def describe(self) -> str:
        return ", ".join(f"{n}={i} ({self.threads[n]} threads)" for n, i in self.ids.items())


@functools.cache
def warpgroup_roles(consumers: int, producer: bool = True, producer_first: bool = True,
                    producer_regs: int = 0, consumer_regs: int = 0):
    """Device functions of a block of ``consumers`` consumer warpgroups and, ``producer``, one
    producer warpgroup (warpgroup 0 with ``producer_first``, else the last).

    * ``warpgroup(tid)``: the thread's warpgroup index, computed so that ptxas knows it is
      warp-uniform (derived values stay in uniform registers);
    * ``consumer(wg)``: the consumer index of warpgroup ``wg`` (0 … consumers − 1), −1 for the
      producer;
    * ``enter_producer()`` / ``enter_consumer()``: ``setmaxnreg.dec`` / ``.inc`` to the
      limits, or nothing when ``producer_regs`` is 0 (in the simulator: the roles' warp
      collectives then meet per warp, :func:`tilepy.ptx.barrier.mark_warp_specialised`).
      Every thread of the block calls one of them at its role's entry.

    Constants: ``THREADS`` (the block), ``CONSUMER_THREADS``, ``PRODUCER_WG`` (−1 without a
    producer), ``SETMAXNREG``."""
    if consumers < 1 or consumers > 3:
        raise ValueError(f"warpgroup_roles: 1 … 3 consumer warpgroups, got {consumers}")
    SET = bool(producer and producer_regs)
    if SET:
        for r in (producer_regs, consumer_regs):
            if not (24 <= r <= 256 and r % 8 == 0):
                raise ValueError(f"warpgroup_roles: setmaxnreg limits must be multiples of 8 "
                                 f"in 24 … 256, got {producer_regs} / {consumer_regs}")
        if WARPGROUP * (producer_regs + consumers * consumer_regs) > REGISTER_FILE:
            raise ValueError(f"warpgroup_roles: {producer_regs} + {consumers} × "
                             f"{consumer_regs} registers per thread exceed the register file")
    PWG = (0 if producer_first else consumers) if producer else -1
    FIRST = 1 if producer and producer_first else 0
    PREG, CREG = producer_regs, consumer_regs

    @inline_device
    def warpgroup(tid):
        return tid // WARPGROUP

    @inline_device
    def consumer(wg):
        if wg == PWG:
            return -1
        return wg - FIRST

    if SIMULATOR and not SET and producer:
        # no setmaxnreg twin to switch the simulator's collectives to per-warp meetings
        @inline_device
        def enter_producer():
            BAR.mark_warp_specialised()

        enter_consumer = enter_producer
    else:
        @inline_device
        def enter_producer():
            if SET:
                W.setmaxnreg_dec(PREG)

        @inline_device
        def enter_consumer():
            if SET:
                W.setmaxnreg_inc(CREG)

    threads = WARPGROUP * (consumers + (1 if producer else 0))
    return device_namespace(
        f"warpgroup_roles({consumers}, {producer}, {producer_first}, {producer_regs}, "
        f"{consumer_regs})", warpgroup=warpgroup, consumer=consumer,
        enter_producer=enter_producer, enter_consumer=enter_consumer, THREADS=threads,
        CONSUMER_THREADS=WARPGROUP * consumers, PRODUCER_WG=PWG, SETMAXNREG=SET,
        bar_sync=BAR.bar_sync, bar_arrive=BAR.bar_arrive)
