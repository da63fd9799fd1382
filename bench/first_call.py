"""The first call of each op in a fresh process: with an empty tilepy cache, then a warm one.

    python bench/first_call.py [--json FILE] [--ops gemm,gemm_tma,...] [--cache-dir DIR]

For each op, two child processes share one ``TILEPY_CACHE_DIR`` (a new empty directory unless
``--cache-dir``): the first compiles (cold), the second should load the compiled kernels from
the disk cache (warm; issue 8's goal: under 0.5 s). Each child makes its inputs first
(PyTorch, else CuPy, else Numba device arrays; not timed), then times ``import tilepy``, the
first call + synchronize, and a second call + synchronize. ``NUMBA_DEBUG_CACHE=1`` in the
children makes Numba report every kernel it saves to or loads from the disk cache; the table
counts them. Needs a GPU.

    gemm       tilepy.gemm            1024 x 1024 x 1024  float16
    gemm_tma   tilepy.gemm            4096 x 4096 x 4096  float16 (sm_90: the TMA kernel)
    gemm_bias_gelu  the same with bias + GELU (the slowest kernel to compile)
    softmax    tilepy.softmax         4096 x 4096         float16
    attention  tilepy.flash_attention 1 x 8 x 1024 x 64   float16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPS = {
    "gemm": ("tilepy.gemm 1024x1024x1024 fp16", [(1024, 1024), (1024, 1024)],
             "tilepy.gemm(*xs)"),
    # the sm_90 TMA kernel (128x256 tiles), plain and with its slowest-compiling epilogue
    "gemm_tma": ("tilepy.gemm 4096x4096x4096 fp16", [(4096, 4096), (4096, 4096)],
                 "tilepy.gemm(*xs)"),
    "gemm_bias_gelu": ("tilepy.gemm 4096^3 fp16 + bias + gelu",
                       [(4096, 4096), (4096, 4096), (4096,)],
                       "tilepy.gemm(xs[0], xs[1], bias=xs[2], activation='gelu')"),
    "softmax": ("tilepy.softmax 4096x4096 fp16", [(4096, 4096)], "tilepy.softmax(*xs)"),
    "attention": ("tilepy.flash_attention 1x8x1024x64 fp16", [(1, 8, 1024, 64)] * 3,
                  "tilepy.flash_attention(*xs)"),
}

CHILD = r"""
import json, sys, time
shapes = json.loads(sys.argv[1])
expr = sys.argv[2]
import numpy as np
host = [np.random.default_rng(i).standard_normal(s).astype(np.float16) for i, s in
        enumerate(shapes)]
lib, xs, sync = None, None, None
try:
    import torch
    if torch.cuda.is_available():
        lib, xs = "torch", [torch.from_numpy(h).cuda() for h in host]
        sync = torch.cuda.synchronize
        sync()
except ImportError:
    pass
if lib is None:
    try:
        import cupy
        lib, xs = "cupy", [cupy.asarray(h) for h in host]
        sync = cupy.cuda.Device().synchronize
        sync()
    except ImportError:
        pass
t0 = time.perf_counter()
import tilepy
t1 = time.perf_counter()
if tilepy.SIMULATOR:
    sys.exit("no GPU: this benchmark measures compilation, which the simulator does not do")
if lib is None:
    from numba import cuda
    lib, xs, sync = "numba", [cuda.to_device(h) for h in host], cuda.synchronize
    sync()
    t1b = time.perf_counter()
else:
    t1b = t1
r = eval(expr)
sync()
t2 = time.perf_counter()
r = eval(expr)
sync()
t3 = time.perf_counter()
from numba import cuda
from tilepy import kcache
name = cuda.get_current_device().name
print("FIRST_CALL " + json.dumps({
    "tilepy": tilepy.__version__, "gpu": name.decode() if isinstance(name, bytes) else name,
    "array_lib": lib, "import_s": t1 - t0, "first_call_s": t2 - t1b,
    "import_plus_first_call_s": (t1 - t0) + (t2 - t1b), "second_call_s": t3 - t2,
    "kernel_cache": kcache.kernel_cache_dir() if kcache.enabled() else None}))
"""


def run_child(op: str, cache_dir: str, kernel_cache: bool) -> dict:
    _, shapes, expr = OPS[op]
    env = dict(os.environ, TILEPY_CACHE_DIR=cache_dir, NUMBA_DEBUG_CACHE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TILEPY_KERNEL_CACHE", None)
    if not kernel_cache:
        env["TILEPY_KERNEL_CACHE"] = "0"
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shapes), expr],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
                          check=False)
    wall = time.perf_counter() - t
    lines = proc.stdout.splitlines()
    found = [ln for ln in lines if ln.startswith("FIRST_CALL ")]
    if proc.returncode != 0 or not found:
        return {"error": (proc.stderr or proc.stdout).strip()[-2000:], "process_s": wall}
    row = json.loads(found[-1][len("FIRST_CALL "):])
    row["process_s"] = wall
    row["kernels_saved"] = sum("data saved to" in ln for ln in lines)
    row["kernels_loaded"] = sum("data loaded from" in ln for ln in lines)
    return row


def fmt(row: dict, key: str) -> str:
    return f"{row[key]:7.2f}" if key in row else "      -"


def table(rows) -> str:
    head = (f"{'op':<40} {'':5} {'import':>7} {'1st call':>8} {'sum':>7} {'2nd call':>8} "
            f"{'process':>7}  kernels saved/loaded")
    out = [head, "-" * len(head)]
    for r in rows:
        for phase in ("cold", "warm"):
            x = r[phase]
            if "error" in x:
                out.append(f"{r['label']:<40} {phase:5} ERROR: {x['error'].splitlines()[-1]}")
                continue
            out.append(f"{r['label'] if phase == 'cold' else '':<40} {phase:5} "
                       f"{fmt(x, 'import_s')} {x['first_call_s']:8.2f} "
                       f"{fmt(x, 'import_plus_first_call_s')} {x['second_call_s'] * 1e3:6.1f}ms "
                       f"{fmt(x, 'process_s')}  {x['kernels_saved']}/{x['kernels_loaded']}")
    out.append("(seconds; 'sum' = import tilepy + first call incl. synchronize; goal for warm: "
               "< 0.5 s)")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--ops", default="gemm,gemm_tma,gemm_bias_gelu,softmax,attention",
                   help="comma-separated subset of " + ", ".join(OPS))
    p.add_argument("--cache-dir", help="use (and keep) this cache directory; it should be "
                   "empty for the cold row to mean anything")
    p.add_argument("--no-kernel-cache", action="store_true",
                   help="TILEPY_KERNEL_CACHE=0 in the children (both rows compile)")
    args = p.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in OPS:
            p.error(f"unknown op {o!r}; choose from {', '.join(OPS)}")
    rows = []
    for op in ops:
        cache_dir = args.cache_dir or tempfile.mkdtemp(prefix=f"tilepy-first-call-{op}-")
        try:
            cold = run_child(op, cache_dir, not args.no_kernel_cache)
            warm = run_child(op, cache_dir, not args.no_kernel_cache)
        finally:
            if not args.cache_dir:
                shutil.rmtree(cache_dir, ignore_errors=True)
        rows.append({"op": op, "label": OPS[op][0], "cold": cold, "warm": warm})
        print(f"{op}: cold {cold.get('import_plus_first_call_s', float('nan')):.2f} s, warm "
              f"{warm.get('import_plus_first_call_s', float('nan')):.2f} s", file=sys.stderr)
    print(table(rows))
    if args.json:
        done = [r[ph] for r in rows for ph in ("cold", "warm") if "gpu" in r[ph]]
        with open(args.json, "w") as f:
            json.dump({"gpu": done[0]["gpu"] if done else None,
                       "tilepy": done[0]["tilepy"] if done else None,
                       "python": sys.version.split()[0], "kernel_cache": not args.no_kernel_cache,
                       "rows": rows}, f, indent=1)
    failed = any("error" in r[ph] for r in rows for ph in ("cold", "warm"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
