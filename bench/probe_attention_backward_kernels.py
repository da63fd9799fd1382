"""Probe: where tilepy.flash_attention_backward's time goes — each of its launches (rows
pre-pass, dK / dV kernel, dQ kernel or conversion) timed on its own, for several configs of
each kernel, so that the dK / dV and dQ kernels' configs can be chosen separately. GPU time
only (CUDA events around 10 back-to-back launches of one plan, median of 5, after a warm-up).

    python bench/probe_attention_backward_kernels.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def time_plan(torch, bound, ptrs, reps=10, rounds=5):
    stream = torch.cuda.current_stream().cuda_stream
    bound(stream, ptrs)
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            bound(stream, ptrs)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    import torch

    import tilepy
    from tilepy.ops import attention_backward as ab
    from tilepy.ops.attention_backward_wgmma import WgmmaBackwardConfig as W

    grids = {128: [W(128, key_groups=1, dq_groups=2, dq_block_n=128),
                   W(128, key_groups=1, dq_groups=1, dq_block_n=64),
                   W(128, key_groups=1, dq_groups=1, dq_block_n=128),
                   W(128, key_groups=2, dq_groups=2, dq_block_n=64),
                   W(128, block_m=32, key_groups=1, dq_groups=2, dq_block_n=128)],
             64: [W(64, key_groups=1, dq_groups=1, dq_block_n=64),
                  W(64, key_groups=1, dq_groups=1, dq_block_n=128),
                  W(64, block_m=128, key_groups=1, dq_groups=2, dq_block_n=128),
                  W(64, block_m=128, key_groups=2, dq_groups=2, dq_block_n=64),
                  W(64, key_groups=2, dq_groups=2, dq_block_n=128)]}
    rows = []
    for b, h, s, d in ((4, 32, 4096, 128), (8, 16, 2048, 64)):
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                           for _ in range(4))
            out, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True)
            dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)   # one forward's worth
            for cfg in grids[d]:
                row = dict(b=b, h=h, s=s, d=d, causal=causal, config=cfg.describe())
                try:
                    ab._PLANS.clear()
                    ab.flash_attention_backward(do, q, k, v, out, lse, causal=causal, dq=dq,
                                                dk=dk, dv=dv, config=cfg)
                    (bound, _, makers), = ab._PLANS.values()
                    ptrs = [x.data_ptr() for x in (do, q, k, v, out, lse, dq, dk, dv)] + [0]
                    keep = [m() for _, m in makers]
                    ptrs += [p for _, p in keep]
                    names = ("prepass", "dkdv", "dq")
                    row["ms"] = {n: time_plan(torch, bp, ptrs) for n, bp in zip(names, bound)}
                    # the GEMM work of each: dK/dV 4 products, dQ 3 (2 of them recomputed)
                    row["tflops"] = {"dkdv": 2 * flops / row["ms"]["dkdv"] / 1e9,
                                     "dq": 1.5 * flops / row["ms"]["dq"] / 1e9}
                    del keep
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
            del q, k, v, do, out, lse, dq, dk, dv
            torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                   "tflops": "per kernel: dK/dV 2 x the forward's 4BHS^2D (halved causal), "
                             "dQ 1.5 x"}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
