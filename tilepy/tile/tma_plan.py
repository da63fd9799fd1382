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
from .stream_counter import StreamCounters, stream_key

MAP_CACHE = 64    # tensor-map buffers a plan keeps (per stream and operand pointers)


_ANY_STREAM = None   # the stream key of maps a plan was handed already written


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
                 cluster: int = 1, *, alloc=None, initial=None, dependent: bool = False):
        super().__init__(kernel, args, grid, block, smem, cluster, dependent=dependent)
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


class ScheduledTmaPlan(StreamCounters, TmaLaunchPlan):
    """The plan of a persistent TMA kernel that draws its tiles from a ticket counter
    (:func:`tilepy.tile.schedule.ticket_scheduler`): its argument after the tensor maps is
    the counter, one per stream (and per capture) from the plan's allocation callback
    (:class:`tilepy.tile.stream_counter.StreamCounters`: a launch leaves it at zero).
    ``counter``: the :class:`~tilepy.tile.device_write.DeviceBuffer` that ``args`` hold a view
    of (not yet zeroed: it becomes the first stream's); without it ``args``' counter must be
    zeroed.

    ``counter_bytes`` (a multiple of 8): the counter's size, all of it zeroed (a launch leaves
    it at zero). ``workspace_offset``: the argument after the counter is a workspace that
    needs no zeroing, at that byte offset in the same per-stream buffer (``counter`` then
    spans both: the split-K GEMM's tile semaphores and its partial sums)."""

    def __init__(self, kernel, args, *rest, counter=None, counter_bytes=COUNTER_BYTES,
                 workspace_offset=None, **kw):
        super().__init__(kernel, args, *rest, **kw)
        workspace = None if workspace_offset is None else (
            self.array_index(self.maps_arg + 2), int(workspace_offset))
        self._init_counters(self._alloc, self.array_index(self.maps_arg + 1),
                            args[self.maps_arg + 1], counter, counter_bytes, workspace)

    def _fill(self, ptrs, stream: int, capturing: bool) -> None:
        self._fill_counter(ptrs, stream, capturing)
