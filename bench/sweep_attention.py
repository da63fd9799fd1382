# ruff: noqa: B023, C408  (closures are called inside the loop iteration that makes them)
"""Time tilepy.flash_attention over a set of kernel configs beside PyTorch SDPA's
FlashAttention-2 backend (one GPU run).

    python bench/sweep_attention.py [--json FILE] [--quick | --grid] [--kernels wgmma]

``--grid``: the benchmark shapes of issue 7 (B4 H32 S1024…8192 D128, B8 H16 S2048 D64),
causal and not, the Hopper configs only and of those the ones that were ever best (which
default ``choose_config`` should take per shape).

Prints one line per (shape, causal, config): TFLOPS and the ratio to SDPA FA2 timed in the
same run; the best config per head_dim is what ``tilepy.ops.attention.choose_config`` should
pick. Each tilepy result is checked against SDPA once before timing.
"""

import argparse
import dataclasses
import itertools
import json
import statistics
import sys


def configs(d, dtype, kernels=("mma_sync", "wgmma")):
    from tilepy.ops.attention_mma_sync import AttentionConfig

    # Offline sm_90 compiles (2026-11-29): at head_dim 128, warp_rows 32 and (64, 128, 16)
    # spill under 255 registers, so they are left out there.
    shapes = [(128, 64, 16), (128, 128, 16), (64, 64, 16), (128, 32, 16), (192, 64, 16)]
    if d <= 64:
        shapes += [(64, 128, 16), (128, 64, 32), (256, 64, 32)]
    if "mma_sync" not in kernels:
        shapes = []
    out = []
    for bm, bn, wr in shapes:
        try:
            out.append(AttentionConfig(d, bm, bn, wr, dtype))
        except ValueError as e:
            print("skip", (d, bm, bn, wr), e, file=sys.stderr)
    # the Hopper kernel (tilepy/ops/attention_wgmma.py): block_m x block_n, one warpgroup per
    # 64 query rows
    from tilepy.ops.attention_wgmma import WgmmaAttentionConfig

    # overlap=True: the softmax of key block j+1 beside the P·V wgmmas of block j (FA3's
    # intra-warpgroup pipelining); it fits without spills only where OVERLAP_FITS says
    # (d128 x 128-key blocks spill), so it is timed at 128 x 64 and, for d64, 128 x 128
    # (block_m, block_n, overlap, persistent); persistent: one block per SM slot walking the
    # tiles, the next tile's Q, K and V loaded during the last key block
    wg = [(128, 128, False, False), (128, 64, False, False), (64, 128, False, False),
          (128, 64, True, False), (128, 128, True, False), (128, 128, False, True),
          (128, 128, True, True)]
    if d <= 64:
        wg = [(128, 64, False, False), (128, 64, True, False), (128, 128, True, False),
              (128, 64, False, True), (128, 128, True, True)]
    for bm, bn, overlap, persistent in wg if "wgmma" in kernels else []:
        try:
            out.append(WgmmaAttentionConfig(d, bm, bn, dtype, overlap=overlap,
                                            persistent=persistent))
        except ValueError as e:
            print("skip wgmma", (d, bm, bn, overlap), e, file=sys.stderr)
    return out


#: The config switches a row records (False where a config type lacks one).
FLAGS = ("overlap", "persistent", "tma", "pingpong", "producer")


def tag_of(cfg, b, h, s, d, causal, hkv=None) -> str:
    wr = getattr(cfg, "warp_rows", 64)   # the wgmma kernel: a warpgroup per 64 rows
    heads = f"H{h}" + (f" Hkv{hkv}" if hkv not in (None, h) else "")
    return (f"B{b} {heads} S{s} D{d} causal={causal} bm={cfg.block_m} bn={cfg.block_n} "
            f"wr={wr}"
            + (" wgmma" if wr == 64 else "")
            + "".join(f" {f}" for f in FLAGS if getattr(cfg, f, False)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="one shape per head_dim, not causal")
    p.add_argument("--grid", action="store_true",
                   help="every benchmark shape, the competitive Hopper configs only")
    p.add_argument("--tma-ab", action="store_true",
                   help="the --grid shapes, only the built-in Hopper config and its TMA twin")
    p.add_argument("--schedule-ab", action="store_true",
                   help="the --grid shapes, the built-in TMA config with and without ping-pong "
                        "and a producer warpgroup")
    p.add_argument("--persistent-ab", action="store_true",
                   help="the --grid shapes, the built-in TMA config and its persistent twin "
                        "(needs its producer warpgroup)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the configs of a shape this many times, in turn (A, B, A, B, "
                        "…), and report each one's median: an A/B less at the mercy of clock "
                        "drift")
    p.add_argument("--variants-ab", action="store_true",
                   help="the --grid shapes, the built-in config against persistent TMA "
                        "variants (ping-pong on and off; at head_dim 64 also 128-row and "
                        "64-key tiles)")
    p.add_argument("--wide-ab", action="store_true",
                   help="head dims 96, 192 and 256 (B4 H16 S4096): the built-in TMA config "
                        "against other key-block sizes, ping-pong on and off")
    p.add_argument("--short-ab", action="store_true",
                   help="issue 25's short-sequence shapes (B16 H16 S512 D64, B4 H32 S1024 "
                        "D128, B8 H16 S2048 D64, GQA 32/8 S4096 D128): the built-in config "
                        "against other tile shapes (64-row ones of one warpgroup too), grid "
                        "and persistent, ping-pong on and "
                        "off; the peer is SDPA's cuDNN backend")
    p.add_argument("--causal-only", action="store_true", help="only the causal cases")
    p.add_argument("--head-dim", type=int, help="only the shapes of this head_dim")
    p.add_argument("--seq", type=int, help="only the shapes of this sequence length")
    p.add_argument("--block-m", type=int,
                   help="--schedule-ab: the built-in config and only those of this block_m")
    p.add_argument("--kernels", default="mma_sync,wgmma",
                   help="comma-separated: which kernels' configs to time (mma_sync, wgmma)")
    args = p.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tilepy
    from tilepy.ops.attention import choose_config  # the built-in configs the A/Bs start from
    from tilepy.testing.timing import time_cuda

    # (batch, heads_q, heads_kv, seq, head_dim)
    shapes = [(4, 32, 32, 4096, 128), (8, 16, 16, 2048, 64)]
    if args.grid or args.tma_ab or args.schedule_ab or args.persistent_ab or args.variants_ab:
        shapes = ([(4, 32, 32, s, 128) for s in (1024, 2048, 4096, 8192)]
                  + [(8, 16, 16, 2048, 64)])
    if args.wide_ab:
        shapes = [(4, 16, 16, 4096, d) for d in (96, 192, 256)]
    if args.short_ab:
        shapes = [(16, 16, 16, 512, 64), (4, 32, 32, 1024, 128), (8, 16, 16, 2048, 64),
                  (4, 32, 8, 4096, 128)]
    if args.head_dim:
        shapes = [sh for sh in shapes if sh[4] == args.head_dim]
    if args.seq:
        shapes = [sh for sh in shapes if sh[3] == args.seq]
    rows = []
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    time_cuda(lambda: torch.matmul(warm, warm), warmup=50, repeat=5)  # clocks up first
    peer_name = "SDPA cuDNN" if args.short_ab else "SDPA FA2"
    peer_backend = SDPBackend.CUDNN_ATTENTION if args.short_ab else SDPBackend.FLASH_ATTENTION
    for b, h, hkv, s, d in shapes:
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16)
                for _ in range(2))
        gqa = {"enable_gqa": True} if hkv != h else {}
        for causal in ((False,) if args.quick else (True,) if args.causal_only
                       else (False, True)):
            flop = 4 * b * h * s * s * d * (0.5 if causal else 1.0)

            def fa2():
                with sdpa_kernel(peer_backend):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal, **gqa)

            want = fa2()
            cfgs = configs(d, "float16", args.kernels.split(","))
            builtin = choose_config(d, "float16", causal)
            # the built-in config as a grid kernel with cp.async loads (at most two consumer
            # warpgroups): the A/Bs' starting point; the built-in ones are TMA-fed, 192-row at
            # d64 and some persistent since sessions 8 and 10, which the A/Bs' own replacements
            # of them no longer passed validation for
            plain = None if args.wide_ab else dataclasses.replace(
                builtin, block_m=min(builtin.block_m, 128), tma=False, pingpong=False,
                producer=False, persistent=False)
            if args.wide_ab:
                # the key blocks whose two stages fit beside Q (OVERLAP_FITS), ping-pong on
                # and off
                from tilepy.ops.attention_wgmma import OVERLAP_FITS

                cfgs = [builtin]
                for bn in sorted(n for t, n in OVERLAP_FITS if t == builtin.tile_dim):
                    for pp in (True, False):
                        for persistent in (False, True):
                            try:
                                cfgs.append(dataclasses.replace(
                                    builtin, block_n=bn, pingpong=pp, persistent=persistent))
                            except ValueError:        # (the persistent kernel's fits)
                                pass
                cfgs = list(dict.fromkeys(cfgs))
            elif args.short_ab:
                # tile shapes of the head dim's class, grid and persistent, ping-pong on
                # and off (configs whose kernel does not fit are left out)
                shapes_mn = (((128, 128), (192, 128), (128, 64)) if d == 64
                             else ((128, 128), (128, 64)))
                cfgs = [builtin]
                for (bm, bn), pp, persistent in itertools.product(
                        shapes_mn, (False, True), (False, True)):
                    try:
                        cfgs.append(dataclasses.replace(builtin, block_m=bm, block_n=bn,
                                                        pingpong=pp, persistent=persistent))
                    except ValueError:
                        pass
                # one consumer warpgroup of 64 rows (the TMA loads from its own thread: no
                # producer warpgroup), small enough for two or three blocks an SM, whose
                # prologues and epilogues then overlap each other's main loops
                for bn, persistent in itertools.product((64, 128), (False, True)):
                    try:
                        cfgs.append(dataclasses.replace(
                            builtin, block_m=64, block_n=bn, pingpong=False, producer=False,
                            persistent=persistent))
                    except ValueError:
                        pass
                cfgs = list(dict.fromkeys(cfgs))
            elif args.tma_ab:
                base = dataclasses.replace(plain, overlap=True)
                cfgs = [builtin, base, dataclasses.replace(base, tma=True)]
                cfgs = list(dict.fromkeys(cfgs))      # the built-in one may be `base`
            elif args.persistent_ab:
                # the built-in config's grid and persistent forms, whichever is the default
                cfgs = [dataclasses.replace(builtin, persistent=False),
                        dataclasses.replace(builtin, persistent=True)]
            elif args.variants_ab:
                base = dataclasses.replace(builtin, overlap=True, tma=True, producer=True,
                                           persistent=True)
                shapes_mn = ((128, 128), (192, 128), (192, 64)) if d == 64 else ((128, 128),)
                cfgs = list(dict.fromkeys(
                    [builtin]
                    + [dataclasses.replace(base, block_m=bm, block_n=bn, pingpong=pp)
                       for bm, bn in shapes_mn for pp in (False, True)]))
            elif args.schedule_ab:
                base = dataclasses.replace(plain, overlap=True, tma=True)
                # d64 also with 128-key blocks (FlashAttention-3's d64 tile is 192 x 128)
                cfgs = list(dict.fromkeys(
                    [builtin]
                    + [dataclasses.replace(base, block_m=128, block_n=bn, pingpong=pp,
                                           producer=pr)
                       for bn in ((64, 128) if d == 64 else (base.block_n,))
                       for pp in (False, True) for pr in (False, True)]
                    # three consumer warpgroups (FlashAttention-3's d64 tile is 192 x 128)
                    + [dataclasses.replace(base, block_m=192, block_n=bn, pingpong=pp,
                                           producer=True)
                       for bn in ((64, 128) if d == 64 else ()) for pp in (False, True)]))
                if args.block_m:
                    cfgs = cfgs[:1] + [c for c in cfgs[1:] if c.block_m == args.block_m]
            elif args.grid:
                # d128 64-key blocks lost to 128-key ones everywhere in s7a's grid
                cfgs = [c for c in cfgs if c.block_m == 128 and getattr(c, "warp_rows", 64) == 64
                        and not (c.head_dim == 128 and c.block_n == 64)]
            runs = {}                                  # config -> [(ms, peer_ms)]
            errs = {}
            for _ in range(max(1, args.rounds)):
                for cfg in cfgs:
                    if cfg in errs and errs[cfg] is None:
                        continue                       # failed in an earlier round
                    # the peer timed next to every config: clocks drift over a sweep (NOTES.md)
                    peer_ms = time_cuda(fa2, warmup=2, repeat=10)
                    try:
                        out = torch.empty_like(q)
                        tilepy.flash_attention(q, k, v, causal=causal, config=cfg, out=out)
                        torch.cuda.synchronize()
                        errs[cfg] = (out.float() - want.float()).abs().max().item()
                        ms = time_cuda(lambda: tilepy.flash_attention(
                            q, k, v, causal=causal, config=cfg, out=out), warmup=2, repeat=10)
                    except Exception as e:  # noqa: BLE001
                        print(f"{tag_of(cfg, b, h, s, d, causal, hkv)}: FAILED "
                              f"{type(e).__name__}: {e}", flush=True)
                        errs[cfg] = None
                        continue
                    runs.setdefault(cfg, []).append((ms, peer_ms))
            for cfg in cfgs:
                if cfg not in runs:
                    continue
                ms = statistics.median(m for m, _ in runs[cfg])
                peer_ms = statistics.median(pm for _, pm in runs[cfg])
                row = dict(b=b, h=h, hkv=hkv, s=s, d=d, causal=causal,
                           builtin=cfg == builtin, block_m=cfg.block_m,
                           block_n=cfg.block_n, warp_rows=getattr(cfg, "warp_rows", 64),
                           kernel=type(cfg).__name__,
                           **{f: getattr(cfg, f, False) for f in FLAGS},
                           ms=ms, runs_ms=[m for m, _ in runs[cfg]],
                           tflops=flop / ms / 1e9, peer=peer_name, peer_ms=peer_ms,
                           ratio=peer_ms / ms, max_abs_err=errs[cfg])
                rows.append(row)
                spread = (f" (rounds {min(row['runs_ms']) * 1e3:.0f}-"
                          f"{max(row['runs_ms']) * 1e3:.0f} us)" if len(runs[cfg]) > 1 else "")
                print(f"{tag_of(cfg, b, h, s, d, causal, hkv)}: {row['tflops']:6.1f} TFLOPS  "
                      f"{row['ratio']:.3f}x {peer_name} (err {errs[cfg]:.1e}){spread}"
                      + (" [built-in]" if row["builtin"] else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
