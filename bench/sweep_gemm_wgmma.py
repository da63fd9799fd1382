"""Time the Hopper (wgmma) GEMM kernel over a few configs beside torch.matmul (one GPU run),
after checking it against torch at odd shapes.

    python bench/sweep_gemm_wgmma.py [--json FILE]
"""
# ruff: noqa: B023  (closures are timed inside the iteration that makes them)

import argparse
import json

import numpy as np


def views(torch, cuda, *ts):
    return [cuda.as_cuda_array(t.view(torch.int16)[None]).view(np.uint16) for t in ts]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    import torch
    from numba import cuda

    from tilepy.ops import gemm_wgmma as gw
    from tilepy.testing.timing import time_cuda

    bias = cuda.as_cuda_array(torch.zeros(1, device="cuda"))
    rows, checks = [], []
    # correctness at odd shapes, both B layouts, f16 and bf16
    for (m, n, k), dt, b_row, ov in [((1000, 1064, 520), "float16", True, False),
                                     ((777, 3000, 1032), "bfloat16", True, False),
                                     ((1000, 1064, 520), "float16", False, False),
                                     ((4096, 4096, 4096), "float16", True, False),
                                     ((777, 3000, 1032), "bfloat16", True, True),
                                     ((4096, 4096, 4096), "float16", False, True)]:
        tdt = getattr(torch, dt)
        a = torch.randn(m, k, device="cuda", dtype=tdt)
        if b_row:
            b = torch.randn(k, n, device="cuda", dtype=tdt)
            bk = b
        else:
            bk = torch.randn(n, k, device="cuda", dtype=tdt)
            b = bk.t()
        out = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
        cfg = gw.WgmmaConfig(dtype=dt, overlap=ov)
        kern = gw.wgmma_gemm_kernel(cfg, b_row, dt)
        va, vb, vo = views(torch, cuda, a, bk, out)
        plan, kargs = gw.plan(kern, cfg, va, vb, vo, vo, bias)
        plan.launch(0, kargs)
        torch.cuda.synchronize()
        ref = a.double() @ b.double()
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        checks.append({"shape": [m, n, k], "dtype": dt, "b_row_major": b_row, "overlap": ov,
                       "rel_err": err})
        print(f"check {m}x{n}x{k} {dt} b_row={b_row} overlap={ov}: rel err {err:.2e}",
              flush=True)
    for size in (4096, 8192):
        a = torch.randn(size, size, device="cuda", dtype=torch.float16)
        b = torch.randn(size, size, device="cuda", dtype=torch.float16)
        out = torch.empty(size, size, device="cuda", dtype=torch.float16)
        flop = 2 * size**3
        peer_ms = time_cuda(lambda: torch.matmul(a, b), warmup=3, repeat=10)
        va, vb, vo = views(torch, cuda, a, b, out)
        for bm, bn, st, ov in [(128, 256, 4, False), (256, 128, 4, False),
                               (128, 256, 4, True), (256, 128, 4, True), (128, 128, 6, True),
                               (128, 128, 4, False)]:
            cfg = gw.WgmmaConfig(bm, bn, st, overlap=ov)
            kern = gw.wgmma_gemm_kernel(cfg, True, "float16")
            plan, kargs = gw.plan(kern, cfg, va, vb, vo, vo, bias)
            ms = time_cuda(lambda: plan.launch(0, kargs), warmup=3, repeat=10)
            torch.cuda.synchronize()
            row = {"n": size, "config": cfg.describe(), "tflops": flop / ms / 1e9,
                   "peer": "torch.matmul (cuBLAS)", "peer_tflops": flop / peer_ms / 1e9,
                   "ratio": peer_ms / ms}
            rows.append(row)
            print(f"{size}^3 {cfg.describe()}: {row['tflops']:.1f} TFLOPS, "
                  f"{row['ratio']:.3f}x cuBLAS ({row['peer_tflops']:.1f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "checks": checks, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
