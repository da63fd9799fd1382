"""Time GPU work with CUDA events: warm-up, then the median of ``repeat`` timed runs."""

from __future__ import annotations

import statistics


def time_cuda(fn, *, warmup: int = 3, repeat: int = 20, inner: int = 1, stream=None) -> float:
    """Median milliseconds per ``fn()`` call, CUDA events around ``inner`` calls, ``repeat`` times.

    Events go on ``stream`` (default: the legacy default stream, which is also where PyTorch
    and CuPy enqueue unless told otherwise, so their work is timed correctly too).
    """
    from numba import cuda

    stream = 0 if stream is None else stream
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cuda.event(), cuda.event()
        start.record(stream)
        for _ in range(inner):
            fn()
        stop.record(stream)
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) / inner)
    return statistics.median(times)


def preset_timer(ms_in_order):
    """A stand-in for a tuner's ``timer(fn, warmup, repeat) -> ms`` (tests): runs each
    candidate once and reports the preset times, in candidate order."""
    times = list(ms_in_order)

    def timer(fn, warmup, repeat):
        fn()
        return times.pop(0)
    return timer
