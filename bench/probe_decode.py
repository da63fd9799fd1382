"""The decoding kernel's configs and splits against a device copy: GPU-only microseconds and
GB/s of K and V (``measure.gpu_time``) of ``tilepy.flash_attention_with_kvcache`` for each
(block_n, stages) config and several ``num_splits`` (the built-in rule's choice for the
config, half and twice that, one split a sequence), the forward
kernel's one-block-per-query-head path (an AttentionConfig) for reference, blocks of one to four
warps (each warp its own run of the keys), 32 query heads over
8 KV heads, head_dim 128, bf16, one query row, every sequence at the capacity.

Usage: python bench/probe_decode.py [--json FILE] [--shapes 8x32768,1x131072,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

#: (block_n, stages, warps a block)
CONFIGS = [(32, 3, 1), (32, 4, 1), (32, 6, 1), (16, 4, 1), (16, 6, 1), (32, 3, 4), (16, 4, 4)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--shapes", default="8x32768,1x131072,64x4096,8x131072,64x32768")
    p.add_argument("--profile", action="store_true",
                   help="instead: the built-in call's kernels under torch.profiler (device "
                        "microseconds per kernel and the span of one call), per shape")
    args = p.parse_args(argv)
    if args.profile:
        return profile(args)

    import torch

    import tilepy
    from measure import gpu_time
    from tilepy.launch import sm_count
    from tilepy.ops.attention_decode_mma_sync import (DecodeConfig, choose_splits,
                                                      resident_splits)
    from tilepy.ops.attention_mma_sync import AttentionConfig

    hq, hk, d, dt = 32, 8, 128, torch.bfloat16
    sms = sm_count(132)
    rows = []
    for shape in args.shapes.split(","):
        b, cap = map(int, shape.split("x"))
        kc = torch.randn(b, cap, hk, d, device="cuda", dtype=dt)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=dt)
        lens = torch.full((b,), cap, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        nbytes = 2 * kc.numel() * 2
        src = torch.empty(min(nbytes, 2 << 30) // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t = gpu_time(torch, lambda: dst.copy_(src), as_called=False)
        copy_gbps = 2 * src.numel() / t.ms / 1e6
        del src, dst
        print(f"B{b} S{cap}: device copy {copy_gbps:.0f} GB/s", flush=True)
        want = tilepy.flash_attention_with_kvcache(q, kc, vc, lens).float()

        def add(name, cfg, splits):
            def run():
                tilepy.flash_attention_with_kvcache(q, kc, vc, lens, out=out, config=cfg,
                                                    num_splits=splits, check_seqlens=False)
            try:
                run()
                err = (out.float() - want).abs().max().item()
                t = gpu_time(torch, run)
            except Exception as e:  # noqa: BLE001 — a config that does not fit is a row too
                print(f"  {name:40s} failed: {type(e).__name__}: {e}", flush=True)
                rows.append(dict(batch=b, capacity=cap, name=name, error=str(e)))
                return
            gbps = nbytes / t.ms / 1e6
            rows.append(dict(batch=b, capacity=cap, name=name, gpu_us=t.ms * 1e3,
                             as_called_us=(t.ms_as_called or 0) * 1e3, gbps=gbps,
                             copy_gbps=copy_gbps, of_copy=gbps / copy_gbps, max_err=err))
            print(f"  {name:40s} {t.ms * 1e3:9.1f} µs  {gbps:6.0f} GB/s  "
                  f"{gbps / copy_gbps:5.2f}x copy  (as called {(t.ms_as_called or 0) * 1e3:.1f}"
                  f" µs, err {err:.1e})", flush=True)

        add("forward kernel (AttentionConfig 16x64)", AttentionConfig(d, 16, 64, 16, "bfloat16"),
            None)
        for bn, st, w in CONFIGS:
            cfg = DecodeConfig(d, bn, st, "bfloat16", warps=w)
            # the built-in choice, then half and twice as many splits, and one
            rule = choose_splits(b, hk, 1, -(-cap // bn), sms, resident_splits(cfg), w)
            for splits in dict.fromkeys((rule, max(w, rule // 2 // w * w), 2 * rule, w)):
                add(f"decode BN{bn} x{st} {w}w splits {splits}"
                    + (" (rule)" if splits == rule else ""), cfg, splits)
        del kc, vc
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


def profile(args):
    """Per shape: the built-in call (contiguous cache, one query row) run 20 times under
    torch.profiler; each kernel's mean device time, and the mean span from a call's first
    kernel start to its last kernel end (launch gaps included), against a device copy."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import tilepy
    from measure import gpu_time

    hq, hk, d, dt = 32, 8, 128, torch.bfloat16
    rows = []
    for shape in args.shapes.split(","):
        b, cap = map(int, shape.split("x"))
        kc = torch.randn(b, cap, hk, d, device="cuda", dtype=dt)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=dt)
        lens = torch.full((b,), cap, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        nbytes = 2 * kc.numel() * 2
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        # (a copy of nbytes / 2 reads and writes nbytes: the bytes the kernel reads)
        copy_us = gpu_time(torch, lambda: dst.copy_(src), as_called=False).ms * 1e3

        def run():
            tilepy.flash_attention_with_kvcache(q, kc, vc, lens, out=out, check_seqlens=False)

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                run()
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        per = {}
        for e in kernels:
            per.setdefault(e.name[:60], []).append(e.device_time)
        starts = sorted(kernels, key=lambda e: e.time_range.start)
        n = max(1, len(per))
        spans = [starts[i + n - 1].time_range.end - starts[i].time_range.start
                 for i in range(0, len(starts) - n + 1, n)]
        span = sum(spans) / max(len(spans), 1)
        print(f"B{b} S{cap}: {nbytes / 1e6:.0f} MB, device copy {copy_us:.1f} µs, one call "
              f"{span:.1f} µs from first kernel start to last kernel end", flush=True)
        for name, ts in per.items():
            print(f"  {name:60s} {sum(ts) / len(ts):8.1f} µs", flush=True)
        rows.append(dict(batch=b, capacity=cap, copy_us=copy_us, span_us=span,
                         kernels={k: sum(v) / len(v) for k, v in per.items()}))
        del kc, vc, src, dst
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(profile=rows), f, indent=1)


if __name__ == "__main__":
    main()
