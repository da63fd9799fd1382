"""Time warp-specialised GEMM configs — tile shapes and split-K — over the issue's shape grid
(M from 1 to 4096 against Llama-3's (N, K) pairs), beside cuBLAS (torch.matmul) in the same
run: what ``gemm.hopper_config`` should pick for which shape.

    python bench/sweep_gemm_grid.py [--json FILE] [--dtype bfloat16] [--ms 1,16,128]
        [--nk 4096x4096,14336x4096] [--large]

``--swapped``: instead, the swapped-operand configs of few rows (``WsConfig(swap_ab=True)``:
64- or 128-column tiles of outᵀ over the rows rounded up to 16, 32 or 64, stages, split-K
1 … 8) and the op's current choice for the shape. ``--bcol``: B as a transposed view of a
row-major (N, K) tensor (a linear layer's weight) instead of a row-major (K, N) one.

``--large``: instead of the small-problem candidates, the persistent tile shapes a problem of
many tiles could take — 128 × 256 (the default), 128 × 192 and 128 × 128 with the TMA-store
epilogue, 256 × 128 with the staged one — for shapes whose 128 × 256 tiles leave the last
wave part empty (e.g. 448 tiles over 132 SMs); and the ping-pong schedules (a tile a
consumer: 64 × 256 with the TMA-store or the register epilogue, also in clusters of two;
128 × 128), whose epilogue runs under the other consumer's main loop.

Both sides are timed as CUDA-graph replays of 20 calls (the GPU work only, no host cost):
events around one replay, median of 5 replays, per call. Every config is checked against a
float32 product once per shape before it is timed (a failure is recorded; the sweep goes on).
"""
# ruff: noqa: B023  (closures are timed inside the iteration that makes them)

import argparse
import json

MS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096)
NKS = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192))
CALLS = 20   # calls per graph replay (bench/measure.py graph_ms)


def candidates(dtype, m):
    """(name, config) pairs: 64- and 128-row tiles of 128 or 256 columns (and 64 × 64 at
    M <= 64: twice the column tiles, so half the splits for the same items — a smaller
    split-K reduction), split-K by 1-8 (small M only), and the built-in large-shape default."""
    from tilepy.ops.gemm_wgmma_ws import WsConfig

    out = []
    tiles = ((64, 128, 8), (64, 256, 5), (128, 128, 6), (128, 256, 4))
    if m <= 64:
        tiles = ((64, 64, 12),) + tiles
    for bm, bn, st in tiles:
        one = {"consumers": 1} if bm == 64 else {}
        for s in ((1, 2, 4, 8) if m <= 512 else (1,)):
            out.append((f"{bm}x{bn} s{st} split{s}",
                        WsConfig(bm, bn, st, dtype, smem_epilogue=True, splits=s, **one)))
    out.append(("default 128x256 persistent tma-store",
                WsConfig(128, 256, 4, dtype, persistent=True, smem_epilogue=True,
                         tma_store=True)))
    return out


def swapped_candidates(dtype, m):
    """(name, config) pairs: swapped-operand tiles (64 or 128 of B's columns × the rows rounded
    up), stage counts, split-K 1 … 8, a block per item or persistent (64-column tiles, 1 or
    2 splits); the op's rule (``gemm.swapped_config``) among them."""
    from tilepy.ops.gemm_wgmma_ws import SWAP_BLOCK_N, WsConfig

    bn = next(w for w in SWAP_BLOCK_N if m <= w)
    out = []
    for bm, stages in ((64, (4, 8)), (128, (6,))):
        for st in stages:
            for s in (1, 2, 4, 8):
                out.append((f"swap {bm}x{bn} s{st} split{s}",
                            WsConfig(bm, bn, st, dtype, consumers=bm // 64, splits=s,
                                     swap_ab=True)))
    for s in (1, 2):   # one block an SM striding over the items
        out.append((f"swap 64x{bn} s8 split{s} persistent",
                    WsConfig(64, bn, 8, dtype, consumers=1, splits=s, swap_ab=True,
                             persistent=True)))
    return out


def op_choice(dtype, m, n, k):
    """("op's choice", the config tilepy.gemm takes for this shape)."""
    from tilepy.ops import gemm as g

    return ("op's choice", g.hopper_config(m, n, 1, dtype, k=k))


def large_candidates(dtype):
    """(name, config) pairs: persistent tile shapes for problems of many tiles."""
    from tilepy.ops.gemm_wgmma_ws import WsConfig

    tma = dict(persistent=True, smem_epilogue=True, tma_store=True)
    return [("default 128x256 persistent tma-store", WsConfig(128, 256, 4, dtype, **tma)),
            ("128x192 s4 persistent tma-store", WsConfig(128, 192, 4, dtype, **tma)),
            ("128x128 s6 persistent tma-store", WsConfig(128, 128, 6, dtype, **tma)),
            ("256x128 s3 persistent", WsConfig(256, 128, 3, dtype, persistent=True,
                                                smem_epilogue=True)),
            ("pingpong 64x256 s4 tma-store", WsConfig(64, 256, 4, dtype, pingpong=True, **tma)),
            ("pingpong 64x256 s5 registers", WsConfig(64, 256, 5, dtype, persistent=True,
                                                       pingpong=True)),
            ("pingpong 128x128 s6 registers", WsConfig(128, 128, 6, dtype, persistent=True,
                                                        pingpong=True)),
            ("pingpong 64x256 s4 tma-store cluster2",
             WsConfig(64, 256, 4, dtype, pingpong=True, cluster=2, producer_regs=56,
                      consumer_regs=224, **tma))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ms", help="comma-separated M values (default: the grid's)")
    p.add_argument("--nk", help="comma-separated NxK pairs (default: the grid's)")
    p.add_argument("--large", action="store_true",
                   help="the persistent tile shapes of problems of many tiles")
    p.add_argument("--swapped", action="store_true",
                   help="the swapped-operand configs of few rows")
    p.add_argument("--bcol", action="store_true",
                   help="B a transposed view of a row-major (N, K) tensor")
    args = p.parse_args()
    ms = tuple(int(x) for x in args.ms.split(",")) if args.ms else MS
    nks = tuple(tuple(int(v) for v in x.split("x")) for x in args.nk.split(",")) \
        if args.nk else NKS
    import torch
    from measure import graph_ms, poisoned_check

    import tilepy

    tdt = getattr(torch, args.dtype)
    x = torch.randn(8192, 8192, device="cuda", dtype=tdt)
    for _ in range(50):
        torch.matmul(x, x)     # clocks up
    del x
    rows, errors = [], []
    for n, k in nks:
        b = torch.randn(n, k, device="cuda", dtype=tdt).t() if args.bcol else \
            torch.randn(k, n, device="cuda", dtype=tdt)
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=tdt)
            out = torch.empty(m, n, device="cuda", dtype=tdt)
            ref = torch.matmul(a.float(), b.float())
            flop = 2 * m * n * k
            peer_ms = graph_ms(torch, lambda: torch.matmul(a, b, out=out))
            best = None
            cands = large_candidates(args.dtype) if args.large else \
                swapped_candidates(args.dtype, m) if args.swapped else candidates(args.dtype, m)
            for name, cfg in cands + [op_choice(args.dtype, m, n, k)]:
                try:
                    err = poisoned_check(
                        torch, lambda: tilepy.gemm(a, b, out=out, config=cfg), out, ref)
                    t = graph_ms(torch, lambda: tilepy.gemm(a, b, out=out, config=cfg))
                except Exception as e:  # noqa: BLE001 - recorded; the sweep goes on
                    errors.append({"shape": [m, n, k], "config": name, "error": repr(e)[:300]})
                    print(f"{m}x{n}x{k} {name}: FAILED {e!r}"[:300], flush=True)
                    if "ILLEGAL" in repr(e) or "LAUNCH_FAILED" in repr(e):
                        raise SystemExit(1) from e
                    continue
                row = {"shape": [m, n, k], "dtype": args.dtype, "config": name,
                       "describe": cfg.describe(), "ms": t, "tflops": flop / t / 1e9,
                       "b_layout": "col" if args.bcol else "row",
                       "peer": "torch.matmul (cuBLAS)", "peer_ms": peer_ms,
                       "peer_tflops": flop / peer_ms / 1e9, "ratio": peer_ms / t,
                       "rel_err": err, "timing": f"CUDA-graph replays of {CALLS} calls"}
                rows.append(row)
                if best is None or row["ratio"] > best["ratio"]:
                    best = row
            if best is not None:
                print(f"{m}x{n}x{k}: best {best['config']} {best['ratio']:.3f}x cuBLAS "
                      f"({best['tflops']:.0f} / {best['peer_tflops']:.0f} TFLOPS)", flush=True)
            del a, out, ref
        del b
        if args.json:   # after every (N, K): a time-out keeps what was measured
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows,
                           "errors": errors}, f, indent=1)


if __name__ == "__main__":
    main()
