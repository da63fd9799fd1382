"""The simulator fix of tilepy._simpatch: every thread of a block gets the same static shared
array, even when many threads reach ``cuda.shared.array`` at once."""

import sys
import threading
import time

import numpy as np
import pytest

import tilepy

pytestmark = pytest.mark.sim

if not tilepy.SIMULATOR:
    pytest.skip("the patch is for the CUDA simulator", allow_module_level=True)

from numba import cuda  # noqa: E402
from numba.cuda.simulator.kernelapi import FakeCUDAShared  # noqa: E402


def _allocate(shared, out, i, start):
    start.wait()
    out[i] = shared.array((16, 16), np.float32)


def test_patch_is_installed():
    assert getattr(FakeCUDAShared.array, "_tilepy_atomic", False)


@pytest.mark.parametrize("attempt", range(3))
def test_threads_racing_to_allocate_share_one_array(attempt, monkeypatch):
    # a slow np.empty widens the window between "not there yet" and "stored": unpatched, the
    # threads then nearly always end up with several arrays
    real_empty = np.empty

    def slow_empty(*args, **kwargs):
        time.sleep(1e-3)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(np, "empty", slow_empty)
    n = 64
    shared = FakeCUDAShared(0)
    out = [None] * n
    start = threading.Barrier(n)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=_allocate, args=(shared, out, i, start))
                   for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert len({id(a) for a in out}) == 1
    assert len(shared._allocations) == 1


def test_call_sites_still_decide_identity_and_dynamic_memory_is_unchanged():
    shared = FakeCUDAShared(64)
    a = shared.array((4,), np.int32)
    b = shared.array((4,), np.int32)       # another line: another array
    assert a is not b
    d = shared.array(0, np.dtype(np.float32))  # dynamic shared memory: the whole 64-byte buffer
    assert d.shape == (16,)


@cuda.jit
def _block_sum(x, out):
    tile = cuda.shared.array(256, np.float32)
    t = cuda.threadIdx.x
    tile[t] = x[t]
    cuda.syncthreads()
    if t == 0:
        s = np.float32(0)
        for i in range(256):
            s += tile[i]
        out[0] = s


def test_a_block_reads_what_its_threads_wrote():
    x = np.arange(256, dtype=np.float32)
    for _ in range(5):
        out = np.full(1, np.nan, np.float32)
        _block_sum[1, 256](x, out)
        assert out[0] == x.sum()


def test_the_barrier_is_counted_by_the_threads():
    from numba.cuda.simulator.kernel import BlockManager, BlockThread

    assert getattr(BlockManager.run, "_tilepy_counted", False)
    assert getattr(BlockThread.syncthreads, "_tilepy_counted", False)


@cuda.jit
def _rounds_with_early_exits(out, rounds):
    # threads t >= 40 leave at once, t in 20 … 39 after two rounds: the barrier is among the
    # threads still running, as in the simulator without the patch
    t = cuda.threadIdx.x
    if t >= 40:
        return
    tile = cuda.shared.array(64, np.int32)
    for r in range(rounds):
        if t >= 20 and r == 2:
            return
        tile[t] = r * 100 + t
        cuda.syncthreads()
        # read a neighbour's value of this round, then wait before it is overwritten
        live = 40 if r < 2 else 20
        out[r, t] = tile[(t + 1) % live]
        cuda.syncthreads()


def test_threads_that_exit_leave_the_barrier_to_the_others():
    rounds = 5
    out = np.full((rounds, 64), -1, np.int32)
    _rounds_with_early_exits[1, 64](out, rounds)
    for r in range(rounds):
        live = 40 if r < 2 else 20
        np.testing.assert_array_equal(out[r, :live], r * 100 + (np.arange(live) + 1) % live)
        assert (out[r, live:] == -1).all()


@cuda.jit
def _one_thread_raises(out):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    if t == 5:
        out[100] = 1            # out of bounds: an IndexError in one thread
    cuda.syncthreads()          # the others wait here and are aborted
    out[t] = 1


def test_an_exception_in_one_thread_is_raised_at_the_launch_without_a_hang():
    out = np.zeros(32, np.int32)
    start = time.monotonic()
    with pytest.raises(IndexError):
        _one_thread_raises[1, 32](out)
    assert time.monotonic() - start < 30
    assert (out == 0).all()     # nobody got past the second barrier


@cuda.jit(device=True)
def _lane_plus(x):
    return x + cuda.threadIdx.x          # `cuda` here is the launch's fake module


@cuda.jit
def _calls_a_device_function(out, fail):
    t = cuda.threadIdx.x
    out[t] = _lane_plus(t)
    if fail and t == 3:
        out[100] = 0                     # out of bounds: the launch raises


def test_device_calls_swap_the_module_once_and_the_launch_restores_it():
    import numba.cuda.simulator.kernel as K

    assert getattr(K.FakeCUDAKernel.__call__, "_tilepy_held", False)
    real = globals()["cuda"]
    out = np.zeros(32, np.int64)
    _calls_a_device_function[1, 32](out, False)
    np.testing.assert_array_equal(out, 2 * np.arange(32))
    assert globals()["cuda"] is real
    with pytest.raises(IndexError):
        _calls_a_device_function[1, 32](out, True)
    assert globals()["cuda"] is real     # restored after a launch that raised, too
    out[:] = 0
    _calls_a_device_function[1, 32](out, False)
    np.testing.assert_array_equal(out, 2 * np.arange(32))
