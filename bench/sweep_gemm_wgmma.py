"""Time the Hopper (wgmma) GEMM kernel over a few configs beside torch.matmul (one GPU run),
after checking it against torch at odd shapes; then the same for the warp-specialised TMA
kernel (gemm_wgmma_ws), whose failures are recorded without stopping the sweep.

    python bench/sweep_gemm_wgmma.py [--json FILE] [--skip-ws]
"""
# ruff: noqa: B023  (closures are timed inside the iteration that makes them)

import argparse
import json

import numpy as np


def views(torch, cuda, *ts):
    return [cuda.as_cuda_array(t.view(torch.int16)[None]).view(np.uint16) for t in ts]


# The warp-specialised TMA kernel (tilepy/ops/gemm_wgmma_ws.py), checked and timed after the
# configs above; a failure there is recorded and printed, and the rest of the sweep stands.
WS_CHECKS = [((1000, 1064, 520), "float16", True), ((777, 3000, 1032), "bfloat16", True),
             ((1000, 1064, 520), "float16", False), ((70, 100, 258), "float16", True),
             ((4096, 4096, 4096), "float16", True), ((4096, 4096, 4096), "float16", False)]
WS_CONFIGS = [{}, {"block_m": 256, "block_n": 128}, {"persistent": True},
              {"block_m": 256, "block_n": 128, "persistent": True}, {"stages": 3},
              {"producer_regs": 0, "consumer_regs": 0}]


def ws_checks(torch, cuda, bias, checks, errors):
    from tilepy.ops import gemm_wgmma_ws as ws

    for cfg_kw in WS_CONFIGS[:3]:
        for (m, n, k), dt, b_row in WS_CHECKS:
            try:
                tdt = getattr(torch, dt)
                cfg = ws.WsConfig(dtype=dt, **cfg_kw)
                a = torch.randn(m, k, device="cuda", dtype=tdt)
                bk = torch.randn(k, n, device="cuda", dtype=tdt) if b_row else \
                    torch.randn(n, k, device="cuda", dtype=tdt)
                b = bk if b_row else bk.t()
                out = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
                kern = ws.wgmma_ws_gemm_kernel(cfg, b_row, dt)
                va, vb, vo = views(torch, cuda, a, bk, out)
                plan, kargs = ws.plan(kern, cfg, va, vb, vo, vo, bias)
                plan.launch(0, kargs)
                torch.cuda.synchronize()
                ref = a.double() @ b.double()
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            except Exception as e:  # noqa: BLE001 - recorded; the sweep goes on
                errors.append({"what": f"check {cfg_kw} {m}x{n}x{k} {dt} b_row={b_row}",
                               "error": repr(e)})
                print(f"ws check {cfg_kw} {m}x{n}x{k}: FAILED {e!r}", flush=True)
                if "ILLEGAL" in repr(e) or "LAUNCH_FAILED" in repr(e):
                    return False   # the context is gone: nothing later can run
                continue
            checks.append({"kernel": "wgmma_ws", "config": cfg.describe(), "shape": [m, n, k],
                           "dtype": dt, "b_row_major": b_row, "rel_err": err})
            print(f"ws check {cfg.describe()} {m}x{n}x{k} {dt} b_row={b_row}: rel err "
                  f"{err:.2e}", flush=True)
    return True


def ws_rows(torch, cuda, bias, rows, errors, time_cuda):
    from tilepy.ops import gemm_wgmma_ws as ws

    for size in (4096, 8192):
        a = torch.randn(size, size, device="cuda", dtype=torch.float16)
        b = torch.randn(size, size, device="cuda", dtype=torch.float16)
        out = torch.empty(size, size, device="cuda", dtype=torch.float16)
        flop = 2 * size**3
        peer_ms = time_cuda(lambda: torch.matmul(a, b), warmup=3, repeat=10)
        va, vb, vo = views(torch, cuda, a, b, out)
        for cfg_kw in WS_CONFIGS:
            try:
                cfg = ws.WsConfig(**cfg_kw)
                kern = ws.wgmma_ws_gemm_kernel(cfg, True, "float16")
                plan, kargs = ws.plan(kern, cfg, va, vb, vo, vo, bias)
                ms = time_cuda(lambda: plan.launch(0, kargs), warmup=3, repeat=10)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - recorded; the sweep goes on
                errors.append({"what": f"time {cfg_kw} {size}^3", "error": repr(e)})
                print(f"ws {size}^3 {cfg_kw}: FAILED {e!r}", flush=True)
                if "ILLEGAL" in repr(e) or "LAUNCH_FAILED" in repr(e):
                    return
                continue
            row = {"n": size, "config": cfg.describe(), "tflops": flop / ms / 1e9,
                   "peer": "torch.matmul (cuBLAS)", "peer_tflops": flop / peer_ms / 1e9,
                   "ratio": peer_ms / ms}
            rows.append(row)
            print(f"{size}^3 {cfg.describe()}: {row['tflops']:.1f} TFLOPS, "
                  f"{row['ratio']:.3f}x cuBLAS ({row['peer_tflops']:.1f})", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--skip-ws", action="store_true",
                   help="leave out the warp-specialised TMA kernel (gemm_wgmma_ws)")
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
    ws_errors = []
    if not args.skip_ws and ws_checks(torch, cuda, bias, checks, ws_errors):
        ws_rows(torch, cuda, bias, rows, ws_errors, time_cuda)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "checks": checks, "rows": rows,
                       "ws_errors": ws_errors}, f, indent=1)


if __name__ == "__main__":
    main()
