"""Thread-block clusters in Numba's CUDA simulator.

The simulator runs a grid's blocks one after another (``FakeCUDAKernel.__call__`` creates a
``BlockManager`` per block and runs it to the end), and all blocks of a launch share one fake
``cuda`` module, so one set of shared arrays. A cluster's blocks wait for each other (the
cluster barrier, a stage freed by the other block's consumers), so they must run at the same
time, each in its own shared memory. :func:`clusters` does that for the duration of one launch:

* it swaps the simulator's ``BlockManager`` for one whose ``run`` only notes the block, until
  the last block of its cluster arrives: then it runs the cluster's blocks at the same time,
  each in a thread of its own, waits for all of them and raises the first error of any;
  blocks ``c·i … c·i + c − 1`` of the grid's x dimension (same y, z) form cluster i, as on
  the GPU;
* it gives each block its own ``cuda.shared`` (static arrays by call site, and the dynamic
  array), keyed by the block's manager;
* each manager carries ``_tilepy_cluster``: the cluster's managers by rank, the cluster
  barrier, and a ``failed`` flag that the twins' waits check (a block that raised aborts the
  others instead of leaving them waiting out the timeout).

The twins of :mod:`tilepy.ptx.cluster` read it: :func:`rank`, :func:`peer_address` (``mapa``),
:func:`owner` (which block of the cluster an address belongs to: the mbarrier and TMA twins
act on that block's state). Outside a cluster launch every block is a cluster of one.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import numpy as np

from .. import _simpatch
from .._simpatch import static_array
from . import _sim, address


class _Stand:
    """What :func:`tilepy.ptx._sim.block_state` needs of a thread: its block's manager."""

    def __init__(self, manager):
        self._manager = manager


def cluster_of(t=None):
    """The calling thread's cluster state (None outside a cluster launch)."""
    return getattr((t or _sim.this_thread())._manager, "_tilepy_cluster", None)


def rank(t=None) -> int:
    m = (t or _sim.this_thread())._manager
    return getattr(m, "_tilepy_rank", 0)


def _arrays(manager):
    """(key, ndarray) of every shared array the block has made (the dynamic one keyed None)."""
    shared = getattr(manager, "_tilepy_shared", None)
    if shared is None:
        return []
    with _simpatch._lock:   # the lock static arrays are created under
        out = list(shared._allocations.items())
    return out + [(None, shared._dynshared)]


def _find(manager, addr):
    for key, arr in _arrays(manager):
        lo = arr.ctypes.data
        if lo <= addr < lo + arr.nbytes:
            return key, addr - lo
    return None


def peer_address(addr: int, r: int, who: str) -> int:
    """The address of the byte at ``addr`` (in the calling block's shared memory) in the
    shared memory of the cluster's block ``r`` (``mapa``)."""
    t = _sim.this_thread()
    cl = cluster_of(t)
    if cl is None:
        if r != 0:
            raise ValueError(f"{who}: rank {r} in a cluster of one block (launch with "
                             "cluster > 1 for more)")
        return addr
    if not 0 <= r < len(cl["managers"]):
        raise ValueError(f"{who}: rank {r} outside the cluster of {len(cl['managers'])}")
    found = _find(t._manager, int(addr))
    if found is None:
        raise IndexError(f"{who}: {int(addr):#x} is in none of this block's shared arrays")
    key, off = found
    peer = cl["managers"][r]
    for k, arr in _arrays(peer):
        if k == key:
            # the peer's array exists whether or not its own threads took its address yet:
            # name it for the peer's range checks (a multicast may land before they do)
            lo = arr.ctypes.data
            extents = address._block_extents(_Stand(peer))["shared"]
            with address._extent_lock:
                extents[lo] = lo + arr.nbytes
            return lo + off
    raise RuntimeError(f"{who}: block {r} of the cluster has not made that shared array yet "
                       "(sync the cluster after making shared arrays, before using mapa)")


def owner(addr: int, t=None):
    """A stand-in thread of the block (of the caller's cluster) whose shared memory holds
    ``addr``; the calling thread itself outside a cluster launch or when none does."""
    t = t or _sim.this_thread()
    cl = cluster_of(t)
    if cl is None:
        return t
    for m in cl["managers"]:
        if m is t._manager:
            continue
        if _find(m, int(addr)) is not None:
            return _Stand(m)
    return t


# ---- the cluster barrier ----------------------------------------------------------------------

def barrier_arrive() -> None:
    t = _sim.this_thread()
    cl = cluster_of(t)
    if cl is None:
        t._tilepy_cluster_gen = None   # a cluster of one: the wait is the block's barrier
        return
    with cl["cond"]:
        t._tilepy_cluster_gen = cl["generation"]
        cl["count"] += 1
        if cl["count"] == cl["threads"]:
            cl["count"] = 0
            cl["generation"] += 1
            cl["cond"].notify_all()


def barrier_wait() -> None:
    t = _sim.this_thread()
    if not hasattr(t, "_tilepy_cluster_gen"):
        raise RuntimeError("cluster_wait without cluster_arrive")
    gen = t._tilepy_cluster_gen
    del t._tilepy_cluster_gen
    if gen is None:
        t.syncthreads()
        return
    cl = cluster_of(t)
    deadline = time.monotonic() + _sim.WAIT_TIMEOUT
    with cl["cond"]:
        while cl["generation"] == gen:
            cl["cond"].wait(0.05)
            _sim.check_abort(t, "cluster_wait")
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster_wait: only {cl['count']} of the {cl['threads']} "
                                   f"threads of the cluster arrived within "
                                   f"{_sim.WAIT_TIMEOUT:.0f} s (a deadlock on the GPU)")


# ---- the launch -------------------------------------------------------------------------------

_lock = threading.Lock()


class _PerBlockShared:
    """``cuda.shared`` of a cluster launch: each block's own arrays."""

    def __init__(self, make):
        self._make = make

    def array(self, shape, dtype, alignment=None):
        m = _sim.this_thread()._manager
        shared = getattr(m, "_tilepy_shared", None)
        if shared is None:
            with _lock:
                shared = getattr(m, "_tilepy_shared", None)
                if shared is None:
                    shared = m._tilepy_shared = self._make()
        if shape == 0 or alignment is not None:
            return shared.array(shape, dtype, alignment)
        # a static array by the kernel's call site, as the simulator keys them (its own
        # lookup would see this line as the call site of every array)
        return static_array(shared._allocations, sys._getframe(1), shape, dtype)


@contextlib.contextmanager
def clusters(size: int, grid, block):
    """Run the simulated kernel launched inside this context in clusters of ``size`` blocks
    along x (see the module docstring)."""
    from numba.cuda.simulator import kernel as K
    from numba.cuda.simulator import kernelapi

    grid = tuple(grid) + (1,) * (3 - len(grid))
    threads = int(np.prod(block)) * size
    states = {}
    pending = {}   # cluster key -> the threads of its blocks seen so far (not started)
    original = K.BlockManager

    class ClusterBlockManager(original):
        def run(self, grid_point, *args):
            module = K._get_kernel_context()
            if not isinstance(module._shared, _PerBlockShared):
                dyn = module._shared._dynshared_size
                module._shared = _PerBlockShared(lambda: kernelapi.FakeCUDAShared(dyn))
            key = (grid_point[0] // size,) + tuple(grid_point[1:])
            state = states.setdefault(key, {"managers": [None] * size, "cond":
                                            threading.Condition(), "count": 0,
                                            "generation": 0, "threads": threads,
                                            "failed": False, "errors": []})
            self._tilepy_cluster = state
            self._tilepy_rank = grid_point[0] % size
            state["managers"][self._tilepy_rank] = self
            def go():
                try:
                    original.run(self, grid_point, *args)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    with state["cond"]:
                        state["errors"].append(e)   # in the order they happened
                        state["failed"] = True

            # The simulator reaches a grid's blocks z, y first, x last: a cluster's blocks
            # are started together once all of them are known, and run to the end before
            # the next cluster starts (no block waits on a cluster that is not running).
            members = pending.setdefault(key, [])
            members.append(threading.Thread(target=go, daemon=True))
            if len(members) == size:
                del pending[key]
                for th in members:
                    th.start()
                for th in members:
                    th.join()
                if state["errors"]:   # the first to fail: the others failed because of it
                    raise state["errors"][0]

    K.BlockManager = ClusterBlockManager
    try:
        yield
    finally:
        K.BlockManager = original
    if pending:
        raise RuntimeError(f"a cluster launch left clusters incomplete: the grid's x "
                           f"dimension ({grid[0]}) must be a multiple of {size}")
