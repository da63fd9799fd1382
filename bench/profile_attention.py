"""One tilepy.flash_attention launch and one SDPA cuDNN launch per shape, between
cudaProfilerStart/Stop, for Nsight Compute (``bench/profile_attention.sh`` runs it under ncu
with ``--profile-from-start off``): where each kernel's time goes (tensor and MUFU pipes,
issue, stall reasons) at the issue-10 target shapes.

    python bench/profile_attention.py [--shapes 64,128] [--causal] [--fp8]

``--fp8``: tilepy on e4m3 inputs (per-tensor descales, B4 H32 S8192, V's transpose pre-pass
included) and then tilepy's bfloat16 attention on the same values, instead of cuDNN.
"""

import argparse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--fp8", action="store_true")
    args = p.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tilepy

    if args.fp8:
        return fp8(torch, tilepy, [int(x) for x in args.head_dims.split(",")], args.causal)
    shapes = {64: (8, 16, 2048), 128: (4, 32, 4096)}
    for d in (int(x) for x in args.head_dims.split(",")):
        b, h, s = shapes[d]
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                   for _ in range(3))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=args.causal)

        for _ in range(3):    # compile, warm up
            tilepy.flash_attention(q, k, v, causal=args.causal)
            cudnn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        tilepy.flash_attention(q, k, v, causal=args.causal)
        cudnn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled B{b} H{h} S{s} D{d} causal={args.causal}: tilepy "
              f"({tilepy.ops.attention.choose_config(d, 'float16', args.causal).describe()}), "
              "then SDPA cuDNN", flush=True)


def fp8(torch, tilepy, head_dims, causal):
    b, h, s = 4, 32, 8192
    for d in head_dims:
        q, k, v = ((torch.randn(b, h, s, d, device="cuda") * 2).to(torch.float8_e4m3fn)
                   for _ in range(3))
        dq, dk, dv = (torch.tensor(x, device="cuda") for x in (0.3, 0.5, 1.5))
        qb, kb, vb = (x.to(torch.bfloat16) * f for x, f in ((q, dq), (k, dk), (v, dv)))

        def ours():
            return tilepy.flash_attention(q, k, v, causal=causal, descale_q=dq, descale_k=dk,
                                          descale_v=dv)

        for _ in range(3):    # compile, warm up
            ours()
            tilepy.flash_attention(qb, kb, vb, causal=causal)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        ours()
        tilepy.flash_attention(qb, kb, vb, causal=causal)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled B{b} H{h} S{s} D{d} causal={causal}: tilepy e4m3 (V transpose, "
              "attention), then tilepy bfloat16", flush=True)


if __name__ == "__main__":
    main()
