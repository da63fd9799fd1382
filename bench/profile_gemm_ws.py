"""A few launches of the Hopper GEMM configs and of cuBLAS (torch.matmul) at one square shape,
between cudaProfilerStart/Stop, for Nsight Compute (``PROFILE=gemm_ws bench/profile_attention.sh
OUTDIR [args]`` runs it under ncu): where each kernel's time goes against cuBLAS's.

    python bench/profile_gemm_ws.py [--n 4096] [--dtype float16] [--configs NAME,NAME]

Config names as in bench/sweep_gemm_shapes.py (default: the op's default, the persistent
TMA-store epilogue, and the same with clusters of two).
"""

import argparse

DEFAULT = ("ws 128x256 s4 smem-epilogue", "ws 128x256 s4 persistent tma-store",
           "ws 128x256 s4 persistent tma-store cluster2")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--configs", default=",".join(DEFAULT))
    args = p.parse_args()
    import torch
    from sweep_gemm_shapes import candidates

    import tilepy

    tdt = getattr(torch, args.dtype)
    n = args.n
    a = torch.randn(n, n, device="cuda", dtype=tdt)
    b = torch.randn(n, n, device="cuda", dtype=tdt)
    out = torch.empty(n, n, device="cuda", dtype=tdt)
    cands = dict(candidates(args.dtype))
    chosen = [(name, cands[name]) for name in args.configs.split(",")]
    for _ in range(20):   # compile, warm the clocks
        for _, cfg in chosen:
            tilepy.gemm(a, b, out=out, config=cfg)
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, cfg in chosen:
        tilepy.gemm(a, b, out=out, config=cfg)
        print(f"profiled {name}: {cfg.describe()}", flush=True)
    torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"then cuBLAS, {n}^3 {args.dtype}", flush=True)


if __name__ == "__main__":
    main()
