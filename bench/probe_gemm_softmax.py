"""Where gemm_softmax's fused Hopper kernel stands against its pieces: GPU-only milliseconds
(``measure.gpu_time``) of tilepy.gemm alone, tilepy.softmax alone (in place on the GEMM's
output), the pair, and the fused kernel in each softmax-mode config that fits (block_n 128
with the overlapped schedule, 256 without; 2–4 stages), at M = 16384, K = 1024, N = 1024 and
4096, float16.

Usage: python bench/probe_gemm_softmax.py [--json FILE] [--n 1024,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--n", default="1024,4096")
    args = p.parse_args(argv)

    import torch

    import tilepy
    from measure import gpu_time
    from tilepy.ops.gemm_softmax_wgmma import check_softmax_config
    from tilepy.ops.gemm_wgmma_ws import WsConfig

    m, k, scale = 16384, 1024, 0.05
    rows = []
    for n in map(int, args.n.split(",")):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        tmp = torch.empty_like(out)
        want = torch.softmax(scale * (a.float() @ b.float()), -1)
        flop = 2 * m * n * k

        def add(name, fn, **info):
            t = gpu_time(torch, fn)
            ms = max(t.ms, t.ms_as_called or 0.0)
            row = dict(n=n, name=name, gpu_ms=t.ms, as_called_ms=t.ms_as_called,
                       tflops=flop / ms / 1e9, **info)
            rows.append(row)
            print(f"N={n:5d} {name:44s} {t.ms * 1e3:8.1f} µs GPU  "
                  f"{(t.ms_as_called or 0) * 1e3:8.1f} as called  {row['tflops']:6.1f} TFLOPS",
                  flush=True)
            return ms

        gemm_ms = add("tilepy.gemm alone", lambda: tilepy.gemm(a, b, alpha=scale, out=tmp))
        soft_ms = add("tilepy.softmax alone (in place)", lambda: tilepy.softmax(tmp, out=tmp))

        def pair():
            tilepy.gemm(a, b, alpha=scale, out=tmp)
            tilepy.softmax(tmp, out=tmp)

        pair_ms = add("tilepy gemm + softmax", pair)
        add("tilepy.gemm_softmax (built-in config)",
            lambda: tilepy.gemm_softmax(a, b, scale=scale, out=out), pair_ms=pair_ms)
        for bn in (128, 256):
            for stages in (2, 3, 4):
                try:   # a config whose stages and buffers do not fit is skipped
                    cfg = WsConfig(128, bn, stages, "float16", persistent=True,
                                   smem_epilogue=True)
                    check_softmax_config(cfg, "float16")
                except ValueError:
                    continue
                try:
                    tilepy.gemm_softmax(a, b, scale=scale, out=out, config=cfg)
                except (ValueError, NotImplementedError) as e:
                    print(f"N={n} {cfg.describe()}: {e}")
                    continue
                err = (out.float() - want).abs().max().item()
                assert err < 2e-2, (cfg, err)
                sched = ", overlapped" if bn == 128 and stages >= 3 else ""
                add(f"gemm_softmax block_n {bn}, {stages} stages{sched}",
                    lambda cfg=cfg: tilepy.gemm_softmax(a, b, scale=scale, out=out, config=cfg),
                    pair_ms=pair_ms, gemm_ms=gemm_ms, softmax_ms=soft_ms, max_abs_err=err,
                    config=cfg.describe())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "m": m, "k": k, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
