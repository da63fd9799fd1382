"""Launch plans of TMA kernels: tensor maps per stream and operand pointers, written on the
launch stream, capture-safe; and the tile-ticket counter of dynamically scheduled persistent
kernels.

A TMA kernel takes its tensor maps as one device-buffer argument (``maps_arg``); the maps hold
the operands' pointers, so a plan re-encodes them when a bound plan is called with other
pointers (:meth:`TmaLaunchPlan.maps_for`). Host side only: the device side of TMA is
:mod:`tilepy.ptx.tma`, the encoding :mod:`tilepy.tile.tma`.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from ..launch import BoundPlan, LaunchPlan, _stream_handle, pointer
from . import device_write
from . import tma as host_tma
from .device_write import DeviceBuffer

MAP_CACHE = 64    # tensor-map buffers a plan keeps (per stream and operand pointers)


#: CUDA's per-thread default stream handle: a different stream in each host thread.
PER_THREAD_STREAM = 2
_ANY_STREAM = None   # the stream key of maps a plan was handed already written


def stream_key(handle: int):
    """What identifies a stream for per-stream state (tensor maps, tile counters): its handle,
    and for the per-thread default stream the host thread too."""
    return (handle, threading.get_ident()) if handle == PER_THREAD_STREAM else handle


class TmaLaunchPlan(LaunchPlan):
    """A :class:`~tilepy.launch.LaunchPlan` of a TMA kernel whose argument ``maps_arg`` (a
    device buffer of tensor maps, 128 bytes each) follows the pointers of the arguments
    ``map_args`` (say a and b, or q, k and v, plus out where the output is TMA-stored):
    ``encoder(*pointers) -> uint8 bytes`` makes the maps of those pointers. Every launch —
    :meth:`launch` and bound plans (:meth:`bind`, with sources for the arrays before the maps
    only) — takes the maps of its
    pointers from :meth:`maps_for`: a small cache (:data:`MAP_CACHE` entries, least recently
    used dropped), filled on a miss by encoding the maps on the host and writing them into a
    buffer from ``alloc`` with a kernel launch on the launch stream
    (:func:`tilepy.tile.tma.maps_to_device`). Arguments after the maps are passed as given
    (see the attention kernel's ScheduledTmaPlan).

    ``alloc(nbytes) -> (owner, pointer)``: where map buffers come from (the op passes
    :func:`tilepy.arrays.byte_allocator` of its inputs: the caller's allocator; default a
    Numba device array). ``initial``: ``(DeviceBuffer, bytes)`` of the maps of ``args``'
    pointers, encoded but not yet written (``args[maps_arg]`` is a view of that buffer);
    without it ``args[maps_arg]`` must already hold those maps.

    CUDA-graph capture: during a capture of the launch stream nothing is allocated outside
    ``alloc``, nothing is copied or synchronised, and only kernels and memsets are enqueued on
    that stream. A map buffer made during a capture is written only when the graph runs, so it is
    not cached; it and every cached buffer a capture used are kept for the life of the
    process (:data:`tilepy.tile.device_write.GRAPH_BUFFERS`: the graph reads them at each
    replay, after the cache, or the plan itself, may have dropped them).

    Maps are cached per stream (:func:`stream_key`) and pointers: a buffer is written on one
    stream and read there. Once its write is known to have run — an event recorded after the
    write, asked (never waited for) by later launches outside a capture — it is *settled*: a
    capture on any stream with the same pointers reads it (and keeps it) instead of writing
    maps of its own in the graph (two or three more nodes per captured call, ~3-8 µs).
    """

    def __init__(self, kernel, args, grid, block, smem, encoder, map_args, maps_arg: int,
                 cluster: int = 1, *, alloc=None, initial=None):
        super().__init__(kernel, args, grid, block, smem, cluster)
        self._encoder = encoder
        self._alloc = alloc
        self._map_args = tuple(map_args)   # the arguments the maps describe (a, b[, out])
        self._map_arrays = tuple(self.array_index(i) for i in self._map_args)
        # (stream key, pointers) -> DeviceBuffer of their maps
        self._maps = collections.OrderedDict()
        # pointers -> DeviceBuffer whose write has run (any stream may read it), and the
        # writes not known to have run yet: (stream key, pointers) -> (DeviceBuffer, token)
        self._settled = collections.OrderedDict()
        self._unsettled = {}
        self._kept = {}   # buffer address -> DeviceBuffer a captured graph of this plan read
        self._maps_lock = threading.Lock()
        key = tuple(pointer(args[i]) for i in self._map_args)
        if initial is None:   # maps the caller wrote: usable on any stream
            held = args[maps_arg]
            self._maps[(_ANY_STREAM, key)] = _held_buffer(held)
            self._pending = None
        else:
            self._pending = (key, *initial)
        self.maps_encoded = 1
        # the maps' index among the array arguments (bound plans' pointers)
        self.maps_arg = maps_arg
        self._maps_array = self.array_index(maps_arg)

    def maps_for(self, *ptrs, stream=0):
        """A device array (uint8) holding the tensor maps of operands at these pointers (a, b,
        and out for a kernel whose output is TMA-stored), written on ``stream`` on a miss."""
        buf = self._maps_buffer(tuple(int(p) for p in ptrs), _stream_handle(stream),
                                device_write.stream_capturing(stream))
        return buf.view((buf.nbytes,), np.uint8)

    def _maps_buffer(self, key, stream: int, capturing: bool):
        # per stream: a buffer is allocated, written and read on one stream, so a launch on
        # another stream never reads maps whose writer kernel has not run yet, and the
        # caching allocator never recycles a buffer another stream still reads
        ckey = (stream_key(stream), key)
        if self._unsettled and not capturing:
            self._settle()
        with self._maps_lock:
            hit = ckey if ckey in self._maps else (_ANY_STREAM, key) \
                if (_ANY_STREAM, key) in self._maps else None
            # a capture may read a settled buffer (kept for the process, as every buffer a
            # capture reads); an eager launch on another stream writes its own, so that no
            # buffer the plan may drop is read by a stream it was not allocated on
            buf = self._maps[hit] if hit is not None else \
                self._settled.get(key) if capturing else None
            if buf is not None:
                if hit is not None:
                    self._maps.move_to_end(hit)
                if capturing:
                    self._kept[buf.ptr] = device_write.keep_for_graphs(buf)
                return buf
            pending = self._pending
            if pending is not None and pending[0] == key:
                self._pending = None
            else:
                pending = None
        from ..arrays import on_device

        with on_device(self.device):
            if pending is not None:   # encoded when the plan was built
                _, buf, raw = pending
                device_write.write(stream, buf.ptr, raw)
            else:
                raw = self._encoder(*key)
                buf = host_tma.maps_to_device(raw, stream, self._alloc)
            token = None if capturing else device_write.record_done(stream)
        old = None
        with self._maps_lock:
            if pending is None:
                self.maps_encoded += 1
            if capturing:
                self._kept[buf.ptr] = device_write.keep_for_graphs(buf)
            else:
                self._maps[ckey] = buf
                while len(self._maps) > MAP_CACHE:
                    self._maps.popitem(last=False)
                old = self._unsettled.pop(ckey, None)
                self._unsettled[ckey] = (buf, token)
        if old is not None:
            device_write.release(old[1])
        return buf

    def _settle(self) -> None:
        """Move the map writes that have run to the settled buffers (outside captures only).
        The entries are taken out under the lock before their events are asked, so no two
        threads ask (or release) one event; those not done yet go back."""
        with self._maps_lock:
            waiting, self._unsettled = self._unsettled, {}
        states = [(ckey, buf, token, device_write.is_done(token))
                  for ckey, (buf, token) in waiting.items()]
        with self._maps_lock:
            for ckey, buf, token, done in states:
                if done:
                    self._settled[ckey[1]] = buf
                    self._settled.move_to_end(ckey[1])
                elif done is False:
                    if ckey in self._unsettled:      # written again meanwhile
                        device_write.release(token)
                    else:
                        self._unsettled[ckey] = (buf, token)
            while len(self._settled) > MAP_CACHE:
                self._settled.popitem(last=False)

    def _go(self, stream, ptrs, scalars):
        """Launch with the array pointers ``ptrs`` (the maps' slot is filled in here)."""
        handle = _stream_handle(stream)
        capturing = device_write.stream_capturing(handle)
        ptrs = list(ptrs)
        ptrs[self._maps_array] = self._maps_buffer(
            tuple(ptrs[i] for i in self._map_arrays), handle, capturing).ptr
        self._fill(ptrs, handle, capturing)
        super()._go(handle, ptrs, scalars)

    def _fill(self, ptrs, stream: int, capturing: bool) -> None:
        """Set the pointers of plan-supplied arrays after the maps (none here)."""

    def bind(self, sources):
        """As :meth:`LaunchPlan.bind`; ``sources`` may leave out the maps and any array
        after them (those the plan supplies itself)."""
        sources = list(sources)
        if len(sources) == self._maps_array:
            sources += [None] * (len(self._arrays) - self._maps_array)
        if len(sources) != len(self._arrays):
            raise ValueError(f"{len(self._arrays)} array arguments, {len(sources)} sources")
        return BoundPlan(self, sources)


def _held_buffer(array):
    """A :class:`~tilepy.tile.device_write.DeviceBuffer` over a device array that already
    holds tensor maps (kept alive by the buffer)."""
    return device_write.DeviceBuffer(array, pointer(array), array.size * array.dtype.itemsize)


#: The tile counter: int32[2] (tickets drawn, blocks finished).
COUNTER_BYTES = 8


def _tile_counter(alloc, stream, nbytes: int = COUNTER_BYTES, zeroed: int = COUNTER_BYTES):
    """``(DeviceBuffer, int32 view of its first zeroed bytes)``: a tile counter from ``alloc``
    (``nbytes``, 256-byte aligned), its first ``zeroed`` bytes zeroed on ``stream``
    (:func:`tilepy.tile.device_write.zero`): the persistent TMA kernel's tile tickets and
    finished blocks, which its last block out sets back to zero (or the split-K GEMM's tile
    semaphores, then its partial sums' workspace)."""
    buf = device_write.allocate(alloc, nbytes, 256)
    device_write.zero(stream, buf.ptr, zeroed)
    return buf, buf.view((zeroed // 4,), np.int32)


class ScheduledTmaPlan(TmaLaunchPlan):
    """The plan of a persistent TMA kernel that draws its tiles from a ticket counter
    (:func:`tilepy.tile.schedule.ticket_scheduler`): its argument after the tensor maps is
    the counter (:func:`_tile_counter`). A launch leaves it at zero, so launches in one stream
    share one; launches in two streams would take each other's tiles, so each stream has its
    own (the per-thread default stream: one per host thread), from the plan's allocation
    callback, zeroed on that stream before its first launch. ``counter``: the
    :class:`~tilepy.tile.device_write.DeviceBuffer` that ``args`` hold a view of (not yet
    zeroed: it becomes the first stream's); without it ``args``' counter must be zeroed.

    Launches during a CUDA-graph capture get a counter of their own per capture and stream
    (:func:`tilepy.tile.device_write.capture_id`; per launch where the driver gives no id),
    zeroed in the graph just before the first of them and kept for the plan's lifetime: the
    graph's launches then share no counter with launches outside it or with other graphs
    (which may run at the same time), and a graph of many calls holds one, not one a call.

    ``counter_bytes`` (a multiple of 8): the counter's size, all of it zeroed (a launch leaves
    it at zero). ``workspace_offset``: the argument after the counter is a workspace that
    needs no zeroing, at that byte offset in the same per-stream buffer (``counter`` then
    spans both: the split-K GEMM's tile semaphores and its partial sums)."""

    def __init__(self, kernel, args, *rest, counter=None, counter_bytes=COUNTER_BYTES,
                 workspace_offset=None, **kw):
        super().__init__(kernel, args, *rest, **kw)
        self._counter_array = self.array_index(self.maps_arg + 1)
        self._counter_bytes = int(counter_bytes)
        self._workspace = None
        if workspace_offset is not None:
            if counter is None:
                raise ValueError("ScheduledTmaPlan: a workspace needs the counter's buffer")
            self._workspace = (self.array_index(self.maps_arg + 2), int(workspace_offset))
        self._buffer_bytes = counter.nbytes if counter is not None else self._counter_bytes
        # stream key (or ("capture", capture id, stream key)) -> (DeviceBuffer, int32 view)
        self._counters = {}
        self._counters_lock = threading.Lock()
        held = args[self.maps_arg + 1]
        # the first stream's counter, and whether it still has to be zeroed
        self._built_counter = (counter or DeviceBuffer(held, pointer(held),
                                                       self._counter_bytes), held)
        self._built_zeroed = counter is None

    def counter_for(self, stream):
        """The tile counter (an int32 device array: [2] for the ticket scheduler, one per tile
        for split-K) of launches in ``stream``, made and zeroed on that stream the first time
        it is seen."""
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
                entry = _tile_counter(self._alloc, handle, *size)
            with self._maps_lock:
                self._kept[entry[0].ptr] = device_write.keep_for_graphs(entry[0])
            if cid:   # (kept for the plan's life, as the buffer is for the process's)
                with self._counters_lock:
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
                entry = _tile_counter(self._alloc, handle, *size)
            else:
                entry = built
                if not self._built_zeroed:
                    device_write.zero(handle, entry[0].ptr, self._counter_bytes)
        with self._counters_lock:
            entry = self._counters.setdefault(key, entry)
        return entry

    def _fill(self, ptrs, stream: int, capturing: bool) -> None:
        ptr = self._counter(stream, capturing)[0].ptr
        ptrs[self._counter_array] = ptr
        if self._workspace is not None:
            ptrs[self._workspace[0]] = ptr + self._workspace[1]
