"""The mbarrier pipeline ring between a producer (TMA, or cp.async threads) and wgmma consumers.

``stages`` slots of shared memory; per slot a *full* mbarrier (arrival count ``producers``:
1 for a TMA producer's ``arrive.expect_tx``, completed when the slot's TMA bytes have landed;
or one per cp.async producer thread) and an *empty* one
(arrival count ``arrivals``: every consumer party that read the slot). The producer and each
consumer walk the same sequence of uses ``i = 0, 1, 2, …``; use ``i`` is slot ``i % stages``
in round ``i // stages``, and a round's parity is ``(i // stages) & 1``. The contract (CuTe
DSL's ``PipelineTmaAsync``; Gluon's ``index = i % n; phase = i // n & 1``):

* producer, use ``i``: ``acquire(bars, s, ph)`` waits until the consumers released the slot's
  previous round (parity ``ph ^ 1``; the first round passes at once on fresh barriers), then
  ``full = commit(bars, s, nbytes)`` arms the full barrier with the bytes the TMA loads of
  this use will deliver, and the loads name ``full`` as their completion barrier;
* consumer, use ``i``: ``wait(bars, s, ph)`` until the slot's data has landed, read it (wgmma),
  and once the reads are complete (``wgmma.wait_group``) ``release(bars, s, lane)``: lane 0 of
  each consumer warp arrives on the empty barrier (so ``arrivals`` is 4 per consumer
  warpgroup) — with a cluster, lane ``r`` arrives on the barrier of the cluster's block ``r``,
  since the slot holds data multicast by every block's producer and each must wait for all;
* ``advance(s, ph) -> (s, ph)`` steps to use ``i + 1``; ``at(i) -> (s, ph)`` gives use ``i``
  from a counter (a consumer that skips uses, e.g. taking every other tile).

cp.async producers (``producers > 1``: that many threads each copy a share of the slot):
after ``acquire``, each producer thread issues its copies and then arrives, in one of two
ways; no ``commit``, no transaction bytes. cp.async writes shared memory through the generic
proxy, and wgmma and TMA read it through the async proxy, which a proxy fence must order:

* ``arrive_copied(bars, s)`` — for slots that wgmma (or a TMA store) reads: the thread waits
  for all its copies (``cp.async.wait_all``), fences them into the async proxy
  (``fence_proxy_async_shared``) and arrives. The consumers read after ``wait`` with no fence
  of their own; the producer is the one that stalls, one slot ahead of them.
* ``arrive_copies(bars, s)`` — :func:`tilepy.ptx.cp_async.cp_async_mbarrier_arrive_noinc`:
  the full barrier completes once every producer thread's copies have landed, the producer
  never waits. For slots read by ordinary loads (``ld.shared``, ``ldmatrix``); a wgmma
  consumer would have to fence after every ``wait``, on its own critical path.

``init(bars)``: one thread, before any use; fence with ``fence_mbarrier_init`` and synchronise
the block (with a cluster, the cluster) before the other roles start. ``bars`` is the shared
address of :data:`Pipeline.nbytes` bytes, 8-byte aligned (an
:class:`~tilepy.tile.smem_layout.SmemLayout` region). The slots' data are the caller's: the
ring only orders them.

A parity wait cannot tell round ``r`` of a slot from round ``r - 2``: a party may be at most
one round ahead of the slowest other party, which the ring enforces for the producer; a
consumer that lags a whole round behind another consumer of the same slot breaks it.
"""

from __future__ import annotations

import functools

from ..inline import device_namespace, inline_device
from ..ptx import cluster as CLU
from ..ptx import cp_async as CP
from ..ptx import mbarrier as MB
from ..ptx import wgmma as WG


@functools.cache
def tma_pipeline(stages: int, arrivals: int, cluster: int = 1, producers: int = 1,
                 single: bool = False):
    """The ring's device functions for ``stages`` slots, ``arrivals`` releases per use (per
    block: each consumer warp's lane 0, or lanes ``0 … cluster - 1``, counted over the
    cluster's blocks), clusters of ``cluster`` blocks (1 or 2) and ``producers`` arrivals
    per fill (1: a TMA producer's ``commit``; more: cp.async producer threads, each
    ``arrive_copies``). Returns a module-like
    namespace that kernels call through (``ring.wait(bars, s, ph)``), with the constants
    ``STAGES`` and ``nbytes``.

    ``single=True`` allows one slot (for tiles too large to double): the producer then fills
    use ``i + 1`` only after every consumer released use ``i``, so loading never overlaps
    reading, and a consumer must release a use before it waits for the next — the discipline
    of releasing slot ``i - 1`` once the products of slot ``i`` are issued deadlocks on one
    slot, which is why it takes the keyword."""
    if stages < (1 if single else 2):
        raise ValueError(f"tma_pipeline: at least 2 stages (a single stage deadlocks a "
                         f"consumer that releases a slot after waiting for the next; "
                         f"single=True allows one), got {stages}")
    if cluster not in (1, 2) or arrivals < 1 or producers < 1:
        raise ValueError(f"tma_pipeline: cluster 1 or 2, arrivals >= 1 and producers >= 1, "
                         f"got {cluster}, {arrivals}, {producers}")
    if producers > 1 and cluster > 1:
        raise ValueError("tma_pipeline: cp.async producers fill their own block's slots only "
                         "(cluster 1)")
    ST = stages
    EMPTY = 8 * stages   # byte offset of the empty barriers
    CL = cluster

    @inline_device
    def init(bars):
        for s in range(ST):
            MB.mbarrier_init(bars + 8 * s, producers)
            MB.mbarrier_init(bars + EMPTY + 8 * s, arrivals)

    @inline_device
    def acquire(bars, s, ph):
        MB.mbarrier_wait_parity(bars + EMPTY + 8 * s, ph ^ 1)

    @inline_device
    def commit(bars, s, nbytes):
        full = bars + 8 * s
        MB.mbarrier_arrive_expect_tx(full, nbytes)
        return full

    @inline_device
    def arrive_copies(bars, s):
        CP.cp_async_mbarrier_arrive_noinc(bars + 8 * s)

    @inline_device
    def arrive_copied(bars, s):
        CP.cp_async_wait_all()
        WG.fence_proxy_async_shared()
        MB.mbarrier_arrive(bars + 8 * s)

    @inline_device
    def wait(bars, s, ph):
        MB.mbarrier_wait_parity(bars + 8 * s, ph)

    @inline_device
    def release(bars, s, lane):
        empty = bars + EMPTY + 8 * s
        if CL == 1:
            if lane == 0:
                MB.mbarrier_arrive(empty)
        elif lane < CL:
            CLU.mbarrier_arrive_cluster(CLU.mapa_shared(empty, lane))

    @inline_device
    def advance(s, ph):
        s += 1
        if s == ST:
            return 0, ph ^ 1
        return s, ph

    @inline_device
    def at(i):
        return i % ST, (i // ST) % 2

    return device_namespace(
        f"tma_pipeline({stages}, {arrivals}, {cluster}, {producers})", init=init,
        acquire=acquire, commit=commit, arrive_copies=arrive_copies,
        arrive_copied=arrive_copied, wait=wait,
        release=release, advance=advance, at=at, STAGES=ST, nbytes=16 * ST)
