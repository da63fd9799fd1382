"""One tilepy.flash_attention_backward call and one SDPA cuDNN backward per config, between
cudaProfilerStart/Stop, for Nsight Compute (``PROFILE=attention_backward
bench/profile_attention.sh OUTDIR [args]`` runs it under ncu): where the backward kernels' time
goes (tensor pipe, issue, warp stall reasons) at B4 H32 S4096 D128.

    python bench/profile_attention_backward.py [--causal] [--configs two,ws]
"""

import argparse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--causal", action="store_true")
    p.add_argument("--configs", default="two,ws")
    args = p.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import tilepy
    from tilepy.ops.attention_backward_wgmma import WgmmaBackwardConfig as W

    configs = {"two": W(128, block_m=64, key_groups=1, dq_groups=1, dq_block_n=64),
               "ws": W(128, block_m=64, key_groups=2, dq_atomic=True, producer=True)}
    b, h, s, d = 4, 32, 4096, 128
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16)
                   for _ in range(4))
    out, lse = tilepy.flash_attention(q, k, v, causal=args.causal, return_lse=True)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = sdpa(qq, kk, vv, is_causal=args.causal)
    runs = [lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)]
    for name in args.configs.split(","):
        cfg = configs[name]
        runs.append(lambda cfg=cfg: tilepy.flash_attention_backward(
            do, q, k, v, out, lse, causal=args.causal, config=cfg))
    for _ in range(2):    # compile, warm up
        for run in runs:
            run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled B{b} H{h} S{s} D{d} causal={args.causal}: SDPA cuDNN, then tilepy "
          f"{args.configs}", flush=True)


if __name__ == "__main__":
    main()
