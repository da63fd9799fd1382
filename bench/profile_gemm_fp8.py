"""One launch of the FP8 GEMM (``tilepy.gemm`` on e4m3 operands, row / column scales, bf16
out) per config and one of ``torch._scaled_mm`` at one shape, between cudaProfilerStart/Stop,
for Nsight Compute (``PROFILE=gemm_fp8 bench/profile_attention.sh OUTDIR [args]`` runs it under
ncu): where the FP8 kernel's time goes against cuBLASLt's — tensor-pipe use, L2 throughput
(the FP8 tile moves as many bytes per k step as the 16-bit one at twice the MMA rate), warp
stalls.

    python bench/profile_gemm_fp8.py [--shape 4096x4096x4096] [--configs 256x4p,256x4pt]
                                     [--block-scales]

``--block-scales``: tilepy's launches take DeepGEMM's block scales (``scale_a`` per 1 × 128
of ``a``, ``scale_b`` per 128 × 128 of ``b``, as ``quantize_fp8`` makes them); the peer keeps
its row / column scales.

A config is ``<block_n>x<stages>`` then ``p`` for persistent and ``t`` for the TMA-store
epilogue (KMajorConfig).
"""

import argparse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="4096x4096x4096")
    p.add_argument("--configs", default="256x4p,256x4pt")
    p.add_argument("--block-scales", action="store_true")
    args = p.parse_args()
    import torch

    import tilepy
    from tilepy.ops.gemm_kmajor_wgmma import KMajorConfig

    m, n, k = map(int, args.shape.split("x"))
    a = (torch.randn(m, k, device="cuda") * 3).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda") * 3).to(torch.float8_e4m3fn)
    sa = torch.rand(m, 1, device="cuda") + 0.5
    sb = torch.rand(1, n, device="cuda") + 0.5
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ta, tb = sa, sb         # tilepy's scales
    if args.block_scales:
        kb = -(-k // 128)
        ta = torch.rand(m, kb, device="cuda") + 0.5
        tb = (torch.rand(-(-n // 128), kb, device="cuda") + 0.5).t()
    cfgs = []
    for c in args.configs.split(","):
        bn, st = c.rstrip("pt").split("x")
        flags = c[len(bn) + 1 + len(st):]
        cfgs.append(KMajorConfig(block_n=int(bn), stages=int(st), persistent="p" in flags,
                                 tma_store="t" in flags))

    def peer():
        return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    for _ in range(20):   # compile, warm the clocks
        for cfg in cfgs:
            tilepy.gemm(a, w.t(), scale_a=ta, scale_b=tb, out=out, config=cfg)
        peer()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for cfg in cfgs:
        tilepy.gemm(a, w.t(), scale_a=ta, scale_b=tb, out=out, config=cfg)
        print(f"profiled {cfg.describe()}{', block scales' if args.block_scales else ''}",
              flush=True)
    peer()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"then torch._scaled_mm, {args.shape} e4m3", flush=True)


if __name__ == "__main__":
    main()
