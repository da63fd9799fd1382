"""Small device buffers that kernels read (tensor maps, tile counters), made and filled in a
way CUDA-graph capture allows.

A TMA kernel reads its tensor maps from global memory and a persistent one draws tiles from a
global counter; both are bytes the host decides. While a stream is being captured into a CUDA
graph, the host may not synchronise, allocate outside the caller's allocator (the graph's
private pool, for a PyTorch caller), copy from pageable host memory, or touch another stream.
So here:

* memory comes from an **allocation callback** ``alloc(nbytes) -> (owner, pointer)`` that the
  op passes in (:func:`tilepy.arrays.byte_allocator`: the caller's framework, on the inputs'
  device); :func:`allocate` aligns inside it and :class:`DeviceBuffer` keeps ``owner`` alive
  beside the pointer;
* bytes are written by :func:`write`: a one-thread kernel launched on the caller's stream that
  takes them as by-value ``uint64`` parameters (16 words, 128 bytes, per launch) — a kernel
  launch is capturable, and its parameters are copied by the driver when it is enqueued
  (or when it is captured, into the graph), so no host buffer has to outlive the call. The
  kernel is compiled once (and kept in tilepy's kernel disk cache) and launched through a
  :class:`tilepy.launch.LaunchPlan` per device and word count;
* :func:`zero` clears bytes with one driver memset on the stream (capturable too);
* :func:`record_done` / :func:`is_done` tell when a write has run (so a buffer written on one
  stream can be read by any other, a capture included, with no write of its own);
* :func:`stream_capturing` says whether a stream is being captured, for callers that must not
  cache what a capture creates (its writes run only when the graph is replayed).

In the CUDA simulator the same path runs: the allocation callback returns host memory, the
writer is a simulator kernel, and no stream is ever capturing.

This module knows Numba and the CUDA driver bindings, not CuPy or PyTorch.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np
from numba import cuda

from .. import devices
from ..kcache import enable_disk_cache
from ..launch import LaunchPlan, _stream_handle
from ..ptx.asm import SIMULATOR

#: uint64 words one writer launch stores (the by-value parameters of the kernel).
WORDS = 16


@cuda.jit
def _write_words(dst, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15):
    """One thread: ``dst[i] = w_i`` for i < len(dst) (at most :data:`WORDS`)."""
    n = dst.shape[0]
    if n > 0:
        dst[0] = w0
    if n > 1:
        dst[1] = w1
    if n > 2:
        dst[2] = w2
    if n > 3:
        dst[3] = w3
    if n > 4:
        dst[4] = w4
    if n > 5:
        dst[5] = w5
    if n > 6:
        dst[6] = w6
    if n > 7:
        dst[7] = w7
    if n > 8:
        dst[8] = w8
    if n > 9:
        dst[9] = w9
    if n > 10:
        dst[10] = w10
    if n > 11:
        dst[11] = w11
    if n > 12:
        dst[12] = w12
    if n > 13:
        dst[13] = w13
    if n > 14:
        dst[14] = w14
    if n > 15:
        dst[15] = w15


class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr`` (aligned as :func:`allocate` was asked), inside
    an allocation whose ``owner`` (the allocation callback's array) this object keeps alive.
    In the simulator the memory is host memory and ``ptr`` its address."""

    __slots__ = ("owner", "ptr", "nbytes")

    def __init__(self, owner, ptr: int, nbytes: int):
        self.owner, self.ptr, self.nbytes = owner, int(ptr), int(nbytes)

    def view(self, shape, dtype):
        """A Numba device array (the simulator's stand-in there) of ``shape`` and ``dtype``
        over the buffer, C-contiguous from ``ptr``; it keeps this buffer alive. No copy, no
        synchronisation."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, tuple) else (shape,)))
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes > self.nbytes:
            raise ValueError(f"a view of {nbytes} bytes over a buffer of {self.nbytes}")
        if SIMULATOR:
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            raw = (ctypes.c_char * max(nbytes, 1)).from_address(self.ptr)
            arr = FakeCUDAArray(np.ndarray(shape, dtype, buffer=raw))
            arr._tilepy_owner = self
            return arr
        desc = {"shape": shape, "strides": None, "typestr": dtype.str,
                "data": (self.ptr, False), "version": 3}
        return cuda.from_cuda_array_interface(desc, owner=self, sync=False)


def allocate(alloc, nbytes: int, align: int = 8) -> DeviceBuffer:
    """``nbytes`` from ``alloc(nbytes) -> (owner, pointer)`` at an ``align``-byte aligned
    address: the allocation itself when the callback's pointer is aligned (PyTorch, CuPy and
    Numba allocations are aligned to 256 bytes or more), else an aligned span inside an
    allocation ``align - 1`` bytes larger. ``alloc=None``: :func:`default_alloc`."""
    alloc = alloc or default_alloc
    nbytes = int(nbytes)
    owner, ptr = alloc(nbytes)
    ptr = int(ptr)
    if ptr % align:
        owner, ptr = alloc(nbytes + align - 1)
        ptr = int(ptr)
        ptr += -ptr % align
    return DeviceBuffer(owner, ptr, nbytes)


def default_alloc(nbytes: int):
    """The allocation callback for callers that give none: a Numba device array on the current
    device (a NumPy array in the simulator). Not for use during a stream capture (a Numba
    allocation is not the caller's allocator)."""
    if SIMULATOR:
        arr = np.empty(max(int(nbytes), 1), np.uint8)
        return arr, arr.ctypes.data
    arr = cuda.device_array(max(int(nbytes), 1), np.uint8)
    return arr, int(arr.device_ctypes_pointer.value or 0)


_WRITERS: dict = {}
_WRITERS_LOCK = threading.Lock()


def _writer(nwords: int, ptr: int):
    """The writer kernel's bound plan for ``nwords`` words on the current device (built on
    first use, typed on a view at ``ptr``)."""
    key = (devices.current_id(), nwords)
    bound = _WRITERS.get(key)
    if bound is None:
        with _WRITERS_LOCK:
            bound = _WRITERS.get(key)
            if bound is None:
                if not _WRITERS:   # first use: tilepy's kernel disk cache
                    enable_disk_cache(_write_words)
                dst = DeviceBuffer(None, ptr, 8 * nwords).view((nwords,), np.uint64)
                args = (dst,) + (np.uint64(0),) * WORDS
                plan = LaunchPlan(_write_words, args, 1, 1)
                bound = _WRITERS[key] = plan.bind([(0, ptr)])
    return bound


def write(stream, ptr: int, data) -> None:
    """Enqueue on ``stream`` (a raw handle, a Numba stream, or 0) the store of ``data`` (bytes
    or a NumPy array, a multiple of 8 bytes) at device address ``ptr`` (8-byte aligned): one
    writer launch per :data:`WORDS` words, on the current device. Returns when the launches
    are enqueued (in the simulator: done); the host bytes need not outlive the call."""
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    ptr = _word_span("write", ptr, len(raw))
    words = np.frombuffer(raw, "<u8").tolist()
    handle = _stream_handle(stream)
    for i in range(0, len(words), WORDS):
        chunk = words[i:i + WORDS]
        at = ptr + 8 * i
        _writer(len(chunk), at)(handle, [at], chunk + [0] * (WORDS - len(chunk)))


def _word_span(who: str, ptr, nbytes: int) -> int:
    """``ptr`` as an int, after checking that ``nbytes`` at it are whole aligned 8-byte words
    (ValueError otherwise)."""
    ptr = int(ptr)
    if nbytes % 8 or ptr % 8:
        raise ValueError(f"{who}: {nbytes} bytes at {ptr:#x}; a multiple of 8 bytes at an "
                         "8-byte aligned address is needed")
    return ptr


def zero(stream, ptr: int, nbytes: int) -> None:
    """``nbytes`` zero bytes (a multiple of 8) at ``ptr``, enqueued on ``stream``: one
    ``cuMemsetD8Async`` (capturable: a memset node in a graph, however many bytes); in the
    simulator :func:`write` of zeros."""
    if SIMULATOR:
        write(stream, ptr, bytes(int(nbytes)))
        return
    ptr = _word_span("zero", ptr, nbytes)
    from cuda.bindings import driver

    (err,) = driver.cuMemsetD8Async(ptr, 0, int(nbytes), _stream_handle(stream))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemsetD8Async of {nbytes} bytes failed: {err}")


def record_done(stream):
    """A token that :func:`is_done` turns true once the work enqueued on ``stream`` so far has
    run (a driver event recorded there, no timing); None in the simulator, where everything
    has run when the call returns. Not during a capture of ``stream``."""
    if SIMULATOR:
        return None
    from cuda.bindings import driver

    err, event = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuEventCreate failed: {err}")
    (err,) = driver.cuEventRecord(event, _stream_handle(stream))
    if err != driver.CUresult.CUDA_SUCCESS:
        driver.cuEventDestroy(event)
        raise RuntimeError(f"cuEventRecord failed: {err}")
    return event


def is_done(token):
    """Whether the work before :func:`record_done`'s ``token`` has run (``cuEventQuery``: no
    waiting): True (the token is released), False (not yet; ask again later), or None (the
    query failed: the token is released, the work must be taken as never done). Not for a
    thread that is capturing a stream; the query runs in the relaxed capture mode, so another
    thread's capture (PyTorch's default global mode) is not invalidated by it. One caller
    per token at a time."""
    if token is None:
        return True
    from cuda.bindings import driver

    relaxed = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    err, mode = driver.cuThreadExchangeStreamCaptureMode(relaxed)
    try:
        (err,) = driver.cuEventQuery(token)
    finally:
        driver.cuThreadExchangeStreamCaptureMode(mode)
    if err == driver.CUresult.CUDA_ERROR_NOT_READY:
        return False
    driver.cuEventDestroy(token)
    return True if err == driver.CUresult.CUDA_SUCCESS else None


def release(token) -> None:
    """Release a :func:`record_done` token that will not be asked again."""
    if token is not None:
        from cuda.bindings import driver

        driver.cuEventDestroy(token)


#: Buffers that captured CUDA graphs may read (tensor maps, tile counters, split-K
#: workspaces), by address: kept for the life of the process. A graph holds no reference to
#: them, and freeing one — when a plan is dropped from its op's cache — would let a later
#: allocation (the graph's own pool included) reuse memory a replay still reads. A few hundred
#: bytes per captured launch (its tensor maps), and per plan, capture and captured stream a
#: tile counter — for a split-K GEMM with its workspace (4 bytes per element of its items'
#: tiles: megabytes).
GRAPH_BUFFERS: dict = {}


def keep_for_graphs(buf):
    """Keep ``buf`` (a :class:`DeviceBuffer`) alive for the process (:data:`GRAPH_BUFFERS`);
    returns it."""
    GRAPH_BUFFERS[buf.ptr] = buf
    return buf


def keep_during_capture(stream, *arrays) -> None:
    """When ``stream`` is being captured into a CUDA graph, keep ``arrays`` (an op's
    temporaries: a converted bias, float32 scratch; None entries ignored) alive for the
    process in :data:`GRAPH_BUFFERS`: freed, a caching allocator (CuPy's pool) would hand their
    memory to a later allocation while the graph's replays still read and write it. Outside
    a capture it does nothing (the arrays are freed as usual, after the launches are queued:
    stream-ordered allocators make that safe). Costs one ``cuStreamIsCapturing`` query."""
    kept = [a for a in arrays if a is not None]
    if kept and stream_capturing(stream):
        for a in kept:
            GRAPH_BUFFERS[("array", id(a))] = a


def stream_capturing(stream) -> bool:
    """Whether ``stream`` (a raw handle or a Numba stream) is being captured into a CUDA graph
    (``cuStreamIsCapturing``; an invalidated capture counts, and so does a query the driver
    refuses — except for the legacy default stream (handle 0, which cannot be captured) on a
    thread without a current context, such as PyTorch's autograd thread before its first
    runtime call). Always False in the simulator."""
    if SIMULATOR:
        return False
    return _capture_query()(_stream_handle(stream))


def capture_id(stream) -> int:
    """The id of the CUDA-graph capture that ``stream`` (a raw handle or a Numba stream) is
    part of — unique over the process's lifetime (``cuStreamGetCaptureInfo``) — or 0 when the
    stream is not being captured or the driver does not answer. Always 0 in the simulator."""
    if SIMULATOR:
        return 0
    from cuda.bindings import driver

    try:
        res = driver.cuStreamGetCaptureInfo(_stream_handle(stream))
        active = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
        if res[0] != driver.CUresult.CUDA_SUCCESS or res[1] != active:
            return 0
        return int(res[2])
    except Exception:  # noqa: BLE001 - an unknown binding's answer: no id (a buffer per launch)
        return 0


@functools.cache
def _capture_query():
    from cuda.bindings import driver

    none = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    ok = driver.CUresult.CUDA_SUCCESS
    no_context = driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
    is_capturing = driver.cuStreamIsCapturing

    def query(handle: int) -> bool:
        err, status = is_capturing(handle)
        if err == no_context and handle == 0:
            return False
        return err != ok or status != none

    return query


def argtypes() -> tuple:
    """Numba argument types of the writer kernel (offline compilation)."""
    from numba import types

    return (types.uint64[::1],) + (types.uint64,) * WORDS


def compile_reports():
    """The writer kernel's offline sm_90 compile (:func:`tilepy.offline.compile_kernel`, as a
    dict), for ``tilepy.offline.run_in_subprocess``."""
    from dataclasses import asdict

    from ..offline import compile_kernel

    return [asdict(compile_kernel("write_words", _write_words.py_func, argtypes()))]


__all__ = ["WORDS", "DeviceBuffer", "allocate", "default_alloc", "stream_capturing", "write",
           "zero"]
