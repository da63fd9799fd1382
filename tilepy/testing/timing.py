"""Time GPU work with CUDA events: warm-up, then the median of ``repeat`` timed runs."""

from __future__ import annotations

import statistics


def time_cuda(fn, *, warmup: int = 3, repeat: int = 20, stream=None) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events on ``stream`` (default stream)."""
    from numba import cuda

    stream = 0 if stream is None else stream
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cuda.event(), cuda.event()
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop))
    return statistics.median(times)
