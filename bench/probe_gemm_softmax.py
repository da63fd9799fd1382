"""Where the TMA gemm_softmax kernel's time goes: the softmax mode with pieces left out
(``gemm_softmax_wgmma_kernel(..., probe=mask)``: 1 the per-chunk online softmax, 2 the final
rescale, 4 the per-chunk parked store), beside ``tilepy.gemm`` and ``tilepy.softmax`` alone and
the unfused pair, all in one process, float16, M = 16384, K = 1024; for both ways the kernel
writes ``out`` (``tma_out``: TMA stores from swizzled staging, the rescale through shared
memory; without: 16-byte stores by the threads, the rescale in global memory).

    python bench/probe_gemm_softmax.py [--n 1024 4096] [--config 128,256,3] [--json FILE]

The full kernel (mask 0) is checked against torch before anything is timed; the variants
with pieces left out compute wrong results by design and are only timed.
"""

import argparse
import json

VARIANTS = [  # (name, probe mask)
    ("full", 0),
    ("no rescale", 2),
    ("no rescale, no softmax (GEMM + park)", 3),
    ("no rescale, no store (GEMM + softmax math)", 6),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--config", default="128,256,3", help="block_m,block_n,stages")
    p.add_argument("--overlap-stages", default="4,5",
                   help="stage counts of the 128-column overlap kernel to time beside it")
    p.add_argument("--json")
    args = p.parse_args()
    import torch

    import tilepy
    from tilepy import arrays
    from tilepy.arrays import describe, kernel_view
    from tilepy.ops import gemm_softmax_wgmma as gsw
    from tilepy.ops import gemm_wgmma_ws as ws
    from tilepy.testing.timing import time_cuda

    bm, bn, st = (int(x) for x in args.config.split(","))
    cfg = ws.WsConfig(bm, bn, st, "float16", persistent=True, smem_epilogue=True)
    m, k = args.m, args.k
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    time_cuda(lambda: torch.matmul(x, x), warmup=50, repeat=5)  # clocks up first
    rows = []
    for n in args.n:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        tmp = torch.empty(m, n, device="cuda", dtype=torch.float16)
        scale = 1.0 / k ** 0.5
        want = torch.softmax(scale * (a.float() @ b.float()), -1)
        flop = 2 * m * n * k
        A, B, O = describe(a, "a"), describe(b, "b"), describe(out, "out")
        handle = arrays.stream_handle(A)
        out_v = kernel_view(O, 3)

        def launcher(mask, tma_out, c=cfg, overlap=False):
            kern = gsw.gemm_softmax_wgmma_kernel(c, True, "float16", tma_out=tma_out,
                                                 overlap=overlap, probe=mask)
            plan, kargs = ws.plan(kern, c, kernel_view(A, 3), kernel_view(B, 3), out_v, out_v,
                                  arrays.placeholder(1), scale, 0.0, stream=handle)
            return lambda: plan.launch(handle, kargs)

        overlaps = [ws.WsConfig(128, 128, int(st), "float16", persistent=True,
                                smem_epilogue=True) for st in args.overlap_stages.split(",") if st]

        checks = [launcher(0, t) for t in (False, True)]
        checks += [launcher(0, True, c, True) for c in overlaps]
        for i, run in enumerate(checks):
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            err = (out.float() - want).abs().max().item()
            if not err < 2e-3:
                raise SystemExit(f"N={n} kernel {i}: wrong, max abs error {err}")

        def unfused():
            tilepy.gemm(a, b, alpha=scale, out=tmp)
            tilepy.softmax(tmp, out=tmp)

        peers = {"tilepy.gemm": lambda: tilepy.gemm(a, b, alpha=scale, out=tmp),
                 "tilepy.softmax": lambda: tilepy.softmax(tmp, out=tmp),
                 "gemm + softmax (unfused)": unfused}
        timed = [(name, fn) for name, fn in peers.items()]
        timed += [(f"fused{' tma_out' if t else ''}: {name}", launcher(mask, t))
                  for t in (False, True) for name, mask in VARIANTS]
        timed += [(f"fused overlap 128x128 s{c.stages}: {name}", launcher(mask, True, c, True))
                  for c in overlaps for name, mask in VARIANTS[:2]]
        for name, fn in timed:
            ms = time_cuda(fn, warmup=5, repeat=15, inner=10)
            row = {"n": n, "variant": name, "us": round(ms * 1e3, 2),
                   "tflops": round(flop / ms / 1e9, 1)}
            rows.append(row)
            print(f"N={n:5d} {name:52s} {row['us']:8.1f} us {row['tflops']:7.1f} TFLOPS",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg.describe(), "m": m, "k": k, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
