"""A fix for a race in Numba-CUDA's simulator that gave wrong answers in CI.

The simulator runs every CUDA thread of a block as a Python thread, and its
``cuda.shared.array`` (``FakeCUDAShared.array`` in numba-cuda 0.30) finds a static shared array
by its call site with a check-then-create on a plain dict::

    res = self._allocations.get(caller)
    if res is None:
        res = np.empty(shape, dtype)
        self._allocations[caller] = res

With a thread switch between the two lines (it walks the whole stack with
``traceback.extract_stack`` in between, and ``tilepy`` shortens the switch interval to make the
simulator's barriers cheap), two threads of one block each create an array and one of them
computes on a private, uninitialised "shared" tile. The float32 GEMM test then failed about
once in a few hundred runs on a loaded 2-core machine (an element off by 10^12, or an
``OverflowError`` in ``math.exp`` of garbage).

:func:`install` replaces the method with one that creates under a lock, and finds the call
site from the caller's frame instead of an extracted stack (same key: file name and line; the
simulator's documented aliasing of two arrays made on one line is unchanged). It patches only
when the method is the one it knows (the dynamic-shared-memory and ``alignment`` cases are
passed to the original), and does nothing when the simulator is not in use.

:func:`install` also replaces how a block meets at ``cuda.syncthreads``. The simulator's
``BlockManager.run`` polls its threads in a loop (every thread's flags, then ``is_alive`` of
each) on the launching thread, which therefore always wants the interpreter lock: profiled on
a wgmma attention kernel, that loop held the lock for more than half of the run, and every
warp-collective twin (which meets at ``syncthreads``) waited on it. With the patch the threads
count themselves: the last one to reach the barrier — or to exit while all others wait —
wakes each waiting thread through that thread's own event (no lock every thread contends
for), and the launching thread sleeps until every thread has exited or one has raised. The
semantics are the simulator's: the barrier is among the block's threads still running; an
exception in one thread aborts the threads waiting at the barrier and is raised at the launch.

And how a device function is called inside a simulated kernel. The simulator swaps the
module-level name of ``numba.cuda`` in the function's module for the launch's fake module on
*every* call (``swapped_cuda_module``: two locks, a context manager and, whenever no other
thread is inside that module at that moment, a scan of all its globals) — about a sixth of a
wgmma GEMM's simulated time. With the patch the first call of a launch into a module swaps it
and the swap is held until the launch ends; later calls go straight to the function. The
simulator runs one launch at a time, so nothing outside the launch sees the swapped names.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import numpy as np

_lock = threading.Lock()


def static_array(allocations: dict, caller, shape, dtype):
    """The static shared array made at ``caller``'s line (a frame), created under the lock if
    ``allocations`` (a ``FakeCUDAShared``'s, keyed by file name and line) has none yet."""
    key = (caller.f_code.co_filename, caller.f_lineno)
    res = allocations.get(key)
    if res is None:
        with _lock:
            res = allocations.get(key)
            if res is None:
                import numpy as np
                from numba.core import types
                from numba.np import numpy_support

                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                res = allocations[key] = np.empty(shape, dtype)
    return res


def _run_block(self, grid_point, *args):
    """``BlockManager.run`` without polling: start the block's threads, sleep until all have
    exited (or one raised), raise the first exception as the simulator does."""
    from numba.cuda.simulator.kernel import BlockThread

    points = list(np.ndindex(*self._block_dim))
    self._tp_cv = threading.Condition(threading.Lock())
    self._tp_live = len(points)
    self._tp_waiting = []
    self._tp_failed = False
    threads = []
    for block_point in points:

        def target():
            self._f(*args)

        t = BlockThread(target, self, grid_point, block_point, self._debug)
        threads.append(t)
        t.start()
    with self._tp_cv:
        while self._tp_live and not self._tp_failed:
            self._tp_cv.wait()
    for t in threads:
        if t.exception:
            for other in threads:     # abort the threads waiting at the barrier
                other.abort = True
            _release(threads)
            raise t.exception[0].with_traceback(t.exception[1])


def _release(waiting, me=None) -> None:
    for t in waiting:
        if t is not me:
            t.syncthreads_blocked = False
            t.syncthreads_event.set()


def _syncthreads(self):
    """``BlockThread.syncthreads`` counted by the threads themselves (see the module
    docstring)."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    m = self._manager
    with m._tp_cv:
        m._tp_waiting.append(self)
        last = len(m._tp_waiting) == m._tp_live
        if last:
            waiting, m._tp_waiting = m._tp_waiting, []
        else:
            self.syncthreads_blocked = True
    if last:
        _release(waiting, self)
    else:
        self.syncthreads_event.wait()
        self.syncthreads_event.clear()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _thread_run(original):
    def run(self):
        try:
            original(self)     # records an exception in self.exception
        finally:
            m = self._manager
            waiting = ()
            with m._tp_cv:
                m._tp_live -= 1
                if self.exception:
                    m._tp_failed = True
                elif m._tp_waiting and len(m._tp_waiting) == m._tp_live:
                    waiting, m._tp_waiting = m._tp_waiting, []
                m._tp_cv.notify()
            _release(waiting)

    return run


def _install_barrier() -> bool:
    from numba.cuda.simulator import kernel as K

    manager, thread = getattr(K, "BlockManager", None), getattr(K, "BlockThread", None)
    if manager is None or thread is None or not hasattr(thread, "syncthreads"):
        return False
    if getattr(manager.run, "_tilepy_counted", False):
        return True
    run = _thread_run(thread.run)
    for f in (_run_block, _syncthreads, run):
        f._tilepy_counted = True
    manager.run = _run_block
    thread.syncthreads = _syncthreads
    thread.run = run
    return True


_held = contextlib.ExitStack()     # the module swaps held for the running launch
_held_modules: set = set()          # id() of the swapped modules' globals
_held_lock = threading.Lock()


def _install_device_calls() -> bool:
    from numba.cuda.simulator import kernel as K
    from numba.cuda.simulator import kernelapi

    cls = getattr(K, "FakeCUDAKernel", None)
    original = getattr(cls, "__call__", None)
    swap = getattr(kernelapi, "swapped_cuda_module", None)
    if original is None or swap is None or not hasattr(K, "_kernel_context"):
        return False
    if getattr(original, "_tilepy_held", False):
        return True

    def call(self, *args):
        ctx = K._kernel_context
        if ctx is None:
            if self._device:            # a device function called from the host
                return original(self, *args)
            try:                        # a launch: its swaps are released at its end
                return original(self, *args)
            finally:
                with _held_lock:
                    _held_modules.clear()
                    _held.close()
        gid = id(self.fn.__globals__)
        if gid not in _held_modules:
            with _held_lock:
                if gid not in _held_modules:
                    _held.enter_context(swap(self.fn, ctx))
                    _held_modules.add(gid)
        return self.fn(*args)

    call._tilepy_held = True
    call.__doc__ = original.__doc__
    cls.__call__ = call
    return True


def install() -> bool:
    """Make the simulator's static shared-array creation atomic, its ``syncthreads`` counted
    by the threads and its device calls cheap (module docstring); True if the patches are
    on."""
    try:
        from numba.cuda.simulator import kernelapi
    except ImportError:
        return False
    if not (_install_barrier() and _install_device_calls()):
        return False
    cls = getattr(kernelapi, "FakeCUDAShared", None)
    original = getattr(cls, "array", None)
    if original is None:
        return False
    if getattr(original, "_tilepy_atomic", False):
        return True

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return original(self, shape, dtype, alignment)
        return static_array(self._allocations, sys._getframe(1), shape, dtype)

    array._tilepy_atomic = True
    array.__doc__ = original.__doc__
    cls.array = array
    return True
