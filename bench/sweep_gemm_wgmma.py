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


def check(torch, cuda, bias, mod, kernel_fn, cfg, shape, dt, b_row):
    """Max relative error of ``kernel_fn(cfg, b_row, dt)`` (launched through ``mod.plan``) on
    fresh (m, k) @ (k, n) inputs, B row-major or a transposed (n, k) array, against float64."""
    m, n, k = shape
    tdt = getattr(torch, dt)
    a = torch.randn(m, k, device="cuda", dtype=tdt)
    bk = torch.randn(k, n, device="cuda", dtype=tdt) if b_row else \
        torch.randn(n, k, device="cuda", dtype=tdt)
    b = bk if b_row else bk.t()
    out = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
    va, vb, vo = views(torch, cuda, a, bk, out)
    plan, kargs = mod.plan(kernel_fn(cfg, b_row, dt), cfg, va, vb, vo, vo, bias)
    plan.launch(0, kargs)
    torch.cuda.synchronize()
    ref = a.double() @ b.double()
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def squares(torch, cuda, time_cuda):
    """(size, flop, cuBLAS ms, (a, b, out) views) for the square fp16 problems."""
    for size in (4096, 8192):
        a = torch.randn(size, size, device="cuda", dtype=torch.float16)
        b = torch.randn(size, size, device="cuda", dtype=torch.float16)
        out = torch.empty(size, size, device="cuda", dtype=torch.float16)
        peer_ms = time_cuda(lambda: torch.matmul(a, b), warmup=3, repeat=10)
        yield size, 2 * size**3, peer_ms, views(torch, cuda, a, b, out)


def time_config(torch, mod, kernel_fn, cfg, va, vb, vo, bias, time_cuda):
    """Median ms of the fp16 kernel ``kernel_fn(cfg, True, "float16")`` on the given views."""
    plan, kargs = mod.plan(kernel_fn(cfg, True, "float16"), cfg, va, vb, vo, vo, bias)
    ms = time_cuda(lambda: plan.launch(0, kargs), warmup=3, repeat=10)
    torch.cuda.synchronize()
    return ms


def add_row(rows, size, cfg, flop, ms, peer_ms):
    row = {"n": size, "config": cfg.describe(), "tflops": flop / ms / 1e9,
           "peer": "torch.matmul (cuBLAS)", "peer_tflops": flop / peer_ms / 1e9,
           "ratio": peer_ms / ms}
    rows.append(row)
    print(f"{size}^3 {cfg.describe()}: {row['tflops']:.1f} TFLOPS, "
          f"{row['ratio']:.3f}x cuBLAS ({row['peer_tflops']:.1f})", flush=True)


def _fatal(e) -> bool:
    """The CUDA context is gone: nothing later in this process can run."""
    return "ILLEGAL" in repr(e) or "LAUNCH_FAILED" in repr(e)


def ws_checks(torch, cuda, bias, checks, errors):
    from tilepy.ops import gemm_wgmma_ws as ws

    for cfg_kw in WS_CONFIGS[:3]:
        for (m, n, k), dt, b_row in WS_CHECKS:
            try:
                cfg = ws.WsConfig(dtype=dt, **cfg_kw)
                err = check(torch, cuda, bias, ws, ws.wgmma_ws_gemm_kernel, cfg, (m, n, k),
                            dt, b_row)
            except Exception as e:  # noqa: BLE001 - recorded; the sweep goes on
                errors.append({"what": f"check {cfg_kw} {m}x{n}x{k} {dt} b_row={b_row}",
                               "error": repr(e)})
                print(f"ws check {cfg_kw} {m}x{n}x{k}: FAILED {e!r}", flush=True)
                if _fatal(e):
                    return False
                continue
            checks.append({"kernel": "wgmma_ws", "config": cfg.describe(), "shape": [m, n, k],
                           "dtype": dt, "b_row_major": b_row, "rel_err": err})
            print(f"ws check {cfg.describe()} {m}x{n}x{k} {dt} b_row={b_row}: rel err "
                  f"{err:.2e}", flush=True)
    return True


def ws_rows(torch, cuda, bias, rows, errors, time_cuda):
    from tilepy.ops import gemm_wgmma_ws as ws

    for size, flop, peer_ms, (va, vb, vo) in squares(torch, cuda, time_cuda):
        for cfg_kw in WS_CONFIGS:
            try:
                cfg = ws.WsConfig(**cfg_kw)
                ms = time_config(torch, ws, ws.wgmma_ws_gemm_kernel, cfg, va, vb, vo, bias,
                                 time_cuda)
            except Exception as e:  # noqa: BLE001 - recorded; the sweep goes on
                errors.append({"what": f"time {cfg_kw} {size}^3", "error": repr(e)})
                print(f"ws {size}^3 {cfg_kw}: FAILED {e!r}", flush=True)
                if _fatal(e):
                    return
                continue
            add_row(rows, size, cfg, flop, ms, peer_ms)


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
    for shape, dt, b_row, ov in [((1000, 1064, 520), "float16", True, False),
                                 ((777, 3000, 1032), "bfloat16", True, False),
                                 ((1000, 1064, 520), "float16", False, False),
                                 ((4096, 4096, 4096), "float16", True, False),
                                 ((777, 3000, 1032), "bfloat16", True, True),
                                 ((4096, 4096, 4096), "float16", False, True)]:
        err = check(torch, cuda, bias, gw, gw.wgmma_gemm_kernel,
                    gw.WgmmaConfig(dtype=dt, overlap=ov), shape, dt, b_row)
        checks.append({"shape": list(shape), "dtype": dt, "b_row_major": b_row, "overlap": ov,
                       "rel_err": err})
        print(f"check {'x'.join(map(str, shape))} {dt} b_row={b_row} overlap={ov}: rel err "
              f"{err:.2e}", flush=True)
    for size, flop, peer_ms, (va, vb, vo) in squares(torch, cuda, time_cuda):
        for bm, bn, st, ov in [(128, 256, 4, False), (256, 128, 4, False),
                               (128, 256, 4, True), (256, 128, 4, True), (128, 128, 6, True),
                               (128, 128, 4, False)]:
            cfg = gw.WgmmaConfig(bm, bn, st, overlap=ov)
            ms = time_config(torch, gw, gw.wgmma_gemm_kernel, cfg, va, vb, vo, bias, time_cuda)
            add_row(rows, size, cfg, flop, ms, peer_ms)
    ws_errors = []
    if not args.skip_ws and ws_checks(torch, cuda, bias, checks, ws_errors):
        ws_rows(torch, cuda, bias, rows, ws_errors, time_cuda)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "checks": checks, "rows": rows,
                       "ws_errors": ws_errors}, f, indent=1)


if __name__ == "__main__":
    main()
