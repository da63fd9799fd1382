"""What every benchmark suite shares: GPU timing, the correctness check, the recorded figures.

Every call is timed twice, both with CUDA events on the legacy default stream:

* **GPU only** (``Timing.ms``): the median of ``repeat`` timed runs — the method of
  :func:`tilepy.testing.timing.time_cuda` — with two additions that function cannot make:

  * **L2 flush** (``flush=True``): a 256 MB buffer is written before every timed run, so
    inputs that fit in the L2 cache (50 MB on an H200) are read from memory as in a real
    pipeline, not from the cache the previous run left warm. Use it where the inputs fit
    (:func:`fits_in_l2`).
  * **Host cost kept out of the events**: before every timed run the GPU is given a short
    spin (``torch.cuda._sleep``) that lasts longer than issuing the calls takes on the CPU,
    so the events time GPU work only, even for a call whose Python wrapper costs more than
    its kernel (``time_cuda`` synchronises right before its first event, so there the host
    cost of the first call lands inside the events). The CPU cost of one asynchronous call
    is measured on its own and recorded as ``host_us`` beside the GPU time.

* **As called** (``Timing.ms_as_called``): what a caller that calls back to back sees. After
  the GPU-only runs, with the GPU idle (synchronised) and no spin in front, events go around
  ``calls_as_called`` calls issued back to back — enough to cover at least
  ``AS_CALLED_MIN_MS`` (2 ms) by the larger of the GPU time and the host cost of one call, and
  at least ``AS_CALLED_MIN_CALLS`` (20) — per call, median of ``AS_CALLED_REPEAT`` (5) such
  runs. A wrapper whose host cost exceeds its kernel's time shows it here (the GPU waits for
  the CPU inside the events); a GPU-bound call gives about its GPU time. With ``flush=True``
  the L2 is flushed before each of these runs, not between its calls (the calls then find
  the cache the previous call left, as a caller's back-to-back calls do).

Why both: hiding the host cost once made an op whose wrapper built a new launch plan per call
(750-1340 µs of host time) look 1.06× faster than its peer when a caller saw it 10× slower.
So the figures that compare use, for each implementation, the **effective** time: the slower
of the two (:attr:`Timing.effective_ms`). A call whose as-called time exceeds its GPU-only
time by more than ``HOST_BOUND`` (10%) is *host-bound as called* (:attr:`Timing.host_bound`).

Every result is recorded through :func:`record_throughput`: throughput of each
implementation, GPU-only (``impls``) and as called (``impls_as_called``), their times
(``ms_all``, ``ms_as_called_all``; tilepy's also as ``ms`` and ``ms_as_called``), the ratio
``peer_ms / ms`` to each peer of the effective times (``ratio``, ``ratios``) and of the
GPU-only times (``ratio_gpu``, ``ratios_gpu``), and what plots and tables need (``table``,
``case``, ``figure``, ``x``); ``bench/results_data.py`` reads them back (and reads older files
without the as-called figures as GPU-only).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass

REPEAT = 10
WARMUP = 2
MAX_LEAD_US = 100_000.0   # the longest GPU spin put ahead of a timed run
FLUSH_BYTES = 256 << 20
L2_DEFAULT_BYTES = 50 << 20  # H200; used when PyTorch does not report the L2 size
HOST_CALLS = 5
AS_CALLED_MIN_MS = 2.0     # an as-called run covers at least this long ...
AS_CALLED_MIN_CALLS = 20   # ... and at least this many calls
AS_CALLED_MAX_CALLS = 10_000
AS_CALLED_REPEAT = 5       # median of this many as-called runs
HOST_BOUND = 1.10          # as called > 1.1 × GPU only: host-bound as called


@dataclass(frozen=True)
class Timing:
    """``ms``: median GPU milliseconds per call; ``host_us``: CPU microseconds of one
    asynchronous call; ``flushed``: L2 written over before each timed run; ``hidden``: the
    GPU was still busy with the spin when the last timed call had been issued (so the events
    hold GPU time only); ``ms_as_called``: median milliseconds per call of
    ``calls_as_called`` calls issued back to back with no spin in front (None: not
    measured)."""

    ms: float
    host_us: float
    flushed: bool
    hidden: bool
    ms_as_called: float | None = None
    calls_as_called: int = 0

    @property
    def effective_ms(self) -> float:
        """The slower of the GPU-only and the as-called time (the GPU-only one when the
        as-called time was not measured): what the figures that compare use."""
        return self.ms if self.ms_as_called is None else max(self.ms, self.ms_as_called)

    @property
    def host_bound(self) -> bool:
        """As called, more than ``HOST_BOUND`` × the GPU-only time."""
        return self.ms_as_called is not None and self.ms_as_called > HOST_BOUND * self.ms


def l2_bytes(torch) -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or L2_DEFAULT_BYTES)


def fits_in_l2(torch, *tensors) -> bool:
    """True when the tensors together fit in the L2 cache (then timed runs flush it)."""
    return sum(t.numel() * t.element_size() for t in tensors) <= l2_bytes(torch)


_flush_buffer = {}


def _flush(torch):
    dev = torch.cuda.current_device()
    if dev not in _flush_buffer:
        _flush_buffer[dev] = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    _flush_buffer[dev].zero_()


@functools.cache
def _cycles_per_us() -> float:
    """SM clock (the attribute is the peak clock, so a spin only ever lasts longer)."""
    from numba import cuda

    try:
        khz = cuda.get_current_device().CLOCK_RATE
    except Exception:  # noqa: BLE001 — attribute missing from a driver's enum
        khz = 0
    return (khz or 2_000_000) / 1000.0


def _gpu_spin(torch, us: float) -> bool:
    """Keep the GPU busy for about ``us`` µs on the current stream; False if unavailable."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return False
    sleep(int(us * _cycles_per_us()))
    return True


def host_us_per_call(torch, fn, calls: int = HOST_CALLS) -> float:
    """CPU microseconds of one asynchronous ``fn()`` call, issued while the GPU is busy (so
    no call waits for the GPU)."""
    _gpu_spin(torch, 20_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def as_called_calls(ms: float, host_us: float, inner: int = 1) -> int:
    """Calls per as-called run: enough to cover ``AS_CALLED_MIN_MS`` at the larger of the
    GPU time ``ms`` and the host cost ``host_us`` of one call, at least
    ``AS_CALLED_MIN_CALLS`` (and ``inner``), at most ``AS_CALLED_MAX_CALLS``."""
    per_call_ms = max(ms, host_us / 1e3, 1e-6)
    calls = max(math.ceil(AS_CALLED_MIN_MS / per_call_ms), AS_CALLED_MIN_CALLS, inner)
    return min(calls, max(AS_CALLED_MAX_CALLS, inner))


def as_called_ms(fn, calls: int, *, repeat: int = AS_CALLED_REPEAT, sync, before=None) -> float:
    """Median milliseconds per ``fn()`` as called: ``sync()`` (the GPU idle, nothing in
    front), CUDA events around ``calls`` calls issued back to back, ``repeat`` times;
    ``before()`` (an L2 flush) runs ahead of each run's ``sync``. Host cost the GPU waits for
    lands inside the events. Events and calls go on the legacy default stream."""
    from numba import cuda

    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        sync()
        start, stop = cuda.event(), cuda.event()
        start.record(0)
        for _ in range(calls):
            fn()
        stop.record(0)
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) / calls)
    return statistics.median(times)


def gpu_time(torch, fn, *, flush: bool = False, repeat: int = REPEAT, warmup: int = WARMUP,
             inner: int = 1, as_called: bool = True,
             as_called_repeat: int = AS_CALLED_REPEAT) -> Timing:
    """Median GPU milliseconds per ``fn()``: CUDA events around ``inner`` calls, ``repeat``
    times, after ``warmup`` calls (which also compile / autotune); then (``as_called``) the
    time per call as called, back to back with no spin in front (:func:`as_called_ms`,
    ``as_called_repeat`` runs of :func:`as_called_calls` calls). Events and calls go on the
    legacy default stream, PyTorch's, CuPy's and tilepy's default."""
    from numba import cuda

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    host_us = host_us_per_call(torch, fn)
    lead_us = min(2.0 * host_us * inner + 100.0, MAX_LEAD_US)
    times, all_hidden = [], True
    for _ in range(repeat):
        for _attempt in range(3):
            if flush:
                _flush(torch)
            spun = _gpu_spin(torch, lead_us)
            guard, start, stop = cuda.event(), cuda.event(), cuda.event()
            guard.record(0)
            start.record(0)
            for _ in range(inner):
                fn()
            stop.record(0)
            # The spin already over when the last call was issued: the GPU may have waited
            # for the CPU inside the events; try again with a longer spin.
            caught_up = spun and guard.query()
            stop.synchronize()
            if not caught_up:
                break
            # bounded: a call that waits for the GPU itself (a synchronous copy inside it)
            # catches up with any spin, and an unbounded lead grew 4x per attempt into
            # minutes-long spins (the bias + GELU benchmark on 2026-11-30)
            lead_us = min(lead_us * 4, MAX_LEAD_US)
        all_hidden = all_hidden and spun and not caught_up
        times.append(cuda.event_elapsed_time(start, stop) / inner)
    ms = statistics.median(times)
    if not as_called:
        return Timing(ms, host_us, flush, all_hidden)
    calls = as_called_calls(ms, host_us, inner)
    ms_called = as_called_ms(fn, calls, repeat=as_called_repeat, sync=torch.cuda.synchronize,
                             before=(lambda: _flush(torch)) if flush else None)
    return Timing(ms, host_us, flush, all_hidden, ms_called, calls)


_SIDE_STREAMS = {}


def capture_calls(torch, fn, calls: int = 20):
    """A CUDA graph of ``calls`` calls of ``fn``, captured after three warm-up calls on a side
    stream (PyTorch's recipe). One side stream per device for the process: tilepy keeps
    per-stream state (tile counters, split-K workspaces) for as long as a plan lives, so each
    new stream handle would add a set (PyTorch's pool hands out up to 32 per device and
    priority)."""
    dev = torch.cuda.current_device()
    side = _SIDE_STREAMS.get(dev)
    if side is None:
        side = _SIDE_STREAMS[dev] = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_ms(torch, fn, calls: int = 20, replays: int = 5) -> float:
    """Milliseconds per call of ``fn`` from CUDA-graph replays of ``calls`` calls (the GPU work
    only: no host cost inside the graph): events around one replay, median of ``replays``."""
    graph = capture_calls(torch, fn, calls)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return statistics.median(times)


def graph_timing(torch, fn, calls: int = 20) -> Timing:
    """A :class:`Timing` whose GPU-only time is :func:`graph_ms` of ``calls`` calls and whose
    as-called time and host cost are :func:`gpu_time`'s."""
    t = gpu_time(torch, fn, repeat=3)
    return Timing(graph_ms(torch, fn, calls), t.host_us, False, True, t.ms_as_called,
                  t.calls_as_called)


def poisoned_check(torch, run, out, want, tolerance=2e-2) -> float:
    """``out`` filled with NaN, ``run()`` (which writes it), then max |out - want| / max |want|
    in float32; AssertionError when it is not below ``tolerance`` (NaN never is)."""
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    err = max_rel_err(out, want)
    if not err < tolerance:
        raise AssertionError(f"relative error {err}")
    return err


def max_rel_err(got, want) -> float:
    """max |got - want| / max |want|, in float32."""
    g, w = got.float(), want.float()
    return ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()


def try_peer(notes: dict, name: str, run):
    """``run()`` (a peer's check + timing), or None when the peer fails; the failure goes into
    ``notes`` so that the results say why a peer is missing instead of the test failing."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 — a broken peer must not cost tilepy's figures
        notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None


def optional_module(name: str):
    """The module, or None when it cannot be imported (the peer is then left out)."""
    import importlib

    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 — ImportError, or a broken install raising anything
        return None


def max_abs_err(got, want) -> float:
    """max |got - want|, in float32."""
    return (got.float() - want.float()).abs().max().item()


def checked_timing(torch, run, want, tolerance, *, flush=False, err=max_rel_err) -> Timing:
    """A peer's timing after one check of its answer: ``run(out)`` writes into ``out`` (shaped
    like ``want``); AssertionError when ``err(out, want)`` is not below ``tolerance``."""
    out = torch.empty_like(want)
    run(out)
    torch.cuda.synchronize()
    e = err(out, want)
    if not e < tolerance:
        raise AssertionError(f"wrong answer: error {e:.3g} (tolerance {tolerance:.3g})")
    return gpu_time(torch, lambda: run(out), flush=flush)


def triton_peers():
    """bench/triton_peers.py, or ImportError when Triton cannot be imported."""
    if optional_module("triton") is None:
        raise ImportError("triton is not importable")
    import triton_peers as peers

    return peers


def _round(v):
    return None if v is None else round(float(v), 4)


def _sig(v, digits=5):
    """``v`` to ``digits`` significant digits (milliseconds of a few-µs kernel would lose
    most of theirs to a fixed number of decimals)."""
    return None if v is None else float(f"{float(v):.{digits}g}")


def record_throughput(record, *, work: float, unit: str, timings: dict, main: str,
                      ours: str = "tilepy", notes: dict | None = None, **info) -> None:
    """Record ``timings`` ({label: Timing or None}, ``ours`` first) as throughput figures.

    ``work``: FLOP (``unit="TFLOPS"``) or bytes moved (``unit="GB/s"``). ``main``: the peer
    of the ``ratio`` figure; every other peer gets its ratio in ``ratios``. ``info``: what
    identifies the case for tables and plots (``table``, ``case``, ``figure``, ``x``,
    ``xlabel``, ``dtype``, ...).

    Throughput and times are recorded GPU only (``impls``, ``ms_all``; ours: ``tflops`` /
    ``gbps``, ``ms``) and as called (``impls_as_called``, ``ms_as_called_all``; ours:
    ``tflops_as_called`` / ``gbps_as_called``, ``ms_as_called``). ``ratio`` / ``ratios``
    are ``peer_ms / ms`` of the effective times (each implementation's slower one,
    :attr:`Timing.effective_ms`); ``ratio_gpu`` / ``ratios_gpu`` of the GPU-only times.
    ``host_bound_as_called`` lists the implementations whose as-called time exceeds
    ``HOST_BOUND`` × their GPU-only time. The as-called keys are left out when no timing
    has an as-called time (``gpu_time(..., as_called=False)``).
    """
    scale = 1e9 if unit == "TFLOPS" else 1e6
    key = "tflops" if unit == "TFLOPS" else "gbps"

    def thr(ms):
        return None if ms is None else work / ms / scale

    me = timings[ours]
    peers = {k: t for k, t in timings.items() if k != ours}
    called = any(t is not None and t.ms_as_called is not None for t in timings.values())
    figures = dict(info)
    figures.update({
        "unit": unit, key: thr(me.ms), "ms": me.ms, "host_us": me.host_us,
        "impls": {k: _round(thr(t.ms)) if t else None for k, t in timings.items()},
        "ratios": {k: _round(t.effective_ms / me.effective_ms) if t else None
                   for k, t in peers.items()},
        "ratios_gpu": {k: _round(t.ms / me.ms) if t else None for k, t in peers.items()},
        "ms_all": {k: _sig(t.ms) if t else None for k, t in timings.items()},
        "host_us_all": {k: _round(t.host_us) for k, t in timings.items() if t},
        "flushed_l2": me.flushed,
        "host_hidden": all(t.hidden for t in timings.values() if t),
        "timing": f"CUDA events, median of {REPEAT} runs after {WARMUP} warm-up calls"
                  + (", L2 flushed before each" if me.flushed else ""),
    })
    if called:
        figures.update({
            f"{key}_as_called": thr(me.ms_as_called), "ms_as_called": me.ms_as_called,
            "impls_as_called": {k: _round(thr(t.ms_as_called)) if t else None
                                for k, t in timings.items()},
            "ms_as_called_all": {k: _sig(t.ms_as_called) if t else None
                                 for k, t in timings.items()},
            "calls_as_called": {k: t.calls_as_called for k, t in timings.items()
                                if t and t.ms_as_called is not None},
            "host_bound_as_called": [k for k, t in timings.items() if t and t.host_bound],
            "timing_as_called": (
                f"as called: CUDA events around back-to-back calls (enough for about "
                f"{AS_CALLED_MIN_MS:g} ms, at least {AS_CALLED_MIN_CALLS}) with no GPU spin "
                f"ahead, median of {AS_CALLED_REPEAT} runs"
                + (", L2 flushed before each run" if me.flushed else "")
                + "; ratio / ratios: each implementation's slower time"),
        })
    if timings.get(main) is not None:
        peer = timings[main]
        figures.update({"peer": main, f"peer_{key}": thr(peer.ms),
                        "ratio": peer.effective_ms / me.effective_ms,
                        "ratio_gpu": peer.ms / me.ms})
        if called:
            figures[f"peer_{key}_as_called"] = thr(peer.ms_as_called)
    if notes:
        figures["peer_errors"] = dict(notes)
    record(**{k: v for k, v in figures.items() if v is not None})
