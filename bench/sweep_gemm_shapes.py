"""Time a few Hopper GEMM configs through the public op over the benchmark shapes (squares and
LLM projections), beside torch.matmul in the same run: which config ``gemm.hopper_config``
should pick for which shape.

    python bench/sweep_gemm_shapes.py [--json FILE] [--dtype float16] [--quick] [--cluster]
        [--configs NAME,NAME] [--rounds N]

Each config's result is checked against torch once per shape before it is timed; a config that
fails is recorded and the sweep goes on (one that kills the CUDA context ends it).
``--rounds N`` times every (shape, config) N times, the configs in turn within each round, and
reports medians (one-shot timings drift by several percent under the power cap).
``--cluster``: the clusters-of-two configs against their one-block twins (same registers).
"""
# ruff: noqa: B023  (closures are timed inside the iteration that makes them)

import argparse
import json

import numpy as np

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)] + [
    (m, n, k) for m in (4096, 16384)
    for n, k in ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))]


def candidates(dtype):
    from tilepy.ops.gemm_wgmma import WgmmaConfig
    from tilepy.ops.gemm_wgmma_ws import WsConfig

    return [("ws 128x256 s4", WsConfig(dtype=dtype)),
            ("ws 128x256 s4 persistent", WsConfig(dtype=dtype, persistent=True)),
            ("cp.async 128x256 s4 overlap", WgmmaConfig(128, 256, 4, dtype, overlap=True)),
            ("cp.async 256x128 s4 overlap", WgmmaConfig(256, 128, 4, dtype, overlap=True)),
            ("ws 128x192 s5", WsConfig(128, 192, 5, dtype)),
            # the shared-memory-staged epilogue (16-byte row stores); persistent needs its own
            # staging buffer, so 3 stages — the s3 persistent row without it is the baseline
            ("ws 128x256 s4 smem-epilogue", WsConfig(dtype=dtype, smem_epilogue=True)),
            ("ws 128x256 s3 persistent", WsConfig(stages=3, dtype=dtype, persistent=True)),
            ("ws 128x256 s3 persistent smem-epilogue",
             WsConfig(stages=3, dtype=dtype, persistent=True, smem_epilogue=True)),
            # the TMA-store epilogue: swizzled staging, stores draining under the next tile
            ("ws 128x256 s3 persistent tma-store",
             WsConfig(128, 256, 3, dtype, persistent=True, smem_epilogue=True, tma_store=True)),
            # ... staging 128 columns a pass (the tile in two), which leaves room for 4 stages
            ("ws 128x256 s4 persistent tma-store",
             WsConfig(128, 256, 4, dtype, persistent=True, smem_epilogue=True, tma_store=True)),
            ("ws 128x192 s4 persistent tma-store",
             WsConfig(128, 192, 4, dtype, persistent=True, smem_epilogue=True, tma_store=True)),
            # clusters of two sharing B by TMA multicast, and their one-block twins with the
            # same register split (the producer needs 56 with clusters)
            ("ws 128x256 s4 smem-epilogue regs56",
             WsConfig(dtype=dtype, smem_epilogue=True, producer_regs=56, consumer_regs=224)),
            ("ws 128x256 s4 smem-epilogue cluster2",
             WsConfig(dtype=dtype, smem_epilogue=True, cluster=2, producer_regs=56,
                      consumer_regs=224)),
            ("ws 128x256 s4 persistent tma-store cluster2",
             WsConfig(128, 256, 4, dtype, persistent=True, smem_epilogue=True, tma_store=True,
                      cluster=2, producer_regs=56, consumer_regs=224)),
            ("ws 256x128 s4 cluster2",
             WsConfig(256, 128, 4, dtype, cluster=2, producer_regs=56, consumer_regs=224))]


#: --quick: the square shapes, the default against the TMA-store epilogue configs
QUICK = ("ws 128x256 s4 smem-epilogue", "ws 128x256 s4 persistent tma-store")

#: --cluster: clusters of two against the configs they extend
CLUSTER = ("ws 128x256 s4 smem-epilogue", "ws 128x256 s4 smem-epilogue regs56",
           "ws 128x256 s4 smem-epilogue cluster2", "ws 128x256 s4 persistent tma-store",
           "ws 128x256 s4 persistent tma-store cluster2", "ws 256x128 s4 cluster2")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--quick", action="store_true",
                   help="4096^3 and 8192^3, the default and the TMA-store configs only")
    p.add_argument("--cluster", action="store_true",
                   help="the clusters-of-two configs and the ones they extend")
    p.add_argument("--configs", help="comma-separated candidate names to time (default: all, "
                   "or the --quick / --cluster ones)")
    p.add_argument("--rounds", type=int, default=1, help="timings per (shape, config), "
                   "interleaved; medians reported")
    args = p.parse_args()
    only = (set(args.configs.split(",")) if args.configs else set(CLUSTER) if args.cluster
            else set(QUICK) if args.quick else None)
    import torch
    from measure import poisoned_check

    import tilepy
    from tilepy.testing.timing import time_cuda

    tdt = getattr(torch, args.dtype)
    rows, errors = [], []
    # Clocks up first: a cold H200 idles at 345 MHz, and the first peer timed against it came
    # out 20% slow in the 2026-11-30 sweep (bench/NOTES.md).
    x = torch.randn(8192, 8192, device="cuda", dtype=tdt)
    time_cuda(lambda: torch.matmul(x, x), warmup=50, repeat=5)
    del x
    shapes = SHAPES[:2] if args.quick else SHAPES
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=tdt)
        b = torch.randn(k, n, device="cuda", dtype=tdt)
        out = torch.empty(m, n, device="cuda", dtype=tdt)
        flop = 2 * m * n * k
        ref = torch.matmul(a.float(), b.float())
        timings = {}   # config name -> ([ms], [peer ms], rel. error)
        failed = set()
        for rnd in range(args.rounds):
            for name, cfg in candidates(args.dtype):
                if only is not None and name not in only or name in failed:
                    continue
                # the peer timed next to every candidate: over a sweep the GPU's clocks drift
                # by ~10% (bench/NOTES.md, 2026-11-30), and a ratio must not carry that
                peer_ms = time_cuda(lambda: torch.matmul(a, b, out=out), warmup=3, repeat=10)
                try:
                    if rnd == 0:
                        err = poisoned_check(
                            torch, lambda: tilepy.gemm(a, b, out=out, config=cfg), out, ref)
                        timings[name] = ([], [], err)
                    ms = time_cuda(lambda: tilepy.gemm(a, b, out=out, config=cfg), warmup=3,
                                   repeat=10)
                except Exception as e:  # noqa: BLE001 - recorded; the sweep goes on
                    errors.append({"shape": [m, n, k], "config": name, "error": repr(e)})
                    print(f"{m}x{n}x{k} {name}: FAILED {e!r}", flush=True)
                    failed.add(name)
                    if "ILLEGAL" in repr(e) or "LAUNCH_FAILED" in repr(e):
                        raise SystemExit(1) from e
                    continue
                timings[name][0].append(ms)
                timings[name][1].append(peer_ms)
        for name, cfg in candidates(args.dtype):
            if name not in timings or name in failed:
                continue
            mss, peers, err = timings[name]
            ms, peer_ms = float(np.median(mss)), float(np.median(peers))
            row = {"shape": [m, n, k], "dtype": args.dtype, "config": name,
                   "describe": cfg.describe(), "tflops": flop / ms / 1e9, "ms": ms,
                   "peer": "torch.matmul (cuBLAS)", "peer_tflops": flop / peer_ms / 1e9,
                   "ratio": peer_ms / ms, "rel_err": err, "rounds": len(mss),
                   "ms_rounds": mss, "peer_ms_rounds": peers}
            rows.append(row)
            print(f"{m}x{n}x{k} {name}: {row['tflops']:.1f} TFLOPS {row['ratio']:.3f}x cuBLAS "
                  f"({row['peer_tflops']:.1f}), median of {len(mss)}", flush=True)
        del a, b, out, ref
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "errors": errors},
                      f, indent=1)
    best = {}
    for r in rows:
        key = tuple(r["shape"])
        if key not in best or r["ratio"] > best[key]["ratio"]:
            best[key] = r
    print("== best per shape ==")
    for key, r in best.items():
        print(f"{'x'.join(map(str, key))}: {r['config']} {r['ratio']:.3f}x")


if __name__ == "__main__":
    main()
