"""Per-stream counters of a launch plan: a zeroed int32 buffer that a kernel's blocks count
themselves in and that the kernel's last user sets back to zero, so the launches of one stream
share it; capture-safe.

Kernels that meet through global atomics — a persistent kernel drawing tile tickets, split-K's
tile semaphores, flash-decoding's splits counting their arrivals so that the last one merges —
need a counter that is zero when a launch starts. Zeroing it before every launch would cost a
memset node per call; instead the kernel leaves it at zero, and the plan gives every stream a
counter of its own (two streams running the same plan at once would count into each other's),
zeroed once on that stream before its first launch. Launches during a CUDA-graph capture get a
counter per capture and stream, zeroed in the graph just before the first of them and kept for
the plan's lifetime (the graph's launches then share no counter with launches outside it or
with other graphs, which may run at the same time).

:class:`StreamCounters` is the mixin that does this for a :class:`tilepy.launch.LaunchPlan`
subclass (:class:`tilepy.tile.tma_plan.ScheduledTmaPlan`, :class:`CountedLaunchPlan`).
"""

from __future__ import annotations

import threading

import numpy as np

from ..launch import LaunchPlan, _stream_handle, arg_at, pointer
from . import device_write
from .device_write import DeviceBuffer


def stream_key(handle: int):
    """What identifies a stream for per-stream state (tensor maps, tile counters): its handle,
    and for the per-thread default stream the host thread too."""
    return (handle, threading.get_ident()) if handle == PER_THREAD_STREAM else handle


#: CUDA's per-thread default stream handle: a different stream in each host thread.
PER_THREAD_STREAM = 2


def make_counter(alloc, stream, nbytes: int, zeroed: int):
    """``(DeviceBuffer, int32 view of its first zeroed bytes)``: a counter from ``alloc``
    (``nbytes``, 256-byte aligned), its first ``zeroed`` bytes zeroed on ``stream``
    (:func:`tilepy.tile.device_write.zero`); the bytes after them are a workspace that needs no
    zeroing."""
    buf = device_write.allocate(alloc, nbytes, 256)
    device_write.zero(stream, buf.ptr, zeroed)
    return buf, buf.view((zeroed // 4,), np.int32)


class StreamCounters:
    """Mixin of a launch plan whose kernel takes a counter argument (the module docstring):
    the plan fills that argument's pointer at each launch with the counter of the launch's
    stream (:meth:`counter_for`), made from the plan's allocation callback ``alloc(nbytes) ->
    (owner, pointer)`` and zeroed on that stream the first time it is seen.

    The subclass calls :meth:`_init_counters` after :class:`~tilepy.launch.LaunchPlan`'s
    ``__init__`` and :meth:`_fill_counter` on the launch's pointers before it launches."""

    def _init_counters(self, alloc, counter_array: int, held, counter=None,
                       counter_bytes: int = 8, workspace=None):
        """``counter_array``: the counter's index among the array arguments; ``held``: the
        counter array the plan was built with — a view of ``counter`` (a
        :class:`~tilepy.tile.device_write.DeviceBuffer`, not yet zeroed: it becomes the first
        stream's), or without ``counter`` an array already zeroed. ``counter_bytes`` (a
        multiple of 8): the bytes zeroed (a launch leaves them at zero). ``workspace``:
        ``(array index, byte offset)`` of an argument that is a workspace at that offset in the
        same per-stream buffer (``counter`` then spans both)."""
        self._alloc = alloc
        self._counter_array = counter_array
        self._counter_bytes = int(counter_bytes)
        if workspace is not None and counter is None:
            raise ValueError("a workspace needs the counter's buffer")
        self._workspace = workspace
        self._buffer_bytes = counter.nbytes if counter is not None else self._counter_bytes
        # stream key (or ("capture", capture id, stream key)) -> (DeviceBuffer, int32 view)
        self._counters = {}
        self._counters_lock = threading.Lock()
        if not hasattr(self, "_kept"):
            self._kept = {}   # buffer address -> DeviceBuffer a captured graph of this plan read
        # the first stream's counter, and whether it still has to be zeroed
        self._built_counter = (counter or DeviceBuffer(held, pointer(held),
                                                       self._counter_bytes), held)
        self._built_zeroed = counter is None

    def counter_for(self, stream):
        """The counter (an int32 device array) of launches in ``stream``, made and zeroed on
        that stream the first time it is seen."""
        return self._counter(_stream_handle(stream), False)[1]

    def _counter(self, handle: int, capturing: bool):
        from ..arrays import on_device

        size = (self._buffer_bytes, self._counter_bytes)
        if capturing:
            # launches in one stream of one capture run in that order, each leaving the
            # counter at zero: they share one, zeroed in the graph before the first
            cid = device_write.capture_id(handle)
            key = ("capture", cid, stream_key(handle))
            with self._counters_lock:
                entry = self._counters.get(key) if cid else None
            if entry is not None:
                return entry
            with on_device(self.device):
                entry = make_counter(self._alloc, handle, *size)
            with self._counters_lock:
                self._kept[entry[0].ptr] = device_write.keep_for_graphs(entry[0])
                if cid:   # (kept for the plan's life, as the buffer is for the process's)
                    self._counters[key] = entry
            return entry
        key = stream_key(handle)
        with self._counters_lock:
            entry = self._counters.get(key)
            if entry is not None:
                return entry
            built, self._built_counter = self._built_counter, None
        with on_device(self.device):
            if built is None:
                entry = make_counter(self._alloc, handle, *size)
            else:
                entry = built
                if not self._built_zeroed:
                    device_write.zero(handle, entry[0].ptr, self._counter_bytes)
        with self._counters_lock:
            entry = self._counters.setdefault(key, entry)
        return entry

    def _fill_counter(self, ptrs, stream: int, capturing: bool) -> None:
        """Put the counter of ``stream`` (and the workspace after it) into ``ptrs``."""
        ptr = self._counter(stream, capturing)[0].ptr
        ptrs[self._counter_array] = ptr
        if self._workspace is not None:
            ptrs[self._workspace[0]] = ptr + self._workspace[1]


class CountedLaunchPlan(StreamCounters, LaunchPlan):
    """A :class:`~tilepy.launch.LaunchPlan` whose argument ``counter_arg`` (an int32 array the
    kernel leaves at zero) is the per-stream counter of :class:`StreamCounters`: built with
    ``args[counter_arg]`` a view of ``counter`` (a
    :class:`~tilepy.tile.device_write.DeviceBuffer` from ``alloc``, zeroed by the plan before
    its first launch). Bound plans take ``None`` as that argument's source (the plan supplies
    it)."""

    def __init__(self, kernel, args, grid, block, smem=0, *, counter_arg, counter, alloc,
                 **kw):
        super().__init__(kernel, args, grid, block, smem, **kw)
        self._init_counters(alloc, self.array_index(counter_arg), arg_at(args, counter_arg),
                            counter, counter.nbytes)

    def _go(self, stream, ptrs, scalars):
        handle = _stream_handle(stream)
        ptrs = list(ptrs)
        self._fill_counter(ptrs, handle, device_write.stream_capturing(handle))
        super()._go(handle, ptrs, scalars)
