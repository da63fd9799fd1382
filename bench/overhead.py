"""Host-side cost of one op call on tiny inputs (µs per call; the GPU is not the bottleneck).

Usage: python bench/overhead.py [--json FILE] [--profile]
Times tilepy.gemm / softmax / flash_attention next to torch.matmul, cupy.matmul and
torch.softmax in the same run: CPU time per asynchronous call, averaged over many calls after
a warm-up (the queue is drained every 200 calls so it never fills). ``--profile`` prints the
top of a cProfile of tilepy.gemm's calls (where the host time goes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def per_call_us(fn, sync, calls=2000, warmup=50):
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for i in range(calls):
        fn()
        if i % 200 == 199:
            sync()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)

    import torch

    import tilepy

    sync = torch.cuda.synchronize
    rows = []

    def add(name, fn, peer=False):
        us = per_call_us(fn, sync, args.calls)
        rows.append({"name": name, "us_per_call": round(us, 2), "peer": peer})
        print(f"{name:48s} {us:8.1f} µs/call", flush=True)

    a = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    out = torch.empty(64, 64, device="cuda", dtype=torch.float16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
    add("torch.matmul 64x64x64 f16", lambda: torch.matmul(a, b), True)
    add("torch.softmax 64x256 f16", lambda: torch.softmax(x, -1), True)
    add("torch SDPA 1x2x64x64 f16",
        lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), True)
    try:
        import cupy

        ca, cb = cupy.asarray(a), cupy.asarray(b)
        add("cupy.matmul 64x64x64 f16", lambda: cupy.matmul(ca, cb), True)
    except Exception as e:  # noqa: BLE001
        print("cupy unavailable:", e)
        ca = cb = None
    add("tilepy.gemm 64x64x64 f16 (torch)", lambda: tilepy.gemm(a, b))
    add("tilepy.gemm 64x64x64 f16 (torch, out=)", lambda: tilepy.gemm(a, b, out=out))
    if ca is not None:
        add("tilepy.gemm 64x64x64 f16 (cupy)", lambda: tilepy.gemm(ca, cb))
    add("tilepy.softmax 64x256 f16 (torch)", lambda: tilepy.softmax(x))
    add("tilepy.flash_attention 1x2x64x64 f16 (torch)", lambda: tilepy.flash_attention(q, q, q))

    if args.profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(500):
            tilepy.gemm(a, b)
        sync()
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(35)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
