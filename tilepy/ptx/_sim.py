"""The simulator side of the PTX layer: lanes, warp-wide exchange, and bit-level conversions.

In Numba's CUDA simulator every CUDA thread is a Python thread (``BlockThread``) run by a
``BlockManager`` per block. A warp-collective twin (mma, ldmatrix, shuffles…) needs the values
of all 32 lanes of its warp: each lane writes its value into per-block scratch, the block meets
at the simulator's own ``syncthreads`` (cheaper than a Python barrier per warp, see
shared/numba-cuda-notes.md), and each lane reads the warp's 32 values back.

Contract (stated in the docs): every thread of the block that is still running reaches each
warp-collective call, in the same order — as tile kernels do. A kernel in which one warp
shuffles while another waits elsewhere does not simulate faithfully, unless it is
warp-specialised: after ``setmaxnreg`` (:func:`set_warp_specialised`) a thread's collectives
meet at a barrier of its own warp instead.

The scratch is double-buffered by a per-thread parity bit, so one barrier per exchange
suffices: a lane can only overwrite buffer ``p`` again after the *next* exchange's barrier,
which every lane reaches only after it has finished reading buffer ``p``.
"""

from __future__ import annotations

import threading

import functools

import numpy as np

WARP = 32
_create_lock = threading.Lock()


def this_thread():
    t = threading.current_thread()
    if not hasattr(t, "thread_id"):
        raise RuntimeError("tilepy.ptx twins must be called from inside a simulated CUDA kernel")
    return t


def lane_id() -> int:
    return this_thread().thread_id % WARP


def warp_id() -> int:
    return this_thread().thread_id // WARP


def block_state(name: str, factory, t=None):
    """Per-block state of the calling simulated thread: ``factory(manager)`` made once per
    block (kept on the simulator's BlockManager, so it dies with the block)."""
    m = (t or this_thread())._manager
    attr = "_tilepy_" + name
    value = getattr(m, attr, None)
    if value is None:
        with _create_lock:
            value = getattr(m, attr, None)
            if value is None:
                value = factory(m)
                setattr(m, attr, value)
    return value


def _new_scratch(m):
    nwarps = (int(np.prod(m._block_dim)) + WARP - 1) // WARP
    return [[[None] * WARP for _ in range(nwarps)] for _ in range(2)]


def _scratch(t):
    return block_state("scratch", _new_scratch, t)


def warp_exchange(value):
    """All 32 lanes' ``value`` (a list indexed by lane), for the calling thread's warp.

    The lanes meet at the block's ``syncthreads``, or, once the thread is warp-specialised
    (:func:`set_warp_specialised`), at a barrier of its own warp."""
    t = this_thread()
    scratch = _scratch(t)
    parity = getattr(t, "_tilepy_parity", 0)
    t._tilepy_parity = parity ^ 1
    row = scratch[parity][t.thread_id // WARP]
    row[t.thread_id % WARP] = value
    if getattr(t, "_tilepy_per_warp", False):
        block_state("warp_barriers", _warp_barriers, t)[t.thread_id // WARP].wait(
            t, "warp collective")
    else:
        t.syncthreads()
    return list(row)


def set_warp_specialised() -> None:
    """From now on the calling thread's warp collectives meet at a barrier of its own warp,
    not at the block's syncthreads (which would wait for warps that never reach them: a
    producer warpgroup polling an mbarrier while consumers shuffle). ``setmaxnreg``'s twins
    call it: every warpgroup of a warp-specialised kernel executes setmaxnreg at the same
    point, before its first collective, so all threads switch together. Dearer per
    exchange (shared/numba-cuda-notes.md), which is why it is not the default."""
    this_thread()._tilepy_per_warp = True


def _warp_barriers(m):
    n = int(np.prod(m._block_dim))
    return [_GroupBarrier(WARP, "warp") for _ in range((n + WARP - 1) // WARP)]


def warp_collective(value, model):
    """``model(all 32 lanes' values)[this lane]``, with ``model`` evaluated once per warp.

    For twins whose warp-wide result is expensive (mma): the first lane past the barrier
    computes the list of 32 results, the others reuse it. Results are kept per (parity, warp)
    with the exchange's sequence number, so a stale result is never read.
    """
    t = this_thread()
    seq = getattr(t, "_tilepy_seq", 0)
    t._tilepy_seq = seq + 1
    lanes = warp_exchange(value)
    results = _results(t)
    slot = (seq & 1, t.thread_id // WARP)
    with _result_lock:
        done = results.get(slot)
        if done is None or done[0] != seq:
            done = (seq, model(lanes))
            results[slot] = done
    return done[1][t.thread_id % WARP]


_result_lock = threading.Lock()


def _results(t):
    return block_state("results", lambda m: {}, t)


# ---- bit-level conversions used by the twins (NumPy scalars in, NumPy scalars out) --------

def u32(x) -> np.uint32:
    return np.uint32(int(x) & 0xFFFFFFFF)


def f16_bits(x) -> int:
    return int(np.float16(x).view(np.uint16))


def bits_f16(b) -> np.float16:
    return np.uint16(int(b) & 0xFFFF).view(np.float16)


def f32_to_bf16_bits(x) -> int:
    """Round-to-nearest-even float32 → bfloat16 bits (NaN stays NaN), like cvt.rn.bf16.f32."""
    b = int(np.float32(x).view(np.uint32))
    if (b & 0x7F800000) == 0x7F800000 and (b & 0x007FFFFF):
        return ((b >> 16) | 0x40) & 0xFFFF  # quiet NaN, sign kept
    b += 0x7FFF + ((b >> 16) & 1)
    return (b >> 16) & 0xFFFF


def bf16_bits_to_f32(b) -> np.float32:
    return np.uint32((int(b) & 0xFFFF) << 16).view(np.float32)


def f32_bits(x) -> int:
    return int(np.float32(x).view(np.uint32))


def bits_f32(b) -> np.float32:
    return np.uint32(int(b) & 0xFFFFFFFF).view(np.float32)


@functools.cache
def fp8_values(exp_bits: int) -> np.ndarray:
    """The 256 values (float64) of an 8-bit float code: ``exp_bits`` 4 is e4m3 (no inf,
    S.1111.111 NaN), 5 is e5m2 (IEEE-like: inf and NaN at the top exponent)."""
    man_bits = 7 - exp_bits
    bias = (1 << (exp_bits - 1)) - 1
    out = np.empty(256, dtype=np.float64)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e = (b >> man_bits) & ((1 << exp_bits) - 1)
        m = b & ((1 << man_bits) - 1)
        if exp_bits == 4 and e == 15 and m == 7:
            out[b] = np.nan
        elif exp_bits == 5 and e == 31:
            out[b] = sign * np.inf if m == 0 else np.nan
        elif e == 0:
            out[b] = sign * m * 2.0 ** (1 - bias - man_bits)
        else:
            out[b] = sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
    out.flags.writeable = False
    return out


def f32_to_fp8_bits(x, exp_bits: int) -> int:
    """``cvt.rn.satfinite`` of one float32 to an 8-bit float code: nearest, ties to the even
    code; beyond the largest finite value (and ±inf) the largest finite value of that sign;
    NaN → 0x7f; the sign kept (−0 → 0x80)."""
    x = float(np.float32(x))
    if x != x:
        return 0x7F
    vals = fp8_values(exp_bits)
    top = 0x7E if exp_bits == 4 else 0x7B            # the largest finite positive code
    pos = vals[:top + 1]
    a = min(abs(x), pos[-1])
    i = int(np.searchsorted(pos, a))
    if i > top:
        i = top
    elif i > 0 and pos[i] != a:
        lo, hi = pos[i - 1], pos[i]
        if a - lo < hi - a or (a - lo == hi - a and (i - 1) % 2 == 0):
            i -= 1
    return i | (0x80 if np.signbit(x) else 0)


def halves(word) -> tuple[int, int]:
    w = int(word) & 0xFFFFFFFF
    return w & 0xFFFF, w >> 16


def join_halves(lo, hi) -> np.uint32:
    return np.uint32((int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16))


def bytes4(word) -> list[int]:
    w = int(word) & 0xFFFFFFFF
    return [(w >> (8 * i)) & 0xFF for i in range(4)]


# ---- warpgroups (wgmma): four consecutive warps, 128 threads -------------------------------
#
# A warpgroup-collective twin (wgmma.mma_async) needs the values of all 128 threads of its
# warpgroup. Unlike the warp collectives above it does NOT rendezvous at the block's
# syncthreads: warp-specialised kernels run a producer warpgroup (TMA, mbarrier waits) beside
# consumer warpgroups, so only the warpgroup's own 128 threads meet, at a Python barrier.

WARPGROUP = 128

#: Seconds a simulated thread waits at a warpgroup barrier or an mbarrier before the twin
#: declares a deadlock (a thread that never arrives) and raises; generous, since a loaded
#: 2-core machine once took over 120 s for a 768-thread cluster to meet.
WAIT_TIMEOUT = 300.0


def warpgroup_id() -> int:
    return this_thread().thread_id // WARPGROUP


def block_threads(t=None) -> int:
    return int(np.prod((t or this_thread())._manager._block_dim))


def check_abort(t, what: str) -> None:
    """Raise if the simulator aborted the block (another thread raised)."""
    if getattr(t, "abort", False):
        raise RuntimeError(f"{what}: the block was aborted (another thread raised)")
    cluster = getattr(getattr(t, "_manager", None), "_tilepy_cluster", None)
    if cluster is not None and cluster["failed"]:
        raise RuntimeError(f"{what}: another block of the cluster raised")


class _GroupBarrier:
    """A reusable barrier for ``n`` simulated threads that gives up when the block aborts."""

    def __init__(self, n: int, group: str = "warpgroup"):
        self.n = n
        self.group = group
        self.count = 0
        self.generation = 0
        self.cond = threading.Condition()

    def wait(self, t, what: str) -> None:
        import time

        with self.cond:
            gen = self.generation
            self.count += 1
            if self.count == self.n:
                self.count = 0
                self.generation += 1
                self.cond.notify_all()
                return
            deadline = time.monotonic() + WAIT_TIMEOUT
            while self.generation == gen:
                self.cond.wait(0.05)
                check_abort(t, what)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{what}: only {self.count} of the {self.n} threads of the "
                        f"{self.group} arrived within {WAIT_TIMEOUT:.0f} s; every thread of a "
                        f"{self.group} must make each .sync.aligned {self.group} call")


def _warpgroup_barriers(m):
    n = int(np.prod(m._block_dim))
    return [_GroupBarrier(WARPGROUP) for _ in range(n // WARPGROUP)]


def warpgroup_exchange(value, what: str = "warpgroup collective"):
    """All 128 threads' ``value`` (a list indexed by thread within the warpgroup)."""
    t = this_thread()
    n = block_threads(t)
    if n % WARPGROUP:
        raise RuntimeError(f"{what}: the block has {n} threads; warpgroup instructions need a "
                           f"multiple of {WARPGROUP} (whole warpgroups)")
    scratch = block_state("wg_scratch", lambda m: [[[None] * WARPGROUP
                                                    for _ in range(n // WARPGROUP)]
                                                   for _ in range(2)], t)
    barriers = block_state("wg_barriers", _warpgroup_barriers, t)
    parity = getattr(t, "_tilepy_wg_parity", 0)
    t._tilepy_wg_parity = parity ^ 1
    wg, me = divmod(t.thread_id, WARPGROUP)
    row = scratch[parity][wg]
    row[me] = value
    barriers[wg].wait(t, what)
    return list(row)


def warpgroup_collective(value, model, what: str = "warpgroup collective"):
    """``model(all 128 threads' values)[this thread]``, ``model`` evaluated once per warpgroup.

    The same double-buffering argument as :func:`warp_collective` makes one barrier per call
    enough: results are kept per (parity, warpgroup) with the call's sequence number.
    If ``model`` raises, every thread of the warpgroup raises the same error.
    """
    t = this_thread()
    seq = getattr(t, "_tilepy_wg_seq", 0)
    t._tilepy_wg_seq = seq + 1
    lanes = warpgroup_exchange(value, what)
    results = block_state("wg_results", lambda m: {}, t)
    slot = (seq & 1, t.thread_id // WARPGROUP)
    with _result_lock:
        done = results.get(slot)
        if done is None or done[0] != seq:
            try:
                done = (seq, model(lanes), None)
            except Exception as e:  # noqa: BLE001  (every thread of the warpgroup re-raises it)
                done = (seq, None, e)
            results[slot] = done
    if done[2] is not None:
        raise type(done[2])(str(done[2]))
    return done[1][t.thread_id % WARPGROUP]
