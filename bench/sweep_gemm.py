"""Time the mma.sync GEMM kernel over a set of configs beside torch.matmul (one GPU run).

    python bench/sweep_gemm.py [N] [dtype] [--json FILE]

Prints one line per config (TFLOPS and ratio to cuBLAS in the same run); the best config per
shape is what the heuristic in tilepy.ops.gemm should pick. Kernel-level, like
bench/test_bench_gemm.py.
"""

import argparse
import json
import sys

import numpy as np


def configs():
    from tilepy.tile.config import BlockTile, GemmConfig, Pipeline, WarpLayout

    out = []
    for (bm, bn, bk), (wm, wn), st in [
        ((128, 128, 32), (2, 4), 3), ((128, 128, 32), (2, 4), 4), ((128, 128, 64), (2, 4), 3),
        ((128, 128, 64), (2, 2), 3), ((128, 256, 32), (2, 4), 3), ((128, 256, 32), (2, 4), 4),
        ((128, 256, 64), (2, 4), 3), ((256, 128, 32), (4, 2), 3), ((256, 128, 64), (4, 2), 3),
        ((128, 128, 32), (2, 2), 4), ((64, 128, 64), (2, 2), 4),
    ]:
        try:
            out.append(GemmConfig(BlockTile(bm, bn, bk), WarpLayout(wm, wn), Pipeline(st)))
        except ValueError as e:
            print("skip", (bm, bn, bk, wm, wn, st), e, file=sys.stderr)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("n", type=int, nargs="?", default=4096)
    p.add_argument("dtype", nargs="?", default="float16")
    p.add_argument("--json")
    p.add_argument("--variants", action="store_true",
                   help="for two configs, each of group_m in {1, 8} x double_buffer on/off x "
                        "late_issue on/off")
    args = p.parse_args()
    import torch
    from numba import cuda

    from tilepy.ops.gemm_mma_sync import gemm_kernel, grid, launch
    from tilepy.tile.config import GemmConfig

    n, dtype = args.n, args.dtype
    tdt = getattr(torch, dtype)
    a = torch.randn(n, n, device="cuda", dtype=tdt)
    b = torch.randn(n, n, device="cuda", dtype=tdt)
    out = torch.empty(n, n, device="cuda", dtype=tdt)
    ref = (a.float() @ b.float())
    bias = torch.zeros(1, device="cuda", dtype=torch.float32)
    dargs = [cuda.as_cuda_array(t.view(torch.int16)[None]).view(np.uint16) for t in (a, b, out)]
    dargs += [dargs[2], cuda.as_cuda_array(bias)]

    from tilepy.testing.timing import time_cuda

    def ms_of(fn, rep=20):
        return time_cuda(fn, repeat=rep)

    flop = 2 * n**3
    peer = ms_of(lambda: torch.matmul(a, b))
    rows = []
    print(f"N={n} {dtype}: torch.matmul {flop / peer / 1e9:.0f} TFLOPS")
    plan = [(c, 8, True, False) for c in configs()]
    if args.variants:
        picked = [configs()[0], configs()[9]]
        plan = [(c, g, d, late) for c in picked for g in (1, 8) for d in (False, True)
                for late in (False, True)]
    for cfg, group_m, dbuf, late in plan:
        cfg = GemmConfig(cfg.block, cfg.warps, cfg.pipeline, dtype)
        try:
            kern = gemm_kernel(cfg, True, dtype, group_m=group_m, double_buffer=dbuf,
                               late_issue=late)
            launch(kern, cfg, *dargs)
            torch.cuda.synchronize()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            configured = kern[grid(cfg, n, n), cfg.threads, 0, cfg.smem_bytes]
            alpha = np.float32(1)
            beta = np.float32(0)
            ms = ms_of(lambda: configured(*dargs, alpha, beta))
            row = {"config": cfg.describe(), "group_m": group_m, "double_buffer": dbuf,
                   "late_issue": late,
                   "tflops": flop / ms / 1e9,
                   "ratio": peer / ms, "err": err}
        except Exception as e:  # report and go on
            row = {"config": cfg.describe(), "error": f"{type(e).__name__}: {e}"[:200]}
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": n, "dtype": dtype, "peer_tflops": flop / peer / 1e9, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
