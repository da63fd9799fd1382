"""Probe: tilepy.flash_attention_backward's configs against SDPA's backward (cuDNN and
FlashAttention-2 backends), one process, GPU time only (CUDA events, median of 10 after a
warm-up; no L2 flush: the inputs are hundreds of MB). Checks each config's gradients against
SDPA's (float32 from the same inputs) first. A probe for choosing configs, not the benchmark
(``bench/test_bench_attention_backward.py``).

    python bench/probe_attention_backward.py --json OUT.json [--quick] [--head-dim D]
        [--configs I,J]   (indices into the head_dim's grid of configs;
        past 128, the built-in choice and the split-column wgmma kernel) [--causal 0|1]
        [--order-ab]      (each config with heavy_first on, off, on, off)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def timed(torch, fn, repeat=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--head-dim", type=int, help="only the shapes of this head_dim")
    ap.add_argument("--configs", help="comma-separated indices into the head_dim's grid")
    ap.add_argument("--causal", choices=("0", "1"), help="only the full (0) or causal (1) "
                    "shapes")
    ap.add_argument("--order-ab", action="store_true", help="each wgmma config twice with "
                    "heavy_first on and off, alternating (A, B, A, B): the causal key blocks' "
                    "order")
    args = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import tilepy
    from tilepy.ops.attention_backward_wgmma import WgmmaBackwardConfig

    shapes = [(4, 32, 4096, 128, False), (4, 32, 4096, 128, True), (8, 16, 2048, 64, False),
              (8, 16, 2048, 64, True), (4, 16, 4096, 256, False), (4, 16, 4096, 256, True),
              (4, 16, 4096, 192, False)]
    if args.quick:
        shapes = shapes[:1] + shapes[2:3]
    if args.head_dim:
        shapes = [x for x in shapes if x[3] == args.head_dim]
    if args.causal is not None:
        shapes = [x for x in shapes if x[4] == (args.causal == "1")]
    ws = WgmmaBackwardConfig
    # the built-in two-kernel configs, then the warp-specialised kernel (dQ by bulk
    # reductions from a producer + 2 consumer warpgroup block)
    grids = {128: [ws(128, block_m=64, key_groups=1, dq_groups=1, dq_block_n=64),
                   ws(128, block_m=64, key_groups=2, dq_atomic=True, producer=True),
                   ws(128, block_m=64, key_groups=2, dq_atomic=True, producer=True,
                      dq_own_keys=True)],
             64: [ws(64, block_m=128, key_groups=1, dq_groups=1, dq_block_n=64),
                  ws(64, block_m=64, key_groups=2, dq_atomic=True, producer=True)]}
    # past 128: the built-in choice (None), then the wgmma kernel with its columns split
    # between the consumers
    for d in {x[3] for x in shapes} - set(grids):
        grids[d] = [None] + [ws(d, key_groups=1, dq_atomic=True, producer=True,
                                split_columns=True, query_halves=h) for h in (False, True)]
    if args.configs:
        pick = [int(i) for i in args.configs.split(",")]
        grids = {d: [g[i] for i in pick if i < len(g)] for d, g in grids.items()}
    if args.order_ab:
        import dataclasses

        grids = {d: [x for c in g if c is not None
                     for x in (c, dataclasses.replace(c, heavy_first=False)) * 2]
                 for d, g in grids.items()}
    rows = []
    for shape in shapes:
        rows += one_shape(torch, tilepy, sdpa, sdpa_kernel, SDPBackend, grids,
                          *shape)
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                   "flops": "2.5 * 4 * B * H * S^2 * D (halved causal)"}, f, indent=1)
    return 0 if all("error" not in r and not r.get("nan") for r in rows) else 1


def one_shape(torch, tilepy, sdpa, sdpa_kernel, SDPBackend, grids, b, h, s, d,
              causal):
    rows = []
    if True:
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                       for _ in range(4))
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        out, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True)
        peers = {}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("fa2", SDPBackend.FLASH_ATTENTION)):
            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            try:
                with sdpa_kernel(backend):
                    o = sdpa(qq, kk, vv, is_causal=causal)
                    ms = timed(torch, lambda: torch.autograd.grad(o, (qq, kk, vv), do,
                                                                  retain_graph=True))
                peers[name] = ms
            except Exception as e:  # noqa: BLE001
                peers[name] = f"refused: {type(e).__name__}: {str(e)[:100]}"
        qq, kk, vv = (x.detach().float().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.MATH):
            o = sdpa(qq, kk, vv, is_causal=causal)
        ref = torch.autograd.grad(o, (qq, kk, vv), do.float())
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        for cfg in grids[d]:   # the default call (deterministic=False)
            row = dict(b=b, h=h, s=s, d=d, causal=causal,
                       config=cfg.describe() if cfg is not None else "built-in",
                       deterministic=False, peers_ms=peers)
            try:
                def run():
                    tilepy.flash_attention_backward(do, q, k, v, out, lse, causal=causal,
                                                    dq=dq, dk=dk, dv=dv, config=cfg)
                run()
                torch.cuda.synchronize()
                row["err"] = [float((g.float() - r).abs().max() / r.abs().max())
                              for g, r in zip((dq, dk, dv), ref)]
                row["nan"] = any(bool(torch.isnan(g).any()) for g in (dq, dk, dv))
                ms = timed(torch, run)
                row.update(ms=ms, tflops=flops / ms / 1e9,
                           ratio_cudnn=(peers["cudnn"] / ms
                                        if isinstance(peers["cudnn"], float) else None),
                           ratio_fa2=(peers["fa2"] / ms
                                      if isinstance(peers["fa2"], float) else None))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
