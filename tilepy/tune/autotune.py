"""Autotuning: time each candidate config once per key, keep the fastest, remember it on disk.

```
tuned = autotune(launch, configs, key=lambda a, b: (a.shape, b.shape), op="my_gemm",
                 prune=lambda cfg, *args: cfg.smem_bytes <= limit, reference=check_fn)
tuned(a, b)            # first call for a key: times the candidates; later calls: cached choice
```

``launch(config, *args)`` runs the kernel with ``config`` (it must be callable repeatedly).
Candidates that raise (e.g. fail to compile) or whose output fails ``reference(config, *args)``
are skipped and reported, not fatal. Timing uses CUDA events (median of ``repeat`` after
``warmup``; wall clock in the simulator) unless a ``timer(fn, warmup, repeat) -> ms`` is given
(tests use a fake one); ``flops(*args)`` / ``nbytes(*args)`` add TFLOPS / GB/s columns to
the table. ``TILEPY_AUTOTUNE=0``
never tunes: the first config (the heuristic choice) is used. ``TILEPY_VERBOSE=0`` silences the
progress line and the result table.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, is_dataclass

from ..cache import TuneCache, current_gpu_name, make_key
from ..cache import autotune_enabled as _enabled


def _verbose() -> bool:
    return os.environ.get("TILEPY_VERBOSE", "1").strip() not in ("0", "false", "no")


def describe_config(cfg) -> str:
    if hasattr(cfg, "describe"):
        return cfg.describe()
    if is_dataclass(cfg):
        return json.dumps(asdict(cfg), default=str)
    return repr(cfg)


def _default_timer(fn, warmup, repeat):
    from numba import config

    if config.ENABLE_CUDASIM:  # no CUDA events there: wall clock (says nothing about a GPU)
        import statistics
        import time

        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    from ..testing.timing import time_cuda

    return time_cuda(fn, warmup=warmup, repeat=repeat)


class Tuned:
    def __init__(self, launch, configs, key, op, prune, reference, warmup, repeat, timer,
                 gpu_name, cache_directory, flops, table=True, nbytes=None):
        self.launch = launch
        self.configs = list(configs)
        if not self.configs:
            raise ValueError("autotune needs at least one config")
        self.key = key
        self.op = op
        self.prune = prune
        self.reference = reference
        self.warmup, self.repeat = warmup, repeat
        self.timer = timer
        self.gpu_name = gpu_name
        self.cache = TuneCache(op, cache_directory)
        self.flops = flops
        self.nbytes = nbytes
        self.table = table
        self.memory: dict = {}
        self.last_report: list = []

    def _cache_key(self, args):
        from .. import __version__

        shape, dtype = self.key(*args)
        return make_key(self.op, shape, dtype, self.gpu_name(), __version__)

    def choose(self, *args):
        """The config to use for these arguments (tuning first if need be)."""
        if not _enabled():
            return self.configs[0]
        k = self._cache_key(args)
        if k in self.memory:
            return self.memory[k]
        stored = self.cache.get(k)
        if stored is not None:
            idx = stored.get("index")
            if isinstance(idx, int) and 0 <= idx < len(self.configs) and \
                    stored.get("config") == describe_config(self.configs[idx]):
                self.memory[k] = self.configs[idx]
                return self.configs[idx]
        best = self.tune(*args)
        self.memory[k] = self.configs[best["index"]]
        self.cache.put(k, best)
        return self.configs[best["index"]]

    def tune(self, *args) -> dict:
        rows, best = [], None
        candidates = [(i, c) for i, c in enumerate(self.configs)
                      if self.prune is None or self.prune(c, *args)]
        if not candidates:
            raise ValueError(f"{self.op}: the prune function rejected every config")
        for n, (i, cfg) in enumerate(candidates):
            if _verbose():
                print(f"\rtilepy tune {self.op}: {n + 1}/{len(candidates)} "
                      f"{describe_config(cfg)[:60]}", end="", file=sys.stderr, flush=True)
            row = {"index": i, "config": describe_config(cfg)}
            try:
                ms = self.timer(lambda cfg=cfg: self.launch(cfg, *args), self.warmup,
                                self.repeat)
                if self.reference is not None and not self.reference(cfg, *args):
                    row["skipped"] = "wrong answer"
                else:
                    row["ms"] = ms
                    if self.flops is not None:
                        row["tflops"] = self.flops(*args) / ms / 1e9
                    if self.nbytes is not None:
                        row["gbps"] = self.nbytes(*args) / ms / 1e6
            except Exception as e:  # noqa: BLE001 - a failing candidate is reported, not fatal
                row["skipped"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            if "ms" in row and (best is None or row["ms"] < best["ms"]):
                best = row
        self.last_report = rows
        if _verbose():
            print(file=sys.stderr)
            if self.table:
                print(format_report(self.op, rows, best), file=sys.stderr)
        if best is None:
            raise RuntimeError(f"{self.op}: every candidate config failed: " +
                               "; ".join(f"{r['config']}: {r['skipped']}" for r in rows))
        return best

    def __call__(self, *args):
        return self.launch(self.choose(*args), *args)


def format_report(op, rows, best) -> str:
    lines = [f"tilepy tune {op}:"]
    for r in rows:
        mark = "*" if best is not None and r["index"] == best["index"] else " "
        if "ms" in r:
            extra = f"  {r['tflops']:.0f} TFLOPS" if "tflops" in r else ""
            if "gbps" in r:
                extra += f"  {r['gbps']:.0f} GB/s"
            if "first_call_s" in r:
                extra += f"  (first call {r['first_call_s']:.1f} s)"
            lines.append(f" {mark} {r['ms']:9.4f} ms{extra}  {r['config']}")
        else:
            lines.append(f"   {'skipped':>12}  {r['config']}  ({r['skipped']})")
    return "\n".join(lines)


def autotune(launch, configs, *, key, op, prune=None, reference=None, warmup=3, repeat=20,
             timer=None, gpu_name=None, cache_directory=None, flops=None,
             table=True, nbytes=None) -> Tuned:
    """Wrap ``launch(config, *args)`` so each call runs the best config for its key.

    ``key(*args) -> (shape tuple, dtype str)`` decides which calls share a choice (shapes are
    bucketed to powers of two). See the module docstring for the rest.
    """
    if timer is None:
        timer = _default_timer
    if gpu_name is None:
        gpu_name = current_gpu_name
    return Tuned(launch, configs, key, op, prune, reference, warmup, repeat, timer, gpu_name,
                 cache_directory, flops, table, nbytes)
